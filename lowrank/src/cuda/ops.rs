//! [`Backend`] for [`CudaBackend`]: validation exactly as the CPU backend's, then cuBLAS
//! (`blas.rs`), an NVRTC kernel (`kernels.rs`) or a driver copy on the backend's stream.

use super::device::CudaBackend;
use super::kernels::{
    driver_error, ORTHO_MAX_THREADS, ORTHO_SERIAL_N, PQT_ERROR_COLS, PQT_ERROR_ROWS,
    PQT_ERROR_THREADS,
};
use crate::backend::{Backend, ViewLen};
use crate::dims::{check_epsilon, check_flag, resolve, same_len};
use crate::{Dims, Element, Error, NormalRng, Result};
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};
use std::any::TypeId;
use std::ops::RangeBounds;

impl<T> ViewLen for CudaView<'_, T> {
    fn len(&self) -> usize {
        CudaView::len(self)
    }
}

impl<T> ViewLen for CudaViewMut<'_, T> {
    fn len(&self) -> usize {
        CudaViewMut::len(self)
    }
}

impl CudaBackend {
    /// `y += x` on the stream (lengths checked by the caller).
    fn launch_add(&self, y: &mut CudaViewMut<'_, f32>, x: &CudaView<'_, f32>) -> Result<()> {
        if y.is_empty() {
            return Ok(());
        }
        let n = y.len() as u64;
        let cfg = self.elementwise_config(y.len());
        let mut launch = self.stream.launch_builder(&self.kernels.add);
        launch.arg(y).arg(x).arg(&n);
        // SAFETY: `lr_add(float* y, const float* x, u64 n)` takes exactly these arguments;
        // both views hold `n` f32s (checked by the caller) and the kernel touches indices
        // below `n` only; `y` and `x` are distinct buffers (one is borrowed mutably).
        unsafe { launch.launch(cfg) }.map_err(driver_error)?;
        Ok(())
    }

    /// `lr_orthogonalize` over `batch` matrices, refilling zero columns under `refill`'s
    /// key when given (see [`Backend::orthogonalize_refill`]); `lr_orthogonalize_serial`
    /// below `ORTHO_SERIAL_N` rows (see [`CudaBackend::ortho_config`]).
    /// `lr_pqt_error`, with the flag that suppresses the error write or without one.
    fn launch_pqt_error(
        &self,
        d: Dims,
        p: CudaView<'_, f32>,
        q: CudaView<'_, f32>,
        mut m: CudaViewMut<'_, f32>,
        mut e: CudaViewMut<'_, f32>,
        flag: Option<CudaView<'_, f32>>,
    ) -> Result<()> {
        d.expect("p", p.len(), d.p_len())?;

        d.expect("q", q.len(), d.q_len())?;
        d.expect("m", m.len(), d.m_len())?;
        d.expect("e", e.len(), d.m_len())?;
        if d.m_len() == 0 {
            return Ok(());
        }
        let tiles = d.batch() * d.n().div_ceil(PQT_ERROR_ROWS) * d.m().div_ceil(PQT_ERROR_COLS);
        let mut cfg = self.launch_config(tiles, PQT_ERROR_THREADS);
        // The tile's P rows and Q columns: r * (32 + 128) floats, at most 40 KiB (r <= 64).
        cfg.shared_mem_bytes = (d.r() * (PQT_ERROR_ROWS + PQT_ERROR_COLS) * 4) as u32;
        let (batch, n, cols, r) = (d.batch() as u64, d.n() as u64, d.m() as u64, d.r() as u32);
        let mut launch = self.stream.launch_builder(&self.kernels.pqt_error);
        // A null pointer when unflagged: the kernel then always writes the error.
        let no_flag = 0u64;
        launch.arg(&p).arg(&q).arg(&mut m).arg(&mut e);
        launch.arg(&batch).arg(&n).arg(&cols).arg(&r);
        match &flag {
            Some(f) => launch.arg(f),
            None => launch.arg(&no_flag),
        };
        // SAFETY: the arguments match `lr_pqt_error(const float* p, const float* q,
        // float* m, float* e, u64 batch, u64 n, u64 m, u32 r, const float* flag)`, the
        // flag a device pointer to one f32 (checked by the caller) or null (a `u64` 0,
        // the size of a device pointer), which the kernel tests before reading; every
        // length was checked
        // against the shape, the kernel indexes below `batch*n*r`, `batch*m*r` and
        // `batch*n*m` only (its 16-byte accesses only when `m % 4 == 0` and both `m` and
        // `e` start 16-byte aligned, checked in the kernel), its dynamic shared memory is
        // the `r * (32 + 128)` floats it indexes, within the 48 KiB default as `r <= 64`
        // (by `Dims`). `m` and `e` are distinct buffers (both borrowed mutably).
        unsafe { launch.launch(cfg) }.map_err(driver_error)?;
        Ok(())
    }

    fn launch_orthogonalize(
        &self,
        batch: usize,
        n: usize,
        r: usize,
        mut x: CudaViewMut<'_, f32>,
        eps: f32,
        refill: Option<u64>,
    ) -> Result<()> {
        let d = Dims::new(batch, n, 1, r)?;
        d.expect("x", x.len(), d.p_len())?;
        check_epsilon(eps)?;
        if d.p_len() == 0 {
            return Ok(());
        }
        // The CPU's threshold, computed the same way in f32.
        let tol = crate::dims::zero_column_tolerance(n);
        let cfg = self.ortho_config(batch, n);
        let (batch, n, r) = (batch as u64, n as u64, r as u32);
        let (key, refill) = (refill.unwrap_or(0), u32::from(refill.is_some()));
        let kernel = if (n as usize) < ORTHO_SERIAL_N {
            &self.kernels.orthogonalize_serial
        } else {
            &self.kernels.orthogonalize
        };
        let mut launch = self.stream.launch_builder(kernel);
        launch
            .arg(&mut x)
            .arg(&batch)
            .arg(&n)
            .arg(&r)
            .arg(&eps)
            .arg(&tol)
            .arg(&key)
            .arg(&refill);
        // SAFETY: the arguments match `lr_orthogonalize` and `lr_orthogonalize_serial`
        // (float* x, u64 batch, u64 n, u32 r, float eps, float tol, u64 key, u32 refill);
        // `x` holds `batch*n*r` f32s (checked), the kernels index below that only (the
        // refill writes only inside the matrix it counts), `r <= 64` (the size of their
        // per-column arrays, by `Dims`), and the block path's block size is a multiple of
        // 32 in 32..=1024 (the sizes of its shared arrays; its loops over columns are
        // strided by the block, so fewer threads than columns is fine). The serial
        // kernel's 128 threads use no shared memory and stay within its launch bounds.
        unsafe { launch.launch(cfg) }.map_err(driver_error)?;
        Ok(())
    }

    /// The launch of the orthogonalisation. Below `ORTHO_SERIAL_N` rows: one thread per
    /// matrix, in blocks of 128. Otherwise one block per matrix (grid-stride beyond the
    /// cap) of about 4 elements of a column per thread, a multiple of 32 up to 1024.
    ///
    /// The block size depends on `n` alone, never on the batch or the device: the block's
    /// reductions add partial sums in an order set by its size, so a matrix gets the same
    /// bits whether it is orthogonalised alone or in a batch, and on every GPU model (the
    /// ranks of a PowerSGD job each orthogonalise the summed `P` themselves and must agree).
    fn ortho_config(&self, batch: usize, n: usize) -> LaunchConfig {
        if n < ORTHO_SERIAL_N {
            return self.launch_config(batch.div_ceil(128), 128);
        }
        let threads = n
            .div_ceil(4)
            .next_multiple_of(32)
            .clamp(32, ORTHO_MAX_THREADS);
        self.launch_config(batch, threads as u32)
    }
}

impl Backend for CudaBackend {
    type Buffer<T: Element> = CudaSlice<T>;
    type View<'a, T: Element> = CudaView<'a, T>;
    type ViewMut<'a, T: Element> = CudaViewMut<'a, T>;

    fn name(&self) -> String {
        self.describe()
    }

    /// More than `isize::MAX` bytes is [`Error::Alloc`] before the driver is asked
    /// (cudarc multiplies the length by the element size unchecked), and so is a device
    /// out of memory.
    fn alloc<T: Element>(&self, len: usize) -> Result<CudaSlice<T>> {
        if len == 0 {
            return self.empty();
        }
        std::alloc::Layout::array::<T>(len).map_err(|_| refused::<T>(len))?;
        self.stream
            .alloc_zeros(len)
            .map_err(|e| allocation_error::<T>(e, len))
    }

    /// A device out of memory is [`Error::Alloc`].
    fn upload<T: Element>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        if host.is_empty() {
            return self.empty();
        }
        self.stream
            .clone_htod(host)
            .map_err(|e| allocation_error::<T>(e, host.len()))
    }

    fn download<T: Element>(&self, src: CudaView<'_, T>, dst: &mut [T]) -> Result<()> {
        same_len("src", src.len(), "dst", dst.len())?;
        if !dst.is_empty() {
            self.stream.memcpy_dtoh(&src, dst).map_err(driver_error)?;
        }
        self.stream.synchronize().map_err(driver_error)
    }

    fn buffer_len<T: Element>(buf: &CudaSlice<T>) -> usize {
        buf.len()
    }

    fn view<'a, T: Element>(
        buf: &'a CudaSlice<T>,
        range: impl RangeBounds<usize>,
    ) -> Result<CudaView<'a, T>> {
        let len = buf.len();
        let r = resolve(range, len)?;
        buf.try_slice(r.clone()).ok_or(Error::OutOfBounds {
            start: r.start,
            end: r.end,
            len,
        })
    }

    fn view_mut<'a, T: Element>(
        buf: &'a mut CudaSlice<T>,
        range: impl RangeBounds<usize>,
    ) -> Result<CudaViewMut<'a, T>> {
        let len = buf.len();
        let r = resolve(range, len)?;
        buf.try_slice_mut(r.clone()).ok_or(Error::OutOfBounds {
            start: r.start,
            end: r.end,
            len,
        })
    }

    fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(driver_error)
    }

    fn mq(
        &self,
        d: Dims,
        m: CudaView<'_, f32>,
        q: CudaView<'_, f32>,
        mut p: CudaViewMut<'_, f32>,
    ) -> Result<()> {
        d.expect("m", m.len(), d.m_len())?;
        d.expect("q", q.len(), d.q_len())?;
        d.expect("p", p.len(), d.p_len())?;
        self.gemm_mq(&d, &m, &q, &mut p)
    }

    fn mtp(
        &self,
        d: Dims,
        m: CudaView<'_, f32>,
        p: CudaView<'_, f32>,
        mut q: CudaViewMut<'_, f32>,
    ) -> Result<()> {
        d.expect("m", m.len(), d.m_len())?;
        d.expect("p", p.len(), d.p_len())?;
        d.expect("q", q.len(), d.q_len())?;
        self.gemm_mtp(&d, &m, &p, &mut q)
    }

    fn pqt(
        &self,
        d: Dims,
        p: CudaView<'_, f32>,
        q: CudaView<'_, f32>,
        mut m: CudaViewMut<'_, f32>,
    ) -> Result<()> {
        d.expect("p", p.len(), d.p_len())?;
        d.expect("q", q.len(), d.q_len())?;
        d.expect("m", m.len(), d.m_len())?;
        self.gemm_pqt(&d, &p, &q, &mut m)
    }

    /// `g += e` (an element-wise kernel), then `P = g Q` (cuBLAS). Not fused on the GPU:
    /// `g` is read twice, the second time mostly from L2 for small matrices.
    fn add_mq(
        &self,
        d: Dims,
        mut g: CudaViewMut<'_, f32>,
        e: CudaView<'_, f32>,
        q: CudaView<'_, f32>,
        mut p: CudaViewMut<'_, f32>,
    ) -> Result<()> {
        d.expect("g", g.len(), d.m_len())?;
        d.expect("e", e.len(), d.m_len())?;
        d.expect("q", q.len(), d.q_len())?;
        d.expect("p", p.len(), d.p_len())?;
        self.launch_add(&mut g, &e)?;
        self.gemm_mq(&d, &g.as_view(), &q, &mut p)
    }

    /// One kernel: each element of `M̂ = P Qᵀ` is a sum over `k` in ascending order, written
    /// into `m` after the old value `x` was read, and `e = x - M̂`.
    fn pqt_error(
        &self,
        d: Dims,
        p: CudaView<'_, f32>,
        q: CudaView<'_, f32>,
        m: CudaViewMut<'_, f32>,
        e: CudaViewMut<'_, f32>,
    ) -> Result<()> {
        self.launch_pqt_error(d, p, q, m, e, None)
    }

    /// The same kernel as [`pqt_error`](Backend::pqt_error), which reads the flag on the
    /// device and then writes no error.
    fn pqt_error_unflagged(
        &self,
        d: Dims,
        p: CudaView<'_, f32>,
        q: CudaView<'_, f32>,
        m: CudaViewMut<'_, f32>,
        e: CudaViewMut<'_, f32>,
        flag: CudaView<'_, f32>,
    ) -> Result<()> {
        check_flag(flag.len())?;
        self.launch_pqt_error(d, p, q, m, e, Some(flag))
    }

    fn flag_nonfinite(&self, x: CudaView<'_, f32>, mut flag: CudaViewMut<'_, f32>) -> Result<()> {
        check_flag(flag.len())?;
        if x.is_empty() {
            return Ok(());
        }
        let n = x.len() as u64;
        let cfg = self.elementwise_config(x.len());
        let mut launch = self.stream.launch_builder(&self.kernels.flag_nonfinite);
        launch.arg(&x).arg(&mut flag).arg(&n);
        // SAFETY: the arguments match `lr_flag_nonfinite(const float* x, float* flag,
        // u64 n)`; `x` holds `n` f32s and the kernel reads indices below `n` only; `flag`
        // holds one f32 (checked), the only element written.
        unsafe { launch.launch(cfg) }.map_err(driver_error)?;
        Ok(())
    }

    fn copy_unflagged(
        &self,
        src: CudaView<'_, f32>,
        mut dst: CudaViewMut<'_, f32>,
        flag: CudaView<'_, f32>,
    ) -> Result<()> {
        check_flag(flag.len())?;
        same_len("src", src.len(), "dst", dst.len())?;
        if src.is_empty() {
            return Ok(());
        }
        let n = src.len() as u64;
        let cfg = self.elementwise_config(src.len());
        let mut launch = self.stream.launch_builder(&self.kernels.copy_unflagged);
        launch.arg(&src).arg(&mut dst).arg(&flag).arg(&n);
        // SAFETY: the arguments match `lr_copy_unflagged(const float* src, float* dst,
        // const float* flag, u64 n)`; `src` and `dst` hold `n` f32s (checked equal) and
        // are distinct buffers (one borrowed mutably); the kernel touches indices below
        // `n` only, and reads the one element of `flag` (checked).
        unsafe { launch.launch(cfg) }.map_err(driver_error)?;
        Ok(())
    }

    fn orthogonalize(
        &self,
        batch: usize,
        n: usize,
        r: usize,
        x: CudaViewMut<'_, f32>,
        eps: f32,
    ) -> Result<()> {
        self.launch_orthogonalize(batch, n, r, x, eps, None)
    }

    fn orthogonalize_refill(
        &self,
        batch: usize,
        n: usize,
        r: usize,
        x: CudaViewMut<'_, f32>,
        eps: f32,
        key: u64,
    ) -> Result<()> {
        self.launch_orthogonalize(batch, n, r, x, eps, Some(key))
    }

    fn add(&self, mut y: CudaViewMut<'_, f32>, x: CudaView<'_, f32>) -> Result<()> {
        same_len("y", y.len(), "x", x.len())?;
        self.launch_add(&mut y, &x)
    }

    fn scale(&self, mut x: CudaViewMut<'_, f32>, alpha: f32) -> Result<()> {
        if !alpha.is_finite() {
            return Err(Error::InvalidScale(alpha));
        }
        if x.is_empty() {
            return Ok(());
        }
        let n = x.len() as u64;
        let cfg = self.elementwise_config(x.len());
        let mut launch = self.stream.launch_builder(&self.kernels.scale);
        launch.arg(&mut x).arg(&alpha).arg(&n);
        // SAFETY: the arguments match `lr_scale(float* x, float alpha, u64 n)`; `x` holds
        // `n` f32s and the kernel touches indices below `n` only.
        unsafe { launch.launch(cfg) }.map_err(driver_error)?;
        Ok(())
    }

    fn copy<T: Element>(&self, src: CudaView<'_, T>, mut dst: CudaViewMut<'_, T>) -> Result<()> {
        same_len("src", src.len(), "dst", dst.len())?;
        if src.is_empty() {
            return Ok(());
        }
        self.stream
            .memcpy_dtod(&src, &mut dst)
            .map_err(driver_error)
    }

    fn zero<T: Element>(&self, mut x: CudaViewMut<'_, T>) -> Result<()> {
        if x.is_empty() {
            return Ok(());
        }
        self.stream.memset_zeros(&mut x).map_err(driver_error)
    }

    /// Element-wise kernels on the bit patterns, bit-exact with the CPU (see the kernels'
    /// module); a cast to the same type is a device copy.
    fn cast<S: Element, D: Element>(
        &self,
        src: CudaView<'_, S>,
        mut dst: CudaViewMut<'_, D>,
    ) -> Result<()> {
        same_len("src", src.len(), "dst", dst.len())?;
        if src.is_empty() {
            return Ok(());
        }
        if TypeId::of::<S>() == TypeId::of::<D>() {
            // SAFETY: `S` and `D` are the same type, so this reinterpretation is the
            // identity, over the same number of elements.
            let same = unsafe { src.transmute::<D>(src.len()) };
            let same = same.ok_or_else(|| Error::Cuda("same-type cast view".into()))?;
            return self
                .stream
                .memcpy_dtod(&same, &mut dst)
                .map_err(driver_error);
        }
        let kernel = self.kernels.cast(S::NAME, D::NAME)?;
        let n = src.len() as u64;
        let cfg = self.elementwise_config(src.len());
        let mut launch = self.stream.launch_builder(kernel);
        launch.arg(&src).arg(&mut dst).arg(&n);
        // SAFETY: the arguments match `lr_cast_{S}_{D}(const S* src, D* dst, u64 n)`, whose
        // element types have the sizes and layouts of `S` and `D` (f32 is `float`, f16 and
        // bf16 are 16-bit patterns); both views hold `n` elements (checked) and the kernel
        // touches indices below `n` only.
        unsafe { launch.launch(cfg) }.map_err(driver_error)?;
        Ok(())
    }

    /// Draws on the host, then copies to the device, so both backends see the same values.
    fn fill_normal(&self, rng: &mut NormalRng, mut x: CudaViewMut<'_, f32>) -> Result<()> {
        let mut host = vec![0.0f32; x.len()];
        rng.fill(&mut host);
        if host.is_empty() {
            return Ok(());
        }
        self.stream.memcpy_htod(&host, &mut x).map_err(driver_error)
    }
}

/// [`Error::Alloc`] for `len` elements of `T`.
fn refused<T>(len: usize) -> Error {
    Error::Alloc {
        elements: len,
        element_bytes: size_of::<T>(),
    }
}

/// A failed device allocation of `len` elements of `T`: [`Error::Alloc`] when the device
/// is out of memory, else the driver's error.
fn allocation_error<T>(e: cudarc::driver::DriverError, len: usize) -> Error {
    match e.0 {
        cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => refused::<T>(len),
        _ => driver_error(e),
    }
}

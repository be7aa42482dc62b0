//! The CUDA backend: construction, library checks, and the launch helpers shared by the
//! operations (which are in `ops.rs` and `blas.rs`).

use super::kernels::{driver_error, Kernels, ELEMENTWISE_THREADS};
use crate::{Element, Error, Result};
use cudarc::cublas::CudaBlas;
use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DriverError, LaunchConfig};
use std::any::Any;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

/// Blocks per streaming multiprocessor that a grid-stride kernel is given at most.
const BLOCKS_PER_SM: usize = 32;

/// The CUDA backend: cuBLAS strided-batched SGEMM for the products, NVRTC-compiled
/// kernels for everything else, all issued in order on one stream.
///
/// Buffers are cudarc [`CudaSlice`]s, views are [`cudarc::driver::CudaView`] and
/// [`cudarc::driver::CudaViewMut`]. The CUDA libraries (`libcuda`, `libcublas`,
/// `libnvrtc`) are loaded at run time; when one is missing, or there is no device,
/// [`CudaBackend::new`] returns [`Error::CudaUnavailable`] instead of panicking.
///
/// Every operation is asynchronous on [`CudaBackend::stream`] (except
/// [`crate::Backend::download`], which waits); [`crate::Backend::synchronize`] waits for
/// all of them. Numerics: the products run in full `f32` (cuBLAS's default math mode, no
/// TF32), so results agree with the CPU backend to rounding, not bit for bit; the casts
/// are bit-exact with the CPU's.
///
/// ```no_run
/// use lowrank::{Backend, CudaBackend, Dims};
/// # fn main() -> lowrank::Result<()> {
/// let gpu = CudaBackend::new(0)?;
/// let dims = Dims::new(1, 2, 3, 1)?;
/// let m = gpu.upload(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0])?; // 2 x 3, row-major
/// let q = gpu.upload(&[1.0f32, 0.0, 1.0])?; // 3 x 1
/// let mut p = gpu.alloc::<f32>(2)?;
/// gpu.mq(dims, m.as_view(), q.as_view(), p.as_view_mut())?;
/// let mut host = [0.0f32; 2];
/// gpu.download(p.as_view(), &mut host)?;
/// assert_eq!(host, [4.0, 10.0]);
/// # Ok(()) }
/// ```
///
/// Cloning is cheap: a clone shares the stream, the cuBLAS handle and the compiled
/// kernels (so work issued through either stays in one stream order).
#[derive(Clone)]
pub struct CudaBackend {
    pub(super) stream: Arc<CudaStream>,
    pub(super) blas: Arc<CudaBlas>,
    pub(super) kernels: Arc<Kernels>,
    sm_count: usize,
    name: String,
}

// Compile-time check that the backend can be shared between threads (as `Backend` needs).
const _: fn() = || {
    fn shareable<T: Send + Sync>() {}
    shareable::<CudaBackend>();
};

impl fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaBackend")
            .field("name", &self.name)
            .field("sm_count", &self.sm_count)
            .finish_non_exhaustive()
    }
}

impl CudaBackend {
    /// The backend on device `ordinal`, issuing its work on that device's default stream
    /// (the legacy NULL stream of its primary context, which orders itself with every other
    /// blocking stream of the context).
    ///
    /// Errors: [`Error::CudaUnavailable`] when `libcuda`, `libcublas` or `libnvrtc` cannot
    /// be loaded, when the driver finds no device, or when `ordinal` is not a device;
    /// [`Error::Nvrtc`] if the kernels fail to compile; [`Error::Cuda`] / [`Error::Cublas`]
    /// for other driver or cuBLAS failures.
    pub fn new(ordinal: usize) -> Result<Self> {
        check_libraries()?;
        guarded(|| {
            let count = CudaContext::device_count()
                .map_err(|e| unavailable("cuInit / cuDeviceGetCount failed", e))?;
            let count = usize::try_from(count).unwrap_or(0);
            if ordinal >= count {
                return Err(Error::CudaUnavailable(format!(
                    "there is no CUDA device {ordinal}: the driver sees {count} device(s)"
                )));
            }
            let ctx = CudaContext::new(ordinal)
                .map_err(|e| unavailable("creating the device context failed", e))?;
            Self::build(ctx.default_stream())
        })
    }

    /// The backend issuing its work on `stream`, shared with the caller (another crate's
    /// stream, for example), so that work on both sides stays in stream order.
    ///
    /// Errors as for [`CudaBackend::new`].
    pub fn from_stream(stream: Arc<CudaStream>) -> Result<Self> {
        check_libraries()?;
        guarded(|| Self::build(stream))
    }

    /// The stream every operation is issued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The CUDA context of the device.
    pub fn context(&self) -> &Arc<CudaContext> {
        self.stream.context()
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.stream.context().ordinal()
    }

    /// Compiles the kernels and creates the cuBLAS handle for `stream`.
    fn build(stream: Arc<CudaStream>) -> Result<Self> {
        let ctx = stream.context().clone();
        ctx.bind_to_thread().map_err(driver_error)?;
        let device = ctx.name().map_err(driver_error)?;
        let sm_count = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(driver_error)?;
        let kernels = Kernels::load(&ctx)?;
        let blas = CudaBlas::new(stream.clone())
            .map_err(|e| Error::Cublas(format!("creating the handle: {e:?}")))?;
        Ok(CudaBackend {
            name: format!("cuda:{} {device}", ctx.ordinal()),
            sm_count: usize::try_from(sm_count).unwrap_or(1).max(1),
            stream,
            blas: Arc::new(blas),
            kernels: Arc::new(kernels),
        })
    }

    /// The backend's description, `"cuda:0 NVIDIA H200"`.
    pub(super) fn describe(&self) -> String {
        self.name.clone()
    }

    /// A launch of `blocks` blocks (clamped to `1..=` the grid-stride cap) of `threads`.
    pub(super) fn launch_config(&self, blocks: usize, threads: u32) -> LaunchConfig {
        let cap = (self.sm_count * BLOCKS_PER_SM).min(i32::MAX as usize);
        LaunchConfig {
            grid_dim: (blocks.clamp(1, cap) as u32, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// The launch of an element-wise kernel over `len` elements.
    pub(super) fn elementwise_config(&self, len: usize) -> LaunchConfig {
        self.launch_config(
            len.div_ceil(ELEMENTWISE_THREADS as usize),
            ELEMENTWISE_THREADS,
        )
    }

    /// A buffer of zero elements.
    ///
    /// The driver rejects zero-byte allocations on some devices, so this allocates one
    /// element and hands it to a slice of length 0, which frees it when dropped.
    pub(super) fn empty<T: Element>(&self) -> Result<CudaSlice<T>> {
        let one = self.stream.alloc_zeros::<T>(1).map_err(driver_error)?;
        let ptr = one.leak();
        // SAFETY: `ptr` is a live allocation of one `T` made on `self.stream`, owned by no
        // one since `leak`; the new slice claims 0 elements of it (so nothing is ever read
        // or written through it) and frees it on the same stream when dropped.
        Ok(unsafe { self.stream.upgrade_device_ptr::<T>(ptr, 0) })
    }
}

/// Errors unless the driver, cuBLAS and NVRTC libraries can all be loaded. cudarc panics
/// on the first call into a library it cannot load, so this runs before any such call.
fn check_libraries() -> Result<()> {
    let missing = |what: &str, file: &str| {
        Err(Error::CudaUnavailable(format!(
            "the {what} library was not found ({file}); put it on LD_LIBRARY_PATH"
        )))
    };
    // SAFETY: `is_culib_present` only tries to open each candidate file name with
    // `dlopen` and closes it again; it calls nothing in the library.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return missing("CUDA driver", "libcuda.so");
    }
    // SAFETY: as above.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return missing("cuBLAS", "libcublas.so, with libcublasLt.so");
    }
    // SAFETY: as above.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return missing("NVRTC", "libnvrtc.so, with libnvrtc-builtins.so");
    }
    Ok(())
}

/// Runs the initialisation `f`, turning a panic inside cudarc into
/// [`Error::CudaUnavailable`].
///
/// The libraries were found by [`check_libraries`], but cudarc resolves each function
/// lazily and panics when a symbol is missing (a driver or library older than the CUDA
/// version cudarc was built for, 13.0), and a few of its constructors `unwrap`. None of
/// that can be checked beforehand, so the constructors catch it here. (The panic message
/// still reaches stderr through the panic hook; with `panic = "abort"` nothing can be
/// caught.)
fn guarded<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        Err(Error::CudaUnavailable(format!(
            "initialising CUDA panicked (a CUDA library too old for the CUDA 13.0 bindings?): {}",
            panic_text(payload.as_ref())
        )))
    })
}

/// The message of a panic payload.
fn panic_text(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_owned()
    }
}

/// A driver error that means there is no usable device.
fn unavailable(what: &str, e: DriverError) -> Error {
    Error::CudaUnavailable(format!("{what}: {e:?}"))
}

//! The CPU backend: hand-written SIMD kernels (AVX-512, AVX2+FMA, portable), chosen at
//! run time, multi-threaded over rows (or columns for `Mᵀ P`).
//!
//! Every output element is computed by exactly one thread in a fixed order, so results
//! are bit-identical for every thread count (they differ between instruction sets, which
//! round differently).

mod kernels;
mod simd;
mod storage;

use crate::backend::Backend;
use crate::dims::{check_epsilon, check_flag, resolve, same_len};
use crate::{Dims, Element, Error, NormalRng, Result};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use kernels::Mat;
use std::any::TypeId;
use std::ops::{Range, RangeBounds};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Below this many bytes of streamed data an operation runs on the calling thread: a
/// thread start costs more than the work.
const PARALLEL_MIN_BYTES: usize = 1 << 20;

/// An instruction set the CPU kernels are compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// AVX-512F (16 lanes, 32 registers).
    Avx512,
    /// AVX2 with FMA (8 lanes).
    Avx2,
    /// Plain Rust that the compiler vectorises for the build target; runs everywhere.
    Portable,
}

impl Isa {
    /// The instruction set [`CpuBackend::new`] uses: the best this CPU supports, capped
    /// by `LOWRANK_CPU_CAPABILITY` (`avx512`, `avx2`, `default` or `portable`; read once,
    /// like PyTorch's `ATEN_CPU_CAPABILITY`: see [`cpucap::level`]). An unknown value is
    /// ignored, with a warning.
    pub fn detect() -> Isa {
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| {
            for warning in cpucap::take_warnings() {
                tracing::warn!("{warning}");
            }
        });
        Isa::from_level(cpucap::level())
    }

    /// Whether this CPU can run kernels compiled for `self` (whatever
    /// `LOWRANK_CPU_CAPABILITY` says): AVX2 needs AVX2 and FMA, AVX-512 AVX-512F as well
    /// ([`cpucap::Level`]'s sets, which include these).
    pub fn is_supported(self) -> bool {
        self.level().is_supported()
    }

    /// Every instruction set this CPU supports, best first (whatever
    /// `LOWRANK_CPU_CAPABILITY` says).
    pub fn supported() -> Vec<Isa> {
        [Isa::Avx512, Isa::Avx2, Isa::Portable]
            .into_iter()
            .filter(|isa| isa.is_supported())
            .collect()
    }

    /// The CPU features these kernels need.
    fn level(self) -> cpucap::Level {
        match self {
            Isa::Avx512 => cpucap::Level::Avx512,
            Isa::Avx2 => cpucap::Level::Avx2,
            Isa::Portable => cpucap::Level::Portable,
        }
    }

    /// The kernels that need at most `level`'s features.
    fn from_level(level: cpucap::Level) -> Isa {
        match level {
            cpucap::Level::Avx512 => Isa::Avx512,
            cpucap::Level::Avx2 => Isa::Avx2,
            cpucap::Level::Portable => Isa::Portable,
        }
    }

    /// Lower-case name (`"avx512"`, `"avx2"`, `"portable"`).
    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512 => "avx512",
            Isa::Avx2 => "avx2",
            Isa::Portable => "portable",
        }
    }
}

/// Calls the kernel entry point `$f` compiled for `$isa`.
macro_rules! dispatch {
    ($isa:expr, $f:ident($($arg:expr),*)) => {
        match $isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => kernels::avx512::$f($($arg),*),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => kernels::avx2::$f($($arg),*),
            _ => kernels::portable::$f($($arg),*),
        }
    };
}

/// The CPU backend. Cheap to clone; holds only its configuration.
///
/// ```
/// use lowrank::{Backend, CpuBackend, Dims};
/// # fn main() -> lowrank::Result<()> {
/// let cpu = CpuBackend::new().with_threads(2)?;
/// let dims = Dims::new(1, 2, 3, 1)?;
/// let m = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]; // 2 x 3, row-major
/// let q = [1.0, 0.0, 1.0]; // 3 x 1
/// let mut p = [0.0; 2];
/// cpu.mq(dims, &m, &q, &mut p)?;
/// assert_eq!(p, [4.0, 10.0]);
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct CpuBackend {
    threads: usize,
    isa: Isa,
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuBackend {
    /// The best instruction set of this CPU ([`Isa::detect`]: capped by
    /// `LOWRANK_CPU_CAPABILITY`); large operations are cut into one piece per available
    /// core.
    pub fn new() -> Self {
        CpuBackend {
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            isa: Isa::detect(),
        }
    }

    /// Cuts large operations into `threads` pieces (at least 1).
    ///
    /// The pieces run on one process-wide pool (rayon's global pool, one worker per core),
    /// shared by every `CpuBackend`: several ranks of a thread group each cutting their
    /// work into pieces share the cores instead of oversubscribing them, and no thread is
    /// spawned per call. Results depend on neither the piece count nor the pool size
    /// (each output element is computed by one piece in a fixed order).
    pub fn with_threads(mut self, threads: usize) -> Result<Self> {
        if threads == 0 {
            return Err(Error::InvalidThreads);
        }
        self.threads = threads;
        Ok(self)
    }

    /// Uses the kernels of `isa`; an error if this CPU lacks it.
    pub fn with_isa(mut self, isa: Isa) -> Result<Self> {
        if !isa.is_supported() {
            return Err(Error::UnsupportedIsa(isa.name()));
        }
        self.isa = isa;
        Ok(self)
    }

    /// How many pieces large operations are cut into.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// The instruction set in use.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// Runs `f(task)` for `task in 0..tasks`, on up to `threads` threads when `bytes`
    /// (the data the whole operation streams) makes that worthwhile. Each thread takes a
    /// contiguous block of tasks.
    fn parallel(&self, tasks: usize, bytes: usize, f: impl Fn(usize) + Sync) {
        let workers = if bytes < PARALLEL_MIN_BYTES {
            1
        } else {
            self.threads.min(tasks)
        };
        if workers <= 1 {
            (0..tasks).for_each(f);
            return;
        }
        // The calling thread takes pieces at once, on the core it already runs on, and
        // `workers - 1` pool jobs take the rest (`in_place_scope`: the caller is not
        // moved into the pool, and it never runs the pool's jobs). Everyone takes pieces
        // from one counter until none is left, so a pool thread that wakes late just does
        // less. `scope` + `spawn` from outside the pool (the body injected into a pool
        // thread) halved the two-thread bandwidth on a 2-core VM. Which thread runs a
        // piece does not change its result.
        let next = AtomicUsize::new(0);
        let take = || loop {
            let w = next.fetch_add(1, Ordering::Relaxed);
            if w >= workers {
                break;
            }
            split(tasks, workers, w, 1).for_each(&f);
        };
        rayon::in_place_scope(|s| {
            for _ in 1..workers {
                s.spawn(|_| take());
            }
            take();
        });
    }

    /// How many pieces to cut each matrix of a batch into, so that all threads have work.
    fn parts_per_matrix(&self, d: &Dims, extent: usize, align: usize) -> usize {
        if d.batch() == 0 || d.batch() >= self.threads || d.m_len() * 4 < PARALLEL_MIN_BYTES {
            return 1;
        }
        let wanted = self.threads.div_ceil(d.batch());
        wanted.min(extent.div_ceil(align)).max(1)
    }

    /// Runs `f(matrix, rows)` over every matrix, its rows cut into pieces for the threads.
    fn over_rows(&self, d: &Dims, mat: Mat, f: impl Fn(&Mat, Range<usize>) + Sync) {
        let parts = self.parts_per_matrix(d, d.n(), 4);
        self.parallel(d.batch() * parts, d.m_len() * 4, |t| {
            let (b, part) = (t / parts, t % parts);
            f(&mat.at(d, b), split(d.n(), parts, part, 4));
        });
    }

    /// Runs `f(matrix, cols)` over every matrix, its columns cut into pieces for the threads.
    fn over_cols(&self, d: &Dims, mat: Mat, f: impl Fn(&Mat, Range<usize>) + Sync) {
        let parts = self.parts_per_matrix(d, d.m(), 16);
        self.parallel(d.batch() * parts, d.m_len() * 4, |t| {
            let (b, part) = (t / parts, t % parts);
            f(&mat.at(d, b), split(d.m(), parts, part, 16));
        });
    }

    /// Element-wise `f` over matching chunks of two slices, in parallel when large.
    fn zip_chunks<A: Sync, B: Send>(
        &self,
        a: &[A],
        b: &mut [B],
        f: impl Fn(&[A], &mut [B]) + Sync,
    ) {
        debug_assert_eq!(a.len(), b.len());
        let bytes = a.len() * (size_of::<A>() + size_of::<B>());
        let pieces = if bytes < PARALLEL_MIN_BYTES {
            1
        } else {
            self.threads
        };
        if pieces <= 1 {
            f(a, b);
            return;
        }
        let chunk = a.len().div_ceil(pieces).next_multiple_of(64);
        // As in `parallel`: the caller and `pieces - 1` pool jobs take pieces until none
        // is left.
        let work = Mutex::new(a.chunks(chunk).zip(b.chunks_mut(chunk)));
        let take = || loop {
            let piece = work.lock().unwrap_or_else(|p| p.into_inner()).next();
            match piece {
                Some((x, y)) => f(x, y),
                None => break,
            }
        };
        rayon::in_place_scope(|s| {
            for _ in 1..pieces {
                s.spawn(|_| take());
            }
            take();
        });
    }
}

/// The `i`-th of `parts` near-equal pieces of `0..len`, boundaries rounded to `align`.
fn split(len: usize, parts: usize, i: usize, align: usize) -> Range<usize> {
    let at = |k: usize| ((len * k / parts).next_multiple_of(align)).min(len);
    let end = if i + 1 == parts { len } else { at(i + 1) };
    at(i).min(end)..end
}

/// Reinterprets a slice of one `Element` type as another when they are the same type.
fn same_type<S: Element, D: Element>(s: &[S]) -> Option<&[D]> {
    (TypeId::of::<S>() == TypeId::of::<D>()).then(|| bytemuck::cast_slice(s))
}

fn same_type_mut<S: Element, D: Element>(s: &mut [S]) -> Option<&mut [D]> {
    (TypeId::of::<S>() == TypeId::of::<D>()).then(|| bytemuck::cast_slice_mut(s))
}

fn cast_chunk<S: Element, D: Element>(src: &[S], dst: &mut [D]) {
    if let (Some(s), Some(d)) = (same_type::<S, f32>(src), same_type_mut::<D, f16>(dst)) {
        d.convert_from_f32_slice(s);
    } else if let (Some(s), Some(d)) = (same_type::<S, f16>(src), same_type_mut::<D, f32>(dst)) {
        s.convert_to_f32_slice(d);
    } else if let (Some(s), Some(d)) = (same_type::<S, f32>(src), same_type_mut::<D, bf16>(dst)) {
        d.convert_from_f32_slice(s);
    } else if let (Some(s), Some(d)) = (same_type::<S, bf16>(src), same_type_mut::<D, f32>(dst)) {
        s.convert_to_f32_slice(d);
    } else {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = D::from_f32(s.to_f32());
        }
    }
}

impl Backend for CpuBackend {
    type Buffer<T: Element> = Vec<T>;
    type View<'a, T: Element> = &'a [T];
    type ViewMut<'a, T: Element> = &'a mut [T];
    const HOST_RESIDENT: bool = true;

    fn name(&self) -> String {
        format!("cpu {} x{}", self.isa.name(), self.threads)
    }

    /// Zeroed by the allocator (lazily mapped pages, as `vec![0.0; len]`); more than
    /// `isize::MAX` bytes, or a refused allocation, is [`Error::Alloc`].
    fn alloc<T: Element>(&self, len: usize) -> Result<Vec<T>> {
        storage::zeroed(len)
    }

    /// A refused allocation is [`Error::Alloc`].
    fn upload<T: Element>(&self, host: &[T]) -> Result<Vec<T>> {
        storage::copied(host)
    }

    fn download<T: Element>(&self, src: &[T], dst: &mut [T]) -> Result<()> {
        same_len("src", src.len(), "dst", dst.len())?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn buffer_len<T: Element>(buf: &Vec<T>) -> usize {
        buf.len()
    }

    fn view<T: Element>(buf: &Vec<T>, range: impl RangeBounds<usize>) -> Result<&[T]> {
        Ok(&buf[resolve(range, buf.len())?])
    }

    fn view_mut<T: Element>(buf: &mut Vec<T>, range: impl RangeBounds<usize>) -> Result<&mut [T]> {
        let r = resolve(range, buf.len())?;
        Ok(&mut buf[r])
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn mq(&self, d: Dims, m: &[f32], q: &[f32], p: &mut [f32]) -> Result<()> {
        d.expect("m", m.len(), d.m_len())?;
        d.expect("q", q.len(), d.q_len())?;
        d.expect("p", p.len(), d.p_len())?;
        let (mp, qp, pp) = (
            m.as_ptr() as *mut f32,
            q.as_ptr() as *mut f32,
            p.as_mut_ptr(),
        );
        let mat = Mat::base(&d, mp, std::ptr::null_mut(), pp, qp);
        // SAFETY: lengths were checked above; `m` is only read (no fusion); each task
        // writes the P entries of its own rows.
        self.over_rows(&d, mat, |a, rows| unsafe {
            dispatch!(self.isa, mq(a, rows, false))
        });
        Ok(())
    }

    fn mtp(&self, d: Dims, m: &[f32], p: &[f32], q: &mut [f32]) -> Result<()> {
        d.expect("m", m.len(), d.m_len())?;
        d.expect("p", p.len(), d.p_len())?;
        d.expect("q", q.len(), d.q_len())?;
        let (mp, pp, qp) = (
            m.as_ptr() as *mut f32,
            p.as_ptr() as *mut f32,
            q.as_mut_ptr(),
        );
        let mat = Mat::base(&d, mp, std::ptr::null_mut(), pp, qp);
        // SAFETY: lengths checked; `m` and `p` only read; each task writes its own
        // columns of Q.
        self.over_cols(&d, mat, |a, cols| unsafe {
            dispatch!(self.isa, mtp(a, cols))
        });
        Ok(())
    }

    fn pqt(&self, d: Dims, p: &[f32], q: &[f32], m: &mut [f32]) -> Result<()> {
        d.expect("p", p.len(), d.p_len())?;
        d.expect("q", q.len(), d.q_len())?;
        d.expect("m", m.len(), d.m_len())?;
        let (pp, qp, mp) = (
            p.as_ptr() as *mut f32,
            q.as_ptr() as *mut f32,
            m.as_mut_ptr(),
        );
        let mat = Mat::base(&d, mp, std::ptr::null_mut(), pp, qp);
        // SAFETY: lengths checked; `p`, `q` only read; each task writes its own rows of M.
        self.over_rows(&d, mat, |a, rows| unsafe {
            dispatch!(self.isa, pqt(a, rows, false))
        });
        Ok(())
    }

    fn add_mq(&self, d: Dims, g: &mut [f32], e: &[f32], q: &[f32], p: &mut [f32]) -> Result<()> {
        d.expect("g", g.len(), d.m_len())?;
        d.expect("e", e.len(), d.m_len())?;
        d.expect("q", q.len(), d.q_len())?;
        d.expect("p", p.len(), d.p_len())?;
        let (gp, ep, qp, pp) = (
            g.as_mut_ptr(),
            e.as_ptr() as *mut f32,
            q.as_ptr() as *mut f32,
            p.as_mut_ptr(),
        );
        let mat = Mat::base(&d, gp, ep, pp, qp);
        // SAFETY: lengths checked; `e` and `q` only read; each task writes its own rows of
        // G and the P entries of those rows.
        self.over_rows(&d, mat, |a, rows| unsafe {
            dispatch!(self.isa, mq(a, rows, true))
        });
        Ok(())
    }

    fn pqt_error(&self, d: Dims, p: &[f32], q: &[f32], m: &mut [f32], e: &mut [f32]) -> Result<()> {
        d.expect("p", p.len(), d.p_len())?;
        d.expect("q", q.len(), d.q_len())?;
        d.expect("m", m.len(), d.m_len())?;
        d.expect("e", e.len(), d.m_len())?;
        let (pp, qp, mp, ep) = (
            p.as_ptr() as *mut f32,
            q.as_ptr() as *mut f32,
            m.as_mut_ptr(),
            e.as_mut_ptr(),
        );
        let mat = Mat::base(&d, mp, ep, pp, qp);
        // SAFETY: lengths checked; each task reads and writes its own rows of M and E.
        self.over_rows(&d, mat, |a, rows| unsafe {
            dispatch!(self.isa, pqt(a, rows, true))
        });
        Ok(())
    }

    fn pqt_error_unflagged(
        &self,
        d: Dims,
        p: &[f32],
        q: &[f32],
        m: &mut [f32],
        e: &mut [f32],
        flag: &[f32],
    ) -> Result<()> {
        check_flag(flag.len())?;
        d.expect("e", e.len(), d.m_len())?;
        if flag[0] == 0.0 {
            self.pqt_error(d, p, q, m, e)
        } else {
            self.pqt(d, p, q, m)
        }
    }

    fn flag_nonfinite(&self, x: &[f32], flag: &mut [f32]) -> Result<()> {
        check_flag(flag.len())?;
        // The exponent field all ones is an infinity or a NaN; one OR over the bits of a
        // chunk, so the loop vectorises without a branch per element.
        let bad = x.chunks(1024).any(|c| {
            c.iter().fold(0u32, |acc, v| {
                acc | u32::from(v.to_bits() & 0x7f80_0000 == 0x7f80_0000)
            }) != 0
        });
        if bad {
            flag[0] = 1.0;
        }
        Ok(())
    }

    fn copy_unflagged(&self, src: &[f32], dst: &mut [f32], flag: &[f32]) -> Result<()> {
        check_flag(flag.len())?;
        same_len("src", src.len(), "dst", dst.len())?;
        if flag[0] == 0.0 {
            dst.copy_from_slice(src);
        }
        Ok(())
    }

    fn orthogonalize(
        &self,
        batch: usize,
        n: usize,
        r: usize,
        x: &mut [f32],
        eps: f32,
    ) -> Result<()> {
        let d = Dims::new(batch, n, 1, r)?;
        d.expect("x", x.len(), d.p_len())?;
        check_epsilon(eps)?;
        let xp = kernels::SendPtr(x.as_mut_ptr());
        let per = n * r;
        self.parallel(batch, x.len() * 4 * r, |b| {
            let base = xp;
            // SAFETY: matrix b occupies x[b*per..(b+1)*per], checked above; tasks touch
            // disjoint matrices.
            unsafe { dispatch!(self.isa, orthogonalize(base.0.add(b * per), n, r, eps)) }
        });
        Ok(())
    }

    fn orthogonalize_refill(
        &self,
        batch: usize,
        n: usize,
        r: usize,
        x: &mut [f32],
        eps: f32,
        key: u64,
    ) -> Result<()> {
        self.orthogonalize(batch, n, r, &mut *x, eps)?;
        let per = n * r;
        if per == 0 {
            return Ok(());
        }
        let full = n.min(r);
        for m in x.chunks_exact_mut(per) {
            for attempt in 0..crate::REFILL_ATTEMPTS {
                let zero: Vec<usize> = (0..r)
                    .filter(|&c| m[c * n..(c + 1) * n].iter().all(|&v| v == 0.0))
                    .collect();
                if r - zero.len() >= full {
                    break;
                }
                for &c in &zero {
                    for (row, v) in m[c * n..(c + 1) * n].iter_mut().enumerate() {
                        *v = crate::refill_value(key, attempt, (c * n + row) as u64);
                    }
                }
                self.orthogonalize(1, n, r, &mut *m, eps)?;
            }
        }
        Ok(())
    }

    fn add(&self, y: &mut [f32], x: &[f32]) -> Result<()> {
        same_len("y", y.len(), "x", x.len())?;
        self.zip_chunks(x, y, |x, y| y.iter_mut().zip(x).for_each(|(y, x)| *y += x));
        Ok(())
    }

    fn scale(&self, x: &mut [f32], alpha: f32) -> Result<()> {
        if !alpha.is_finite() {
            return Err(Error::InvalidScale(alpha));
        }
        let dummy = vec![(); x.len()];
        self.zip_chunks(&dummy, x, |_, x| x.iter_mut().for_each(|v| *v *= alpha));
        Ok(())
    }

    fn copy<T: Element>(&self, src: &[T], dst: &mut [T]) -> Result<()> {
        same_len("src", src.len(), "dst", dst.len())?;
        self.zip_chunks(src, dst, |s, d| d.copy_from_slice(s));
        Ok(())
    }

    fn zero<T: Element>(&self, x: &mut [T]) -> Result<()> {
        x.fill(T::default());
        Ok(())
    }

    fn cast<S: Element, D: Element>(&self, src: &[S], dst: &mut [D]) -> Result<()> {
        same_len("src", src.len(), "dst", dst.len())?;
        self.zip_chunks(src, dst, cast_chunk::<S, D>);
        Ok(())
    }

    fn fill_normal(&self, rng: &mut NormalRng, x: &mut [f32]) -> Result<()> {
        rng.fill(x);
        Ok(())
    }
}

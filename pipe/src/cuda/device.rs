//! [`Gpu`] (one shared context and the compiled kernels per device) and [`GpuStream`] (a
//! partition's stream, its cuBLAS handle and its memory accounting).

use std::any::Any;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cublas::CudaBlas;
use cudarc::driver::sys::{CUdevice_attribute, CUevent_flags};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DriverError, LaunchConfig,
    PushKernelArg,
};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions, Ptx};

use crate::error::Error;

/// The kernels' CUDA C source (`kernels.cu`).
pub(super) const SOURCE: &str = include_str!("kernels.cu");
/// Threads per block of the element-wise kernels.
pub(super) const THREADS: u32 = 256;
/// Threads per block of the per-feature reductions (`PP_REDUCE_THREADS` in the source).
pub(super) const REDUCE_THREADS: u32 = 256;

/// The handles of the compiled kernels.
#[derive(Debug)]
pub(super) struct Kernels {
    pub(super) fill_rows: CudaFunction,
    pub(super) add: CudaFunction,
    pub(super) relu: CudaFunction,
    pub(super) relu_backward: CudaFunction,
    pub(super) dropout: CudaFunction,
    pub(super) col_sum: CudaFunction,
    pub(super) spin: CudaFunction,
    pub(super) bn_stats: CudaFunction,
    pub(super) bn_forward: CudaFunction,
    pub(super) bn_eval: CudaFunction,
    pub(super) bn_running: CudaFunction,
    pub(super) bn_backward_sums: CudaFunction,
    pub(super) bn_backward_dx: CudaFunction,
}

/// One CUDA device as the pipe's CUDA layers use it: a context shared by every partition
/// on the device (one per process and ordinal, from [`Gpu::new`]) and the compiled kernels.
///
/// cudarc's automatic cross-stream tracking is turned off on this context: the ordering
/// rules of [`CudaTensor`](super::CudaTensor) (every buffer has one home stream, and moves
/// between streams through events) replace it, without an event per kernel argument.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    kernels: Kernels,
    sm_count: usize,
    name: String,
    transfer: OnceLock<Arc<GpuStream>>,
    bytes: Bytes,
    graveyard: Mutex<Vec<Grave>>,
}

impl fmt::Debug for Gpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gpu")
            .field("name", &self.name)
            .field("sm_count", &self.sm_count)
            .finish_non_exhaustive()
    }
}

/// Memory whose last holder is gone while other streams may still read it: freed once
/// every event (recorded on each reader when the holder went) has completed, as PyTorch's
/// caching allocator does for `record_stream`. No stream waits for another to free it.
struct Grave {
    slice: CudaSlice<f32>,
    home: Arc<GpuStream>,
    events: Vec<CudaEvent>,
}

/// Live bytes and their peak (of a stream, or of a whole device).
#[derive(Debug, Default)]
struct Bytes {
    live: AtomicUsize,
    peak: AtomicUsize,
}

impl Bytes {
    fn live(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }

    fn peak(&self) -> usize {
        self.peak.load(Ordering::Relaxed)
    }

    fn reset_peak(&self) {
        self.peak.store(self.live(), Ordering::Relaxed);
    }

    fn add(&self, bytes: usize) {
        let now = self.live.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }

    fn sub(&self, bytes: usize) {
        self.live.fetch_sub(bytes, Ordering::Relaxed);
    }
}

/// The devices opened so far, by ordinal.
static GPUS: Mutex<Vec<Option<Arc<Gpu>>>> = Mutex::new(Vec::new());

impl Gpu {
    /// The device `ordinal`, shared: every call with the same ordinal returns the same
    /// context, so all partitions on a device order their work in one context.
    ///
    /// Errors: [`Error::CudaUnavailable`] when `libcuda`, `libcublas` or `libnvrtc` cannot
    /// be loaded, the driver finds no device, or `ordinal` is not one; [`Error::Cuda`] when
    /// the kernels fail to compile or load.
    pub fn new(ordinal: usize) -> Result<Arc<Gpu>, Error> {
        let mut gpus = GPUS.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(Some(gpu)) = gpus.get(ordinal) {
            return Ok(gpu.clone());
        }
        check_libraries()?;
        let gpu = Arc::new(guarded(|| Gpu::open(ordinal))?);
        if gpus.len() <= ordinal {
            gpus.resize(ordinal + 1, None);
        }
        gpus[ordinal] = Some(gpu.clone());
        Ok(gpu)
    }

    fn open(ordinal: usize) -> Result<Gpu, Error> {
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
        // SAFETY: no slice has been made on this context yet (it was just created and is
        // not shared), so none relies on tracking; every slice made later is ordered by
        // the home-stream rules of `CudaTensor` (see the module documentation).
        unsafe { ctx.disable_event_tracking() };
        ctx.bind_to_thread().map_err(driver)?;
        let name = ctx.name().map_err(driver)?;
        let sm_count = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(driver)?;
        let (major, minor) = ctx.compute_capability().map_err(driver)?;
        let module = ctx.load_module(compile(major, minor)?).map_err(driver)?;
        let f = |name: &str| {
            module
                .load_function(name)
                .map_err(|e| Error::Cuda(format!("kernel `{name}` not in the module: {e:?}")))
        };
        let kernels = Kernels {
            fill_rows: f("pp_fill_rows")?,
            add: f("pp_add")?,
            relu: f("pp_relu")?,
            relu_backward: f("pp_relu_backward")?,
            dropout: f("pp_dropout")?,
            col_sum: f("pp_col_sum")?,
            spin: f("pp_spin")?,
            bn_stats: f("pp_bn_stats")?,
            bn_forward: f("pp_bn_forward")?,
            bn_eval: f("pp_bn_eval")?,
            bn_running: f("pp_bn_running")?,
            bn_backward_sums: f("pp_bn_backward_sums")?,
            bn_backward_dx: f("pp_bn_backward_dx")?,
        };
        Ok(Gpu {
            name: format!("cuda:{ordinal} {name}"),
            sm_count: usize::try_from(sm_count).unwrap_or(1).max(1),
            ctx,
            kernels,
            transfer: OnceLock::new(),
            bytes: Bytes::default(),
            graveyard: Mutex::new(Vec::new()),
        })
    }

    /// A new stream on this device (non-blocking: it never waits on the legacy default
    /// stream), with its own cuBLAS handle: give each partition its own, so that two
    /// partitions on one device overlap.
    pub fn stream(self: &Arc<Self>) -> Result<Arc<GpuStream>, Error> {
        let stream = self.ctx.new_stream().map_err(driver)?;
        let blas = CudaBlas::new(stream.clone())
            .map_err(|e| Error::Cuda(format!("creating a cuBLAS handle: {e:?}")))?;
        // SAFETY: the handle is valid (just created) and owned by `blas`; pedantic math
        // only forbids reduced-precision paths (TF32), so every product is full f32.
        let status = unsafe {
            cudarc::cublas::sys::cublasSetMathMode(
                *blas.handle(),
                cudarc::cublas::sys::cublasMath_t::CUBLAS_PEDANTIC_MATH,
            )
        };
        if status != cudarc::cublas::sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(Error::Cuda(format!("cublasSetMathMode: {status:?}")));
        }
        Ok(Arc::new(GpuStream {
            gpu: self.clone(),
            stream,
            blas: Mutex::new(blas),
            bytes: Bytes::default(),
        }))
    }

    /// The stream that receives tensors moved to this device from another one
    /// ([`Tensor::to_device`](crate::Tensor::to_device)); made on first use.
    pub fn transfer_stream(self: &Arc<Self>) -> Result<Arc<GpuStream>, Error> {
        if let Some(s) = self.transfer.get() {
            return Ok(s.clone());
        }
        let s = self.stream()?;
        Ok(self.transfer.get_or_init(|| s).clone())
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// `"cuda:0 NVIDIA H200"`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The shared context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// `(free, total)` device memory in bytes, from `cuMemGetInfo`.
    pub fn memory(&self) -> Result<(usize, usize), Error> {
        self.ctx.bind_to_thread().map_err(driver)?;
        self.ctx.mem_get_info().map_err(driver)
    }

    /// Bytes of the [`CudaTensor`](super::CudaTensor)s on this device, over all its
    /// streams (the allocator's own accounting, as each stream's
    /// [`live_bytes`](GpuStream::live_bytes)), memory waiting for other streams' reads
    /// before it is freed included ([`buried_bytes`](Gpu::buried_bytes)).
    pub fn live_bytes(&self) -> usize {
        self.bytes.live()
    }

    /// The most [`live_bytes`](Gpu::live_bytes) has been since the device was opened or
    /// since [`reset_peak`](Gpu::reset_peak).
    pub fn peak_bytes(&self) -> usize {
        self.bytes.peak()
    }

    /// Restarts the device's peak at its current live bytes.
    pub fn reset_peak(&self) {
        self.bytes.reset_peak();
    }

    /// Waits for all work on the device (and frees the memory that was waiting for
    /// other streams' reads).
    pub fn synchronize(&self) -> Result<(), Error> {
        self.ctx.synchronize().map_err(driver)?;
        self.collect();
        Ok(())
    }

    /// Keeps `slice` (at home on `home`) until every event has completed: each was
    /// recorded on a stream that read the memory, after its reads.
    pub(super) fn bury(&self, slice: CudaSlice<f32>, home: Arc<GpuStream>, events: Vec<CudaEvent>) {
        self.graveyard().push(Grave {
            slice,
            home,
            events,
        });
    }

    /// Frees the buried memory whose readers have all passed their events (on its home
    /// stream, after the home's own earlier work). Memory whose event cannot be queried
    /// (a failed device) stays buried: leaked, never freed under a reader.
    pub(super) fn collect(&self) {
        let done: Vec<Grave> = {
            let mut graves = self.graveyard();
            let mut done = Vec::new();
            let mut i = 0;
            while i < graves.len() {
                let complete = graves[i]
                    .events
                    .iter()
                    .all(|e| matches!(e.try_is_complete(), Ok(true)));
                if complete {
                    done.push(graves.swap_remove(i));
                } else {
                    i += 1;
                }
            }
            done
        };
        if done.is_empty() {
            return;
        }
        if self.ctx.bind_to_thread().is_err() {
            // Not bound: keep them for a later call rather than free without a context.
            self.graveyard().extend(done);
            return;
        }
        for g in done {
            g.home.uncount(g.slice.len() * 4);
            drop(g.slice);
        }
    }

    /// Bytes of memory whose last holder is gone but which waits for other streams'
    /// reads to finish before it is freed; [`live_bytes`](Gpu::live_bytes) and the peaks
    /// include it, as it is still allocated. [`synchronize`](Gpu::synchronize) frees it.
    pub fn buried_bytes(&self) -> usize {
        self.graveyard().iter().map(|g| g.slice.len() * 4).sum()
    }

    fn graveyard(&self) -> std::sync::MutexGuard<'_, Vec<Grave>> {
        self.graveyard.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn kernels(&self) -> &Kernels {
        &self.kernels
    }

    /// A grid-stride launch over `len` elements.
    pub(super) fn elementwise(&self, len: usize) -> LaunchConfig {
        let cap = self.sm_count * 32;
        LaunchConfig {
            grid_dim: (len.div_ceil(THREADS as usize).clamp(1, cap) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

/// A partition's CUDA stream: where every layer of the partition enqueues its work and
/// where the tensors it makes live (their home; see [`CudaTensor`](super::CudaTensor)).
/// Counts the bytes of the tensors at home here, and their peak, as the partition's
/// device memory.
pub struct GpuStream {
    gpu: Arc<Gpu>,
    stream: Arc<CudaStream>,
    blas: Mutex<CudaBlas>,
    bytes: Bytes,
}

impl fmt::Debug for GpuStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuStream")
            .field("gpu", &self.gpu.name)
            .field("live_bytes", &self.live_bytes())
            .field("peak_bytes", &self.peak_bytes())
            .finish_non_exhaustive()
    }
}

impl GpuStream {
    /// The device.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// The cudarc stream.
    pub fn cuda_stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Bytes of the tensors whose home is this stream.
    pub fn live_bytes(&self) -> usize {
        self.bytes.live()
    }

    /// The most [`live_bytes`](GpuStream::live_bytes) has been since the stream was made
    /// or since [`reset_peak`](GpuStream::reset_peak).
    pub fn peak_bytes(&self) -> usize {
        self.bytes.peak()
    }

    /// Restarts the peak at the current live bytes.
    pub fn reset_peak(&self) {
        self.bytes.reset_peak();
    }

    /// Waits for the work enqueued on this stream (and frees the device's memory that
    /// was waiting for reads that have now finished).
    pub fn synchronize(&self) -> Result<(), Error> {
        self.stream.synchronize().map_err(driver)?;
        self.gpu.collect();
        Ok(())
    }

    /// Enqueues a kernel that spins for about `cycles` clock cycles (tests delay a
    /// producer with it).
    #[doc(hidden)]
    pub fn spin(&self, cycles: u64) -> Result<(), Error> {
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = self.stream.launch_builder(&self.gpu.kernels.spin);
        launch.arg(&cycles);
        // SAFETY: `pp_spin(u64)` takes exactly this argument and touches no memory.
        unsafe { launch.launch(cfg) }.map(drop).map_err(driver)
    }

    /// An event recorded now on this stream (no timing).
    pub(super) fn event(&self) -> Result<CudaEvent, Error> {
        self.stream
            .record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(driver)
    }

    /// Makes this stream wait for `event`.
    pub(super) fn wait_event(&self, event: &CudaEvent) -> Result<(), Error> {
        self.stream.wait(event).map_err(driver)
    }

    /// Makes this stream wait for everything enqueued so far on `other`.
    pub(super) fn wait_for(&self, other: &GpuStream) -> Result<(), Error> {
        if std::ptr::eq(self, other) {
            return Ok(());
        }
        let event = other.event()?;
        self.stream.wait(&event).map_err(driver)
    }

    /// `len` uninitialised elements at home here (one hidden element when `len` is 0:
    /// the driver refuses empty allocations).
    pub(super) fn alloc(&self, len: usize) -> Result<CudaSlice<f32>, Error> {
        self.gpu.collect();
        if len == 0 {
            // SAFETY: one f32 is allocated; it is never read as data (the slice made from
            // it claims 0 elements).
            let one = unsafe { self.stream.alloc::<f32>(1) }.map_err(driver)?;
            let ptr = one.leak();
            // SAFETY: `ptr` is a live allocation of one f32 made on this stream and owned
            // by no one since `leak`; the slice claims none of it and frees it on drop.
            return Ok(unsafe { self.stream.upgrade_device_ptr(ptr, 0) });
        }
        // SAFETY: every caller writes all `len` elements (a kernel, a copy or a memset)
        // on this stream before anything reads them.
        unsafe { self.stream.alloc::<f32>(len) }
            .map_err(|e| Error::Cuda(format!("allocating {len} f32 on {}: {e:?}", self.gpu.name)))
    }

    /// Moves a slice made on another stream of the same device here: the caller has made
    /// this stream wait for every use of it there, and no other holder is left.
    pub(super) fn adopt(self: &Arc<Self>, slice: CudaSlice<f32>) -> CudaSlice<f32> {
        let len = slice.len();
        let ptr = slice.leak();
        // SAFETY: `ptr` is the live allocation of `len` f32 that `slice` owned (its
        // bookkeeping was released by `leak`, which frees nothing); it was made in this
        // stream's context, and the caller made this stream wait for all its uses on the
        // old one, so freeing it here later (stream-ordered) follows them.
        unsafe { self.stream.upgrade_device_ptr(ptr, len) }
    }

    pub(super) fn count(&self, bytes: usize) {
        self.bytes.add(bytes);
        self.gpu.bytes.add(bytes);
    }

    pub(super) fn uncount(&self, bytes: usize) {
        self.bytes.sub(bytes);
        self.gpu.bytes.sub(bytes);
    }

    /// Runs `f` with the cuBLAS handle, the context bound to the calling thread.
    pub(super) fn blas<R>(&self, f: impl FnOnce(&CudaBlas) -> R) -> Result<R, Error> {
        self.gpu.ctx.bind_to_thread().map_err(driver)?;
        let blas = self.blas.lock().unwrap_or_else(|p| p.into_inner());
        Ok(f(&blas))
    }
}

/// A driver error.
pub(super) fn driver(e: DriverError) -> Error {
    Error::Cuda(format!("{e:?}"))
}

fn unavailable(what: &str, e: DriverError) -> Error {
    Error::CudaUnavailable(format!("{what}: {e:?}"))
}

/// Errors unless the driver, cuBLAS and NVRTC can be loaded (cudarc panics on the first
/// call into a library it cannot load).
fn check_libraries() -> Result<(), Error> {
    let missing = |what: &str, file: &str| {
        Err(Error::CudaUnavailable(format!(
            "the {what} library was not found ({file}); put it on LD_LIBRARY_PATH"
        )))
    };
    // SAFETY: `is_culib_present` only tries to `dlopen` each candidate name and closes it.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return missing("CUDA driver", "libcuda.so");
    }
    // SAFETY: as above.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return missing("cuBLAS", "libcublas.so");
    }
    // SAFETY: as above.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return missing("NVRTC", "libnvrtc.so");
    }
    Ok(())
}

/// Runs `f`, turning a panic inside cudarc (a missing symbol in an old library) into
/// [`Error::CudaUnavailable`].
fn guarded<T>(f: impl FnOnce() -> Result<T, Error>) -> Result<T, Error> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        Err(Error::CudaUnavailable(format!(
            "initialising CUDA panicked: {}",
            panic_text(payload.as_ref())
        )))
    })
}

fn panic_text(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_owned()
    }
}

/// Compiles [`SOURCE`] for `compute_{major}{minor}`, or for NVRTC's default architecture
/// when NVRTC does not know that one. IEEE behaviour is pinned (no flush to zero, exact
/// division and square root, no contraction into FMAs).
pub(super) fn compile(major: i32, minor: i32) -> Result<Ptx, Error> {
    let options = |arch: Option<String>| CompileOptions {
        ftz: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        fmad: Some(false),
        options: arch.into_iter().collect(),
        name: Some("pipe_kernels.cu".into()),
        ..Default::default()
    };
    let arch = format!("--gpu-architecture=compute_{major}{minor}");
    match compile_ptx_with_opts(SOURCE, options(Some(arch))) {
        Ok(ptx) => Ok(ptx),
        Err(first) => compile_ptx_with_opts(SOURCE, options(None)).map_err(|_| nvrtc(first)),
    }
}

fn nvrtc(e: CompileError) -> Error {
    match e {
        CompileError::CompileError { nvrtc, log, .. } => {
            Error::Cuda(format!("NVRTC: {nvrtc:?}:\n{}", log.to_string_lossy()))
        }
        other => Error::Cuda(format!("NVRTC: {other:?}")),
    }
}

#[cfg(test)]
mod tests {
    /// The source compiles for Hopper and for NVRTC's default architecture wherever
    /// `libnvrtc` is found (NVRTC needs no GPU), and the launch sizes agree with it.
    #[test]
    fn source_compiles_with_nvrtc() {
        let line = super::SOURCE
            .lines()
            .find(|l| l.starts_with("#define PP_REDUCE_THREADS "))
            .expect("PP_REDUCE_THREADS");
        assert_eq!(
            line.split_whitespace().nth(2),
            Some(super::REDUCE_THREADS.to_string().as_str())
        );
        // SAFETY: `is_culib_present` only tries to open each candidate library name.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            println!("skipped: libnvrtc not found");
            return;
        }
        for (major, minor) in [(9, 0), (8, 0)] {
            if let Err(e) = super::compile(major, minor) {
                panic!("NVRTC rejected the kernels for compute_{major}{minor}: {e}");
            }
        }
    }
}

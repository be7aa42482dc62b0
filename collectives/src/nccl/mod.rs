//! The NCCL backend (feature `cuda`): a [`ProcessGroup`] whose collectives run on GPUs
//! through NCCL, loaded at run time by `cudarc`.
//!
//! [`NcclGroup`] takes host [`Buffer`](crate::Buffer)s (staged through device buffers on the group's
//! stream) and, through its own `*_device` methods, `cudarc` [`CudaSlice`]s of any
//! [`NcclElement`] (`f32`, `f64`, `f16`, `bf16`, and `u8`, which is moved but never
//! reduced), reduced in place or into new buffers on the group's stream. Through the trait ([`ProcessGroup::all_reduce_device`],
//! [`ProcessGroup::broadcast_device`]) it takes [`DeviceBuffer`](crate::DeviceBuffer)s the same way, with no
//! host copy ([`ProcessGroup::device_native`] is `true`); the inherent typed methods of
//! the same names shadow them on a concrete `NcclGroup` (call the trait's through
//! `&dyn ProcessGroup` or `ProcessGroup::all_reduce_device(&group, ..)`). Create the ranks from a unique id ([`NcclGroup::new`] with an
//! [`NcclId`]), through the rendezvous store ([`NcclGroup::from_store`]), or from the
//! variables a launcher set ([`NcclGroup::from_env`]).
//!
//! ```no_run
//! use std::time::Duration;
//! use collectives::nccl::{NcclGroup, NcclId};
//! use collectives::{Buffer, ProcessGroup, ReduceOp};
//!
//! // A one-rank group on GPU 0 (several ranks: share the id, see `from_store`).
//! let group = NcclGroup::new(0, 1, 0, NcclId::new()?, Duration::from_secs(60))?;
//! let sum = group.all_reduce(Buffer::F32(vec![1.0, 2.0]), ReduceOp::Sum).wait()?;
//! assert_eq!(sum, Buffer::F32(vec![1.0, 2.0]));
//! # Ok::<(), collectives::Error>(())
//! ```
//!
//! # Design
//! NCCL's communicator is not `Send`, so each group has a **progress thread** that owns
//! the device context, the group's CUDA stream and the communicator; operations reach it
//! through a channel and run there in the order they were issued, one at a time. Each
//! operation issues its NCCL calls on the stream, then the thread polls a CUDA event and
//! `ncclCommGetAsyncError` until the work is done, and completes the [`Work`] handle, so
//! continuations run on the progress thread. The caller's thread never blocks, and
//! compute on other streams overlaps the communication.
//!
//! The communicator is created non-blocking (`ncclCommInitRankConfig` with
//! `blocking = 0`), so that no NCCL call can block the progress thread: creation, splits
//! and calls answering `ncclInProgress` are polled like the operations.
//!
//! # Guarantees
//! - **Bounded waits.** Creation and every operation fail with [`Error::Timeout`] after
//!   the group's timeout (creation waits up to a minute more for the CUDA context).
//!   Exception: a host buffer's upload waits for work the caller queued on
//!   [`NcclGroup::stream`] itself.
//! - **Faults abort.** A timeout, an asynchronous NCCL error (a peer that died:
//!   `ncclRemoteError`, a network error: `ncclSystemError`) or a failed NCCL or CUDA call
//!   aborts the communicator (`ncclCommAbort`): the failing operation and every pending
//!   and later one fail with that error, and [`NcclGroup::failure`] returns it. NCCL
//!   cannot tell a peer that this rank gave up: the peers' pending operations fail by
//!   their own timeout, or with `ncclRemoteError` where the transport notices.
//! - **Abort on request.** [`NcclGroup::abort`] aborts the communicator from any thread;
//!   the operation in flight and every later one fail with [`Error::Aborted`].
//! - **Point-to-point natively.** `send`, `recv` and `batch_isend_irecv` (and their
//!   `_device` forms, on device memory with no host copy) are `ncclSend` / `ncclRecv`,
//!   a batch in one `ncclGroupStart` / `ncclGroupEnd`. NCCL has no tags: messages match
//!   by posting order per peer, and outside debug mode NCCL cannot see a receive whose
//!   length or type differs from the send's; see [`p2p`] for exactly what
//!   holds. `reduce`, `gather`, `scatter` and `all_to_all` are the trait's defaults,
//!   composed of these and of `all_reduce`.
//! - **Raw bytes.** [`U8`](crate::DType::U8) buffers travel as `ncclUint8`; every
//!   reduction of one is [`Error::InvalidArgument`] before anything is queued.
//! - **Mismatches in debug mode.** With [`NcclGroup::with_debug`] (or
//!   `COLLECTIVES_DEBUG=1`) every rank all-gathers a small descriptor before each
//!   operation; different collectives, roots, reductions, types or lengths fail on every
//!   rank with [`Error::Mismatch`] naming both operations. Without it, NCCL cannot see
//!   such mistakes: mismatched lengths corrupt data or time out.
//! - **No panics.** A missing CUDA driver or NCCL library is an [`Error::Unavailable`] that
//!   says what to install or link; `cudarc` panics (a symbol missing from an old library)
//!   are caught; `Drop` never panics.
//! - **Dropping** a group lets its queued operations finish (within one timeout from the
//!   drop), then aborts the communicator (`ncclCommDestroy` could wait for peers) and
//!   joins the progress thread.
//!
//! # Libraries
//! `cudarc` looks for `libnccl.so` (and `libnccl.so.13`, ...), while the pip wheel
//! `nvidia-nccl-cu13` ships only `libnccl.so.2`: put a link named `libnccl.so` to it in a
//! directory on `LD_LIBRARY_PATH`. NCCL 2.14 or newer is needed (non-blocking
//! communicators); `new_group` needs 2.18 (`ncclCommSplit`). NCCL refuses two ranks on
//! one GPU, so a single-GPU machine can run groups of one rank only.
//!
//! # What has run where
//! On one H200 (driver 580.159.04, NCCL 2.28.9 from the `nvidia-nccl-cu13` package,
//! 2026-12-01) `tests/nccl.rs` passed: every operation at world size 1, debug mode,
//! `new_group`, the store rendezvous, the abort path, the creation timeout, device
//! buffers, and continuations in order; the two-rank tests (collectives, mismatch
//! detection, a peer that leaves) need two GPUs and have not run. Without a driver, with
//! the pip wheel's NCCL linked as `libnccl.so`, the library checks, [`library_version`],
//! [`NcclId::new`] (`ncclGetUniqueId`) and the missing-library errors run; every other
//! test skips.
//! The point-to-point operations, `U8` buffers and the composed collectives (2026-12-01)
//! have been compiled, not yet run on a GPU: their tests in `tests/nccl.rs` wait for the
//! next `cargo xtask gpu-check`.
//! Asynchronous errors from a real network fault go through the same path as a timeout
//! but no test provokes one.

mod comm;
mod debug;
mod engine;
mod group;
mod ops;
pub mod p2p;

pub use comm::{check_libraries, NcclId};
pub use ops::NcclElement;

use crate::store::TcpStore;
use crate::{Error, ProcessGroup, ReduceOp, Result, Work};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use debug::{Desc, Kind};
use engine::{Engine, Job, Setup, Shared};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::{self, JoinHandle};
use std::time::Duration;

/// How long construction waits, beyond the group's timeout, for the CUDA context.
const CONTEXT_GRACE: Duration = Duration::from_secs(60);

/// The loaded NCCL library's version, `(major, minor, patch)`. Errors: [`Error::Unavailable`]
/// when the NCCL library is missing.
pub fn library_version() -> Result<(u32, u32, u32)> {
    let code = comm::version_code()?;
    Ok((code / 10000, code % 10000 / 100, code % 100))
}

/// The number of CUDA devices the driver sees. Errors: [`Error::Unavailable`] when the driver
/// library is missing or fails to initialise.
pub fn device_count() -> Result<usize> {
    // SAFETY: `is_culib_present` only tries to `dlopen` candidate names and closes them.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(Error::Unavailable(comm::MISSING_DRIVER.into()));
    }
    comm::guarded("counting CUDA devices", || {
        let count = CudaContext::device_count().map_err(engine::driver("cuDeviceGetCount"))?;
        Ok(usize::try_from(count).unwrap_or(0))
    })
}

/// One rank of an NCCL process group; see the [module docs](self).
pub struct NcclGroup {
    shared: Arc<Shared>,
    stream: Arc<CudaStream>,
    ordinal: usize,
    debug: AtomicBool,
    jobs: Option<mpsc::Sender<Job>>,
    worker: Option<JoinHandle<()>>,
}

// Compile-time check that a group can be shared between threads, as `ProcessGroup` needs.
const _: fn() = || {
    fn shareable<T: Send + Sync>() {}
    shareable::<NcclGroup>();
};

impl std::fmt::Debug for NcclGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclGroup")
            .field("rank", &self.shared.rank)
            .field("size", &self.shared.size)
            .field("device", &self.ordinal)
            .field("timeout", &self.shared.timeout)
            .finish_non_exhaustive()
    }
}

impl NcclGroup {
    /// Rank `rank` of a group of `world_size` ranks, on CUDA device `device_ordinal`, from
    /// the unique id every rank was given (rank 0 created it with [`NcclId::new`]). Every
    /// rank calls this; it returns once all of them have joined, within `timeout` (plus
    /// up to a minute to create the CUDA context). Debug mode is on when the environment
    /// has `COLLECTIVES_DEBUG=1`.
    ///
    /// Errors: [`Error::InvalidArgument`] for a bad rank, size, timeout or device;
    /// [`Error::Unavailable`] when the CUDA driver or NCCL is missing (the message says how to
    /// provide `libnccl.so`), too old, or fails; [`Error::Timeout`] when some rank did not
    /// join in time.
    pub fn new(
        rank: usize,
        world_size: usize,
        device_ordinal: usize,
        id: NcclId,
        timeout: Duration,
    ) -> Result<NcclGroup> {
        if world_size == 0 || rank >= world_size || world_size > i32::MAX as usize {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} of a group of {world_size}: need 0 <= rank < size <= 2^31 - 1"
            )));
        }
        if timeout.is_zero() {
            return Err(Error::InvalidArgument(
                "the timeout must be positive".into(),
            ));
        }
        check_libraries()?;
        let version = comm::version_code()?;
        if version < comm::MIN_VERSION {
            return Err(Error::Unavailable(format!(
                "NCCL {} is too old: non-blocking communicators need NCCL 2.14 or newer",
                comm::version_text(version)
            )));
        }
        NcclGroup::spawn(
            Setup::Init(id),
            rank,
            world_size,
            device_ordinal,
            timeout,
            env_debug(),
        )
    }

    /// Rank `rank` of `world_size`, exchanging the unique id through the rendezvous store:
    /// rank 0 creates it and sets it, the others get it, and all meet at a barrier (so
    /// rank 0 may drop the store afterwards) before creating the communicator with
    /// [`NcclGroup::new`]. Every rank calls this the same number of times (each call
    /// uses fresh keys).
    ///
    /// Errors: as [`NcclGroup::new`]; the store's errors; [`Error::PeerLost`] on the other
    /// ranks when rank 0 could not create the id.
    pub fn from_store(
        store: &TcpStore,
        rank: usize,
        world_size: usize,
        device_ordinal: usize,
        timeout: Duration,
    ) -> Result<NcclGroup> {
        if world_size == 0 || rank >= world_size {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} is not below the world size {world_size}"
            )));
        }
        let generation = store.add(&format!("collectives/nccl/calls/{rank}"), 1)?;
        let key = format!("collectives/nccl/{generation}/unique_id");
        let id = if rank == 0 {
            match NcclId::new() {
                Ok(id) => {
                    store.set(&key, id.as_bytes())?;
                    id
                }
                Err(e) => {
                    // An empty value tells the other ranks at once, instead of by timeout.
                    let _ = store.set(&key, b"");
                    return Err(e);
                }
            }
        } else {
            check_libraries()?;
            let bytes = store.get(&key)?;
            if bytes.is_empty() {
                return Err(Error::PeerLost {
                    rank: 0,
                    why: "it could not create the NCCL unique id".into(),
                });
            }
            NcclId::from_bytes(&bytes)?
        };
        store.barrier(
            &format!("collectives/nccl/{generation}/have_id"),
            world_size,
            rank,
            timeout,
        )?;
        NcclGroup::new(rank, world_size, device_ordinal, id, timeout)
    }

    /// The group the launcher's variables describe ([`EnvInfo`](crate::env::EnvInfo):
    /// `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`, or Slurm's or
    /// Open MPI's), on device `LOCAL_RANK`, with the id exchanged through the store that
    /// rank 0 serves on `MASTER_PORT`.
    pub fn from_env(timeout: Duration) -> Result<NcclGroup> {
        let info = crate::env::EnvInfo::from_env()?;
        let store = info.connect_store(timeout)?;
        NcclGroup::from_store(&store, info.rank, info.world_size, info.local_rank, timeout)
    }

    /// Starts the progress thread and waits for it to have its communicator.
    fn spawn(
        setup: Setup,
        rank: usize,
        size: usize,
        ordinal: usize,
        timeout: Duration,
        debug: bool,
    ) -> Result<NcclGroup> {
        let shared = Arc::new(Shared::new(rank, size, timeout));
        let (ready_tx, ready_rx) = mpsc::channel::<Result<Arc<CudaStream>>>();
        let (jobs_tx, jobs_rx) = mpsc::channel::<Job>();
        let thread_shared = shared.clone();
        let worker = thread::Builder::new()
            .name(format!("nccl-rank-{rank}"))
            .spawn(move || {
                let started = comm::guarded("starting the NCCL progress thread", || {
                    Ok(Engine::start(setup, ordinal, thread_shared))
                });
                match started {
                    Ok(Ok(engine)) => {
                        if ready_tx.send(Ok(engine.stream.clone())).is_ok() {
                            engine.serve(jobs_rx);
                        }
                    }
                    Ok(Err(failure)) => {
                        // Answer first: aborting the half-made communicator can take a while.
                        let _ = ready_tx.send(Err(failure.error));
                        if let Some(leftover) = failure.leftover {
                            leftover.discard();
                        }
                    }
                    Err(panicked) => {
                        let _ = ready_tx.send(Err(panicked));
                    }
                }
            })
            .map_err(|e| Error::io("starting the NCCL progress thread", e))?;
        match ready_rx.recv_timeout(timeout + CONTEXT_GRACE) {
            Ok(Ok(stream)) => Ok(NcclGroup {
                shared,
                stream,
                ordinal,
                debug: AtomicBool::new(debug),
                jobs: Some(jobs_tx),
                worker: Some(worker),
            }),
            // The thread ends on its own after a failure (not joined: an abort may take a
            // while, and the caller has its answer).
            Ok(Err(e)) => Err(e),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                shared.stop.store(true, Ordering::Release);
                Err(Error::Timeout {
                    what: format!(
                        "creating the NCCL group (rank {rank} of {size}, device {ordinal})"
                    ),
                    after: timeout + CONTEXT_GRACE,
                    missing: Vec::new(),
                })
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(Error::Gone {
                what: "the NCCL progress thread ended before the communicator was ready".into(),
            }),
        }
    }

    /// Turns debug mode on or off (see the [module docs](self)). Every rank must use the
    /// same setting: the descriptor exchange is itself a collective.
    pub fn with_debug(self, on: bool) -> NcclGroup {
        self.debug.store(on, Ordering::Relaxed);
        self
    }

    /// Whether debug mode is on.
    pub fn debug(&self) -> bool {
        self.debug.load(Ordering::Relaxed)
    }

    /// The CUDA stream every operation runs on. Device buffers given to the `*_device`
    /// methods may live on any stream of the same device: the group's stream first waits
    /// for the work already queued on theirs.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The CUDA device ordinal.
    pub fn device_ordinal(&self) -> usize {
        self.ordinal
    }

    /// Aborts the communicator (`ncclCommAbort`) from any thread: the operation in flight
    /// and every later one fail with [`Error::Aborted`]. Peers are not told; their
    /// operations fail by timeout.
    pub fn abort(&self) {
        self.shared.stop.store(true, Ordering::Release);
        // Wakes an idle progress thread, which then aborts.
        self.post(Box::new(|_: &mut Engine| {}));
    }

    /// Why the communicator was aborted, once it was (the first failure, or the abort).
    pub fn failure(&self) -> Option<Error> {
        self.shared
            .failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn post(&self, job: Job) {
        if let Some(tx) = &self.jobs {
            // A send fails only if the progress thread is gone; the job is then dropped,
            // and with it the completer, which fails its work.
            let _ = tx.send(job);
        }
    }

    /// Queues an operation described by `desc`; its result completes the returned work.
    fn submit<T: Send + 'static>(
        &self,
        desc: Desc,
        op: impl FnOnce(&mut Engine, &comm::Watch<'_>) -> Result<T> + Send + 'static,
    ) -> Work<T> {
        let (work, completer) = Work::pending_on(self.progress_thread());
        let debug = self.debug();
        self.post(Box::new(move |engine| {
            completer.complete(engine.run(&desc, debug, op))
        }));
        work
    }

    /// Queues an operation on a caller's device buffer, which comes back with the result
    /// or is released (ordered after the group's stream) on failure.
    fn submit_device<B: Send + 'static, T: Send + 'static>(
        &self,
        desc: Desc,
        bufs: B,
        op: impl FnOnce(&mut Engine, &comm::Watch<'_>, &mut B) -> Result<T> + Send + 'static,
        release: impl FnOnce(&Engine, B) + Send + 'static,
    ) -> Work<(B, T)> {
        let (work, completer) = Work::pending_on(self.progress_thread());
        let debug = self.debug();
        self.post(Box::new(move |engine| {
            let mut bufs = bufs;
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                engine.run(&desc, debug, |e, w| op(e, w, &mut bufs))
            }));
            // A panic after the NCCL call was issued: the buffers are released in stream
            // order before the unwind goes on (it fails the group), never freed under a
            // kernel that may still use them.
            let outcome = match outcome {
                Ok(outcome) => outcome,
                Err(panic) => {
                    release(engine, bufs);
                    std::panic::resume_unwind(panic)
                }
            };
            completer.complete(match outcome {
                Ok(v) => Ok((bufs, v)),
                Err(err) => {
                    release(engine, bufs);
                    Err(err)
                }
            })
        }));
        work
    }

    /// Errors unless `buf` lives on this group's device.
    fn same_device<T>(&self, buf: &CudaSlice<T>) -> Result<()> {
        if **buf.context() == **self.stream.context() {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "a device buffer on CUDA device {} given to the NCCL group of device {}",
                buf.ordinal(),
                self.ordinal
            )))
        }
    }

    fn check_root(&self, root: usize) -> Result<()> {
        if root < self.size() {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "broadcast root {root} is not a rank of a group of {}",
                self.size()
            )))
        }
    }

    fn check_divisible(&self, len: usize) -> Result<()> {
        if len.is_multiple_of(self.size()) {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "reduce_scatter needs a length divisible by the group size {}, got {len}",
                self.size()
            )))
        }
    }

    /// [`ProcessGroup::all_reduce`] on a device buffer, in place: reduces `buf` over all
    /// ranks and gives it back.
    pub fn all_reduce_device<T: NcclElement>(
        &self,
        buf: CudaSlice<T>,
        op: ReduceOp,
    ) -> Work<CudaSlice<T>> {
        if let Err(e) = self
            .same_device(&buf)
            .and_then(|()| reducible::<T>("all_reduce"))
        {
            return Work::ready(Err(e));
        }
        let desc = Desc::new(Kind::AllReduce(op), [(T::DTYPE, buf.len())]);
        self.submit_device(
            desc,
            buf,
            move |e, w, buf| e.all_reduce_device(std::slice::from_mut(buf), op, w),
            |e, buf| e.release(buf),
        )
        .then(|r| r.map(|(buf, ())| buf))
    }

    /// [`ProcessGroup::all_reduce_coalesced`] on device buffers of one element type, in
    /// place, as one grouped NCCL launch.
    pub fn all_reduce_coalesced_device<T: NcclElement>(
        &self,
        bufs: Vec<CudaSlice<T>>,
        op: ReduceOp,
    ) -> Work<Vec<CudaSlice<T>>> {
        if let Some(e) = bufs
            .iter()
            .find_map(|b| self.same_device(b).err())
            .or_else(|| reducible::<T>("all_reduce_coalesced").err())
        {
            return Work::ready(Err(e));
        }
        let desc = Desc::new(
            Kind::Coalesced(op),
            bufs.iter().map(|b| (T::DTYPE, b.len())),
        );
        self.submit_device(
            desc,
            bufs,
            move |e, w, bufs| e.all_reduce_device(bufs, op, w),
            |e, bufs| bufs.into_iter().for_each(|b| e.release(b)),
        )
        .then(|r| r.map(|(bufs, ())| bufs))
    }

    /// [`ProcessGroup::broadcast`] on a device buffer, in place.
    pub fn broadcast_device<T: NcclElement>(
        &self,
        buf: CudaSlice<T>,
        root: usize,
    ) -> Work<CudaSlice<T>> {
        if let Err(e) = self.same_device(&buf).and_then(|()| self.check_root(root)) {
            return Work::ready(Err(e));
        }
        let desc = Desc::new(Kind::Broadcast(root), [(T::DTYPE, buf.len())]);
        self.submit_device(
            desc,
            buf,
            move |e, w, buf| e.broadcast_device(buf, root, w),
            |e, buf| e.release(buf),
        )
        .then(|r| r.map(|(buf, ())| buf))
    }

    /// [`ProcessGroup::all_gather`] on a device buffer: every rank's buffer, concatenated
    /// in rank order, in one new buffer (`size()` times as long) on the group's stream.
    pub fn all_gather_device<T: NcclElement>(&self, buf: CudaSlice<T>) -> Work<CudaSlice<T>> {
        if let Err(e) = self.same_device(&buf) {
            return Work::ready(Err(e));
        }
        let desc = Desc::new(Kind::AllGather, [(T::DTYPE, buf.len())]);
        self.submit(desc, move |e, w| e.all_gather_device(buf, w))
    }

    /// [`ProcessGroup::reduce_scatter`] on a device buffer of `size()` equal chunks: this
    /// rank's reduced chunk, in a new buffer on the group's stream.
    pub fn reduce_scatter_device<T: NcclElement>(
        &self,
        buf: CudaSlice<T>,
        op: ReduceOp,
    ) -> Work<CudaSlice<T>> {
        if let Err(e) = self
            .same_device(&buf)
            .and_then(|()| reducible::<T>("reduce_scatter"))
            .and_then(|()| self.check_divisible(buf.len()))
        {
            return Work::ready(Err(e));
        }
        let desc = Desc::new(Kind::ReduceScatter(op), [(T::DTYPE, buf.len())]);
        self.submit(desc, move |e, w| e.reduce_scatter_device(buf, op, w))
    }

    /// The subgroup of `ranks` as an `NcclGroup` (what [`ProcessGroup::new_group`] boxes):
    /// `ncclCommSplit`, with rank `i` of the subgroup being `ranks[i]`. Every rank of this
    /// group calls it with the same list; ranks outside it get `None`. Blocks until the
    /// split is done (within the timeout); not callable from a continuation, which runs on
    /// the progress thread that does the split.
    ///
    /// Errors: [`Error::InvalidArgument`] for a bad list; [`Error::Unsupported`] before
    /// NCCL 2.18; as an operation otherwise (a failed split aborts this group's
    /// communicator).
    pub fn split(&self, ranks: &[usize]) -> Result<Option<NcclGroup>> {
        let size = self.size();
        let mut sorted = ranks.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        if ranks.is_empty() || sorted.len() != ranks.len() || sorted.iter().any(|&r| r >= size) {
            return Err(Error::InvalidArgument(format!(
                "new_group needs distinct ranks below {size}, got {ranks:?}"
            )));
        }
        if self.on_progress_thread() {
            return Err(Error::InvalidArgument(
                "new_group cannot be called from a continuation: it runs on the progress \
                 thread that must do the split"
                    .into(),
            ));
        }
        let version = comm::version_code()?;
        if version < comm::MIN_SPLIT_VERSION {
            return Err(Error::Unsupported(format!(
                "new_group needs ncclCommSplit (NCCL 2.18 or newer); the loaded NCCL is {}",
                comm::version_text(version)
            )));
        }
        let key = ranks.iter().position(|&r| r == self.rank());
        let desc = Desc::new(Kind::Split(debug::ranks_hash(ranks)), []);
        let detached = self.submit(desc, move |e, w| e.split(key, w)).wait()?;
        match (key, detached) {
            (Some(index), Some(comm)) => NcclGroup::spawn(
                Setup::Adopt(comm),
                index,
                ranks.len(),
                self.ordinal,
                self.timeout(),
                self.debug(),
            )
            .map(Some),
            (None, None) => Ok(None),
            _ => Err(Error::Internal(
                "ncclCommSplit disagreed with the rank list".into(),
            )),
        }
    }

    /// The progress thread, which alone completes this group's works: a wait on it (in a
    /// continuation) for another of its operations fails at once instead of hanging.
    fn progress_thread(&self) -> Option<thread::ThreadId> {
        self.worker.as_ref().map(|w| w.thread().id())
    }

    fn on_progress_thread(&self) -> bool {
        self.worker
            .as_ref()
            .is_some_and(|w| w.thread().id() == thread::current().id())
    }
}

/// Errors ([`Error::InvalidArgument`]) unless NCCL's reduction `what` may reduce `T`
/// (every element type but `u8`).
fn reducible<T: NcclElement>(what: &str) -> Result<()> {
    match crate::buffer::unreducible(what, std::iter::once(T::DTYPE)) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Whether `COLLECTIVES_DEBUG` asks for debug mode (`1`, `true`, `yes`, `on`, `detail`).
fn env_debug() -> bool {
    std::env::var("COLLECTIVES_DEBUG").is_ok_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "1" | "true" | "yes" | "on" | "detail"
        )
    })
}

impl Drop for NcclGroup {
    fn drop(&mut self) {
        *self
            .shared
            .closing
            .lock()
            .unwrap_or_else(|p| p.into_inner()) =
            Some(crate::group::deadline_after(self.shared.timeout));
        drop(self.jobs.take());
        if let Some(worker) = self.worker.take() {
            // Dropped by a continuation on its own progress thread: the thread ends by
            // itself once that job returns (its channel is closed), so it is not joined.
            if worker.thread().id() != thread::current().id() {
                let _ = worker.join();
            }
        }
    }
}

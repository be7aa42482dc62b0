//! The progress thread: it owns the device context, the group's stream and the
//! communicator (which is not `Send`), takes jobs from a channel, runs them one at a time
//! in order, waits for each on the stream while polling NCCL's asynchronous error, and
//! completes the work handles, so continuations run here.
//!
//! One operation is in flight at a time: the next is issued once the previous one has
//! completed on the device. Besides keeping every wait simple and bounded, this matters
//! for host buffers: a copy from pageable memory to the device waits for the stream, so
//! issuing it behind a collective that never completes would block this thread beyond
//! the timeout.

use super::comm::{self, Comm, Detached, InitFailure, NcclId, Watch};
use super::debug::{self, Desc};
use crate::{Error, Result};
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DriverError};
use cudarc::nccl::{result, sys};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// A unit of work for the progress thread.
pub(super) type Job = Box<dyn FnOnce(&mut Engine) + Send>;

/// What the group's handle and its progress thread share.
pub(super) struct Shared {
    pub rank: usize,
    pub size: usize,
    pub timeout: Duration,
    /// Set by `NcclGroup::abort` (or by a construction that gave up): the progress thread
    /// aborts the communicator at its next check, and every wait ends.
    pub stop: AtomicBool,
    /// Set when the group is dropped: queued operations must finish by then.
    pub closing: Mutex<Option<Instant>>,
    /// Why the communicator was aborted, once it was.
    pub failed: Mutex<Option<Error>>,
}

impl Shared {
    pub fn new(rank: usize, size: usize, timeout: Duration) -> Shared {
        Shared {
            rank,
            size,
            timeout,
            stop: AtomicBool::new(false),
            closing: Mutex::new(None),
            failed: Mutex::new(None),
        }
    }
}

/// How the progress thread gets its communicator.
pub(super) enum Setup {
    /// Creates it with `ncclCommInitRankConfig`.
    Init(NcclId),
    /// Takes one made by a split on the parent's thread.
    Adopt(Detached),
}

/// A driver error, with what was being done.
pub(super) fn driver(what: &'static str) -> impl Fn(DriverError) -> Error {
    move |e| Error::Cuda {
        op: what.into(),
        message: format!("{e:?}"),
    }
}

/// The context of device `ordinal`, current on this thread. Errors name the devices the
/// driver sees.
pub(super) fn open_device(ordinal: usize) -> Result<Arc<CudaContext>> {
    let count = CudaContext::device_count().map_err(driver("cuInit / cuDeviceGetCount"))?;
    let count = usize::try_from(count).unwrap_or(0);
    if ordinal >= count {
        return Err(Error::InvalidArgument(format!(
            "there is no CUDA device {ordinal}: the driver sees {count} device(s)"
        )));
    }
    let ctx = CudaContext::new(ordinal).map_err(driver("creating the device context"))?;
    ctx.bind_to_thread()
        .map_err(driver("binding the device context"))?;
    Ok(ctx)
}

/// The progress thread's state. Not `Send` (it holds the communicator): it is created on
/// that thread and never leaves it.
pub(super) struct Engine {
    /// `None` once aborted. First, so that it is dropped (aborted) before the stream.
    comm: Option<Comm>,
    pub(super) shared: Arc<Shared>,
    pub(super) stream: Arc<CudaStream>,
    /// Re-recorded after each operation's work, then polled.
    event: CudaEvent,
    /// Why the communicator was aborted; every later operation fails with it.
    failure: Option<Error>,
    /// Operations run so far, for messages.
    seq: u64,
}

impl Engine {
    /// Opens the device, creates the group's stream and gets the communicator. On
    /// failure the half-made communicator comes back with the error, to be aborted after
    /// the caller has been answered.
    pub fn start(setup: Setup, ordinal: usize, shared: Arc<Shared>) -> Result<Engine, InitFailure> {
        let plain = |error| InitFailure {
            error,
            leftover: None,
        };
        let ctx = open_device(ordinal).map_err(plain)?;
        let stream = ctx
            .new_stream()
            .map_err(driver("creating the group's stream"))
            .map_err(plain)?;
        let event = ctx
            .new_event(None)
            .map_err(driver("creating the group's event"))
            .map_err(plain)?;
        let comm = match setup {
            Setup::Adopt(Detached(comm)) => comm,
            Setup::Init(id) => {
                let what = format!(
                    "NCCL communicator initialisation (rank {} of {})",
                    shared.rank, shared.size
                );
                let watch = Watch {
                    what: &what,
                    until: crate::group::deadline_after(shared.timeout),
                    timeout: shared.timeout,
                    stop: &shared.stop,
                };
                Comm::init(shared.size, &id, shared.rank, &watch)?
            }
        };
        Ok(Engine {
            comm: Some(comm),
            shared,
            stream,
            event,
            failure: None,
            seq: 0,
        })
    }

    /// Runs jobs until the group's handle is dropped, then aborts the communicator (by
    /// dropping it). A panicking job (a continuation, say) fails the group, not the thread.
    pub fn serve(mut self, jobs: mpsc::Receiver<Job>) {
        while let Ok(job) = jobs.recv() {
            self.check_stop();
            let ran = catch_unwind(AssertUnwindSafe(|| job(&mut self)));
            if let Err(payload) = ran {
                self.fail(Error::Panicked {
                    what: format!(
                        "a job or continuation on the NCCL progress thread of rank {}",
                        self.shared.rank
                    ),
                    message: Some(comm::panic_text(payload.as_ref())),
                });
            }
        }
    }

    /// Runs one operation: at once an error if the communicator is gone; in debug mode
    /// after every rank's descriptor matched (a point-to-point batch's: its peers'); and on any failure of the operation aborts
    /// the communicator, so that this and every later operation fail (a mismatch found by
    /// debug mode is not a failure of the communicator).
    pub fn run<T>(
        &mut self,
        desc: &Desc,
        debug: bool,
        op: impl FnOnce(&mut Engine, &Watch<'_>) -> Result<T>,
    ) -> Result<T> {
        self.check_stop();
        if let Some(cause) = &self.failure {
            return Err(cause.clone());
        }
        self.seq += 1;
        let what = format!(
            "NCCL {} (operation {} on rank {} of {})",
            desc.name(),
            self.seq,
            self.shared.rank,
            self.shared.size
        );
        let shared = self.shared.clone();
        let watch = Watch {
            what: &what,
            until: self.deadline(),
            timeout: shared.timeout,
            stop: &shared.stop,
        };
        if debug {
            // Point-to-point operations involve their peers alone: checked pairwise.
            let checked = match desc.kind {
                debug::Kind::P2p => self.check_p2p(&desc.legs, &watch),
                _ => self.check_descriptor(desc, &watch),
            };
            match checked {
                Ok(Ok(())) => {}
                Ok(Err(mismatch)) => return Err(mismatch),
                Err(fault) => return Err(self.fail(fault)),
            }
        }
        op(self, &watch).map_err(|e| self.fail(e))
    }

    /// When an operation started now must have finished: after the group's timeout, or
    /// sooner once the group has been dropped.
    fn deadline(&self) -> Instant {
        let own = crate::group::deadline_after(self.shared.timeout);
        match *self
            .shared
            .closing
            .lock()
            .unwrap_or_else(|p| p.into_inner())
        {
            Some(closing) => own.min(closing),
            None => own,
        }
    }

    /// Aborts the communicator if `NcclGroup::abort` asked for it.
    fn check_stop(&mut self) {
        if self.shared.stop.load(Ordering::Acquire) && self.comm.is_some() {
            self.fail(Error::Aborted {
                op: None,
                rank: Some(self.shared.rank),
            });
        }
    }

    /// Aborts the communicator and remembers why (the first cause wins); returns the
    /// error for the operation that failed.
    fn fail(&mut self, error: Error) -> Error {
        if let Some(mut comm) = self.comm.take() {
            comm.abort();
        }
        if self.failure.is_none() {
            self.failure = Some(error.clone());
            *self.shared.failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(error.clone());
            tracing::warn!("NCCL group of rank {} failed: {error}", self.shared.rank);
        }
        error
    }

    /// The live communicator.
    fn comm(&self) -> Result<&Comm> {
        self.comm.as_ref().ok_or_else(|| {
            self.failure.clone().unwrap_or_else(|| Error::Gone {
                what: "the NCCL communicator is gone".into(),
            })
        })
    }

    /// Issues one NCCL call on the communicator and the group's stream. A non-blocking
    /// communicator may answer `ncclInProgress` (connections still being set up); the
    /// call is then on the stream only once the communicator's state says so, which this
    /// waits for.
    pub fn issue(
        &self,
        watch: &Watch<'_>,
        name: &str,
        call: impl FnOnce(
            sys::ncclComm_t,
            sys::cudaStream_t,
        ) -> Result<result::NcclStatus, result::NcclError>,
    ) -> Result<()> {
        let comm = self.comm()?;
        let stream: sys::cudaStream_t = self.stream.cu_stream().cast();
        match call(comm.raw(), stream) {
            Ok(result::NcclStatus::InProgress) => watch.poll(|| comm.ready(watch.what)),
            Ok(_) => Ok(()),
            Err(e) => Err(comm::nccl_error(name, e)),
        }
    }

    /// Runs `body`'s NCCL calls as one group (`ncclGroupStart` / `ncclGroupEnd`), so that
    /// NCCL fuses them; the group is closed even if `body` fails.
    pub fn grouped(
        &self,
        watch: &Watch<'_>,
        body: impl FnOnce(&Engine) -> Result<()>,
    ) -> Result<()> {
        result::group_start().map_err(|e| comm::nccl_error("ncclGroupStart", e))?;
        let issued = body(self);
        let ended = result::group_end();
        issued?;
        match ended {
            Ok(result::NcclStatus::InProgress) => {
                let comm = self.comm()?;
                watch.poll(|| comm.ready(watch.what))
            }
            Ok(_) => Ok(()),
            Err(e) => Err(comm::nccl_error("ncclGroupEnd", e)),
        }
    }

    /// Waits until everything issued on the stream so far has completed, polling the
    /// communicator's asynchronous error, up to the watch's deadline.
    pub fn finish(&self, watch: &Watch<'_>) -> Result<()> {
        self.event
            .record(&self.stream)
            .map_err(driver("recording the completion event"))?;
        let comm = self.comm()?;
        watch.poll(|| {
            if self
                .event
                .try_is_complete()
                .map_err(driver("waiting for the group's stream"))?
            {
                return Ok(true);
            }
            // `Ok(false)` (still in progress) is not expected here and harmless.
            comm.ready(watch.what).map(|_| false)
        })
    }

    /// Drops a caller's device buffer after a failed operation. Its own stream first waits
    /// for the group's stream, so that its memory is not freed under a kernel that may
    /// still run (cudarc frees a buffer on its own stream).
    pub fn release<T>(&self, buf: CudaSlice<T>) {
        if **buf.stream() != *self.stream {
            if let Err(e) = buf.stream().join(&self.stream) {
                // Unordered, the free could run under a kernel that still uses the
                // memory: leak the buffer instead (the context is broken anyway).
                tracing::warn!(
                    "ordering a buffer's release after the NCCL stream failed ({e:?}); \
                     its {} elements are leaked",
                    buf.len()
                );
                std::mem::forget(buf);
                return;
            }
        }
        drop(buf);
    }

    /// Makes the group's stream wait for the work already queued on `other` (the stream
    /// of a caller's device buffer).
    pub fn follow(&self, other: &CudaStream) -> Result<()> {
        if *other != *self.stream {
            self.stream
                .join(other)
                .map_err(driver("ordering the NCCL stream after the buffer's stream"))?;
        }
        Ok(())
    }

    /// Debug mode: all-gathers every rank's descriptor and compares. The outer error is a
    /// fault of the communicator, the inner one a mismatch.
    fn check_descriptor(&self, desc: &Desc, watch: &Watch<'_>) -> Result<Result<()>> {
        let mine = desc.encode();
        let send = self
            .stream
            .clone_htod(&mine[..])
            .map_err(driver("uploading the debug descriptor"))?;
        let mut recv = self
            .stream
            .alloc_zeros::<u64>(debug::WORDS * self.shared.size)
            .map_err(driver("allocating the debug descriptors"))?;
        {
            use cudarc::driver::{DevicePtr, DevicePtrMut};
            let (src, _read) = send.device_ptr(&self.stream);
            let (dst, _write) = recv.device_ptr_mut(&self.stream);
            self.issue(
                watch,
                "ncclAllGather (debug descriptors)",
                |comm, stream| {
                    // SAFETY: `src` holds WORDS u64s and `dst` WORDS * size, both on this
                    // device and alive until the stream has finished with them (`finish`
                    // below); the communicator and stream are live.
                    unsafe {
                        result::all_gather(
                            src as *const _,
                            dst as *mut _,
                            debug::WORDS,
                            sys::ncclDataType_t::ncclUint64,
                            comm,
                            stream,
                        )
                    }
                },
            )?;
        }
        self.finish(watch)?;
        let mut all = vec![0u64; debug::WORDS * self.shared.size];
        self.stream
            .memcpy_dtoh(&recv, &mut all[..])
            .map_err(driver("downloading the debug descriptors"))?;
        self.finish(watch)?;
        Ok(debug::compare(self.shared.rank, &all))
    }

    /// Splits the communicator (every rank of the group calls this): a member gets its
    /// communicator of the new group, to hand to the new group's progress thread.
    pub fn split(&self, key: Option<usize>, watch: &Watch<'_>) -> Result<Option<Detached>> {
        Ok(self.comm()?.split(key, watch)?.map(Detached))
    }
}

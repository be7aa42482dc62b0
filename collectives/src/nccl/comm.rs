//! The raw NCCL communicator, on cudarc's `result` and `sys` layers: library checks,
//! unique ids, non-blocking creation and splitting, bounded polling, and a `Drop` that
//! aborts and never panics.
//!
//! cudarc's safe `Comm` is not used: it has no abort, creates blocking communicators and
//! unwraps the abort result in its `Drop`.

use crate::{Error, Result};
use cudarc::nccl::{result, sys};
use std::any::Any;
use std::ffi::{c_char, c_int, CStr};
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Bytes of an NCCL unique id (`NCCL_UNIQUE_ID_BYTES`).
const ID_BYTES: usize = 128;

/// `NCCL_VERSION(2, 30, 0)`: the NCCL release whose `ncclConfig_t` layout cudarc 0.19's
/// bindings (feature `nccl-02030`) carry. NCCL reads `min(size, its own size)` bytes of the
/// config and fills fields newer than `version` with defaults, so this is right for older
/// and newer libraries alike as long as it names the layout of the struct we pass.
const CONFIG_VERSION: u32 = 23000;
/// `NCCL_CONFIG_INITIALIZER`'s magic number.
const CONFIG_MAGIC: u32 = 0xcafe_beef;
/// `NCCL_CONFIG_UNDEF_INT`: "let NCCL choose".
const UNDEF: c_int = c_int::MIN;
/// `NCCL_SPLIT_NOCOLOR`: this rank joins no communicator of the split.
const SPLIT_NOCOLOR: c_int = -1;
/// Non-blocking communicators need NCCL 2.14.
pub(super) const MIN_VERSION: u32 = 21400;
/// `ncclCommSplit` needs NCCL 2.18.
pub(super) const MIN_SPLIT_VERSION: u32 = 21800;

/// What a missing CUDA driver library is reported as.
pub(super) const MISSING_DRIVER: &str = "the CUDA driver library (libcuda.so) was not \
    found: install the NVIDIA driver or put libcuda.so on LD_LIBRARY_PATH";
/// What a missing NCCL library is reported as.
pub(super) const MISSING_NCCL: &str = "the NCCL library was not found: cudarc loads \
    `libnccl.so` (or `libnccl.so.13`), but the pip wheel nvidia-nccl-cu13 ships only \
    `libnccl.so.2`; link it, e.g. `ln -s <site-packages>/nvidia/nccl/lib/libnccl.so.2 \
    <dir>/libnccl.so`, and put `<dir>` on LD_LIBRARY_PATH";

/// Errors unless the NCCL and CUDA driver libraries can be loaded. cudarc panics on the
/// first call into a library it cannot load, so every entry point runs this first.
pub fn check_libraries() -> Result<()> {
    check_nccl()?;
    // SAFETY: `is_culib_present` only tries to `dlopen` each candidate file name and
    // closes it again; it calls nothing in the library.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(Error::Unavailable(MISSING_DRIVER.into()));
    }
    Ok(())
}

/// Errors unless the NCCL library can be loaded (enough for a unique id or the version).
fn check_nccl() -> Result<()> {
    // SAFETY: as in `check_libraries`.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::Unavailable(MISSING_NCCL.into()));
    }
    Ok(())
}

/// The loaded NCCL library's version code (`NCCL_VERSION_CODE`, e.g. 22805 for 2.28.5).
pub(super) fn version_code() -> Result<u32> {
    check_nccl()?;
    guarded("ncclGetVersion", || {
        let code = result::get_nccl_version().map_err(|e| nccl_error("ncclGetVersion", e))?;
        u32::try_from(code).map_err(|_| Error::Unavailable(format!("NCCL reports version {code}")))
    })
}

/// `"2.28.5"` from a version code.
pub(super) fn version_text(code: u32) -> String {
    format!("{}.{}.{}", code / 10000, code % 10000 / 100, code % 100)
}

/// Runs `f`, turning a panic inside cudarc (a symbol missing from an old library, one of
/// its `unwrap`s) into [`Error::Panicked`]. The panic message still reaches stderr through
/// the panic hook.
pub(super) fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        Err(Error::Panicked {
            what: format!(
                "{what} (inside cudarc: a CUDA or NCCL library too old for its bindings?)"
            ),
            message: Some(panic_text(payload.as_ref())),
        })
    })
}

/// The message of a panic payload.
pub(super) fn panic_text(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_owned()
    }
}

/// An NCCL call that failed. cudarc's `NcclError` prints only `NcclError`, so the code is
/// taken from it and described here.
pub(super) fn nccl_error(what: &str, e: result::NcclError) -> Error {
    Error::Nccl {
        op: what.into(),
        code: e.0 as i32,
        message: describe(e.0),
    }
}

/// A result code, NCCL's text for it, and NCCL's last error message (all after the
/// library was loaded by [`check_libraries`]).
fn describe(code: sys::ncclResult_t) -> String {
    // SAFETY: `ncclGetErrorString` returns a pointer to a static string for every code.
    let text = unsafe { sys::ncclGetErrorString(code) };
    // SAFETY: `ncclGetLastError` ignores its argument and returns NCCL's last-error
    // buffer, a NUL-terminated string that lives as long as the library.
    let last = unsafe { sys::ncclGetLastError(std::ptr::null_mut()) };
    let mut out = format!("{code:?}");
    if !text.is_null() {
        // SAFETY: non-null, NUL-terminated and static, as above.
        out += &format!(" ({})", unsafe { CStr::from_ptr(text) }.to_string_lossy());
    }
    if !last.is_null() {
        // SAFETY: as above.
        let last = unsafe { CStr::from_ptr(last) }.to_string_lossy();
        if !last.trim().is_empty() {
            out += &format!("; NCCL's last error: {}", last.trim());
        }
    }
    out
}

/// The unique id that names one NCCL communicator. Rank 0 creates it with
/// [`NcclId::new`] and sends its bytes ([`NcclId::as_bytes`]) to every other rank, which
/// rebuild it with [`NcclId::from_bytes`];
/// [`NcclGroup::from_store`](super::NcclGroup::from_store) does this through the
/// rendezvous store.
///
/// Creating the id starts NCCL's bootstrap listener in this process, so the process that
/// created it must live until every rank has joined.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclId {
    bytes: [u8; ID_BYTES],
}

impl NcclId {
    /// A fresh id (`ncclGetUniqueId`; needs the NCCL library, not a GPU). Errors:
    /// [`Error::Unavailable`] when the NCCL library is missing (the message says how to provide
    /// `libnccl.so`) or NCCL fails.
    pub fn new() -> Result<NcclId> {
        check_nccl()?;
        guarded("ncclGetUniqueId", || {
            let id = result::get_uniqueid().map_err(|e| nccl_error("ncclGetUniqueId", e))?;
            Ok(NcclId {
                bytes: id.internal.map(|c| c.to_ne_bytes()[0]),
            })
        })
    }

    /// The id from the bytes another rank sent. Errors: [`Error::InvalidArgument`] unless
    /// there are exactly 128 of them.
    pub fn from_bytes(bytes: &[u8]) -> Result<NcclId> {
        let bytes = <[u8; ID_BYTES]>::try_from(bytes).map_err(|_| {
            Error::InvalidArgument(format!(
                "an NCCL unique id has {ID_BYTES} bytes, got {}",
                bytes.len()
            ))
        })?;
        Ok(NcclId { bytes })
    }

    /// The id's 128 bytes, to send to the other ranks.
    pub fn as_bytes(&self) -> &[u8; ID_BYTES] {
        &self.bytes
    }

    fn to_raw(self) -> sys::ncclUniqueId {
        sys::ncclUniqueId {
            internal: self.bytes.map(|b| c_char::from_ne_bytes([b])),
        }
    }
}

impl fmt::Debug for NcclId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NcclId(")?;
        for b in &self.bytes[..8] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "..)")
    }
}

/// How long a wait may last and what ends it early: the bounded polling loop that every
/// wait on the progress thread goes through.
pub(super) struct Watch<'a> {
    /// What is waited for, for the error messages.
    pub what: &'a str,
    /// When the wait fails with [`Error::Timeout`].
    pub until: Instant,
    /// The group's timeout, reported in that error.
    pub timeout: Duration,
    /// Set when the group is being aborted; ends the wait with an error.
    pub stop: &'a AtomicBool,
}

impl Watch<'_> {
    /// Calls `ready` until it returns `true`, spinning briefly, then sleeping in short
    /// steps. Fails with `ready`'s error, [`Error::Timeout`] at `until`, or
    /// [`Error::Aborted`] once `stop` is set.
    pub fn poll(&self, mut ready: impl FnMut() -> Result<bool>) -> Result<()> {
        let mut idle: u32 = 0;
        loop {
            if ready()? {
                return Ok(());
            }
            if self.stop.load(Ordering::Acquire) {
                return Err(Error::Aborted {
                    op: Some(self.what.to_string()),
                    rank: None,
                });
            }
            if Instant::now() >= self.until {
                return Err(Error::Timeout {
                    what: self.what.to_owned(),
                    after: self.timeout,
                    missing: Vec::new(),
                });
            }
            idle = idle.saturating_add(1);
            match idle {
                0..=63 => std::thread::yield_now(),
                64..=2047 => std::thread::sleep(Duration::from_micros(20)),
                _ => std::thread::sleep(Duration::from_micros(500)),
            }
        }
    }
}

/// `NCCL_CONFIG_INITIALIZER` with `blocking = 0`: every call returns at once (possibly
/// with `ncclInProgress`) and the state is polled with `ncclCommGetAsyncError`.
fn non_blocking_config() -> sys::ncclConfig_t {
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: CONFIG_MAGIC,
        version: CONFIG_VERSION,
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    }
}

/// A non-blocking NCCL communicator. The raw handle makes it neither `Send` nor `Sync`:
/// it lives on its group's progress thread (see [`Detached`] for the one hand-over).
pub(super) struct Comm {
    /// Where NCCL wrote the handle. Boxed because a non-blocking creation or split writes
    /// it from NCCL's own thread after the call returned; see [`Comm::forget`].
    slot: Box<sys::ncclComm_t>,
    /// Whether the handle is still to be aborted (false once aborted).
    live: bool,
}

/// How creating a communicator failed, and the half-made communicator to abort once the
/// caller has been told (aborting can take a while).
pub(super) struct InitFailure {
    pub error: Error,
    pub leftover: Option<Comm>,
}

impl Comm {
    /// `ncclCommInitRankConfig` for rank `rank` of `nranks`, non-blocking, then polls
    /// until the communicator is ready. The calling thread must have the device's context
    /// current (NCCL takes the device from it).
    pub fn init(
        nranks: usize,
        id: &NcclId,
        rank: usize,
        watch: &Watch<'_>,
    ) -> Result<Comm, InitFailure> {
        let fail = |error| InitFailure {
            error,
            leftover: None,
        };
        let n = c_int::try_from(nranks).map_err(|_| {
            fail(Error::InvalidArgument(format!(
                "{nranks} ranks are too many"
            )))
        })?;
        let r = c_int::try_from(rank)
            .map_err(|_| fail(Error::InvalidArgument(format!("rank {rank} is too large"))))?;
        let mut config = non_blocking_config();
        let mut comm = Comm {
            slot: Box::new(std::ptr::null_mut()),
            live: true,
        };
        // SAFETY: the slot and the config are valid for writes and reads during the call;
        // the slot stays allocated while NCCL's init thread may still write it (until the
        // communicator is ready, or aborted, which joins that thread); the id is a plain
        // 128-byte value.
        let started = unsafe {
            result::comm_init_rank_config(&mut *comm.slot, n, id.to_raw(), r, &mut config)
        };
        if let Err(e) = started {
            return Err(InitFailure {
                error: nccl_error("ncclCommInitRankConfig", e),
                leftover: Some(comm),
            });
        }
        match watch.poll(|| comm.ready(watch.what)) {
            Ok(()) => Ok(comm),
            Err(error) => Err(InitFailure {
                error,
                leftover: Some(comm),
            }),
        }
    }

    /// The handle, for NCCL calls.
    pub fn raw(&self) -> sys::ncclComm_t {
        *self.slot
    }

    /// The communicator's asynchronous state: `Ok(true)` when idle and healthy,
    /// `Ok(false)` while NCCL is still working on a non-blocking call, and the error it
    /// reported otherwise (the communicator must then be aborted).
    pub fn ready(&self, what: &str) -> Result<bool> {
        let raw = self.raw();
        if raw.is_null() || !self.live {
            return Err(Error::Gone {
                what: format!("{what}: the NCCL communicator is gone"),
            });
        }
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: `raw` is a live communicator (not yet aborted) and `state` is valid for
        // a write.
        let call = unsafe { sys::ncclCommGetAsyncError(raw, &mut state) };
        if call != sys::ncclResult_t::ncclSuccess {
            return Err(Error::Nccl {
                op: format!("{what}: ncclCommGetAsyncError"),
                code: call as i32,
                message: describe(call),
            });
        }
        match state {
            sys::ncclResult_t::ncclSuccess => Ok(true),
            sys::ncclResult_t::ncclInProgress => Ok(false),
            code => Err(Error::Nccl {
                op: format!("{what}: an asynchronous operation"),
                code: code as i32,
                message: describe(code),
            }),
        }
    }

    /// `ncclCommSplit`: a member (`Some(key)`, its rank in the new communicator) gets the
    /// new communicator, a non-member (`None`) gets `None`. Every rank of this
    /// communicator must call it.
    pub fn split(&self, key: Option<usize>, watch: &Watch<'_>) -> Result<Option<Comm>> {
        let (color, new_rank) = match key {
            Some(k) => (
                0,
                c_int::try_from(k)
                    .map_err(|_| Error::InvalidArgument(format!("rank {k} is too large")))?,
            ),
            None => (SPLIT_NOCOLOR, 0),
        };
        let mut config = non_blocking_config();
        let mut child = Comm {
            slot: Box::new(std::ptr::null_mut()),
            live: true,
        };
        // SAFETY: `self` is a live communicator; the slot and config are valid during the
        // call, and the slot stays allocated while NCCL's thread may write it (it is
        // forgotten, not freed, if the split does not finish).
        let started = unsafe {
            sys::ncclCommSplit(self.raw(), color, new_rank, &mut *child.slot, &mut config)
        }
        .result();
        if let Err(e) = started {
            child.forget();
            return Err(nccl_error("ncclCommSplit", e));
        }
        // A non-blocking split runs as a job of the parent: it is done when the parent's
        // state leaves ncclInProgress, and only then does NCCL write the new handle.
        if let Err(e) = watch.poll(|| self.ready(watch.what)) {
            child.forget();
            return Err(e);
        }
        match (key, child.raw().is_null()) {
            (None, true) => {
                child.live = false;
                Ok(None)
            }
            (Some(_), false) => {
                watch.poll(|| child.ready(watch.what))?;
                Ok(Some(child))
            }
            (None, false) => Err(Error::Internal(
                "ncclCommSplit gave a communicator to a rank that asked for none".into(),
            )),
            (Some(_), true) => {
                child.live = false;
                Err(Error::Internal(
                    "ncclCommSplit gave no communicator to a member rank".into(),
                ))
            }
        }
    }

    /// `ncclCommAbort`: stops the communicator's kernels and frees it, without waiting for
    /// peers. Idempotent; an error is logged, never raised (it runs in drops).
    pub fn abort(&mut self) {
        if !self.live {
            return;
        }
        self.live = false;
        let raw = self.raw();
        if raw.is_null() {
            return;
        }
        // SAFETY: `raw` is a communicator that has not been aborted yet (`live` was set),
        // and no other thread uses it.
        if let Err(e) = unsafe { result::comm_abort(raw) } {
            tracing::warn!("ncclCommAbort failed: {}", describe(e.0));
        }
    }

    /// Aborts a communicator whose creation failed, and leaks its 8-byte slot rather than
    /// trust that NCCL's init thread is done writing it.
    pub fn discard(mut self) {
        self.abort();
        self.forget();
    }

    /// Gives up on a communicator whose creation did not finish: NCCL's thread may still
    /// write its slot, so the 8-byte slot is leaked rather than freed, and the handle is
    /// not touched.
    fn forget(mut self) {
        self.live = false;
        Box::leak(std::mem::replace(
            &mut self.slot,
            Box::new(std::ptr::null_mut()),
        ));
        // Dropping `self` now aborts nothing (`live` is false) and frees the placeholder.
    }
}

impl Drop for Comm {
    /// Aborts rather than destroys: `ncclCommDestroy` may wait for peers, and by the time
    /// a group drops its communicator every operation it issued has completed or failed.
    fn drop(&mut self) {
        self.abort();
    }
}

/// A communicator handed from the thread that created it (the parent's progress
/// thread, in a split) to the thread that will own it.
pub(super) struct Detached(pub Comm);

// SAFETY: NCCL lets any one thread at a time use a communicator; the handle moves whole
// from the creating thread, which keeps no copy, to the new owner's thread, and `Comm`
// has no thread-affine state of its own.
unsafe impl Send for Detached {}

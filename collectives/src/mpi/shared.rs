//! What the progress engine's parts share (`progress.rs`, `job.rs`, `pt2pt.rs`): the ids
//! of communicators, the graveyard of abandoned operations, and the guard around
//! continuations. A leaf of the MPI backend: it imports only `raw`.

use super::raw::Request;
use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

/// A communicator of the progress thread, named by the group handles.
pub(super) type CommId = usize;

/// `MPI_COMM_WORLD`'s id.
pub(super) const WORLD: CommId = 0;

/// The longest shutdown waits for abandoned operations to complete.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Abandoned operations whose buffers MPI may still use: kept until their requests
/// complete (or forever).
pub(super) struct Graveyard {
    pub(super) graves: Vec<Grave>,
    pub(super) last_poll: Instant,
}

impl Default for Graveyard {
    fn default() -> Self {
        Graveyard {
            graves: Vec::new(),
            last_poll: Instant::now(),
        }
    }
}

pub(super) struct Grave {
    pub(super) requests: Vec<Request>,
    pub(super) bufs: Box<dyn Any>,
    /// How long shutdown waits for it.
    pub(super) deadline: Instant,
}

impl Graveyard {
    pub(super) fn bury(&mut self, requests: Vec<Request>, bufs: Box<dyn Any>, grace: Duration) {
        self.graves.push(Grave {
            requests,
            bufs,
            deadline: Instant::now() + grace.min(SHUTDOWN_GRACE),
        });
    }

    /// Tests the abandoned requests; frees the buffers of those that completed.
    pub(super) fn poll(&mut self) {
        self.last_poll = Instant::now();
        self.graves.retain_mut(|g| {
            // An error ends a request as surely as completion does.
            g.requests.retain_mut(|r| matches!(r.test(), Ok(false)));
            !g.requests.is_empty()
        });
    }
}

/// Runs `f` (which completes work, so runs continuations), containing a panic in one so
/// that it cannot take down the progress thread of every other operation.
pub(super) fn guarded<R>(what: &str, f: impl FnOnce() -> R) -> Option<R> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => Some(r),
        Err(_) => {
            tracing::error!("a continuation of {what} panicked");
            None
        }
    }
}

//! One order of collectives on every rank, for the hooks that issue a bucket's later
//! collectives from continuations (PowerSGD, the quantisation hooks).
//!
//! A PowerSGD bucket issues its last collective (the `Q` all-reduce) from a continuation,
//! on the process group's progress thread, while the caller may already be starting the
//! next bucket. Left alone, the two would reach the group in an order that depends on
//! timing, and ranks would disagree on which collective comes next (the thread backend
//! reports that as a mismatch; other backends may hang). The sequencer starts each
//! bucket's collectives only once the previous bucket has issued all of its own, so every
//! rank issues `U0 P0 Q0 U1 P1 Q1 ...`. The local work of a bucket (error feedback, `P =
//! X Q`) still runs at once on the caller's thread, overlapping earlier buckets'
//! communication. (PyTorch's hook has the same race on backends whose futures complete
//! on another thread, such as gloo.)

use collectives::{Completer, Work};
use std::sync::Mutex;

/// Chains each bucket's collectives after the previous bucket's.
#[derive(Default)]
pub(crate) struct Sequencer {
    last: Mutex<Option<Work<()>>>,
}

impl Sequencer {
    /// Runs `issue` once every earlier bucket has issued its collectives; `issue` must
    /// complete the `Completer` once it has issued its own last collective (dropping it
    /// also releases the next bucket).
    pub(crate) fn next<T: Send + 'static>(
        &self,
        issue: impl FnOnce(Completer<()>) -> Work<T> + Send + 'static,
    ) -> Work<T> {
        let (gate, issued) = Work::<()>::pending();
        let previous = self
            .last
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .replace(gate);
        match previous {
            None => issue(issued),
            Some(prev) => prev.then(|_| Ok(())).and_then(move |()| issue(issued)),
        }
    }
}

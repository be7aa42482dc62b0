//! Work handles: the result of an asynchronous collective.
//!
//! A collective returns a [`Work`] at once. [`Work::wait`] blocks until the operation has
//! finished and gives the buffer back; [`Work::then`] chains a continuation, as c10d's
//! futures do. Continuations run on the thread that completes the work, which is the
//! owning rank's own progress thread, or on the caller's thread if the work has already
//! completed: never on a peer rank's thread.

use crate::sync::{Arc, Condvar, Mutex, MutexGuard};
use crate::{Error, Result};
use std::time::Duration;
#[cfg(not(loom))]
use std::time::Instant;

type Continuation<T> = Box<dyn FnOnce(Result<T>) + Send>;

/// Both results of a [`Work::zip`] as they arrive, and the completer of the pair.
type ZipSlot<T, U> = (
    Option<Result<T>>,
    Option<Result<U>>,
    Option<Completer<(T, U)>>,
);

enum State<T> {
    Pending(Option<Continuation<T>>),
    Done(Result<T>),
    Taken,
}

struct Shared<T> {
    state: Mutex<State<T>>,
    ready: Condvar,
    /// The thread that will complete the work, where one single thread does (a thread
    /// group's worker): waiting on it from that thread would wait forever.
    owner: Option<std::thread::ThreadId>,
}

impl<T> Shared<T> {
    fn lock(&self) -> MutexGuard<'_, State<T>> {
        // A panic while holding this lock leaves a consistent state (each transition is
        // one assignment), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The handle of an operation in flight; completes with a value or an [`Error`].
#[must_use = "a Work does nothing unless waited on or chained"]
pub struct Work<T> {
    shared: Arc<Shared<T>>,
}

/// The producing side of a [`Work`]: the backend completes it exactly once. Dropping it
/// uncompleted completes the work with an error, so a waiter never hangs.
pub struct Completer<T> {
    shared: Option<Arc<Shared<T>>>,
}

impl<T: Send + 'static> Work<T> {
    /// A pending work and the completer that finishes it.
    pub fn pending() -> (Work<T>, Completer<T>) {
        Self::pending_on(None)
    }

    /// A pending work that only `owner` completes: [`wait`](Self::wait) on that thread
    /// fails at once instead of waiting for itself. Works chained from it
    /// ([`then`](Self::then)) have the same owner.
    pub(crate) fn pending_on(owner: Option<std::thread::ThreadId>) -> (Work<T>, Completer<T>) {
        let shared = Arc::new(Shared {
            state: Mutex::new(State::Pending(None)),
            ready: Condvar::new(),
            owner,
        });
        (
            Work {
                shared: shared.clone(),
            },
            Completer {
                shared: Some(shared),
            },
        )
    }

    /// A work that has already completed with `result`.
    pub fn ready(result: Result<T>) -> Work<T> {
        Work {
            shared: Arc::new(Shared {
                state: Mutex::new(State::Done(result)),
                ready: Condvar::new(),
                owner: None,
            }),
        }
    }

    /// Whether the operation has finished (successfully or not).
    pub fn is_completed(&self) -> bool {
        matches!(*self.shared.lock(), State::Done(_))
    }

    /// Blocks until the operation finishes and returns its result. Backends bound every
    /// operation by their group's timeout, so this returns within it. Waiting, from a
    /// continuation, on an operation that only this thread can complete (a thread
    /// group's operation issued after the one whose continuation runs) fails at once
    /// with [`Error::InvalidArgument`]: it would wait for itself. Chain it with
    /// [`and_then`](Self::and_then) instead.
    pub fn wait(self) -> Result<T> {
        let mut st = self.shared.lock();
        loop {
            match std::mem::replace(&mut *st, State::Taken) {
                State::Done(r) => return r,
                pending => *st = pending,
            }
            if let Some(e) = self.waits_for_itself() {
                return Err(e);
            }
            st = self
                .shared
                .ready
                .wait(st)
                .unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Like [`wait`](Self::wait), but gives up after `timeout` with [`Error::Timeout`]
    /// (the operation itself carries on; its result is dropped). A timeout too long for
    /// the clock (`Duration::MAX`) means no timeout.
    pub fn wait_timeout(self, timeout: Duration) -> Result<T> {
        #[cfg(loom)]
        {
            // Loom has no clock: a timed wait is a wait.
            let _ = timeout;
            self.wait()
        }
        #[cfg(not(loom))]
        self.wait_deadline(timeout)
    }

    /// The error of a wait on the thread that must complete this pending work.
    fn waits_for_itself(&self) -> Option<Error> {
        #[cfg(loom)]
        return None;
        #[cfg(not(loom))]
        (self.shared.owner == Some(std::thread::current().id())).then(|| {
            Error::InvalidArgument(
                "waiting, on a process group's own thread (in a continuation), for an \
                 operation that only that thread can run would wait forever: chain it \
                 with `and_then` instead of waiting"
                    .into(),
            )
        })
    }

    #[cfg(not(loom))]
    fn wait_deadline(self, timeout: Duration) -> Result<T> {
        let deadline = crate::group::deadline_after(timeout);
        let mut st = self.shared.lock();
        loop {
            match std::mem::replace(&mut *st, State::Taken) {
                State::Done(r) => return r,
                pending => *st = pending,
            }
            if let Some(e) = self.waits_for_itself() {
                return Err(e);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    what: "waiting for a work handle".into(),
                    after: timeout,
                    missing: Vec::new(),
                });
            }
            st = self
                .shared
                .ready
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Chains `f` to run with this work's result; returns the work of `f`'s result. `f`
    /// runs on the completing thread (the owning rank's progress thread), or at once on
    /// this thread if the work has already completed.
    pub fn then<U: Send + 'static>(
        self,
        f: impl FnOnce(Result<T>) -> Result<U> + Send + 'static,
    ) -> Work<U> {
        let (next, completer) = Work::pending_on(self.shared.owner);
        let mut st = self.shared.lock();
        match std::mem::replace(&mut *st, State::Taken) {
            State::Done(r) => {
                drop(st);
                completer.complete(f(r));
            }
            State::Pending(_) => {
                *st = State::Pending(Some(Box::new(move |r| completer.complete(f(r)))));
            }
            State::Taken => completer.complete(Err(Error::InvalidArgument(
                "work result already taken".into(),
            ))),
        }
        next
    }
}

impl<T: Send + 'static> Work<T> {
    /// Chains an operation that itself returns work (for example, issuing the next
    /// collective of a pipeline from a continuation, which must not block the progress
    /// thread that will run it). The result completes when the inner work does.
    pub fn and_then<U: Send + 'static>(
        self,
        f: impl FnOnce(T) -> Work<U> + Send + 'static,
    ) -> Work<U> {
        let (outer, completer) = Work::pending();
        drop(self.then(move |r| {
            match r {
                Ok(v) => drop(f(v).then(move |u| {
                    completer.complete(u);
                    Ok(())
                })),
                Err(e) => completer.complete(Err(e)),
            }
            Ok(())
        }));
        outer
    }

    /// Completes when both works have completed, with both values (or the first error),
    /// without blocking any thread.
    pub fn zip<U: Send + 'static>(self, other: Work<U>) -> Work<(T, U)> {
        let (out, completer) = Work::pending();
        let slot: Arc<Mutex<ZipSlot<T, U>>> = Arc::new(Mutex::new((None, None, Some(completer))));
        fn finish<T: Send + 'static, U: Send + 'static>(st: &mut ZipSlot<T, U>) {
            if st.0.is_some() && st.1.is_some() {
                if let (Some(a), Some(b), Some(c)) = (st.0.take(), st.1.take(), st.2.take()) {
                    c.complete(a.and_then(|a| b.map(|b| (a, b))));
                }
            }
        }
        let s1 = slot.clone();
        drop(self.then(move |r| {
            let mut st = s1.lock().unwrap_or_else(|p| p.into_inner());
            st.0 = Some(r);
            finish(&mut st);
            Ok(())
        }));
        drop(other.then(move |r| {
            let mut st = slot.lock().unwrap_or_else(|p| p.into_inner());
            st.1 = Some(r);
            finish(&mut st);
            Ok(())
        }));
        out
    }
}

impl<T: Send + 'static> Completer<T> {
    /// Completes the work; runs a chained continuation, if any, on this thread.
    pub fn complete(mut self, result: Result<T>) {
        if let Some(shared) = self.shared.take() {
            Self::finish(&shared, result);
        }
    }

    /// Completes the work from a thread that is not its owner's (a peer's, matching a
    /// point-to-point message): a waiter wakes at once, and a continuation chained to the
    /// work, if any, is handed to `run` (the owning rank's queue) instead of running on
    /// this thread. A job that `run` drops unrun fails the works chained from it.
    pub(crate) fn complete_from_afar(
        mut self,
        result: Result<T>,
        run: impl FnOnce(Box<dyn FnOnce() + Send>),
    ) {
        let Some(shared) = self.shared.take() else {
            return;
        };
        let mut st = shared.lock();
        match std::mem::replace(&mut *st, State::Taken) {
            State::Pending(Some(cont)) => {
                drop(st);
                run(Box::new(move || cont(result)));
            }
            _ => {
                *st = State::Done(result);
                shared.ready.notify_all();
            }
        }
    }

    fn finish(shared: &Shared<T>, result: Result<T>) {
        let mut st = shared.lock();
        match std::mem::replace(&mut *st, State::Taken) {
            State::Pending(Some(cont)) => {
                drop(st);
                cont(result);
            }
            _ => {
                *st = State::Done(result);
                shared.ready.notify_all();
            }
        }
    }
}

impl<T> Drop for Completer<T> {
    fn drop(&mut self) {
        if let Some(shared) = self.shared.take() {
            let mut st = shared.lock();
            if let State::Pending(cont) = std::mem::replace(&mut *st, State::Taken) {
                let err = Error::Abandoned;
                match cont {
                    // Dropped while its thread unwinds (the job panicked): a continuation
                    // that panicked in turn would abort the process, so it is dropped
                    // unrun; the completers it holds fail the works chained from it.
                    Some(cont) if std::thread::panicking() => {
                        drop(st);
                        drop(cont);
                    }
                    Some(cont) => {
                        drop(st);
                        cont(Err(err));
                    }
                    None => {
                        *st = State::Done(Err(err));
                        shared.ready.notify_all();
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_then_and_timeout() {
        let (w, c) = Work::<u32>::pending();
        assert!(!w.is_completed());
        let chained = w.then(|r| r.map(|v| v + 1));
        let t = std::thread::spawn(move || c.complete(Ok(41)));
        assert_eq!(chained.wait().unwrap(), 42);
        t.join().unwrap();

        let (w, _c) = Work::<u32>::pending();
        assert!(matches!(
            w.wait_timeout(Duration::from_millis(20)),
            Err(Error::Timeout { .. })
        ));

        let w = Work::ready(Ok(3));
        assert!(w.is_completed());
        assert_eq!(w.then(|r| r.map(|v| v * 2)).wait().unwrap(), 6);
    }

    /// A completer dropped while its thread unwinds (a job that panicked) fails the works
    /// chained from it without running their continuations: one that panicked in turn
    /// would abort the process.
    #[test]
    fn a_completer_dropped_in_a_panic_fails_the_chain_without_running_it() {
        let (w, c) = Work::<u32>::pending();
        let chained = w
            .then(|_: Result<u32>| -> Result<u32> { panic!("a continuation that panics") })
            .then(|r| r.map(|v| v + 1));
        let job = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let _completer = c;
            panic!("the job panics before completing");
        }));
        assert!(job.is_err());
        assert!(matches!(chained.wait(), Err(Error::Abandoned)));
    }

    #[test]
    fn and_then_and_zip() {
        let (a, ca) = Work::<u32>::pending();
        let (b, cb) = Work::<u32>::pending();
        let chained = a.and_then(|v| Work::ready(Ok(v * 10)));
        let both = chained.zip(b);
        assert!(!both.is_completed());
        cb.complete(Ok(2));
        assert!(!both.is_completed());
        ca.complete(Ok(4));
        assert_eq!(both.wait().unwrap(), (40, 2));
        let (a, ca) = Work::<u32>::pending();
        let failed = a.zip(Work::ready(Ok(1u32)));
        ca.complete(Err(Error::Mismatch("x".into())));
        assert!(matches!(failed.wait(), Err(Error::Mismatch(_))));
    }

    #[test]
    fn dropped_completer_fails_the_work() {
        let (w, c) = Work::<u32>::pending();
        drop(c);
        assert!(matches!(w.wait(), Err(Error::Abandoned)));
    }
}

/// Loom models of completion racing with `wait` and `then` (`cargo xtask loom`).
#[cfg(all(test, loom))]
mod loom_model {
    use super::*;

    /// A completion on another thread races a `wait`: the waiter always gets the value.
    #[test]
    fn complete_races_wait() {
        loom::model(|| {
            let (w, c) = Work::<u32>::pending();
            let t = loom::thread::spawn(move || c.complete(Ok(7)));
            assert_eq!(w.wait().unwrap(), 7);
            t.join().unwrap();
        });
    }

    /// A completion races the registration of a continuation: the continuation runs
    /// exactly once, with the value, whichever comes first.
    #[test]
    fn complete_races_then() {
        loom::model(|| {
            let (w, c) = Work::<u32>::pending();
            let t = loom::thread::spawn(move || c.complete(Ok(1)));
            let chained = w.then(|r| r.map(|v| v + 1));
            assert_eq!(chained.wait().unwrap(), 2);
            t.join().unwrap();
        });
    }

    /// A completer dropped on another thread fails the waiter instead of hanging it.
    #[test]
    fn dropped_completer_fails_the_waiter() {
        loom::model(|| {
            let (w, c) = Work::<u32>::pending();
            let t = loom::thread::spawn(move || drop(c));
            assert!(w.wait().is_err());
            t.join().unwrap();
        });
    }
}

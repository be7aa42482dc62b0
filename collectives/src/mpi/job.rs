//! What the progress thread runs: the jobs a group handle sends it ([`Job`], [`Op`],
//! [`Action`]) and the collectives they start, in one stage ([`collective`]) or several
//! ([`staged`]), with the buffers and requests a started one leaves in flight
//! ([`Running`]). The progress thread itself (`progress.rs`) starts, tests, completes and
//! abandons them.

use super::debug::Desc;
use super::raw::Request;
use crate::{Completer, Error, Result};
use mpi::topology::SimpleCommunicator;
use std::any::Any;
use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

pub(super) use super::shared::{CommId, WORLD};

/// Starts a collective on a communicator and returns what it left in flight; given an
/// error instead, fails the operation's work without communicating.
pub(super) type Start = Box<dyn FnOnce(Result<&SimpleCommunicator>) -> Option<Running> + Send>;

/// What a group handle asks of the progress thread.
pub(super) enum Job {
    /// Run an operation.
    Op(Op),
    /// A point-to-point operation (outside the order of collectives).
    P2p(super::pt2pt::P2pJob),
    /// A group handle was dropped: free its communicator once its operations are started.
    Free(CommId),
}

/// One operation, as issued.
pub(super) struct Op {
    /// The communicator.
    pub comm: CommId,
    /// What every rank must issue at this position.
    pub desc: Desc,
    /// Whether to compare descriptors across ranks first (debug mode).
    pub check: bool,
    /// The bound on the whole operation, from the moment the progress thread takes it.
    pub timeout: Duration,
    /// What to do.
    pub action: Action,
}

/// The work of an [`Op`].
pub(super) enum Action {
    /// A non-blocking collective.
    Collective(Start),
    /// Split the communicator: the ranks listed (in that order) get a new one. Always
    /// preceded by a descriptor check, so the blocking `MPI_Comm_split` starts only once
    /// every rank has agreed to it.
    Split {
        ranks: Vec<usize>,
        done: Completer<Option<Joined>>,
    },
}

/// This rank's place in a new communicator.
pub(super) struct Joined {
    pub comm: CommId,
    pub rank: usize,
    pub size: usize,
}

impl Action {
    /// Fails the operation's work (or its split) with `e`, without communicating.
    pub(super) fn fail(self, e: Error) {
        match self {
            Action::Collective(start) => drop(start(Err(e))),
            Action::Split { done, .. } => done.complete(Err(e)),
        }
    }
}

/// Completes an operation's work from its buffers (or an error).
pub(super) type Finish = Box<dyn FnOnce(Result<Box<dyn Any>>)>;

/// A later stage of a staged collective, on its buffers (type-erased).
pub(super) type Step =
    Box<dyn FnOnce(&SimpleCommunicator, &mut dyn Any, &mut Vec<Request>) -> Result<()>>;

/// One stage of a collective on buffers `B`: local work on them, then the requests it
/// starts (pushed as each starts).
pub(super) type Stage<B> =
    Box<dyn FnOnce(&SimpleCommunicator, &mut B, &mut Vec<Request>) -> Result<()> + Send>;

/// A collective whose MPI requests are in flight, with the buffers they use.
pub(super) struct Running {
    pub(super) requests: Vec<Request>,
    /// The stages still to start, each once every request before it has completed.
    pub(super) steps: VecDeque<Step>,
    /// An error from starting it after some requests had started.
    pub(super) error: Option<Error>,
    /// The buffers MPI reads and writes: kept apart from `finish` so that they can outlive
    /// the work when the operation is abandoned.
    pub(super) bufs: Box<dyn Any>,
    /// Completes the work from the buffers, or with the error.
    pub(super) finish: Finish,
    pub(super) what: String,
}

/// A collective on prepared buffers: `start` issues its requests (pushing each as soon
/// as it has started), `finish` turns the buffers into the work's value once MPI is done
/// with them. The buffers stay alive until every request has completed, or forever.
pub(super) fn collective<B, T>(
    done: Completer<T>,
    bufs: B,
    start: impl FnOnce(&SimpleCommunicator, &mut B, &mut Vec<Request>) -> Result<()> + Send + 'static,
    finish: impl FnOnce(B) -> Result<T> + Send + 'static,
) -> Start
where
    B: Send + 'static,
    T: Send + 'static,
{
    staged(done, bufs, vec![Box::new(start)], finish)
}

/// A collective in stages on prepared buffers: each stage runs once every request of the
/// stages before has completed (at once if they started none), and `finish` turns the
/// buffers into the work's value after the last. One deadline bounds them all. A stage
/// that fails after an earlier one started requests leaves this rank out of step with
/// its peers (they go on to the next stage), so its communicator is then broken, as after
/// a timeout: the peers' operation times out, and every later one fails at once.
pub(super) fn staged<B, T>(
    done: Completer<T>,
    bufs: B,
    stages: Vec<Stage<B>>,
    finish: impl FnOnce(B) -> Result<T> + Send + 'static,
) -> Start
where
    B: Send + 'static,
    T: Send + 'static,
{
    Box::new(move |comm| {
        let comm = match comm {
            Ok(comm) => comm,
            Err(e) => {
                done.complete(Err(e));
                return None;
            }
        };
        let mut bufs = bufs;
        let mut requests = Vec::new();
        let mut stages = VecDeque::from(stages);
        let mut error = None;
        // The first stages that start no requests (nothing to send: one rank) run now.
        while requests.is_empty() {
            let Some(stage) = stages.pop_front() else {
                break;
            };
            // A stage that panics after starting a request must not unwind past `bufs`
            // and `requests`: MPI would go on writing into freed memory. Caught here, the
            // panic is an error and both stay in the `Running` below until MPI is done
            // with them, as a later stage's panic is (see `Engine::poll`).
            let ran = catch_unwind(AssertUnwindSafe(|| stage(comm, &mut bufs, &mut requests)))
                .unwrap_or_else(|_| {
                    Err(Error::Panicked {
                        what: "a stage of an MPI collective".into(),
                        message: None,
                    })
                });
            if let Err(e) = ran {
                // The stages left stay with the `Running` (if requests started): when
                // those complete, stages left unstarted break the communicator, since
                // the peers go on to them.
                error = Some(e);
                break;
            }
        }
        if requests.is_empty() {
            done.complete(match error {
                Some(e) => Err(e),
                None => finish(bufs),
            });
            return None;
        }
        let steps = stages
            .into_iter()
            .map(|stage| {
                Box::new(
                    move |comm: &SimpleCommunicator,
                          bufs: &mut dyn Any,
                          requests: &mut Vec<Request>| {
                        let bufs = bufs
                            .downcast_mut::<B>()
                            .ok_or_else(|| Error::Internal("a stage lost its buffers".into()))?;
                        stage(comm, bufs, requests)
                    },
                ) as Step
            })
            .collect();
        Some(Running {
            requests,
            steps,
            error,
            bufs: Box::new(bufs),
            finish: Box::new(move |r: Result<Box<dyn Any>>| {
                let value = r.and_then(|b| {
                    b.downcast::<B>()
                        .map_err(|_| Error::Internal("an operation lost its buffers".into()))
                        .and_then(|b| finish(*b))
                });
                done.complete(value);
            }),
            what: String::new(),
        })
    })
}

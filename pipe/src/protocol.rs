//! What the executor and its workers exchange: the stages handed to a run
//! ([`StageSlot`]), the settings every worker reads ([`Common`]), the messages between
//! workers ([`Msg`]), the state they share ([`Shared`]: stop flag, first failure, inboxes),
//! and the callbacks they run ([`LossFn`], [`FinalHook`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use skip::Tracker;

use crate::error::Error;
use crate::layer::Layer;
use crate::memory::Memory;
use crate::message::Msg;
use crate::microbatch::{Batch, MicroBatch};
use crate::portal::SkipPlan;
use crate::ranks::Ranks;
use crate::schedule::Schedule;
use crate::stage::Kept;
use crate::vocab::Device;

/// The loss of a [`Pipe::step`](crate::Pipe::step), as the executor calls it: the output
/// gradient of one micro-batch from its output.
pub(crate) type LossFn<'a, T> =
    dyn FnMut(MicroBatch, &Batch<T>) -> Result<Batch<T>, Error> + Send + 'a;

/// A callback run on a stage's worker right after the stage's last backward action.
pub(crate) type FinalHook<T> = dyn Fn(usize, &mut [Box<dyn Layer<T>>]) + Send + Sync;

/// Per micro-batch, a stage's skip tracker (absent where it has no skip layers or the
/// micro-batch has not reached it).
pub(crate) type Trackers<T> = Vec<Option<Box<Tracker<T>>>>;

/// A stage as the executor receives it.
pub(crate) struct StageSlot<'a, T> {
    pub layers: &'a mut [Box<dyn Layer<T>>],
    /// Global index of its first layer.
    pub first_layer: usize,
    pub device: Device,
    /// Per micro-batch, what an earlier run kept (for a backward-only run); all `None`
    /// otherwise.
    pub kept: Vec<Option<Kept<T>>>,
    /// Per micro-batch, the skip trackers an earlier run left (for a backward-only run).
    pub trackers: Trackers<T>,
    pub memory: Memory,
}

/// The run's settings every worker reads.
pub(crate) struct Common<'a> {
    pub schedule: &'a Schedule,
    pub devices: Vec<Device>,
    pub micro_batches: &'a [MicroBatch],
    pub train: bool,
    pub seed: u64,
    pub step: u64,
    pub checkpoint_stop: usize,
    pub defer_weight_grads: bool,
    pub timeout: Duration,
    pub record: Option<Instant>,
    pub skips: &'a SkipPlan,
}

/// The state all workers share: the stop flag, the first failure, everyone's inbox, and
/// for a pipe on ranks, the other ranks.
pub(crate) struct Shared<T> {
    stop: AtomicBool,
    failure: Mutex<Option<Error>>,
    pub senders: Vec<Sender<Msg<T>>>,
    pub ranks: Option<Arc<Ranks<T>>>,
}

impl<T> Shared<T> {
    /// No failure yet, every worker's inbox by worker index.
    pub fn new(senders: Vec<Sender<Msg<T>>>, ranks: Option<Arc<Ranks<T>>>) -> Self {
        Shared {
            stop: AtomicBool::new(false),
            failure: Mutex::new(None),
            senders,
            ranks,
        }
    }

    pub fn stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    /// Records the first failure, raises the stop flag and wakes every worker. On ranks,
    /// a first failure of this rank's own is sent to every other rank at once.
    pub fn fail(&self, error: Error) {
        {
            let mut failure = self.failure.lock().unwrap_or_else(|p| p.into_inner());
            if failure.is_none() {
                if let Some(ranks) = &self.ranks {
                    if !matches!(error, Error::Remote { .. }) {
                        ranks.abort_peers(&error);
                    }
                }
                *failure = Some(error);
            }
        }
        self.stop.store(true, Ordering::Release);
        for sender in &self.senders {
            // A worker that has already returned has dropped its inbox; nothing to wake.
            let _ = sender.send(Msg::Abort);
        }
    }

    pub fn take_failure(&self) -> Option<Error> {
        self.failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }
}

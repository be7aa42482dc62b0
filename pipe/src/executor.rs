//! The executor: runs any valid [`Schedule`], one scoped thread per worker, dataflow
//! between them over channels.
//!
//! Guarantees, each with a test in `tests/failure.rs` or `tests/dataflow.rs`:
//! - A worker waits only for the data its next action needs; every wait is bounded by the
//!   pipe's timeout, after which it fails with [`Error::Timeout`].
//! - The first failure (a layer's error or panic, the loss's, a timeout) sets a stop flag
//!   and wakes every worker: no worker starts an action after it has seen the flag, and
//!   waiting workers return at once.
//! - Every worker thread is joined before the run returns (scoped threads): none is left
//!   behind, whatever failed. The price: a layer that never returns cannot be interrupted;
//!   its neighbours time out and stop, and the run returns when that layer does.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use skip::{Moves, Tracker};

use crate::checkpoint::{panic_message, Kept};
use crate::error::Error;
use crate::layer::Layer;
use crate::microbatch::{Batch, MicroBatch};
use crate::portal::{held_bytes, SkipPlan};
use crate::record::Span;
use crate::schedule::Schedule;
use crate::tensor::{Device, Tensor};
use crate::worker::{Hosted, Worker};

/// The loss of a [`Pipe::step`](crate::Pipe::step), as the executor calls it: the output
/// gradient of one micro-batch from its output.
pub(crate) type LossFn<'a, T> =
    dyn FnMut(MicroBatch, &Batch<T>) -> Result<Batch<T>, Error> + Send + 'a;

/// A callback run on a stage's worker right after the stage's last backward action.
pub(crate) type FinalHook<T> = dyn Fn(usize, &mut [Box<dyn Layer<T>>]) + Send + Sync;

/// Bytes a partition holds between forward and backward passes: saved states, the inputs
/// of checkpointed micro-batches, and skip values and gradients waiting in its trackers.
/// Counted through [`Tensor::size_bytes`] at action boundaries and when a skip arrives.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Memory {
    /// Held now (skips included).
    pub held: usize,
    /// The most held at once since the pending forward began (or the last step began).
    pub peak: usize,
    /// Of `held`, the bytes of skip values and gradients in the partition's trackers:
    /// a value waits there from its arrival until it is popped (under checkpointing, until
    /// the recomputation pops it again), a gradient until it is sent back or taken.
    pub skips: usize,
    /// Of `held`, the bytes the partition's layers keep for deferred weight gradients
    /// ([`Layer::deferred_bytes`]) from a backward action until the partition's last one
    /// of the run ([`PipeBuilder::defer_weight_grads`](crate::PipeBuilder::defer_weight_grads)).
    pub deferred: usize,
}

impl Memory {
    /// Adjusts the skip bytes from `old` to `new`, and the totals with them.
    pub(crate) fn set_skips(&mut self, old: usize, new: usize) {
        self.held = (self.held + new).saturating_sub(old);
        self.skips = (self.skips + new).saturating_sub(old);
        self.peak = self.peak.max(self.held);
    }

    /// Adjusts the deferred bytes to `now`, and the totals with them.
    pub(crate) fn set_deferred(&mut self, now: usize) {
        self.held = (self.held + now).saturating_sub(self.deferred);
        self.deferred = now;
        self.peak = self.peak.max(self.held);
    }
}

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

/// Everything one run needs.
pub(crate) struct Job<'a, 'l, T> {
    pub schedule: &'a Schedule,
    pub stages: Vec<StageSlot<'a, T>>,
    /// Stage 0's input per micro-batch (runs with forwards).
    pub inputs: Vec<Option<Batch<T>>>,
    /// The last stage's output gradient per micro-batch (runs without a loss).
    pub grads: Vec<Option<Batch<T>>>,
    pub loss: Option<&'a mut LossFn<'l, T>>,
    pub micro_batches: &'a [MicroBatch],
    pub train: bool,
    pub seed: u64,
    pub step: u64,
    pub checkpoint_stop: usize,
    /// Whether backward actions may defer weight gradients to the stage's last one.
    pub defer_weight_grads: bool,
    pub timeout: Duration,
    /// Record spans measured from this instant.
    pub record: Option<Instant>,
    pub on_final: Option<&'a FinalHook<T>>,
    pub skips: &'a SkipPlan,
}

/// What a successful run leaves.
pub(crate) struct Outcome<T> {
    /// The last stage's output per micro-batch.
    pub outputs: Vec<Option<Batch<T>>>,
    /// Stage 0's input gradient per micro-batch.
    pub input_grads: Vec<Option<Batch<T>>>,
    /// Per stage, per micro-batch, what is still kept for a later backward.
    pub kept: Vec<Vec<Option<Kept<T>>>>,
    /// Per stage, the skip trackers still needed by a later backward.
    pub trackers: Vec<Trackers<T>>,
    /// The skip moves of the trackers this run finished with.
    pub moves: Moves,
    pub memory: Vec<Memory>,
    pub spans: Vec<Vec<Span>>,
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

/// A message between workers.
pub(crate) enum Msg<T> {
    /// A stage's input for a micro-batch, from the previous stage.
    Activation {
        stage: usize,
        mb: usize,
        batch: Batch<T>,
    },
    /// A stage's output gradient for a micro-batch, from the next stage.
    Gradient {
        stage: usize,
        mb: usize,
        batch: Batch<T>,
    },
    /// A skip value (or the stash of nothing) for micro-batch `mb`, straight from the
    /// stashing stage to the popping `stage`, along `skips.routes[route]`.
    Skip {
        stage: usize,
        mb: usize,
        route: usize,
        value: Option<T>,
    },
    /// A skip's gradient (or none), back from the popping stage to the stashing `stage`.
    SkipGrad {
        stage: usize,
        mb: usize,
        route: usize,
        grad: Option<T>,
    },
    /// Stop: another worker failed.
    Abort,
}

/// The state all workers share: the stop flag, the first failure, everyone's inbox.
pub(crate) struct Shared<T> {
    stop: AtomicBool,
    failure: Mutex<Option<Error>>,
    pub senders: Vec<Sender<Msg<T>>>,
}

impl<T> Shared<T> {
    pub fn stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    /// Records the first failure, raises the stop flag and wakes every worker.
    pub fn fail(&self, error: Error) {
        {
            let mut failure = self.failure.lock().unwrap_or_else(|p| p.into_inner());
            if failure.is_none() {
                *failure = Some(error);
            }
        }
        self.stop.store(true, Ordering::Release);
        for sender in &self.senders {
            // A worker that has already returned has dropped its inbox; nothing to wake.
            let _ = sender.send(Msg::Abort);
        }
    }

    fn take_failure(&self) -> Option<Error> {
        self.failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }
}

/// Runs `job`'s schedule to completion or to its first failure.
pub(crate) fn execute<T: Tensor>(job: Job<'_, '_, T>) -> Result<Outcome<T>, Error> {
    let schedule = job.schedule;
    let (n, m) = (schedule.stages(), schedule.micro_batches());
    let workers = schedule.workers().len();
    let (senders, receivers): (Vec<_>, Vec<_>) = (0..workers).map(|_| channel()).unzip();
    let shared = Shared {
        stop: AtomicBool::new(false),
        failure: Mutex::new(None),
        senders,
    };
    let common = Common {
        schedule,
        devices: job.stages.iter().map(|s| s.device).collect(),
        micro_batches: job.micro_batches,
        train: job.train,
        seed: job.seed,
        step: job.step,
        checkpoint_stop: job.checkpoint_stop,
        defer_weight_grads: job.defer_weight_grads,
        timeout: job.timeout,
        record: job.record,
        skips: job.skips,
    };
    let none = || -> Vec<Option<Batch<T>>> { (0..m).map(|_| None).collect() };
    let mut hosted: Vec<Vec<Hosted<'_, T>>> = (0..workers).map(|_| Vec::new()).collect();
    let (mut inputs, mut grads) = (Some(job.inputs), Some(job.grads));
    for (stage, slot) in job.stages.into_iter().enumerate() {
        let worker = schedule.worker_of(stage).unwrap_or(0);
        // Trackers left by a forward-only run hold what the memory already counts.
        let mut skip_bytes = vec![0; m];
        for (bytes, tracker) in skip_bytes.iter_mut().zip(&slot.trackers) {
            *bytes = tracker.as_deref().map_or(0, held_bytes);
        }
        hosted[worker].push(Hosted {
            stage,
            slot,
            inputs: if stage == 0 { inputs.take() } else { None }.unwrap_or_else(none),
            grads: if stage + 1 == n { grads.take() } else { None }.unwrap_or_else(none),
            values_in: vec![0; m],
            grads_in: vec![0; m],
            skip_bytes,
            moves: Moves::default(),
        });
    }
    let mut loss = job.loss;
    let loss_worker = schedule.worker_of(n - 1);
    let on_final = job.on_final;

    let mut results = Vec::with_capacity(workers);
    std::thread::scope(|scope| {
        let mut handles = Vec::with_capacity(workers);
        for (index, (stages, inbox)) in hosted.into_iter().zip(receivers).enumerate() {
            let loss = if loss_worker == Some(index) {
                loss.take()
            } else {
                None
            };
            let worker = Worker::new(index, stages, inbox, &shared, &common, loss, on_final);
            let shared = &shared;
            let spawned = std::thread::Builder::new()
                .name(format!("pipe-worker-{index}"))
                .spawn_scoped(scope, move || {
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| worker.run()))
                        .map_err(|payload| {
                            shared.fail(Error::WorkerPanicked {
                                worker: index,
                                message: panic_message(payload.as_ref()),
                            })
                        })
                        .ok()
                });
            match spawned {
                Ok(handle) => handles.push(handle),
                Err(source) => {
                    shared.fail(Error::Spawn {
                        worker: index,
                        source,
                    });
                    break;
                }
            }
        }
        for handle in handles {
            // Panics are caught inside the thread, so join reports none.
            results.push(handle.join().ok().flatten());
        }
    });
    if let Some(error) = shared.take_failure() {
        return Err(error);
    }

    let mut outcome = Outcome {
        outputs: none(),
        input_grads: none(),
        kept: (0..n).map(|_| Vec::new()).collect(),
        trackers: (0..n).map(|_| Vec::new()).collect(),
        moves: Moves::default(),
        memory: vec![Memory::default(); n],
        spans: Vec::with_capacity(workers),
    };
    for result in results {
        let Some(out) = result else {
            return Err(Error::WorkerPanicked {
                worker: outcome.spans.len(),
                message: "worker ended without a result".to_string(),
            });
        };
        for stage in out.stages {
            outcome.kept[stage.stage] = stage.kept;
            outcome.trackers[stage.stage] = stage.trackers;
            outcome.moves = outcome.moves + stage.moves;
            outcome.memory[stage.stage] = stage.memory;
        }
        if let Some(outputs) = out.outputs {
            outcome.outputs = outputs;
        }
        if let Some(input_grads) = out.input_grads {
            outcome.input_grads = input_grads;
        }
        outcome.spans.push(out.spans);
    }
    Ok(outcome)
}

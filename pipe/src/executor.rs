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

use std::sync::mpsc::channel;
use std::time::{Duration, Instant};

use skip::Moves;

use std::sync::Arc;

use crate::error::Error;
use crate::frame::Control;
use crate::memory::Memory;
use crate::microbatch::{Batch, MicroBatch};
use crate::portal::{held_bytes, SkipPlan};
use crate::protocol::{Common, FinalHook, LossFn, Shared, StageSlot, Trackers};
use crate::ranks::Ranks;
use crate::receiver::receive_from;
use crate::record::Span;
use crate::schedule::Schedule;
use crate::stage::{panic_message, Kept};
use crate::tensor::Tensor;
use crate::worker::{Hosted, Worker};

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
    /// For a pipe on ranks: where its stages run. Only this rank's stages have workers
    /// here; messages to the others go over the transport.
    pub ranks: Option<Arc<Ranks<T>>>,
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

/// Runs `job`'s schedule to completion or to its first failure.
pub(crate) fn execute<T: Tensor>(job: Job<'_, '_, T>) -> Result<Outcome<T>, Error> {
    let schedule = job.schedule;
    let (n, m) = (schedule.stages(), schedule.micro_batches());
    let workers = schedule.workers().len();
    let (senders, receivers): (Vec<_>, Vec<_>) = (0..workers).map(|_| channel()).unzip();
    let ranks = job.ranks;
    let shared = Shared::new(senders, ranks.clone());
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
        if ranks.as_ref().is_some_and(|r| !r.is_local(stage)) {
            continue;
        }
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
            if stages.is_empty() && ranks.is_some() {
                // Its stages run on other ranks.
                continue;
            }
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
        // On ranks: one receiver per peer rank, until that peer's part of the run is over.
        let mut receiving = Vec::new();
        if let Some(r) = ranks.as_deref() {
            for peer in r.peers() {
                let (shared, common) = (&shared, &common);
                let spawned = std::thread::Builder::new()
                    .name(format!("pipe-from-rank-{peer}"))
                    .spawn_scoped(scope, move || {
                        let run = std::panic::AssertUnwindSafe(|| {
                            receive_from(r, peer, shared, schedule, &common.devices, common.timeout)
                        });
                        if let Err(payload) = std::panic::catch_unwind(run) {
                            shared.fail(Error::WorkerPanicked {
                                worker: usize::MAX,
                                message: panic_message(payload.as_ref()),
                            });
                        }
                    });
                match spawned {
                    Ok(handle) => receiving.push(handle),
                    Err(source) => shared.fail(Error::Spawn {
                        worker: usize::MAX,
                        source,
                    }),
                }
            }
        }
        for handle in handles {
            // Panics are caught inside the thread, so join reports none.
            results.push(handle.join().ok().flatten());
        }
        if let Some(r) = ranks.as_deref() {
            // This rank's part is over (done or failed): every peer hears it, then every
            // peer's end is awaited, so no frame of this run is left for the next one.
            for peer in r.peers() {
                if let Err(e) = r.send_control(peer, &Control::Done) {
                    shared.fail(e);
                }
            }
            for handle in receiving {
                let _ = handle.join();
            }
            if let Err(source) = r.transport.flush(common.timeout) {
                shared.fail(Error::Transport {
                    rank: r.rank(),
                    peer: r.rank(),
                    source,
                });
            }
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

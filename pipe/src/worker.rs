//! One worker: runs its list of actions in order, waiting on its inbox for the data each
//! needs, sending results straight to the worker that needs them.

use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::Instant;

use crate::checkpoint::{guard, Keep, Kept, StageCall};
use crate::error::{Error, Site, Task};
use crate::executor::{Common, FinalHook, LossFn, Memory, Msg, Shared, StageSlot};
use crate::microbatch::Batch;
use crate::pin::pin_current_thread;
use crate::record::{Span, SpanKind};
use crate::schedule::{Action, Work};
use crate::tensor::{Device, Tensor};

/// A stage on its worker, with the data that has arrived for it.
pub(crate) struct Hosted<'a, T> {
    pub stage: usize,
    pub slot: StageSlot<'a, T>,
    /// Inputs by micro-batch, taken by the forward actions.
    pub inputs: Vec<Option<Batch<T>>>,
    /// Output gradients by micro-batch, taken by the backward actions.
    pub grads: Vec<Option<Batch<T>>>,
}

/// A hosted stage at the end of a run.
pub(crate) struct StageOut<T> {
    pub stage: usize,
    /// Per micro-batch, what it still keeps for a later backward.
    pub kept: Vec<Option<Kept<T>>>,
    pub memory: Memory,
}

/// What a worker hands back when its thread ends.
pub(crate) struct WorkerOut<T> {
    pub stages: Vec<StageOut<T>>,
    /// The last stage's outputs, if this worker hosts it.
    pub outputs: Option<Vec<Option<Batch<T>>>>,
    /// Stage 0's input gradients, if this worker hosts it.
    pub input_grads: Option<Vec<Option<Batch<T>>>>,
    pub spans: Vec<Span>,
}

/// Why a worker stops early.
enum Halt {
    /// Another worker failed (the stop flag or an abort message).
    Stopped,
    /// This worker failed.
    Failed(Error),
}

impl From<Error> for Halt {
    fn from(error: Error) -> Self {
        Halt::Failed(error)
    }
}

pub(crate) struct Worker<'a, 'l, 's, T> {
    index: usize,
    stages: Vec<Hosted<'a, T>>,
    /// `position[stage]`: where the stage is in `stages`, if hosted here.
    position: Vec<Option<usize>>,
    inbox: Receiver<Msg<T>>,
    shared: &'s Shared<T>,
    common: &'s Common<'s>,
    loss: Option<&'a mut LossFn<'l, T>>,
    on_final: Option<&'a FinalHook<T>>,
    outputs: Vec<Option<Batch<T>>>,
    input_grads: Vec<Option<Batch<T>>>,
    spans: Vec<Span>,
}

impl<'a, 'l, 's, T: Tensor> Worker<'a, 'l, 's, T> {
    pub fn new(
        index: usize,
        stages: Vec<Hosted<'a, T>>,
        inbox: Receiver<Msg<T>>,
        shared: &'s Shared<T>,
        common: &'s Common<'s>,
        loss: Option<&'a mut LossFn<'l, T>>,
        on_final: Option<&'a FinalHook<T>>,
    ) -> Self {
        let (n, m) = (common.schedule.stages(), common.schedule.micro_batches());
        let mut position = vec![None; n];
        for (p, hosted) in stages.iter().enumerate() {
            position[hosted.stage] = Some(p);
        }
        let none = || (0..m).map(|_| None).collect();
        Worker {
            index,
            stages,
            position,
            inbox,
            shared,
            common,
            loss,
            on_final,
            outputs: none(),
            input_grads: none(),
            spans: Vec::new(),
        }
    }

    /// Runs the worker's actions until done, stopped or failed; never panics on a layer's
    /// behalf (layer panics become errors).
    pub fn run(mut self) -> WorkerOut<T> {
        let actions = &self.common.schedule.workers()[self.index];
        let pinned = self.stages.first().and_then(|h| match h.slot.device {
            Device::CpuCore(core) => Some(core),
            _ => None,
        });
        if let Some(core) = pinned {
            if let Err(error) = pin_current_thread(core) {
                self.shared.fail(error);
                return self.finish();
            }
        }
        // The position of each stage's last backward action: after it, that stage's
        // parameter gradients are final for this run.
        let mut last_backward = vec![None; self.position.len()];
        for (k, a) in actions.iter().enumerate() {
            if a.work == Work::Backward {
                last_backward[a.stage] = Some(k);
            }
        }
        for (k, &action) in actions.iter().enumerate() {
            if self.shared.stopped() {
                break;
            }
            let mut result = match action.work {
                Work::Forward => self.forward(action),
                Work::Backward => self.backward(action),
            };
            if result.is_ok() && last_backward[action.stage] == Some(k) {
                result = self.gradients_final(action.stage);
            }
            match result {
                Ok(()) => {}
                Err(Halt::Stopped) => break,
                Err(Halt::Failed(error)) => {
                    self.shared.fail(error);
                    break;
                }
            }
        }
        self.finish()
    }

    fn finish(self) -> WorkerOut<T> {
        let n = self.position.len();
        let hosts = |stage: usize| self.position.get(stage).copied().flatten().is_some();
        let (first, last) = (hosts(0), n > 0 && hosts(n - 1));
        WorkerOut {
            outputs: last.then_some(self.outputs),
            input_grads: first.then_some(self.input_grads),
            stages: self
                .stages
                .into_iter()
                .map(|h| StageOut {
                    stage: h.stage,
                    kept: h.slot.kept,
                    memory: h.slot.memory,
                })
                .collect(),
            spans: self.spans,
        }
    }

    fn call<'c>(common: &Common<'_>, host: &'c mut Hosted<'a, T>, mb: usize) -> StageCall<'c, T> {
        StageCall {
            stage: host.stage,
            first_layer: host.slot.first_layer,
            layers: &mut *host.slot.layers,
            train: common.train,
            seed: common.seed,
            step: common.step,
            micro_batch: common.micro_batches[mb],
        }
    }

    fn forward(&mut self, action: Action) -> Result<(), Halt> {
        let (s, i) = (action.stage, action.micro_batch);
        let input = self.receive(action)?;
        let common = self.common;
        let keep = if !common.train {
            Keep::Nothing
        } else if i < common.checkpoint_stop {
            Keep::Input
        } else {
            Keep::Saved
        };
        let host = self.host(s)?;
        let start = Instant::now();
        let result = Self::call(common, &mut self.stages[host], i).forward(input, keep);
        self.span(action, SpanKind::Forward, start);
        let (output, kept) = result?;
        let slot = &mut self.stages[host].slot;
        if let Some(kept) = kept {
            slot.memory.held += kept.size_bytes();
            slot.memory.peak = slot.memory.peak.max(slot.memory.held);
            slot.kept[i] = Some(kept);
        }
        if s + 1 < common.schedule.stages() {
            let output = self.moved(output, s + 1, action)?;
            return self.route(
                s + 1,
                Msg::Activation {
                    stage: s + 1,
                    mb: i,
                    batch: output,
                },
            );
        }
        if let Some(loss) = self.loss.take() {
            let mb = common.micro_batches[i];
            let start = Instant::now();
            let result = guard(|| loss(mb, &output));
            self.loss = Some(loss);
            self.span(action, SpanKind::Loss, start);
            let site = || Site {
                partition: s,
                layer: None,
                micro_batch: Some(i),
                task: Task::Loss,
            };
            let grad = result.map_err(|fault| fault.at(site()))?;
            let grad = grad
                .to_device(&common.devices[s])
                .map_err(|e| Error::Failed {
                    site: site(),
                    source: Box::new(e),
                })?;
            self.stages[host].grads[i] = Some(grad);
        }
        self.outputs[i] = Some(output);
        Ok(())
    }

    fn backward(&mut self, action: Action) -> Result<(), Halt> {
        let (s, i) = (action.stage, action.micro_batch);
        let grad = self.receive(action)?;
        let common = self.common;
        let host = self.host(s)?;
        let slot = &mut self.stages[host].slot;
        let kept = slot.kept[i].take().ok_or(Error::MissingAction {
            action: Action::forward(s, i),
        })?;
        slot.memory.held = slot.memory.held.saturating_sub(kept.size_bytes());
        let saved = match kept {
            Kept::Saved(saved) => saved,
            Kept::Input(input) => {
                let start = Instant::now();
                let result = Self::call(common, &mut self.stages[host], i).recompute(input);
                self.span(action, SpanKind::Recompute, start);
                result?
            }
        };
        let start = Instant::now();
        let result = Self::call(common, &mut self.stages[host], i).backward(grad, saved);
        self.span(action, SpanKind::Backward, start);
        let grad_input = result?;
        if s == 0 {
            self.input_grads[i] = Some(grad_input);
            return Ok(());
        }
        let grad_input = self.moved(grad_input, s - 1, action)?;
        self.route(
            s - 1,
            Msg::Gradient {
                stage: s - 1,
                mb: i,
                batch: grad_input,
            },
        )
    }

    /// Runs the gradients-final callback for `stage`.
    fn gradients_final(&mut self, stage: usize) -> Result<(), Halt> {
        let Some(hook) = self.on_final else {
            return Ok(());
        };
        let host = self.host(stage)?;
        let layers = &mut *self.stages[host].slot.layers;
        guard(|| {
            hook(stage, layers);
            Ok(())
        })
        .map_err(|fault| {
            Halt::Failed(fault.at(Site {
                partition: stage,
                layer: None,
                micro_batch: None,
                task: Task::GradientsFinal,
            }))
        })
    }

    fn host(&self, stage: usize) -> Result<usize, Halt> {
        self.position
            .get(stage)
            .copied()
            .flatten()
            .ok_or(Halt::Failed(Error::StageSplit {
                stage,
                first: self.common.schedule.worker_of(stage).unwrap_or(0),
                second: self.index,
            }))
    }

    /// Moves a batch to `stage`'s device, naming the sending action on failure.
    fn moved(&self, batch: Batch<T>, stage: usize, action: Action) -> Result<Batch<T>, Halt> {
        batch.to_device(&self.common.devices[stage]).map_err(|e| {
            Halt::Failed(Error::Failed {
                site: Site {
                    partition: action.stage,
                    layer: None,
                    micro_batch: Some(action.micro_batch),
                    task: match action.work {
                        Work::Forward => Task::Forward,
                        Work::Backward => Task::Backward,
                    },
                },
                source: Box::new(e),
            })
        })
    }

    /// Sends a message to the worker of `stage`, or files it here if that is this worker.
    fn route(&mut self, stage: usize, msg: Msg<T>) -> Result<(), Halt> {
        match self.common.schedule.worker_of(stage) {
            Some(w) if w == self.index => {
                self.deliver(msg);
                Ok(())
            }
            // A closed inbox means its worker returned, which before the end of a valid
            // schedule happens only when the run is stopping.
            Some(w) => self.shared.senders[w].send(msg).map_err(|_| Halt::Stopped),
            None => Err(Halt::Stopped),
        }
    }

    fn deliver(&mut self, msg: Msg<T>) {
        let (stage, mb, batch, work) = match msg {
            Msg::Activation { stage, mb, batch } => (stage, mb, batch, Work::Forward),
            Msg::Gradient { stage, mb, batch } => (stage, mb, batch, Work::Backward),
            Msg::Abort => return,
        };
        if let Some(p) = self.position.get(stage).copied().flatten() {
            let slots = match work {
                Work::Forward => &mut self.stages[p].inputs,
                Work::Backward => &mut self.stages[p].grads,
            };
            if let Some(slot) = slots.get_mut(mb) {
                *slot = Some(batch);
            }
        }
    }

    /// Waits for the data `action` needs: its input (forward) or its output gradient
    /// (backward), at most the pipe's timeout.
    fn receive(&mut self, action: Action) -> Result<Batch<T>, Halt> {
        let timeout = self.common.timeout;
        let deadline = Instant::now().checked_add(timeout);
        let host = self.host(action.stage)?;
        loop {
            let hosted = &mut self.stages[host];
            let slot = match action.work {
                Work::Forward => &mut hosted.inputs[action.micro_batch],
                Work::Backward => &mut hosted.grads[action.micro_batch],
            };
            if let Some(batch) = slot.take() {
                return Ok(batch);
            }
            let left = deadline.map_or(timeout, |d| d.saturating_duration_since(Instant::now()));
            match self.inbox.recv_timeout(left) {
                Ok(Msg::Abort) | Err(RecvTimeoutError::Disconnected) => return Err(Halt::Stopped),
                Ok(msg) => self.deliver(msg),
                Err(RecvTimeoutError::Timeout) => {
                    return Err(Halt::Failed(Error::Timeout {
                        partition: action.stage,
                        action,
                        timeout,
                    }))
                }
            }
        }
    }

    fn span(&mut self, action: Action, kind: SpanKind, start: Instant) {
        if let Some(origin) = self.common.record {
            self.spans.push(Span {
                action,
                kind,
                start: start.saturating_duration_since(origin),
                end: Instant::now().saturating_duration_since(origin),
            });
        }
    }
}

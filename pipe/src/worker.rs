//! One worker: runs its list of actions in order, waiting on its inbox for the data each
//! needs, sending results straight to the worker that needs them.

use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::Instant;

use skip::{Moves, Tracker};

use crate::error::{Error, Site};
use crate::memory::Memory;
use crate::message::Msg;
use crate::microbatch::Batch;
use crate::pin::pin_current_thread;
use crate::portal::{held_bytes, new_tracker};
use crate::protocol::{Common, FinalHook, LossFn, Shared, StageSlot, Trackers};
use crate::record::{Span, SpanKind};
use crate::stage::{deferred_bytes, flush, flush_first, guard, Keep, Kept, StageCall};
use crate::tensor::Tensor;
use crate::vocab::Device;
use crate::vocab::Task;
use crate::vocab::{Action, Pass};

/// A stage on its worker, with the data that has arrived for it.
pub(crate) struct Hosted<'a, T> {
    pub stage: usize,
    pub slot: StageSlot<'a, T>,
    /// Inputs by micro-batch, taken by the forward actions.
    pub inputs: Vec<Option<Batch<T>>>,
    /// Output gradients by micro-batch, taken by the backward actions.
    pub grads: Vec<Option<Batch<T>>>,
    /// Per micro-batch, skip values received this run (the forward waits for all).
    pub values_in: Vec<usize>,
    /// Per micro-batch, skip gradients received this run (the backward waits for all).
    pub grads_in: Vec<usize>,
    /// Per micro-batch, the bytes its tracker held when last counted.
    pub skip_bytes: Vec<usize>,
    /// Moves of the trackers finished with in this run.
    pub moves: Moves,
}

/// A hosted stage at the end of a run.
pub(crate) struct StageOut<T> {
    pub stage: usize,
    /// Per micro-batch, what it still keeps for a later backward.
    pub kept: Vec<Option<Kept<T>>>,
    /// Per micro-batch, the skip trackers a later backward needs.
    pub trackers: Trackers<T>,
    /// Moves of the trackers finished with in this run.
    pub moves: Moves,
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
            if a.pass != Pass::Forward {
                last_backward[a.stage] = Some(k);
            }
        }
        for (k, &action) in actions.iter().enumerate() {
            if self.shared.stopped() {
                break;
            }
            let mut result = match action.pass {
                Pass::Forward => self.forward(action),
                Pass::Backward | Pass::InputGrad => self.backward(action),
                Pass::WeightGrad => self.weight_grad(action),
            };
            if result.is_ok() && last_backward[action.stage] == Some(k) {
                result = self
                    .flush_weight_grads(action)
                    .and_then(|()| self.gradients_final(action.stage));
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
                    trackers: h.slot.trackers,
                    moves: h.moves,
                    memory: h.slot.memory,
                })
                .collect(),
            spans: self.spans,
        }
    }

    fn call<'c>(
        common: &'c Common<'_>,
        host: &'c mut Hosted<'a, T>,
        mb: usize,
        tracker: Option<Box<Tracker<T>>>,
        defer: bool,
    ) -> StageCall<'c, T> {
        let first = host.slot.first_layer;
        let count = host.slot.layers.len();
        StageCall {
            stage: host.stage,
            first_layer: first,
            layers: &mut *host.slot.layers,
            decls: common.skips.decls.get(first..first + count).unwrap_or(&[]),
            tracker,
            train: common.train,
            seed: common.seed,
            step: common.step,
            micro_batch: common.micro_batches[mb],
            micro_batches: common.micro_batches.len(),
            defer_weight_grads: defer,
        }
    }

    /// Whether micro-batch `mb` is checkpointed (its trackers keep incoming values until
    /// the recomputation).
    fn checkpointed(&self, mb: usize) -> bool {
        self.common.train && mb < self.common.checkpoint_stop
    }

    /// Recounts the bytes the tracker of (`host`, `mb`) holds into the stage's memory.
    fn recount(&mut self, host: usize, mb: usize) {
        let hosted = &mut self.stages[host];
        let now = hosted.slot.trackers[mb].as_deref().map_or(0, held_bytes);
        let before = std::mem::replace(&mut hosted.skip_bytes[mb], now);
        hosted.slot.memory.set_skips(before, now);
    }

    /// Finishes with the tracker of (`host`, `mb`): it must hold nothing; its moves are
    /// counted.
    fn retire(&mut self, host: usize, mb: usize, tracker: Box<Tracker<T>>) -> Result<(), Halt> {
        let hosted = &mut self.stages[host];
        hosted.moves = hosted.moves + tracker.moves();
        let held = tracker.len();
        drop(tracker);
        self.recount(host, mb);
        if held > 0 {
            return Err(Halt::Failed(Error::SkipsLeftBehind {
                partition: self.stages[host].stage,
                micro_batch: mb,
                held,
            }));
        }
        Ok(())
    }

    /// A skip error of the engine's own moves, at the action that made them.
    fn skip_failure(action: Action, task: Task, error: impl Into<Error>) -> Halt {
        Halt::Failed(Error::Failed {
            site: Site {
                partition: action.stage,
                layer: None,
                micro_batch: Some(action.micro_batch),
                task,
            },
            source: Box::new(error.into()),
        })
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
        let tracker = common.skips.stage_has_skips(s).then(|| {
            let checkpointed = self.checkpointed(i);
            self.stages[host].slot.trackers[i]
                .take()
                .unwrap_or_else(|| new_tracker(checkpointed))
        });
        let start = Instant::now();
        let mut call = Self::call(common, &mut self.stages[host], i, tracker, false);
        let result = call.forward(input, keep);
        let tracker = call.tracker.take();
        self.span(action, SpanKind::Forward, start);
        let (output, kept) = result?;
        let slot = &mut self.stages[host].slot;
        if let Some(kept) = kept {
            slot.memory.held += kept.size_bytes();
            slot.memory.peak = slot.memory.peak.max(slot.memory.held);
            slot.kept[i] = Some(kept);
        }
        if let Some(mut tracker) = tracker {
            self.send_skips(action, &mut tracker)?;
            if common.train {
                self.stages[host].slot.trackers[i] = Some(tracker);
                self.recount(host, i);
            } else {
                // Evaluation has no backward: the tracker is done with.
                self.retire(host, i, tracker)?;
            }
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

    /// After a forward pass: sends every skip value stashed here for a later stage straight
    /// to that stage, on its device.
    fn send_skips(&mut self, action: Action, tracker: &mut Tracker<T>) -> Result<(), Halt> {
        let plan = self.common.skips;
        for &r in &plan.outgoing[action.stage] {
            let route = &plan.routes[r];
            let value = tracker
                .take_outgoing(route.ns, &route.name)
                .map_err(|e| Self::skip_failure(action, Task::Forward, e))?;
            let value = value
                .map(|v| self.to_stage(v, route.dest))
                .transpose()
                .map_err(|e| Self::skip_failure(action, Task::Forward, e))?;
            let msg = Msg::Skip {
                stage: route.dest,
                mb: action.micro_batch,
                route: r,
                value,
            };
            self.route(route.dest, msg)?;
        }
        Ok(())
    }

    /// After a backward pass: sends the gradient of every skip popped here that came from
    /// an earlier stage straight back to that stage, on its device.
    fn send_skip_grads(&mut self, action: Action, tracker: &mut Tracker<T>) -> Result<(), Halt> {
        let plan = self.common.skips;
        for &r in &plan.incoming[action.stage] {
            let route = &plan.routes[r];
            let grad = tracker
                .take_outgoing_grad(route.ns, &route.name)
                .map_err(|e| Self::skip_failure(action, Task::Backward, e))?;
            let grad = grad
                .map(|g| self.to_stage(g, route.source))
                .transpose()
                .map_err(|e| Self::skip_failure(action, Task::Backward, e))?;
            let msg = Msg::SkipGrad {
                stage: route.source,
                mb: action.micro_batch,
                route: r,
                grad,
            };
            self.route(route.source, msg)?;
        }
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
        let mut tracker = if common.skips.stage_has_skips(s) {
            Some(slot.trackers[i].take().ok_or(Error::MissingAction {
                action: Action::forward(s, i),
            })?)
        } else {
            None
        };
        let saved = match kept {
            Kept::Saved(saved) => saved,
            Kept::Input(input) => {
                let start = Instant::now();
                let mut call = Self::call(common, &mut self.stages[host], i, tracker, false);
                let result = call.recompute(input);
                tracker = call.tracker.take();
                self.span(action, SpanKind::Recompute, start);
                result?
            }
        };
        // An input-gradient action defers the weight gradients to its W action; in a
        // schedule with W actions, a full backward adds its own at once (a W takes the
        // oldest deferred call, which must be its I's), even under `defer_weight_grads`.
        let defer = action.pass == Pass::InputGrad
            || (common.defer_weight_grads && !common.schedule.splits_backward());
        let start = Instant::now();
        let mut call = Self::call(common, &mut self.stages[host], i, tracker, defer);
        let result = call.backward(grad, saved);
        let tracker = call.tracker.take();
        self.span(action, SpanKind::Backward, start);
        if defer {
            let slot = &mut self.stages[host].slot;
            slot.memory.set_deferred(deferred_bytes(slot.layers));
        }
        let grad_input = result?;
        if let Some(mut tracker) = tracker {
            self.send_skip_grads(action, &mut tracker)?;
            self.retire(host, i, tracker)?;
        }
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

    /// A weight-gradient action: each layer of the stage adds the weight gradients of its
    /// oldest deferred call, the input-gradient action this one completes (a
    /// [`SpanKind::WeightGrad`] span).
    fn weight_grad(&mut self, action: Action) -> Result<(), Halt> {
        let host = self.host(action.stage)?;
        let start = Instant::now();
        let slot = &mut self.stages[host].slot;
        let result = flush_first(action, slot.first_layer, slot.layers);
        slot.memory.set_deferred(deferred_bytes(slot.layers));
        self.span(action, SpanKind::WeightGrad, start);
        Ok(result?)
    }

    /// After the last backward action of its stage: adds the weight gradients the stage's
    /// layers deferred (a [`SpanKind::WeightGrad`] span), so they are final.
    fn flush_weight_grads(&mut self, action: Action) -> Result<(), Halt> {
        if !self.common.defer_weight_grads {
            return Ok(());
        }
        let host = self.host(action.stage)?;
        let start = Instant::now();
        let slot = &mut self.stages[host].slot;
        let result = flush(action.stage, slot.first_layer, slot.layers);
        slot.memory.set_deferred(deferred_bytes(slot.layers));
        self.span(action, SpanKind::WeightGrad, start);
        Ok(result?)
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

    /// Whether `stage` runs on another rank (its device is that rank's business: the
    /// tensor is read onto it there).
    fn remote(&self, stage: usize) -> bool {
        self.shared
            .ranks
            .as_ref()
            .is_some_and(|r| !r.is_local(stage))
    }

    /// Moves a tensor to `stage`'s device, unless that stage is on another rank.
    fn to_stage(&self, t: T, stage: usize) -> Result<T, Error> {
        if self.remote(stage) {
            return Ok(t);
        }
        t.to_device(&self.common.devices[stage])
    }

    /// Moves a batch to `stage`'s device (unless it runs on another rank), naming the
    /// sending action on failure.
    fn moved(&self, batch: Batch<T>, stage: usize, action: Action) -> Result<Batch<T>, Halt> {
        if self.remote(stage) {
            return Ok(batch);
        }
        batch.to_device(&self.common.devices[stage]).map_err(|e| {
            Halt::Failed(Error::Failed {
                site: Site {
                    partition: action.stage,
                    layer: None,
                    micro_batch: Some(action.micro_batch),
                    task: action.pass.into(),
                },
                source: Box::new(e),
            })
        })
    }

    /// Sends a message to the worker of `stage` (over the transport if it runs on another
    /// rank), or files it here if that is this worker.
    fn route(&mut self, stage: usize, msg: Msg<T>) -> Result<(), Halt> {
        if let Some(ranks) = self.shared.ranks.as_ref().filter(|r| !r.is_local(stage)) {
            return ranks.send_msg(stage, &msg).map_err(Halt::Failed);
        }
        match self.common.schedule.worker_of(stage) {
            Some(w) if w == self.index => self.deliver(msg),
            // A closed inbox means its worker returned, which before the end of a valid
            // schedule happens only when the run is stopping.
            Some(w) => self.shared.senders[w].send(msg).map_err(|_| Halt::Stopped),
            None => Err(Halt::Stopped),
        }
    }

    /// Files a message where the action that needs it will look: inputs and gradients in
    /// their slots, skip values and gradients in the micro-batch's tracker.
    fn deliver(&mut self, msg: Msg<T>) -> Result<(), Halt> {
        let (stage, mb, batch, pass) = match msg {
            Msg::Activation { stage, mb, batch } => (stage, mb, batch, Pass::Forward),
            Msg::Gradient { stage, mb, batch } => (stage, mb, batch, Pass::Backward),
            Msg::Skip {
                stage,
                mb,
                route,
                value,
            } => return self.deliver_skip(stage, mb, route, value, Pass::Forward),
            Msg::SkipGrad {
                stage,
                mb,
                route,
                grad,
            } => return self.deliver_skip(stage, mb, route, grad, Pass::Backward),
            Msg::Abort => return Ok(()),
        };
        if let Some(p) = self.position.get(stage).copied().flatten() {
            let slots = match pass {
                Pass::Forward => &mut self.stages[p].inputs,
                Pass::Backward | Pass::InputGrad | Pass::WeightGrad => &mut self.stages[p].grads,
            };
            if let Some(slot) = slots.get_mut(mb) {
                *slot = Some(batch);
            }
        }
        Ok(())
    }

    /// Puts a skip value (`Pass::Forward`) or gradient (`Pass::Backward`) that arrived for
    /// (`stage`, `mb`) into its tracker.
    fn deliver_skip(
        &mut self,
        stage: usize,
        mb: usize,
        route: usize,
        value: Option<T>,
        pass: Pass,
    ) -> Result<(), Halt> {
        let host = self.host(stage)?;
        let checkpointed = self.checkpointed(mb);
        let action = Action {
            stage,
            micro_batch: mb,
            pass,
        };
        let Some(r) = self.common.skips.routes.get(route) else {
            return Err(Halt::Failed(Error::MissingAction { action }));
        };
        let hosted = &mut self.stages[host];
        let result = match pass {
            Pass::Forward => {
                hosted.values_in[mb] += 1;
                hosted.slot.trackers[mb]
                    .get_or_insert_with(|| new_tracker(checkpointed))
                    .insert_incoming(r.ns, &r.name, value)
            }
            Pass::Backward | Pass::InputGrad | Pass::WeightGrad => {
                hosted.grads_in[mb] += 1;
                match hosted.slot.trackers[mb].as_mut() {
                    Some(tracker) => tracker.insert_incoming_grad(r.ns, &r.name, value),
                    None => {
                        return Err(Halt::Failed(Error::MissingAction {
                            action: Action::forward(stage, mb),
                        }))
                    }
                }
            }
        };
        result.map_err(|e| Self::skip_failure(action, pass.into(), e))?;
        self.recount(host, mb);
        Ok(())
    }

    /// Waits for the data `action` needs: its input (forward) or its output gradient
    /// (backward), and every skip value (forward) or skip gradient (backward) that comes
    /// to its stage from another one, at most the pipe's timeout.
    fn receive(&mut self, action: Action) -> Result<Batch<T>, Halt> {
        let timeout = self.common.timeout;
        let deadline = Instant::now().checked_add(timeout);
        let host = self.host(action.stage)?;
        let plan = self.common.skips;
        let (mb, stage) = (action.micro_batch, action.stage);
        loop {
            let hosted = &mut self.stages[host];
            let (slot, skips_ready) = match action.pass {
                Pass::Forward => (
                    &mut hosted.inputs[mb],
                    hosted.values_in[mb] >= plan.values_in(stage),
                ),
                Pass::Backward | Pass::InputGrad | Pass::WeightGrad => (
                    &mut hosted.grads[mb],
                    hosted.grads_in[mb] >= plan.grads_in(stage),
                ),
            };
            if skips_ready {
                if let Some(batch) = slot.take() {
                    return Ok(batch);
                }
            }
            let left = deadline.map_or(timeout, |d| d.saturating_duration_since(Instant::now()));
            match self.inbox.recv_timeout(left) {
                Ok(Msg::Abort) | Err(RecvTimeoutError::Disconnected) => return Err(Halt::Stopped),
                Ok(msg) => self.deliver(msg)?,
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

//! [`Pipe`]: a sequence of layers split into partitions, each on its own worker, run over
//! micro-batches by a schedule.

use std::sync::Arc;
use std::time::{Duration, Instant};

use skip::Moves;

use crate::error::{Error, Site};
use crate::executor::{execute, Outcome};
use crate::layer::Layer;
use crate::memory::Memory;
use crate::microbatch::{Batch, MicroBatch};
use crate::portal::{moves_of, SkipPlan};
use crate::protocol::{FinalHook, LossFn, StageSlot, Trackers};
use crate::ranks::Ranks;
use crate::record::Record;
use crate::schedule::{Schedule, ScheduleKind};
use crate::stage::{Checkpoint, Kept};
use crate::tensor::Tensor;
use crate::vocab::{Action, Device, Pass};

mod builder;
mod ranks;

pub use builder::{PipeBuilder, DEFAULT_TIMEOUT};

impl<T: Tensor> PipeBuilder<T> {
    /// Checks the arguments (`chunks`, then the balance, then the devices, as torchgpipe's
    /// `split_module`), verifies the layers' skip declarations (every mismatch at once,
    /// [`Error::Skip`]) and splits the layers. torchgpipe verifies the skips first, so
    /// with both kinds of mistake it reports the skip one where this reports the argument.
    pub fn build(self) -> Result<Pipe<T>, Error> {
        let c = self.check()?;
        let n = c.partitions.len();
        Ok(Pipe {
            partitions: c.partitions,
            first_layer: c.first_layer,
            devices: c.devices,
            chunks: c.chunks,
            checkpoint: c.checkpoint,
            schedule: c.schedule,
            timeout: c.timeout,
            seed: c.seed,
            step: 0,
            train: true,
            pending: None,
            poison: None,
            memory: vec![Memory::default(); n],
            record: c.record.then(|| Record::new(Instant::now(), n)),
            recording: c.record,
            on_final: None,
            skips: c.skips,
            moves: Moves::default(),
            defer_weight_grads: c.defer_weight_grads,
            balance: c.balance,
            ranks: c.ranks,
        })
    }
}

/// What [`Pipe::step`] returns.
#[derive(Debug)]
pub struct StepOutput<T, L> {
    /// The outputs of all micro-batches, gathered.
    pub output: Batch<T>,
    /// The gradient with respect to the input, gathered (no-chunk items summed).
    pub input_grad: Batch<T>,
    /// Each micro-batch's loss, in micro-batch order.
    pub losses: Vec<L>,
}

/// Per stage, per micro-batch, what a forward-only run left for its backward: the kept
/// state and the skip trackers.
type Earlier<T> = (Vec<Vec<Option<Kept<T>>>>, Vec<Trackers<T>>);

/// A training forward whose backward has not run yet.
struct Pending<T> {
    plan: Vec<MicroBatch>,
    kept: Vec<Vec<Option<Kept<T>>>>,
    trackers: Vec<Trackers<T>>,
    batch_len: usize,
}

/// A pipeline: layers split into partitions by a balance, each partition on a worker
/// thread (optionally pinned to a core), mini-batches split into micro-batches, run by a
/// schedule, with checkpointing.
///
/// - [`forward`](Pipe::forward) then [`backward`](Pipe::backward) run GPipe's schedule
///   split at its middle: all forwards, then all backwards in reverse micro-batch order.
/// - [`step`](Pipe::step) runs a whole training step with the configured schedule: the loss
///   function gets each micro-batch's output as soon as its forward ends, so 1F1B can start
///   backward passes before all forwards have run.
/// - In eval mode ([`eval`](Pipe::eval)) nothing is kept and nothing is checkpointed.
///
/// Parameter gradients accumulate in the layers across steps until
/// [`zero_grad`](Pipe::zero_grad).
///
/// A failed run returns an error naming the partition, layer and micro-batch, discards the
/// run's state, and leaves the pipe usable (parameter gradients may hold part of the
/// step: zero them). A failed training run uses up its step number, so a retry runs at a
/// fresh one: its random streams are its own, and a deferred batch norm drops the partial
/// sums of the failed run instead of adding the retry's to them. A panic in a layer, the loss or a callback also **poisons** the pipe:
/// later runs return [`Error::Poisoned`] until [`clear_poison`](Pipe::clear_poison).
pub struct Pipe<T: Tensor> {
    partitions: Vec<Vec<Box<dyn Layer<T>>>>,
    first_layer: Vec<usize>,
    devices: Vec<Device>,
    chunks: usize,
    checkpoint: Checkpoint,
    schedule: ScheduleKind,
    timeout: Duration,
    seed: u64,
    step: u64,
    train: bool,
    pending: Option<Pending<T>>,
    poison: Option<Option<Site>>,
    memory: Vec<Memory>,
    record: Option<Record>,
    recording: bool,
    on_final: Option<Box<FinalHook<T>>>,
    skips: SkipPlan,
    moves: Moves,
    defer_weight_grads: bool,
    /// Layers per partition, over every rank.
    balance: Vec<usize>,
    /// For stages on ranks: where each runs (the partitions of other ranks are empty
    /// here).
    ranks: Option<Arc<Ranks<T>>>,
}

impl<T: Tensor> Pipe<T> {
    /// Starts building a pipe of `layers` split into partitions of `balance[j]` consecutive
    /// layers each.
    pub fn builder(layers: Vec<Box<dyn Layer<T>>>, balance: &[usize]) -> PipeBuilder<T> {
        PipeBuilder::new(layers, balance)
    }

    /// Runs the forward pass of `input` and returns the gathered output. In training mode
    /// the micro-batches' state is kept for [`backward`](Pipe::backward) (a previous pending
    /// forward is discarded).
    pub fn forward(&mut self, input: Batch<T>) -> Result<Batch<T>, Error> {
        if let Some(ranks) = self.ranks.clone() {
            return self.forward_on_ranks(&ranks, input);
        }
        self.check_poison()?;
        self.discard_pending();
        let n = self.partitions.len();
        if n == 0 {
            return Ok(input);
        }
        let batch_len = input.batch_len()?;
        let (plan, parts) = input.scatter(self.chunks)?;
        let inputs = self.on_device(parts, 0)?;
        let schedule = Schedule::gpipe_forward(plan.len(), n)?;
        let outcome = self.run(&schedule, &plan, inputs, Vec::new(), None, None)?;
        let output = Batch::gather(complete(outcome.outputs, n - 1, Pass::Forward)?)?;
        if self.train {
            self.pending = Some(Pending {
                plan,
                kept: outcome.kept,
                trackers: outcome.trackers,
                batch_len,
            });
        }
        Ok(output)
    }

    /// Runs the backward pass of the pending training forward from the gradient of its
    /// output, and returns the gradient of its input. Parameter gradients accumulate in the
    /// layers.
    pub fn backward(&mut self, grad_output: Batch<T>) -> Result<Batch<T>, Error> {
        if let Some(ranks) = self.ranks.clone() {
            return self.backward_on_ranks(&ranks, grad_output);
        }
        self.check_poison()?;
        let n = self.partitions.len();
        if n == 0 {
            return Ok(grad_output);
        }
        let pending = self.pending.take().ok_or(Error::NoPendingForward)?;
        let got = match grad_output.batch_len() {
            Ok(got) => got,
            Err(e) => {
                self.pending = Some(pending);
                return Err(e);
            }
        };
        if got != pending.batch_len {
            let expected = pending.batch_len;
            self.pending = Some(pending);
            return Err(Error::GradientLength { expected, got });
        }
        let Pending {
            plan,
            kept,
            trackers,
            ..
        } = pending;
        let grads = self.on_device(grad_output.split_as(&plan)?, n - 1)?;
        let schedule = Schedule::gpipe_backward(plan.len(), n)?;
        let earlier = Some((kept, trackers));
        let outcome = self.run(&schedule, &plan, Vec::new(), grads, earlier, None)?;
        self.step += 1;
        Batch::gather_gradients(complete(outcome.input_grads, 0, Pass::Backward)?)
    }

    /// Runs a whole training step with the configured schedule. `loss` gets each
    /// micro-batch's place in the batch and its output as soon as that micro-batch's forward
    /// ends, on the last partition's worker, and returns its loss and the output's gradient.
    pub fn step<L, F>(&mut self, input: Batch<T>, loss: F) -> Result<StepOutput<T, L>, Error>
    where
        L: Send,
        F: FnMut(MicroBatch, &Batch<T>) -> Result<(L, Batch<T>), Error> + Send,
    {
        if let Some(ranks) = self.ranks.clone() {
            return self.step_on_ranks(&ranks, None, input, loss);
        }
        let plan = self.micro_batches(input.batch_len()?)?;
        let schedule = self
            .schedule
            .generate(plan.len(), self.partitions.len().max(1))?;
        self.run_step(&schedule, Some(plan), input, loss)
    }

    /// [`step`](Pipe::step) with a schedule of your own: it must have forward and backward
    /// actions for this pipe's partitions and the batch's micro-batches (see
    /// [`micro_batches`](Pipe::micro_batches)).
    pub fn step_with<L, F>(
        &mut self,
        schedule: &Schedule,
        input: Batch<T>,
        loss: F,
    ) -> Result<StepOutput<T, L>, Error>
    where
        L: Send,
        F: FnMut(MicroBatch, &Batch<T>) -> Result<(L, Batch<T>), Error> + Send,
    {
        if let Some(ranks) = self.ranks.clone() {
            return self.step_on_ranks(&ranks, Some(schedule), input, loss);
        }
        self.run_step(schedule, None, input, loss)
    }

    /// [`step_with`](Pipe::step_with) on the micro-batches `plan` of `input` when the
    /// caller has computed them already ([`step`](Pipe::step), to size its schedule).
    fn run_step<L, F>(
        &mut self,
        schedule: &Schedule,
        plan: Option<Vec<MicroBatch>>,
        input: Batch<T>,
        loss: F,
    ) -> Result<StepOutput<T, L>, Error>
    where
        L: Send,
        F: FnMut(MicroBatch, &Batch<T>) -> Result<(L, Batch<T>), Error> + Send,
    {
        self.check_poison()?;
        if !self.train {
            return Err(Error::NotTraining);
        }
        self.discard_pending();
        let n = self.partitions.len();
        let (plan, parts) = match plan {
            Some(plan) => {
                let parts = input.split_as(&plan)?;
                (plan, parts)
            }
            None => input.scatter(self.chunks)?,
        };
        let m = plan.len();
        if n == 0 {
            return step_without_layers(plan, parts, loss);
        }
        check_schedule(schedule, n, m)?;
        let inputs = self.on_device(parts, 0)?;
        let (outcome, losses) = self.run_with_loss(schedule, &plan, inputs, loss)?;
        self.step += 1;
        let output = Batch::gather(complete(outcome.outputs, n - 1, Pass::Forward)?)?;
        let input_grad =
            Batch::gather_gradients(complete(outcome.input_grads, 0, Pass::Backward)?)?;
        let losses = complete_losses(losses, n)?;
        Ok(StepOutput {
            output,
            input_grad,
            losses,
        })
    }

    /// A training run of `schedule` whose last stage calls `loss` on each micro-batch's
    /// output for its gradient: the outcome and each micro-batch's loss (where the last
    /// stage ran here).
    fn run_with_loss<L, F>(
        &mut self,
        schedule: &Schedule,
        plan: &[MicroBatch],
        inputs: Vec<Option<Batch<T>>>,
        mut loss: F,
    ) -> Result<(Outcome<T>, Vec<Option<L>>), Error>
    where
        L: Send,
        F: FnMut(MicroBatch, &Batch<T>) -> Result<(L, Batch<T>), Error> + Send,
    {
        let mut losses: Vec<Option<L>> = (0..plan.len()).map(|_| None).collect();
        let mut per_micro_batch = |mb: MicroBatch, output: &Batch<T>| -> Result<Batch<T>, Error> {
            let (value, grad) = loss(mb, output)?;
            losses[mb.index] = Some(value);
            Ok(grad)
        };
        let outcome = self.run(
            schedule,
            plan,
            inputs,
            Vec::new(),
            None,
            Some(&mut per_micro_batch),
        )?;
        Ok((outcome, losses))
    }

    fn run(
        &mut self,
        schedule: &Schedule,
        plan: &[MicroBatch],
        inputs: Vec<Option<Batch<T>>>,
        grads: Vec<Option<Batch<T>>>,
        earlier: Option<Earlier<T>>,
        loss: Option<&mut LossFn<'_, T>>,
    ) -> Result<Outcome<T>, Error> {
        let n = self.partitions.len();
        let m = plan.len();
        let (kept, trackers) = earlier.unwrap_or_else(|| {
            let kept = (0..n).map(|_| (0..m).map(|_| None).collect()).collect();
            let trackers = (0..n).map(|_| (0..m).map(|_| None).collect()).collect();
            (kept, trackers)
        });
        let fill = |mut v: Vec<Option<Batch<T>>>| {
            v.resize_with(m, || None);
            v
        };
        let (inputs, grads) = (fill(inputs), fill(grads));
        let origin = self
            .record
            .as_ref()
            .filter(|_| self.recording)
            .map(Record::origin);
        let stages = self
            .partitions
            .iter_mut()
            .zip(kept.into_iter().zip(trackers))
            .enumerate()
            .map(|(j, (layers, (kept, trackers)))| StageSlot {
                layers: layers.as_mut_slice(),
                first_layer: self.first_layer[j],
                device: self.devices[j],
                kept,
                trackers,
                memory: self.memory[j],
            })
            .collect();
        let job = crate::executor::Job {
            schedule,
            stages,
            inputs,
            grads,
            loss,
            micro_batches: plan,
            train: self.train,
            seed: self.seed,
            step: self.step,
            checkpoint_stop: if self.train {
                self.checkpoint.stop(m)
            } else {
                0
            },
            defer_weight_grads: self.defer_weight_grads,
            timeout: self.timeout,
            record: origin,
            on_final: self.on_final.as_deref(),
            skips: &self.skips,
            ranks: self.ranks.clone(),
        };
        match execute(job) {
            Ok(mut outcome) => {
                self.moves = self.moves + outcome.moves;
                self.memory.clone_from(&outcome.memory);
                if let (Some(record), true) = (self.record.as_mut(), self.recording) {
                    record.extend(std::mem::take(&mut outcome.spans));
                }
                Ok(outcome)
            }
            Err(error) => {
                // Whatever backward actions completed keep their gradients, as without
                // deferral; nothing deferred is held past the run (an input-gradient
                // action whose weight-gradient action never ran deferred too).
                if self.defer_weight_grads || schedule.splits_backward() {
                    for (j, layers) in self.partitions.iter_mut().enumerate() {
                        let _ = crate::stage::flush(j, self.first_layer[j], layers);
                    }
                }
                for memory in &mut self.memory {
                    memory.held = 0;
                    memory.deferred = 0;
                }
                // The failed run may have left state keyed by its step in the layers (a
                // deferred batch norm's sums over the micro-batches it reached): the next
                // run gets another step number, so none of it is taken for the retry's.
                if self.train {
                    self.step += 1;
                }
                if error.poisons() {
                    self.poison = Some(error.site().cloned());
                }
                Err(error)
            }
        }
    }

    fn on_device(
        &self,
        parts: Vec<Batch<T>>,
        stage: usize,
    ) -> Result<Vec<Option<Batch<T>>>, Error> {
        parts
            .into_iter()
            .map(|p| p.to_device(&self.devices[stage]).map(Some))
            .collect()
    }

    fn check_poison(&self) -> Result<(), Error> {
        match &self.poison {
            Some(site) => Err(Error::Poisoned { site: site.clone() }),
            None => Ok(()),
        }
    }

    /// The micro-batches a batch of `len` samples is split into.
    pub fn micro_batches(&self, len: usize) -> Result<Vec<MicroBatch>, Error> {
        MicroBatch::plan(len, self.chunks)
    }

    /// Drops the pending forward's state, if any (and resets the memory peaks). A
    /// discarded training forward uses up its step number, so the next run draws fresh
    /// random numbers: two training forwards in a row get different dropout masks, as in
    /// torchgpipe (Monte-Carlo dropout), while a forward and its `backward` share one.
    pub fn discard_pending(&mut self) {
        if let Some(pending) = self.pending.take() {
            let trackers = pending.trackers.iter().flatten().flatten();
            self.moves = self.moves + moves_of(trackers.map(|t| &**t));
            self.step += 1;
        }
        self.memory.iter_mut().for_each(|m| *m = Memory::default());
    }

    /// The skip moves made since the pipe was built, summed over every micro-batch's
    /// trackers: values and gradients sent between partitions (each crossing skip once
    /// each way per micro-batch in training, once forward in evaluation), and recomputed
    /// stashes dropped because their first value had already moved. Counted when a
    /// micro-batch's trackers are done with (after its backward pass, or its forward pass
    /// in evaluation).
    pub fn skip_moves(&self) -> Moves {
        self.moves
    }

    /// Whether a training forward awaits its backward.
    pub fn has_pending(&self) -> bool {
        self.pending.is_some()
    }

    /// Training mode: keep state for backward, checkpoint, draw dropout masks.
    pub fn train(&mut self) {
        self.train = true;
    }

    /// Evaluation mode: keep nothing, checkpoint nothing.
    pub fn eval(&mut self) {
        self.train = false;
        self.discard_pending();
    }

    /// Whether in training mode.
    pub fn is_training(&self) -> bool {
        self.train
    }

    /// Whether a panic poisoned the pipe.
    pub fn is_poisoned(&self) -> bool {
        self.poison.is_some()
    }

    /// Declares the layers consistent again after a panic (e.g. after reloading them).
    pub fn clear_poison(&mut self) {
        self.poison = None;
    }

    /// Per partition, the bytes held between forward and backward: now and at most.
    pub fn memory(&self) -> &[Memory] {
        &self.memory
    }

    /// The spans recorded since recording began or the last take, if recording.
    pub fn take_record(&mut self) -> Option<Record> {
        let n = self.partitions.len();
        let fresh = self.recording.then(|| Record::new(Instant::now(), n));
        std::mem::replace(&mut self.record, fresh)
    }

    /// Turns recording on or off.
    pub fn set_record(&mut self, on: bool) {
        self.recording = on;
        if on && self.record.is_none() {
            self.record = Some(Record::new(Instant::now(), self.partitions.len()));
        }
    }

    /// Registers a callback run on a partition's worker right after that partition's last
    /// backward action of a run: from then on its parameter gradients are final for the
    /// step, while other partitions may still be computing (a data-parallel reducer can
    /// start on them). It gets the partition index and its layers.
    pub fn on_gradients_final<F>(&mut self, callback: F)
    where
        F: Fn(usize, &mut [Box<dyn Layer<T>>]) + Send + Sync + 'static,
    {
        self.on_final = Some(Box::new(callback));
    }

    /// Sets every layer's gradients to zero.
    pub fn zero_grad(&mut self) {
        self.partitions
            .iter_mut()
            .flatten()
            .for_each(|layer| layer.zero_grad());
    }

    /// The layers, per partition.
    pub fn partitions(&self) -> &[Vec<Box<dyn Layer<T>>>] {
        &self.partitions
    }

    /// The layers, per partition, mutably (for an optimizer step).
    pub fn partitions_mut(&mut self) -> &mut [Vec<Box<dyn Layer<T>>>] {
        &mut self.partitions
    }

    /// The layers, in their original order.
    pub fn into_layers(self) -> Vec<Box<dyn Layer<T>>> {
        self.partitions.into_iter().flatten().collect()
    }

    /// Layers per partition (over every rank, for stages on ranks: the partitions of
    /// other ranks are empty in [`partitions`](Pipe::partitions)).
    pub fn balance(&self) -> Vec<usize> {
        self.balance.clone()
    }

    /// For stages on ranks: the rank of each partition; `None` for a pipe in one
    /// process.
    pub fn stage_ranks(&self) -> Option<&[usize]> {
        self.ranks.as_deref().map(|r| r.stage_rank.as_slice())
    }

    /// One device per partition.
    pub fn devices(&self) -> &[Device] {
        &self.devices
    }

    /// The most micro-batches per mini-batch.
    pub fn chunks(&self) -> usize {
        self.chunks
    }

    /// Whether backward actions defer weight gradients to each partition's last one
    /// ([`PipeBuilder::defer_weight_grads`]).
    pub fn defers_weight_grads(&self) -> bool {
        self.defer_weight_grads
    }

    /// The checkpoint mode.
    pub fn checkpoint(&self) -> Checkpoint {
        self.checkpoint
    }

    /// The schedule [`step`](Pipe::step) runs.
    pub fn schedule(&self) -> ScheduleKind {
        self.schedule
    }

    /// The bound on every wait between workers.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The seed of the random streams.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The step number the next training run uses: incremented by each completed
    /// `backward` or `step`, by each training forward discarded without its `backward`
    /// ([`discard_pending`](Self::discard_pending), also by the next `forward` or `step`),
    /// and by each training run (`forward`, `backward` or `step`) that fails once its
    /// layers may have run, so that a retry never shares a step number with the attempt
    /// that failed.
    pub fn step_number(&self) -> u64 {
        self.step
    }

    /// Sets the step number (to resume a run).
    pub fn set_step_number(&mut self, step: u64) {
        self.step = step;
    }
}

/// Checks that `schedule` runs both passes of `n` stages over `m` micro-batches.
fn check_schedule(schedule: &Schedule, n: usize, m: usize) -> Result<(), Error> {
    if schedule.stages() != n
        || schedule.micro_batches() != m
        || !schedule.has_forward()
        || !schedule.has_backward()
    {
        return Err(Error::ScheduleMismatch {
            schedule_stages: schedule.stages(),
            schedule_micro_batches: schedule.micro_batches(),
            stages: n,
            micro_batches: m,
        });
    }
    Ok(())
}

/// Unwraps each micro-batch's loss of a successful step through `n` stages.
fn complete_losses<L>(losses: Vec<Option<L>>, n: usize) -> Result<Vec<L>, Error> {
    losses
        .into_iter()
        .enumerate()
        .map(|(i, l)| {
            l.ok_or(Error::MissingAction {
                action: Action::forward(n - 1, i),
            })
        })
        .collect()
}

/// Unwraps per-micro-batch results of a successful run.
fn complete<T>(
    values: Vec<Option<Batch<T>>>,
    stage: usize,
    pass: Pass,
) -> Result<Vec<Batch<T>>, Error> {
    values
        .into_iter()
        .enumerate()
        .map(|(micro_batch, v)| {
            v.ok_or(Error::MissingAction {
                action: Action {
                    stage,
                    micro_batch,
                    pass,
                },
            })
        })
        .collect()
}

/// A step through no layers: the output is the input, its gradient is the loss's.
fn step_without_layers<T: Tensor, L, F>(
    plan: Vec<MicroBatch>,
    parts: Vec<Batch<T>>,
    mut loss: F,
) -> Result<StepOutput<T, L>, Error>
where
    F: FnMut(MicroBatch, &Batch<T>) -> Result<(L, Batch<T>), Error>,
{
    let mut losses = Vec::with_capacity(plan.len());
    let mut grads = Vec::with_capacity(plan.len());
    for (mb, part) in plan.into_iter().zip(&parts) {
        let (value, grad) = loss(mb, part)?;
        losses.push(value);
        grads.push(grad);
    }
    Ok(StepOutput {
        output: Batch::gather(parts)?,
        input_grad: Batch::gather_gradients(grads)?,
        losses,
    })
}

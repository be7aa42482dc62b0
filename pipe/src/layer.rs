//! The layer trait with an explicit backward pass, its saved state, and the per-call
//! [`Context`].
//!
//! There is no autograd: a layer's `forward` returns its output together with whatever its
//! `backward` will need ([`Saved`]), and `backward` turns the output gradient and that state
//! into the input gradient, accumulating parameter gradients inside the layer. The pipeline
//! decides what to keep: the saved state (no checkpoint), only the stage's input
//! (checkpoint: `forward` is re-run with the same context before `backward`), or nothing
//! (evaluation).
//!
//! A layer with skip connections declares them ([`Layer::skips`]) and reaches them through
//! its context: [`Context::skips`] in its forward pass (stash and pop) and
//! [`Context::skip_grads`] in its backward pass (hand in a popped value's gradient, take a
//! stashed value's gradient). The pipe attaches the micro-batch's tracker to the context of
//! every layer that declares a skip, and only to those.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use skip::{Declaration, Grads, Skips, Tracker};

use crate::error::Error;
use crate::microbatch::{Batch, MicroBatch};
use crate::rng::{SampleStream, Stream};
use crate::tensor::Tensor;
use crate::vocab::Phase;

/// What a layer call may know about its circumstances: train or eval, the step, its
/// global layer index, the micro-batch (and how many there are), the phase, the random
/// stream keyed by those, and, for a layer that declares skips, the micro-batch's skip
/// tracker.
///
/// The random stream depends on (seed, step, global layer index, global sample index) only,
/// never on the chunking, the balance, the schedule or the phase, so a recomputed forward
/// draws exactly what the first one drew.
///
/// Layers take the context as `&mut Context`: the skip handles borrow it mutably.
/// Cloning a context leaves the skip tracker behind (it belongs to one call).
pub struct Context {
    train: bool,
    seed: u64,
    step: u64,
    layer: usize,
    micro_batch: MicroBatch,
    micro_batches: usize,
    phase: Phase,
    checkpointing: bool,
    profiling: bool,
    defer_weight_grads: bool,
    skips: Option<SkipSlot>,
}

/// The skip tracker lent to one layer call, with the layer's declaration. The tracker is
/// a `skip::Tracker<T>` for the pipe's tensor type `T`, kept as `Any` so that `Context`
/// stays one type for every tensor type.
struct SkipSlot {
    tracker: Box<dyn Any + Send>,
    decl: Arc<Declaration>,
}

impl Clone for Context {
    fn clone(&self) -> Self {
        Context {
            skips: None,
            ..*self
        }
    }
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("train", &self.train)
            .field("seed", &self.seed)
            .field("step", &self.step)
            .field("layer", &self.layer)
            .field("micro_batch", &self.micro_batch)
            .field("micro_batches", &self.micro_batches)
            .field("phase", &self.phase)
            .field("checkpointing", &self.checkpointing)
            .field("profiling", &self.profiling)
            .field("defer_weight_grads", &self.defer_weight_grads)
            .field("skips", &self.skips.as_ref().map(|s| &s.decl))
            .finish()
    }
}

impl Context {
    /// A context for a forward call of layer 0 on a micro-batch of `len` samples starting
    /// at sample 0, the only micro-batch of its mini-batch. Pipes build their own; this is
    /// for running layers outside a pipe (a reference model, a test).
    pub fn new(train: bool, seed: u64, step: u64, len: usize) -> Self {
        Context {
            train,
            seed,
            step,
            layer: 0,
            micro_batch: MicroBatch {
                index: 0,
                offset: 0,
                len,
            },
            micro_batches: 1,
            phase: Phase::Forward,
            checkpointing: false,
            profiling: false,
            defer_weight_grads: false,
            skips: None,
        }
    }

    /// The same context for the layer with global index `layer`.
    pub fn with_layer(mut self, layer: usize) -> Self {
        self.layer = layer;
        self
    }

    /// The same context for another micro-batch.
    pub fn with_micro_batch(mut self, micro_batch: MicroBatch) -> Self {
        self.micro_batch = micro_batch;
        self
    }

    /// The same context in a mini-batch of `count` micro-batches (at least 1).
    pub fn with_micro_batches(mut self, count: usize) -> Self {
        self.micro_batches = count.max(1);
        self
    }

    /// The same context in another phase.
    pub fn with_phase(mut self, phase: Phase) -> Self {
        self.phase = phase;
        self
    }

    /// The same context, marked as the first forward of a checkpointed micro-batch (what
    /// it returns as [`Saved`] will be dropped).
    pub fn with_checkpointing(mut self, checkpointing: bool) -> Self {
        self.checkpointing = checkpointing;
        self
    }

    /// The same context, marked as a profiling call (see [`balance`](crate::balance)):
    /// the layer computes as in training but must leave its running state alone.
    pub fn with_profiling(mut self, profiling: bool) -> Self {
        self.profiling = profiling;
        self
    }

    /// The same context, allowing (or not) a backward call to defer its weight gradients
    /// until [`Layer::flush_grads`] (see [`defers_weight_grads`](Context::defers_weight_grads)).
    pub fn with_deferred_weight_grads(mut self, defer: bool) -> Self {
        self.defer_weight_grads = defer;
        self
    }

    /// Whether this backward call may defer its weight gradients: keep what it needs to
    /// compute them (its input and output gradient) and add them to the parameter
    /// gradients in [`Layer::flush_grads`], which the caller promises to call before
    /// reading the gradients. A [`Pipe`](crate::Pipe) built with
    /// [`defer_weight_grads(true)`](crate::PipeBuilder::defer_weight_grads) sets it in its
    /// backward contexts and flushes each partition after its last backward action of a
    /// run; a layer may ignore it. Default `false`: gradients are added in `backward`.
    pub fn defers_weight_grads(&self) -> bool {
        self.defer_weight_grads && self.phase == Phase::Backward
    }

    /// Training (true) or evaluation (false).
    pub fn is_training(&self) -> bool {
        self.train
    }

    /// The training step number.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The seed of the random streams.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The layer's global index: its position in the sequence the pipe was built from.
    pub fn layer(&self) -> usize {
        self.layer
    }

    /// The micro-batch: its index and the global indices of its samples.
    pub fn micro_batch(&self) -> MicroBatch {
        self.micro_batch
    }

    /// How many micro-batches the mini-batch was split into (the actual number, which
    /// is `min(chunks, batch)`): what deferred batch norm counts to before it commits.
    pub fn micro_batches(&self) -> usize {
        self.micro_batches
    }

    /// The phase.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// Whether this is the first forward pass of a checkpointed micro-batch: its saved state
    /// will be dropped and the forward re-run before backward (torchgpipe's
    /// `is_checkpointing`).
    pub fn is_checkpointing(&self) -> bool {
        self.checkpointing && self.phase == Phase::Forward
    }

    /// Whether this is the re-run (torchgpipe's `is_recomputing`).
    pub fn is_recomputing(&self) -> bool {
        self.phase == Phase::Recompute
    }

    /// Whether this call only profiles the layer (its cost, for balancing).
    pub fn is_profiling(&self) -> bool {
        self.profiling
    }

    /// Whether a layer with running state (batch-norm statistics) should update it: a
    /// first forward pass in training that is not profiling. Recomputations, evaluation
    /// and profiling leave it alone.
    pub fn updates_running_stats(&self) -> bool {
        self.train && self.phase == Phase::Forward && !self.profiling
    }

    /// Whether what `forward` returns as [`Saved`] will be kept for `backward` (training,
    /// not a checkpointed first pass). A layer may skip building its state otherwise.
    pub fn keeps_state(&self) -> bool {
        self.train && !self.is_checkpointing()
    }

    /// This layer's random stream at this step.
    pub fn rng(&self) -> Stream {
        Stream::new(self.seed, self.step, self.layer as u64)
    }

    /// The random stream of row `row` of this micro-batch (its global sample index is
    /// `offset + row`).
    pub fn sample_rng(&self, row: usize) -> SampleStream {
        self.rng().sample((self.micro_batch.offset + row) as u64)
    }

    /// Lends this call a skip tracker (one per micro-batch, per partition in a pipe) and the
    /// layer's declaration. The pipe does this for every layer that declares skips; outside
    /// a pipe (a reference run, a profiler) the caller does, then takes the tracker back
    /// with [`detach_skips`](Context::detach_skips).
    pub fn attach_skips<T: Tensor>(&mut self, tracker: Box<Tracker<T>>, decl: Arc<Declaration>) {
        self.skips = Some(SkipSlot { tracker, decl });
    }

    /// Takes back the tracker lent by [`attach_skips`](Context::attach_skips): `None` if
    /// none is attached or it holds values of another tensor type (then it stays attached).
    pub fn detach_skips<T: Tensor>(&mut self) -> Option<Box<Tracker<T>>> {
        let slot = self.skips.take()?;
        match slot.tracker.downcast::<Tracker<T>>() {
            Ok(tracker) => Some(tracker),
            Err(tracker) => {
                self.skips = Some(SkipSlot {
                    tracker,
                    decl: slot.decl,
                });
                None
            }
        }
    }

    /// Whether a skip tracker is attached.
    pub fn has_skips(&self) -> bool {
        self.skips.is_some()
    }

    fn tracker<T: Tensor>(&mut self) -> Result<(&mut Tracker<T>, &Declaration), Error> {
        let layer = self.layer;
        let slot = self.skips.as_mut().ok_or(Error::NoSkipTracker { layer })?;
        let tracker = slot
            .tracker
            .downcast_mut::<Tracker<T>>()
            .ok_or(Error::SkipType { layer })?;
        Ok((tracker, &slot.decl))
    }

    /// The layer's skip handle for this forward pass (or its recomputation): stash and
    /// pop the names it declared, then [`Skips::finish`]. Errors: no tracker attached
    /// ([`Error::NoSkipTracker`]), called in the backward phase ([`Error::SkipPhase`]),
    /// or the tracker's own checks ([`Error::Skip`]: a declared pop not stashed).
    pub fn skips<T: Tensor>(&mut self) -> Result<Skips<'_, T>, Error> {
        let (layer, phase) = (self.layer, self.phase);
        let (tracker, decl) = self.tracker::<T>()?;
        match phase {
            Phase::Forward => Ok(tracker.forward(layer, decl)?),
            Phase::Recompute => Ok(tracker.recompute(layer, decl)?),
            Phase::Backward => Err(Error::SkipPhase { layer, phase }),
        }
    }

    /// The layer's skip-gradient handle for this backward pass: a popping layer hands in
    /// the gradient of each value it popped, a stashing layer takes the gradient of each
    /// value it stashed and adds it to its input's; then [`Grads::finish`].
    pub fn skip_grads<T: Tensor>(&mut self) -> Result<Grads<'_, T>, Error> {
        let (layer, phase) = (self.layer, self.phase);
        if phase != Phase::Backward {
            return Err(Error::SkipPhase { layer, phase });
        }
        let (tracker, decl) = self.tracker::<T>()?;
        Ok(tracker.backward(layer, decl)?)
    }
}

/// What a layer's `forward` keeps for its `backward`: a list of tensors, counted in bytes
/// through [`Tensor::size_bytes`].
#[derive(Debug, Clone, PartialEq)]
pub struct Saved<T> {
    tensors: Vec<T>,
}

impl<T: Tensor> Saved<T> {
    /// Saves these tensors.
    pub fn new(tensors: Vec<T>) -> Self {
        Saved { tensors }
    }

    /// Saves nothing.
    pub fn none() -> Self {
        Saved {
            tensors: Vec::new(),
        }
    }

    /// The tensors.
    pub fn tensors(&self) -> &[T] {
        &self.tensors
    }

    /// The tensors, by value.
    pub fn into_tensors(self) -> Vec<T> {
        self.tensors
    }

    /// Bytes held.
    pub fn size_bytes(&self) -> usize {
        self.tensors.iter().map(Tensor::size_bytes).sum()
    }
}

/// A parameter and its accumulated gradient.
#[derive(Debug)]
pub struct Param<'a, T> {
    /// Its name within the layer (`"weight"`, `"bias"`).
    pub name: &'static str,
    /// The value.
    pub value: &'a T,
    /// The accumulated gradient.
    pub grad: &'a T,
}

/// A parameter and its gradient, mutably (for an optimizer step).
#[derive(Debug)]
pub struct ParamMut<'a, T> {
    /// Its name within the layer.
    pub name: &'static str,
    /// The value.
    pub value: &'a mut T,
    /// The accumulated gradient.
    pub grad: &'a mut T,
}

/// A layer with an explicit backward pass. `Send`, so a partition can run on its own
/// worker thread.
///
/// Rules a layer keeps, which make pipelining transparent:
/// - `forward` depends only on its input, its parameters, its own state and the context;
///   any randomness comes from [`Context::rng`] / [`Context::sample_rng`].
/// - In [`Phase::Recompute`] it computes exactly what it computed in [`Phase::Forward`] and
///   updates no running state (batch-norm statistics).
/// - `backward` adds its parameter gradients into the layer (never overwrites them) and
///   returns one gradient item per input item ([`Item::None`](crate::Item::None) where an
///   input has none). Where its context allows it ([`Context::defers_weight_grads`]), it
///   may instead keep what the gradients need and add them in
///   [`flush_grads`](Layer::flush_grads), in the order its backward calls came, so that
///   the sums are the same as if each call had added its own.
pub trait Layer<T: Tensor>: Send {
    /// Computes the output and the state `backward` needs.
    fn forward(
        &mut self,
        input: Batch<T>,
        ctx: &mut Context,
    ) -> Result<(Batch<T>, Saved<T>), Error>;

    /// Computes the input gradient from the output gradient and the saved state, and
    /// accumulates parameter gradients.
    fn backward(
        &mut self,
        grad_output: Batch<T>,
        saved: Saved<T>,
        ctx: &mut Context,
    ) -> Result<Batch<T>, Error>;

    /// A short name for error messages; by default the type's name without its path.
    fn name(&self) -> &str {
        short_type_name(std::any::type_name::<Self>())
    }

    /// The parameters with their gradients, in a fixed order. Default: none.
    fn parameters(&self) -> Vec<Param<'_, T>> {
        Vec::new()
    }

    /// The parameters with their gradients, mutably, in the same order. Default: none.
    fn parameters_mut(&mut self) -> Vec<ParamMut<'_, T>> {
        Vec::new()
    }

    /// Sets the accumulated gradients to zero, and drops any deferred gradient work (see
    /// [`flush_grads`](Layer::flush_grads)). Default: nothing to do.
    fn zero_grad(&mut self) {}

    /// Adds every parameter gradient deferred by backward calls whose context allowed it
    /// ([`Context::defers_weight_grads`]), and lets go of what was kept for them. A layer
    /// can then compute them as one product over all the micro-batches' rows instead of one
    /// per micro-batch. The pipe calls it on each layer of a partition right after the
    /// partition's last backward action of a run (before
    /// [`on_gradients_final`](crate::Pipe::on_gradients_final)'s callback), and after a
    /// failed run. Default: nothing deferred.
    fn flush_grads(&mut self) -> Result<(), Error> {
        Ok(())
    }

    /// Adds the weight gradients of the oldest call whose gradients are still deferred, and
    /// forgets it: the `W` action of a zero-bubble schedule
    /// ([`Pass::WeightGrad`](crate::Pass::WeightGrad)), which completes the stage's
    /// input-gradient actions one by one, in their order. The sums must be those its
    /// backward would have added. The default flushes everything deferred
    /// ([`flush_grads`](Layer::flush_grads)): right for a layer that defers nothing, or one
    /// call at a time.
    fn flush_first_grad(&mut self) -> Result<(), Error> {
        self.flush_grads()
    }

    /// Bytes kept for deferred gradients (see [`flush_grads`](Layer::flush_grads)), counted
    /// through [`Tensor::size_bytes`]; the pipe counts them as held memory. Default: 0.
    fn deferred_bytes(&self) -> usize {
        0
    }

    /// The skips this layer stashes and pops (torchgpipe's `@skippable`), fixed before any
    /// run: the pipe reads it once when it is built, verifies the whole sequence and
    /// routes each skip from its stashing partition to its popping one. A layer that
    /// declares skips reaches them through [`Context::skips`] and
    /// [`Context::skip_grads`]. Default: none.
    fn skips(&self) -> Declaration {
        Declaration::new()
    }

    /// Switches a batch-norm layer to deferred running statistics (torchgpipe's
    /// `DeferredBatchNorm`): accumulated over every micro-batch of a mini-batch and
    /// committed once per mini-batch, so they equal plain batch norm's over the whole
    /// batch. Returns whether the layer has running statistics to defer. The pipe calls it
    /// on every layer when built with
    /// [`deferred_batch_norm(true)`](crate::PipeBuilder::deferred_batch_norm). Default: not
    /// a batch norm, `false`.
    fn defer_batch_norm(&mut self) -> bool {
        false
    }
}

fn short_type_name(full: &str) -> &str {
    let base = full.split('<').next().unwrap_or(full);
    base.rsplit("::").next().unwrap_or(base)
}

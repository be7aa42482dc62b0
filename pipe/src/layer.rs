//! The layer trait with an explicit backward pass, its saved state, and the per-call
//! [`Context`].
//!
//! There is no autograd: a layer's `forward` returns its output together with whatever its
//! `backward` will need ([`Saved`]), and `backward` turns the output gradient and that state
//! into the input gradient, accumulating parameter gradients inside the layer. The pipeline
//! decides what to keep: the saved state (no checkpoint), only the stage's input
//! (checkpoint: `forward` is re-run with the same context before `backward`), or nothing
//! (evaluation).

use crate::error::Error;
use crate::microbatch::{Batch, MicroBatch};
use crate::rng::{SampleStream, Stream};
use crate::tensor::Tensor;

/// Which pass a layer call belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// The first forward pass of a micro-batch.
    Forward,
    /// A checkpointed micro-batch's forward pass, re-run just before its backward pass.
    /// Draws the same random numbers as the first; must not update running statistics.
    Recompute,
    /// The backward pass.
    Backward,
}

/// What a layer call may know about its circumstances: train or eval, the step, its
/// global layer index, the micro-batch, the phase, and the random stream keyed by those.
///
/// The random stream depends on (seed, step, global layer index, global sample index) only,
/// never on the chunking, the balance, the schedule or the phase, so a recomputed forward
/// draws exactly what the first one drew.
///
/// Later additions (the skip handle of the `skip` integration) arrive as new accessors;
/// layers take the context as `&mut Context`, so they can be handed mutable per-call state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Context {
    train: bool,
    seed: u64,
    step: u64,
    layer: usize,
    micro_batch: MicroBatch,
    phase: Phase,
    checkpointing: bool,
}

impl Context {
    /// A context for a forward call of layer 0 on a micro-batch of `len` samples starting
    /// at sample 0. Pipes build their own; this is for running layers outside a pipe (a
    /// reference model, a test).
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
            phase: Phase::Forward,
            checkpointing: false,
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
///   input has none).
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

    /// Sets the accumulated gradients to zero. Default: nothing to do.
    fn zero_grad(&mut self) {}
}

fn short_type_name(full: &str) -> &str {
    let base = full.split('<').next().unwrap_or(full);
    base.rsplit("::").next().unwrap_or(base)
}

//! Checkpointing: what a micro-batch keeps on a stage between its forward and its backward,
//! and running a stage's layers forward, again (recompute) and backward.
//!
//! A micro-batch below the checkpoint stop keeps only the stage's input; its backward first
//! re-runs the stage's forward with the same contexts, which draw the same random numbers
//! (see [`Context`]), so the recomputed state is bit-identical to the state that was
//! dropped. Other micro-batches keep every layer's [`Saved`] state. Evaluation keeps
//! nothing.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use skip::{Declaration, Tracker};

use crate::error::{Error, Site};
use crate::layer::{Context, Layer, Saved};
use crate::microbatch::{Batch, MicroBatch};
use crate::tensor::Tensor;
use crate::vocab::Action;
use crate::vocab::Phase;
use crate::vocab::Task;

/// When to checkpoint (torchgpipe's `checkpoint` argument).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Checkpoint {
    /// Every micro-batch: least memory, every forward computed twice.
    Always,
    /// Every micro-batch but the last, whose activations backward would need right away.
    #[default]
    ExceptLast,
    /// None: every activation kept until its backward.
    Never,
}

impl Checkpoint {
    /// The checkpoint stop for `micro_batches` actual micro-batches in training: micro-batch
    /// `i` is checkpointed iff `i < stop`. Uses the actual count (not `chunks`), so
    /// `except_last` never checkpoints everything because the batch was small.
    pub fn stop(self, micro_batches: usize) -> usize {
        match self {
            Checkpoint::Always => micro_batches,
            Checkpoint::ExceptLast => micro_batches.saturating_sub(1),
            Checkpoint::Never => 0,
        }
    }
}

impl std::str::FromStr for Checkpoint {
    type Err = Error;

    /// `"always"`, `"except_last"` or `"never"`.
    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "always" => Ok(Checkpoint::Always),
            "except_last" => Ok(Checkpoint::ExceptLast),
            "never" => Ok(Checkpoint::Never),
            other => Err(Error::CheckpointMode(other.to_string())),
        }
    }
}

impl std::fmt::Display for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Checkpoint::Always => "always",
            Checkpoint::ExceptLast => "except_last",
            Checkpoint::Never => "never",
        })
    }
}

/// What a forward keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Keep {
    /// Every layer's saved state.
    Saved,
    /// The stage's input only (checkpointed).
    Input,
    /// Nothing (evaluation).
    Nothing,
}

/// What a micro-batch holds on a stage between its forward and its backward.
#[derive(Debug)]
pub(crate) enum Kept<T> {
    /// Every layer's saved state, in layer order.
    Saved(Vec<Saved<T>>),
    /// The stage's input, to recompute from.
    Input(Batch<T>),
}

impl<T: Tensor> Kept<T> {
    pub(crate) fn size_bytes(&self) -> usize {
        match self {
            Kept::Saved(saved) => saved.iter().map(Saved::size_bytes).sum(),
            Kept::Input(input) => input.size_bytes(),
        }
    }
}

/// A stage's layers and what a call on them needs to build each layer's [`Context`].
pub(crate) struct StageCall<'s, T> {
    pub stage: usize,
    /// Global index of the stage's first layer.
    pub first_layer: usize,
    pub layers: &'s mut [Box<dyn Layer<T>>],
    /// Per layer of the stage, its skip declaration if it has one.
    pub decls: &'s [Option<Arc<Declaration>>],
    /// The micro-batch's skip tracker on this stage, lent to each layer that declares
    /// skips; the caller takes it back after the call.
    pub tracker: Option<Box<Tracker<T>>>,
    pub train: bool,
    pub seed: u64,
    pub step: u64,
    pub micro_batch: MicroBatch,
    /// The number of micro-batches of the mini-batch.
    pub micro_batches: usize,
    /// Whether backward calls may defer their weight gradients until the stage is flushed
    /// ([`flush`]).
    pub defer_weight_grads: bool,
}

impl<T: Tensor> StageCall<'_, T> {
    fn context(&self, l: usize, phase: Phase, checkpointing: bool) -> Context {
        Context::new(self.train, self.seed, self.step, self.micro_batch.len)
            .with_layer(self.first_layer + l)
            .with_micro_batch(self.micro_batch)
            .with_micro_batches(self.micro_batches)
            .with_phase(phase)
            .with_checkpointing(checkpointing)
            .with_deferred_weight_grads(self.defer_weight_grads)
    }

    /// Lends the tracker to layer `l`'s context if the layer declares skips.
    fn lend(&mut self, l: usize, ctx: &mut Context) {
        if let Some(decl) = self.decls.get(l).and_then(Option::as_ref) {
            if let Some(tracker) = self.tracker.take() {
                ctx.attach_skips(tracker, Arc::clone(decl));
            }
        }
    }

    /// Takes the tracker back from a context it was lent to (also after a failure).
    fn take_back(&mut self, ctx: &mut Context) {
        if let Some(tracker) = ctx.detach_skips::<T>() {
            self.tracker = Some(tracker);
        }
    }

    fn site(&self, l: usize, task: Task) -> Site {
        Site {
            partition: self.stage,
            layer: Some((self.first_layer + l, self.layers[l].name().to_string())),
            micro_batch: Some(self.micro_batch.index),
            task,
        }
    }

    /// Runs the stage forward, keeping what `keep` says.
    pub fn forward(
        &mut self,
        input: Batch<T>,
        keep: Keep,
    ) -> Result<(Batch<T>, Option<Kept<T>>), Error> {
        let kept_input = (keep == Keep::Input).then(|| input.clone());
        let (output, saved) = self.run_forward(input, Phase::Forward, keep)?;
        let kept = match keep {
            Keep::Saved => Some(Kept::Saved(saved)),
            Keep::Input => kept_input.map(Kept::Input),
            Keep::Nothing => None,
        };
        Ok((output, kept))
    }

    /// Re-runs a checkpointed micro-batch's forward from its kept input, for the state its
    /// backward needs.
    pub fn recompute(&mut self, input: Batch<T>) -> Result<Vec<Saved<T>>, Error> {
        self.run_forward(input, Phase::Recompute, Keep::Saved)
            .map(|(_, saved)| saved)
    }

    fn run_forward(
        &mut self,
        input: Batch<T>,
        phase: Phase,
        keep: Keep,
    ) -> Result<(Batch<T>, Vec<Saved<T>>), Error> {
        // Only ever `Forward` or `Recompute`.
        let task = Task::from(phase);
        let mut saved = Vec::with_capacity(if keep == Keep::Saved {
            self.layers.len()
        } else {
            0
        });
        let mut x = input;
        for l in 0..self.layers.len() {
            let mut ctx = self.context(l, phase, keep == Keep::Input);
            self.lend(l, &mut ctx);
            let layer = &mut self.layers[l];
            let result = guard(|| layer.forward(x, &mut ctx));
            self.take_back(&mut ctx);
            let (y, state) = result.map_err(|e| e.at(self.site(l, task)))?;
            if keep == Keep::Saved {
                saved.push(state);
            }
            x = y;
        }
        Ok((x, saved))
    }

    /// Runs the stage backward from the output gradient and every layer's saved state.
    pub fn backward(
        &mut self,
        grad_output: Batch<T>,
        mut saved: Vec<Saved<T>>,
    ) -> Result<Batch<T>, Error> {
        let mut g = grad_output;
        for l in (0..self.layers.len()).rev() {
            let state = saved.pop().unwrap_or_else(Saved::none);
            let mut ctx = self.context(l, Phase::Backward, false);
            self.lend(l, &mut ctx);
            let layer = &mut self.layers[l];
            let result = guard(|| layer.backward(g, state, &mut ctx));
            self.take_back(&mut ctx);
            g = result.map_err(|e| e.at(self.site(l, Task::Backward)))?;
        }
        Ok(g)
    }
}

/// Adds the weight gradients the `layers` of `stage` (global index of the first:
/// `first_layer`) deferred ([`Layer::flush_grads`]); a failure names the layer, as a
/// backward task.
pub(crate) fn flush<T: Tensor>(
    stage: usize,
    first_layer: usize,
    layers: &mut [Box<dyn Layer<T>>],
) -> Result<(), Error> {
    for (l, layer) in layers.iter_mut().enumerate() {
        guard(|| layer.flush_grads()).map_err(|fault| {
            fault.at(Site {
                partition: stage,
                layer: Some((first_layer + l, layer.name().to_string())),
                micro_batch: None,
                task: Task::Backward,
            })
        })?;
    }
    Ok(())
}

/// A weight-gradient action's work: every layer adds the weight gradients of its oldest
/// deferred call ([`Layer::flush_first_grad`]); a failure names the layer and the
/// micro-batch.
pub(crate) fn flush_first<T: Tensor>(
    action: Action,
    first_layer: usize,
    layers: &mut [Box<dyn Layer<T>>],
) -> Result<(), Error> {
    for (l, layer) in layers.iter_mut().enumerate() {
        guard(|| layer.flush_first_grad()).map_err(|fault| {
            fault.at(Site {
                partition: action.stage,
                layer: Some((first_layer + l, layer.name().to_string())),
                micro_batch: Some(action.micro_batch),
                task: Task::Backward,
            })
        })?;
    }
    Ok(())
}

/// Bytes the layers keep for deferred weight gradients.
pub(crate) fn deferred_bytes<T: Tensor>(layers: &[Box<dyn Layer<T>>]) -> usize {
    layers.iter().map(|l| l.deferred_bytes()).sum()
}

/// A failure inside a guarded call, before its site is known.
pub(crate) enum Fault {
    Error(Error),
    Panic(String),
}

impl Fault {
    pub(crate) fn at(self, site: Site) -> Error {
        match self {
            Fault::Error(source) => Error::Failed {
                site,
                source: Box::new(source),
            },
            Fault::Panic(message) => Error::Panicked { site, message },
        }
    }
}

/// Runs user code (a layer, the loss, a callback), turning a panic into a [`Fault`].
pub(crate) fn guard<R>(f: impl FnOnce() -> Result<R, Error>) -> Result<R, Fault> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(r)) => Ok(r),
        Ok(Err(e)) => Err(Fault::Error(e)),
        Err(payload) => Err(Fault::Panic(panic_message(payload.as_ref()))),
    }
}

pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-string panic payload".to_string())
}

//! The `CommHook` trait and the simple hooks: allreduce, fp16/bf16 compression, noop.
//! Also what every hook reports through the trait: its saved state ([`HookState`]), its
//! compression statistics ([`CompressionStats`]) and its iteration.

use crate::{CommBackend, Error, GradBucket, PowerSgdState, Result};
use collectives::{ProcessGroup, ReduceOp, Work};
use lowrank::Backend;
use serde::{Deserialize, Serialize};
use std::marker::PhantomData;
use std::sync::Arc;

/// A DDP communication hook: called once per bucket per synchronised step, it returns
/// at once a work that completes with the bucket's reduced gradients (the mean over the
/// ranks, or an approximation of it). Stateful hooks own their state.
///
/// Besides [`name`](Self::name) and [`run`](Self::run), a hook reports its state, its
/// statistics and its iteration, so a hook known only as `Box<dyn CommHook<B>>` (as
/// [`HookSpec::build`](crate::HookSpec::build) returns it) can be checkpointed and
/// watched without downcasting. Every hook of this crate implements all of them; the
/// defaults let hooks written elsewhere compile unchanged: they report no statistics
/// and no iteration, and refuse to save or load (a hook that keeps state must say how).
/// A hook that wraps another must forward all of them.
///
/// Errors a hook returns through its work (a bad bucket, a state that does not fit)
/// travel as [`collectives::Error::Hook`]; [`Error::from_comm`] (or `Error::from`) gives
/// them back typed.
pub trait CommHook<B: Backend>: Send {
    /// The hook's name, as the registry spells it.
    fn name(&self) -> String;

    /// Starts reducing `bucket`.
    fn run(&mut self, bucket: GradBucket<B>) -> Work<B::Buffer<f32>>;

    /// Everything the hook needs to continue exactly where it is, except its process
    /// group, on the host (serde-serialisable). Call it between steps: a step still in
    /// flight is an [`Error::Bucket`] naming the bucket.
    ///
    /// The default refuses with [`Error::State`].
    fn save_state(&self) -> Result<HookState> {
        Err(Error::State(format!(
            "the hook `{}` does not implement `CommHook::save_state` (a hook that wraps another must forward it)",
            self.name()
        )))
    }

    /// Continues from `state`, saved by a hook of the same kind and configuration
    /// (possibly over another process group, as in PyTorch), replacing this hook's state.
    /// A state of another hook or configuration, or one that does not fit, is
    /// [`Error::State`] and leaves the hook unchanged; so is a step still in flight
    /// ([`Error::Bucket`]).
    ///
    /// The default refuses with [`Error::State`].
    fn load_state(&self, state: HookState) -> Result<()> {
        let _ = state;
        Err(Error::State(format!(
            "the hook `{}` does not implement `CommHook::load_state` (a hook that wraps another must forward it)",
            self.name()
        )))
    }

    /// The compression statistics over every compressed step so far, for hooks that
    /// keep them (PowerSGD); `None` for the others (the default).
    fn compression_stats(&self) -> Option<CompressionStats> {
        None
    }

    /// Synchronised steps seen so far (PyTorch's `state.iter`), for hooks that count
    /// them (PowerSGD); `None` for the others (the default).
    fn iteration(&self) -> Option<u64> {
        None
    }
}

/// A hook's saved state ([`CommHook::save_state`]): serde-serialisable, loaded back with
/// [`CommHook::load_state`] into a hook of the same kind and configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum HookState {
    /// A hook that keeps nothing between steps (`allreduce`, `fp16`, `bf16`, `noop`):
    /// its name, so a state is never loaded into a hook of another kind.
    Stateless {
        /// The hook's [`CommHook::name`].
        hook: String,
    },
    /// [`PowerSgd`](crate::PowerSgd)'s state (see [`PowerSgdState`] for how its memories
    /// map to each bucket's parameters).
    PowerSgd(Box<PowerSgdState>),
    /// [`BatchedPowerSgd`](crate::BatchedPowerSgd)'s state: the same type, with each
    /// bucket's memories laid out as the batched hook's padded square matrix (see
    /// [`SavedBucket`](crate::powersgd::SavedBucket)).
    BatchedPowerSgd(Box<PowerSgdState>),
    /// [`PostLocalSgd`](crate::averaging::PostLocalSgd)'s state: its configuration and
    /// iteration.
    PostLocalSgd(crate::averaging::PostLocalSgdState),
    /// The error feedback of a quantisation hook
    /// ([`QuantizePerTensor`](crate::QuantizePerTensor),
    /// [`QuantizePerChannel`](crate::QuantizePerChannel)) that keeps it; without error
    /// feedback they are [`Stateless`](Self::Stateless).
    Quantize {
        /// The hook's [`CommHook::name`], which is its configuration (kind, row length,
        /// error feedback): a state loads only into a hook of the same name.
        hook: String,
        /// Per bucket index, the memory `e`: one `f32` per bucket element, in bucket
        /// order (the bucket's length).
        buckets: std::collections::BTreeMap<usize, Vec<f32>>,
    },
}

impl HookState {
    /// The kind of hook that saved this state, for error messages.
    fn kind(&self) -> String {
        match self {
            HookState::Stateless { hook } => format!("the stateless hook `{hook}`"),
            HookState::PowerSgd(_) => "PowerSGD".into(),
            HookState::BatchedPowerSgd(_) => "batched PowerSGD".into(),
            HookState::PostLocalSgd(_) => "post-local SGD".into(),
            HookState::Quantize { hook, .. } => format!("the quantisation hook `{hook}`"),
        }
    }

    /// [`Error::State`] for a state loaded into a hook of another kind.
    pub(crate) fn mismatch(&self, into: &str) -> Error {
        Error::State(format!(
            "a state saved by {} cannot be loaded into {into}",
            self.kind()
        ))
    }
}

/// Elements before and after compression over every compressed step so far (PyTorch's
/// `compression_stats()`, whose tuple is `(ratio, before, after)`). The counters start at
/// the first compressed step, are never reset, and saturate at `u64::MAX`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CompressionStats {
    /// Elements the compressed steps would have sent uncompressed.
    pub before: u64,
    /// Elements they sent (factors, and uncompressed tensors whole).
    pub after: u64,
    /// `before / after`; 0 before the first compressed step (`after == 0`).
    pub ratio: f64,
    /// Compressed bucket steps that met a NaN or an infinity in their reduced values (an
    /// overflow step of mixed-precision training): their output was non-finite, so a loss
    /// scaler skips the optimizer step, and the hook's memories were left as before the
    /// step. Counted by the PowerSGD hooks; 0 for the others and in a state saved before
    /// it was counted.
    #[serde(default)]
    pub nonfinite_steps: u64,
}

impl CompressionStats {
    /// The statistics of `before` and `after` elements, with their ratio (and no held
    /// step).
    pub fn new(before: u64, after: u64) -> Self {
        let ratio = if after > 0 {
            before as f64 / after as f64
        } else {
            0.0
        };
        CompressionStats {
            before,
            after,
            ratio,
            nonfinite_steps: 0,
        }
    }
}

/// `save_state` of a hook that keeps nothing between steps.
fn save_stateless<B: Backend>(hook: &(impl CommHook<B> + ?Sized)) -> Result<HookState> {
    Ok(HookState::Stateless { hook: hook.name() })
}

/// `load_state` of a hook that keeps nothing: accepts only its own kind's state.
fn load_stateless<B: Backend>(hook: &(impl CommHook<B> + ?Sized), state: HookState) -> Result<()> {
    let name = hook.name();
    match state {
        HookState::Stateless { hook } if hook == name => Ok(()),
        other => Err(other.mismatch(&format!("the stateless hook `{name}`"))),
    }
}

/// Averages the bucket exactly over the ranks (PyTorch's `allreduce_hook`, which DDP
/// without a hook also does). The mean is taken as the group's `Avg` (a sum, then one
/// division) where PyTorch divides each rank's bucket first: the rounding differs in the
/// last place, and gradients within a factor of the world size of `f32::MAX` overflow to
/// infinity here where PyTorch's would not.
pub struct AllReduce<B> {
    backend: Arc<B>,
    group: Arc<dyn ProcessGroup>,
}

impl<B: CommBackend> AllReduce<B> {
    /// The hook over `group`.
    pub fn new(backend: Arc<B>, group: Arc<dyn ProcessGroup>) -> Self {
        AllReduce { backend, group }
    }
}

impl<B: CommBackend> CommHook<B> for AllReduce<B> {
    fn name(&self) -> String {
        "allreduce".into()
    }
    fn run(&mut self, bucket: GradBucket<B>) -> Work<B::Buffer<f32>> {
        self.backend
            .all_reduce(&*self.group, bucket.into_buffer(), ReduceOp::Avg)
    }
    fn save_state(&self) -> Result<HookState> {
        save_stateless(self)
    }
    fn load_state(&self, state: HookState) -> Result<()> {
        load_stateless(self, state)
    }
}

/// A 16-bit format for [`Compress`]: `collectives`' [`WireFormat`](collectives::WireFormat)
/// ([`f16`](half::f16), [`bf16`](half::bf16)), under the name this crate gave it first.
pub use collectives::WireFormat as HalfFormat;

/// Sends the bucket in a 16-bit format and averages it (PyTorch's `fp16_compress_hook`
/// and `bf16_compress_hook`): half the bytes, within that format's precision. The thread
/// backend accumulates the sum in `f32` and rounds once, so it never overflows where
/// PyTorch pre-divides to avoid that.
///
/// It is [`AllReduce`] over a [`HalfWire`](collectives::HalfWire) group (the one 16-bit
/// path): host buffers go to the group's [`ProcessGroup::all_reduce_wire`] (a network
/// backend narrows, sends 16 bits and widens; the thread backend fuses the rounding into
/// its reduction pass: same bits, no cast passes); the CUDA bridge casts device buffers
/// on the device and hands the group 16-bit device buffers
/// ([`ProcessGroup::narrowed`]).
pub struct Compress<B, H> {
    inner: AllReduce<B>,
    _format: PhantomData<fn() -> H>,
}

impl<B: CommBackend, H: HalfFormat> Compress<B, H> {
    /// The hook over `group`.
    pub fn new(backend: Arc<B>, group: Arc<dyn ProcessGroup>) -> Self {
        Compress {
            inner: AllReduce::new(backend, Arc::new(collectives::HalfWire::<H>::new(group))),
            _format: PhantomData,
        }
    }
}

impl<B: CommBackend, H: HalfFormat> CommHook<B> for Compress<B, H> {
    fn name(&self) -> String {
        H::HOOK.into()
    }

    fn run(&mut self, bucket: GradBucket<B>) -> Work<B::Buffer<f32>> {
        self.inner.run(bucket)
    }

    fn save_state(&self) -> Result<HookState> {
        save_stateless(self)
    }
    fn load_state(&self, state: HookState) -> Result<()> {
        load_stateless(self, state)
    }
}

/// Returns the bucket unchanged, communicating nothing (PyTorch's `noop_hook`): for
/// measuring how much of a step is communication.
pub struct Noop<B>(PhantomData<fn() -> B>);

impl<B> Noop<B> {
    /// The hook.
    pub fn new() -> Self {
        Noop(PhantomData)
    }
}

impl<B> Default for Noop<B> {
    fn default() -> Self {
        Self::new()
    }
}

impl<B: Backend> CommHook<B> for Noop<B> {
    fn name(&self) -> String {
        "noop".into()
    }
    fn run(&mut self, bucket: GradBucket<B>) -> Work<B::Buffer<f32>> {
        Work::ready(Ok(bucket.into_buffer()))
    }
    fn save_state(&self) -> Result<HookState> {
        save_stateless(self)
    }
    fn load_state(&self, state: HookState) -> Result<()> {
        load_stateless(self, state)
    }
}

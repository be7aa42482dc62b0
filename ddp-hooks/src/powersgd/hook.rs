//! The per-layer PowerSGD hook: its public face. Its bucket memory is in `memory.rs`,
//! the step itself in `step.rs`, the machinery both hooks share in `core.rs`.

use super::config::PowerSgdConfig;
use super::core::{comm_hook, Core};
use super::memory::{Factors, LayerMemory};
use super::state::{check_saved_layout, PowerSgdState};
use crate::{CommBackend, CompressionStats, GradBucket, Result};
use collectives::{ProcessGroup, Work};
use std::collections::BTreeMap;
use std::sync::Arc;

/// The PowerSGD hook: owns its state (a [`PowerSgdState`] when saved) and reduces every
/// bucket it is given over its process group.
///
/// Each step calls each kernel once per tensor, or once per shape with
/// [`PowerSgdConfig::batch_tensors_with_same_shape`] (the same results; see that field
/// for the copies it may make and where it pays). Off by default, as in PyTorch; left
/// unset (`None`, "auto"), the flag takes the backend's choice, resolved when the hook
/// is built ([`PowerSgd::batches_same_shape`]).
///
/// **Buckets run side by side.** A step holds its bucket's memory for itself while it
/// runs and takes the hook's lock only to take and return it: the kernels of bucket `k`'s
/// decompression and of bucket `k + 1`'s products run at the same time on different
/// threads.
///
/// **A failed step fails alone.** When a collective fails (or a kernel fails between two
/// collectives), the step's work returns that error, and the bucket's memories are left
/// exactly as before the step: the error feedback is only updated by a step's last
/// continuation, and a step computes and all-reduces its own `P` and `Q` buffers, copied
/// into the warm-start memory only when it succeeds. So the next step of the bucket
/// works, [`PowerSgd::save`] and [`CommHook::load_state`](crate::CommHook::load_state)
/// work, and with warm start the following steps are those of a run that never saw the
/// failed step (its gradient is dropped, as in PyTorch, whose memories keep their tensors
/// when the hook raises). What the failed step did change: its compression statistics
/// are counted (PyTorch counts them before communicating) and, at a bucket's first
/// compressed step or without warm start, its random draw of `Q` is consumed; without
/// warm start the drawn `Q` is then dropped, as after a completed step. The iteration is
/// not counted, as in PyTorch (it is counted after decompression). Every rank sees a
/// failed collective fail, and every rank recovers the same way, so the ranks stay
/// consistent. (A kernel failure *during* decompression, a bug rather than a
/// communication failure, may leave the error of the batches before it updated.)
///
/// **A non-finite step is held.** A step whose reduced values hold a NaN or an infinity
/// (any rank's gradient did: an overflow step of mixed-precision training) outputs
/// non-finite values, so a loss scaler sees the overflow and skips the optimizer step as
/// `torch.cuda.amp.GradScaler` does, and leaves the bucket's error feedback, `P` and `Q`
/// exactly as before the step: the next finite step compresses as if the held one had
/// never happened. (PyTorch's hook instead writes the NaN into its error memory, and every
/// later step's output is NaN.) The decision is made where the data is, from a flag the
/// step raises on the reduced `P̂`, `Q` and uncompressed means, which are the same on
/// every rank, so every rank holds the same steps; on a GPU the flag never leaves the
/// device within the step. What a held step still changes: its statistics and the
/// iteration are counted (the step happened; [`PowerSgd::iteration`] stays PyTorch's
/// count), and at a bucket's first compressed step or without warm start its random draw
/// of `Q` is consumed, as after a failed step. Each held step is counted
/// ([`CompressionStats::nonfinite_steps`]) and logged with a `tracing` warning: at once on
/// the CPU; on a device backend when the statistics are next read. The hold is per
/// bucket: buckets of the same step whose values were finite update their memories (a
/// bucket is reduced before the later buckets' gradients exist).
pub struct PowerSgd<B: CommBackend> {
    pub(super) core: Core<B, LayerMemory<B>>,
    /// `batch_tensors_with_same_shape` resolved on the backend at construction; loading
    /// a state does not change it.
    pub(super) batch: bool,
}

impl<B: CommBackend> PowerSgd<B> {
    /// The name in hook specs and [`CommHook::name`](crate::CommHook::name).
    const SPEC_NAME: &'static str = "powersgd";

    /// A hook with `config` (validated) over `group`. An unset
    /// `batch_tensors_with_same_shape` is resolved here, on `backend`
    /// ([`PowerSgdConfig::batches_with`]); [`PowerSgd::config`] still reports it unset.
    pub fn new(
        backend: Arc<B>,
        group: Arc<dyn ProcessGroup>,
        config: PowerSgdConfig,
    ) -> Result<Self> {
        config.validate()?;
        let batch = config.batches_with(&*backend);
        tracing::info!(?config, batch_same_shape = batch, "PowerSGD hook");
        Ok(PowerSgd {
            core: Core::new(backend, group, config),
            batch,
        })
    }

    /// The hyperparameters, as given (an unset `batch_tensors_with_same_shape` stays
    /// `None`; [`PowerSgd::batches_same_shape`] says what it resolved to).
    pub fn config(&self) -> PowerSgdConfig {
        self.core.config()
    }

    /// Whether this hook batches same-shape tensors: `batch_tensors_with_same_shape` as
    /// configured, or, unset, the backend's choice ([`PowerSgdConfig::batches_on`]: on
    /// for CUDA, off on the CPU). Fixed when the hook is built; loading a state with
    /// [`CommHook::load_state`](crate::CommHook::load_state) keeps it.
    pub fn batches_same_shape(&self) -> bool {
        self.batch
    }

    /// Synchronised steps seen so far (PyTorch's `state.iter`).
    pub fn iteration(&self) -> u64 {
        self.core.iteration()
    }

    /// Elements before and after compression over all compressed steps, and their
    /// ratio (0 before the first compressed step), as PyTorch's `compression_stats()`;
    /// and the compressed bucket steps that met a NaN or an infinity and were held
    /// ([`CompressionStats::nonfinite_steps`], see [`PowerSgd`]). On a device backend the
    /// count is read from the device here (a wait for the work already issued).
    pub fn compression_stats(&self) -> CompressionStats {
        self.core.compression_stats()
    }

    /// The whole state except the process group, on the host. A memory holding a NaN
    /// or an infinity is [`Error::NonFinite`](crate::Error::NonFinite): such a state is
    /// corrupt and would not load. A step still in flight is
    /// [`Error::Bucket`](crate::Error::Bucket); after a failed step (its work has
    /// returned the error) the state saves as it was before that step (see [`PowerSgd`]).
    pub fn save(&self) -> Result<PowerSgdState> {
        self.core.save()
    }

    /// A hook that continues from `state` over `group` (which may differ from the group
    /// the state was saved with, as in PyTorch), with the state's configuration (an unset
    /// `batch_tensors_with_same_shape` is resolved on `backend`, as in [`PowerSgd::new`]).
    /// The state is checked first ([`PowerSgdState::validate`]): a NaN or an infinity is
    /// [`Error::NonFinite`](crate::Error::NonFinite); a bucket whose recorded layout
    /// ([`SavedBucket::layout`](super::SavedBucket::layout)) does not give its saved length and memory sizes is
    /// [`Error::State`](crate::Error::State).
    /// [`CommHook::load_state`](crate::CommHook::load_state) instead loads into a hook
    /// whose configuration must match, except `batch_tensors_with_same_shape`, which it
    /// keeps.
    ///
    /// Each bucket's memories apply only to the layout they were built for: the first
    /// compressed step of a bucket whose parameter shapes differ from the recorded ones
    /// is [`Error::Bucket`](crate::Error::Bucket) naming the bucket and both layouts, even
    /// at the same length and memory sizes (a state saved without a recorded layout is
    /// not checked).
    pub fn load(
        backend: Arc<B>,
        group: Arc<dyn ProcessGroup>,
        state: PowerSgdState,
    ) -> Result<Self> {
        let hook = PowerSgd::new(backend, group, state.config.clone())?;
        hook.restore(state)?;
        Ok(hook)
    }

    /// Replaces this hook's state with `state` (see [`Core::restore`]). Each bucket's
    /// recorded layout must fit its saved memories ([`check_saved_layout`]) and is kept:
    /// the bucket's next step checks it against the bucket it is given.
    fn restore(&self, state: PowerSgdState) -> Result<()> {
        self.core.restore(state, |be, config, state| {
            let mut memory = BTreeMap::new();
            for (&index, saved) in &state.buckets {
                if let Some(shapes) = &saved.layout {
                    check_saved_layout(config, index, saved, shapes)?;
                }
                let mut m = LayerMemory::empty(saved.len);
                m.layout = saved.layout.clone();
                if !saved.error.is_empty() {
                    m.error = Some(be.upload(&saved.error)?);
                }
                if !saved.p.is_empty() || !saved.q.is_empty() {
                    m.factors = Some(Factors {
                        p: be.upload(&saved.p)?,
                        q: be.upload(&saved.q)?,
                    });
                }
                // In the saved order until the bucket's next step (`order` unset).
                memory.insert(index, m);
            }
            Ok(memory)
        })
    }

    /// Starts one bucket's reduction ([`super::step::start`]).
    fn start(&self, bucket: GradBucket<B>) -> Result<Work<B::Buffer<f32>>> {
        super::step::start(&self.core, self.batch, bucket)
    }
}

comm_hook!(PowerSgd, PowerSgd, "a PowerSGD hook");

//! What both PowerSGD hooks share: the state behind one lock (the progress, each
//! bucket's memory, the held-step counters), the lease through which a step owns its
//! bucket's memory, saving and restoring, and the `CommHook` impl.
//!
//! **One memory value per bucket, leased for the step.** A compressed step takes its
//! bucket's memory out of [`Shared::memory`] ([`Core::lease`]), works on it with no lock
//! held (other buckets' steps run their kernels meanwhile, on any thread), and puts it
//! back when it ends ([`Lease::finish`]). The lease travels with the step's collectives;
//! if a collective fails, the continuation that held it is dropped and the lease puts
//! the memory back as it was ([`Lease`]'s `Drop`), so a failed step fails alone. A lock
//! is held only to take or return a memory (and to count or draw from the random stream).

use super::config::PowerSgdConfig;
use super::progress::{count_nonfinite, in_flight, lock, observe_nonfinite, Progress};
use super::state::{PowerSgdState, SavedBucket};
use crate::sequence::Sequencer;
use crate::{CommBackend, CompressionStats, Error, GradBucket, Result};
use collectives::{ProcessGroup, ReduceOp, Work};
use lowrank::Backend;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};

/// One bucket's memory, as a hook keeps it between steps.
pub(super) trait Memory<B: Backend>: Send + 'static {
    /// The memory as the hook keeps it after a failed step (the per-layer hook without
    /// warm start drops its factors, as a completed step does).
    fn after_failure(&mut self, config: &PowerSgdConfig);
    /// Its saved form on the host (`None`: nothing to save).
    fn save(&self, be: &B, index: usize) -> Result<Option<SavedBucket>>;
    /// Keeps the step's non-finite flag for the next step.
    fn keep_flag(&mut self, flag: B::Buffer<f32>);
}

/// Everything behind the hook's lock.
pub(super) struct Shared<B: Backend, M> {
    pub progress: Progress,
    /// Each bucket's memory; absent before its first compressed step and while a step
    /// holds it ([`Lease`]).
    pub memory: BTreeMap<usize, M>,
    /// The buckets with a compressed step in flight: leased by `start`, released when
    /// the lease ends, whether the step succeeded or failed.
    pub busy: BTreeSet<usize>,
    /// Each bucket's count of held steps (non-finite values), a one-element buffer on the
    /// backend, added to on the device and read when the statistics are asked for. Kept
    /// outside the memory, so a step in flight does not hide its count.
    pub counts: BTreeMap<usize, B::Buffer<f32>>,
}

/// A hook's backend, group, shared state and collective order.
pub(super) struct Core<B: CommBackend, M> {
    pub backend: Arc<B>,
    pub group: Arc<dyn ProcessGroup>,
    pub shared: Arc<Mutex<Shared<B, M>>>,
    pub sequence: Sequencer,
}

impl<B: CommBackend, M: Memory<B>> Core<B, M> {
    /// A core with `config` (already validated), no memory.
    pub fn new(backend: Arc<B>, group: Arc<dyn ProcessGroup>, config: PowerSgdConfig) -> Self {
        Core {
            backend,
            group,
            shared: Arc::new(Mutex::new(Shared {
                progress: Progress::new(config),
                memory: BTreeMap::new(),
                busy: BTreeSet::new(),
                counts: BTreeMap::new(),
            })),
            sequence: Sequencer::default(),
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, Shared<B, M>> {
        lock(&self.shared)
    }

    pub fn config(&self) -> PowerSgdConfig {
        self.lock().progress.config.clone()
    }

    pub fn iteration(&self) -> u64 {
        self.lock().progress.iter
    }

    /// The statistics with the held steps counted (read from the device on a device
    /// backend: a wait for the work already issued).
    pub fn compression_stats(&self) -> CompressionStats {
        let mut g = self.lock();
        let g = &mut *g;
        let nonfinite = observe_nonfinite(&*self.backend, &mut g.progress, g.counts.values());
        CompressionStats {
            nonfinite_steps: nonfinite,
            ..g.progress.compression_stats()
        }
    }

    /// The whole state except the process group: every memory's saved form, checked
    /// ([`PowerSgdState::validate`]). A step still in flight is [`Error::Bucket`].
    pub fn save(&self) -> Result<PowerSgdState> {
        let g = self.lock();
        if let Some(&index) = g.busy.iter().next() {
            return Err(in_flight(index));
        }
        let be = &*self.backend;
        let mut buckets = BTreeMap::new();
        for (&index, m) in &g.memory {
            if let Some(saved) = m.save(be, index)? {
                buckets.insert(index, saved);
            }
        }
        let mut state = g.progress.to_state(buckets);
        state.nonfinite_steps = count_nonfinite(be, &g.progress, g.counts.values())?;
        state.validate()?;
        Ok(state)
    }

    /// Replaces the state with `state`, whose configuration must be this hook's except
    /// perhaps `batch_tensors_with_same_shape` (the hook keeps its own: it changes no
    /// saved value). `build` makes the memories from the checked state; everything is
    /// checked and uploaded before anything changes, so a failure leaves the hook as it
    /// was.
    pub fn restore(
        &self,
        state: PowerSgdState,
        build: impl FnOnce(&B, &PowerSgdConfig, &PowerSgdState) -> Result<BTreeMap<usize, M>>,
    ) -> Result<()> {
        state.validate()?;
        let config = self.config();
        let batch = config.batch_tensors_with_same_shape;
        let comparable = PowerSgdConfig {
            batch_tensors_with_same_shape: batch,
            ..state.config.clone()
        };
        if comparable != config {
            return Err(Error::State(format!(
                "the state was saved with {:?}, this hook has {config:?}",
                state.config
            )));
        }
        let memory = build(&*self.backend, &config, &state)?;
        let mut g = self.lock();
        if let Some(&index) = g.busy.iter().next() {
            return Err(in_flight(index));
        }
        g.progress = Progress::from_state(&state);
        g.progress.config.batch_tensors_with_same_shape = batch;
        g.memory = memory;
        g.counts.clear();
        Ok(())
    }

    /// Before `start_powersgd_iter`: the exact all-reduce of the bucket (the iteration
    /// counted); `Err` gives the bucket back for a compressed step.
    pub fn vanilla(
        &self,
        bucket: GradBucket<B>,
    ) -> std::result::Result<Work<B::Buffer<f32>>, GradBucket<B>> {
        let mut g = self.lock();
        if !g.progress.vanilla() {
            return Err(bucket);
        }
        g.progress.maybe_increase_iter(bucket.is_last());
        drop(g);
        let (be, group) = (self.backend.clone(), self.group.clone());
        let x = bucket.into_buffer();
        Ok(self.sequence.next(move |issued| {
            let work = be.all_reduce(&*group, x, ReduceOp::Avg);
            issued.complete(Ok(()));
            work
        }))
    }

    /// Takes bucket `index`'s memory for a step (`None` inside: the bucket has none yet),
    /// with the configuration and iteration the step runs under. A bucket whose previous
    /// step is still in flight is [`Error::Bucket`].
    pub fn lease(&self, index: usize, is_last: bool) -> Result<(Lease<B, M>, PowerSgdConfig, u64)> {
        let mut g = self.lock();
        if g.busy.contains(&index) {
            return Err(in_flight(index));
        }
        if let std::collections::btree_map::Entry::Vacant(slot) = g.counts.entry(index) {
            slot.insert(zeroed(&*self.backend, 1)?);
        }
        let memory = g.memory.remove(&index);
        g.busy.insert(index);
        let (config, iter) = (g.progress.config.clone(), g.progress.iter);
        let lease = Lease {
            shared: self.shared.clone(),
            index,
            is_last,
            memory,
            issued: false,
            finished: false,
        };
        Ok((lease, config, iter))
    }
}

/// A zeroed buffer whose pages are written now, for a memory the hook reads before it
/// writes (the error).
///
/// The CPU backend's zeroed allocation maps fresh pages lazily: a page read first is the
/// kernel's shared zero page, and the first write to it then copies it and flushes the
/// TLB of every core the process runs on (an inter-processor interrupt per 4 KiB page,
/// dear in a virtual machine). The error memory is read by the first products before
/// decompression writes it, so its first step paid that per page: BERT-base's first
/// compressed step took 1.9-2.7 s instead of 0.42-0.46 s (AVX-512, 2 ranks, 2-core VM),
/// most of it in those flushes. Writing zeros first maps every page writable at once
/// (one pass, no flush).
pub(super) fn zeroed<B: Backend>(be: &B, len: usize) -> Result<B::Buffer<f32>> {
    let mut buf = be.alloc(len)?;
    be.zero(B::view_mut(&mut buf, ..)?)?;
    Ok(buf)
}

/// A step's hold on its bucket's memory. Dropped without [`Lease::finish`] (the step
/// failed, or was refused before it communicated), it puts the memory back and releases
/// the bucket: as it was, if the step had not yet [`issued`](Lease::issue) its
/// collectives; else after [`Memory::after_failure`], with a warning. Every rank sees a
/// failed collective fail and does the same, so the ranks stay consistent.
pub(super) struct Lease<B: Backend, M: Memory<B>> {
    shared: Arc<Mutex<Shared<B, M>>>,
    index: usize,
    is_last: bool,
    memory: Option<M>,
    issued: bool,
    /// Set by `finish`: `Drop` then has nothing left to do.
    finished: bool,
}

impl<B: Backend, M: Memory<B>> Lease<B, M> {
    /// The bucket's index.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The bucket's memory, if it has one.
    pub fn memory(&self) -> Option<&M> {
        self.memory.as_ref()
    }

    /// The bucket's memory, mutably.
    pub fn memory_mut(&mut self) -> Option<&mut M> {
        self.memory.as_mut()
    }

    /// Gives the bucket a memory (its first compressed step, or a memory rebuilt).
    pub fn set_memory(&mut self, memory: M) -> &mut M {
        self.memory.insert(memory)
    }

    /// The step is about to issue its collectives: it cannot be refused any more, its
    /// statistics are counted (PyTorch counts them before communicating), and a failure
    /// from now on is a failed step.
    pub fn issue(&mut self, before: u64, after: u64) {
        self.issued = true;
        lock(&self.shared)
            .progress
            .record(before, after, self.is_last);
    }

    /// The step succeeded: the memory goes back, the step's non-finite `flag` is added to
    /// the bucket's count (and logged at once on a host backend), the bucket is released
    /// and the iteration counted.
    pub fn finish(mut self, be: &B, flag: B::Buffer<f32>) -> Result<()> {
        self.finished = true;
        let mut g = lock(&self.shared);
        let g = &mut *g;
        let counted = match g.counts.get_mut(&self.index) {
            Some(count) => {
                (|| be.add(B::view_mut(count, ..)?, B::view(&flag, ..)?))().map_err(Error::from)
            }
            None => Ok(()),
        };
        let warned = if B::HOST_RESIDENT {
            super::progress::warn_if_flagged(be, &flag, self.index, g.progress.iter)
        } else {
            Ok(())
        };
        if let Some(mut m) = self.memory.take() {
            m.keep_flag(flag);
            g.memory.insert(self.index, m);
        }
        g.busy.remove(&self.index);
        g.progress.maybe_increase_iter(self.is_last);
        counted.and(warned)
    }
}

impl<B: Backend, M: Memory<B>> Drop for Lease<B, M> {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        let mut g = lock(&self.shared);
        let g = &mut *g;
        if let Some(mut m) = self.memory.take() {
            if self.issued {
                m.after_failure(&g.progress.config);
            }
            g.memory.insert(self.index, m);
        }
        g.busy.remove(&self.index);
        if self.issued {
            tracing::warn!(
                bucket = self.index,
                "a PowerSGD step failed; the bucket keeps its memories from before the step"
            );
        }
    }
}

/// The `CommHook` impl of a PowerSGD hook `$hook` whose [`Core`] is its `core` field
/// and whose step is its `start` method; `$state` is its [`HookState`](crate::HookState)
/// variant and `$what` names it in a mismatch.
macro_rules! comm_hook {
    ($hook:ident, $state:ident, $what:literal) => {
        impl<B: CommBackend> crate::CommHook<B> for $hook<B> {
            fn name(&self) -> String {
                let c = self.core.config();
                format!(
                    "{}:rank={},start_iter={}",
                    Self::SPEC_NAME,
                    c.matrix_approximation_rank,
                    c.start_powersgd_iter
                )
            }

            fn run(&mut self, bucket: crate::GradBucket<B>) -> collectives::Work<B::Buffer<f32>> {
                match self.start(bucket) {
                    Ok(work) => work,
                    Err(e) => collectives::Work::ready(Err(e.into())),
                }
            }

            #[doc = concat!("[`HookState::", stringify!($state), "`](crate::HookState) holding the state `save` returns.")]
            fn save_state(&self) -> crate::Result<crate::HookState> {
                Ok(crate::HookState::$state(Box::new(self.save()?)))
            }

            #[doc = concat!("Loads a [`HookState::", stringify!($state), "`](crate::HookState) saved with the same configuration, except perhaps `batch_tensors_with_same_shape`: the hook keeps its own (the saved memories do not depend on it). Each bucket's memories apply only to the parameter shapes they were recorded with: a bucket of another layout, even of the same length, is refused at its next step ([`Error::Bucket`](crate::Error::Bucket)).")]
            fn load_state(&self, state: crate::HookState) -> crate::Result<()> {
                match state {
                    crate::HookState::$state(s) => self.restore(*s),
                    other => Err(other.mismatch($what)),
                }
            }

            fn compression_stats(&self) -> Option<crate::CompressionStats> {
                Some(self.core.compression_stats())
            }

            fn iteration(&self) -> Option<u64> {
                Some(self.core.iteration())
            }
        }
    };
}
pub(super) use comm_hook;

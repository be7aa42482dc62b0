//! The reducer: the part of DDP that the hooks need, framework-agnostic.
//!
//! It owns the gradient storage (PyTorch's `gradient_as_bucket_view=True`): parameters
//! are assigned to buckets in the order their gradients are expected to become ready
//! (at first the reverse of the forward order), the first bucket small
//! (`first_bucket_mb`, DDP's 1 MiB) so the first communication starts early, the others up
//! to `bucket_cap_mb` (DDP's 25 MiB). The caller writes each parameter's gradient into its
//! view and marks it ready; when a bucket is complete its hook is launched at once,
//! strictly in bucket order, so communication overlaps the rest of the backward pass.
//! `finish` waits for every bucket and leaves the reduced gradients in place.
//!
//! With synchronisation off ([`accum::GradSync`]), no hook is called: gradients
//! accumulate in place, and the next synchronised step reduces the accumulated sum.
//!
//! # Unused parameters
//!
//! A parameter that gets no gradient in a step (a frozen branch, an expert that received
//! no tokens) is declared with [`Reducer::mark_unused`], or simply left unmarked when
//! [`ReducerConfig::find_unused_parameters`] is on. In a synchronised step it counts as a
//! zero gradient on this rank: its slot is zeroed (as DDP zeroes the bucket view of a
//! parameter without a gradient) and its bucket launches, so every bucket completes on
//! every rank even when ranks disagree on which parameters were unused; the mean includes
//! the zeros. A parameter that received gradients in unsynchronised steps since the last
//! synchronised one keeps them instead, and they are reduced (DDP's map of used
//! parameters also spans `no_sync` iterations). So does one that received gradients
//! earlier in an accumulation group whose micro-steps all synchronise (Accelerate's
//! `sync_each_batch`, told through [`accum::GradSync::set_accumulating`]): the group's
//! synchronised micro-steps leave their reduced gradients for the next ones to add to.
//!
//! A parameter that no rank used is no gradient at all: DDP finds those with one
//! all-reduce of a used-parameter map per step and leaves their `.grad` untouched, so
//! that the optimizer skips them (weight decay and momentum included). With the option
//! and a process group, the reducer does the same after the step's buckets complete:
//! [`Reducer::globally_unused`] lists them, and their slots are zero even where the hook
//! gave something else (PowerSGD's error feedback does).
//!
//! Without the option, `finish` with unmarked parameters returns
//! [`Error::UnmarkedParameters`] naming all of them, after doing what the option does:
//! it launches every remaining bucket with zeros for them and waits. The rank in error
//! thus issues the same collectives as its peers, no rank waits for it, and every rank
//! ends the step with the same gradients; only this rank reports the error.
//!
//! # Bucket rebuild
//!
//! With a process group ([`Reducer::with_process_group`]), the buckets are rebuilt once,
//! at the end of the first synchronised step, in the order gradients became ready in it
//! (the order of `mark_ready` and `mark_unused` calls, then the parameters `finish` found
//! unmarked), with the same caps. Rank 0's assignment is broadcast, so every rank ends
//! with the same buckets even where the orders differed; gradients move to the new
//! buckets, so the step's results stay readable. As in DDP, bucket indices change once:
//! a hook that keys state by bucket index must hold none before the end of the first
//! synchronised step. PowerSGD holds none before it starts compressing, and
//! `start_powersgd_iter` must be > 1 when that state persists (error feedback or warm
//! start; [`crate::PowerSgdConfig::validate`]) for exactly this reason. A hook restored
//! from a checkpoint does hold such state: save [`Reducer::bucket_params`] with it and
//! restore them with [`Reducer::set_bucket_params`] before the first step, which also
//! cancels the rebuild. Without a group the buckets never change.
//!
//! Unlike DDP, which skips the rebuild under `find_unused_parameters=True`, the rebuild
//! also happens with the option on: parameters rank 0 left unmarked come last, where they
//! hold back no other bucket. And where DDP reduces its first iteration in one bucket,
//! the first step here already uses the reverse-order guess.
//!
//! # Switching synchronisation mid-step
//!
//! A step's setting is fixed by its first `mark_ready` (or `mark_unused`). Switching it
//! before that step's `finish` would make this rank issue different collectives than its
//! peers (or leave a launched bucket unwaited), so the step keeps its setting, `finish`
//! waits for every launched bucket as always, and returns [`Error::SyncChanged`]; the new
//! setting applies from the next step.
//!
//! A step abandoned before its `finish` (an early return or a caught panic between the
//! marks, with the `no_sync` guard dropped on the way out) is still in progress: its
//! marks stand, so marking a parameter again is an error. Call `finish` to end it: it
//! waits for what was launched, reports the step's error (here `SyncChanged`), and the
//! next step starts clean. Gradients written in the abandoned step stay in their slots,
//! as they stay in `.grad` in PyTorch.

mod assign;
mod rebuild;
mod unused;

use crate::bucket::{element_count, shape_str};
use crate::{BucketLayout, CommBackend, CommHook, Error, GradBucket, Layout, Result};
use assign::Caps;
use collectives::{ProcessGroup, Work};
use lowrank::Backend;
use std::sync::Arc;

/// Bucket sizes, as DDP's `bucket_cap_mb` and its first-bucket size, and DDP's
/// `find_unused_parameters`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReducerConfig {
    /// Capacity of each bucket after the first, in MiB (DDP: 25). A bucket closes once
    /// its bytes reach the capacity (truncated to whole bytes, as DDP's).
    pub bucket_cap_mb: f64,
    /// Capacity of the first bucket in launch order, in MiB (DDP: 1,
    /// `dist._DEFAULT_FIRST_BUCKET_BYTES`). As in DDP, where the first bucket takes the
    /// user's `bucket_cap_mb` when one is given: left at 1 while `bucket_cap_mb` is not
    /// 25, the first bucket's cap is `bucket_cap_mb` too
    /// ([`first_cap_mb`](ReducerConfig::first_cap_mb)). Any other value is used as it is.
    pub first_bucket_mb: f64,
    /// Parameters left unmarked at a synchronised step's `finish` are unused: zero
    /// gradients on this rank (DDP's `find_unused_parameters`, default off). Off, they
    /// are [`Error::UnmarkedParameters`]; see the module docs. On, with a process group,
    /// each synchronised step also finds the parameters no rank used
    /// ([`Reducer::globally_unused`]).
    pub find_unused_parameters: bool,
    /// Where each gradient lies in its bucket (default [`BucketLayout::Launch`], DDP's
    /// launch order). [`BucketLayout::ByShape`] lays buckets out for PowerSGD: same-shape
    /// matrices adjacent, 1-D tensors last, so its batches read the bucket in place.
    /// Every rank must use the same layout.
    pub layout: BucketLayout,
}

impl ReducerConfig {
    /// The first bucket's capacity in MiB: `first_bucket_mb`, except that with
    /// `first_bucket_mb` at its default (1) and `bucket_cap_mb` not at its (25) it is
    /// `bucket_cap_mb`, as DDP's first bucket takes a `bucket_cap_mb` the user passed.
    pub fn first_cap_mb(&self) -> f64 {
        let defaults = ReducerConfig::default();
        if self.first_bucket_mb == defaults.first_bucket_mb
            && self.bucket_cap_mb != defaults.bucket_cap_mb
        {
            self.bucket_cap_mb
        } else {
            self.first_bucket_mb
        }
    }
}

impl Default for ReducerConfig {
    fn default() -> Self {
        ReducerConfig {
            bucket_cap_mb: 25.0,
            first_bucket_mb: 1.0,
            find_unused_parameters: false,
            layout: BucketLayout::Launch,
        }
    }
}

struct Bucket<B: Backend> {
    /// `None` while the bucket's hook is running.
    storage: Option<B::Buffer<f32>>,
    layout: Arc<Layout>,
    /// Parameter indices, in the bucket's order.
    params: Vec<usize>,
    ready: usize,
    pending: Option<Work<B::Buffer<f32>>>,
}

/// Where a parameter's gradient lives.
#[derive(Clone, Copy, Debug)]
struct Place {
    bucket: usize,
    offset: usize,
    len: usize,
}

/// Gradient buckets and the hook that reduces them. See the module docs.
pub struct Reducer<B: CommBackend, H> {
    backend: Arc<B>,
    hook: H,
    config: ReducerConfig,
    /// The reducer's own collectives (the rebuild broadcast); `None`: no rebuild.
    group: Option<Arc<dyn ProcessGroup>>,
    shapes: Vec<Vec<usize>>,
    lens: Vec<usize>,
    places: Vec<Place>,
    is_ready: Vec<bool>,
    /// Handed out by [`Reducer::grad_mut`] in the step in progress: the slot may hold
    /// this step's gradient, which [`Reducer::mark_unused`] must not zero.
    written: Vec<bool>,
    /// Marked ready in an unsynchronised step since the last synchronised one (or in any
    /// step of the accumulation group in progress): the slot holds accumulated
    /// gradients, which a synchronised step reduces even if the parameter is unused in
    /// that step.
    accumulated: Vec<bool>,
    /// Gradients go on accumulating after this step ([`accum::GradSync::set_accumulating`]).
    accumulating: bool,
    /// Counted unused in the synchronised step in progress (declared, or left unmarked
    /// at `finish`), whether or not accumulated gradients make it used after all.
    unused: Vec<bool>,
    /// The parameters no rank used in the last synchronised step, when it was found
    /// (see [`Reducer::globally_unused`]).
    globally_unused: Option<Vec<usize>>,
    buckets: Vec<Bucket<B>>,
    next_launch: usize,
    sync: bool,
    /// The setting of the step in progress, fixed by its first mark; `None` between
    /// steps.
    step_sync: Option<bool>,
    /// Parameters marked in the step in progress.
    marked: usize,
    /// Parameters marked when `set_sync` first changed the setting during the step in
    /// progress; `None` if it did not.
    switched_after: Option<usize>,
    hook_calls: u64,
    /// The buckets are still to be rebuilt at the end of the first synchronised step.
    rebuild_pending: bool,
    /// The order parameters were marked in the step in progress, kept while a rebuild is
    /// pending and a group is set.
    ready_order: Vec<usize>,
}

impl<B: CommBackend, H: CommHook<B>> Reducer<B, H> {
    /// Buckets for parameters of the given shapes, **in forward order**, reduced by
    /// `hook`. Gradients start at zero. A shape or bucket whose element count overflows
    /// is [`Error::Overflow`]; storage that cannot be allocated is [`Error::Alloc`]
    /// (checked before anything is allocated where the size alone rules it out).
    pub fn new(
        backend: Arc<B>,
        shapes: &[Vec<usize>],
        hook: H,
        config: ReducerConfig,
    ) -> Result<Self> {
        for (name, mb) in [
            ("bucket_cap_mb", config.bucket_cap_mb),
            ("first_bucket_mb", config.first_bucket_mb),
        ] {
            if !(mb.is_finite() && mb > 0.0) {
                return Err(Error::Config(format!(
                    "{name} = {mb}: must be finite and > 0"
                )));
            }
        }
        let lens = shapes
            .iter()
            .enumerate()
            .map(|(p, s)| {
                element_count(s).ok_or_else(|| {
                    Error::Overflow(format!("parameter {p} of shape {}", shape_str(s)))
                })
            })
            .collect::<Result<Vec<usize>>>()?;
        let reverse: Vec<usize> = (0..shapes.len()).rev().collect();
        let groups = assign::by_size(&reverse, &lens, Caps::new(&config));
        let (buckets, places) = rebuild::build::<B>(&backend, shapes, config.layout, groups)?;
        tracing::debug!(buckets = buckets.len(), "reducer buckets assigned");
        Ok(Reducer {
            backend,
            hook,
            config,
            group: None,
            shapes: shapes.to_vec(),
            lens,
            is_ready: vec![false; shapes.len()],
            written: vec![false; shapes.len()],
            accumulated: vec![false; shapes.len()],
            accumulating: false,
            unused: vec![false; shapes.len()],
            globally_unused: None,
            places,
            buckets,
            next_launch: 0,
            sync: true,
            step_sync: None,
            marked: 0,
            switched_after: None,
            hook_calls: 0,
            rebuild_pending: true,
            ready_order: Vec::new(),
        })
    }

    /// The reducer's own process group (DDP's `process_group`; normally the hook's), used
    /// for one collective: the broadcast of rank 0's bucket assignment when the buckets
    /// are rebuilt at the end of the first synchronised step (see the module docs). Every
    /// rank must set it, or none. Also names this rank in errors. Set it before the first
    /// synchronised step; without it the buckets never change.
    pub fn with_process_group(mut self, group: Arc<dyn ProcessGroup>) -> Self {
        self.group = Some(group);
        self
    }

    /// Copies rank 0's `params` into every rank's, bit for bit, over the reducer's
    /// process group: DDP's broadcast of rank 0's parameters and buffers at construction,
    /// so every replica starts from the same model. `params`: any `f32` slices (the
    /// parameters, in the reducer's order or not, and buffers), the same lengths in the
    /// same order on every rank; see [`broadcast_parameters`](crate::broadcast_parameters)
    /// for the coalescing, the timeout and the errors (lengths that differ between ranks
    /// fail on every rank). Without a process group ([`Reducer::with_process_group`]):
    /// [`Error::Config`], before any communication.
    pub fn broadcast_parameters(&self, params: &mut [&mut [f32]]) -> Result<()> {
        let group = self.group.as_deref().ok_or_else(|| {
            Error::Config(
                "Reducer::broadcast_parameters needs the reducer's process group \
                 (Reducer::with_process_group)"
                    .into(),
            )
        })?;
        crate::broadcast_parameters(group, params, 0)
    }

    /// The configuration.
    pub fn config(&self) -> &ReducerConfig {
        &self.config
    }

    /// Number of buckets.
    pub fn bucket_count(&self) -> usize {
        self.buckets.len()
    }

    /// The hook.
    pub fn hook(&self) -> &H {
        &self.hook
    }

    /// Hook calls so far (one per bucket per synchronised step).
    pub fn hook_calls(&self) -> u64 {
        self.hook_calls
    }

    fn place(&self, param: usize) -> Result<Place> {
        self.places.get(param).copied().ok_or_else(|| {
            Error::Config(format!(
                "parameter {param} does not exist (there are {})",
                self.places.len()
            ))
        })
    }

    fn storage(&self, bucket: usize) -> Result<&B::Buffer<f32>> {
        self.buckets[bucket]
            .storage
            .as_ref()
            .ok_or_else(|| in_flight(bucket))
    }

    /// Parameter `param`'s gradient storage.
    pub fn grad(&self, param: usize) -> Result<B::View<'_, f32>> {
        let p = self.place(param)?;
        Ok(B::view(
            self.storage(p.bucket)?,
            p.offset..p.offset + p.len,
        )?)
    }

    /// Parameter `param`'s gradient storage, to write or accumulate into. The parameter
    /// counts as written in this step: [`Reducer::mark_unused`] then refuses it.
    pub fn grad_mut(&mut self, param: usize) -> Result<B::ViewMut<'_, f32>> {
        let p = self.place(param)?;
        let storage = self.buckets[p.bucket]
            .storage
            .as_mut()
            .ok_or_else(|| in_flight(p.bucket))?;
        let view = B::view_mut(storage, p.offset..p.offset + p.len)?;
        self.written[param] = true;
        Ok(view)
    }

    /// Marks `param`'s gradient as complete for this step. With sync on, a bucket whose
    /// gradients are all ready is handed to the hook at once (in bucket order). The
    /// first mark of a step fixes the step's setting (see the module docs).
    pub fn mark_ready(&mut self, param: usize) -> Result<()> {
        let sync = self.mark(param)?;
        if !sync || self.accumulating {
            self.accumulated[param] = true;
        }
        if sync {
            self.launch_ready()
        } else {
            Ok(())
        }
    }

    /// Counts `param` as marked in this step; returns the step's setting.
    fn mark(&mut self, param: usize) -> Result<bool> {
        let p = self.place(param)?;
        if std::mem::replace(&mut self.is_ready[param], true) {
            return Err(twice(param));
        }
        self.buckets[p.bucket].ready += 1;
        self.marked += 1;
        let sync = *self.step_sync.get_or_insert(self.sync);
        if sync && self.recording() {
            self.ready_order.push(param);
        }
        Ok(sync)
    }

    fn launch_ready(&mut self) -> Result<()> {
        let count = self.buckets.len();
        while self.next_launch < count {
            let b = &mut self.buckets[self.next_launch];
            if b.ready < b.params.len() {
                break;
            }
            let storage = b.storage.take().ok_or_else(|| Error::Bucket {
                index: self.next_launch,
                why: "launched twice".into(),
            })?;
            let index = self.next_launch;
            let bucket = GradBucket::new(index, count, storage, b.layout.clone())?;
            // A hook that panics fails its bucket as a hook error does: `finish` reports
            // it and gives the bucket fresh storage, so the reducer stays usable (and the
            // panic does not unwind through the caller's backward pass).
            let hook = &mut self.hook;
            let work = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| hook.run(bucket)))
                .unwrap_or_else(|_| {
                    Work::ready(Err(Error::Bucket {
                        index,
                        why: "the hook panicked; the bucket's gradients of this step are lost"
                            .into(),
                    }
                    .into()))
                });
            b.pending = Some(work);
            self.hook_calls += 1;
            self.next_launch += 1;
        }
        Ok(())
    }

    /// Ends the backward pass. In a synchronised step, parameters not marked count as
    /// unused (see the module docs): with `find_unused_parameters` that is all, without
    /// it this returns [`Error::UnmarkedParameters`] after the step completed all the
    /// same. The reduced gradients are left in place (on a device backend, the device has
    /// finished writing them: `finish` is the step's one host wait). In an unsynchronised step gradients
    /// stay as accumulated. Either way every launched bucket is waited for, and the next
    /// step starts. If the setting was switched during the step, the step kept its own
    /// and this returns [`Error::SyncChanged`]. The first synchronised step with a
    /// process group also rebuilds the buckets (a broadcast from rank 0), whatever the
    /// step's outcome, so that every rank takes part.
    pub fn finish(&mut self) -> Result<()> {
        // The step's setting stays in place until the step is over: `finish_sync` marks
        // the parameters left unmarked as the step's own marks.
        let step_sync = *self.step_sync.get_or_insert(self.sync);
        self.globally_unused = None;
        let result = if step_sync {
            self.finish_sync()
        } else {
            self.wait_all()
        };
        // The one host wait of a step on a device backend: the hooks' last kernels (the
        // decompression that continuations queued after the final collective) finish
        // before `finish` returns, so the gradients are ready for the host as for the
        // device. Nothing on the CPU backend.
        let result = result.and(self.backend.synchronize().map_err(Error::from));
        self.step_sync = None;
        let changed = self.switched_after.take().map(|marked| Error::SyncChanged {
            on: !step_sync,
            marked,
            params: self.is_ready.len(),
            launched: self.next_launch,
            buckets: self.buckets.len(),
        });
        self.is_ready.iter_mut().for_each(|r| *r = false);
        self.written.iter_mut().for_each(|w| *w = false);
        self.unused.iter_mut().for_each(|u| *u = false);
        self.buckets.iter_mut().for_each(|b| b.ready = 0);
        self.next_launch = 0;
        self.marked = 0;
        let rebuilt = if step_sync {
            if !self.accumulating {
                self.accumulated.iter_mut().for_each(|a| *a = false);
            }
            if std::mem::take(&mut self.rebuild_pending) {
                self.rebuild()
            } else {
                Ok(())
            }
        } else {
            Ok(())
        };
        self.ready_order.clear();
        // One error is returned: a switched setting first, then the step's own error
        // (the causes the caller must fix), then the rebuild's.
        let mut errors = [changed.map(Err), Some(result), Some(rebuilt)]
            .into_iter()
            .flatten()
            .filter_map(|r| r.err());
        match errors.next() {
            None => Ok(()),
            Some(first) => {
                for also in errors {
                    tracing::warn!("the step that failed with `{first}` also failed: {also}");
                }
                Err(first)
            }
        }
    }

    fn finish_sync(&mut self) -> Result<()> {
        // Every parameter left unmarked counts as unused and its bucket launches, with or
        // without the option, so this rank issues the same collectives as its peers.
        let unmarked: Vec<usize> = (0..self.is_ready.len())
            .filter(|&p| !self.is_ready[p])
            .collect();
        let mut first_error = None;
        for &p in &unmarked {
            if let Err(e) = self.zero_unless_accumulated(p) {
                first_error.get_or_insert(e);
            }
            if let Err(e) = self.mark(p) {
                first_error.get_or_insert(e);
            }
            self.unused[p] = true;
        }
        if let Err(e) = self.launch_ready() {
            first_error.get_or_insert(e);
        }
        // Wait for what was launched in any case, so no bucket is left in flight.
        let mut waited = self.wait_all();
        // After every bucket (whose hooks may still issue collectives until they
        // complete), so that every rank issues this one in the same place.
        if self.config.find_unused_parameters {
            if let Err(e) = self.find_globally_unused() {
                waited = waited.and(Err(e));
            }
        }
        if !unmarked.is_empty() && !self.config.find_unused_parameters {
            let e = Error::UnmarkedParameters {
                params: unmarked,
                total: self.is_ready.len(),
                rank: self.group.as_ref().map(|g| g.rank()),
            };
            if let Some(also) = first_error.or(waited.err()) {
                tracing::warn!("the step with unmarked parameters also failed: {also}");
            }
            return Err(e);
        }
        first_error.map_or(waited, Err)
    }

    fn wait_all(&mut self) -> Result<()> {
        let mut first_error = None;
        for (index, b) in self.buckets.iter_mut().enumerate() {
            if let Some(work) = b.pending.take() {
                match work.wait() {
                    Ok(buf) if B::buffer_len(&buf) == b.layout.len() => b.storage = Some(buf),
                    Ok(buf) => {
                        first_error.get_or_insert(Error::Bucket {
                            index,
                            why: format!(
                                "the hook returned {} elements for {}",
                                B::buffer_len(&buf),
                                b.layout.len()
                            ),
                        });
                    }
                    Err(e) => {
                        first_error.get_or_insert(e.into());
                    }
                }
                if b.storage.is_none() {
                    // The hook failed and kept the buffer: give the bucket fresh storage
                    // so the reducer stays usable (the step's gradients are lost). The
                    // remaining buckets are waited for even if this fails.
                    match self.backend.try_alloc(b.layout.len()) {
                        Ok(fresh) => b.storage = Some(fresh),
                        Err(e) => {
                            first_error.get_or_insert(e);
                        }
                    }
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Sets every gradient to zero (and forgets which parameters accumulated any).
    pub fn zero_grad(&mut self) -> Result<()> {
        self.accumulated.iter_mut().for_each(|a| *a = false);
        for b in 0..self.buckets.len() {
            let storage = self.buckets[b]
                .storage
                .as_mut()
                .ok_or_else(|| in_flight(b))?;
            self.backend.zero(B::view_mut(storage, ..)?)?;
        }
        Ok(())
    }
}

pub(super) fn in_flight(bucket: usize) -> Error {
    Error::Bucket {
        index: bucket,
        why: "its reduction is in flight; call finish() first".into(),
    }
}

pub(super) fn twice(param: usize) -> Error {
    Error::Config(format!("parameter {param} was marked twice in one step"))
}

impl<B: CommBackend, H: CommHook<B>> accum::GradSync for Reducer<B, H> {
    /// Sets the setting of the next step. Called between a step's first `mark_ready`
    /// and its `finish` with a different value, it leaves that step as it began and makes
    /// its `finish` return [`Error::SyncChanged`].
    fn set_sync(&mut self, on: bool) -> bool {
        let previous = std::mem::replace(&mut self.sync, on);
        if self.step_sync.is_some() && on != previous {
            self.switched_after.get_or_insert(self.marked);
        }
        previous
    }

    fn sync_enabled(&self) -> bool {
        self.sync
    }

    /// While on, a synchronised step keeps the record of which parameters hold
    /// gradients, so that one unused in a later micro-step of the group keeps what it
    /// accumulated (see the module docs).
    fn set_accumulating(&mut self, on: bool) -> bool {
        std::mem::replace(&mut self.accumulating, on)
    }
}

impl<B: Backend> CommHook<B> for Box<dyn CommHook<B>> {
    fn name(&self) -> String {
        (**self).name()
    }
    fn run(&mut self, bucket: GradBucket<B>) -> Work<B::Buffer<f32>> {
        (**self).run(bucket)
    }
    fn save_state(&self) -> Result<crate::HookState> {
        (**self).save_state()
    }
    fn load_state(&self, state: crate::HookState) -> Result<()> {
        (**self).load_state(state)
    }
    fn compression_stats(&self) -> Option<crate::CompressionStats> {
        (**self).compression_stats()
    }
    fn iteration(&self) -> Option<u64> {
        (**self).iteration()
    }
}

//! The reducer: the part of DDP that the hooks need, framework-agnostic.
//!
//! It owns the gradient storage (PyTorch's `gradient_as_bucket_view=True`): parameters
//! are assigned to buckets in reverse order of the forward pass (the order their
//! gradients become ready in the backward pass), the first bucket small so the first
//! communication starts early. The caller writes each parameter's gradient into its view
//! and marks it ready; when a bucket is complete its hook is launched at once, strictly in
//! bucket order, so communication overlaps the rest of the backward pass. `finish` waits
//! for every bucket and leaves the reduced gradients in place.
//!
//! With synchronisation off ([`accum::GradSync`]), no hook is called: gradients
//! accumulate in place, and the next synchronised step reduces the accumulated sum.
//!
//! A step's setting is fixed by its first `mark_ready`. Switching it before that step's
//! `finish` would make this rank issue different collectives than its peers (or leave a
//! launched bucket unwaited), so the step keeps its setting, `finish` waits for every
//! launched bucket as always, and returns [`Error::SyncChanged`]; the new setting
//! applies from the next step.

use crate::bucket::{element_count, shape_str};
use crate::{CommBackend, CommHook, Error, GradBucket, Layout, Result};
use collectives::Work;
use lowrank::Backend;
use std::sync::Arc;

/// Bucket sizes, as DDP's `bucket_cap_mb` and its first-bucket size.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReducerConfig {
    /// Capacity of each bucket after the first, in MiB (DDP: 25).
    pub bucket_cap_mb: f64,
    /// Capacity of the first bucket, in MiB (DDP: 1).
    pub first_bucket_mb: f64,
}

impl Default for ReducerConfig {
    fn default() -> Self {
        ReducerConfig {
            bucket_cap_mb: 25.0,
            first_bucket_mb: 1.0,
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
    places: Vec<Place>,
    is_ready: Vec<bool>,
    buckets: Vec<Bucket<B>>,
    next_launch: usize,
    sync: bool,
    /// The setting of the step in progress, fixed by its first `mark_ready`; `None`
    /// between steps.
    step_sync: Option<bool>,
    /// Parameters marked ready in the step in progress.
    marked: usize,
    /// Parameters marked ready when `set_sync` first changed the setting during the step
    /// in progress; `None` if it did not.
    switched_after: Option<usize>,
    hook_calls: u64,
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
        // Reverse order; a bucket closes once it reaches its capacity.
        let mut groups: Vec<Vec<usize>> = Vec::new();
        let mut current = Vec::new();
        let mut bytes = 0.0;
        for p in (0..shapes.len()).rev() {
            current.push(p);
            bytes += 4.0 * lens[p] as f64;
            let cap = if groups.is_empty() {
                config.first_bucket_mb
            } else {
                config.bucket_cap_mb
            };
            if bytes >= cap * (1 << 20) as f64 {
                groups.push(std::mem::take(&mut current));
                bytes = 0.0;
            }
        }
        if !current.is_empty() {
            groups.push(current);
        }
        let mut places = vec![
            Place {
                bucket: 0,
                offset: 0,
                len: 0
            };
            shapes.len()
        ];
        // Every layout is checked before the first allocation, so a shape that cannot
        // exist fails without allocating anything.
        let layouts = groups
            .iter()
            .enumerate()
            .map(|(b, params)| {
                let bucket_shapes: Vec<Vec<usize>> =
                    params.iter().map(|&p| shapes[p].clone()).collect();
                Layout::packed(&bucket_shapes).map_err(|e| match e {
                    Error::Overflow(what) => Error::Overflow(format!("bucket {b}: {what}")),
                    other => other,
                })
            })
            .collect::<Result<Vec<Layout>>>()?;
        let mut buckets = Vec::with_capacity(groups.len());
        for (b, (params, layout)) in groups.into_iter().zip(layouts).enumerate() {
            let layout = Arc::new(layout);
            for (slot, &p) in layout.params().iter().zip(&params) {
                places[p] = Place {
                    bucket: b,
                    offset: slot.offset,
                    len: slot.len,
                };
            }
            let storage = Some(backend.try_alloc::<f32>(layout.len())?);
            buckets.push(Bucket {
                storage,
                layout,
                params,
                ready: 0,
                pending: None,
            });
        }
        tracing::debug!(buckets = buckets.len(), "reducer buckets assigned");
        Ok(Reducer {
            backend,
            hook,
            is_ready: vec![false; shapes.len()],
            places,
            buckets,
            next_launch: 0,
            sync: true,
            step_sync: None,
            marked: 0,
            switched_after: None,
            hook_calls: 0,
        })
    }

    /// Number of buckets.
    pub fn bucket_count(&self) -> usize {
        self.buckets.len()
    }

    /// Parameter indices (forward order) of each bucket, in bucket order.
    pub fn bucket_params(&self) -> Vec<Vec<usize>> {
        self.buckets.iter().map(|b| b.params.clone()).collect()
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
            .ok_or_else(|| Error::Bucket {
                index: bucket,
                why: "its reduction is in flight; call finish() first".into(),
            })
    }

    /// Parameter `param`'s gradient storage.
    pub fn grad(&self, param: usize) -> Result<B::View<'_, f32>> {
        let p = self.place(param)?;
        Ok(B::view(
            self.storage(p.bucket)?,
            p.offset..p.offset + p.len,
        )?)
    }

    /// Parameter `param`'s gradient storage, to write or accumulate into.
    pub fn grad_mut(&mut self, param: usize) -> Result<B::ViewMut<'_, f32>> {
        let p = self.place(param)?;
        let storage = self.buckets[p.bucket]
            .storage
            .as_mut()
            .ok_or_else(|| Error::Bucket {
                index: p.bucket,
                why: "its reduction is in flight; call finish() first".into(),
            })?;
        Ok(B::view_mut(storage, p.offset..p.offset + p.len)?)
    }

    /// Marks `param`'s gradient as complete for this step. With sync on, a bucket whose
    /// gradients are all ready is handed to the hook at once (in bucket order). The
    /// first call of a step fixes the step's setting (see the module docs).
    pub fn mark_ready(&mut self, param: usize) -> Result<()> {
        let p = self.place(param)?;
        if std::mem::replace(&mut self.is_ready[param], true) {
            return Err(Error::Config(format!(
                "parameter {param} was marked ready twice in one step"
            )));
        }
        self.buckets[p.bucket].ready += 1;
        self.marked += 1;
        if *self.step_sync.get_or_insert(self.sync) {
            self.launch_ready()?;
        }
        Ok(())
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
            let bucket = GradBucket::new(self.next_launch, count, storage, b.layout.clone())?;
            b.pending = Some(self.hook.run(bucket));
            self.hook_calls += 1;
            self.next_launch += 1;
        }
        Ok(())
    }

    /// Ends the backward pass. In a synchronised step every parameter must have been
    /// marked ready; the reduced gradients are left in place. In an unsynchronised step
    /// gradients stay as accumulated. Either way every launched bucket is waited for,
    /// and the next step starts. If the setting was switched during the step, the step
    /// kept its own and this returns [`Error::SyncChanged`].
    pub fn finish(&mut self) -> Result<()> {
        let step_sync = self.step_sync.take().unwrap_or(self.sync);
        let result = if step_sync {
            self.finish_sync()
        } else {
            self.wait_all()
        };
        let changed = self.switched_after.take().map(|marked| Error::SyncChanged {
            on: !step_sync,
            marked,
            params: self.is_ready.len(),
            launched: self.next_launch,
            buckets: self.buckets.len(),
        });
        self.is_ready.iter_mut().for_each(|r| *r = false);
        self.buckets.iter_mut().for_each(|b| b.ready = 0);
        self.next_launch = 0;
        self.marked = 0;
        match (changed, result) {
            (Some(changed), Err(e)) => {
                // One error is returned; the switch is the cause the caller must fix.
                tracing::warn!("step with a switched synchronisation setting also failed: {e}");
                Err(changed)
            }
            (Some(changed), Ok(())) => Err(changed),
            (None, result) => result,
        }
    }

    fn finish_sync(&mut self) -> Result<()> {
        // Wait for what was launched in any case, so no bucket is left in flight.
        let waited = self.wait_all();
        if let Some(p) = self.is_ready.iter().position(|r| !r) {
            return Err(Error::Config(format!(
                "parameter {p} was not marked ready before finish() in a synchronised step"
            )));
        }
        waited
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

    /// Sets every gradient to zero.
    pub fn zero_grad(&mut self) -> Result<()> {
        for b in 0..self.buckets.len() {
            let storage = self.buckets[b]
                .storage
                .as_mut()
                .ok_or_else(|| Error::Bucket {
                    index: b,
                    why: "its reduction is in flight; call finish() first".into(),
                })?;
            self.backend.zero(B::view_mut(storage, ..)?)?;
        }
        Ok(())
    }
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
}

impl<B: Backend> CommHook<B> for Box<dyn CommHook<B>> {
    fn name(&self) -> String {
        (**self).name()
    }
    fn run(&mut self, bucket: GradBucket<B>) -> Work<B::Buffer<f32>> {
        (**self).run(bucket)
    }
}

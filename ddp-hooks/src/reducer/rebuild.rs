//! The bucket assignment after construction: restoring one (`set_bucket_params`), the
//! one rebuild in rank 0's gradient-ready order, and building buckets for an assignment.
//! See the parent module's "Bucket rebuild".

use super::assign::{self, Caps};
use super::{in_flight, Bucket, Place, Reducer};
use crate::{BucketLayout, CommBackend, CommHook, Error, Layout, Result};
use collectives::Buffer;
use std::sync::Arc;

impl<B: CommBackend, H: CommHook<B>> Reducer<B, H> {
    /// Parameter indices (forward order) of each bucket, in bucket order; within a
    /// bucket, in the order of its layout ([`ReducerConfig::layout`]: launch order by
    /// default).
    ///
    /// [`ReducerConfig::layout`]: crate::ReducerConfig::layout
    pub fn bucket_params(&self) -> Vec<Vec<usize>> {
        self.buckets.iter().map(|b| b.params.clone()).collect()
    }

    /// Replaces the buckets by `buckets` (parameter indices, in launch order, as
    /// [`bucket_params`](Self::bucket_params) returns them), keeping every gradient, and
    /// cancels the automatic rebuild. For resuming a hook whose saved state is keyed by
    /// bucket index: save the assignment with the hook's state, restore both. Every rank
    /// must call it with the same buckets. Called during a step, or with buckets that are
    /// not a partition of the parameters into non-empty buckets, it is
    /// [`Error::Config`]; storage that cannot be allocated is [`Error::Alloc`]. Either
    /// way nothing changes.
    pub fn set_bucket_params(&mut self, buckets: Vec<Vec<usize>>) -> Result<()> {
        if self.step_sync.is_some() {
            return Err(Error::Config(
                "set_bucket_params during a step: call it before the first mark or after finish()"
                    .into(),
            ));
        }
        assign::check_partition(&buckets, self.lens.len())
            .map_err(|why| Error::Config(format!("set_bucket_params: {why}")))?;
        self.apply(buckets)?;
        self.rebuild_pending = false;
        Ok(())
    }

    /// Whether this step's order will rebuild the buckets.
    pub(super) fn recording(&self) -> bool {
        self.rebuild_pending && self.group.is_some()
    }

    /// Rebuilds the buckets in the order of the step that just finished, as rank 0 saw
    /// it. The broadcast comes first, so this rank takes part even if applying fails.
    pub(super) fn rebuild(&mut self) -> Result<()> {
        let Some(group) = self.group.clone() else {
            return Ok(());
        };
        let n = self.lens.len();
        if n == 0 {
            return Ok(());
        }
        // `finish` marked every parameter, so the order is complete; parameters missing
        // from it all the same go last, in the current bucket order.
        let mut seen = vec![false; n];
        let mut order: Vec<usize> = Vec::with_capacity(n);
        let marked = std::mem::take(&mut self.ready_order);
        let current = self.buckets.iter().flat_map(|b| b.params.iter());
        for &p in marked.iter().chain(current) {
            if !std::mem::replace(&mut seen[p], true) {
                order.push(p);
            }
        }
        let proposal = assign::by_size(&order, &self.lens, Caps::new(&self.config));
        let wire = Buffer::from(assign::encode(&proposal));
        let wire: Vec<f64> = group.broadcast(wire, 0).wait()?.try_into()?;
        let buckets = assign::decode(&wire, n).map_err(|why| {
            Error::Config(format!(
                "bucket rebuild: rank 0 sent an assignment that does not fit this rank's {n} parameters: {why}"
            ))
        })?;
        self.apply(buckets)?;
        tracing::info!(
            buckets = self.buckets.len(),
            "reducer buckets rebuilt in gradient-ready order"
        );
        Ok(())
    }

    /// Moves every gradient into freshly allocated `buckets` (a checked partition, each
    /// in launch order or already arranged). Changes nothing on error.
    pub(super) fn apply(&mut self, groups: Vec<Vec<usize>>) -> Result<()> {
        let groups: Vec<Vec<usize>> = groups
            .into_iter()
            .map(|params| arrange(&self.shapes, self.config.layout, params))
            .collect();
        if self.buckets.iter().map(|b| &b.params).eq(groups.iter()) {
            return Ok(());
        }
        let (mut buckets, places) =
            build::<B>(&self.backend, &self.shapes, self.config.layout, groups)?;
        for (old, new) in self.places.iter().zip(&places) {
            if old.len == 0 {
                continue;
            }
            let from = self.buckets[old.bucket]
                .storage
                .as_ref()
                .ok_or_else(|| in_flight(old.bucket))?;
            let to = buckets[new.bucket]
                .storage
                .as_mut()
                .ok_or_else(|| in_flight(new.bucket))?;
            self.backend.copy(
                B::view(from, old.offset..old.offset + old.len)?,
                B::view_mut(to, new.offset..new.offset + new.len)?,
            )?;
        }
        self.buckets = buckets;
        self.places = places;
        Ok(())
    }
}

/// The parameters of one bucket in the order `layout` places them.
fn arrange(shapes: &[Vec<usize>], layout: BucketLayout, params: Vec<usize>) -> Vec<usize> {
    let bucket_shapes: Vec<Vec<usize>> = params.iter().map(|&p| shapes[p].clone()).collect();
    layout
        .arrange(&bucket_shapes)
        .into_iter()
        .map(|i| params[i])
        .collect()
}

/// Buckets holding `groups` of parameters (in launch order, or already arranged) of the
/// given shapes, laid out as `layout` says, with zeroed storage, and each parameter's
/// place. Every layout is checked before the first allocation, so a shape that cannot
/// exist fails without allocating anything.
#[allow(clippy::type_complexity)]
pub(super) fn build<B: CommBackend>(
    backend: &B,
    shapes: &[Vec<usize>],
    layout: BucketLayout,
    groups: Vec<Vec<usize>>,
) -> Result<(Vec<Bucket<B>>, Vec<Place>)> {
    let groups: Vec<Vec<usize>> = groups
        .into_iter()
        .map(|params| arrange(shapes, layout, params))
        .collect();
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
    let mut places = vec![
        Place {
            bucket: 0,
            offset: 0,
            len: 0
        };
        shapes.len()
    ];
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
    Ok((buckets, places))
}

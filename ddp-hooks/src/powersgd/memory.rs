//! The per-layer hook's memory of one bucket: what is saved and the buffers a step
//! works in.

use super::config::PowerSgdConfig;
use super::core::Memory;
use super::plan::{self, Plan};
use super::state::SavedBucket;
use crate::Result;
use lowrank::Backend;
use std::sync::Arc;

/// A factor buffer (`P` or `Q`).
pub(super) type Factor<B> = <B as Backend>::Buffer<f32>;

/// A bucket's warm-start factors, as the last completed step left them. A step works on
/// its own pair of buffers ([`LayerMemory::work`]) and copies them in only once it has
/// succeeded with finite values, so these are never in a collective and a failed or held
/// step leaves them as they were.
pub(super) struct Factors<B: Backend> {
    pub p: Factor<B>,
    pub q: Factor<B>,
}

/// One bucket's memory: what is saved (error feedback, warm-start factors, the layout
/// they belong to, the order they are in) and the buffers a step works in, kept from step
/// to step and never saved.
pub(super) struct LayerMemory<B: Backend> {
    /// The bucket length the error and the factors were made for.
    pub len: usize,
    /// Error feedback of the compressed tensors.
    pub error: Option<B::Buffer<f32>>,
    /// Warm-start factors (absent without warm start between steps).
    pub factors: Option<Factors<B>>,
    /// The plan whose order the memories are in; absent: the saved order (a loaded
    /// state, not yet used).
    pub order: Option<Arc<Plan>>,
    /// The parameter shapes of the layout the memories were built for
    /// ([`SavedBucket::layout`]); a step whose bucket has other shapes while the bucket
    /// holds memory is refused ([`plan::check_memory`]). Absent for a bucket loaded from
    /// a state saved without it, until its next step records the layout it meets.
    pub layout: Option<Vec<Vec<usize>>>,
    /// The stacking buffer of the batches whose matrices are not contiguous in the bucket.
    pub stack: Option<B::Buffer<f32>>,
    /// The step's working `P` and `Q`, the buffers it computes and all-reduces (lost in a
    /// failed collective: reallocated then).
    pub work: Option<(Factor<B>, Factor<B>)>,
    /// The step's non-finite flag (one element).
    pub flag: Option<B::Buffer<f32>>,
    /// The uncompressed tensors, gathered for their all-reduce (lost in a failed
    /// collective: reallocated then).
    pub u: Option<B::Buffer<f32>>,
}

impl<B: Backend> LayerMemory<B> {
    /// The memory of a bucket of `len` elements that has none yet.
    pub fn empty(len: usize) -> Self {
        LayerMemory {
            len,
            error: None,
            factors: None,
            order: None,
            layout: None,
            stack: None,
            work: None,
            flag: None,
            u: None,
        }
    }
}

impl<B: Backend + 'static> Memory<B> for LayerMemory<B> {
    /// Without warm start the factors are dropped, as a completed step drops them: the
    /// next step draws a new `Q`.
    fn after_failure(&mut self, config: &PowerSgdConfig) {
        if !config.warm_start {
            self.factors = None;
        }
    }

    /// In the saved order, whatever the plan's (see `plan.rs`); `None` without error
    /// feedback and factors.
    fn save(&self, be: &B, _index: usize) -> Result<Option<SavedBucket>> {
        if self.error.is_none() && self.factors.is_none() {
            return Ok(None);
        }
        let saved = |memory: plan::Memory, buf: Option<&B::Buffer<f32>>| -> Result<Vec<f32>> {
            let Some(buf) = buf else {
                return Ok(Vec::new());
            };
            let mut v = vec![0.0; B::buffer_len(buf)];
            be.download(B::view(buf, ..)?, &mut v)?;
            match &self.order {
                Some(plan) if !plan.in_saved_order() => Ok(plan.ours_to_saved(memory, &v)?),
                _ => Ok(v),
            }
        };
        let f = self.factors.as_ref();
        Ok(Some(SavedBucket {
            len: self.len,
            layout: self.layout.clone(),
            error: saved(plan::Memory::Error, self.error.as_ref())?,
            p: saved(plan::Memory::P, f.map(|f| &f.p))?,
            q: saved(plan::Memory::Q, f.map(|f| &f.q))?,
        }))
    }

    fn keep_flag(&mut self, flag: B::Buffer<f32>) {
        self.flag = Some(flag);
    }
}

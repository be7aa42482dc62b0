//! Unused parameters: declared ones (`mark_unused`), zeroed slots, and DDP's
//! used-parameter map across ranks (`find_unused_parameters`). See the parent module's
//! "Unused parameters".

use super::{in_flight, twice, Reducer};
use crate::{CommBackend, CommHook, Error, Result};
use collectives::Buffer;

impl<B: CommBackend, H: CommHook<B>> Reducer<B, H> {
    /// The parameters that no rank used in the last step (declared unused or left
    /// unmarked on every rank, and holding no accumulated gradients), in increasing
    /// order, when that step was synchronised, [`ReducerConfig::find_unused_parameters`](super::ReducerConfig::find_unused_parameters)
    /// is on and the reducer has a process group ([`with_process_group`]): like DDP's
    /// `local_used_map`, one all-reduce of a map of the used parameters at the end of
    /// each such step finds them. Their gradient slots are zero. DDP leaves their `.grad`
    /// untouched (`None` after `zero_grad(set_to_none=True)`), so that the optimizer
    /// skips them, weight decay and momentum included: skip these likewise. `None`
    /// otherwise.
    ///
    /// [`with_process_group`]: Self::with_process_group
    pub fn globally_unused(&self) -> Option<&[usize]> {
        self.globally_unused.as_deref()
    }

    /// Declares that `param` gets no gradient in this step (DDP's unused parameter),
    /// whatever [`ReducerConfig::find_unused_parameters`](super::ReducerConfig::find_unused_parameters) says. In a synchronised step
    /// its slot is zeroed, unless gradients accumulated in unsynchronised steps since the
    /// last synchronised one are there (those are reduced as they are), and it counts as
    /// ready, so its bucket can launch before `finish`. In an unsynchronised step it
    /// only counts as marked. Its slot must not have been written in this step: a
    /// parameter whose slot [`Reducer::grad_mut`] handed out in this step is
    /// [`Error::WrittenUnused`], and nothing changes (zeroing it would silently drop the
    /// gradient). Marking a parameter twice in a step (ready or unused) is an error.
    pub fn mark_unused(&mut self, param: usize) -> Result<()> {
        self.place(param)?;
        if self.is_ready[param] {
            return Err(twice(param));
        }
        if self.written[param] {
            return Err(Error::WrittenUnused {
                param,
                shape: crate::bucket::shape_str(&self.shapes[param]),
            });
        }
        self.mark_unused_unchecked(param)
    }

    /// [`Reducer::mark_unused`] for a slot this crate wrote in part and gives up on (a
    /// copy into it failed): it is zeroed like any unused parameter's.
    #[cfg(feature = "pipe")]
    pub(crate) fn discard(&mut self, param: usize) -> Result<()> {
        self.place(param)?;
        if self.is_ready[param] {
            return Err(twice(param));
        }
        self.mark_unused_unchecked(param)
    }

    /// `mark_unused` once the checks passed.
    pub(super) fn mark_unused_unchecked(&mut self, param: usize) -> Result<()> {
        // Zero before the mark: once marked, the bucket may be in flight.
        let zeroed = if self.step_sync.unwrap_or(self.sync) {
            self.zero_unless_accumulated(param)
        } else {
            Ok(())
        };
        let launched = if self.mark(param)? {
            self.unused[param] = true;
            self.launch_ready()
        } else {
            Ok(())
        };
        zeroed.and(launched)
    }

    /// Zeroes `param`'s slot, unless it holds gradients accumulated in unsynchronised
    /// steps since the last synchronised one.
    pub(super) fn zero_unless_accumulated(&mut self, param: usize) -> Result<()> {
        if self.accumulated[param] {
            return Ok(());
        }
        self.zero_slot(param)
    }

    /// Zeroes `param`'s slot.
    pub(super) fn zero_slot(&mut self, param: usize) -> Result<()> {
        let p = self.place(param)?;
        if p.len == 0 {
            return Ok(());
        }
        let storage = self.buckets[p.bucket]
            .storage
            .as_mut()
            .ok_or_else(|| in_flight(p.bucket))?;
        self.backend
            .zero(B::view_mut(storage, p.offset..p.offset + p.len)?)?;
        Ok(())
    }

    /// DDP's used-parameter map (nothing without a process group): one all-reduce of
    /// this rank's map (1 where the parameter was marked ready in this step or holds
    /// accumulated gradients) finds the parameters no rank used; their slots are zeroed,
    /// since a hook's result there is no gradient (PowerSGD's error feedback can make it
    /// nonzero), and [`Reducer::globally_unused`] lists them.
    pub(super) fn find_globally_unused(&mut self) -> Result<()> {
        let Some(group) = self.group.clone() else {
            return Ok(());
        };
        let used: Vec<f32> = (0..self.unused.len())
            .map(|p| f32::from(u8::from(!self.unused[p] || self.accumulated[p])))
            .collect();
        let total: Vec<f32> = group
            .all_reduce(Buffer::from(used), collectives::ReduceOp::Sum)
            .wait()?
            .try_into()?;
        if total.len() != self.unused.len() {
            return Err(Error::Config(format!(
                "the used-parameter map came back with {} entries for {} parameters",
                total.len(),
                self.unused.len()
            )));
        }
        let unused: Vec<usize> = (0..total.len()).filter(|&p| total[p] == 0.0).collect();
        for &p in &unused {
            self.zero_slot(p)?;
        }
        self.globally_unused = Some(unused);
        Ok(())
    }
}

//! Model averaging and post-local SGD (PyTorch's `torch.distributed.algorithms.model_averaging`
//! and `post_localSGD_hook`).
//!
//! Local SGD lets each rank take optimizer steps on its own gradients and averages the
//! *parameters* every few steps instead of the gradients every step:
//!
//! - [`PostLocalSgd`], a [`CommHook`], averages gradients globally (exactly as
//!   [`AllReduce`](crate::AllReduce)) for the first `start_local_sgd_iter` steps, then
//!   only within a subgroup (or not at all).
//! - [`PeriodicModelAverager`] averages the parameters over a group every `period`
//!   steps after `warmup_steps`; [`HierarchicalModelAverager`] averages them within
//!   several nested groups at several periods (pairs every 2 steps, everyone every 4).
//!
//! Pair the hook with an averager whose `warmup_steps` is the hook's
//! `start_local_sgd_iter`, called after each optimizer step, as in PyTorch:
//!
//! ```
//! use collectives::{run_local, ProcessGroup};
//! use ddp_hooks::averaging::PeriodicModelAverager;
//! use std::sync::Arc;
//!
//! let out = run_local(2, |group| {
//!     let rank = group.rank() as f32;
//!     let mut averager = PeriodicModelAverager::new(2, 1, Arc::new(group)).unwrap();
//!     let mut weight = vec![rank; 3];
//!     let mut averaged = Vec::new();
//!     for _ in 0..4 {
//!         weight[0] += rank; // a local optimizer step
//!         averaged.push(averager.average_parameters(&mut [&mut weight[..]]).unwrap());
//!     }
//!     (averaged, weight)
//! })
//! .unwrap();
//! for r in out {
//!     let (averaged, weight) = r.unwrap();
//!     assert_eq!(averaged, [false, true, false, true]); // steps 1 and 3: warmup + k·period
//!     assert_eq!(weight, [2.5, 0.5, 0.5]); // equal on both ranks right after step 3
//! }
//! ```

use crate::bucket::f32_bytes;
use crate::{CommBackend, CommHook, Error, GradBucket, HookState, Result};
use collectives::{Buffer, ProcessGroup, ReduceOp, Work};
use serde::{Deserialize, Serialize};
use std::sync::{Arc, Mutex, MutexGuard};

/// PyTorch's warning for averaging every step.
const PERIOD_ONE: &str = "When period is 1, no need to use model averaging because the communication cost of all-reducing parameters will be no less than the cost of all-reducing gradients by DistributedDataParallel in the backward pass. Therefore, only DistributedDataParallel should be used for this case.";

/// This rank's block of `size` consecutive ranks of `group` (PyTorch's
/// `dist.new_subgroups(group_size=size)`): blocks `0..size`, `size..2·size`, ... each made
/// a subgroup with [`ProcessGroup::new_group`], and the one holding this rank returned
/// (its rank `i` is the block's `i`-th rank).
///
/// It calls `new_group` once per block, so **every rank of `group` must call it, with the
/// same `size`, at the same point of its sequence of `new_group` calls** (as every
/// `new_group`). A `size` of 0 or one that does not divide the group's size is
/// [`Error::Config`] (on every rank alike, before any `new_group` call).
pub fn new_subgroups(group: &dyn ProcessGroup, size: usize) -> Result<Arc<dyn ProcessGroup>> {
    let world = group.size();
    if size == 0 || !world.is_multiple_of(size) {
        return Err(Error::Config(format!(
            "subgroup size = {size}: the group's size {world} must be divisible by it"
        )));
    }
    let mut mine = None;
    for block in 0..world / size {
        let ranks: Vec<usize> = (block * size..(block + 1) * size).collect();
        if let Some(sub) = group.new_group(&ranks)? {
            mine = Some(Arc::from(sub));
        }
    }
    mine.ok_or_else(|| {
        Error::Config(format!(
            "rank {} of a group of {world} is in no block of {size} ranks",
            group.rank()
        ))
    })
}

/// Averages `params` over `group` in place, as PyTorch's
/// `average_parameters_or_parameter_groups`: all of them flattened into one buffer,
/// divided by the group's size, SUM all-reduced (waited for within the group's timeout)
/// and written back. On an error the parameters are left as they were.
fn average_in(group: &dyn ProcessGroup, params: &mut [&mut [f32]]) -> Result<()> {
    let total = params
        .iter()
        .try_fold(0usize, |n, p| n.checked_add(p.len()))
        .filter(|&n| f32_bytes(n).is_some())
        .ok_or_else(|| Error::Overflow(format!("the {} parameters averaged", params.len())))?;
    let mut flat: Vec<f32> = Vec::new();
    flat.try_reserve_exact(total)
        .map_err(|_| Error::buffer(total, size_of::<f32>()))?;
    let size = group.size() as f32;
    for p in params.iter() {
        flat.extend(p.iter().map(|&x| x / size));
    }
    let out = group
        .all_reduce(Buffer::from(flat), ReduceOp::Sum)
        .wait_timeout(group.timeout())?;
    let out = Vec::<f32>::try_from(out)?;
    if out.len() != total {
        return Err(Error::Comm(collectives::Error::Mismatch(format!(
            "the averaged buffer came back with {} elements, {total} were sent",
            out.len()
        ))));
    }
    let mut offset = 0;
    for p in params.iter_mut() {
        let len = p.len();
        p.copy_from_slice(&out[offset..offset + len]);
        offset += len;
    }
    Ok(())
}

/// An averager's saved state ([`PeriodicModelAverager::state`],
/// [`HierarchicalModelAverager::state`]): the steps taken so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AveragerState {
    /// Calls of `average_parameters` so far (PyTorch's `averager.step`).
    pub step: u64,
}

/// Averages parameters over a group every `period` steps after `warmup_steps` (PyTorch's
/// `PeriodicModelAverager`): at steps `warmup`, `warmup + period`, `warmup + 2·period`, ...
/// Call [`average_parameters`](Self::average_parameters) once per step, after the
/// optimizer step, on every rank of the group.
pub struct PeriodicModelAverager {
    period: u64,
    warmup_steps: u64,
    step: u64,
    group: Arc<dyn ProcessGroup>,
}

impl PeriodicModelAverager {
    /// An averager over `group` at step 0. A `period` of 0 is [`Error::Config`]; a
    /// `period` of 1 logs a warning (averaging the parameters every step costs no less
    /// than averaging the gradients, as DDP already does).
    pub fn new(period: u64, warmup_steps: u64, group: Arc<dyn ProcessGroup>) -> Result<Self> {
        if period < 1 {
            return Err(Error::Config(format!(
                "period = {period}: Arg ``period`` must be a positive value."
            )));
        }
        if period == 1 {
            tracing::warn!("{PERIOD_ONE}");
        }
        Ok(PeriodicModelAverager {
            period,
            warmup_steps,
            step: 0,
            group,
        })
    }

    /// Averages `params` over the group in place if this step is `warmup_steps + k·period`
    /// (PyTorch divides each value by the group size, then sums: so does this), then
    /// counts the step; returns whether it averaged. Every rank must pass parameters of
    /// the same lengths. A failed collective (a timeout, a lost peer, a length mismatch)
    /// is an error that leaves the parameters and the step as they were.
    pub fn average_parameters(&mut self, params: &mut [&mut [f32]]) -> Result<bool> {
        let due = self.step >= self.warmup_steps
            && (self.step - self.warmup_steps).is_multiple_of(self.period);
        if due {
            average_in(&*self.group, params)?;
        }
        self.step = self.step.saturating_add(1);
        Ok(due)
    }

    /// Steps taken so far (the next call of `average_parameters` is step `step()`).
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Sets the step counter, to resume a run.
    pub fn set_step(&mut self, step: u64) {
        self.step = step;
    }

    /// The averaging period.
    pub fn period(&self) -> u64 {
        self.period
    }

    /// Steps before the first average.
    pub fn warmup_steps(&self) -> u64 {
        self.warmup_steps
    }

    /// The state to save (the step).
    pub fn state(&self) -> AveragerState {
        AveragerState { step: self.step }
    }

    /// Continues from a saved state.
    pub fn load_state(&mut self, state: AveragerState) {
        self.step = state.step;
    }
}

/// Averages parameters within nested groups at several periods (PyTorch's
/// `HierarchicalModelAverager`): `periods` lists `(period, group size)` pairs in
/// ascending order of period, the last size being the whole group's. At each step from
/// `warmup_steps` on, the parameters are averaged in the group of the **largest** period
/// that divides the step, if any. As in PyTorch this tests `step % period`, not
/// `(step − warmup) % period` as [`PeriodicModelAverager`] does.
///
/// With `[(2, 2), (4, 4)]` over 4 ranks: pairs `{0, 1}` and `{2, 3}` average at steps 2,
/// 6, 10, ...; all four at steps 0, 4, 8, ...
///
/// The groups of each size other than the whole group's are consecutive blocks of ranks
/// ([`new_subgroups`]), made by [`new`](Self::new) with `new_group`: every rank of the
/// group must construct its averager at the same point of its sequence of `new_group`
/// calls, with the same `periods`.
pub struct HierarchicalModelAverager {
    /// `(period, this rank's group of that period's size)`, ascending in period.
    groups: Vec<(u64, Arc<dyn ProcessGroup>)>,
    warmup_steps: u64,
    step: u64,
}

impl HierarchicalModelAverager {
    /// An averager at step 0 over `group` and the subgroups `periods` asks for.
    ///
    /// [`Error::Config`] (PyTorch's `ValueError`s, plus what would fail later there): an
    /// empty `periods`; a period of 0 (PyTorch checks only the first); periods not
    /// strictly ascending (PyTorch assumes it without checking); a group size of 0 or
    /// one that does not divide the group's size; a last size other than the group's.
    /// A last period of 1 logs a warning. The checks run before any `new_group` call, so
    /// every rank fails alike.
    pub fn new(
        periods: Vec<(u64, usize)>,
        warmup_steps: u64,
        group: Arc<dyn ProcessGroup>,
    ) -> Result<Self> {
        let world = group.size();
        let Some(&(last_period, last_size)) = periods.last() else {
            return Err(Error::Config(
                "periods = []: Arg ``period_group_size_dict`` must not be empty.".into(),
            ));
        };
        if let Some(&(p, _)) = periods.iter().find(|(p, _)| *p == 0) {
            return Err(Error::Config(format!(
                "period = {p}: The period in arg ``period_group_size_dict`` must be a positive value."
            )));
        }
        if let Some(w) = periods.windows(2).find(|w| w[0].0 >= w[1].0) {
            return Err(Error::Config(format!(
                "periods {} then {}: the periods must be strictly ascending",
                w[0].0, w[1].0
            )));
        }
        if let Some(&(p, s)) = periods
            .iter()
            .find(|(_, s)| *s == 0 || !world.is_multiple_of(*s))
        {
            return Err(Error::Config(format!(
                "period {p}: group size {s} does not divide the group's size {world}"
            )));
        }
        if last_size != world {
            return Err(Error::Config(format!(
                "last group size = {last_size}: The last value in arg ``period_process_group_dict`` must be equal to the size of arg ``process_group`` ({world})."
            )));
        }
        if last_period == 1 {
            tracing::warn!("{PERIOD_ONE}");
        }
        let mut groups = Vec::with_capacity(periods.len());
        for (period, size) in periods {
            let g = if size == world {
                group.clone()
            } else {
                new_subgroups(&*group, size)?
            };
            groups.push((period, g));
        }
        Ok(HierarchicalModelAverager {
            groups,
            warmup_steps,
            step: 0,
        })
    }

    /// Averages `params` in place, from `warmup_steps` on, in the group of the largest
    /// period dividing the step (divided by that group's size, then summed over it), then
    /// counts the step; returns the period it averaged at, or `None`. A failed collective
    /// is an error that leaves the parameters and the step as they were.
    pub fn average_parameters(&mut self, params: &mut [&mut [f32]]) -> Result<Option<u64>> {
        let chosen = if self.step >= self.warmup_steps {
            self.groups
                .iter()
                .rev()
                .find(|(period, _)| self.step.is_multiple_of(*period))
        } else {
            None
        };
        let averaged = match chosen {
            Some((period, group)) => {
                average_in(&**group, params)?;
                Some(*period)
            }
            None => None,
        };
        self.step = self.step.saturating_add(1);
        Ok(averaged)
    }

    /// Steps taken so far.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Sets the step counter, to resume a run.
    pub fn set_step(&mut self, step: u64) {
        self.step = step;
    }

    /// Steps before the first average.
    pub fn warmup_steps(&self) -> u64 {
        self.warmup_steps
    }

    /// `(period, size of this rank's group for it)`, ascending in period.
    pub fn periods(&self) -> Vec<(u64, usize)> {
        self.groups.iter().map(|(p, g)| (*p, g.size())).collect()
    }

    /// The state to save (the step).
    pub fn state(&self) -> AveragerState {
        AveragerState { step: self.step }
    }

    /// Continues from a saved state.
    pub fn load_state(&mut self, state: AveragerState) {
        self.step = state.step;
    }
}

/// [`PostLocalSgd`]'s state (PyTorch's `PostLocalSGDState`, less its groups).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PostLocalSgdState {
    /// Steps of global gradient averaging before local SGD starts
    /// (`start_localSGD_iter`).
    pub start_local_sgd_iter: u64,
    /// After the start, whether gradients are still averaged within the subgroup
    /// (`post_local_gradient_allreduce`); if not, they stay local.
    pub post_local_gradient_allreduce: bool,
    /// Steps counted so far; stops at `start_local_sgd_iter`.
    pub iter: u64,
}

/// Post-local SGD (PyTorch's `post_localSGD_hook`): while fewer than
/// `start_local_sgd_iter` steps have been seen, the exact global average of each bucket
/// (what [`AllReduce`](crate::AllReduce) does, a group `Avg`); from then on the average
/// within `subgroup` if `post_local_gradient_allreduce`, else the bucket untouched (no
/// communication). Pair it with a model averager (see the [module](self)).
///
/// A step is counted at its last bucket ([`GradBucket::is_last`]: `index + 1 == count`,
/// this crate's last bucket of a step, PyTorch's bucket 0), so `iter` advances once per
/// step and freezes at `start_local_sgd_iter`; with a start of 0 the hook is local from
/// the first step.
///
/// `subgroup` is this rank's subgroup, made by the caller (by [`new_subgroups`] or
/// [`ProcessGroup::new_group`]; PyTorch's default is a block of as many ranks as a node
/// has accelerators). It is used only after the start with
/// `post_local_gradient_allreduce`.
pub struct PostLocalSgd<B> {
    backend: Arc<B>,
    group: Arc<dyn ProcessGroup>,
    subgroup: Arc<dyn ProcessGroup>,
    state: Mutex<PostLocalSgdState>,
}

impl<B: CommBackend> PostLocalSgd<B> {
    /// The hook over `group` and `subgroup`, at iteration 0. A `subgroup` larger than
    /// `group` is [`Error::Config`].
    pub fn new(
        backend: Arc<B>,
        group: Arc<dyn ProcessGroup>,
        subgroup: Arc<dyn ProcessGroup>,
        start_local_sgd_iter: u64,
        post_local_gradient_allreduce: bool,
    ) -> Result<Self> {
        if subgroup.size() > group.size() {
            return Err(Error::Config(format!(
                "subgroup of {} ranks: larger than the group of {}",
                subgroup.size(),
                group.size()
            )));
        }
        Ok(PostLocalSgd {
            backend,
            group,
            subgroup,
            state: Mutex::new(PostLocalSgdState {
                start_local_sgd_iter,
                post_local_gradient_allreduce,
                iter: 0,
            }),
        })
    }

    /// The hook's state (a poisoned lock still holds a consistent state: it is only
    /// ever replaced whole or counted).
    fn lock(&self) -> MutexGuard<'_, PostLocalSgdState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The current state.
    pub fn state(&self) -> PostLocalSgdState {
        *self.lock()
    }
}

impl<B: CommBackend> CommHook<B> for PostLocalSgd<B> {
    fn name(&self) -> String {
        "post_local_sgd".into()
    }

    fn run(&mut self, bucket: GradBucket<B>) -> Work<B::Buffer<f32>> {
        let (global, local_allreduce) = {
            let mut s = self.lock();
            if s.iter < s.start_local_sgd_iter {
                if bucket.is_last() {
                    s.iter += 1;
                    if s.iter == s.start_local_sgd_iter {
                        tracing::info!("Start to apply local SGD after {} iterations.", s.iter);
                    }
                }
                (true, true)
            } else {
                (false, s.post_local_gradient_allreduce)
            }
        };
        let buffer = bucket.into_buffer();
        match (global, local_allreduce) {
            (true, _) => self.backend.all_reduce(&*self.group, buffer, ReduceOp::Avg),
            (false, true) => self
                .backend
                .all_reduce(&*self.subgroup, buffer, ReduceOp::Avg),
            (false, false) => Work::ready(Ok(buffer)),
        }
    }

    fn save_state(&self) -> Result<HookState> {
        Ok(HookState::PostLocalSgd(self.state()))
    }

    /// Accepts a state of the same `start_local_sgd_iter` and
    /// `post_local_gradient_allreduce` whose `iter` is at most the start.
    fn load_state(&self, state: HookState) -> Result<()> {
        let HookState::PostLocalSgd(new) = state else {
            return Err(state.mismatch("post-local SGD"));
        };
        let mut s = self.lock();
        if new.start_local_sgd_iter != s.start_local_sgd_iter
            || new.post_local_gradient_allreduce != s.post_local_gradient_allreduce
        {
            return Err(Error::State(format!(
                "a post-local SGD state with start_local_sgd_iter = {}, post_local_gradient_allreduce = {} cannot be loaded into a hook with {}, {}",
                new.start_local_sgd_iter,
                new.post_local_gradient_allreduce,
                s.start_local_sgd_iter,
                s.post_local_gradient_allreduce
            )));
        }
        if new.iter > new.start_local_sgd_iter {
            return Err(Error::State(format!(
                "post-local SGD iter = {} is past start_local_sgd_iter = {}, where it stops",
                new.iter, new.start_local_sgd_iter
            )));
        }
        *s = new;
        Ok(())
    }

    fn iteration(&self) -> Option<u64> {
        Some(self.lock().iter)
    }
}

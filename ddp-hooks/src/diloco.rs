//! DiLoCo and Streaming DiLoCo (torchft's `DiLoCo` in `local_sgd.py`; arXiv 2311.08105
//! and 2501.18512): each rank takes `H` inner optimizer steps on its own, then the ranks
//! average the *pseudo-gradient* `Δ = θ − θ_local` (the outer parameters minus the local
//! ones) through a [`CommHook`] and take one outer step on `θ`, by default PyTorch's
//! `SGD(lr=0.7, momentum=0.9, nesterov=True)`; every rank then continues from the new `θ`.
//!
//! With `fragments = F > 1` (Streaming DiLoCo) the parameters are split into `F`
//! contiguous fragments, by parameter, and one fragment syncs every `S = H / F` inner
//! steps, in turn: fragment 0 at step `S`, fragment 1 at `2·S`, ..., fragment `F − 1` at
//! `H`, fragment 0 again at `H + S`. Each fragment so syncs every `H` steps, staggered, and
//! a sync touches only its fragment's parameters (torchft with `fragment_sync_delay = 0`
//! and `fragment_update_alpha = 0`: the reduction is waited for at once, and the
//! fragment restarts from the new `θ`).
//!
//! Call [`DiLoCo::step`] after each inner optimizer step, on every rank:
//!
//! ```
//! use collectives::{run_local, ProcessGroup};
//! use ddp_hooks::{AllReduce, DiLoCo, DiLoCoConfig};
//! use lowrank::CpuBackend;
//! use std::sync::Arc;
//!
//! let out = run_local(2, |group| {
//!     let rank = group.rank() as f32;
//!     let backend = Arc::new(CpuBackend::new());
//!     let hook = AllReduce::new(backend.clone(), Arc::new(group));
//!     // Outer SGD with lr 1 and no momentum: θ − mean(θ − θ_local) = mean(θ_local).
//!     let config = DiLoCoConfig {
//!         inner_steps: 2,
//!         outer_lr: 1.0,
//!         outer_momentum: 0.0,
//!         nesterov: false,
//!         ..Default::default()
//!     };
//!     let mut weight = vec![1.0f32; 3];
//!     let mut diloco = DiLoCo::new(config, hook, backend, &[&weight[..]]).unwrap();
//!     let mut synced = Vec::new();
//!     for _ in 0..2 {
//!         weight[0] += rank; // an inner optimizer step
//!         synced.push(diloco.step(&mut [&mut weight[..]]).unwrap());
//!     }
//!     (synced, weight)
//! })
//! .unwrap();
//! for r in out {
//!     let (synced, weight) = r.unwrap();
//!     assert_eq!(synced, [false, true]); // the H-th step syncs
//!     assert_eq!(weight, [2.0, 1.0, 1.0]); // the mean of 1 + 0 + 0 and 1 + 1 + 1
//! }
//! ```

use crate::bucket::{element_count, f32_bytes, shape_str};
use crate::{CommBackend, CommHook, Error, GradBucket, HookState, Layout, Result};
use lowrank::CpuBackend;
use serde::{Deserialize, Serialize};
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

/// [`DiLoCo`]'s hyperparameters. The defaults are the published DiLoCo's outer optimizer
/// (Nesterov SGD, lr 0.7, momentum 0.9) and `H = 500`, one fragment.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DiLoCoConfig {
    /// Inner steps per outer step of each fragment (`H`, torchft's `sync_every`), at
    /// least 1 and a multiple of `fragments`.
    pub inner_steps: u64,
    /// The outer SGD's learning rate (finite, at least 0).
    pub outer_lr: f32,
    /// The outer SGD's momentum `μ` (finite, at least 0; 0 keeps no momentum buffer, as
    /// PyTorch's SGD).
    pub outer_momentum: f32,
    /// Nesterov momentum (requires `outer_momentum > 0`, as PyTorch's SGD).
    pub nesterov: bool,
    /// Fragments `F` (1: plain DiLoCo; more: Streaming DiLoCo), at least 1, at most the
    /// number of parameters and at most `inner_steps`, dividing `inner_steps`.
    pub fragments: usize,
    /// How long a sync waits for the hook's reduction before [`collectives::Error::Timeout`]
    /// (set it to the process group's [`timeout`](collectives::ProcessGroup::timeout);
    /// [`collectives::DEFAULT_TIMEOUT`] unless set).
    pub timeout: Duration,
}

impl Default for DiLoCoConfig {
    fn default() -> Self {
        DiLoCoConfig {
            inner_steps: 500,
            outer_lr: 0.7,
            outer_momentum: 0.9,
            nesterov: true,
            fragments: 1,
            timeout: collectives::DEFAULT_TIMEOUT,
        }
    }
}

impl DiLoCoConfig {
    /// Checks the configuration for a model of `params` parameters: [`Error::Config`]
    /// for `inner_steps = 0`; a learning rate or momentum that is negative or not finite;
    /// Nesterov without momentum; `fragments` of 0, above `params`, above `inner_steps`
    /// or not dividing it (torchft's checks).
    pub fn validate(&self, params: usize) -> Result<()> {
        let DiLoCoConfig {
            inner_steps: h,
            outer_lr: lr,
            outer_momentum: mu,
            nesterov,
            fragments: f,
            timeout: _,
        } = *self;
        if h < 1 {
            return Err(Error::Config(format!(
                "inner_steps = {h}: must be at least 1"
            )));
        }
        if !lr.is_finite() || lr < 0.0 {
            return Err(Error::Config(format!(
                "outer_lr = {lr}: must be finite and at least 0"
            )));
        }
        if !mu.is_finite() || mu < 0.0 {
            return Err(Error::Config(format!(
                "outer_momentum = {mu}: must be finite and at least 0"
            )));
        }
        if nesterov && mu <= 0.0 {
            return Err(Error::Config(format!(
                "nesterov with outer_momentum = {mu}: Nesterov momentum requires a momentum"
            )));
        }
        if f < 1 || f > params {
            return Err(Error::Config(format!(
                "fragments = {f}: must be at least 1 and at most the number of parameters ({params})"
            )));
        }
        if (f as u64) > h || !h.is_multiple_of(f as u64) {
            return Err(Error::Config(format!(
                "fragments = {f}: inner_steps = {h} must be a multiple of the number of fragments"
            )));
        }
        Ok(())
    }

    /// Inner steps between two syncs (of successive fragments): `S = H / F`.
    pub fn sync_interval(&self) -> u64 {
        self.inner_steps / (self.fragments.max(1) as u64)
    }
}

/// [`DiLoCo`]'s saved state ([`DiLoCo::state`]), serde-serialisable.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DiLoCoState {
    /// Inner steps taken so far.
    pub step: u64,
    /// The outer parameters `θ`, one vector per parameter.
    pub original: Vec<Vec<f32>>,
    /// The outer SGD's momentum buffer per parameter: `None` before the parameter's first
    /// outer step, and always with no momentum (as PyTorch's SGD keeps none).
    pub momentum: Vec<Option<Vec<f32>>>,
    /// The hook's state ([`CommHook::save_state`]).
    pub hook: HookState,
}

/// DiLoCo / Streaming DiLoCo over a [`CommHook`] (see the [module](self)): keeps the outer
/// parameters `θ` and the outer momentum per parameter, and on each fragment's sync step
/// reduces that fragment's pseudo-gradient through the hook as one bucket (index `f` of
/// `F`, laid out with the parameters' shapes, so per-layer hooks such as PowerSGD see
/// each matrix), takes the outer step and resets the fragment to the new `θ`.
pub struct DiLoCo<H, B: CommBackend = CpuBackend> {
    config: DiLoCoConfig,
    hook: H,
    backend: Arc<B>,
    /// Fragment `f` holds parameters `bounds[f]..bounds[f + 1]`.
    bounds: Vec<usize>,
    /// Each fragment's bucket layout.
    layouts: Vec<Arc<Layout>>,
    original: Vec<Vec<f32>>,
    momentum: Vec<Option<Vec<f32>>>,
    step: u64,
}

/// A copy of `src`, an allocation failure being an error.
fn copy_of(src: &[f32]) -> Result<Vec<f32>> {
    let mut v = Vec::new();
    v.try_reserve_exact(src.len())
        .map_err(|_| Error::buffer(src.len(), size_of::<f32>()))?;
    v.extend_from_slice(src);
    Ok(v)
}

impl<H: CommHook<B>, B: CommBackend> DiLoCo<H, B> {
    /// DiLoCo at step 0 over `params`, each taken as a vector (shape `[len]`): their copy
    /// is the outer parameters. See [`with_shapes`](Self::with_shapes).
    pub fn new(config: DiLoCoConfig, hook: H, backend: Arc<B>, params: &[&[f32]]) -> Result<Self> {
        let shapes: Vec<Vec<usize>> = params.iter().map(|p| vec![p.len()]).collect();
        Self::with_shapes(config, hook, backend, params, &shapes)
    }

    /// DiLoCo at step 0 over `params` of the given shapes (what a per-layer hook such as
    /// PowerSGD compresses: a weight `[out, in]` is a matrix). Fragment `f` of `F` holds
    /// parameters `⌊n·f/F⌋..⌊n·(f+1)/F⌋` of the `n`. [`Error::Config`] for a
    /// configuration that [`DiLoCoConfig::validate`] refuses, or shapes that are not one
    /// per parameter with its element count; [`Error::Overflow`] / [`Error::Alloc`] for
    /// parameters no buffer could hold.
    pub fn with_shapes(
        config: DiLoCoConfig,
        hook: H,
        backend: Arc<B>,
        params: &[&[f32]],
        shapes: &[Vec<usize>],
    ) -> Result<Self> {
        let n = params.len();
        config.validate(n)?;
        if shapes.len() != n {
            return Err(Error::Config(format!(
                "{} shapes for {n} parameters",
                shapes.len()
            )));
        }
        for (i, (p, s)) in params.iter().zip(shapes).enumerate() {
            if element_count(s) != Some(p.len()) {
                return Err(Error::Config(format!(
                    "parameter {i} has {} elements, its shape {} does not",
                    p.len(),
                    shape_str(s)
                )));
            }
        }
        let f = config.fragments;
        let bounds: Vec<usize> = (0..=f).map(|k| n * k / f).collect();
        let layouts = bounds
            .windows(2)
            .map(|w| Layout::packed(&shapes[w[0]..w[1]]).map(Arc::new))
            .collect::<Result<Vec<_>>>()?;
        let original = params
            .iter()
            .map(|p| copy_of(p))
            .collect::<Result<Vec<_>>>()?;
        Ok(DiLoCo {
            config,
            hook,
            backend,
            bounds,
            layouts,
            original,
            momentum: vec![None; n],
            step: 0,
        })
    }

    /// Counts an inner step, to be called after each inner optimizer step on every rank;
    /// on a sync step (every `S`-th: every `H`-th with one fragment) syncs its fragment:
    /// the pseudo-gradient `θ − params` of the fragment's parameters reduced through the
    /// hook (waited for within the configured timeout), the outer SGD step on `θ`
    /// (PyTorch's: `m = μ·m + g` (`m = g` at first), `u = g + μ·m` with Nesterov, else
    /// `m`; `θ −= lr·u`; with `μ = 0`, `θ −= lr·g`), then the fragment's parameters set
    /// to the new `θ`. Returns whether it synced.
    ///
    /// `params` must be the parameters of construction, in order, of the same lengths
    /// ([`Error::Config`] otherwise). A failed sync (a timeout, a lost peer, a hook's
    /// error) is an error that leaves the parameters, `θ`, the momentum and the step as
    /// they were, so calling again retries it (the hook's own state may have moved).
    pub fn step(&mut self, params: &mut [&mut [f32]]) -> Result<bool> {
        if params.len() != self.original.len() {
            return Err(Error::Config(format!(
                "{} parameters passed, DiLoCo holds {}",
                params.len(),
                self.original.len()
            )));
        }
        if let Some((i, (p, o))) = params
            .iter()
            .zip(&self.original)
            .enumerate()
            .find(|(_, (p, o))| p.len() != o.len())
        {
            return Err(Error::Config(format!(
                "parameter {i} has {} elements, {} at construction",
                p.len(),
                o.len()
            )));
        }
        let next = self
            .step
            .checked_add(1)
            .ok_or_else(|| Error::Overflow("the inner step counter".into()))?;
        let synced = match self.fragment_at(next) {
            Some(f) => {
                self.sync(f, params)?;
                true
            }
            None => false,
        };
        self.step = next;
        Ok(synced)
    }

    /// The fragment that syncs at inner step `step` (counted from 1), if any.
    fn fragment_at(&self, step: u64) -> Option<usize> {
        let s = self.config.sync_interval();
        let f = self.config.fragments as u64;
        (step > 0 && step.is_multiple_of(s)).then(|| ((step / s - 1) % f) as usize)
    }

    /// Syncs fragment `f` (see [`step`](Self::step)); nothing changes on an error.
    fn sync(&mut self, f: usize, params: &mut [&mut [f32]]) -> Result<()> {
        let range = self.bounds[f]..self.bounds[f + 1];
        let layout = self.layouts[f].clone();
        let total = layout.len();
        if f32_bytes(total).is_none() {
            return Err(Error::Overflow(format!("fragment {f}'s pseudo-gradient")));
        }
        let mut host: Vec<f32> = Vec::new();
        host.try_reserve_exact(total)
            .map_err(|_| Error::buffer(total, size_of::<f32>()))?;
        for i in range.clone() {
            host.extend(self.original[i].iter().zip(&*params[i]).map(|(o, p)| o - p));
        }
        let bucket = GradBucket::new(
            f,
            self.config.fragments,
            self.backend.upload(&host)?,
            layout,
        )?;
        let out = self
            .hook
            .run(bucket)
            .wait_timeout(self.config.timeout)
            .map_err(Error::from)?;
        let len = B::buffer_len(&out);
        if len != total {
            return Err(Error::Comm(collectives::Error::Mismatch(format!(
                "fragment {f}'s pseudo-gradient came back with {len} elements, {total} were sent"
            ))));
        }
        self.backend.download(B::view(&out, ..)?, &mut host)?;
        let (lr, mu, nesterov) = (
            self.config.outer_lr,
            self.config.outer_momentum,
            self.config.nesterov,
        );
        // The first outer step's momentum buffers (`m = g`), allocated before anything
        // changes.
        let mut offset = 0;
        let mut fresh = Vec::with_capacity(range.len());
        for i in range.clone() {
            let len = self.original[i].len();
            let first = mu != 0.0 && self.momentum[i].is_none();
            fresh.push(if first {
                Some(copy_of(&host[offset..offset + len])?)
            } else {
                None
            });
            offset += len;
        }
        let mut offset = 0;
        for (i, fresh) in range.zip(fresh) {
            let theta = &mut self.original[i];
            let g = &host[offset..offset + theta.len()];
            offset += theta.len();
            if mu == 0.0 {
                for (t, g) in theta.iter_mut().zip(g) {
                    *t -= lr * g;
                }
            } else {
                let slot = &mut self.momentum[i];
                match (fresh, slot.as_mut()) {
                    (Some(buf), _) => *slot = Some(buf),
                    (None, Some(m)) => {
                        for (m, g) in m.iter_mut().zip(g) {
                            *m = *m * mu + g;
                        }
                    }
                    (None, None) => {}
                }
                if let Some(m) = slot.as_deref() {
                    for ((t, g), m) in theta.iter_mut().zip(g).zip(m) {
                        let u = if nesterov { g + mu * m } else { *m };
                        *t -= lr * u;
                    }
                }
            }
            params[i].copy_from_slice(theta);
        }
        Ok(())
    }

    /// The state to save: the step, `θ`, the momentum and the hook's
    /// [`save_state`](CommHook::save_state) (whose error it returns).
    pub fn state(&self) -> Result<DiLoCoState> {
        Ok(DiLoCoState {
            step: self.step,
            original: self.original.clone(),
            momentum: self.momentum.clone(),
            hook: self.hook.save_state()?,
        })
    }

    /// Continues from `state`, saved by a `DiLoCo` over parameters of the same lengths
    /// (the parameters themselves are the caller's to restore): the next
    /// [`step`](Self::step) continues bit for bit as the saving run would have.
    /// [`Error::State`] if the lengths do not fit, or the hook's
    /// [`load_state`](CommHook::load_state) error; either leaves this `DiLoCo` unchanged.
    pub fn load_state(&mut self, state: DiLoCoState) -> Result<()> {
        let n = self.original.len();
        if state.original.len() != n || state.momentum.len() != n {
            return Err(Error::State(format!(
                "a DiLoCo state of {} parameters (momentum of {}) cannot be loaded into one of {n}",
                state.original.len(),
                state.momentum.len()
            )));
        }
        for (i, ((o, m), mine)) in state
            .original
            .iter()
            .zip(&state.momentum)
            .zip(&self.original)
            .enumerate()
        {
            let m_len = m.as_ref().map_or(o.len(), Vec::len);
            if o.len() != mine.len() || m_len != mine.len() {
                return Err(Error::State(format!(
                    "parameter {i} of the DiLoCo state has {} elements (momentum {m_len}), this DiLoCo's {}",
                    o.len(),
                    mine.len()
                )));
            }
        }
        self.hook.load_state(state.hook)?;
        self.step = state.step;
        self.original = state.original;
        self.momentum = state.momentum;
        Ok(())
    }

    /// The configuration.
    pub fn config(&self) -> &DiLoCoConfig {
        &self.config
    }

    /// Inner steps counted so far.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// The next sync: the inner step count after which it happens (`steps()` then) and
    /// its fragment.
    pub fn next_sync(&self) -> (u64, usize) {
        let s = self.config.sync_interval();
        let at = (self.step / s).saturating_add(1).saturating_mul(s);
        (at, self.fragment_at(at).unwrap_or(0))
    }

    /// The parameters of fragment `fragment` (indices into the parameter list), or
    /// `None` past the last fragment.
    pub fn fragment_params(&self, fragment: usize) -> Option<Range<usize>> {
        (fragment < self.config.fragments).then(|| self.bounds[fragment]..self.bounds[fragment + 1])
    }

    /// The outer parameters `θ`, one vector per parameter.
    pub fn original_params(&self) -> &[Vec<f32>] {
        &self.original
    }

    /// The hook.
    pub fn hook(&self) -> &H {
        &self.hook
    }

    /// The hook, mutably.
    pub fn hook_mut(&mut self) -> &mut H {
        &mut self.hook
    }

    /// The hook, giving up the rest.
    pub fn into_hook(self) -> H {
        self.hook
    }
}

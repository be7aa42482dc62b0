//! Candle embedding (feature `candle`): a candle training loop's gradients reduced by any
//! hook.
//!
//! [`CandleDdp`] holds a candle model's variables and a [`Reducer`] over their shapes. After
//! `loss.backward()`, [`CandleDdp::sync`] copies each variable's gradient out of candle's
//! [`GradStore`] into its bucket slot, in reverse order (the order backward produces them,
//! so the first bucket launches first), marking each ready; waits for every bucket's
//! reduction ([`Reducer::finish`]); and writes the reduced gradients back into the
//! `GradStore`, where the optimizer step finds them. Two thread ranks, one variable each:
//!
//! ```
//! use candle_core::{Device, Tensor, Var};
//! use collectives::{run_local, ProcessGroup};
//! use ddp_hooks::{candle::CandleDdp, HookSpec};
//! use std::sync::Arc;
//!
//! let means = run_local(2, |group| -> Result<Vec<f32>, ddp_hooks::candle::CandleError> {
//!     let rank = group.rank() as f32;
//!     let w = Var::new(&[1.0f32, 2.0, 3.0], &Device::Cpu)?;
//!     let mut ddp = CandleDdp::from_spec(&[w.clone()], &HookSpec::AllReduce, Arc::new(group))?;
//!     // loss = (rank + 1) · sum(w): the gradient is rank + 1 everywhere.
//!     let mut grads = w.affine(rank as f64 + 1.0, 0.0)?.sum_all()?.backward()?;
//!     ddp.sync(&mut grads)?;
//!     Ok(grads.get(&w).expect("synced").to_vec1::<f32>()?)
//! })
//! .unwrap();
//! for mean in means {
//!     assert_eq!(mean.unwrap().unwrap(), vec![1.5; 3]); // the mean of 1 and 2
//! }
//! ```
//!
//! # What it requires
//!
//! - The same variables in the same order on every rank (forward order, as
//!   [`Reducer::new`] takes shapes). candle-nn's `VarMap::all_vars` lists a hash map's
//!   order, which differs between maps: sort the vars by name first.
//! - `f32` variables on the CPU (checked by [`CandleDdp::new`]); gradients of the same
//!   dtype, device and shape (checked by `sync`). Non-contiguous gradients are copied.
//! - Accumulation over micro-steps happens in candle (sum the losses, or
//!   `GradStore::extend`), and `sync` runs once per optimizer step: it overwrites the
//!   reducer's slots, so the reducer's own `no_sync` accumulation is not used here.
//!
//! # A variable without a gradient
//!
//! candle's backward leaves a variable that did not contribute to the loss out of the
//! `GradStore`. `sync` treats it as DDP treats an unused parameter: it is not marked, and
//! [`Reducer::finish`] decides. With [`ReducerConfig::find_unused_parameters`] off (the
//! default) `sync` returns [`CandleError::Reducer`] holding
//! [`crate::Error::UnmarkedParameters`], which names every such variable by its index;
//! with it on, the variable counts as a zero gradient on this rank and receives the mean
//! like every other, unless no rank has a gradient for it: then it stays out of the
//! `GradStore` (DDP leaves such a parameter's `.grad` untouched, [`Reducer::globally_unused`];
//! candle-nn's optimizers skip a variable without a gradient, as PyTorch's skip a `None`
//! one). Either way the step's collectives all run, so no rank waits for this one.
//!
//! # Errors
//!
//! A gradient of the wrong dtype, device or shape is reduced as a zero on this rank, so the
//! peers complete the step, and `sync` returns [`CandleError::Gradients`] naming each one. On any
//! error `sync` leaves the `GradStore` as it was.

use crate::{CommHook, HookSpec, Reducer, ReducerConfig};
use candle_core::backprop::GradStore;
use candle_core::{DType, DeviceLocation, Storage, Tensor, Var};
use collectives::ProcessGroup;
use lowrank::CpuBackend;
use std::fmt;
use std::sync::Arc;

/// What can go wrong moving gradients between candle and the reducer. A type of its own
/// (not a variant of [`crate::Error`]) because candle's error is neither `Clone` nor
/// `PartialEq`, which the crate's error is.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CandleError {
    /// The reducer's or a hook's error.
    #[error(transparent)]
    Reducer(#[from] crate::Error),
    /// Candle's own error.
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    /// A variable the reducer cannot hold.
    #[error("var {var}: {problem}")]
    Var {
        /// Its index in the vars given.
        var: usize,
        /// What is wrong.
        problem: Problem,
    },
    /// Gradients that could not be reduced; the step ran with zeros in their place.
    #[error(
        "{}; the step was reduced with zeros in their place, so no rank waits, and the GradStore was left unchanged",
        list(.0)
    )]
    Gradients(Vec<(usize, Problem)>),
}

/// Why a variable or its gradient does not fit the reducer.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Problem {
    /// Not `f32`.
    DType(DType),
    /// Not in host memory.
    Device(DeviceLocation),
    /// A gradient whose shape differs from its variable's.
    Shape {
        /// The variable's shape.
        expected: Vec<usize>,
        /// The gradient's shape.
        got: Vec<usize>,
    },
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Problem::DType(d) => write!(f, "is {}, the reducer reduces f32", d.as_str()),
            Problem::Device(d) => write!(f, "is on {d:?}, the candle adapter is CPU only"),
            Problem::Shape { expected, got } => {
                write!(f, "has shape {got:?}, its var {expected:?}")
            }
        }
    }
}

fn list(problems: &[(usize, Problem)]) -> String {
    problems
        .iter()
        .map(|(var, p)| format!("gradient of var {var} {p}"))
        .collect::<Vec<_>>()
        .join("; ")
}

/// This module's result.
pub type Result<T> = std::result::Result<T, CandleError>;

/// A candle model's variables and the reducer that averages their gradients. See the
/// [module docs](self).
pub struct CandleDdp<H = Box<dyn CommHook<CpuBackend>>> {
    vars: Vec<Var>,
    shapes: Vec<Vec<usize>>,
    reducer: Reducer<CpuBackend, H>,
}

impl<H> fmt::Debug for CandleDdp<H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CandleDdp")
            .field("shapes", &self.shapes)
            .finish_non_exhaustive()
    }
}

impl CandleDdp {
    /// The hook `spec` over `group` (the registry's names: `allreduce`,
    /// `powersgd:rank=2,start_iter=10`, ...), DDP's default buckets, and `group` for the
    /// reducer's bucket rebuild. `vars` in forward order, the same on every rank.
    pub fn from_spec(vars: &[Var], spec: &HookSpec, group: Arc<dyn ProcessGroup>) -> Result<Self> {
        let backend = Arc::new(CpuBackend::new());
        let hook = spec.build(backend.clone(), group.clone())?;
        Ok(
            CandleDdp::new(vars, backend, hook, ReducerConfig::default())?
                .with_process_group(group),
        )
    }
}

impl<H: CommHook<CpuBackend>> CandleDdp<H> {
    /// A reducer for `vars` (forward order, the same on every rank) and `hook`. Each var
    /// must be `f32` in host memory ([`CandleError::Var`] otherwise).
    pub fn new(
        vars: &[Var],
        backend: Arc<CpuBackend>,
        hook: H,
        config: ReducerConfig,
    ) -> Result<Self> {
        for (i, var) in vars.iter().enumerate() {
            if let Some(problem) = unfit(var) {
                return Err(CandleError::Var { var: i, problem });
            }
        }
        let shapes: Vec<Vec<usize>> = vars.iter().map(|v| v.dims().to_vec()).collect();
        let reducer = Reducer::new(backend, &shapes, hook, config)?;
        Ok(CandleDdp {
            vars: vars.to_vec(),
            shapes,
            reducer,
        })
    }

    /// Gives the reducer its process group, for the bucket rebuild at the end of the first
    /// synchronised step ([`Reducer::with_process_group`]). Every rank or none.
    pub fn with_process_group(mut self, group: Arc<dyn ProcessGroup>) -> Self {
        self.reducer = self.reducer.with_process_group(group);
        self
    }

    /// Copies rank 0's variables into every rank's, bit for bit (DDP's broadcast of rank
    /// 0's parameters at construction): call it once after building the model on every
    /// rank, so that every replica starts from the same weights. Over the reducer's
    /// process group ([`CandleDdp::from_spec`] or [`CandleDdp::with_process_group`] set
    /// it; without one, [`CandleError::Reducer`] holding [`crate::Error::Config`]), through
    /// [`Reducer::broadcast_parameters`]: coalesced, bounded by the group's timeout, and
    /// failing on every rank when the variables' lengths differ between ranks.
    pub fn broadcast_parameters(&self) -> Result<()> {
        broadcast_with(&self.vars, |params| {
            self.reducer.broadcast_parameters(params)
        })
    }

    /// The variables, in the order given.
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// The reducer (its hook, bucket assignment, hook calls).
    pub fn reducer(&self) -> &Reducer<CpuBackend, H> {
        &self.reducer
    }

    /// The reducer, mutably (to restore a bucket assignment with a saved hook state).
    /// Its `no_sync` accumulation (`accum::GradSync`) is not for use with `sync`, which
    /// overwrites the slots: accumulate in candle and call `sync` once per optimizer step.
    pub fn reducer_mut(&mut self) -> &mut Reducer<CpuBackend, H> {
        &mut self.reducer
    }

    /// Reduces the gradients in `grads` over the group and writes the results back into
    /// `grads`, one `f32` tensor per variable. See the module docs for variables without a
    /// gradient and for errors; on an error `grads` is unchanged.
    pub fn sync(&mut self, grads: &mut GradStore) -> Result<()> {
        let mut problems = Vec::new();
        let mut failed = None;
        for p in (0..self.vars.len()).rev() {
            let Some(grad) = grads.get(&self.vars[p]) else {
                continue; // unused: `finish` decides (see the module docs)
            };
            let marked = match self.check(p, grad) {
                Some(problem) => {
                    problems.push((p, problem));
                    self.reducer.mark_unused(p).map_err(CandleError::from)
                }
                None => self.stage(p, grad),
            };
            if let Err(e) = marked {
                failed = Some(e);
                break;
            }
        }
        // `finish` runs whatever happened above: it launches every bucket not yet launched,
        // so the peers complete the step.
        let finished = self.reducer.finish();
        if let Some(e) = failed {
            return Err(e);
        }
        finished?;
        if !problems.is_empty() {
            problems.reverse();
            return Err(CandleError::Gradients(problems));
        }
        // A variable no rank has a gradient for stays out of the store, as it came.
        let mut unused = vec![false; self.vars.len()];
        for &p in self.reducer.globally_unused().unwrap_or_default() {
            unused[p] = true;
        }
        let reduced = (0..self.vars.len())
            .filter(|&p| !unused[p])
            .map(|p| {
                let g = self.reducer.grad(p)?;
                let t = Tensor::from_slice(g, self.shapes[p].as_slice(), &candle_core::Device::Cpu);
                Ok((p, t?))
            })
            .collect::<Result<Vec<(usize, Tensor)>>>()?;
        for (p, g) in reduced {
            grads.insert(&self.vars[p], g);
        }
        Ok(())
    }

    fn check(&self, p: usize, grad: &Tensor) -> Option<Problem> {
        if grad.dims() != self.shapes[p].as_slice() {
            return Some(Problem::Shape {
                expected: self.shapes[p].clone(),
                got: grad.dims().to_vec(),
            });
        }
        unfit(grad)
    }

    /// Copies var `p`'s gradient into its slot and marks it ready.
    fn stage(&mut self, p: usize, grad: &Tensor) -> Result<()> {
        let grad = grad.contiguous()?;
        {
            let (storage, layout) = grad.storage_and_layout();
            let Storage::Cpu(cpu) = &*storage else {
                return Err(CandleError::Gradients(vec![(
                    p,
                    Problem::Device(grad.device().location()),
                )]));
            };
            let values = cpu.as_slice::<f32>()?;
            let (start, end) = layout
                .contiguous_offsets()
                .ok_or_else(|| candle_core::Error::msg("a contiguous tensor has no offsets"))?;
            self.reducer
                .grad_mut(p)?
                .copy_from_slice(&values[start..end]);
        }
        Ok(self.reducer.mark_ready(p)?)
    }
}

/// Copies `root`'s `vars` into every rank's, bit for bit, over `group` (see
/// [`crate::broadcast_parameters`]): the same vars (`f32`, in host memory) in the same
/// order on every rank, for a model not wrapped in a [`CandleDdp`] (its
/// [`CandleDdp::broadcast_parameters`] broadcasts from rank 0 over its own group). A var
/// that is not `f32` on the CPU is [`CandleError::Var`], before any communication (so
/// the peers' broadcast fails by the group's timeout).
pub fn broadcast_vars(group: &dyn ProcessGroup, vars: &[Var], root: usize) -> Result<()> {
    broadcast_with(vars, |params| {
        crate::broadcast_parameters(group, params, root)
    })
}

/// Reads each var into a host vector, lets `broadcast` overwrite them, and sets every
/// var to its vector (nothing is set if `broadcast` fails).
fn broadcast_with(
    vars: &[Var],
    broadcast: impl FnOnce(&mut [&mut [f32]]) -> crate::Result<()>,
) -> Result<()> {
    for (i, var) in vars.iter().enumerate() {
        if let Some(problem) = unfit(var) {
            return Err(CandleError::Var { var: i, problem });
        }
    }
    let mut data = vars
        .iter()
        .map(|v| v.as_tensor().flatten_all()?.to_vec1::<f32>())
        .collect::<std::result::Result<Vec<Vec<f32>>, candle_core::Error>>()?;
    {
        let mut slices: Vec<&mut [f32]> = data.iter_mut().map(Vec::as_mut_slice).collect();
        broadcast(&mut slices)?;
    }
    for (var, values) in vars.iter().zip(data) {
        let t = Tensor::from_vec(values, var.dims(), &candle_core::Device::Cpu)?;
        var.set(&t)?;
    }
    Ok(())
}

/// Why `t` cannot live in the reducer, if it cannot.
fn unfit(t: &Tensor) -> Option<Problem> {
    if t.dtype() != DType::F32 {
        Some(Problem::DType(t.dtype()))
    } else if !t.device().is_cpu() {
        Some(Problem::Device(t.device().location()))
    } else {
        None
    }
}

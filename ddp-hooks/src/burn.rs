//! Burn embedding (feature `burn`): a burn training loop's gradients reduced by any hook.
//!
//! [`BurnDdp`] holds the ids and shapes of a burn model's float parameters, collected by
//! the module's visitor (`Module::visit`, the declaration order of the module's fields:
//! the same on every rank for the same model type), and a [`Reducer`] over those shapes.
//! After `loss.backward()` and [`GradientsParams::from_grads`], [`BurnDdp::sync`] adds each
//! parameter's gradient into its bucket slot, in reverse visitor order (the order backward
//! produces them, so the first bucket launches first), marking each ready; waits for every
//! bucket's reduction ([`Reducer::finish`]); and, in a synchronised step, registers the
//! reduced (averaged) gradients back into the `GradientsParams` under the same
//! [`ParamId`]s, where burn's optimizer (`Optimizer::step`) finds them. Two thread ranks:
//!
//! ```
//! use burn_core::module::Param;
//! use burn_core::tensor::Tensor;
//! use burn_optim::GradientsParams;
//! use collectives::{run_local, ProcessGroup};
//! use ddp_hooks::burn::{BurnDdp, CpuAutodiff};
//! use ddp_hooks::HookSpec;
//! use std::sync::Arc;
//!
//! let means = run_local(2, |group| -> Result<Vec<f32>, ddp_hooks::burn::BurnError> {
//!     let rank = group.rank() as f32;
//!     let device = Default::default();
//!     let w: Param<Tensor<CpuAutodiff, 1>> =
//!         Param::from_tensor(Tensor::from_floats([1.0, 2.0, 3.0], &device));
//!     let mut ddp = BurnDdp::<CpuAutodiff>::from_spec(&w, &HookSpec::AllReduce, Arc::new(group))?;
//!     // loss = (rank + 1) · sum(w): the gradient is rank + 1 everywhere.
//!     let loss = w.val().mul_scalar(rank + 1.0).sum();
//!     let mut grads = GradientsParams::from_grads::<CpuAutodiff, _>(loss.backward(), &w);
//!     ddp.sync(&mut grads)?;
//!     let g = grads.get::<burn_ndarray::NdArray<f32>, 1>(w.id).expect("synced");
//!     Ok(g.into_data().to_vec::<f32>().expect("f32"))
//! })
//! .unwrap();
//! for mean in means {
//!     assert_eq!(mean.unwrap().unwrap(), vec![1.5; 3]); // the mean of 1 and 2
//! }
//! ```
//!
//! # The burn version
//!
//! burn 0.20 (0.20.1), through its sub-crates (`burn-tensor`, `burn-core`, `burn-optim`,
//! `burn-autodiff`, `burn-ndarray`, std only: no rayon, no SIMD kernels), not the `burn`
//! umbrella. It is the newest release that builds with this workspace's MSRV (Rust 1.89):
//! burn 0.21 depends on `cubecl-zspace` 0.10 (Rust 1.92) and burn 0.22 on `cubecl-zspace`
//! 0.11 (Rust 1.95) and `macerator` 0.5 (Rust 1.94), whatever their features.
//! [`CpuAutodiff`] (`Autodiff<NdArray<f32>>`) is the CPU backend the examples and tests
//! use; the wrapper itself is generic over any [`AutodiffBackend`] whose gradients read
//! back as `f32`.
//!
//! # What it requires
//!
//! - The same model type on every rank, so that the visitor lists the same parameters in
//!   the same order. Parameter ids ([`ParamId`]) are random per process and need not agree
//!   between ranks: the position in the visitor's order is what identifies a parameter.
//! - `f32` parameters (checked by [`BurnDdp::new`]); gradients of the same dtype and shape
//!   (checked by `sync`).
//! - `sync` once per backward pass, with the `GradientsParams` of that pass. In a
//!   synchronised step it hands back the reduced gradients and returns `true`; with
//!   synchronisation off ([`accum::GradSync`], which [`BurnDdp`] implements, so
//!   [`accum::Accumulator`]'s steps and `no_sync` guards apply to it) it only adds the
//!   gradients into the reducer's slots, leaves `grads` as they came and returns `false`
//!   (skip the optimizer step); the next synchronised `sync` reduces the accumulated sum.
//!
//! # A parameter without a gradient
//!
//! A parameter that did not contribute to the loss has no entry in the `GradientsParams`.
//! `sync` treats it as DDP treats an unused parameter: it is not marked, and
//! [`Reducer::finish`] decides. With [`ReducerConfig::find_unused_parameters`] off (the
//! default) `sync` returns [`BurnError::Reducer`] holding
//! [`crate::Error::UnmarkedParameters`], which names every such parameter by its index in
//! the visitor's order; with it on, the parameter counts as a zero gradient on this rank
//! and receives the mean like every other, unless no rank has a gradient for it: then it
//! stays out of the `GradientsParams` (burn's optimizers skip a parameter without a
//! gradient, as PyTorch's skip a `None` one). Either way the step's collectives all run,
//! so no rank waits for this one.
//!
//! # Errors
//!
//! A gradient of the wrong dtype, shape or backend is reduced as a zero on this rank, so the
//! peers complete the step, and `sync` returns [`BurnError::Gradients`] naming each one; a
//! gradient under a [`ParamId`] the wrapper does not know is [`BurnError::UnknownGradients`],
//! also after the step ran. On any error `sync` leaves the `GradientsParams` as it was.
//! Parameters whose shapes differ between ranks fail on every rank at the first
//! synchronised step (the reducer's bucket rebuild compares the ranks' layouts) or, for
//! [`BurnDdp::broadcast_parameters`], at the broadcast.
//!
//! # Saving and resuming
//!
//! [`BurnDdp::save_state`] and [`BurnDdp::load_state`] are the hook's
//! ([`CommHook::save_state`]: PowerSGD's error feedback, its bases and iteration count),
//! and [`Reducer::bucket_params`] / [`Reducer::set_bucket_params`] (through
//! [`BurnDdp::reducer`] and [`BurnDdp::reducer_mut`]) the bucket assignment: a run resumed
//! from both, with the model's and optimizer's own records, continues bit for bit.

use crate::{CommHook, HookSpec, HookState, Reducer, ReducerConfig};
use burn_core::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn_core::tensor::backend::{AutodiffBackend, Backend};
use burn_core::tensor::{DType, Tensor, TensorData};
use burn_optim::GradientsParams;
use collectives::ProcessGroup;
use lowrank::CpuBackend;
use std::fmt;
use std::sync::Arc;

/// The CPU backend the examples and tests train on: burn's `NdArray` (`f32`) under
/// `Autodiff`.
pub type CpuAutodiff = burn_autodiff::Autodiff<burn_ndarray::NdArray<f32>>;

/// What can go wrong moving gradients between burn and the reducer. A type of its own
/// (not a variant of [`crate::Error`]) because burn's errors are neither `Clone` nor
/// `PartialEq`, which the crate's error is.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BurnError {
    /// The reducer's or a hook's error.
    #[error(transparent)]
    Reducer(#[from] crate::Error),
    /// A parameter the reducer cannot hold.
    #[error("parameter {param}: {problem}")]
    Param {
        /// Its index in the module's visitor order.
        param: usize,
        /// What is wrong.
        problem: Problem,
    },
    /// Gradients that could not be reduced; the step ran with zeros in their place.
    #[error(
        "{}; the step was reduced with zeros in their place, so no rank waits, and the \
         GradientsParams were left unchanged",
        list(.0)
    )]
    Gradients(Vec<(usize, Problem)>),
    /// Gradients registered under parameter ids the wrapper does not know (another
    /// module's parameters): the step ran without them and the `GradientsParams` were
    /// left unchanged.
    #[error(
        "{count} gradient(s) for parameters this BurnDdp does not know (another module's); \
         the step ran without them, and the GradientsParams were left unchanged"
    )]
    UnknownGradients {
        /// How many.
        count: usize,
    },
    /// A module whose parameters are not the ones the wrapper was built for.
    #[error("the module's parameters differ from this BurnDdp's: {0}")]
    Module(String),
    /// Burn could not convert a tensor's data.
    #[error("burn: {0}")]
    Data(String),
}

/// Why a parameter or its gradient does not fit the reducer.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Problem {
    /// Not `f32`.
    DType(DType),
    /// A gradient whose shape differs from its parameter's.
    Shape {
        /// The parameter's shape.
        expected: Vec<usize>,
        /// The gradient's shape.
        got: Vec<usize>,
    },
    /// A gradient that is not a tensor of the module's inner backend (registered with
    /// another backend type).
    Backend,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Problem::DType(d) => write!(f, "is {d:?}, the reducer reduces f32"),
            Problem::Shape { expected, got } => {
                write!(f, "has shape {got:?}, its parameter {expected:?}")
            }
            Problem::Backend => write!(f, "is not a tensor of the module's inner backend"),
        }
    }
}

fn list(problems: &[(usize, Problem)]) -> String {
    problems
        .iter()
        .map(|(p, problem)| format!("gradient of parameter {p} {problem}"))
        .collect::<Vec<_>>()
        .join("; ")
}

/// This module's result.
pub type Result<T> = std::result::Result<T, BurnError>;

/// Reads parameter `id`'s gradient out of the container as data (`None`: no gradient).
type ReadFn = fn(&GradientsParams, ParamId) -> Option<std::result::Result<TensorData, Problem>>;
/// Registers `data` as parameter `id`'s gradient, on `device`.
type WriteFn<B> = fn(&mut GradientsParams, ParamId, TensorData, &<B as Backend>::Device);

/// One parameter: its id and shape, and the rank-specific ways in and out of
/// `GradientsParams` (whose accessors take the rank as a const parameter).
struct Slot<B: AutodiffBackend> {
    id: ParamId,
    shape: Vec<usize>,
    device: B::Device,
    read: ReadFn,
    write: WriteFn<B>,
}

fn read<B: AutodiffBackend, const D: usize>(
    grads: &GradientsParams,
    id: ParamId,
) -> Option<std::result::Result<TensorData, Problem>> {
    // `GradientsParams::get` unwraps a downcast to the given backend's primitive: a
    // gradient registered with another backend would panic there. Catch it as a problem.
    let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        grads.get::<B::InnerBackend, D>(id)
    }));
    match got {
        Ok(g) => g.map(|t| Ok(t.into_data())),
        Err(_) => Some(Err(Problem::Backend)),
    }
}

fn write<B: AutodiffBackend, const D: usize>(
    grads: &mut GradientsParams,
    id: ParamId,
    data: TensorData,
    device: &B::Device,
) {
    let t = Tensor::<B::InnerBackend, D>::from_data(data, device);
    grads.register::<B::InnerBackend, D>(id, t);
}

/// Collects the float parameters of a module, in visitor order.
struct Collect<B: AutodiffBackend> {
    slots: Vec<Slot<B>>,
    /// The first parameter that is not `f32`.
    bad: Option<(usize, Problem)>,
    /// Each parameter's values, when asked.
    values: Option<Vec<TensorData>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Collect<B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let t = param.val();
        let dtype = t.dtype();
        if dtype != DType::F32 && self.bad.is_none() {
            self.bad = Some((self.slots.len(), Problem::DType(dtype)));
        }
        if let Some(values) = &mut self.values {
            values.push(t.to_data());
        }
        self.slots.push(Slot {
            id: param.id,
            shape: t.dims().to_vec(),
            device: t.device(),
            read: read::<B, D>,
            write: write::<B, D>,
        });
    }
}

fn collect<B: AutodiffBackend, M: Module<B>>(module: &M, values: bool) -> Collect<B> {
    let mut c = Collect {
        slots: Vec::new(),
        bad: None,
        values: values.then(Vec::new),
    };
    module.visit(&mut c);
    c
}

/// Replaces each float parameter's value (visitor order), keeping its id and whether it
/// requires a gradient.
struct Assign {
    values: std::vec::IntoIter<TensorData>,
}

impl<B: Backend> ModuleMapper<B> for Assign {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let Some(data) = self.values.next() else {
            return param;
        };
        param.map(|t| {
            let grad = t.is_require_grad();
            Tensor::from_data(data, &t.device()).set_require_grad(grad)
        })
    }
}

/// A burn model's parameters (ids and shapes) and the reducer that averages their
/// gradients. See the [module docs](self).
pub struct BurnDdp<B: AutodiffBackend, H = Box<dyn CommHook<CpuBackend>>> {
    slots: Vec<Slot<B>>,
    shapes: Vec<Vec<usize>>,
    reducer: Reducer<CpuBackend, H>,
    accumulating: bool,
}

impl<B: AutodiffBackend, H> fmt::Debug for BurnDdp<B, H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BurnDdp")
            .field("shapes", &self.shapes)
            .finish_non_exhaustive()
    }
}

impl<B: AutodiffBackend> BurnDdp<B> {
    /// The hook `spec` over `group` (the registry's names: `allreduce`,
    /// `powersgd:rank=2,start_iter=10`, ...), DDP's default buckets, and `group` for the
    /// reducer's bucket rebuild, for `module`'s float parameters (the same model type on
    /// every rank).
    pub fn from_spec<M: AutodiffModule<B>>(
        module: &M,
        spec: &HookSpec,
        group: Arc<dyn ProcessGroup>,
    ) -> Result<Self> {
        Self::from_spec_with(module, spec, group, ReducerConfig::default())
    }

    /// [`BurnDdp::from_spec`] with a reducer configuration of one's own (bucket sizes,
    /// `find_unused_parameters`).
    pub fn from_spec_with<M: AutodiffModule<B>>(
        module: &M,
        spec: &HookSpec,
        group: Arc<dyn ProcessGroup>,
        config: ReducerConfig,
    ) -> Result<Self> {
        let backend = Arc::new(CpuBackend::new());
        let hook = spec.build(backend.clone(), group.clone())?;
        Ok(BurnDdp::new(module, backend, hook, config)?.with_process_group(group))
    }
}

impl<B: AutodiffBackend, H: CommHook<CpuBackend>> BurnDdp<B, H> {
    /// A reducer for `module`'s float parameters (visitor order) and `hook`. Each must be
    /// `f32` ([`BurnError::Param`] otherwise); a module without any is
    /// [`BurnError::Module`].
    pub fn new<M: AutodiffModule<B>>(
        module: &M,
        backend: Arc<CpuBackend>,
        hook: H,
        config: ReducerConfig,
    ) -> Result<Self> {
        let c = collect(module, false);
        if let Some((param, problem)) = c.bad {
            return Err(BurnError::Param { param, problem });
        }
        if c.slots.is_empty() {
            // A `#[derive(Module)]` whose backend parameter is not named `B` visits nothing.
            return Err(BurnError::Module(
                "it has no float parameters (a derived module's backend type parameter \
                 must be named `B`)"
                    .into(),
            ));
        }
        let shapes: Vec<Vec<usize>> = c.slots.iter().map(|s| s.shape.clone()).collect();
        let reducer = Reducer::new(backend, &shapes, hook, config)?;
        Ok(BurnDdp {
            slots: c.slots,
            shapes,
            reducer,
            accumulating: false,
        })
    }

    /// Gives the reducer its process group, for the bucket rebuild at the end of the first
    /// synchronised step ([`Reducer::with_process_group`]). Every rank or none.
    pub fn with_process_group(mut self, group: Arc<dyn ProcessGroup>) -> Self {
        self.reducer = self.reducer.with_process_group(group);
        self
    }

    /// Returns `module` with rank 0's parameter values on every rank, bit for bit (DDP's
    /// broadcast of rank 0's parameters at construction): call it once after building the
    /// model on every rank, so that every replica starts from the same weights. Ids and
    /// `require_grad` stay as they were. Over the reducer's process group
    /// ([`BurnDdp::from_spec`] or [`BurnDdp::with_process_group`] set it; without one,
    /// [`BurnError::Reducer`] holding [`crate::Error::Config`]), through
    /// [`Reducer::broadcast_parameters`]: coalesced, bounded by the group's timeout, and
    /// failing on every rank when the parameters' lengths differ between ranks. A module
    /// whose parameter shapes differ from the wrapper's is [`BurnError::Module`], before
    /// any communication (the peers' broadcast then fails by the group's timeout).
    pub fn broadcast_parameters<M: AutodiffModule<B>>(&self, module: M) -> Result<M> {
        let c = collect(&module, true);
        let shapes: Vec<&Vec<usize>> = c.slots.iter().map(|s| &s.shape).collect();
        if shapes != self.shapes.iter().collect::<Vec<_>>() {
            return Err(BurnError::Module(format!(
                "shapes {shapes:?}, the wrapper's {:?}",
                self.shapes
            )));
        }
        broadcast_with(module, c, |params| {
            self.reducer.broadcast_parameters(params)
        })
    }

    /// The parameters' ids, in visitor order (this rank's: ids differ between processes).
    pub fn param_ids(&self) -> Vec<ParamId> {
        self.slots.iter().map(|s| s.id).collect()
    }

    /// The parameters' shapes, in visitor order.
    pub fn shapes(&self) -> &[Vec<usize>] {
        &self.shapes
    }

    /// The reducer (its hook, bucket assignment, hook calls).
    pub fn reducer(&self) -> &Reducer<CpuBackend, H> {
        &self.reducer
    }

    /// The reducer, mutably (to restore a bucket assignment with a saved hook state).
    /// Switch synchronisation through the [`accum::GradSync`] of the `BurnDdp` itself,
    /// which also tracks the accumulation setting.
    pub fn reducer_mut(&mut self) -> &mut Reducer<CpuBackend, H> {
        &mut self.reducer
    }

    /// The hook's state ([`CommHook::save_state`]), to save with the model.
    pub fn save_state(&self) -> Result<HookState> {
        Ok(self.reducer.hook().save_state()?)
    }

    /// Restores a state saved by [`BurnDdp::save_state`] into the hook.
    pub fn load_state(&self, state: HookState) -> Result<()> {
        Ok(self.reducer.hook().load_state(state)?)
    }

    /// Adds the gradients in `grads` into the reducer's slots and, in a synchronised step,
    /// reduces them over the group and registers the results in `grads` (returning
    /// `true`: step the optimizer with them); with synchronisation off, leaves `grads`
    /// unchanged and returns `false`. See the module docs for parameters without a
    /// gradient and for errors; on an error `grads` is unchanged.
    pub fn sync(&mut self, grads: &mut GradientsParams) -> Result<bool> {
        let sync = accum::GradSync::sync_enabled(&self.reducer);
        let mut problems = Vec::new();
        let mut failed = None;
        let mut found = 0;
        for p in (0..self.slots.len()).rev() {
            let Some(data) = (self.slots[p].read)(grads, self.slots[p].id) else {
                continue; // unused: `finish` decides (see the module docs)
            };
            found += 1;
            let marked = match data.map_err(|e| (e, None)).and_then(|d| self.check(p, d)) {
                Err((problem, data_error)) => {
                    if let Some(e) = data_error {
                        failed.get_or_insert(BurnError::Data(e));
                    }
                    problems.push((p, problem));
                    self.reducer.mark_unused(p).map_err(BurnError::from)
                }
                Ok(values) => self.stage(p, &values),
            };
            if let Err(e) = marked {
                failed = Some(e);
                break;
            }
        }
        // `finish` runs whatever happened above: it launches every bucket not yet launched,
        // so the peers complete the step.
        let finished = self.reducer.finish();
        let result = self.hand_back(sync, finished, failed, problems, found, grads);
        // A synchronised step that closes its accumulation group starts the next from zero
        // (the reducer leaves the reduced gradients in place).
        if sync && !self.accumulating {
            self.reducer.zero_grad()?;
        }
        result.map(|()| sync)
    }

    fn hand_back(
        &self,
        sync: bool,
        finished: crate::Result<()>,
        failed: Option<BurnError>,
        mut problems: Vec<(usize, Problem)>,
        found: usize,
        grads: &mut GradientsParams,
    ) -> Result<()> {
        if let Some(e) = failed {
            return Err(e);
        }
        finished?;
        if !problems.is_empty() {
            problems.reverse();
            return Err(BurnError::Gradients(problems));
        }
        if grads.len() > found {
            return Err(BurnError::UnknownGradients {
                count: grads.len() - found,
            });
        }
        if !sync {
            return Ok(());
        }
        // A parameter no rank has a gradient for stays out of the container, as it came.
        let mut unused = vec![false; self.slots.len()];
        for &p in self.reducer.globally_unused().unwrap_or_default() {
            unused[p] = true;
        }
        let reduced = (0..self.slots.len())
            .filter(|&p| !unused[p])
            .map(|p| {
                let g: &[f32] = self.reducer.grad(p)?;
                Ok((p, TensorData::new(g.to_vec(), self.shapes[p].clone())))
            })
            .collect::<Result<Vec<(usize, TensorData)>>>()?;
        for (p, data) in reduced {
            let s = &self.slots[p];
            (s.write)(grads, s.id, data, &s.device);
        }
        Ok(())
    }

    /// Parameter `p`'s gradient values, or why they do not fit (with burn's conversion
    /// error, if that was the reason).
    fn check(
        &self,
        p: usize,
        data: TensorData,
    ) -> std::result::Result<Vec<f32>, (Problem, Option<String>)> {
        if data.shape != self.shapes[p] {
            return Err((
                Problem::Shape {
                    expected: self.shapes[p].clone(),
                    got: data.shape.clone(),
                },
                None,
            ));
        }
        if data.dtype != DType::F32 {
            return Err((Problem::DType(data.dtype), None));
        }
        data.into_vec::<f32>()
            .map_err(|e| (Problem::DType(DType::F32), Some(format!("{e:?}"))))
    }

    /// Adds parameter `p`'s gradient into its slot and marks it ready.
    fn stage(&mut self, p: usize, values: &[f32]) -> Result<()> {
        let slot: &mut [f32] = self.reducer.grad_mut(p)?;
        for (s, v) in slot.iter_mut().zip(values) {
            *s += v;
        }
        Ok(self.reducer.mark_ready(p)?)
    }
}

impl<B: AutodiffBackend, H: CommHook<CpuBackend>> accum::GradSync for BurnDdp<B, H> {
    fn set_sync(&mut self, on: bool) -> bool {
        self.reducer.set_sync(on)
    }

    fn sync_enabled(&self) -> bool {
        self.reducer.sync_enabled()
    }

    /// While on, a synchronised `sync` keeps the reduced gradients in the slots for the
    /// group's next micro-steps to add to (Accelerate's `sync_each_batch`).
    fn set_accumulating(&mut self, on: bool) -> bool {
        self.reducer.set_accumulating(on);
        std::mem::replace(&mut self.accumulating, on)
    }
}

/// Returns `module` with `root`'s parameter values on every rank, bit for bit, over
/// `group` (see [`crate::broadcast_parameters`]): the same model type (`f32` parameters)
/// on every rank, for a model not wrapped in a [`BurnDdp`] (its
/// [`BurnDdp::broadcast_parameters`] broadcasts from rank 0 over its own group). A
/// parameter that is not `f32` is [`BurnError::Param`], before any communication (so the
/// peers' broadcast fails by the group's timeout).
pub fn broadcast_module<B: AutodiffBackend, M: AutodiffModule<B>>(
    group: &dyn ProcessGroup,
    module: M,
    root: usize,
) -> Result<M> {
    let c = collect(&module, true);
    broadcast_with(module, c, |params| {
        crate::broadcast_parameters(group, params, root)
    })
}

/// Reads each parameter into a host vector, lets `broadcast` overwrite them, and sets
/// every parameter to its vector (nothing is set if `broadcast` fails).
fn broadcast_with<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: M,
    c: Collect<B>,
    broadcast: impl FnOnce(&mut [&mut [f32]]) -> crate::Result<()>,
) -> Result<M> {
    if let Some((param, problem)) = c.bad {
        return Err(BurnError::Param { param, problem });
    }
    let mut data = c
        .values
        .unwrap_or_default()
        .into_iter()
        .map(|d| {
            d.into_vec::<f32>()
                .map_err(|e| BurnError::Data(format!("{e:?}")))
        })
        .collect::<Result<Vec<Vec<f32>>>>()?;
    {
        let mut slices: Vec<&mut [f32]> = data.iter_mut().map(Vec::as_mut_slice).collect();
        broadcast(&mut slices)?;
    }
    let values: Vec<TensorData> = data
        .into_iter()
        .zip(&c.slots)
        .map(|(v, s)| TensorData::new(v, s.shape.clone()))
        .collect();
    Ok(module.map(&mut Assign {
        values: values.into_iter(),
    }))
}

//! Pipeline × data parallel (feature `pipe`): each rank runs a [`pipe::Pipe`], and each
//! partition's gradients go to the reducer as soon as they are final.
//!
//! [`DistributedPipe`] owns one rank's pipe and a [`Reducer`] over the pipe's parameters.
//! During a synchronised [`step`](DistributedPipe::step), the pipe's generic
//! gradients-final point ([`Pipe::on_gradients_final`]) fires on a partition's worker
//! thread right after that partition's last backward action of the step; the callback
//! copies the partition's parameter gradients into their bucket slots and marks them
//! ready, so the partition's buckets go to the hook at once, while the other partitions
//! still compute their backward passes. When the pipe's step returns, the reducer waits
//! for every bucket ([`Reducer::finish`]) and the averaged gradients are written back into
//! the layers, where the optimizer finds them. Two thread ranks, two partitions each:
//!
//! ```
//! use collectives::{run_local, ProcessGroup};
//! use ddp_hooks::pipeline::DistributedPipe;
//! use ddp_hooks::HookSpec;
//! use pipe::cpu::{CpuTensor, Linear, ReLU};
//! use pipe::{Batch, Layer, Pipe};
//! use std::sync::Arc;
//!
//! let grads = run_local(2, |group| -> Result<Vec<f32>, ddp_hooks::pipeline::PipelineError> {
//!     let layers: Vec<Box<dyn Layer<CpuTensor>>> =
//!         vec![Box::new(Linear::new(3, 4, 1)), Box::new(ReLU), Box::new(Linear::new(4, 2, 2))];
//!     let pipe = Pipe::builder(layers, &[2, 1]).chunks(2).build()?;
//!     let rank = group.rank() as f32;
//!     let mut ddp = DistributedPipe::from_spec(pipe, &HookSpec::AllReduce, Arc::new(group))?;
//!     // Each rank its own data; loss: the sum of the outputs.
//!     let x = CpuTensor::from_shape_vec(&[4, 3], vec![rank + 1.0; 12])?;
//!     ddp.step(Batch::single(x), |_mb, y| {
//!         let y = y.tensor(0)?;
//!         Ok((y.array().sum(), Batch::single(CpuTensor::ones(y.shape()))))
//!     })?;
//!     // The last layer's bias gradient: 4 samples of ones on each rank, averaged.
//!     let last = &ddp.pipe().partitions()[1][0];
//!     Ok(last.parameters()[1].grad.to_vec())
//! })
//! .unwrap();
//! for g in grads {
//!     assert_eq!(g.unwrap().unwrap(), vec![4.0, 4.0]);
//! }
//! ```
//!
//! # Buckets follow the backward order, and never straddle partitions
//!
//! Parameters are numbered in forward order (partition by partition, layer by layer, in
//! each layer's [`Layer::parameters`] order). Buckets are assigned by size as DDP does
//! ([`ReducerConfig`]'s caps: the first bucket `first_bucket_mb`, the others
//! `bucket_cap_mb`), walking the parameters in backward order (the last partition's last
//! parameter first), but a bucket also closes at the end of each partition: a bucket that
//! held the tail of one partition and the head of the next could launch only when the
//! earlier partition finishes, holding back gradients that were final long before.
//! The pipe knows its backward order before the first step, so the reducer's rebuild in
//! observed order is not used (the assignment is set with
//! [`Reducer::set_bucket_params`], which cancels it); every rank builds the same buckets
//! from the same model.
//!
//! # Checkpointing, schedules and hooks
//!
//! Nothing here depends on how a partition reaches its last backward action: with
//! [`pipe::Checkpoint::Always`] or `ExceptLast` that action re-runs a forward pass first,
//! under GPipe or 1F1B or a schedule of the caller's ([`DistributedPipe::step_with`]); the
//! gradients are final after it all the same. (PyTorch's `Pipe` can be wrapped in DDP only
//! with `checkpoint='never'`, because autograd's recomputation fires DDP's hooks twice;
//! an explicit backward has no such limit.) Any [`CommHook`] works, PowerSGD included:
//! the reducer launches buckets strictly in bucket order, the same order on every rank.
//!
//! # Accumulation
//!
//! [`DistributedPipe`] implements [`accum::GradSync`], so `accum`'s `no_sync` guard and
//! `Accumulator` drive it. With synchronisation off, a step only runs the pipe: parameter
//! gradients accumulate in the layers (the pipe adds, never overwrites), and the next
//! synchronised step hands the accumulated sum to the reducer, one reduction for the whole
//! group of mini-batches. The setting in force when `step` (or `backward`) is called
//! decides, for the whole step. Scale each micro-step's loss gradient yourself (the
//! `Accumulator`'s `loss_scale`).
//!
//! # The tensor type
//!
//! The reducer's buckets are host `f32` memory ([`CpuBackend`]); a pipe's tensor type
//! takes part through [`GradTensor`] (its shape, and copies of its elements into and out
//! of a host `f32` slice). [`CpuTensor`] implements it; a device tensor type would stage
//! through host memory in those two methods.
//!
//! # Errors
//!
//! In a synchronised step the reducer's `finish` runs whatever happened, so this rank
//! launches every bucket and no peer is left waiting: a partition whose callback did not
//! run (the pipe failed first) is reduced as zeros, and a gradient that cannot be copied
//! (a shape that changed since construction) is reduced as zeros on this rank. The step
//! then returns the first cause: the pipe's error ([`PipelineError::Pipe`]), the gradients that
//! could not be copied ([`PipelineError::Gradients`]), or the reducer's error
//! ([`PipelineError::Reducer`]). On any error the layers' gradients are left as the pipe made
//! them (this rank's own, possibly partial): zero them before the next step. Peers that
//! succeeded averaged with this rank's zeros, as DDP peers would; a failed step on one
//! rank calls for a fresh start (or a re-broadcast of the parameters) on all of them.
//!
//! # On a mesh: stages on ranks
//!
//! [`DistributedPipe::on_mesh`] runs a [`Mesh`] of `stages × replicas` ranks: each rank
//! holds one stage (one partition) of one replica's pipeline, the stages of a replica
//! talk over their pipeline group ([`pipe::GroupTransport`], stage `s` on the group's
//! rank `s`), and the replicas of a stage reduce that stage's gradients over their
//! data-parallel group. World rank `r` is stage `r / replicas` of replica
//! `r % replicas` (Megatron-LM's default; the table is in [`mesh`]'s docs). Each rank
//! passes only its own partition's layers, in a builder with the global balance
//! ([`Pipe::builder`]`(layers, &balance)`, settings the same on every rank); the pipe's
//! other partitions are empty on this rank ([`Pipe::partitions`]), hold no parameters
//! here and get no buckets. Each rank then calls the same methods in the same order: the
//! rank of stage 0 passes its replica's inputs, the others `Batch::new(Vec::new())`; the
//! loss runs on the last stage's rank, where the outputs and losses come back (empty
//! elsewhere), and the input gradients come back on stage 0's rank.
//!
//! The hook averages over the replicas: with each replica's loss the mean over its own
//! samples, the gradients are those of the mean over all replicas' samples.
//!
//! A synchronised step on a mesh ends with one more collective, over the world group:
//! the ranks agree on whether every rank's step went through (one `f32` per rank). A
//! rank whose step failed returns its own error; every other rank returns
//! [`PipelineError::PeersFailed`] naming it, without writing back, so a failure anywhere
//! is an error everywhere (within the pipe's timeout) instead of a silent average with
//! zeros. An unsynchronised step (under `no_sync`) communicates only along its pipeline:
//! its failure reaches the other replicas at the next synchronised step's agreement.
//!
//! [`CommHook`]: crate::CommHook

mod buckets;
mod error;
mod grad;
mod handover;
pub mod mesh;
mod step;

pub use error::{Fault, PipelineError, Problem, Result};
pub use grad::GradTensor;
pub use mesh::{Mesh, MeshError, MeshGroups};

use crate::{CommHook, HookSpec, Reducer, ReducerConfig};
use buckets::partition_buckets;
use collectives::ProcessGroup;
use handover::Shared;
use lowrank::CpuBackend;
use pipe::cpu::CpuTensor;
#[cfg(doc)]
use pipe::Layer;
use pipe::{GroupTransport, Pipe, PipeBuilder, Transport, Wire};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// When a synchronised step hands gradients to the reducer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Launch {
    /// Each partition's gradients, on its worker, right after its last backward action:
    /// communication overlaps the other partitions' backward passes. The default.
    #[default]
    PerPartition,
    /// Every gradient after the whole backward pass, on the caller's thread: what a
    /// data-parallel wrapper around a pipe without a gradients-final point would do. For
    /// comparison (the `pipeline` bench measures both).
    AfterBackward,
}

/// Where the time of the last step went ([`DistributedPipe::last_step_times`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepTimes {
    /// The pipe's run: the forward and backward passes of every micro-batch. With
    /// [`Launch::PerPartition`] the finished partitions' communication overlaps it.
    pub pipe: Duration,
    /// From the end of the pipe's run to the averaged gradients in the layers: handing
    /// over what was not handed over yet, waiting for every bucket, writing back. Zero in
    /// an unsynchronised step. Communication that no compute hid shows up here.
    pub tail: Duration,
}

/// One data-parallel rank's pipe and the reducer that averages its gradients over the
/// ranks, each partition's buckets launched as soon as that partition's gradients are
/// final. See the [module docs](self).
pub struct DistributedPipe<T: GradTensor = CpuTensor, H = Box<dyn CommHook<CpuBackend>>> {
    pipe: Pipe<T>,
    shared: Arc<Shared<H>>,
    sync: bool,
    launch: Launch,
    times: Option<StepTimes>,
    /// On a mesh: the world group (for the agreement) and this rank's groups.
    mesh: Option<OnMesh>,
}

/// What a [`DistributedPipe`] on a mesh keeps.
struct OnMesh {
    mesh: Mesh,
    world: Arc<dyn ProcessGroup>,
    groups: MeshGroups,
}

impl<T: GradTensor, H> fmt::Debug for DistributedPipe<T, H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DistributedPipe")
            .field("balance", &self.pipe.balance())
            .field("params", &self.shared.shapes.len())
            .field("sync", &self.sync)
            .field("launch", &self.launch)
            .field("mesh", &self.mesh.as_ref().map(|m| (m.mesh, &m.groups)))
            .finish_non_exhaustive()
    }
}

impl<T: GradTensor> DistributedPipe<T> {
    /// The hook `spec` over `group` (the registry's names: `allreduce`,
    /// `powersgd:rank=2,start_iter=10`, ...) with DDP's default bucket sizes.
    pub fn from_spec(pipe: Pipe<T>, spec: &HookSpec, group: Arc<dyn ProcessGroup>) -> Result<Self> {
        let backend = Arc::new(CpuBackend::new());
        let hook = spec.build(backend.clone(), group)?;
        DistributedPipe::new(pipe, backend, hook, ReducerConfig::default())
    }
}

impl<T: GradTensor + Wire> DistributedPipe<T> {
    /// This rank's part of a pipeline × data-parallel `mesh` over `world` (see the
    /// [module docs](self#on-a-mesh-stages-on-ranks) and [`mesh`]): `builder` is
    /// [`Pipe::builder`] with this rank's stage's layers and the global balance
    /// (`mesh.stages` partitions), with the settings of every rank; the stages are put on
    /// the ranks of this replica's pipeline group here. The hook `spec` runs over this
    /// stage's data-parallel group, with DDP's default bucket sizes.
    ///
    /// Every rank of `world` must call it at the same point (it creates the mesh's groups
    /// with [`ProcessGroup::new_group`], then builds the pipe, which meets the other stages).
    ///
    /// ```
    /// use collectives::{run_local, ProcessGroup};
    /// use ddp_hooks::pipeline::{DistributedPipe, Mesh, PipelineError};
    /// use ddp_hooks::HookSpec;
    /// use pipe::cpu::{CpuTensor, Linear, ReLU};
    /// use pipe::{Batch, Layer, Pipe};
    /// use std::sync::Arc;
    ///
    /// // 2 stages × 2 replicas on 4 thread ranks: rank = stage * 2 + replica.
    /// let grads = run_local(4, |world| -> Result<Vec<f32>, PipelineError> {
    ///     let (stage, replica) = (world.rank() / 2, world.rank() % 2);
    ///     let layers: Vec<Box<dyn Layer<CpuTensor>>> = if stage == 0 {
    ///         vec![Box::new(Linear::new(3, 4, 1)), Box::new(ReLU)]
    ///     } else {
    ///         vec![Box::new(Linear::new(4, 2, 2))]
    ///     };
    ///     let builder = Pipe::builder(layers, &[2, 1]).chunks(2);
    ///     let mesh = Mesh::new(2, 2);
    ///     let mut ddp = DistributedPipe::on_mesh(builder, mesh, Arc::new(world), &HookSpec::AllReduce)?;
    ///     // Stage 0 passes its replica's inputs; loss: the sum of the outputs.
    ///     let x = CpuTensor::from_shape_vec(&[4, 3], vec![replica as f32 + 1.0; 12])?;
    ///     let input = if stage == 0 { Batch::single(x) } else { Batch::new(Vec::new()) };
    ///     ddp.step(input, |_mb, y| {
    ///         let y = y.tensor(0)?;
    ///         Ok((y.array().sum(), Batch::single(CpuTensor::ones(y.shape()))))
    ///     })?;
    ///     // The last layer's bias gradient, on the last stage's ranks: 4 ones, averaged.
    ///     Ok(match ddp.pipe().partitions()[1].first() {
    ///         Some(last) => last.parameters()[1].grad.to_vec(),
    ///         None => Vec::new(),
    ///     })
    /// })
    /// .unwrap();
    /// let grads: Vec<Vec<f32>> = grads.into_iter().map(|g| g.unwrap().unwrap()).collect();
    /// assert_eq!(grads[2], vec![4.0, 4.0]);
    /// assert_eq!(grads[3], vec![4.0, 4.0]);
    /// ```
    pub fn on_mesh(
        builder: PipeBuilder<T>,
        mesh: Mesh,
        world: Arc<dyn ProcessGroup>,
        spec: &HookSpec,
    ) -> Result<Self> {
        let backend = Arc::new(CpuBackend::new());
        let for_hook = backend.clone();
        DistributedPipe::on_mesh_with(
            builder,
            mesh,
            world,
            backend,
            |data| Ok(spec.build(for_hook, data)?),
            ReducerConfig::default(),
        )
    }
}

impl<T: GradTensor + Wire, H: CommHook<CpuBackend> + 'static> DistributedPipe<T, H> {
    /// [`on_mesh`](DistributedPipe::on_mesh) with a hook of the caller's, made by `hook`
    /// from this stage's data-parallel group (wrap it first, in a
    /// [`collectives::link::Linked`] say), on `backend`, buckets sized by `config`.
    pub fn on_mesh_with(
        builder: PipeBuilder<T>,
        mesh: Mesh,
        world: Arc<dyn ProcessGroup>,
        backend: Arc<CpuBackend>,
        hook: impl FnOnce(Arc<dyn ProcessGroup>) -> Result<H>,
        config: ReducerConfig,
    ) -> Result<Self> {
        let groups = mesh.groups(&*world)?;
        let transport: Arc<dyn Transport> = Arc::new(GroupTransport::new(groups.pipeline.clone()));
        let stage_ranks: Vec<usize> = (0..mesh.stages).collect();
        let pipe = builder.on_ranks(transport, &stage_ranks).build()?;
        let hook = hook(groups.data.clone())?;
        let mut ddp = DistributedPipe::new(pipe, backend, hook, config)?;
        ddp.mesh = Some(OnMesh {
            mesh,
            world,
            groups,
        });
        Ok(ddp)
    }
}

impl<T: GradTensor, H: CommHook<CpuBackend> + 'static> DistributedPipe<T, H> {
    /// Wraps `pipe` (the same model on every rank) with a reducer over its parameters and
    /// `hook`, buckets sized by `config` (see the module docs). Registers the pipe's
    /// gradients-final callback, replacing any other.
    pub fn new(
        mut pipe: Pipe<T>,
        backend: Arc<CpuBackend>,
        hook: H,
        config: ReducerConfig,
    ) -> Result<Self> {
        let mut shapes = Vec::new();
        let mut bounds = vec![0];
        let mut first_layer = Vec::new();
        let mut layers = 0;
        for partition in pipe.partitions() {
            first_layer.push(layers);
            layers += partition.len();
            for layer in partition {
                shapes.extend(layer.parameters().iter().map(|p| p.value.dims()));
            }
            bounds.push(shapes.len());
        }
        let mut reducer = Reducer::new(backend, &shapes, hook, config)?;
        let lens: Vec<usize> = (0..shapes.len())
            .map(|p| reducer.grad(p).map(<[f32]>::len))
            .collect::<Result<_, _>>()?;
        reducer.set_bucket_params(partition_buckets(&bounds, &lens, &config))?;
        let shared = Arc::new(Shared {
            reducer: Mutex::new(reducer),
            bounds,
            first_layer,
            shapes,
            armed: AtomicBool::new(false),
            faults: Mutex::new(Vec::new()),
        });
        let callback = shared.clone();
        pipe.on_gradients_final(move |j, layers| {
            if !callback.armed.load(Ordering::Acquire) {
                return;
            }
            let faults = {
                let mut reducer = callback.reducer();
                callback.hand_over(&mut reducer, j, layers)
            };
            callback.faults().extend(faults);
        });
        Ok(DistributedPipe {
            pipe,
            shared,
            sync: true,
            launch: Launch::default(),
            times: None,
            mesh: None,
        })
    }
}

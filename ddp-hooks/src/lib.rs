//! DDP communication hooks on gradient buckets: allreduce, fp16/bf16 compression, noop,
//! and PowerSGD with the full `PowerSGDState`.
//!
//! A hook is called once per bucket per synchronised step with a [`GradBucket`] (one
//! flat gradient buffer and where each parameter lives in it) and returns at once a
//! [`collectives::Work`] that completes with the reduced gradients, so communication
//! overlaps the rest of the backward pass. Hooks are generic over the `lowrank` backend
//! (CPU or CUDA) and take any `collectives` process group.
//!
//! ```
//! use collectives::{run_local, ProcessGroup};
//! use ddp_hooks::{AllReduce, CommHook, GradBucket, Layout};
//! use lowrank::CpuBackend;
//! use std::sync::Arc;
//!
//! let layout = Arc::new(Layout::packed(&[vec![2, 3], vec![3]]).unwrap()); // a weight and a bias
//! let results = run_local(2, |group| {
//!     let rank = group.rank() as f32;
//!     let mut hook = AllReduce::new(Arc::new(CpuBackend::new()), Arc::new(group));
//!     let bucket = GradBucket::<CpuBackend>::new(0, 1, vec![rank; 9], layout.clone()).unwrap();
//!     hook.run(bucket).wait()
//! })
//! .unwrap();
//! for r in results {
//!     assert_eq!(r.unwrap().unwrap(), vec![0.5; 9]); // the mean of 0 and 1
//! }
//! ```
//!
//! The [`Reducer`] packs parameters into buckets, calls the hook per bucket as gradients
//! become ready, and implements `accum`'s `GradSync` so `no_sync` and `Accumulator`
//! drive it.
//!
//! Hooks can be chosen by name: [`HookSpec`] parses `powersgd:rank=2,start_iter=10`.
//!
//! With the `cuda` feature, buckets live on the GPU (`lowrank::CudaBackend`): NCCL
//! reduces them on the device, the thread and MPI backends stage them through host memory.
#![deny(missing_docs)]

pub mod averaging;
mod broadcast;
mod bucket;
#[cfg(feature = "burn")]
pub mod burn;
#[cfg(feature = "candle")]
pub mod candle;
mod comm;
pub mod diloco;
mod error;
mod hooks;
#[cfg(feature = "pipe")]
pub mod pipeline;
pub mod powersgd;
mod quantize;
mod reducer;
mod registry;
mod sequence;
mod wire;

pub use averaging::{HierarchicalModelAverager, PeriodicModelAverager, PostLocalSgd};
pub use broadcast::{broadcast_parameters, broadcast_parameters_bucketed, BROADCAST_BUCKET_BYTES};
pub use bucket::{BucketLayout, GradBucket, Layout, ParamSlot};
pub use comm::{CommBackend, CommElement};
pub use diloco::{DiLoCo, DiLoCoConfig, DiLoCoState};
pub use error::{Error, Result};
pub use hooks::{AllReduce, CommHook, Compress, CompressionStats, HalfFormat, HookState, Noop};
#[cfg(feature = "pipe")]
pub use pipeline::DistributedPipe;
pub use powersgd::{BatchedPowerSgd, PowerSgd, PowerSgdConfig, PowerSgdState, SavedBucket};
pub use quantize::{QuantizePerChannel, QuantizePerTensor};
pub use reducer::{Reducer, ReducerConfig};
pub use registry::HookSpec;
pub use wire::{HalfWire, WireFormat};

/// The README's examples, compiled and run as doctests so they cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;

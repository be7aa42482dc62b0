//! Process groups for data-parallel and pipeline-parallel training: `all_reduce`,
//! `broadcast`, `all_gather`, `reduce_scatter`, `reduce`, `gather`, `scatter`,
//! `all_to_all`, `barrier` and point-to-point `send` / `recv` / `batch_isend_irecv`
//! ([`p2p`]) returning async work handles, on an in-process thread
//! backend, NCCL (through `cudarc`) and MPI, with `env://` rendezvous like `torchrun`.
//!
//! - [`ProcessGroup`]: the trait hooks are written against; every operation returns a
//!   [`Work`] handle (`wait`, `wait_timeout`, `is_completed`, `then`, `and_then`, `zip`).
//! - [`ThreadGroup`] / [`run_local`]: N ranks as threads of one process, zero-copy and
//!   rootless; the backend of every test.
//! - [`store::TcpStore`] and [`env::EnvInfo`]: `env://` rendezvous as `torchrun` sets it
//!   up (also from Slurm or Open MPI variables); the `launch` binary starts N local
//!   processes with those variables, like `torchrun --standalone`.
//! - [`tcp::TcpGroup`]: N processes over plain TCP sockets (PyTorch's gloo role), made
//!   from the rendezvous store (`TcpGroup::from_env` under `launch`); reductions
//!   bit-identical to the thread backend's, failures (a dead peer, a mismatch) typed
//!   errors on every rank.
//! - [`link`]: a link model that charges each operation a network's ring cost, for
//!   benchmarks at 1, 10 and 100 Gbit/s.
//!
//! ```
//! use collectives::{run_local, Buffer, ProcessGroup, ReduceOp};
//! let out = run_local(2, |g| g.all_reduce(Buffer::F32(vec![g.rank() as f32]), ReduceOp::Sum).wait()).unwrap();
//! assert!(out.into_iter().all(|r| r.unwrap().unwrap() == Buffer::F32(vec![1.0])));
//! ```
//!
//! - `nccl::NcclGroup` (feature `cuda`): NCCL through `cudarc`, on a progress thread
//!   that owns the communicator; host buffers are staged, device buffers (`CudaSlice`) go
//!   direct. It compiles everywhere; see its module docs for what has run on which GPU.
//! - `device` (feature `cuda`): `DeviceBuffer` and the device methods of every
//!   [`ProcessGroup`] (`all_reduce_device`, `broadcast_device`, `device_native`): NCCL
//!   works on the device, other backends stage through host memory in one place.
//!
//! - `mpi::MpiGroup` (feature `mpi`): MPI through the `mpi` crate (Open MPI), one
//!   progress thread per process owning every communicator, non-blocking collectives
//!   polled against the timeout; reductions bit-identical to the thread backend's by
//!   default (a fixed order of additions on any number of ranks). Open MPI 4 has no fault tolerance: a dead rank aborts the
//!   whole job.
#![deny(missing_docs)]

mod buffer;
mod compose;
#[cfg(feature = "cuda")]
pub mod device;
pub mod env;
mod error;
mod forward;
mod group;
pub mod link;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod narrow;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod p2p;
pub mod store;
mod sync;
#[cfg(not(loom))]
pub mod tcp;
pub mod threads;
mod work;

pub use buffer::{Buffer, DType, ReduceOp};
#[cfg(feature = "cuda")]
pub use device::DeviceBuffer;
pub use error::{Error, HookError, Result};
pub use group::{Narrowed, ProcessGroup, DEFAULT_TIMEOUT};
pub use narrow::{HalfWire, WireFormat};
pub use p2p::{P2pOp, MAX_TAG};
#[cfg(not(loom))]
pub use tcp::{TcpGroup, TcpOptions};
pub use threads::{run_local, run_local_with_timeout, ThreadGroup};
pub use work::{Completer, Work};

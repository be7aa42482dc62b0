//! Process groups for data-parallel training: `all_reduce`, `broadcast`, `all_gather`,
//! `reduce_scatter` and `barrier` returning async work handles, on an in-process thread
//! backend, NCCL (through `cudarc`) and MPI, with `env://` rendezvous like `torchrun`.
//!
//! **Status: in progress (issue 3).** Present: the error type, the TCP key-value store and
//! the environment rendezvous. The process-group trait and its backends land next.
#![deny(missing_docs)]

mod buffer;
pub mod env;
mod error;
mod group;
pub mod link;
pub mod store;
pub mod threads;
mod work;

pub use buffer::{Buffer, DType, ReduceOp};
pub use error::{Error, Result};
pub use group::{ProcessGroup, DEFAULT_TIMEOUT};
pub use threads::{run_local, run_local_with_timeout, ThreadGroup};
pub use work::{Completer, Work};

//! Process groups for data-parallel training: `all_reduce`, `broadcast`, `all_gather`,
//! `reduce_scatter` and `barrier` returning async work handles, on an in-process thread
//! backend, NCCL (through `cudarc`) and MPI, with `env://` rendezvous like `torchrun`.
//!
//! **Status: placeholder.** This crate is specified by issue 3 and not yet written; it
//! exports nothing. See `ARCHITECTURE.md` for where it sits: it depends on no other
//! crate of this workspace, and `ddp-hooks` is generic over its `ProcessGroup` trait.
#![deny(missing_docs)]

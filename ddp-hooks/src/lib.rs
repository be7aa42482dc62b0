//! DDP communication hooks on gradient buckets: allreduce, fp16/bf16 compression, noop,
//! PowerSGD (per layer) and batched PowerSGD with the full `PowerSGDState`, plus the
//! gradient bucketing (the reducer) that calls them.
//!
//! **Status: placeholder.** This crate is specified by issue 4 and not yet written; it
//! exports nothing. It will build on `lowrank` (the kernels), `collectives` (the process
//! group) and `accum` (the sync trait its reducer implements).
#![deny(missing_docs)]

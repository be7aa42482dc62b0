//! GPipe pipeline parallelism: micro-batches, partitions on worker threads or devices,
//! checkpointing (`always`, `except_last`, `never`), deferred batch norm and balancing.
//!
//! **Status: placeholder.** The pipeline crates follow the data-parallel path in later
//! issues; this crate exports nothing yet. It will be generic over a tensor trait and use
//! `skip` for skip connections.
#![deny(missing_docs)]

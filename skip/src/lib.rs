//! Skip connections across pipeline stages: stash/pop, namespaces and verification, as in
//! torchgpipe's `skip` package.
//!
//! **Status: placeholder.** The pipeline crates follow the data-parallel path in later
//! issues; this crate exports nothing yet. It will work without `pipe` (on a plain
//! sequence of layers), and `pipe` will use it.
#![deny(missing_docs)]

//! Gradient-accumulation guards: `no_sync` and `accumulate` (as in Accelerate), over a
//! small trait for anything whose gradient synchronisation can be switched off.
//!
//! **Status: placeholder.** This crate is specified by issue 5 and not yet written; it
//! exports nothing. It will know nothing of `ddp-hooks`: that crate implements this one's
//! trait for its reducer.
#![deny(missing_docs)]

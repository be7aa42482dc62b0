//! Gradient accumulation that is cheap and correct: `no_sync` and `accumulate`.
//!
//! Synchronising gradients on every micro-step of an accumulation group wastes the
//! network: only the sum at the end of the group is needed (Accelerate measured 2.2x
//! faster steps across nodes by skipping the intermediate all-reduces). This crate makes
//! that the easy thing:
//!
//! - [`GradSync`]: the one trait a data-parallel engine implements (`ddp-hooks`'
//!   reducer does; so can any other framework's) — can its synchronisation be switched
//!   off?
//! - [`no_sync`] / [`with_no_sync`]: an RAII guard and a closure under which gradients
//!   only accumulate locally; the previous setting comes back on every exit path (end of
//!   scope, `?`, a caught panic), and guards nest.
//! - [`Accumulator`]: Accelerate's `accumulate`. Before each micro-step's gradients are
//!   produced it decides whether that step synchronises, gives the loss scale, and gates
//!   the optimizer step, zero-grad and scheduler step so a loop can call them every
//!   micro-step.
//!
//! ```
//! use accum::{Accumulator, GradSync};
//!
//! /// Stands in for a data-parallel engine: counts the all-reduces it would do.
//! #[derive(Default)]
//! struct Engine { sync: bool, allreduces: usize }
//! impl GradSync for Engine {
//!     fn set_sync(&mut self, on: bool) -> bool { std::mem::replace(&mut self.sync, on) }
//!     fn sync_enabled(&self) -> bool { self.sync }
//! }
//!
//! # fn main() -> Result<(), accum::Error> {
//! let mut engine = Engine { sync: true, ..Default::default() };
//! let mut acc = Accumulator::new(4)?;
//! let batches = vec![(); 10];
//! let mut optimizer_steps = 0;
//! for (step, _batch) in acc.epoch(batches.iter()) {
//!     let mut model = step.apply(&mut engine); // no_sync unless this step synchronises
//!     let _scale = step.loss_scale(); // 1/4, or 1/2 for the short last group
//!     if model.sync_enabled() {
//!         model.allreduces += 1; // what the backward pass would trigger
//!     }
//!     drop(model);
//!     step.on_sync(|| optimizer_steps += 1); // gated: only at the end of a group
//! }
//! assert_eq!((engine.allreduces, optimizer_steps), (3, 3)); // groups of 4, 4, 2
//! assert!(engine.sync_enabled()); // restored
//! # Ok(()) }
//! ```
//!
//! The decision is taken before the forward pass, as DDP takes it: a guard around the
//! backward pass alone would be too late for engines that prepare the reduction in
//! forward.
#![deny(missing_docs)]

mod accumulator;
mod guard;

pub use accumulator::{Accumulator, Config, Epoch, Step, Stream};
pub use guard::{no_sync, with_no_sync, GradSync, SyncGuard};

/// What can go wrong when configuring or driving an [`Accumulator`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `num_steps` must be at least 1.
    #[error("num_steps must be at least 1, got {0}")]
    InvalidNumSteps(usize),
    /// [`Accumulator::next_step`] was called with no epoch started.
    #[error("no epoch in progress: call Accumulator::start_epoch(len) (or iterate Accumulator::epoch) first")]
    NoEpoch,
    /// More micro-steps were taken than the epoch announced.
    #[error("the epoch announced {len} batches, and all of them have been taken")]
    EpochOver {
        /// The announced length.
        len: usize,
    },
}

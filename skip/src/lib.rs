//! Skip connections across pipeline stages, as in torchgpipe's `skip` package: a layer
//! stashes a value by name and a later layer pops it, without threading it through the
//! layers in between, and the gradient flows back the same way.
//!
//! - [`Declaration`]: what a layer stashes and pops, fixed before any run
//!   (`@skippable(stash=[...], pop=[...])`), with [`Namespace`]s to [`isolate`] names so
//!   one block type can appear many times (U-Net's encoder/decoder pairs).
//! - [`verify`]: checks that stashes and pops pair up, reporting every problem at once.
//! - [`Tracker`]: one per micro-batch (per partition in a pipeline); holds values until
//!   they are popped and gradients until the stashing layer takes them, and knows
//!   recomputation under checkpointing. A layer sees it through [`Skips`] (forward) and
//!   [`Grads`] (backward), which admit only its declared names.
//! - [`SkipLayout`]: for a partitioning, which skips each partition must receive from
//!   which, so a pipeline moves each value once, straight to the popping partition.
//!
//! Layer 0 stashes its input, layer 2 adds it to its output (torchgpipe's `1to3`):
//!
//! ```
//! use skip::{verify, Declaration, Tracker};
//! # fn main() -> Result<(), skip::Error> {
//! let (stash, pop) = (Declaration::new().stash(["1to3"]), Declaration::new().pop(["1to3"]));
//! let decls = [stash, Declaration::new(), pop]; // declared before any run
//! verify(&decls)?;
//! let mut tracker = Tracker::<f64>::new(); // one per micro-batch
//!
//! let x = 3.0;
//! let skips = tracker.forward(0, &decls[0])?;
//! skips.stash("1to3", x)?; // or `None`: stash nothing
//! skips.finish()?;
//! let h = 2.0 * x; // what layers 0 and 1 compute
//! let skips = tracker.forward(2, &decls[2])?;
//! let y = h + skips.pop("1to3")?.copied().unwrap_or(0.0);
//! skips.finish()?;
//! assert_eq!(y, 9.0);
//!
//! // Backward, dy = 1: layer 2 hands in dy/dskip, layer 0 adds it to its input's gradient.
//! let mut grads = tracker.backward(2, &decls[2])?;
//! grads.put_grad("1to3", 1.0)?;
//! grads.finish()?;
//! let mut grads = tracker.backward(0, &decls[0])?;
//! let dx = 2.0 * 1.0 + grads.take_grad("1to3")?.unwrap_or(0.0);
//! grads.finish()?;
//! assert_eq!(dx, 3.0);
//! assert!(tracker.is_empty()); // nothing left behind
//! # Ok(()) }
//! ```
//!
//! The crate is generic over the carried value `T` and does no arithmetic: a layer adds a
//! popped value, and the gradient it gets back, where they belong. Without an autograd
//! engine the gradient cannot ride along the value by itself, so the tracker carries it
//! explicitly, in the same (micro-batch, partition) stores that carried the value.
//!
//! [`isolate`]: Declaration::isolate
#![deny(missing_docs)]

mod declare;
mod error;
mod layer;
mod layout;
mod namespace;
mod tracker;
mod verify;

pub use declare::Declaration;
pub use error::{Error, Problem};
pub use layer::{Grads, Skips};
pub use layout::{Route, SkipLayout};
pub use namespace::Namespace;
pub use tracker::{Moves, Tracker};
pub use verify::verify;

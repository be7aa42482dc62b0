//! Skip connections through the pipe: which skips cross which partitions, and the moves
//! a worker makes for them (torchgpipe's portals).
//!
//! Each (micro-batch, partition) has its own [`Tracker`], living on the partition's worker.
//! A skip that stays inside a partition never leaves its tracker. A skip that crosses
//! partitions moves once each way:
//!
//! - after the stashing partition's forward pass of micro-batch `i`, its worker takes the
//!   value out of the tracker ([`Tracker::take_outgoing`]), moves it to the popping
//!   partition's device and sends it straight to the popping partition's worker, which
//!   puts it into its tracker for `i` ([`Tracker::insert_incoming`]); the partitions in
//!   between never see it. The popping partition's forward pass waits for it as it waits
//!   for its input;
//! - after the popping partition's backward pass of `i`, the gradient goes back the same
//!   way ([`Tracker::take_outgoing_grad`], [`Tracker::insert_incoming_grad`]), and the
//!   stashing partition's backward pass waits for it.
//!
//! Under checkpointing the popping partition's tracker keeps the value until its
//! recomputation has popped it again, and the stashing partition's recomputed stash is
//! dropped, so nothing moves twice (the tracker's rules, counted in [`Moves`]).

use std::sync::Arc;

use skip::{Declaration, Moves, Route, SkipLayout, Tracker};

use crate::tensor::Tensor;

/// The skip routes of a pipe, fixed when it is built.
#[derive(Debug, Default)]
pub(crate) struct SkipPlan {
    /// The routes that cross partitions; a message names its route by index here.
    pub routes: Vec<Route>,
    /// Per stage: the routes into it, in torchgpipe's `copy_policy` order.
    pub incoming: Vec<Vec<usize>>,
    /// Per stage: the routes out of it.
    pub outgoing: Vec<Vec<usize>>,
    /// Per global layer: its declaration, if it declares any skip.
    pub decls: Vec<Option<Arc<Declaration>>>,
    /// Per stage: whether any of its layers declares a skip (it then gets trackers).
    pub has_skips: Vec<bool>,
}

impl SkipPlan {
    /// Verifies the declarations (every problem at once) and routes the skips for
    /// `balance`, which the caller has checked.
    pub fn new(decls: Vec<Declaration>, balance: &[usize]) -> Result<Self, skip::Error> {
        let n = balance.len();
        let layout = SkipLayout::new(&decls, balance)?;
        let mut routes = Vec::new();
        let mut incoming = vec![Vec::new(); n];
        let mut outgoing = vec![Vec::new(); n];
        for (j, into) in incoming.iter_mut().enumerate() {
            for route in layout.copy_policy(j) {
                into.push(routes.len());
                outgoing[route.source].push(routes.len());
                routes.push(route.clone());
            }
        }
        let has_skips = (0..n)
            .map(|j| layout.layers(j).any(|l| !decls[l].is_empty()))
            .collect();
        let decls = decls
            .into_iter()
            .map(|d| (!d.is_empty()).then(|| Arc::new(d)))
            .collect();
        Ok(SkipPlan {
            routes,
            incoming,
            outgoing,
            decls,
            has_skips,
        })
    }

    /// Whether `stage` has layers with skips.
    pub fn stage_has_skips(&self, stage: usize) -> bool {
        self.has_skips.get(stage).copied().unwrap_or(false)
    }

    /// How many skip values `stage` receives per micro-batch before its forward pass.
    pub fn values_in(&self, stage: usize) -> usize {
        self.incoming.get(stage).map_or(0, Vec::len)
    }

    /// How many skip gradients `stage` receives per micro-batch before its backward pass.
    pub fn grads_in(&self, stage: usize) -> usize {
        self.outgoing.get(stage).map_or(0, Vec::len)
    }
}

/// A tracker for one (micro-batch, stage), made with checkpointing when the micro-batch
/// is checkpointed (so it keeps received values for the recomputation).
pub(crate) fn new_tracker<T>(checkpointed: bool) -> Box<Tracker<T>> {
    Box::new(if checkpointed {
        Tracker::with_checkpointing()
    } else {
        Tracker::new()
    })
}

/// Bytes of the values and gradients a tracker holds, through [`Tensor::size_bytes`].
pub(crate) fn held_bytes<T: Tensor>(tracker: &Tracker<T>) -> usize {
    tracker.held().map(Tensor::size_bytes).sum()
}

/// Sums the moves of trackers that are done with.
pub(crate) fn moves_of<'t, T: 't>(trackers: impl IntoIterator<Item = &'t Tracker<T>>) -> Moves {
    trackers.into_iter().map(Tracker::moves).sum()
}

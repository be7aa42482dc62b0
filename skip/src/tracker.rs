//! The per-micro-batch store of skip values and their gradients, and the portal moves a
//! pipeline engine makes between partitions.

use crate::namespace::KeyMap;
use crate::{Declaration, Error, Grads, Namespace, Skips};

/// Holds one micro-batch's skip values until they are popped and their gradients until the
/// stashing layers take them.
///
/// On a plain sequence there is one tracker per micro-batch. A pipeline engine keeps one
/// per (micro-batch, partition), each on its partition's thread (a tracker is `Send` when
/// `T` is), and moves the values that cross partitions itself, once, from the stashing
/// partition's tracker to the popping one's, and their gradients back (see
/// [`SkipLayout`](crate::SkipLayout)); [`moves`](Tracker::moves) counts them. `T` needs
/// no bound: the tracker never clones or adds values.
///
/// # Passes
///
/// - [`forward`](Tracker::forward) gives a layer its [`Skips`] handle; the layer stashes
///   and pops by name, then [`Skips::finish`] checks the declaration was honoured and
///   commits.
/// - [`backward`](Tracker::backward) gives it a [`Grads`] handle: a popping layer hands in
///   the gradient of each popped value, and the stashing layer's own backward pass takes
///   it and adds it to the gradient of the stashed tensor.
/// - [`recompute`](Tracker::recompute), on a tracker made
///   [`with_checkpointing`](Tracker::with_checkpointing), re-runs a layer's forward pass
///   before its backward pass.
///
/// # Lifetime of a value (torchgpipe's tensor life)
///
/// - A value is held from its stash until the popping layer's forward pass finishes, and
///   dropped there; pops lend it (`&T`), so a layer that needs it in its backward pass
///   keeps a clone of its own.
/// - Under checkpointing, a value that came from another partition is kept after that
///   first pop until the popping layer's *recomputation* has used it, because the
///   stashing partition will not run again before then. A value stashed and popped in one
///   tracker is not kept: recomputing the partition stashes it again first.
/// - A recomputed stash neither duplicates nor replaces anything: if the first value was
///   sent to another partition, or is still held here, the recomputed one is dropped
///   (counted in [`Moves::recomputed_stashes_dropped`]); only a value the first pass
///   popped locally is stored again, for the recomputed pop.
/// - A gradient is held from the popping layer's backward pass until the stashing layer's
///   backward pass takes it (or, across partitions, until the engine moves it back).
///
/// [`is_empty`](Tracker::is_empty) then tells that nothing was left behind.
#[derive(Debug)]
pub struct Tracker<T> {
    pub(crate) checkpointed: bool,
    /// Values waiting for a pop (or a move, or a recomputed pop).
    pub(crate) values: KeyMap<Held<T>>,
    /// Gradients handed in by popping layers (or received), waiting to be taken.
    pub(crate) grads: KeyMap<T>,
    /// What layers of this tracker stashed, for the backward pass and recomputation.
    pub(crate) stashes: KeyMap<StashRecord>,
    /// What layers of this tracker popped, likewise.
    pub(crate) pops: KeyMap<PopRecord>,
    pub(crate) moves: Moves,
}

/// A held value: `None` when the layer stashed nothing.
#[derive(Debug)]
pub(crate) struct Held<T> {
    pub(crate) value: Option<T>,
    /// Received from another partition rather than stashed here.
    pub(crate) incoming: bool,
    /// The first pass popped it; kept for the recomputed pop.
    pub(crate) popped: bool,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct StashRecord {
    pub(crate) layer: usize,
    pub(crate) nothing: bool,
    /// Taken by `take_outgoing`: popped in another partition.
    pub(crate) sent: bool,
    /// `insert_incoming_grad` delivered (possibly no) gradient.
    pub(crate) grad_arrived: bool,
    pub(crate) grad_taken: bool,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct PopRecord {
    pub(crate) layer: usize,
    pub(crate) nothing: bool,
    pub(crate) incoming: bool,
    pub(crate) backward_done: bool,
    pub(crate) grad_sent: bool,
}

/// How many skip values and gradients a tracker let through its portal methods, and how
/// many recomputed stashes it dropped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Moves {
    /// Values taken out by [`Tracker::take_outgoing`].
    pub values_sent: usize,
    /// Values put in by [`Tracker::insert_incoming`].
    pub values_received: usize,
    /// Gradients taken out by [`Tracker::take_outgoing_grad`].
    pub grads_sent: usize,
    /// Gradients put in by [`Tracker::insert_incoming_grad`].
    pub grads_received: usize,
    /// Stashes of a recomputation that were dropped because the first value had been
    /// sent or was still held.
    pub recomputed_stashes_dropped: usize,
}

impl std::ops::Add for Moves {
    type Output = Moves;

    fn add(self, other: Moves) -> Moves {
        Moves {
            values_sent: self.values_sent + other.values_sent,
            values_received: self.values_received + other.values_received,
            grads_sent: self.grads_sent + other.grads_sent,
            grads_received: self.grads_received + other.grads_received,
            recomputed_stashes_dropped: self.recomputed_stashes_dropped
                + other.recomputed_stashes_dropped,
        }
    }
}

/// Totals over several trackers: `trackers.iter().map(Tracker::moves).sum()`.
impl std::iter::Sum for Moves {
    fn sum<I: Iterator<Item = Moves>>(iter: I) -> Moves {
        iter.fold(Moves::default(), |a, b| a + b)
    }
}

impl<T> Default for Tracker<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Tracker<T> {
    /// A tracker for a micro-batch that is not checkpointed.
    pub fn new() -> Self {
        Tracker {
            checkpointed: false,
            values: KeyMap::default(),
            grads: KeyMap::default(),
            stashes: KeyMap::default(),
            pops: KeyMap::default(),
            moves: Moves::default(),
        }
    }

    /// A tracker for a checkpointed micro-batch: values received from other partitions
    /// are kept for the recomputation, and [`recompute`](Tracker::recompute) is allowed.
    pub fn with_checkpointing() -> Self {
        Tracker {
            checkpointed: true,
            ..Self::new()
        }
    }

    /// Whether this tracker was made [`with_checkpointing`](Tracker::with_checkpointing).
    pub fn is_checkpointed(&self) -> bool {
        self.checkpointed
    }

    /// The handle for the first forward pass of layer `layer` (its global index, used in
    /// errors) with declaration `decl`.
    ///
    /// Fails with [`Error::NotStashed`] if a declared pop's value is not here (torchgpipe
    /// loads pops eagerly, before the layer runs).
    pub fn forward<'a>(
        &'a mut self,
        layer: usize,
        decl: &'a Declaration,
    ) -> Result<Skips<'a, T>, Error> {
        for (ns, name) in decl.poppable() {
            match self.values.get(ns, name) {
                Some(held) if !held.popped => {}
                _ => return Err(not_stashed(layer, ns, name)),
            }
        }
        Ok(Skips::new(self, decl, layer, false))
    }

    /// The handle for recomputing layer `layer`'s forward pass during the backward pass of
    /// a checkpointed micro-batch. Its pops lend the same values as the first pass; its
    /// stashes follow the rules in the [type docs](Tracker).
    ///
    /// Fails with [`Error::NotCheckpointed`] on a tracker made with [`Tracker::new`], and
    /// with [`Error::NotForwarded`] if the first pass of this layer did not stash or pop
    /// a declared name.
    pub fn recompute<'a>(
        &'a mut self,
        layer: usize,
        decl: &'a Declaration,
    ) -> Result<Skips<'a, T>, Error> {
        if !self.checkpointed {
            return Err(Error::NotCheckpointed { layer });
        }
        for (ns, name) in decl.stashable() {
            if self.stashes.get(ns, name).is_none_or(|r| r.layer != layer) {
                return Err(not_forwarded(layer, ns, name));
            }
        }
        for (ns, name) in decl.poppable() {
            if self.pops.get(ns, name).is_none_or(|r| r.layer != layer) {
                return Err(not_forwarded(layer, ns, name));
            }
            if !self.values.contains(ns, name) {
                return Err(not_stashed(layer, ns, name));
            }
        }
        Ok(Skips::new(self, decl, layer, true))
    }

    /// The handle for layer `layer`'s backward pass.
    ///
    /// Fails with [`Error::NotForwarded`] if this layer's forward pass did not stash or
    /// pop a declared name, and with [`Error::BackwardTwice`] on a second backward pass of
    /// a popping layer.
    pub fn backward<'a>(
        &'a mut self,
        layer: usize,
        decl: &'a Declaration,
    ) -> Result<Grads<'a, T>, Error> {
        for (ns, name) in decl.stashable() {
            if self.stashes.get(ns, name).is_none_or(|r| r.layer != layer) {
                return Err(not_forwarded(layer, ns, name));
            }
        }
        for (ns, name) in decl.poppable() {
            match self.pops.get(ns, name) {
                Some(r) if r.layer == layer && r.backward_done => {
                    return Err(Error::BackwardTwice {
                        layer,
                        ns,
                        name: name.to_owned(),
                    })
                }
                Some(r) if r.layer == layer => {}
                _ => return Err(not_forwarded(layer, ns, name)),
            }
        }
        // Checked above: from here on the popped skips' gradients count as handed in,
        // empty until `Grads::put_grad`; nobody can look before the handle is dropped.
        for (ns, name) in decl.poppable() {
            if let Some(r) = self.pops.get_mut(ns, name) {
                r.backward_done = true;
            }
        }
        Ok(Grads::new(self, decl, layer))
    }

    /// Takes the value of a skip stashed here and popped in another partition, for the
    /// engine to move to the popping partition's tracker. `Ok(None)` means the layer
    /// stashed nothing (the move still has to happen, as torchgpipe's phony does).
    pub fn take_outgoing(&mut self, ns: Namespace, name: &str) -> Result<Option<T>, Error> {
        let nothing_to_send = || Error::NothingToSend {
            ns,
            name: name.to_owned(),
        };
        let record = self.stashes.get_mut(ns, name).ok_or_else(nothing_to_send)?;
        match self.values.get(ns, name) {
            Some(held) if !held.incoming && !held.popped && !record.sent => {}
            _ => return Err(nothing_to_send()),
        }
        record.sent = true;
        self.moves.values_sent += 1;
        Ok(self.values.remove(ns, name).and_then(|held| held.value))
    }

    /// Puts in a value moved from the stashing partition's tracker, for a layer of this
    /// one to pop.
    pub fn insert_incoming(
        &mut self,
        ns: Namespace,
        name: &str,
        value: Option<T>,
    ) -> Result<(), Error> {
        if self.values.contains(ns, name)
            || self.pops.contains(ns, name)
            || self.stashes.contains(ns, name)
        {
            return Err(Error::AlreadyHeld {
                ns,
                name: name.to_owned(),
            });
        }
        let held = Held {
            value,
            incoming: true,
            popped: false,
        };
        self.values.insert(ns, name, held);
        self.moves.values_received += 1;
        Ok(())
    }

    /// Takes the gradient of a skip that came from another partition, once its popping
    /// layer's backward pass has run, for the engine to move back to the stashing
    /// partition's tracker. `Ok(None)`: no gradient (the value was nothing, or the
    /// popping layer handed none in).
    pub fn take_outgoing_grad(&mut self, ns: Namespace, name: &str) -> Result<Option<T>, Error> {
        match self.pops.get_mut(ns, name) {
            Some(r) if r.incoming && r.backward_done && !r.grad_sent => r.grad_sent = true,
            _ => {
                return Err(Error::NoGradToSend {
                    ns,
                    name: name.to_owned(),
                })
            }
        }
        self.moves.grads_sent += 1;
        Ok(self.grads.remove(ns, name))
    }

    /// Puts in a gradient moved back from the popping partition's tracker, for the
    /// stashing layer's backward pass to take.
    pub fn insert_incoming_grad(
        &mut self,
        ns: Namespace,
        name: &str,
        grad: Option<T>,
    ) -> Result<(), Error> {
        match self.stashes.get_mut(ns, name) {
            Some(r) if r.sent && !r.grad_arrived && !(r.nothing && grad.is_some()) => {
                r.grad_arrived = true;
            }
            _ => {
                return Err(Error::UnexpectedGrad {
                    ns,
                    name: name.to_owned(),
                })
            }
        }
        if let Some(grad) = grad {
            self.grads.insert(ns, name, grad);
        }
        self.moves.grads_received += 1;
        Ok(())
    }

    /// Whether a value of the skip is held here (waiting for a pop, a move or a
    /// recomputed pop), even a stash of nothing.
    pub fn holds_value(&self, ns: Namespace, name: &str) -> bool {
        self.values.contains(ns, name)
    }

    /// Whether a gradient of the skip is held here.
    pub fn holds_grad(&self, ns: Namespace, name: &str) -> bool {
        self.grads.contains(ns, name)
    }

    /// Every value and gradient held (stashes of nothing left out), for an engine to
    /// count the memory its trackers hold.
    pub fn held(&self) -> impl Iterator<Item = &T> + '_ {
        let values = self.values.iter().filter_map(|(_, _, h)| h.value.as_ref());
        values.chain(self.grads.iter().map(|(_, _, g)| g))
    }

    /// Number of values plus gradients held.
    pub fn len(&self) -> usize {
        self.values.len() + self.grads.len()
    }

    /// Whether no value and no gradient is held: after a complete forward and backward
    /// pass (and the engine's moves), nothing was left behind or lost.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty() && self.grads.is_empty()
    }

    /// The portal moves and dropped recomputed stashes so far.
    pub fn moves(&self) -> Moves {
        self.moves
    }
}

pub(crate) fn not_stashed(layer: usize, ns: Namespace, name: &str) -> Error {
    Error::NotStashed {
        layer,
        ns,
        name: name.to_owned(),
    }
}

fn not_forwarded(layer: usize, ns: Namespace, name: &str) -> Error {
    Error::NotForwarded {
        layer,
        ns,
        name: name.to_owned(),
    }
}

//! The handles a layer sees: [`Skips`] in its forward pass, [`Grads`] in its backward
//! pass. Both admit only the names the layer declared.

use std::cell::Cell;

use crate::tracker::{not_stashed, Held, PopRecord, StashRecord};
use crate::{Declaration, Error, Namespace, Tracker};

/// One layer's access to the skips during a forward pass (first or recomputed), made by
/// [`Tracker::forward`] or [`Tracker::recompute`]: torchgpipe's `yield stash(...)` and
/// `yield pop(...)`.
///
/// Stashes are committed to the tracker by [`finish`](Skips::finish), once the
/// declaration has been checked; a handle dropped without `finish` (say, because the
/// layer failed) leaves the tracker as it found it. Both methods take `&self`, so popped
/// values can stay borrowed while the layer stashes.
#[must_use = "call finish() to check the declaration and commit the stashes"]
pub struct Skips<'a, T> {
    tracker: &'a mut Tracker<T>,
    decl: &'a Declaration,
    layer: usize,
    recompute: bool,
    /// Index into `decl.stash_names()` and the value, in stash order.
    stashed: Cell<Vec<(usize, Option<T>)>>,
    /// One flag per `decl.pop_names()`.
    popped: Vec<Cell<bool>>,
}

impl<'a, T> Skips<'a, T> {
    pub(crate) fn new(
        tracker: &'a mut Tracker<T>,
        decl: &'a Declaration,
        layer: usize,
        recompute: bool,
    ) -> Self {
        Skips {
            tracker,
            decl,
            layer,
            recompute,
            stashed: Cell::new(Vec::new()),
            popped: decl.pop_names().iter().map(|_| Cell::new(false)).collect(),
        }
    }

    /// The layer's global index.
    pub fn layer(&self) -> usize {
        self.layer
    }

    /// Whether this is a recomputation of the layer's forward pass.
    pub fn is_recompute(&self) -> bool {
        self.recompute
    }

    /// Stashes `value` under the declared name `name`: a `T`, or `None` to stash nothing
    /// (a conditional skip; the pop then gets `None` and no gradient flows).
    pub fn stash(&self, name: &str, value: impl Into<Option<T>>) -> Result<(), Error> {
        let ns = self.decl.namespace(name);
        let Some(index) = self.decl.stash_names().iter().position(|n| n == name) else {
            return Err(Error::NotDeclaredStashable {
                layer: self.layer,
                ns,
                name: name.to_owned(),
            });
        };
        let twice = || Error::StashedTwice {
            layer: self.layer,
            ns,
            name: name.to_owned(),
        };
        let held_here =
            self.tracker.stashes.contains(ns, name) || self.tracker.values.contains(ns, name);
        if !self.recompute && held_here {
            return Err(twice());
        }
        let mut stashed = self.stashed.take();
        let result = if stashed.iter().any(|(i, _)| *i == index) {
            Err(twice())
        } else {
            stashed.push((index, value.into()));
            Ok(())
        };
        self.stashed.set(stashed);
        result
    }

    /// Pops the value stashed under the declared name `name`: `Some(&value)`, or `None` if
    /// the stashing layer stashed nothing. The value is lent: it stays in the tracker until
    /// this pass finishes (and, for a value from another partition under checkpointing,
    /// until the recomputation), so a layer that needs it later clones it.
    pub fn pop(&self, name: &str) -> Result<Option<&T>, Error> {
        let ns = self.decl.namespace(name);
        let Some(index) = self.decl.pop_names().iter().position(|n| n == name) else {
            return Err(Error::NotDeclaredPoppable {
                layer: self.layer,
                ns,
                name: name.to_owned(),
            });
        };
        if self.popped[index].get() {
            return Err(Error::PoppedTwice {
                layer: self.layer,
                ns,
                name: name.to_owned(),
            });
        }
        // Present since the handle was made (checked there), but never trust it to panic.
        let held = self
            .tracker
            .values
            .get(ns, name)
            .ok_or_else(|| not_stashed(self.layer, ns, name))?;
        self.popped[index].set(true);
        Ok(held.value.as_ref())
    }

    /// Ends the pass: every declared name must have been stashed
    /// ([`Error::MustBeStashed`], checked first) and popped ([`Error::MustBePopped`]).
    /// Then popped values are released and stashes committed, as the
    /// [`Tracker`] docs describe. On an error the tracker is left unchanged.
    pub fn finish(self) -> Result<(), Error> {
        let stashed = self.stashed.take();
        let decl = self.decl;
        let not_stashed: Vec<_> = decl
            .stashable()
            .enumerate()
            .filter(|(i, _)| !stashed.iter().any(|(j, _)| j == i))
            .map(|(_, (ns, name))| (ns, name.to_owned()))
            .collect();
        if !not_stashed.is_empty() {
            return Err(Error::MustBeStashed {
                layer: self.layer,
                names: not_stashed,
            });
        }
        let not_popped: Vec<_> = decl
            .poppable()
            .zip(&self.popped)
            .filter(|(_, done)| !done.get())
            .map(|((ns, name), _)| (ns, name.to_owned()))
            .collect();
        if !not_popped.is_empty() {
            return Err(Error::MustBePopped {
                layer: self.layer,
                names: not_popped,
            });
        }

        let tracker = self.tracker;
        for (ns, name) in decl.poppable() {
            if self.recompute {
                tracker.values.remove(ns, name);
                continue;
            }
            // Present: checked when the handle was made, and only `finish` removes values.
            let Some(held) = tracker.values.get_mut(ns, name) else {
                continue;
            };
            let record = PopRecord {
                layer: self.layer,
                nothing: held.value.is_none(),
                incoming: held.incoming,
                backward_done: false,
                grad_sent: false,
            };
            tracker.pops.insert(ns, name, record);
            // Kept for the recomputed pop when the stashing partition will not run again
            // before it; released now otherwise.
            held.popped = held.incoming && tracker.checkpointed;
            if !held.popped {
                tracker.values.remove(ns, name);
            }
        }

        for (index, value) in stashed {
            let name = &decl.stash_names()[index];
            let ns = decl.namespace(name);
            if self.recompute {
                let sent = tracker.stashes.get(ns, name).is_some_and(|r| r.sent);
                if sent || tracker.values.contains(ns, name) {
                    tracker.moves.recomputed_stashes_dropped += 1;
                    continue;
                }
            } else {
                let record = StashRecord {
                    layer: self.layer,
                    nothing: value.is_none(),
                    sent: false,
                    grad_arrived: false,
                    grad_taken: false,
                };
                tracker.stashes.insert(ns, name, record);
            }
            let held = Held {
                value,
                incoming: false,
                popped: false,
            };
            tracker.values.insert(ns, name, held);
        }
        Ok(())
    }
}

/// One layer's access to skip gradients during its backward pass, made by
/// [`Tracker::backward`].
///
/// A popping layer hands in the gradient of each value it popped
/// ([`put_grad`](Grads::put_grad); none if the value did not reach its output); a stashing
/// layer takes the gradient of each value it stashed ([`take_grad`](Grads::take_grad)) and
/// adds it to the gradient of the tensor it stashed, which is how nothing is lost when
/// that tensor also fed the layer's own output.
#[must_use = "call finish() to check that every stashed value's gradient was taken"]
pub struct Grads<'a, T> {
    tracker: &'a mut Tracker<T>,
    decl: &'a Declaration,
    layer: usize,
}

impl<'a, T> Grads<'a, T> {
    pub(crate) fn new(tracker: &'a mut Tracker<T>, decl: &'a Declaration, layer: usize) -> Self {
        Grads {
            tracker,
            decl,
            layer,
        }
    }

    /// The layer's global index.
    pub fn layer(&self) -> usize {
        self.layer
    }

    fn key(&self, name: &str) -> (Namespace, String) {
        (self.decl.namespace(name), name.to_owned())
    }

    /// Hands in the gradient of the value this layer popped under `name`.
    pub fn put_grad(&mut self, name: &str, grad: T) -> Result<(), Error> {
        let layer = self.layer;
        let ns = self.decl.namespace(name);
        if !self.decl.is_poppable(name) {
            let (ns, name) = self.key(name);
            return Err(Error::NotDeclaredPoppable { layer, ns, name });
        }
        let nothing = self.tracker.pops.get(ns, name).is_none_or(|r| r.nothing);
        if nothing {
            let (ns, name) = self.key(name);
            return Err(Error::GradOfNothing { layer, ns, name });
        }
        if self.tracker.grads.contains(ns, name) {
            let (ns, name) = self.key(name);
            return Err(Error::GradTwice { layer, ns, name });
        }
        self.tracker.grads.insert(ns, name, grad);
        Ok(())
    }

    /// Takes the gradient of the value this layer stashed under `name`, to add to the
    /// gradient of the stashed tensor: `None` if the layer stashed nothing or the popping
    /// layer handed no gradient in.
    ///
    /// Fails with [`Error::GradNotReady`] before the popping layer's backward pass (or,
    /// across partitions, before the engine moved the gradient back).
    pub fn take_grad(&mut self, name: &str) -> Result<Option<T>, Error> {
        let layer = self.layer;
        let ns = self.decl.namespace(name);
        if !self.decl.is_stashable(name) {
            let (ns, name) = self.key(name);
            return Err(Error::NotDeclaredStashable { layer, ns, name });
        }
        let tracker = &mut *self.tracker;
        let Some(record) = tracker.stashes.get(ns, name).copied() else {
            let (ns, name) = self.key(name);
            return Err(Error::NotForwarded { layer, ns, name });
        };
        if record.grad_taken {
            let (ns, name) = self.key(name);
            return Err(Error::GradAlreadyTaken { layer, ns, name });
        }
        let ready = record.nothing
            || if record.sent {
                record.grad_arrived
            } else {
                tracker.pops.get(ns, name).is_some_and(|r| r.backward_done)
            };
        if !ready {
            let (ns, name) = self.key(name);
            return Err(Error::GradNotReady { layer, ns, name });
        }
        if let Some(r) = tracker.stashes.get_mut(ns, name) {
            r.grad_taken = true;
        }
        Ok(tracker.grads.remove(ns, name))
    }

    /// Ends the backward pass: the gradient of every value this layer stashed (other than
    /// nothing) must have been taken ([`Error::GradNotTaken`]), or it would be lost.
    pub fn finish(self) -> Result<(), Error> {
        let names: Vec<_> = self
            .decl
            .stashable()
            .filter(|&(ns, name)| {
                self.tracker
                    .stashes
                    .get(ns, name)
                    .is_some_and(|r| !r.nothing && !r.grad_taken)
            })
            .map(|(ns, name)| (ns, name.to_owned()))
            .collect();
        if names.is_empty() {
            Ok(())
        } else {
            Err(Error::GradNotTaken {
                layer: self.layer,
                names,
            })
        }
    }
}

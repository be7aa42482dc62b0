//! The error-feedback memories of a quantisation hook, the lease a step holds on its
//! bucket's memory, and the hooks' `save_state` / `load_state`.

use crate::{Error, HookState, Result};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};

/// The error-feedback memories of a hook, per bucket index, and the buckets with a step
/// in flight.
#[derive(Default)]
pub(super) struct Memories {
    /// `e` per bucket index: the bucket's length, `f32`.
    errors: BTreeMap<usize, Vec<f32>>,
    /// Buckets whose step has started and not yet completed or failed.
    in_flight: BTreeSet<usize>,
}

/// A hook's memories, shared with its steps in flight.
pub(super) type Shared = Arc<Mutex<Memories>>;

/// Locks the memories. Every update completes before the lock is released, so a lock
/// poisoned by a panicking continuation holds consistent data.
fn lock(m: &Mutex<Memories>) -> MutexGuard<'_, Memories> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The error for a bucket whose previous step has not completed.
fn in_flight(index: usize) -> Error {
    Error::Bucket {
        index,
        why: "the previous step of this bucket has not completed (wait for every hook's work before the next step)".into(),
    }
}

/// One step's hold on its bucket's memory: taken by [`Lease::take`], which adds `e` into
/// the bucket; [`commit`](Lease::commit) stores the new `e` once the step has succeeded.
/// Dropped without committing (any failure), it leaves the memory as before the step.
pub(super) struct Lease {
    shared: Shared,
    index: usize,
    /// The new `e`, once computed.
    pub(super) pending: Option<Vec<f32>>,
}

impl Lease {
    /// Marks bucket `index` in flight and adds its memory (none: zeros) into `x`, element
    /// by element (`x + e`). A step already in flight, or a memory of another length, is
    /// [`Error::Bucket`].
    pub(super) fn take(shared: &Shared, index: usize, x: &mut [f32]) -> Result<Self> {
        let mut m = lock(shared);
        if m.in_flight.contains(&index) {
            return Err(in_flight(index));
        }
        if let Some(e) = m.errors.get(&index) {
            if e.len() != x.len() {
                return Err(Error::Bucket {
                    index,
                    why: format!(
                        "the error-feedback memory holds {} elements, the bucket {}: the bucket changed length (or a state of another model was loaded)",
                        e.len(),
                        x.len()
                    ),
                });
            }
            for (x, e) in x.iter_mut().zip(e) {
                *x += e;
            }
        }
        m.in_flight.insert(index);
        Ok(Lease {
            shared: shared.clone(),
            index,
            pending: None,
        })
    }

    /// Stores the new memory: the step succeeded.
    pub(super) fn commit(mut self) {
        if let Some(e) = self.pending.take() {
            lock(&self.shared).errors.insert(self.index, e);
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        lock(&self.shared).in_flight.remove(&self.index);
    }
}

/// `save_state` of a quantisation hook named `name`: [`HookState::Stateless`] without
/// error feedback, else its memories. A step in flight is [`Error::Bucket`].
pub(super) fn save_quantize(name: String, memories: Option<&Shared>) -> Result<HookState> {
    let Some(shared) = memories else {
        return Ok(HookState::Stateless { hook: name });
    };
    let m = lock(shared);
    if let Some(&index) = m.in_flight.first() {
        return Err(in_flight(index));
    }
    Ok(HookState::Quantize {
        hook: name,
        buckets: m.errors.clone(),
    })
}

/// `load_state` of a quantisation hook named `name`: its own stateless state without
/// error feedback; with it, a [`HookState::Quantize`] of the same name (configuration)
/// whose memories are finite and, for every bucket the hook holds a memory of, of that
/// memory's length. Anything else is [`Error::State`], a step in flight
/// [`Error::Bucket`]; either leaves the hook unchanged.
pub(super) fn load_quantize(name: &str, memories: Option<&Shared>, state: HookState) -> Result<()> {
    let Some(shared) = memories else {
        return load_stateless(name, state);
    };
    let buckets = match state {
        HookState::Quantize { hook, buckets } if hook == name => buckets,
        other => {
            return Err(other.mismatch(&format!("the quantisation hook `{name}`")));
        }
    };
    for (&index, e) in &buckets {
        if let Some(i) = e.iter().position(|v| !v.is_finite()) {
            return Err(Error::State(format!(
                "{name}: bucket {index}: error[{i}] = {} is not finite; the state is corrupt",
                e[i]
            )));
        }
    }
    let mut m = lock(shared);
    if let Some(&index) = m.in_flight.first() {
        return Err(in_flight(index));
    }
    for (&index, e) in &buckets {
        if let Some(own) = m.errors.get(&index) {
            if own.len() != e.len() {
                return Err(Error::State(format!(
                    "{name}: bucket {index} holds {} elements here, {} in the state: the buckets differ",
                    own.len(),
                    e.len()
                )));
            }
        }
    }
    m.errors = buckets;
    Ok(())
}

/// `load_state` of a stateless hook named `name`.
fn load_stateless(name: &str, state: HookState) -> Result<()> {
    match state {
        HookState::Stateless { hook } if hook == name => Ok(()),
        other => Err(other.mismatch(&format!("the stateless hook `{name}`"))),
    }
}

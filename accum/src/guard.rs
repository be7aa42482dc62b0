//! The gradient-sync trait and the `no_sync` guard.

use std::ops::{Deref, DerefMut};

/// Anything whose gradient synchronisation can be switched off: a data-parallel reducer,
/// a model wrapper, another framework's engine.
///
/// With sync off, backward passes only accumulate gradients locally; the first backward
/// pass with sync on reduces the accumulated sum.
pub trait GradSync {
    /// Switches synchronisation on or off; returns the previous setting.
    fn set_sync(&mut self, on: bool) -> bool;
    /// Whether the next backward pass synchronises.
    fn sync_enabled(&self) -> bool;
    /// Tells the target whether the gradients go on accumulating after this step: on for
    /// every micro-step of an accumulation group but the last, including the synchronised
    /// ones of Accelerate's `sync_each_batch`, whose reduced gradients the next micro-steps
    /// add to. A target that zeroes the gradients of parameters unused in a synchronised
    /// step keeps what they accumulated in the group instead while this is on (DDP keeps
    /// any gradient a parameter holds). Returns the previous setting. The default does
    /// nothing and returns `false`.
    fn set_accumulating(&mut self, on: bool) -> bool {
        let _ = on;
        false
    }
}

impl<T: GradSync + ?Sized> GradSync for &mut T {
    fn set_sync(&mut self, on: bool) -> bool {
        (**self).set_sync(on)
    }
    fn sync_enabled(&self) -> bool {
        (**self).sync_enabled()
    }
    fn set_accumulating(&mut self, on: bool) -> bool {
        (**self).set_accumulating(on)
    }
}

/// Sets a [`GradSync`] target's synchronisation for a scope and restores the previous
/// setting when dropped: at the end of the scope, on an early return (`?`) and while
/// unwinding from a panic. Dereferences to the target, so the model is used through it;
/// guards nest (a guard on a guard restores in reverse order).
#[must_use = "the setting is restored when the guard is dropped; bind it to a variable"]
pub struct SyncGuard<'a, S: GradSync + ?Sized> {
    target: &'a mut S,
    previous: bool,
    /// The accumulating setting to restore, where the guard changed it.
    accumulating: Option<bool>,
}

impl<'a, S: GradSync + ?Sized> SyncGuard<'a, S> {
    /// Sets `target`'s synchronisation to `on` until the guard is dropped.
    pub fn new(target: &'a mut S, on: bool) -> Self {
        let previous = target.set_sync(on);
        SyncGuard {
            target,
            previous,
            accumulating: None,
        }
    }

    /// Sets `target`'s synchronisation to `on` and its accumulating setting
    /// ([`GradSync::set_accumulating`]) to `accumulating` until the guard is dropped.
    pub fn with_accumulating(target: &'a mut S, on: bool, accumulating: bool) -> Self {
        let previous = target.set_sync(on);
        let accumulating = Some(target.set_accumulating(accumulating));
        SyncGuard {
            target,
            previous,
            accumulating,
        }
    }

    /// The setting that will be restored.
    pub fn previous(&self) -> bool {
        self.previous
    }
}

impl<S: GradSync + ?Sized> Deref for SyncGuard<'_, S> {
    type Target = S;
    fn deref(&self) -> &S {
        self.target
    }
}

impl<S: GradSync + ?Sized> DerefMut for SyncGuard<'_, S> {
    fn deref_mut(&mut self) -> &mut S {
        self.target
    }
}

impl<S: GradSync + ?Sized> Drop for SyncGuard<'_, S> {
    fn drop(&mut self) {
        if let Some(accumulating) = self.accumulating {
            self.target.set_accumulating(accumulating);
        }
        self.target.set_sync(self.previous);
    }
}

/// Switches synchronisation off until the returned guard is dropped (DDP's `no_sync`).
pub fn no_sync<S: GradSync + ?Sized>(target: &mut S) -> SyncGuard<'_, S> {
    SyncGuard::new(target, false)
}

/// Runs `f` with synchronisation off, then restores the previous setting, also if `f`
/// panics.
pub fn with_no_sync<S: GradSync + ?Sized, R>(target: &mut S, f: impl FnOnce(&mut S) -> R) -> R {
    let mut guard = no_sync(target);
    f(&mut guard)
}

//! The synchronisation primitives of the thread backend and of work handles: `std::sync`,
//! or loom's models of them under `cfg(loom)`, so the loom tests (`cargo xtask loom`)
//! explore every interleaving of the rendezvous and of work completion.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU64, Ordering};
#[cfg(loom)]
pub(crate) use loom::sync::{Arc, Condvar, Mutex, MutexGuard};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::{Arc, Condvar, Mutex, MutexGuard};

//! The signals `launch` forwards, caught into a flag that the supervising loop (and the
//! wait for a token file) polls.

use std::io;
use std::sync::atomic::{AtomicI32, Ordering};

/// The last signal caught and not yet taken, or 0.
static CAUGHT: AtomicI32 = AtomicI32::new(0);

/// Only stores into a lock-free atomic: async-signal-safe.
extern "C" fn on_signal(signal: libc::c_int) {
    CAUGHT.store(signal, Ordering::SeqCst);
}

/// Catches SIGTERM and SIGINT from now on.
pub(crate) fn catch() -> io::Result<()> {
    for signal in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: an all-zero `sigaction` is a valid value of the plain C struct
        // (no handler, empty flags); the fields that matter are set below.
        let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
        action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        action.sa_flags = libc::SA_RESTART;
        // SAFETY: `action.sa_mask` is a valid, exclusively borrowed `sigset_t`.
        unsafe { libc::sigemptyset(&mut action.sa_mask) };
        // SAFETY: `action` is initialised and outlives the call; the old action is
        // not asked for (null). The handler only stores into an atomic, which is
        // async-signal-safe, and runs on whatever thread takes the signal.
        if unsafe { libc::sigaction(signal, &action, std::ptr::null_mut()) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// The signal caught since the last call, if any.
pub(crate) fn take() -> Option<i32> {
    match CAUGHT.swap(0, Ordering::SeqCst) {
        0 => None,
        signal => Some(signal),
    }
}

/// The signal's name, for messages.
pub(crate) fn name(signal: i32) -> String {
    match signal {
        libc::SIGTERM => "SIGTERM".into(),
        libc::SIGINT => "SIGINT".into(),
        libc::SIGKILL => "SIGKILL".into(),
        other => format!("signal {other}"),
    }
}

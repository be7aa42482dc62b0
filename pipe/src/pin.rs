//! Pinning a worker thread to a CPU core (Linux `sched_setaffinity`; elsewhere a no-op).
//!
//! Pinning keeps each partition's worker on its own core, so two partitions on a 2-core
//! machine do not migrate onto one core and serialise. It is best effort only where the OS
//! has no affinity call; on Linux a failure (a core the process may not use) is an error.

use crate::error::Error;

/// Pins the calling thread to `core`.
#[cfg(target_os = "linux")]
pub(crate) fn pin_current_thread(core: usize) -> Result<(), Error> {
    let setsize = libc::CPU_SETSIZE as usize;
    if core >= setsize {
        return Err(Error::Pin {
            core,
            source: std::io::Error::from_raw_os_error(libc::EINVAL),
        });
    }
    // SAFETY: `set` is a plain bit array owned by this frame; all-zero bytes are a valid
    // (empty) cpu_set_t. CPU_SET writes bit `core`, which is below CPU_SETSIZE (checked
    // above), so it stays inside `set`. sched_setaffinity(0, ..) reads exactly
    // size_of::<cpu_set_t>() bytes from `&set` during the call and keeps no pointer to it,
    // on success and on failure alike; pid 0 names the calling thread only.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(core, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(Error::Pin {
            core,
            source: std::io::Error::last_os_error(),
        })
    }
}

/// Pins the calling thread to `core`: a no-op where the OS has no affinity call here.
#[cfg(not(target_os = "linux"))]
pub(crate) fn pin_current_thread(_core: usize) -> Result<(), Error> {
    Ok(())
}

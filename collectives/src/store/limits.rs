//! What a store's server may hold: its configurable limits, the statistics that show
//! them kept, and the meter that bounds the bytes it holds.

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::{Error, Result};

/// The bounds a store's server keeps, so that clients, well behaved or not, cannot
/// exhaust its host.
///
/// Start from [`StoreLimits::default`] and change fields:
///
/// ```
/// use std::time::Duration;
/// use collectives::store::StoreLimits;
///
/// let mut limits = StoreLimits::default();
/// limits.max_connections = 64;
/// limits.idle_timeout = Duration::from_secs(30);
/// assert_eq!(limits.max_bytes, 256 << 20);
/// ```
///
/// The server checks them when it starts: a zero limit, or fewer connections than the
/// world has ranks, is [`Error::InvalidArgument`] naming the field.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoreLimits {
    /// The most connections open at once, greeted or not, each with its own thread on
    /// the server (the server's own client holds one). One more is answered "busy" and
    /// closed; clients retry until their timeout. Default 1024.
    pub max_connections: usize,
    /// How long a connection may send nothing between requests before the server closes
    /// it. Clients reconnect on their own when they next send a request, so this only
    /// frees the threads of clients that went quiet or away. Default 2 minutes.
    pub idle_timeout: Duration,
    /// How long a new connection has to deliver its hello, and a request to arrive in
    /// full once its first byte has. Default 10 s.
    pub read_timeout: Duration,
    /// How long the server spends writing one reply, all of it, before it gives up on
    /// the client and closes the connection. Default 10 s.
    pub reply_timeout: Duration,
    /// The bytes the server holds at once: stored keys and values (each with a small
    /// fixed overhead, [`ENTRY_OVERHEAD`] bytes) and requests being read or handled. A
    /// request that would pass it is refused with [`Error::StoreQuota`] and the
    /// connection stays usable. Replacing a value needs room for both while the old one
    /// is still held. Default 256 MiB.
    pub max_bytes: usize,
    /// How long dropping the server waits for the replies it is writing before it cuts
    /// their connections, and, after the job failed, for the ranks that have not asked
    /// to join yet (so that a rank starting late is told why). Default 2 s.
    pub shutdown_grace: Duration,
}

/// The bytes each stored key counts for beyond its key and value, in
/// [`StoreLimits::max_bytes`]: about what the server's map spends on an entry.
pub const ENTRY_OVERHEAD: usize = 64;

impl Default for StoreLimits {
    fn default() -> Self {
        StoreLimits {
            max_connections: 1024,
            idle_timeout: Duration::from_secs(120),
            read_timeout: Duration::from_secs(10),
            reply_timeout: Duration::from_secs(10),
            max_bytes: 256 << 20,
            shutdown_grace: Duration::from_secs(2),
        }
    }
}

impl StoreLimits {
    /// The defaults, with room for `world_size` ranks: at least two connections per
    /// rank, so that every rank may hold a second store value or reconnect.
    pub fn for_world_size(world_size: usize) -> Self {
        let defaults = StoreLimits::default();
        StoreLimits {
            max_connections: defaults.max_connections.max(world_size.saturating_mul(2)),
            ..defaults
        }
    }

    /// Checks that every limit is usable for a world of `world_size` ranks.
    pub(super) fn validate(&self, world_size: usize) -> Result<()> {
        let zero = |name: &str| {
            Err(Error::InvalidArgument(format!(
                "store limit {name} is zero; a store needs it positive"
            )))
        };
        if self.max_connections == 0 {
            return zero("max_connections");
        }
        if self.max_bytes == 0 {
            return zero("max_bytes");
        }
        for (name, value) in [
            ("idle_timeout", self.idle_timeout),
            ("read_timeout", self.read_timeout),
            ("reply_timeout", self.reply_timeout),
            ("shutdown_grace", self.shutdown_grace),
        ] {
            if value.is_zero() {
                return zero(name);
            }
        }
        if self.max_connections < world_size {
            return Err(Error::InvalidArgument(format!(
                "store limit max_connections = {} is below the world size {world_size}: \
                 every rank holds a connection",
                self.max_connections
            )));
        }
        Ok(())
    }
}

/// A snapshot of what a store's server holds, from [`TcpStore::stats`](super::TcpStore::stats).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct StoreStats {
    /// Open connections, greeted or not; each has its own serving thread.
    pub connections: usize,
    /// Requests parked in a wait (a `get`, `wait`, `barrier` or `join` whose keys are
    /// not all there yet).
    pub waiting: usize,
    /// Keys stored.
    pub keys: usize,
    /// Bytes held, as counted against [`StoreLimits::max_bytes`].
    pub bytes_held: usize,
}

/// Counts the bytes a server holds against its limit.
pub(super) struct Meter {
    used: AtomicUsize,
    limit: usize,
}

/// A refused charge: what it needed and what was held.
#[derive(Debug, Clone, Copy)]
pub(super) struct OverQuota {
    pub(super) needed: usize,
    pub(super) held: usize,
    pub(super) limit: usize,
}

/// Bytes charged to a [`Meter`], given back when this is dropped.
pub(super) struct Charge {
    meter: Arc<Meter>,
    bytes: usize,
}

impl Meter {
    pub(super) fn new(limit: usize) -> Arc<Meter> {
        Arc::new(Meter {
            used: AtomicUsize::new(0),
            limit,
        })
    }

    pub(super) fn held(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// Charges `bytes` if they fit under the limit.
    pub(super) fn charge(self: &Arc<Self>, bytes: usize) -> std::result::Result<Charge, OverQuota> {
        let refused = |held| OverQuota {
            needed: bytes,
            held,
            limit: self.limit,
        };
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|&total| total <= self.limit)
            })
            .map_err(refused)?;
        Ok(Charge {
            meter: Arc::clone(self),
            bytes,
        })
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.meter.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// A stored value with the charge for its entry: the bytes stay counted until the last
/// reply that shares the value has been written.
pub(super) struct Stored {
    /// The value is `bytes[range]`: a value set by a request keeps the request's frame.
    bytes: Vec<u8>,
    range: Range<usize>,
    _charges: (Charge, Option<Charge>),
}

impl Stored {
    /// `bytes` stored under `key`, charged to `meter`.
    pub(super) fn new(
        meter: &Arc<Meter>,
        key: &str,
        bytes: Vec<u8>,
    ) -> std::result::Result<Stored, OverQuota> {
        let size = key
            .len()
            .saturating_add(bytes.len())
            .saturating_add(ENTRY_OVERHEAD);
        let charge = meter.charge(size)?;
        Ok(Stored {
            range: 0..bytes.len(),
            bytes,
            _charges: (charge, None),
        })
    }

    /// `frame[range]` stored under `key`: the frame is already charged (`charge`); the
    /// key's copy and the entry's overhead are charged to `meter` on top.
    pub(super) fn in_frame(
        meter: &Arc<Meter>,
        key: &str,
        frame: Vec<u8>,
        range: Range<usize>,
        charge: Charge,
    ) -> std::result::Result<Stored, OverQuota> {
        let entry = meter.charge(key.len().saturating_add(ENTRY_OVERHEAD))?;
        Ok(Stored {
            bytes: frame,
            range,
            _charges: (charge, Some(entry)),
        })
    }
}

impl AsRef<[u8]> for Stored {
    fn as_ref(&self) -> &[u8] {
        // `range` lies within `bytes` by construction; an empty slice if it ever did not.
        self.bytes.get(self.range.clone()).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_meter_refuses_what_does_not_fit_and_takes_back_what_is_dropped() {
        let meter = Meter::new(100);
        let a = meter.charge(60).expect("fits");
        let refused = meter.charge(41).err().expect("does not fit");
        assert_eq!((refused.needed, refused.held, refused.limit), (41, 60, 100));
        assert!(meter.charge(usize::MAX).is_err());
        drop(a);
        assert_eq!(meter.held(), 0);
        let _b = meter.charge(100).expect("fits once the first is back");
    }

    #[test]
    fn limits_are_checked_by_name() {
        let mut limits = StoreLimits::default();
        assert!(limits.validate(8).is_ok());
        limits.read_timeout = Duration::ZERO;
        let e = limits.validate(8).expect_err("zero read timeout");
        assert!(e.to_string().contains("read_timeout"), "{e}");
        let limits = StoreLimits {
            max_connections: 4,
            ..StoreLimits::default()
        };
        let e = limits
            .validate(8)
            .expect_err("fewer connections than ranks");
        assert!(e.to_string().contains("max_connections = 4"), "{e}");
        assert_eq!(StoreLimits::for_world_size(4096).max_connections, 8192);
        assert_eq!(StoreLimits::for_world_size(2).max_connections, 1024);
    }
}

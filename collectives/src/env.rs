//! Where this process sits in the job, read from the variables its launcher set.
//!
//! [`EnvInfo::from_env`] reads, in this order of precedence:
//!
//! | source            | rank                   | world size             | local rank                   |
//! |-------------------|------------------------|------------------------|------------------------------|
//! | torchrun, `launch`| `RANK`                 | `WORLD_SIZE`           | `LOCAL_RANK`                 |
//! | Slurm (`srun`)    | `SLURM_PROCID`         | `SLURM_NTASKS`         | `SLURM_LOCALID`              |
//! | Open MPI (`mpirun`)| `OMPI_COMM_WORLD_RANK`| `OMPI_COMM_WORLD_SIZE` | `OMPI_COMM_WORLD_LOCAL_RANK` |
//!
//! A source is chosen when its rank or world-size variable is set; then all three of its
//! variables are required. `MASTER_ADDR` and `MASTER_PORT` are read whatever the source,
//! and [`EnvInfo::connect_store`] needs them.
//!
//! # Guarantees
//! - **Bad values are named.** A missing variable is [`Error::MissingEnv`] naming it; an
//!   unparsable or inconsistent one (rank not below the world size, port 0) is
//!   [`Error::InvalidEnv`] naming it, its value and why.
//! - **Tests need no process environment.** [`EnvInfo::from_vars`] reads from any
//!   lookup function, e.g. a map.
//!
//! ```
//! use std::collections::HashMap;
//! use collectives::env::{EnvInfo, EnvSource};
//!
//! let vars = HashMap::from([("SLURM_PROCID", "3"), ("SLURM_NTASKS", "8"), ("SLURM_LOCALID", "1")]);
//! let info = EnvInfo::from_vars(|name| vars.get(name).map(|v| v.to_string()))?;
//! assert_eq!((info.rank, info.world_size, info.local_rank), (3, 8, 1));
//! assert_eq!(info.source, EnvSource::Slurm);
//! assert_eq!(info.master_addr, None);
//! # Ok::<(), collectives::Error>(())
//! ```
//!
//! # Not under torchrun
//! Being started by `torchrun` is not a goal: torchrun's agent already serves its own
//! store on `MASTER_PORT`, so our rank 0 cannot bind it. Start ranks with this crate's
//! `launch` binary (`launch -n 4 -- program args`), which sets the same variables.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs};
use std::time::Duration;

use crate::store::TcpStore;
use crate::{Error, Result};

/// Which launcher's variables an [`EnvInfo`] was read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EnvSource {
    /// `RANK`, `WORLD_SIZE`, `LOCAL_RANK`: torchrun, or this crate's `launch`.
    Torchrun,
    /// `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`: a Slurm `srun` step.
    Slurm,
    /// `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_RANK`:
    /// Open MPI's `mpirun`.
    OpenMpi,
}

/// This process's place in the job and where the rendezvous store is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvInfo {
    /// This process's rank, below `world_size`.
    pub rank: usize,
    /// The number of ranks in the job, at least 1.
    pub world_size: usize,
    /// This process's rank among those on its host (selects its GPU).
    pub local_rank: usize,
    /// `MASTER_ADDR`: the host that serves the store (rank 0's), if set.
    pub master_addr: Option<String>,
    /// `MASTER_PORT`: the store's port, if set; never 0.
    pub master_port: Option<u16>,
    /// Which variables the ranks came from.
    pub source: EnvSource,
}

/// One launcher's variable names.
struct Scheme {
    source: EnvSource,
    rank: &'static str,
    world_size: &'static str,
    local_rank: &'static str,
}

/// In order of precedence.
const SCHEMES: [Scheme; 3] = [
    Scheme {
        source: EnvSource::Torchrun,
        rank: "RANK",
        world_size: "WORLD_SIZE",
        local_rank: "LOCAL_RANK",
    },
    Scheme {
        source: EnvSource::Slurm,
        rank: "SLURM_PROCID",
        world_size: "SLURM_NTASKS",
        local_rank: "SLURM_LOCALID",
    },
    Scheme {
        source: EnvSource::OpenMpi,
        rank: "OMPI_COMM_WORLD_RANK",
        world_size: "OMPI_COMM_WORLD_SIZE",
        local_rank: "OMPI_COMM_WORLD_LOCAL_RANK",
    },
];

impl EnvInfo {
    /// Reads the process environment; see the [module docs](self) for the variables.
    pub fn from_env() -> Result<EnvInfo> {
        // A value that is not UTF-8 is kept, lossily, so that it fails validation by name.
        EnvInfo::from_vars(|name| {
            std::env::var_os(name).map(|value| value.to_string_lossy().into_owned())
        })
    }

    /// Reads the variables through `var` (`None` for an unset variable), so that tests
    /// need not touch the process environment.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<EnvInfo> {
        let scheme = SCHEMES
            .iter()
            .find(|s| var(s.rank).is_some() || var(s.world_size).is_some())
            .ok_or_else(|| Error::MissingEnv(SCHEMES[0].rank.into()))?;
        let number = |name: &str| -> Result<usize> {
            let value = var(name).ok_or_else(|| Error::MissingEnv(name.into()))?;
            value
                .trim()
                .parse()
                .map_err(|_| invalid(name, &value, "not a non-negative integer"))
        };
        let rank = number(scheme.rank)?;
        let world_size = number(scheme.world_size)?;
        let local_rank = number(scheme.local_rank)?;
        if world_size == 0 {
            return Err(invalid(
                scheme.world_size,
                "0",
                "a job has at least one rank",
            ));
        }
        if rank >= world_size {
            let why = format!("not below {}={world_size}", scheme.world_size);
            return Err(invalid(scheme.rank, &rank.to_string(), &why));
        }
        if local_rank >= world_size {
            let why = format!("not below {}={world_size}", scheme.world_size);
            return Err(invalid(scheme.local_rank, &local_rank.to_string(), &why));
        }
        let master_addr = match var("MASTER_ADDR") {
            Some(addr) if addr.trim().is_empty() => {
                return Err(invalid("MASTER_ADDR", &addr, "empty"));
            }
            addr => addr.map(|addr| addr.trim().to_owned()),
        };
        let master_port = match var("MASTER_PORT") {
            None => None,
            Some(value) => match value.trim().parse::<u16>() {
                Ok(0) => return Err(invalid("MASTER_PORT", &value, "port 0 cannot be shared")),
                Ok(port) => Some(port),
                Err(_) => return Err(invalid("MASTER_PORT", &value, "not a port (1 to 65535)")),
            },
        };
        Ok(EnvInfo {
            rank,
            world_size,
            local_rank,
            master_addr,
            master_port,
            source: scheme.source,
        })
    }

    /// Connects to the rendezvous store: rank 0 serves it on `MASTER_ADDR:MASTER_PORT`,
    /// the others connect there, retrying until `timeout` (so they may start first).
    ///
    /// Rank 0 binds the address `MASTER_ADDR` resolves to when that is a loopback
    /// address (a single-host job), and all interfaces otherwise, as PyTorch's store
    /// does: a host name can resolve, on its own host, to an address other hosts cannot
    /// reach. Without `MASTER_ADDR` or `MASTER_PORT` this is [`Error::MissingEnv`].
    pub fn connect_store(&self, timeout: Duration) -> Result<TcpStore> {
        let host = self
            .master_addr
            .as_deref()
            .ok_or_else(|| Error::MissingEnv("MASTER_ADDR".into()))?;
        let port = self
            .master_port
            .ok_or_else(|| Error::MissingEnv("MASTER_PORT".into()))?;
        if self.rank != 0 {
            return TcpStore::client(host, port, timeout);
        }
        let resolved: Vec<SocketAddr> = (host, port)
            .to_socket_addrs()
            .map_err(|e| Error::io(format!("resolving MASTER_ADDR={host}"), e))?
            .collect();
        let bind = match resolved.first() {
            None => return Err(invalid("MASTER_ADDR", host, "resolves to no address")),
            Some(_) if resolved.iter().all(|a| a.ip().is_loopback()) => resolved,
            Some(first) if first.is_ipv6() => vec![(Ipv6Addr::UNSPECIFIED, port).into()],
            Some(_) => vec![(Ipv4Addr::UNSPECIFIED, port).into()],
        };
        TcpStore::server(&bind[..], self.world_size, timeout)
    }
}

fn invalid(name: &str, value: &str, why: &str) -> Error {
    Error::InvalidEnv {
        name: name.into(),
        value: value.into(),
        why: why.into(),
    }
}

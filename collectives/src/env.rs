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
//! and [`EnvInfo::connect_store`] needs them. `LOWRANK_STORE_TOKEN`
//! ([`TOKEN_ENV`]), when set, is the secret the store's clients
//! must present; `launch` sets it for its ranks. Without it, rank 0 serves only a
//! loopback `MASTER_ADDR`, unless `LOWRANK_STORE_INSECURE=1`
//! ([`INSECURE_ENV`](crate::store::INSECURE_ENV)).
//!
//! # Guarantees
//! - **Bad values are named.** A missing variable is [`Error::MissingEnv`] naming it; an
//!   unparsable or inconsistent one (rank not below the world size, a world size above
//!   [`MAX_WORLD_SIZE`], port 0, a token too short) is [`Error::InvalidEnv`] naming it,
//!   its value (never a token's) and why; nothing is allocated for the ranks before.
//! - **Rendezvous mistakes are caught at connect.** [`EnvInfo::connect_store`] joins the
//!   store ([`TcpStore::join`]): two processes with one `RANK`, or ranks that disagree on
//!   `WORLD_SIZE`, fail on every rank with [`Error::Rendezvous`] naming the ranks; a rank
//!   that never starts is named on every rank when the rendezvous times out.
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
//! # Under torchrun
//! A binary runs unchanged under `torchrun` (`torchrun --no-python --nproc-per-node 4
//! program args`) as under this crate's `launch`. torchrun's elastic agent already
//! serves a PyTorch c10d `TCPStore` at `MASTER_ADDR:MASTER_PORT` and says so with
//! `TORCHELASTIC_USE_AGENT_STORE=True`; then [`EnvInfo::connect_store`] makes every
//! rank, rank 0 included, a client of that store ([`TcpStore::torch_client`]) and joins
//! there, as torch's own `env://` rendezvous makes every rank a client of it. The keys go
//! under the prefix [`EnvInfo::store_prefix`], `worker/attempt_{TORCHELASTIC_RESTART_COUNT}`:
//! the agent keeps its store across restarts of the workers, so each attempt joins
//! afresh. **Not covered:** an elastic membership change (`--nnodes MIN:MAX`, a node
//! joining or leaving) restarts the workers without counting a restart, so the new
//! round meets the old round's keys and its join fails on every rank (naming a rank
//! "claimed by two processes") instead of succeeding; fixed-size jobs, with or without
//! `--max-restarts`, are what this supports. (torch 2.15's own workers use no such prefix; their process group's keys go
//! under `default_pg/`.) The agent's other variables are read too:
//! `TORCHELASTIC_RESTART_COUNT`, `TORCHELASTIC_MAX_RESTARTS`, `TORCHELASTIC_RUN_ID`,
//! `GROUP_RANK`, `GROUP_WORLD_SIZE` and `LOCAL_WORLD_SIZE` (on one node,
//! `GROUP_WORLD_SIZE=1`, a `WORLD_SIZE` other than `LOCAL_WORLD_SIZE` is
//! [`Error::InvalidEnv`] at once; across nodes, ranks that disagree on it fail the join
//! by name). torch's store checks no token, so
//! `LOWRANK_STORE_TOKEN` with the agent's store is [`Error::InvalidEnv`] rather than a
//! silent loss of the token's protection. Without `TORCHELASTIC_USE_AGENT_STORE=True`
//! (this crate's `launch`, a plain `env://` setup, torchrun with
//! `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`) rank 0 serves this crate's store as before.

use std::io;
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::time::Duration;

use crate::store::{
    check_bind, escape_for_log, StoreLimits, StoreOptions, StoreToken, TcpStore, MAX_WORLD_SIZE,
    TOKEN_ENV,
};
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
    /// `LOWRANK_STORE_TOKEN`: the secret the store's clients present, if set.
    pub token: Option<StoreToken>,
    /// `TORCHELASTIC_USE_AGENT_STORE=True` (exactly, as torch compares it): torchrun's
    /// agent serves a PyTorch store at `MASTER_ADDR:MASTER_PORT`, which
    /// [`connect_store`](Self::connect_store) then joins as a client on every rank.
    pub agent_store: bool,
    /// `TORCHELASTIC_RESTART_COUNT`: how many times torchrun has restarted the workers
    /// (0 when unset); it names the store prefix of this attempt.
    pub restart_count: u32,
    /// `TORCHELASTIC_MAX_RESTARTS`: how many restarts torchrun allows, if set.
    pub max_restarts: Option<u32>,
    /// `TORCHELASTIC_RUN_ID`: torchrun's rendezvous id of the job, if set.
    pub run_id: Option<String>,
    /// `GROUP_RANK`: the rank of this process's agent (its node), if set.
    pub group_rank: Option<usize>,
    /// `GROUP_WORLD_SIZE`: the number of agents (nodes), if set.
    pub group_world_size: Option<usize>,
    /// `LOCAL_WORLD_SIZE`: the number of ranks on this process's node, if set; not
    /// above `world_size`.
    pub local_world_size: Option<usize>,
}

/// The variable that announces torchrun's agent store.
pub const AGENT_STORE_ENV: &str = "TORCHELASTIC_USE_AGENT_STORE";

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
            let digits = value.trim();
            match digits.parse() {
                Ok(n) => Ok(n),
                Err(_) if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) => {
                    Err(invalid(name, &value, "too large"))
                }
                Err(_) => Err(invalid(name, &value, "not a non-negative integer")),
            }
        };
        let world_size = number(scheme.world_size)?;
        if world_size == 0 {
            return Err(invalid(
                scheme.world_size,
                "0",
                "a job has at least one rank",
            ));
        }
        if world_size > MAX_WORLD_SIZE {
            let why = format!("more than the {MAX_WORLD_SIZE} ranks a job may have");
            return Err(invalid(scheme.world_size, &world_size.to_string(), &why));
        }
        let rank = number(scheme.rank)?;
        let local_rank = number(scheme.local_rank)?;
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
        let token = StoreToken::from_var(var(TOKEN_ENV))?;
        let optional = |name: &str| -> Result<Option<usize>> {
            match var(name) {
                None => Ok(None),
                Some(_) => number(name).map(Some),
            }
        };
        let small = |name: &str| -> Result<Option<u32>> {
            match optional(name)? {
                None => Ok(None),
                Some(n) => u32::try_from(n)
                    .map(Some)
                    .map_err(|_| invalid(name, &n.to_string(), "too large")),
            }
        };
        let agent_store = var(AGENT_STORE_ENV).as_deref() == Some("True");
        let restart_count = small("TORCHELASTIC_RESTART_COUNT")?.unwrap_or(0);
        let max_restarts = small("TORCHELASTIC_MAX_RESTARTS")?;
        let run_id = var("TORCHELASTIC_RUN_ID");
        let group_rank = optional("GROUP_RANK")?;
        let group_world_size = optional("GROUP_WORLD_SIZE")?;
        let local_world_size = optional("LOCAL_WORLD_SIZE")?;
        if let Some(local) = local_world_size {
            if local == 0 || local > world_size {
                let why = format!("not between 1 and {}={world_size}", scheme.world_size);
                return Err(invalid("LOCAL_WORLD_SIZE", &local.to_string(), &why));
            }
            // One agent starts every rank of the job: a WORLD_SIZE of another count was
            // overridden, and its rendezvous could only time out.
            if agent_store && group_world_size == Some(1) && local != world_size {
                let why = format!(
                    "torchrun's one node runs LOCAL_WORLD_SIZE={local} ranks \
                     (GROUP_WORLD_SIZE=1): WORLD_SIZE must be {local}"
                );
                return Err(invalid(scheme.world_size, &world_size.to_string(), &why));
            }
        }
        Ok(EnvInfo {
            rank,
            world_size,
            local_rank,
            master_addr,
            master_port,
            source: scheme.source,
            token,
            agent_store,
            restart_count,
            max_restarts,
            run_id,
            group_rank,
            group_world_size,
            local_world_size,
        })
    }

    /// The key prefix of this attempt on torchrun's agent store:
    /// `worker/attempt_{restart_count}` (keys travel as `/worker/attempt_0/...`, what
    /// Python sees through `PrefixStore("worker/attempt_0", store)`).
    pub fn store_prefix(&self) -> String {
        format!("worker/attempt_{}", self.restart_count)
    }

    /// Connects to the rendezvous store and joins it: rank 0 serves it on
    /// `MASTER_ADDR:MASTER_PORT`, the others connect there, retrying until `timeout` (so
    /// they may start first); then every rank [joins](TcpStore::join), waiting up to
    /// `timeout` more for all `world_size` ranks.
    ///
    /// Rank 0 binds the address `MASTER_ADDR` names, and no other: for a job across
    /// hosts, give it an address the other hosts reach (a host name can resolve, on its
    /// own host, to a loopback address). The token, if set, is required of every client.
    /// Without one, rank 0 serves only a loopback `MASTER_ADDR` (127.0.0.0/8, `::1`,
    /// `localhost`): any other is [`Error::InvalidArgument`], before binding, saying how
    /// to set the token, unless `LOWRANK_STORE_INSECURE=1`
    /// ([`INSECURE_ENV`](crate::store::INSECURE_ENV)) opts in. A second process with
    /// `RANK=0` finds the port taken, joins the store as a client, and so fails every
    /// rank by name.
    ///
    /// Under torchrun (`TORCHELASTIC_USE_AGENT_STORE=True`, [`agent_store`](Self::agent_store))
    /// no rank serves: every rank connects to the agent's PyTorch store at
    /// `MASTER_ADDR:MASTER_PORT` ([`TcpStore::torch_client`], retrying until `timeout`),
    /// under [`store_prefix`](Self::store_prefix), and joins there; the join makes the
    /// same checks (a rank claimed twice, ranks that disagree on `WORLD_SIZE`, a rank
    /// that never comes: each named on every rank). A token is [`Error::InvalidEnv`]
    /// there, since torch's store checks none.
    ///
    /// Errors: [`Error::MissingEnv`] without `MASTER_ADDR` or `MASTER_PORT`; the store's
    /// and [`TcpStore::join`]'s errors.
    pub fn connect_store(&self, timeout: Duration) -> Result<TcpStore> {
        let host = self
            .master_addr
            .as_deref()
            .ok_or_else(|| Error::MissingEnv("MASTER_ADDR".into()))?;
        let port = self
            .master_port
            .ok_or_else(|| Error::MissingEnv("MASTER_PORT".into()))?;
        let options = StoreOptions {
            token: self.token.clone(),
            limits: StoreLimits::for_world_size(self.world_size),
            ..StoreOptions::default()
        };
        if self.agent_store {
            if self.token.is_some() {
                return Err(invalid(
                    TOKEN_ENV,
                    "<not shown>",
                    "torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE=True) checks no \
                     token; unset it, or keep the token's protection by not sharing the \
                     agent's store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)",
                ));
            }
            let store = TcpStore::torch_client(host, port, &self.store_prefix(), timeout)?;
            store.join(self.rank, self.world_size, timeout)?;
            return Ok(store);
        }
        let store = if self.rank == 0 {
            self.serve(host, port, timeout, &options)?
        } else {
            TcpStore::client_with(host, port, timeout, &options)?
        };
        store.join(self.rank, self.world_size, timeout)?;
        Ok(store)
    }

    /// Rank 0's store: served on the address `host` names, or, when another process
    /// serves that port already, a client of it.
    fn serve(
        &self,
        host: &str,
        port: u16,
        timeout: Duration,
        options: &StoreOptions,
    ) -> Result<TcpStore> {
        let shown = escape_for_log(host);
        let resolved: Vec<SocketAddr> = (host, port)
            .to_socket_addrs()
            .map_err(|e| Error::io(format!("resolving MASTER_ADDR={shown}"), e))?
            .collect();
        if resolved.is_empty() {
            return Err(invalid("MASTER_ADDR", host, "resolves to no address"));
        }
        // Before binding: a store that may not serve there holds no port.
        check_bind(&resolved, options)?;
        let context = || format!("binding the store at MASTER_ADDR={shown} MASTER_PORT={port}");
        match TcpListener::bind(&resolved[..]) {
            Ok(listener) => TcpStore::serve_on(listener, self.world_size, timeout, options),
            Err(e) if e.kind() == io::ErrorKind::AddrInUse => {
                // If this job's store holds the port, a second rank 0 is the mistake:
                // joining it as rank 0 makes the store name it on every rank. Anything
                // else there is reported as the bind error.
                let taken = Error::io(context(), e);
                let brief = timeout.min(Duration::from_secs(2));
                match TcpStore::client_with(host, port, brief, options) {
                    Ok(store) => Ok(store),
                    Err(_) => Err(taken),
                }
            }
            Err(e) => Err(Error::io(context(), e)),
        }
    }
}

fn invalid(name: &str, value: &str, why: &str) -> Error {
    Error::InvalidEnv {
        name: name.into(),
        value: value.into(),
        why: why.into(),
    }
}

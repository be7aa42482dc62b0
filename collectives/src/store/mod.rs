//! A TCP key-value store for rendezvous, like PyTorch's `TCPStore`, made for shared
//! clusters: bounded, authenticated, and strict about rendezvous mistakes.
//!
//! Rank 0 runs the server ([`TcpStore::server`]) and is itself a client of it; every
//! other rank connects with [`TcpStore::client`]. Ranks [`join`](TcpStore::join), then
//! exchange small values through it (an NCCL unique id, a port) and meet at
//! [`TcpStore::barrier`]s. [`EnvInfo::connect_store`](crate::env::EnvInfo::connect_store)
//! does the serving or connecting and the join from the launcher's variables.
//!
//! The same `TcpStore` can instead be a client of PyTorch's c10d `TCPStore`
//! ([`TcpStore::torch_client`]), the store `torchrun`'s agent serves: every method works
//! on it unchanged, [`join`](TcpStore::join) and [`barrier`](TcpStore::barrier) built on
//! torch's compare-and-set and waits, with the limits that constructor lists (no token,
//! no server-side limits or stats, failures of the job seen by joins and barriers only).
//! Everything below describes this crate's own store unless it says otherwise.
//!
//! # Guarantees
//! - **Every blocking call is bounded.** [`get`](TcpStore::get), [`wait`](TcpStore::wait),
//!   [`barrier`](TcpStore::barrier), [`join`](TcpStore::join) and connecting return
//!   [`Error::Timeout`] when their timeout passes; a server that stops answering is a
//!   timeout too, never a hang.
//! - **Clients may start first.** [`TcpStore::client`] retries until its timeout, so a
//!   rank that starts before rank 0 has bound the port still joins.
//! - **The server's resources are bounded** by its [`StoreLimits`]: a cap on connections
//!   (one more is told "busy"; clients retry), a deadline for the hello and for each
//!   request once it starts, an idle timeout (clients reconnect on their own), a deadline
//!   for each reply as a whole, and a cap on the bytes held, keys, values and requests in
//!   flight together ([`Error::StoreQuota`]). A wait ends when its client disconnects.
//!   [`TcpStore::stats`] shows what the server holds.
//! - **No request is served before the hello**, and with a [`StoreToken`] none before a
//!   hello carrying it ([`Error::Unauthorized`] otherwise); a client with a token also
//!   refuses a server that does not check one.
//! - **Only loopback without a token.** A server on any other address (`0.0.0.0`, a
//!   host's own address) needs a token, or an explicit opt-in
//!   ([`StoreOptions::allow_insecure_bind`], [`INSECURE_ENV`]`=1`); otherwise it does not
//!   start ([`Error::InvalidArgument`], saying how to set a token).
//! - **A malformed join fails only its sender.** A join whose rank is not below its
//!   own world size, or whose world size is 0 or above [`MAX_WORLD_SIZE`], is answered
//!   [`Error::InvalidArgument`] before it touches the rendezvous.
//! - **Peer text cannot forge a log line.** Keys and names are quoted with [`Quoted`],
//!   and text a peer sends (a failure it reports, a server's message) is shown through
//!   [`escape_for_log`]: no control character or bidirectional override reaches an
//!   error message or a log line raw.
//! - **Rendezvous mistakes fail every rank, by name.** [`join`](TcpStore::join) registers
//!   a rank with set-if-absent and compares world sizes: a rank claimed by two processes,
//!   or ranks that disagree on the world size, is [`Error::Rendezvous`] naming the ranks
//!   on every rank still in the rendezvous, and on the others at their next request.
//!   A failed server serves on after it is dropped, for its grace period, until every
//!   rank has asked to join, so a rank that starts late is told too.
//! - **A missing rank is named on every rank.** A join or barrier that times out lists,
//!   in [`Error::Timeout::missing`](Error::Timeout), the ranks that never arrived, and
//!   hands the same error to every other rank's pending and later requests.
//! - **Dropping the server stops it promptly.** Requests it is already handling are
//!   answered (so rank 0 may leave right after a final barrier) within
//!   [`StoreLimits::shutdown_grace`]; then every connection is cut, its threads are
//!   joined, and clients' other pending and later operations fail with [`Error::Io`].
//!   After a failure of the job (above), the server first serves on, for the grace
//!   period at most, until every client has left, so that each rank's next request is
//!   answered with the failure rather than a closed connection.
//! - **A broken peer is an error value.** A malformed message is [`Error::Protocol`], a
//!   lost connection [`Error::Io`]; after either, that client's connection is unusable and
//!   says so.
//!
//! ```
//! use std::time::Duration;
//! use collectives::store::{StoreOptions, StoreToken, TcpStore};
//!
//! let timeout = Duration::from_secs(5);
//! let mut options = StoreOptions::default();
//! options.token = Some(StoreToken::generate()?);
//! let server = TcpStore::server_with(("127.0.0.1", 0), 2, timeout, &options)?;
//! let client = TcpStore::client_with("127.0.0.1", server.port(), timeout, &options)?;
//! client.set("nccl_id", b"\x01\x02")?;
//! assert_eq!(server.get("nccl_id")?, b"\x01\x02");
//! assert_eq!(server.add("count", 2)?, 2);
//! assert_eq!(client.add("count", 1)?, 3);
//! // Without the token, nothing is served.
//! let refused = TcpStore::client("127.0.0.1", server.port(), timeout);
//! assert!(matches!(refused, Err(collectives::Error::Unauthorized(_))));
//! # Ok::<(), collectives::Error>(())
//! ```
//!
//! The protocol is private: each message is a 4-byte big-endian length and a payload, one
//! request and one reply at a time per connection, the hello first. Waits happen on the
//! server (a condition variable with a deadline), so a waiting client costs no traffic.
//! The token travels in the clear: it keeps out other users of a shared host or network,
//! not someone who can read the job's traffic.

mod bind;
mod client;
mod codec;
mod escape;
mod frame;
mod limits;
mod server;
mod state;
mod token;
mod torch;
mod torch_join;
mod torch_wire;

use std::collections::HashSet;
use std::fmt;
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::{Error, Result};

use client::Client;
use codec::{Failure, Request, Response};
use escape::quoted_list;
use server::Server;
use state::join_key;
use torch::TorchClient;

pub(crate) use bind::check_bind;
pub use bind::INSECURE_ENV;
pub use escape::{escape_for_log, EscapedForLog, Quoted};
pub use limits::{StoreLimits, StoreStats, ENTRY_OVERHEAD};
pub use token::{StoreToken, MAX_TOKEN_LEN, MIN_TOKEN_LEN, TOKEN_ENV};
pub use torch::{MAX_KEYS as TORCH_MAX_KEYS, MAX_VALUE_LEN as TORCH_MAX_VALUE_LEN};
pub use torch_wire::MAX_KEY_LEN as TORCH_MAX_KEY_LEN;

/// The largest world size a store, a join, a barrier or the environment accepts: far
/// above any job run today, and small enough that a barrier's list of keys fits in one
/// request. Larger is [`Error::InvalidArgument`] (or [`Error::InvalidEnv`]), checked
/// before anything is allocated for the ranks.
pub const MAX_WORLD_SIZE: usize = 1 << 20;

/// How a store is served or joined: the shared token, the server's limits, and whether
/// it may serve a non-loopback address without a token.
///
/// ```
/// use collectives::store::{StoreLimits, StoreOptions};
///
/// let mut options = StoreOptions::default();
/// options.limits = StoreLimits::for_world_size(4096);
/// assert_eq!(options.limits.max_connections, 8192);
/// assert!(options.token.is_none() && !options.allow_insecure_bind);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoreOptions {
    /// The secret every client must present in its hello. `None`: the server accepts
    /// any client that reaches it, and a client refuses a server that checks none only
    /// when it has a token itself.
    pub token: Option<StoreToken>,
    /// The server's limits; a client ignores them.
    pub limits: StoreLimits,
    /// Lets a server without a token serve a non-loopback address (`0.0.0.0`, a host's
    /// own address), where anyone who reaches it may join: the opt-in in code that
    /// [`INSECURE_ENV`]`=1` is in the environment. Off by default; a client ignores it.
    pub allow_insecure_bind: bool,
}

/// A client of a TCP key-value store, and on rank 0 also its server; or a client of
/// PyTorch's c10d `TCPStore` ([`torch_client`](Self::torch_client)), such as the one
/// `torchrun`'s agent serves.
///
/// `TcpStore` is `Send + Sync`; threads may share one, their requests take turns on its
/// single connection.
pub struct TcpStore {
    backend: Backend,
    timeout: Duration,
    /// Tells the server that a second join of a rank from this value is no second process.
    join_id: String,
    /// On a torch store, which does not know it: the world size of the last join (0
    /// before).
    joined_world_size: AtomicUsize,
}

/// Whose protocol the store speaks.
enum Backend {
    /// This crate's store; rank 0 also serves it.
    Own {
        // Declared before `server` so that our own connection closes before the server
        // stops.
        client: Client,
        server: Option<Server>,
    },
    /// PyTorch's c10d `TCPStore` (`torch.rs`); join and barrier are built on its
    /// primitives (`torch_join.rs`).
    Torch(TorchClient),
}

impl TcpStore {
    /// Binds `addr`, serves the store from background threads, and connects to it; no
    /// token (so `addr` must be a loopback address, unless [`INSECURE_ENV`]`=1`), and
    /// the default limits with room for `world_size` ranks
    /// ([`StoreLimits::for_world_size`]). See [`server_with`](Self::server_with).
    pub fn server(addr: impl ToSocketAddrs, world_size: usize, timeout: Duration) -> Result<Self> {
        let options = StoreOptions {
            limits: StoreLimits::for_world_size(world_size),
            ..StoreOptions::default()
        };
        TcpStore::server_with(addr, world_size, timeout, &options)
    }

    /// Binds `addr`, serves the store from background threads with `options`' token and
    /// limits, and connects to it.
    ///
    /// Port 0 picks a free port; [`port`](Self::port) tells which. `world_size` is the
    /// number of ranks the job has (1 to [`MAX_WORLD_SIZE`]); clients learn it when they
    /// connect. `timeout` bounds every operation of the returned store that does not
    /// take its own. A bad world size or limit is [`Error::InvalidArgument`].
    ///
    /// Without a token, only loopback addresses (127.0.0.0/8, `::1`, `localhost`) are
    /// served: any other address, `0.0.0.0` included, is [`Error::InvalidArgument`]
    /// (checked before binding, the message says how to set a token) unless
    /// [`StoreOptions::allow_insecure_bind`] or [`INSECURE_ENV`]`=1` opts in.
    pub fn server_with(
        addr: impl ToSocketAddrs,
        world_size: usize,
        timeout: Duration,
        options: &StoreOptions,
    ) -> Result<Self> {
        check_world_size(world_size)?;
        options.limits.validate(world_size)?;
        let addrs: Vec<SocketAddr> = addr
            .to_socket_addrs()
            .map_err(|e| Error::io("resolving the store's address", e))?
            .collect();
        check_bind(&addrs, options)?;
        let listener =
            TcpListener::bind(&addrs[..]).map_err(|e| Error::io("binding the store", e))?;
        TcpStore::serve_on(listener, world_size, timeout, options)
    }

    /// Serves the store on a bound `listener`; see [`server_with`](Self::server_with).
    /// The caller has checked the bind rule ([`check_bind`]) before binding.
    pub(crate) fn serve_on(
        listener: TcpListener,
        world_size: usize,
        timeout: Duration,
        options: &StoreOptions,
    ) -> Result<Self> {
        check_world_size(world_size)?;
        options.limits.validate(world_size)?;
        let server = Server::start(
            listener,
            world_size,
            options.token.clone(),
            options.limits.clone(),
        )?;
        let client = Client::connect(
            &server.addr.to_string(),
            server.addr,
            timeout,
            options.token.clone(),
        )?;
        Ok(TcpStore::with_backend(
            Backend::Own {
                client,
                server: Some(server),
            },
            timeout,
        ))
    }

    /// Connects to the store served at `host:port` without a token, retrying until
    /// `timeout` passes. See [`client_with`](Self::client_with).
    pub fn client(host: &str, port: u16, timeout: Duration) -> Result<Self> {
        TcpStore::client_with(host, port, timeout, &StoreOptions::default())
    }

    /// Connects to the store served at `host:port`, presenting `options`' token, retrying
    /// until `timeout` passes.
    ///
    /// The server need not exist yet: refused connections, and a server at its
    /// connection limit, are retried with a short back-off. A peer that answers but is
    /// not a store is [`Error::Protocol`]; a server that refuses the token, or checks
    /// none while this client has one, is [`Error::Unauthorized`]; no answer in time is
    /// [`Error::Timeout`].
    pub fn client_with(
        host: &str,
        port: u16,
        timeout: Duration,
        options: &StoreOptions,
    ) -> Result<Self> {
        // The host is shown in errors: escaped, as a caller may pass anything.
        let name = format!("{}:{port}", escape_for_log(host));
        let client = Client::connect(&name, (host, port), timeout, options.token.clone())?;
        Ok(TcpStore::with_backend(
            Backend::Own {
                client,
                server: None,
            },
            timeout,
        ))
    }

    /// Connects to PyTorch's c10d `TCPStore` served at `host:port` (by `torchrun`'s
    /// elastic agent, or by `torch.distributed.TCPStore(..., is_master=True)`), retrying
    /// until `timeout` passes, since the server may not be up yet.
    ///
    /// Every key is sent as torch's Python `TCPStore` sends it, after a `/`, and with a
    /// non-empty `prefix` as `PrefixStore(prefix, store)` does: key `k` travels as
    /// `/{prefix}/k`, so Python code sees this store's keys through that `PrefixStore`.
    /// Every operation works as on our own store, within these limits of torch's
    /// protocol: no token (it has none, the server accepts anyone who reaches it); a key
    /// with its prefix longer than [`TORCH_MAX_KEY_LEN`] bytes is
    /// [`Error::InvalidArgument`]; [`add`](Self::add) stores torch's decimal text too but
    /// wraps on overflow, and on a key holding no integer the server closes the
    /// connection ([`Error::Io`]); [`join`](Self::join) and [`barrier`](Self::barrier)
    /// are built on compare-and-set and waits, and a rank that fails them publishes the
    /// failure, which the other ranks' joins and barriers report within a fraction of a
    /// second (their other operations do not look for it).
    ///
    /// A peer that answers but not as a torch store (the ping's echo is wrong) is
    /// [`Error::Protocol`]; no answer in time is [`Error::Timeout`]. After a lost
    /// connection or a malformed reply the store is unusable and says so.
    pub fn torch_client(host: &str, port: u16, prefix: &str, timeout: Duration) -> Result<Self> {
        let name = format!("{}:{port}", escape_for_log(host));
        let client = TorchClient::connect(&name, (host, port), prefix, timeout)?;
        Ok(TcpStore::with_backend(Backend::Torch(client), timeout))
    }

    fn with_backend(backend: Backend, timeout: Duration) -> TcpStore {
        TcpStore {
            backend,
            timeout,
            join_id: token::join_id(),
            joined_world_size: AtomicUsize::new(0),
        }
    }

    /// Whether this is a client of a PyTorch store ([`torch_client`](Self::torch_client)).
    pub fn is_torch(&self) -> bool {
        matches!(self.backend, Backend::Torch(_))
    }

    /// The key prefix of a torch store's client (empty for none); `None` for our own
    /// store, which prefixes nothing.
    pub fn key_prefix(&self) -> Option<&str> {
        match &self.backend {
            Backend::Torch(torch) => Some(&torch.prefix),
            Backend::Own { .. } => None,
        }
    }

    /// The address this store's connection goes to (for the server, a loopback address
    /// when it is bound to all interfaces).
    pub fn addr(&self) -> SocketAddr {
        match &self.backend {
            Backend::Own { client, .. } => client.addr,
            Backend::Torch(torch) => torch.addr,
        }
    }

    /// The server's port.
    pub fn port(&self) -> u16 {
        self.addr().port()
    }

    /// Whether this value runs the server (never for a torch store's client).
    pub fn is_server(&self) -> bool {
        matches!(
            self.backend,
            Backend::Own {
                server: Some(_),
                ..
            }
        )
    }

    /// The job's number of ranks, as given to [`server`](Self::server). A torch store
    /// does not know it: there, the world size of this value's last successful
    /// [`join`](Self::join), 0 before.
    pub fn world_size(&self) -> usize {
        match &self.backend {
            Backend::Own { client, .. } => client.world_size,
            Backend::Torch(_) => self.joined_world_size.load(Ordering::Relaxed),
        }
    }

    /// The timeout of operations that take none of their own.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// What the server holds now (connections, parked waits, keys, bytes); `None` for a
    /// client, which cannot see it, a torch store's included.
    pub fn stats(&self) -> Option<StoreStats> {
        match &self.backend {
            Backend::Own { server, .. } => server.as_ref().map(Server::stats),
            Backend::Torch(_) => None,
        }
    }

    /// The number of keys the whole server holds, every prefix's: torch's `num_keys`.
    /// Our own server does not count them for clients: [`Error::Unsupported`] there
    /// (rank 0 has [`stats`](Self::stats)).
    pub fn num_keys(&self) -> Result<i64> {
        match &self.backend {
            Backend::Torch(torch) => torch.num_keys(),
            Backend::Own { .. } => Err(Error::Unsupported(
                "num_keys on this crate's store (rank 0 has TcpStore::stats)".into(),
            )),
        }
    }

    /// Sets `key` to `value`, replacing any value it had, and wakes its waiters.
    ///
    /// A request larger than 64 MiB is [`Error::InvalidArgument`]; one the server has no
    /// room for, [`Error::StoreQuota`].
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        if let Backend::Torch(torch) = &self.backend {
            return torch.set(key, value);
        }
        match self.call("set", &Request::Set { key, value }, Duration::ZERO)? {
            Response::Unit => Ok(()),
            other => Err(unexpected("set", &other)),
        }
    }

    /// Sets `key` to `value` only if it does not exist, atomically; returns the value it
    /// already had (and then leaves it), or `None` when this call set it.
    ///
    /// On a torch store this is compare-and-set from the empty value, so a key that
    /// holds the empty value is replaced, and one that already holds `value` reads as
    /// set by this call (torch's reply cannot tell the two apart).
    pub fn set_if_absent(&self, key: &str, value: &[u8]) -> Result<Option<Vec<u8>>> {
        if let Backend::Torch(torch) = &self.backend {
            let now = torch.compare_set(key, b"", value)?;
            return Ok((now != value).then_some(now));
        }
        match self.call(
            "set_if_absent",
            &Request::SetIfAbsent { key, value },
            Duration::ZERO,
        )? {
            Response::Unit => Ok(None),
            Response::Value(existing) => Ok(Some((*existing).as_ref().to_vec())),
            other => Err(unexpected("set_if_absent", &other)),
        }
    }

    /// The value of `key`, waiting up to the store's timeout for some rank to set it.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        let timeout = self.timeout;
        if let Backend::Torch(torch) = &self.backend {
            let mut values = torch.get_many(&[key], timeout)?;
            return values
                .pop()
                .ok_or_else(|| Error::Protocol("the torch store sent no value".into()));
        }
        match self.call("get", &Request::Get { key, timeout }, timeout)? {
            Response::Value(value) => Ok((*value).as_ref().to_vec()),
            Response::TimedOut(_) => Err(Error::Timeout {
                what: format!("store get of key {}", Quoted(key)),
                after: timeout,
                missing: Vec::new(),
            }),
            other => Err(unexpected("get", &other)),
        }
    }

    /// Waits until every key in `keys` exists, up to `timeout`; the error names the keys
    /// still missing (on a torch store, the keys waited for: its protocol does not say
    /// which are missing). An empty `keys` is satisfied at once.
    pub fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        if let Backend::Torch(torch) = &self.backend {
            // Torch's wait tells nothing of which keys are missing; asking would cost a
            // request per key.
            if torch.wait_for(keys, timeout)? {
                return Ok(());
            }
            return Err(Error::Timeout {
                what: format!(
                    "torch store wait for keys {} (some still missing)",
                    quoted_list(keys)
                ),
                after: timeout,
                missing: Vec::new(),
            });
        }
        let missing = self.missing_after(None, keys, timeout)?;
        if missing.is_empty() {
            return Ok(());
        }
        Err(Error::Timeout {
            what: format!(
                "store wait for keys {} (still missing: {})",
                quoted_list(keys),
                quoted_list(&missing)
            ),
            after: timeout,
            missing: Vec::new(),
        })
    }

    /// Atomically adds `delta` to the integer under `key` (0 when absent) and returns the
    /// new value. The value is stored as decimal text, so [`get`](Self::get) reads it as
    /// such; a key holding anything else, or an overflow, is [`Error::InvalidArgument`].
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        if let Backend::Torch(torch) = &self.backend {
            return torch.add(key, delta);
        }
        match self.call("add", &Request::Add { key, delta }, Duration::ZERO)? {
            Response::Int(value) => Ok(value),
            other => Err(unexpected("add", &other)),
        }
    }

    /// Whether every key in `keys` exists, without waiting.
    pub fn check(&self, keys: &[&str]) -> Result<bool> {
        if let Backend::Torch(torch) = &self.backend {
            return torch.check(keys);
        }
        match self.call(
            "check",
            &Request::Check {
                keys: keys.to_vec(),
            },
            Duration::ZERO,
        )? {
            Response::Bool(present) => Ok(present),
            other => Err(unexpected("check", &other)),
        }
    }

    /// Removes `key`; returns whether it existed.
    pub fn delete_key(&self, key: &str) -> Result<bool> {
        if let Backend::Torch(torch) = &self.backend {
            return torch.delete_key(key);
        }
        match self.call("delete", &Request::Delete { key }, Duration::ZERO)? {
            Response::Bool(existed) => Ok(existed),
            other => Err(unexpected("delete", &other)),
        }
    }

    /// Torch's compare-and-set: when `key` holds `expected` (or is absent and
    /// `expected` is empty) it is set to `desired`; returns the value `key` holds
    /// afterwards (for an absent key and a non-empty `expected`: `expected`, and the key
    /// stays absent). Only a torch store has it; ours answers
    /// [`Error::Unsupported`] (use [`set_if_absent`](Self::set_if_absent)).
    pub fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        match &self.backend {
            Backend::Torch(torch) => torch.compare_set(key, expected, desired),
            Backend::Own { .. } => Err(Error::Unsupported(
                "compare_set on this crate's store (it has set_if_absent)".into(),
            )),
        }
    }

    /// The values of `keys`, in order, waiting up to the store's timeout until all
    /// exist: one request on a torch store (`MULTI_GET`), one [`get`](Self::get) per key
    /// on ours.
    pub fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>> {
        match &self.backend {
            Backend::Torch(torch) if !keys.is_empty() => torch.get_many(keys, self.timeout),
            Backend::Torch(_) => Ok(Vec::new()),
            Backend::Own { .. } => keys.iter().map(|key| self.get(key)).collect(),
        }
    }

    /// Sets every `(key, value)` of `pairs`: one request on a torch store
    /// (`MULTI_SET`), one [`set`](Self::set) per key on ours.
    pub fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<()> {
        match &self.backend {
            Backend::Torch(torch) => torch.multi_set(pairs),
            Backend::Own { .. } => pairs.iter().try_for_each(|(k, v)| self.set(k, v)),
        }
    }

    /// Registers this process as rank `rank` of `world_size` and waits, up to `timeout`,
    /// until every rank has: the rendezvous at the start of a job, which
    /// [`EnvInfo::connect_store`](crate::env::EnvInfo::connect_store) does.
    ///
    /// The rank is registered with set-if-absent, so a second process claiming it fails;
    /// the world size is compared with the server's. Either mistake is
    /// [`Error::Rendezvous`] naming the ranks, on every rank still waiting here and on the
    /// others at their next request. On timeout the error's `missing` lists the ranks
    /// that never joined, and every other rank's pending and later requests fail with
    /// the same error. Joining again from the same `TcpStore` value is no mistake.
    /// `rank >= world_size` or a world size above [`MAX_WORLD_SIZE`] is
    /// [`Error::InvalidArgument`].
    pub fn join(&self, rank: usize, world_size: usize, timeout: Duration) -> Result<()> {
        check_world_size(world_size)?;
        if rank >= world_size {
            return Err(Error::InvalidArgument(format!(
                "join: rank {rank} is not below the world size {world_size}"
            )));
        }
        if let Backend::Torch(torch) = &self.backend {
            torch_join::join(torch, rank, world_size, &self.join_id, timeout)?;
            self.joined_world_size.store(world_size, Ordering::Relaxed);
            return Ok(());
        }
        let request = Request::Join {
            rank: rank as u64,
            world_size: world_size as u64,
            id: self.join_id.as_bytes(),
        };
        match self.call("join", &request, Duration::ZERO)? {
            Response::Unit => {}
            other => return Err(unexpected("join", &other)),
        }
        let keys: Vec<String> = (0..world_size).map(join_key).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let missing = self.missing_after(None, &refs, timeout)?;
        if missing.is_empty() {
            return Ok(());
        }
        Err(self.fail(Error::Timeout {
            what: format!("the rendezvous of {world_size} ranks (rank {rank} waited)"),
            after: timeout,
            missing: ranks_of(&keys, &missing),
        }))
    }

    /// Waits until all `world_size` ranks have called `barrier` with this `name`, up to
    /// `timeout`.
    ///
    /// Each rank adds one to its own counter `{name}/calls/{rank}` (its generation `g`),
    /// then, in one request, registers `{name}/{g}/rank/{rank}` and waits for every
    /// rank's key of generation `g`; so a name serves any number of successive barriers.
    /// On timeout the error's `missing` lists the ranks that never arrived, and every
    /// other rank's pending and later requests fail with the same error (the job cannot
    /// go on without those ranks). `rank >= world_size`, or a world size above
    /// [`MAX_WORLD_SIZE`], is [`Error::InvalidArgument`].
    ///
    /// The server stops when rank 0's store is dropped; requests it is already handling
    /// are answered first, so rank 0 may drop it right after a final barrier.
    pub fn barrier(
        &self,
        name: &str,
        world_size: usize,
        rank: usize,
        timeout: Duration,
    ) -> Result<()> {
        // Before anything is allocated for the ranks.
        check_world_size(world_size)?;
        if rank >= world_size {
            return Err(Error::InvalidArgument(format!(
                "barrier {}: rank {rank} is not below the world size {world_size}",
                Quoted(name)
            )));
        }
        if let Backend::Torch(torch) = &self.backend {
            return torch_join::barrier(torch, name, world_size, rank, timeout);
        }
        let generation = self.add(&format!("{name}/calls/{rank}"), 1)?;
        let keys: Vec<String> = (0..world_size)
            .map(|r| format!("{name}/{generation}/rank/{r}"))
            .collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        // Arriving and waiting are one request: when the last rank arrives, every rank's
        // request is already in the server's hands and is answered even if rank 0 then
        // drops the server at once.
        let missing = self.missing_after(Some(&keys[rank]), &refs, timeout)?;
        if missing.is_empty() {
            return Ok(());
        }
        Err(self.fail(Error::Timeout {
            what: format!("barrier {} (rank {rank} of {world_size})", Quoted(name)),
            after: timeout,
            missing: ranks_of(&keys, &missing),
        }))
    }

    /// Hands `error` to every rank's pending and later requests, then returns it. Best
    /// effort: the error is this rank's whether the server hears of it or not.
    fn fail(&self, error: Error) -> Error {
        if let Some(failure) = Failure::from_error(&error) {
            if let Err(e) = self.call("fail", &Request::Fail(failure), Duration::ZERO) {
                tracing::debug!(error = %e, "could not tell the store of a failure");
            }
        }
        error
    }

    /// Sets `arrive` (if any), then returns the keys of `keys` still missing when all
    /// were present or `timeout` passed.
    fn missing_after(
        &self,
        arrive: Option<&str>,
        keys: &[&str],
        timeout: Duration,
    ) -> Result<Vec<String>> {
        let request = Request::Wait {
            arrive,
            keys: keys.to_vec(),
            timeout,
        };
        match self.call("wait", &request, timeout)? {
            Response::Unit => Ok(Vec::new()),
            Response::TimedOut(missing) => Ok(missing),
            other => Err(unexpected("wait", &other)),
        }
    }

    /// Sends a request that the server may hold for up to `held` before answering; the
    /// reply is awaited for that plus the store's timeout.
    fn call(&self, op: &str, request: &Request<'_>, held: Duration) -> Result<Response> {
        match &self.backend {
            Backend::Own { client, .. } => {
                client.call(op, request, held.saturating_add(self.timeout))
            }
            Backend::Torch(_) => Err(Error::Internal(format!(
                "{op}: a request of this crate's protocol for a torch store"
            ))),
        }
    }
}

impl fmt::Debug for TcpStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TcpStore")
            .field("addr", &self.addr())
            .field("is_server", &self.is_server())
            .field("is_torch", &self.is_torch())
            .field("world_size", &self.world_size())
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// `Ok` for a world size a store accepts.
fn check_world_size(world_size: usize) -> Result<()> {
    if world_size == 0 {
        return Err(Error::InvalidArgument(
            "a store needs a world of at least one rank".into(),
        ));
    }
    if world_size > MAX_WORLD_SIZE {
        return Err(Error::InvalidArgument(format!(
            "a world of {world_size} ranks is more than the {MAX_WORLD_SIZE} a store supports"
        )));
    }
    Ok(())
}

/// The ranks whose key (`keys[rank]`) is among `missing`.
fn ranks_of(keys: &[String], missing: &[String]) -> Vec<usize> {
    let missing: HashSet<&str> = missing.iter().map(String::as_str).collect();
    (0..keys.len())
        .filter(|&r| missing.contains(keys[r].as_str()))
        .collect()
}

fn unexpected(op: &str, reply: &Response) -> Error {
    Error::Protocol(format!("unexpected reply to {op}: {reply:?}"))
}

//! A TCP key-value store for rendezvous, like PyTorch's `TCPStore`.
//!
//! Rank 0 runs the server ([`TcpStore::server`]) and is itself a client of it; every
//! other rank connects with [`TcpStore::client`]. Ranks exchange small values through it
//! (an NCCL unique id, a port) and meet at [`TcpStore::barrier`]s.
//!
//! # Guarantees
//! - **Every blocking call is bounded.** [`get`](TcpStore::get), [`wait`](TcpStore::wait),
//!   [`barrier`](TcpStore::barrier) and connecting return [`Error::Timeout`] when their
//!   timeout passes; a server that stops answering is a timeout too, never a hang.
//! - **Clients may start first.** [`TcpStore::client`] retries until its timeout, so a
//!   rank that starts before rank 0 has bound the port still joins.
//! - **A missing rank is named.** A barrier that times out lists, in
//!   [`Error::Timeout::missing`](Error::Timeout), the ranks that never arrived.
//! - **Dropping the server stops it.** Requests it is already handling are answered
//!   (so rank 0 may leave right after a final barrier), its threads are joined, and
//!   clients' other pending and later operations fail with [`Error::Io`].
//! - **A broken peer is an error value.** A malformed message is [`Error::Protocol`], a
//!   lost connection [`Error::Io`]; after either, that client's connection is unusable and
//!   says so.
//!
//! ```
//! use std::time::Duration;
//! use collectives::store::TcpStore;
//!
//! let timeout = Duration::from_secs(5);
//! let server = TcpStore::server(("127.0.0.1", 0), 2, timeout)?;
//! let client = TcpStore::client("127.0.0.1", server.port(), timeout)?;
//! client.set("nccl_id", b"\x01\x02")?;
//! assert_eq!(server.get("nccl_id")?, b"\x01\x02");
//! assert_eq!(server.add("count", 2)?, 2);
//! assert_eq!(client.add("count", 1)?, 3);
//! # Ok::<(), collectives::Error>(())
//! ```
//!
//! The protocol is private: each message is a 4-byte big-endian length and a payload, one
//! request and one reply at a time per connection. Waits happen on the server (a condition
//! variable with a deadline), so a waiting client costs no traffic.

mod client;
mod server;
mod wire;

use std::fmt;
use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

use crate::{Error, Result};

use client::Client;
use server::Server;
use wire::{Request, Response};

/// A client of a TCP key-value store, and on rank 0 also its server.
///
/// `TcpStore` is `Send + Sync`; threads may share one, their requests take turns on its
/// single connection.
pub struct TcpStore {
    // Declared before `server` so that our own connection closes before the server stops.
    client: Client,
    server: Option<Server>,
    timeout: Duration,
}

impl TcpStore {
    /// Binds `addr`, serves the store from background threads, and connects to it.
    ///
    /// Port 0 picks a free port; [`port`](Self::port) tells which. `world_size` is the
    /// number of ranks the job has (at least 1); clients learn it when they connect.
    /// `timeout` bounds every operation of the returned store that does not take its own.
    pub fn server(addr: impl ToSocketAddrs, world_size: usize, timeout: Duration) -> Result<Self> {
        if world_size == 0 {
            return Err(Error::InvalidArgument(
                "a store needs a world of at least one rank".into(),
            ));
        }
        let server = Server::start(addr, world_size)?;
        let client = Client::connect(&server.addr.to_string(), server.addr, timeout)?;
        Ok(TcpStore {
            client,
            server: Some(server),
            timeout,
        })
    }

    /// Connects to the store served at `host:port`, retrying until `timeout` passes.
    ///
    /// The server need not exist yet: refused connections are retried with a short
    /// back-off. A peer that answers but is not a store is [`Error::Protocol`]; no
    /// answer in time is [`Error::Timeout`].
    pub fn client(host: &str, port: u16, timeout: Duration) -> Result<Self> {
        let name = format!("{host}:{port}");
        let client = Client::connect(&name, (host, port), timeout)?;
        Ok(TcpStore {
            client,
            server: None,
            timeout,
        })
    }

    /// The address this store's connection goes to (for the server, a loopback address
    /// when it is bound to all interfaces).
    pub fn addr(&self) -> SocketAddr {
        self.client.addr
    }

    /// The server's port.
    pub fn port(&self) -> u16 {
        self.client.addr.port()
    }

    /// Whether this value runs the server.
    pub fn is_server(&self) -> bool {
        self.server.is_some()
    }

    /// The job's number of ranks, as given to [`server`](Self::server).
    pub fn world_size(&self) -> usize {
        self.client.world_size
    }

    /// The timeout of operations that take none of their own.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Sets `key` to `value`, replacing any value it had, and wakes its waiters.
    ///
    /// A request larger than 64 MiB is [`Error::InvalidArgument`].
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        match self.call("set", &Request::Set { key, value }, Duration::ZERO)? {
            Response::Unit => Ok(()),
            other => Err(unexpected("set", &other)),
        }
    }

    /// The value of `key`, waiting up to the store's timeout for some rank to set it.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        let timeout = self.timeout;
        match self.call("get", &Request::Get { key, timeout }, timeout)? {
            Response::Value(value) => Ok(value),
            Response::TimedOut(_) => Err(Error::Timeout {
                what: format!("store get of key {key:?}"),
                after: timeout,
                missing: Vec::new(),
            }),
            other => Err(unexpected("get", &other)),
        }
    }

    /// Waits until every key in `keys` exists, up to `timeout`; the error names the keys
    /// still missing.
    pub fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let missing = self.missing_after(None, keys, timeout)?;
        if missing.is_empty() {
            return Ok(());
        }
        Err(Error::Timeout {
            what: format!("store wait for keys {keys:?} (still missing: {missing:?})"),
            after: timeout,
            missing: Vec::new(),
        })
    }

    /// Atomically adds `delta` to the integer under `key` (0 when absent) and returns the
    /// new value. The value is stored as decimal text, so [`get`](Self::get) reads it as
    /// such; a key holding anything else, or an overflow, is [`Error::InvalidArgument`].
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        match self.call("add", &Request::Add { key, delta }, Duration::ZERO)? {
            Response::Int(value) => Ok(value),
            other => Err(unexpected("add", &other)),
        }
    }

    /// Whether every key in `keys` exists, without waiting.
    pub fn check(&self, keys: &[&str]) -> Result<bool> {
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
        match self.call("delete", &Request::Delete { key }, Duration::ZERO)? {
            Response::Bool(existed) => Ok(existed),
            other => Err(unexpected("delete", &other)),
        }
    }

    /// Waits until all `world_size` ranks have called `barrier` with this `name`, up to
    /// `timeout`.
    ///
    /// Each rank adds one to its own counter `{name}/calls/{rank}` (its generation `g`),
    /// then, in one request, registers `{name}/{g}/rank/{rank}` and waits for every
    /// rank's key of generation `g`; so a name serves any number of successive barriers.
    /// On timeout the error's `missing` lists the ranks that never arrived.
    /// `rank >= world_size` is [`Error::InvalidArgument`].
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
        if rank >= world_size {
            return Err(Error::InvalidArgument(format!(
                "barrier {name:?}: rank {rank} is not below the world size {world_size}"
            )));
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
        let ranks: Vec<usize> = (0..world_size)
            .filter(|&r| missing.contains(&keys[r]))
            .collect();
        Err(Error::Timeout {
            what: format!("barrier {name:?} (rank {rank} of {world_size})"),
            after: timeout,
            missing: ranks,
        })
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
        self.client
            .call(op, request, held.saturating_add(self.timeout))
    }
}

impl fmt::Debug for TcpStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TcpStore")
            .field("addr", &self.client.addr)
            .field("is_server", &self.is_server())
            .field("world_size", &self.client.world_size)
            .field("timeout", &self.timeout)
            .finish()
    }
}

fn unexpected(op: &str, reply: &Response) -> Error {
    Error::Protocol(format!("unexpected reply to {op}: {reply:?}"))
}

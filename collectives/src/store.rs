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

use std::collections::HashMap;
use std::fmt;
use std::io;
use std::net::{
    IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs,
};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crate::{Error, Result};

use wire::{read_frame, write_frame, FrameError, Request, Response};

/// How long the server tries to write a reply before giving up on its client.
const SERVER_WRITE_TIMEOUT: Duration = Duration::from_secs(10);

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

/// One connection to the server; requests take turns on it.
struct Client {
    conn: Mutex<Conn>,
    addr: SocketAddr,
    world_size: usize,
}

struct Conn {
    stream: TcpStream,
    /// Why the connection is unusable, once it is: after a lost connection, a timed-out
    /// reply or a malformed one, the stream is no longer in step with the server.
    broken: Option<String>,
}

impl Client {
    /// Connects to the first of `addrs` that answers, retrying until `timeout`.
    fn connect(name: &str, addrs: impl ToSocketAddrs, timeout: Duration) -> Result<Client> {
        let start = Instant::now();
        let mut backoff = Duration::from_millis(5);
        let mut last_error = String::from("no address to try");
        loop {
            let left = timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                return Err(Error::Timeout {
                    what: format!("connecting to the store at {name} (last error: {last_error})"),
                    after: timeout,
                    missing: Vec::new(),
                });
            }
            // Resolve on every try: a name may resolve only once its host is up.
            match addrs.to_socket_addrs() {
                Ok(resolved) => {
                    for addr in resolved {
                        match Client::try_connect(addr, left) {
                            Ok(client) => return Ok(client),
                            Err(e @ Error::Protocol(_)) => return Err(e),
                            Err(e) => last_error = e.to_string(),
                        }
                    }
                }
                Err(e) => last_error = format!("resolving {name}: {e}"),
            }
            thread::sleep(backoff.min(timeout.saturating_sub(start.elapsed())));
            backoff = (backoff * 2).min(Duration::from_millis(100));
        }
    }

    fn try_connect(addr: SocketAddr, left: Duration) -> Result<Client> {
        let context = || format!("connecting to the store at {addr}");
        let stream =
            TcpStream::connect_timeout(&addr, left).map_err(|e| Error::io(context(), e))?;
        // Connecting to a free port of the ephemeral range can, rarely, connect the socket
        // to itself (TCP simultaneous open); that is no server.
        if stream.local_addr().ok() == Some(addr) {
            return Err(Error::Io {
                context: context(),
                message: "connected to itself; no server yet".into(),
            });
        }
        stream
            .set_nodelay(true)
            .map_err(|e| Error::io(context(), e))?;
        let client = Client {
            conn: Mutex::new(Conn {
                stream,
                broken: None,
            }),
            addr,
            world_size: 0,
        };
        match client.call("hello", &Request::Hello, left)? {
            Response::Hello { world_size } => Ok(Client {
                world_size: usize::try_from(world_size).map_err(|_| {
                    Error::Protocol(format!("the store reports a world of {world_size} ranks"))
                })?,
                ..client
            }),
            other => Err(unexpected("hello", &other)),
        }
    }

    /// Sends `request` and reads the reply, waiting at most `reply_within` for it.
    /// Replies that report the caller's mistake or a protocol violation become errors.
    fn call(&self, op: &str, request: &Request<'_>, reply_within: Duration) -> Result<Response> {
        let payload = request.encode()?;
        let mut conn = self.conn.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(why) = &conn.broken {
            return Err(Error::Io {
                context: format!("{op} on the store at {}", self.addr),
                message: format!("the connection is unusable: {why}"),
            });
        }
        let reply = exchange(&mut conn.stream, self.addr, &payload, reply_within);
        match reply {
            Err(e) => {
                conn.broken = Some(e.to_string());
                Err(e)
            }
            Ok(Response::Protocol(message)) => {
                // The server closes the connection after a protocol error.
                conn.broken = Some(format!("the store rejected a request: {message}"));
                Err(Error::Protocol(format!(
                    "the store rejected our {op}: {message}"
                )))
            }
            Ok(Response::Invalid(message)) => Err(Error::InvalidArgument(message)),
            Ok(response) => Ok(response),
        }
    }
}

fn exchange(
    stream: &mut TcpStream,
    addr: SocketAddr,
    payload: &[u8],
    reply_within: Duration,
) -> Result<Response> {
    // Zero would mean no timeout at all.
    let within = Some(reply_within.max(Duration::from_millis(1)));
    stream
        .set_read_timeout(within)
        .and_then(|()| stream.set_write_timeout(within))
        .map_err(|e| Error::io(format!("configuring the connection to {addr}"), e))?;
    write_frame(stream, payload)
        .map_err(|e| Error::io(format!("sending a request to the store at {addr}"), e))?;
    let context = || format!("reading a reply from the store at {addr}");
    match read_frame(stream) {
        Ok(Some(frame)) => Response::decode(&frame).map_err(Error::Protocol),
        Ok(None) => Err(Error::Io {
            context: context(),
            message: "the store closed the connection".into(),
        }),
        Err(FrameError::Io(e))
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            Err(Error::Timeout {
                what: format!("a reply from the store at {addr}"),
                after: reply_within,
                missing: Vec::new(),
            })
        }
        Err(FrameError::Io(e)) => Err(Error::io(context(), e)),
        Err(FrameError::TooLarge(len)) => Err(Error::Protocol(format!(
            "a reply of {len} bytes exceeds the limit of {} bytes",
            wire::MAX_FRAME
        ))),
    }
}

/// The serving side: an accept thread and one thread per connection.
struct Server {
    shared: Arc<Shared>,
    /// Where clients on this host reach the server.
    addr: SocketAddr,
    accept: Option<JoinHandle<()>>,
}

struct Shared {
    state: Mutex<State>,
    /// Notified whenever a key is set and when the server stops.
    changed: Condvar,
    world_size: usize,
}

/// A clone of a connection's stream, and whether a request of it is being handled.
struct Connection {
    stream: TcpStream,
    busy: bool,
}

struct State {
    data: HashMap<String, Vec<u8>>,
    stopping: bool,
    /// The open connections, so that stopping can shut down the idle ones.
    conns: HashMap<u64, Connection>,
    next_conn: u64,
}

impl Server {
    fn start(addr: impl ToSocketAddrs, world_size: usize) -> Result<Server> {
        let listener = TcpListener::bind(addr).map_err(|e| Error::io("binding the store", e))?;
        let bound = listener
            .local_addr()
            .map_err(|e| Error::io("binding the store", e))?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                data: HashMap::new(),
                stopping: false,
                conns: HashMap::new(),
                next_conn: 0,
            }),
            changed: Condvar::new(),
            world_size,
        });
        let accept = {
            let shared = Arc::clone(&shared);
            thread::Builder::new()
                .name("tcp-store-accept".into())
                .spawn(move || accept_loop(&listener, &shared))
                .map_err(|e| Error::io("starting the store's thread", e))?
        };
        tracing::debug!(%bound, world_size, "store serving");
        Ok(Server {
            shared,
            addr: reachable(bound),
            accept: Some(accept),
        })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        {
            let mut state = self.shared.lock();
            state.stopping = true;
            // Idle connections are cut (waking threads blocked reading); busy ones answer
            // the request in hand first, so a rank that has just passed a barrier may
            // drop the server while its peers' replies are still on their way.
            for conn in state.conns.values().filter(|conn| !conn.busy) {
                // An error means the connection is closed already.
                let _ = conn.stream.shutdown(Shutdown::Both);
            }
        }
        self.shared.changed.notify_all();
        // The accept thread blocks in `accept`; a connection of our own wakes it.
        let woke = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1)).is_ok();
        if let Some(accept) = self.accept.take() {
            if woke {
                if accept.join().is_err() {
                    tracing::warn!("the store's accept thread panicked");
                }
            } else {
                tracing::warn!(addr = %self.addr, "cannot wake the store's accept thread; left running");
            }
        }
    }
}

/// `addr` with an unspecified IP (all interfaces) replaced by loopback.
fn reachable(addr: SocketAddr) -> SocketAddr {
    match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => {
            SocketAddr::new(Ipv4Addr::LOCALHOST.into(), addr.port())
        }
        IpAddr::V6(ip) if ip.is_unspecified() => {
            SocketAddr::new(Ipv6Addr::LOCALHOST.into(), addr.port())
        }
        _ => addr,
    }
}

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    let mut workers: Vec<JoinHandle<()>> = Vec::new();
    loop {
        let accepted = listener.accept();
        if shared.lock().stopping {
            break;
        }
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of descriptors and the like: back off instead of spinning.
                tracing::warn!(error = %e, "store accept failed");
                thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let Ok(clone) = stream.try_clone() else {
            continue;
        };
        let id = {
            let mut state = shared.lock();
            // Checked under the lock that `Drop` takes, so no connection escapes shutdown.
            if state.stopping {
                break;
            }
            let id = state.next_conn;
            state.next_conn += 1;
            let conn = Connection {
                stream: clone,
                busy: false,
            };
            state.conns.insert(id, conn);
            id
        };
        let _ = stream.set_nodelay(true);
        // Bounds how long a client that does not read its reply can delay stopping.
        let _ = stream.set_write_timeout(Some(SERVER_WRITE_TIMEOUT));
        workers.retain(|worker| !worker.is_finished());
        let worker_shared = Arc::clone(shared);
        let spawned = thread::Builder::new()
            .name("tcp-store-conn".into())
            .spawn(move || {
                serve(&worker_shared, id, stream);
                worker_shared.lock().conns.remove(&id);
            });
        match spawned {
            Ok(worker) => workers.push(worker),
            Err(e) => {
                tracing::warn!(error = %e, "cannot start a store connection thread");
                shared.lock().conns.remove(&id);
            }
        }
    }
    for worker in workers {
        if worker.join().is_err() {
            tracing::warn!("a store connection thread panicked");
        }
    }
}

/// Answers one connection's requests until it closes, breaks the protocol or the server
/// stops.
fn serve(shared: &Shared, id: u64, mut stream: TcpStream) {
    let set_busy = |busy: bool| -> bool {
        let mut state = shared.lock();
        if let Some(conn) = state.conns.get_mut(&id) {
            conn.busy = busy;
        }
        !state.stopping
    };
    loop {
        let frame = read_frame(&mut stream);
        if !set_busy(true) {
            return;
        }
        let reply = match &frame {
            Ok(Some(frame)) => match Request::decode(frame) {
                Ok(request) => match shared.handle(request) {
                    Some(reply) => reply,
                    None => return,
                },
                Err(message) => Response::Protocol(message),
            },
            Ok(None) | Err(FrameError::Io(_)) => return,
            Err(FrameError::TooLarge(len)) => Response::Protocol(format!(
                "a request of {len} bytes exceeds the limit of {} bytes",
                wire::MAX_FRAME
            )),
        };
        let fatal = matches!(reply, Response::Protocol(_));
        let sent = reply
            .encode()
            .and_then(|payload| write_frame(&mut stream, &payload).map_err(|e| e.to_string()));
        if !set_busy(false) || fatal || sent.is_err() {
            return;
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // No code panics while holding the lock; recover the state if that ever changes.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The reply to `request`, or `None` when the server stops during a wait.
    fn handle(&self, request: Request<'_>) -> Option<Response> {
        Some(match request {
            Request::Hello => Response::Hello {
                world_size: self.world_size as u64,
            },
            Request::Set { key, value } => {
                self.lock().data.insert(key.to_owned(), value.to_vec());
                self.changed.notify_all();
                Response::Unit
            }
            Request::Get { key, timeout } => {
                let (state, missing) = self.wait_for(&[key], timeout)?;
                match state.data.get(key) {
                    Some(value) if missing.is_empty() => Response::Value(value.clone()),
                    _ => Response::TimedOut(missing),
                }
            }
            Request::Add { key, delta } => {
                let reply = add(&mut self.lock().data, key, delta);
                self.changed.notify_all();
                reply
            }
            Request::Check { keys } => {
                let state = self.lock();
                Response::Bool(keys.iter().all(|key| state.data.contains_key(*key)))
            }
            Request::Wait {
                arrive,
                keys,
                timeout,
            } => {
                if let Some(key) = arrive {
                    self.lock().data.insert(key.to_owned(), b"1".to_vec());
                    self.changed.notify_all();
                }
                let (state, missing) = self.wait_for(&keys, timeout)?;
                drop(state);
                if missing.is_empty() {
                    Response::Unit
                } else {
                    Response::TimedOut(missing)
                }
            }
            Request::Delete { key } => Response::Bool(self.lock().data.remove(key).is_some()),
        })
    }

    /// Waits until all `keys` exist or `timeout` passes; returns the lock and the keys
    /// still missing, or `None` when the server stops.
    fn wait_for(
        &self,
        keys: &[&str],
        timeout: Duration,
    ) -> Option<(MutexGuard<'_, State>, Vec<String>)> {
        let deadline = Instant::now().checked_add(timeout);
        let mut state = self.lock();
        loop {
            let missing: Vec<String> = keys
                .iter()
                .filter(|key| !state.data.contains_key(**key))
                .map(|key| (*key).to_owned())
                .collect();
            // A wait already satisfied is answered even while the server stops.
            if missing.is_empty() {
                return Some((state, missing));
            }
            if state.stopping {
                return None;
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| d <= now) {
                return Some((state, missing));
            }
            state = match deadline {
                Some(deadline) => {
                    self.changed
                        .wait_timeout(state, deadline - now)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0
                }
                // A timeout too large for an `Instant` is as good as none.
                None => self
                    .changed
                    .wait(state)
                    .unwrap_or_else(PoisonError::into_inner),
            };
        }
    }
}

fn add(data: &mut HashMap<String, Vec<u8>>, key: &str, delta: i64) -> Response {
    let old = match data.get(key) {
        None => 0,
        Some(bytes) => match std::str::from_utf8(bytes)
            .ok()
            .and_then(|s| s.parse::<i64>().ok())
        {
            Some(old) => old,
            None => {
                return Response::Invalid(format!(
                    "add to key {key:?}: its {} bytes are not a decimal integer",
                    bytes.len()
                ))
            }
        },
    };
    match old.checked_add(delta) {
        Some(new) => {
            data.insert(key.to_owned(), new.to_string().into_bytes());
            Response::Int(new)
        }
        None => Response::Invalid(format!("add of {delta} to key {key:?} ({old}) overflows")),
    }
}

/// The private message format.
mod wire {
    use std::io::{self, Read, Write};
    use std::time::Duration;

    use crate::{Error, Result};

    /// A decoding failure, described for [`Error::Protocol`].
    type DecodeResult<T> = std::result::Result<T, String>;

    /// The largest payload either side sends or accepts.
    pub(super) const MAX_FRAME: usize = 64 << 20;

    /// Sent by a client first, so that a peer that is not a store is caught at once.
    const MAGIC: &[u8; 8] = b"ctstore1";

    /// A client's request; keys and values borrow the caller's or the frame's bytes.
    #[derive(Debug)]
    pub(super) enum Request<'a> {
        Hello,
        Set {
            key: &'a str,
            value: &'a [u8],
        },
        Get {
            key: &'a str,
            timeout: Duration,
        },
        Add {
            key: &'a str,
            delta: i64,
        },
        Check {
            keys: Vec<&'a str>,
        },
        /// Sets `arrive` to `1` first, if given.
        Wait {
            arrive: Option<&'a str>,
            keys: Vec<&'a str>,
            timeout: Duration,
        },
        Delete {
            key: &'a str,
        },
    }

    /// A server's reply.
    #[derive(Debug)]
    pub(super) enum Response {
        Hello {
            world_size: u64,
        },
        Unit,
        Value(Vec<u8>),
        Int(i64),
        Bool(bool),
        /// The wait timed out; these keys were still missing.
        TimedOut(Vec<String>),
        /// The request was well formed but cannot be done (an add to a non-integer).
        Invalid(String),
        /// The request was malformed; the server closes the connection after this.
        Protocol(String),
    }

    impl<'a> Request<'a> {
        pub(super) fn encode(&self) -> Result<Vec<u8>> {
            let mut e = Encoder::default();
            match self {
                Request::Hello => {
                    e.u8(0);
                    e.raw(MAGIC);
                }
                Request::Set { key, value } => {
                    e.u8(1);
                    e.str(key);
                    e.bytes(value);
                }
                Request::Get { key, timeout } => {
                    e.u8(2);
                    e.duration(*timeout);
                    e.str(key);
                }
                Request::Add { key, delta } => {
                    e.u8(3);
                    e.str(key);
                    e.u64(*delta as u64);
                }
                Request::Check { keys } => {
                    e.u8(4);
                    e.strs(keys);
                }
                Request::Wait {
                    arrive,
                    keys,
                    timeout,
                } => {
                    e.u8(5);
                    e.duration(*timeout);
                    e.strs(keys);
                    e.strs(arrive.as_slice());
                }
                Request::Delete { key } => {
                    e.u8(6);
                    e.str(key);
                }
            }
            e.finish().ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "a store request larger than {MAX_FRAME} bytes (keys or value too large)"
                ))
            })
        }

        /// Decodes a request frame; keys and values borrow from it.
        pub(super) fn decode(frame: &'a [u8]) -> DecodeResult<Request<'a>> {
            let mut d = Decoder { buf: frame };
            let request = match d.u8()? {
                0 if d.take(MAGIC.len())? == MAGIC => Request::Hello,
                0 => return Err("the peer is not a store client (bad greeting)".into()),
                1 => Request::Set {
                    key: d.str()?,
                    value: d.bytes()?,
                },
                2 => Request::Get {
                    timeout: d.duration()?,
                    key: d.str()?,
                },
                3 => Request::Add {
                    key: d.str()?,
                    delta: d.u64()? as i64,
                },
                4 => Request::Check { keys: d.strs()? },
                5 => Request::Wait {
                    timeout: d.duration()?,
                    keys: d.strs()?,
                    arrive: match d.strs()?[..] {
                        [] => None,
                        [key] => Some(key),
                        _ => return Err("a wait that sets several keys".into()),
                    },
                },
                6 => Request::Delete { key: d.str()? },
                op => return Err(format!("unknown request type {op}")),
            };
            d.end()?;
            Ok(request)
        }
    }

    impl Response {
        pub(super) fn encode(&self) -> DecodeResult<Vec<u8>> {
            let mut e = Encoder::default();
            match self {
                Response::Hello { world_size } => {
                    e.u8(0);
                    e.raw(MAGIC);
                    e.u64(*world_size);
                }
                Response::Unit => e.u8(1),
                Response::Value(value) => {
                    e.u8(2);
                    e.bytes(value);
                }
                Response::Int(value) => {
                    e.u8(3);
                    e.u64(*value as u64);
                }
                Response::Bool(value) => {
                    e.u8(4);
                    e.u8(u8::from(*value));
                }
                Response::TimedOut(keys) => {
                    e.u8(5);
                    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
                    e.strs(&keys);
                }
                Response::Invalid(message) => {
                    e.u8(6);
                    e.str(message);
                }
                Response::Protocol(message) => {
                    e.u8(7);
                    e.str(message);
                }
            }
            e.finish()
                .ok_or_else(|| format!("a reply larger than {MAX_FRAME} bytes"))
        }

        pub(super) fn decode(frame: &[u8]) -> DecodeResult<Response> {
            let mut d = Decoder { buf: frame };
            let response = match d.u8()? {
                0 => {
                    if d.take(MAGIC.len())? != MAGIC {
                        return Err("the peer is not a store (bad greeting)".into());
                    }
                    Response::Hello {
                        world_size: d.u64()?,
                    }
                }
                1 => Response::Unit,
                2 => Response::Value(d.bytes()?.to_vec()),
                3 => Response::Int(d.u64()? as i64),
                4 => match d.u8()? {
                    0 => Response::Bool(false),
                    1 => Response::Bool(true),
                    b => return Err(format!("a boolean byte of {b}")),
                },
                5 => Response::TimedOut(d.strs()?.into_iter().map(str::to_owned).collect()),
                6 => Response::Invalid(d.str()?.to_owned()),
                7 => Response::Protocol(d.str()?.to_owned()),
                status => return Err(format!("unknown reply type {status}")),
            };
            d.end()?;
            Ok(response)
        }
    }

    #[derive(Default)]
    struct Encoder {
        buf: Vec<u8>,
        too_large: bool,
    }

    impl Encoder {
        fn raw(&mut self, bytes: &[u8]) {
            if self.buf.len() + bytes.len() > MAX_FRAME {
                self.too_large = true;
            } else {
                self.buf.extend_from_slice(bytes);
            }
        }
        fn u8(&mut self, v: u8) {
            self.raw(&[v]);
        }
        fn u32(&mut self, v: usize) {
            match u32::try_from(v) {
                Ok(v) => self.raw(&v.to_be_bytes()),
                Err(_) => self.too_large = true,
            }
        }
        fn u64(&mut self, v: u64) {
            self.raw(&v.to_be_bytes());
        }
        fn duration(&mut self, d: Duration) {
            self.u64(u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        }
        fn bytes(&mut self, v: &[u8]) {
            self.u32(v.len());
            self.raw(v);
        }
        fn str(&mut self, s: &str) {
            self.bytes(s.as_bytes());
        }
        fn strs(&mut self, keys: &[&str]) {
            self.u32(keys.len());
            for key in keys {
                self.str(key);
            }
        }
        fn finish(self) -> Option<Vec<u8>> {
            (!self.too_large).then_some(self.buf)
        }
    }

    struct Decoder<'a> {
        buf: &'a [u8],
    }

    impl<'a> Decoder<'a> {
        fn take(&mut self, n: usize) -> DecodeResult<&'a [u8]> {
            if n > self.buf.len() {
                return Err(format!(
                    "a truncated message ({n} bytes wanted, {} left)",
                    self.buf.len()
                ));
            }
            let (head, tail) = self.buf.split_at(n);
            self.buf = tail;
            Ok(head)
        }
        fn u8(&mut self) -> DecodeResult<u8> {
            Ok(self.take(1)?[0])
        }
        fn u32(&mut self) -> DecodeResult<usize> {
            let bytes: [u8; 4] = self.take(4)?.try_into().map_err(|_| "u32")?;
            Ok(u32::from_be_bytes(bytes) as usize)
        }
        fn u64(&mut self) -> DecodeResult<u64> {
            let bytes: [u8; 8] = self.take(8)?.try_into().map_err(|_| "u64")?;
            Ok(u64::from_be_bytes(bytes))
        }
        fn duration(&mut self) -> DecodeResult<Duration> {
            Ok(Duration::from_millis(self.u64()?))
        }
        fn bytes(&mut self) -> DecodeResult<&'a [u8]> {
            let len = self.u32()?;
            self.take(len)
        }
        fn str(&mut self) -> DecodeResult<&'a str> {
            std::str::from_utf8(self.bytes()?).map_err(|_| "a key that is not UTF-8".to_owned())
        }
        fn strs(&mut self) -> DecodeResult<Vec<&'a str>> {
            let count = self.u32()?;
            // Each string takes at least its 4-byte length: bounds the count before
            // anything is allocated for it.
            if count > self.buf.len() / 4 {
                return Err(format!(
                    "a list of {count} keys in {} bytes",
                    self.buf.len()
                ));
            }
            (0..count).map(|_| self.str()).collect()
        }
        fn end(&self) -> DecodeResult<()> {
            if self.buf.is_empty() {
                Ok(())
            } else {
                Err(format!(
                    "{} unexpected bytes at the end of a message",
                    self.buf.len()
                ))
            }
        }
    }

    /// Why a frame could not be read.
    pub(super) enum FrameError {
        Io(io::Error),
        TooLarge(usize),
    }

    /// Writes one frame: the payload's length, then the payload, in one write.
    pub(super) fn write_frame(w: &mut impl Write, payload: &[u8]) -> io::Result<()> {
        let len = u32::try_from(payload.len())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "frame too large"))?;
        let mut frame = Vec::with_capacity(4 + payload.len());
        frame.extend_from_slice(&len.to_be_bytes());
        frame.extend_from_slice(payload);
        w.write_all(&frame)?;
        w.flush()
    }

    /// Reads one frame; `Ok(None)` when the peer closed the connection between frames.
    pub(super) fn read_frame(
        r: &mut impl Read,
    ) -> std::result::Result<Option<Vec<u8>>, FrameError> {
        let mut len = [0u8; 4];
        let mut got = 0;
        while got < len.len() {
            match r.read(&mut len[got..]) {
                Ok(0) if got == 0 => return Ok(None),
                Ok(0) => return Err(FrameError::Io(io::ErrorKind::UnexpectedEof.into())),
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(FrameError::Io(e)),
            }
        }
        let len = u32::from_be_bytes(len) as usize;
        if len > MAX_FRAME {
            return Err(FrameError::TooLarge(len));
        }
        let mut payload = vec![0u8; len];
        r.read_exact(&mut payload).map_err(FrameError::Io)?;
        Ok(Some(payload))
    }
}

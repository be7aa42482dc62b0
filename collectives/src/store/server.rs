//! The serving side: the accept thread and its connection cap, one thread per
//! connection with its hello, read and reply deadlines, and a prompt stop when the
//! server is dropped.

use std::io::{self, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crate::{Error, Result};

use super::codec::{self, Request, Response};
use super::frame::{self, deadline_after, is_timeout, read_by, write_frame};
use super::limits::{Charge, OverQuota, StoreLimits, StoreStats};
use super::state::{quota, Connection, Shared};
use super::token::{StoreToken, MAX_TOKEN_LEN};

/// The serving side: an accept thread and one thread per connection.
pub(super) struct Server {
    shared: Arc<Shared>,
    /// Where clients on this host reach the server.
    pub(super) addr: SocketAddr,
    accept: Option<JoinHandle<()>>,
}

impl Server {
    /// Serves the store on `listener` from background threads.
    pub(super) fn start(
        listener: TcpListener,
        world_size: usize,
        token: Option<StoreToken>,
        limits: StoreLimits,
    ) -> Result<Server> {
        let bound = listener
            .local_addr()
            .map_err(|e| Error::io("binding the store", e))?;
        let shared = Arc::new(Shared::new(world_size, token, limits));
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

    pub(super) fn stats(&self) -> StoreStats {
        self.shared.stats()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // After the job failed, ranks still connected get the failure in reply to their
        // next request, not a closed connection, and ranks that have not asked to join
        // yet (a late start) find a server that tells them: the server serves on until
        // every rank has asked and left, for the grace period at most.
        if self.shared.has_failed() {
            self.wait_for_connections(self.shared.limits.shutdown_grace, true);
        }
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
        // Replies in hand get the grace period; then every connection is cut, which
        // ends a write to a client that does not read at once.
        self.wait_for_connections(self.shared.limits.shutdown_grace, false);
        let mut state = self.shared.lock();
        for conn in state.conns.values() {
            let _ = conn.stream.shutdown(Shutdown::Both);
        }
        let workers = std::mem::take(&mut state.workers);
        drop(state);
        for worker in workers {
            if worker.join().is_err() {
                tracing::warn!("a store connection thread panicked");
            }
        }
    }
}

impl Server {
    /// Waits until every connection has closed (and, with `all_heard`, every rank has
    /// asked to join), or `grace` has passed.
    fn wait_for_connections(&self, grace: Duration, all_heard: bool) {
        let end = Instant::now().checked_add(grace);
        let mut state = self.shared.lock();
        while !state.conns.is_empty() || (all_heard && !self.shared.all_heard(&state)) {
            let left = end.map_or(Duration::MAX, |end| {
                end.saturating_duration_since(Instant::now())
            });
            if left.is_zero() {
                break;
            }
            state = self
                .shared
                .closed
                .wait_timeout(state, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
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
    loop {
        let accepted = listener.accept();
        let accepted_at = Instant::now();
        if shared.lock().stopping {
            break;
        }
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
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
        let mut state = shared.lock();
        // Checked under the lock that `Drop` takes, so no connection escapes shutdown.
        if state.stopping {
            break;
        }
        let max = shared.limits.max_connections;
        if state.conns.len() >= max {
            drop(state);
            tracing::debug!(%peer, max, "store at its connection limit; refused a connection");
            refuse_busy(stream, max);
            continue;
        }
        let id = state.next_conn;
        state.next_conn += 1;
        state.conns.insert(
            id,
            Connection {
                stream: clone,
                busy: false,
            },
        );
        state.workers.retain(|worker| !worker.is_finished());
        let worker_shared = Arc::clone(shared);
        let spawned = thread::Builder::new()
            .name("tcp-store-conn".into())
            .spawn(move || {
                let _closing = Closing {
                    shared: &worker_shared,
                    id,
                };
                serve(&worker_shared, id, stream, accepted_at);
            });
        match spawned {
            Ok(worker) => state.workers.push(worker),
            Err(e) => {
                tracing::warn!(error = %e, "cannot start a store connection thread");
                state.conns.remove(&id);
            }
        }
    }
}

/// Tells a connection over the cap so, without waiting for it: the frame fits in a new
/// socket's send buffer, and a client that misses it sees the connection closed; either
/// way it retries.
fn refuse_busy(mut stream: TcpStream, max: usize) {
    let reply = Response::Busy(format!("the store is at its limit of {max} connections"));
    if let Ok((head, tail)) = reply.encode() {
        let _ = stream.set_nonblocking(true);
        let mut frame = (head.len() as u32).to_be_bytes().to_vec();
        frame.extend_from_slice(&head);
        frame.extend_from_slice(tail);
        let _ = stream.write_all(&frame);
    }
    let _ = stream.shutdown(Shutdown::Both);
}

/// Removes a connection from the table when its thread ends, however it ends.
struct Closing<'a> {
    shared: &'a Shared,
    id: u64,
}

impl Drop for Closing<'_> {
    fn drop(&mut self) {
        self.shared.lock().conns.remove(&self.id);
        self.shared.closed.notify_all();
    }
}

/// A request read from a connection.
enum Incoming {
    /// A whole frame, with the charge for its bytes.
    Frame(Vec<u8>, Charge),
    /// A frame that would pass the byte limit; it was read and dropped.
    OverQuota(OverQuota),
    /// A frame longer than the limit (its length, the limit); the connection is out of
    /// step.
    TooLarge(usize, usize),
    /// The client closed the connection, sent nothing for too long, or broke off.
    Gone,
}

/// Answers one connection: the hello first, then requests until the client leaves,
/// breaks the protocol or goes quiet, or the server stops.
fn serve(shared: &Shared, id: u64, mut stream: TcpStream, accepted_at: Instant) {
    let _ = stream.set_nodelay(true);
    let limits = &shared.limits;
    // The hello arrives, whole, within the read timeout of connecting.
    let hello_by = accepted_at.checked_add(limits.read_timeout);
    let (reply, go_on) = match read_request(shared, &mut stream, hello_by, hello_by, MAX_HELLO) {
        Incoming::Frame(frame, _charge) => match Request::decode(&frame) {
            Ok(Request::Hello { token }) => shared.hello(token),
            Ok(_) => (
                Response::Refused("the first request must be the hello".into()),
                false,
            ),
            Err(message) => (Response::Protocol(message), false),
        },
        Incoming::TooLarge(len, max) => (too_large(len, max), false),
        // Retried by the client, as the connection cap is.
        Incoming::OverQuota(refused) => (
            Response::Busy(format!(
                "the store holds {} of its limit of {} bytes",
                refused.held, refused.limit
            )),
            false,
        ),
        Incoming::Gone => return,
    };
    if let Response::Refused(why) = &reply {
        tracing::warn!(peer = ?stream.peer_addr().ok(), why, "store refused a connection");
    }
    if !send(shared, &mut stream, &reply) || !go_on {
        return;
    }
    let set_busy = |busy: bool| -> bool {
        let mut state = shared.lock();
        if let Some(conn) = state.conns.get_mut(&id) {
            conn.busy = busy;
        }
        !state.stopping
    };
    loop {
        let idle_by = deadline_after(limits.idle_timeout);
        let incoming = read_request(shared, &mut stream, idle_by, None, codec::MAX_FRAME);
        if !set_busy(true) {
            return;
        }
        // The request's bytes stay charged until its reply is out.
        let (reply, _held) = match incoming {
            Incoming::Frame(frame, charge) => {
                let alive = || client_alive(&stream);
                match shared.handle(frame, charge, &alive) {
                    (Some(reply), held) => (reply, held),
                    (None, _) => return,
                }
            }
            Incoming::OverQuota(refused) => (quota(refused), None),
            Incoming::TooLarge(len, max) => (too_large(len, max), None),
            Incoming::Gone => return,
        };
        let fatal = matches!(reply, Response::Protocol(_));
        let sent = send(shared, &mut stream, &reply);
        if !set_busy(false) || fatal || !sent {
            return;
        }
    }
}

/// The longest hello: its token and a few bytes. A client not yet greeted gets no more
/// of the server's memory than this.
const MAX_HELLO: usize = MAX_TOKEN_LEN + 64;

fn too_large(len: usize, max: usize) -> Response {
    Response::Protocol(format!(
        "a request of {len} bytes exceeds the limit of {max} bytes"
    ))
}

/// Reads one request of at most `max_len` bytes: its first byte by `first_by`, the rest
/// within the read timeout of that byte (and by `whole_by`, if given). The frame's bytes
/// are charged to the meter before they are allocated.
fn read_request(
    shared: &Shared,
    stream: &mut TcpStream,
    first_by: Option<Instant>,
    whole_by: Option<Instant>,
    max_len: usize,
) -> Incoming {
    let mut len = [0u8; 4];
    match read_by(stream, &mut len[..1], first_by) {
        Ok(true) => {}
        Ok(false) => return Incoming::Gone,
        Err(e) => {
            if is_timeout(&e) {
                tracing::debug!("store closed a connection that sent nothing in time");
            }
            return Incoming::Gone;
        }
    }
    let rest_by = match (deadline_after(shared.limits.read_timeout), whole_by) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    if !matches!(read_by(stream, &mut len[1..], rest_by), Ok(true)) {
        return Incoming::Gone;
    }
    let len = u32::from_be_bytes(len) as usize;
    if len > max_len {
        return Incoming::TooLarge(len, max_len);
    }
    let charge = match shared.meter.charge(len) {
        Ok(charge) => charge,
        Err(refused) => {
            // Reading the payload into nothing keeps the connection in step.
            return match frame::discard_by(stream, len, rest_by) {
                Ok(()) => Incoming::OverQuota(refused),
                Err(_) => Incoming::Gone,
            };
        }
    };
    let Some(mut frame) = frame::zeroed_bytes(len) else {
        tracing::warn!(
            len,
            "no memory for a request frame: the connection is closed"
        );
        return Incoming::Gone;
    };
    match read_by(stream, &mut frame, rest_by) {
        Ok(true) => Incoming::Frame(frame, charge),
        Ok(false) if len == 0 => Incoming::Frame(frame, charge),
        Ok(false) | Err(_) => Incoming::Gone,
    }
}

/// Writes `reply` within the reply timeout; whether it was sent.
fn send(shared: &Shared, stream: &mut TcpStream, reply: &Response) -> bool {
    let deadline = deadline_after(shared.limits.reply_timeout);
    let written = reply.encode().map_err(|message| {
        tracing::warn!(message, "store reply cannot be encoded");
        io::Error::new(io::ErrorKind::InvalidData, message)
    });
    match written.and_then(|(head, tail)| write_frame(stream, &head, tail, deadline)) {
        Ok(()) => true,
        Err(e) => {
            tracing::debug!(error = %e, "store reply not delivered; closing the connection");
            false
        }
    }
}

/// Whether the client of a connection is still there, seen without blocking: a closed
/// or reset connection reads as gone; bytes waiting or nothing yet, as there.
fn client_alive(stream: &TcpStream) -> bool {
    if stream.set_nonblocking(true).is_err() {
        return false;
    }
    let mut byte = [0u8; 1];
    let alive = match stream.peek(&mut byte) {
        Ok(0) => false,
        Ok(_) => true,
        Err(e) => matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
        ),
    };
    stream.set_nonblocking(false).is_ok() && alive
}

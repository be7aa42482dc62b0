//! The client's side of a connection: connecting with retries and the hello, one
//! request and its reply at a time, reconnecting after the server closed an idle
//! connection, and a connection that stays broken once it falls out of step.

use std::io;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::{Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use crate::{Error, Result};

use super::codec::{self, Request, Response};
use super::escape::{escape_for_log, sanitize};
use super::frame::{deadline_after, is_timeout, read_frame, write_frame, FrameError};
use super::token::StoreToken;
use super::{unexpected, MAX_WORLD_SIZE};

/// The likely cause when nothing listens where the store should be, once connecting
/// has timed out.
const NOTHING_LISTENS: &str = "; nothing listens there: either the rendezvous is over \
    (rank 0 has left it and closed the store: is this rank late, or a second process \
    with the same RANK?) or MASTER_ADDR/MASTER_PORT do not name rank 0's store";

/// The likely cause when the store refuses to reconnect.
const GONE: &str = " (the store has closed: rank 0 has left the rendezvous)";

/// One connection to the server; requests take turns on it.
pub(super) struct Client {
    conn: Mutex<Conn>,
    pub(super) addr: SocketAddr,
    pub(super) world_size: usize,
    token: Option<StoreToken>,
    /// Bounds a reconnection.
    timeout: Duration,
}

struct Conn {
    stream: TcpStream,
    /// Why the connection is unusable, once it is: after a lost connection, a timed-out
    /// reply or a malformed one, the stream is no longer in step with the server.
    broken: Option<String>,
    /// When the last reply arrived: the server closes a connection idle for its idle
    /// timeout, so one idle for half of it is replaced before use.
    last_reply: Instant,
    idle_timeout: Duration,
}

/// A connection and the server's hello.
struct Greeted {
    stream: TcpStream,
    world_size: usize,
    idle_timeout: Duration,
}

/// Why one attempt to connect failed.
enum Attempt {
    /// Nothing listens (`refused`), or the connection broke: the server may not be up
    /// yet.
    Unreachable { why: String, refused: bool },
    /// The server is at its connection limit.
    Busy(String),
    /// Retrying cannot help: not a store, or the token was refused.
    Fatal(Error),
}

impl Client {
    /// Connects to the first of `addrs` that answers, retrying until `timeout`.
    pub(super) fn connect(
        name: &str,
        addrs: impl ToSocketAddrs,
        timeout: Duration,
        token: Option<StoreToken>,
    ) -> Result<Client> {
        let start = Instant::now();
        let mut backoff = Duration::from_millis(5);
        let mut last_error = String::from("no address to try");
        let mut refused = false;
        loop {
            let left = timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                let cause = if refused { NOTHING_LISTENS } else { "" };
                return Err(Error::Timeout {
                    what: format!(
                        "connecting to the store at {name} (last error: {last_error}){cause}"
                    ),
                    after: timeout,
                    missing: Vec::new(),
                });
            }
            // Resolve on every try: a name may resolve only once its host is up.
            match addrs.to_socket_addrs() {
                Ok(resolved) => {
                    for addr in resolved {
                        match greet(addr, left, token.as_ref()) {
                            Ok(greeted) => {
                                return Ok(Client {
                                    world_size: greeted.world_size,
                                    conn: Mutex::new(Conn {
                                        stream: greeted.stream,
                                        broken: None,
                                        last_reply: Instant::now(),
                                        idle_timeout: greeted.idle_timeout,
                                    }),
                                    addr,
                                    token,
                                    timeout,
                                })
                            }
                            Err(Attempt::Fatal(e)) => return Err(e),
                            Err(Attempt::Unreachable { why, refused: r }) => {
                                (last_error, refused) = (why, r);
                            }
                            Err(Attempt::Busy(why)) => (last_error, refused) = (why, false),
                        }
                    }
                }
                Err(e) => (last_error, refused) = (format!("resolving {name}: {e}"), false),
            }
            thread::sleep(backoff.min(timeout.saturating_sub(start.elapsed())));
            backoff = (backoff * 2).min(Duration::from_millis(100));
        }
    }

    /// Sends `request` and reads the reply, waiting at most `reply_within` for it.
    /// Replies that report the caller's mistake, a limit, the job's failure or a
    /// protocol violation become errors.
    pub(super) fn call(
        &self,
        op: &str,
        request: &Request<'_>,
        reply_within: Duration,
    ) -> Result<Response> {
        let payload = request.encode()?;
        let mut conn = self.conn.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(why) = &conn.broken {
            return Err(Error::Io {
                context: format!("{op} on the store at {}", self.addr),
                message: format!("the connection is unusable: {why}"),
            });
        }
        if conn.last_reply.elapsed() >= conn.idle_timeout / 2 || peer_closed(&conn.stream) {
            if let Err(e) = self.reconnect(&mut conn) {
                conn.broken = Some(e.to_string());
                return Err(e);
            }
        }
        let reply = exchange(&mut conn.stream, self.addr, &payload, reply_within);
        conn.last_reply = Instant::now();
        match reply {
            Err(e) => {
                conn.broken = Some(e.to_string());
                Err(e)
            }
            Ok(Response::Protocol(message)) => {
                // The server closes the connection after a protocol error.
                let message = sanitize(&message);
                conn.broken = Some(format!("the store rejected a request: {message}"));
                Err(Error::Protocol(format!(
                    "the store rejected our {op}: {message}"
                )))
            }
            Ok(Response::Refused(message)) => {
                let message = sanitize(&message);
                conn.broken = Some(format!("the store refused us: {message}"));
                Err(Error::Unauthorized(format!(
                    "the store at {} refused our {op}: {message}",
                    self.addr
                )))
            }
            Ok(Response::Invalid(message)) => Err(Error::InvalidArgument(sanitize(&message))),
            Ok(Response::Quota {
                needed,
                held,
                limit,
            }) => Err(Error::StoreQuota {
                needed: saturate(needed),
                held: saturate(held),
                limit: saturate(limit),
            }),
            Ok(Response::Failed(failure)) => Err(failure.into_error()),
            Ok(response) => Ok(response),
        }
    }

    /// Replaces a connection the server closed (or is about to close) for idleness. A
    /// server at its connection limit is retried until the timeout; one that is gone is
    /// an error at once.
    fn reconnect(&self, conn: &mut Conn) -> Result<()> {
        let start = Instant::now();
        let mut backoff = Duration::from_millis(5);
        loop {
            let left = self.timeout.saturating_sub(start.elapsed());
            let why = match greet(
                self.addr,
                left.max(Duration::from_millis(1)),
                self.token.as_ref(),
            ) {
                Ok(greeted) => {
                    conn.stream = greeted.stream;
                    conn.idle_timeout = greeted.idle_timeout;
                    conn.last_reply = Instant::now();
                    return Ok(());
                }
                Err(Attempt::Fatal(e)) => return Err(e),
                Err(Attempt::Unreachable { why, refused }) => {
                    let cause = if refused { GONE } else { "" };
                    return Err(Error::Io {
                        context: format!("reconnecting to the store at {}", self.addr),
                        message: format!("{why}{cause}"),
                    });
                }
                Err(Attempt::Busy(why)) => why,
            };
            if start.elapsed() >= self.timeout {
                return Err(Error::Timeout {
                    what: format!("reconnecting to the store at {} ({why})", self.addr),
                    after: self.timeout,
                    missing: Vec::new(),
                });
            }
            thread::sleep(backoff);
            backoff = (backoff * 2).min(Duration::from_millis(100));
        }
    }
}

fn saturate(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

/// Connects to `addr` and exchanges the hello, all within `left`.
fn greet(addr: SocketAddr, left: Duration, token: Option<&StoreToken>) -> Result<Greeted, Attempt> {
    let context = || format!("connecting to the store at {addr}");
    let unreachable = |e: io::Error| Attempt::Unreachable {
        refused: e.kind() == io::ErrorKind::ConnectionRefused,
        why: format!("{}: {e}", context()),
    };
    let mut stream = TcpStream::connect_timeout(&addr, left).map_err(unreachable)?;
    // Connecting to a free port of the ephemeral range can, rarely, connect the socket
    // to itself (TCP simultaneous open); that is no server.
    if stream.local_addr().ok() == Some(addr) {
        return Err(Attempt::Unreachable {
            why: format!("{}: connected to itself; no server yet", context()),
            refused: true,
        });
    }
    stream.set_nodelay(true).map_err(unreachable)?;
    let hello = Request::Hello {
        token: token.map(|t| t.secret().as_bytes()),
    }
    .encode()
    .map_err(Attempt::Fatal)?;
    let reply = match exchange(&mut stream, addr, &hello, left) {
        Ok(reply) => reply,
        Err(e @ Error::Protocol(_)) => return Err(Attempt::Fatal(e)),
        Err(e) => {
            return Err(Attempt::Unreachable {
                why: e.to_string(),
                refused: false,
            })
        }
    };
    match reply {
        Response::Hello {
            world_size,
            token_checked,
            idle_timeout,
        } => {
            if token.is_some() && !token_checked {
                return Err(Attempt::Fatal(Error::Unauthorized(format!(
                    "the store at {addr} accepts clients without a token, but this client has \
                     one: give the process that serves it (rank 0) the same token"
                ))));
            }
            let world_size = usize::try_from(world_size)
                .ok()
                .filter(|&n| (1..=MAX_WORLD_SIZE).contains(&n))
                .ok_or_else(|| {
                    Attempt::Fatal(Error::Protocol(format!(
                        "the store at {addr} reports a world of {world_size} ranks"
                    )))
                })?;
            Ok(Greeted {
                stream,
                world_size,
                idle_timeout,
            })
        }
        Response::Refused(why) => Err(Attempt::Fatal(Error::Unauthorized(format!(
            "the store at {addr} refused this client: {}",
            escape_for_log(&why)
        )))),
        Response::Busy(why) => Err(Attempt::Busy(format!(
            "the store at {addr}: {}",
            escape_for_log(&why)
        ))),
        Response::Protocol(message) => Err(Attempt::Fatal(Error::Protocol(format!(
            "the store at {addr} rejected our hello: {}",
            escape_for_log(&message)
        )))),
        other => Err(Attempt::Fatal(unexpected("hello", &other))),
    }
}

/// Whether the server has closed this connection (it does so to idle ones), seen
/// without blocking. Bytes waiting would be a reply to no request: out of step, so
/// closed too.
fn peer_closed(stream: &TcpStream) -> bool {
    if stream.set_nonblocking(true).is_err() {
        return true;
    }
    let mut byte = [0u8; 1];
    let closed = match stream.peek(&mut byte) {
        Ok(_) => true,
        Err(e) => !matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
        ),
    };
    stream.set_nonblocking(false).is_err() || closed
}

/// Writes the request and reads its reply, all within `reply_within`.
fn exchange(
    stream: &mut TcpStream,
    addr: SocketAddr,
    payload: &[u8],
    reply_within: Duration,
) -> Result<Response> {
    let deadline = deadline_after(reply_within);
    let timed_out = || Error::Timeout {
        what: format!("a reply from the store at {addr}"),
        after: reply_within,
        missing: Vec::new(),
    };
    write_frame(stream, payload, &[], deadline).map_err(|e| {
        if is_timeout(&e) {
            timed_out()
        } else {
            Error::io(format!("sending a request to the store at {addr}"), e)
        }
    })?;
    let context = || format!("reading a reply from the store at {addr}");
    match read_frame(stream, deadline) {
        Ok(Some(frame)) => Response::decode(&frame).map_err(|e| Error::Protocol(sanitize(&e))),
        Ok(None) => Err(Error::Io {
            context: context(),
            message: "the store closed the connection".into(),
        }),
        Err(FrameError::Io(e)) if is_timeout(&e) => Err(timed_out()),
        Err(FrameError::Io(e)) => Err(Error::io(context(), e)),
        Err(FrameError::TooLarge(len)) => Err(Error::Protocol(format!(
            "a reply of {len} bytes exceeds the limit of {} bytes",
            codec::MAX_FRAME
        ))),
    }
}

//! The client's side of a connection: connecting with retries, one request and its
//! reply at a time, and a connection that stays broken once it falls out of step.

use std::io;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::{Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use crate::{Error, Result};

use super::unexpected;
use super::wire::{self, read_frame, write_frame, FrameError, Request, Response};

/// One connection to the server; requests take turns on it.
pub(super) struct Client {
    conn: Mutex<Conn>,
    pub(super) addr: SocketAddr,
    pub(super) world_size: usize,
}

struct Conn {
    stream: TcpStream,
    /// Why the connection is unusable, once it is: after a lost connection, a timed-out
    /// reply or a malformed one, the stream is no longer in step with the server.
    broken: Option<String>,
}

impl Client {
    /// Connects to the first of `addrs` that answers, retrying until `timeout`.
    pub(super) fn connect(
        name: &str,
        addrs: impl ToSocketAddrs,
        timeout: Duration,
    ) -> Result<Client> {
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

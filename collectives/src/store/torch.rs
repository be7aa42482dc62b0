//! A client of PyTorch's c10d `TCPStore`: the store `torchrun`'s elastic agent serves at
//! `MASTER_ADDR:MASTER_PORT` for its workers (`TORCHELASTIC_USE_AGENT_STORE=True`).
//!
//! The wire protocol, as verified against torch 2.15's servers (the libuv one, torch's
//! default, and the classic one; both speak it byte for byte alike):
//! - Integers are native-endian (little-endian here): a command is one byte, a string
//!   or a value is a `u64` length and its bytes, a count is a `u64`, `add`'s delta and
//!   every integer reply an `i64`.
//! - A connection starts with `VALIDATE` (0) and the `u32` magic `0x3C85F7CE`; nothing
//!   is answered before it, and the libuv server closes a connection that sends it
//!   twice. Then this client sends `PING` (13) with a `u32` nonce (torch uses its pid)
//!   and the server echoes the nonce: the proof that the peer is a store.
//! - `SET` (1) `key value`, `APPEND` (9) `key value` and `MULTI_SET` (11)
//!   `n (key value)*` have no reply. `ADD` (4) `key delta` replies the new `i64` (the
//!   server wraps on overflow, and closes the connection when the key holds no
//!   integer). `COMPARE_SET` (2) `key expected desired` replies the value now held: an
//!   absent key is set only when `expected` is empty. `CHECK` (5) `n key*` replies
//!   `READY` (0) or `NOT_READY` (1). `GETNUMKEYS` (7) replies an `i64`, `DELETE_KEY` (8)
//!   `key` the `i64` number deleted.
//! - `WAIT` (6) `n key*` is answered `STOP_WAITING` (0) once every key exists; the
//!   timeout is the client's: when it passes, the client sends `CANCEL_WAIT` (12) and
//!   the server answers `WAIT_CANCELED` (1), after a `STOP_WAITING` if the keys arrived
//!   meanwhile. `GET` (3) `key` and `MULTI_GET` (10) `n key*` reply values, but only for
//!   keys that exist (the libuv server answers an empty value for an absent one, the
//!   classic one closes the connection), so a get waits first, as torch's does.
//! - Torch's Python `TCPStore` puts `/` before every key; `PrefixStore(p, store)` puts
//!   `p/` before that. A server closes the connection on anything it cannot parse (an
//!   unknown command, a key longer than [`MAX_KEY_LEN`]).

use std::io;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::{Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use crate::{Error, Result};

use super::escape::quoted_list;
use super::frame::{deadline_after, read_by};
use super::torch_wire::{write_by, Cmd, Io, Msg, MAGIC, MAX_KEY_LEN, NOT_READY, READY};

/// The most bytes a value may have: torch's libuv server closes the connection of a
/// client that sends a longer one (`MAX_PAYLOAD_LEN`), and `SET` has no reply to say so.
pub const MAX_VALUE_LEN: usize = 8 << 20;
/// The most keys one request may name (the libuv server's `MAX_KEY_COUNT`).
pub const MAX_KEYS: usize = 128 * 1024;

/// A value the server takes, or [`Error::InvalidArgument`] before anything is sent.
fn check_value(value: &[u8]) -> Result<()> {
    if value.len() > MAX_VALUE_LEN {
        return Err(Error::InvalidArgument(format!(
            "a {}-byte value for the torch store: its libuv server closes the connection \
             above {MAX_VALUE_LEN} bytes",
            value.len()
        )));
    }
    Ok(())
}

/// One connection to a torch store; requests take turns on it.
pub(super) struct TorchClient {
    conn: Mutex<Conn>,
    pub(super) addr: SocketAddr,
    /// What every key is prefixed with on the wire: `/`, or `/{prefix}/`.
    wire_prefix: String,
    /// The prefix as given (empty for none).
    pub(super) prefix: String,
    /// Bounds every reply that does not wait for keys.
    timeout: Duration,
}

struct Conn {
    stream: TcpStream,
    /// Why the connection is unusable, once it is out of step with the server.
    broken: Option<String>,
}

/// Why one attempt to connect failed.
enum Attempt {
    /// Nothing listens yet, or the connection broke before the ping's echo.
    Retry(String),
    /// A peer that answers, but not as a store.
    Fatal(Error),
}

/// The nonce of the first ping: this process's id, as torch's client sends.
pub(super) fn ping_nonce() -> u32 {
    std::process::id()
}

impl TorchClient {
    /// Connects to the first of `addrs` that answers as a torch store, retrying until
    /// `timeout`: the agent may not serve yet.
    pub(super) fn connect(
        name: &str,
        addrs: impl ToSocketAddrs,
        prefix: &str,
        timeout: Duration,
    ) -> Result<TorchClient> {
        let wire_prefix = if prefix.is_empty() {
            "/".to_owned()
        } else {
            format!("/{prefix}/")
        };
        if wire_prefix.len() >= MAX_KEY_LEN {
            return Err(Error::InvalidArgument(format!(
                "a torch store key prefix of {} bytes leaves no room below its {MAX_KEY_LEN}-byte \
                 key limit",
                prefix.len()
            )));
        }
        let start = Instant::now();
        let mut backoff = Duration::from_millis(5);
        let mut last_error = String::from("no address to try");
        loop {
            let left = timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                return Err(Error::Timeout {
                    what: format!(
                        "connecting to the torch store at {name} (last error: {last_error})"
                    ),
                    after: timeout,
                    missing: Vec::new(),
                });
            }
            match addrs.to_socket_addrs() {
                Ok(resolved) => {
                    for addr in resolved {
                        match handshake(addr, left) {
                            Ok(stream) => {
                                tracing::debug!(%addr, prefix, "connected to a torch store");
                                return Ok(TorchClient {
                                    conn: Mutex::new(Conn {
                                        stream,
                                        broken: None,
                                    }),
                                    addr,
                                    wire_prefix,
                                    prefix: prefix.to_owned(),
                                    timeout,
                                });
                            }
                            Err(Attempt::Fatal(e)) => return Err(e),
                            Err(Attempt::Retry(why)) => last_error = why,
                        }
                    }
                }
                Err(e) => last_error = format!("resolving {name}: {e}"),
            }
            thread::sleep(backoff.min(timeout.saturating_sub(start.elapsed())));
            backoff = (backoff * 2).min(Duration::from_millis(200));
        }
    }

    /// `key` as it travels: prefixed, and no longer than the server reads.
    fn wire_key(&self, key: &str) -> Result<String> {
        let wire = format!("{}{key}", self.wire_prefix);
        if wire.len() > MAX_KEY_LEN {
            return Err(Error::InvalidArgument(format!(
                "the torch store key {} is {} bytes with its prefix, more than the \
                 {MAX_KEY_LEN} its server reads",
                super::Quoted(key),
                wire.len()
            )));
        }
        Ok(wire)
    }

    fn wire_keys(&self, keys: &[&str]) -> Result<Vec<String>> {
        if keys.len() > MAX_KEYS {
            return Err(Error::InvalidArgument(format!(
                "{} keys in one torch store request: its libuv server closes the connection \
                 above {MAX_KEYS}",
                keys.len()
            )));
        }
        keys.iter().map(|k| self.wire_key(k)).collect()
    }

    /// Runs `f` on the connection unless it is broken; an error of `f` breaks it.
    fn with_conn<T>(&self, op: &str, f: impl FnOnce(&mut Io<'_>) -> Result<T>) -> Result<T> {
        let mut conn = self.conn.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(why) = &conn.broken {
            return Err(Error::Io {
                context: format!("{op} on the torch store at {}", self.addr),
                message: format!("the connection is unusable: {why}"),
            });
        }
        let mut io = Io {
            stream: &mut conn.stream,
            addr: self.addr,
            op,
            timeout: self.timeout,
        };
        let result = f(&mut io);
        if let Err(e) = &result {
            conn.broken = Some(e.to_string());
        }
        result
    }

    /// `SET`: no reply.
    pub(super) fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        check_value(value)?;
        let msg = Msg::new(Cmd::Set)
            .bytes(self.wire_key(key)?.as_bytes())
            .bytes(value);
        self.with_conn("set", |io| io.send(&msg))
    }

    /// `COMPARE_SET`: the value the key holds afterwards (`desired` when it was set).
    pub(super) fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>> {
        check_value(expected)?;
        check_value(desired)?;
        let msg = Msg::new(Cmd::CompareSet)
            .bytes(self.wire_key(key)?.as_bytes())
            .bytes(expected)
            .bytes(desired);
        self.with_conn("compare_set", |io| {
            io.send(&msg)?;
            io.value()
        })
    }

    /// `ADD`: the new value.
    pub(super) fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let msg = Msg::new(Cmd::Add)
            .bytes(self.wire_key(key)?.as_bytes())
            .i64(delta);
        self.with_conn("add", |io| {
            io.send(&msg)?;
            io.i64()
        })
    }

    /// `CHECK`: whether every key exists.
    pub(super) fn check(&self, keys: &[&str]) -> Result<bool> {
        let msg = Msg::new(Cmd::Check).keys(&self.wire_keys(keys)?);
        self.with_conn("check", |io| {
            io.send(&msg)?;
            match io.byte()? {
                READY => Ok(true),
                NOT_READY => Ok(false),
                other => Err(Error::Protocol(format!(
                    "the torch store answered check with {other}, not READY (0) or NOT_READY (1)"
                ))),
            }
        })
    }

    /// `DELETE_KEY`: whether the key existed.
    pub(super) fn delete_key(&self, key: &str) -> Result<bool> {
        let msg = Msg::new(Cmd::DeleteKey).bytes(self.wire_key(key)?.as_bytes());
        self.with_conn("delete_key", |io| {
            io.send(&msg)?;
            Ok(io.i64()? > 0)
        })
    }

    /// `GETNUMKEYS`: the keys the whole server holds (all prefixes).
    pub(super) fn num_keys(&self) -> Result<i64> {
        let msg = Msg::new(Cmd::GetNumKeys);
        self.with_conn("num_keys", |io| {
            io.send(&msg)?;
            io.i64()
        })
    }

    /// `MULTI_SET`: no reply.
    pub(super) fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<()> {
        if pairs.len() > MAX_KEYS {
            return Err(Error::InvalidArgument(format!(
                "{} keys in one torch store MULTI_SET: its libuv server closes the connection \
                 above {MAX_KEYS}",
                pairs.len()
            )));
        }
        let mut msg = Msg::new(Cmd::MultiSet).u64(pairs.len() as u64);
        for (key, value) in pairs {
            check_value(value)?;
            msg = msg.bytes(self.wire_key(key)?.as_bytes()).bytes(value);
        }
        self.with_conn("multi_set", |io| io.send(&msg))
    }

    /// Waits up to `timeout` until every key exists: `Ok(true)` then, `Ok(false)` when
    /// the timeout passed first (the wait is cancelled on the server).
    pub(super) fn wait_for(&self, keys: &[&str], timeout: Duration) -> Result<bool> {
        let wire = self.wire_keys(keys)?;
        self.with_conn("wait", |io| io.wait(&wire, timeout))
    }

    /// Waits up to `timeout` for `keys`, then reads their values (`GET`, or `MULTI_GET`
    /// for several); a timeout is [`Error::Timeout`] naming the keys.
    pub(super) fn get_many(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let wire = self.wire_keys(keys)?;
        let op = if keys.len() == 1 { "get" } else { "multi_get" };
        self.with_conn(op, |io| {
            if !io.wait(&wire, timeout)? {
                return Ok(None);
            }
            if let [key] = &wire[..] {
                io.send(&Msg::new(Cmd::Get).bytes(key.as_bytes()))?;
                return Ok(Some(vec![io.value()?]));
            }
            io.send(&Msg::new(Cmd::MultiGet).keys(&wire))?;
            let values = (0..wire.len()).map(|_| io.value()).collect::<Result<_>>()?;
            Ok(Some(values))
        })?
        .ok_or_else(|| Error::Timeout {
            what: format!("torch store {op} of keys {}", quoted_list(keys)),
            after: timeout,
            missing: Vec::new(),
        })
    }
}

/// Connects to `addr`, validates and pings.
fn handshake(addr: SocketAddr, within: Duration) -> Result<TcpStream, Attempt> {
    let retry = |what: &str, e: io::Error| Attempt::Retry(format!("{what} {addr}: {e}"));
    let connect_within = within.max(Duration::from_millis(1));
    let mut stream =
        TcpStream::connect_timeout(&addr, connect_within).map_err(|e| retry("connecting to", e))?;
    stream
        .set_nodelay(true)
        .map_err(|e| retry("configuring", e))?;
    let nonce = ping_nonce();
    let mut hello = vec![Cmd::Validate as u8];
    hello.extend_from_slice(&MAGIC.to_ne_bytes());
    hello.push(Cmd::Ping as u8);
    hello.extend_from_slice(&nonce.to_ne_bytes());
    let deadline = deadline_after(within);
    write_by(&mut stream, &hello, deadline).map_err(|e| retry("greeting", e))?;
    let mut echo = [0u8; 4];
    match read_by(&mut stream, &mut echo, deadline) {
        Ok(true) => {}
        Ok(false) => {
            return Err(Attempt::Retry(format!(
                "{addr} closed the connection before answering the ping"
            )))
        }
        Err(e) => return Err(retry("awaiting the ping's echo from", e)),
    }
    let echo = u32::from_ne_bytes(echo);
    if echo != nonce {
        return Err(Attempt::Fatal(Error::Protocol(format!(
            "{addr} is not a torch store: it echoed ping {nonce} as {echo}"
        ))));
    }
    Ok(stream)
}

//! The bytes of torch's `TCPStore` protocol (see `torch.rs` for what was verified):
//! commands, requests being built, and one operation's reads and writes against its
//! deadlines.

use std::io::{self, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use crate::{Error, Result};

use super::escape::escape_for_log;
use super::frame::{deadline_after, is_timeout, read_by};

/// The magic number that follows `VALIDATE`.
pub(super) const MAGIC: u32 = 0x3C85_F7CE;

/// The longest key (with its prefix) torch's libuv server reads; it closes the
/// connection on a longer one, so this client refuses it first.
pub const MAX_KEY_LEN: usize = 8192;

/// The largest value this client accepts in a reply: a larger length is a broken peer.
const MAX_REPLY_VALUE: u64 = 1 << 30;

/// The commands (`c10d::detail::QueryType`) this client sends.
#[derive(Clone, Copy)]
#[repr(u8)]
pub(super) enum Cmd {
    Validate = 0,
    Set = 1,
    CompareSet = 2,
    Get = 3,
    Add = 4,
    Check = 5,
    Wait = 6,
    GetNumKeys = 7,
    DeleteKey = 8,
    MultiGet = 10,
    MultiSet = 11,
    CancelWait = 12,
    Ping = 13,
}

pub(super) const READY: u8 = 0;
pub(super) const NOT_READY: u8 = 1;
pub(super) const STOP_WAITING: u8 = 0;
pub(super) const WAIT_CANCELED: u8 = 1;

/// A request being built.
pub(super) struct Msg(pub(super) Vec<u8>);

impl Msg {
    pub(super) fn new(cmd: Cmd) -> Msg {
        Msg(vec![cmd as u8])
    }
    pub(super) fn u64(mut self, n: u64) -> Msg {
        self.0.extend_from_slice(&n.to_ne_bytes());
        self
    }
    pub(super) fn i64(mut self, n: i64) -> Msg {
        self.0.extend_from_slice(&n.to_ne_bytes());
        self
    }
    pub(super) fn bytes(self, b: &[u8]) -> Msg {
        let mut m = self.u64(b.len() as u64);
        m.0.extend_from_slice(b);
        m
    }
    pub(super) fn keys(self, keys: &[String]) -> Msg {
        keys.iter()
            .fold(self.u64(keys.len() as u64), |m, k| m.bytes(k.as_bytes()))
    }
}

/// Writes all of `bytes` by `deadline`.
pub(super) fn write_by(
    stream: &mut TcpStream,
    bytes: &[u8],
    deadline: Option<Instant>,
) -> io::Result<()> {
    let mut sent = 0;
    while sent < bytes.len() {
        let left = match deadline {
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(io::ErrorKind::TimedOut.into());
                }
                Some(left.max(Duration::from_millis(1)))
            }
            None => None,
        };
        stream.set_write_timeout(left)?;
        match stream.write(&bytes[sent..]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => sent += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// One operation's view of the connection.
pub(super) struct Io<'a> {
    pub(super) stream: &'a mut TcpStream,
    pub(super) addr: SocketAddr,
    pub(super) op: &'a str,
    pub(super) timeout: Duration,
}

impl Io<'_> {
    pub(super) fn io_error(&self, e: io::Error) -> Error {
        let context = format!("{} on the torch store at {}", self.op, self.addr);
        if is_timeout(&e) {
            return Error::Timeout {
                what: format!("{context}: no reply"),
                after: self.timeout,
                missing: Vec::new(),
            };
        }
        Error::io(context, e)
    }

    pub(super) fn closed(&self) -> Error {
        Error::Io {
            context: format!("{} on the torch store at {}", self.op, self.addr),
            message: "the server closed the connection (a torch store closes it on a \
                      request it cannot serve, such as add to a key that holds no integer)"
                .into(),
        }
    }

    pub(super) fn send(&mut self, msg: &Msg) -> Result<()> {
        write_by(self.stream, &msg.0, deadline_after(self.timeout)).map_err(|e| self.io_error(e))
    }

    /// Fills `buf` by `deadline`; a closed connection is an error.
    pub(super) fn read(&mut self, buf: &mut [u8], deadline: Option<Instant>) -> Result<()> {
        match read_by(self.stream, buf, deadline) {
            Ok(true) => Ok(()),
            Ok(false) => Err(self.closed()),
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Err(self.closed()),
            Err(e) => Err(self.io_error(e)),
        }
    }

    pub(super) fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut buf = [0u8; N];
        self.read(&mut buf, deadline_after(self.timeout))?;
        Ok(buf)
    }

    pub(super) fn byte(&mut self) -> Result<u8> {
        Ok(self.array::<1>()?[0])
    }

    pub(super) fn i64(&mut self) -> Result<i64> {
        Ok(i64::from_ne_bytes(self.array()?))
    }

    /// A `u64` length and that many bytes.
    pub(super) fn value(&mut self) -> Result<Vec<u8>> {
        let len = u64::from_ne_bytes(self.array()?);
        if len > MAX_REPLY_VALUE {
            return Err(Error::Protocol(format!(
                "the torch store sent a {len}-byte value in reply to {}, more than the \
                 {MAX_REPLY_VALUE} this client accepts",
                escape_for_log(self.op)
            )));
        }
        let mut value = vec![0u8; len as usize];
        self.read(&mut value, deadline_after(self.timeout))?;
        Ok(value)
    }

    /// `WAIT` for `keys` up to `timeout`, cancelled on the server when it passes.
    pub(super) fn wait(&mut self, keys: &[String], timeout: Duration) -> Result<bool> {
        self.send(&Msg::new(Cmd::Wait).keys(keys))?;
        let mut reply = [0u8; 1];
        match read_by(self.stream, &mut reply, deadline_after(timeout)) {
            Ok(true) => return self.stop_waiting(reply[0]).map(|()| true),
            Ok(false) => return Err(self.closed()),
            Err(e) if is_timeout(&e) => {}
            Err(e) => return Err(self.io_error(e)),
        }
        self.send(&Msg::new(Cmd::CancelWait))?;
        match self.byte()? {
            WAIT_CANCELED => Ok(false),
            STOP_WAITING => {
                // The keys arrived just before the cancel; its answer follows.
                match self.byte()? {
                    WAIT_CANCELED => Ok(true),
                    other => Err(Error::Protocol(format!(
                        "the torch store answered a cancelled wait with {other}, not \
                         WAIT_CANCELED (1)"
                    ))),
                }
            }
            other => Err(Error::Protocol(format!(
                "the torch store answered a cancelled wait with {other}"
            ))),
        }
    }

    pub(super) fn stop_waiting(&self, reply: u8) -> Result<()> {
        if reply == STOP_WAITING {
            return Ok(());
        }
        Err(Error::Protocol(format!(
            "the torch store answered wait with {reply}, not STOP_WAITING (0)"
        )))
    }
}

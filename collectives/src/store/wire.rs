//! The private message format: length-prefixed frames and the binary encoding of
//! requests and replies.

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
pub(super) fn read_frame(r: &mut impl Read) -> std::result::Result<Option<Vec<u8>>, FrameError> {
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

//! The private message format: the binary encoding of requests and replies, each the
//! payload of one frame ([`super::frame`]).

use std::sync::Arc;
use std::time::Duration;

use crate::{Error, Result};

use super::escape::sanitize;

/// A decoding failure, described for [`Error::Protocol`].
type DecodeResult<T> = std::result::Result<T, String>;

/// The largest payload either side sends or accepts.
pub(super) const MAX_FRAME: usize = 64 << 20;

/// Sent by a client first, so that a peer that is not a store is caught at once. The
/// digit is the protocol's version: version 2 added the token, joins and failures.
const MAGIC: &[u8; 8] = b"ctstore2";

/// The type byte of a set-if-absent request.
pub(super) const SET_IF_ABSENT: u8 = 7;

/// A stored value a reply shares with the server's map, so that many readers of one
/// large value do not each hold a copy of it.
pub(super) type SharedBytes = Arc<dyn AsRef<[u8]> + Send + Sync>;

/// A client's request; keys and values borrow the caller's or the frame's bytes.
#[derive(Debug)]
pub(super) enum Request<'a> {
    /// The first request of every connection; the server serves nothing before it.
    Hello {
        token: Option<&'a [u8]>,
    },
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
    /// Sets `key` unless it exists; the reply is the value it had, if any.
    SetIfAbsent {
        key: &'a str,
        value: &'a [u8],
    },
    /// Registers `rank` of `world_size` under a key set only if absent; `id` tells a
    /// second process claiming the rank from the same one joining again.
    Join {
        rank: u64,
        world_size: u64,
        id: &'a [u8],
    },
    /// Records a failure of the job: every pending and later request is answered with it.
    Fail(Failure),
}

/// Why a store's job failed, as every rank is told; it becomes the same [`Error`] on each.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Failure {
    /// A rendezvous or barrier timed out on some rank.
    Timeout {
        what: String,
        after: Duration,
        missing: Vec<usize>,
    },
    /// A rendezvous mistake: a rank claimed twice, world sizes that disagree.
    Rendezvous { why: String, ranks: Vec<usize> },
}

impl Failure {
    /// The failure an error reports, when it is one that every rank should see.
    pub(super) fn from_error(error: &Error) -> Option<Failure> {
        match error {
            Error::Timeout {
                what,
                after,
                missing,
            } => Some(Failure::Timeout {
                what: what.clone(),
                after: *after,
                missing: missing.clone(),
            }),
            Error::Rendezvous { why, ranks } => Some(Failure::Rendezvous {
                why: why.clone(),
                ranks: ranks.clone(),
            }),
            _ => None,
        }
    }

    /// The failure with its text shown as [`escape_for_log`](super::escape_for_log)
    /// shows it: a peer reported it, and it ends up in every rank's error and logs.
    pub(super) fn sanitized(self) -> Failure {
        match self {
            Failure::Timeout {
                what,
                after,
                missing,
            } => Failure::Timeout {
                what: sanitize(&what),
                after,
                missing,
            },
            Failure::Rendezvous { why, ranks } => Failure::Rendezvous {
                why: sanitize(&why),
                ranks,
            },
        }
    }

    /// The error every rank reports for this failure, its text escaped
    /// ([`sanitized`](Self::sanitized)): it came from a peer.
    pub(super) fn into_error(self) -> Error {
        match self.sanitized() {
            Failure::Timeout {
                what,
                after,
                missing,
            } => Error::Timeout {
                what,
                after,
                missing,
            },
            Failure::Rendezvous { why, ranks } => Error::Rendezvous { why, ranks },
        }
    }
}

/// A server's reply.
pub(super) enum Response {
    Hello {
        world_size: u64,
        /// Whether the server checked the hello's token (it has one).
        token_checked: bool,
        /// How long the server keeps a connection that sends nothing.
        idle_timeout: Duration,
    },
    Unit,
    /// A value: shared with the server's map when sent, owned when received.
    Value(SharedBytes),
    Int(i64),
    Bool(bool),
    /// The wait timed out; these keys were still missing.
    TimedOut(Vec<String>),
    /// The request was well formed but cannot be done (an add to a non-integer).
    Invalid(String),
    /// The request was malformed; the server closes the connection after this.
    Protocol(String),
    /// The hello was refused (a missing or wrong token, or no hello first); the server
    /// closes the connection after this.
    Refused(String),
    /// The server is at its connection limit; it closes the connection after this.
    Busy(String),
    /// Holding the request or its value would exceed the server's byte limit.
    Quota {
        needed: u64,
        held: u64,
        limit: u64,
    },
    /// The job failed; see [`Failure`].
    Failed(Failure),
}

impl std::fmt::Debug for Response {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Response::Hello {
                world_size,
                token_checked,
                idle_timeout,
            } => write!(
                f,
                "Hello {{ world_size: {world_size}, token_checked: {token_checked}, idle_timeout: {idle_timeout:?} }}"
            ),
            Response::Unit => write!(f, "Unit"),
            Response::Value(value) => write!(f, "Value({} bytes)", (**value).as_ref().len()),
            Response::Int(value) => write!(f, "Int({value})"),
            Response::Bool(value) => write!(f, "Bool({value})"),
            Response::TimedOut(keys) => write!(f, "TimedOut({keys:?})"),
            Response::Invalid(message) => write!(f, "Invalid({message:?})"),
            Response::Protocol(message) => write!(f, "Protocol({message:?})"),
            Response::Refused(message) => write!(f, "Refused({message:?})"),
            Response::Busy(message) => write!(f, "Busy({message:?})"),
            Response::Quota {
                needed,
                held,
                limit,
            } => write!(f, "Quota {{ needed: {needed}, held: {held}, limit: {limit} }}"),
            Response::Failed(failure) => write!(f, "Failed({failure:?})"),
        }
    }
}

impl<'a> Request<'a> {
    pub(super) fn encode(&self) -> Result<Vec<u8>> {
        let mut e = Encoder::default();
        match self {
            Request::Hello { token } => {
                e.u8(0);
                e.raw(MAGIC);
                e.u8(u8::from(token.is_some()));
                e.bytes(token.unwrap_or_default());
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
            Request::SetIfAbsent { key, value } => {
                e.u8(SET_IF_ABSENT);
                e.str(key);
                e.bytes(value);
            }
            Request::Join {
                rank,
                world_size,
                id,
            } => {
                e.u8(8);
                e.u64(*rank);
                e.u64(*world_size);
                e.bytes(id);
            }
            Request::Fail(failure) => {
                e.u8(9);
                e.failure(failure);
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
            0 if d.take(MAGIC.len())? == MAGIC => {
                let has_token = d.bool()?;
                let token = d.bytes()?;
                Request::Hello {
                    token: has_token.then_some(token),
                }
            }
            0 => {
                return Err("the peer is not a store client of this version (bad greeting)".into())
            }
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
            SET_IF_ABSENT => Request::SetIfAbsent {
                key: d.str()?,
                value: d.bytes()?,
            },
            8 => Request::Join {
                rank: d.u64()?,
                world_size: d.u64()?,
                id: d.bytes()?,
            },
            9 => Request::Fail(d.failure()?),
            op => return Err(format!("unknown request type {op}")),
        };
        d.end()?;
        Ok(request)
    }
}

impl Response {
    /// The reply's payload as a head and a tail (a value's bytes, shared rather than
    /// copied); the frame is the two together.
    pub(super) fn encode(&self) -> DecodeResult<(Vec<u8>, &[u8])> {
        let mut e = Encoder::default();
        let mut tail: &[u8] = &[];
        match self {
            Response::Hello {
                world_size,
                token_checked,
                idle_timeout,
            } => {
                e.u8(0);
                e.raw(MAGIC);
                e.u64(*world_size);
                e.u8(u8::from(*token_checked));
                e.duration(*idle_timeout);
            }
            Response::Unit => e.u8(1),
            Response::Value(value) => {
                tail = (**value).as_ref();
                e.u8(2);
                e.u32(tail.len());
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
            Response::Refused(message) => {
                e.u8(8);
                e.str(message);
            }
            Response::Busy(message) => {
                e.u8(9);
                e.str(message);
            }
            Response::Quota {
                needed,
                held,
                limit,
            } => {
                e.u8(10);
                e.u64(*needed);
                e.u64(*held);
                e.u64(*limit);
            }
            Response::Failed(failure) => {
                e.u8(11);
                e.failure(failure);
            }
        }
        match e.finish() {
            Some(head) if head.len() + tail.len() <= MAX_FRAME => Ok((head, tail)),
            _ => Err(format!("a reply larger than {MAX_FRAME} bytes")),
        }
    }

    pub(super) fn decode(frame: &[u8]) -> DecodeResult<Response> {
        let mut d = Decoder { buf: frame };
        let response = match d.u8()? {
            0 => {
                if d.take(MAGIC.len())? != MAGIC {
                    return Err("the peer is not a store of this version (bad greeting)".into());
                }
                Response::Hello {
                    world_size: d.u64()?,
                    token_checked: d.bool()?,
                    idle_timeout: d.duration()?,
                }
            }
            1 => Response::Unit,
            2 => Response::Value(Arc::new(d.bytes()?.to_vec())),
            3 => Response::Int(d.u64()? as i64),
            4 => Response::Bool(d.bool()?),
            5 => Response::TimedOut(d.strs()?.into_iter().map(str::to_owned).collect()),
            6 => Response::Invalid(d.str()?.to_owned()),
            7 => Response::Protocol(d.str()?.to_owned()),
            8 => Response::Refused(d.str()?.to_owned()),
            9 => Response::Busy(d.str()?.to_owned()),
            10 => Response::Quota {
                needed: d.u64()?,
                held: d.u64()?,
                limit: d.u64()?,
            },
            11 => Response::Failed(d.failure()?),
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
    fn ranks(&mut self, ranks: &[usize]) {
        self.u32(ranks.len());
        for &rank in ranks {
            self.u64(rank as u64);
        }
    }
    fn failure(&mut self, failure: &Failure) {
        match failure {
            Failure::Timeout {
                what,
                after,
                missing,
            } => {
                self.u8(0);
                self.str(what);
                self.duration(*after);
                self.ranks(missing);
            }
            Failure::Rendezvous { why, ranks } => {
                self.u8(1);
                self.str(why);
                self.ranks(ranks);
            }
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
    fn bool(&mut self) -> DecodeResult<bool> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(format!("a boolean byte of {b}")),
        }
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
    /// A count of items that each take at least `min_size` bytes, checked against what
    /// is left before anything is allocated for them.
    fn count(&mut self, min_size: usize) -> DecodeResult<usize> {
        let count = self.u32()?;
        if count > self.buf.len() / min_size {
            return Err(format!(
                "a list of {count} items in {} bytes",
                self.buf.len()
            ));
        }
        Ok(count)
    }
    fn strs(&mut self) -> DecodeResult<Vec<&'a str>> {
        let count = self.count(4)?;
        (0..count).map(|_| self.str()).collect()
    }
    fn ranks(&mut self) -> DecodeResult<Vec<usize>> {
        let count = self.count(8)?;
        (0..count)
            .map(|_| {
                let rank = self.u64()?;
                usize::try_from(rank).map_err(|_| format!("a rank of {rank}"))
            })
            .collect()
    }
    fn failure(&mut self) -> DecodeResult<Failure> {
        Ok(match self.u8()? {
            0 => Failure::Timeout {
                what: self.str()?.to_owned(),
                after: self.duration()?,
                missing: self.ranks()?,
            },
            1 => Failure::Rendezvous {
                why: self.str()?.to_owned(),
                ranks: self.ranks()?,
            },
            kind => return Err(format!("unknown failure type {kind}")),
        })
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

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(request: &Request<'_>) -> String {
        let frame = request.encode().expect("encodes");
        format!("{:?}", Request::decode(&frame).expect("decodes"))
    }

    #[test]
    fn requests_survive_a_round_trip() {
        let failure = Failure::Timeout {
            what: "barrier".into(),
            after: Duration::from_millis(1500),
            missing: vec![2, 5],
        };
        let cases = [
            Request::Hello { token: None },
            Request::Hello {
                token: Some(b"secret"),
            },
            Request::Join {
                rank: 3,
                world_size: 8,
                id: b"id",
            },
            Request::SetIfAbsent {
                key: "k",
                value: b"v",
            },
            Request::Fail(failure),
        ];
        for request in &cases {
            assert_eq!(round_trip(request), format!("{request:?}"));
        }
    }

    #[test]
    fn replies_survive_a_round_trip() {
        let value: SharedBytes = Arc::new(b"abc".to_vec());
        let cases = [
            Response::Hello {
                world_size: 4,
                token_checked: true,
                idle_timeout: Duration::from_secs(120),
            },
            Response::Value(value),
            Response::Quota {
                needed: 10,
                held: 20,
                limit: 25,
            },
            Response::Failed(Failure::Rendezvous {
                why: "two processes claim rank 1".into(),
                ranks: vec![1],
            }),
        ];
        for response in &cases {
            let (head, tail) = response.encode().expect("encodes");
            let frame = [head, tail.to_vec()].concat();
            let decoded = Response::decode(&frame).expect("decodes");
            assert_eq!(format!("{decoded:?}"), format!("{response:?}"));
        }
    }

    #[test]
    fn a_rank_list_longer_than_its_frame_is_refused_before_allocating() {
        // A failure claiming 2^32 - 1 missing ranks in a few bytes.
        let mut frame = vec![9, 0];
        frame.extend_from_slice(&0u32.to_be_bytes()); // empty `what`
        frame.extend_from_slice(&0u64.to_be_bytes()); // `after`
        frame.extend_from_slice(&u32::MAX.to_be_bytes());
        let error = Request::decode(&frame).expect_err("a list longer than its frame");
        assert!(error.contains("a list of 4294967295 items"), "{error}");
    }
}

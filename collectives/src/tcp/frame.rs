//! The wire format of the TCP backend: the hello that opens each connection, and the
//! fixed-size header in front of every frame's payload.
//!
//! A frame is a [`HEADER_LEN`]-byte little-endian header and `count` elements of
//! `dtype` as little-endian bytes (the payload's length follows from the header, which
//! is checked against [`MAX_FRAME_BYTES`] before anything is allocated).

use crate::{DType, Error, Result};
use std::io::{Read, Write};

/// Bytes of a frame header.
pub(crate) const HEADER_LEN: usize = 56;

/// The largest payload a frame may announce: larger is a protocol error (a corrupt
/// stream), refused before allocating.
pub(crate) const MAX_FRAME_BYTES: u64 = 1 << 40;

/// The first bytes of a hello and of its answer.
const MAGIC: &[u8; 8] = b"LRTCPv01";

/// The longest job check value a hello may carry.
const MAX_CHECK_LEN: usize = 256;

/// What a frame is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FrameKind {
    /// A collective's message: `key` is the collective's sequence number.
    Coll = 1,
    /// A point-to-point message: `key` is the tag, `desc` the message id.
    P2pData = 2,
    /// A receiver's answer to a point-to-point message: `coll` is 0 (taken) or 1
    /// (mismatch: `total` and `aux` hold the receiver's length and type).
    P2pAck = 3,
}

/// A frame header (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Header {
    pub kind: FrameKind,
    pub dtype: DType,
    /// The collective's kind (see `ops::Coll`), or an ack's status.
    pub coll: u8,
    /// The collective's phase.
    pub phase: u8,
    /// The number of buffers of the collective.
    pub parts: u32,
    /// The group (world 0, subgroups their id).
    pub group: u64,
    /// Sequence number of a collective, or tag of a point-to-point message.
    pub key: u64,
    /// The collective's parameters (op, root, ...), or a message id.
    pub desc: u64,
    /// The length of the whole buffer the payload belongs to.
    pub total: u64,
    /// Which buffer of the collective.
    pub part: u32,
    /// An ack's receiver type code.
    pub aux: u32,
    /// Elements in the payload.
    pub count: u64,
}

impl Header {
    /// A header of `kind` with every other field zero (an empty `U8` payload).
    pub fn new(kind: FrameKind, group: u64, key: u64) -> Header {
        Header {
            kind,
            dtype: DType::U8,
            coll: 0,
            phase: 0,
            parts: 0,
            group,
            key,
            desc: 0,
            total: 0,
            part: 0,
            aux: 0,
            count: 0,
        }
    }

    /// Bytes of the payload that follows.
    pub fn payload_bytes(&self) -> u64 {
        self.count.saturating_mul(self.dtype.size() as u64)
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0] = self.kind as u8;
        b[1] = dtype_code(self.dtype);
        b[2] = self.coll;
        b[3] = self.phase;
        b[4..8].copy_from_slice(&self.parts.to_le_bytes());
        b[8..16].copy_from_slice(&self.group.to_le_bytes());
        b[16..24].copy_from_slice(&self.key.to_le_bytes());
        b[24..32].copy_from_slice(&self.desc.to_le_bytes());
        b[32..40].copy_from_slice(&self.total.to_le_bytes());
        b[40..44].copy_from_slice(&self.part.to_le_bytes());
        b[44..48].copy_from_slice(&self.aux.to_le_bytes());
        b[48..56].copy_from_slice(&self.count.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Header> {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        let kind = match b[0] {
            1 => FrameKind::Coll,
            2 => FrameKind::P2pData,
            3 => FrameKind::P2pAck,
            k => return Err(Error::Protocol(format!("unknown TCP frame kind {k}"))),
        };
        let h = Header {
            kind,
            dtype: dtype_from(b[1])?,
            coll: b[2],
            phase: b[3],
            parts: u32_at(4),
            group: u64_at(8),
            key: u64_at(16),
            desc: u64_at(24),
            total: u64_at(32),
            part: u32_at(40),
            aux: u32_at(44),
            count: u64_at(48),
        };
        if h.payload_bytes() > MAX_FRAME_BYTES {
            return Err(Error::Protocol(format!(
                "a TCP frame announces {} elements of {:?}, more than {MAX_FRAME_BYTES} bytes",
                h.count, h.dtype
            )));
        }
        Ok(h)
    }
}

/// The wire code of a type.
pub(crate) fn dtype_code(d: DType) -> u8 {
    match d {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
        DType::F64 => 3,
        DType::U8 => 4,
    }
}

/// The type of a wire code.
pub(crate) fn dtype_from(code: u8) -> Result<DType> {
    Ok(match code {
        0 => DType::F32,
        1 => DType::F16,
        2 => DType::BF16,
        3 => DType::F64,
        4 => DType::U8,
        c => {
            return Err(Error::Protocol(format!(
                "unknown dtype code {c} in a TCP frame"
            )))
        }
    })
}

/// What a connecting rank says first, and what the accepting rank answers: the rank,
/// the world size and the job check value (which only ranks of this group read from the
/// store).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Hello {
    pub rank: u64,
    pub world_size: u64,
    pub check: Vec<u8>,
}

/// The answer to a hello: accepted (with the acceptor's own hello) or refused, why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Answer {
    Accepted(Hello),
    Refused(String),
}

impl Hello {
    pub fn write_to(&self, w: &mut impl Write) -> std::io::Result<()> {
        w.write_all(&self.encode())
    }

    fn encode(&self) -> Vec<u8> {
        let check = &self.check[..self.check.len().min(MAX_CHECK_LEN)];
        let mut b = Vec::with_capacity(26 + check.len());
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&self.rank.to_le_bytes());
        b.extend_from_slice(&self.world_size.to_le_bytes());
        b.extend_from_slice(&(check.len() as u16).to_le_bytes());
        b.extend_from_slice(check);
        b
    }

    /// Reads a hello; anything that is not one is [`Error::Protocol`].
    pub fn read_from(r: &mut impl Read) -> Result<Hello> {
        let mut head = [0u8; 26];
        r.read_exact(&mut head)
            .map_err(|e| Error::io("reading a TCP group hello", e))?;
        if &head[..8] != MAGIC {
            return Err(Error::Protocol(
                "a connection to a TCP group listener did not start with its hello".into(),
            ));
        }
        let mut w = [0u8; 8];
        w.copy_from_slice(&head[8..16]);
        let rank = u64::from_le_bytes(w);
        w.copy_from_slice(&head[16..24]);
        let world_size = u64::from_le_bytes(w);
        let len = u16::from_le_bytes([head[24], head[25]]) as usize;
        if len > MAX_CHECK_LEN {
            return Err(Error::Protocol(format!(
                "a TCP group hello carries a check value of {len} bytes, at most {MAX_CHECK_LEN}"
            )));
        }
        let mut check = vec![0u8; len];
        r.read_exact(&mut check)
            .map_err(|e| Error::io("reading a TCP group hello", e))?;
        Ok(Hello {
            rank,
            world_size,
            check,
        })
    }
}

impl Answer {
    pub fn write_to(&self, w: &mut impl Write) -> std::io::Result<()> {
        match self {
            Answer::Accepted(h) => {
                w.write_all(&[0])?;
                h.write_to(w)
            }
            Answer::Refused(why) => {
                let why = &why.as_bytes()[..why.len().min(MAX_CHECK_LEN)];
                w.write_all(&[1])?;
                w.write_all(&(why.len() as u16).to_le_bytes())?;
                w.write_all(why)
            }
        }
    }

    pub fn read_from(r: &mut impl Read) -> Result<Answer> {
        let mut status = [0u8; 1];
        r.read_exact(&mut status)
            .map_err(|e| Error::io("reading a TCP group peer's answer to a hello", e))?;
        match status[0] {
            0 => Ok(Answer::Accepted(Hello::read_from(r)?)),
            1 => {
                let mut len = [0u8; 2];
                r.read_exact(&mut len)
                    .map_err(|e| Error::io("reading a TCP group refusal", e))?;
                let len = (u16::from_le_bytes(len) as usize).min(MAX_CHECK_LEN);
                let mut why = vec![0u8; len];
                r.read_exact(&mut why)
                    .map_err(|e| Error::io("reading a TCP group refusal", e))?;
                Ok(Answer::Refused(String::from_utf8_lossy(&why).into_owned()))
            }
            s => Err(Error::Protocol(format!(
                "a TCP group peer answered a hello with status {s}"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_and_hellos_round_trip() {
        let h = Header {
            kind: FrameKind::Coll,
            dtype: DType::BF16,
            coll: 3,
            phase: 1,
            parts: 2,
            group: 0xdead_beef,
            key: 7,
            desc: 9,
            total: 11,
            part: 1,
            aux: 4,
            count: 5,
        };
        assert_eq!(Header::decode(&h.encode()).unwrap(), h);
        let mut bad = h.encode();
        bad[0] = 9;
        assert!(matches!(Header::decode(&bad), Err(Error::Protocol(_))));
        let mut huge = h;
        huge.count = u64::MAX;
        assert!(matches!(
            Header::decode(&huge.encode()),
            Err(Error::Protocol(_))
        ));

        let hello = Hello {
            rank: 3,
            world_size: 4,
            check: b"secret".to_vec(),
        };
        let mut wire = Vec::new();
        Answer::Accepted(hello.clone()).write_to(&mut wire).unwrap();
        Answer::Refused("no".into()).write_to(&mut wire).unwrap();
        let mut r = &wire[..];
        assert_eq!(Answer::read_from(&mut r).unwrap(), Answer::Accepted(hello));
        assert_eq!(
            Answer::read_from(&mut r).unwrap(),
            Answer::Refused("no".into())
        );
        assert!(matches!(
            Hello::read_from(&mut &b"GET / HTTP/1.1\r\n\r\n.........."[..]),
            Err(Error::Protocol(_))
        ));
    }
}

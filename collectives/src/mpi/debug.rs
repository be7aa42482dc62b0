//! Operation descriptors: what the debug mode exchanges before each operation, so that
//! ranks which issue different collectives (or the same one on different buffers) fail
//! with [`Error::Mismatch`] naming both operations instead of corrupting data or hanging.

use crate::{Buffer, DType, Error, ReduceOp};

/// Words per descriptor on the wire.
pub(super) const WORDS: usize = 9;

/// The collective a descriptor describes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    AllReduce,
    Coalesced,
    Broadcast,
    AllGather,
    ReduceScatter,
    Barrier,
    NewGroup,
}

const KINDS: [Kind; 7] = [
    Kind::AllReduce,
    Kind::Coalesced,
    Kind::Broadcast,
    Kind::AllGather,
    Kind::ReduceScatter,
    Kind::Barrier,
    Kind::NewGroup,
];
const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];
/// Wire codes of the types (index + 1): new types go at the end, so codes stay put.
const DTYPES: [DType; 5] = [DType::F32, DType::F16, DType::BF16, DType::F64, DType::U8];

/// One operation as every rank must issue it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Desc {
    kind: Kind,
    op: Option<ReduceOp>,
    root: Option<usize>,
    /// The buffer's type, for single-buffer operations.
    dtype: Option<DType>,
    /// Elements (all buffers together), or ranks for `new_group`.
    len: usize,
    /// Buffers of a coalesced all-reduce.
    parts: usize,
    /// A digest of each buffer's type and length, or of the rank list of `new_group`.
    digest: u64,
    /// A reduction through MPI's own operations rather than the deterministic ones.
    native: bool,
}

impl Desc {
    /// A single-buffer collective.
    pub(super) fn one(kind: Kind, op: Option<ReduceOp>, root: Option<usize>, buf: &Buffer) -> Desc {
        Desc {
            kind,
            op,
            root,
            dtype: Some(buf.dtype()),
            len: buf.len(),
            parts: 1,
            digest: 0,
            native: false,
        }
    }

    /// The same descriptor for a reduction through MPI's own operations (`on`) or the
    /// deterministic ones: ranks that chose differently would pair different collectives.
    pub(super) fn native(mut self, on: bool) -> Desc {
        self.native = on;
        self
    }

    /// A coalesced all-reduce.
    pub(super) fn coalesced(op: ReduceOp, bufs: &[Buffer]) -> Desc {
        let words = bufs
            .iter()
            .flat_map(|b| [dtype_code(Some(b.dtype())), b.len() as u64]);
        Desc {
            kind: Kind::Coalesced,
            op: Some(op),
            root: None,
            dtype: None,
            len: bufs.iter().map(Buffer::len).sum(),
            parts: bufs.len(),
            digest: fnv1a(words),
            native: false,
        }
    }

    /// A barrier.
    pub(super) fn barrier() -> Desc {
        Desc {
            kind: Kind::Barrier,
            op: None,
            root: None,
            dtype: None,
            len: 0,
            parts: 0,
            digest: 0,
            native: false,
        }
    }

    /// A `new_group` call with this list of ranks.
    pub(super) fn new_group(ranks: &[usize]) -> Desc {
        Desc {
            kind: Kind::NewGroup,
            op: None,
            root: None,
            dtype: None,
            len: ranks.len(),
            parts: 0,
            digest: fnv1a(ranks.iter().map(|&r| r as u64)),
            native: false,
        }
    }

    /// The wire form, with the operation's sequence number on its communicator.
    pub(super) fn encode(&self, seq: u64) -> [u64; WORDS] {
        [
            seq,
            KINDS.iter().position(|&k| k == self.kind).unwrap_or(0) as u64,
            self.op
                .and_then(|o| OPS.iter().position(|&x| x == o))
                .map_or(0, |i| i as u64 + 1),
            self.root.map_or(0, |r| r as u64 + 1),
            dtype_code(self.dtype),
            self.len as u64,
            self.parts as u64,
            self.digest,
            u64::from(self.native),
        ]
    }

    /// The sequence number and descriptor from their wire form (`None` for garbage).
    fn decode(w: &[u64]) -> Option<(u64, Desc)> {
        let index = |code: u64| usize::try_from(code).ok();
        let optional = |code: u64| code.checked_sub(1).and_then(index);
        Some((
            w[0],
            Desc {
                kind: *KINDS.get(index(w[1])?)?,
                op: match optional(w[2]) {
                    Some(i) => Some(*OPS.get(i)?),
                    None => None,
                },
                root: optional(w[3]),
                dtype: match optional(w[4]) {
                    Some(i) => Some(*DTYPES.get(i)?),
                    None => None,
                },
                len: index(w[5])?,
                parts: index(w[6])?,
                digest: w[7],
                native: match w[8] {
                    0 => false,
                    1 => true,
                    _ => return None,
                },
            },
        ))
    }
}

impl std::fmt::Display for Desc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.fmt_op(f)?;
        match self.kind {
            Kind::AllReduce | Kind::Coalesced | Kind::ReduceScatter if self.native => {
                write!(f, " (native MPI reduction)")
            }
            Kind::AllReduce | Kind::Coalesced | Kind::ReduceScatter => {
                write!(f, " (deterministic)")
            }
            _ => Ok(()),
        }
    }
}

impl Desc {
    fn fmt_op(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let dtype = self.dtype.map_or(String::new(), |d| format!("{d:?} x "));
        match self.kind {
            Kind::AllReduce => write!(
                f,
                "all_reduce({:?}, {dtype}{})",
                self.op.unwrap_or(ReduceOp::Sum),
                self.len
            ),
            Kind::Coalesced => write!(
                f,
                "all_reduce_coalesced({:?}, {} buffers, {} elements, layout {:016x})",
                self.op.unwrap_or(ReduceOp::Sum),
                self.parts,
                self.len,
                self.digest
            ),
            Kind::Broadcast => write!(
                f,
                "broadcast(root {}, {dtype}{})",
                self.root.unwrap_or(0),
                self.len
            ),
            Kind::AllGather => write!(f, "all_gather({dtype}{})", self.len),
            Kind::ReduceScatter => write!(
                f,
                "reduce_scatter({:?}, {dtype}{})",
                self.op.unwrap_or(ReduceOp::Sum),
                self.len
            ),
            Kind::Barrier => write!(f, "barrier()"),
            Kind::NewGroup => write!(
                f,
                "new_group({} ranks, list {:016x})",
                self.len, self.digest
            ),
        }
    }
}

/// Compares every rank's descriptor (`all` holds [`WORDS`] per rank, in rank order) with
/// rank 0's; the error names rank 0's operation and the first one that differs, so every
/// rank reports the same text.
pub(super) fn compare(all: &[u64]) -> Result<(), Error> {
    let describe = |rank: usize, w: &[u64]| match Desc::decode(w) {
        Some((seq, d)) => format!("rank {rank} issued {d} as its operation #{seq}"),
        None => format!("rank {rank} sent an unreadable descriptor {w:?}"),
    };
    let mut ranks = all.chunks_exact(WORDS).enumerate();
    let Some((_, first)) = ranks.next() else {
        return Ok(());
    };
    match ranks.find(|(_, w)| w != &first) {
        None => Ok(()),
        Some((rank, w)) => Err(Error::Mismatch(format!(
            "{}, but {}; the operation was skipped on every rank",
            describe(0, first),
            describe(rank, w)
        ))),
    }
}

/// The wire code of a type (`0` for none), as descriptors and point-to-point headers
/// carry it.
pub(super) fn dtype_code(d: Option<DType>) -> u64 {
    d.and_then(|d| DTYPES.iter().position(|&x| x == d))
        .map_or(0, |i| i as u64 + 1)
}

/// The type of a wire code from [`dtype_code`] (`None` for `0` or garbage).
pub(super) fn dtype_of_code(code: u64) -> Option<DType> {
    let i = usize::try_from(code.checked_sub(1)?).ok()?;
    DTYPES.get(i).copied()
}

/// FNV-1a over 64-bit words: stable across processes and builds, unlike `std`'s hasher.
fn fnv1a(words: impl Iterator<Item = u64>) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for w in words {
        for b in w.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_codes_round_trip_and_stay_put() {
        for (i, d) in DTYPES.iter().enumerate() {
            assert_eq!(dtype_code(Some(*d)), i as u64 + 1);
            assert_eq!(dtype_of_code(dtype_code(Some(*d))), Some(*d));
        }
        assert_eq!(dtype_code(Some(DType::F32)), 1);
        assert_eq!(dtype_code(Some(DType::U8)), 5);
        assert_eq!(dtype_of_code(0), None);
        assert_eq!(dtype_of_code(6), None);
        assert_eq!(dtype_of_code(u64::MAX), None);
    }

    #[test]
    fn descriptors_round_trip_and_mismatches_name_both_operations() {
        let a = Desc::one(
            Kind::AllReduce,
            Some(ReduceOp::Avg),
            None,
            &Buffer::F32(vec![0.0; 8]),
        );
        let b = Desc::one(
            Kind::Broadcast,
            None,
            Some(1),
            &Buffer::BF16(vec![half::bf16::ZERO; 8]),
        );
        let native = a.clone().native(true);
        for d in [&a, &b, &native, &Desc::barrier(), &Desc::new_group(&[2, 0])] {
            assert_eq!(Desc::decode(&d.encode(7)), Some((7, d.clone())));
        }
        let same: Vec<u64> = [a.encode(3), a.encode(3)].concat();
        assert_eq!(compare(&same), Ok(()));
        let differ: Vec<u64> = [a.encode(3), a.encode(3), b.encode(3)].concat();
        let Err(Error::Mismatch(m)) = compare(&differ) else {
            panic!("no mismatch reported");
        };
        assert!(m.contains("rank 0 issued all_reduce(Avg, F32 x 8)"), "{m}");
        assert!(
            m.contains("rank 2 issued broadcast(root 1, BF16 x 8)"),
            "{m}"
        );
        let coalesced = |lens: &[usize]| {
            let bufs: Vec<Buffer> = lens.iter().map(|&n| Buffer::zeros(DType::F32, n)).collect();
            Desc::coalesced(ReduceOp::Sum, &bufs)
        };
        assert_ne!(coalesced(&[1, 2]), coalesced(&[2, 1]));
        // Ranks that chose different reductions would pair different collectives.
        let Err(Error::Mismatch(m)) = compare(&[a.encode(4), native.encode(4)].concat()) else {
            panic!("deterministic vs native is no mismatch");
        };
        assert!(
            m.contains("(deterministic)") && m.contains("(native MPI reduction)"),
            "{m}"
        );
    }
}

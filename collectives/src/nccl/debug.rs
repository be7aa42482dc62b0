//! Debug mode's operation descriptors: before each operation every rank all-gathers a
//! fixed-size descriptor of it, so that ranks calling different operations, or the same
//! one with different buffers, fail with [`Error::Mismatch`] naming both operations
//! instead of corrupting data or hanging (as PyTorch's `TORCH_DISTRIBUTED_DEBUG=DETAIL`).

use crate::{DType, Error, ReduceOp, Result};

/// Words (`u64`) of an encoded descriptor; the all-gather moves `8 * size` of them.
pub(super) const WORDS: usize = 8;
/// The first word of every descriptor: tells one from garbage.
const TAG: u64 = 0x636f_6c6c_2d6e_6363;

/// Which collective, with the arguments every rank must agree on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    AllReduce(ReduceOp),
    Coalesced(ReduceOp),
    Broadcast(usize),
    AllGather,
    ReduceScatter(ReduceOp),
    Barrier,
    /// `new_group`, with a hash of the rank list.
    Split(u64),
}

/// One operation as debug mode compares it: its kind and each buffer's type and length.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Desc {
    pub kind: Kind,
    pub parts: Vec<(DType, usize)>,
}

impl Desc {
    /// The descriptor of an operation on buffers of these types and lengths.
    pub fn new(kind: Kind, parts: impl IntoIterator<Item = (DType, usize)>) -> Desc {
        Desc {
            kind,
            parts: parts.into_iter().collect(),
        }
    }

    /// The operation's name, for messages (`"all_reduce"`).
    pub fn name(&self) -> &'static str {
        kind_name(kind_code(self.kind).0)
    }

    /// The fixed-size form that ranks exchange: tag, kind, kind argument, number of
    /// buffers, first buffer's type, total elements, a hash of every (type, length).
    pub fn encode(&self) -> [u64; WORDS] {
        let (code, arg) = kind_code(self.kind);
        let mut hash = Fnv::new();
        for &(dtype, len) in &self.parts {
            hash.add(dtype_code(dtype));
            hash.add(len as u64);
        }
        [
            TAG,
            code,
            arg,
            self.parts.len() as u64,
            self.parts.first().map_or(0, |&(d, _)| dtype_code(d)),
            self.parts.iter().map(|&(_, n)| n as u64).sum(),
            hash.0,
            0,
        ]
    }
}

impl std::fmt::Display for Desc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&describe(&self.encode()))
    }
}

/// A hash of a `new_group` rank list, so that ranks passing different lists disagree.
pub(super) fn ranks_hash(ranks: &[usize]) -> u64 {
    let mut hash = Fnv::new();
    ranks.iter().for_each(|&r| hash.add(r as u64));
    hash.0
}

/// Compares every rank's descriptor (`all`: `WORDS` words per rank, in rank order) with
/// rank `me`'s; the first that differs is an [`Error::Mismatch`] naming both operations.
/// Every rank sees the same descriptors, so every rank fails alike.
pub(super) fn compare(me: usize, all: &[u64]) -> Result<()> {
    let mine = all.get(me * WORDS..(me + 1) * WORDS).ok_or_else(|| {
        Error::Internal(format!(
            "debug mode: {} descriptor words for rank {me}",
            all.len()
        ))
    })?;
    for (peer, theirs) in all.chunks_exact(WORDS).enumerate() {
        if theirs != mine {
            return Err(Error::Mismatch(format!(
                "rank {me} called {} but rank {peer} called {} (NCCL debug mode)",
                describe(mine),
                describe(theirs)
            )));
        }
    }
    Ok(())
}

/// A descriptor, decoded for a message: `"all_reduce(Sum) of 1 buffer (f32, 10 elements)"`.
fn describe(words: &[u64]) -> String {
    if words.len() != WORDS || words[0] != TAG {
        return "an operation outside debug mode (no descriptor)".into();
    }
    let (code, arg, count, dtype, total, hash) =
        (words[1], words[2], words[3], words[4], words[5], words[6]);
    let name = kind_name(code);
    let head = match code {
        1 | 2 | 5 => format!("{name}({})", op_name(arg)),
        3 => format!("{name}(root {arg})"),
        7 => format!("{name}(ranks hash {arg:#x})"),
        _ => name.to_owned(),
    };
    match count {
        0 => head,
        1 => format!(
            "{head} of 1 buffer ({}, {total} elements)",
            dtype_name(dtype)
        ),
        n => format!(
            "{head} of {n} buffers ({total} elements, first {}, layout hash {hash:#x})",
            dtype_name(dtype)
        ),
    }
}

fn kind_code(kind: Kind) -> (u64, u64) {
    match kind {
        Kind::AllReduce(op) => (1, op_code(op)),
        Kind::Coalesced(op) => (2, op_code(op)),
        Kind::Broadcast(root) => (3, root as u64),
        Kind::AllGather => (4, 0),
        Kind::ReduceScatter(op) => (5, op_code(op)),
        Kind::Barrier => (6, 0),
        Kind::Split(hash) => (7, hash),
    }
}

fn kind_name(code: u64) -> &'static str {
    match code {
        1 => "all_reduce",
        2 => "all_reduce_coalesced",
        3 => "broadcast",
        4 => "all_gather",
        5 => "reduce_scatter",
        6 => "barrier",
        7 => "new_group",
        _ => "an unknown operation",
    }
}

fn op_code(op: ReduceOp) -> u64 {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Avg => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
    }
}

fn op_name(code: u64) -> &'static str {
    ["Sum", "Avg", "Max", "Min"]
        .get(code as usize)
        .copied()
        .unwrap_or("?")
}

fn dtype_code(dtype: DType) -> u64 {
    match dtype {
        DType::F32 => 1,
        DType::F16 => 2,
        DType::BF16 => 3,
        DType::F64 => 4,
    }
}

fn dtype_name(code: u64) -> &'static str {
    match code {
        1 => "f32",
        2 => "f16",
        3 => "bf16",
        4 => "f64",
        _ => "?",
    }
}

/// 64-bit FNV-1a over words: a stable hash, the same on every rank and build.
struct Fnv(u64);

impl Fnv {
    fn new() -> Fnv {
        Fnv(0xcbf2_9ce4_8422_2325)
    }

    fn add(&mut self, word: u64) {
        for byte in word.to_le_bytes() {
            self.0 = (self.0 ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gathered(descs: &[Desc]) -> Vec<u64> {
        descs.iter().flat_map(|d| d.encode()).collect()
    }

    #[test]
    fn equal_descriptors_pass() {
        let d = Desc::new(Kind::AllReduce(ReduceOp::Sum), [(DType::F32, 10)]);
        let all = gathered(&[d.clone(), d.clone(), d]);
        for me in 0..3 {
            assert_eq!(compare(me, &all), Ok(()));
        }
    }

    #[test]
    fn different_operations_are_named_on_every_rank() {
        let a = Desc::new(Kind::AllReduce(ReduceOp::Sum), [(DType::F32, 10)]);
        let b = Desc::new(Kind::Broadcast(1), [(DType::F32, 10)]);
        let all = gathered(&[a, b]);
        for me in 0..2 {
            match compare(me, &all) {
                Err(Error::Mismatch(m)) => {
                    assert!(
                        m.contains("all_reduce(Sum)") && m.contains("broadcast(root 1)"),
                        "{m}"
                    );
                }
                other => panic!("expected a mismatch, got {other:?}"),
            }
        }
    }

    #[test]
    fn lengths_types_and_layouts_are_compared() {
        let base = Desc::new(
            Kind::Coalesced(ReduceOp::Avg),
            [(DType::F16, 4), (DType::F32, 6)],
        );
        let swapped = Desc::new(
            Kind::Coalesced(ReduceOp::Avg),
            [(DType::F16, 6), (DType::F32, 4)],
        );
        let retyped = Desc::new(
            Kind::Coalesced(ReduceOp::Avg),
            [(DType::BF16, 4), (DType::F32, 6)],
        );
        for other in [swapped, retyped] {
            let all = gathered(&[base.clone(), other]);
            assert!(matches!(compare(0, &all), Err(Error::Mismatch(_))));
        }
        assert_eq!(base.name(), "all_reduce_coalesced");
        assert_ne!(ranks_hash(&[0, 1]), ranks_hash(&[1, 0]));
        assert_eq!(
            Desc::new(Kind::Barrier, []).to_string(),
            "barrier",
            "a barrier has no buffers"
        );
    }
}

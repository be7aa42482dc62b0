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
    /// A point-to-point batch (`send`, `recv`, `batch_isend_irecv`): not compared by the
    /// all-gather (only the peers take part) but pairwise, see [`Leg`].
    P2p,
}

/// One operation as debug mode compares it: its kind and each buffer's type and length.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Desc {
    pub kind: Kind,
    pub parts: Vec<(DType, usize)>,
    /// The point-to-point operations of a [`Kind::P2p`] descriptor, in posting order
    /// (empty for collectives).
    pub legs: Vec<Leg>,
}

impl Desc {
    /// The descriptor of an operation on buffers of these types and lengths.
    pub fn new(kind: Kind, parts: impl IntoIterator<Item = (DType, usize)>) -> Desc {
        Desc {
            kind,
            parts: parts.into_iter().collect(),
            legs: Vec::new(),
        }
    }

    /// The descriptor of a point-to-point batch.
    pub fn p2p(legs: Vec<Leg>) -> Desc {
        Desc {
            kind: Kind::P2p,
            parts: legs.iter().map(|l| (l.dtype, l.len)).collect(),
            legs,
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
        Kind::P2p => (8, 0),
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
        8 => "point-to-point",
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
        DType::U8 => 5,
    }
}

fn dtype_name(code: u64) -> &'static str {
    match code {
        1 => "f32",
        2 => "f16",
        3 => "bf16",
        4 => "f64",
        5 => "u8",
        _ => "?",
    }
}

fn code_dtype(code: u64) -> Option<DType> {
    [DType::F32, DType::F16, DType::BF16, DType::F64, DType::U8]
        .into_iter()
        .find(|&d| dtype_code(d) == code)
}

/// One point-to-point operation as debug mode checks it against its peer's.
///
/// NCCL matches sends and receives by posting order per peer and direction, and has no
/// tags. Debug mode exchanges, for every peer of a batch, first a [`header`] (how many
/// sends to and receives from that peer the batch holds), then the [`list`] of their
/// types, lengths and tags, and checks that the `k`-th send of one side meets a `k`-th
/// receive of the same type, length and tag on the other. Both sides see both lists, so
/// both fail alike with [`Error::Mismatch`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Leg {
    /// A send (else a receive).
    pub send: bool,
    /// The peer rank.
    pub peer: usize,
    /// The tag.
    pub tag: u32,
    /// The buffer's type.
    pub dtype: DType,
    /// The buffer's length.
    pub len: usize,
}

/// Words of a point-to-point [`header`].
pub(super) const HEADER_WORDS: usize = 4;
/// Words of one operation in a point-to-point [`list`].
pub(super) const LEG_WORDS: usize = 3;
/// The first word of a point-to-point header.
const P2P_TAG: u64 = 0x636f_6c6c_2d70_3270;

/// The distinct peers of a batch, in order of first appearance.
pub(super) fn peers(legs: &[Leg]) -> Vec<usize> {
    let mut out: Vec<usize> = Vec::new();
    for l in legs {
        if !out.contains(&l.peer) {
            out.push(l.peer);
        }
    }
    out
}

fn count(legs: &[Leg], peer: usize, send: bool) -> u64 {
    legs.iter()
        .filter(|l| l.peer == peer && l.send == send)
        .count() as u64
}

/// What a batch tells `peer` first: how many sends to it and receives from it it holds.
pub(super) fn header(legs: &[Leg], peer: usize) -> [u64; HEADER_WORDS] {
    [
        P2P_TAG,
        count(legs, peer, true),
        count(legs, peer, false),
        0,
    ]
}

/// Checks this rank's header for `peer` against the one `peer` sent: its receives must
/// answer our sends and its sends our receives.
pub(super) fn check_header(me: usize, peer: usize, mine: &[u64], theirs: &[u64]) -> Result<()> {
    if theirs.len() != HEADER_WORDS || theirs[0] != P2P_TAG {
        return Err(Error::Mismatch(format!(
            "rank {me} posted point-to-point operations with rank {peer}, which was in \
             another operation (NCCL debug mode)"
        )));
    }
    if mine.len() != HEADER_WORDS {
        return Err(Error::Internal(format!(
            "debug mode: a header of {} words",
            mine.len()
        )));
    }
    let (sends, recvs) = (mine[1], mine[2]);
    let (their_sends, their_recvs) = (theirs[1], theirs[2]);
    if sends != their_recvs || recvs != their_sends {
        return Err(Error::Mismatch(format!(
            "rank {me} posted {sends} send(s) to and {recvs} receive(s) from rank {peer} in \
             one batch, which posted {their_recvs} receive(s) from and {their_sends} send(s) \
             to rank {me} (NCCL debug mode: the two sides of an exchange must post it in \
             matching batches)"
        )));
    }
    Ok(())
}

/// What a batch tells `peer` next: type, length and tag of each send to it, in order,
/// then of each receive from it.
pub(super) fn list(legs: &[Leg], peer: usize) -> Vec<u64> {
    let mut out = Vec::new();
    for send in [true, false] {
        for l in legs.iter().filter(|l| l.peer == peer && l.send == send) {
            out.extend([dtype_code(l.dtype), l.len as u64, u64::from(l.tag)]);
        }
    }
    out
}

/// Checks this rank's operations with `peer` against the [`list`] `peer` sent (its
/// sends to this rank, then its receives from it; the headers matched, so there are as
/// many as this rank has receives and sends).
pub(super) fn check_list(me: usize, peer: usize, legs: &[Leg], theirs: &[u64]) -> Result<()> {
    let garbled = || Error::Internal(format!("debug mode: a garbled list from rank {peer}"));
    let decode = |w: &[u64]| -> Result<(DType, usize, u32)> {
        let dtype = code_dtype(w[0]).ok_or_else(garbled)?;
        let len = usize::try_from(w[1]).map_err(|_| garbled())?;
        let tag = u32::try_from(w[2]).map_err(|_| garbled())?;
        Ok((dtype, len, tag))
    };
    let mine = |send: bool| {
        legs.iter()
            .filter(move |l| l.peer == peer && l.send == send)
    };
    let (my_sends, my_recvs) = (count(legs, peer, true), count(legs, peer, false));
    if theirs.len() as u64 != (my_sends + my_recvs) * LEG_WORDS as u64 {
        return Err(garbled());
    }
    let (their_sends, their_recvs) = theirs.split_at(my_recvs as usize * LEG_WORDS);
    // Our receives meet their sends; our sends meet their receives.
    let pairs = mine(false)
        .zip(their_sends.chunks_exact(LEG_WORDS))
        .map(|(l, w)| (l, w, false))
        .chain(
            mine(true)
                .zip(their_recvs.chunks_exact(LEG_WORDS))
                .map(|(l, w)| (l, w, true)),
        );
    for (l, w, i_send) in pairs {
        let (dtype, len, tag) = decode(w)?;
        let (src, dst) = if i_send { (me, peer) } else { (peer, me) };
        let (sent, posted) = if i_send {
            ((l.dtype, l.len), (dtype, len))
        } else {
            ((dtype, len), (l.dtype, l.len))
        };
        let (sent_tag, posted_tag) = if i_send { (l.tag, tag) } else { (tag, l.tag) };
        if sent != posted {
            return Err(crate::p2p::mismatch(src, dst, sent_tag, sent, posted));
        }
        if sent_tag != posted_tag {
            return Err(Error::Mismatch(format!(
                "rank {src} sent with tag {sent_tag} to rank {dst}, whose receive in the same \
                 position has tag {posted_tag} (NCCL has no tags and matches by posting \
                 order; NCCL debug mode)"
            )));
        }
    }
    Ok(())
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

    fn leg(send: bool, peer: usize, tag: u32, dtype: DType, len: usize) -> Leg {
        Leg {
            send,
            peer,
            tag,
            dtype,
            len,
        }
    }

    /// Runs both sides' checks of an exchange between ranks 0 and 1.
    fn pair(a: &[Leg], b: &[Leg]) -> (Result<()>, Result<()>) {
        let (ha, hb) = (header(a, 1), header(b, 0));
        let heads = (check_header(0, 1, &ha, &hb), check_header(1, 0, &hb, &ha));
        if heads.0.is_err() || heads.1.is_err() {
            return heads;
        }
        (
            check_list(0, 1, a, &list(b, 0)),
            check_list(1, 0, b, &list(a, 1)),
        )
    }

    #[test]
    fn matching_p2p_batches_pass_on_both_sides() {
        let a = [
            leg(true, 1, 3, DType::F32, 4),
            leg(false, 1, 3, DType::U8, 9),
        ];
        // The other side posts its receive and send in the other order: NCCL matches
        // sends with receives, each direction on its own.
        let b = [
            leg(true, 0, 3, DType::U8, 9),
            leg(false, 0, 3, DType::F32, 4),
        ];
        assert_eq!(pair(&a, &b), (Ok(()), Ok(())));
        assert_eq!(peers(&a), vec![1]);
    }

    #[test]
    fn a_send_to_self_meets_a_receive_from_self() {
        let me = [
            leg(true, 0, 0, DType::F16, 5),
            leg(false, 0, 0, DType::F16, 5),
        ];
        let h = header(&me, 0);
        assert_eq!(check_header(0, 0, &h, &h), Ok(()));
        assert_eq!(check_list(0, 0, &me, &list(&me, 0)), Ok(()));
        let bad = [
            leg(true, 0, 0, DType::F16, 5),
            leg(false, 0, 0, DType::F16, 6),
        ];
        let h = header(&bad, 0);
        assert!(matches!(
            check_list(0, 0, &bad, &list(&bad, 0)),
            Err(Error::Mismatch(_))
        ));
        assert_eq!(check_header(0, 0, &h, &h), Ok(()));
    }

    #[test]
    fn p2p_lengths_types_tags_and_counts_fail_on_both_sides() {
        let send = [leg(true, 1, 2, DType::F32, 4)];
        for recv in [
            leg(false, 0, 2, DType::F32, 5),
            leg(false, 0, 2, DType::F64, 4),
            leg(false, 0, 7, DType::F32, 4),
        ] {
            let (x, y) = pair(&send, &[recv]);
            for r in [x, y] {
                match r {
                    Err(Error::Mismatch(m)) => assert!(m.contains("rank 0"), "{m}"),
                    other => panic!("expected a mismatch, got {other:?}"),
                }
            }
        }
        let two = [
            leg(false, 0, 2, DType::F32, 4),
            leg(false, 0, 2, DType::F32, 4),
        ];
        let (x, y) = pair(&send, &two);
        assert!(matches!(x, Err(Error::Mismatch(_))) && matches!(y, Err(Error::Mismatch(_))));
        let m = crate::p2p::mismatch(0, 1, 2, (DType::F32, 4), (DType::F32, 5));
        assert!(m.to_string().contains("F32 x 4"), "{m}");
    }
}

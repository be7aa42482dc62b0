//! The collectives of the TCP backend, run on a group's progress thread.
//!
//! Every collective is one or two *phases*. In a phase each rank writes one frame per
//! buffer (at least one) to every peer, then reads every peer's: the frames carry the
//! collective's description (kind, parameters, each buffer's type and length), so every
//! rank compares its own with every peer's and a difference fails all of them at once
//! with [`Error::Mismatch`] (a rank that differs from one differs from all the others
//! or is differed from). Writes never wait for a peer's progress thread (its reader
//! threads drain the sockets), so a phase cannot deadlock.
//!
//! `all_reduce` of a buffer over 32 KiB is a reduce-scatter and an all-gather: rank `r`
//! gets chunk `r` of every peer's buffer, reduces it in rank order and sends the result
//! to every peer (`(n-1)/n` of the buffer out and in, twice: a ring's volume). Smaller
//! buffers take one phase: every rank gets every buffer and reduces all of it, in the
//! same order.

use super::frame::{dtype_code, FrameKind, Header};
use super::inbox::{Frame, WaitErr};
use super::reduce::combine_buffers;
pub(crate) use super::spec::{coll, op_code, shape, Spec};
use super::Core;
use crate::{Buffer, DType, Error, ReduceOp, Result};
use std::ops::Range;
use std::time::Instant;

/// Buffers up to this many bytes are all-reduced in one phase.
const SMALL_BYTES: usize = 32 * 1024;

/// A collective in progress on this rank: its group, number and deadline.
pub(crate) struct Run<'a> {
    pub core: &'a Core,
    pub seq: u64,
    pub deadline: Instant,
    pub name: &'static str,
}

impl<'a> Run<'a> {
    pub fn new(core: &'a Core, seq: u64, name: &'static str) -> Run<'a> {
        Run {
            core,
            seq,
            deadline: crate::group::deadline_after(core.timeout),
            name,
        }
    }

    fn lost(&self, world: usize, why: String) -> Error {
        Error::PeerLost {
            rank: self.core.group_rank_of(world),
            why,
        }
    }

    /// Writes this rank's frames of `phase`: for each peer (starting after this rank,
    /// so that ranks do not all write to the same one first), one frame per buffer of
    /// `parts` (or one empty frame when there are none), the payload `payload(peer,
    /// part)`.
    fn send<'b>(
        &self,
        phase: u8,
        spec: &Spec,
        parts: &[usize],
        payload: impl Fn(usize, usize) -> (DType, &'b [u8]),
    ) -> Result<()> {
        let core = self.core;
        let n = core.members.len();
        let mut failed = None;
        for k in 1..n {
            let peer = (core.rank + k) % n;
            let world = core.members[peer];
            let mut h = Header::new(FrameKind::Coll, core.id, self.seq);
            h.coll = spec.coll;
            h.phase = phase;
            h.desc = spec.desc;
            h.parts = spec.parts.len() as u32;
            let frames: Vec<Option<usize>> = if parts.is_empty() {
                vec![None]
            } else {
                parts.iter().map(|&p| Some(p)).collect()
            };
            for p in frames {
                let bytes: &[u8] = match p {
                    Some(p) => {
                        let (dtype, bytes) = payload(peer, p);
                        let (pd, len) = spec.parts[p];
                        h.part = p as u32;
                        h.aux = u32::from(dtype_code(pd));
                        h.total = len as u64;
                        h.dtype = dtype;
                        h.count = (bytes.len() / dtype.size()) as u64;
                        bytes
                    }
                    None => {
                        let (dtype, bytes) = payload(peer, usize::MAX);
                        h.dtype = dtype;
                        h.count = (bytes.len() / dtype.size()) as u64;
                        bytes
                    }
                };
                // A lost peer does not stop the frames to the others: they learn of
                // the loss themselves, rather than of this rank's giving up.
                if let Err(e) = core.shared().write_frame(world, &h, bytes) {
                    failed.get_or_insert(match e {
                        Error::PeerLost { why, .. } => self.lost(world, why),
                        e => e,
                    });
                    break;
                }
            }
        }
        failed.map_or(Ok(()), Err)
    }

    /// Reads every peer's frames of `phase` (as [`send`](Self::send) writes them), in
    /// rank order, checking each against `spec`: `[peer][i]` is peer's frame for
    /// `parts[i]` (or its one empty frame); this rank's own slot is empty.
    fn recv(&self, phase: u8, spec: &Spec, parts: &[usize]) -> Result<Vec<Vec<Frame>>> {
        let core = self.core;
        let n = core.members.len();
        let mut got: Vec<Vec<Frame>> = (0..n).map(|_| Vec::new()).collect();
        let frames = parts.len().max(1);
        for peer in (0..n).filter(|&p| p != core.rank) {
            let world = core.members[peer];
            for i in 0..frames {
                let f = core
                    .shared()
                    .take_coll(
                        (core.id, world, self.seq, phase),
                        self.deadline,
                        &core.closed,
                    )
                    .map_err(|e| match e {
                        WaitErr::Lost(w, why) => self.lost(w, why),
                        WaitErr::Timeout => Error::Timeout {
                            what: format!(
                                "rank {}'s {} (collective #{}) over TCP",
                                core.rank, self.name, self.seq
                            ),
                            after: core.timeout,
                            missing: std::iter::once(peer)
                                .chain((peer + 1..n).filter(|&p| {
                                    p != core.rank
                                        && !core.shared().has_coll((
                                            core.id,
                                            core.members[p],
                                            self.seq,
                                            phase,
                                        ))
                                }))
                                .collect(),
                        },
                        WaitErr::Closed => Error::Gone {
                            what: format!("{}: the TCP group was dropped", self.name),
                        },
                    })?;
                self.check(peer, spec, parts.get(i).copied(), &f)?;
                got[peer].push(f);
            }
        }
        Ok(got)
    }

    /// Compares a peer's frame with this rank's own description.
    fn check(&self, peer: usize, spec: &Spec, part: Option<usize>, f: &Frame) -> Result<()> {
        let h = &f.header;
        let me = self.core.rank;
        if spec.coll == coll::REJECTED {
            return Ok(());
        }
        if h.coll == coll::REJECTED {
            let why = match &f.payload {
                Buffer::U8(b) => String::from_utf8_lossy(b).into_owned(),
                _ => String::new(),
            };
            return Err(Error::Mismatch(format!(
                "rank {peer} rejected its arguments where rank {me} called {}: {}",
                spec.mine(),
                crate::store::escape_for_log(&why)
            )));
        }
        let same_call =
            h.coll == spec.coll && h.desc == spec.desc && h.parts as usize == spec.parts.len();
        let same_part = match part {
            Some(p) => {
                let (d, len) = spec.parts[p];
                h.part as usize == p && h.aux == u32::from(dtype_code(d)) && h.total == len as u64
            }
            None => true,
        };
        if same_call && same_part {
            return Ok(());
        }
        let what = match part {
            Some(p) if same_call => {
                let (d, len) = spec.parts[p];
                format!(
                    "buffer {p}: rank {me} has {d:?} x {len}, rank {peer} {}",
                    shape(h.aux, h.total)
                )
            }
            _ => format!(
                "rank {me} called {}, rank {peer} {}",
                spec.mine(),
                Spec::describe(h.coll, h.desc, h.parts, Some((h.aux, h.total)))
            ),
        };
        Err(Error::Mismatch(format!("{} over TCP: {what}", self.name)))
    }

    /// Hands the payloads of frames that are done with to the mesh's pool.
    fn recycle(&self, got: Vec<Vec<Frame>>) {
        for f in got.into_iter().flatten() {
            self.core.shared().recycle(f.payload);
        }
    }

    /// One phase: [`send`](Self::send), then [`recv`](Self::recv).
    fn phase<'b>(
        &self,
        phase: u8,
        spec: &Spec,
        parts: &[usize],
        payload: impl Fn(usize, usize) -> (DType, &'b [u8]),
    ) -> Result<Vec<Vec<Frame>>> {
        self.send(phase, spec, parts, payload)?;
        self.recv(phase, spec, parts)
    }
}

/// The range of chunk `k` of `n` of a buffer of `len` elements.
fn chunk(len: usize, n: usize, k: usize) -> Range<usize> {
    (len * k / n)..(len * (k + 1) / n)
}

fn bytes_of(b: &Buffer, r: Range<usize>) -> &[u8] {
    let s = b.dtype().size();
    &b.as_bytes()[r.start * s..r.end * s]
}

/// `all_reduce` (`coll` [`coll::ALL_REDUCE`]) and `all_reduce_coalesced`
/// ([`coll::COALESCED`]) of `bufs`, in place.
pub(crate) fn all_reduce(
    run: &Run<'_>,
    coll: u8,
    mut bufs: Vec<Buffer>,
    op: ReduceOp,
) -> Result<Vec<Buffer>> {
    let (me, n) = (run.core.rank, run.core.members.len());
    let spec = Spec {
        coll,
        desc: op_code(op),
        parts: bufs.iter().map(|b| (b.dtype(), b.len())).collect(),
    };
    let small = |b: &Buffer| b.len() * b.dtype().size() <= SMALL_BYTES;
    let all: Vec<usize> = (0..bufs.len()).collect();
    let large: Vec<usize> = all.iter().copied().filter(|&p| !small(&bufs[p])).collect();
    let got = {
        let bufs = &bufs;
        run.phase(0, &spec, &all, |peer, p| {
            // No buffers (an empty coalesced list): one empty frame per peer.
            let Some(b) = bufs.get(p) else {
                return (DType::U8, &[][..]);
            };
            let r = if small(b) {
                0..b.len()
            } else {
                chunk(b.len(), n, peer)
            };
            (b.dtype(), bytes_of(b, r))
        })?
    };
    for (i, b) in bufs.iter_mut().enumerate() {
        let others: Vec<&Buffer> = (0..n)
            .filter(|&k| k != me)
            .map(|k| &got[k][i].payload)
            .collect();
        let r = if small(b) {
            0..b.len()
        } else {
            chunk(b.len(), n, me)
        };
        combine_buffers(b, r, me, &others, op)?;
    }
    run.recycle(got);
    if large.is_empty() {
        return Ok(bufs);
    }
    let got = {
        let bufs = &bufs;
        run.phase(1, &spec, &large, |_, p| {
            let b = &bufs[p];
            (b.dtype(), bytes_of(b, chunk(b.len(), n, me)))
        })?
    };
    for (k, frames) in got.iter().enumerate().filter(|&(k, _)| k != me) {
        for (f, &p) in frames.iter().zip(&large) {
            let b = &mut bufs[p];
            let r = chunk(b.len(), n, k);
            let s = b.dtype().size();
            let src = f.payload.as_bytes();
            let dst = &mut b.as_bytes_mut()[r.start * s..r.end * s];
            if src.len() != dst.len() || f.payload.dtype() != spec.parts[p].0 {
                return Err(Error::Protocol(format!(
                    "{}: rank {k} sent a chunk of {} bytes where {} were due",
                    run.name,
                    src.len(),
                    dst.len()
                )));
            }
            dst.copy_from_slice(src);
        }
    }
    run.recycle(got);
    Ok(bufs)
}

/// `reduce_scatter`: chunk `k` of `buf` to rank `k`; this rank's reduced chunk back.
/// The length divides by the group size (checked by the caller).
pub(crate) fn reduce_scatter(run: &Run<'_>, buf: Buffer, op: ReduceOp) -> Result<Buffer> {
    let (me, n) = (run.core.rank, run.core.members.len());
    let spec = Spec {
        coll: coll::REDUCE_SCATTER,
        desc: op_code(op),
        parts: vec![(buf.dtype(), buf.len())],
    };
    let each = buf.len() / n;
    let got = run.phase(0, &spec, &[0], |peer, _| {
        (buf.dtype(), bytes_of(&buf, peer * each..(peer + 1) * each))
    })?;
    let mut out = buf.try_slice(me * each..(me + 1) * each)?;
    drop(buf);
    let others: Vec<&Buffer> = (0..n)
        .filter(|&k| k != me)
        .map(|k| &got[k][0].payload)
        .collect();
    combine_buffers(&mut out, 0..each, me, &others, op)?;
    run.recycle(got);
    Ok(out)
}

/// `broadcast` from `root` (a rank of the group, checked by the caller).
pub(crate) fn broadcast(run: &Run<'_>, buf: Buffer, root: usize) -> Result<Buffer> {
    let me = run.core.rank;
    let spec = Spec {
        coll: coll::BROADCAST,
        desc: root as u64,
        parts: vec![(buf.dtype(), buf.len())],
    };
    let mut got = run.phase(0, &spec, &[0], |_, _| {
        if me == root {
            (buf.dtype(), buf.as_bytes())
        } else {
            (DType::U8, &[][..])
        }
    })?;
    if me == root {
        return Ok(buf);
    }
    let f = got[root]
        .pop()
        .ok_or_else(|| Error::Internal("broadcast lost the root's frame".into()))?;
    if (f.payload.dtype(), f.payload.len()) != (buf.dtype(), buf.len()) {
        return Err(Error::Protocol(format!(
            "broadcast: root {root} sent {:?} x {} for a buffer of {:?} x {}",
            f.payload.dtype(),
            f.payload.len(),
            buf.dtype(),
            buf.len()
        )));
    }
    Ok(f.payload)
}

/// `all_gather`: every rank's buffer, in rank order (this rank's own moved).
pub(crate) fn all_gather(run: &Run<'_>, buf: Buffer) -> Result<Vec<Buffer>> {
    let me = run.core.rank;
    let spec = Spec {
        coll: coll::ALL_GATHER,
        desc: 0,
        parts: vec![(buf.dtype(), buf.len())],
    };
    let got = run.phase(0, &spec, &[0], |_, _| (buf.dtype(), buf.as_bytes()))?;
    let mut own = Some(buf);
    let mut out = Vec::with_capacity(got.len());
    for (k, mut frames) in got.into_iter().enumerate() {
        if k == me {
            out.push(
                own.take()
                    .ok_or_else(|| Error::Internal("all_gather lost its buffer".into()))?,
            );
        } else {
            let f = frames
                .pop()
                .ok_or_else(|| Error::Internal("all_gather lost a frame".into()))?;
            out.push(f.payload);
        }
    }
    Ok(out)
}

/// A collective without buffers: `barrier`, or `new_group`'s check of the rank lists
/// (`desc` their hash).
pub(crate) fn meet(run: &Run<'_>, coll: u8, desc: u64) -> Result<()> {
    let spec = Spec {
        coll,
        desc,
        parts: Vec::new(),
    };
    run.phase(0, &spec, &[], |_, _| (DType::U8, &[][..]))
        .map(drop)
}

/// This rank's place in a collective whose arguments it rejected (`e`): it meets the
/// others with nothing (its frames say why), so that they fail at once with a mismatch;
/// it gets `e`.
pub(crate) fn rejected<T>(run: &Run<'_>, e: Error) -> Result<T> {
    let spec = Spec {
        coll: coll::REJECTED,
        desc: 0,
        parts: Vec::new(),
    };
    let why = e.to_string();
    // Only the sends matter: the peers' frames are dropped when this collective ends.
    match run.send(0, &spec, &[], |_, _| (DType::U8, why.as_bytes())) {
        Ok(()) | Err(Error::PeerLost { .. }) => Err(e),
        Err(other) => Err(other),
    }
}

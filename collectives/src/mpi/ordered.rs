//! The deterministic reductions: every element is combined in rank order, exactly as the
//! thread backend combines it (`acc = rank 0's value`, then `acc += rank 1's`, `rank
//! 2's`, ...; `Avg` divides that sum by the group size in the accumulation type; halves
//! accumulate in `f32` and round once), so the MPI backend's results are bit-identical to
//! the thread backend's for every type, operation and group size, and the same on every
//! rank.
//!
//! `MPI_Iallreduce` promises neither: Open MPI picks its algorithm (and with it the order
//! of additions) by message size and group size, so with three or more ranks its sums
//! differ from the thread backend's in the last bits, and PowerSGD, which carries its
//! error forward, turns those bits into a visible drift over a few hundred steps.
//!
//! The all-reduce here costs what a ring costs in bandwidth: the buffer is cut into one
//! chunk per rank; an `MPI_Ialltoallv` gives rank `k` chunk `k` of every rank, in rank
//! order; rank `k` reduces it; an `MPI_Iallgatherv` gives everyone every reduced chunk.
//! Each rank sends `(n-1)/n` of the buffer twice, in its own type (halves as 16 bits, half
//! what the native path sends after widening them). A reduce-scatter is the first half.
//!
//! Buffers of at most [`SMALL`] bytes (PowerSGD's factors, most of a step's collectives)
//! take one latency instead of two: an `MPI_Iallgather` of the whole buffer, then every
//! rank reduces every element, in the same order, so with the same bits.

use super::job::{collective, staged, Stage, Start};
use super::raw::{self, Request};
use crate::buffer::Reducible;
use crate::{Buffer, Completer, DType, Error, ReduceOp, Result};
use bytemuck::{cast_slice, cast_slice_mut};
use mpi::topology::SimpleCommunicator;
use std::os::raw::c_int;

/// `$call` on the send and receive slices of two buffers of one type, with `$s` and `$r`
/// bound to them (16-bit types as `u16`, which MPI moves bit for bit); `Err(mixed())`
/// if the types differ. The one place the stages below dispatch on the element type.
macro_rules! on_slices {
    ($send:expr, $recv:expr, |$s:ident, $r:ident| $call:expr) => {
        match ($send, $recv) {
            (Buffer::F32($s), Buffer::F32($r)) => $call,
            (Buffer::F64($s), Buffer::F64($r)) => $call,
            (Buffer::U8($s), Buffer::U8($r)) => $call,
            (Buffer::F16(s), Buffer::F16(r)) => {
                let ($s, $r): (&[u16], &mut [u16]) = (cast_slice(s), cast_slice_mut(r));
                $call
            }
            (Buffer::BF16(s), Buffer::BF16(r)) => {
                let ($s, $r): (&[u16], &mut [u16]) = (cast_slice(s), cast_slice_mut(r));
                $call
            }
            _ => Err(mixed()),
        }
    };
}

/// Elements combined at a time: the accumulator stays in L1 (as the thread backend's).
const BLOCK: usize = 1024;

/// Buffers up to this many bytes are all-gathered whole and reduced by every rank (one
/// round of messages; `n` times the bytes, which at this size cost less than a second
/// round's latency); longer ones are cut into chunks (two rounds, a ring's bytes).
pub(super) const SMALL: usize = 32 * 1024;

/// Whether a buffer takes the one-round path. The same on every rank (it depends only on
/// the buffer's type and length, which every rank shares).
fn small(dtype: DType, len: usize) -> bool {
    len.saturating_mul(dtype.size()) <= SMALL
}

/// A small buffer's all-reduce: every rank's whole buffer to every rank, then the same
/// reduction everywhere.
struct Gathered {
    /// This rank's values.
    data: Buffer,
    /// Every rank's buffer, in rank order; row `rank` becomes the result.
    all: Buffer,
    rank: usize,
    size: usize,
}

impl Gathered {
    fn new(data: Buffer, rank: usize, size: usize) -> Result<Gathered> {
        let all = data
            .len()
            .checked_mul(size)
            .ok_or_else(|| Error::InvalidArgument("a buffer too long to gather".into()))?;
        raw::count(all)?;
        Ok(Gathered {
            all: Buffer::zeros(data.dtype(), all),
            data,
            rank,
            size,
        })
    }

    /// Starts the all-gather (nothing to exchange on one rank).
    fn start(&mut self, comm: &SimpleCommunicator, requests: &mut Vec<Request>) -> Result<()> {
        if self.size == 1 {
            return Ok(());
        }
        // SAFETY: MPI gets pointers into the vectors' heap storage, which stays put when
        // this moves; the collective keeps it alive until the request completes (or
        // forever), and nothing touches either buffer until then.
        let request = unsafe {
            on_slices!(&self.data, &mut self.all, |s, r| raw::iallgather(
                comm, s, r
            ))
        };
        requests.push(request?);
        Ok(())
    }

    /// Every rank's buffer reduced in rank order (this rank's own read from `data`).
    fn finish(mut self, op: ReduceOp) -> Result<Buffer> {
        let (rank, n, m) = (self.rank, self.size, self.data.len());
        match (&mut self.all, &self.data) {
            (Buffer::F32(v), Buffer::F32(d)) => reduce_chunk(v, d, rank, n, m, op),
            (Buffer::F16(v), Buffer::F16(d)) => reduce_chunk(v, d, rank, n, m, op),
            (Buffer::BF16(v), Buffer::BF16(d)) => reduce_chunk(v, d, rank, n, m, op),
            (Buffer::F64(v), Buffer::F64(d)) => reduce_chunk(v, d, rank, n, m, op),
            _ => return Err(mixed()),
        }
        cut(&mut self.all, rank * m, m)
    }
}

/// One flat buffer of a coalesced all-reduce, on the path its size picks.
enum Part {
    Small(Gathered),
    Large(Exchange),
}

impl Part {
    fn new(data: Buffer, rank: usize, size: usize) -> Result<Part> {
        if small(data.dtype(), data.len()) {
            Gathered::new(data, rank, size).map(Part::Small)
        } else {
            Exchange::new(data, rank, size).map(Part::Large)
        }
    }

    /// The first round: the all-gather, or the all-to-all.
    fn start(&mut self, comm: &SimpleCommunicator, requests: &mut Vec<Request>) -> Result<()> {
        match self {
            Part::Small(g) => g.start(comm, requests),
            Part::Large(x) => x.scatter(comm, requests),
        }
    }

    /// The second round, for a large buffer: its reduction and all-gather.
    fn gather(
        &mut self,
        op: ReduceOp,
        comm: &SimpleCommunicator,
        requests: &mut Vec<Request>,
    ) -> Result<()> {
        match self {
            Part::Small(_) => Ok(()),
            Part::Large(x) => x.gather(op, comm, requests),
        }
    }

    fn finish(self, op: ReduceOp) -> Result<Buffer> {
        match self {
            Part::Small(g) => g.finish(op),
            Part::Large(x) => Ok(x.data),
        }
    }
}

/// One buffer's exchange: its data, the chunk of every rank that this rank reduces, and
/// the layouts MPI reads while the requests run (so they live as long as the buffers).
struct Exchange {
    /// This rank's values; after the all-gather, the reduced buffer.
    data: Buffer,
    /// One row of `mine()` elements per rank, in rank order: every other rank's chunk
    /// `rank`; this rank's own row receives nothing (its chunk is read from `data`, with
    /// no copy) and holds the reduced chunk once reduced.
    recv: Buffer,
    /// Chunk `k` of `data`: `counts[k]` elements from `displs[k]`.
    counts: Vec<c_int>,
    displs: Vec<c_int>,
    /// `counts`, but nothing to this rank itself.
    scounts: Vec<c_int>,
    /// Where each other rank's copy of chunk `rank` lands in `recv` (nothing from itself).
    rcounts: Vec<c_int>,
    rdispls: Vec<c_int>,
    rank: usize,
    size: usize,
}

impl Exchange {
    /// The exchange of `data` cut into `size` chunks: chunk `k` holds `len / size`
    /// elements, one more for the first `len % size` chunks.
    fn new(data: Buffer, rank: usize, size: usize) -> Result<Exchange> {
        let len = data.len();
        let (base, extra) = (len / size.max(1), len % size.max(1));
        let count = |k: usize| base + usize::from(k < extra);
        let start = |k: usize| k * base + k.min(extra);
        let counts: Vec<c_int> = (0..size)
            .map(|k| raw::count(count(k)))
            .collect::<Result<_>>()?;
        let displs = (0..size)
            .map(|k| raw::count(start(k)))
            .collect::<Result<_>>()?;
        let mine = count(rank);
        let mut scounts = counts.clone();
        let mut rcounts = vec![raw::count(mine)?; size];
        if let (Some(s), Some(r)) = (scounts.get_mut(rank), rcounts.get_mut(rank)) {
            (*s, *r) = (0, 0);
        }
        let rdispls = (0..size)
            .map(|k| raw::count(k * mine))
            .collect::<Result<_>>()?;
        Ok(Exchange {
            recv: Buffer::zeros(data.dtype(), mine * size),
            data,
            counts,
            displs,
            scounts,
            rcounts,
            rdispls,
            rank,
            size,
        })
    }

    /// Elements of this rank's chunk.
    fn mine(&self) -> usize {
        self.recv.len() / self.size.max(1)
    }

    /// This rank's chunk of `data`: where it starts.
    fn own_start(&self) -> usize {
        self.displs
            .get(self.rank)
            .and_then(|&d| usize::try_from(d).ok())
            .unwrap_or(0)
    }

    /// Stage 1: starts the all-to-all (nothing to exchange on one rank).
    fn scatter(&mut self, comm: &SimpleCommunicator, requests: &mut Vec<Request>) -> Result<()> {
        if self.size == 1 {
            return Ok(());
        }
        let Exchange {
            data,
            recv,
            scounts: counts,
            displs,
            rcounts,
            rdispls,
            ..
        } = self;
        // SAFETY: MPI gets pointers into the vectors' heap storage, which stays put when
        // the exchange moves; `staged` keeps the exchange alive until the request
        // completes (or forever), and nothing touches the buffers or changes the layouts
        // until the next stage, which runs only once the request has completed.
        let request = unsafe {
            on_slices!(&*data, recv, |s, r| raw::ialltoallv(
                comm, s, counts, displs, r, rcounts, rdispls
            ))
        };
        requests.push(request?);
        Ok(())
    }

    /// Reduces every rank's chunk `rank`, in rank order, into this rank's row of `recv`.
    fn reduce(&mut self, op: ReduceOp) -> Result<()> {
        let (rank, n, m, at) = (self.rank, self.size, self.mine(), self.own_start());
        let own = at..at + m;
        let short = || Error::Internal("a chunk lies outside its buffer".into());
        match (&mut self.recv, &self.data) {
            (Buffer::F32(v), Buffer::F32(d)) => {
                reduce_chunk(v, d.get(own).ok_or_else(short)?, rank, n, m, op)
            }
            (Buffer::F16(v), Buffer::F16(d)) => {
                reduce_chunk(v, d.get(own).ok_or_else(short)?, rank, n, m, op)
            }
            (Buffer::BF16(v), Buffer::BF16(d)) => {
                reduce_chunk(v, d.get(own).ok_or_else(short)?, rank, n, m, op)
            }
            (Buffer::F64(v), Buffer::F64(d)) => {
                reduce_chunk(v, d.get(own).ok_or_else(short)?, rank, n, m, op)
            }
            _ => return Err(mixed()),
        }
        Ok(())
    }

    /// Stage 2: reduces this rank's chunk and starts the all-gather of every reduced
    /// chunk into `data` (on one rank, moves the result into place instead).
    fn gather(
        &mut self,
        op: ReduceOp,
        comm: &SimpleCommunicator,
        requests: &mut Vec<Request>,
    ) -> Result<()> {
        self.reduce(op)?;
        if self.size == 1 {
            std::mem::swap(&mut self.data, &mut self.recv);
            return Ok(());
        }
        let m = self.mine();
        let mine = self.rank * m..(self.rank + 1) * m;
        let Exchange {
            data,
            recv,
            counts,
            displs,
            ..
        } = self;
        // SAFETY: as in `scatter`; `recv` (the send buffer) and `data` (the receive
        // buffer) are distinct, and neither is touched until the request completes.
        let request = unsafe {
            on_slices!(&*recv, data, |s, r| raw::iallgatherv(
                comm,
                &s[mine.clone()],
                r,
                counts,
                displs
            ))
        };
        requests.push(request?);
        Ok(())
    }
}

/// `recv` holds `n` rows of `m` elements, one per rank in rank order, except that row
/// `rank` is this rank's output and its own values are `own`. Writes into row `rank` the
/// reduction of every row, combined exactly as the thread backend's element loops
/// combine buffers: widened, accumulated in rank order, divided by `n` for `Avg`, rounded
/// once.
fn reduce_chunk<T: Reducible>(
    recv: &mut [T],
    own: &[T],
    rank: usize,
    n: usize,
    m: usize,
    op: ReduceOp,
) where
    T::Acc: Default + std::ops::Div<Output = T::Acc>,
{
    let (before, rest) = recv.split_at_mut(rank * m);
    let (out, after) = rest.split_at_mut(m);
    let row = |r: usize| -> &[T] {
        match r.cmp(&rank) {
            std::cmp::Ordering::Less => &before[r * m..(r + 1) * m],
            std::cmp::Ordering::Equal => own,
            std::cmp::Ordering::Greater => &after[(r - rank - 1) * m..(r - rank) * m],
        }
    };
    let n_acc = T::acc_from_usize(n);
    let mut acc = [T::Acc::default(); BLOCK];
    let mut start = 0;
    while start < m {
        let len = BLOCK.min(m - start);
        let acc = &mut acc[..len];
        T::widen_slice(&row(0)[start..start + len], acc);
        for r in 1..n {
            T::accumulate(acc, &row(r)[start..start + len], op);
        }
        if op == ReduceOp::Avg {
            acc.iter_mut().for_each(|a| *a = *a / n_acc);
        }
        T::narrow_slice(acc, &mut out[start..start + len]);
        start += len;
    }
}

fn mixed() -> Error {
    Error::Internal("send and receive buffers of different types".into())
}

/// `all_reduce`, deterministic: one all-gather for a small buffer; else one exchange, in
/// two stages.
pub(super) fn all_reduce(
    buf: Buffer,
    op: ReduceOp,
    rank: usize,
    size: usize,
    done: Completer<Buffer>,
) -> Start {
    all_reduce_parts(vec![buf], op, rank, size, done, |mut flats| {
        flats
            .pop()
            .ok_or_else(|| Error::Internal("all_reduce lost its buffer".into()))
    })
}

/// `all_reduce_coalesced`, deterministic: the buffers are concatenated into one flat
/// buffer per type (each reduced in its own type, as the thread backend reduces each
/// buffer), and the flats' collectives run side by side: at most four in each round,
/// whatever the number of buffers.
pub(super) fn all_reduce_coalesced(
    bufs: Vec<Buffer>,
    op: ReduceOp,
    rank: usize,
    size: usize,
    done: Completer<Vec<Buffer>>,
) -> Start {
    let layout: Vec<(DType, usize)> = bufs.iter().map(|b| (b.dtype(), b.len())).collect();
    let mut flats = [
        Buffer::F32(Vec::new()),
        Buffer::F16(Vec::new()),
        Buffer::BF16(Vec::new()),
        Buffer::F64(Vec::new()),
    ];
    for b in bufs {
        let Some(flat) = flats.iter_mut().find(|f| f.dtype() == b.dtype()) else {
            return failed(done, mixed());
        };
        match (flat, b) {
            (Buffer::F32(f), Buffer::F32(v)) => f.extend(v),
            (Buffer::F16(f), Buffer::F16(v)) => f.extend(v),
            (Buffer::BF16(f), Buffer::BF16(v)) => f.extend(v),
            (Buffer::F64(f), Buffer::F64(v)) => f.extend(v),
            _ => return failed(done, mixed()),
        }
    }
    // The types present, in a fixed order (the same on every rank, as the layouts are).
    let flats: Vec<Buffer> = flats.into_iter().filter(|f| !f.is_empty()).collect();
    all_reduce_parts(flats, op, rank, size, done, move |mut flats| {
        let mut offsets = vec![0usize; flats.len()];
        layout
            .into_iter()
            .map(|(dtype, len)| {
                if len == 0 {
                    // Its type may have no flat (only empty buffers of it).
                    return Ok(Buffer::zeros(dtype, 0));
                }
                let i = flats
                    .iter()
                    .position(|f| f.dtype() == dtype)
                    .ok_or_else(|| Error::Internal("a coalesced type went missing".into()))?;
                let at = offsets[i];
                offsets[i] += len;
                cut(&mut flats[i], at, len)
            })
            .collect()
    })
}

/// Reduces `flats` side by side, each on the path its size picks, and hands the results
/// (in order) to `unpack`. Two stages if any is large (the small ones' all-gathers start
/// with the large ones' all-to-alls), else one.
fn all_reduce_parts<T: Send + 'static>(
    flats: Vec<Buffer>,
    op: ReduceOp,
    rank: usize,
    size: usize,
    done: Completer<T>,
    unpack: impl FnOnce(Vec<Buffer>) -> Result<T> + Send + 'static,
) -> Start {
    let parts: Result<Vec<Part>> = flats
        .into_iter()
        .map(|f| Part::new(f, rank, size))
        .collect();
    let parts = match parts {
        Ok(p) => p,
        Err(e) => return failed(done, e),
    };
    let mut stages: Vec<Stage<Vec<Part>>> = vec![Box::new(|comm, parts, requests| {
        parts.iter_mut().try_for_each(|p| p.start(comm, requests))
    })];
    if parts.iter().any(|p| matches!(p, Part::Large(_))) {
        stages.push(Box::new(move |comm, parts, requests| {
            parts
                .iter_mut()
                .try_for_each(|p| p.gather(op, comm, requests))
        }));
    }
    staged(done, parts, stages, move |parts| {
        let flats = parts
            .into_iter()
            .map(|p| p.finish(op))
            .collect::<Result<Vec<Buffer>>>()?;
        unpack(flats)
    })
}

/// Elements `at..at + len` of a flat buffer, as a buffer of their own.
fn cut(flat: &mut Buffer, at: usize, len: usize) -> Result<Buffer> {
    let range = at..at + len;
    let short = || Error::Internal("a coalesced flat buffer came back short".into());
    Ok(match flat {
        Buffer::F32(v) => Buffer::F32(v.get(range).ok_or_else(short)?.to_vec()),
        Buffer::F16(v) => Buffer::F16(v.get(range).ok_or_else(short)?.to_vec()),
        Buffer::BF16(v) => Buffer::BF16(v.get(range).ok_or_else(short)?.to_vec()),
        Buffer::F64(v) => Buffer::F64(v.get(range).ok_or_else(short)?.to_vec()),
        Buffer::U8(v) => Buffer::U8(v.get(range).ok_or_else(short)?.to_vec()),
    })
}

/// `reduce_scatter`, deterministic: the all-to-all of the exchange (equal chunks: the
/// caller has checked that the length divides by the group size), then this rank's
/// chunk reduced locally.
pub(super) fn reduce_scatter(
    buf: Buffer,
    op: ReduceOp,
    rank: usize,
    size: usize,
    done: Completer<Buffer>,
) -> Start {
    let x = match Exchange::new(buf, rank, size) {
        Ok(x) => x,
        Err(e) => return failed(done, e),
    };
    collective(
        done,
        x,
        |comm, x, requests| x.scatter(comm, requests),
        move |mut x| {
            x.reduce(op)?;
            let m = x.mine();
            cut(&mut x.recv, x.rank * m, m)
        },
    )
}

/// A start that fails the work without communicating (every rank fails alike: the
/// failure depends only on lengths, which every rank shares).
fn failed<T: Send + 'static>(done: Completer<T>, e: Error) -> Start {
    Box::new(move |_| {
        done.complete(Err(e));
        None
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    /// Values whose sum depends on the order of additions: magnitudes from 2^-30 to 2^30
    /// with both signs.
    fn spread(rank: usize, len: usize) -> Vec<f32> {
        (0..len)
            .map(|i| {
                let k = (i * 31 + rank * 17) % 61;
                let sign = if (i + rank).is_multiple_of(3) {
                    -1.0
                } else {
                    1.0
                };
                sign * (1.0 + k as f32 / 61.0) * 2f32.powi(k as i32 - 30)
            })
            .collect()
    }

    /// The thread backend's order, spelled out: rank 0, then += each rank in turn.
    fn in_rank_order(rows: &[Vec<f32>], op: ReduceOp) -> Vec<f32> {
        let n = rows.len() as f32;
        (0..rows[0].len())
            .map(|i| {
                let mut acc = rows[0][i];
                for r in &rows[1..] {
                    match op {
                        ReduceOp::Sum | ReduceOp::Avg => acc += r[i],
                        ReduceOp::Max => {
                            if r[i] > acc || r[i].is_nan() {
                                acc = r[i]
                            }
                        }
                        ReduceOp::Min => {
                            if r[i] < acc || r[i].is_nan() {
                                acc = r[i]
                            }
                        }
                    }
                }
                if op == ReduceOp::Avg {
                    acc /= n;
                }
                acc
            })
            .collect()
    }

    /// Rank `rank`'s reduction of `rows` (`n` rows of `m`, concatenated): its own row
    /// read from its data, the others from the receive buffer, whose own row holds
    /// another rank's values (so reading it instead would show).
    fn reduce_as<T: Reducible>(rows: &[T], n: usize, m: usize, rank: usize, op: ReduceOp) -> Vec<T>
    where
        T::Acc: Default + std::ops::Div<Output = T::Acc>,
    {
        let own = rows[rank * m..(rank + 1) * m].to_vec();
        let mut recv = rows.to_vec();
        let other = (rank + 1) % n;
        recv.copy_within(other * m..(other + 1) * m, rank * m);
        reduce_chunk(&mut recv, &own, rank, n, m, op);
        recv[rank * m..(rank + 1) * m].to_vec()
    }

    #[test]
    fn rows_reduce_in_rank_order_bit_for_bit() {
        for n in [1, 2, 3, 4, 7] {
            // Lengths across the block size, so the blocking is covered too.
            for m in [0, 1, 5, BLOCK, BLOCK + 3, 2 * BLOCK + 17] {
                let rows: Vec<Vec<f32>> = (0..n).map(|r| spread(r, m)).collect();
                for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
                    let want = in_rank_order(&rows, op);
                    let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    for rank in 0..n {
                        let got = reduce_as(&rows.concat(), n, m, rank, op);
                        assert_eq!(bits(&got), bits(&want), "n {n}, m {m}, {op:?}, rank {rank}");
                    }
                }
            }
        }
        // The order matters for these values (else the test above proves nothing).
        let rows: Vec<Vec<f32>> = (0..4).map(|r| spread(r, 64)).collect();
        let reversed: Vec<Vec<f32>> = rows.iter().rev().cloned().collect();
        assert_ne!(
            in_rank_order(&rows, ReduceOp::Sum),
            in_rank_order(&reversed, ReduceOp::Sum)
        );
    }

    #[test]
    fn halves_accumulate_in_f32_and_round_once() {
        // 1 + 3 * 2^-11 is not an f16, but rounding each partial sum would lose the
        // small terms one at a time: 1 + 2^-11 rounds to 1 (ties to even).
        let rows = [1.0f32, 2f32.powi(-11), 2f32.powi(-11), 2f32.powi(-11)];
        let v: Vec<f16> = rows.iter().map(|&x| f16::from_f32(x)).collect();
        for rank in 0..4 {
            let got = reduce_as(&v, 4, 1, rank, ReduceOp::Sum);
            assert_eq!(got, [f16::from_f32(1.0 + 3.0 * 2f32.powi(-11))]);
            assert_ne!(got, [f16::ONE]);
        }
        let v: Vec<bf16> = [3.0f32, 4.0, 5.0].map(bf16::from_f32).to_vec();
        assert_eq!(reduce_as(&v, 3, 1, 2, ReduceOp::Avg), [bf16::from_f32(4.0)]);
    }

    #[test]
    fn small_buffers_are_gathered_whole_by_bytes_not_elements() {
        assert!(small(DType::F32, SMALL / 4));
        assert!(!small(DType::F32, SMALL / 4 + 1));
        assert!(small(DType::BF16, SMALL / 2));
        assert!(!small(DType::F64, SMALL / 4));
        assert!(!small(DType::F32, usize::MAX));
    }

    #[test]
    fn chunks_cover_the_buffer_in_rank_order() {
        for size in [1, 2, 3, 4, 5] {
            for len in [0, 1, 3, 4, 10, 1001] {
                for rank in 0..size {
                    let x = Exchange::new(Buffer::zeros(DType::F32, len), rank, size)
                        .expect("small lengths fit");
                    let mut end = 0;
                    for k in 0..size {
                        assert_eq!(x.displs[k] as usize, end, "size {size}, len {len}");
                        end += x.counts[k] as usize;
                    }
                    assert_eq!(end, len);
                    let mine = x.counts[rank] as usize;
                    assert_eq!(x.mine(), mine);
                    assert_eq!(x.recv.len(), mine * size);
                    // Nothing to or from itself: its own chunk is read in place.
                    for k in 0..size {
                        let (s, r) = (x.scounts[k] as usize, x.rcounts[k] as usize);
                        let want = if k == rank {
                            (0, 0)
                        } else {
                            (x.counts[k] as usize, mine)
                        };
                        assert_eq!((s, r), want);
                        assert_eq!(x.rdispls[k] as usize, k * mine);
                    }
                    let spread =
                        x.counts.iter().max().unwrap_or(&0) - x.counts.iter().min().unwrap_or(&0);
                    assert!(spread <= 1);
                }
            }
        }
    }
}

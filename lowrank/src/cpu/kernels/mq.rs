//! `P = M Q`, optionally fused with `M += E`: register tiles over row blocks, and for
//! ranks of 2 or more column chunks whose `Q` stays in L1 ([`mq_chunked`]).

use super::{Mat, PREFETCH};
use crate::cpu::simd::Simd;
use std::ops::Range;

/// `P[rows, k0..k0+RT] = X[rows] Q[:, k0..k0+RT]` for `RB` rows starting at `i0`. With
/// `FUSE`, `X = M + E` is computed on the fly and written back into `M`.
// Register tiles read best with explicit indices.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn mq_tile<S: Simd, const RB: usize, const RT: usize, const FUSE: bool>(
    a: &Mat,
    i0: usize,
    k0: usize,
) {
    let cols = a.cols;
    let lanes = S::LANES;
    // SAFETY: the caller guarantees rows i0..i0+RB < n and columns k0..k0+RT < r, so every
    // pointer below stays inside the buffers described by `a`.
    unsafe {
        let row = |ii: usize| a.m.add((i0 + ii) * cols);
        let erow = |ii: usize| a.e.add((i0 + ii) * cols);
        let qcol = |t: usize| a.q.add((k0 + t) * cols);
        let mut acc = [[S::zero(); RT]; RB];
        let mut j = 0;
        while j + lanes <= cols {
            let mut x = [S::zero(); RB];
            for (ii, xi) in x.iter_mut().enumerate() {
                S::prefetch(row(ii).wrapping_add(j + PREFETCH));
                let mut v = S::load(row(ii).add(j));
                if FUSE {
                    S::prefetch(erow(ii).wrapping_add(j + PREFETCH));
                    v = S::add(v, S::load(erow(ii).add(j)));
                    S::store(row(ii).add(j), v);
                }
                *xi = v;
            }
            for t in 0..RT {
                let qv = S::load(qcol(t).add(j));
                for ii in 0..RB {
                    acc[ii][t] = S::fma(x[ii], qv, acc[ii][t]);
                }
            }
            j += lanes;
        }
        // The reduction, the ragged columns and the store, as after a chunked run.
        mq_finish::<S, RB, RT, FUSE>(a, i0, k0, j, acc.as_ptr().cast());
    }
}

/// All `r` columns of `P` for `RB` rows at `i0`, in tiles of at most `WIDE` columns (8 or
/// 4). Only the first tile fuses the error add; later tiles read the already-updated rows
/// (from cache).
#[inline(always)]
unsafe fn mq_block<S: Simd, const RB: usize, const WIDE: usize, const FUSE: bool>(
    a: &Mat,
    i0: usize,
) {
    let mut k0 = 0;
    while k0 < a.r {
        let rem = a.r - k0;
        let fuse = FUSE && k0 == 0;
        let rt = if WIDE >= 8 && rem >= 8 {
            8
        } else if rem >= 4 {
            4
        } else if rem >= 2 {
            2
        } else {
            1
        };
        // SAFETY: rows and tile columns are in range (see `mq_tile`).
        unsafe {
            match (rt, fuse) {
                (8, true) => mq_tile::<S, RB, 8, true>(a, i0, k0),
                (8, false) => mq_tile::<S, RB, 8, false>(a, i0, k0),
                (4, true) => mq_tile::<S, RB, 4, true>(a, i0, k0),
                (4, false) => mq_tile::<S, RB, 4, false>(a, i0, k0),
                (2, true) => mq_tile::<S, RB, 2, true>(a, i0, k0),
                (2, false) => mq_tile::<S, RB, 2, false>(a, i0, k0),
                (_, true) => mq_tile::<S, RB, 1, true>(a, i0, k0),
                (_, false) => mq_tile::<S, RB, 1, false>(a, i0, k0),
            }
        }
        k0 += rt;
    }
}

/// Bytes of `Q` per column chunk in [`mq_chunked`]: the chunk's `r` columns stay in L1
/// while every row of a block passes over them. A third of the 48 KiB L1 of the bench
/// machine leaves room for the rows streaming through and their prefetches: at `r = 8`,
/// one thread, cold, AVX2 kernels with 3 × 4 tiles, 4 KiB read 0.85-0.87 of the read
/// reference, 8 KiB 0.88-0.89, 12 KiB 0.89-0.92, 16 KiB 0.83-0.85 and 32 KiB 0.73-0.74;
/// AVX-512 at `r = 8` went from 0.90-0.91 (16 KiB) to 0.95-0.96.
const MQ_CHUNK_BYTES: usize = 12 * 1024;
/// Rows per block in [`mq_chunked`]: their accumulators (`r` vectors a row) stay in L1
/// between chunks.
const MQ_BLOCK_ROWS: usize = 16;

/// The vector part of one register tile over the columns `j0..j1` (whole vectors):
/// `acc` (`RB x RT` vectors, row by row) is loaded, advanced over the span, and stored.
/// With `FUSE`, `M += E` is written back on the way, as in [`mq_tile`].
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn mq_span<S: Simd, const RB: usize, const RT: usize, const FUSE: bool>(
    a: &Mat,
    i0: usize,
    k0: usize,
    span: Range<usize>,
    acc: *mut S::V,
    qpack: *const f32,
    next: Option<(usize, usize)>,
) {
    let cols = a.cols;
    let lanes = S::LANES;
    // SAFETY: the caller guarantees rows i0..i0+RB < n, columns k0..k0+RT <= r, whole
    // vectors in `span` inside 0..cols, `acc` valid for RB * RT vectors, and `qpack`
    // holding Q's vectors interleaved (see `mq_chunked`) over `span`. Prefetch addresses
    // are computed with `wrapping_add` and may lie outside the buffers: a prefetch never
    // faults.
    unsafe {
        let row = |ii: usize| a.m.add((i0 + ii) * cols);
        let erow = |ii: usize| a.e.add((i0 + ii) * cols);
        let qcol = |t: usize, j: usize| qpack.add((j / lanes * a.r + k0 + t) * lanes);
        let mut regs = [[S::zero(); RT]; RB];
        for ii in 0..RB {
            for t in 0..RT {
                regs[ii][t] = *acc.add(ii * RT + t);
            }
        }
        // Where the next span's rows start (element offsets into M and E); the prefetch
        // runs that far ahead, in step with this span.
        let ahead = next.map(|(row, col)| row * cols + col);
        let mut j = span.start;
        while j + lanes <= span.end {
            let mut x = [S::zero(); RB];
            for (ii, xi) in x.iter_mut().enumerate() {
                if let Some(base) = ahead {
                    let at = base + ii * cols + (j - span.start);
                    S::prefetch(a.m.wrapping_add(at));
                    if FUSE {
                        S::prefetch(a.e.wrapping_add(at));
                    }
                }
                let mut v = S::load(row(ii).add(j));
                if FUSE {
                    v = S::add(v, S::load(erow(ii).add(j)));
                    S::store(row(ii).add(j), v);
                }
                *xi = v;
            }
            for t in 0..RT {
                let qv = S::load(qcol(t, j));
                for ii in 0..RB {
                    regs[ii][t] = S::fma(x[ii], qv, regs[ii][t]);
                }
            }
            j += lanes;
        }
        for ii in 0..RB {
            for t in 0..RT {
                *acc.add(ii * RT + t) = regs[ii][t];
            }
        }
    }
}

thread_local! {
    /// Each thread's buffer for [`mq_chunked`]'s interleaved `Q`, kept between calls: a
    /// fresh one of 128 KiB or more would come from `mmap` and fault in zeroed pages on
    /// every call.
    static QPACK: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// A thread's `Q` pack buffer, taken for one call and given back when dropped.
struct QPack(Vec<f32>);

impl QPack {
    /// At least `len` floats, 16 of them slack for alignment.
    fn take(len: usize) -> Self {
        let mut buffer = QPACK.with(|p| p.take());
        if buffer.len() < len {
            buffer = vec![0.0; len];
        }
        QPack(buffer)
    }

    /// The first 64-byte aligned element.
    fn aligned(&mut self) -> *mut f32 {
        let p = self.0.as_mut_ptr();
        p.wrapping_add(p.align_offset(64).min(15))
    }
}

impl Drop for QPack {
    fn drop(&mut self) {
        let buffer = std::mem::take(&mut self.0);
        QPACK.with(|p| p.set(buffer));
    }
}

/// The end of one register tile after its spans: reduces `acc`, adds the ragged columns
/// past `j` (scalar, fusing `M += E` as [`mq_tile`] does), and writes `P`.
#[inline(always)]
unsafe fn mq_finish<S: Simd, const RB: usize, const RT: usize, const FUSE: bool>(
    a: &Mat,
    i0: usize,
    k0: usize,
    mut j: usize,
    acc: *const S::V,
) {
    let cols = a.cols;
    // SAFETY: as in `mq_span`; columns j..cols are inside every row.
    unsafe {
        let row = |ii: usize| a.m.add((i0 + ii) * cols);
        let erow = |ii: usize| a.e.add((i0 + ii) * cols);
        let qcol = |t: usize| a.q.add((k0 + t) * cols);
        let mut out = [[0.0f32; RT]; RB];
        for (ii, o) in out.iter_mut().enumerate() {
            for (t, ot) in o.iter_mut().enumerate() {
                *ot = S::reduce(*acc.add(ii * RT + t));
            }
        }
        while j < cols {
            for (ii, o) in out.iter_mut().enumerate() {
                let mut v = *row(ii).add(j);
                if FUSE {
                    v += *erow(ii).add(j);
                    *row(ii).add(j) = v;
                }
                for (t, ot) in o.iter_mut().enumerate() {
                    *ot += v * *qcol(t).add(j);
                }
            }
            j += 1;
        }
        for (ii, o) in out.iter().enumerate() {
            for (t, &ot) in o.iter().enumerate() {
                *a.p.add((k0 + t) * a.n + i0 + ii) = ot;
            }
        }
    }
}

/// `P = M Q` for a rank of 2 or more, `r` a multiple of `RT`: the columns go in chunks
/// whose `r` columns of `Q` fit L1 ([`MQ_CHUNK_BYTES`]), and each chunk serves a block of
/// [`MQ_BLOCK_ROWS`] rows, whose accumulators wait in L1 between chunks.
///
/// Without chunks every row pair re-read all `r` columns of `Q` from L2 (128 KiB at
/// `r = 8` and 4096 columns): 8 lines of `Q` per 2 lines of `M`, and the L1 fill rate,
/// not the FMA units or memory, set the speed (13 GB/s in cache at `r = 8` against 35
/// at `r = 4` on the AVX-512 bench machine). Each accumulator lane still sums its columns
/// in order and is reduced as [`mq_tile`] reduces it, so the results are bit-identical
/// to the unchunked kernel's.
#[inline(always)]
unsafe fn mq_chunked<S: Simd, const RB: usize, const RT: usize, const FUSE: bool>(
    a: &Mat,
    rows: Range<usize>,
) {
    let lanes = S::LANES;
    let vec_end = a.cols / lanes * lanes;
    let chunk = (MQ_CHUNK_BYTES / 4 / a.r / lanes * lanes).max(lanes);
    let tiles = a.r / RT;
    let per_group = tiles * RB * RT;
    // SAFETY: S::zero has no preconditions beyond the instruction set, which the entry
    // point guarantees.
    let mut acc = vec![unsafe { S::zero() }; MQ_BLOCK_ROWS / RB * per_group];
    // Q's whole vectors, interleaved: for each vector of columns, the r vectors one after
    // the other, so that a chunk is one contiguous run. Read in place, Q's columns lie
    // `cols` floats apart, and for the power-of-two widths of most models every column
    // and every row of M map to the same L1 sets at each step: the chunk did not stay
    // in L1.
    let mut pack = QPack::take(a.r * vec_end + 16);
    let qpack = pack.aligned();
    // SAFETY: Q holds r columns of `cols` floats (the caller); the pack holds r * vec_end
    // floats from its aligned start.
    unsafe {
        for v in 0..vec_end / lanes {
            for k in 0..a.r {
                let src = a.q.add(k * a.cols + v * lanes);
                S::store(qpack.add((v * a.r + k) * lanes), S::load(src));
            }
        }
    }
    let qpack = qpack.cast_const();
    let mut i0 = rows.start;
    while i0 + RB <= rows.end {
        let groups = ((rows.end - i0) / RB).min(MQ_BLOCK_ROWS / RB);
        // SAFETY: S::zero as above.
        acc[..groups * per_group].fill(unsafe { S::zero() });
        let base = acc.as_mut_ptr();
        let mut j0 = 0;
        // SAFETY: groups * RB rows from i0 are inside `rows` (inside 0..n, the caller);
        // tiles cover columns 0..r of P and Q in steps of RT; spans are whole vectors
        // inside 0..cols; accumulator slices lie inside `acc`.
        unsafe {
            while j0 < vec_end {
                let span = j0..(j0 + chunk).min(vec_end);
                for g in 0..groups {
                    // The rows and columns read after this group's span: the next group's
                    // same span, else the first group's next span, else the next block's
                    // first span. The first tile prefetches them, one span ahead (the
                    // other tiles reread this span from L1).
                    let next = if g + 1 < groups {
                        (i0 + (g + 1) * RB, span.start)
                    } else if span.end < vec_end {
                        (i0, span.end)
                    } else {
                        (i0 + groups * RB, 0)
                    };
                    for t in 0..tiles {
                        let slot = base.add(g * per_group + t * RB * RT);
                        let (i, k0) = (i0 + g * RB, t * RT);
                        let next = (t == 0).then_some(next);
                        if FUSE && t == 0 {
                            mq_span::<S, RB, RT, true>(a, i, k0, span.clone(), slot, qpack, next);
                        } else {
                            mq_span::<S, RB, RT, false>(a, i, k0, span.clone(), slot, qpack, next);
                        }
                    }
                }
                j0 = span.end;
            }
            for g in 0..groups {
                for t in 0..tiles {
                    let slot = base.add(g * per_group + t * RB * RT);
                    let (i, k0) = (i0 + g * RB, t * RT);
                    if FUSE && t == 0 {
                        mq_finish::<S, RB, RT, true>(a, i, k0, vec_end, slot);
                    } else {
                        mq_finish::<S, RB, RT, false>(a, i, k0, vec_end, slot);
                    }
                }
            }
        }
        i0 += groups * RB;
    }
    // SAFETY: the remaining rows are inside `rows`.
    unsafe {
        while i0 < rows.end {
            mq_block::<S, 1, 8, FUSE>(a, i0);
            i0 += 1;
        }
    }
}

/// `P = M Q` (or with `FUSE`, `M += E; P = M Q`) for the given rows of one matrix.
///
/// Register budget: `RB x tile` accumulators plus `RB` row vectors. From `r = 4` (a
/// multiple of the tile) [`mq_chunked`] keeps `Q` in L1: 4 rows × 4 columns at `r = 4` on
/// AVX-512, tiles of 2 rows × 4 on AVX2 at `r = 4` (unchunked, `Q` is 64 KiB for 4096
/// columns and came from L2 for every row pair: cold, one thread, AVX2 kernels 0.82-0.91
/// of the read reference, 0.93-1.03 chunked), and from `r = 8` tiles of 2 rows × 8. At
/// `r = 2` (`Q` 32 KiB for 4096 columns, two thirds of L1) 8 rows × 2 on AVX-512 and
/// 4 × 2 on AVX2 (AVX2 kernels 0.91-0.95 unchunked, 1.00-1.02 chunked).
/// On AVX2 (16 registers) a 2 × 8 tile needs 19 and spills 4 accumulators: each step
/// stores and reloads them, which puts store forwarding on their chains (17-18 GB/s with
/// `M` in L2 against 47 GB/s of FMA); its occasional runs at 0.30 of the read reference
/// (4.9 GB/s in L2, the whole run) fit a spill slot 4 KiB apart from a row of `M` (a
/// false store-to-load dependency), which no counter here can confirm. From
/// `r = 8` (a multiple of 4) AVX2 takes 3 × 4 tiles instead: 15 registers, no spill, each
/// row read once per tile from L1 (20-21 GB/s in L2; cold, one thread, 0.89-0.90 of the
/// read reference against 0.84-0.86 for 2 × 8, alternated runs).
/// At `r = 1` (and for ranks the chunked tiles do not divide), AVX-512 takes 4 rows at
/// a time with tiles of 4 (2 × 8 from `r = 8`), and AVX2 and the fallback 2 rows with
/// tiles of 4.
#[inline(always)]
pub(crate) unsafe fn mq_rows<S: Simd, const FUSE: bool>(a: &Mat, rows: Range<usize>) {
    let mut i = rows.start;
    // SAFETY: every block lies inside `rows`, which the caller keeps inside 0..n.
    unsafe {
        if S::LANES == 8 && a.r >= 8 && a.r.is_multiple_of(4) {
            return mq_chunked::<S, 3, 4, FUSE>(a, rows);
        } else if a.r >= 8 && a.r.is_multiple_of(8) {
            return mq_chunked::<S, 2, 8, FUSE>(a, rows);
        } else if S::LANES == 8 && a.r >= 4 && a.r.is_multiple_of(4) {
            return mq_chunked::<S, 2, 4, FUSE>(a, rows);
        } else if S::LANES == 16 && a.r == 4 {
            return mq_chunked::<S, 4, 4, FUSE>(a, rows);
        } else if S::LANES == 16 && a.r == 2 {
            return mq_chunked::<S, 8, 2, FUSE>(a, rows);
        } else if S::LANES == 8 && a.r == 2 {
            return mq_chunked::<S, 4, 2, FUSE>(a, rows);
        } else if S::LANES == 16 && a.r >= 8 {
            while i + 2 <= rows.end {
                mq_block::<S, 2, 8, FUSE>(a, i);
                i += 2;
            }
        } else if S::LANES == 16 {
            while i + 4 <= rows.end {
                mq_block::<S, 4, 4, FUSE>(a, i);
                i += 4;
            }
        } else {
            while i + 2 <= rows.end {
                mq_block::<S, 2, 4, FUSE>(a, i);
                i += 2;
            }
        }
        while i < rows.end {
            mq_block::<S, 1, 8, FUSE>(a, i);
            i += 1;
        }
    }
}

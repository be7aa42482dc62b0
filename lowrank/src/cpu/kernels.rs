//! The CPU kernels, written once over [`Simd`] and instantiated per instruction set.
//!
//! Skinny products stream `M` from memory once and keep everything else (the thin
//! factors, the accumulators) in registers or in L1/L2, so their speed is the memory
//! read bandwidth. Rows are processed in blocks so that each load of a factor vector is
//! shared by several rows; loads run a fixed distance behind software prefetches.
//!
//! All functions here are `unsafe`: they take raw pointers that the safe layer
//! (`mod.rs`) has checked against the shape, and they are only reached through the entry
//! points at the bottom, after runtime detection of the instruction set.

use super::simd::Simd;
use std::ops::Range;

/// How far ahead of the loads (in `f32` elements) the software prefetch runs. Prefetch
/// addresses are computed with `wrapping_add`: near the end of a buffer they point past
/// it, and `add` beyond one past the end is undefined behaviour even when never read.
const PREFETCH: usize = 512;

/// One matrix of a batch and its factors, as raw pointers checked by the caller.
///
/// `m` is `n x cols` row-major; `e` (optional, may be null) has the same shape; `p` is
/// `r` columns of `n` (column-major `n x r`); `q` is `r` columns of `cols`.
#[derive(Clone, Copy)]
pub(crate) struct Mat {
    pub m: *mut f32,
    pub e: *mut f32,
    pub p: *mut f32,
    pub q: *mut f32,
    pub n: usize,
    pub cols: usize,
    pub r: usize,
}

impl Mat {
    /// The pointers of matrix 0 of a batch of shape `d`.
    pub(crate) fn base(d: &crate::Dims, m: *mut f32, e: *mut f32, p: *mut f32, q: *mut f32) -> Mat {
        Mat {
            m,
            e,
            p,
            q,
            n: d.n(),
            cols: d.m(),
            r: d.r(),
        }
    }

    /// The pointers of matrix `b` (offsets computed with wrapping arithmetic; they are
    /// only dereferenced for `b < batch`).
    pub(crate) fn at(&self, d: &crate::Dims, b: usize) -> Mat {
        let mo = b * d.matrix_len();
        Mat {
            m: self.m.wrapping_add(mo),
            e: if self.e.is_null() {
                self.e
            } else {
                self.e.wrapping_add(mo)
            },
            p: self.p.wrapping_add(b * d.n() * d.r()),
            q: self.q.wrapping_add(b * d.m() * d.r()),
            ..*self
        }
    }
}

// SAFETY: a `Mat` is a bundle of pointers into buffers that the safe layer keeps alive
// and borrowed (shared or exclusive as each operation needs) for the duration of the
// parallel call; tasks write disjoint parts.
unsafe impl Send for Mat {}
// SAFETY: as above.
unsafe impl Sync for Mat {}

// ---------------------------------------------------------------------------------------
// P = M Q (optionally fused with M += E)

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

// ---------------------------------------------------------------------------------------
// Q = Mᵀ P

/// Adds `Mᵀ P` of rows `i0..i0+RB` to a column panel of `Q`.
///
/// `acc` is the panel's part of `Q` in a chunk-interleaved layout (for each vector-wide
/// chunk of columns, the `r` vectors one after the other), so one pointer with constant
/// offsets reaches every accumulator; `tile` is `P` of these rows, row-major (`RB x r`),
/// for the same reason. `RC` is the rank when it is a small constant (the loop over it
/// unrolls), or 0 for a rank known at run time.
#[inline(always)]
unsafe fn mtp_block<S: Simd, const RB: usize, const RC: usize>(
    a: &Mat,
    i0: usize,
    panel: &Range<usize>,
    acc: *mut f32,
    tile: *const f32,
) {
    let lanes = S::LANES;
    let r = if RC == 0 { a.r } else { RC };
    // SAFETY: the caller guarantees rows i0..i0+RB < n, `panel` inside 0..a.cols, `acc`
    // valid for r * panel.len() (rounded up to lanes) elements and `tile` for RB * r.
    unsafe {
        let row = |ii: usize| a.m.add((i0 + ii) * a.cols);
        let mut j = panel.start;
        let mut dst = acc;
        while j + lanes <= panel.end {
            // Prefetch PREFETCH floats ahead in the order the rows are read: along these
            // rows, then on into the next block's rows of the same panel. A block reads
            // RB rows side by side, more streams than the hardware prefetchers keep far
            // enough ahead (cold, n = m = 4096, one thread, AVX-512 machine: r = 8 went
            // from 0.79-0.83 to 0.90-0.91 of the read reference with this prefetch).
            let ahead = j + PREFETCH;
            let (base, at) = if ahead < panel.end {
                (i0, ahead)
            } else {
                (i0 + RB, panel.start + (ahead - panel.end))
            };
            let mut x = [S::zero(); RB];
            for (ii, xi) in x.iter_mut().enumerate() {
                S::prefetch(a.m.wrapping_add((base + ii) * a.cols + at));
                *xi = S::load(row(ii).add(j));
            }
            for k in 0..r {
                let d = dst.add(k * lanes);
                let mut sum = S::load(d);
                for (ii, &xi) in x.iter().enumerate() {
                    sum = S::fma(S::splat(*tile.add(ii * r + k)), xi, sum);
                }
                S::store(d, sum);
            }
            dst = dst.add(r * lanes);
            j += lanes;
        }
        // The ragged end of the panel: scalar, in the same interleaved layout.
        let rest = panel.end - j;
        for t in 0..rest {
            for k in 0..r {
                let d = dst.add(k * lanes + t);
                for ii in 0..RB {
                    *d += *tile.add(ii * r + k) * *row(ii).add(j + t);
                }
            }
        }
    }
}

/// Columns of `M` per panel: the panel's accumulators (`r x width` floats) stay within
/// 128 KiB, in L2 (even a 256 KiB one), while each row is read in runs of at least
/// 16 KiB: whole rows of 4096 columns at `r = 8`. Cold, n = m = 4096, one thread, `r = 8`,
/// AVX-512 machine, alternated runs: 64 KiB panels (rows read in two halves) 0.86-0.90
/// of the read reference for both instruction sets, 128 KiB 0.95-0.97 (256 KiB the same,
/// 32 and 16 KiB 0.78-0.85 and 0.66-0.72); other ranks unchanged.
const MTP_PANEL_FLOATS: usize = 32768;

#[inline(always)]
unsafe fn mtp_cols_rc<S: Simd, const RC: usize>(a: &Mat, cols: Range<usize>) {
    const RB: usize = 8;
    let lanes = S::LANES;
    let r = a.r;
    let width = (MTP_PANEL_FLOATS / r).max(lanes) / lanes * lanes;
    let mut acc = vec![0.0f32; r * width.min(cols.len()).next_multiple_of(lanes)];
    let mut tile = [0.0f32; 16 * crate::MAX_RANK];
    let mut c0 = cols.start;
    while c0 < cols.end {
        let panel = c0..(c0 + width).min(cols.end);
        acc.fill(0.0);
        let mut i = 0;
        // SAFETY: rows stay inside 0..n, columns inside `panel` inside `cols`; `acc`
        // holds r floats per panel column rounded up to whole chunks; `tile` 16 * r (the largest block).
        unsafe {
            let load_tile = |tile: &mut [f32], i: usize, rows: usize| {
                for ii in 0..rows {
                    for k in 0..r {
                        tile[ii * r + k] = *a.p.add(k * a.n + i + ii);
                    }
                }
            };
            macro_rules! blocks {
                ($rb:expr) => {
                    while i + $rb <= a.n {
                        load_tile(&mut tile, i, $rb);
                        mtp_block::<S, { $rb }, RC>(a, i, &panel, acc.as_mut_ptr(), tile.as_ptr());
                        i += $rb;
                    }
                };
            }
            if S::LANES == 16 && r >= 8 {
                blocks!(16);
            }
            blocks!(RB);
            while i < a.n {
                load_tile(&mut tile, i, 1);
                mtp_block::<S, 1, RC>(a, i, &panel, acc.as_mut_ptr(), tile.as_ptr());
                i += 1;
            }
            // Scatter the interleaved accumulators into Q's column-major layout.
            for (c, j) in panel.clone().enumerate() {
                let (chunk, lane) = (c / lanes, c % lanes);
                for k in 0..r {
                    *a.q.add(k * a.cols + j) = acc[(chunk * r + k) * lanes + lane];
                }
            }
        }
        c0 = panel.end;
    }
}

/// `Q[cols] = (Mᵀ P)[cols]` for one matrix: every row of `M`, the given columns, one
/// column panel at a time.
#[inline(always)]
pub(crate) unsafe fn mtp_cols<S: Simd>(a: &Mat, cols: Range<usize>) {
    // SAFETY: `cols` is inside 0..a.cols and `q` holds r columns of a.cols (caller).
    unsafe {
        match a.r {
            1 => mtp_cols_rc::<S, 1>(a, cols),
            2 => mtp_cols_rc::<S, 2>(a, cols),
            4 => mtp_cols_rc::<S, 4>(a, cols),
            8 => mtp_cols_rc::<S, 8>(a, cols),
            _ => mtp_cols_rc::<S, 0>(a, cols),
        }
    }
}

// ---------------------------------------------------------------------------------------
// M = P Qᵀ (optionally fused with E = X - M, X read from M)

// Register tiles read best with explicit indices.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn pqt_block<S: Simd, const RB: usize, const RC: usize, const FUSE: bool>(
    a: &Mat,
    i0: usize,
) {
    let lanes = S::LANES;
    let cols = a.cols;
    let r = if RC == 0 { a.r } else { RC };
    // SAFETY: the caller guarantees rows i0..i0+RB < n.
    unsafe {
        let row = |ii: usize| a.m.add((i0 + ii) * cols);
        let erow = |ii: usize| a.e.add((i0 + ii) * cols);
        let pval = |k: usize, ii: usize| *a.p.add(k * a.n + i0 + ii);
        let qcol = |k: usize| a.q.add(k * cols);
        // With a constant rank, a local copy of this block's P values: the compiler knows
        // nothing writes to it, so it keeps the broadcasts in registers across the row
        // (it cannot for `a.p`, which might alias `a.m`).
        let mut local = [[0.0f32; 8]; RB];
        if RC != 0 {
            for (ii, l) in local.iter_mut().enumerate() {
                for (k, v) in l.iter_mut().enumerate().take(RC) {
                    *v = pval(k, ii);
                }
            }
        }
        let mut j = 0;
        while j + lanes <= cols {
            let mut acc = [S::zero(); RB];
            for k in 0..r {
                let qv = S::load(qcol(k).add(j));
                for (ii, acc_i) in acc.iter_mut().enumerate() {
                    let pk = if RC != 0 { local[ii][k] } else { pval(k, ii) };
                    *acc_i = S::fma(S::splat(pk), qv, *acc_i);
                }
            }
            for (ii, &acc_i) in acc.iter().enumerate() {
                let dst = row(ii).add(j);
                if FUSE {
                    S::prefetch(dst.wrapping_add(PREFETCH));
                    let x = S::load(dst);
                    S::store(erow(ii).add(j), S::sub(x, acc_i));
                }
                S::store(dst, acc_i);
            }
            j += lanes;
        }
        while j < cols {
            for ii in 0..RB {
                let mut s = 0.0f32;
                for k in 0..r {
                    s += pval(k, ii) * *qcol(k).add(j);
                }
                let dst = row(ii).add(j);
                if FUSE {
                    *erow(ii).add(j) = *dst - s;
                }
                *dst = s;
            }
            j += 1;
        }
    }
}

#[inline(always)]
unsafe fn pqt_rows_rc<S: Simd, const RC: usize, const FUSE: bool>(a: &Mat, rows: Range<usize>) {
    const RB: usize = 4;
    let mut i = rows.start;
    // SAFETY: blocks stay inside `rows`, inside 0..n.
    unsafe {
        while i + RB <= rows.end {
            pqt_block::<S, RB, RC, FUSE>(a, i);
            i += RB;
        }
        while i < rows.end {
            pqt_block::<S, 1, RC, FUSE>(a, i);
            i += 1;
        }
    }
}

/// `M[rows] = (P Qᵀ)[rows]`; with `FUSE`, also `E[rows] = X[rows] - M[rows]` where `X`
/// is what `M` held before.
#[inline(always)]
pub(crate) unsafe fn pqt_rows<S: Simd, const FUSE: bool>(a: &Mat, rows: Range<usize>) {
    // SAFETY: forwarded caller guarantees.
    unsafe {
        match a.r {
            1 => pqt_rows_rc::<S, 1, FUSE>(a, rows),
            2 => pqt_rows_rc::<S, 2, FUSE>(a, rows),
            4 => pqt_rows_rc::<S, 4, FUSE>(a, rows),
            8 => pqt_rows_rc::<S, 8, FUSE>(a, rows),
            _ => pqt_rows_rc::<S, 0, FUSE>(a, rows),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Gram-Schmidt

#[inline(always)]
unsafe fn dot<S: Simd>(x: *const f32, y: *const f32, n: usize) -> f32 {
    let lanes = S::LANES;
    // SAFETY: x and y are valid for n elements (caller).
    unsafe {
        let mut acc = [S::zero(); 4];
        let mut j = 0;
        while j + 4 * lanes <= n {
            for (u, a) in acc.iter_mut().enumerate() {
                let o = j + u * lanes;
                *a = S::fma(S::load(x.add(o)), S::load(y.add(o)), *a);
            }
            j += 4 * lanes;
        }
        while j + lanes <= n {
            acc[0] = S::fma(S::load(x.add(j)), S::load(y.add(j)), acc[0]);
            j += lanes;
        }
        let mut s = S::reduce(S::add(S::add(acc[0], acc[1]), S::add(acc[2], acc[3])));
        while j < n {
            s += *x.add(j) * *y.add(j);
            j += 1;
        }
        s
    }
}

/// `y -= alpha * x`.
#[inline(always)]
unsafe fn sub_scaled<S: Simd>(y: *mut f32, alpha: f32, x: *const f32, n: usize) {
    let lanes = S::LANES;
    // SAFETY: x and y are valid for n elements (caller).
    unsafe {
        let na = S::splat(-alpha);
        let mut j = 0;
        while j + lanes <= n {
            S::store(y.add(j), S::fma(na, S::load(x.add(j)), S::load(y.add(j))));
            j += lanes;
        }
        while j < n {
            *y.add(j) -= alpha * *x.add(j);
            j += 1;
        }
    }
}

#[inline(always)]
unsafe fn scale<S: Simd>(x: *mut f32, alpha: f32, n: usize) {
    let lanes = S::LANES;
    // SAFETY: x is valid for n elements (caller).
    unsafe {
        let a = S::splat(alpha);
        let mut j = 0;
        while j + lanes <= n {
            S::store(x.add(j), S::mul(a, S::load(x.add(j))));
            j += lanes;
        }
        while j < n {
            *x.add(j) *= alpha;
            j += 1;
        }
    }
}

/// Sums of squares below this are recomputed on a rescaled column: their smallest
/// squares may have underflowed (`2^-60`, far above where underflow loses bits that
/// matter at f32 precision).
const TINY_SUM_OF_SQUARES: f32 = 8.673_617e-19;

/// The power of two that brings `amax` (finite, non-zero) into `[0.5, 1)`, as two factors
/// whose product it is (one factor alone overflows `f32` for subnormal `amax`). Scaling by
/// a power of two is exact, so it changes no normalised result.
fn pow2_scale(amax: f32) -> (f32, f32) {
    // amax = 2^e · f with f in [0.5, 1) for e = exponent + 1; the factor is 2^-e.
    let exp = (amax.to_bits() >> 23) as i32; // biased; 0 for subnormals
    let e = if exp == 0 {
        // Subnormal: 2^-149 · mantissa, with the mantissa's bit length.
        let mant = amax.to_bits() & 0x7f_ffff;
        (32 - mant.leading_zeros()) as i32 - 149
    } else {
        exp - 126
    };
    let half = -e / 2;
    let rest = -e - half;
    (2f32.powi(half), 2f32.powi(rest))
}

/// One modified Gram-Schmidt pass over the `r` columns at `x`. Column `k` is divided by
/// `‖c_k‖`, or set to zero when `prior[k] · ‖c_k‖ / ‖c_k‖_before ≤ tol` (its
/// relative residual over both passes; `‖c_k‖_before` is its norm at the start of the
/// pass). Returns each column's norm when normalised and its relative residual (both 0
/// for a zeroed column).
///
/// # Safety
/// `x` is valid for `r * n` elements and `r <= MAX_RANK`.
#[inline(always)]
unsafe fn mgs_pass<S: Simd>(
    x: *mut f32,
    n: usize,
    r: usize,
    prior: &[f32; crate::MAX_RANK],
    tol: f32,
) -> ([f32; crate::MAX_RANK], [f32; crate::MAX_RANK]) {
    let mut norms = [0.0f32; crate::MAX_RANK];
    let mut ratios = [0.0f32; crate::MAX_RANK];
    // SAFETY: x is valid for r * n elements (caller).
    unsafe {
        let col = |k: usize| x.add(k * n);
        let mut before = [0.0f32; crate::MAX_RANK];
        for (k, b) in before.iter_mut().enumerate().take(r) {
            *b = dot::<S>(col(k), col(k), n).sqrt();
        }
        for (i, &norm_before) in before.iter().enumerate().take(r) {
            let c = col(i);
            let norm = dot::<S>(c, c, n).sqrt();
            let ratio = if norm_before > 0.0 {
                norm / norm_before
            } else {
                0.0
            };
            if norm == 0.0 || prior[i] * ratio <= tol || !norm.is_finite() {
                std::ptr::write_bytes(c, 0, n);
                continue;
            }
            norms[i] = norm;
            ratios[i] = ratio;
            scale::<S>(c, 1.0 / norm, n);
            for j in i + 1..r {
                let d = dot::<S>(c, col(j), n);
                sub_scaled::<S>(col(j), d, c, n);
            }
        }
    }
    (norms, ratios)
}

/// Gram-Schmidt on the `r` contiguous columns of `n` elements at `x`, with the rules of
/// [`crate::Backend::orthogonalize`]:
///
/// 1. A column whose sum of squares is not finite, or so small that its squares may have
///    underflowed, is checked element by element: any NaN or infinity makes every column
///    of the matrix NaN (non-finite input propagates, so a loss scaler sees it); otherwise
///    the column is scaled by a power of two into `[0.5, 1)` (exact), so norms neither
///    overflow nor underflow, and `eps` is scaled with it.
/// 2. Modified Gram-Schmidt, each column normalised to unit length (an exactly zero column
///    stays zero).
/// 3. A second pass ("twice is enough") re-orthogonalises to working precision; a column
///    whose residual over both passes is at most `tol` of its norm is set to zero.
/// 4. With `eps > 0`, column `c` is scaled by `‖c‖ / (‖c‖ + eps)` (its norm as projected
///    in step 2), so the result is PyTorch's `c / (‖c‖ + eps)` made orthogonal.
///
/// # Safety
/// `x` is valid for `r * n` elements and `r <= MAX_RANK`.
#[inline(always)]
pub(crate) unsafe fn gram_schmidt<S: Simd>(x: *mut f32, n: usize, r: usize, eps: f32) {
    let tol = crate::dims::zero_column_tolerance(n);
    let mut eps_k = [eps; crate::MAX_RANK];
    // SAFETY: x is valid for r * n elements (caller); every column pointer is in range.
    unsafe {
        let col = |k: usize| x.add(k * n);
        for (k, eps_k) in eps_k.iter_mut().enumerate().take(r) {
            let c = col(k);
            let ss = dot::<S>(c, c, n);
            if ss.is_finite() && ss >= TINY_SUM_OF_SQUARES {
                continue;
            }
            let column = std::slice::from_raw_parts(c, n);
            if column.iter().any(|v| !v.is_finite()) {
                std::slice::from_raw_parts_mut(x, r * n).fill(f32::NAN);
                return;
            }
            let amax = column.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            if amax == 0.0 {
                continue;
            }
            let (s1, s2) = pow2_scale(amax);
            scale::<S>(c, s1, n);
            scale::<S>(c, s2, n);
            *eps_k = ((*eps_k as f64) * (s1 as f64) * (s2 as f64)).min(f32::MAX as f64) as f32;
        }
        let ones = [1.0; crate::MAX_RANK];
        // Both passes normalise to unit length (a column shrunk by a large `eps` would
        // underflow in the second pass); `eps`'s shrinking is applied at the end.
        let (norms, ratios) = mgs_pass::<S>(x, n, r, &ones, 0.0);
        let mut lengths = [0.0f32; crate::MAX_RANK];
        for k in 0..r {
            lengths[k] = if norms[k] == 0.0 {
                0.0
            } else {
                norms[k] / (norms[k] + eps_k[k])
            };
        }
        mgs_pass::<S>(x, n, r, &ratios, tol);
        if eps != 0.0 {
            for (k, &len) in lengths.iter().enumerate().take(r) {
                if len != 1.0 {
                    scale::<S>(col(k), len, n);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Entry points, one set per instruction set.

macro_rules! isa_entries {
    ($(#[$attr:meta])* $module:ident, $simd:ty) => {
        pub(crate) mod $module {
            use super::*;
            $(#[$attr])*
            pub(crate) unsafe fn mq(a: &Mat, rows: Range<usize>, fuse_add: bool) {
                // SAFETY: forwarded caller guarantees.
                unsafe {
                    if fuse_add {
                        mq_rows::<$simd, true>(a, rows)
                    } else {
                        mq_rows::<$simd, false>(a, rows)
                    }
                }
            }
            $(#[$attr])*
            pub(crate) unsafe fn mtp(a: &Mat, cols: Range<usize>) {
                // SAFETY: forwarded caller guarantees.
                unsafe { mtp_cols::<$simd>(a, cols) }
            }
            $(#[$attr])*
            pub(crate) unsafe fn pqt(a: &Mat, rows: Range<usize>, fuse_error: bool) {
                // SAFETY: forwarded caller guarantees.
                unsafe {
                    if fuse_error {
                        pqt_rows::<$simd, true>(a, rows)
                    } else {
                        pqt_rows::<$simd, false>(a, rows)
                    }
                }
            }
            $(#[$attr])*
            pub(crate) unsafe fn orthogonalize(x: *mut f32, n: usize, r: usize, eps: f32) {
                // SAFETY: forwarded caller guarantees.
                unsafe { gram_schmidt::<$simd>(x, n, r, eps) }
            }
        }
    };
}

isa_entries!(portable, super::super::simd::Portable);
#[cfg(target_arch = "x86_64")]
isa_entries!(
    #[target_feature(enable = "avx2,fma")]
    avx2,
    super::super::simd::Avx2
);
#[cfg(target_arch = "x86_64")]
isa_entries!(
    #[target_feature(enable = "avx512f,avx2,fma")]
    avx512,
    super::super::simd::Avx512
);

/// A raw pointer that may cross threads; the code sharing it guarantees disjoint access.
#[derive(Clone, Copy)]
pub(crate) struct SendPtr(pub *mut f32);
// SAFETY: users of `SendPtr` only touch disjoint ranges from different threads.
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}

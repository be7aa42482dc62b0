//! `M = P Qᵀ`, optionally fused with `E = X - M` (`X` read from `M`).

use super::pack::{pack_q_from, QPack};
use super::{
    l1_is_wide, line_lead, llc_bytes, sweep_min_bytes, zen5_or_later, Mat, PQT_OWN_PREFETCH_RANK,
    SWEEP_STRIDE,
};
use crate::cpu::simd::{Outlined, Simd};
use std::marker::PhantomData;
use std::ops::Range;

/// How far ahead (floats) the fused pass sweeps `M` and `E` into L2 when a call streams
/// [`SWEEP_MIN_BYTES`](super::SWEEP_MIN_BYTES) or more (the plain pass `M` alone): 128 KiB,
/// as `mq`'s sweep (on top of the L1 prefetch, [`PQT_PREFETCH`]). `E` is written whole, and
/// each of its stores waited for the line's read for ownership: sweeping `M` alone did not
/// help (cold, AVX-512, r = 4: 14.6-19.1 GB/s against 15.1-16.6). Cold, n = m = 4096, one
/// thread, AMD Zen 4, alternated runs, fraction of the same traffic's stream loop (`e = m;
/// m = -m`) from memory: AVX-512 r = 2 0.65-0.92 -> 0.83-0.99, r = 4 0.56-0.75 ->
/// 0.79-0.80, r = 8 0.56-0.71 -> 0.69-0.87; AVX2 r = 4 0.58-0.62 -> 0.63-0.67, r = 8
/// 0.52-0.59 -> 0.63-0.71; r = 1 unchanged (0.71-0.94).
const PQT_AHEAD: usize = 32 * 1024;
/// How far ahead (floats) both passes prefetch into L1 what they write, in every call: 8
/// lines of each row (`M`, and `E` for the fused pass). Without the prefetch each store of
/// a line not in L1 waited for its read for ownership in the store buffer (the fused pass
/// prefetched only `M`, 512 floats ahead and only below
/// [`SWEEP_MIN_BYTES`](super::SWEEP_MIN_BYTES); the plain one nothing). Intel Xeon (Emerald
/// Rapids class), median ratio of alternated pairs, 3 each, against the stream loop that
/// prefetches both too (`benches/bandwidth.rs`): with `M` in L2 (64 x 1024, 16 bytes past a
/// line), `E` prefetched 512 floats ahead, AVX-512 r = 1 / 2 / 4 / 8 1.43 / 1.44 / 1.37 /
/// 1.15 against the old pass, AVX2 1.60 / 1.65 / 1.70 / 1.09; 128 floats ahead instead of
/// 512 then 1.00 / 1.01 / 1.07 / 1.36 (AVX2 1.00 / 1.03 / 1.01 / 1.21), and 64 floats no
/// better (r = 4 0.90). From memory (n = m = 4096) both streams' L1 prefetch (512 floats
/// ahead) beside the sweep read 1.15 / 1.14 / 1.19 / 1.19 of the sweep alone, and 128
/// floats ahead the same as 512 (0.98-1.02). One row of eight vectors at r = 8 instead of
/// two of four read 1.32 in L2 but 0.86-0.90 from memory. Column chunks of `Q` (8-16 KiB,
/// blocks of 8-32 rows) to keep its 32 KiB at r = 8 in L1 read 0.85-0.98 in L2 and
/// 0.38-0.54 from memory.
///
/// The plain pass, against `fill` over the same `M` in the same run (three alternated
/// runs, AVX-512): in L2 (128 x 1024) r = 4 0.89-0.99 -> 0.98-1.06, r = 1 / 2 / 8 the
/// same; from memory (4096 x 4096) r = 1 0.98-1.05 -> 1.04-1.22, r = 4 0.57-0.59 ->
/// 0.62-0.68, r = 2 and 8 within noise.
///
/// The addresses are formed with `wrapping_add`: near the end of a buffer they point
/// past it, and `add` beyond one past the end is undefined behaviour even when never
/// read.
const PQT_PREFETCH: usize = 128;

/// Whether a pass prefetches into L1 what it writes ([`PQT_PREFETCH`]): always, but for
/// the fused pass in cache (a call that does not sweep) on AMD Zen 5 and later (`zen5`,
/// [`zen5_or_later`]), whose stores there keep up without it and whose load slots the
/// two prefetches a vector take. AMD EPYC (Zen 5, KVM), `--roofline`, `pqt+e` without
/// them, median ratio of alternated pairs (four each), in L2 / from memory / from the
/// LLC: AVX-512 r = 1 1.14 / 1.11 / 1.03, r = 2 1.06 / 0.99 / 1.02, r = 4 1.01 / 0.99 /
/// 1.19, r = 8 1.04 / 1.02 / 1.05; AVX2 r = 1 1.26 / 1.05 / 1.00, r = 2 1.35 / 1.02 /
/// 0.96, r = 4 1.08 / 1.01 / 1.00 (from memory and the LLC only r = 1 goes without on
/// that core: the others sweep there). A probe at 64 x 1024 in L2 (r = 1, one thread):
/// 69-70 -> 80-81 GB/s of `M`, where a plain loop of the same steps read 106-111.
fn pqt_prefetches_l1(fuse: bool, sweep: bool, zen5: bool) -> bool {
    !(fuse && zen5 && !sweep)
}

/// The columns a [`pqt_block`] call writes in each of its rows: the whole vectors
/// `from..to` (vector boundaries counted from the row's first line boundary, `lead`),
/// and with `edges` also the columns before `lead` and past the row's last whole vector.
#[derive(Clone, Copy)]
struct Span {
    from: usize,
    to: usize,
    edges: bool,
}

impl Span {
    /// The whole row: its `nvec` whole vectors of `lanes` from `lead`, and its edges.
    fn whole(lead: usize, nvec: usize, lanes: usize) -> Span {
        Span {
            from: lead,
            to: lead + nvec * lanes,
            edges: true,
        }
    }

    /// Chunk `c` of `chunks`, `chunk` whole vectors each (the last one what is left, and
    /// the edges), of the row [`Span::whole`] describes.
    fn chunk(
        lead: usize,
        nvec: usize,
        lanes: usize,
        chunk: usize,
        c: usize,
        chunks: usize,
    ) -> Span {
        Span {
            from: lead + c * chunk * lanes,
            to: (lead + (c + 1) * chunk * lanes).min(lead + nvec * lanes),
            edges: c + 1 == chunks,
        }
    }
}

/// Bytes of packed `Q` a column chunk of [`pqt_chunk_vectors`] holds: 512 columns at
/// r = 8, so that the chunk stays in a 48 KiB L1 beside the rows of `M` and `E` passing
/// over it. Each element of `M` and `E` is written once, from its own chain of `r`
/// multiply-adds, so the chunks add no traffic and change no bit: only `Q` is read
/// again, from L1 once a chunk instead of from L2 once a block of rows.
const PQT_CHUNK_BYTES: usize = 16 * 1024;

/// Bytes of packed `Q` above which the `P Qᵀ` passes go in column chunks
/// ([`pqt_chunk_vectors`]): half of a 48 KiB L1. At 24 KiB (r = 3 at 2048 columns, r = 6
/// at 1024) the chunks read the same as whole rows.
const PQT_CHUNK_MIN_BYTES: usize = 24 * 1024;

/// Whole vectors a column chunk of the `P Qᵀ` passes holds, a multiple of 8 (of every
/// tile's `U`), or all `nvec` of a row (no chunks). On AMD Zen 5 and later (`zen5`,
/// [`zen5_or_later`]) a call at rank 3 or more whose packed `Q` is larger than
/// [`PQT_CHUNK_MIN_BYTES`] goes in chunks of [`PQT_CHUNK_BYTES`] where the matrices it
/// writes fit the last-level cache (`fits_llc`; calls that do not `sweep` are in
/// cache): over whole rows each row block read all of `Q` from L2 (at r = 8 and 1024
/// columns as much as the block's `M`, the multiply-adds waiting on it). AMD EPYC (Zen
/// 5, KVM), one thread, a probe alternating both walks on the same buffers (median GB/s
/// of `M`, `pqt_error`):
/// - in L2, AVX-512: r = 8 at 64 x 1024 / 32 x 2048 / 16 x 4096 34 / 20 / 19 -> 47 / 39
///   / 32, r = 4 at 2048-8192 columns 31-35 -> 39-55 (1024 columns, 16 KiB, stays
///   whole), r = 6 1.51-1.74 at 2048-4096, r = 3 1.37 at 4096; AVX2 r = 4 1.38-1.43,
///   r = 8 1.17-1.22. Rank 2 read the same (0.98-1.05 up to 8192 columns) and rank 1
///   lost its one-vector walk ([`pqt_one_vector_walk`]), so both stay whole;
/// - from the LLC (512 x 4096, read once before): AVX-512 r = 8 1.17, r = 4 1.37; AVX2
///   r = 4 1.13 but r = 8 (four rows of two vectors) 0.93, so AVX2 calls that `sweep`
///   stay whole above r = 4;
/// - from memory (4096 x 4096) the probe read 1.15-1.40 (AVX-512, r = 4 and 8) but
///   `bench lowrank --roofline`'s `cold` 0.93-0.95 (three alternated pairs: there each
///   call follows the reference's writes of `M` and `E`), and two threads read the same
///   (0.94-1.01): calls larger than the LLC stay whole.
///
/// The plain pass (`pqt`) in L2, the same probe: r = 8 at 32 x 2048 20 -> 37, r = 4 at
/// 32 x 2048 / 16 x 4096 70 / 38 -> 83 / 70, r = 8 at 1024 columns the same (0.97-0.99).
fn pqt_chunk_vectors(
    r: usize,
    lanes: usize,
    nvec: usize,
    sweep: bool,
    fits_llc: bool,
    zen5: bool,
) -> usize {
    let vector_bytes = r * lanes * 4;
    let chunked = zen5
        && r >= 3
        && nvec * vector_bytes > PQT_CHUNK_MIN_BYTES
        && (!sweep || (fits_llc && (lanes >= 16 || r <= 4)));
    if chunked {
        (PQT_CHUNK_BYTES / vector_bytes / 8 * 8).max(8)
    } else {
        nvec.max(1)
    }
}

/// The rows `i0..i0 + RB` of [`pqt_rows_with`] over the columns of `span`: `RB` rows of
/// `U` vectors a step, each element from `r` fused multiply-adds in `k` order (`RC`
/// the rank where it is constant, else 0 and `a.r`); `qpack` is `Q` packed from `lead`
/// ([`pack_q_from`]); with `sweep` the rows ahead are prefetched into L2.
// Register tiles read best with explicit indices.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn pqt_block<
    S: Simd,
    const RB: usize,
    const U: usize,
    const RC: usize,
    const FUSE: bool,
    const NT: bool,
>(
    a: &Mat,
    i0: usize,
    qpack: *const f32,
    lead: usize,
    sweep: bool,
    span: Span,
) {
    let lanes = S::LANES;
    let r = if RC == 0 { a.r } else { RC };
    let pf = PQT_PREFETCH;
    // The L1 prefetch of what the pass writes ([`PQT_PREFETCH`], [`pqt_prefetches_l1`]).
    let pfon = pqt_prefetches_l1(FUSE, sweep, zen5_or_later());
    // The plain pass writes `M` whole: around the caches with `NT` (the fused one `E`).
    let m_nt = NT && !FUSE;
    // SAFETY: the caller guarantees rows i0..i0+RB < n and `span`'s whole vectors inside
    // the rows, from `lead` (packed in `qpack`). Prefetch addresses are formed with
    // `wrapping_add` (they may lie past the buffers) and a prefetch never faults.
    unsafe {
        let row = |ii: usize| a.m.add((i0 + ii) * a.cols);
        let erow = |ii: usize| a.e.add((i0 + ii) * a.cols);
        let pval = |k: usize, ii: usize| *a.p.add(k * a.n + i0 + ii);
        // Q's vectors packed (`pack_q`): at power-of-two widths Q's r columns, the RB rows
        // of M and of E all map to the same L1 sets, more lines than it has ways.
        // (`r`, a constant with `RC`: with `a.r` every vector's address took a multiply.)
        let qvec = |k: usize, j: usize| qpack.add(((j - lead) / lanes * r + k) * lanes);
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
        // U vectors a row at once: RB x U independent chains of r fused multiply-adds
        // (with one vector a row, the RB chains each waited 4 cycles an FMA).
        let mut j = span.from;
        while j + U * lanes <= span.to {
            let mut acc = [[S::zero(); U]; RB];
            // This step's first vector of packed `Q` (`j - lead` is a multiple of
            // `lanes`): vector `u` of column `k` lies `(u * r + k) * lanes` on.
            let qstep = qvec(0, j);
            for k in 0..r {
                let mut qv = [S::zero(); U];
                for (u, q) in qv.iter_mut().enumerate() {
                    *q = S::load(qstep.add((u * r + k) * lanes));
                }
                for (ii, acc_i) in acc.iter_mut().enumerate() {
                    let pk = S::splat(if RC != 0 { local[ii][k] } else { pval(k, ii) });
                    for (u, a_u) in acc_i.iter_mut().enumerate() {
                        *a_u = S::fma(pk, qv[u], *a_u);
                    }
                }
            }
            for (ii, acc_i) in acc.iter().enumerate() {
                for (u, &a_u) in acc_i.iter().enumerate() {
                    let dst = row(ii).add(j + u * lanes);
                    if pfon && !m_nt {
                        S::prefetch(dst.wrapping_add(pf));
                    }
                    let swept = sweep && (u * lanes).is_multiple_of(SWEEP_STRIDE);
                    if swept && !m_nt {
                        S::prefetch_l2(dst.wrapping_add(PQT_AHEAD));
                    }
                    if FUSE {
                        let edst = erow(ii).add(j + u * lanes);
                        let x = S::load(dst);
                        if NT {
                            // Around the caches: no prefetch, no read for ownership.
                            S::store_nt(edst, S::sub(x, a_u));
                        } else {
                            if pfon {
                                S::prefetch(edst.wrapping_add(pf));
                            }
                            if swept {
                                S::prefetch_l2(edst.wrapping_add(PQT_AHEAD));
                            }
                            S::store(edst, S::sub(x, a_u));
                        }
                    }
                    if m_nt {
                        S::store_nt(dst, a_u);
                    } else {
                        S::store(dst, a_u);
                    }
                }
            }
            j += U * lanes;
        }
        while j + lanes <= span.to {
            let mut acc = [S::zero(); RB];
            for k in 0..r {
                let qv = S::load(qvec(k, j));
                for (ii, acc_i) in acc.iter_mut().enumerate() {
                    let pk = if RC != 0 { local[ii][k] } else { pval(k, ii) };
                    *acc_i = S::fma(S::splat(pk), qv, *acc_i);
                }
            }
            for (ii, &acc_i) in acc.iter().enumerate() {
                let dst = row(ii).add(j);
                if FUSE {
                    let x = S::load(dst);
                    if NT {
                        S::store_nt(erow(ii).add(j), S::sub(x, acc_i));
                    } else {
                        S::store(erow(ii).add(j), S::sub(x, acc_i));
                    }
                }
                if m_nt {
                    S::store_nt(dst, acc_i);
                } else {
                    S::store(dst, acc_i);
                }
            }
            j += lanes;
        }
        if span.edges {
            pqt_edges::<S, RB, RC, FUSE>(a, i0, lead, j, &local);
        }
    }
}

/// The columns of [`pqt_block`]'s (or [`pqt_row`]'s) rows at `i0` before the first line
/// boundary (`lead`) and the ragged ones from `j` (past the last whole vector): masked
/// vectors ([`pqt_edge`]), the same operations lane by lane (the same bits).
#[inline(always)]
unsafe fn pqt_edges<S: Simd, const RB: usize, const RC: usize, const FUSE: bool>(
    a: &Mat,
    i0: usize,
    lead: usize,
    j: usize,
    local: &[[f32; 8]; RB],
) {
    let lanes = S::LANES;
    // SAFETY: the caller's rows and shape; `pqt_edge` touches only the lanes inside
    // columns 0..lead and j..cols of them.
    unsafe {
        let mut end = lead as isize;
        while end > 0 {
            let c0 = end - lanes as isize;
            let lo = if c0 < 0 { c0.unsigned_abs() } else { 0 };
            pqt_edge::<S, RB, RC, FUSE>(a, i0, c0, lo, lanes, local);
            end = c0;
        }
        if j < a.cols {
            pqt_edge::<S, RB, RC, FUSE>(a, i0, j as isize, 0, a.cols - j, local);
        }
    }
}

/// One row of [`pqt_block`] at rank `RC`, one vector at a time in a loop of its own:
/// for each whole vector from the row's first line boundary (`lead`), `RC` fused
/// multiply-adds from zero in `k` order, then (with `FUSE`) `E = X - M` and `M`; the
/// columns before `lead` and past the last whole vector through [`pqt_edge`]. The same
/// operations on each element in the same order as [`pqt_block`], so the same bits.
///
/// For [`pqt_one_vector_walk`]: the tile walk of one row (eight vectors a step, the
/// prefetch and sweep branches in its loop) read less than a loop of its steps.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn pqt_row<S: Simd, const RC: usize, const FUSE: bool, const NT: bool>(
    a: &Mat,
    i: usize,
    qpack: *const f32,
    lead: usize,
) {
    // A copy of the shape: through the reference LLVM would reload it after every store.
    let a = &{ *a };
    let lanes = S::LANES;
    let cols = a.cols;
    // SAFETY: the caller guarantees row `i` inside 0..n, `qpack` holding `RC` packed
    // vectors for every whole vector of the row from `lead` (`pack_q_from`), and, with
    // `FUSE`, `E` of `M`'s shape; every vector read or written lies inside the row, and
    // the edges touch only their lanes inside it (`pqt_edge`). `E`'s row pointer is
    // formed with `wrapping_add` (null without `FUSE`, never dereferenced then).
    unsafe {
        let mut local = [[0.0f32; 8]; 1];
        let mut pk = [S::zero(); 8];
        for k in 0..RC {
            local[0][k] = *a.p.add(k * a.n + i);
            pk[k] = S::splat(local[0][k]);
        }
        let row = a.m.add(i * cols);
        let erow = a.e.wrapping_add(i * cols);
        let mut j = lead;
        let mut qv = qpack;
        while j + lanes <= cols {
            let mut acc = S::zero();
            for k in 0..RC {
                acc = S::fma(pk[k], S::load(qv.add(k * lanes)), acc);
            }
            let dst = row.add(j);
            if FUSE {
                let x = S::load(dst);
                if NT {
                    S::store_nt(erow.add(j), S::sub(x, acc));
                } else {
                    S::store(erow.add(j), S::sub(x, acc));
                }
            }
            S::store(dst, acc);
            j += lanes;
            qv = qv.add(RC * lanes);
        }
        pqt_edges::<S, 1, RC, FUSE>(a, i, lead, j, &local);
    }
}

/// Whether the fused pass (`fuse`) at rank `r` on `lanes` lanes goes one vector at a
/// time ([`pqt_row`]) for a call that does not `sweep`: at r = 1 with AVX-512 on AMD Zen
/// 5 and later (`zen5`, [`zen5_or_later`]). AMD EPYC (Zen 5, KVM), `--roofline`, `pqt+e`
/// with `M` in L2, median ratio of four alternated pairs: r = 1 1.16 (r = 2 1.05, r = 4
/// and 8 1.00-1.03), from memory 1.01, from the LLC 0.97; with AVX2 r = 1 0.89, so it
/// keeps the tile walk. A probe (64 x 1024 in L2): 64-80 -> 92-98 GB/s of `M` at 16 bytes
/// past a line. The plain pass (`pqt`) was not measured and keeps the tile walk.
fn pqt_one_vector_walk(fuse: bool, lanes: usize, r: usize, sweep: bool, zen5: bool) -> bool {
    fuse && zen5 && lanes == 16 && r == 1 && !sweep
}

/// Lanes `lo..hi` of the vector at column `c0` (negative for a vector that starts before
/// the row) of [`pqt_block`]'s rows, through masked loads and stores: only those lanes'
/// memory is touched. `local` holds the block's `P` values when `RC` is not 0.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn pqt_edge<S: Simd, const RB: usize, const RC: usize, const FUSE: bool>(
    a: &Mat,
    i0: usize,
    c0: isize,
    lo: usize,
    hi: usize,
    local: &[[f32; 8]; RB],
) {
    let r = if RC == 0 { a.r } else { RC };
    // SAFETY: lanes lo..hi lie at columns 0..cols of rows i0..i0+RB (the caller), of `Q`'s
    // r columns and of `E`'s rows; only they are read and written (`load_lanes`,
    // `store_lanes`), and the pointers to the vectors' starts are formed with
    // `wrapping_offset`.
    unsafe {
        let mut acc = [S::zero(); RB];
        for k in 0..r {
            let qv = S::load_lanes(a.q.wrapping_add(k * a.cols).wrapping_offset(c0), lo, hi);
            for ii in 0..RB {
                let pk = if RC != 0 {
                    local[ii][k]
                } else {
                    *a.p.add(k * a.n + i0 + ii)
                };
                acc[ii] = S::fma(S::splat(pk), qv, acc[ii]);
            }
        }
        for ii in 0..RB {
            let at = |buf: *mut f32| buf.wrapping_add((i0 + ii) * a.cols).wrapping_offset(c0);
            let dst = at(a.m);
            if FUSE {
                let x = S::load_lanes(dst, lo, hi);
                S::store_lanes(at(a.e), S::sub(x, acc[ii]), lo, hi);
            }
            S::store_lanes(dst, acc[ii], lo, hi);
        }
    }
}

/// Where each row's vectors start: at [`line_lead`] when a vector fits after it, at 0
/// otherwise. The columns before it are masked vectors ([`pqt_edge`]).
///
/// With `M` in L2 (AMD Zen 4, 128 x 1024, three alternated runs), `pqt_error` AVX2 r = 1
/// 0.74-0.78 -> 1.09-1.18 of the in-core limit, r = 2 0.73-0.78 -> 0.77-1.10, r = 4
/// 0.57-0.67 -> 0.65-0.76, r = 8 0.37-0.51 -> 0.37-0.56, with those columns one at a
/// time; with AVX-512 its 12-16 scalar columns a row cost more than the split lines
/// (r = 1 0.90-0.96 -> 0.69-0.81, r = 8 0.45-0.56 -> 0.38-0.42), which the masked
/// vectors do not.
fn vector_start<S: Simd>(a: &Mat) -> usize {
    match line_lead(a, 0) {
        lead if lead + S::LANES <= a.cols => lead,
        _ => 0,
    }
}

#[inline(always)]
unsafe fn pqt_rows_rc<S: Simd, const RC: usize, const FUSE: bool>(a: &Mat, rows: Range<usize>) {
    let lead = vector_start::<S>(a);
    // The stream written whole: `E` in the fused pass, `M` in the plain one.
    let whole = if FUSE { a.e } else { a.m };
    let nt = writes_around_caches::<S>(a, whole, &rows, lead, zen5_or_later());
    // SAFETY: forwarded caller guarantees; the stream written whole goes around the
    // caches only where every vector of it the walk stores lies on a vector boundary.
    unsafe {
        if nt {
            pqt_rows_with::<S, RC, FUSE, true>(a, rows, None)
        } else {
            pqt_rows_with::<S, RC, FUSE, false>(a, rows, None)
        }
    }
}

/// [`pqt_rows_rc`] with the stream written whole (`E` in the fused pass, `M` in the
/// plain one) around the caches or not (`NT`, [`writes_around_caches`]), in column
/// chunks of `chunk` whole vectors (`None`: [`pqt_chunk_vectors`]; any count gives the
/// same bits).
///
/// # Safety
/// As [`pqt_rows_rc`]; with `NT`, every vector of that stream from column
/// [`vector_start`] of each row lies on a vector boundary.
#[inline(always)]
unsafe fn pqt_rows_with<S: Simd, const RC: usize, const FUSE: bool, const NT: bool>(
    a: &Mat,
    rows: Range<usize>,
    chunk: Option<usize>,
) {
    // Two rows with four vectors each (eight independent chains) at r = 8 (and any rank
    // above 4), where one row would load each vector of Q for 8 FMAs of one row only;
    // one row with eight vectors at r <= 4, where the loads are few and a second row's
    // M and E lines only add to the L1 sets they share at power-of-two widths. With four
    // rows of M and four of E in flight (and Q's columns, before packing) one set held
    // more lines than it has ways (Zen 4, M in L2: 0.41-0.66 of the in-core limit at
    // r <= 4 with 4 rows, 0.69-0.92 with 2). Two rows against one at r <= 4, M in L2,
    // AMD Zen 4, alternated runs: AVX-512 r = 4 0.56-0.66 -> 0.62-0.76 of the in-core
    // limit, r = 2 0.72-0.84 -> 0.78-0.90; AVX2 r = 4 0.59-0.67 -> 0.71-0.73, r = 1
    // 0.76-0.80 -> 0.82-0.84. At r = 8 one row read 0.33-0.40 against 0.41-0.59.
    // A call that streams from memory (`sweep`) on an L1 of 12 ways or more
    // ([`l1_is_wide`]) takes four rows of two vectors above r = 4 instead: each vector of
    // `Q` is loaded for four rows' FMAs, not two, and the four rows of `M` and of `E`
    // fit such a set beside `Q`'s line. Intel Xeon (Emerald Rapids class), median ratio
    // of alternated pairs against two rows: `pqt_error` r = 8 (`--roofline`, eight pairs)
    // from memory (4096 x 4096) 1.06-1.07 (AVX-512, AVX2), from the last-level cache
    // 1.03-1.04, but with `M` in L2 0.93-0.96, so calls in cache keep two rows; from
    // memory, nine pairs, AVX-512 / AVX2, `pqt_error` r = 5, 8, 16 1.03 / 1.03, 1.05 /
    // 1.06, 1.09 / 1.02 and `pqt` r = 5, 8 1.11 / 1.12, 1.14 / 1.15. Such a call takes
    // two rows of four vectors at r = 2 to 4 too, where one row of eight read the same
    // lines with each vector of `Q` loaded for one row: `pqt_error` (`--roofline`, four
    // and five pairs, AVX-512 / AVX2) from memory r = 2 1.06 / 1.04, r = 4 1.14 / 1.09,
    // from the last-level cache 1.07 / 1.05 and 1.16 / 1.10 (r = 1 the same, so it keeps
    // one row); from memory at 4096 x 4096, nine pairs, `pqt_error` r = 2 / 3 / 4 1.02 /
    // 1.05 / 1.08 (AVX-512) and 1.06 / 1.06 / 1.08 (AVX2), `pqt` 1.10 / 1.22 / 1.23 and
    // 1.01 / 1.22 / 1.26.
    // The tile does not change how any element is summed (each is its own chain of r
    // FMAs in k order), so results are bit-identical either way.
    let lanes = S::LANES;
    let lead = vector_start::<S>(a);
    let nvec = (a.cols - lead) / lanes;
    let mut pack = QPack::take(a.r * nvec * lanes + 16);
    let qpack = pack.aligned();
    let sweep = rows.len() * a.cols * 4 >= sweep_min_bytes(a.r, S::LANES, PQT_OWN_PREFETCH_RANK);
    let _fence = NT.then(|| FenceNt::<S>(std::marker::PhantomData));
    // SAFETY: the pack holds r * nvec vectors from its aligned start; blocks stay inside
    // `rows`, inside 0..n.
    unsafe {
        pack_q_from::<S>(a, lead, nvec, qpack);
        let zen5 = zen5_or_later();
        // `M`, and `E` when fused, of the whole matrix (the threads share the LLC).
        let written = a.n * a.cols * 4 * if FUSE { 2 } else { 1 };
        let fits_llc = written <= llc_bytes();
        // Column chunks of `Q` ([`pqt_chunk_vectors`], or `chunk` vectors), each over
        // all the rows; the last one also writes the rows' edges.
        let chunk = chunk
            .unwrap_or_else(|| pqt_chunk_vectors(a.r, lanes, nvec, sweep, fits_llc, zen5))
            .clamp(1, nvec.max(1));
        let chunks = nvec.div_ceil(chunk).max(1);
        let tiles = Tiles {
            lead,
            sweep,
            wide_sweep: sweep && l1_is_wide(),
            zen5,
        };
        // Whole rows call the tiles' walks ([`Blocks`]) outside the chunks' loop: when the
        // walks were inlined, the chunks' loop around them cost AVX2 `pqt+e` at r = 1
        // 0.11-0.14 in L2.
        if chunks == 1 {
            let span = Span::whole(lead, nvec, lanes);
            pqt_tiles::<S, RC, FUSE, NT>(a, rows, qpack, tiles, span, true);
        } else {
            for c in 0..chunks {
                let span = Span::chunk(lead, nvec, lanes, chunk, c, chunks);
                pqt_tiles::<S, RC, FUSE, NT>(a, rows.clone(), qpack, tiles, span, false);
            }
        }
    }
}

/// What [`pqt_tiles`] needs of its call besides the rows and the columns.
#[derive(Clone, Copy)]
struct Tiles {
    /// Floats before the rows' first line boundary ([`vector_start`]).
    lead: usize,
    /// The call streams from memory or the LLC ([`sweep_min_bytes`]).
    sweep: bool,
    /// `sweep` on an L1 of 12 ways or more ([`l1_is_wide`]).
    wide_sweep: bool,
    /// An AMD Zen 5 or later core ([`zen5_or_later`]).
    zen5: bool,
}

/// The rows `rows` of [`pqt_rows_with`] over the columns of `span`, in the row tiles
/// its comment describes; `whole` (the span is the whole row) lets rank 1 take the
/// one-vector walk ([`pqt_one_vector_walk`]).
///
/// # Safety
/// As [`pqt_rows_with`]; `qpack` holds `Q` packed from `tiles.lead`, and `span` lies
/// inside the rows' whole vectors from there.
#[inline(always)]
unsafe fn pqt_tiles<S: Simd, const RC: usize, const FUSE: bool, const NT: bool>(
    a: &Mat,
    rows: Range<usize>,
    qpack: *const f32,
    tiles: Tiles,
    span: Span,
    whole: bool,
) {
    let Tiles {
        lead,
        sweep,
        wide_sweep,
        zen5,
    } = tiles;
    // The rank, a constant with `RC` (`pqt_rows` dispatches on `a.r`): the tiles that
    // rank never takes are not compiled.
    let r = if RC == 0 { a.r } else { RC };
    let mut i = rows.start;
    let end = rows.end;
    // SAFETY: forwarded caller guarantees; every block lies inside `rows`.
    unsafe {
        macro_rules! blocks {
            ($rb:literal, $u:literal) => {
                i = S::outlined(Blocks::<S, $rb, $u, RC, FUSE, NT> {
                    a,
                    i,
                    end,
                    qpack,
                    lead,
                    sweep,
                    span,
                    isa: PhantomData,
                })
            };
        }
        if r > 4 && wide_sweep {
            blocks!(4, 2);
        }
        if (2..=4).contains(&r) && wide_sweep {
            blocks!(2, 4);
        }
        // Two rows of four at r = 4 in cache too on Zen 5: [`PQT_ZEN5_TWO_ROWS_RANK`].
        if r > 4 || (r == PQT_ZEN5_TWO_ROWS_RANK && zen5) {
            blocks!(2, 4);
        }
        if RC == 1 && whole && pqt_one_vector_walk(FUSE, S::LANES, r, sweep, zen5) {
            i = S::outlined(Rows::<S, FUSE, NT> {
                a,
                i,
                end,
                qpack,
                lead,
                isa: PhantomData,
            });
        }
        blocks!(1, 8);
        debug_assert_eq!(i, end);
    }
}

/// [`pqt_block`]s of `RB` rows from row `i` while they fit before `end`, in a function of
/// its own ([`Simd::outlined`]); it returns the row after the last block. One function
/// for each tile, where each of [`pqt_tiles`]' walks inlined (whole rows, chunks, and
/// the tiles each rank can take) compiled a copy of it: the crate's build took twice
/// as long. Its arguments are [`pqt_block`]'s.
struct Blocks<
    'a,
    S,
    const RB: usize,
    const U: usize,
    const RC: usize,
    const FUSE: bool,
    const NT: bool,
> {
    a: &'a Mat,
    i: usize,
    end: usize,
    qpack: *const f32,
    lead: usize,
    sweep: bool,
    span: Span,
    isa: PhantomData<S>,
}

impl<
        S: Simd,
        const RB: usize,
        const U: usize,
        const RC: usize,
        const FUSE: bool,
        const NT: bool,
    > Outlined for Blocks<'_, S, RB, U, RC, FUSE, NT>
{
    type Output = usize;
    #[inline(always)]
    unsafe fn run(self) -> usize {
        // A copy of the shape: through the field's reference LLVM would reload it after
        // every store (it cannot know that nothing writes to it).
        let a = &{ *self.a };
        let mut i = self.i;
        while i + RB <= self.end {
            // SAFETY: the guarantees of `pqt_block` for rows `i..i + RB`, inside the rows
            // `self.i..self.end` that the creator of the work gives them for.
            unsafe {
                pqt_block::<S, RB, U, RC, FUSE, NT>(
                    a, i, self.qpack, self.lead, self.sweep, self.span,
                )
            };
            i += RB;
        }
        i
    }
}

/// [`pqt_row`] at rank 1 for every row from `i` to `end`, in a function of its own
/// ([`Blocks`]); it returns `end`.
struct Rows<'a, S, const FUSE: bool, const NT: bool> {
    a: &'a Mat,
    i: usize,
    end: usize,
    qpack: *const f32,
    lead: usize,
    isa: PhantomData<S>,
}

impl<S: Simd, const FUSE: bool, const NT: bool> Outlined for Rows<'_, S, FUSE, NT> {
    type Output = usize;
    #[inline(always)]
    unsafe fn run(self) -> usize {
        for i in self.i..self.end {
            // SAFETY: the guarantees of `pqt_row` for row `i`, inside the rows
            // `self.i..self.end` that the creator of the work gives them for.
            unsafe { pqt_row::<S, 1, FUSE, NT>(self.a, i, self.qpack, self.lead) };
        }
        self.end.max(self.i)
    }
}

/// Orders the thread's stores around the caches ([`Simd::store_nt`]) before anything it
/// does next, and so before the join that hands `E` to the caller, when dropped: at the
/// end of the walk or on an unwind through it.
struct FenceNt<S: Simd>(std::marker::PhantomData<S>);

impl<S: Simd> Drop for FenceNt<S> {
    fn drop(&mut self) {
        // SAFETY: `sfence` (SSE, on every x86_64 core) or nothing; it touches no memory.
        unsafe { S::fence_nt() }
    }
}

/// Whether a pass writes the stream it writes whole (`whole`: `E` in the fused pass, `M`
/// in the plain one) around the caches ([`Simd::store_nt`]) for the rows `rows` of `a`,
/// its vectors from column `lead`: on AMD Zen 5 and later (`zen5`, [`zen5_or_later`])
/// for calls that stream [`SWEEP_MIN_BYTES`](super::SWEEP_MIN_BYTES) or more, where every
/// vector of that stream the walk stores lies on a vector boundary (`E` lies as `M` does
/// modulo the vector, as two buffers of one allocator and one layout do; rows a whole
/// number of vectors long). A plain store first reads each line for ownership: from
/// memory a stream more (the fused pass reads `X` and writes `M` and `E`; the plain one
/// only writes `M`). Around the caches the line goes to memory whole. The stream's
/// readers come later: `E` at the hook's next step (`add_mq`), `M` after the hook's
/// other matrices (the optimizer), past what the caches hold in training. AMD EPYC
/// (Zen 5, KVM), a probe of one thread alternating groups of four calls on the same
/// buffers (the first of each group dropped), from memory (8192 x 4096), GB/s of `M`,
/// r = 1 / 2 / 4 / 8: `pqt_error` AVX-512 16.6 / 13.0 / 11.9 / 12.5 -> 17.4 / 16.9 /
/// 14.5 / 17.8, AVX2 17.7 / 13.4 / 12.9 / 14.7 -> 24.3 / 20.4 / 21.2 / 21.9, two threads
/// (AVX-512) r = 2 / 4 / 8 17.3 / 17.8 / 17.3 -> 25.0 / 25.5 / 25.8, from the LLC (512 x
/// 4096, repeated) 1.27-1.44; `pqt` AVX-512 20.8 / 23.9 / 22.4 / 23.6 -> 30.1 / 33.7 /
/// 28.7 / 32.9, AVX2 26.6 / 23.5 / 21.9 / 24.2 -> 34.4 / 36.4 / 32.6 / 26.8, two threads
/// r = 2 / 8 30.9 / 29.4 -> 40.7 / 37.7. The fused pass's `M` (read, then written)
/// around the caches too read 1.04-1.28 more with AVX-512 and one thread, the same with
/// two, 0.72 with AVX2 at r = 8 and 0.82-0.85 from the LLC (where the next call reads
/// `M` back), so it keeps plain stores. Other cores were not measured and keep plain
/// stores.
fn writes_around_caches<S: Simd>(
    a: &Mat,
    whole: *mut f32,
    rows: &Range<usize>,
    lead: usize,
    zen5: bool,
) -> bool {
    let vector_bytes = S::LANES * 4;
    zen5 && rows.len() * a.cols * 4 >= super::SWEEP_MIN_BYTES
        && a.cols.is_multiple_of(S::LANES)
        && (whole.wrapping_add(rows.start * a.cols + lead) as usize).is_multiple_of(vector_bytes)
}

/// The rank at which a call in cache reads two rows of four vectors on AMD Zen 5 and
/// later ([`zen5_or_later`]), where other cores read one row of eight: there each
/// vector of `Q` serves two rows' multiply-adds. AMD EPYC (Zen 5, KVM), `--roofline`,
/// `pqt+e` with `M` in L2, median ratio of alternated pairs: AVX-512 1.16-1.20 (three
/// sets of four to six pairs), AVX2 1.17 (four pairs); r = 1 and 2 read 0.98-1.01, so
/// they keep one row. Calls from memory on a 12-way L1 read two rows already.
const PQT_ZEN5_TWO_ROWS_RANK: usize = 4;

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

#[cfg(test)]
mod tests;

//! `mtp`'s row-streaming kernels: blocks of rows added to a packed `Q` in panels that
//! stay in L1 ([`mtp_stream`], for 8 lanes and on some cores 16), and one row at a time
//! ([`mtp_stream_one_row`]). [`mtp_cols`] chooses between them and the strips of the
//! parent module; all give the same bits.

use super::*;

/// Rows the streaming kernel ([`mtp_stream`]) adds to each vector of `Q` in one pass.
const MTP_STREAM_ROWS: usize = 4;
/// Floats of each row [`mtp_stream`] keeps in L1 (2 KiB a row, 8 KiB for its rows) while
/// its passes (one per tile of [`MTP_STREAM_COLS`] columns of `Q`) go over them.
const MTP_STREAM_PANEL: usize = 512;
/// Columns of `Q` one pass of [`mtp_stream`] adds the rows to: the rows' vectors are
/// loaded once for them, and `RB x KT` splats of `P`, `RB` row vectors and an
/// accumulator fill 13 of AVX2's 16 registers.
const MTP_STREAM_COLS: usize = 2;

/// Bytes at least that [`mtp_stream`] sweeps ahead, in whole blocks of rows.
const MTP_STREAM_AHEAD_BYTES: usize = 128 * 1024;

/// [`mtp_stream`] for the `RB` rows at `i0`: for each panel of the vectors `0..nvec`
/// (from column `c0`) and each tile of [`MTP_STREAM_COLS`] columns of `Q` (`KT` the
/// tile's width), the rows' vectors loaded once and `RB` fused multiply-adds into each
/// of the tile's vectors of the packed `Q` at `qp` (`qp[(v * r + k) * lanes]`), the
/// rows' `P` values in registers and their vectors from L1 (read once a tile). `c0` may
/// lie before the columns (a shift, [`stream_shift`]); with `EDGE` only the lanes `valid`
/// of the vectors are read (the others are zero). With `NEAR` the first pass prefetches
/// each row's own line [`NEAR_FLOATS`] ahead into L1 (a constant: the stream is the
/// 8-lane kernels' walk in cache, whose loop a flag's test cost up to a quarter).
// Register tiles read best with explicit indices.
#[allow(clippy::needless_range_loop, clippy::too_many_arguments)]
#[inline(always)]
unsafe fn mtp_stream_tile<
    S: Simd,
    const RB: usize,
    const KT: usize,
    const EDGE: bool,
    const NEAR: bool,
>(
    a: &Mat,
    i0: usize,
    c0: isize,
    vecs: Range<usize>,
    k0: usize,
    qp: *mut f32,
    ahead_rows: usize,
    valid: (usize, usize),
) {
    let lanes = S::LANES;
    // The tiles start at multiples of MTP_STREAM_COLS: this is tile `pass` of `passes`.
    let (pass, passes) = (k0 / MTP_STREAM_COLS, a.r.div_ceil(MTP_STREAM_COLS));
    // SAFETY: the caller guarantees rows i0..i0+RB inside 0..n, the vectors `vecs` from
    // column c0 inside the row (with EDGE, their lanes `valid`, the only ones a masked
    // load reads), columns k0..k0+KT inside 0..r, and `qp` holding the r
    // vectors of every vector of columns in `vecs` (`qp[(v * r + k) * lanes]`). Prefetch
    // addresses are formed with `wrapping_add` and a prefetch never faults. Nothing here
    // waits or unwinds: a failure elsewhere cannot leave it half-way with anything but
    // partial sums in this thread's own `Q` columns.
    unsafe {
        // `wrapping_*`: with a shift ([`stream_shift`]) the first vector starts before
        // its row, and only its lanes inside the row (`valid`, with EDGE) are read.
        let row = |ii: usize| a.m.wrapping_add((i0 + ii) * a.cols).wrapping_offset(c0);
        let mut pk = [[S::zero(); KT]; RB];
        for ii in 0..RB {
            for k in 0..KT {
                pk[ii][k] = S::splat(*a.p.add((k0 + k) * a.n + i0 + ii));
            }
        }
        for v in vecs {
            // One prefetch a line, each line's in one of the passes, so that memory
            // stays busy through all of them.
            let line = v * lanes / SWEEP_STRIDE;
            if ahead_rows != 0 && (v * lanes).is_multiple_of(SWEEP_STRIDE) && line % passes == pass
            {
                for ii in 0..RB {
                    S::prefetch_l2(row(ii).wrapping_add(ahead_rows * a.cols + v * lanes));
                }
            }
            if NEAR && pass == 0 && (v * lanes).is_multiple_of(SWEEP_STRIDE) {
                for ii in 0..RB {
                    S::prefetch(row(ii).wrapping_add(v * lanes + NEAR_FLOATS).cast_const());
                }
            }
            let mut x = [S::zero(); RB];
            for ii in 0..RB {
                x[ii] = if EDGE {
                    S::load_lanes(row(ii).wrapping_add(v * lanes), valid.0, valid.1)
                } else {
                    // Inside the row: an in-bounds offset from `M` (which LLVM folds
                    // into the loads' addressing better than a wrapping one).
                    let col = (c0 + (v * lanes) as isize) as usize;
                    S::load(a.m.add((i0 + ii) * a.cols + col))
                };
            }
            for k in 0..KT {
                let dst = qp.add((v * a.r + k0 + k) * lanes);
                let mut acc = S::load(dst);
                for ii in 0..RB {
                    acc = S::fma(pk[ii][k], x[ii], acc);
                }
                S::store(dst, acc);
            }
        }
    }
}

/// [`mtp_stream_tile`] for every panel of the vectors `0..nvec` and every tile of
/// columns of `Q`, for the `RB` rows at `i0`; with a `shift`, the first and the last
/// vector are edges (their lanes from `shift`, and below it); `NEAR` as there.
#[inline(always)]
unsafe fn mtp_stream_block<S: Simd, const RB: usize, const NEAR: bool>(
    a: &Mat,
    i0: usize,
    c0: isize,
    nvec: usize,
    qp: *mut f32,
    ahead_rows: usize,
    shift: usize,
) {
    let lanes = S::LANES;
    let panel = MTP_STREAM_PANEL / lanes;
    let mut v0 = 0;
    // SAFETY: forwarded caller guarantees; every tile's columns lie inside 0..r. With a
    // shift, the first vector's lanes from `shift` and the last's below it lie in the
    // row, and only those are read.
    unsafe {
        while v0 < nvec {
            let v1 = (v0 + panel).min(nvec);
            let mut k0 = 0;
            while k0 < a.r {
                let kt = if a.r - k0 >= MTP_STREAM_COLS {
                    MTP_STREAM_COLS
                } else {
                    1
                };
                // The vectors v0..v1, the edge ones (with a shift) apart. (A macro, not a
                // closure: closures do not take the caller's target features, and the
                // intrinsics in one that is not inlined become calls.)
                macro_rules! run {
                    ($vecs:expr, $edge:literal, $valid:expr) => {{
                        let vecs: Range<usize> = $vecs;
                        if !vecs.is_empty() {
                            if kt == MTP_STREAM_COLS {
                                mtp_stream_tile::<S, RB, MTP_STREAM_COLS, $edge, NEAR>(
                                    a, i0, c0, vecs, k0, qp, ahead_rows, $valid,
                                )
                            } else {
                                mtp_stream_tile::<S, RB, 1, $edge, NEAR>(
                                    a, i0, c0, vecs, k0, qp, ahead_rows, $valid,
                                )
                            }
                        }
                    }};
                }
                let (mut lo, mut hi) = (v0, v1);
                if shift > 0 && lo == 0 {
                    run!(0..1, true, (shift, lanes));
                    lo = 1;
                }
                let last_edge = shift > 0 && hi == nvec && hi > lo;
                if last_edge {
                    hi -= 1;
                }
                run!(lo..hi, false, (0, lanes));
                if last_edge {
                    run!(hi..hi + 1, true, (0, shift));
                }
                k0 += kt;
            }
            v0 = v1;
        }
    }
}

/// Floats from the vector boundary before column `c0` of `M`'s first row to it, where
/// [`mtp_stream`] starts its vectors there (every row alike): their loads then never
/// straddle two lines, where a vector off its alignment split every other one (with 8
/// lanes; every one with 16). With `M` in L2 (Intel Xeon, Emerald Rapids class, AVX2,
/// r = 1, 128 x 1024) the kernel read 86-102 GB/s at offsets of whole vectors and
/// 54-63 GB/s at every other offset. 0 where they already lie on one (or the rows do
/// not all lie alike).
fn stream_shift<S: Simd>(a: &Mat, c0: usize) -> usize {
    match vector_lead::<S>(a, c0) {
        lead if lead > 0 => S::LANES - lead,
        _ => 0,
    }
}

/// `Q[cols] = (Mᵀ P)[cols]` streaming whole rows, for 8 lanes (AVX2 and the portable
/// fallback; 16 lanes where [`takes_wide_stream`] says): blocks of [`MTP_STREAM_ROWS`] rows, each added to every vector of a packed
/// `Q` (for each vector of columns the `r` vectors one after the other, zeroed first,
/// written back at the end) in panels of [`MTP_STREAM_PANEL`] floats.
///
/// The strips of [`mtp_block`](super::strips::mtp_block) read 8 vectors (256 bytes) of each row down a block; at
/// power-of-two widths the block's rows are multiples of 4 KiB apart and the strip's
/// lines fall in 4 of L1's 64 sets: with `M` in L2 (AMD Zen 4, AVX2), 0.28-0.45 of the
/// in-core limit at 1024 columns against 0.67-0.85 at 1008. Here 4 rows side by side
/// share a set with one line of the packed `Q`: at r = 1 45 → 77 GB/s in L2, r = 2
/// 31-34 → 65, and from memory (one thread, 4096 x 4096) r = 1 0.71-0.85 → 0.86-0.92
/// of the read bandwidth, r = 2 0.71-0.94 → 0.63-0.84 (within this VM's noise).
///
/// The rows' vectors are loaded once for [`MTP_STREAM_COLS`] columns of `Q` (one pass per
/// column had them loaded `r` times). With `M` in L2 (128 x 1024 and 32 x 4096), AMD Zen 4,
/// AVX2, three alternated runs against one pass a column: r = 2 0.94-1.22 of the old rate
/// with `M` on a line boundary and 1.17-1.50 at 16 bytes past one (where glibc puts a large
/// `Vec`), cold (4096 x 4096) the same within noise. Against the strips, in L2 at 1024
/// columns: r = 3 27 → 47 GB/s, r = 4 31-33 → 43, r = 6 18 → 26, r = 8 15-16 → 21; cold,
/// one thread, 4096 x 4096: r = 3 16 → 19 GB/s, but r = 4 17-20 → 14-18, r = 5 17 → 13, r =
/// 6 15 → 11 and r = 8 5-9 → 8-9 (each row block reads and writes the whole packed `Q`, `r`
/// times the row's bytes, where a strip's tile stays in registers down a block). With
/// [`MTP_STREAM_COLS`] columns a pass (the rows' vectors loaded once for two columns of
/// `Q`), cold, alternated runs: r = 4 strips 23.9-24.3 GB/s against the stream's 20.1-21.8,
/// r = 5 19.7-19.9 against 17.6-17.8, r = 6 18.7-19.5 against 17.9-18.0, r = 7 14.1-14.3
/// against 13.9-14.0, but r = 8 12.3-12.4 against 15.4-15.8, r = 12 8.7-8.9 against
/// 11.5-11.6. The strips' old 8-column tile (one vector wide) read 6.5-7.2 GB/s at r = 8 in
/// one placement of the buffers and 11.1-13.9 in another, where the stream read 14.7-15.5
/// in both. So [`mtp_cols`] takes this kernel up to [`MTP_STREAM_MAX_RANK`] and from
/// [`MTP_STREAM_FROM_RANK`], and for a call that streams less than
/// [`SWEEP_MIN_BYTES`](super::super::SWEEP_MIN_BYTES) (`M` likely in cache) at every rank
/// on 8-way L1s, at ranks not a multiple of [`MTP_STRIPS_WIDE_TILE`] on wider ones, but not
/// on those wider ones where every row lies alike on lines ([`MTP_STRIPS_ROW_FLOATS`]).
///
/// Each element gets the same operations in the same order as in [`mtp_block`](super::strips::mtp_block) (from
/// zero, one fused multiply-add a row in row order, [`Simd::fma1`] for the columns taken
/// one at a time), so the two give the same bits. Its vectors do not start at a line
/// boundary as the strips' do: the columns before one, taken one at a time with each
/// block of rows, cost more than the split lines (M in L2, Zen 4, AVX2, three
/// alternated runs: r = 2 0.56-0.57 -> 0.38-0.50 of the in-core limit). So where every
/// row lies alike off a vector boundary, the vectors start at the boundary before the
/// columns ([`stream_shift`]), one more of them, the first and the last (edges) read and
/// written only in their lanes inside the columns, and the pack shifted to match; the
/// lanes outside are accumulated from zeros and dropped. With `M` in L2 16 bytes past a
/// line (Intel Xeon, Emerald Rapids class, AVX2, four alternated runs), r = 1 / 2 / 4 /
/// 8: 0.39-0.41 / 0.54-0.58 / 0.62-0.63 / 0.60-0.64 -> 0.43-0.61 / 0.64-0.66 /
/// 0.67-0.70 / 0.65-0.68 of the in-core limit; over three sets of alternated runs the
/// median ratio of pairs was 1.39-1.51 / 1.18-1.20 / 0.91-1.11 / 0.90-1.07 (r = 4 and 8
/// within this VM's noise). Only calls that do not stream from memory shift: from
/// memory the split lines cost nothing (r = 1-4 the same). (Each row vector built
/// instead from the two aligned ones it straddles, one `vperm2f128` a vector on the one
/// shuffle port, read 1.06 / 1.04 / 0.91 / 0.81.)
#[inline(always)]
pub(super) unsafe fn mtp_stream<S: Simd>(a: &Mat, cols: Range<usize>) {
    let near = zen5_or_later() && streams_from_memory(a, &cols);
    // SAFETY: forwarded caller guarantees.
    unsafe { mtp_stream_as::<S>(a, cols, near) }
}

/// [`mtp_stream`], with `near` prefetching each row's own line [`NEAR_FLOATS`] ahead of
/// its loads into L1 where it does not sweep, with 16 lanes (the 8-lane stream from
/// memory sweeps on every core): the same bits either way.
///
/// # Safety
/// As [`mtp_stream`].
#[inline(always)]
pub(super) unsafe fn mtp_stream_as<S: Simd>(a: &Mat, cols: Range<usize>, near: bool) {
    let lanes = S::LANES;
    let nvec = cols.len() / lanes;
    let vec_end = cols.start + nvec * lanes;
    // With a shift, the vectors start `shift` floats before the columns, on a vector
    // boundary, and there is one more: the first and the last hold the columns' ends
    // (edges). Each column's lane gets the same operations in the same order either way.
    // Only for calls that do not stream from memory, where the split lines cost nothing
    // (n = m = 4096, one thread: r = 1-4 the same within noise).
    let sweep = mtp_sweeps::<S>(a, &cols);
    let shift = if nvec > 0 && !sweep {
        stream_shift::<S>(a, cols.start)
    } else {
        0
    };
    let nv = nvec + usize::from(shift > 0);
    let c0 = cols.start as isize - shift as isize;
    let mut pack = QPack::take(a.r * nv * lanes + 16);
    let qp = pack.aligned();
    let ahead_rows = if sweep {
        (2 * MTP_STREAM_ROWS).max(MTP_STREAM_AHEAD_BYTES.div_ceil(a.cols * 4))
    } else {
        0
    };
    // SAFETY: the pack holds r * nv vectors from its aligned start; every block's rows
    // lie inside 0..n, the vectors (but the edges' lanes outside the columns, neither
    // read nor written) and the ragged columns inside `cols` (inside 0..cols, the
    // caller), and Q holds r columns of `cols` floats.
    unsafe {
        for t in 0..a.r * nv {
            S::store(qp.add(t * lanes), S::zero());
        }
        let mut i0 = 0;
        while i0 < a.n {
            let rb = if a.n - i0 >= MTP_STREAM_ROWS {
                MTP_STREAM_ROWS
            } else {
                1
            };
            // Only 16 lanes compile the near prefetch (a constant: see the tile).
            let near = near && ahead_rows == 0 && lanes == 16;
            match (rb == MTP_STREAM_ROWS, near) {
                (true, true) => mtp_stream_block::<S, MTP_STREAM_ROWS, true>(
                    a, i0, c0, nv, qp, ahead_rows, shift,
                ),
                (true, false) => mtp_stream_block::<S, MTP_STREAM_ROWS, false>(
                    a, i0, c0, nv, qp, ahead_rows, shift,
                ),
                (false, true) => {
                    mtp_stream_block::<S, 1, true>(a, i0, c0, nv, qp, ahead_rows, shift)
                }
                (false, false) => {
                    mtp_stream_block::<S, 1, false>(a, i0, c0, nv, qp, ahead_rows, shift)
                }
            }
            for jj in vec_end..cols.end {
                for k in 0..a.r {
                    let d = a.q.add(k * a.cols + jj);
                    let mut s = if i0 > 0 { *d } else { 0.0 };
                    for i in i0..i0 + rb {
                        s = S::fma1(*a.p.add(k * a.n + i), *a.m.add(i * a.cols + jj), s);
                    }
                    *d = s;
                }
            }
            i0 += rb;
        }
        write_back::<S>(a, qp, nv, nvec, shift, c0);
    }
}

/// `Q[cols] = (Mᵀ P)[cols]` at rank 1, one row at a time: each row's vectors added to a
/// packed `Q` that stays in L1 (`Q[v] += P[i] M[i, v]`, a load, a fused multiply-add and
/// a store a vector), rows in order. For calls in cache on cores where rows read side
/// by side stream from L2 worse than one row at a time (the strips walk a block's rows
/// side by side, and so does [`mtp_stream`]'s block of rows).
///
/// Each element gets the same operations in the same order as in the strips and
/// [`mtp_stream`] (from zero, one fused multiply-add a row in row order, [`Simd::fma1`]
/// for the ragged columns), so the same bits. Where every row lies alike off a vector
/// boundary the vectors start at the boundary before the columns, one more of them, the
/// first and the last read only in their lanes inside the columns (the lanes outside
/// accumulate zeros and are dropped), so no load splits a line.
#[inline(always)]
pub(super) unsafe fn mtp_stream_one_row<S: Simd>(a: &Mat, cols: Range<usize>) {
    let lanes = S::LANES;
    debug_assert_eq!(a.r, 1);
    let nvec = cols.len() / lanes;
    let vec_end = cols.start + nvec * lanes;
    let shift = match vector_lead::<S>(a, cols.start) {
        lead if nvec > 0 && lead > 0 => lanes - lead,
        _ => 0,
    };
    let nv = nvec + usize::from(shift > 0);
    let c0 = cols.start as isize - shift as isize;
    let mut pack = QPack::take(nv * lanes + 16);
    let qp = pack.aligned();
    // The vectors without an edge: all, or all but the first and the last (`nvec`).
    let (first, top) = if shift > 0 { (1, nvec) } else { (0, nv) };
    // SAFETY: the pack holds `nv` vectors from its aligned start; every row lies inside
    // 0..n and its vectors inside `cols` (inside 0..cols, the caller), but for the edge
    // vectors' lanes outside the columns, which masked loads do not read; row pointers
    // are formed with `wrapping_*` (with a shift the first vector starts before the
    // columns). `P` holds `n` floats and `Q` `cols` floats (rank 1). Nothing here waits,
    // allocates past the pack or unwinds.
    unsafe {
        for v in 0..nv {
            S::store(qp.add(v * lanes), S::zero());
        }
        for i in 0..a.n {
            let row =
                a.m.wrapping_add(i * a.cols)
                    .wrapping_offset(c0)
                    .cast_const();
            let p = S::splat(*a.p.add(i));
            if shift > 0 {
                let x = S::load_lanes(row, shift, lanes);
                S::store(qp, S::fma(p, x, S::load(qp)));
            }
            for v in first..top {
                let d = qp.add(v * lanes);
                S::store(
                    d,
                    S::fma(p, S::load(row.wrapping_add(v * lanes)), S::load(d)),
                );
            }
            if shift > 0 {
                let d = qp.add(nvec * lanes);
                let x = S::load_lanes(row.wrapping_add(nvec * lanes), 0, shift);
                S::store(d, S::fma(p, x, S::load(d)));
            }
        }
        for jj in vec_end..cols.end {
            let mut s = 0.0;
            for i in 0..a.n {
                s = S::fma1(*a.p.add(i), *a.m.add(i * a.cols + jj), s);
            }
            *a.q.add(jj) = s;
        }
        write_back::<S>(a, qp, nv, nvec, shift, c0);
    }
}

/// The packed `Q` at `qp` (`nv` vectors of columns from `c0`, `r` vectors each) written
/// to `Q`: with a `shift`, the first vector only in its lanes from `shift` and the last
/// (`nvec`) below it, the lanes outside the columns dropped.
///
/// # Safety
/// `qp` holds `r * nv` vectors; the vectors from `c0` lie inside `Q`'s columns but for
/// those edge lanes, which masked stores do not touch.
#[inline(always)]
unsafe fn write_back<S: Simd>(
    a: &Mat,
    qp: *const f32,
    nv: usize,
    nvec: usize,
    shift: usize,
    c0: isize,
) {
    let lanes = S::LANES;
    for v in 0..nv {
        let valid = match v {
            0 if shift > 0 => (shift, lanes),
            _ if shift > 0 && v == nvec => (0, shift),
            _ => (0, lanes),
        };
        for k in 0..a.r {
            // SAFETY: the caller's guarantees; pointers to the vectors' starts are formed
            // with `wrapping_*` (with a shift the first starts before the columns).
            unsafe {
                let src = S::load(qp.add((v * a.r + k) * lanes));
                let dst = a.q.wrapping_add(k * a.cols + v * lanes).wrapping_offset(c0);
                if valid == (0, lanes) {
                    S::store(dst, src);
                } else {
                    S::store_lanes(dst, src, valid.0, valid.1);
                }
            }
        }
    }
}

//! `mtp`'s strips: a register tile of `Q` over a strip of columns, walked down a block of
//! rows ([`mtp_strip`]), with the part vectors of a row's edges in the same walk, and one
//! row block of one panel and tile of columns strip by strip ([`mtp_block`]), in a
//! function of its own per tile ([`Block`]). [`mtp_cols`] chooses the blocks, panels
//! and tiles.

use super::*;

/// `Q[k0..k0+KT][strip] (+)= Σ_{i in rows} P[i, k] M[i, strip]`, where the strip is `VW`
/// whole vectors from column `j0`, and the same for the `N` part vectors `parts` (each
/// `(j0, keep)`: one vector from column `j0`, of which only the columns `keep` are
/// written to `Q`; [`mtp_strip_part`]) in the same walk down the rows. The accumulators
/// start at zero for the first row block and from `Q` otherwise.
///
/// `sweep` ([`Sweep`], on when the call sweeps) prefetches each row's run ahead.
/// Without a sweep and with `next_row` ([`strips_prefetch_next_row`]: AMD), a tile of
/// one column of `Q` prefetches the strip of the next row into L1: it takes one vector a
/// fused multiply-add, the hardware prefetchers do not see the strip's next run (a row
/// stride away) in time, and a load slot is there to spare. With `M` in L2 (AMD Zen 4,
/// AVX-512, alternated runs), r = 1 read 0.74-0.75 of the in-core limit without it and
/// 0.81-0.82 with it; at r = 2 the same prefetch changed nothing and at r >= 4 it cost up
/// to 0.02, and two rows ahead cost at every rank. On Intel it costs (see there).
// Register tiles read best with explicit indices.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
pub(super) unsafe fn mtp_strip<
    S: Simd,
    const VW: usize,
    const KT: usize,
    const N: usize,
    const LIN: bool,
>(
    a: &Mat,
    rows: Range<usize>,
    j0: usize,
    k0: usize,
    sweep: Sweep,
    next_row: bool,
    parts: [(usize, Range<usize>); N],
) {
    let lanes = S::LANES;
    let cols = a.cols;
    // SAFETY: the caller guarantees `rows` inside 0..n, columns k0..k0+KT inside 0..r and
    // the strip's VW * lanes columns inside 0..cols, so every load and store below is in
    // the buffers of `a`. Prefetch addresses (past the last row, for the last row) are
    // formed with `wrapping_add`, and a prefetch never faults.
    unsafe {
        let qv = |k: usize, v: usize| a.q.add((k0 + k) * cols + j0 + v * lanes);
        // The order a constant: by rows the loop keeps only the row offset
        // ([`Sweep::by_rows`]).
        let sweep = if LIN { sweep } else { sweep.by_rows() };
        let into_l1 = sweep.is_on() && zen5_or_later();
        let mut acc = [[S::zero(); VW]; KT];
        let mut part = [[S::zero(); KT]; N];
        if rows.start > 0 {
            for k in 0..KT {
                for v in 0..VW {
                    acc[k][v] = S::load(qv(k, v));
                }
            }
            part_load::<S, KT, N>(a, k0, &parts, &mut part);
        }
        for i in rows {
            let row = a.m.add(i * cols + j0);
            let mut pk = [S::zero(); KT];
            for k in 0..KT {
                pk[k] = S::splat(*a.p.add((k0 + k) * a.n + i));
            }
            // Each vector's multiply-adds as soon as it is loaded: loaded all first, the
            // row's vectors and the parts' accumulators outgrew the registers (16 x 1
            // with two parts spilled three accumulators).
            for v in 0..VW {
                if sweep.is_on() && (v * lanes).is_multiple_of(SWEEP_STRIDE) {
                    sweep_prefetch::<S>(sweep.at(a, i, j0, VW * lanes, v * lanes), into_l1);
                }
                if next_row && !sweep.is_on() && KT == 1 && (v * lanes).is_multiple_of(SWEEP_STRIDE)
                {
                    S::prefetch(row.wrapping_add(cols + v * lanes));
                }
                let x = S::load(row.add(v * lanes));
                for k in 0..KT {
                    acc[k][v] = S::fma(pk[k], x, acc[k][v]);
                }
            }
            let y = part_row::<S, N>(a, i, &parts, sweep, into_l1);
            for t in 0..N {
                for k in 0..KT {
                    part[t][k] = S::fma(pk[k], y[t], part[t][k]);
                }
            }
        }
        for k in 0..KT {
            for v in 0..VW {
                S::store(qv(k, v), acc[k][v]);
            }
        }
        part_store::<S, KT, N>(a, k0, &parts, &part);
    }
}

/// The accumulators of the part vectors `parts` ([`mtp_strip_part`]), from `Q`: a row
/// block after the first.
///
/// # Safety
/// As [`mtp_strip_part`]: columns `k0..k0 + KT` inside 0..r and each vector's columns
/// `j0..j0 + lanes` inside 0..cols; the instruction set is the caller's.
#[inline(always)]
unsafe fn part_load<S: Simd, const KT: usize, const N: usize>(
    a: &Mat,
    k0: usize,
    parts: &[(usize, Range<usize>); N],
    part: &mut [[S::V; KT]; N],
) {
    for ((j0, keep), acc) in parts.iter().zip(part.iter_mut()) {
        debug_assert!(*j0 <= keep.start && keep.end <= j0 + S::LANES);
        for (k, v) in acc.iter_mut().enumerate() {
            // SAFETY: the vector lies in column k0 + k of Q (the caller).
            *v = unsafe { S::load(a.q.add((k0 + k) * a.cols + j0)) };
        }
    }
}

/// One prefetch of the strips' sweep: into L1 (`prefetcht0`) with `into_l1`, which
/// [`mtp_strip`] sets on AMD Zen 5 and later ([`zen5_or_later`]: its 48 KiB L1 holds the
/// strips' tiles beside the lines in flight), else into L2. AMD EPYC (Zen 5, KVM),
/// AVX-512, r = 8 (the ranks that sweep there), median ratios of alternated pairs:
/// `bench lowrank --quick` (4096 x 4096), one thread 1.31 and 1.22 in two sets of four
/// (0.38-0.53 → 0.51-0.58 of the read bandwidth), two threads 1.11 and 0.99;
/// `--roofline` from memory 1.46 (four pairs) and 1.00 (six), from the LLC 0.83 and
/// 0.96; with AVX2 1.07 from memory, 1.00 from the LLC. The same hint for `mq`'s and
/// `pqt_error`'s sweeps read 0.98-1.07, so they keep L2.
///
/// Timed otherwise, L2 wins, but only there: a probe timing the same call in groups of
/// four on the same buffers (the first of each group dropped), `M` from memory, read
/// with AVX-512 at r = 8 19.7-22.1 GB/s (4096 columns, four sets) sweeping into L1 and
/// 25.8-28.7 into L2 1.5 blocks ahead (1.08-1.45 at 1024-8192 columns, r = 5-7
/// 1.02-1.05), where `--quick` (each call after the flush and the read reference) then
/// read 0.74 (six pairs, one thread; 0.68-0.72 -> 0.42-0.54 of the read bandwidth). A
/// call sweeping into L2 reads fast only after calls like it: in C, the first such call
/// after calls that swept into L1 read 17-20 GB/s against 34 for the next ones. The
/// lines swept into L1 are gone from it before the strips reach them (they walk the
/// panel twice first) but reach L2 as well, and that sweep reads the same whatever ran
/// before.
///
/// # Safety
/// The caller's instruction set; a prefetch never faults, whatever the address.
#[inline(always)]
unsafe fn sweep_prefetch<S: Simd>(at: *const f32, into_l1: bool) {
    // SAFETY: prefetches are hints that never fault.
    unsafe {
        if into_l1 {
            S::prefetch(at);
        } else {
            S::prefetch_l2(at);
        }
    }
}

/// Row `i`'s vectors of the parts `parts`, each prefetched ahead by `sweep`: by rows
/// both lines it touches (the strips' prefetches start at the line boundary;
/// [`sweep_prefetch`]), in memory order the place of its kept columns (fewer than a
/// line a row, so one prefetch a row touches every line of the part's run).
///
/// # Safety
/// As [`part_load`], with row `i` inside 0..n.
#[inline(always)]
unsafe fn part_row<S: Simd, const N: usize>(
    a: &Mat,
    i: usize,
    parts: &[(usize, Range<usize>); N],
    sweep: Sweep,
    into_l1: bool,
) -> [S::V; N] {
    // SAFETY: each vector lies in row i (the caller); prefetch addresses are formed with
    // `wrapping_add` and a prefetch never faults.
    unsafe {
        let mut y = [S::zero(); N];
        for (t, (j0, keep)) in parts.iter().enumerate() {
            if sweep.is_linear() {
                sweep_prefetch::<S>(sweep.at(a, i, keep.start, keep.len(), 0), into_l1);
            } else if sweep.is_on() {
                sweep_prefetch::<S>(sweep.at(a, i, *j0, S::LANES, 0), into_l1);
                sweep_prefetch::<S>(sweep.at(a, i, *j0, S::LANES, S::LANES - 1), into_l1);
            }
            y[t] = S::load(a.m.add(i * a.cols + j0));
        }
        y
    }
}

/// The part vectors' accumulators `part` written to `Q`, only their columns `keep`
/// (the others belong to other strips), through a scratch tile.
///
/// # Safety
/// As [`part_load`].
#[inline(always)]
unsafe fn part_store<S: Simd, const KT: usize, const N: usize>(
    a: &Mat,
    k0: usize,
    parts: &[(usize, Range<usize>); N],
    part: &[[S::V; KT]; N],
) {
    let mut tile = [0.0f32; 16];
    for ((j0, keep), acc) in parts.iter().zip(part.iter()) {
        for (k, &v) in acc.iter().enumerate() {
            // SAFETY: the scratch tile holds 16 floats, `lanes` at most; the kept columns
            // lie in column k0 + k of Q (the caller).
            unsafe {
                S::store(tile.as_mut_ptr(), v);
                for c in keep.clone() {
                    *a.q.add((k0 + k) * a.cols + c) = tile[c - j0];
                }
            }
        }
    }
}

/// [`mtp_strip`] for the part vectors `parts` alone (no whole strip): each `(j0, keep)`
/// one vector from column `j0`, of which only the columns `keep` are written to `Q` (the
/// others belong to other strips): the vector is loaded from `Q` and stored to a scratch
/// tile, so each kept column gets the same operations as in a whole strip.
#[inline(always)]
unsafe fn mtp_strip_part<S: Simd, const KT: usize, const N: usize, const LIN: bool>(
    a: &Mat,
    rows: Range<usize>,
    parts: [(usize, Range<usize>); N],
    k0: usize,
    sweep: Sweep,
) {
    // SAFETY: forwarded caller guarantees (a strip of no whole vectors reads only the
    // parts).
    unsafe { mtp_strip::<S, 0, KT, N, LIN>(a, rows, parts[0].0, k0, sweep, false, parts) }
}

/// One row block of one panel for the columns `k0..k0+KT` of `Q`: with a row start off
/// a line boundary, edge vectors for the columns before it; strips of `VW`
/// vectors from there, the vectors left over in strips of 8, 4, 2 and 1, an edge vector
/// for what those leave of the whole vectors, then the ragged columns (one at a time).
/// `sweep` and `next_row` as in [`mtp_strip`].
#[inline(always)]
pub(super) unsafe fn mtp_block<S: Simd, const VW: usize, const KT: usize, const LIN: bool>(
    a: &Mat,
    rows: Range<usize>,
    panel: &Range<usize>,
    k0: usize,
    sweep: Sweep,
    next_row: bool,
) {
    let lanes = S::LANES;
    let vec_end = panel.start + panel.len() / lanes * lanes;
    let mut j = panel.start;
    let lead = line_lead(a, panel.start);
    // A strip of VW x 8 floats is one line or two at r >= 4, and the split lines cost
    // it: peeled, 0.35-0.40 -> 0.49-0.57 of the in-core limit at r = 4 and 0.40-0.44 ->
    // 0.46-0.55 at r = 8 (M in L2, AMD Zen 4, AVX2, alternated runs). AVX-512's strips
    // are 2-16 lines a row, and on Zen 4 (whose 512-bit loads are two 256-bit halves, one
    // of which a split line costs) peeling them read 0.63-0.85 against 0.74-0.97; on an
    // Intel Xeon (Emerald Rapids class, full-width loads, where every vector of an
    // unaligned strip splits a line), against the aligned read stream, 16 bytes past a
    // line, three alternated runs, r = 1 / 2 / 4 / 8: 0.49-0.52 / 0.41-0.46 / 0.39-0.53 /
    // 0.42-0.69 -> 0.61-0.62 / 0.66-0.67 / 0.48-0.74 / 0.51-0.79, from memory unchanged.
    // Full-width cores (Intel, Zen 5) are where AVX-512 goes, so both widths peel.
    let peel = lead != 0 && vec_end - panel.start >= lead + 2 * lanes;
    // SAFETY: strips lie inside the panel's whole vectors, inside 0..cols; rows and
    // columns of Q as the caller guarantees.
    unsafe {
        let mut last = vec_end;
        // The part of the lead vector that waits for the tail's (one walk down the rows
        // for both).
        let mut lead_part = None;
        if peel {
            // The columns before the first line boundary, then the strips from it, and
            // the vector ending at `vec_end` for what they leave (see [`line_lead`]).
            let mut c = panel.start;
            while c < panel.start + lead {
                let keep = c..(c + lanes).min(panel.start + lead);
                if c + lanes >= panel.start + lead {
                    lead_part = Some((c, keep));
                } else {
                    mtp_strip_part::<S, KT, 1, LIN>(a, rows.clone(), [(c, keep)], k0, sweep);
                }
                c += lanes;
            }
            j = panel.start + lead;
            last = j + (vec_end - j) / lanes * lanes;
        }
        let vec_end = last;
        // Each part (the lead's, the tail's) is one dependent chain of multiply-adds down
        // the rows. One walk each cost 10-16% at r = 1 and 2 against `M` on a line; one
        // walk for both (their latencies overlapped) read, as median ratio of pairs in
        // two sets of 3 and 5 alternated runs, r = 1 1.01-1.04, r = 2 1.02-1.10, r = 8
        // 1.01-1.06, but still waited an FMA's latency a row. So the first strip takes
        // them beside its own vectors where its tile leaves registers for them
        // (`KT <= 2`). With `M` in L2 16 bytes past a line (Intel Xeon, Emerald Rapids
        // class, AVX-512, `--roofline`, five alternated pairs, with the cached blocks of
        // [`MTP_BLOCK_FLOATS_CACHED`]): r = 1 0.71-0.75 -> 0.79-0.82 of the in-core
        // limit (median ratio of pairs 1.09), r = 2 0.66-0.70 -> 0.73-0.75 (1.09), r = 4
        // and 8 (blocks alone) 1.07 and 1.05; from memory the same (0.99-1.01); AVX2 the
        // same (1.00-1.01, whose r = 1 and 2 take the row stream in cache). (Taken with
        // the row's vectors all loaded first, 16 x 1 plus two parts spilled three
        // accumulators and r = 1 read 0.91-0.97 of one walk.)
        let tail = (vec_end < panel.start + panel.len() / lanes * lanes).then(|| {
            let end = panel.start + panel.len() / lanes * lanes;
            (end - lanes, vec_end..end)
        });
        let mut parts = (lead_part, tail);
        if KT <= 2 && j + VW * lanes <= vec_end {
            match parts {
                (Some(l), Some(t)) => {
                    mtp_strip::<S, VW, KT, 2, LIN>(a, rows.clone(), j, k0, sweep, next_row, [l, t])
                }
                (Some(p), None) | (None, Some(p)) => {
                    mtp_strip::<S, VW, KT, 1, LIN>(a, rows.clone(), j, k0, sweep, next_row, [p])
                }
                (None, None) => {
                    mtp_strip::<S, VW, KT, 0, LIN>(a, rows.clone(), j, k0, sweep, next_row, [])
                }
            }
            j += VW * lanes;
            parts = (None, None);
        }
        while j + VW * lanes <= vec_end {
            mtp_strip::<S, VW, KT, 0, LIN>(a, rows.clone(), j, k0, sweep, next_row, []);
            j += VW * lanes;
        }
        // The vectors left over, fewer than VW: strips of 8, 4, 2 and 1 (a binary
        // decomposition), so that they keep several accumulators in flight: one vector
        // at a time is one dependent chain of multiply-adds down the rows.
        if VW > 8 && j + 8 * lanes <= vec_end {
            mtp_strip::<S, 8, KT, 0, LIN>(a, rows.clone(), j, k0, sweep, next_row, []);
            j += 8 * lanes;
        }
        if VW > 4 && j + 4 * lanes <= vec_end {
            mtp_strip::<S, 4, KT, 0, LIN>(a, rows.clone(), j, k0, sweep, next_row, []);
            j += 4 * lanes;
        }
        if VW > 2 && j + 2 * lanes <= vec_end {
            mtp_strip::<S, 2, KT, 0, LIN>(a, rows.clone(), j, k0, sweep, next_row, []);
            j += 2 * lanes;
        }
        if VW > 1 && j < vec_end {
            mtp_strip::<S, 1, KT, 0, LIN>(a, rows.clone(), j, k0, sweep, next_row, []);
            j += lanes;
        }
        debug_assert_eq!(j, vec_end);
        match parts {
            (Some(l), Some(t)) => {
                mtp_strip_part::<S, KT, 2, LIN>(a, rows.clone(), [l, t], k0, sweep)
            }
            (Some(p), None) | (None, Some(p)) => {
                mtp_strip_part::<S, KT, 1, LIN>(a, rows.clone(), [p], k0, sweep)
            }
            (None, None) => {}
        }
        let vec_end = panel.start + panel.len() / lanes * lanes;
        let j = vec_end;
        for jj in j..panel.end {
            for k in k0..k0 + KT {
                let d = a.q.add(k * a.cols + jj);
                let mut s = if rows.start > 0 { *d } else { 0.0 };
                for i in rows.clone() {
                    s = S::fma1(*a.p.add(k * a.n + i), *a.m.add(i * a.cols + jj), s);
                }
                *d = s;
            }
        }
    }
}

/// [`mtp_block`] in a function of its own ([`Simd::outlined`]), one for each tile and
/// order: inlined, each of the walks that reach it ([`mtp_cols`] with `Q` in place and
/// in its scratch) compiled a copy of every strip, and the crate's build took twice as
/// long. One call a block of rows, panel and tile of columns. Its fields are
/// [`mtp_block`]'s arguments.
pub(super) struct Block<'a, S, const VW: usize, const KT: usize, const LIN: bool> {
    pub(super) a: &'a Mat,
    pub(super) rows: Range<usize>,
    pub(super) panel: &'a Range<usize>,
    pub(super) k0: usize,
    pub(super) sweep: Sweep,
    pub(super) next_row: bool,
    pub(super) isa: PhantomData<S>,
}

impl<S: Simd, const VW: usize, const KT: usize, const LIN: bool> Outlined
    for Block<'_, S, VW, KT, LIN>
{
    type Output = ();
    #[inline(always)]
    unsafe fn run(self) {
        // Copies of the shape and the panel: through the fields' references LLVM would
        // reload them after every store (it cannot know that nothing writes to them).
        let (a, panel) = (*self.a, self.panel.clone());
        // SAFETY: the guarantees of `mtp_block`, which the creator of the work gives.
        unsafe {
            mtp_block::<S, VW, KT, LIN>(&a, self.rows, &panel, self.k0, self.sweep, self.next_row)
        }
    }
}

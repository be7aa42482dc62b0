//! Whole rows (a call whose rows are not chunked, [`super::MQ_WHOLE_ROW_BYTES`]): each
//! tile of a group goes from its first vector to `P` with its accumulators in registers,
//! in a function of its own ([`Simd::outlined`]). The same steps ([`mq_step`]), edges and
//! finish ([`mq_finish_regs`]) as the chunked spans of the parent module, so the same
//! bits.

use super::*;

/// One tile over whole rows (a call whose rows are not chunked): [`mq_span`](super::chunked::mq_span) over every
/// vector of the rows of `ap` (`M` shifted back with `edges`, as in [`mq_rows_rb`]) and
/// [`mq_finish_regs`] (on `a`, the rows as they are) in one, with the accumulators in
/// registers from the first vector to the reduction. The same operations on each
/// accumulator in the same order as the span and the finish, so the same bits; what it
/// saves is a group's round trip through memory, its calls and its spilled row pointers.
/// With `M` in L2 (Intel Xeon, Emerald Rapids class, r = 1, one thread) the span and
/// finish path read 0.60 / 0.71 / 0.83 of the speed of a plain loop of the same tile
/// (accumulators in registers) at 512 / 1024 / 4096 columns: a fixed cost a group, of
/// about 100-200 cycles (`rdtsc` around the parts) against a loop of a few hundred.
/// `bench lowrank --roofline`, M in L2 16 bytes past a line, 8 alternated runs: `mq`
/// r = 1 / 2 / 4 0.56-0.65 / 0.46-0.56 / 0.42-0.67 -> 0.69-0.80 / 0.58-0.71 / 0.49-0.81
/// of the in-core limit (median ratio of pairs 1.22-1.31 on AVX-512, 1.17-1.37 on AVX2),
/// `mq+e` 1.04-1.22; from memory unchanged (memory-bound).
#[inline(always)]
unsafe fn mq_whole<S: Simd, const RB: usize, const KT: usize, const U: usize, const FUSE: bool>(
    w: Whole<'_, S, RB, KT, U, FUSE>,
) {
    let Whole {
        a,
        ap,
        i0,
        gap,
        k0,
        vec_end_p,
        vec_end,
        q,
        ahead,
        edges,
        isa: _,
    } = w;
    let lanes = S::LANES;
    let (sweep, base, _) = ahead.parts();
    // SAFETY: as in `mq_span` for the span 0..vec_end_p of the shifted rows (the caller's
    // guarantees for the group: its rows `i0 + ii * gap`, ii < RB, inside 0..n), then as
    // in `mq_finish_regs` for the same rows.
    unsafe {
        let t = TileRows {
            stride: gap * ap.cols,
            ..TileRows::new(ap, i0, FUSE, base, 0, vec_end_p)
        };
        let mut regs = [[[S::zero(); U]; KT]; RB];
        let group = U * lanes;
        let mut j = 0;
        if edges.lead > 0 {
            j = group.min(vec_end_p);
            mq_each::<S, RB, KT, U, FUSE>(sweep, &t, &mut regs, 0..j, q, ap.r, k0, edges);
        }
        let hot_end = if edges.lead > 0 {
            vec_end_p.min(edges.last)
        } else {
            vec_end_p
        };
        let hot = j..j + hot_end.saturating_sub(j) / group * group;
        // The sweep a constant of the loop: as a flag LLVM kept it (and a row pointer)
        // on the stack and tested it every step of the fused pass. (The same walk as
        // `mq_span`'s, but not shared: through one function for both, LLVM spilled two
        // of the AVX2 3 x 2 x 2 tile's accumulators, all 16 registers busy, and r = 2
        // read 0.54 of the in-core limit in L2 against 0.73.)
        if !hot.is_empty() {
            mq_hot_by::<S, RB, KT, U, FUSE>(sweep, &t, &mut regs, k0, ap.r, hot.clone(), q);
            j = hot.end;
        }
        mq_each::<S, RB, KT, U, FUSE>(sweep, &t, &mut regs, j..vec_end_p, q, ap.r, k0, edges);
        mq_finish_regs::<S, RB, KT, U, FUSE>(a, i0, gap, k0, vec_end, &regs);
    }
}

/// The arguments of [`mq_whole`] (see there), to run it in a function of its own: rows
/// `i0..` of `a` (and of `ap`, `M` shifted back with `edges`), the tile from column `k0`
/// of `P`, the whole vectors `0..vec_end_p` of the shifted rows (`0..vec_end` of the
/// rows), `Q` packed at `q`, the sweep `ahead`.
struct Whole<'a, S, const RB: usize, const KT: usize, const U: usize, const FUSE: bool> {
    a: &'a Mat,
    ap: &'a Mat,
    i0: usize,
    gap: usize,
    k0: usize,
    vec_end_p: usize,
    vec_end: usize,
    q: *const f32,
    ahead: Ahead,
    edges: Edges,
    isa: PhantomData<S>,
}

impl<S: Simd, const RB: usize, const KT: usize, const U: usize, const FUSE: bool> Outlined
    for Whole<'_, S, RB, KT, U, FUSE>
{
    type Output = ();
    #[inline(always)]
    unsafe fn run(self) {
        // SAFETY: the guarantees of `mq_whole`, which the creator of the work gives.
        unsafe { mq_whole(self) }
    }
}

/// [`mq_group`](super::chunked::mq_group) and [`mq_group_finish`](super::chunked::mq_group_finish) in one for whole rows: [`mq_whole`] for every
/// column tile of the group, each in a function of its own ([`Simd::outlined`]: inlined
/// into the driver, the loop's row pointers were spilled and reloaded from the stack).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) unsafe fn mq_group_whole<S: Simd, const RB: usize, const FUSE: bool>(
    a: &Mat,
    ap: &Mat,
    i0: usize,
    gap: usize,
    vec_end_p: usize,
    vec_end: usize,
    q: *const f32,
    ahead: Ahead,
    edges: Edges,
) {
    let mut k0 = 0;
    // SAFETY: forwarded caller guarantees.
    unsafe {
        macro_rules! whole {
            ($kt:literal, $u:literal, $fuse:literal) => {
                S::outlined(Whole::<S, RB, $kt, $u, $fuse> {
                    a,
                    ap,
                    i0,
                    gap,
                    k0,
                    vec_end_p,
                    vec_end,
                    q,
                    ahead: if k0 == 0 { ahead } else { Ahead::No },
                    edges,
                    isa: PhantomData,
                })
            };
        }
        each_tile!(S::LANES, RB, FUSE, a.r, k0, whole);
    }
}

/// [`mq_whole`] for `groups` groups of `RB` rows from `i0` in one function of its own:
/// the product (`mq`, not fused) at r = 1 and 2, in cache or from memory without a
/// sweep. One call for all
/// of them, where [`mq_group_whole`] pays a call and a finish's setup a group, against
/// a loop of a few hundred cycles at 1024 columns. With `M` in L2 (Intel Xeon, Emerald
/// Rapids class, 128 x 1024, 16 bytes past a line, alternated pairs) r = 1 and 2 read
/// 1.04-1.06 of the group-by-group walk on AVX-512 and AVX2 (r = 1 0.79 -> 0.82 of the
/// in-core limit). Not at r = 4 (AVX-512's 4 x 4 tile 0.97, eight pairs) or r = 8
/// (the same), and not for the fused pass: a loop around every group's call there read
/// 0.93 at AVX2's r = 4.
///
/// With `spaced` ([`spaces_rows`]) group `g` takes rows `i0 + g + s * groups`, rows far
/// apart, instead of `i0 + g * RB + s`. `M` in L2 (AMD EPYC, Zen 5, KVM, `--roofline`,
/// four alternated pairs): AVX-512 r = 2 (4-row groups) 0.50-0.53 -> 0.78-0.88 of the
/// in-core limit (median ratio 1.56), from memory 1.08; AVX2 r = 1 (4-row groups)
/// 0.49-0.56 -> 0.72-0.74 (1.42), from memory 1.16; AVX2 r = 2 (3 rows, FMA-bound) the
/// same; AVX-512 r = 1 (4-row groups far apart, where the previous build read one row
/// at a time in a loop of its own, also to keep rows from streaming side by side) 1.08
/// over ten pairs (0.72-0.78 -> 0.78-0.81), from memory 1.03, from the LLC 1.00. The
/// step and the gap are chosen once, outside the loop over groups: a branch
/// between the two inside it left LLVM one register short in AVX2's 3 x 2 x 2 tile,
/// which spilled an accumulator in the hot loop (0.44-0.48 of the limit).
struct WholeRun<'a, S, const RB: usize, const KT: usize, const U: usize> {
    whole: Whole<'a, S, RB, KT, U, false>,
    groups: usize,
    spaced: bool,
}

impl<S: Simd, const RB: usize, const KT: usize, const U: usize> Outlined
    for WholeRun<'_, S, RB, KT, U>
{
    type Output = ();
    #[inline(always)]
    unsafe fn run(self) {
        let first = self.whole.i0;
        let (a, ap) = (*self.whole.a, *self.whole.ap);
        let (step, gap) = if self.spaced {
            (1, self.groups)
        } else {
            (RB, 1)
        };
        for g in 0..self.groups {
            // SAFETY: the guarantees of `mq_whole` for every group, which the creator of
            // the work gives for the `groups * RB` rows from `first`: group g's rows
            // `first + g * step + ii * gap` (ii < RB) are the g-th block of RB rows with
            // (RB, 1), and `first + g + ii * groups < first + RB * groups` with
            // (1, groups); either way inside them.
            unsafe {
                mq_whole(Whole {
                    a: &a,
                    ap: &ap,
                    i0: first + g * step,
                    gap,
                    ..self.whole
                })
            }
        }
    }
}

/// [`WholeRun`] over `groups` groups of `RB` rows at `i0` for a rank of one column tile
/// ([`tile_width`]`(lanes, r) == r`), from the column tile's width, prefetching by
/// `ahead` ([`Ahead::No`] or [`Ahead::Near`]: the run does not sweep).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) unsafe fn mq_run_whole<S: Simd, const RB: usize>(
    a: &Mat,
    ap: &Mat,
    i0: usize,
    groups: usize,
    spaced: bool,
    vec_end_p: usize,
    vec_end: usize,
    q: *const f32,
    ahead: Ahead,
    edges: Edges,
) {
    debug_assert_eq!(tile_width(S::LANES, a.r), a.r);
    // SAFETY: forwarded caller guarantees, for each of the groups.
    unsafe {
        macro_rules! run {
            ($kt:literal, $u:literal, $fuse:literal) => {
                S::outlined(WholeRun::<S, RB, $kt, $u> {
                    whole: Whole {
                        a,
                        ap,
                        i0,
                        gap: 1,
                        k0: 0,
                        vec_end_p,
                        vec_end,
                        q,
                        ahead,
                        edges,
                        isa: PhantomData,
                    },
                    groups,
                    spaced,
                })
            };
        }
        let mut k0 = 0;
        each_tile!(S::LANES, RB, false, a.r, k0, run);
    }
}

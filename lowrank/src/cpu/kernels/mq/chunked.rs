//! Rows in column chunks (a call whose `Q` is too large to read rows whole,
//! [`takes_whole_rows`]): a block of rows goes chunk by chunk ([`Chunked`]), each group
//! of rows through every column tile over the chunk ([`mq_span`]) with its accumulators
//! in memory between chunks, then each group's finish ([`mq_finish`]). The same steps
//! ([`mq_step`]) as whole rows ([`super::whole`]), so the same bits.

use super::*;

/// The vector part of one tile over the whole vectors `span` of `RB` rows at `i0` and the
/// columns `k0..k0+KT` of `P`: `acc` (`RB x KT x U` vectors) is loaded, advanced and
/// stored. `q` points at `Q`'s vectors, packed (`q[(v * r + k) * lanes]`, from
/// [`pack_q`], 64-byte aligned). With `FUSE`, `M += E` is written back on the way. With
/// [`Ahead::Sweep`], the span's image at element `base` of `M` (and `E`), rows
/// `span_len` apart, is prefetched into L2.
// Register tiles read best with explicit indices.
#[allow(clippy::needless_range_loop, clippy::too_many_arguments)]
#[inline(always)]
pub(super) unsafe fn mq_span<
    S: Simd,
    const RB: usize,
    const KT: usize,
    const U: usize,
    const FUSE: bool,
>(
    a: &Mat,
    i0: usize,
    k0: usize,
    span: Range<usize>,
    acc: *mut S::V,
    q: *const f32,
    ahead: Ahead,
    edges: Edges,
) {
    let lanes = S::LANES;
    let (sweep, base, span_len) = ahead.parts();
    // SAFETY: the caller guarantees rows i0..i0+RB < n, columns k0..k0+KT <= r, `span`
    // whole vectors inside the rows (with `edges`, of the shifted rows: only the edge
    // vectors' lanes inside the row are touched, through `Edges::at`) starting at a
    // multiple of U vectors, `acc` valid for RB * KT * U vectors and `q` laid out as
    // described over the span. Row pointers and prefetch addresses are formed with
    // `wrapping_*` (a shifted row starts before its row, prefetches may lie past the
    // buffers) and a prefetch never faults.
    unsafe {
        let t = TileRows::new(a, i0, FUSE, base, span.start, span_len);
        let slot = |ii: usize, k: usize, u: usize| acc.add((ii * KT + k) * U + u);
        let mut regs = [[[S::zero(); U]; KT]; RB];
        for ii in 0..RB {
            for k in 0..KT {
                for u in 0..U {
                    regs[ii][k][u] = *slot(ii, k, u);
                }
            }
        }
        let group = U * lanes;
        // The first group of a row with edges goes one vector at a time, as the vectors
        // that do not fill a group and the last edge do: all in registers (one at a
        // time on the accumulators in memory, the edges cost a 1024-float row of 2 x 8
        // tiles a tenth in L2).
        let mut j = span.start;
        if edges.lead > 0 && j == 0 {
            j = group.min(span.end);
            mq_each::<S, RB, KT, U, FUSE>(sweep, &t, &mut regs, span.start..j, q, a.r, k0, edges);
        }
        // Whole groups short of the last edge vector.
        let hot_end = if edges.lead > 0 {
            span.end.min(edges.last)
        } else {
            span.end
        };
        let hot = j..j + (hot_end.saturating_sub(j)) / group * group;
        if !hot.is_empty() {
            mq_hot_by::<S, RB, KT, U, FUSE>(sweep, &t, &mut regs, k0, a.r, hot.clone(), q);
            j = hot.end;
        }
        mq_each::<S, RB, KT, U, FUSE>(sweep, &t, &mut regs, j..span.end, q, a.r, k0, edges);
        for ii in 0..RB {
            for k in 0..KT {
                for u in 0..U {
                    *slot(ii, k, u) = regs[ii][k][u];
                }
            }
        }
    }
}

/// The end of one tile after its spans, from the accumulators in memory (`acc`, as
/// [`mq_span`] lays them out): [`mq_finish_regs`].
#[inline(always)]
pub(super) unsafe fn mq_finish<
    S: Simd,
    const RB: usize,
    const KT: usize,
    const U: usize,
    const FUSE: bool,
>(
    a: &Mat,
    i0: usize,
    k0: usize,
    vec_end: usize,
    acc: *const S::V,
) {
    // SAFETY: `acc` holds the tile's RB x KT x U accumulators (the caller); the rest as
    // `mq_finish_regs`.
    unsafe {
        let mut regs = [[[S::zero(); U]; KT]; RB];
        for (ii, row) in regs.iter_mut().enumerate() {
            for (k, col) in row.iter_mut().enumerate() {
                for (u, v) in col.iter_mut().enumerate() {
                    *v = *acc.add((ii * KT + k) * U + u);
                }
            }
        }
        mq_finish_regs::<S, RB, KT, U, FUSE>(a, i0, 1, k0, vec_end, &regs)
    }
}

/// One group of `RB` rows at `i0` through every column tile of `P`, over the vector
/// columns `span`, with its accumulators at `acc` (per tile, `RB x KT x U` vectors, in
/// tile order). Only the first tile fuses the error add; the later ones read the updated
/// rows (from L1).
#[inline(always)]
pub(super) unsafe fn mq_group<S: Simd, const RB: usize, const FUSE: bool>(
    a: &Mat,
    i0: usize,
    span: Range<usize>,
    acc: *mut S::V,
    q: *const f32,
    ahead: Ahead,
    edges: Edges,
) {
    let (mut k0, mut slot) = (0, acc);
    // SAFETY: forwarded caller guarantees; each tile's accumulators follow the previous
    // tile's inside `acc` (`group_vectors`).
    unsafe {
        // One span of tile ($kt, $u), fusing or not; only the first tile prefetches.
        macro_rules! span {
            ($kt:literal, $u:literal, $fuse:literal) => {{
                let ahead = if k0 == 0 { ahead } else { Ahead::No };
                mq_span::<S, RB, $kt, $u, $fuse>(a, i0, k0, span.clone(), slot, q, ahead, edges);
                slot = slot.add(RB * $kt * $u);
            }};
        }
        each_tile!(S::LANES, RB, FUSE, a.r, k0, span);
    }
}

/// [`mq_finish`] for every column tile of a group.
#[inline(always)]
pub(super) unsafe fn mq_group_finish<S: Simd, const RB: usize, const FUSE: bool>(
    a: &Mat,
    i0: usize,
    vec_end: usize,
    acc: *mut S::V,
) {
    let (mut k0, mut slot) = (0, acc);
    // SAFETY: as in `mq_group`.
    unsafe {
        // Only the first tile fuses the ragged columns' error add, as in the spans.
        macro_rules! finish {
            ($kt:literal, $u:literal, $fuse:literal) => {{
                mq_finish::<S, RB, $kt, $u, $fuse>(a, i0, k0, vec_end, slot);
                slot = slot.add(RB * $kt * $u);
            }};
        }
        each_tile!(S::LANES, RB, FUSE, a.r, k0, finish);
    }
}

/// One block of [`mq_rows_rb`]'s chunked walk: `groups` groups of rows from `i0`, each
/// column chunk over all of them (their accumulators in `acc`, `per` vectors a group),
/// then each group's finish. The fields are the walk's values for the block.
pub(super) struct ChunkedBlock<'a, S: Simd> {
    pub(super) a: &'a Mat,
    pub(super) ap: &'a Mat,
    pub(super) i0: usize,
    pub(super) groups: usize,
    pub(super) block_rows: usize,
    pub(super) blocks: usize,
    pub(super) vec_end_p: usize,
    pub(super) vec_end: usize,
    pub(super) chunk: usize,
    pub(super) chunks: usize,
    pub(super) by_chunk: bool,
    pub(super) sweep: bool,
    pub(super) hint: Hint,
    pub(super) acc: *mut S::V,
    pub(super) per: usize,
    pub(super) q: *const f32,
    pub(super) edges: Edges,
    pub(super) isa: PhantomData<S>,
}

/// A [`ChunkedBlock`] of groups of `RB` rows in a function of its own
/// ([`Simd::outlined`]), one for each group size: inlined, every [`mq_rows_rb`] compiled
/// its own copy of the one-row groups (its last rows), and the crate's build took
/// longer. One call a block of rows.
pub(super) struct Chunked<'a, S: Simd, const RB: usize, const FUSE: bool>(
    pub(super) ChunkedBlock<'a, S>,
);

impl<S: Simd, const RB: usize, const FUSE: bool> Outlined for Chunked<'_, S, RB, FUSE> {
    type Output = ();
    #[inline(always)]
    unsafe fn run(self) {
        let b = self.0;
        // Copies of the shapes: through the references LLVM would reload them after
        // every store (it cannot know that nothing writes to them).
        let (a, ap) = (&{ *b.a }, &{ *b.ap });
        let mut j0 = 0;
        // The chunk after this one, counted from the block's first.
        let mut next = 1;
        // SAFETY: the guarantees of `mq_rows_rb`'s walk for this block, which the creator
        // of the work gives: the groups lie inside its rows, the spans inside the rows'
        // whole vectors, each group's accumulators (`per` vectors) inside `acc`.
        unsafe {
            while j0 < b.vec_end_p {
                let span = j0..if next == b.chunks {
                    b.vec_end_p
                } else {
                    j0 + b.chunk
                };
                for g in 0..b.groups {
                    let (i, slot) = (b.i0 + g * RB, b.acc.add(g * b.per));
                    let span_len = span.end - span.start;
                    let ahead = if b.by_chunk {
                        // The same rows one chunk on (the next block's after the last).
                        let rows_on = next / b.chunks * b.block_rows;
                        let image = (i + rows_on) * a.cols + next % b.chunks * b.chunk;
                        Ahead::Sweep(image, a.cols, b.hint)
                    } else if b.sweep {
                        // This tile's image in the block MQ_AHEAD_BLOCKS ahead: the
                        // block's spans before this one, then its groups before this one.
                        let image = (b.i0 + b.blocks * b.block_rows) * a.cols
                            + span.start * b.block_rows
                            + g * RB * span_len;
                        Ahead::Sweep(image, span_len, b.hint)
                    } else {
                        Ahead::No
                    };
                    mq_group::<S, RB, FUSE>(ap, i, span.clone(), slot, b.q, ahead, b.edges)
                }
                j0 = span.end;
                next += 1;
            }
            for g in 0..b.groups {
                let (i, slot) = (b.i0 + g * RB, b.acc.add(g * b.per));
                mq_group_finish::<S, RB, FUSE>(a, i, b.vec_end, slot);
            }
        }
    }
}

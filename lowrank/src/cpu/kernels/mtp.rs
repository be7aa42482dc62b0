//! `Q = Mᵀ P`: register tiles of `Q` over strips of columns, walked down blocks of rows
//! small enough to stay in L2 while every strip of the block passes over them.
//!
//! Each element `Q[j, k] = Σᵢ M[i, j] P[i, k]` is one lane of one accumulator, summed over
//! the rows in order with one fused multiply-add a row (the ragged columns, taken one at
//! a time, the same through [`Simd::fma1`]), whatever the blocking, the column panels,
//! the thread count and where `M` lies.

use super::pack::QPack;
use super::{
    l1_is_wide, line_lead, llc_bytes, strips_prefetch_next_row, sweep_min_bytes, vector_lead,
    zen5_or_later, Mat, MTP_OWN_PREFETCH_RANK, NEAR_FLOATS, SWEEP_STRIDE,
};
use crate::cpu::simd::{Outlined, Simd};
use std::marker::PhantomData;
use std::ops::Range;

/// Floats of `M` per row block and column panel: 128 KiB, so that the block and the
/// panel's part of `Q` stay in L2 while the strips walk it. Cold, n = m = 4096, one
/// thread, AMD Zen 4 (AVX-512): 32 KiB and 16 KiB blocks read 0.20-0.62 of the read
/// bandwidth, 128 KiB 0.40-0.86, 512 KiB and whole-matrix blocks 0.12-0.56 (strips
/// walking further down than L2 holds); with `M` in L2 the bigger the better.
const MTP_BLOCK_FLOATS: usize = 32768;
/// [`MTP_BLOCK_FLOATS`] for a call that streams less than
/// [`SWEEP_MIN_BYTES`](super::SWEEP_MIN_BYTES) (`M` likely in cache, L2 or the last level):
/// 256 KiB. Each strip loads its tile from `Q` and stores it once a block, and the fewer
/// the blocks the fewer the round trips (the loads and stores of a `Q` that does not lie on
/// a line split). With `M` in L2 (Intel Xeon, Emerald Rapids class, AVX-512, 128 x 1024, 16
/// bytes past a line), median ratio of four alternated pairs against 128 KiB: r = 1 / 2 / 4
/// / 8 1.01 / 1.07 / 1.05 / 1.03, and 512 KiB (blocks of 128 rows) 0.96-0.99 of this; a
/// plain loop of the 16 x 1 and 8 x 2 tiles read 0.90-0.92 and 0.84-0.87 of the read sum
/// with 64 rows, 0.90 and 0.78-0.80 with 32.
const MTP_BLOCK_FLOATS_CACHED: usize = 65536;
/// [`MTP_BLOCK_FLOATS`] for a call on AMD Zen 5 and later ([`zen5_or_later`]) that
/// streams [`SWEEP_MIN_BYTES`](super::SWEEP_MIN_BYTES) or more but leaves the rows to the
/// hardware prefetchers ([`MTP_OWN_PREFETCH_RANK`]) in tiles of 4 columns of `Q` by
/// [`MTP_ZEN5_TILE_VECTORS`] (r = 4 with AVX-512): 512 KiB, 32 rows at 4096 columns
/// where [`MTP_BLOCK_FLOATS_CACHED`] makes 16. Each strip then loads and stores its
/// tile of `Q` half as often, and walks twice as far down a row's columns before the next
/// strip. AMD EPYC (Zen 5, KVM), a probe of one thread alternating groups of four calls
/// on the same buffers (the first of each group dropped), median GB/s against 256 KiB
/// blocks, `M` from memory: 4096 columns 23.2-23.9 -> 25.5-25.7 (two sets), 2048 22.8 ->
/// 24.8, 3072 22.7 -> 25.0, 8192 23.0 -> 25.3; 1024 and 1000 columns (64 rows a block
/// already, [`MTP_BLOCK_ROWS_MAX`]) 1.00-1.02; two threads 35.5 -> 37.5-39.4; from the
/// LLC (512 x 4096) 74.7 -> 83.7. 1 MiB blocks read the same as 512 KiB. At r = 1-3
/// (other tiles) 512 KiB read 0.97-0.98, so they keep 256 KiB. Where `M` is larger
/// than the LLC, r = 4 now sweeps instead ([`MTP_ZEN5_SWEEP_RANK`]), and these blocks
/// serve calls that stream 1 MiB or more of an `M` the LLC holds.
const MTP_BLOCK_FLOATS_ZEN5_FROM_MEMORY: usize = 131072;
/// Rows per block: at least this many (the accumulators are loaded and stored once a
/// block; fewer rows would make that traffic count), at most [`MTP_BLOCK_ROWS_MAX`].
const MTP_BLOCK_ROWS_MIN: usize = 8;
const MTP_BLOCK_ROWS_MAX: usize = 64;
/// Columns of `M` per panel: a row's run inside a panel is long enough for the hardware
/// prefetchers (16 KiB or more), and a block of [`MTP_BLOCK_ROWS_MIN`] rows of it fits
/// [`MTP_BLOCK_FLOATS`].
const MTP_PANEL_COLS: usize = MTP_BLOCK_FLOATS / MTP_BLOCK_ROWS_MIN;

mod scratch;
mod stream;
mod strips;
mod sweep;
use scratch::QScratch;
#[cfg(test)]
use stream::mtp_stream_as;
use stream::{mtp_stream, mtp_stream_one_row};
use strips::Block;
use sweep::Sweep;

/// [`mtp_stream_one_row`] in a function of its own ([`Simd::outlined`]): inlined into
/// [`mtp_cols`] beside the outlined [`Block`]s, its row loop kept a pointer on the stack
/// (AVX-512, r = 1, `M` in L2 16 bytes past a line: 0.87 of its own function, twelve
/// alternated pairs of `--roofline`).
struct OneRow<'a, S> {
    a: &'a Mat,
    cols: Range<usize>,
    isa: PhantomData<S>,
}

impl<S: Simd> Outlined for OneRow<'_, S> {
    type Output = ();
    #[inline(always)]
    unsafe fn run(self) {
        // A copy of the shape, as in [`Block`].
        let a = *self.a;
        // SAFETY: the guarantees of `mtp_stream_one_row`, which the creator of the work
        // gives.
        unsafe { mtp_stream_one_row::<S>(&a, self.cols) }
    }
}

/// The largest rank at which [`mtp_cols`] takes [`mtp_stream`] for a call that streams
/// `M` from memory (see there).
const MTP_STREAM_MAX_RANK: usize = 3;
/// The rank from which [`mtp_cols`] takes [`mtp_stream`] again for such a call: there
/// the strips' tiles (at most 4 columns of `Q` with 8 lanes) walk each row block twice or
/// more, and the stream's passes over rows kept in L1 cost less (see there).
const MTP_STREAM_FROM_RANK: usize = 8;
/// With 8 lanes, a call that does not stream from memory takes the strips, not
/// [`mtp_stream`], where L1 has 12 ways or more ([`l1_is_wide`]) and the rank is a
/// multiple of this (every tile of the strips 4 columns of `Q` wide): there a block's
/// rows, 4 KiB apart at power-of-two widths, no longer overflow the strip's L1 sets, and
/// the strips keep `Q` in registers where the stream loads and stores it once a pass.
/// With `M` in L2 (Intel Xeon, Emerald Rapids class, 48 KiB 12-way L1, AVX2, 16 bytes
/// past a line), three alternated runs, the strips against the stream: r = 4 0.50-0.70
/// -> 0.81-0.83 of the in-core limit (median ratio of pairs 1.17), r = 8 0.48-0.66 ->
/// 0.80-0.82 (1.24); in GB/s at 1024 / 2048 / 1000 columns, r = 4 31-32 / 25 / 31-32 ->
/// 36-38 / 36-38 / 31-35, r = 8 15 / 12 / 15-16 -> 18 / 18 / 17-18; r = 12 and 16
/// faster at 768, 1000, 1024 and 2048 columns alike. Other ranks keep the stream: r = 1
/// 0.90, r = 2 50-61 against 54-60 GB/s, r = 3 25-36 against 27-40, and r = 5-7, which
/// add a tile of 1-2 columns, faster with the strips at 2048 columns but slower at 768
/// and 1000 (r = 7 at 1000: 0.09-0.11 of the read sum against 0.13).
const MTP_STRIPS_WIDE_TILE: usize = 4;
/// With 8 lanes where L1 has 12 ways or more ([`l1_is_wide`]), [`mtp_cols`] takes the
/// strips at every rank, in cache and from memory, when every row lies alike on 64-byte
/// lines (`cols` a multiple of this many floats), where the strips peel each row's lead
/// and every strip reads whole lines. Since the strips walk their part vectors beside a
/// strip, load each row's vectors as they multiply them and keep 256 KiB row blocks in
/// cache, they read more than the stream on an Intel Xeon (Emerald Rapids class, 48 KiB
/// 12-way L1, AVX2), median ratio of alternated pairs: with `M` in L2 16 bytes past a
/// line (`--roofline`, eight pairs) r = 1 1.06, r = 2 1.17, and at 768 / 1024 / 2048
/// columns (15 pairs) r = 1 1.02 / 1.02 / 1.09, r = 2 1.18 / 1.18 / 1.24, r = 3 0.99 /
/// 0.98 / 1.10, r = 5-7 1.02-1.41; from the last-level cache (512 x 4096) r = 1, 2, 3,
/// 8, 12, 16 1.10, 1.11, 1.11, 1.26, 1.27, 1.28; from memory (4096 x 4096) 0.98-1.05.
/// Where rows lie apart (1000 columns) the strips read 0.73-1.01 of the stream in L2,
/// and the rules before hold.
const MTP_STRIPS_ROW_FLOATS: usize = 16;
/// Whether, on AMD Zen 5 and later ([`zen5_or_later`]) and with 8 lanes, [`mtp_cols`]
/// takes the row stream (for a call that sweeps or not, at rank `r`): in cache at every
/// rank, from memory at r = 2, 3 and 5. The strips walk a block's rows side by side,
/// which that core streams worse than rows one after another. AMD EPYC (Zen 5, 48 KiB
/// 12-way L1, AVX2, KVM), a probe of one thread, median of calls, two or three
/// alternated pairs each, the stream against the strips: in cache (128 x 1024 /
/// 64 x 2048 / 32 x 4096, 16 bytes past a line) r = 1 1.21-1.55 / 1.45 / 1.25-1.28,
/// r = 2 1.92-1.96 / 1.63-1.65 / 1.32-1.34, r = 3 1.93-1.96, r = 4 1.65 / - / 0.97,
/// r = 5-7 1.69-1.74, r = 8 1.62 / - / 1.24, r = 12 1.55 / - / 1.22; from memory
/// (8192 x 4096) r = 2 1.11-1.24, r = 3 1.57-1.86, r = 5 1.50-1.73, but r = 1 0.87-1.07,
/// r = 4 0.79-0.93, r = 6 0.83-1.08 and r = 8 0.97-1.02, which keep the strips.
fn zen5_takes_stream(sweep: bool, r: usize) -> bool {
    !sweep || matches!(r, 2 | 3 | 5)
}
/// Vectors a strip of 4 columns of `Q` takes with 16 lanes in cache on AMD Zen 5 and
/// later ([`zen5_or_later`]): 6 (24 accumulators, with the 4 broadcasts of `P` and the
/// row's vector 29 of the 32 registers) where the other cores take 4. AMD EPYC (Zen 5,
/// AVX-512, KVM), r = 4, 16 bytes past a line: `--roofline` in L2 median ratio of four
/// alternated pairs 1.16 (0.62-0.64 -> 0.72 of the in-core limit); a probe, three pairs
/// each, 128 x 1024 / 64 x 2048 / 32 x 4096 / 100 x 1000 1.17 / 1.16-1.17 / 1.05-1.07 /
/// 1.05. From memory r = 4 did not sweep on Zen 5 ([`MTP_OWN_PREFETCH_RANK`]), so it
/// took 6 there too: 0.96-0.98 in the probe (8192 x 4096), 1.07 in `--roofline`'s
/// `cold` (4096 x 4096) and 1.17 from the LLC (four pairs). Calls that sweep (a tile of
/// 4 at r >= 5, and r = 4 where `M` is larger than the LLC, [`MTP_ZEN5_SWEEP_RANK`])
/// keep 4.
const MTP_ZEN5_TILE_VECTORS: usize = 6;
/// Whether [`mtp_cols`] takes the one-row stream ([`mtp_stream_one_row`]) for a call of
/// rank `r` on `lanes` lanes over `bytes` of `M`: at rank 1 with AVX-512 on AMD Zen 5
/// and later (`zen5`, [`zen5_or_later`]), for calls in cache (less than
/// [`SWEEP_MIN_BYTES`](super::SWEEP_MIN_BYTES), as for the other rules here). The strips
/// walk a block's rows side by side, which that core streams from L2 at about half the
/// rate of one row at a time. AMD EPYC (Zen 5, AVX-512, KVM): in C, one row at a time
/// into `Q` in L1 read 163-174 GB/s with `M` in L2 (128 x 1024), strips of 8 or 16
/// vectors down the rows 113-148, the same stream over 2, 4 or 8 rows at once 127-184;
/// a probe of the kernel 120 -> 165-168 GB/s; `--roofline` (four alternated pairs) in L2
/// median ratio 1.32, from the LLC 1.06, but from memory 0.95 (0.96-1.04 -> 0.92-0.93
/// of the read bandwidth), so calls from memory keep the strips.
fn takes_one_row_stream(lanes: usize, r: usize, bytes: usize, zen5: bool) -> bool {
    zen5 && lanes == 16 && r == 1 && bytes < super::SWEEP_MIN_BYTES
}
/// Whether [`mtp_cols`] takes the row stream ([`mtp_stream`]) with 16 lanes: on AMD
/// Zen 5 and later (`zen5`, [`zen5_or_later`]) at rank 2, for calls whose rows all lie
/// alike on vectors (in cache the stream then starts its vectors on a line: no load
/// splits one). From memory it prefetches each row [`NEAR_FLOATS`] ahead of its loads
/// (it does not sweep at r = 2 there, [`MTP_OWN_PREFETCH_RANK`]). AMD EPYC (Zen 5,
/// KVM), AVX-512, against the strips, `bench lowrank` in alternated pairs (three sets
/// of five to ten): `--roofline` `cold` (4096 x 4096) 1.09 / 1.17 / 1.32 (0.67-0.73 ->
/// 0.77-0.79 of the read bandwidth), from the LLC 1.14 / 1.15 / 1.15; `--quick` one
/// thread 1.01 / 1.15 / 1.32, two 1.00 / 0.95 / 0.99; in L2 the same (0.99-1.00). The
/// stream from memory without the prefetch read 0.79 of it with one thread (`cold`
/// 0.81). In cache: The strips'
/// 8 x 2 tile walks a block's rows side by side, which that core streams worse than a
/// few rows one line at a time. AMD EPYC (Zen 5, AVX-512, KVM), a probe of one thread
/// alternating the two on the same buffers (median of 15 rounds), GB/s with `M` in L2 16
/// bytes past a line: 128 x 1024 108 -> 130, 64 x 2048 112 -> 127, 32 x 4096 101 -> 108,
/// 200 x 1200 109 -> 118, 64 x 1536 and 256 x 512 115 -> 123; on a line 1.05-1.13.
/// `--roofline` (six alternated pairs) in L2 median ratio 1.19 (0.43-0.46 -> 0.48-0.72
/// of the in-core limit), `M` on a line 1.11. Blocks of 2 or 3 rows read the same as 4
/// (2 and 4: 134 / 128 at 128 x 1024, 103 / 127 at 32 x 4096); rows not alike (1000
/// columns, no shift) 0.89-0.96, and at r = 4 the stream in one pass of 4 columns (4
/// rows: 16 broadcasts in registers) 0.79-0.97 of the strips' 6 x 4 tile, 2, 3 or 6
/// rows less, so neither takes it. (In C, with `M` on a line: 2 rows at r = 2 133-137
/// GB/s against a read of the same `M` at 240-250; one row at r = 1 168-175.)
fn takes_wide_stream(a: &Mat, lanes: usize, zen5: bool) -> bool {
    zen5 && lanes == 16 && a.r == 2 && a.cols.is_multiple_of(lanes)
}
/// Whether an `mtp` call over the columns `cols` streams `M` from memory: reads
/// [`SWEEP_MIN_BYTES`](super::SWEEP_MIN_BYTES) or more (whether it sweeps or not).
fn streams_from_memory(a: &Mat, cols: &Range<usize>) -> bool {
    a.n * cols.len() * 4 >= super::SWEEP_MIN_BYTES
}
/// Whether an `mtp` call over the columns `cols` sweeps `M` ahead into L2 (the strips
/// and the stream alike): [`sweep_min_bytes`] at the call's rank, and on AMD Zen 5 with
/// 16 lanes at r = [`MTP_ZEN5_SWEEP_RANK`] where the strips sweep in memory order.
fn mtp_sweeps<S: Simd>(a: &Mat, cols: &Range<usize>) -> bool {
    a.n * cols.len() * 4 >= sweep_min_bytes(a.r, S::LANES, MTP_OWN_PREFETCH_RANK)
        || S::LANES == 16
            && a.r == MTP_ZEN5_SWEEP_RANK
            && streams_from_memory(a, cols)
            && sweeps_in_memory_order(a)
}
/// The rank at which `mtp` with 16 lanes sweeps on AMD Zen 5 and later where its strips
/// sweep in memory order ([`sweeps_in_memory_order`]: `M` larger than the last-level
/// cache), though at ranks up to [`MTP_OWN_PREFETCH_RANK`] it leaves the rows to the
/// hardware prefetchers: the 4 x 4 tile (128 KiB blocks) swept in memory order against
/// the 6 x 4 tile in 512 KiB blocks unswept ([`MTP_ZEN5_TILE_VECTORS`]). AMD EPYC (Zen
/// 5, KVM), AVX-512, a probe alternating both on the same buffers, each call after a
/// 512 MiB write (median GB/s of 11-21 calls): one thread 4096 x 4096 18.2 / 14.2 ->
/// 20.2 / 17.9, 8192 x 4096 15.4 / 14.0 -> 19.6 / 19.0 (1.11-1.36); two threads
/// 4096 x 4096 22.2 / 21.0 / 17.6 / 17.2 -> 19.1 / 21.6 / 20.8 / 20.0, 8192 x 4096 24.5 /
/// 17.4 / 19.4 -> 27.1 / 21.8 / 21.1 (0.86-1.25, median 1.11). Ranks 1-3 have no tile
/// that sweeps in memory order (their rows' order read less), so they keep none.
const MTP_ZEN5_SWEEP_RANK: usize = 4;
/// Accumulators a tile holds: 16 vectors with AVX-512's 32 registers, 8 with 16 (AVX2
/// and the portable fallback), leaving room for the row's vectors and a broadcast.
const fn tile_accumulators(lanes: usize) -> usize {
    if lanes == 16 {
        16
    } else {
        8
    }
}

/// `Q[cols] = (Mᵀ P)[cols]` for one matrix: column panels of [`MTP_PANEL_COLS`], row blocks
/// of [`MTP_BLOCK_FLOATS`] inside each ([`MTP_BLOCK_FLOATS_CACHED`] for a call that does
/// not stream from memory), and in each block tiles of `KT` columns of `Q` by `VW` vectors
/// (`KT x VW` accumulators: 1 x 16, 2 x 8, 4 x 4, 8 x 2 on AVX-512; 1 x 8, 2 x 4, 4 x 2 on
/// AVX2), each row adding `KT x VW` fused multiply-adds to them. A rank that is not 1, 2, 4
/// or 8 goes in tiles of 8 (16 lanes only), 4, 2, 1 columns, each tile walking the block
/// again (from L2). With 16 lanes, on some cores, calls in cache at rank 1 take
/// [`mtp_stream_one_row`] ([`takes_one_row_stream`]) and at rank 2 [`mtp_stream`]
/// ([`takes_wide_stream`]). With 8 lanes, ranks up to [`MTP_STREAM_MAX_RANK`] or from
/// [`MTP_STREAM_FROM_RANK`], and calls that stream less than
/// [`SWEEP_MIN_BYTES`](super::SWEEP_MIN_BYTES) (where L1 has 12 ways or more, at ranks not
/// a multiple of [`MTP_STRIPS_WIDE_TILE`]), take the row-streaming [`mtp_stream`] instead
/// (the same bits), unless L1 has 12 ways or more and every row lies alike on lines
/// ([`MTP_STRIPS_ROW_FLOATS`]).
///
/// A call that streams [`SWEEP_MIN_BYTES`](super::SWEEP_MIN_BYTES) or more prefetches each
/// row it reads into L2 one row block ahead at r = 1, two otherwise (the hardware
/// prefetchers do not keep up with a block's rows read in strips): cold, n = m = 4096, one
/// thread, AMD Zen 4 (AVX-512), alternated runs, r = 1 went from 0.22-0.27 of the read
/// bandwidth to 0.80-0.91, r = 2 from 0.63-0.70 to 0.78-0.88, r = 4 from 0.55-0.82 to
/// 0.74-0.93, r = 8 from 0.39-0.51 to 0.60-0.80.
///
/// The old kernel kept `Q` in memory and added a block of 8 rows to it per pass: each
/// vector of `Q` was loaded, had 8 dependent FMAs added and was stored, and the 8 (or 16)
/// rows read side by side were 4 or 16 KiB apart at power-of-two widths, all in one L1
/// set (8 ways) with their prefetches: 0.25-0.48 of the in-core limit with `M` in L2
/// (AMD Zen 4, AVX-512), 0.37-0.66 of the read bandwidth from memory.
#[inline(always)]
pub(crate) unsafe fn mtp_cols<S: Simd>(a: &Mat, cols: Range<usize>) {
    if a.n == 0 {
        // An empty sum: Q is zero.
        for k in 0..a.r {
            for j in cols.clone() {
                // SAFETY: `cols` is inside 0..cols and Q holds r columns of them.
                unsafe { *a.q.add(k * a.cols + j) = 0.0 };
            }
        }
        return;
    }
    if let Some(far) = QScratch::wanted(a, &cols, S::LANES) {
        // SAFETY: `far.mat` is `a` with `Q` in the scratch, which holds every index `a`
        // names in `Q`; forwarded caller guarantees otherwise.
        unsafe { mtp_cols_in::<S>(&far.mat, cols.clone()) };
        // SAFETY: `cols` is this call's share of `Q`'s columns (the caller).
        unsafe { far.copy_to(a, cols) };
        return;
    }
    // SAFETY: forwarded caller guarantees.
    unsafe { mtp_cols_in::<S>(a, cols) }
}

/// [`mtp_cols`] with `Q` where `a` has it.
///
/// # Safety
/// As [`mtp_cols`].
#[inline(always)]
unsafe fn mtp_cols_in<S: Simd>(a: &Mat, cols: Range<usize>) {
    let lanes = S::LANES;
    let sweep = mtp_sweeps::<S>(a, &cols);
    let wide = l1_is_wide();
    let stream = takes_wide_stream(a, lanes, zen5_or_later())
        || lanes == 8
            && if zen5_or_later() {
                zen5_takes_stream(sweep, a.r)
            } else {
                !(wide && a.cols.is_multiple_of(MTP_STRIPS_ROW_FLOATS))
                    && if sweep {
                        a.r <= MTP_STREAM_MAX_RANK || a.r >= MTP_STREAM_FROM_RANK
                    } else {
                        !a.r.is_multiple_of(MTP_STRIPS_WIDE_TILE) || !wide
                    }
            };
    // SAFETY: forwarded caller guarantees.
    unsafe {
        if takes_one_row_stream(lanes, a.r, a.n * cols.len() * 4, zen5_or_later()) {
            S::outlined(OneRow::<S> {
                a,
                cols,
                isa: PhantomData,
            })
        } else if stream {
            mtp_stream::<S>(a, cols)
        } else {
            mtp_strips::<S>(a, cols)
        }
    }
}

/// The strips of [`mtp_cols`] (see there) over the columns `cols`, `a.n` > 0.
#[inline(always)]
unsafe fn mtp_strips<S: Simd>(a: &Mat, cols: Range<usize>) {
    // SAFETY: forwarded caller guarantees.
    unsafe { mtp_strips_as::<S>(a, cols, sweeps_in_memory_order(a)) }
}

/// Whether the strips sweep (where they sweep) in memory order ([`Sweep`]): on AMD Zen 5
/// and later where `M` is larger than the last-level cache. From the LLC (AVX-512,
/// r = 8, 512 x 4096, read once before) memory order read 0.92-1.04 of the rows' order,
/// so calls there keep that.
fn sweeps_in_memory_order(a: &Mat) -> bool {
    zen5_or_later() && a.n * a.cols * 4 > llc_bytes()
}

/// [`mtp_strips`] with the sweep (where the call sweeps) in memory order or not
/// (`linear`, [`Sweep`]): the same bits either way.
#[inline(always)]
unsafe fn mtp_strips_as<S: Simd>(a: &Mat, cols: Range<usize>, linear: bool) {
    let lanes = S::LANES;
    let sweep = mtp_sweeps::<S>(a, &cols);
    let accs = tile_accumulators(lanes);
    let next_row = strips_prefetch_next_row();
    // Tiles of 4 columns of `Q` by 6 vectors (24 accumulators) in cache on Zen 5: see
    // [`MTP_ZEN5_TILE_VECTORS`].
    let six_wide = !sweep && zen5_or_later();
    let from_memory = streams_from_memory(a, &cols);
    let width = MTP_PANEL_COLS.max(lanes);
    let mut c0 = cols.start;
    while c0 < cols.end {
        let panel = c0..(c0 + width).min(cols.end);
        let block_floats = if sweep {
            MTP_BLOCK_FLOATS
        } else if six_wide && from_memory && a.r.is_multiple_of(4) {
            MTP_BLOCK_FLOATS_ZEN5_FROM_MEMORY
        } else {
            MTP_BLOCK_FLOATS_CACHED
        };
        let block = (block_floats / panel.len().max(1))
            .clamp(MTP_BLOCK_ROWS_MIN, MTP_BLOCK_ROWS_MAX)
            .min(a.n.max(1));
        let mut i0 = 0;
        while i0 < a.n {
            let rows = i0..(i0 + block).min(a.n);
            let ahead_rows = match (sweep, a.r) {
                (false, _) => 0,
                (true, 1) => block,
                (true, _) => 2 * block,
            };
            let mut k0 = 0;
            while k0 < a.r {
                let rem = a.r - k0;
                // Only the first tile of columns prefetches; the others walk the block
                // again from L2.
                let sw = if k0 == 0 {
                    Sweep::new(ahead_rows, linear, &rows, &panel)
                } else {
                    Sweep::NONE
                };
                // Eight lanes never reach 8 columns (the stream takes those ranks).
                let kt = if rem >= 8 && lanes == 16 {
                    8
                } else if rem >= 4 {
                    4
                } else if rem >= 2 {
                    2
                } else {
                    1
                };
                // SAFETY: rows inside 0..n, the panel inside `cols` (inside 0..cols, the
                // caller), tile columns inside 0..r.
                unsafe {
                    // Each tile with its sweep by rows (or none), the tiles that sweep from
                    // memory on Zen 5 in memory order too ([`Sweep::takes_linear`]), the
                    // order a constant (`LIN`): see [`Sweep::by_rows`].
                    macro_rules! block {
                        ($vw:expr, $kt:literal) => {
                            if sw.is_linear() && const { Sweep::takes_linear(S::LANES, $kt) } {
                                S::outlined(Block::<S, $vw, $kt, true> {
                                    a,
                                    rows: rows.clone(),
                                    panel: &panel,
                                    k0,
                                    sweep: sw,
                                    next_row,
                                    isa: PhantomData,
                                })
                            } else {
                                S::outlined(Block::<S, $vw, $kt, false> {
                                    a,
                                    rows: rows.clone(),
                                    panel: &panel,
                                    k0,
                                    sweep: sw.by_rows(),
                                    next_row,
                                    isa: PhantomData,
                                })
                            }
                        };
                    }
                    match (kt, accs) {
                        (8, 16) => block!(2, 8),
                        // Only in calls that do not sweep (`six_wide`).
                        (4, 16) if six_wide => {
                            S::outlined(Block::<S, MTP_ZEN5_TILE_VECTORS, 4, false> {
                                a,
                                rows: rows.clone(),
                                panel: &panel,
                                k0,
                                sweep: Sweep::NONE,
                                next_row,
                                isa: PhantomData,
                            })
                        }
                        (4, 16) => block!(4, 4),
                        (2, 16) => block!(8, 2),
                        (1, 16) => block!(16, 1),
                        (4, _) => block!(2, 4),
                        (2, _) => block!(4, 2),
                        _ => block!(8, 1),
                    }
                }
                k0 += kt;
            }
            i0 = rows.end;
        }
        c0 = panel.end;
    }
}

#[cfg(test)]
mod tests;

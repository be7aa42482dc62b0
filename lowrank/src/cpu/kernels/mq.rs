//! `P = M Q`, optionally fused with `M += E`: register tiles of a few rows by a few
//! columns of `P`, each with `U` accumulators a column so that the fused multiply-adds
//! of a row do not wait on each other, over column chunks whose `Q` stays in L1.
//!
//! Each `P[i, k]` is summed the same way whatever the tile, the chunks or the thread
//! count: vector `v` of row `i` goes to accumulator `v mod U` (in order), the `U`
//! accumulators are added in a fixed tree, the lanes reduced, and the ragged columns past
//! the last whole vector added one by one. `U` depends only on the instruction set and on
//! the width of the tile of columns `k` falls in, which depends only on `r`.

use super::pack::{pack_q, pack_q_edges, QPack};
use super::{
    l1_is_wide, llc_bytes, spaces_rows, sweep_min_bytes_on, vector_lead, zen5_or_later, Mat,
    MQ_OWN_PREFETCH_RANK, NEAR_FLOATS, SWEEP_MIN_BYTES, SWEEP_STRIDE,
};
use crate::cpu::simd::{Outlined, Simd};
use std::marker::PhantomData;
use std::ops::Range;

/// Bytes of `Q` up to which rows are read whole (no column chunks): `Q` stays in L1
/// (32 KiB on AMD Zen 4, 48 KiB on Intel and Zen 5) beside one stream of rows: 4096
/// columns at `r = 1`, 2048 at `r = 2`.
const MQ_WHOLE_ROW_BYTES: usize = 16 * 1024;
/// [`MQ_WHOLE_ROW_BYTES`] where L1 has 48 KiB and 12 ways ([`l1_is_wide`]): `Q` of
/// 8 columns by 1024 stays in L1 beside the rows. Intel Xeon (Emerald Rapids class),
/// r = 8, 1024 columns, three alternated runs: cold (16384 x 1024) `mq` 0.67-0.74 →
/// 0.75-0.87 of the read bandwidth with AVX-512, 0.60-0.62 → 0.64-0.66 with AVX2,
/// `add_mq` 0.77-0.88 → 0.81-0.86; with `M` in L2 `mq` 0.45-0.52 → 0.49-0.53 of the
/// in-core limit (AVX-512), 0.60-0.64 → 0.64-0.68 (AVX2); r = 4 at 2048 columns the
/// same within noise.
const MQ_WHOLE_ROW_BYTES_WIDE: usize = 32 * 1024;
/// Bytes of `Q` up to which rows are read whole on AMD Zen 5 and later from L2, where a
/// group reads at least 1.5 r rows ([`takes_whole_rows`]): 8192 columns at r = 2, 16384
/// at r = 1. Cold (AMD EPYC, KVM, one thread, a probe's runs in turn): AVX-512 r = 2 at
/// 2048 x 16384 20-26 -> 31-32 GB/s; AVX2 r = 2 (three rows) at 2048 x 8192 18 -> 26-27,
/// r = 1 at 2048 x 16384 24-37 -> 37-41. Where a group reads fewer rows the chunks
/// stay: AVX-512 r = 8 (two rows) at 8192 x 2048 18-21 -> 15-19, AVX2 r = 4 (two rows)
/// at 4096 x 4096 23 -> 22; AVX-512 r = 4 (four rows, `Q` as much L2 traffic as `M`)
/// gained from memory (`bench lowrank --quick`, 4096 x 4096, four alternated pairs: one
/// thread 0.64-0.68 -> 0.71-0.78 of the read bandwidth, two threads 1.20; `--roofline`
/// 1.14-1.18) but lost from the last-level cache (8 MiB of `M`, 0.82 and 0.86 in two
/// sets), the sizes of most models' layers, so it keeps the chunks.
const MQ_WHOLE_ROW_BYTES_L2: usize = 64 * 1024;
/// The highest rank at which `mq` with 16 lanes on AMD Zen 5 reads whole rows with `Q`
/// from L2 ([`MQ_WHOLE_ROW_BYTES_L2`]) whatever its group's rows, where `M` is larger
/// than the last-level cache ([`llc_bytes`]), so comes from memory: the column chunks'
/// 8-row blocks each read all of `Q` from L2 again, and beside that traffic the core
/// streams `M` well below its read bandwidth (see [`MQ_BLOCK_ROWS_ZEN5`]). AMD EPYC
/// (Zen 5, KVM), one thread, 4096 x 4096 cold: `bench lowrank --roofline`'s `cold`
/// (four alternated pairs) `mq` r = 4 0.62-0.66 -> 0.72-0.77 of the read bandwidth,
/// `mq+e` 0.61-0.64 -> 0.72-0.79; `--quick` one thread 0.63 -> 0.76, two 0.89 -> 0.86
/// (four rounds); a probe (three rounds) r = 3 20.9 -> 29.3 GB/s, fused 13.7 -> 14.5.
/// From the last-level cache (8 MiB) the same walk read 0.91 (0.96 fused) of the
/// chunks, so `M` that fits there keeps them. With AVX2 the fused pass at r = 4 read
/// 0.81 of the chunks from memory.
const MQ_WHOLE_FROM_MEMORY_RANK: usize = 4;
/// Bytes of `Q` per column chunk past that: the chunk's `r` columns stay in L1 while a
/// block of rows passes over them. Cold, n = m = 4096, r = 8, Zen 4, AVX-512: 12 KiB
/// chunks read 0.42-0.47 of the read bandwidth, 16 KiB 0.37-0.41. On a 48 KiB 12-way L1
/// (Intel Xeon, Emerald Rapids class, AVX-512, four alternated runs) 24 KiB chunks read
/// the same (median ratio of pairs 0.99 with one thread, 1.05 with two).
const MQ_CHUNK_BYTES: usize = 12 * 1024;
/// Rows per block when the columns are chunked: each chunk serves a block of rows, whose
/// accumulators wait in L1 between chunks. Cold, n = m = 4096, one thread, AMD Zen 4
/// (AVX-512), with the sweep 2 blocks ahead: 8 rows read 0.83-0.92 of the read bandwidth
/// at r = 2 and 0.78-0.87 at r = 4, 16 rows 0.82-0.89 and 0.80-0.83.
const MQ_BLOCK_ROWS: usize = 8;
/// How many row blocks ahead the software prefetch sweeps ([`Ahead::Sweep`]). Cold,
/// n = m = 4096, r = 2, one thread, AMD Zen 4 (AVX-512): with no sweep and prefetches
/// of the next group's span into L1 the kernel read 0.53-0.58 of the read bandwidth (the
/// prefetched rows evicted the chunk of `Q`); the same prefetches into L2 0.74-0.84, the
/// sweep 1 block ahead 0.80-0.88, 2 blocks 0.84-0.89.
const MQ_AHEAD_BLOCKS: usize = 2;
/// At least this many bytes ahead, in whole blocks: unchunked, a block is one group of
/// rows (one row of 16 KiB for the fused pass at r = 1 and 4096 columns), and two of
/// them are too near for a prefetch from memory to arrive in time.
const MQ_AHEAD_MIN_BYTES: usize = 128 * 1024;
/// [`MQ_BLOCK_ROWS`] for chunked calls that sweep on AMD Zen 5 and later
/// ([`zen5_or_later`]), which sweep chunk by chunk ([`Ahead::Sweep`]): each block reads
/// all of `Q` from L2 once, and with 8 rows a block that is more traffic than `M`'s.
/// With `M` from memory the core then streams far below its read bandwidth: C loops of
/// `mq`'s r = 8 step (3 rows, 8192 x 4096, one thread) read 30 GB/s where `Q` stayed in
/// L1 and 18-21 where each block read it anew, at any prefetch hint or distance; 48-row
/// blocks swept a chunk ahead 28. In the kernel (`M` 16 bytes past a line, cold after a
/// 512 MiB write, median of 8 calls, three alternated rounds): r = 8 at 4096 x 4096
/// 19.6 -> 25.4 GB/s; 24-row blocks 25.2, 12 rows 22.8.
const MQ_BLOCK_ROWS_ZEN5: usize = 48;
/// [`MQ_CHUNK_BYTES`] for the calls of [`MQ_BLOCK_ROWS_ZEN5`]: 512 columns at r = 8.
/// The kernel at r = 8 (8192 x 4096, one thread, cold, three alternated rounds, 48-row
/// blocks): 8 KiB chunks 21.2 GB/s, 12 KiB 17.5, 16 KiB 22.5 (24.8 and 26.6 in a
/// second set). In C loops a `Q` of 32 KiB or more in L1 beside a stream from memory
/// halved the stream (16 KiB or less: 30-34 GB/s, 32 KiB 17-18).
const MQ_CHUNK_BYTES_ZEN5: usize = 16 * 1024;
/// The lowest rank that takes [`MQ_BLOCK_ROWS_ZEN5`]: at r = 4 (with AVX2; AVX-512 does
/// not sweep there) a block's `Q` is half the traffic it is at r = 8, and the tall
/// blocks read 0.87-0.91 of the short ones (4096 x 4096, one thread, cold, four
/// alternated rounds; `--roofline`'s `cold` 0.96, its `llc` 1.14). With 8 lanes the
/// fused pass keeps the short blocks at every rank: at r = 8 the tall ones read 1.06-1.11
/// from memory but 0.84-0.88 from the LLC (8 MiB, `--roofline`, two sets of six and
/// eight alternated pairs).
const MQ_TALL_MIN_RANK: usize = 5;

/// The lowest rank at which the plain pass (`mq`, not fused) prefetches each row near
/// ([`Walk::near`]); the fused pass does at every rank. At r = 1 one row's two
/// accumulators a column leave the loads room, and the hardware prefetchers alone read
/// as much as the reference: AMD EPYC (Zen 5, KVM), AVX-512, `bench lowrank --quick`
/// with the near prefetch against without (eight alternated pairs), r = 1 one / two
/// threads 0.94 / 0.90 (0.95-1.23 of the read bandwidth without it), r = 2 1.26 / 1.03.
const MQ_NEAR_MIN_RANK: usize = 2;

/// Walks the column tiles of a group of `$rb` rows on `$lanes` lanes through rank `$r`
/// (`$fuse`: the call's `FUSE`): for each, with `$k0` (the caller's, from 0; declared
/// before its local macro, which reads it) its first column, runs the caller's
/// local macro `$tile!(KT, U, FUSE_TILE)` with the tile's constant width, the
/// accumulators a column [`tile`] gives it (the one table of tile shapes, so the spans,
/// the finish and the whole rows walk the accumulators in the same order) and whether
/// it fuses `M += E` (only the first tile does; the later ones read the updated rows
/// from L1). Only the tiles that occur are compiled ([`tile_occurs`]).
macro_rules! each_tile {
    ($lanes:expr, $rb:expr, $fuse:expr, $r:expr, $k0:ident, $tile:ident) => {
        while $k0 < $r {
            let kt = tile_width($lanes, $r - $k0);
            let fuse_tile = $fuse && $k0 == 0;
            match kt {
                8 => each_tile!(@fuse 8, 1, fuse_tile, $lanes, $rb, $fuse, $tile),
                4 => each_tile!(@fuse 4, 1, fuse_tile, $lanes, $rb, $fuse, $tile),
                2 => each_tile!(@fuse 2, 2, fuse_tile, $lanes, $rb, $fuse, $tile),
                _ => each_tile!(@fuse 1, 2, fuse_tile, $lanes, $rb, $fuse, $tile),
            }
            $k0 += kt;
        }
    };
    (@fuse $kt:literal, $u:literal, $f:ident, $lanes:expr, $rb:expr, $fuse:expr, $tile:ident) => {{
        debug_assert_eq!(tile($lanes, $kt).1, $u);
        if $f {
            each_tile!(@one $kt, $u, true, $lanes, $rb, $fuse, $tile)
        } else {
            each_tile!(@one $kt, $u, false, $lanes, $rb, $fuse, $tile)
        }
    }};
    (@one $kt:literal, $u:literal, $f:literal, $lanes:expr, $rb:expr, $fuse:expr, $tile:ident) => {
        if const { tile_occurs($lanes, $rb, $kt, $fuse, $f) } {
            $tile!($kt, $u, $f)
        } else {
            unreachable!("mq: no {}-row tile {} wide (fused {})", $rb, $kt, $f)
        }
    };
}

mod chunked;
mod shape;
mod sweep;
mod whole;
use chunked::{Chunked, ChunkedBlock};
use shape::{group_occurs, group_rows, group_vectors, tile, tile_occurs, tile_width, GroupOf};
use sweep::{sweep_hint, Ahead, Hint, NEAR, NO_SWEEP};
use whole::{mq_group_whole, mq_run_whole};

/// Where a tile's rows are: row `ii` of `M` at `m + ii * stride` (of `E` at `e + ii *
/// stride` when fused), and the prefetch for its column `jj` at
/// `pf + ii * pf_stride + jj` (then `pf_e` floats further on for `E`). One base and a
/// stride, not a pointer a row: with a pointer a row (and one a row for the prefetches)
/// a 4-row tile ran out of general registers and reloaded them from the stack in its
/// loop.
#[derive(Clone, Copy)]
struct TileRows {
    m: *mut f32,
    e: *const f32,
    stride: usize,
    pf: *const f32,
    pf_stride: usize,
    pf_e: isize,
}

impl TileRows {
    /// Rows `i0..` of `a` (and of `E` with `fuse`), for a span from column `start`, `len`
    /// long, whose image to prefetch starts at element `base` of `M` (row `ii`'s
    /// prefetch for column `jj` of the span goes to `pf + ii * len + jj`). Formed with
    /// `wrapping_*`: a shifted row starts before its row, and prefetches may lie past the
    /// buffers.
    #[inline(always)]
    fn new(a: &Mat, i0: usize, fuse: bool, base: usize, start: usize, len: usize) -> TileRows {
        TileRows {
            m: a.m.wrapping_add(i0 * a.cols),
            e: if fuse {
                a.e.wrapping_add(i0 * a.cols).cast_const()
            } else {
                std::ptr::null()
            },
            stride: a.cols,
            pf: a.m.cast_const().wrapping_add(base).wrapping_sub(start),
            pf_stride: len,
            pf_e: (a.e as isize).wrapping_sub(a.m as isize) / 4,
        }
    }
}

/// One vector of every row of a tile, at column `jj`, into accumulator `u` (see
/// [`mq_span`](chunked::mq_span), whose guarantees it takes). `t` says where the rows are, `qv` points at
/// the packed `Q` vector of column `k0` for this vector of columns; with `sweep` (a
/// [`Hint`]'s value, not [`NO_SWEEP`]) the rows' image is prefetched by that hint, and
/// with [`NEAR`] each row's own line [`NEAR_FLOATS`] on ([`Ahead::Near`]). With
/// `EDGE`, only lanes `valid` of the rows are read, written and accumulated.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn mq_step<
    S: Simd,
    const RB: usize,
    const KT: usize,
    const U: usize,
    const FUSE: bool,
    const EDGE: bool,
>(
    sweep: u8,
    t: &TileRows,
    regs: &mut [[[S::V; U]; KT]; RB],
    jj: usize,
    u: usize,
    qv: *const f32,
    valid: (usize, usize),
) {
    let lanes = S::LANES;
    // SAFETY: as in `mq_span`: rows of the tile, the vector at jj inside the span (with
    // `EDGE`, only its lanes `valid` inside the row, the only ones read or written),
    // `qv` KT packed vectors; prefetch addresses are formed with `wrapping_*` and never
    // fault.
    unsafe {
        let mut x = [S::zero(); RB];
        for ii in 0..RB {
            if sweep == NEAR && (jj % SWEEP_STRIDE) < lanes {
                // The row's own line [`NEAR_FLOATS`] on (and `E`'s), into L1.
                let at = ii * t.stride + jj + NEAR_FLOATS;
                S::prefetch(t.m.wrapping_add(at).cast_const());
                if FUSE {
                    S::prefetch(t.e.wrapping_add(at));
                }
            } else if sweep != NO_SWEEP && (jj % SWEEP_STRIDE) < lanes {
                let at = t.pf.wrapping_add(ii * t.pf_stride + jj);
                if sweep == Hint::Nta as u8 {
                    S::prefetch_nta(at);
                } else {
                    S::prefetch_l2(at);
                }
                if FUSE {
                    S::prefetch_l2(at.wrapping_offset(t.pf_e));
                }
            }
            let at = ii * t.stride + jj;
            let mut v = load_edge::<S, EDGE>(t.m.wrapping_add(at), valid);
            if FUSE {
                v = S::add(v, load_edge::<S, EDGE>(t.e.wrapping_add(at), valid));
            }
            x[ii] = v;
        }
        // The stores after every load of the step: at widths of 1024 floats and
        // multiples, row ii + 1 lies a multiple of 4 KiB after row ii, and a load issued
        // after a store to the same address bits 0..11 waits for it.
        if FUSE {
            for ii in 0..RB {
                let at = t.m.wrapping_add(ii * t.stride + jj);
                if EDGE {
                    S::store_lanes(at, x[ii], valid.0, valid.1);
                } else {
                    S::store(at, x[ii]);
                }
            }
        }
        for k in 0..KT {
            let qk = S::load(qv.add(k * lanes));
            for ii in 0..RB {
                regs[ii][k][u] = if EDGE {
                    S::fma_lanes(x[ii], qk, regs[ii][k][u], valid.0, valid.1)
                } else {
                    S::fma(x[ii], qk, regs[ii][k][u])
                };
            }
        }
    }
}

/// A vector at `p`, or with `EDGE` only its lanes `valid` (the others zero).
///
/// # Safety
/// The lanes read lie inside one buffer; the instruction set is the caller's. (A
/// function, not a closure: closures do not take the caller's `target_feature`s, and
/// the intrinsics in one that is not inlined become calls.)
#[inline(always)]
unsafe fn load_edge<S: Simd, const EDGE: bool>(p: *const f32, valid: (usize, usize)) -> S::V {
    // SAFETY: forwarded caller guarantees.
    unsafe {
        if EDGE {
            S::load_lanes(p, valid.0, valid.1)
        } else {
            S::load(p)
        }
    }
}

/// Where a call's vectors of `M` lie against its rows. Rows whose first element is not
/// on a vector boundary (`LANES * 4` bytes) are read in whole aligned vectors ("physical"
/// vectors; an unaligned vector load costs two, in L2 on Intel up to 1.4x the time of a
/// whole kernel) when every row has the same alignment: the span loops then walk `M`
/// (and `E`) from `lanes - lead` floats before each row, the first vector's lanes before
/// the row and the last one's past it neither read, written nor accumulated, and `Q` is
/// packed to match (with zeros there). Lane `p` of vector `w` holds column
/// `w * lanes + p - (lanes - lead)`, so each lane gets the same columns in the same
/// order as lane `(p + lead) % lanes` of the vectors from the row's start (an edge
/// vector's other lanes are not accumulated, [`Simd::fma_lanes`]), in the
/// accumulator of vector `w` for `p >= lanes - lead` and of `w - 1` below. With one
/// accumulator a column that is the same accumulator; with two ([`tile`] has no more)
/// the lanes below `lanes - lead` of the two are swapped, which their sum does not see.
/// What is left is a rotation of the lanes, which [`Simd::reduce`] does not see either,
/// so [`mq_finish`](chunked::mq_finish) takes the accumulators as they are and the bits do not depend on
/// where `M` lies.
#[derive(Clone, Copy)]
struct Edges {
    /// Floats from a row's start to its first vector boundary, 0 when rows start on
    /// one (no edges: the vectors are the rows' own).
    lead: usize,
    /// The offset (from the shifted row start) of the last vector, which holds the
    /// row's last `lanes - lead` floats; unused when `lead` is 0.
    last: usize,
}

impl Edges {
    /// The lanes of the vector at offset `jj` inside the row, when it is an edge.
    #[inline(always)]
    fn at(self, jj: usize, lanes: usize) -> Option<(usize, usize)> {
        if self.lead == 0 {
            None
        } else if jj == 0 {
            Some((lanes - self.lead, lanes))
        } else if jj == self.last {
            Some((0, lanes - self.lead))
        } else {
            None
        }
    }
}

/// [`mq_hot`] with the sweep `sweep` ([`NO_SWEEP`], a [`Hint`]'s value or [`NEAR`]) as
/// its constant. (The sweep a constant of the loop: as a flag LLVM kept it, and a row
/// pointer, on the stack and tested it every step of the fused pass.)
///
/// # Safety
/// As [`mq_hot`].
#[inline(always)]
unsafe fn mq_hot_by<S: Simd, const RB: usize, const KT: usize, const U: usize, const FUSE: bool>(
    sweep: u8,
    t: &TileRows,
    regs: &mut [[[S::V; U]; KT]; RB],
    k0: usize,
    r: usize,
    range: Range<usize>,
    q: *const f32,
) {
    const L2: u8 = Hint::L2 as u8;
    const NTA: u8 = Hint::Nta as u8;
    // SAFETY: forwarded caller guarantees.
    unsafe {
        match sweep {
            NO_SWEEP => mq_hot::<S, RB, KT, U, FUSE, NO_SWEEP>(t, regs, k0, r, range, q),
            NEAR => mq_hot::<S, RB, KT, U, FUSE, NEAR>(t, regs, k0, r, range, q),
            // Only the plain pass sweeps with `prefetchnta` ([`sweep_hint`]).
            NTA if !FUSE => mq_hot::<S, RB, KT, U, FUSE, NTA>(t, regs, k0, r, range, q),
            _ => mq_hot::<S, RB, KT, U, FUSE, L2>(t, regs, k0, r, range, q),
        }
    }
}

/// The hot loop of [`mq_span`](chunked::mq_span): whole groups of `U` vectors `range` (none an edge) on
/// the accumulators `regs`, sweeping by `SWEEP` ([`mq_step`]).
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn mq_hot<
    S: Simd,
    const RB: usize,
    const KT: usize,
    const U: usize,
    const FUSE: bool,
    const SWEEP: u8,
>(
    t: &TileRows,
    regs: &mut [[[S::V; U]; KT]; RB],
    k0: usize,
    r: usize,
    range: Range<usize>,
    q: *const f32,
) {
    let lanes = S::LANES;
    // SAFETY: as in `mq_span`, whose guarantees the caller forwards; `range` is whole
    // groups of whole vectors inside the rows.
    unsafe {
        // `Q`'s vectors for columns k0.. of each vector of columns, `r` vectors apart.
        let qstep = r * lanes;
        let mut qv = q.add((range.start / lanes * r + k0) * lanes);
        let mut j = range.start;
        while j < range.end {
            for u in 0..U {
                mq_step::<S, RB, KT, U, FUSE, false>(
                    SWEEP,
                    t,
                    regs,
                    j + u * lanes,
                    u,
                    qv.add(u * qstep),
                    (0, lanes),
                );
            }
            j += U * lanes;
            qv = qv.add(U * qstep);
        }
    }
}

/// Vectors `range` of a tile's rows (a span's or a whole row's) one at a time (`range` starts at a multiple of
/// `U` vectors), each only in its lanes inside the row ([`Edges`]), on the accumulators
/// in registers: the first group of a row with edges, and what the whole groups leave.
/// (A function, not a closure: see [`load_edge`].)
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn mq_each<S: Simd, const RB: usize, const KT: usize, const U: usize, const FUSE: bool>(
    sweep: u8,
    t: &TileRows,
    regs: &mut [[[S::V; U]; KT]; RB],
    range: Range<usize>,
    q: *const f32,
    r: usize,
    k0: usize,
    edges: Edges,
) {
    let lanes = S::LANES;
    let mut j = range.start;
    // SAFETY: as in `mq_span` and `mq_whole`, whose guarantees the caller forwards.
    unsafe {
        while j < range.end {
            // `u` a constant in each unrolled step: the accumulators stay in registers.
            for u in 0..U {
                let jj = j + u * lanes;
                if jj < range.end {
                    let valid = edges.at(jj, lanes).unwrap_or((0, lanes));
                    let qv = q.add((jj / lanes * r + k0) * lanes);
                    mq_step::<S, RB, KT, U, FUSE, true>(sweep, t, regs, jj, u, qv, valid);
                }
            }
            j += U * lanes;
        }
    }
}

/// The end of one tile: its accumulators `regs` added (a fixed tree) and reduced, the
/// ragged columns past `vec_end` added one by one (fusing `M += E`), and `P` written;
/// the tile's rows are `i0 + ii * gap` (`gap` 1 but for groups of rows far apart).
#[inline(always)]
unsafe fn mq_finish_regs<
    S: Simd,
    const RB: usize,
    const KT: usize,
    const U: usize,
    const FUSE: bool,
>(
    a: &Mat,
    i0: usize,
    gap: usize,
    k0: usize,
    vec_end: usize,
    regs: &[[[S::V; U]; KT]; RB],
) {
    let cols = a.cols;
    // SAFETY: as in `mq_span` (the caller guarantees rows `i0 + ii * gap`, ii < RB,
    // inside 0..n); columns vec_end..cols are inside every row, and Q holds r columns of
    // `cols` floats.
    unsafe {
        let row = |ii: usize| a.m.add((i0 + ii * gap) * cols);
        let erow = |ii: usize| a.e.add((i0 + ii * gap) * cols);
        let qcol = |k: usize| a.q.add((k0 + k) * cols);
        // The accumulators of each (row, column) added (a fixed tree), then all of the
        // tile's reduced together (`Simd::reduce_into`: the same bits as one by one).
        let mut comb = [[S::zero(); KT]; RB];
        for (ii, c) in comb.iter_mut().enumerate() {
            for (k, ck) in c.iter_mut().enumerate() {
                let mut v = regs[ii][k];
                // Pairwise: (0 + U/2) (1 + U/2 + 1) ..., halving until one is left.
                let mut width = U;
                while width > 1 {
                    let half = width / 2;
                    for t in 0..half {
                        v[t] = S::add(v[t], v[t + half]);
                    }
                    width = half;
                }
                *ck = v[0];
            }
        }
        let mut out = [[0.0f32; KT]; RB];
        S::reduce_into(comb.as_flattened(), out.as_flattened_mut());
        for j in vec_end..cols {
            for (ii, o) in out.iter_mut().enumerate() {
                let mut v = *row(ii).add(j);
                if FUSE {
                    v += *erow(ii).add(j);
                    *row(ii).add(j) = v;
                }
                for (k, ok) in o.iter_mut().enumerate() {
                    *ok += v * *qcol(k).add(j);
                }
            }
        }
        for (ii, o) in out.iter().enumerate() {
            for (k, &ok) in o.iter().enumerate() {
                *a.p.add((k0 + k) * a.n + i0 + ii * gap) = ok;
            }
        }
    }
}

/// Whether a call reads its rows whole rather than in column chunks: its `Q` within
/// [`MQ_WHOLE_ROW_BYTES`] ([`MQ_WHOLE_ROW_BYTES_WIDE`] where L1 is [`l1_is_wide`]), or on
/// AMD Zen 5 and later ([`zen5_or_later`]) within [`MQ_WHOLE_ROW_BYTES_L2`] where a group
/// of rows read whole (`rows_whole`, [`group_rows`]) is at least 1.5 `r` rows: then
/// each vector of `Q` it reads from L2 serves `rows_whole` rows, and `Q` adds at most
/// two thirds of `M`'s traffic to L2's. And there with 16 `lanes` up to rank
/// [`MQ_WHOLE_FROM_MEMORY_RANK`] where `M` is larger than the last-level cache
/// ([`llc_bytes`]).
fn takes_whole_rows(a: &Mat, rows_whole: usize, lanes: usize) -> bool {
    let whole_max = if l1_is_wide() {
        MQ_WHOLE_ROW_BYTES_WIDE
    } else {
        MQ_WHOLE_ROW_BYTES
    };
    let q_bytes = a.r * a.cols * 4;
    q_bytes <= whole_max
        || (zen5_or_later()
            && q_bytes <= MQ_WHOLE_ROW_BYTES_L2
            && (2 * rows_whole >= 3 * a.r
                || (lanes >= 16
                    && a.r <= MQ_WHOLE_FROM_MEMORY_RANK
                    && a.n * a.cols * 4 > llc_bytes())))
}

/// The walks a core takes where the bits do not depend on them: each `P[i, k]` is
/// summed in the same order either way.
#[derive(Clone, Copy)]
struct Walk {
    /// Whole rows in cache go in groups whose rows lie far apart ([`spaces_rows`]).
    spaces: bool,
    /// Chunked calls that sweep, from rank [`MQ_TALL_MIN_RANK`] (not the fused pass
    /// with 8 lanes), take blocks of
    /// [`MQ_BLOCK_ROWS_ZEN5`] rows and sweep chunk by chunk ([`Ahead::Sweep`]) with
    /// chunks of [`MQ_CHUNK_BYTES_ZEN5`].
    tall: bool,
    /// Calls at low rank leave the rows to the hardware prefetchers (no sweep:
    /// [`sweep_min_bytes`](super::sweep_min_bytes) on AMD Zen 5 and later), and whole rows from memory (a call
    /// that streams [`SWEEP_MIN_BYTES`] or more) then prefetch each row's own stream a
    /// little ahead of its loads into L1 ([`Ahead::Near`], [`NEAR_FLOATS`]), the plain
    /// pass from [`MQ_NEAR_MIN_RANK`]. The hardware prefetchers alone leave a stream with
    /// the multiply-adds of `mq`'s tiles about serial (compute, then wait for memory;
    /// `bench lowrank --roofline`'s `plain` and `+pf` columns show the same of a plain
    /// loop). AMD EPYC (Zen 5, KVM), AVX-512, `bench lowrank` against the build before:
    /// `--roofline` `cold` (six alternated pairs) `mq` r = 2 / 4 1.20 / 1.39 (0.76 /
    /// 0.59 -> 0.92 / 0.83 of the read bandwidth), `mq+e` r = 1 / 2 / 4 1.26 / 1.27 /
    /// 1.22, from the LLC 0.94-1.05; `--quick` (eight pairs) `mq` r = 4 one thread 1.28
    /// (0.56-0.73 -> 0.74-0.94), two 1.08, r = 2 1.04 / 1.07; with AVX2 `mq+e` r = 1
    /// 1.07 from memory.
    near: bool,
}

impl Walk {
    /// This core's walks: all three on AMD Zen 5 and later ([`zen5_or_later`]).
    fn of_core() -> Walk {
        let zen5 = zen5_or_later();
        Walk {
            spaces: spaces_rows(),
            tall: zen5,
            near: zen5,
        }
    }
}

/// `P = M Q` (or with `FUSE`, `M += E; P = M Q`) for the given rows of one matrix, in
/// groups of `RB` rows (the widest tile's row count; leftover rows one at a time, summed
/// the same way), by the walks of `walk`.
#[inline(always)]
unsafe fn mq_rows_rb<S: Simd, const RB: usize, const FUSE: bool>(
    a: &Mat,
    rows: Range<usize>,
    whole: bool,
    walk: Walk,
) {
    let lanes = S::LANES;
    let vec_end = a.cols / lanes * lanes;
    // Whole aligned vectors when the rows are not on a vector boundary but all lie alike
    // ([`Edges`]): `ap` is `M` (and `E`) shifted back to the boundary before each row,
    // one vector a row more, the first and the last vectors edges.
    let lead = vector_lead::<S>(a, 0);
    let (ap, vec_end_p, edges) = if lead > 0 {
        let back = lanes - lead;
        let shifted = Mat {
            m: a.m.wrapping_sub(back),
            e: if a.e.is_null() {
                a.e
            } else {
                a.e.wrapping_sub(back)
            },
            ..*a
        };
        let last = vec_end;
        (shifted, vec_end + lanes, Edges { lead, last })
    } else {
        (*a, vec_end, Edges { lead: 0, last: 0 })
    };
    // Whole vectors per chunk: a multiple of 8 vectors (of every U), so that every chunk
    // boundary keeps vector v in accumulator v mod U.
    let step = 8 * lanes;
    let bytes = rows.len() * a.cols * 4;
    // Low ranks leave the rows to the hardware prefetchers where the core's keep up
    // ([`Walk::near`], as [`sweep_min_bytes`](super::sweep_min_bytes) says for this core).
    let sweep = bytes >= sweep_min_bytes_on(a.r, S::LANES, MQ_OWN_PREFETCH_RANK, walk.near);
    let hint = sweep_hint(a, FUSE);
    // Whole rows from memory that do not sweep ([`Walk::near`]), the plain pass from
    // [`MQ_NEAR_MIN_RANK`]; nothing otherwise.
    let idle = if walk.near
        && bytes >= SWEEP_MIN_BYTES
        && !sweep
        && whole
        && (FUSE || a.r >= MQ_NEAR_MIN_RANK)
    {
        Ahead::Near
    } else {
        Ahead::No
    };
    // Tall blocks swept chunk by chunk where the sweep runs ([`Walk::tall`]).
    let by_chunk = sweep && walk.tall && a.r >= MQ_TALL_MIN_RANK && (lanes >= 16 || !FUSE);
    let chunk_bytes = if by_chunk {
        MQ_CHUNK_BYTES_ZEN5
    } else {
        MQ_CHUNK_BYTES
    };
    let chunk = if whole {
        vec_end_p.max(step)
    } else {
        (chunk_bytes / 4 / a.r / step * step).max(step)
    };
    let chunked = chunk < vec_end_p;
    let chunks = chunk_count(vec_end_p, chunk, step);
    let per_group = group_vectors(lanes, a.r, RB);
    let per_row = group_vectors(lanes, a.r, 1);
    let block = match (chunked, by_chunk) {
        (true, true) => MQ_BLOCK_ROWS_ZEN5,
        (true, false) => MQ_BLOCK_ROWS,
        (false, _) => RB,
    };
    // SAFETY: S::zero has no preconditions beyond the instruction set, which the entry
    // point guarantees.
    let zero = unsafe { S::zero() };
    // Accumulators of a block between its chunks (whole rows keep theirs in registers).
    let mut acc = if chunked {
        vec![zero; (block / RB).max(1) * per_group.max(per_row)]
    } else {
        Vec::new()
    };
    // Q packed even at rank 1, where it is one contiguous column: the pack is 64-byte
    // aligned, and an unaligned vector load costs two.
    let mut pack = QPack::take(a.r * vec_end_p + 16);
    let q = {
        let dst = pack.aligned();
        // SAFETY: the pack holds r * vec_end_p floats from its aligned start.
        unsafe {
            if lead > 0 {
                pack_q_edges::<S>(a, lead, vec_end_p / lanes, dst)
            } else {
                pack_q::<S>(a, vec_end, dst)
            }
        };
        dst.cast_const()
    };
    // SAFETY: every group lies inside `rows` (inside 0..n, the caller; a spaced group's
    // rows `i0 + h + s * all`, h < all and s < RB, inside i0..i0 + all * RB); spans are whole
    // vectors inside 0..cols (of the shifted rows with edges, whose edge vectors touch
    // only their lanes inside the row) starting at multiples of 8 vectors; accumulator
    // slices lie inside `acc`; `q` is the packed Q.
    unsafe {
        let mut i0 = rows.start;
        while i0 < rows.end {
            let left = rows.end - i0;
            // Whole groups of RB rows, else single rows (the same sums).
            let (rb, groups) = if left >= RB {
                (RB, (left / RB).min((block / RB).max(1)))
            } else {
                (1, left.min(block))
            };
            // The sweep's distance in blocks (a division: once a block, not a span).
            let block_rows = groups * rb;
            let blocks = if sweep {
                MQ_AHEAD_BLOCKS.max(MQ_AHEAD_MIN_BYTES.div_ceil(block_rows * a.cols * 4))
            } else {
                0
            };
            // Whole rows in cache, on cores where rows near each other stream badly side
            // by side ([`spaces_rows`]): every whole group at once, a group's rows
            // `all` rows apart (group `h` takes rows `i0 + h + s * all`).
            let all = left / RB;
            let spaced = walk.spaces && RB > 1 && !chunked && !sweep && rb == RB;
            if !FUSE && !chunked && !sweep && rb == RB && a.r <= 2 {
                // Whole rows that do not sweep at ranks 1 and 2 (one column tile): every
                // whole group in one function ([`whole::WholeRun`]).
                mq_run_whole::<S, RB>(a, &ap, i0, all, spaced, vec_end_p, vec_end, q, idle, edges);
                i0 += all * RB;
                continue;
            }
            if spaced {
                // The fused pass (2 rows at r = 1 and 2 in cache, [`group_rows`]) and
                // r = 4 and 8, group by group. AVX-512, `M` in L2 (AMD
                // Zen 5, four alternated pairs): `mq+e` r = 4 / 8 1.19 / 1.26 (0.46-0.55
                // -> 0.52-0.71 of the in-core limit), `mq` 1.04 / 1.01.
                for h in 0..all {
                    let i = i0 + h;
                    mq_group_whole::<S, RB, FUSE>(
                        a, &ap, i, all, vec_end_p, vec_end, q, idle, edges,
                    )
                }
                i0 += all * RB;
                continue;
            }
            if !chunked {
                // Whole rows: each group from its first vector to `P` in registers.
                for g in 0..groups {
                    let i = i0 + g * rb;
                    let image = (i0 + blocks * block_rows) * a.cols + g * rb * vec_end_p;
                    let ahead = if sweep {
                        Ahead::Sweep(image, vec_end_p, hint)
                    } else {
                        idle
                    };
                    if rb == RB {
                        mq_group_whole::<S, RB, FUSE>(
                            a, &ap, i, 1, vec_end_p, vec_end, q, ahead, edges,
                        )
                    } else {
                        mq_group_whole::<S, 1, FUSE>(
                            a, &ap, i, 1, vec_end_p, vec_end, q, ahead, edges,
                        )
                    }
                }
                i0 += groups * rb;
                continue;
            }
            let per = if rb == RB { per_group } else { per_row };
            acc[..groups * per].fill(zero);
            let block = ChunkedBlock {
                a,
                ap: &ap,
                i0,
                groups,
                block_rows,
                blocks,
                vec_end_p,
                vec_end,
                chunk,
                chunks,
                by_chunk,
                sweep,
                hint,
                acc: acc.as_mut_ptr(),
                per,
                q,
                edges,
                isa: PhantomData::<S>,
            };
            if rb == RB {
                S::outlined(Chunked::<_, RB, FUSE>(block))
            } else {
                S::outlined(Chunked::<_, 1, FUSE>(block))
            }
            i0 += groups * rb;
        }
    }
}

/// Column chunks of `chunk` floats over rows of `len` floats (both whole vectors, `chunk`
/// a multiple of `step`): one a `chunk`, the last one taking what is left, and what is
/// left past the whole chunks only a chunk of its own when it is `step` floats or more.
/// Shorter, it is an edge vector (rows 16 bytes past a line, where the system allocator
/// puts large buffers, are one vector longer shifted back to a boundary, [`Edges`]): a
/// chunk of its own would be a walk over the block's rows for one vector, and its sweep
/// ahead (as long as the chunk) would leave the next block's first chunk unswept.
/// AMD EPYC (Zen 5, KVM), AVX-512, `mq` r = 8 (48-row blocks, 16 KiB chunks, 4096
/// columns: 8 chunks and the edge), one thread, cold after a 512 MiB write, a probe
/// alternating the two in one process (median of nine calls): 17.3 -> 18.4-18.7 and
/// 20.8-21.3 -> 22.5-24.0 GB/s (two processes each on each vCPU); after a 64 MiB write
/// 23.0-24.8 -> 26.4-26.5, where `M` on a line read 25.1-27.2. `--roofline` `cold`
/// (ten pairs AVX-512, eight AVX2): `mq` r = 8 1.07 / 1.08, `mq+e` r = 8 1.07 / 0.99.
fn chunk_count(len: usize, chunk: usize, step: usize) -> usize {
    let (whole, left) = (len / chunk, len % chunk);
    if whole > 0 && left < step {
        whole
    } else {
        whole + usize::from(left > 0)
    }
}

/// `P = M Q` (or with `FUSE`, `M += E; P = M Q`) for the given rows of one matrix.
///
/// Tiles (rows x columns of `P` x accumulators a column, [`tile`]): AVX-512 2 x 8 x 1,
/// 4 x 4 x 1, 4 x 2 x 2, 4 x 1 x 2; AVX2 and the fallback (at most 4 columns a tile, so
/// `r = 8` is two tiles over rows read again from L1) 2 x 4 x 1, 2 x 2 x 2, 4 x 1 x 2;
/// the rows a group reads at once may differ from the tile's ([`group_rows`]: AVX2 takes
/// 3 x 2 x 2 over whole rows). `Q` is packed (aligned, interleaved) on every call. With `M` in L2 (AMD Zen 4,
/// AVX-512, alternated runs), the previous kernel (4 to 8 rows a tile, one accumulator a
/// column, `Q` read in place at rank 1, 8 rows side by side at rank 2 with their
/// prefetches in the same L1 sets) reached 0.27-0.70 of the in-core limit for `mq` at
/// r = 1, 2, 4 and 0.66-0.70 at r = 8; this one 0.55-0.85 and 0.59-0.61. The fused
/// `add_mq` went from 0.36-0.38 to 0.66-0.74 at r = 2 but from 0.91-0.93 to 0.56-0.59 at
/// r = 1, and the AVX2 tiles at r = 8 lost to the previous 3 x 4 ones (0.39-0.42 against
/// 0.51-0.71): [`group_rows`] now takes one row for the fused pass at low rank and three
/// rows for AVX2 at r = 8.
///
/// From memory, a call that streams [`SWEEP_MIN_BYTES`] or more
/// sweeps the rows [`MQ_AHEAD_BLOCKS`] blocks ahead into L2 ([`Ahead::Sweep`]; on AMD
/// Zen 5 from r = 5 in tall blocks a chunk ahead, [`MQ_BLOCK_ROWS_ZEN5`], and with
/// `prefetchnta` where `M` is larger than the last-level cache, [`sweep_hint`]). Cold, n = m
/// = 4096, one thread, AMD Zen 4 (AVX-512), alternated runs against prefetches of the next
/// group's span into L1 (and none for whole rows): r = 1 0.69-0.98 → 0.86-0.92 of the read
/// bandwidth, r = 2 0.49-0.58 → 0.77-0.88, r = 4 0.50-0.56 → 0.63-0.84, r = 8 (where the
/// FMA units, not memory, set the pace) 0.48-0.51 → 0.49-0.66.
///
/// Rows that do not start on a vector boundary are read in aligned vectors ([`Edges`];
/// the same bits). On an Intel Xeon (Emerald Rapids class, KVM, two 512-bit FMA
/// pipes, 2 MiB L2), with `M` in L2 16 bytes past a line (glibc's placement of a large
/// block), against the aligned read stream (`bench lowrank --roofline`, three runs each
/// of the kernels before and after, alternated), `of limit` r = 1 / 2 / 4 / 8: AVX-512
/// `mq` 0.40-0.48 / 0.40-0.43 / 0.42 / 0.37-0.49 → 0.58 / 0.47-0.49 / 0.43-0.44 /
/// 0.41-0.46, `mq+e` 0.60-0.72 / 0.51-0.58 / 0.39-0.45 / 0.34-0.35 → 0.67-0.70 /
/// 0.64-0.80 / 0.62-0.77 / 0.35-0.39; AVX2 `mq` 0.39-0.42 / 0.32 / 0.45-0.54 /
/// 0.55-0.56 → 0.58-0.63 / 0.34-0.40 / 0.61 / 0.56-0.63, `mq+e` 0.45-0.46 / 0.43-0.49 /
/// 0.30-0.32 / 0.36-0.39 → 0.52-0.67 / 0.46-0.50 / 0.36-0.42 / 0.43-0.59. The kernel now
/// reads the same with `M` on a line (the `aligned` column), where before it lost up to
/// 40% (r = 1) to the placement.
#[inline(always)]
pub(crate) unsafe fn mq_rows<S: Simd, const FUSE: bool>(a: &Mat, rows: Range<usize>) {
    // SAFETY: forwarded caller guarantees.
    unsafe { mq_rows_as::<S, FUSE>(a, rows, Walk::of_core()) }
}

/// [`mq_rows`] by the walks of `walk`: the same bits with any.
#[inline(always)]
unsafe fn mq_rows_as<S: Simd, const FUSE: bool>(a: &Mat, rows: Range<usize>, walk: Walk) {
    let group = GroupOf {
        lanes: S::LANES,
        regs: S::REGS,
        r: a.r,
        fuse: FUSE,
        wide: l1_is_wide(),
        whole: true,
        zen5: zen5_or_later(),
        cached: rows.len() * a.cols * 4 < SWEEP_MIN_BYTES,
    };
    let whole = takes_whole_rows(a, group_rows(group), S::LANES);
    let rb = group_rows(GroupOf { whole, ..group });
    // SAFETY: forwarded caller guarantees.
    unsafe {
        // Only the groups that occur are compiled ([`group_occurs`]).
        match rb {
            4 if const { group_occurs(S::LANES, 4, FUSE) } => {
                mq_rows_rb::<S, 4, FUSE>(a, rows, whole, walk)
            }
            3 if const { group_occurs(S::LANES, 3, FUSE) } => {
                mq_rows_rb::<S, 3, FUSE>(a, rows, whole, walk)
            }
            2 if const { group_occurs(S::LANES, 2, FUSE) } => {
                mq_rows_rb::<S, 2, FUSE>(a, rows, whole, walk)
            }
            1 => mq_rows_rb::<S, 1, FUSE>(a, rows, whole, walk),
            _ => unreachable!("mq: no groups of {rb} rows"),
        }
    }
}

#[cfg(test)]
mod tests;

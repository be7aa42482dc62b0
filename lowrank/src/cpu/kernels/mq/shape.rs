//! The shapes of `mq`'s register tiles: how many columns of `P` a tile takes
//! ([`tile_width`]), its rows and accumulators a column ([`tile`]), the rows a group
//! reads at once ([`group_rows`]), and which of them a build compiles ([`tile_occurs`],
//! [`group_occurs`]). Constant functions only (and [`group_vectors`]): the walks that
//! use them are the parent module's.

/// The tile for a group of `kt` columns of `P` (8, 4, 2 or 1) on an instruction set of
/// `lanes` lanes: `(rows, accumulators per column)`. Accumulators `rows x kt x u` plus
/// the row vectors and the `Q` vectors fit the register file (32 vectors with AVX-512,
/// 16 otherwise), and `rows x kt x u >= 8` chains hide the FMA latency on cores that
/// issue two FMAs a cycle.
///
/// Tried and left (Intel Xeon, Emerald Rapids class, AVX-512, `M` in L2 16 bytes past a
/// line, alternated runs): 3 x 8 at r = 8 (11 loads for 24 multiply-adds where 2 x 8 has
/// 10 for 16). LLVM spilled a row's accumulators in the hot loop until the masked edge
/// passes ran in functions of their own; then 0.53-0.69 of the in-core limit against
/// 0.59-0.81 (median ratio of six pairs 0.89), from memory 1.07, and fused 0.47-0.52
/// against 0.58-0.61 (the call and the accumulators' round trip cost a 1024-float row a
/// tenth). Nor did a prefetch into L1 eight lines ahead in every row of a tile help
/// (r = 1 and 2 lost a tenth in L2; r = 4 and 8 the same within noise, in L2 and cold).
pub(super) const fn tile(lanes: usize, kt: usize) -> (usize, usize) {
    match (lanes, kt) {
        (16, 8) => (2, 1),
        (16, 4) => (4, 1),
        (16, 2) => (4, 2),
        (16, _) => (4, 2),
        (_, 4) => (2, 1),
        (_, 2) => (2, 2),
        _ => (4, 2),
    }
}

/// Rows a group reads side by side (every column tile of the group takes them): the
/// first column tile's ([`tile`]), but
/// - one for the fused pass when that tile is at most 2 columns wide (4 with 8 lanes):
///   at the row strides of most models (multiples of 4 KiB) a group's rows of `M` and
///   of `E` all fall in one L1 set, and with 4 rows they and `Q` overflow its 8 ways.
///   With `M` in L2, AMD Zen 4, alternated runs: r = 1 0.48-0.57 → 0.94-1.01 of the
///   in-core limit (AVX-512), 0.57-0.63 → 0.87-0.91 (AVX2); r = 2 88-94 → 81-105 GB/s
///   and 70-77 → 92-100; AVX2 r = 4 44-58 → 69-70;
/// - two for the fused pass when it is 4 columns wide with 16 lanes: its four rows of `M`
///   and four of `E` (the first tile's, [`tile`]) are eight streams through L1, and a
///   pass over two (eight independent chains still) keeps up better. With `M` in L2, AMD
///   Zen 4, AVX-512, r = 4, alternated runs: 0.47-0.48 → 0.49-0.51 of the in-core limit
///   (one row 0.55, but less from memory); cold, n = m = 4096, 0.66-0.71 → 0.73-0.79 of
///   the same traffic's stream loop;
/// - 3 from 8 columns with 8 lanes (two tiles of 4, 12 accumulators): AVX2 r = 8,
///   0.60-0.70 → 0.56-0.77 of the in-core limit for `mq`, 0.29-0.49 → 0.49-0.51 fused,
///   cold 0.50-0.65 → 0.64-0.68 of the read bandwidth.
///
/// - but two for that 4-column fused pass with 8 lanes where L1 has 12 ways or more
///   (`wide`, [`l1_is_wide`](super::l1_is_wide)): one row is four dependent chains of multiply-adds, and
///   two rows of `M` and two of `E` fit such a set beside `Q`. With `M` in L2, Intel Xeon
///   (Emerald Rapids class, 48 KiB 12-way L1), AVX2, r = 4, 10 alternated runs: 0.40-0.43
///   → 0.53-0.71 of the in-core limit, cold the same (median ratio 0.89 and 1.05 in two
///   sets of runs).
///
/// - 3 for the 2-column tile with 8 lanes over whole rows (`whole`: the call's `Q`
///   fits L1, [`takes_whole_rows`](super::takes_whole_rows)) where the register file holds 16 vectors (`regs`,
///   [`Simd::REGS`](crate::cpu::simd::Simd::REGS): AVX2, not the portable lanes), 12 accumulators: with 2 rows a step
///   loads a vector of `Q` for every 2 multiply-adds, with 3 for every 3. `M` in L2 16
///   bytes past a line (Intel Xeon, Emerald Rapids class, `--roofline --isa avx2`,
///   r = 2, 16 alternated pairs): median 0.53 → 0.70 of the in-core limit (median
///   ratio of pairs 1.16), from memory the same (0.99); in a harness (five alternated
///   pairs) r = 2 at 128 x 1024 and 32 x 4096 1.15-1.3, r = 3 at 128 x 1024 about 1.2.
///   In column chunks 3-row groups make 6-row blocks (8 with 2), and `Q`'s chunk serves
///   fewer rows: r = 2 at 16 x 8192 0.71-0.90, r = 3 at 32 x 4096 and 16 x 8192
///   0.75-0.85, so chunked calls keep 2. The portable lanes, whose registers hold half
///   as many vectors, read 0.77 of 2 rows in L2 and 0.80 from memory with 3, so they
///   keep 2 too.
///
/// - 3 for AVX-512's 8-column tile in column chunks on AMD Zen 5 and later (`zen5`,
///   [`zen5_or_later`](super::zen5_or_later)): 24 accumulators, 11 loads for 24
///   multiply-adds where 2 rows take 10 for 16. There, with the core busy at its
///   multiply-add rate, memory streams well only while the loads leave L1 room: in C
///   loops of this step (8 multiply-adds a vector of `M`, rows in L2 ahead by software
///   prefetch, AMD EPYC, KVM) 9 loads a vector of `M` (`Q` from L1) read 16-18 GB/s
///   from memory, with 4 of the 8 vectors of `Q` from registers 32-38 (a plain read
///   35-40), and 3 rows 21-27 against 2 rows' 16-21. In the kernel (`bench lowrank`,
///   alternated pairs): `--quick`, 4096 x 4096, r = 8 one thread 0.41-0.44 → 0.47-0.55
///   of the read bandwidth (median ratio 1.25), two threads 0.74-0.83 → 0.80-0.95
///   (1.09); `--roofline` from memory 1.28 and 1.10 (four pairs each), from the LLC
///   0.96 and 1.08. Not for whole rows (a call whose `Q` fits L1): there LLVM spilled
///   the third row's accumulators and `mq` r = 8 read half its in-L2 rate (as on the
///   Intel Xeons, the 3-row tile's note in [`tile`]).
///
/// - 2 for the fused pass at r = 1 and 2 over whole rows in cache (`cached`: the call
///   streams less than [`SWEEP_MIN_BYTES`](super::SWEEP_MIN_BYTES)) on AMD Zen 5
///   and later (`zen5`), where a group's rows lie far apart ([`spaces_rows`](super::spaces_rows)):
///   one row at a time is two chains of dependent multiply-adds as long as the row (64
///   deep at 1024 columns with 8 lanes), and two rows far apart do not share the L1 sets
///   of rows next to each other any more than one does. With `M` in L2 (AMD EPYC, KVM,
///   `--roofline`, three alternated pairs): AVX2 r = 1 / 2 1.37 / 1.29, AVX-512 1.09 /
///   1.11; from memory and the LLC two rows read 0.92-0.96 of one, so calls that stream
///   more keep one. Four rows: AVX2 r = 1 1.44, AVX-512 0.97.
///
/// Rows do not change how any `P[i, k]` is summed, so this choice keeps results
/// bit-identical.
pub(super) const fn group_rows(g: GroupOf) -> usize {
    let GroupOf {
        lanes,
        regs,
        r,
        fuse,
        wide,
        whole,
        zen5,
        cached,
    } = g;
    let kt = tile_width(lanes, r);
    let zen5_wide = zen5 && lanes == 16 && kt == 8 && regs >= 32 && !whole;
    if zen5 && fuse && whole && cached && kt <= 2 {
        2
    } else if zen5_wide || (lanes == 8 && r >= 8) {
        3
    } else if fuse && wide && lanes == 8 && kt == 4 {
        2
    } else if fuse && (kt <= 2 || (lanes == 8 && kt == 4)) {
        1
    } else if fuse && kt == 4 {
        2
    } else if lanes == 8 && kt == 2 && regs >= 16 && whole {
        3
    } else {
        tile(lanes, kt).0
    }
}

/// What [`group_rows`] chooses by: the instruction set's `lanes` and `regs`
/// ([`Simd::REGS`](crate::cpu::simd::Simd::REGS)), the rank `r`, whether the pass fuses `M += E`, whether L1 is
/// `wide` ([`l1_is_wide`](super::l1_is_wide)), whether the call reads `whole` rows
/// ([`takes_whole_rows`](super::takes_whole_rows)), whether the core is AMD's `zen5`
/// or later ([`zen5_or_later`](super::zen5_or_later)) and whether the call is `cached`
/// (streams less than [`SWEEP_MIN_BYTES`](super::SWEEP_MIN_BYTES) of `M`).
#[derive(Clone, Copy)]
pub(super) struct GroupOf {
    pub(super) lanes: usize,
    pub(super) regs: usize,
    pub(super) r: usize,
    pub(super) fuse: bool,
    pub(super) wide: bool,
    pub(super) whole: bool,
    pub(super) zen5: bool,
    pub(super) cached: bool,
}

/// Whether [`group_rows`] gives `rb` at rank `r` for some L1, register file, kind of
/// call and core (the union: the groups of rows a build may meet).
const fn takes_rows(lanes: usize, rb: usize, r: usize, fuse: bool) -> bool {
    let mut regs = 8;
    while regs <= 32 {
        let mut case = 0;
        while case < 16 {
            let (wide, whole, zen5, cached) =
                (case & 1 == 1, case & 2 == 2, case & 4 == 4, case & 8 == 8);
            let g = GroupOf {
                lanes,
                regs,
                r,
                fuse,
                wide,
                whole,
                zen5,
                cached,
            };
            if rb == group_rows(g) {
                return true;
            }
            case += 1;
        }
        regs *= 2;
    }
    false
}

/// Whether `mq_rows::<_, FUSE>` on `lanes` lanes ever runs a group of `rb` rows over a
/// column tile `kt` wide (with `fuse_span`, as the tile that fuses `M += E`, the first):
/// the groups and tiles that cannot meet are not compiled. (Every combination was, and
/// the kernels, each inlined whole into its instruction set's entry point, doubled the
/// crate's build time.) Groups of one row meet every tile (the rows a group leaves); the
/// tile sequence repeats from `r = 8` on (widest tiles, then what is left of `r mod 8`),
/// so ranks up to 32 cover them all; the groups of every L1, register file and kind of
/// call ([`takes_rows`]) are compiled.
pub(super) const fn tile_occurs(
    lanes: usize,
    rb: usize,
    kt: usize,
    fuse: bool,
    fuse_span: bool,
) -> bool {
    if fuse_span && !fuse {
        return false;
    }
    let mut r = 1;
    while r <= 32 {
        if rb == 1 || takes_rows(lanes, rb, r, fuse) {
            let mut k0 = 0;
            while k0 < r {
                let w = tile_width(lanes, r - k0);
                if w == kt && (k0 == 0 || !fuse_span) {
                    return true;
                }
                k0 += w;
            }
        }
        r += 1;
    }
    false
}

/// Whether `mq_rows::<_, FUSE>` on `lanes` lanes ever takes groups of `rb` rows.
pub(super) const fn group_occurs(lanes: usize, rb: usize, fuse: bool) -> bool {
    let mut r = 1;
    while r <= 32 {
        if rb == 1 || takes_rows(lanes, rb, r, fuse) {
            return true;
        }
        r += 1;
    }
    rb == 1
}

// At most two accumulators a column: [`Edges`](super::Edges) relies on it.
const _: () = {
    let mut kt = 1;
    while kt <= 8 {
        assert!(tile(16, kt).1 <= 2 && tile(8, kt).1 <= 2);
        kt *= 2;
    }
};

/// The widest column tile (8, 4, 2, 1; at most 4 with 8 lanes) that fits the `rem`
/// columns left.
pub(super) const fn tile_width(lanes: usize, rem: usize) -> usize {
    if rem >= 8 && lanes == 16 {
        8
    } else if rem >= 4 {
        4
    } else if rem >= 2 {
        2
    } else {
        1
    }
}

/// Accumulator vectors one group of `rb` rows needs across all its column tiles.
pub(super) fn group_vectors(lanes: usize, r: usize, rb: usize) -> usize {
    let mut k0 = 0;
    let mut n = 0;
    while k0 < r {
        let kt = tile_width(lanes, r - k0);
        n += rb * kt * tile(lanes, kt).1;
        k0 += kt;
    }
    n
}

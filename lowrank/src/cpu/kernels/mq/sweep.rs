//! How `mq`'s spans prefetch the rows they will read ([`Ahead`]), and with which
//! instruction ([`Hint`], [`sweep_hint`]).

use super::*;

/// What a span prefetches (only a group's first column tile; the others reread the span
/// from L1).
#[derive(Clone, Copy)]
pub(super) enum Ahead {
    /// Nothing.
    No,
    /// The span's image ahead, into L2. Element offset into `M` (and `E`) of the image of
    /// the span's first row, and the image's row stride. Two images:
    /// - [`MQ_AHEAD_BLOCKS`] row blocks ahead, the span's length the stride: a block's
    ///   tiles (group by group, span by span) map one to one onto the later block read
    ///   as one run, so the prefetches walk memory in order, as far ahead as the loads
    ///   consume;
    /// - on AMD Zen 5 and later, in chunked calls ([`MQ_BLOCK_ROWS_ZEN5`]), the same rows'
    ///   span one column chunk on (after a block's last chunk, the next block's first),
    ///   the row stride `M`'s: a block then need not fit in L2 twice over.
    ///
    /// The third field is `M`'s prefetch instruction ([`Hint`]).
    Sweep(usize, usize, Hint),
    /// Each row's own stream (and `E`'s, fused) [`NEAR_FLOATS`] ahead of its loads,
    /// into L1 (`prefetcht0`): for calls from memory that do not sweep, on AMD Zen 5
    /// and later ([`Walk::near`](super::Walk::near)).
    Near,
}

/// The prefetch instruction of a sweep of `M` ([`Ahead::Sweep`]; `E`'s is always
/// [`Hint::L2`]), which [`mq_hot`] takes as a constant.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Hint {
    /// `prefetcht1` ([`Simd::prefetch_l2`]).
    L2 = 1,
    /// `prefetchnta` ([`Simd::prefetch_nta`]): on AMD Zen 5 and later for the plain pass
    /// over an `M` larger than the last-level cache ([`sweep_hint`]).
    Nta = 2,
}

/// [`mq_hot`]'s constant for no sweep (the others are [`Hint`]'s values and [`NEAR`]).
pub(super) const NO_SWEEP: u8 = 0;
/// [`mq_hot`]'s constant for [`Ahead::Near`].
pub(super) const NEAR: u8 = 3;

impl Ahead {
    /// The sweep as [`mq_step`] takes it ([`NO_SWEEP`], a [`Hint`]'s value or
    /// [`NEAR`]), the image's base and its row stride (0 without an image).
    pub(super) fn parts(self) -> (u8, usize, usize) {
        match self {
            Ahead::No => (NO_SWEEP, 0, 0),
            Ahead::Sweep(base, len, hint) => (hint as u8, base, len),
            Ahead::Near => (NEAR, 0, 0),
        }
    }
}

/// The prefetch instruction of the sweeps of `M` for a call over `a`: `prefetchnta`
/// on AMD Zen 5 and later ([`zen5_or_later`]) for the plain pass (`fuse` false) over an
/// `M` larger than the last-level cache ([`llc_bytes`]), else `prefetcht1`.
///
/// AMD EPYC (Zen 5, KVM), `--roofline`, `cold` (4096 x 4096 after a 512 MiB write),
/// median ratio of alternated pairs, every `mq` sweep of `M` into L2 against
/// `prefetchnta`: AVX-512 (ten pairs) r = 8 1.15 (0.56-0.74 -> 0.68-0.75 of the read
/// bandwidth; r = 1-4 do not sweep there); AVX2 (eight pairs) r = 2 / 4 / 8 1.17 /
/// 1.06 / 1.29 (r = 8 0.44-0.66 -> 0.59-0.94). From the last-level cache (8 MiB) the
/// same change read 0.96-0.99, and the fused pass (its `M` so, its `E` into L2)
/// 0.96-1.06 from memory, so both keep `prefetcht1`. A probe of the kernel (r = 8, one
/// thread, 4096 x 4096, cold after a 512 MiB write, 16 bytes past a line, one process
/// each, three each) read 15.2-16.6 GB/s with `prefetcht1` and 19.2-21.9 with
/// `prefetchnta`. With this rule and [`chunk_count`]'s against the kernel before both
/// (`--roofline`, ten pairs AVX-512, eight AVX2): `cold` AVX-512 r = 8 1.17, AVX2 r = 2
/// / 4 / 8 1.10 / 1.24 / 1.29, `llc` 0.94-1.05; `bench lowrank --quick` (six pairs)
/// `mq` r = 8 one thread 1.23 (0.55-0.64 -> 0.64-0.75), two threads 1.00. (C loops
/// of the same walk had read alike at every hint in another session on this core;
/// the kernel did not.)
pub(super) fn sweep_hint(a: &Mat, fuse: bool) -> Hint {
    if !fuse && zen5_or_later() && a.n * a.cols * 4 > llc_bytes() {
        Hint::Nta
    } else {
        Hint::L2
    }
}

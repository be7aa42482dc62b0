//! `mtp`'s scratch `Q` ([`QScratch`]): where `Q` lies near `M` modulo 4 KiB, the call
//! writes a copy of `Q` placed away from `M` and copies it out.

use super::*;

/// Bytes within which `Q`'s offset from `M` modulo 4 KiB (either way) makes `mtp` store
/// `Q` into the L1 sets that its rows of `M` stream through ([`QScratch`]).
pub(super) const Q_NEAR_M_BYTES: usize = 256;
/// The lowest rank at which [`QScratch`] is taken with `lanes` lanes: 8 with 16, 4 with 8:
/// where a tile of `Q` is 8 columns wide (AVX-512 at r = 8) or 4 (AVX2 from
/// r = 4). The probe of [`QScratch`], alternating the scratch and `Q` in place on the
/// same buffers (`Q` 16 bytes past `M` modulo 4 KiB): AVX-512 r = 8 1.28 (16.7-16.9 ->
/// 21.4-21.6 GB/s), r = 1-7 0.97-1.03; AVX2 r = 4 1.31-1.34, r = 6 1.13, r = 7 1.10,
/// r = 8 1.14, r = 1-3 and 5 0.98-1.03.
const fn q_scratch_min_rank(lanes: usize) -> usize {
    if lanes >= 16 {
        8
    } else {
        4
    }
}
/// Rows of `M` a call needs per column of `Q` to take [`QScratch`]: its copy of `Q` (zeroed,
/// written, copied out) then costs at most about 5% of the traffic of `M`.
const Q_SCRATCH_MIN_ROWS_PER_RANK: usize = 64;

/// Whether `Q` at `q` lies within [`Q_NEAR_M_BYTES`] of `M` at `m` modulo 4 KiB.
pub(super) fn q_near_m(m: *const f32, q: *const f32) -> bool {
    let apart = (q as usize).wrapping_sub(m as usize) % 4096;
    !(Q_NEAR_M_BYTES..=4096 - Q_NEAR_M_BYTES).contains(&apart)
}

/// `Q` written through a scratch copy 2 KiB away from `M` modulo 4 KiB, for an `mtp` call
/// whose `Q` lies within [`Q_NEAR_M_BYTES`] of it, on AMD Zen 5 and later
/// ([`zen5_or_later`]) for calls from memory ([`SWEEP_MIN_BYTES`](super::super::SWEEP_MIN_BYTES)
/// or more). There each tile of `Q` shares its L1 sets with the lines of `M` that its
/// strip reads and has in flight (rows 4 KiB apart at power-of-two widths all fall in
/// the same sets), and its loads and stores miss. Two buffers from the system allocator
/// (`mmap`) both lie 16 bytes past a page, so that is the common case. AMD EPYC (Zen 5,
/// KVM), a probe of one thread (8192 x 4096 from memory, medians of 8 calls), `Q` moved
/// through 4 KiB against `M`, r = 8 (AVX-512): 16-19 GB/s from 128 bytes before `M` to
/// 224 bytes past it, 21-25 elsewhere; r = 4 23-24 against 25-26, with AVX2 18 against
/// 23-25; r = 1 and 2, `mq` and `pqt` the same wherever `Q` lies.
pub(super) struct QScratch {
    /// `a` with `q` in `buf`.
    pub(super) mat: Mat,
    /// Holds the scratch `Q` at `mat.q`.
    _buf: Vec<f32>,
}

impl QScratch {
    /// The scratch for the call `a` over `cols`, where it is wanted (see [`QScratch`]) and
    /// its allocation succeeds.
    pub(super) fn wanted(a: &Mat, cols: &Range<usize>, lanes: usize) -> Option<QScratch> {
        let from_memory = streams_from_memory(a, cols);
        let tall = a.n >= Q_SCRATCH_MIN_ROWS_PER_RANK * a.r;
        // Rows of `M` and of `Q` a multiple of 4 KiB long: one offset between them
        // throughout. Elsewhere it changes from row to row (and `Q`'s place mattered
        // less in the probe: width 768 1.00, 1000 0.95).
        let aligned = (a.cols * 4).is_multiple_of(4096);
        if a.r >= q_scratch_min_rank(lanes)
            && zen5_or_later()
            && from_memory
            && tall
            && aligned
            && q_near_m(a.m, a.q)
        {
            QScratch::new(a)
        } else {
            None
        }
    }

    /// A zeroed scratch `Q` for `a`, 2 KiB from `M` modulo 4 KiB; `None` where the
    /// allocation fails (the caller then writes `Q` in place).
    pub(super) fn new(a: &Mat) -> Option<QScratch> {
        // Room for `Q` and for the shift that places it.
        let len = a.r.checked_mul(a.cols)?.checked_add(1024)?;
        let mut buf: Vec<f32> = Vec::new();
        buf.try_reserve_exact(len).ok()?;
        // Zeroed, so that every float a vector load of a part (whose other lanes belong
        // to no strip of this call) reads is initialised.
        buf.resize(len, 0.0);
        let at = buf.as_mut_ptr() as usize;
        let shift = ((a.m as usize).wrapping_add(2048).wrapping_sub(at) % 4096) / 4;
        Some(QScratch {
            // `shift` < 1024, so `shift + r * cols` floats lie inside `buf`.
            mat: Mat {
                q: buf.as_mut_ptr().wrapping_add(shift),
                ..*a
            },
            _buf: buf,
        })
    }

    /// The scratch's columns `cols` copied to `a`'s `Q`.
    ///
    /// # Safety
    /// `cols` lies inside `a`'s columns, and this call owns those columns of `Q`.
    pub(super) unsafe fn copy_to(&self, a: &Mat, cols: Range<usize>) {
        for k in 0..a.r {
            let at = k * a.cols + cols.start;
            // SAFETY: row k's columns `cols` lie inside both `Q`s (the scratch holds
            // `r * cols` floats from `mat.q`), which do not overlap; no other call
            // touches these columns of `a.q`.
            unsafe { std::ptr::copy_nonoverlapping(self.mat.q.add(at), a.q.add(at), cols.len()) };
        }
    }
}

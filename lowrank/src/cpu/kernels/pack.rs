//! `Q` packed for the kernels that read it across rows (`mq`, `pqt`, the `mtp` stream):
//! its vectors interleaved and 64-byte aligned in a buffer each thread keeps between
//! calls.

use super::Mat;
use crate::cpu::simd::Simd;

thread_local! {
    /// Each thread's buffer for the packed `Q`, kept between calls: a fresh one of
    /// 128 KiB or more would come from `mmap` and fault in zeroed pages on every call.
    static QPACK: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// A thread's `Q` pack buffer, taken for one call and given back when dropped.
pub(super) struct QPack(Vec<f32>);

impl QPack {
    /// At least `len` floats, 16 of them slack for alignment.
    pub(super) fn take(len: usize) -> Self {
        let mut buffer = QPACK.with(|p| p.take());
        if buffer.len() < len {
            buffer = vec![0.0; len];
        }
        QPack(buffer)
    }

    /// The first 64-byte aligned element.
    pub(super) fn aligned(&mut self) -> *mut f32 {
        let p = self.0.as_mut_ptr();
        p.wrapping_add(p.align_offset(64).min(15))
    }
}

impl Drop for QPack {
    fn drop(&mut self) {
        let buffer = std::mem::take(&mut self.0);
        QPACK.with(|p| p.set(buffer));
    }
}

/// Copies `Q`'s whole vectors into `dst` interleaved: for each vector of columns, the `r`
/// vectors one after the other, so that a chunk of columns is one contiguous run. Read in
/// place, `Q`'s columns lie `cols` floats apart, and at the power-of-two widths of most
/// models all of them map to the same L1 sets.
#[inline(always)]
pub(super) unsafe fn pack_q<S: Simd>(a: &Mat, vec_end: usize, dst: *mut f32) {
    // SAFETY: forwarded caller guarantees.
    unsafe { pack_q_from::<S>(a, 0, vec_end / S::LANES, dst) }
}

/// [`pack_q`] for the `nvec` vectors of columns from `c0`.
#[inline(always)]
pub(super) unsafe fn pack_q_from<S: Simd>(a: &Mat, c0: usize, nvec: usize, dst: *mut f32) {
    let lanes = S::LANES;
    // SAFETY: Q holds r columns of `cols` floats, c0 + nvec * lanes of them at most (the
    // caller); `dst` holds r * nvec vectors.
    unsafe {
        for v in 0..nvec {
            for k in 0..a.r {
                let src = a.q.add(k * a.cols + c0 + v * lanes);
                S::store(dst.add((v * a.r + k) * lanes), S::load(src));
            }
        }
    }
}

/// [`pack_q`] for vectors that start `lanes - lead` columns before each row (`mq::Edges`):
/// `nvec` vectors, the first one's `back` lanes before column 0 and the last one's `lead`
/// lanes past the last column zero.
#[inline(always)]
pub(super) unsafe fn pack_q_edges<S: Simd>(a: &Mat, lead: usize, nvec: usize, dst: *mut f32) {
    let lanes = S::LANES;
    let back = lanes - lead;
    // SAFETY: Q holds r columns of `cols` floats; vector v covers columns
    // v * lanes - back .. (v + 1) * lanes - back, of which only those inside 0..cols
    // are read (the first and the last vectors through `load_lanes`); `dst` holds
    // r * nvec vectors.
    unsafe {
        for v in 0..nvec {
            for k in 0..a.r {
                let src = a.q.wrapping_add(k * a.cols + v * lanes).wrapping_sub(back);
                let x = if v == 0 {
                    S::load_lanes(src, back, lanes)
                } else if v + 1 == nvec {
                    S::load_lanes(src, 0, back)
                } else {
                    S::load(src)
                };
                S::store(dst.add((v * a.r + k) * lanes), x);
            }
        }
    }
}

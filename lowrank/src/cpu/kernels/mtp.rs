//! `Q = Mᵀ P`: column panels whose accumulators stay in L2, each row adding its part.

use super::{Mat, PREFETCH};
use crate::cpu::simd::Simd;
use std::ops::Range;

/// Adds `Mᵀ P` of rows `i0..i0+RB` to a column panel of `Q`.
///
/// `acc` is the panel's part of `Q` in a chunk-interleaved layout (for each vector-wide
/// chunk of columns, the `r` vectors one after the other), so one pointer with constant
/// offsets reaches every accumulator; `tile` is `P` of these rows, row-major (`RB x r`),
/// for the same reason. `RC` is the rank when it is a small constant (the loop over it
/// unrolls), or 0 for a rank known at run time.
#[inline(always)]
unsafe fn mtp_block<S: Simd, const RB: usize, const RC: usize>(
    a: &Mat,
    i0: usize,
    panel: &Range<usize>,
    acc: *mut f32,
    tile: *const f32,
) {
    let lanes = S::LANES;
    let r = if RC == 0 { a.r } else { RC };
    // SAFETY: the caller guarantees rows i0..i0+RB < n, `panel` inside 0..a.cols, `acc`
    // valid for r * panel.len() (rounded up to lanes) elements and `tile` for RB * r.
    unsafe {
        let row = |ii: usize| a.m.add((i0 + ii) * a.cols);
        let mut j = panel.start;
        let mut dst = acc;
        while j + lanes <= panel.end {
            // Prefetch PREFETCH floats ahead in the order the rows are read: along these
            // rows, then on into the next block's rows of the same panel. A block reads
            // RB rows side by side, more streams than the hardware prefetchers keep far
            // enough ahead (cold, n = m = 4096, one thread, AVX-512 machine: r = 8 went
            // from 0.79-0.83 to 0.90-0.91 of the read reference with this prefetch).
            let ahead = j + PREFETCH;
            let (base, at) = if ahead < panel.end {
                (i0, ahead)
            } else {
                (i0 + RB, panel.start + (ahead - panel.end))
            };
            let mut x = [S::zero(); RB];
            for (ii, xi) in x.iter_mut().enumerate() {
                S::prefetch(a.m.wrapping_add((base + ii) * a.cols + at));
                *xi = S::load(row(ii).add(j));
            }
            for k in 0..r {
                let d = dst.add(k * lanes);
                let mut sum = S::load(d);
                for (ii, &xi) in x.iter().enumerate() {
                    sum = S::fma(S::splat(*tile.add(ii * r + k)), xi, sum);
                }
                S::store(d, sum);
            }
            dst = dst.add(r * lanes);
            j += lanes;
        }
        // The ragged end of the panel: scalar, in the same interleaved layout.
        let rest = panel.end - j;
        for t in 0..rest {
            for k in 0..r {
                let d = dst.add(k * lanes + t);
                for ii in 0..RB {
                    *d += *tile.add(ii * r + k) * *row(ii).add(j + t);
                }
            }
        }
    }
}

/// Columns of `M` per panel: the panel's accumulators (`r x width` floats) stay within
/// 128 KiB, in L2 (even a 256 KiB one), while each row is read in runs of at least
/// 16 KiB: whole rows of 4096 columns at `r = 8`. Cold, n = m = 4096, one thread, `r = 8`,
/// AVX-512 machine, alternated runs: 64 KiB panels (rows read in two halves) 0.86-0.90
/// of the read reference for both instruction sets, 128 KiB 0.95-0.97 (256 KiB the same,
/// 32 and 16 KiB 0.78-0.85 and 0.66-0.72); other ranks unchanged.
const MTP_PANEL_FLOATS: usize = 32768;

#[inline(always)]
unsafe fn mtp_cols_rc<S: Simd, const RC: usize>(a: &Mat, cols: Range<usize>) {
    const RB: usize = 8;
    let lanes = S::LANES;
    let r = a.r;
    let width = (MTP_PANEL_FLOATS / r).max(lanes) / lanes * lanes;
    let mut acc = vec![0.0f32; r * width.min(cols.len()).next_multiple_of(lanes)];
    let mut tile = [0.0f32; 16 * crate::MAX_RANK];
    let mut c0 = cols.start;
    while c0 < cols.end {
        let panel = c0..(c0 + width).min(cols.end);
        acc.fill(0.0);
        let mut i = 0;
        // SAFETY: rows stay inside 0..n, columns inside `panel` inside `cols`; `acc`
        // holds r floats per panel column rounded up to whole chunks; `tile` 16 * r (the largest block).
        unsafe {
            let load_tile = |tile: &mut [f32], i: usize, rows: usize| {
                for ii in 0..rows {
                    for k in 0..r {
                        tile[ii * r + k] = *a.p.add(k * a.n + i + ii);
                    }
                }
            };
            macro_rules! blocks {
                ($rb:expr) => {
                    while i + $rb <= a.n {
                        load_tile(&mut tile, i, $rb);
                        mtp_block::<S, { $rb }, RC>(a, i, &panel, acc.as_mut_ptr(), tile.as_ptr());
                        i += $rb;
                    }
                };
            }
            if S::LANES == 16 && r >= 8 {
                blocks!(16);
            }
            blocks!(RB);
            while i < a.n {
                load_tile(&mut tile, i, 1);
                mtp_block::<S, 1, RC>(a, i, &panel, acc.as_mut_ptr(), tile.as_ptr());
                i += 1;
            }
            // Scatter the interleaved accumulators into Q's column-major layout.
            for (c, j) in panel.clone().enumerate() {
                let (chunk, lane) = (c / lanes, c % lanes);
                for k in 0..r {
                    *a.q.add(k * a.cols + j) = acc[(chunk * r + k) * lanes + lane];
                }
            }
        }
        c0 = panel.end;
    }
}

/// `Q[cols] = (Mᵀ P)[cols]` for one matrix: every row of `M`, the given columns, one
/// column panel at a time.
#[inline(always)]
pub(crate) unsafe fn mtp_cols<S: Simd>(a: &Mat, cols: Range<usize>) {
    // SAFETY: `cols` is inside 0..a.cols and `q` holds r columns of a.cols (caller).
    unsafe {
        match a.r {
            1 => mtp_cols_rc::<S, 1>(a, cols),
            2 => mtp_cols_rc::<S, 2>(a, cols),
            4 => mtp_cols_rc::<S, 4>(a, cols),
            8 => mtp_cols_rc::<S, 8>(a, cols),
            _ => mtp_cols_rc::<S, 0>(a, cols),
        }
    }
}

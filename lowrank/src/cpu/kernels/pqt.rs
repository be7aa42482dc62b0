//! `M = P Qᵀ`, optionally fused with `E = X - M` (`X` read from `M`).

use super::{Mat, PREFETCH};
use crate::cpu::simd::Simd;
use std::ops::Range;

// Register tiles read best with explicit indices.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn pqt_block<S: Simd, const RB: usize, const RC: usize, const FUSE: bool>(
    a: &Mat,
    i0: usize,
) {
    let lanes = S::LANES;
    let cols = a.cols;
    let r = if RC == 0 { a.r } else { RC };
    // SAFETY: the caller guarantees rows i0..i0+RB < n.
    unsafe {
        let row = |ii: usize| a.m.add((i0 + ii) * cols);
        let erow = |ii: usize| a.e.add((i0 + ii) * cols);
        let pval = |k: usize, ii: usize| *a.p.add(k * a.n + i0 + ii);
        let qcol = |k: usize| a.q.add(k * cols);
        // With a constant rank, a local copy of this block's P values: the compiler knows
        // nothing writes to it, so it keeps the broadcasts in registers across the row
        // (it cannot for `a.p`, which might alias `a.m`).
        let mut local = [[0.0f32; 8]; RB];
        if RC != 0 {
            for (ii, l) in local.iter_mut().enumerate() {
                for (k, v) in l.iter_mut().enumerate().take(RC) {
                    *v = pval(k, ii);
                }
            }
        }
        let mut j = 0;
        while j + lanes <= cols {
            let mut acc = [S::zero(); RB];
            for k in 0..r {
                let qv = S::load(qcol(k).add(j));
                for (ii, acc_i) in acc.iter_mut().enumerate() {
                    let pk = if RC != 0 { local[ii][k] } else { pval(k, ii) };
                    *acc_i = S::fma(S::splat(pk), qv, *acc_i);
                }
            }
            for (ii, &acc_i) in acc.iter().enumerate() {
                let dst = row(ii).add(j);
                if FUSE {
                    S::prefetch(dst.wrapping_add(PREFETCH));
                    let x = S::load(dst);
                    S::store(erow(ii).add(j), S::sub(x, acc_i));
                }
                S::store(dst, acc_i);
            }
            j += lanes;
        }
        while j < cols {
            for ii in 0..RB {
                let mut s = 0.0f32;
                for k in 0..r {
                    s += pval(k, ii) * *qcol(k).add(j);
                }
                let dst = row(ii).add(j);
                if FUSE {
                    *erow(ii).add(j) = *dst - s;
                }
                *dst = s;
            }
            j += 1;
        }
    }
}

#[inline(always)]
unsafe fn pqt_rows_rc<S: Simd, const RC: usize, const FUSE: bool>(a: &Mat, rows: Range<usize>) {
    const RB: usize = 4;
    let mut i = rows.start;
    // SAFETY: blocks stay inside `rows`, inside 0..n.
    unsafe {
        while i + RB <= rows.end {
            pqt_block::<S, RB, RC, FUSE>(a, i);
            i += RB;
        }
        while i < rows.end {
            pqt_block::<S, 1, RC, FUSE>(a, i);
            i += 1;
        }
    }
}

/// `M[rows] = (P Qᵀ)[rows]`; with `FUSE`, also `E[rows] = X[rows] - M[rows]` where `X`
/// is what `M` held before.
#[inline(always)]
pub(crate) unsafe fn pqt_rows<S: Simd, const FUSE: bool>(a: &Mat, rows: Range<usize>) {
    // SAFETY: forwarded caller guarantees.
    unsafe {
        match a.r {
            1 => pqt_rows_rc::<S, 1, FUSE>(a, rows),
            2 => pqt_rows_rc::<S, 2, FUSE>(a, rows),
            4 => pqt_rows_rc::<S, 4, FUSE>(a, rows),
            8 => pqt_rows_rc::<S, 8, FUSE>(a, rows),
            _ => pqt_rows_rc::<S, 0, FUSE>(a, rows),
        }
    }
}

//! Gram-Schmidt: orthonormalising the columns of a factor in place, rescaled where sums
//! of squares would underflow.

use super::vector::{dot, scale, sub_scaled};
use crate::cpu::simd::Simd;

/// Sums of squares below this are recomputed on a rescaled column: their smallest
/// squares may have underflowed (`2^-60`, far above where underflow loses bits that
/// matter at f32 precision).
const TINY_SUM_OF_SQUARES: f32 = 8.673_617e-19;

/// The power of two that brings `amax` (finite, non-zero) into `[0.5, 1)`, as two factors
/// whose product it is (one factor alone overflows `f32` for subnormal `amax`). Scaling by
/// a power of two is exact, so it changes no normalised result.
fn pow2_scale(amax: f32) -> (f32, f32) {
    // amax = 2^e · f with f in [0.5, 1) for e = exponent + 1; the factor is 2^-e.
    let exp = (amax.to_bits() >> 23) as i32; // biased; 0 for subnormals
    let e = if exp == 0 {
        // Subnormal: 2^-149 · mantissa, with the mantissa's bit length.
        let mant = amax.to_bits() & 0x7f_ffff;
        (32 - mant.leading_zeros()) as i32 - 149
    } else {
        exp - 126
    };
    let half = -e / 2;
    let rest = -e - half;
    (2f32.powi(half), 2f32.powi(rest))
}

/// One modified Gram-Schmidt pass over the `r` columns at `x`. Column `k` is divided by
/// `‖c_k‖`, or set to zero when `prior[k] · ‖c_k‖ / ‖c_k‖_before ≤ tol` (its
/// relative residual over both passes; `‖c_k‖_before` is its norm at the start of the
/// pass). Returns each column's norm when normalised and its relative residual (both 0
/// for a zeroed column).
///
/// # Safety
/// `x` is valid for `r * n` elements and `r <= MAX_RANK`.
#[inline(always)]
unsafe fn mgs_pass<S: Simd>(
    x: *mut f32,
    n: usize,
    r: usize,
    prior: &[f32; crate::MAX_RANK],
    tol: f32,
) -> ([f32; crate::MAX_RANK], [f32; crate::MAX_RANK]) {
    let mut norms = [0.0f32; crate::MAX_RANK];
    let mut ratios = [0.0f32; crate::MAX_RANK];
    // SAFETY: x is valid for r * n elements (caller).
    unsafe {
        let col = |k: usize| x.add(k * n);
        let mut before = [0.0f32; crate::MAX_RANK];
        for (k, b) in before.iter_mut().enumerate().take(r) {
            *b = dot::<S>(col(k), col(k), n).sqrt();
        }
        for (i, &norm_before) in before.iter().enumerate().take(r) {
            let c = col(i);
            let norm = dot::<S>(c, c, n).sqrt();
            let ratio = if norm_before > 0.0 {
                norm / norm_before
            } else {
                0.0
            };
            if norm == 0.0 || prior[i] * ratio <= tol || !norm.is_finite() {
                std::ptr::write_bytes(c, 0, n);
                continue;
            }
            norms[i] = norm;
            ratios[i] = ratio;
            scale::<S>(c, 1.0 / norm, n);
            for j in i + 1..r {
                let d = dot::<S>(c, col(j), n);
                sub_scaled::<S>(col(j), d, c, n);
            }
        }
    }
    (norms, ratios)
}

/// Gram-Schmidt on the `r` contiguous columns of `n` elements at `x`, with the rules of
/// [`crate::Backend::orthogonalize`]:
///
/// 1. A column whose sum of squares is not finite, or so small that its squares may have
///    underflowed, is checked element by element: any NaN or infinity makes every column
///    of the matrix NaN (non-finite input propagates, so a loss scaler sees it); otherwise
///    the column is scaled by a power of two into `[0.5, 1)` (exact), so norms neither
///    overflow nor underflow, and `eps` is scaled with it.
/// 2. Modified Gram-Schmidt, each column normalised to unit length (an exactly zero column
///    stays zero).
/// 3. A second pass ("twice is enough") re-orthogonalises to working precision; a column
///    whose residual over both passes is at most `tol` of its norm is set to zero.
/// 4. With `eps > 0`, column `c` is scaled by `‖c‖ / (‖c‖ + eps)` (its norm as projected
///    in step 2), so the result is PyTorch's `c / (‖c‖ + eps)` made orthogonal.
///
/// # Safety
/// `x` is valid for `r * n` elements and `r <= MAX_RANK`.
#[inline(always)]
pub(crate) unsafe fn gram_schmidt<S: Simd>(x: *mut f32, n: usize, r: usize, eps: f32) {
    let tol = crate::dims::zero_column_tolerance(n);
    let mut eps_k = [eps; crate::MAX_RANK];
    // SAFETY: x is valid for r * n elements (caller); every column pointer is in range.
    unsafe {
        let col = |k: usize| x.add(k * n);
        for (k, eps_k) in eps_k.iter_mut().enumerate().take(r) {
            let c = col(k);
            let ss = dot::<S>(c, c, n);
            if ss.is_finite() && ss >= TINY_SUM_OF_SQUARES {
                continue;
            }
            let column = std::slice::from_raw_parts(c, n);
            if column.iter().any(|v| !v.is_finite()) {
                std::slice::from_raw_parts_mut(x, r * n).fill(f32::NAN);
                return;
            }
            let amax = column.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            if amax == 0.0 {
                continue;
            }
            let (s1, s2) = pow2_scale(amax);
            scale::<S>(c, s1, n);
            scale::<S>(c, s2, n);
            *eps_k = ((*eps_k as f64) * (s1 as f64) * (s2 as f64)).min(f32::MAX as f64) as f32;
        }
        let ones = [1.0; crate::MAX_RANK];
        // Both passes normalise to unit length (a column shrunk by a large `eps` would
        // underflow in the second pass); `eps`'s shrinking is applied at the end.
        let (norms, ratios) = mgs_pass::<S>(x, n, r, &ones, 0.0);
        let mut lengths = [0.0f32; crate::MAX_RANK];
        for k in 0..r {
            lengths[k] = if norms[k] == 0.0 {
                0.0
            } else {
                norms[k] / (norms[k] + eps_k[k])
            };
        }
        mgs_pass::<S>(x, n, r, &ratios, tol);
        if eps != 0.0 {
            for (k, &len) in lengths.iter().enumerate().take(r) {
                if len != 1.0 {
                    scale::<S>(col(k), len, n);
                }
            }
        }
    }
}

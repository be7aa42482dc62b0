//! The vector helpers of [`super::gram_schmidt`](mod@super::gram_schmidt): dot product, `y -= αx`, `x *= α`.

use crate::cpu::simd::Simd;

#[inline(always)]
pub(super) unsafe fn dot<S: Simd>(x: *const f32, y: *const f32, n: usize) -> f32 {
    let lanes = S::LANES;
    // SAFETY: x and y are valid for n elements (caller).
    unsafe {
        let mut acc = [S::zero(); 4];
        let mut j = 0;
        while j + 4 * lanes <= n {
            for (u, a) in acc.iter_mut().enumerate() {
                let o = j + u * lanes;
                *a = S::fma(S::load(x.add(o)), S::load(y.add(o)), *a);
            }
            j += 4 * lanes;
        }
        while j + lanes <= n {
            acc[0] = S::fma(S::load(x.add(j)), S::load(y.add(j)), acc[0]);
            j += lanes;
        }
        let mut s = S::reduce(S::add(S::add(acc[0], acc[1]), S::add(acc[2], acc[3])));
        while j < n {
            s += *x.add(j) * *y.add(j);
            j += 1;
        }
        s
    }
}

/// `y -= alpha * x`.
#[inline(always)]
pub(super) unsafe fn sub_scaled<S: Simd>(y: *mut f32, alpha: f32, x: *const f32, n: usize) {
    let lanes = S::LANES;
    // SAFETY: x and y are valid for n elements (caller).
    unsafe {
        let na = S::splat(-alpha);
        let mut j = 0;
        while j + lanes <= n {
            S::store(y.add(j), S::fma(na, S::load(x.add(j)), S::load(y.add(j))));
            j += lanes;
        }
        while j < n {
            *y.add(j) -= alpha * *x.add(j);
            j += 1;
        }
    }
}

#[inline(always)]
pub(super) unsafe fn scale<S: Simd>(x: *mut f32, alpha: f32, n: usize) {
    let lanes = S::LANES;
    // SAFETY: x is valid for n elements (caller).
    unsafe {
        let a = S::splat(alpha);
        let mut j = 0;
        while j + lanes <= n {
            S::store(x.add(j), S::mul(a, S::load(x.add(j))));
            j += lanes;
        }
        while j < n {
            *x.add(j) *= alpha;
            j += 1;
        }
    }
}

//! The explicit-vector instances of the rounding loops (AVX2, F16C, AVX-512F), each
//! compiled with its features and called by [`super`]'s dispatch only when
//! [`super::level`] (hence the CPU) has them.

use super::{bf16_in_place, round_bf16, two_ranks_bf16, two_ranks_with};
use half::f16;

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(super) fn bf16_avx2(v: &mut [f32]) {
    bf16_in_place(v)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
pub(super) fn f16_f16c(v: &mut [f32]) {
    use std::arch::x86_64::{_mm256_cvtph_ps, _mm256_cvtps_ph, _mm256_loadu_ps, _mm256_storeu_ps};
    let mut chunks = v.chunks_exact_mut(8);
    for c in &mut chunks {
        // SAFETY: `c` holds exactly 8 f32s, what an unaligned 256-bit load and store
        // touch; rounding mode 0 is round to nearest even, as `half` converts.
        unsafe {
            let x = _mm256_loadu_ps(c.as_ptr());
            let h = _mm256_cvtps_ph::<0>(x);
            _mm256_storeu_ps(c.as_mut_ptr(), _mm256_cvtph_ps(h));
        }
    }
    chunks
        .into_remainder()
        .iter_mut()
        .for_each(|x| *x = f16::from_f32(*x).to_f32());
}

/// The exact element loop of [`two_ranks_bf16`] for a sum (`scale` 1) or a mean
/// (`scale` 0.5: the same bits as dividing by 2), for the vectors that hold a NaN.
#[inline(always)]
fn sum_bf16_exact(a: &mut [f32], b: &mut [f32], scale: f32) {
    for (x, y) in a.iter_mut().zip(b.iter_mut()) {
        let r = round_bf16((round_bf16(*x) + round_bf16(*y)) * scale);
        *x = r;
        *y = r;
    }
}

/// `scale` of a sum or a mean; `None` for the operators without a fast path.
fn sum_scale(op: crate::ReduceOp) -> Option<f32> {
    match op {
        crate::ReduceOp::Sum => Some(1.0),
        crate::ReduceOp::Avg => Some(0.5),
        crate::ReduceOp::Max | crate::ReduceOp::Min => None,
    }
}

// bf16 sums and means with explicit vectors. Without a NaN, rounding to bf16 is an add
// and a mask on the bits: `(b + 0x7fff + lsb) & 0xffff0000` rounds to nearest even, and
// carries a finite value that overflows into the infinity of its sign (the carry cannot
// reach the sign bit, as no magnitude below a NaN's exceeds 0x7f80_0000). The select
// that keeps a NaN's payload (a third of the loop as the compiler writes it) moves out of
// the loop: each vector checks once whether either input or the combined value is a NaN
// (an infinity minus an infinity), and only such a vector takes the exact element loop.
// The same bits as [`two_ranks_bf16`] either way.

/// One vector width of a 16-bit sum, in the `#[target_feature]` function that invokes
/// it (a macro, not closures, so that every intrinsic is compiled with the function's
/// features). `$load`/`$store`/`$add`/`$mul` are the width's intrinsics and `$sc` the
/// scale splatted; `$fq!(v)` (a macro of that function) rounds to the wire format (bf16:
/// only right without NaNs), and `$nan!(x, y, s)` says whether a vector must take the
/// exact element loop `$exact` (bf16: a lane of the three is a NaN; f16, whose
/// conversion instructions handle NaNs: never), which also does the tail.
macro_rules! sum_loop {
    (
        $a:ident, $b:ident, $scale:expr, $w:expr,
        $load:ident, $store:ident, $add:ident, $mul:ident, $sc:ident,
        $fq:ident, $nan:ident, $exact:ident
    ) => {{
        let n = $a.len().min($b.len());
        let mut i = 0;
        while i + $w <= n {
            let (pa, pb) = ($a[i..].as_mut_ptr(), $b[i..].as_mut_ptr());
            // SAFETY: `i + $w <= n`, so both pointers have `$w` f32s behind them, and
            // `a` and `b` are distinct slices.
            let (x, y) = unsafe { ($load(pa), $load(pb)) };
            let s = $mul($add($fq!(x), $fq!(y)), $sc);
            if $nan!(x, y, s) {
                $exact(&mut $a[i..i + $w], &mut $b[i..i + $w], $scale);
            } else {
                let r = $fq!(s);
                // SAFETY: as for the loads.
                unsafe {
                    $store(pa, r);
                    $store(pb, r);
                }
            }
            i += $w;
        }
        $exact(&mut $a[i..n], &mut $b[i..n], $scale);
    }};
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(super) fn two_ranks_bf16_avx512(a: &mut [f32], b: &mut [f32], op: crate::ReduceOp) {
    use std::arch::x86_64::*;
    let Some(scale) = sum_scale(op) else {
        return two_ranks_bf16(a, b, op);
    };
    let (one, bias) = (_mm512_set1_epi32(1), _mm512_set1_epi32(0x7fff));
    let keep = _mm512_set1_epi32(0xffff_0000u32 as i32);
    let sc = _mm512_set1_ps(scale);
    macro_rules! fq {
        ($x:expr) => {{
            let b = _mm512_castps_si512($x);
            let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(b), one);
            let r = _mm512_add_epi32(_mm512_add_epi32(b, bias), lsb);
            _mm512_castsi512_ps(_mm512_and_si512(r, keep))
        }};
    }
    macro_rules! nan {
        ($x:expr, $y:expr, $s:expr) => {
            (_mm512_cmp_ps_mask::<_CMP_UNORD_Q>($x, $y)
                | _mm512_cmp_ps_mask::<_CMP_UNORD_Q>($s, $s))
                != 0
        };
    }
    sum_loop!(
        a,
        b,
        scale,
        16,
        _mm512_loadu_ps,
        _mm512_storeu_ps,
        _mm512_add_ps,
        _mm512_mul_ps,
        sc,
        fq,
        nan,
        sum_bf16_exact
    );
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(super) fn two_ranks_bf16_avx2(a: &mut [f32], b: &mut [f32], op: crate::ReduceOp) {
    use std::arch::x86_64::*;
    let Some(scale) = sum_scale(op) else {
        return two_ranks_bf16(a, b, op);
    };
    let (one, bias) = (_mm256_set1_epi32(1), _mm256_set1_epi32(0x7fff));
    let keep = _mm256_set1_epi32(0xffff_0000u32 as i32);
    let sc = _mm256_set1_ps(scale);
    macro_rules! fq {
        ($x:expr) => {{
            let b = _mm256_castps_si256($x);
            let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(b), one);
            let r = _mm256_add_epi32(_mm256_add_epi32(b, bias), lsb);
            _mm256_castsi256_ps(_mm256_and_si256(r, keep))
        }};
    }
    macro_rules! nan {
        ($x:expr, $y:expr, $s:expr) => {{
            let m = _mm256_or_ps(
                _mm256_cmp_ps::<_CMP_UNORD_Q>($x, $y),
                _mm256_cmp_ps::<_CMP_UNORD_Q>($s, $s),
            );
            _mm256_testz_ps(m, m) == 0
        }};
    }
    sum_loop!(
        a,
        b,
        scale,
        8,
        _mm256_loadu_ps,
        _mm256_storeu_ps,
        _mm256_add_ps,
        _mm256_mul_ps,
        sc,
        fq,
        nan,
        sum_bf16_exact
    );
}

/// `$nan` of [`sum_loop`] for f16: its conversion instructions round NaNs as `half` does.
macro_rules! never_nan {
    ($x:expr, $y:expr, $s:expr) => {
        false
    };
}

/// The exact element loop of an f16 sum (`scale` 1) or mean (`scale` 0.5).
#[inline(always)]
fn sum_f16_exact(a: &mut [f32], b: &mut [f32], scale: f32) {
    let q = |x: f32| f16::from_f32(x).to_f32();
    for (x, y) in a.iter_mut().zip(b.iter_mut()) {
        let r = q((q(*x) + q(*y)) * scale);
        *x = r;
        *y = r;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
pub(super) fn two_ranks_f16_f16c(a: &mut [f32], b: &mut [f32], op: crate::ReduceOp) {
    use std::arch::x86_64::*;
    let Some(scale) = sum_scale(op) else {
        let q8 = |v: [f32; 8]| {
            let mut out = [0.0f32; 8];
            // SAFETY: 8 f32s in, 8 out; this function is compiled with F16C, and the CPU
            // has it (checked by `two_ranks`); mode 0 is round to nearest even.
            unsafe {
                let h = _mm256_cvtps_ph::<0>(_mm256_loadu_ps(v.as_ptr()));
                _mm256_storeu_ps(out.as_mut_ptr(), _mm256_cvtph_ps(h));
            }
            out
        };
        return two_ranks_with(a, b, op, q8, |x| f16::from_f32(x).to_f32());
    };
    let sc = _mm256_set1_ps(scale);
    // Mode 0: round to nearest even, as `half` converts (NaNs too, `matches_half`).
    macro_rules! fq {
        ($x:expr) => {
            _mm256_cvtph_ps(_mm256_cvtps_ph::<0>($x))
        };
    }
    sum_loop!(
        a,
        b,
        scale,
        8,
        _mm256_loadu_ps,
        _mm256_storeu_ps,
        _mm256_add_ps,
        _mm256_mul_ps,
        sc,
        fq,
        never_nan,
        sum_f16_exact
    );
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,f16c")]
pub(super) fn two_ranks_f16_avx512(a: &mut [f32], b: &mut [f32], op: crate::ReduceOp) {
    use std::arch::x86_64::*;
    let Some(scale) = sum_scale(op) else {
        return two_ranks_f16_f16c(a, b, op);
    };
    let sc = _mm512_set1_ps(scale);
    // Mode 0: round to nearest even, as the 256-bit instruction in `two_ranks_f16_f16c`.
    macro_rules! fq {
        ($x:expr) => {
            _mm512_cvtph_ps(_mm512_cvtps_ph::<0>($x))
        };
    }
    sum_loop!(
        a,
        b,
        scale,
        16,
        _mm512_loadu_ps,
        _mm512_storeu_ps,
        _mm512_add_ps,
        _mm512_mul_ps,
        sc,
        fq,
        never_nan,
        sum_f16_exact
    );
}

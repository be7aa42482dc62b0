//! Rounding `f32` values to a 16-bit wire format and back, in place, vectorised: the
//! conversions behind [`super::reduce::reduce_wire`].
//!
//! Each function leaves `widen(narrow(x))` in every element, bit for bit what the `half`
//! crate's conversions give (round to nearest, ties to even; overflow to infinity; a NaN
//! stays a NaN with its payload truncated and its quiet bit set). bf16 is integer
//! arithmetic on the bit patterns, which the compiler vectorises; f16 uses the F16C
//! instructions where the CPU has them (`vcvtps2ph`/`vcvtph2ps`, the same rounding) and
//! the `half` crate elsewhere.
//!
//! The widest loops the CPU has run, unless `COLLECTIVES_CPU_CAPABILITY` caps them (read
//! once, like PyTorch's `ATEN_CPU_CAPABILITY`): `avx2` keeps to AVX2 and F16C (what an
//! AVX2-only CPU runs, measurable on an AVX-512 one), `default` to the portable loops.

use half::f16;

/// The vector loops this process uses.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Level {
    Portable,
    /// AVX2 and F16C (and AVX).
    Avx2,
    /// AVX-512F as well.
    Avx512,
}

/// The widest [`Level`] this CPU has, capped by `COLLECTIVES_CPU_CAPABILITY` (an unknown
/// value is ignored, with a warning); decided once.
fn level() -> Level {
    static LEVEL: std::sync::OnceLock<Level> = std::sync::OnceLock::new();
    *LEVEL.get_or_init(|| {
        #[allow(unused_mut)]
        let mut cpu = Level::Portable;
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx") && has!("avx2") && has!("f16c") {
                cpu = Level::Avx2;
                if has!("avx512f") {
                    cpu = Level::Avx512;
                }
            }
        }
        capped(
            cpu,
            std::env::var("COLLECTIVES_CPU_CAPABILITY").ok().as_deref(),
        )
    })
}

/// `cpu` capped by the value of `COLLECTIVES_CPU_CAPABILITY`, if set.
fn capped(cpu: Level, var: Option<&str>) -> Level {
    let cap = match var {
        None | Some("") | Some("avx512") => Level::Avx512,
        Some("avx2") => Level::Avx2,
        Some("default") => Level::Portable,
        Some(other) => {
            tracing::warn!(
                value = other,
                "COLLECTIVES_CPU_CAPABILITY is not avx512, avx2 or default; ignored"
            );
            Level::Avx512
        }
    };
    cpu.min(cap)
}

/// `widen(narrow_bf16(x))` for one element.
#[inline(always)]
fn round_bf16(x: f32) -> f32 {
    let b = x.to_bits();
    // Round to nearest even: adding 0x7fff plus the kept lowest bit carries into the
    // kept part exactly when the dropped half is above the tie, or at it and odd.
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1));
    // NaN: keep the sign and the top of the payload, set the quiet bit. Both are
    // computed and one selected by a mask, so the loop vectorises without branches.
    let nan_mask = 0u32.wrapping_sub(((b & 0x7fff_ffff) > 0x7f80_0000) as u32);
    let quiet = b | 0x0040_0000;
    f32::from_bits(((quiet & nan_mask) | (rounded & !nan_mask)) & 0xffff_0000)
}

#[inline(always)]
fn bf16_in_place(v: &mut [f32]) {
    v.iter_mut().for_each(|x| *x = round_bf16(*x));
}

/// Rounds every element of `v` to bfloat16 precision, in place.
pub(crate) fn round_to_bf16(v: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if level() >= Level::Avx2 {
        // SAFETY: the CPU has AVX2 (`level`), which is all this instance's code may use.
        return unsafe { bf16_avx2(v) };
    }
    bf16_in_place(v)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn bf16_avx2(v: &mut [f32]) {
    bf16_in_place(v)
}

/// Rounds every element of `v` to IEEE half precision, in place.
pub(crate) fn round_to_f16(v: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if level() >= Level::Avx2 {
        // SAFETY: the CPU has AVX and F16C (`level`), which is all this function uses.
        return unsafe { f16_f16c(v) };
    }
    v.iter_mut().for_each(|x| *x = f16::from_f32(*x).to_f32());
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
fn f16_f16c(v: &mut [f32]) {
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

/// Two ranks (DDP's most common case), one pass: `a[i] = b[i] = q(q(a[i]) ⊕ q(b[i]))`
/// with `q` the wire rounding and `⊕` the operator as [`super::reduce::reduce`] applies
/// it to 16-bit buffers (`Avg` divides the sum by 2).
///
/// # Safety
/// `a` and `b` are distinct f32 buffers of `len` elements that nobody else touches.
pub(crate) unsafe fn two_ranks(
    bf16: bool,
    a: *mut f32,
    b: *mut f32,
    len: usize,
    op: crate::ReduceOp,
) {
    // SAFETY: forwarded caller guarantees; each instance uses only the features that
    // `level` found on this CPU.
    unsafe {
        let a = std::slice::from_raw_parts_mut(a, len);
        let b = std::slice::from_raw_parts_mut(b, len);
        #[cfg(target_arch = "x86_64")]
        if level() == Level::Avx512 {
            return if bf16 {
                two_ranks_bf16_avx512(a, b, op)
            } else {
                two_ranks_f16_avx512(a, b, op)
            };
        }
        #[cfg(target_arch = "x86_64")]
        if level() >= Level::Avx2 {
            return if bf16 {
                two_ranks_bf16_avx2(a, b, op)
            } else {
                two_ranks_f16_f16c(a, b, op)
            };
        }
        if bf16 {
            two_ranks_bf16(a, b, op)
        } else {
            let q = |x: f32| f16::from_f32(x).to_f32();
            two_ranks_with(a, b, op, |v| v.map(q), q)
        }
    }
}

#[inline(always)]
fn combine(x: f32, y: f32, op: crate::ReduceOp) -> f32 {
    use crate::ReduceOp::*;
    match op {
        Sum => x + y,
        Avg => (x + y) / 2.0,
        // NaN propagates whichever rank holds it (`accumulate` does the same).
        Max => {
            if y > x || y.is_nan() {
                y
            } else {
                x
            }
        }
        Min => {
            if y < x || y.is_nan() {
                y
            } else {
                x
            }
        }
    }
}

#[inline(always)]
fn two_ranks_with(
    a: &mut [f32],
    b: &mut [f32],
    op: crate::ReduceOp,
    q8: impl Fn([f32; 8]) -> [f32; 8],
    q1: impl Fn(f32) -> f32,
) {
    let mut ac = a.chunks_exact_mut(8);
    let mut bc = b.chunks_exact_mut(8);
    for (x, y) in (&mut ac).zip(&mut bc) {
        let (xs, ys): (&mut [f32; 8], &mut [f32; 8]) = match (x.try_into(), y.try_into()) {
            (Ok(xs), Ok(ys)) => (xs, ys),
            _ => continue, // unreachable: exact chunks of 8
        };
        let (qx, qy) = (q8(*xs), q8(*ys));
        let mut r = [0.0f32; 8];
        for k in 0..8 {
            r[k] = combine(qx[k], qy[k], op);
        }
        let r = q8(r);
        *xs = r;
        *ys = r;
    }
    for (x, y) in ac.into_remainder().iter_mut().zip(bc.into_remainder()) {
        let r = q1(combine(q1(*x), q1(*y), op));
        *x = r;
        *y = r;
    }
}

/// bf16, element by element with the operator hoisted out of the loop: integer and
/// float lanes that the compiler vectorises.
#[inline(always)]
fn two_ranks_bf16(a: &mut [f32], b: &mut [f32], op: crate::ReduceOp) {
    #[inline(always)]
    fn each(a: &mut [f32], b: &mut [f32], f: impl Fn(f32, f32) -> f32) {
        for (x, y) in a.iter_mut().zip(b.iter_mut()) {
            let r = round_bf16(f(round_bf16(*x), round_bf16(*y)));
            *x = r;
            *y = r;
        }
    }
    use crate::ReduceOp::*;
    match op {
        Sum => each(a, b, |x, y| x + y),
        Avg => each(a, b, |x, y| (x + y) / 2.0),
        Max => each(a, b, |x, y| combine(x, y, Max)),
        Min => each(a, b, |x, y| combine(x, y, Min)),
    }
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
fn two_ranks_bf16_avx512(a: &mut [f32], b: &mut [f32], op: crate::ReduceOp) {
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
fn two_ranks_bf16_avx2(a: &mut [f32], b: &mut [f32], op: crate::ReduceOp) {
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
fn two_ranks_f16_f16c(a: &mut [f32], b: &mut [f32], op: crate::ReduceOp) {
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
fn two_ranks_f16_avx512(a: &mut [f32], b: &mut [f32], op: crate::ReduceOp) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    /// `COLLECTIVES_CPU_CAPABILITY` only ever narrows what the CPU has.
    #[test]
    fn capability_caps_never_widens() {
        use Level::*;
        assert_eq!(capped(Avx512, None), Avx512);
        assert_eq!(capped(Avx512, Some("avx2")), Avx2);
        assert_eq!(capped(Avx512, Some("default")), Portable);
        assert_eq!(capped(Avx512, Some("sse9")), Avx512);
        assert_eq!(capped(Avx2, Some("avx512")), Avx2);
        assert_eq!(capped(Portable, Some("avx2")), Portable);
        assert_eq!(capped(Avx2, Some("")), Avx2);
    }

    /// Every conversion matches the `half` crate bit for bit on special and random values.
    #[test]
    fn matches_half() {
        let mut vals: Vec<f32> = vec![
            0.0,
            -0.0,
            1.0,
            -1.0,
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            1e-40,
            -1e-40,
            65504.0,
            65520.0,
            65519.99,
            1.0 + 1.0 / 2048.0,
            1.0 + 3.0 / 2048.0,
            1.0 + 1.0 / 256.0,
            1.0 + 3.0 / 256.0,
            6e-8,
            3e-8,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::from_bits(0x7f80_0001), // signalling NaN
            f32::from_bits(0xffc1_2345),
            f32::from_bits(0x7f7f_ffff),
        ];
        let mut s = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..10_000 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            vals.push(f32::from_bits(s as u32));
        }
        let mut b = vals.clone();
        round_to_bf16(&mut b);
        let mut h = vals.clone();
        round_to_f16(&mut h);
        for (i, &x) in vals.iter().enumerate() {
            let want_b = bf16::from_f32(x).to_f32();
            let want_h = f16::from_f32(x).to_f32();
            assert_eq!(
                b[i].to_bits(),
                want_b.to_bits(),
                "bf16 of {x:e} ({:#x})",
                x.to_bits()
            );
            // F16C quiets a signalling NaN the same way; compare NaN-ness and payload.
            assert_eq!(
                h[i].to_bits(),
                want_h.to_bits(),
                "f16 of {x:e} ({:#x})",
                x.to_bits()
            );
        }
    }

    type TwoRanks = dyn Fn(&mut [f32], &mut [f32]);

    /// Every instance of the two-rank loop (AVX-512, AVX2, portable) gives the reference
    /// `q(q(a) ⊕ q(b))` computed with `half`, for every operator, on this CPU's features.
    #[test]
    fn two_rank_instances_agree_with_half() {
        use crate::ReduceOp;
        let n = 1000 + 3;
        let gen = |seed: u32| -> Vec<f32> {
            (0..n as u32)
                .map(|i| {
                    let x = ((i.wrapping_mul(2_654_435_761) ^ seed) % 100_003) as f32 / 100_003.0;
                    (x - 0.5) * [1e-6, 0.5, 3.0, 7e4, 1e30][i as usize % 5]
                })
                .collect()
        };
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
            for bf in [false, true] {
                let q = |x: f32| {
                    if bf {
                        bf16::from_f32(x).to_f32()
                    } else {
                        f16::from_f32(x).to_f32()
                    }
                };
                let (mut a0, mut b0) = (gen(1), gen(2));
                // Values the fast bf16 loops must hand to the exact one (NaNs, and an
                // infinity minus an infinity) or round right without it (infinities,
                // overflow to infinity, subnormals), in one rank's buffer or the other's
                // at positions all through the vectors; never a NaN in both at once
                // (which of two NaNs an addition keeps is the compiler's choice).
                let specials = [
                    f32::NAN,
                    f32::from_bits(0x7f80_0001),
                    f32::from_bits(0xffc1_2345),
                    f32::INFINITY,
                    f32::NEG_INFINITY,
                    f32::MAX,
                    f32::from_bits(0x7f7f_ffff),
                    f32::from_bits(0xff7f_8000),
                    1e-40,
                    -0.0,
                ];
                for (k, i) in (0..n).step_by(37).enumerate() {
                    a0[i] = specials[k % specials.len()];
                }
                for (k, i) in (7..n).step_by(41).enumerate() {
                    b0[i] = specials[(k + 3) % specials.len()];
                }
                for (i, (x, y)) in [
                    (f32::INFINITY, f32::NEG_INFINITY),
                    (f32::MAX, f32::MAX),
                    (f32::from_bits(0xff7f_ffff), -f32::MAX),
                ]
                .into_iter()
                .enumerate()
                {
                    a0[500 + 8 * i] = x;
                    b0[500 + 8 * i] = y;
                }
                let want: Vec<f32> = a0
                    .iter()
                    .zip(&b0)
                    .map(|(&x, &y)| q(combine(q(x), q(y), op)))
                    .collect();
                let mut runs: Vec<(&str, Box<TwoRanks>)> = vec![(
                    "portable",
                    Box::new(move |a: &mut [f32], b: &mut [f32]| {
                        if bf {
                            two_ranks_bf16(a, b, op)
                        } else {
                            two_ranks_with(
                                a,
                                b,
                                op,
                                |v| v.map(|x| f16::from_f32(x).to_f32()),
                                |x| f16::from_f32(x).to_f32(),
                            )
                        }
                    }),
                )];
                #[cfg(target_arch = "x86_64")]
                {
                    if std::arch::is_x86_feature_detected!("avx2")
                        && std::arch::is_x86_feature_detected!("f16c")
                    {
                        runs.push((
                            "avx2",
                            Box::new(move |a: &mut [f32], b: &mut [f32]| {
                                // SAFETY: the CPU has AVX2 and F16C (checked above).
                                unsafe {
                                    if bf {
                                        two_ranks_bf16_avx2(a, b, op)
                                    } else {
                                        two_ranks_f16_f16c(a, b, op)
                                    }
                                }
                            }),
                        ));
                    }
                    if std::arch::is_x86_feature_detected!("avx512f")
                        && std::arch::is_x86_feature_detected!("avx2")
                        && std::arch::is_x86_feature_detected!("f16c")
                    {
                        runs.push((
                            "avx512",
                            Box::new(move |a: &mut [f32], b: &mut [f32]| {
                                // SAFETY: the CPU has AVX-512F, AVX2 and F16C (checked
                                // above).
                                unsafe {
                                    if bf {
                                        two_ranks_bf16_avx512(a, b, op)
                                    } else {
                                        two_ranks_f16_avx512(a, b, op)
                                    }
                                }
                            }),
                        ));
                    }
                }
                for (name, run) in runs {
                    let (mut a, mut b) = (a0.clone(), b0.clone());
                    run(&mut a, &mut b);
                    for i in 0..n {
                        assert_eq!(
                            a[i].to_bits(),
                            want[i].to_bits(),
                            "{name} {op:?} bf16={bf} at {i}"
                        );
                        assert_eq!(
                            b[i].to_bits(),
                            want[i].to_bits(),
                            "{name} {op:?} bf16={bf} at {i}"
                        );
                    }
                }
            }
        }
    }
}

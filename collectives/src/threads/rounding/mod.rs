//! Rounding `f32` values to a 16-bit wire format and back, in place, vectorised: the
//! fused rounding loops behind [`super::reduce::reduce_wire`] (`all_reduce_wire`), the
//! dispatch and portable loops here, the explicit x86-64 vectors in [`simd`].
//!
//! Each function leaves `widen(narrow(x))` in every element, bit for bit what the `half`
//! crate's conversions give (round to nearest, ties to even; overflow to infinity; a NaN
//! stays a NaN with its payload truncated and its quiet bit set). bf16 is integer
//! arithmetic on the bit patterns, which the compiler vectorises; f16 uses the F16C
//! instructions where the CPU has them (`vcvtps2ph`/`vcvtph2ps`, the same rounding) and
//! the `half` crate elsewhere.
//!
//! The widest loops the CPU has run ([`cpucap::level`]), unless `LOWRANK_CPU_CAPABILITY`
//! caps them (read once, like PyTorch's `ATEN_CPU_CAPABILITY`; `COLLECTIVES_CPU_CAPABILITY`
//! is its deprecated alias): `avx2` keeps to AVX2 and F16C (what an AVX2-only CPU runs,
//! measurable on an AVX-512 one), `default` or `portable` to the portable loops.

use cpucap::Level;
use half::f16;

#[cfg(target_arch = "x86_64")]
mod simd;
#[cfg(target_arch = "x86_64")]
use simd::*;

/// The vector loops this process uses: [`cpucap::level`], whose environment problems (an
/// unknown `LOWRANK_CPU_CAPABILITY`, the deprecated name) are logged once per process.
fn level() -> Level {
    static LEVEL: std::sync::OnceLock<Level> = std::sync::OnceLock::new();
    *LEVEL.get_or_init(|| {
        for warning in cpucap::take_warnings() {
            tracing::warn!("{warning}");
        }
        cpucap::level()
    })
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

/// Rounds every element of `v` to IEEE half precision, in place.
pub(crate) fn round_to_f16(v: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if level() >= Level::Avx2 {
        // SAFETY: the CPU has AVX and F16C (`level`), which is all this function uses.
        return unsafe { f16_f16c(v) };
    }
    v.iter_mut().for_each(|x| *x = f16::from_f32(*x).to_f32());
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

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

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

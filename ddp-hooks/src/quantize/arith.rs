//! The 8-bit arithmetic of the quantisation hooks, PyTorch's in its order: MinMax
//! observer parameters, quantisation and dequantisation, and the error-feedback residual.

/// The largest value of a `quint8` (PyTorch's `quant_max`; `quant_min` is 0).
const QMAX: f32 = 255.0;

/// MinMax-observer parameters `(scale, zero_point)` of `xs` with the range forced to
/// contain 0 (`padded`: as if a zero were among them, which changes nothing since the
/// range contains 0 anyway). `(NaN, 0)` if a value is not finite. An empty `xs` without
/// padding is PyTorch's uninitialised observer: `(1, 0)`.
pub(super) fn qparams(xs: &[f32], padded: bool) -> (f32, f32) {
    if xs.is_empty() && !padded {
        return (1.0, 0.0);
    }
    // Branch-free passes the compiler vectorises: the range (`min`/`max` skip NaN, and
    // let infinities through), then whether any element is NaN.
    let (lo, hi) = xs
        .iter()
        .fold((0.0f32, 0.0f32), |(lo, hi), &x| (lo.min(x), hi.max(x)));
    let nan = xs.iter().fold(false, |nan, x| nan | x.is_nan());
    if nan || !lo.is_finite() || !hi.is_finite() {
        return (f32::NAN, 0.0);
    }
    let scale = ((hi - lo) / QMAX).max(f32::EPSILON);
    // PyTorch: `quant_min - round(lo / scale).to(int)`, clamped; an integer, so `+0.0`.
    let zp = (-(lo / scale).round_ties_even()).clamp(0.0, QMAX) as i32;
    (scale, zp as f32)
}

/// `clamp(round(x / scale) + zp, 0, 255)` as a byte, rounding half to even.
///
/// The rounding is `(v + 1.5·2²³) − 1.5·2²³`, which in the default rounding mode is
/// `round_ties_even(v)` exactly for `|v| ≤ 2²²` (the sum lands where floats are one apart),
/// in two adds the compiler vectorises (`round_ties_even` is a libm call on a baseline
/// x86-64 target). `v` is clamped to ±2²² first: with `zp` in 0..=255 anything beyond
/// ±512 ends at the same bound of the byte, so the result is unchanged.
pub(super) fn quantize(x: f32, scale: f32, zp: f32) -> u8 {
    const MAGIC: f32 = 12_582_912.0;
    const LIMIT: f32 = 4_194_304.0;
    let v = (x / scale).clamp(-LIMIT, LIMIT);
    (((v + MAGIC) - MAGIC) + zp).clamp(0.0, QMAX) as u8
}

/// `scale · (q − zp)`.
pub(super) fn dequantize(q: u8, scale: f32, zp: f32) -> f32 {
    scale * (f32::from(q) - zp)
}

/// The first element of `xs` that is not finite, with its position.
pub(super) fn first_nonfinite(xs: &[f32]) -> Option<(usize, f32)> {
    xs.iter().copied().enumerate().find(|(_, x)| !x.is_finite())
}

/// `y − dequant(q)` in place in `y`, element by element with the scale and zero point
/// `params(i)` of element `i`: the quantisation error of this rank's own values.
pub(super) fn residual(y: &mut [f32], q: &[u8], params: impl Fn(usize) -> (f32, f32)) {
    for (i, (y, &q)) in y.iter_mut().zip(q).enumerate() {
        let (s, z) = params(i);
        *y -= dequantize(q, s, z);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The parameters of simple ranges, against the formulas by hand.
    #[test]
    fn quantize_equals_round_ties_even_everywhere() {
        // PyTorch's formula, with the libm rounding.
        let plain = |x: f32, s: f32, z: f32| ((x / s).round_ties_even() + z).clamp(0.0, QMAX) as u8;
        let mut xs: Vec<f32> = (-2000..2000).map(|k| k as f32 * 0.25).collect();
        xs.extend([
            1e30,
            -1e30,
            4_194_304.5,
            -4_194_304.5,
            8_388_609.0,
            0.5,
            1.5,
            2.5,
            -0.5,
            -2.5,
        ]);
        xs.extend((0..10_000).map(|k| ((k * 7919) % 100_003) as f32 / 37.0 - 1350.0));
        for &s in &[1.0f32, 0.5, 3.0, f32::EPSILON, 1e-3, 1e6] {
            for &z in &[0.0f32, 17.0, 128.0, 255.0] {
                for &x in &xs {
                    assert_eq!(
                        quantize(x, s, z),
                        plain(x, s, z),
                        "x {x}, scale {s}, zp {z}"
                    );
                }
            }
        }
    }

    #[test]
    fn qparams_of_simple_ranges() {
        let ramp: Vec<f32> = (0..=255).map(|v| v as f32).collect();
        assert_eq!(qparams(&ramp, false), (1.0, 0.0));
        assert_eq!(qparams(&[-255.0, -1.0], false), (1.0, 255.0));
        assert_eq!(qparams(&[3.0; 4], false), (3.0 / 255.0, 0.0));
        assert_eq!(qparams(&[0.0; 4], false), (f32::EPSILON, 0.0));
        assert_eq!(qparams(&[], false), (1.0, 0.0));
        assert_eq!(qparams(&[], true), (f32::EPSILON, 0.0));
        assert!(qparams(&[1.0, f32::NAN], false).0.is_nan());
        assert!(qparams(&[f32::INFINITY], false).0.is_nan());
        assert!(qparams(&[f32::MAX, -f32::MAX], false).0.is_infinite());
        // The zero point is +0, never -0 (PyTorch's goes through an integer).
        assert!(qparams(&[1.0], false).1.is_sign_positive());
    }

    /// Ties round to even; values past the range clamp.
    #[test]
    fn quantize_rounds_half_to_even_and_clamps() {
        assert_eq!(quantize(0.5, 1.0, 0.0), 0);
        assert_eq!(quantize(1.5, 1.0, 0.0), 2);
        assert_eq!(quantize(2.5, 1.0, 0.0), 2);
        assert_eq!(quantize(-1.0, 1.0, 0.0), 0);
        assert_eq!(quantize(300.0, 1.0, 0.0), 255);
        assert_eq!(dequantize(3, 0.5, 1.0), 1.0);
    }
}

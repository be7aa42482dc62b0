//! A seeded, serialisable standard-normal generator, drawn on the host.
//!
//! PowerSGD starts every rank from the same random `Q`. Drawing it on the host from one
//! portable generator makes CPU and CUDA start from identical values and lets a saved
//! state resume the stream exactly. The stream is ChaCha8 (a stable, specified
//! algorithm) turned into normals by the Box-Muller transform in `f64`.

use rand_chacha::rand_core::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// A standard-normal generator from a 64-bit seed. Serialise it (serde) to save the
/// position in its stream; the deserialised value continues exactly where it stopped.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NormalRng {
    inner: ChaCha8Rng,
}

impl NormalRng {
    /// A generator whose stream is fixed by `seed`.
    pub fn new(seed: u64) -> Self {
        NormalRng {
            inner: ChaCha8Rng::seed_from_u64(seed),
        }
    }

    /// A uniform `u64`, for deriving further seeds.
    pub fn next_u64(&mut self) -> u64 {
        self.inner.next_u64()
    }

    /// A uniform value in `(0, 1]` with 53 random bits.
    fn open_unit(&mut self) -> f64 {
        ((self.inner.next_u64() >> 11) + 1) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Fills `out` with independent standard-normal values. Values are made in pairs; for
    /// an odd length the last pair's second value is discarded, so the stream position
    /// after a call depends only on `out.len()`.
    pub fn fill(&mut self, out: &mut [f32]) {
        let mut chunks = out.chunks_exact_mut(2);
        for pair in &mut chunks {
            let (a, b) = self.pair();
            pair[0] = a;
            pair[1] = b;
        }
        if let [last] = chunks.into_remainder() {
            *last = self.pair().0;
        }
    }

    fn pair(&mut self) -> (f32, f32) {
        let u1 = self.open_unit();
        let u2 = self.open_unit();
        let radius = (-2.0 * u1.ln()).sqrt();
        let (s, c) = (std::f64::consts::TAU * u2).sin_cos();
        ((radius * c) as f32, (radius * s) as f32)
    }
}

/// Attempts [`Backend::orthogonalize_refill`](crate::Backend::orthogonalize_refill)
/// makes at refilling a matrix's zero columns before leaving them zero for this call. A
/// refilled column is zero again only if its values lie in the span of the other
/// columns (probability zero for generic values), so a second attempt is never expected.
pub const REFILL_ATTEMPTS: u64 = 3;

/// SplitMix64's finaliser: a bijective mix of 64 bits (the same constants as the CUDA
/// kernels').
#[inline]
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The value element `index` (column-major, `column * n + row`) of a matrix gets when
/// attempt `attempt` refills its column under `key`: a counter-based pseudo-random value
/// uniform on `[-1, 1)` in steps of `2^-23`, computed with integer operations and one
/// exact scaling, so every backend (and every rank) gets the same bits without drawing
/// from, or advancing, any random stream. It does not depend on which matrix of a batch
/// is refilled (they are independent problems), so batching matrices differently does
/// not change the values; callers vary `key` between calls (PowerSGD: per bucket and
/// step).
#[inline]
pub fn refill_value(key: u64, attempt: u64, index: u64) -> f32 {
    let h = mix(mix(key ^ attempt) ^ index);
    // 24 bits to f32 and a power-of-two scale are exact; so is the subtraction (the
    // result is a multiple of 2^-23 of magnitude below 1).
    (h >> 40) as f32 * (1.0 / (1u32 << 23) as f32) - 1.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream_and_resume_after_serde() {
        let mut a = NormalRng::new(7);
        let mut b = NormalRng::new(7);
        let (mut x, mut y) = (vec![0.0; 33], vec![0.0; 33]);
        a.fill(&mut x);
        b.fill(&mut y);
        assert_eq!(x, y);
        let saved = serde_json::to_string(&a).unwrap();
        let mut resumed: NormalRng = serde_json::from_str(&saved).unwrap();
        a.fill(&mut x);
        resumed.fill(&mut y);
        assert_eq!(x, y);
        assert_ne!(NormalRng::new(8), NormalRng::new(7));
    }

    #[test]
    fn moments_are_standard_normal() {
        let mut g = NormalRng::new(1);
        let mut v = vec![0.0f32; 200_000];
        g.fill(&mut v);
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
        let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.02, "variance {var}");
        assert!(v.iter().all(|x| x.is_finite()));
    }

    /// The refill values: pinned bits (the CUDA kernel computes the same formula, checked
    /// on a GPU by the primitives test), the range, and independence of every argument.
    #[test]
    fn refill_values_are_pinned_and_uniform() {
        let pinned = [0x3ee2d308, 0x3ed76320, 0x3d8bf580, 0x3e9c1b74].map(f32::from_bits);
        let got = [
            refill_value(7, 0, 0),
            refill_value(7, 1, 0),
            refill_value(7, 0, 5),
            refill_value(0, 0, 0),
        ];
        assert_eq!(got, pinned);
        let n = 1 << 16;
        let vs: Vec<f32> = (0..n).map(|i| refill_value(42, 1, i)).collect();
        assert!(vs.iter().all(|v| (-1.0..1.0).contains(v)));
        let mean = vs.iter().map(|&v| f64::from(v)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.01, "mean {mean}");
        let distinct: std::collections::HashSet<u32> = vs.iter().map(|v| v.to_bits()).collect();
        assert!(distinct.len() > n as usize * 99 / 100);
    }
}

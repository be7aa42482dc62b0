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
}

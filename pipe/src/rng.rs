//! Counter-based randomness: a draw is a pure function of (seed, step, layer, sample,
//! element), so it does not depend on how the batch was chunked, balanced or scheduled,
//! and a recomputed forward pass draws exactly what the first one drew.
//!
//! torchgpipe saves and restores the global RNG state around each checkpoint; that
//! reproduces dropout under recomputation but still ties the draws to the chunking, so the
//! same seed trains differently with different `chunks` (torchgpipe#35, pytorch#55036).
//! Keying every draw by the sample's global index removes both problems at once.

/// SplitMix64's increment (the golden ratio in 64-bit fixed point).
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;
/// Odd constants that separate the key's fields before mixing.
const STEP: u64 = 0xD1B5_4A32_D192_ED03;
const LAYER: u64 = 0xABC9_8388_FB8F_AC03;
const SAMPLE: u64 = 0x8CB9_2BA7_2F3D_8DD7;

/// SplitMix64's output function: a bijective avalanche mix of 64 bits.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The random stream of one layer at one training step: keyed by (seed, step, layer).
///
/// ```
/// use pipe::Stream;
/// let a = Stream::new(7, 3, 2);
/// // The same key draws the same numbers, whoever asks and in whatever order.
/// assert_eq!(a.sample(10).uniform(5), Stream::new(7, 3, 2).sample(10).uniform(5));
/// assert_ne!(a.sample(10).bits(5), Stream::new(7, 4, 2).sample(10).bits(5));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Stream {
    key: u64,
}

impl Stream {
    /// The stream of `layer` (its global index) at training `step` under `seed`.
    pub fn new(seed: u64, step: u64, layer: u64) -> Self {
        let key =
            mix(mix(mix(seed ^ GOLDEN) ^ step.wrapping_mul(STEP)) ^ layer.wrapping_mul(LAYER));
        Stream { key }
    }

    /// The stream's 64-bit key, for kernels that draw the same numbers on a device.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn key(&self) -> u64 {
        self.key
    }

    /// The sub-stream of one sample, by its global index in the mini-batch.
    pub fn sample(&self, sample: u64) -> SampleStream {
        SampleStream {
            key: mix(self.key ^ sample.wrapping_mul(SAMPLE)),
        }
    }
}

/// The draws of one sample: SplitMix64 seeded with the hash of (seed, step, layer, sample);
/// element `e` is its `e`-th output, computed directly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SampleStream {
    key: u64,
}

impl SampleStream {
    /// 64 random bits for element `element`.
    pub fn bits(&self, element: u64) -> u64 {
        mix(self
            .key
            .wrapping_add(element.wrapping_add(1).wrapping_mul(GOLDEN)))
    }

    /// A uniform draw in `[0, 1)` with 24 random bits, for element `element`.
    pub fn uniform(&self, element: u64) -> f32 {
        (self.bits(element) >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_draws_look_uniform_and_streams_differ() {
        let s = Stream::new(1, 0, 0).sample(0);
        let n = 100_000u64;
        let draws: Vec<f32> = (0..n).map(|e| s.uniform(e)).collect();
        assert!(draws.iter().all(|&u| (0.0..1.0).contains(&u)));
        let mean = draws.iter().sum::<f32>() / n as f32;
        assert!((mean - 0.5).abs() < 0.01, "mean {mean}");
        let below = draws.iter().filter(|&&u| u < 0.1).count() as f32 / n as f32;
        assert!((below - 0.1).abs() < 0.01, "P(u < 0.1) = {below}");
        // Neighbouring keys in every field give unrelated draws.
        let base = Stream::new(1, 0, 0).sample(0).bits(0);
        for other in [
            Stream::new(2, 0, 0).sample(0).bits(0),
            Stream::new(1, 1, 0).sample(0).bits(0),
            Stream::new(1, 0, 1).sample(0).bits(0),
            Stream::new(1, 0, 0).sample(1).bits(0),
            Stream::new(1, 0, 0).sample(0).bits(1),
        ] {
            assert!((base ^ other).count_ones() > 10);
        }
    }
}

//! PowerSGD's hyperparameters, with PyTorch's defaults, validated at construction.

use crate::{Error, Result};
use serde::{Deserialize, Serialize};

/// Every hyperparameter of PyTorch's `PowerSGDState`, under Rust names, with the same
/// defaults.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PowerSgdConfig {
    /// Rank `r` of the approximation (PyTorch `matrix_approximation_rank`, default 1),
    /// clamped per tensor to `min(n, m, r)`. At most [`lowrank::MAX_RANK`].
    pub matrix_approximation_rank: usize,
    /// Synchronised steps of exact all-reduce before compression starts
    /// (`start_powerSGD_iter`, default 1000).
    pub start_powersgd_iter: u64,
    /// A tensor is compressed only if `(n + m) · r · min_compression_rate < n · m`
    /// (default 2).
    pub min_compression_rate: f64,
    /// Carry each rank's compression error into its next gradient (default on).
    pub use_error_feedback: bool,
    /// Start each step from the previous step's `Q` (default on).
    pub warm_start: bool,
    /// Gram-Schmidt's epsilon: columns are divided by `‖c‖ + eps` (default 0; a zero
    /// column stays zero instead of becoming NaN).
    pub orthogonalization_epsilon: f32,
    /// Seed of the random initial `Q` (default 0).
    pub random_seed: u64,
    /// Steps between compression-statistics log lines (default 10 000).
    pub compression_stats_logging_frequency: u64,
    /// Batch same-shape tensors into one product (default off). Results are the same
    /// either way up to rounding; the flag is kept for configuration parity.
    pub batch_tensors_with_same_shape: bool,
}

impl Default for PowerSgdConfig {
    fn default() -> Self {
        PowerSgdConfig {
            matrix_approximation_rank: 1,
            start_powersgd_iter: 1_000,
            min_compression_rate: 2.0,
            use_error_feedback: true,
            warm_start: true,
            orthogonalization_epsilon: 0.0,
            random_seed: 0,
            compression_stats_logging_frequency: 10_000,
            batch_tensors_with_same_shape: false,
        }
    }
}

impl PowerSgdConfig {
    /// Checks every value. PyTorch checks only the `start_powerSGD_iter` rule (kept here
    /// with its message); the others would give NaN or silent misbehaviour there.
    pub fn validate(&self) -> Result<()> {
        let r = self.matrix_approximation_rank;
        if r == 0 || r > lowrank::MAX_RANK {
            return Err(Error::Config(format!(
                "matrix_approximation_rank = {r}: must be in 1..={}",
                lowrank::MAX_RANK
            )));
        }
        if !(self.min_compression_rate.is_finite() && self.min_compression_rate > 0.0) {
            return Err(Error::Config(format!(
                "min_compression_rate = {}: must be finite and > 0",
                self.min_compression_rate
            )));
        }
        let eps = self.orthogonalization_epsilon;
        if !(eps.is_finite() && eps >= 0.0) {
            return Err(Error::Config(format!(
                "orthogonalization_epsilon = {eps}: must be finite and >= 0"
            )));
        }
        if self.compression_stats_logging_frequency == 0 {
            return Err(Error::Config(
                "compression_stats_logging_frequency = 0: must be at least 1".into(),
            ));
        }
        if (self.use_error_feedback || self.warm_start) && self.start_powersgd_iter <= 1 {
            return Err(Error::Config(format!(
                "start_powersgd_iter = {}: Expect `start_powerSGD_iter` > 1 if `use_error_feedback` or `warm_start` is enabled, because PowerSGD can only be applied after the first two iterations in DDP.",
                self.start_powersgd_iter
            )));
        }
        Ok(())
    }
}

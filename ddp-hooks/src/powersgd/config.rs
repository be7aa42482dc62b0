//! PowerSGD's hyperparameters, with PyTorch's defaults, validated at construction.

use crate::{Error, Result};
use lowrank::Backend;
use serde::{Deserialize, Serialize};
use std::any::TypeId;

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
    /// Same-shape tensors of a bucket go through each kernel in one batched call: one
    /// batched product of each kind and one batched orthogonalisation per shape
    /// (PyTorch's flag, PR #75157). Off in [`Default`] (PyTorch's default); on in
    /// [`PowerSgdConfig::default_for`] a CUDA backend.
    ///
    /// - **Same results.** The outputs are the unbatched hook's up to rounding
    ///   (bit-identical on the CPU backend, whose batched kernels compute each matrix as
    ///   the unbatched ones); the random `Q` of every tensor is the same either way (drawn
    ///   tensor by tensor in bucket order).
    /// - **Same saved state.** The hook keeps its memories grouped by shape, as PyTorch,
    ///   but saves them in bucket order ([`SavedBucket`](super::SavedBucket)): a state
    ///   saved with the flag on loads with it off and the other way round, and a hook
    ///   that loads a state keeps its own setting.
    /// - **Copies.** Same-shape matrices that lie one after another in the bucket (a
    ///   bias-free model's projections) are batched in place. Others (BERT's, separated by
    ///   their biases) are stacked by copy into a buffer the hook keeps per bucket (the
    ///   size of those matrices), and copied back after decompression, as PyTorch's
    ///   `torch.stack`: two extra passes over them in, two out, on top of the 7 of the
    ///   fused algorithm.
    /// - **When it pays.** Batching saves kernel launches and per-call overhead, so it
    ///   pays where launches cost more than memory traffic (CUDA, small matrices). On
    ///   the CPU each call is already a pass over the matrices at memory bandwidth, with
    ///   an overhead of microseconds: it saves nothing measurable there, and stacking
    ///   costs its copies (measured on BERT-base in the `hooks` bench, `batch` suite).
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
    /// PyTorch's defaults, except [`batch_tensors_with_same_shape`] as
    /// [`PowerSgdConfig::batches_on`] says for `backend`: on for CUDA.
    ///
    /// [`Default`] keeps PyTorch's defaults on every backend; start from this instead to
    /// get the backend's own, then set any field (the flag included) as usual:
    ///
    /// ```
    /// use ddp_hooks::PowerSgdConfig;
    /// let cpu = lowrank::CpuBackend::new();
    /// let config = PowerSgdConfig {
    ///     matrix_approximation_rank: 4,
    ///     ..PowerSgdConfig::default_for(&cpu)
    /// };
    /// assert!(!config.batch_tensors_with_same_shape);
    /// ```
    ///
    /// [`batch_tensors_with_same_shape`]: PowerSgdConfig::batch_tensors_with_same_shape
    pub fn default_for<B: Backend + 'static>(backend: &B) -> Self {
        PowerSgdConfig {
            batch_tensors_with_same_shape: Self::batches_on(backend),
            ..PowerSgdConfig::default()
        }
    }

    /// Whether batching same-shape tensors pays on `backend`: where each kernel launch
    /// costs more than the copies batching may make, that is on
    /// [`lowrank::CudaBackend`]. Not on [`lowrank::CpuBackend`], whose calls cost
    /// microseconds next to their passes over memory (see
    /// [`batch_tensors_with_same_shape`](PowerSgdConfig::batch_tensors_with_same_shape)).
    pub fn batches_on<B: Backend + 'static>(backend: &B) -> bool {
        let _ = backend;
        TypeId::of::<B>() == TypeId::of::<lowrank::CudaBackend>()
    }

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

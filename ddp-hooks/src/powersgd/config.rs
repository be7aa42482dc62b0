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
    /// (PyTorch's flag, PR #75157).
    ///
    /// - **Default: off, as PyTorch's `False`.** [`Default`] is `Some(false)` (it was
    ///   `None`, the backend's choice, before: a CUDA hook built from the defaults
    ///   batched). `None` asks for the backend's choice ("auto": the registry's
    ///   `batch_same_shape=auto`), what [`PowerSgdConfig::batches_on`] says for the
    ///   backend the hook is built with: off on [`lowrank::CpuBackend`] (and any other
    ///   backend), on for [`lowrank::CudaBackend`], where batching pays. The hook resolves
    ///   it once, when it is built ([`PowerSgdConfig::batches_with`];
    ///   [`PowerSgd::batches_same_shape`] reports the result). `Some(b)` forces it either
    ///   way. A state saved when this field was a plain `bool` holds `true` or `false`,
    ///   which loads as `Some`; a saved state without the field loads as `None`.
    /// - **Same results.** The outputs are the unbatched hook's up to rounding
    ///   (bit-identical on the CPU backend, whose batched kernels compute each matrix as
    ///   the unbatched ones); the random `Q` of every tensor is the same either way (drawn
    ///   tensor by tensor in bucket order).
    /// - **Same saved state.** The hook keeps its memories grouped by shape, as PyTorch,
    ///   but saves them in bucket order ([`SavedBucket`](super::SavedBucket)): a state
    ///   saved with the flag on loads with it off and the other way round. A hook that
    ///   loads a state (`CommHook::load_state`) keeps its own setting; `PowerSgd::load`
    ///   takes the state's, which is the value configured (`None` stays `None`, resolved
    ///   again on the backend it is loaded on).
    /// - **Copies.** Same-shape matrices that lie one after another in the bucket (a
    ///   bias-free model's projections) are batched in place. Others (BERT's, separated by
    ///   their biases) are stacked by copy into a buffer the hook keeps per bucket (the
    ///   size of those matrices), and copied back after decompression, as PyTorch's
    ///   `torch.stack`: two extra passes over them in, two out, on top of the 7 of the
    ///   fused algorithm. A reducer with [`ReducerConfig::layout`] set to
    ///   [`BucketLayout::ByShape`] lays its buckets out so that every batch is in place
    ///   and the uncompressed tensors are one run (one copy each way): on BERT-base
    ///   (Zen 4, AVX-512, 2 ranks) that takes the batched hook from 1.14-1.17 × the
    ///   unbatched one's time to 0.95-1.04 ×.
    ///
    ///   [`ReducerConfig::layout`]: crate::ReducerConfig::layout
    ///   [`BucketLayout::ByShape`]: crate::BucketLayout::ByShape
    /// - **When it pays.** Batching saves kernel launches and per-call overhead, so it
    ///   pays where launches cost more than memory traffic (CUDA, small matrices). On
    ///   the CPU each call is already a pass over the matrices at memory bandwidth, with
    ///   an overhead of microseconds: it saves nothing measurable there, and stacking
    ///   costs its copies (measured on BERT-base in the `hooks` bench, `batch` suite).
    ///
    /// [`PowerSgd::batches_same_shape`]: super::PowerSgd::batches_same_shape
    #[serde(default)]
    pub batch_tensors_with_same_shape: Option<bool>,
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
            // PyTorch's `batch_tensors_with_same_shape: bool = False`.
            batch_tensors_with_same_shape: Some(false),
        }
    }
}

impl PowerSgdConfig {
    /// PyTorch's defaults, with [`batch_tensors_with_same_shape`] set to what
    /// [`PowerSgdConfig::batches_on`] says for `backend` (`Some(true)` for CUDA,
    /// `Some(false)` otherwise): the setting a hook built with the field unset (`None`,
    /// "auto") on `backend` resolves to, written out.
    ///
    /// ```
    /// use ddp_hooks::PowerSgdConfig;
    /// let cpu = lowrank::CpuBackend::new();
    /// let config = PowerSgdConfig {
    ///     matrix_approximation_rank: 4,
    ///     ..PowerSgdConfig::default_for(&cpu)
    /// };
    /// assert_eq!(config.batch_tensors_with_same_shape, Some(false));
    /// assert!(!PowerSgdConfig::default().batches_with(&cpu)); // PyTorch's False
    /// let auto = PowerSgdConfig { batch_tensors_with_same_shape: None, ..config };
    /// assert!(!auto.batches_with(&cpu)); // the CPU's choice: off
    /// ```
    ///
    /// [`batch_tensors_with_same_shape`]: PowerSgdConfig::batch_tensors_with_same_shape
    pub fn default_for<B: Backend + 'static>(backend: &B) -> Self {
        PowerSgdConfig {
            batch_tensors_with_same_shape: Some(Self::batches_on(backend)),
            ..PowerSgdConfig::default()
        }
    }

    /// Whether batching same-shape tensors pays on `backend`, hence the default of
    /// [`batch_tensors_with_same_shape`](PowerSgdConfig::batch_tensors_with_same_shape):
    /// where each kernel launch costs more than the copies batching may make, that is on
    /// [`lowrank::CudaBackend`]. Not on [`lowrank::CpuBackend`], whose calls cost
    /// microseconds next to their passes over memory, nor on any other backend.
    pub fn batches_on<B: Backend + 'static>(backend: &B) -> bool {
        let _ = backend;
        TypeId::of::<B>() == TypeId::of::<lowrank::CudaBackend>()
    }

    /// Whether a hook with this configuration built on `backend` batches same-shape
    /// tensors: [`batch_tensors_with_same_shape`] if set, else
    /// [`PowerSgdConfig::batches_on`]`(backend)`.
    ///
    /// [`batch_tensors_with_same_shape`]: PowerSgdConfig::batch_tensors_with_same_shape
    pub fn batches_with<B: Backend + 'static>(&self, backend: &B) -> bool {
        self.batch_tensors_with_same_shape
            .unwrap_or_else(|| Self::batches_on(backend))
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

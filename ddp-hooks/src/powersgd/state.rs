//! The saved form of a PowerSGD hook: everything but the process group.

use super::PowerSgdConfig;
use crate::{Error, Result};
use lowrank::NormalRng;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The memory of one bucket, on the host: where each value belongs in the bucket.
///
/// **Per-layer hook ([`PowerSgd`](crate::PowerSgd)).** Only the bucket's *compressed*
/// parameters have memory: those whose matrix view `n x m` ([`ParamSlot::matrix`]) passes
/// the compression test `(n + m) · r · min_compression_rate < n · m` with
/// `r = min(n, m, matrix_approximation_rank)`. Taking them in the bucket's parameter
/// order ([`Layout::params`]) and skipping the others:
///
/// - `error` is their `n x m` error matrices, row-major (the layout of the gradient
///   itself), one after another: `n · m` values each;
/// - `p` is their `n x r` factors `P̂` (the last step's, orthogonalised), column-major,
///   one after another: column `j` of the `k`-th compressed parameter is
///   `p[p_k + j·n .. p_k + (j+1)·n]`, `p_k` being the sum of `n · r` over the compressed
///   parameters before it;
/// - `q` is their `m x r` factors `Q` (the all-reduced mean of the last step, which warm
///   start reuses), column-major in the same way.
///
/// Uncompressed parameters (biases, small matrices) are averaged exactly and carry no
/// memory. The order is the parameters' order whatever
/// [`batch_tensors_with_same_shape`] says: with it the hook keeps its memories grouped
/// by shape, as PyTorch does (always, there), and reorders them when it saves and at a
/// loaded bucket's next step, so a state saved with either setting loads with either.
///
/// **Batched hook ([`BatchedPowerSgd`](crate::BatchedPowerSgd)).** The bucket of `len`
/// elements is one `side x side` matrix, row-major, `side = ceil(sqrt(len))`, zero-padded
/// at the end: bucket element `i` is at row `i / side`, column `i % side`, and positions
/// `len..side²` are the pad. `error` is that padded matrix's error (`side²` values, the
/// pad included, as in PyTorch); `p` and `q` are `side x r` column-major with the
/// unclamped rank `r`.
///
/// [`ParamSlot::matrix`]: crate::ParamSlot::matrix
/// [`batch_tensors_with_same_shape`]: super::PowerSgdConfig::batch_tensors_with_same_shape
/// [`Layout::params`]: crate::Layout::params
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SavedBucket {
    /// The bucket's length when the memory was made.
    pub len: usize,
    /// Error feedback (empty without error feedback); layout above.
    pub error: Vec<f32>,
    /// The orthogonalised factors `P̂` (empty for the per-layer hook without warm start);
    /// layout above.
    pub p: Vec<f32>,
    /// The factors `Q` (empty for the per-layer hook without warm start); layout above.
    pub q: Vec<f32>,
}

/// Everything a PowerSGD hook knows except its process group, for checkpoints: loading
/// it into a fresh hook continues exactly where the saved one stopped.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PowerSgdState {
    /// The hyperparameters.
    pub config: PowerSgdConfig,
    /// Synchronised steps seen (PyTorch's `iter`). It saturates at `u64::MAX`: a step
    /// counted there leaves it there, past any `start_powersgd_iter`, so compression
    /// never turns back into the exact all-reduce.
    pub iter: u64,
    /// Elements before compression, over all compressed steps (saturating).
    pub total_before: u64,
    /// Elements after compression, over all compressed steps (saturating).
    pub total_after: u64,
    /// The step at which the next statistics line is logged.
    pub next_stats_report: u64,
    /// The random stream of initial `Q`s.
    pub rng: NormalRng,
    /// Per bucket index.
    pub buckets: BTreeMap<usize, SavedBucket>,
}

impl PowerSgdState {
    /// Checks what `load` relies on: a valid configuration and finite memories. A NaN or
    /// an infinity in an error or a factor is [`Error::NonFinite`]: error feedback would
    /// carry it into every later step (and JSON would write it as `null`, which cannot be
    /// read back), so hooks refuse to save or load such a state.
    pub fn validate(&self) -> Result<()> {
        self.config.validate()?;
        for (&bucket, saved) in &self.buckets {
            for (buffer, values) in [("error", &saved.error), ("p", &saved.p), ("q", &saved.q)] {
                if let Some(index) = values.iter().position(|x| !x.is_finite()) {
                    return Err(Error::NonFinite {
                        bucket,
                        buffer,
                        index,
                        value: values[index],
                    });
                }
            }
        }
        Ok(())
    }
}

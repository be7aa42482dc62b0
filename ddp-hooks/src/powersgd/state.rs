//! The saved form of a PowerSGD hook: everything but the process group.

use super::config::PowerSgdConfig;
use super::plan::Plan;
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
/// **The memory belongs to one layout.** Both layouts above place each value by its
/// parameter's position and shape in the bucket, so a memory applied to another layout
/// of the same length would be silently misapplied (bucket `[64x32, 32x64]` reordered
/// into `[32x64, 64x32]`: the first matrix's row-major error added onto the second's
/// slot, its `Q` split at the wrong offsets). `layout` records the parameter shapes the
/// memory was built for, and the hooks refuse any other: the first compressed step of a
/// bucket whose shapes differ from its memory's is [`Error::Bucket`] naming the bucket
/// and both layouts (loading itself cannot see the bucket; it checks that the recorded
/// layout fits the saved memories, else [`Error::State`]). The same rule holds for a
/// live hook whose buckets are reassigned (`Reducer::set_bucket_params`) while it holds
/// memory. Same-shape parameters that trade places cannot be told apart by shape and
/// are not detected. A state saved before `layout` was recorded loads with `None` and is
/// not checked until its next step records the layout it then meets.
///
/// [`ParamSlot::matrix`]: crate::ParamSlot::matrix
/// [`batch_tensors_with_same_shape`]: super::PowerSgdConfig::batch_tensors_with_same_shape
/// [`Layout::params`]: crate::Layout::params
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SavedBucket {
    /// The bucket's length when the memory was made.
    pub len: usize,
    /// The shapes of the bucket's parameters, in bucket order ([`Layout::params`]), when
    /// the memory was made: the layout the memory is valid for (see above). `None` in a
    /// state saved before it was recorded (such a state still loads, without this
    /// check), and for a bucket loaded from one that has not stepped since.
    ///
    /// [`Layout::params`]: crate::Layout::params
    #[serde(default)]
    pub layout: Option<Vec<Vec<usize>>>,
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
    /// Compressed bucket steps held because their reduced values held a NaN or an
    /// infinity ([`CompressionStats::nonfinite_steps`](crate::CompressionStats)); 0 in a
    /// state saved before it was counted.
    #[serde(default)]
    pub nonfinite_steps: u64,
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

/// A saved bucket's recorded layout must give its saved length and memory sizes under
/// `config` (the plan the memories were built with), else [`Error::State`]: a state
/// whose layout does not describe its memories is corrupt.
pub(super) fn check_saved_layout(
    config: &PowerSgdConfig,
    index: usize,
    saved: &SavedBucket,
    shapes: &[Vec<usize>],
) -> Result<()> {
    let bad = |why: String| {
        Error::State(format!(
            "bucket {index}: the recorded layout of {} parameters {why}",
            shapes.len()
        ))
    };
    let layout = crate::Layout::packed(shapes).map_err(|e| bad(format!("is invalid ({e})")))?;
    let plan = Plan::new(
        &layout,
        config.matrix_approximation_rank,
        config.min_compression_rate,
        false,
    )
    .map_err(|e| bad(format!("has no PowerSGD plan ({e})")))?;
    if plan.len != saved.len {
        return Err(bad(format!(
            "holds {} elements, the saved bucket {}",
            plan.len, saved.len
        )));
    }
    for (what, has, needs) in [
        ("error", saved.error.len(), plan.e_len),
        ("p", saved.p.len(), plan.p_len),
        ("q", saved.q.len(), plan.q_len),
    ] {
        if has != 0 && has != needs {
            return Err(bad(format!(
                "needs {needs} elements of {what}, the state holds {has}"
            )));
        }
    }
    Ok(())
}

//! The saved form of a PowerSGD hook: everything but the process group.

use super::PowerSgdConfig;
use crate::{Error, Result};
use lowrank::NormalRng;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The memory of one bucket, on the host.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SavedBucket {
    /// The bucket's length when the memory was made.
    pub len: usize,
    /// Error feedback of the compressed tensors (empty without error feedback).
    pub error: Vec<f32>,
    /// Warm-start factors (empty without warm start).
    pub p: Vec<f32>,
    /// Warm-start factors (empty without warm start).
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

//! What both PowerSGD hooks track besides their buckets' memory: the configuration, the
//! iteration count, the compression statistics and the random stream.

use super::state::SavedBucket;
use super::{PowerSgdConfig, PowerSgdState};
use crate::{CompressionStats, Error};
use lowrank::NormalRng;
use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

pub(super) struct Progress {
    pub config: PowerSgdConfig,
    pub iter: u64,
    pub total_before: u64,
    pub total_after: u64,
    pub next_stats_report: u64,
    pub rng: NormalRng,
}

impl Progress {
    pub fn new(config: PowerSgdConfig) -> Progress {
        let rng = NormalRng::new(config.random_seed);
        Progress {
            config,
            iter: 0,
            total_before: 0,
            total_after: 0,
            next_stats_report: 0,
            rng,
        }
    }

    /// Restores everything but the buckets from a saved state.
    pub fn from_state(state: &PowerSgdState) -> Progress {
        Progress {
            config: state.config.clone(),
            iter: state.iter,
            total_before: state.total_before,
            total_after: state.total_after,
            next_stats_report: state.next_stats_report,
            rng: state.rng.clone(),
        }
    }

    /// Saves, with the given buckets.
    pub fn to_state(&self, buckets: BTreeMap<usize, SavedBucket>) -> PowerSgdState {
        PowerSgdState {
            config: self.config.clone(),
            iter: self.iter,
            total_before: self.total_before,
            total_after: self.total_after,
            next_stats_report: self.next_stats_report,
            rng: self.rng.clone(),
            buckets,
        }
    }

    /// Whether steps still use the exact all-reduce.
    pub fn vanilla(&self) -> bool {
        self.iter < self.config.start_powersgd_iter
    }

    /// PyTorch's `maybe_increase_iter`: one step per last bucket. Saturates at
    /// `u64::MAX` (see [`PowerSgdState::iter`]) rather than wrapping back to the exact
    /// all-reduce.
    pub fn maybe_increase_iter(&mut self, is_last: bool) {
        if is_last {
            self.iter = self.iter.saturating_add(1);
            if self.iter == self.config.start_powersgd_iter {
                tracing::info!("Start to apply PowerSGD after {} iterations.", self.iter);
            }
        }
    }

    /// Counts a compressed bucket and logs the statistics at the configured frequency
    /// (PyTorch's `_report_compression_stats`). The counters saturate.
    pub fn record(&mut self, before: u64, after: u64, is_last: bool) {
        self.total_before = self.total_before.saturating_add(before);
        self.total_after = self.total_after.saturating_add(after);
        if is_last && self.iter >= self.next_stats_report {
            let CompressionStats {
                before,
                after,
                ratio,
            } = self.compression_stats();
            tracing::info!(
                "Compression stats: iter {}, total before compression {before}, total after compression {after}, rate {ratio}",
                self.iter
            );
            self.next_stats_report = self
                .iter
                .saturating_add(self.config.compression_stats_logging_frequency);
        }
    }

    /// The statistics, ratio 0 before the first compressed step.
    pub fn compression_stats(&self) -> CompressionStats {
        CompressionStats::new(self.total_before, self.total_after)
    }
}

/// The key of a bucket's zero-column refill at a step
/// ([`Backend::orthogonalize_refill`](lowrank::Backend::orthogonalize_refill)).
///
/// Gram-Schmidt sets a column that depends on the earlier ones to exactly zero (a zero
/// gradient, a gradient of lower rank than the factor). Under warm start such a column
/// would stay zero forever: `P = M Q` gets a zero column, so does the next `Q = Mᵀ P̂`,
/// and the approximation keeps fewer than `r` directions (none at all after an all-zero
/// step). Refilling it lets the power iteration find the missing directions again.
///
/// Ranks stay bit-identical: `Q` (random, or the previous step's all-reduced mean) and
/// the key (the seed, the bucket, the step) are the same on every rank, and the refill
/// values are counter-based (`lowrank::refill_value`), computed where `Q` lives: no host
/// copy of `Q`, no host wait, nothing drawn from the random stream (which stays exactly
/// PyTorch's sequence of initial draws), the same values whether or not same-shape
/// tensors are batched.
pub(super) fn refill_key(seed: u64, bucket: usize, iter: u64) -> u64 {
    // Distinct (bucket, step) pairs give distinct keys for any realistic counts; the
    // refill's own hashing spreads them.
    seed ^ (bucket as u64).rotate_left(40) ^ iter.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// Locks a hook's state. Every update completes before the lock is released (or the step
/// fails as a whole), so a lock poisoned by a panicking continuation holds consistent data.
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The error for a bucket whose previous step still holds its memory.
pub(super) fn in_flight(index: usize) -> Error {
    Error::Bucket {
        index,
        why: "the previous step of this bucket has not completed (wait for every hook's work before the next step)".into(),
    }
}

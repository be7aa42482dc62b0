//! What both PowerSGD hooks track besides their buckets' memory: the configuration, the
//! iteration count, the compression statistics and the random stream.

use super::state::SavedBucket;
use super::{PowerSgdConfig, PowerSgdState};
use crate::Error;
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
            let (rate, b, a) = self.compression_stats();
            tracing::info!(
                "Compression stats: iter {}, total before compression {b}, total after compression {a}, rate {rate}",
                self.iter
            );
            self.next_stats_report = self
                .iter
                .saturating_add(self.config.compression_stats_logging_frequency);
        }
    }

    /// `(rate, before, after)`, rate 0 before the first compressed step.
    pub fn compression_stats(&self) -> (f64, u64, u64) {
        let rate = if self.total_after > 0 {
            self.total_before as f64 / self.total_after as f64
        } else {
            0.0
        };
        (rate, self.total_before, self.total_after)
    }
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

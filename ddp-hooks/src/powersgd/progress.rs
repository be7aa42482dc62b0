//! What both PowerSGD hooks track besides their buckets' memory: the configuration, the
//! iteration count, the compression statistics and the random stream.

use super::config::PowerSgdConfig;
use super::state::{PowerSgdState, SavedBucket};
use crate::{CompressionStats, Error, Result};
use lowrank::{Backend, NormalRng};
use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

pub(super) struct Progress {
    pub config: PowerSgdConfig,
    pub iter: u64,
    pub total_before: u64,
    pub total_after: u64,
    pub next_stats_report: u64,
    pub rng: NormalRng,
    /// Held steps (non-finite values) counted before the buckets' counters began: those
    /// of a loaded state.
    pub nonfinite_base: u64,
    /// The held steps already logged ([`observe_nonfinite`]).
    pub nonfinite_reported: u64,
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
            nonfinite_base: 0,
            nonfinite_reported: 0,
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
            nonfinite_base: state.nonfinite_steps,
            nonfinite_reported: state.nonfinite_steps,
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
            nonfinite_steps: self.nonfinite_base,
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
                ..
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

/// The held steps so far: the loaded state's, plus every bucket's counter (one-element
/// buffers on the backend, whole numbers of `f32`, exact up to `2^24` held steps a
/// bucket; read from the device, a wait for the work already issued there).
pub(super) fn count_nonfinite<'a, B: Backend>(
    be: &B,
    progress: &Progress,
    counts: impl IntoIterator<Item = &'a B::Buffer<f32>>,
) -> Result<u64> {
    let mut total = progress.nonfinite_base;
    for count in counts {
        let mut v = [0.0f32];
        be.download(B::view(count, ..)?, &mut v)?;
        total = total.saturating_add(v[0] as u64);
    }
    Ok(total)
}

/// [`count_nonfinite`] for the statistics, which cannot fail: a counter that cannot be
/// read is logged and left out. On a device backend, held steps not logged yet (the step
/// left its flag on the device) are logged here; the CPU backend's were logged by the
/// step itself ([`warn_if_flagged`]).
pub(super) fn observe_nonfinite<'a, B: Backend>(
    be: &B,
    progress: &mut Progress,
    counts: impl IntoIterator<Item = &'a B::Buffer<f32>>,
) -> u64 {
    match count_nonfinite(be, progress, counts) {
        Ok(total) => {
            if total > progress.nonfinite_reported && !B::HOST_RESIDENT {
                tracing::warn!(
                    held = total - progress.nonfinite_reported,
                    total,
                    "PowerSGD held bucket steps whose reduced gradients held a NaN or an infinity: their output is non-finite (for the loss scaler to skip the step) and the memories were left as before the step"
                );
            }
            progress.nonfinite_reported = progress.nonfinite_reported.max(total);
            total
        }
        Err(e) => {
            tracing::error!("the PowerSGD non-finite counters could not be read: {e}");
            progress.nonfinite_reported
        }
    }
}

/// After a step on a host backend: logs the bucket's held step at once when the step
/// raised its flag.
pub(super) fn warn_if_flagged<B: Backend>(
    be: &B,
    flag: &B::Buffer<f32>,
    bucket: usize,
    iter: u64,
) -> Result<()> {
    let mut v = [0.0f32];
    be.download(B::view(flag, ..)?, &mut v)?;
    if v[0] != 0.0 {
        tracing::warn!(
            bucket,
            iter,
            "a PowerSGD step met a NaN or an infinity in the reduced gradients: its output is non-finite (for the loss scaler to skip the step) and the bucket keeps its memories from before the step"
        );
    }
    Ok(())
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

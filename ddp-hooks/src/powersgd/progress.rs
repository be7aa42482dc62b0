//! What both PowerSGD hooks track besides their buckets' memory: the configuration, the
//! iteration count, the compression statistics and the random stream.

use super::state::SavedBucket;
use super::{PowerSgdConfig, PowerSgdState};
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

/// Attempts at redrawing a factor's zero columns before giving up on them for this step.
/// A redrawn column is zero again only if the random draw lies in the span of the other
/// columns (probability zero), so more than one attempt is never expected.
const REFILL_ATTEMPTS: usize = 3;

/// Redraws the zero columns of orthogonalised `Q` factors from the shared random stream
/// and orthogonalises them again; `mats` gives each factor's `(offset, rows, cols)`
/// (column-major) in `q`.
///
/// Gram-Schmidt sets a column that depends on the earlier ones to exactly zero (a zero
/// gradient, a gradient of lower rank than the factor). Under warm start such a column
/// would stay zero forever: `P = M Q` gets a zero column, so does the next `Q = Mᵀ P̂`,
/// and the approximation keeps fewer than `r` directions (none at all after an all-zero
/// step). Redrawing it lets the power iteration find the missing directions again.
///
/// Ranks stay bit-identical: `Q` (random, or the previous step's all-reduced mean) is the
/// same on every rank, so every rank finds the same zero columns and makes the same
/// draws from its identical stream. Nothing is drawn when no column is zero, so the
/// stream of a run without zero columns is unchanged. At most `min(rows, cols)` columns
/// can be non-zero; only fewer than that triggers a redraw.
pub(super) fn refill_zero_columns<B: Backend>(
    be: &B,
    rng: &mut NormalRng,
    q: &mut B::Buffer<f32>,
    mats: impl IntoIterator<Item = (usize, usize, usize)>,
    eps: f32,
) -> Result<()> {
    let mut host = vec![0.0f32; B::buffer_len(q)];
    be.download(B::view(q, ..)?, &mut host)?;
    for (off, rows, cols) in mats {
        let len = rows * cols;
        let mut factor = match host.get(off..off + len) {
            Some(f) => f.to_vec(),
            None => {
                return Err(Error::Kernel(format!(
                    "a factor of {rows} x {cols} at {off} does not fit a Q of {} elements",
                    host.len()
                )))
            }
        };
        for _ in 0..REFILL_ATTEMPTS {
            let zero: Vec<usize> = (0..cols)
                .filter(|&c| factor[c * rows..(c + 1) * rows].iter().all(|&x| x == 0.0))
                .collect();
            if cols - zero.len() >= rows.min(cols) {
                break;
            }
            for &c in &zero {
                let at = off + c * rows;
                be.fill_normal(rng, B::view_mut(q, at..at + rows)?)?;
            }
            be.orthogonalize(1, rows, cols, B::view_mut(q, off..off + len)?, eps)?;
            be.download(B::view(q, off..off + len)?, &mut factor)?;
        }
    }
    Ok(())
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

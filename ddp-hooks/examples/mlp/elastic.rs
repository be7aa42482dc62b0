//! Elastic checkpoints, for runs that `torchrun --max-restarts N` restarts after a
//! failure: each rank saves into `DIR/step-<N>/rank<R>.json` every few steps and keeps its
//! two newest; a (re)started run resumes from the newest step that every rank has. The
//! ranks agree on it over the process group, so a rank killed halfway through a save
//! costs one save interval, never a restart from checkpoints of different steps.

use super::checkpoint;
use collectives::{Buffer, ProcessGroup};
use std::path::{Path, PathBuf};

/// Steps a rank keeps (the newest and the one before).
const KEPT: usize = 2;

/// `dir/step-<step>`.
pub fn step_dir(dir: &Path, step: usize) -> PathBuf {
    dir.join(format!("step-{step}"))
}

/// The steps for which this rank has a complete checkpoint in `dir`, newest first.
fn local_steps(dir: &Path, rank: usize) -> Result<Vec<usize>, String> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(format!("{}: {e}", dir.display())),
    };
    let mut steps: Vec<usize> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str()?.strip_prefix("step-")?.parse().ok())
        .filter(|&step| checkpoint::path(&step_dir(dir, step), rank).is_file())
        .collect();
    steps.sort_unstable_by(|a, b| b.cmp(a));
    Ok(steps)
}

/// The newest step every rank of `group` has a checkpoint of, or `None` (a fresh start).
/// Every rank calls it; all get the same answer.
pub fn agreed_step(group: &dyn ProcessGroup, dir: &Path) -> Result<Option<usize>, String> {
    let mine = local_steps(dir, group.rank())?;
    // Each rank's newest KEPT steps, padded with -1 (none).
    let mut row = vec![-1.0f64; KEPT];
    for (slot, &step) in row.iter_mut().zip(&mine) {
        *slot = step as f64;
    }
    let rows = group
        .all_gather(Buffer::F64(row))
        .wait_timeout(group.timeout())
        .map_err(|e| format!("agreeing on the checkpoint to resume from: {e}"))?;
    let mut sets = Vec::with_capacity(rows.len());
    for r in rows {
        let r = Vec::<f64>::try_from(r).map_err(|e| e.to_string())?;
        sets.push(
            r.into_iter()
                .filter(|&s| s >= 0.0)
                .map(|s| s as usize)
                .collect::<Vec<_>>(),
        );
    }
    let common = sets[0]
        .iter()
        .copied()
        .filter(|step| sets.iter().all(|set| set.contains(step)))
        .max();
    if common.is_none() && sets.iter().any(|set| !set.is_empty()) {
        // A rank died during the first save: the others' first checkpoints are of no use.
        tracing::warn!(dir = %dir.display(), ?sets, "no step every rank saved: starting afresh");
    }
    Ok(common)
}

/// Removes this rank's checkpoints older than the `KEPT` newest, after a save of `step`.
pub fn prune(dir: &Path, rank: usize, step: usize) -> Result<(), String> {
    for old in local_steps(dir, rank)?
        .into_iter()
        .filter(|&s| s < step)
        .skip(KEPT - 1)
    {
        let p = checkpoint::path(&step_dir(dir, old), rank);
        std::fs::remove_file(&p).map_err(|e| format!("{}: {e}", p.display()))?;
        // The folder goes with its last rank's file (another rank may still hold one).
        let _ = std::fs::remove_dir(step_dir(dir, old));
    }
    Ok(())
}

/// Whether this is torchrun's first attempt of the job (or no torchrun at all).
pub fn first_attempt() -> bool {
    std::env::var("TORCHELASTIC_RESTART_COUNT").map_or(true, |c| c.trim() == "0")
}

/// Kills this process with SIGKILL, as the OOM killer or a lost node would: no
/// destructors, no flushing, sockets reset by the kernel.
pub fn die() -> ! {
    tracing::warn!("--die-at: killing this rank with SIGKILL");
    let _ = std::process::Command::new("kill")
        .args(["-KILL", &std::process::id().to_string()])
        .status();
    // `kill` is missing or failed: die as abruptly as the process can on its own.
    std::process::abort()
}

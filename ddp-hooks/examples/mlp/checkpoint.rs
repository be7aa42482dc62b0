//! One rank's checkpoint: the run it belongs to, the step, the model, the optimizer's
//! momentum, the hook's state and local SGD's or DiLoCo's, as JSON (`rank<N>.json` in the checkpoint folder).
//! `f32` values round-trip exactly through JSON (shortest representation, and hooks
//! refuse to save non-finite memories).

use ddp_hooks::averaging::AveragerState;
use ddp_hooks::DiLoCoState;
use ddp_hooks::HookState;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// What must be equal for a checkpoint to continue a run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunId {
    /// The hook spec as given, or the method and its hook (`Config::label`).
    pub hook: String,
    /// Ranks.
    pub ranks: usize,
    /// Optimizer steps of the whole run.
    pub steps: usize,
    /// Micro-steps per optimizer step.
    pub accumulate: usize,
    /// Samples per micro-step and rank.
    pub batch: usize,
}

/// A rank's state after `step` optimizer steps.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Checkpoint {
    /// The run.
    pub run: RunId,
    /// The rank that saved it.
    pub rank: usize,
    /// Optimizer steps done.
    pub step: usize,
    /// Parameters.
    pub params: Vec<Vec<f32>>,
    /// Momentum buffers.
    pub velocity: Vec<Vec<f32>>,
    /// The hook's state (`CommHook::save_state`).
    pub hook: HookState,
    /// Local SGD's model averager (its step), when the run uses it.
    #[serde(default)]
    pub averager: Option<AveragerState>,
    /// DiLoCo's state (outer momentum, the last synchronised parameters, its step), when
    /// the run uses it.
    #[serde(default)]
    pub diloco: Option<DiLoCoState>,
}

/// `dir/rank<rank>.json`.
pub fn path(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("rank{rank}.json"))
}

impl Checkpoint {
    /// Writes the checkpoint (to a temporary file, then renamed, so a crash never leaves
    /// half a checkpoint).
    pub fn save(&self, dir: &Path) -> Result<(), String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let target = path(dir, self.rank);
        let tmp = target.with_extension("json.tmp");
        let text = serde_json::to_string(self).map_err(|e| e.to_string())?;
        std::fs::write(&tmp, text).map_err(|e| format!("{}: {e}", tmp.display()))?;
        std::fs::rename(&tmp, &target).map_err(|e| format!("{}: {e}", target.display()))
    }

    /// Reads rank `rank`'s checkpoint and checks that it belongs to `run`.
    pub fn load(dir: &Path, rank: usize, run: &RunId) -> Result<Checkpoint, String> {
        let p = path(dir, rank);
        let text = std::fs::read_to_string(&p).map_err(|e| format!("{}: {e}", p.display()))?;
        let c: Checkpoint =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", p.display()))?;
        if c.run != *run {
            return Err(format!(
                "{} belongs to another run: {:?}, this one is {run:?}",
                p.display(),
                c.run
            ));
        }
        if c.rank != rank || c.step > run.steps {
            return Err(format!(
                "{}: rank {} step {} does not fit rank {rank} of a {}-step run",
                p.display(),
                c.rank,
                c.step,
                run.steps
            ));
        }
        Ok(c)
    }
}

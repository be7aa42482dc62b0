//! Schedules as data: per worker, an ordered list of actions; generators for GPipe and
//! 1F1B; a validator that rejects a schedule that cannot run.
//!
//! An [`Action`] names a stage, a micro-batch and the work (forward or backward). A worker
//! runs its list in order and waits only for data: a forward for the previous stage's
//! output, a backward for the next stage's gradient. So a fast stage never waits for an
//! unrelated slow one (torchgpipe's lock-step clock does make it wait), while the order
//! of results is the one the lists fix.
//!
//! GPipe's clock order for m = 4 micro-batches on n = 3 stages (`clock_cycles(4, 3)`):
//!
//! ```text
//! clock    0      1      2      3      4      5
//! stage 0  F0     F1     F2     F3
//! stage 1         F0     F1     F2     F3
//! stage 2                F0     F1     F2     F3
//! ```
//!
//! then every stage runs its backwards in reverse micro-batch order (B3 B2 B1 B0). 1F1B
//! starts backward passes early: stage j runs `n - j - 1` warm-up forwards, then alternates
//! one forward and one backward, so it holds at most `n - j` micro-batches in flight instead
//! of `m`.
//!
//! Later generators (interleaved stages on one worker, backward split into input- and
//! weight-gradient parts) add actions and generators; the executor stays the same.

use std::fmt;

use crate::error::Error;
use crate::vocab::{Action, Pass};

/// GPipe's clock schedule (torchgpipe's `clock_cycles`): clock `k` holds every
/// `(micro_batch, stage)` with `micro_batch + stage == k`, in increasing stage order;
/// there are `m + n - 1` clocks.
pub fn clock_cycles(m: usize, n: usize) -> Vec<Vec<(usize, usize)>> {
    (0..(m + n).saturating_sub(1))
        .map(|k| {
            ((1 + k).saturating_sub(m)..n.min(1 + k))
                .map(|j| (k - j, j))
                .collect()
        })
        .collect()
}

/// Which generator a [`Pipe`](crate::Pipe) uses for [`step`](crate::Pipe::step).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ScheduleKind {
    /// All forwards in clock order, then all backwards in reverse micro-batch order.
    #[default]
    GPipe,
    /// One forward, one backward after a warm-up: at most `n - j` micro-batches in flight
    /// on stage `j`.
    OneFOneB,
}

impl ScheduleKind {
    /// The schedule of `m` micro-batches on `n` stages, one worker per stage.
    pub fn generate(self, m: usize, n: usize) -> Result<Schedule, Error> {
        match self {
            ScheduleKind::GPipe => Schedule::gpipe(m, n),
            ScheduleKind::OneFOneB => Schedule::one_f_one_b(m, n),
        }
    }
}

impl std::str::FromStr for ScheduleKind {
    type Err = Error;

    /// `"gpipe"` or `"1f1b"`.
    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "gpipe" => Ok(ScheduleKind::GPipe),
            "1f1b" => Ok(ScheduleKind::OneFOneB),
            other => Err(Error::ScheduleName(other.to_string())),
        }
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ScheduleKind::GPipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
        })
    }
}

/// A validated schedule: per worker, the actions it runs, in order.
///
/// Construction checks that it can run: every stage lives on one worker; every
/// (stage, micro-batch) has exactly one forward if the schedule has forwards and exactly one
/// backward if it has backwards; each backward comes after its forward on the same worker;
/// and the workers' lists, with the data each action waits for, form no cycle. A schedule
/// with no forward is the second half of a split run (GPipe's `backward` after `forward`):
/// its forwards ran earlier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    stages: usize,
    micro_batches: usize,
    workers: Vec<Vec<Action>>,
    stage_worker: Vec<usize>,
    has_forward: bool,
    has_backward: bool,
}

impl Schedule {
    /// Validates per-worker action lists for `stages` stages and `micro_batches`
    /// micro-batches.
    pub fn new(
        stages: usize,
        micro_batches: usize,
        workers: Vec<Vec<Action>>,
    ) -> Result<Self, Error> {
        if stages == 0 || micro_batches == 0 {
            return Err(Error::ScheduleEmpty {
                stages,
                micro_batches,
            });
        }
        let (m, n) = (micro_batches, stages);
        let mut stage_worker: Vec<Option<usize>> = vec![None; n];
        // position[pass][stage * m + mb] = (worker, index in its list), pass in F, B, I, W
        let mut position: [Vec<Option<(usize, usize)>>; 4] = [
            vec![None; n * m],
            vec![None; n * m],
            vec![None; n * m],
            vec![None; n * m],
        ];
        for (w, list) in workers.iter().enumerate() {
            for (k, &action) in list.iter().enumerate() {
                if action.stage >= n || action.micro_batch >= m {
                    return Err(Error::ActionOutOfRange {
                        action,
                        stages,
                        micro_batches,
                    });
                }
                match stage_worker[action.stage] {
                    Some(first) if first != w => {
                        return Err(Error::StageSplit {
                            stage: action.stage,
                            first,
                            second: w,
                        })
                    }
                    _ => stage_worker[action.stage] = Some(w),
                }
                let slot =
                    &mut position[action.pass as usize][action.stage * m + action.micro_batch];
                if slot.replace((w, k)).is_some() {
                    return Err(Error::DuplicateAction { action });
                }
            }
        }
        let has_forward = position[0].iter().any(Option::is_some);
        let has_backward = position[1].iter().chain(&position[2]).any(Option::is_some);
        let at = |pass: Pass, stage: usize, mb: usize| position[pass as usize][stage * m + mb];
        for stage in 0..n {
            for mb in 0..m {
                let forward = at(Pass::Forward, stage, mb);
                let (full, input, weight) = (
                    at(Pass::Backward, stage, mb),
                    at(Pass::InputGrad, stage, mb),
                    at(Pass::WeightGrad, stage, mb),
                );
                if forward.is_none() && (has_forward || !has_backward) {
                    return Err(Error::MissingAction {
                        action: Action::forward(stage, mb),
                    });
                }
                // A backward is one B, or one I and one W after it.
                match (full, input, weight) {
                    (Some(_), Some(_), _) => {
                        return Err(Error::DuplicateAction {
                            action: Action::input_grad(stage, mb),
                        })
                    }
                    (Some(_), None, Some(_)) => {
                        return Err(Error::DuplicateAction {
                            action: Action::weight_grad(stage, mb),
                        })
                    }
                    (None, None, None) if has_backward => {
                        return Err(Error::MissingAction {
                            action: Action::backward(stage, mb),
                        })
                    }
                    (None, None, Some(_)) => {
                        return Err(Error::MissingAction {
                            action: Action::input_grad(stage, mb),
                        })
                    }
                    (None, Some(_), None) => {
                        return Err(Error::MissingAction {
                            action: Action::weight_grad(stage, mb),
                        })
                    }
                    (None, Some((w, i)), Some((_, k))) if k < i => {
                        return Err(Error::BackwardBeforeForward {
                            worker: w,
                            action: Action::weight_grad(stage, mb),
                        })
                    }
                    _ => {}
                }
                let backward = full.or(input);
                if let (Some((_, f)), Some((w, b))) = (forward, backward) {
                    if b < f {
                        return Err(Error::BackwardBeforeForward {
                            worker: w,
                            action: Action {
                                stage,
                                micro_batch: mb,
                                pass: if full.is_some() {
                                    Pass::Backward
                                } else {
                                    Pass::InputGrad
                                },
                            },
                        });
                    }
                }
            }
        }
        // A stage's W actions complete its I actions in order (a W takes the oldest I's
        // kept state): their micro-batches must come in the same order.
        for (w, list) in workers.iter().enumerate() {
            for stage in 0..n {
                let order = |pass: Pass| -> Vec<usize> {
                    list.iter()
                        .filter(|a| a.stage == stage && a.pass == pass)
                        .map(|a| a.micro_batch)
                        .collect()
                };
                let (inputs, weights) = (order(Pass::InputGrad), order(Pass::WeightGrad));
                if let Some(k) = (0..weights.len()).find(|&k| inputs.get(k) != Some(&weights[k])) {
                    return Err(Error::WeightGradOrder {
                        worker: w,
                        action: Action::weight_grad(stage, weights[k]),
                        expected: inputs.get(k).copied(),
                    });
                }
            }
        }
        // Every stage has an action by now, so every stage has a worker.
        let stage_worker = stage_worker.into_iter().map(|w| w.unwrap_or(0)).collect();
        let schedule = Schedule {
            stages,
            micro_batches,
            workers,
            stage_worker,
            has_forward,
            has_backward,
        };
        schedule.check_progress()?;
        Ok(schedule)
    }

    /// Runs the lists symbolically: each worker advances while the action at its head has
    /// its data; if all are stuck before the end, the schedule has a cycle.
    fn check_progress(&self) -> Result<(), Error> {
        let (m, n) = (self.micro_batches, self.stages);
        let mut done = [
            vec![false; n * m],
            vec![false; n * m],
            vec![false; n * m],
            vec![false; n * m],
        ];
        let mut heads = vec![0usize; self.workers.len()];
        loop {
            let mut moved = false;
            for (w, list) in self.workers.iter().enumerate() {
                while let Some(&a) = list.get(heads[w]) {
                    let at =
                        |pass: Pass, stage: usize| done[pass as usize][stage * m + a.micro_batch];
                    let ready = match a.pass {
                        Pass::Forward => a.stage == 0 || at(Pass::Forward, a.stage - 1),
                        Pass::Backward | Pass::InputGrad => {
                            (!self.has_forward || at(Pass::Forward, a.stage))
                                && (a.stage + 1 == n
                                    || at(Pass::Backward, a.stage + 1)
                                    || at(Pass::InputGrad, a.stage + 1))
                        }
                        Pass::WeightGrad => at(Pass::InputGrad, a.stage),
                    };
                    if !ready {
                        break;
                    }
                    done[a.pass as usize][a.stage * m + a.micro_batch] = true;
                    heads[w] += 1;
                    moved = true;
                }
            }
            let waiting: Vec<(usize, Action)> = self
                .workers
                .iter()
                .enumerate()
                .filter_map(|(w, list)| list.get(heads[w]).map(|&a| (w, a)))
                .collect();
            if waiting.is_empty() {
                return Ok(());
            }
            if !moved {
                return Err(Error::Deadlock { waiting });
            }
        }
    }

    /// GPipe: each stage runs its forwards in clock order, then its backwards in reverse
    /// micro-batch order. One worker per stage.
    pub fn gpipe(m: usize, n: usize) -> Result<Self, Error> {
        let workers = (0..n)
            .map(|j| {
                let mut list = gpipe_forwards(m, n, j);
                list.extend((0..m).rev().map(|i| Action::backward(j, i)));
                list
            })
            .collect();
        Schedule::new(n, m, workers)
    }

    /// The first half of [`gpipe`](Schedule::gpipe): forwards only (also what evaluation
    /// runs).
    pub fn gpipe_forward(m: usize, n: usize) -> Result<Self, Error> {
        Schedule::new(n, m, (0..n).map(|j| gpipe_forwards(m, n, j)).collect())
    }

    /// The second half of [`gpipe`](Schedule::gpipe): backwards only, for forwards that
    /// already ran.
    pub fn gpipe_backward(m: usize, n: usize) -> Result<Self, Error> {
        let workers = (0..n)
            .map(|j| (0..m).rev().map(|i| Action::backward(j, i)).collect())
            .collect();
        Schedule::new(n, m, workers)
    }

    /// 1F1B (PipeDream-flush): stage `j` runs `min(n - j - 1, m)` warm-up forwards, then
    /// alternates one forward and one backward, then drains the remaining backwards. Stage
    /// `j` never holds more than `n - j` micro-batches between forward and backward.
    pub fn one_f_one_b(m: usize, n: usize) -> Result<Self, Error> {
        let workers = (0..n)
            .map(|j| {
                let warm_up = (n - j - 1).min(m);
                let mut list: Vec<Action> = (0..warm_up).map(|i| Action::forward(j, i)).collect();
                for k in 0..m - warm_up {
                    list.push(Action::forward(j, warm_up + k));
                    list.push(Action::backward(j, k));
                }
                list.extend((m - warm_up..m).map(|i| Action::backward(j, i)));
                list
            })
            .collect();
        Schedule::new(n, m, workers)
    }

    /// Number of stages.
    pub fn stages(&self) -> usize {
        self.stages
    }

    /// Number of micro-batches.
    pub fn micro_batches(&self) -> usize {
        self.micro_batches
    }

    /// Each worker's actions, in order.
    pub fn workers(&self) -> &[Vec<Action>] {
        &self.workers
    }

    /// The worker that hosts `stage`.
    pub fn worker_of(&self, stage: usize) -> Option<usize> {
        self.stage_worker.get(stage).copied()
    }

    /// Whether it has forward actions.
    pub fn has_forward(&self) -> bool {
        self.has_forward
    }

    /// Whether it has backward actions (`B`, or `I` and `W`).
    pub fn has_backward(&self) -> bool {
        self.has_backward
    }

    /// Whether it splits some backward into its input- and weight-gradient halves (`I`
    /// and `W` actions).
    pub fn splits_backward(&self) -> bool {
        self.workers
            .iter()
            .flatten()
            .any(|a| a.pass == Pass::InputGrad)
    }

    /// The most micro-batches `stage` holds between forward and backward at once, following
    /// its worker's list (in a schedule without forwards, all micro-batches start held; in
    /// one without backwards, none is released).
    pub fn max_in_flight(&self, stage: usize) -> usize {
        let Some(list) = self.worker_of(stage).and_then(|w| self.workers.get(w)) else {
            return 0;
        };
        let mut held = if self.has_forward {
            0
        } else {
            self.micro_batches
        };
        let mut most = held;
        for a in list.iter().filter(|a| a.stage == stage) {
            match a.pass {
                Pass::Forward => held += 1,
                // An input-gradient half keeps what its weight-gradient half needs.
                Pass::InputGrad => {}
                Pass::Backward | Pass::WeightGrad => held = held.saturating_sub(1),
            }
            most = most.max(held);
        }
        most
    }
}

fn gpipe_forwards(m: usize, n: usize, stage: usize) -> Vec<Action> {
    clock_cycles(m, n)
        .into_iter()
        .flatten()
        .filter(|&(_, j)| j == stage)
        .map(|(i, j)| Action::forward(j, i))
        .collect()
}

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

mod csv;
mod generators;
pub use generators::*;

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

/// Which generator a [`Pipe`](crate::Pipe) uses for [`step`](crate::Pipe::step): PyTorch's
/// schedules, each generating PyTorch's action order (`Schedule*` in
/// `torch.distributed.pipelining`; the orders are checked against PyTorch's in
/// `tests/schedules.rs`).
///
/// A schedule with several stages per worker (`stages_per_worker`, PyTorch's stages per
/// rank) runs `n` stages on `n / stages_per_worker` workers: on threads, one worker per
/// group of stages (pinned to the first one's core); on ranks, the pipe's stage ranks must
/// put each worker's stages on one rank ([`placement`](ScheduleKind::placement)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ScheduleKind {
    /// All forwards in clock order, then all backwards in reverse micro-batch order.
    #[default]
    GPipe,
    /// One forward, one backward after a warm-up: at most `n - j` micro-batches in flight
    /// on stage `j`.
    OneFOneB,
    /// 1F1B with every backward split into its input-gradient and weight-gradient halves,
    /// the weight gradients placed in the bubbles of the cool-down (ZB-H1).
    ZeroBubble,
    /// PyTorch's `ScheduleLoopedBFS`: stages looped over the workers (stage `s` on worker
    /// `s % workers`), breadth first.
    LoopedBfs {
        /// Stages per worker.
        stages_per_worker: usize,
    },
    /// PyTorch's `ScheduleInterleaved1F1B`: looped stages, depth first; its bubble is
    /// `(w − 1) / (v·m + w − 1)` on `w` workers with `v` stages each.
    Interleaved1F1B {
        /// Stages per worker.
        stages_per_worker: usize,
    },
    /// PyTorch's `ScheduleInterleavedZeroBubble`: interleaved, with the split backward.
    InterleavedZeroBubble {
        /// Stages per worker.
        stages_per_worker: usize,
    },
    /// PyTorch's `ScheduleZBVZeroBubble`: two stages per worker in a V (worker `r` holds
    /// stages `r` and `2w − 1 − r`), split backward.
    Zbv,
    /// PyTorch's `ScheduleDualPipeV` (DeepSeek's DualPipe on a V): two stages per worker,
    /// forward and backward of different micro-batches back to back.
    DualPipeV,
}

impl ScheduleKind {
    /// Every kind, the interleaved ones with two stages per worker: what the benchmarks
    /// and tests run.
    pub const ALL: [ScheduleKind; 8] = [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::ZeroBubble,
        ScheduleKind::LoopedBfs {
            stages_per_worker: 2,
        },
        ScheduleKind::Interleaved1F1B {
            stages_per_worker: 2,
        },
        ScheduleKind::InterleavedZeroBubble {
            stages_per_worker: 2,
        },
        ScheduleKind::Zbv,
        ScheduleKind::DualPipeV,
    ];

    /// Stages each worker hosts.
    pub fn stages_per_worker(self) -> usize {
        match self {
            ScheduleKind::GPipe | ScheduleKind::OneFOneB | ScheduleKind::ZeroBubble => 1,
            ScheduleKind::LoopedBfs { stages_per_worker }
            | ScheduleKind::Interleaved1F1B { stages_per_worker }
            | ScheduleKind::InterleavedZeroBubble { stages_per_worker } => stages_per_worker,
            ScheduleKind::Zbv | ScheduleKind::DualPipeV => 2,
        }
    }

    /// How many workers `n` stages need, or why they cannot be placed.
    fn workers(self, n: usize) -> Result<usize, Error> {
        let v = self.stages_per_worker();
        if v == 0 || !n.is_multiple_of(v) || n == 0 {
            return Err(Error::ScheduleShape {
                schedule: self.to_string(),
                why: format!("{n} stages do not split into groups of {v} stages per worker"),
            });
        }
        Ok(n / v)
    }

    /// The worker (for a pipe on ranks, the rank) of each of `n` stages: stage `s` on
    /// `s` for one stage per worker, `s % workers` for looped schedules, the V for ZBV and
    /// DualPipeV. Pass it to [`PipeBuilder::on_ranks`](crate::PipeBuilder::on_ranks).
    pub fn placement(self, n: usize) -> Result<Vec<usize>, Error> {
        let pp = self.workers(n)?;
        Ok(match self {
            ScheduleKind::Zbv | ScheduleKind::DualPipeV => v_placement(pp),
            _ => loop_placement(pp, self.stages_per_worker()),
        })
    }

    /// The schedule of `m` micro-batches on `n` stages.
    pub fn generate(self, m: usize, n: usize) -> Result<Schedule, Error> {
        let pp = self.workers(n)?;
        match self {
            ScheduleKind::GPipe => Schedule::gpipe(m, n),
            ScheduleKind::OneFOneB => Schedule::one_f_one_b(m, n),
            ScheduleKind::ZeroBubble => zb_h1(m, pp)?.to_schedule(),
            ScheduleKind::LoopedBfs { stages_per_worker } => {
                looped_bfs(m, pp, stages_per_worker)?.to_schedule()
            }
            ScheduleKind::Interleaved1F1B { stages_per_worker } => {
                interleaved_1f1b(m, pp, stages_per_worker)?.to_schedule()
            }
            ScheduleKind::InterleavedZeroBubble { stages_per_worker } => {
                interleaved_zero_bubble(m, pp, stages_per_worker)?.to_schedule()
            }
            ScheduleKind::Zbv => zbv(m, pp)?.to_schedule(),
            ScheduleKind::DualPipeV => dual_pipe_v(m, pp)?.to_schedule(),
        }
    }
}

impl std::str::FromStr for ScheduleKind {
    type Err = Error;

    /// Ours (`gpipe`, `1f1b`, `zb`, `looped_bfs[:V]`, `interleaved_1f1b[:V]`,
    /// `interleaved_zb[:V]`, `zbv`, `dualpipev`; `V` stages per worker, default 2) or
    /// PyTorch's class names without `Schedule`, in any case (`GPipe`, `1F1B`,
    /// `LoopedBFS`, `Interleaved1F1B`, `InterleavedZeroBubble`, `ZBVZeroBubble`,
    /// `DualPipeV`).
    fn from_str(s: &str) -> Result<Self, Error> {
        let (name, v) = match s.split_once(':') {
            Some((name, v)) => {
                let v: usize = v
                    .parse()
                    .ok()
                    .filter(|&v| v > 0)
                    .ok_or_else(|| Error::ScheduleName(unknown(s)))?;
                (name, Some(v))
            }
            None => (s, None),
        };
        let stages_per_worker = v.unwrap_or(2);
        let kind = match name.to_ascii_lowercase().as_str() {
            "gpipe" => ScheduleKind::GPipe,
            "1f1b" => ScheduleKind::OneFOneB,
            "zb" | "zb_h1" | "zerobubble" => ScheduleKind::ZeroBubble,
            "looped_bfs" | "loopedbfs" => ScheduleKind::LoopedBfs { stages_per_worker },
            "interleaved_1f1b" | "interleaved1f1b" => {
                ScheduleKind::Interleaved1F1B { stages_per_worker }
            }
            "interleaved_zb" | "interleavedzerobubble" => {
                ScheduleKind::InterleavedZeroBubble { stages_per_worker }
            }
            "zbv" | "zbvzerobubble" => ScheduleKind::Zbv,
            "dualpipev" => ScheduleKind::DualPipeV,
            _ => return Err(Error::ScheduleName(unknown(s))),
        };
        if v.is_some() && kind.stages_per_worker() != stages_per_worker {
            return Err(Error::ScheduleName(format!(
                "{kind} runs {} stages per worker, not {stages_per_worker} (got {s:?})",
                kind.stages_per_worker()
            )));
        }
        Ok(kind)
    }
}

/// The message for a schedule name that is none of ours.
fn unknown(s: &str) -> String {
    format!(
        "{s:?} is not one of gpipe, 1f1b, zb, looped_bfs[:V], interleaved_1f1b[:V], \
         interleaved_zb[:V], zbv, dualpipev (or PyTorch's class names)"
    )
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScheduleKind::GPipe => f.write_str("gpipe"),
            ScheduleKind::OneFOneB => f.write_str("1f1b"),
            ScheduleKind::ZeroBubble => f.write_str("zb"),
            ScheduleKind::LoopedBfs { stages_per_worker } => {
                write!(f, "looped_bfs:{stages_per_worker}")
            }
            ScheduleKind::Interleaved1F1B { stages_per_worker } => {
                write!(f, "interleaved_1f1b:{stages_per_worker}")
            }
            ScheduleKind::InterleavedZeroBubble { stages_per_worker } => {
                write!(f, "interleaved_zb:{stages_per_worker}")
            }
            ScheduleKind::Zbv => f.write_str("zbv"),
            ScheduleKind::DualPipeV => f.write_str("dualpipev"),
        }
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
    /// Whether it has `I` (and so `W`) actions.
    splits: bool,
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
        let splits = position[Pass::InputGrad as usize]
            .iter()
            .any(Option::is_some);
        let schedule = Schedule {
            stages,
            micro_batches,
            workers,
            stage_worker,
            has_forward,
            has_backward,
            splits,
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
                return Err(Error::Deadlock {
                    waiting,
                    grid: grid_around(&self.workers, &heads),
                });
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
        self.splits
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

/// Each worker's list around position `heads[w]` (four actions either side), the action
/// there marked `>...<`, one line per worker: where a stuck schedule is stuck.
pub(crate) fn grid_around(workers: &[Vec<Action>], heads: &[usize]) -> String {
    let mut out = String::new();
    for (w, list) in workers.iter().enumerate() {
        let head = heads.get(w).copied().unwrap_or(list.len());
        let from = head.saturating_sub(4);
        let to = (head + 5).min(list.len());
        let cells: Vec<String> = list[from..to]
            .iter()
            .enumerate()
            .map(|(k, a)| {
                let cell = format!("{}{}{}", a.stage, a.pass.letter(), a.micro_batch);
                if from + k == head {
                    format!(">{cell}<")
                } else {
                    cell
                }
            })
            .collect();
        let (before, after) = (
            if from > 0 { "... " } else { "" },
            if to < list.len() { " ..." } else { "" },
        );
        let done = if head >= list.len() { "  (done)" } else { "" };
        out.push_str(&format!(
            "  worker {w}: {before}{}{after}{done}\n",
            cells.join(" ")
        ));
    }
    out
}

fn gpipe_forwards(m: usize, n: usize, stage: usize) -> Vec<Action> {
    clock_cycles(m, n)
        .into_iter()
        .flatten()
        .filter(|&(_, j)| j == stage)
        .map(|(i, j)| Action::forward(j, i))
        .collect()
}

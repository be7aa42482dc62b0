//! PyTorch's multi-stage schedules (`torch.distributed.pipelining`) as timestep grids.
//!
//! Each generator builds, for `pp` ranks, the compute-only `pipeline_order` that PyTorch's
//! schedule class builds in its constructor: one row per rank, one cell per timestep, `None`
//! for a bubble, stage indices global. [`Order::to_schedule`] turns it into a [`Schedule`]
//! with one worker per rank (bubbles dropped: our workers wait for data, not for the clock).
//!
//! Stage placement: [`loop_placement`] (stage `s` on rank `s % pp`) for
//! [`looped_bfs`], [`interleaved_1f1b`], [`interleaved_zero_bubble`] and [`zb_h1`];
//! [`v_placement`] (rank `r` holds `r` and `2pp − 1 − r`) for [`zbv`] and
//! [`dual_pipe_v`].
//!
//! The orders for `pp = 2`, two stages per rank, `m = 4` (`.` a bubble, `a+b` an
//! [`Cell::Overlap`]):
//!
//! ```text
//! looped_bfs   r0: 0F0 0F1 0F2 0F3 2F0 2F1 2F2 2F3 .   .   2B3 2B2 2B1 2B0 0B3 0B2 0B1 0B0
//!              r1: .   1F0 1F1 1F2 1F3 3F0 3F1 3F2 3F3 3B3 3B2 3B1 3B0 1B3 1B2 1B1 1B0
//! dual_pipe_v  r0: 0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3+3B1 3F2+0B0 3B2 3F3+0B1 3B3 0I2 0W2 0I3 0W3
//!              r1: 1F0 2F0 1F1 2F1 1F2 2B0 2F2+1B0 1F3+2B1 2F3+1B1 2B2 1B2 2I3 1I3 2W3 1W3
//! ```

use std::collections::{HashSet, VecDeque};
use std::fmt;

use crate::error::Error;
use crate::schedule::Schedule;
use crate::vocab::{Action, Pass};

/// One rank's work in one timestep of an [`Order`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Cell {
    /// One action.
    Action(Action),
    /// PyTorch's `OVERLAP_F_B`: two actions (DualPipeV: a forward of one stage and a full
    /// backward of the other) that may overlap; our workers run them one after the other,
    /// as PyTorch does without a registered overlap function.
    Overlap(Action, Action),
}

impl Cell {
    /// The actions, in the order they run (one, or the two of an overlap).
    pub fn actions(&self) -> impl Iterator<Item = Action> {
        let pair = match *self {
            Cell::Action(a) => [Some(a), None],
            Cell::Overlap(a, b) => [Some(a), Some(b)],
        };
        pair.into_iter().flatten()
    }
}

impl From<Action> for Cell {
    fn from(action: Action) -> Self {
        Cell::Action(action)
    }
}

/// PyTorch's string form of an action: `{stage}{letter}{micro_batch}`, e.g. `2F0`.
pub(crate) struct Short(pub(crate) Action);

impl fmt::Display for Short {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}{}{}",
            self.0.stage,
            self.0.pass.letter(),
            self.0.micro_batch
        )
    }
}

impl fmt::Display for Cell {
    /// PyTorch's `str(_Action)`: `2F0`, or `(0F3;3B1)OVERLAP_F_B` for an overlap.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Cell::Action(a) => Short(a).fmt(f),
            Cell::Overlap(a, b) => write!(f, "({};{})OVERLAP_F_B", Short(a), Short(b)),
        }
    }
}

/// A timestep grid: per rank, what it computes at each step (`None`: a bubble). PyTorch's
/// compute-only `pipeline_order`.
///
/// [`Display`](fmt::Display) prints it the way PyTorch's `_format_pipeline_order` does: a
/// header of `Rank i` columns, then one `Step NN:` row per timestep, bubbles blank.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Order {
    /// Row `r`: rank `r`'s cells, one per timestep (rows may differ in length).
    pub ranks: Vec<Vec<Option<Cell>>>,
}

impl Order {
    /// Every action of the grid, with its rank, rank by rank in timestep order.
    fn all_actions(&self) -> impl Iterator<Item = (usize, Action)> + '_ {
        self.ranks.iter().enumerate().flat_map(|(r, row)| {
            row.iter()
                .flatten()
                .flat_map(Cell::actions)
                .map(move |a| (r, a))
        })
    }

    /// The number of stages: one more than the highest stage index in the grid (0 if it
    /// has no action).
    pub fn stages(&self) -> usize {
        self.all_actions()
            .map(|(_, a)| a.stage.saturating_add(1))
            .max()
            .unwrap_or(0)
    }

    /// The number of micro-batches: one more than the highest micro-batch index in the
    /// grid (0 if it has no action).
    pub fn micro_batches(&self) -> usize {
        self.all_actions()
            .map(|(_, a)| a.micro_batch.saturating_add(1))
            .max()
            .unwrap_or(0)
    }

    /// The number of timesteps: the longest row.
    pub fn steps(&self) -> usize {
        self.ranks.iter().map(Vec::len).max().unwrap_or(0)
    }

    /// Per rank, its actions in order: bubbles dropped, an overlap's two actions in order.
    pub fn workers(&self) -> Vec<Vec<Action>> {
        self.ranks
            .iter()
            .map(|row| row.iter().flatten().flat_map(Cell::actions).collect())
            .collect()
    }

    /// The [`Schedule`] with one worker per rank ([`workers`](Order::workers)), for
    /// [`stages`](Order::stages) stages and [`micro_batches`](Order::micro_batches)
    /// micro-batches, validated by [`Schedule::new`].
    ///
    /// A grid with fewer actions than `stages × micro_batches` (say, a CSV naming stage
    /// 1000000) misses some: that is reported without sizing anything by the indices.
    pub fn to_schedule(&self) -> Result<Schedule, Error> {
        let (stages, micro_batches) = (self.stages(), self.micro_batches());
        let workers = self.workers();
        let count: usize = workers.iter().map(Vec::len).sum();
        if stages > 0 && micro_batches > 0 && stages.saturating_mul(micro_batches) > count {
            let has_forward = workers.iter().flatten().any(|a| a.pass == Pass::Forward);
            let present: HashSet<(usize, usize)> = workers
                .iter()
                .flatten()
                .filter(|a| (a.pass == Pass::Forward) == has_forward)
                .map(|a| (a.stage, a.micro_batch))
                .collect();
            // Fewer pairs are present than there are cells, so one of the first
            // `present.len() + 1` cells (stage-major) is missing.
            let missing = (0..stages)
                .flat_map(|s| (0..micro_batches).map(move |i| (s, i)))
                .find(|pair| !present.contains(pair));
            if let Some((stage, micro_batch)) = missing {
                let action = if has_forward {
                    Action::forward(stage, micro_batch)
                } else {
                    Action::backward(stage, micro_batch)
                };
                return Err(Error::MissingAction { action });
            }
        }
        Schedule::new(stages, micro_batches, workers)
    }

    /// The [`Display`](fmt::Display) grid with PyTorch's ` <-- ERROR HERE` after the row of
    /// timestep `step`.
    pub fn format_marked(&self, step: usize) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = self.format_grid(&mut out, Some(step));
        out
    }

    fn format_grid(&self, f: &mut dyn fmt::Write, error_step: Option<usize>) -> fmt::Result {
        let steps = self.steps();
        let digits = steps.saturating_sub(1).to_string().len();
        let label_len = "Step ".len() + digits;
        let text: Vec<Vec<String>> = self
            .ranks
            .iter()
            .map(|row| {
                row.iter()
                    .map(|c| c.map(|c| c.to_string()).unwrap_or_default())
                    .collect()
            })
            .collect();
        // PyTorch sizes column i by the step labels and rank i's cells (not its header).
        let widths: Vec<usize> = text
            .iter()
            .map(|row| {
                row.iter()
                    .map(String::len)
                    .max()
                    .unwrap_or(0)
                    .max(label_len)
            })
            .collect();
        write!(f, "{}", " ".repeat(label_len + 2))?;
        for (r, w) in widths.iter().enumerate() {
            if r > 0 {
                f.write_char(' ')?;
            }
            write!(f, "{:<w$}", format!("Rank {r}"))?;
        }
        f.write_char('\n')?;
        for step in 0..steps {
            write!(f, "Step {step:0digits$}: ")?;
            for (r, w) in widths.iter().enumerate() {
                if r > 0 {
                    f.write_char(' ')?;
                }
                let cell = text[r].get(step).map(String::as_str).unwrap_or("");
                write!(f, "{cell:<w$}")?;
            }
            if error_step == Some(step) {
                f.write_str(" <-- ERROR HERE")?;
            }
            f.write_char('\n')?;
        }
        Ok(())
    }
}

impl fmt::Display for Order {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.format_grid(f, None)
    }
}

/// The loop placement of `pp · per_rank` stages: stage `s` on rank `s % pp` (entry `s` of
/// the result is its rank).
pub fn loop_placement(pp: usize, per_rank: usize) -> Vec<usize> {
    (0..pp * per_rank).map(|s| s % pp.max(1)).collect()
}

/// The V placement of `2 · pp` stages: rank `r` holds stages `r` and `2pp − 1 − r` (entry
/// `s` of the result is its rank).
pub fn v_placement(pp: usize) -> Vec<usize> {
    (0..2 * pp)
        .map(|s| if s < pp { s } else { 2 * pp - 1 - s })
        .collect()
}

fn check_sizes(m: usize, pp: usize, per_rank: usize) -> Result<(), Error> {
    if m == 0 || pp == 0 || per_rank == 0 {
        return Err(Error::ScheduleEmpty {
            stages: pp * per_rank,
            micro_batches: m,
        });
    }
    Ok(())
}

fn act(stage: usize, micro_batch: usize, pass: Pass) -> Option<Cell> {
    Some(Cell::Action(Action {
        stage,
        micro_batch,
        pass,
    }))
}

/// PyTorch's `ScheduleLoopedBFS` (breadth-first): rank `r` waits `r` steps, runs every
/// forward of its stages (stage by stage ascending, micro-batches ascending), waits
/// `2(pp − 1 − r)` steps, then every backward (stages descending, micro-batches
/// descending). Loop placement; any `m ≥ 1`.
pub fn looped_bfs(m: usize, pp: usize, per_rank: usize) -> Result<Order, Error> {
    check_sizes(m, pp, per_rank)?;
    let ranks = (0..pp)
        .map(|r| {
            let stages: Vec<usize> = (r..pp * per_rank).step_by(pp).collect();
            let mut row: Vec<Option<Cell>> = vec![None; r];
            for &s in &stages {
                row.extend((0..m).map(|i| act(s, i, Pass::Forward)));
            }
            row.extend(std::iter::repeat_n(None, 2 * (pp - 1 - r)));
            for &s in stages.iter().rev() {
                row.extend((0..m).rev().map(|i| act(s, i, Pass::Backward)));
            }
            row
        })
        .collect();
    Ok(Order { ranks })
}

/// PyTorch's rounds of the interleaved schedules: `rounds = max(1, m / pp)`, and `m` must
/// be a multiple of it. Returns the micro-batches per round.
fn micro_batches_per_round(name: &str, m: usize, pp: usize) -> Result<usize, Error> {
    let rounds = (m / pp).max(1);
    if !m.is_multiple_of(rounds) {
        return Err(Error::ScheduleName(format!(
            "{name}: the number of micro-batches must be a multiple of the number of rounds \
             max(1, m / pp) = {rounds}, got m = {m} on pp = {pp} ranks"
        )));
    }
    Ok(m / rounds)
}

/// PyTorch's `_get_1f1b_rank_ops` for rank `r` with `per_rank` stages (loop placement).
fn one_f_one_b_rank_ops(
    m: usize,
    pp: usize,
    per_rank: usize,
    r: usize,
    per_round: usize,
    zero_bubble: bool,
) -> Vec<Option<Cell>> {
    // Warm-up forwards: those of the last rank, plus 2 (1F1B) or 1 (ZB) per hop from it.
    let factor = if zero_bubble { 1 } else { 2 };
    let ops = m * per_rank;
    let warmup = ((per_rank - 1) * per_round + factor * (pp - 1 - r)).min(ops);
    let steady = ops - warmup;
    let total = ops + warmup;
    let post_warmup = if zero_bubble {
        pp - r - 1
    } else {
        (per_rank * pp + 2 * (pp - 1 - r)).saturating_sub(warmup + r)
    };
    let forward_stage = |op: usize| ((op / per_round) % per_rank) * pp + r;
    let backward_stage =
        |op: usize| (per_rank - 1 - ((op - warmup) / per_round) % per_rank) * pp + r;
    let backward_pass = if zero_bubble {
        Pass::InputGrad
    } else {
        Pass::Backward
    };
    let stages = pp * per_rank;
    let (mut next_f, mut next_b, mut next_w) = (
        vec![0usize; stages],
        vec![0usize; stages],
        vec![0usize; stages],
    );
    fn take(counter: &mut [usize], stage: usize) -> usize {
        let i = counter[stage];
        counter[stage] += 1;
        i
    }
    let mut row: Vec<Option<Cell>> = vec![None; r];
    let mut backward_ops: Vec<usize> = Vec::new();
    let mut weights = 0usize;
    for op in 0..total {
        if op < warmup {
            let s = forward_stage(op);
            row.push(act(s, take(&mut next_f, s), Pass::Forward));
            if op + 1 == warmup {
                row.extend(std::iter::repeat_n(None, post_warmup));
            }
            continue;
        }
        if op < warmup + steady {
            let s = forward_stage(op);
            row.push(act(s, take(&mut next_f, s), Pass::Forward));
        } else if !zero_bubble {
            row.push(None);
        }
        let s = backward_stage(op);
        row.push(act(s, take(&mut next_b, s), backward_pass));
        backward_ops.push(op);
        if zero_bubble && op - warmup >= r {
            let s = backward_stage(backward_ops[weights]);
            row.push(act(s, take(&mut next_w, s), Pass::WeightGrad));
            weights += 1;
        }
    }
    while zero_bubble && weights < backward_ops.len() {
        let s = backward_stage(backward_ops[weights]);
        row.push(act(s, take(&mut next_w, s), Pass::WeightGrad));
        weights += 1;
    }
    row
}

/// PyTorch's `ScheduleInterleaved1F1B` (depth-first, Megatron's interleaved schedule with
/// PyTorch's flexible rounds). Loop placement.
///
/// `rounds = max(1, m / pp)` and `per_round = m / rounds`; rank `r` runs
/// `warmup = min((per_rank − 1)·per_round + 2(pp − 1 − r), m·per_rank)` forwards after `r`
/// bubbles, waits until step `per_rank·pp + 2(pp − 1 − r)`, alternates forward and backward,
/// then drains the backwards one every other step. Forward op `k` runs on local stage
/// `(k / per_round) % per_rank`, backward op `k` on `per_rank − 1 − ((k − warmup) /
/// per_round) % per_rank`; micro-batches count up per stage.
///
/// Errors: `m`, `pp` or `per_rank` zero ([`Error::ScheduleEmpty`]); `m` not a multiple of
/// `rounds` ([`Error::ScheduleName`], PyTorch's `ValueError`; e.g. `m = 5, pp = 2`, while
/// `m = 3, pp = 2` runs).
pub fn interleaved_1f1b(m: usize, pp: usize, per_rank: usize) -> Result<Order, Error> {
    check_sizes(m, pp, per_rank)?;
    let per_round = micro_batches_per_round("interleaved 1F1B", m, pp)?;
    let ranks = (0..pp)
        .map(|r| one_f_one_b_rank_ops(m, pp, per_rank, r, per_round, false))
        .collect();
    Ok(Order { ranks })
}

/// PyTorch's `ScheduleInterleavedZeroBubble` (ZB1P of the zero-bubble paper), loop
/// placement: the rounds and stage formulas of [`interleaved_1f1b`] with
/// `warmup = min((per_rank − 1)·per_round + (pp − 1 − r), m·per_rank)` forwards followed by
/// `pp − r − 1` bubbles; each steady op is F, I and (once `op − warmup ≥ r`) the W of the
/// oldest I without one; the cool-down is I (plus W by the same rule) without bubbles;
/// the remaining Ws go last, in the order of their Is. Then PyTorch's
/// `_add_bubbles_to_actions`: the ranks are replayed in lock-step and a bubble is put
/// before an F whose previous stage's F, or a B whose next stage's B (on the last stage:
/// its own F), was not emitted at an earlier step (I and W never wait there).
///
/// Errors as [`interleaved_1f1b`]; where PyTorch's bubble pass would loop forever on a
/// dependency that never comes (it cannot for these orders), this returns
/// [`Error::ScheduleName`].
pub fn interleaved_zero_bubble(m: usize, pp: usize, per_rank: usize) -> Result<Order, Error> {
    check_sizes(m, pp, per_rank)?;
    let per_round = micro_batches_per_round("interleaved zero bubble", m, pp)?;
    zero_bubble_order(m, pp, per_rank, per_round)
}

fn zero_bubble_order(
    m: usize,
    pp: usize,
    per_rank: usize,
    per_round: usize,
) -> Result<Order, Error> {
    let order = Order {
        ranks: (0..pp)
            .map(|r| one_f_one_b_rank_ops(m, pp, per_rank, r, per_round, true))
            .collect(),
    };
    add_bubbles_to_actions(&order, pp * per_rank)
}

/// ZB-H1 (the zero-bubble paper's handcrafted schedule with 1F1B's memory), one stage per
/// rank: PyTorch's [`interleaved_zero_bubble`] with `per_rank = 1`.
///
/// The rule, rank `r` of `pp`: `r` bubbles; `pp − 1 − r` warm-up forwards; `pp − 1 − r`
/// bubbles; then for each remaining forward: F, I of the oldest micro-batch without one,
/// and, from the `(r + 1)`-th of these steps on, W of the oldest micro-batch without one;
/// then the remaining Is, each followed by a W under the same rule; then the remaining Ws.
/// So rank `r` holds back `r` weight gradients, which fill the cool-down bubbles (the last
/// rank, `r = pp − 1`, holds `pp − 1`). Finally the lock-step bubble pass of
/// [`interleaved_zero_bubble`]. Micro-batches run in order `0..m` on every rank.
///
/// With one stage per rank the rounds do not change the order, so unlike PyTorch (which
/// refuses `m % max(1, m / pp) ≠ 0` here too, e.g. `m = 5, pp = 2`) any `m ≥ 1` runs.
pub fn zb_h1(m: usize, pp: usize) -> Result<Order, Error> {
    check_sizes(m, pp, 1)?;
    zero_bubble_order(m, pp, 1, m)
}

/// PyTorch's `_add_bubbles_to_actions`, with a stop where it would spin forever.
fn add_bubbles_to_actions(order: &Order, stages: usize) -> Result<Order, Error> {
    let mut seen: HashSet<(usize, Pass, usize)> = HashSet::new();
    let needs_bubble = |a: Action, seen: &HashSet<(usize, Pass, usize)>| match a.pass {
        Pass::Forward => {
            a.stage != 0 && !seen.contains(&(a.stage - 1, Pass::Forward, a.micro_batch))
        }
        Pass::Backward if a.stage + 1 == stages => {
            !seen.contains(&(a.stage, Pass::Forward, a.micro_batch))
        }
        Pass::Backward => !seen.contains(&(a.stage + 1, Pass::Backward, a.micro_batch)),
        Pass::InputGrad | Pass::WeightGrad => false,
    };
    let ranks = order.ranks.len();
    let mut result: Vec<Vec<Option<Cell>>> = vec![Vec::new(); ranks];
    let mut next = vec![0usize; ranks];
    loop {
        let mut running = false;
        let mut advanced = false;
        let mut emitted = Vec::new();
        for r in 0..ranks {
            let Some(&cell) = order.ranks[r].get(next[r]) else {
                continue;
            };
            running = true;
            match cell {
                Some(Cell::Action(a)) if needs_bubble(a, &seen) => result[r].push(None),
                Some(c) => {
                    if let Cell::Action(a) = c {
                        emitted.push((a.stage, a.pass, a.micro_batch));
                    }
                    result[r].push(Some(c));
                    next[r] += 1;
                    advanced = true;
                }
                None => {
                    result[r].push(None);
                    next[r] += 1;
                    advanced = true;
                }
            }
        }
        seen.extend(emitted);
        if !running {
            return Ok(Order { ranks: result });
        }
        if !advanced {
            return Err(Error::ScheduleName(format!(
                "zero bubble: no rank can take its next action (PyTorch's bubble pass would \
                 not end):\n{}",
                Order { ranks: result }
            )));
        }
    }
}

/// PyTorch's `ScheduleZBVZeroBubble` (the zero-bubble paper's ZB-V), V placement: rank `r`
/// holds stages `c0 = r` and `c1 = 2pp − 1 − r` (two per rank by construction: PyTorch's
/// other stage counts, a `ValueError` there, cannot be asked for).
///
/// It schedules `m' = max(2pp − 1, m)` micro-batches and blanks those `≥ m` to bubbles:
/// `r` bubbles; `2(pp − r) − 1` × F(c0); `r` × [F(c1), F(c0)]; `pp − r` × [F(c1), I(c1),
/// W(c1)]; while F(c1) lags F(c0) or F(c0) has micro-batches left: [F(c0) if left], I(c0),
/// W(c0), F(c1), I(c1), W(c1); `r` × [I(c0), I(c1)]; `pp − r` × [I(c0), W(c0)]; then the
/// remaining W(c1), then the remaining W(c0).
pub fn zbv(m: usize, pp: usize) -> Result<Order, Error> {
    check_sizes(m, pp, 2)?;
    let stages = 2 * pp;
    let n_micro = (2 * pp - 1).max(m);
    let ranks = (0..pp)
        .map(|r| {
            let (c0, c1) = (r, stages - 1 - r);
            let mut row: Vec<Option<Cell>> = vec![None; r];
            let (mut f0, mut f1, mut b0, mut b1) = (0, 0, 0, 0);
            let mut push = |s: usize, i: usize, pass: Pass| row.push(act(s, i, pass));
            for _ in 0..2 * (pp - r) - 1 {
                push(c0, f0, Pass::Forward);
                f0 += 1;
            }
            for _ in 0..r {
                push(c1, f1, Pass::Forward);
                f1 += 1;
                push(c0, f0, Pass::Forward);
                f0 += 1;
            }
            for _ in 0..pp - r {
                push(c1, f1, Pass::Forward);
                f1 += 1;
                push(c1, b1, Pass::InputGrad);
                push(c1, b1, Pass::WeightGrad);
                b1 += 1;
            }
            while f1 < f0 || f0 < n_micro {
                if f0 < n_micro {
                    push(c0, f0, Pass::Forward);
                    f0 += 1;
                }
                push(c0, b0, Pass::InputGrad);
                push(c0, b0, Pass::WeightGrad);
                b0 += 1;
                push(c1, f1, Pass::Forward);
                f1 += 1;
                push(c1, b1, Pass::InputGrad);
                push(c1, b1, Pass::WeightGrad);
                b1 += 1;
            }
            let (mut w0, mut w1) = (b0, b1);
            for _ in 0..r {
                push(c0, b0, Pass::InputGrad);
                b0 += 1;
                push(c1, b1, Pass::InputGrad);
                b1 += 1;
            }
            for _ in 0..pp - r {
                push(c0, b0, Pass::InputGrad);
                b0 += 1;
                push(c0, w0, Pass::WeightGrad);
                w0 += 1;
            }
            while w1 < b1 {
                push(c1, w1, Pass::WeightGrad);
                w1 += 1;
            }
            while w0 < b0 {
                push(c0, w0, Pass::WeightGrad);
                w0 += 1;
            }
            // The extra micro-batches of `n_micro` become bubbles.
            for cell in row.iter_mut() {
                if matches!(cell, Some(Cell::Action(a)) if a.micro_batch >= m) {
                    *cell = None;
                }
            }
            row
        })
        .collect();
    Ok(Order { ranks })
}

/// PyTorch's `ScheduleDualPipeV` (DeepSeek's DualPipe folded into a V), V placement:
/// rank `r` holds `s0 = r` and `s1 = 2pp − 1 − r`. "W" is the weight gradient of the oldest
/// input-gradient action not yet completed by one (either stage); an overlap is
/// [`Cell::Overlap`] of a forward and a full backward.
///
/// Rank `r`: `2(pp − r − 1)` × F(s0); `r + 1` × [F(s0), F(s1)]; `pp − r − 1` × [I(s1), W,
/// F(s1)]; `m − 2pp + r + 1` × [F(s0)+B(s1), F(s1)+B(s0)] (on the last rank the first
/// F(s0)+B(s1) is two separate cells); `pp − r − 1` × [B(s1), F(s1)+B(s0)]; `r + 1` ×
/// [X(s1), X(s0)] where X turns from B to I at iteration `(r + 1) / 2` (before the s1
/// action on odd ranks, after it on even ones); `pp − r − 1` × [W, X(s0)]; `r + 1` × W.
/// No bubbles.
///
/// Errors: `m < 2pp` ([`Error::ScheduleName`], PyTorch's `ValueError`), `m` or `pp` zero
/// ([`Error::ScheduleEmpty`]).
pub fn dual_pipe_v(m: usize, pp: usize) -> Result<Order, Error> {
    check_sizes(m, pp, 2)?;
    if m < 2 * pp {
        return Err(Error::ScheduleName(format!(
            "DualPipeV needs at least as many micro-batches as stages, got {m} micro-batches \
             and {} stages",
            2 * pp
        )));
    }
    let ranks = (0..pp).map(|r| dual_pipe_v_rank(m, pp, r)).collect();
    Ok(Order { ranks })
}

fn dual_pipe_v_rank(m: usize, pp: usize, r: usize) -> Vec<Option<Cell>> {
    struct Rank {
        cells: Vec<Option<Cell>>,
        next_f: [usize; 2],
        // Input-gradient counter, shared by I and full B.
        next_b: [usize; 2],
        weights: VecDeque<Action>,
        stage: [usize; 2],
    }
    impl Rank {
        fn forward(&mut self, k: usize) -> Action {
            let a = Action::forward(self.stage[k], self.next_f[k]);
            self.next_f[k] += 1;
            a
        }
        fn backward(&mut self, k: usize, split: bool) -> Action {
            let i = self.next_b[k];
            self.next_b[k] += 1;
            if split {
                let a = Action::input_grad(self.stage[k], i);
                self.weights
                    .push_back(Action::weight_grad(self.stage[k], i));
                a
            } else {
                Action::backward(self.stage[k], i)
            }
        }
        fn push(&mut self, a: Action) {
            self.cells.push(Some(Cell::Action(a)));
        }
        fn weight(&mut self) {
            if let Some(w) = self.weights.pop_front() {
                self.push(w);
            }
        }
        fn overlap(&mut self, fk: usize, bk: usize) {
            let f = self.forward(fk);
            let b = self.backward(bk, false);
            self.cells.push(Some(Cell::Overlap(f, b)));
        }
    }
    let mut k = Rank {
        cells: Vec::new(),
        next_f: [0; 2],
        next_b: [0; 2],
        weights: VecDeque::new(),
        stage: [r, 2 * pp - 1 - r],
    };
    for _ in 0..2 * (pp - r - 1) {
        let a = k.forward(0);
        k.push(a);
    }
    for _ in 0..r + 1 {
        let a = k.forward(0);
        k.push(a);
        let a = k.forward(1);
        k.push(a);
    }
    for _ in 0..pp - r - 1 {
        let a = k.backward(1, true);
        k.push(a);
        k.weight();
        let a = k.forward(1);
        k.push(a);
    }
    for i in 0..m + r + 1 - 2 * pp {
        if i == 0 && r == pp - 1 {
            let a = k.forward(0);
            k.push(a);
            let a = k.backward(1, false);
            k.push(a);
        } else {
            k.overlap(0, 1);
        }
        k.overlap(1, 0);
    }
    for _ in 0..pp - r - 1 {
        let a = k.backward(1, false);
        k.push(a);
        k.overlap(1, 0);
    }
    let mut split = false;
    let last = r + 1;
    for i in 0..last {
        if i == last / 2 && !r.is_multiple_of(2) {
            split = true;
        }
        let a = k.backward(1, split);
        k.push(a);
        if i == last / 2 && r.is_multiple_of(2) {
            split = true;
        }
        let a = k.backward(0, split);
        k.push(a);
    }
    for _ in 0..pp - r - 1 {
        k.weight();
        let a = k.backward(0, split);
        k.push(a);
    }
    for _ in 0..r + 1 {
        k.weight();
    }
    k.cells
}

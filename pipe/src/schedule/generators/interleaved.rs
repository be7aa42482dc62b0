//! The loop-placement schedules without split backwards: [`looped_bfs`] and
//! [`interleaved_1f1b`] (with the rounds the interleaved schedules share).

use super::{act, check_sizes, Cell, Order};
use crate::error::Error;
use crate::vocab::Pass;

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
pub(super) fn micro_batches_per_round(name: &str, m: usize, pp: usize) -> Result<usize, Error> {
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
pub(super) fn one_f_one_b_rank_ops(
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

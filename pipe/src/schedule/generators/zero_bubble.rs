//! The zero-bubble schedules of the loop placement, backward split into input (I) and
//! weight (W) gradients: [`interleaved_zero_bubble`], [`zb_h1`], and PyTorch's bubble
//! pass they share.

use std::collections::HashSet;

use super::interleaved::{micro_batches_per_round, one_f_one_b_rank_ops};
#[cfg(doc)]
use super::interleaved_1f1b;
use super::{check_sizes, Cell, Order};
use crate::error::Error;
use crate::vocab::{Action, Pass};

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

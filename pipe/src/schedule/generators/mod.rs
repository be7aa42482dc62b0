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

mod interleaved;
mod order;
mod v;
mod zero_bubble;

pub use interleaved::{interleaved_1f1b, looped_bfs};
pub use order::{Cell, Order};
pub use v::{dual_pipe_v, zbv};
pub use zero_bubble::{interleaved_zero_bubble, zb_h1};

use crate::error::Error;
#[cfg(doc)]
use crate::schedule::Schedule;
use crate::vocab::{Action, Pass};

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

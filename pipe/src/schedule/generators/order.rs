//! The grid the generators build ([`Order`] of [`Cell`]s), its checks, its conversion
//! to a [`Schedule`] and its PyTorch-style printing.

use std::collections::HashSet;
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

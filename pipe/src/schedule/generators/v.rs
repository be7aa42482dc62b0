//! The V-placement schedules: [`zbv`] (ZB-V) and [`dual_pipe_v`] (DualPipeV).

use std::collections::VecDeque;

use super::{act, check_sizes, Cell, Order};
use crate::error::Error;
use crate::vocab::{Action, Pass};

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

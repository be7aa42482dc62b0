//! The split backward of zero-bubble schedules: `I` (input gradient, weight gradients
//! kept) and `W` (the weight gradients of the stage's oldest `I`) in place of `B`. A
//! schedule whose `W`s come in the order of its `B`s computes bit for bit what the
//! schedule with `B`s computes, wherever the `W`s are placed; the validator rejects `W`s
//! out of order, a `W` without its `I`, an `I` with a `B`.

mod common;

use common::*;
use pipe::{Action, Batch, Checkpoint, Error, Pass, Pipe, Schedule};

const BATCH: usize = 10;

/// Outputs, input gradient and every parameter gradient of one step with `schedule`.
fn run(
    schedule: &Schedule,
    n: usize,
    mode: Checkpoint,
) -> (
    Batch<pipe::cpu::CpuTensor>,
    Batch<pipe::cpu::CpuTensor>,
    Vec<pipe::cpu::CpuTensor>,
) {
    let balance: Vec<usize> = match n {
        2 => vec![2, 2],
        _ => vec![1, 1, 1, 1],
    };
    let mut pipe = Pipe::builder(plain_model(), &balance)
        .chunks(schedule.micro_batches())
        .checkpoint(mode)
        .seed(SEED)
        .build()
        .unwrap();
    let target = data(BATCH, 3, 8);
    let out = pipe
        .step_with(schedule, Batch::single(data(BATCH, 5, 7)), |mb, y| {
            mse(&target, mb, y)
        })
        .unwrap();
    assert!(pipe.memory().iter().all(|m| m.deferred == 0), "every W ran");
    (out.output, out.input_grad, grads(&pipe.into_layers()))
}

/// `schedule` with every `B` split into `I` at its place and its `W` `delay` actions later
/// on the same worker (at the end if fewer remain).
fn split(schedule: &Schedule, delay: usize) -> Schedule {
    let workers = schedule
        .workers()
        .iter()
        .map(|list| {
            let mut out: Vec<Action> = Vec::new();
            let mut pending: Vec<(usize, Action)> = Vec::new();
            for (k, &a) in list.iter().enumerate() {
                if a.pass == Pass::Backward {
                    out.push(Action::input_grad(a.stage, a.micro_batch));
                    pending.push((k + delay, Action::weight_grad(a.stage, a.micro_batch)));
                } else {
                    out.push(a);
                }
                while pending.first().is_some_and(|&(due, _)| due <= k) {
                    out.push(pending.remove(0).1);
                }
            }
            out.extend(pending.into_iter().map(|(_, w)| w));
            out
        })
        .collect();
    Schedule::new(schedule.stages(), schedule.micro_batches(), workers).unwrap()
}

#[test]
fn split_backwards_are_bit_identical_wherever_the_ws_go() {
    for n in [2, 4] {
        for mode in [
            Checkpoint::Always,
            Checkpoint::ExceptLast,
            Checkpoint::Never,
        ] {
            for base in [
                Schedule::gpipe(4, n).unwrap(),
                Schedule::one_f_one_b(4, n).unwrap(),
            ] {
                let want = run(&base, n, mode);
                for delay in [0, 1, 3, 100] {
                    let s = split(&base, delay);
                    assert!(s.splits_backward());
                    assert_eq!(run(&s, n, mode), want, "n {n}, {mode:?}, W {delay} later");
                }
            }
        }
    }
}

#[test]
fn the_validator_rejects_broken_splits() {
    let f = Action::forward;
    let (i, w, b) = (Action::input_grad, Action::weight_grad, Action::backward);
    // W out of I's order.
    let e = Schedule::new(
        1,
        2,
        vec![vec![f(0, 0), f(0, 1), i(0, 0), i(0, 1), w(0, 1), w(0, 0)]],
    );
    assert!(matches!(e, Err(Error::WeightGradOrder { .. })), "{e:?}");
    // W before its I.
    let e = Schedule::new(1, 1, vec![vec![f(0, 0), w(0, 0), i(0, 0)]]);
    assert!(e.is_err(), "{e:?}");
    // An I without W; a W without I; a B and an I of one micro-batch.
    let e = Schedule::new(1, 1, vec![vec![f(0, 0), i(0, 0)]]);
    assert!(matches!(e, Err(Error::MissingAction { action }) if action.pass == Pass::WeightGrad));
    let e = Schedule::new(1, 1, vec![vec![f(0, 0), w(0, 0)]]);
    assert!(matches!(e, Err(Error::MissingAction { action }) if action.pass == Pass::InputGrad));
    let e = Schedule::new(1, 1, vec![vec![f(0, 0), b(0, 0), i(0, 0), w(0, 0)]]);
    assert!(matches!(e, Err(Error::DuplicateAction { .. })), "{e:?}");
    // I waits for the next stage's I like a B waits for its B.
    let ok = Schedule::new(
        2,
        1,
        vec![
            vec![f(0, 0), i(0, 0), w(0, 0)],
            vec![f(1, 0), i(1, 0), w(1, 0)],
        ],
    );
    assert!(ok.is_ok(), "{ok:?}");
    let e = Schedule::new(
        2,
        1,
        vec![vec![f(0, 0), i(0, 0), w(0, 0), f(1, 0), i(1, 0), w(1, 0)]],
    );
    assert!(matches!(e, Err(Error::Deadlock { .. })), "{e:?}");
}

//! Transparency (torchgpipe's `test_transparency`, §7 row 16): a pipe computes what its
//! layers compute unpipelined.
//!
//! (a) Bit-identical to the same layers run in one thread over the same micro-batches, with
//!     gradients accumulated in the schedule's backward order: outputs, input gradients,
//!     every parameter gradient and batch-norm running statistics (through evaluation
//!     outputs after the step), for every balance,
//!     chunk count, checkpoint mode and schedule (Dropout included), with weight gradients
//!     added by each backward action or deferred to each partition's last one
//!     ([`PipeBuilder::defer_weight_grads`](pipe::PipeBuilder::defer_weight_grads); the
//!     reference adds them in `backward`).
//! (b) Without batch norm, equal to the unpipelined model on the whole batch within 1e-5
//!     relative.

mod common;

use common::*;
use pipe::cpu::CpuTensor;
use pipe::{Batch, Checkpoint, Context, Layer, Pass, Pipe, Schedule, ScheduleKind};

const BATCH: usize = 11;
const BALANCES: [&[usize]; 3] = [&[1, 1, 1, 1], &[2, 2], &[3, 1]];
const MODES: [Checkpoint; 3] = [
    Checkpoint::Always,
    Checkpoint::ExceptLast,
    Checkpoint::Never,
];

/// How the pipe is driven.
#[derive(Debug, Clone, Copy)]
enum Drive {
    /// `step` with this schedule.
    Step(ScheduleKind),
    /// `forward` then `backward` (GPipe split in two).
    Split,
}

struct Run {
    output: CpuTensor,
    input_grad: CpuTensor,
    grads: Vec<CpuTensor>,
    evaluated: CpuTensor,
    backward_order: Vec<usize>,
}

/// Evaluation outputs per micro-batch of `plan`: after training they depend on the batch
/// norm running statistics, so equal evaluation outputs mean equal statistics.
fn evaluate(
    layers: &mut [Box<dyn Layer<CpuTensor>>],
    x: &CpuTensor,
    plan: &[pipe::MicroBatch],
) -> CpuTensor {
    let parts: Vec<CpuTensor> = plan
        .iter()
        .map(|&mb| {
            let mut b = Batch::single(rows(x, mb));
            for (l, layer) in layers.iter_mut().enumerate() {
                let mut ctx = Context::new(false, SEED, 1, mb.len)
                    .with_layer(l)
                    .with_micro_batch(mb);
                b = layer.forward(b, &mut ctx).unwrap().0;
            }
            b.into_single().unwrap()
        })
        .collect();
    cat(&parts)
}

fn run_pipe(
    model: fn() -> common::Layers,
    balance: &[usize],
    chunks: usize,
    mode: Checkpoint,
    drive: Drive,
    defer: bool,
) -> Run {
    let x = data(BATCH, 5, 7);
    let target = data(BATCH, 3, 8);
    let mut pipe = Pipe::builder(model(), balance)
        .chunks(chunks)
        .checkpoint(mode)
        .seed(SEED)
        .defer_weight_grads(defer)
        .build()
        .unwrap();
    let plan = pipe.micro_batches(BATCH).unwrap();
    let (output, input_grad, schedule) = match drive {
        Drive::Step(kind) => {
            let schedule = kind.generate(plan.len(), balance.len()).unwrap();
            let out = pipe
                .step_with(&schedule, Batch::single(x), |mb, out| mse(&target, mb, out))
                .unwrap();
            (out.output, out.input_grad, schedule)
        }
        Drive::Split => {
            let output = pipe.forward(Batch::single(x)).unwrap();
            let y = output.tensor(0).unwrap().clone();
            let full = pipe::MicroBatch {
                index: 0,
                offset: 0,
                len: BATCH,
            };
            let (_, g) = mse(&target, full, &Batch::single(y)).unwrap();
            let input_grad = pipe.backward(g).unwrap();
            (
                output,
                input_grad,
                Schedule::gpipe(plan.len(), balance.len()).unwrap(),
            )
        }
    };
    assert_eq!(pipe.step_number(), 1);
    assert!(
        pipe.memory().iter().all(|m| m.held == 0 && m.deferred == 0),
        "nothing held after the step"
    );
    pipe.eval();
    let evaluated = pipe
        .forward(Batch::single(data(BATCH, 5, 7)))
        .unwrap()
        .into_single()
        .unwrap();
    let layers = pipe.into_layers();
    Run {
        output: output.into_single().unwrap(),
        input_grad: input_grad.into_single().unwrap(),
        grads: grads(&layers),
        evaluated,
        backward_order: schedule.workers()[0]
            .iter()
            .filter(|a| a.pass == Pass::Backward)
            .map(|a| a.micro_batch)
            .collect(),
    }
}

fn check_bit_identical(
    model: fn() -> common::Layers,
    balance: &[usize],
    chunks: usize,
    mode: Checkpoint,
    drive: Drive,
    defer: bool,
) {
    let case = format!("balance {balance:?}, chunks {chunks}, {mode}, {drive:?}, defer {defer}");
    let run = run_pipe(model, balance, chunks, mode, drive, defer);
    let mut layers = model();
    let plan = pipe::MicroBatch::plan(BATCH, chunks).unwrap();
    let r = reference(
        &mut layers,
        &data(BATCH, 5, 7),
        &data(BATCH, 3, 8),
        &plan,
        &run.backward_order,
        0,
    );
    assert_eq!(run.output, cat(&r.outputs), "output, {case}");
    assert_eq!(
        run.input_grad,
        cat(&r.input_grads),
        "input gradient, {case}"
    );
    let expected = grads(&layers);
    assert_eq!(run.grads.len(), expected.len());
    for (k, (a, b)) in run.grads.iter().zip(&expected).enumerate() {
        assert_eq!(a, b, "parameter gradient {k}, {case}");
    }
    let evaluated = evaluate(&mut layers, &data(BATCH, 5, 7), &plan);
    assert_eq!(
        run.evaluated, evaluated,
        "evaluation after the step (running statistics), {case}"
    );
}

fn drives() -> [Drive; 3] {
    [
        Drive::Step(ScheduleKind::GPipe),
        Drive::Step(ScheduleKind::OneFOneB),
        Drive::Split,
    ]
}

#[test]
fn bit_identical_to_unpipelined_micro_batches_with_batch_norm() {
    for balance in BALANCES {
        for chunks in 1..=8 {
            for mode in MODES {
                for drive in drives() {
                    for defer in [false, true] {
                        check_bit_identical(bn_model, balance, chunks, mode, drive, defer);
                    }
                }
            }
        }
    }
}

#[test]
fn bit_identical_to_unpipelined_micro_batches_without_batch_norm() {
    for balance in BALANCES {
        for chunks in 1..=8 {
            for mode in MODES {
                for drive in drives() {
                    for defer in [false, true] {
                        check_bit_identical(plain_model, balance, chunks, mode, drive, defer);
                    }
                }
            }
        }
    }
}

#[test]
fn equal_to_the_whole_batch_model_within_1e_5() {
    let whole = pipe::MicroBatch::plan(BATCH, 1).unwrap();
    let mut layers = plain_model();
    let r = reference(
        &mut layers,
        &data(BATCH, 5, 7),
        &data(BATCH, 3, 8),
        &whole,
        &[0],
        0,
    );
    let expected = grads(&layers);
    for balance in BALANCES {
        for chunks in 1..=8 {
            for mode in MODES {
                for drive in drives() {
                    let case = format!("balance {balance:?}, chunks {chunks}, {mode}, {drive:?}");
                    let run = run_pipe(plain_model, balance, chunks, mode, drive, chunks % 2 == 0);
                    assert!(
                        relative(&run.output, &r.outputs[0]) <= 1e-5,
                        "output, {case}"
                    );
                    assert!(
                        relative(&run.input_grad, &r.input_grads[0]) <= 1e-5,
                        "input gradient, {case}"
                    );
                    for (k, (a, b)) in run.grads.iter().zip(&expected).enumerate() {
                        let rel = relative(a, b);
                        assert!(rel <= 1e-5, "parameter gradient {k}: {rel}, {case}");
                    }
                }
            }
        }
    }
}

#[test]
fn dropout_masks_follow_the_step_and_stay_independent_of_chunking() {
    // Two steps with chunks 3 and with chunks 1 draw the same masks per step; the second
    // step draws different masks from the first.
    let x = data(BATCH, 5, 7);
    let outputs = |chunks: usize| {
        let mut pipe = Pipe::builder(plain_model(), &[2, 2])
            .chunks(chunks)
            .seed(SEED)
            .build()
            .unwrap();
        let target = data(BATCH, 3, 8);
        (0..2)
            .map(|_| {
                let out = pipe
                    .step(Batch::single(x.clone()), |mb, out| mse(&target, mb, out))
                    .unwrap();
                pipe.zero_grad();
                out.output.into_single().unwrap()
            })
            .collect::<Vec<_>>()
    };
    let (three, one) = (outputs(3), outputs(1));
    assert_ne!(
        three[0], three[1],
        "step 1 draws new masks (the weights did not change)"
    );
    for (a, b) in three.iter().zip(&one) {
        assert!(relative(a, b) <= 1e-6);
    }
}

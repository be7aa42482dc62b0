//! A small residual network trained through a two-partition pipe: two residual blocks
//! whose skips go through `skip` (stash at the block's start, add at its end), the pipe
//! cut inside the second block so that its skip moves straight from the first partition
//! to the second. Synthetic regression data, plain SGD written here. Prints the loss and
//! the balance `balance_by_time` would pick; exits non-zero unless the loss falls by half.
//!
//! `cargo run --release -p pipe --example residual`

use std::process::ExitCode;

use pipe::balance::balance_by_time;
use pipe::cpu::{CpuTensor, Linear, ReLU};
use pipe::ndarray::{Array2, Axis};
use pipe::{residual, Batch, Checkpoint, Error, Layer, MicroBatch, Pipe, ScheduleKind};

const BATCH: usize = 256;
const INPUTS: usize = 8;
const WIDTH: usize = 32;
const STEPS: usize = 300;
const LEARNING_RATE: f32 = 0.05;

type Layers = Vec<Box<dyn Layer<CpuTensor>>>;

/// `Linear(8, 32)`, two residual blocks `x + Linear(ReLU(Linear(x)))`, `Linear(32, 1)`:
/// 12 layers, the skip ends counted.
fn model() -> Layers {
    let block = |seed: u64| -> Layers {
        vec![
            Box::new(Linear::new(WIDTH, WIDTH, seed)),
            Box::new(ReLU),
            Box::new(Linear::new(WIDTH, WIDTH, seed + 1)),
        ]
    };
    let mut layers: Layers = vec![Box::new(Linear::new(INPUTS, WIDTH, 1))];
    layers.extend(residual(block(10)));
    layers.extend(residual(block(20)));
    layers.push(Box::new(Linear::new(WIDTH, 1, 30)));
    layers
}

/// Inputs in [-1, 1) and a smooth non-linear target of them.
fn data() -> (CpuTensor, CpuTensor) {
    let stream = pipe::Stream::new(7, 0, 0);
    let x = Array2::from_shape_fn((BATCH, INPUTS), |(i, j)| {
        2.0 * stream.sample(i as u64).uniform(j as u64) - 1.0
    });
    let y = Array2::from_shape_fn((BATCH, 1), |(i, _)| {
        let r = x.row(i);
        (1.5 * r[0] - r[1]).sin() + 0.5 * r[2] * r[3] + 0.3 * r[4]
    });
    (CpuTensor::from(x), CpuTensor::from(y))
}

/// Mean squared error over the whole batch: this micro-batch's share of the loss and of
/// its gradient.
fn mse(
    target: &CpuTensor,
    mb: MicroBatch,
    out: &Batch<CpuTensor>,
) -> Result<(f32, Batch<CpuTensor>), Error> {
    let rows = target.array().slice_axis(Axis(0), mb.samples().into());
    let diff = out.tensor(0)?.array() - &rows;
    let loss = diff.iter().map(|d| 0.5 * d * d).sum::<f32>() / BATCH as f32;
    Ok((loss, Batch::single(CpuTensor::new(diff / BATCH as f32))))
}

fn sgd(pipe: &mut Pipe<CpuTensor>, lr: f32) {
    for layer in pipe.partitions_mut().iter_mut().flatten() {
        for p in layer.parameters_mut() {
            let step = p.grad.array() * lr;
            *p.value.array_mut() -= &step;
        }
    }
    pipe.zero_grad();
}

fn main() -> Result<ExitCode, Error> {
    let (x, y) = data();
    let mut layers = model();
    let sample = Batch::single(CpuTensor::from(
        x.array()
            .slice_axis(Axis(0), (0..BATCH / 4).into())
            .to_owned(),
    ));
    let suggested = balance_by_time(2, &mut layers, &sample, 3)?;
    println!("balance_by_time suggests {suggested:?} (profiled through the skips)");

    // Partition 0: Linear, block 1, and the start of block 2; partition 1: the rest, so
    // block 2's skip crosses from partition 0 to partition 1.
    let balance = [7, 5];
    let mut pipe = Pipe::builder(layers, &balance)
        .chunks(4)
        .checkpoint(Checkpoint::ExceptLast)
        .schedule(ScheduleKind::OneFOneB)
        .build()?;
    println!("training with balance {balance:?}, 4 micro-batches, 1F1B, except_last");

    let mut first = None;
    let mut last = f32::NAN;
    for step in 0..STEPS {
        let out = pipe.step(Batch::single(x.clone()), |mb, o| mse(&y, mb, o))?;
        last = out.losses.iter().sum();
        first.get_or_insert(last);
        sgd(&mut pipe, LEARNING_RATE);
        if step % 50 == 0 || step + 1 == STEPS {
            println!("step {step:3}  loss {last:.5}");
        }
    }
    let moves = pipe.skip_moves();
    println!(
        "skip moves: {} values and {} gradients between partitions ({} per step), {} recomputed stashes dropped",
        moves.values_sent,
        moves.grads_sent,
        moves.values_sent / STEPS,
        moves.recomputed_stashes_dropped
    );
    let first = first.unwrap_or(f32::NAN);
    if last <= first / 2.0 {
        println!("loss fell from {first:.5} to {last:.5}");
        Ok(ExitCode::SUCCESS)
    } else {
        eprintln!("loss did not fall by half: {first:.5} -> {last:.5}");
        Ok(ExitCode::FAILURE)
    }
}

//! A two-partition pipe trained for a few steps with 1F1B and checkpointing, checked
//! against the same layers run unpipelined on the whole batch after every step.
//!
//! `cargo run -p pipe --example two_stage`

use pipe::cpu::{CpuTensor, Dropout, Linear, ReLU};

use pipe::{Batch, Checkpoint, Error, Layer, MicroBatch, Pipe, ScheduleKind};

fn model() -> Vec<Box<dyn Layer<CpuTensor>>> {
    vec![
        Box::new(Linear::new(16, 32, 1)),
        Box::new(ReLU),
        Box::new(Dropout::new(0.1).expect("0.1 is a probability")),
        Box::new(Linear::new(32, 32, 2)),
        Box::new(ReLU),
        Box::new(Linear::new(32, 4, 3)),
    ]
}

/// Half the squared error against this micro-batch's rows of `target`.
fn mse(
    target: &CpuTensor,
    mb: MicroBatch,
    out: &Batch<CpuTensor>,
) -> Result<(f32, Batch<CpuTensor>), Error> {
    let rows = target
        .array()
        .slice_axis(pipe::ndarray::Axis(0), mb.samples().into());
    let grad = CpuTensor::new(out.tensor(0)?.array() - &rows);
    let loss = grad.array().iter().map(|g| 0.5 * g * g).sum();
    Ok((loss, Batch::single(grad)))
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

fn main() -> Result<(), Error> {
    let (batch, chunks) = (64, 8);
    let x = CpuTensor::new(
        pipe::ndarray::Array2::from_shape_fn((batch, 16), |(i, j)| {
            ((i * 7 + j * 3) % 11) as f32 / 11.0 - 0.5
        })
        .into_dyn(),
    );
    // A target the model can learn: a linear mix of the inputs.
    let target = CpuTensor::new(
        pipe::ndarray::Array2::from_shape_fn((batch, 4), |(i, j)| {
            2.0 * x.array()[[i, j]] - x.array()[[i, j + 4]]
        })
        .into_dyn(),
    );

    // Partition 0: Linear, ReLU, Dropout; partition 1: Linear, ReLU, Linear.
    let mut pipe = Pipe::builder(model(), &[3, 3])
        .chunks(chunks)
        .checkpoint(Checkpoint::ExceptLast)
        .schedule(ScheduleKind::OneFOneB)
        .seed(7)
        .build()?;
    // The same layers as one partition and one micro-batch: the unpipelined model.
    let mut plain = Pipe::builder(model(), &[6])
        .checkpoint(Checkpoint::Never)
        .seed(7)
        .build()?;

    let mut worst: f32 = 0.0;
    for step in 0..8 {
        let out = pipe.step(Batch::single(x.clone()), |mb, y| mse(&target, mb, y))?;
        let reference = plain.step(Batch::single(x.clone()), |mb, y| mse(&target, mb, y))?;
        let (loss, plain_loss): (f32, f32) =
            (out.losses.iter().sum(), reference.losses.iter().sum());
        let (y, y_plain) = (out.output.into_single()?, reference.output.into_single()?);
        let rel = y.max_abs_diff(&y_plain).unwrap_or(f32::INFINITY) / y_plain.max_abs();
        worst = worst.max(rel);
        println!("step {step}: loss {loss:.5} (unpipelined {plain_loss:.5}), outputs differ by {rel:.1e} relative");
        sgd(&mut pipe, 0.002);
        sgd(&mut plain, 0.002);
    }
    let memory: Vec<usize> = pipe.memory().iter().map(|m| m.peak).collect();
    println!("peak bytes held per partition in the last step (1F1B, except_last): {memory:?}");
    if worst > 1e-4 {
        eprintln!("pipelined and unpipelined runs drifted apart: {worst:.1e}");
        std::process::exit(1);
    }
    Ok(())
}

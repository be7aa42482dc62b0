//! Partitions on one GPU (feature `cuda`): what two partitions on two streams cost against
//! the same layers unpipelined on one stream, and what the executor costs per action.
//!
//! - **Step rows**: 8 × Linear(4096, 4096), batch 2048, `f32` (cuBLAS, no TF32), a
//!   training step (forward and backward of the whole batch). `unpipelined`: the layers
//!   called directly on the whole batch, on one stream, from one thread. `pipe`: two
//!   partitions of four layers on two streams of the same GPU, m = 8, GPipe and 1F1B,
//!   checkpoint `never`. The ratio is pipe time over unpipelined time; the goal is at
//!   most 1.10 (one GPU has nothing to gain from two partitions but memory: this row says
//!   what splitting costs).
//! - **Overhead row**: near-empty layers (8 × Linear(8, 8), batch 64, m = 8, GPipe), the
//!   pipelined step minus the same layer calls made directly on one stream, over the
//!   actions of the busiest partition. The goal is under 30 µs.
//!
//! Times are host times to a device synchronisation, best of `--reps N` (default 5) after
//! a warm-up. Without a CUDA driver it prints one `skipped:` line and exits 0. Every
//! figure line starts `pipe-cuda:`; `gpu-check/run.sh` puts them in its summary. Run by
//! `cargo bench -p pipe --features cuda --bench cuda_pipe -- [--reps N]`.

use std::hint::black_box;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pipe::cuda::{CudaTensor, Gpu, GpuStream, Linear};
use pipe::{
    Batch, Checkpoint, Context, Device, Error, Layer, MicroBatch, Phase, Pipe, Saved, ScheduleKind,
};

type Layers = Vec<Box<dyn Layer<CudaTensor>>>;

fn stack(streams: &[&Arc<GpuStream>], width: usize) -> Result<Layers, Error> {
    streams
        .iter()
        .enumerate()
        .map(|(i, s)| {
            Ok(Box::new(Linear::new(width, width, i as u64 + 1, s)?) as Box<dyn Layer<CudaTensor>>)
        })
        .collect()
}

fn values(len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
        .collect()
}

/// Best of `reps` timed calls of `f`, after one warm-up call; each call ends in a device
/// synchronisation.
fn best(
    gpu: &Gpu,
    reps: usize,
    mut f: impl FnMut() -> Result<(), Error>,
) -> Result<Duration, Error> {
    f()?;
    gpu.synchronize()?;
    let mut best = Duration::MAX;
    for _ in 0..reps {
        let start = Instant::now();
        f()?;
        gpu.synchronize()?;
        best = best.min(start.elapsed());
    }
    Ok(best)
}

/// The layers called directly on each micro-batch of `plan` in turn: forward through all,
/// backward through all with `dy` as the output gradient.
fn direct(
    layers: &mut Layers,
    x: &CudaTensor,
    plan: &[MicroBatch],
    dy: &[CudaTensor],
) -> Result<(), Error> {
    let parts = Batch::single(x.clone()).split_as(plan)?;
    for ((part, &mb), g) in parts.into_iter().zip(plan).zip(dy) {
        let mut h = part;
        let mut saved: Vec<Saved<CudaTensor>> = Vec::with_capacity(layers.len());
        for (l, layer) in layers.iter_mut().enumerate() {
            let mut ctx = Context::new(true, 0, 0, mb.len)
                .with_layer(l)
                .with_micro_batch(mb);
            let (y, s) = layer.forward(h, &mut ctx)?;
            saved.push(s);
            h = y;
        }
        let mut g = Batch::single(g.clone());
        for (l, layer) in layers.iter_mut().enumerate().rev() {
            let mut ctx = Context::new(true, 0, 0, mb.len)
                .with_layer(l)
                .with_micro_batch(mb)
                .with_phase(Phase::Backward);
            let s = saved.pop().expect("one saved state per layer");
            g = layer.backward(g, s, &mut ctx)?;
        }
        black_box(g);
    }
    Ok(())
}

fn pipe(layers: Layers, m: usize, kind: ScheduleKind) -> Result<Pipe<CudaTensor>, Error> {
    let half = layers.len() / 2;
    Pipe::builder(layers, &[half, half])
        .devices(vec![Device::Cuda(0); 2])
        .chunks(m)
        .checkpoint(Checkpoint::Never)
        .schedule(kind)
        .build()
}

/// A pipelined step with the output gradient `ones` (a tensor of the micro-batch's shape).
fn step(pipe: &mut Pipe<CudaTensor>, x: &CudaTensor, ones: &CudaTensor) -> Result<(), Error> {
    let out = pipe.step(Batch::single(x.clone()), |mb, _y| {
        let g = if mb.len == ones.shape()[0] {
            ones.clone()
        } else {
            CudaTensor::zeros(ones.home(), &[mb.len, ones.shape()[1]])?
        };
        Ok(((), Batch::single(g)))
    })?;
    black_box(out);
    Ok(())
}

fn run(reps: usize) -> Result<(), Error> {
    let gpu = match Gpu::new(0) {
        Ok(gpu) => gpu,
        Err(Error::CudaUnavailable(why)) => {
            println!("skipped: no CUDA device ({why})");
            return Ok(());
        }
        Err(e) => return Err(e),
    };
    let (one, s0, s1) = (gpu.stream()?, gpu.stream()?, gpu.stream()?);
    let (batch, width, m) = (2048, 4096, 8);
    println!("pipe-cuda: device {}", gpu.name());

    // Step rows.
    let x = CudaTensor::from_host(&one, &[batch, width], &values(batch * width))?;
    let whole = [MicroBatch {
        index: 0,
        offset: 0,
        len: batch,
    }];
    let dy_whole = [CudaTensor::from_host(
        &one,
        &[batch, width],
        &vec![1.0; batch * width],
    )?];
    let mut layers = stack(&[&one; 8], width)?;
    let unpipelined = best(&gpu, reps, || direct(&mut layers, &x, &whole, &dy_whole))?;
    drop(layers);
    let flops = 8.0 * 3.0 * 2.0 * (batch * width * width) as f64;
    println!(
        "pipe-cuda: 8 x Linear({width}), batch {batch}: unpipelined on one stream {:.2} ms ({:.1} TFLOP/s)",
        unpipelined.as_secs_f64() * 1e3,
        flops / unpipelined.as_secs_f64() / 1e12
    );
    let ones = CudaTensor::from_host(&s1, &[batch / m, width], &vec![1.0; batch / m * width])?;
    let mut ratios = Vec::new();
    for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
        let layers = stack(&[&s0, &s0, &s0, &s0, &s1, &s1, &s1, &s1], width)?;
        let mut p = pipe(layers, m, kind)?;
        let t = best(&gpu, reps, || step(&mut p, &x, &ones))?;
        let ratio = t.as_secs_f64() / unpipelined.as_secs_f64();
        println!(
            "pipe-cuda: 2 partitions on 2 streams, m = {m}, {kind}, never: {:.2} ms, {ratio:.3} x unpipelined (goal <= 1.10: {})",
            t.as_secs_f64() * 1e3,
            if ratio <= 1.10 { "met" } else { "NOT met" }
        );
        ratios.push(ratio);
    }
    drop((x, dy_whole, ones));

    // Overhead row.
    let (batch, width) = (64, 8);
    let plan = MicroBatch::plan(batch, m)?;
    let x = CudaTensor::from_host(&one, &[batch, width], &values(batch * width))?;
    let dy: Vec<CudaTensor> = plan
        .iter()
        .map(|mb| CudaTensor::from_host(&one, &[mb.len, width], &vec![1.0; mb.len * width]))
        .collect::<Result<_, _>>()?;
    let mut layers = stack(&[&one; 8], width)?;
    let direct_t = best(&gpu, reps * 4, || direct(&mut layers, &x, &plan, &dy))?;
    let ones = CudaTensor::from_host(&s1, &[batch / m, width], &vec![1.0; batch / m * width])?;
    let layers = stack(&[&s0, &s0, &s0, &s0, &s1, &s1, &s1, &s1], width)?;
    let mut p = pipe(layers, m, ScheduleKind::GPipe)?;
    let piped = best(&gpu, reps * 4, || step(&mut p, &x, &ones))?;
    let actions = 2 * m;
    let per_action = (piped.as_secs_f64() - direct_t.as_secs_f64()) / actions as f64 * 1e6;
    println!(
        "pipe-cuda: overhead {per_action:.1} us per action ({actions} actions on the busiest partition; 8 x Linear({width}), batch {batch}, m = {m}: pipelined {:.1} us, direct {:.1} us a step) (goal < 30: {})",
        piped.as_secs_f64() * 1e6,
        direct_t.as_secs_f64() * 1e6,
        if per_action < 30.0 { "met" } else { "NOT met" }
    );
    Ok(())
}

fn main() -> ExitCode {
    let mut reps = 5;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--bench" => {}
            "--reps" => match args.next().and_then(|v| v.parse().ok()) {
                Some(n) if n > 0 => reps = n,
                _ => {
                    eprintln!("--reps takes a positive count");
                    return ExitCode::from(2);
                }
            },
            other => {
                eprintln!("unknown argument `{other}` (the bench takes --reps N)");
                return ExitCode::from(2);
            }
        }
    }
    match run(reps) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pipe-cuda: error: {e}");
            ExitCode::FAILURE
        }
    }
}

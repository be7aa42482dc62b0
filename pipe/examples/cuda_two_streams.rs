//! Two partitions on two streams of one GPU (feature `cuda`), checked bit for bit against
//! the same layers as one partition on one stream, with the device memory each held.
//!
//! `cargo run --release -p pipe --features cuda --example cuda_two_streams`; without a
//! CUDA driver it prints one `skipped:` line and exits 0.

use std::process::ExitCode;
use std::sync::Arc;

use pipe::cuda::{CudaTensor, Dropout, Gpu, GpuStream, Linear, ReLU};
use pipe::{Batch, Checkpoint, Device, Error, Layer, Pipe, ScheduleKind};

/// Linear, ReLU, Dropout, Linear, ReLU, Linear; layer `i` on `streams[i]`.
fn model(streams: [&Arc<GpuStream>; 6]) -> Result<Vec<Box<dyn Layer<CudaTensor>>>, Error> {
    Ok(vec![
        Box::new(Linear::new(256, 512, 1, streams[0])?),
        Box::new(ReLU::new(streams[1])),
        Box::new(Dropout::new(0.1, streams[2])?),
        Box::new(Linear::new(512, 512, 2, streams[3])?),
        Box::new(ReLU::new(streams[4])),
        Box::new(Linear::new(512, 10, 3, streams[5])?),
    ])
}

/// One training step (loss ½‖y‖²); the output and the input gradient on the host.
fn step(
    layers: Vec<Box<dyn Layer<CudaTensor>>>,
    balance: &[usize],
    x: &CudaTensor,
) -> Result<(Vec<f32>, Vec<f32>), Error> {
    let mut pipe = Pipe::builder(layers, balance)
        .devices(vec![Device::Cuda(0); balance.len()])
        .chunks(8)
        .checkpoint(Checkpoint::ExceptLast)
        .schedule(ScheduleKind::OneFOneB)
        .seed(7)
        .build()?;
    let out = pipe.step(Batch::single(x.clone()), |_mb, y| {
        Ok(((), Batch::single(y.tensor(0)?.clone())))
    })?;
    Ok((
        out.output.into_single()?.to_host()?,
        out.input_grad.into_single()?.to_host()?,
    ))
}

fn run() -> Result<(), Error> {
    let gpu = match Gpu::new(0) {
        Ok(gpu) => gpu,
        Err(Error::CudaUnavailable(why)) => {
            println!("skipped: no CUDA device ({why})");
            return Ok(());
        }
        Err(e) => return Err(e),
    };
    let input = gpu.stream()?;
    let data: Vec<f32> = (0..512 * 256)
        .map(|i| ((i % 97) as f32 - 48.0) / 64.0)
        .collect();
    let x = CudaTensor::from_host(&input, &[512, 256], &data)?;

    let one = gpu.stream()?;
    let reference = step(model([&one; 6])?, &[6], &x)?;
    let (s0, s1) = (gpu.stream()?, gpu.stream()?);
    let split = step(model([&s0, &s0, &s0, &s1, &s1, &s1])?, &[3, 3], &x)?;
    let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits());
    println!(
        "{}: 2 partitions on 2 streams against 1 partition, 1F1B, m = 8: output {}, input gradient {}; \
         device memory peak {:.1} MiB (stream 0 {:.1}, stream 1 {:.1})",
        gpu.name(),
        if same(&split.0, &reference.0) { "bit-identical" } else { "DIFFERS" },
        if same(&split.1, &reference.1) { "bit-identical" } else { "DIFFERS" },
        gpu.peak_bytes() as f64 / 1048576.0,
        s0.peak_bytes() as f64 / 1048576.0,
        s1.peak_bytes() as f64 / 1048576.0,
    );
    if same(&split.0, &reference.0) && same(&split.1, &reference.1) {
        Ok(())
    } else {
        Err(Error::Cuda(
            "the two-stream pipe differs from one partition".into(),
        ))
    }
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cuda_two_streams: {e}");
            ExitCode::FAILURE
        }
    }
}

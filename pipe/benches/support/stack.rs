//! What both pipe benchmarks share: the stack of Linear(1024) + ReLU blocks, its input,
//! the loss, one unpipelined step, and the timing helpers.
#![allow(dead_code)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use pipe::cpu::{CpuTensor, Linear, ReLU};
use pipe::{Batch, Context, Error, Layer, MicroBatch, Phase, Saved};

pub type Layers = Vec<Box<dyn Layer<CpuTensor>>>;

/// `blocks` × (Linear(width, width) + ReLU).
pub fn stack(blocks: usize, width: usize) -> Layers {
    (0..blocks)
        .flat_map(|b| -> [Box<dyn Layer<CpuTensor>>; 2] {
            [
                Box::new(Linear::new(width, width, b as u64)),
                Box::new(ReLU),
            ]
        })
        .collect()
}

pub fn input(rows: usize, width: usize) -> CpuTensor {
    let stream = pipe::Stream::new(1, 0, 0);
    CpuTensor::new(
        pipe::ndarray::Array2::from_shape_fn((rows, width), |(i, j)| {
            stream.sample(i as u64).uniform(j as u64) - 0.5
        })
        .into_dyn(),
    )
}

/// The loss: the sum of the outputs, whose gradient is all ones.
pub fn ones_loss(_mb: MicroBatch, out: &Batch<CpuTensor>) -> Result<((), Batch<CpuTensor>), Error> {
    let shape = out.tensor(0)?.shape().to_vec();
    Ok(((), Batch::single(CpuTensor::ones(&shape))))
}

/// One training step of `layers` unpipelined on one thread: every layer forward on the
/// micro-batch, then every layer backward.
pub fn direct_step(layers: &mut [Box<dyn Layer<CpuTensor>>], x: &CpuTensor, mb: MicroBatch) {
    let mut h = Batch::single(x.clone());
    let mut saved: Vec<Saved<CpuTensor>> = Vec::with_capacity(layers.len());
    for (l, layer) in layers.iter_mut().enumerate() {
        let mut ctx = Context::new(true, 0, 0, mb.len)
            .with_layer(l)
            .with_micro_batch(mb);
        let (y, s) = layer.forward(h, &mut ctx).expect("forward");
        saved.push(s);
        h = y;
    }
    let (_, mut g) = ones_loss(mb, &h).expect("loss");
    for (l, layer) in layers.iter_mut().enumerate().rev() {
        let mut ctx = Context::new(true, 0, 0, mb.len)
            .with_layer(l)
            .with_micro_batch(mb)
            .with_phase(Phase::Backward);
        let s = saved.pop().expect("saved state");
        g = layer.backward(g, s, &mut ctx).expect("backward");
    }
    black_box(g);
}

/// Whether the machine has AVX-512F.
pub fn avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Best of `reps` calls of `f`, after one warm-up call.
pub fn best(reps: usize, mut f: impl FnMut()) -> Duration {
    f();
    (0..reps)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed()
        })
        .min()
        .unwrap_or_default()
}

/// The 1-minute load average, as a JSON number (`null` where unknown).
pub fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_owned))
        .filter(|l| l.parse::<f64>().is_ok())
        .unwrap_or_else(|| "null".into())
}

pub fn zero(layers: &mut [Box<dyn Layer<CpuTensor>>]) {
    layers.iter_mut().for_each(|l| l.zero_grad());
}

/// The workspace's target directory (`CARGO_TARGET_DIR`, or `target/` beside the crates),
/// where the benches write their pictures and traces. The package folder is read at run
/// time (`CARGO_MANIFEST_DIR`, which `cargo bench` sets for the bench it runs, else the
/// current directory, which cargo makes the package folder), not at compile time: with
/// a target directory shared by two clones, one compiled bench would otherwise write
/// into the clone it was built from.
pub fn target_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::env::var_os("CARGO_MANIFEST_DIR")
                .map(std::path::PathBuf::from)
                .or_else(|| std::env::current_dir().ok())
                .unwrap_or_else(|| std::path::PathBuf::from("."))
                .join("..")
                .join("target")
        })
}

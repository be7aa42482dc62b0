//! The model, data, loss and optimiser shared by the pipeline × data parallel tests
//! (`pipeline.rs`: both partitions on every rank; `pipeline_mesh.rs`: stages on ranks).

use collectives::ProcessGroup;
use ddp_hooks::{CommHook, HookSpec};
use lowrank::{CpuBackend, NormalRng};
use pipe::cpu::{CpuTensor, Linear, ReLU};
use pipe::ndarray::Axis;
use pipe::{Batch, Layer, MicroBatch, Pipe};
use std::sync::Arc;

pub const IN: usize = 6;
pub const HIDDEN: usize = 8;
pub const OUT: usize = 3;
/// Partition (stage) 0: Linear, ReLU; partition 1: Linear, ReLU, Linear.
pub const BALANCE: [usize; 2] = [2, 3];
pub const LR: f32 = 0.1;

/// Linear, ReLU, Linear, ReLU, Linear through `widths`, seeded from `seed`.
pub fn model(widths: [usize; 4], seed: u64) -> Vec<Box<dyn Layer<CpuTensor>>> {
    vec![
        Box::new(Linear::new(widths[0], widths[1], seed)),
        Box::new(ReLU),
        Box::new(Linear::new(widths[1], widths[2], seed + 1)),
        Box::new(ReLU),
        Box::new(Linear::new(widths[2], widths[3], seed + 2)),
    ]
}

/// The tests' model: `IN → HIDDEN → HIDDEN → OUT`.
pub fn small() -> Vec<Box<dyn Layer<CpuTensor>>> {
    model([IN, HIDDEN, HIDDEN, OUT], 10)
}

pub fn normal(shape: &[usize], seed: u64) -> CpuTensor {
    let mut v = vec![0.0; shape.iter().product()];
    NormalRng::new(seed).fill(&mut v);
    CpuTensor::from_shape_vec(shape, v).unwrap()
}

/// `n` samples of inputs and targets for rank (or replica) `who` at step `step`.
pub fn data(n: usize, who: usize, step: usize) -> (CpuTensor, CpuTensor) {
    let seed = 1000 * step as u64 + who as u64;
    (normal(&[n, IN], 2 * seed), normal(&[n, OUT], 2 * seed + 1))
}

/// The loss `½ Σ (y − t)² / denom` of micro-batch `mb` (rows of `target`) and its output
/// gradient, scaled by `scale`.
pub fn mse(
    target: &CpuTensor,
    denom: usize,
    scale: f32,
    mb: MicroBatch,
    y: &Batch<CpuTensor>,
) -> Result<(f32, Batch<CpuTensor>), pipe::Error> {
    let y = y.tensor(0)?.array();
    let t = target.array().slice_axis(Axis(0), mb.samples().into());
    let diff = y - &t;
    let loss = 0.5 * diff.iter().map(|d| d * d).sum::<f32>() / denom as f32;
    let grad = diff.mapv(|d| d * scale / denom as f32);
    Ok((loss, Batch::single(CpuTensor::new(grad))))
}

/// One SGD step (`LR`) of every parameter this pipe holds, then the gradients zeroed.
pub fn sgd(pipe: &mut Pipe<CpuTensor>) {
    for layer in pipe.partitions_mut().iter_mut().flatten() {
        for p in layer.parameters_mut() {
            let g = p.grad.array().clone();
            p.value.array_mut().scaled_add(-LR, &g);
        }
    }
    pipe.zero_grad();
}

/// `max |a − b| / max |b|`.
pub fn rel(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let diff = a
        .iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
    diff / b.iter().fold(0.0f32, |m, y| m.max(y.abs()))
}

/// `parts` stacked along the sample axis.
pub fn concat(parts: &[CpuTensor]) -> CpuTensor {
    let views: Vec<_> = parts.iter().map(|p| p.array().view()).collect();
    CpuTensor::new(pipe::ndarray::concatenate(Axis(0), &views).unwrap())
}

/// The all-reduce hook over `group`, on the CPU.
pub fn allreduce(group: Arc<dyn ProcessGroup>) -> Box<dyn CommHook<CpuBackend>> {
    HookSpec::AllReduce
        .build(Arc::new(CpuBackend::new()), group)
        .unwrap()
}

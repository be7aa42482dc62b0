//! Deferred batch norm (§7 rows 14 and 22): with `deferred_batch_norm(true)` the running
//! statistics after a step equal plain batch norm's over the whole batch (within 1e-6
//! relative), for chunk counts that divide the batch and that do not, every checkpoint
//! mode and both schedules, step after step; evaluation uses the committed statistics.

mod common;

use common::*;
use pipe::cpu::{BatchNorm, CpuTensor, Linear, ReLU};
use pipe::{Batch, Checkpoint, Context, Layer, MicroBatch, Pipe, ScheduleKind};

const BATCH: usize = 12;
const FEATURES: usize = 6;

/// Linear, batch norm (watched), ReLU, Linear.
fn model() -> (Layers, Watched) {
    let bn = Watched::new(BatchNorm::new(FEATURES));
    let layers: Layers = vec![
        Box::new(Linear::new(5, FEATURES, 31)),
        Box::new(bn.clone()),
        Box::new(ReLU),
        Box::new(Linear::new(FEATURES, 3, 32)),
    ];
    (layers, bn)
}

/// Inputs whose features have means well away from zero, so the running means are not
/// tiny numbers compared by a relative bound.
fn input(step: usize) -> CpuTensor {
    let x = data(BATCH, 5, 100 + step as u64);
    CpuTensor::new(x.array().mapv(|v| 2.0 * v + 1.5))
}

/// Plain batch norm over the whole batch, step after step: the reference statistics.
struct Reference {
    linear: Linear,
    bn: BatchNorm,
}

impl Reference {
    fn new() -> Self {
        Reference {
            linear: Linear::new(5, FEATURES, 31),
            bn: BatchNorm::new(FEATURES),
        }
    }

    fn step(&mut self, x: &CpuTensor, step: u64) {
        let mut ctx = Context::new(true, SEED, step, BATCH);
        let h = self
            .linear
            .forward(Batch::single(x.clone()), &mut ctx)
            .unwrap()
            .0;
        self.bn.forward(h, &mut ctx.with_layer(1)).unwrap();
    }

    /// Evaluation of the first two layers.
    fn eval(&mut self, x: &CpuTensor) -> CpuTensor {
        let mut ctx = Context::new(false, SEED, 0, BATCH);
        let h = self
            .linear
            .forward(Batch::single(x.clone()), &mut ctx)
            .unwrap()
            .0;
        self.bn
            .forward(h, &mut ctx)
            .unwrap()
            .0
            .into_single()
            .unwrap()
    }
}

fn check_stats(got: &BatchNorm, want: &BatchNorm, case: &str) {
    let mean = relative(got.running_mean(), want.running_mean());
    let var = relative(got.running_var(), want.running_var());
    assert!(mean <= 1e-6, "running mean off by {mean:e}, {case}");
    assert!(var <= 1e-6, "running var off by {var:e}, {case}");
}

#[test]
fn running_statistics_equal_plain_batch_norm_over_the_whole_batch() {
    // 1, 2, 3, 4, 6 and 12 divide 12; 5 and 7 do not; 16 > 12 gives 12 micro-batches.
    for chunks in [1, 2, 3, 4, 5, 6, 7, 12, 16] {
        for mode in [
            Checkpoint::Always,
            Checkpoint::ExceptLast,
            Checkpoint::Never,
        ] {
            for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
                let case = format!("chunks {chunks}, {mode}, {kind}");
                let (layers, bn) = model();
                let mut pipe = Pipe::builder(layers, &[2, 2])
                    .chunks(chunks)
                    .checkpoint(mode)
                    .schedule(kind)
                    .deferred_batch_norm(true)
                    .seed(SEED)
                    .build()
                    .unwrap();
                assert!(bn.get().is_deferred());
                let mut reference = Reference::new();
                for step in 0..3 {
                    let x = input(step);
                    pipe.step(Batch::single(x.clone()), sum_loss).unwrap();
                    reference.step(&x, step as u64);
                    check_stats(&bn.get(), &reference.bn, &format!("{case}, step {step}"));
                }
                // Evaluation normalises with the committed statistics.
                let x = input(9);
                pipe.eval();
                let mut probe = Pipe::builder(
                    vec![
                        Box::new(Linear::new(5, FEATURES, 31)) as Box<dyn Layer<CpuTensor>>,
                        Box::new(bn.get().clone()),
                    ],
                    &[2],
                )
                .build()
                .unwrap();
                probe.eval();
                let got = probe
                    .forward(Batch::single(x.clone()))
                    .unwrap()
                    .into_single()
                    .unwrap();
                let want = reference.eval(&x);
                assert!(relative(&got, &want) <= 1e-6, "evaluation, {case}");
            }
        }
    }
}

/// Without deferral, statistics follow each micro-batch (torchgpipe's plain batch norm),
/// which is what deferral fixes.
#[test]
fn plain_batch_norm_differs_with_several_micro_batches() {
    let (layers, bn) = model();
    let mut pipe = Pipe::builder(layers, &[2, 2]).chunks(4).build().unwrap();
    let mut reference = Reference::new();
    pipe.step(Batch::single(input(0)), sum_loss).unwrap();
    reference.step(&input(0), 0);
    assert!(!bn.get().is_deferred());
    let var = relative(bn.get().running_var(), reference.bn.running_var());
    assert!(
        var > 1e-4,
        "per-micro-batch statistics are not the whole batch's: {var:e}"
    );
}

/// A forward pass alone commits (the split GPipe run); its backward, and a recomputation
/// under checkpointing, add nothing.
#[test]
fn a_split_forward_commits_once_and_recomputation_does_not_count() {
    let (layers, bn) = model();
    let mut pipe = Pipe::builder(layers, &[1, 3])
        .chunks(5)
        .checkpoint(Checkpoint::Always)
        .deferred_batch_norm(true)
        .seed(SEED)
        .build()
        .unwrap();
    let mut reference = Reference::new();
    let y = pipe.forward(Batch::single(input(0))).unwrap();
    reference.step(&input(0), 0);
    check_stats(&bn.get(), &reference.bn, "after forward");
    pipe.backward(Batch::single(CpuTensor::ones(y.tensor(0).unwrap().shape())))
        .unwrap();
    check_stats(&bn.get(), &reference.bn, "after backward (recomputed)");
}

/// Outside a pipe (one micro-batch per call), a deferred batch norm is a plain one.
#[test]
fn alone_a_deferred_batch_norm_commits_every_call() {
    let (mut plain, mut deferred) = (BatchNorm::new(3), BatchNorm::deferred(3));
    let x = CpuTensor::new(data(8, 3, 5).array().mapv(|v| v + 0.5));
    let mb = MicroBatch {
        index: 0,
        offset: 0,
        len: 8,
    };
    for step in 0..2 {
        let mut ctx = Context::new(true, 0, step, 8).with_micro_batch(mb);
        plain.forward(Batch::single(x.clone()), &mut ctx).unwrap();
        deferred
            .forward(Batch::single(x.clone()), &mut ctx)
            .unwrap();
    }
    check_stats(&deferred, &plain, "alone");
}

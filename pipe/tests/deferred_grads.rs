//! Deferred weight gradients ([`PipeBuilder::defer_weight_grads`](pipe::PipeBuilder)):
//! complete before a partition reports them final, counted as held memory until then and
//! released after, flushed after a failed run, dropped by `zero_grad`; and `Linear`'s
//! transposed weight copy follows weight updates. (Bit-identical gradients against the
//! unpipelined reference: `transparency.rs`.)

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use pipe::cpu::{CpuTensor, Linear};
use pipe::{Batch, Checkpoint, Context, Error, Layer, Pass, Phase, Pipe, ScheduleKind, SpanKind};

const BATCH: usize = 12;
const CHUNKS: usize = 4;
const BALANCE: [usize; 2] = [2, 2];

fn pipe(kind: ScheduleKind, mode: Checkpoint, defer: bool) -> Pipe<CpuTensor> {
    Pipe::builder(plain_model(), &BALANCE)
        .chunks(CHUNKS)
        .checkpoint(mode)
        .schedule(kind)
        .seed(SEED)
        .defer_weight_grads(defer)
        .build()
        .unwrap()
}

fn step(pipe: &mut Pipe<CpuTensor>) -> Result<(), Error> {
    let target = data(BATCH, 3, 8);
    pipe.step(Batch::single(data(BATCH, 5, 7)), |mb, y| {
        mse(&target, mb, y)
    })
    .map(|_| ())
}

fn partition_grads(layers: &[Box<dyn Layer<CpuTensor>>]) -> Vec<CpuTensor> {
    grads(layers)
}

#[test]
fn gradients_are_complete_when_a_partition_reports_them_final() {
    for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
        for mode in [Checkpoint::Never, Checkpoint::Always] {
            let mut p = pipe(kind, mode, true);
            type Seen = Vec<(usize, Vec<CpuTensor>, usize)>;
            let seen: Arc<Mutex<Seen>> = Arc::default();
            let log = Arc::clone(&seen);
            p.on_gradients_final(move |j, layers| {
                let deferred = layers.iter().map(|l| l.deferred_bytes()).sum();
                log.lock()
                    .unwrap()
                    .push((j, partition_grads(layers), deferred));
            });
            step(&mut p).unwrap();
            let seen = seen.lock().unwrap();
            assert_eq!(seen.len(), BALANCE.len(), "{kind}, {mode}");
            for (j, got, deferred) in seen.iter() {
                assert_eq!(*deferred, 0, "{kind}, {mode}: partition {j} flushed");
                let now = partition_grads(&p.partitions()[*j]);
                assert_eq!(got, &now, "{kind}, {mode}: partition {j}'s final gradients");
                assert!(now.iter().any(|g| g.max_abs() > 0.0));
            }
        }
    }
}

/// Bytes of each Linear's input and output gradient over every micro-batch, per partition:
/// what a deferring partition holds at its last backward action.
fn deferred_per_partition() -> Vec<usize> {
    let widths = [(5, 8), (8, 3)]; // plain_model's Linears, one per partition
    widths
        .iter()
        .map(|&(i, o)| BATCH * (i + o) * std::mem::size_of::<f32>())
        .collect()
}

#[test]
fn deferred_bytes_are_held_until_the_flush_and_released_after() {
    let expected = deferred_per_partition();
    for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
        for mode in [
            Checkpoint::Never,
            Checkpoint::ExceptLast,
            Checkpoint::Always,
        ] {
            let (mut on, mut off) = (pipe(kind, mode, true), pipe(kind, mode, false));
            step(&mut on).unwrap();
            step(&mut off).unwrap();
            for (j, (a, b)) in on.memory().iter().zip(off.memory()).enumerate() {
                let case = format!("{kind}, {mode}, partition {j}");
                assert_eq!((a.held, a.deferred), (0, 0), "{case}: released");
                assert!(
                    a.peak >= expected[j],
                    "{case}: {} < {}",
                    a.peak,
                    expected[j]
                );
                assert!(a.peak <= b.peak + expected[j], "{case}: counted once");
                assert_eq!(b.deferred, 0);
            }
            for layer in on.partitions().iter().flatten() {
                assert_eq!(layer.deferred_bytes(), 0, "{kind}, {mode}");
            }
        }
    }
}

#[test]
fn the_split_backward_flushes_too() {
    let mut p = pipe(ScheduleKind::GPipe, Checkpoint::ExceptLast, true);
    let mut q = pipe(ScheduleKind::GPipe, Checkpoint::ExceptLast, false);
    for p in [&mut p, &mut q] {
        p.forward(Batch::single(data(BATCH, 5, 7))).unwrap();
        assert!(p.memory().iter().all(|m| m.deferred == 0));
        p.backward(Batch::single(data(BATCH, 3, 8))).unwrap();
        assert!(p.memory().iter().all(|m| m.held == 0 && m.deferred == 0));
    }
    let all = |p: &Pipe<CpuTensor>| {
        p.partitions()
            .iter()
            .flat_map(|l| partition_grads(l))
            .collect::<Vec<_>>()
    };
    assert_eq!(all(&p), all(&q), "same gradients, bit for bit");
}

#[test]
fn the_record_shows_each_flush_after_its_partitions_last_backward() {
    let mut p = pipe(ScheduleKind::OneFOneB, Checkpoint::Never, true);
    p.set_record(true);
    step(&mut p).unwrap();
    let record = p.take_record().unwrap();
    for (w, spans) in record.workers().iter().enumerate() {
        let flushes: Vec<_> = spans
            .iter()
            .filter(|s| s.kind == SpanKind::WeightGrad)
            .collect();
        assert_eq!(flushes.len(), 1, "worker {w}");
        let last_backward = spans
            .iter()
            .filter(|s| s.kind == SpanKind::Backward)
            .map(|s| s.end)
            .max()
            .unwrap();
        assert!(flushes[0].start >= last_backward, "worker {w}");
        assert_eq!(flushes[0].action.pass, Pass::Backward);
    }
    // Without deferral there is nothing to flush.
    let mut q = pipe(ScheduleKind::OneFOneB, Checkpoint::Never, false);
    q.set_record(true);
    step(&mut q).unwrap();
    let record = q.take_record().unwrap();
    assert!(record
        .workers()
        .iter()
        .flatten()
        .all(|s| s.kind != SpanKind::WeightGrad));
}

#[test]
fn a_failed_run_adds_what_completed_and_holds_nothing() {
    let mut p = pipe(ScheduleKind::OneFOneB, Checkpoint::Never, true);
    let target = data(BATCH, 3, 8);
    // 1F1B runs micro-batch 0's backward before micro-batch 2's loss, which fails.
    let err = p
        .step(Batch::single(data(BATCH, 5, 7)), |mb, y| {
            if mb.index == 2 {
                return Err(Error::NotTraining);
            }
            mse(&target, mb, y)
        })
        .unwrap_err();
    assert!(matches!(err, Error::Failed { .. }), "{err}");
    for layer in p.partitions().iter().flatten() {
        assert_eq!(layer.deferred_bytes(), 0);
    }
    assert!(p.memory().iter().all(|m| m.held == 0 && m.deferred == 0));
    let added = p
        .partitions()
        .iter()
        .flat_map(|l| partition_grads(l))
        .any(|g| g.max_abs() > 0.0);
    assert!(
        added,
        "the completed backward actions' gradients were added"
    );
}

fn backward_ctx(rows: usize, defer: bool) -> Context {
    Context::new(true, 0, 0, rows)
        .with_phase(Phase::Backward)
        .with_deferred_weight_grads(defer)
}

#[test]
fn linear_defers_only_when_its_context_allows_and_zero_grad_drops_the_work() {
    let (x, dy) = (data(6, 5, 1), data(6, 4, 2));
    let run = |layer: &mut Linear, defer: bool| {
        let mut ctx = Context::new(true, 0, 0, 6);
        let (_, saved) = layer.forward(Batch::single(x.clone()), &mut ctx).unwrap();
        layer
            .backward(
                Batch::single(dy.clone()),
                saved,
                &mut backward_ctx(6, defer),
            )
            .unwrap()
    };
    let mut now = Linear::new(5, 4, 3);
    let mut later = Linear::new(5, 4, 3);
    let dx_now = run(&mut now, false);
    let dx_later = run(&mut later, true);
    assert_eq!(dx_now, dx_later, "the input gradient does not wait");
    assert_eq!(now.deferred_bytes(), 0);
    assert_eq!(later.deferred_bytes(), (6 * 5 + 6 * 4) * 4);
    assert_eq!(
        later.parameters()[0].grad.max_abs(),
        0.0,
        "weight: deferred"
    );
    assert_eq!(
        later.parameters()[1].grad,
        now.parameters()[1].grad,
        "bias: added at once"
    );
    later.flush_grads().unwrap();
    assert_eq!(later.deferred_bytes(), 0);
    assert_eq!(grads_of(&later), grads_of(&now));
    // A second flush adds nothing.
    later.flush_grads().unwrap();
    assert_eq!(grads_of(&later), grads_of(&now));

    run(&mut later, true);
    later.zero_grad();
    assert_eq!(later.deferred_bytes(), 0);
    later.flush_grads().unwrap();
    assert!(grads_of(&later).iter().all(|g| g.max_abs() == 0.0));
}

fn grads_of(layer: &Linear) -> Vec<CpuTensor> {
    layer.parameters().iter().map(|p| p.grad.clone()).collect()
}

#[test]
fn linear_forward_follows_weight_updates() {
    // 8 rows: the forward pass streams the transposed weight copy.
    let x = data(8, 5, 4);
    let forward = |layer: &mut Linear| {
        let mut ctx = Context::new(true, 0, 0, 8);
        layer.forward(Batch::single(x.clone()), &mut ctx).unwrap().0
    };
    let mut layer = Linear::new(5, 3, 1);
    let before = forward(&mut layer);
    for p in layer.parameters_mut() {
        if p.name == "weight" {
            p.value.array_mut().mapv_inplace(|v| 2.0 * v + 0.25);
        }
    }
    let after = forward(&mut layer);
    let weight = layer.weight().array().clone();
    let bias = layer.bias().array().clone();
    let mut fresh = Linear::from_parts(
        weight.into_dimensionality().unwrap(),
        bias.into_dimensionality().unwrap(),
    )
    .unwrap();
    assert_eq!(after, forward(&mut fresh), "the updated weight is used");
    assert_ne!(before, after);
}

//! Checkpointing and evaluation (§7 rows 7-9 and 17-20): which micro-batches recompute,
//! the flags a layer sees, the backward order, and exact random replay.

mod common;

use common::*;
use pipe::cpu::{CpuTensor, Dropout, Linear};
use pipe::{Batch, Checkpoint, Context, Error, Layer, Phase, Pipe, ScheduleKind};

fn probes(n: usize, log: &Log) -> Vec<Box<dyn Layer<CpuTensor>>> {
    (0..n)
        .map(|j| Box::new(Probe::new(j, log)) as Box<dyn Layer<CpuTensor>>)
        .collect()
}

fn count(log: &Log, tag: usize, phase: Phase) -> usize {
    events(log)
        .iter()
        .filter(|e| e.tag == tag && e.phase == phase)
        .count()
}

#[test]
fn checkpoint_counts_per_mode() {
    // torchgpipe's test_checkpoint_mode: chunks 2 gives 2 / 1 / 0 checkpoints.
    for (mode, expected) in [
        (Checkpoint::Always, 2),
        (Checkpoint::ExceptLast, 1),
        (Checkpoint::Never, 0),
    ] {
        let log = new_log();
        let mut pipe = Pipe::builder(probes(2, &log), &[1, 1])
            .chunks(2)
            .checkpoint(mode)
            .build()
            .unwrap();
        pipe.step(Batch::single(data(2, 3, 1)), sum_loss).unwrap();
        for tag in 0..2 {
            assert_eq!(
                count(&log, tag, Phase::Recompute),
                expected,
                "{mode}, partition {tag}"
            );
            let checkpointed = events(&log)
                .iter()
                .filter(|e| e.tag == tag && e.checkpointing)
                .count();
            assert_eq!(checkpointed, expected, "{mode}, partition {tag}");
        }
    }
}

#[test]
fn checkpoint_stop_uses_the_actual_micro_batch_count() {
    // chunks 4 on a batch of 2 gives 2 micro-batches; except_last checkpoints only the first
    // (torchgpipe computes the stop from `chunks` and checkpoints both).
    let log = new_log();
    let mut pipe = Pipe::builder(probes(1, &log), &[1])
        .chunks(4)
        .build()
        .unwrap();
    assert_eq!(pipe.checkpoint(), Checkpoint::ExceptLast);
    pipe.step(Batch::single(data(2, 3, 1)), sum_loss).unwrap();
    let recomputed: Vec<usize> = events(&log)
        .iter()
        .filter(|e| e.recomputing)
        .map(|e| e.micro_batch)
        .collect();
    assert_eq!(recomputed, vec![0]);
}

#[test]
fn evaluation_keeps_nothing_and_checkpoints_nothing() {
    // Rows 8 and 9 (test_checkpoint_eval, test_no_grad).
    let log = new_log();
    let mut pipe = Pipe::builder(probes(2, &log), &[1, 1])
        .chunks(2)
        .checkpoint(Checkpoint::Always)
        .build()
        .unwrap();
    pipe.eval();
    assert!(!pipe.is_training());
    pipe.forward(Batch::single(data(4, 3, 1))).unwrap();
    assert!(events(&log)
        .iter()
        .all(|e| e.phase == Phase::Forward && !e.checkpointing));
    assert_eq!(events(&log).len(), 4);
    assert!(!pipe.has_pending());
    assert!(pipe.memory().iter().all(|m| m.held == 0 && m.peak == 0));
    assert!(matches!(
        pipe.backward(Batch::single(data(4, 3, 1))),
        Err(Error::NoPendingForward)
    ));
    assert!(matches!(
        pipe.step(Batch::single(data(4, 3, 1)), sum_loss),
        Err(Error::NotTraining)
    ));
    pipe.train();
    pipe.forward(Batch::single(data(4, 3, 1))).unwrap();
    assert!(pipe.has_pending());
}

#[test]
fn flags_seen_by_a_checkpointed_layer() {
    // test_detect_checkpointing_recomputing: (checkpointing, recomputing) is (true, false)
    // in the first forward and (false, true) in the recomputation.
    let log = new_log();
    let mut pipe = Pipe::builder(probes(1, &log), &[1])
        .checkpoint(Checkpoint::Always)
        .build()
        .unwrap();
    pipe.step(Batch::single(data(1, 3, 1)), sum_loss).unwrap();
    let flags: Vec<(Phase, bool, bool)> = events(&log)
        .iter()
        .map(|e| (e.phase, e.checkpointing, e.recomputing))
        .collect();
    assert_eq!(
        flags,
        vec![
            (Phase::Forward, true, false),
            (Phase::Recompute, false, true),
            (Phase::Backward, false, false)
        ]
    );
}

#[test]
fn backward_order_follows_the_schedule_and_recompute_precedes_its_backward() {
    // test_serial_checkpoints: with GPipe every partition runs its backwards in reverse
    // micro-batch order; with 1F1B in forward order. Each recomputation comes right before
    // the backward of the same micro-batch on the same partition.
    for (kind, expected) in [
        (ScheduleKind::GPipe, vec![3, 2, 1, 0]),
        (ScheduleKind::OneFOneB, vec![0, 1, 2, 3]),
    ] {
        let log = new_log();
        let mut pipe = Pipe::builder(probes(2, &log), &[1, 1])
            .chunks(4)
            .checkpoint(Checkpoint::Always)
            .schedule(kind)
            .build()
            .unwrap();
        pipe.step(Batch::single(data(4, 3, 1)), sum_loss).unwrap();
        for tag in 0..2 {
            let mine: Vec<Event> = events(&log).into_iter().filter(|e| e.tag == tag).collect();
            let order: Vec<usize> = mine
                .iter()
                .filter(|e| e.phase == Phase::Backward)
                .map(|e| e.micro_batch)
                .collect();
            assert_eq!(order, expected, "{kind}, partition {tag}");
            for (k, e) in mine
                .iter()
                .enumerate()
                .filter(|(_, e)| e.phase == Phase::Backward)
            {
                let before = mine[k - 1];
                assert_eq!(
                    (before.phase, before.micro_batch),
                    (Phase::Recompute, e.micro_batch)
                );
            }
        }
    }
}

#[test]
fn recomputation_replays_dropout_exactly() {
    // test_random_in_checkpoint: the same gradients with and without checkpointing, bit for
    // bit, because the recomputed masks are the first masks.
    let run = |mode: Checkpoint| {
        let layers: Vec<Box<dyn Layer<CpuTensor>>> = vec![
            Box::new(Linear::new(3, 16, 1)),
            Box::new(Dropout::new(0.5).unwrap()),
            Box::new(Dropout::new(0.5).unwrap()),
            Box::new(Linear::new(16, 2, 2)),
        ];
        let mut pipe = Pipe::builder(layers, &[2, 2])
            .chunks(3)
            .checkpoint(mode)
            .seed(9)
            .build()
            .unwrap();
        let out = pipe.step(Batch::single(data(6, 3, 1)), sum_loss).unwrap();
        (out.output, out.input_grad, grads(&pipe.into_layers()))
    };
    let never = run(Checkpoint::Never);
    assert_eq!(run(Checkpoint::Always), never);
    assert_eq!(run(Checkpoint::ExceptLast), never);
    // Parameter gradients flow through checkpointed micro-batches (row 19).
    assert!(never.2.iter().all(|g| g.max_abs() > 0.0));
}

#[test]
fn repeated_training_forwards_draw_fresh_masks() {
    // torchgpipe draws new masks on every forward: Monte-Carlo dropout (several training
    // forwards of one input) must see different outputs. A forward and its backward
    // still share their masks, and a step after two forwards matches a fresh pipe's step
    // two step numbers later.
    let build = || {
        let layers: Vec<Box<dyn Layer<CpuTensor>>> = vec![
            Box::new(Linear::new(3, 16, 1)),
            Box::new(Dropout::new(0.5).unwrap()),
            Box::new(Linear::new(16, 2, 2)),
        ];
        Pipe::builder(layers, &[2, 1])
            .chunks(2)
            .checkpoint(Checkpoint::Always)
            .seed(9)
            .build()
            .unwrap()
    };
    let x = || Batch::single(data(6, 3, 1));
    let mut pipe = build();
    let first = pipe.forward(x()).unwrap();
    let second = pipe.forward(x()).unwrap();
    assert_ne!(first, second, "two training forwards drew the same masks");
    assert_eq!(pipe.step_number(), 1);
    let stepped = pipe.step(x(), sum_loss).unwrap();
    assert_eq!(pipe.step_number(), 3);
    let mut fresh = build();
    fresh.set_step_number(2);
    let want = fresh.step(x(), sum_loss).unwrap();
    assert_eq!(stepped.output, want.output);
    assert_eq!(stepped.input_grad, want.input_grad);
}

#[test]
fn parallel_dropouts_draw_independent_masks() {
    // test_parallel_randoms: two dropout layers (different global indices) at the same step
    // drop different elements; one layer's mask for a sample does not depend on the
    // micro-batch it lands in.
    let ones = || Batch::single(CpuTensor::ones(&[4, 64]));
    let mask = |layer: usize, offset: usize| {
        let mut d = Dropout::new(0.5).unwrap();
        let mb = pipe::MicroBatch {
            index: 0,
            offset,
            len: 4,
        };
        let mut ctx = Context::new(true, 1, 0, 4)
            .with_layer(layer)
            .with_micro_batch(mb);
        d.forward(ones(), &mut ctx)
            .unwrap()
            .0
            .into_single()
            .unwrap()
    };
    assert_ne!(mask(0, 0), mask(1, 0));
    assert_ne!(mask(0, 0), mask(0, 4));
    let (a, b) = (mask(0, 0), mask(0, 2));
    assert_eq!(
        a.array().slice(ndarray::s![2..4, ..]),
        b.array().slice(ndarray::s![0..2, ..])
    );
    let kept = a.array().iter().filter(|&&v| v != 0.0).count();
    assert!((64..192).contains(&kept), "{kept} of 256 kept at p = 0.5");
}

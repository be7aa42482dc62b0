//! Deferred batch norm after a failed step: the partial sums of the micro-batches the
//! failed run reached never reach the running statistics. A retry that succeeds leaves
//! exactly the statistics of a fresh pipe after one good step on the same input, whatever
//! the checkpoint mode (recomputations count nothing), the schedule, or the order in which
//! the retry's schedule runs the micro-batches.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use common::*;
use pipe::cpu::{BatchNorm, CpuTensor};
use pipe::{Action, Batch, Checkpoint, Error, Phase, Pipe, Schedule, ScheduleKind};

const BATCH: usize = 12;
const FEATURES: usize = 4;
const CHUNKS: usize = 4;

/// A batch of `BATCH` rows whose features have means away from zero and differ between
/// micro-batches, so that counting a micro-batch twice moves the statistics. The failed
/// attempts run on `input(1)`, the retries on `input(2)`: sums left from a failed attempt
/// change what the retry commits.
fn input(salt: u64) -> Batch<CpuTensor> {
    let x = data(BATCH, FEATURES, salt).to_vec();
    let shifted = x
        .iter()
        .enumerate()
        .map(|(k, v)| v + 0.5 * (k / FEATURES) as f32 + 1.0)
        .collect();
    Batch::single(CpuTensor::from_shape_vec(&[BATCH, FEATURES], shifted).unwrap())
}

/// Balance [2]: the deferred batch norm, then an identity layer that fails at micro-batch
/// 1's first forward while `armed` (once: it disarms itself).
fn pipe(
    mode: Checkpoint,
    kind: ScheduleKind,
    armed: bool,
) -> (Pipe<CpuTensor>, Watched, Arc<AtomicBool>) {
    let bn = Watched::new(BatchNorm::deferred(FEATURES));
    let armed = Arc::new(AtomicBool::new(armed));
    let trigger = Arc::clone(&armed);
    let fail_once = Probe::with(1, &new_log(), move |e| {
        if e.phase == Phase::Forward && e.micro_batch == 1 && trigger.swap(false, Ordering::SeqCst)
        {
            Err(Error::custom(OnPurpose))
        } else {
            Ok(())
        }
    });
    let layers: Layers = vec![Box::new(bn.clone()), Box::new(fail_once)];
    let pipe = Pipe::builder(layers, &[2])
        .chunks(CHUNKS)
        .checkpoint(mode)
        .schedule(kind)
        .seed(SEED)
        .build()
        .unwrap();
    (pipe, bn, armed)
}

/// The statistics of a fresh pipe after one good step on `input(2)`.
fn fresh_stats(mode: Checkpoint, kind: ScheduleKind) -> (Vec<f32>, Vec<f32>) {
    let (mut pipe, bn, _) = pipe(mode, kind, false);
    pipe.step(input(2), sum_loss).unwrap();
    bn.stats()
}

fn assert_failed_at_micro_batch_1(err: &Error) {
    assert_eq!(
        err.site().map(|s| (s.partition, s.micro_batch)),
        Some((0, Some(1))),
        "{err}"
    );
}

#[test]
fn a_retried_step_commits_the_statistics_of_one_good_step() {
    for mode in [
        Checkpoint::Always,
        Checkpoint::ExceptLast,
        Checkpoint::Never,
    ] {
        for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
            let case = format!("{mode}, {kind}");
            let want = fresh_stats(mode, kind);
            let initial = (vec![0.0; FEATURES], vec![1.0; FEATURES]);
            assert_ne!(want, initial, "{case}: a good step moves the statistics");

            let (mut pipe, bn, armed) = pipe(mode, kind, true);
            let err = pipe.step(input(1), sum_loss).unwrap_err();
            assert_failed_at_micro_batch_1(&err);
            assert!(!armed.load(Ordering::SeqCst));
            // Micro-batches 0 and 1 went through the batch norm, but nothing is committed.
            assert_eq!(bn.stats(), initial, "{case}: the failed step committed");

            pipe.step(input(2), sum_loss).unwrap();
            assert_eq!(bn.stats(), want, "{case}: the retry's statistics");
            // The failed run used step 0 up, the retry ran at step 1.
            assert_eq!(pipe.step_number(), 2, "{case}");
        }
    }
}

/// The split run: a training `forward` that fails, then one that succeeds.
#[test]
fn a_retried_forward_commits_the_statistics_of_one_good_forward() {
    let (mut fresh, want_bn, _) = pipe(Checkpoint::Always, ScheduleKind::GPipe, false);
    fresh.forward(input(2)).unwrap();
    let want = want_bn.stats();

    let (mut pipe, bn, _) = pipe(Checkpoint::Always, ScheduleKind::GPipe, true);
    let err = pipe.forward(input(1)).unwrap_err();
    assert_failed_at_micro_batch_1(&err);
    pipe.forward(input(2)).unwrap();
    assert_eq!(bn.stats(), want);
    // The backward pass recomputes every micro-batch and counts none of them.
    pipe.backward(input(2)).unwrap();
    assert_eq!(bn.stats(), want);
}

/// The retry runs the micro-batches in reverse order, so the failed run's micro-batches
/// (0 and 1) come last: partial sums kept at the same step would be committed with the
/// retry's micro-batches 3 and 2 before the retry's 1 and 0 are seen.
#[test]
fn a_retry_in_another_order_does_not_take_the_failed_runs_sums() {
    let reverse = Schedule::new(
        1,
        CHUNKS,
        vec![(0..CHUNKS)
            .rev()
            .map(|i| Action::forward(0, i))
            .chain((0..CHUNKS).map(|i| Action::backward(0, i)))
            .collect()],
    )
    .unwrap();
    let (mut fresh, want_bn, _) = pipe(Checkpoint::Never, ScheduleKind::GPipe, false);
    fresh.step_with(&reverse, input(2), sum_loss).unwrap();
    let want = want_bn.stats();

    let (mut pipe, bn, _) = pipe(Checkpoint::Never, ScheduleKind::GPipe, true);
    let err = pipe.step(input(1), sum_loss).unwrap_err();
    assert_failed_at_micro_batch_1(&err);
    pipe.step_with(&reverse, input(2), sum_loss).unwrap();
    assert_eq!(bn.stats(), want);
}

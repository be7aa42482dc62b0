//! Failures (§7 rows 10-11, "Our choices" #3): a layer's error or panic anywhere stops the
//! whole pipeline at once, the error names the partition, the layer and the micro-batch,
//! the call returns well within the timeout, and the pipe says whether it can be reused.

mod common;

use std::time::{Duration, Instant};

use common::*;
use pipe::{Batch, Error, Layer, Phase, Pipe, ScheduleKind, Task};

const TIMEOUT: Duration = Duration::from_secs(20);

fn x(rows: usize) -> Batch<pipe::cpu::CpuTensor> {
    Batch::single(data(rows, 3, 1))
}

/// `n` probes, one per partition; partition `fail_on` fails at micro-batch 3's forward.
fn failing_pipe(
    n: usize,
    fail_on: usize,
    log: &Log,
    kind: ScheduleKind,
) -> Pipe<pipe::cpu::CpuTensor> {
    let layers: Vec<Box<dyn Layer<pipe::cpu::CpuTensor>>> = (0..n)
        .map(|j| -> Box<dyn Layer<pipe::cpu::CpuTensor>> {
            if j == fail_on {
                Box::new(Probe::with(j, log, |e| {
                    if e.phase == Phase::Forward && e.micro_batch == 3 {
                        Err(Error::custom(OnPurpose))
                    } else {
                        Ok(())
                    }
                }))
            } else {
                Box::new(Probe::new(j, log))
            }
        })
        .collect();
    Pipe::builder(layers, &vec![1; n])
        .chunks(8)
        .checkpoint(pipe::Checkpoint::Never)
        .schedule(kind)
        .timeout(TIMEOUT)
        .build()
        .unwrap()
}

fn started(log: &Log, tag: usize) -> Vec<(Phase, usize)> {
    events(log)
        .into_iter()
        .filter(|e| e.tag == tag)
        .map(|e| (e.phase, e.micro_batch))
        .collect()
}

#[test]
fn a_failure_at_micro_batch_3_on_partition_1_names_both_and_stops_there() {
    let log = new_log();
    let mut pipe = failing_pipe(3, 1, &log, ScheduleKind::GPipe);
    let start = Instant::now();
    let err = pipe.forward(x(8)).unwrap_err();
    assert!(
        start.elapsed() < TIMEOUT / 2,
        "returned after {:?}",
        start.elapsed()
    );
    let site = err.site().expect("a run error names its site").clone();
    assert_eq!(
        (site.partition, site.micro_batch, site.task),
        (1, Some(3), Task::Forward)
    );
    assert_eq!(site.layer, Some((1, "Probe".to_string())));
    assert_eq!(
        err.to_string(),
        "partition 1, layer 1 (Probe), micro-batch 3, forward: probe failed on purpose"
    );
    assert!(matches!(&err, Error::Failed { source, .. } if matches!(**source, Error::Custom(_))));
    // Partition 1 starts nothing after micro-batch 3; partition 2 never gets micro-batch 3
    // (how many of 0..3 it ran before seeing the stop flag depends on the timing).
    let forward =
        |mbs: std::ops::Range<usize>| mbs.map(|i| (Phase::Forward, i)).collect::<Vec<_>>();
    assert_eq!(started(&log, 1), forward(0..4));
    let p2 = started(&log, 2);
    assert!(forward(0..3).starts_with(&p2), "partition 2 ran {p2:?}");
    // Not a panic: the pipe is usable again, with nothing pending.
    assert!(!pipe.is_poisoned() && !pipe.has_pending());
    assert!(pipe.memory().iter().all(|m| m.held == 0));
    assert!(matches!(pipe.backward(x(8)), Err(Error::NoPendingForward)));
}

#[test]
fn a_failure_stops_workers_waiting_for_gradients_in_1f1b() {
    // Partition 1 (the last) fails at forward 3. In 1F1B partition 0 is by then waiting for
    // backward 3's gradient, which never comes: the failure must wake it, not the timeout.
    let log = new_log();
    let mut pipe = failing_pipe(2, 1, &log, ScheduleKind::OneFOneB);
    let start = Instant::now();
    let err = pipe.step(x(8), sum_loss).unwrap_err();
    assert!(
        start.elapsed() < TIMEOUT / 2,
        "returned after {:?}",
        start.elapsed()
    );
    assert_eq!(
        err.site().map(|s| (s.partition, s.micro_batch)),
        Some((1, Some(3)))
    );
    let p1 = started(&log, 1);
    assert_eq!(
        p1.last(),
        Some(&(Phase::Forward, 3)),
        "partition 1 stops at its failure: {p1:?}"
    );
    let p0 = started(&log, 0);
    assert!(
        p0.iter()
            .all(|&(phase, i)| phase == Phase::Forward && i <= 4
                || phase == Phase::Backward && i < 3),
        "partition 0 ran only what could precede the failure: {p0:?}"
    );
}

#[test]
fn exceptions_never_hang_and_the_pipe_stays_usable() {
    // torchgpipe v0.0.2 hung here (test_exception_no_hang): fail many runs in a row, on each
    // partition, then run cleanly.
    for fail_on in 0..3 {
        let log = new_log();
        let mut pipe = failing_pipe(3, fail_on, &log, ScheduleKind::GPipe);
        for _ in 0..5 {
            let err = pipe.step(x(8), sum_loss).unwrap_err();
            assert_eq!(err.site().map(|s| s.partition), Some(fail_on));
        }
        // Three samples: micro-batch 3 does not exist, so nothing fails.
        let out = pipe.step(x(3), sum_loss).unwrap();
        assert_eq!(out.losses.len(), 3);
    }
}

#[test]
fn a_panic_names_its_site_and_poisons_the_pipe() {
    let log = new_log();
    let layers: Vec<Box<dyn Layer<pipe::cpu::CpuTensor>>> = vec![
        Box::new(Probe::new(0, &log)),
        Box::new(Probe::with(1, &log, |e| {
            if e.phase == Phase::Backward && e.micro_batch == 2 {
                panic!("boom at {}", e.micro_batch);
            }
            Ok(())
        })),
    ];
    let mut pipe = Pipe::builder(layers, &[1, 1])
        .chunks(4)
        .timeout(TIMEOUT)
        .build()
        .unwrap();
    let err = pipe.step(x(4), sum_loss).unwrap_err();
    match &err {
        Error::Panicked { site, message } => {
            assert_eq!(
                (site.partition, site.micro_batch, site.task),
                (1, Some(2), Task::Backward)
            );
            assert_eq!(message, "boom at 2");
        }
        other => panic!("expected a panic error, got {other}"),
    }
    assert!(err.poisons() && pipe.is_poisoned());
    assert!(matches!(
        pipe.forward(x(4)),
        Err(Error::Poisoned { site: Some(_) })
    ));
    pipe.clear_poison();
    pipe.forward(x(2)).unwrap();
}

#[test]
fn a_loss_error_names_the_last_partition_and_the_micro_batch() {
    let log = new_log();
    let layers: Vec<Box<dyn Layer<pipe::cpu::CpuTensor>>> =
        vec![Box::new(Probe::new(0, &log)), Box::new(Probe::new(1, &log))];
    let mut pipe = Pipe::builder(layers, &[1, 1]).chunks(4).build().unwrap();
    let err = pipe
        .step(x(4), |mb, out| {
            if mb.index == 1 {
                Err(Error::custom(OnPurpose))
            } else {
                sum_loss(mb, out)
            }
        })
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "partition 1, micro-batch 1, loss: probe failed on purpose"
    );
}

#[test]
fn a_worker_that_waits_too_long_times_out() {
    // Partition 1 takes 1 s on micro-batch 0; partition 2 waits at most 100 ms for it.
    let log = new_log();
    let layers: Vec<Box<dyn Layer<pipe::cpu::CpuTensor>>> = vec![
        Box::new(Probe::new(0, &log)),
        Box::new(Probe::with(1, &log, |e| {
            if e.micro_batch == 0 {
                std::thread::sleep(Duration::from_secs(1));
            }
            Ok(())
        })),
        Box::new(Probe::new(2, &log)),
    ];
    let mut pipe = Pipe::builder(layers, &[1, 1, 1])
        .chunks(2)
        .timeout(Duration::from_millis(100))
        .build()
        .unwrap();
    let err = pipe.forward(x(2)).unwrap_err();
    match err {
        Error::Timeout {
            partition, action, ..
        } => {
            assert_eq!((partition, action), (2, pipe::Action::forward(2, 0)));
        }
        other => panic!("expected a timeout, got {other}"),
    }
    // Partition 1 finished micro-batch 0 but saw the stop flag before starting micro-batch 1.
    assert_eq!(started(&log, 1), vec![(Phase::Forward, 0)]);
    assert!(started(&log, 2).is_empty());
    assert!(!pipe.is_poisoned());
}

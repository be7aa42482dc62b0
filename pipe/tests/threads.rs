//! No worker thread outlives its run, whatever failed. (Its own test binary: the check
//! lists the process's threads, which other tests' pipes would add to.)

mod common;

use std::time::Duration;

use common::*;
use pipe::cpu::CpuTensor;
use pipe::{Batch, Error, Layer, Phase, Pipe, ScheduleKind};

/// The pipe workers still listed after a run, waiting up to a second for them to go:
/// a thread that has been joined may still be listed for a moment while the kernel
/// finishes its exit (`pthread_join` returns when its stack is released, before the
/// task is reaped). A worker that outlives its run stays listed, and fails the check.
fn workers_after_run() -> Option<Vec<String>> {
    let deadline = std::time::Instant::now() + Duration::from_secs(1);
    loop {
        let left = pipe_workers()?;
        if left.is_empty() || std::time::Instant::now() > deadline {
            return Some(left);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Names of this process's threads that are pipe workers (Linux: /proc/self/task).
fn pipe_workers() -> Option<Vec<String>> {
    let tasks = std::fs::read_dir("/proc/self/task").ok()?;
    Some(
        tasks
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .map(|name| name.trim().to_string())
            .filter(|name| name.starts_with("pipe-worker"))
            .collect(),
    )
}

#[test]
fn no_worker_thread_is_left_behind() {
    let Some(before) = pipe_workers() else {
        println!("no /proc/self/task on this OS: thread check skipped (scoped threads still join)");
        return;
    };
    assert!(before.is_empty());
    let log = new_log();
    // The check sees workers while they run (at least the one asking; the other may not
    // have started yet).
    let seen = std::sync::Arc::new(std::sync::Mutex::new(None));
    let during = seen.clone();
    let layers: Vec<Box<dyn Layer<CpuTensor>>> = vec![
        Box::new(Probe::with(0, &log, move |_| {
            *during.lock().unwrap() = pipe_workers().map(|w| w.len());
            Ok(())
        })),
        Box::new(Probe::new(1, &log)),
    ];
    let mut pipe = Pipe::builder(layers, &[1, 1]).build().unwrap();
    pipe.forward(Batch::single(data(1, 2, 1))).unwrap();
    assert!(matches!(*seen.lock().unwrap(), Some(1..=2)));
    assert_eq!(workers_after_run(), Some(Vec::new()));
    for (kind, fail) in [
        (ScheduleKind::GPipe, Phase::Forward),
        (ScheduleKind::OneFOneB, Phase::Forward),
        (ScheduleKind::OneFOneB, Phase::Backward),
    ] {
        let layers: Vec<Box<dyn Layer<CpuTensor>>> = vec![
            Box::new(Probe::new(0, &log)),
            Box::new(Probe::with(1, &log, move |e| {
                if e.phase == fail && e.micro_batch == 1 {
                    Err(Error::custom(OnPurpose))
                } else {
                    Ok(())
                }
            })),
            Box::new(Probe::new(2, &log)),
        ];
        let mut pipe = Pipe::builder(layers, &[1, 1, 1])
            .chunks(4)
            .schedule(kind)
            .timeout(Duration::from_secs(20))
            .build()
            .unwrap();
        assert!(pipe.step(Batch::single(data(4, 2, 1)), sum_loss).is_err());
        assert_eq!(
            workers_after_run(),
            Some(Vec::new()),
            "{kind}, failing in {fail:?}"
        );
        pipe.forward(Batch::single(data(1, 2, 1))).unwrap();
        assert_eq!(workers_after_run(), Some(Vec::new()));
    }
}

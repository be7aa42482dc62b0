//! Regression tests for the thread backend's soundness under failure (issue 8): a failure
//! while peers are inside a collective never frees a buffer they still use, a panicking
//! continuation fails the group at once, and `Duration::MAX` means "no timeout".

use collectives::{Buffer, Error, ProcessGroup, ReduceOp, ThreadGroup, Work};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// Regression (issue 8 item 1): a rank that dropped its group (or failed) while its peers
/// were still reducing into its buffer returned at once and freed the buffer: SIGSEGV on
/// every run with three ranks of 64 MiB, one dropping its group about 1 ms after issuing
/// an all-reduce. Now every rank ends with an error (or a correct result, if the
/// operation finished first) and nothing crashes.
#[test]
fn dropping_a_group_during_an_all_reduce_frees_no_buffer_in_use() {
    const LEN: usize = 16 << 20; // 64 MiB of f32 per rank
    for round in 0..3 {
        let groups = ThreadGroup::create(3, Duration::from_secs(60)).unwrap();
        let start = Arc::new(Barrier::new(3));
        let results: Vec<Option<collectives::Result<Buffer>>> = std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .into_iter()
                .map(|g| {
                    let start = start.clone();
                    s.spawn(move || {
                        let rank = g.rank();
                        start.wait();
                        let work = g.all_reduce(Buffer::F32(vec![1.0; LEN]), ReduceOp::Sum);
                        if rank == 2 {
                            // Drop the group (and with it the work) while the peers reduce.
                            std::thread::sleep(Duration::from_micros(500 + 500 * round));
                            drop(work);
                            drop(g);
                            None
                        } else {
                            Some(work.wait())
                        }
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for r in results.into_iter().flatten() {
            match r {
                Ok(Buffer::F32(v)) => assert!(v.iter().all(|&x| x == 3.0)),
                Ok(other) => panic!("wrong buffer type {:?}", other.dtype()),
                Err(Error::PeerLost { rank: 2, .. }) => {}
                Err(e) => panic!("unexpected error {e}"),
            }
        }
    }
}

/// The same with every rank still waiting and one rank's progress thread failing in the
/// middle through a timeout: nobody crashes, everybody gets an error.
#[test]
fn a_timeout_while_peers_reduce_ends_in_errors_not_crashes() {
    const LEN: usize = 8 << 20;
    let groups = ThreadGroup::create(3, Duration::from_millis(200)).unwrap();
    let results: Vec<collectives::Result<Buffer>> = std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|g| {
                s.spawn(move || {
                    if g.rank() == 1 {
                        // Arrives late: the others time out waiting for it (or not).
                        std::thread::sleep(Duration::from_millis(190));
                    }
                    g.all_reduce(Buffer::F32(vec![1.0; LEN]), ReduceOp::Sum)
                        .wait()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let oks = results.iter().filter(|r| r.is_ok()).count();
    assert!(
        oks == 0 || oks == 3,
        "either the operation completed everywhere or failed everywhere: {results:?}"
    );
}

/// Regression (issue 8 item 4): a panicking continuation killed the rank's progress
/// thread without failing the group, so its peers waited out the whole timeout (30
/// minutes by default). Now the group fails at once, naming the rank.
#[test]
fn a_panicking_continuation_fails_the_group_at_once() {
    let groups = ThreadGroup::create(2, Duration::from_secs(120)).unwrap();
    let started = Instant::now();
    let results: Vec<collectives::Result<Buffer>> = std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|g| {
                s.spawn(move || {
                    if g.rank() == 1 {
                        // Joins late, so that rank 0 chains its continuation while the
                        // all-reduce is still pending and the continuation runs on the
                        // progress thread (chained to finished work, it would run, and
                        // panic, on this thread instead: a race a slow run, such as
                        // under AddressSanitizer, lost).
                        std::thread::sleep(Duration::from_millis(300));
                    }
                    let first = g.all_reduce(Buffer::F32(vec![1.0; 4]), ReduceOp::Sum);
                    if g.rank() == 0 {
                        let chained: Work<()> = first.then(|_| -> collectives::Result<()> {
                            panic!("a bug in a continuation")
                        });
                        assert!(chained.wait().is_err());
                    } else {
                        first.wait().unwrap();
                    }
                    // Rank 0's progress thread panicked; rank 1's next operation must
                    // not wait for it until the timeout.
                    g.all_reduce(Buffer::F32(vec![1.0; 4]), ReduceOp::Sum)
                        .wait()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "peers waited {:?} for a dead progress thread",
        started.elapsed()
    );
    for r in results {
        match r {
            Err(Error::PeerLost { rank: 0, why }) => assert!(why.contains("panicked"), "{why}"),
            other => panic!("expected PeerLost naming rank 0, got {other:?}"),
        }
    }
}

/// Regression (issue 8 item 5): `Duration::MAX` as a timeout panicked every collective
/// (`Instant + Duration` overflow). An overflowing deadline means no deadline.
#[test]
fn duration_max_means_no_timeout() {
    let groups = ThreadGroup::create(2, Duration::MAX).unwrap();
    let sums: Vec<Buffer> = std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|g| {
                s.spawn(move || {
                    if g.rank() == 1 {
                        // Make rank 0 wait, so the deadline arithmetic runs.
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    g.barrier().wait_timeout(Duration::MAX).unwrap();
                    g.all_reduce(Buffer::F32(vec![2.0; 3]), ReduceOp::Sum)
                        .wait_timeout(Duration::MAX)
                        .unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(sums.iter().all(|b| *b == Buffer::F32(vec![4.0; 3])));
}

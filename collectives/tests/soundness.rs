//! Regression tests for the thread backend's soundness under failure (issue 8): a failure
//! while peers are inside a collective never frees a buffer they still use, a panicking
//! continuation fails the group at once, and `Duration::MAX` means "no timeout".

use collectives::{Buffer, Error, ProcessGroup, ReduceOp, ThreadGroup, Work};
use std::sync::mpsc;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// How long a rank waits for a peer's signal: far beyond any wait these tests order, so
/// that reaching it means the signal never came.
const SIGNAL: Duration = Duration::from_secs(60);

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

/// A rank that arrives after its peers timed out waiting for it gets their timeout, at
/// once, and touches none of their buffers: they posted their addresses, gave up, and
/// freed them. The order is forced: rank 1 issues its all-reduce only once ranks 0 and 2
/// have their errors (their buffers dropped), so every rank must fail with the one
/// timeout that names rank 1. (Were rank 1 counted as arriving, it would complete the
/// rendezvous with the freed buffers' addresses and reduce into them.) A rank arriving
/// at the very moment of the timeout is the loom models' case (`cargo xtask loom`).
#[test]
fn a_rank_arriving_after_its_peers_timed_out_fails_without_touching_their_buffers() {
    const LEN: usize = 8 << 20; // 32 MiB of f32 per rank: freed memory is unmapped
    let timeout = Duration::from_millis(300);
    let mut groups = ThreadGroup::create(3, timeout).unwrap().into_iter();
    let (g0, g1, g2) = (
        groups.next().unwrap(),
        groups.next().unwrap(),
        groups.next().unwrap(),
    );
    let (timed_out, gave_up) = mpsc::channel::<usize>();
    let results: Vec<collectives::Result<Buffer>> = std::thread::scope(|s| {
        let waiting = [g0, g2].map(|g| {
            let timed_out = timed_out.clone();
            s.spawn(move || {
                let r = g
                    .all_reduce(Buffer::F32(vec![1.0; LEN]), ReduceOp::Sum)
                    .wait();
                // The work's buffer is gone (freed, or handed back in `r`) by now.
                let _ = timed_out.send(g.rank());
                r
            })
        });
        let late = s.spawn(move || {
            for _ in 0..2 {
                gave_up
                    .recv_timeout(SIGNAL)
                    .expect("ranks 0 and 2 never returned from their all-reduce");
            }
            g1.all_reduce(Buffer::F32(vec![1.0; LEN]), ReduceOp::Sum)
                .wait()
        });
        let [r0, r2] = waiting.map(|h| h.join().unwrap());
        vec![r0, late.join().unwrap(), r2]
    });
    let first = match &results[0] {
        Err(e @ Error::Timeout { missing, .. }) if missing == &[1] => e.clone(),
        other => panic!("rank 0: expected a timeout naming rank 1, got {other:?}"),
    };
    for (rank, r) in results.iter().enumerate() {
        match r {
            Err(e) => assert_eq!(e, &first, "rank {rank} got another error"),
            Ok(_) => panic!("rank {rank} completed an all-reduce its peers had left"),
        }
    }
}

/// Regression (issue 8 item 4): a panicking continuation killed the rank's progress
/// thread without failing the group, so its peers waited out the whole timeout (30
/// minutes by default). Now the group fails at once, naming the rank.
///
/// Rank 1 joins the first all-reduce only once rank 0 has chained its continuation, so
/// the continuation is chained to pending work and runs (and panics) on rank 0's
/// progress thread; chained to finished work, it would run on rank 0's own thread
/// instead.
#[test]
fn a_panicking_continuation_fails_the_group_at_once() {
    let groups = ThreadGroup::create(2, Duration::from_secs(120)).unwrap();
    let started = Instant::now();
    let (chained_tx, chained_rx) = mpsc::channel::<()>();
    let chained_rx = std::sync::Mutex::new(chained_rx);
    let results: Vec<collectives::Result<Buffer>> = std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|g| {
                let chained_tx = chained_tx.clone();
                let chained_rx = &chained_rx;
                s.spawn(move || {
                    if g.rank() == 1 {
                        chained_rx
                            .lock()
                            .unwrap()
                            .recv_timeout(SIGNAL)
                            .expect("rank 0 never chained its continuation");
                    }
                    let first = g.all_reduce(Buffer::F32(vec![1.0; 4]), ReduceOp::Sum);
                    if g.rank() == 0 {
                        let chained: Work<()> = first.then(|_| -> collectives::Result<()> {
                            panic!("a bug in a continuation")
                        });
                        chained_tx.send(()).unwrap();
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
            Err(Error::PeerLost { rank: 0, why }) => {
                assert!(why.contains("progress thread panicked"), "{why}")
            }
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

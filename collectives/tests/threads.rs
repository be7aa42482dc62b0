//! The thread backend: every collective against an exact reference, on 1 to 4 ranks, and
//! the failure guarantees of `ProcessGroup` (with a 1-second timeout).

use collectives::{
    run_local, run_local_with_timeout, Buffer, Error, ProcessGroup, ReduceOp, ThreadGroup,
};
use half::{bf16, f16};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const SHORT: Duration = Duration::from_secs(1);

/// How long a rank waits for a peer's [`Signals`]: far beyond any wait these tests
/// order, so that reaching it means the signal never came.
const SIGNAL: Duration = Duration::from_secs(60);

/// Signals between the threads of a test, counted, each wait bounded: what orders the
/// ranks' steps where the property needs one order.
#[derive(Default)]
struct Signals {
    count: Mutex<usize>,
    changed: Condvar,
}

impl Signals {
    fn send(&self) {
        *self.count.lock().unwrap() += 1;
        self.changed.notify_all();
    }

    /// Waits until `n` signals have been sent; panics if [`SIGNAL`] passes first.
    fn wait_for(&self, n: usize, what: &str) {
        let count = self.count.lock().unwrap();
        let (count, timeout) = self
            .changed
            .wait_timeout_while(count, SIGNAL, |count| *count < n)
            .unwrap();
        assert!(!timeout.timed_out(), "{what}: {} of {n} signals", *count);
    }
}

/// Rank r's input: distinct, exactly representable values.
fn input(rank: usize, len: usize) -> Vec<f64> {
    (0..len)
        .map(|i| ((i * 7 + rank * 13) % 23) as f64 - 11.0 + rank as f64 * 0.5)
        .collect()
}

fn expected(ranks: usize, len: usize, op: ReduceOp) -> Vec<f64> {
    let inputs: Vec<Vec<f64>> = (0..ranks).map(|r| input(r, len)).collect();
    (0..len)
        .map(|i| {
            let xs = inputs.iter().map(|v| v[i]);
            match op {
                ReduceOp::Sum => xs.sum(),
                ReduceOp::Avg => xs.sum::<f64>() / ranks as f64,
                ReduceOp::Max => xs.fold(f64::MIN, f64::max),
                ReduceOp::Min => xs.fold(f64::MAX, f64::min),
            }
        })
        .collect()
}

/// A rank's result: it did not panic, and its operation succeeded.
/// Asserts that what started at `start` ended well before the 20 s timeouts of the
/// failure tests: it failed at once, not by timeout.
fn assert_prompt(start: Instant) {
    let took = start.elapsed();
    assert!(took < Duration::from_secs(10), "{took:?}");
}

fn ok<T>(r: collectives::Result<collectives::Result<T>>) -> T {
    r.expect("rank panicked").expect("operation failed")
}

fn to_f64(b: &Buffer) -> Vec<f64> {
    match b {
        Buffer::F32(v) => v.iter().map(|&x| x as f64).collect(),
        Buffer::F64(v) => v.clone(),
        Buffer::F16(v) => v.iter().map(|x| x.to_f64()).collect(),
        Buffer::BF16(v) => v.iter().map(|x| x.to_f64()).collect(),
        Buffer::U8(v) => v.iter().map(|&x| f64::from(x)).collect(),
    }
}

fn make(dtype: &str, xs: &[f64]) -> Buffer {
    match dtype {
        "f32" => Buffer::F32(xs.iter().map(|&x| x as f32).collect()),
        "f64" => Buffer::F64(xs.to_vec()),
        "f16" => Buffer::F16(xs.iter().map(|&x| f16::from_f64(x)).collect()),
        _ => Buffer::BF16(xs.iter().map(|&x| bf16::from_f64(x)).collect()),
    }
}

#[test]
fn all_reduce_matches_exact_reduction_on_every_rank() {
    for ranks in 1..=4 {
        for dtype in ["f32", "f64", "f16", "bf16"] {
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
                let len = 3001;
                let out = run_local(ranks, |g| {
                    g.all_reduce(make(dtype, &input(g.rank(), len)), op).wait()
                })
                .unwrap();
                let want = expected(ranks, len, op);
                let out: Vec<Buffer> = out.into_iter().map(ok).collect();
                let first = out[0].clone();
                for got in out {
                    assert_eq!(got, first, "ranks must agree bit for bit");
                    // Inputs are exact in every type; sums stay below 100, so f16/bf16
                    // results are within their half-ulp rounding of the exact value.
                    let tol = match dtype {
                        "f16" => 0.05,
                        "bf16" => 0.4,
                        _ => 1e-6,
                    };
                    for (g, w) in to_f64(&got).iter().zip(&want) {
                        assert!(
                            (g - w).abs() <= tol,
                            "{ranks} ranks {dtype} {op:?}: {g} vs {w}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn coalesced_all_reduce_of_mixed_buffers() {
    let out = run_local(3, |g| {
        let r = g.rank();
        let bufs = vec![
            make("f32", &input(r, 10)),
            make("f64", &input(r, 1)),
            make("f32", &[]),
            make("f16", &input(r, 33)),
        ];
        g.all_reduce_coalesced(bufs, ReduceOp::Sum).wait()
    })
    .unwrap();
    for r in out {
        let bufs = ok(r);
        for (b, len) in bufs.iter().zip([10, 1, 0, 33]) {
            assert_eq!(to_f64(b), expected(3, len, ReduceOp::Sum));
        }
    }
}

#[test]
fn broadcast_all_gather_reduce_scatter_barrier() {
    for root in 0..3 {
        let out = run_local(3, |g| {
            g.broadcast(make("f32", &input(g.rank(), 50)), root).wait()
        })
        .unwrap();
        for r in out {
            assert_eq!(to_f64(&ok(r)), input(root, 50));
        }
    }
    let out = run_local(4, |g| {
        g.all_gather(make("bf16", &input(g.rank(), 5))).wait()
    })
    .unwrap();
    for r in out {
        let got: Vec<Vec<f64>> = ok(r).iter().map(to_f64).collect();
        let want: Vec<Vec<f64>> = (0..4)
            .map(|k| to_f64(&make("bf16", &input(k, 5))))
            .collect();
        assert_eq!(got, want);
    }
    let out = run_local(4, |g| {
        g.reduce_scatter(make("f64", &input(g.rank(), 12)), ReduceOp::Sum)
            .wait()
    })
    .unwrap();
    let want = expected(4, 12, ReduceOp::Sum);
    for (rank, r) in out.into_iter().enumerate() {
        assert_eq!(to_f64(&ok(r)), want[rank * 3..rank * 3 + 3]);
    }
    let out = run_local(4, |g| g.barrier().wait()).unwrap();
    assert!(out.into_iter().all(|r| r.unwrap().is_ok()));
}

#[test]
fn continuations_run_on_the_owning_rank_thread() {
    let out = run_local(2, |g| {
        let me = g.rank();
        g.all_reduce(Buffer::F32(vec![1.0; 4]), ReduceOp::Sum)
            .then(move |r| {
                let name = std::thread::current()
                    .name()
                    .unwrap_or_default()
                    .to_string();
                r.map(|b| (b, name, me))
            })
            .wait()
    })
    .unwrap();
    for r in out {
        let (b, thread, rank) = r.unwrap().unwrap();
        assert_eq!(b, Buffer::F32(vec![2.0; 4]));
        // On this rank's progress thread, or (if the work had already completed when
        // `then` was called) on the calling thread, which is unnamed here; never on the
        // peer's progress thread.
        assert!(
            thread == format!("collectives-rank-{rank}") || thread.is_empty(),
            "continuation ran on {thread:?}"
        );
    }
}

#[test]
fn subgroups() {
    let out = run_local(4, |g| {
        let sub = g.new_group(&[0, 2])?;
        let odd = g.new_group(&[3, 1])?;
        let a = match sub {
            Some(s) => Some((
                s.rank(),
                s.size(),
                s.all_reduce(Buffer::F64(vec![g.rank() as f64]), ReduceOp::Sum)
                    .wait()?,
            )),
            None => None,
        };
        let b = match odd {
            Some(s) => Some((
                s.rank(),
                s.all_reduce(Buffer::F64(vec![g.rank() as f64]), ReduceOp::Sum)
                    .wait()?,
            )),
            None => None,
        };
        Ok::<_, Error>((a, b))
    })
    .unwrap();
    let out: Vec<_> = out.into_iter().map(|r| r.unwrap().unwrap()).collect();
    assert_eq!(out[0].0, Some((0, 2, Buffer::F64(vec![2.0]))));
    assert_eq!(out[2].0, Some((1, 2, Buffer::F64(vec![2.0]))));
    assert_eq!(out[1].0, None);
    assert_eq!(
        out[3].1,
        Some((0, Buffer::F64(vec![4.0]))),
        "ranks are ordered as listed"
    );
    assert_eq!(out[1].1, Some((1, Buffer::F64(vec![4.0]))));
    let out = run_local(2, |g| g.new_group(&[0, 0]).map(|_| ())).unwrap();
    assert!(matches!(
        out[0].as_ref().unwrap(),
        Err(Error::InvalidArgument(_))
    ));
}

/// A rank that panics makes the other ranks' operations fail, fast, with its rank.
#[test]
fn a_panicking_rank_fails_the_others() {
    let start = Instant::now();
    let out = run_local_with_timeout(3, SHORT, |g| {
        if g.rank() == 1 {
            panic!("rank 1 fails");
        }
        g.all_reduce(Buffer::F32(vec![1.0; 8]), ReduceOp::Sum)
            .wait()
    })
    .unwrap();
    assert!(
        matches!(&out[1], Err(Error::PeerLost { rank: 1, why }) if why.contains("rank 1 fails"))
    );
    for r in [0, 2] {
        match &out[r] {
            Ok(Err(Error::PeerLost { rank: 1, .. })) | Ok(Err(Error::Timeout { .. })) => {}
            other => panic!("rank {r}: {other:?}"),
        }
    }
    assert!(start.elapsed() < Duration::from_secs(3));
}

/// A rank that returns early (dropping its group) fails every pending and later
/// operation of the others.
#[test]
fn a_rank_that_leaves_early_fails_pending_and_later_operations() {
    let out = run_local_with_timeout(2, SHORT, |g| {
        if g.rank() == 0 {
            return Vec::new();
        }
        let first = g.all_reduce(Buffer::F32(vec![1.0]), ReduceOp::Sum).wait();
        let later = g.barrier().wait();
        vec![first.map(drop), later]
    })
    .unwrap();
    for r in &out[1].as_ref().unwrap()[..] {
        assert!(
            matches!(
                r,
                Err(Error::PeerLost { rank: 0, .. }) | Err(Error::Timeout { .. })
            ),
            "{r:?}"
        );
    }
}

/// A rank that never arrives: a timeout naming it, on every rank that waited.
#[test]
fn a_missing_rank_times_out_with_its_name() {
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let rx = std::sync::Mutex::new(rx);
    let groups = ThreadGroup::create(3, SHORT).unwrap();
    let start = Instant::now();
    let results: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = groups
            .into_iter()
            .map(|g| {
                let (tx, rx) = (tx.clone(), &rx);
                s.spawn(move || {
                    if g.rank() == 2 {
                        // Alive but busy: it joins only after the others gave up.
                        let _ = rx.lock().unwrap().recv();
                        let _ = rx.lock().unwrap().recv();
                        return None;
                    }
                    let r = g.all_reduce(Buffer::F32(vec![1.0]), ReduceOp::Sum).wait();
                    tx.send(()).unwrap();
                    Some(r)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(start.elapsed() < Duration::from_secs(3));
    for r in results.into_iter().flatten() {
        match r {
            Err(e @ Error::Timeout { .. }) => {
                assert!(
                    matches!(&e, Error::Timeout { missing, .. } if missing == &vec![2]),
                    "{e}"
                );
                assert!(e.to_string().contains("[2]"), "{e}");
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
    }
}

#[test]
fn mismatched_buffers_and_operations_are_errors_on_every_rank() {
    let out = run_local_with_timeout(2, SHORT, |g| {
        let len = if g.rank() == 0 { 10 } else { 11 };
        g.all_reduce(Buffer::F32(vec![1.0; len]), ReduceOp::Sum)
            .wait()
    })
    .unwrap();
    for r in out {
        assert!(
            matches!(r.unwrap(), Err(Error::Mismatch(m)) if m.contains("F32 x 10") && m.contains("F32 x 11"))
        );
    }
    let out = run_local_with_timeout(2, SHORT, |g| {
        let b = Buffer::F32(vec![1.0; 4]);
        if g.rank() == 0 {
            g.all_reduce(b, ReduceOp::Sum).wait()
        } else {
            g.broadcast(b, 0).wait()
        }
    })
    .unwrap();
    for r in out {
        let e = r.unwrap().unwrap_err();
        assert!(
            matches!(&e, Error::Mismatch(m) if m.contains("AllReduce") && m.contains("Broadcast")),
            "{e}"
        );
    }
    let out = run_local_with_timeout(2, SHORT, |g| {
        let b = if g.rank() == 0 {
            Buffer::F32(vec![1.0; 4])
        } else {
            Buffer::F64(vec![1.0; 4])
        };
        g.all_reduce(b, ReduceOp::Sum).wait()
    })
    .unwrap();
    assert!(out
        .into_iter()
        .all(|r| matches!(r.unwrap(), Err(Error::Mismatch(_)))));
}

#[test]
fn bad_arguments_are_errors() {
    assert!(matches!(
        ThreadGroup::create(0, SHORT),
        Err(Error::InvalidArgument(_))
    ));
    let out = run_local(2, |g| {
        (
            g.broadcast(Buffer::F32(vec![0.0]), 2).wait(),
            g.reduce_scatter(Buffer::F32(vec![0.0; 3]), ReduceOp::Sum)
                .wait(),
        )
    })
    .unwrap();
    for r in out {
        let (b, rs) = r.unwrap();
        assert!(matches!(b, Err(Error::InvalidArgument(_))));
        assert!(matches!(rs, Err(Error::InvalidArgument(_))));
    }
}

/// `all_reduce_wire` on the thread backend (rounding fused into the reduction pass) gives
/// exactly what narrowing, reducing the 16-bit buffers and widening gives, for every
/// operator, wire format and rank count; bad arguments are errors.
#[test]
fn fused_wire_all_reduce_is_bit_identical_to_narrow_reduce_widen() {
    use collectives::DType;
    for ranks in [1, 2, 3] {
        for wire in [DType::F16, DType::BF16, DType::F32] {
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
                let results = run_local(ranks, |g| {
                    // Values that exercise rounding: many magnitudes, ties, subnormals
                    // in f16, overflow past f16's range.
                    let n = 1000 + 7;
                    let v: Vec<f32> = (0..n)
                        .map(|i| {
                            let x = ((i * 7919 + g.rank() * 104_729) % 10_007) as f32 / 10_007.0;
                            let scale = [1e-6, 1e-3, 0.5, 1.0, 3.0, 1e3, 7e4][i % 7];
                            (x - 0.4) * scale
                        })
                        .collect();
                    let buf = Buffer::F32(v);
                    let fused = g.all_reduce_wire(buf.clone(), wire, op).wait().unwrap();
                    let plain = g
                        .all_reduce(buf.narrowed(wire), op)
                        .wait()
                        .unwrap()
                        .widened();
                    (fused, plain)
                })
                .unwrap();
                for r in results {
                    let (fused, plain) = r.unwrap();
                    let (Buffer::F32(a), Buffer::F32(b)) = (&fused, &plain) else {
                        panic!("expected f32 results");
                    };
                    assert!(
                        a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                        "{ranks} ranks, {wire:?}, {op:?}: fused differs from narrow-reduce-widen"
                    );
                }
            }
        }
    }
    let errors = run_local(1, |g| {
        let not_f32 = g
            .all_reduce_wire(Buffer::F16(vec![]), DType::F16, ReduceOp::Sum)
            .wait();
        let f64_wire = g
            .all_reduce_wire(Buffer::F32(vec![1.0]), DType::F64, ReduceOp::Sum)
            .wait();
        (not_f32.is_err(), f64_wire.is_err())
    })
    .unwrap();
    assert_eq!(errors[0].as_ref().unwrap(), &(true, true));
}

#[test]
fn max_and_min_propagate_nan_whichever_rank_holds_it() {
    // torch's max and min propagate NaN; the result must not depend on which rank's
    // value is first. Every dtype, 2 and 3 ranks (two paths), plain and 16-bit wire.
    for ranks in [2, 3] {
        for nan_at in 0..ranks {
            for op in [ReduceOp::Max, ReduceOp::Min] {
                for dtype in ["f32", "f16", "bf16", "f64"] {
                    let out = run_local_with_timeout(ranks, SHORT, |g| {
                        let mut xs = vec![1.0 + g.rank() as f64, -2.0, 3.0];
                        if g.rank() == nan_at {
                            xs[0] = f64::NAN;
                        }
                        g.all_reduce(make(dtype, &xs), op).wait()
                    })
                    .unwrap();
                    for got in out.into_iter().map(ok) {
                        let got = to_f64(&got);
                        let what = format!("{ranks} ranks, NaN on {nan_at}, {op:?}, {dtype}");
                        assert!(got[0].is_nan(), "{what}: {got:?}");
                        assert!(!got[1].is_nan() && !got[2].is_nan(), "{what}: {got:?}");
                    }
                }
                for wire in [collectives::DType::F16, collectives::DType::BF16] {
                    let out = run_local_with_timeout(ranks, SHORT, |g| {
                        let mut xs = vec![1.0f32 + g.rank() as f32, -2.0, 3.0];
                        if g.rank() == nan_at {
                            xs[0] = f32::NAN;
                        }
                        g.all_reduce_wire(Buffer::F32(xs), wire, op).wait()
                    })
                    .unwrap();
                    for got in out.into_iter().map(ok) {
                        let got = to_f64(&got);
                        let what = format!("{ranks} ranks, NaN on {nan_at}, {op:?}, {wire:?} wire");
                        assert!(got[0].is_nan(), "{what}: {got:?}");
                    }
                }
            }
        }
    }
}

/// A continuation that owns the last handle of its group drops it on the group's own
/// worker thread, where `Drop` must not join the worker (itself): the work still
/// completes with its result, and nothing panics.
///
/// The order is forced: ranks 0 and 1 chain the continuation to their pending all-reduce
/// and drop their own handle, and only then does rank 2 join the all-reduce, so each
/// continuation runs on its rank's worker, holding the last handle.
#[test]
fn the_last_handle_dropped_inside_its_own_continuation() {
    let handles_dropped = Signals::default();
    let out = run_local_with_timeout(3, Duration::from_secs(20), |g| {
        let rank = g.rank();
        if rank == 2 {
            handles_dropped.wait_for(2, "ranks 0 and 1 dropping their handles");
            let sum = g
                .all_reduce(Buffer::F32(vec![1.0; 4]), ReduceOp::Sum)
                .wait();
            return sum.map(|sum| (sum, None));
        }
        let g = Arc::new(g);
        let keep = g.clone();
        let work = g
            .all_reduce(Buffer::F32(vec![1.0; 4]), ReduceOp::Sum)
            .then(move |r| {
                // Where it runs, and whether `keep` is the last handle.
                let seen = (
                    std::thread::current().name().map(String::from),
                    Arc::strong_count(&keep),
                );
                drop(keep);
                r.map(|sum| (sum, Some(seen)))
            });
        drop(g);
        handles_dropped.send();
        work.wait()
    })
    .unwrap();
    for (rank, got) in out.into_iter().map(ok).enumerate() {
        assert_eq!(got.0, Buffer::F32(vec![3.0; 4]), "rank {rank}");
        if rank < 2 {
            let worker = format!("collectives-rank-{rank}");
            assert_eq!(
                got.1,
                Some((Some(worker), 1)),
                "rank {rank}: the continuation should run on the worker with the last handle"
            );
        }
    }
}

#[test]
fn waiting_in_a_continuation_for_the_groups_next_operation_fails_at_once() {
    // The continuation runs on the group's own thread, which is the only one that can
    // run the barrier it waits for: that wait would never end. It fails at once, and the
    // group goes on (the queued barrier still runs and completes). Rank 1 enters the
    // first barrier only once rank 0 has attached its continuation, so that barrier
    // cannot have completed by then (a continuation attached to finished work runs on
    // the caller's thread, where the wait is fine); rank 1 matches the three barriers
    // rank 0 issues with plain waits.
    let start = Instant::now();
    let attached = std::sync::Barrier::new(2);
    let out = run_local_with_timeout(2, Duration::from_secs(20), |g| {
        let g = std::sync::Arc::new(g);
        if g.rank() == 0 {
            let g2 = g.clone();
            let inner = g.barrier().then(move |_| g2.barrier().wait());
            attached.wait();
            let inner = inner.wait();
            let after = g.barrier().wait();
            (inner, after)
        } else {
            attached.wait();
            let first = g.barrier().wait();
            let second = g.barrier().wait();
            (first.and(second), g.barrier().wait())
        }
    })
    .unwrap();
    for (rank, r) in out.into_iter().enumerate() {
        let (inner, after) = r.unwrap();
        if rank == 0 {
            assert!(
                matches!(&inner, Err(Error::InvalidArgument(m)) if m.contains("and_then")),
                "{inner:?}"
            );
        } else {
            inner.unwrap();
        }
        after.unwrap();
    }
    assert_prompt(start);
}

#[test]
fn an_argument_one_rank_rejects_fails_its_peers_at_once() {
    // Rank 1 passes a length the group size does not divide, or a root out of range;
    // rank 0 is well-formed. Rank 1 gets its own error, rank 0 a mismatch naming the
    // reason, both at once rather than after the timeout. Where every rank rejects its
    // arguments, the group stays usable.
    let start = Instant::now();
    let out = run_local_with_timeout(2, Duration::from_secs(20), |g| {
        g.reduce_scatter(Buffer::F32(vec![1.0; 4 - g.rank()]), ReduceOp::Sum)
            .wait()
    })
    .unwrap();
    let rs: Vec<_> = out.into_iter().map(|r| r.unwrap()).collect();
    assert!(
        matches!(&rs[0], Err(Error::Mismatch(m)) if m.contains("rank 1 rejected its arguments") && m.contains("divisible")),
        "{:?}",
        rs[0]
    );
    assert!(
        matches!(&rs[1], Err(Error::InvalidArgument(m)) if m.contains("divisible")),
        "{:?}",
        rs[1]
    );
    let out = run_local_with_timeout(2, Duration::from_secs(20), |g| {
        let root = if g.rank() == 1 { 5 } else { 0 };
        g.broadcast(Buffer::F32(vec![1.0]), root).wait()
    })
    .unwrap();
    let b: Vec<_> = out.into_iter().map(|r| r.unwrap()).collect();
    assert!(
        matches!(&b[0], Err(Error::Mismatch(m)) if m.contains("root 5")),
        "{:?}",
        b[0]
    );
    assert!(
        matches!(&b[1], Err(Error::InvalidArgument(_))),
        "{:?}",
        b[1]
    );
    let out = run_local_with_timeout(2, Duration::from_secs(20), |g| {
        let bad = g.broadcast(Buffer::F32(vec![1.0]), 7).wait();
        (bad, g.barrier().wait())
    })
    .unwrap();
    for r in out {
        let (bad, after) = r.unwrap();
        assert!(matches!(bad, Err(Error::InvalidArgument(_))), "{bad:?}");
        after.unwrap();
    }
    assert_prompt(start);
}

/// Rank 0 asks for [0, 1], rank 1 for [1, 0]: the second to ask gets a mismatch, and
/// the first, which got a subgroup, fails at its first operation on it, not by the
/// timeout. The order is forced: rank 1 asks only once rank 0 has its subgroup and has
/// started a barrier on it, which rank 1's mismatch must end.
#[test]
fn new_group_with_different_lists_fails_every_member_at_once() {
    let start = Instant::now();
    let barrier_started = Signals::default();
    let out = run_local_with_timeout(2, Duration::from_secs(20), |g| {
        if g.rank() == 0 {
            let sub = match g.new_group(&[0, 1]) {
                Ok(Some(sub)) => sub,
                Ok(None) => panic!("rank 0 asks first: expected its subgroup, got none"),
                Err(e) => panic!("rank 0 asks first: expected its subgroup, got {e}"),
            };
            let barrier = sub.barrier();
            barrier_started.send();
            barrier.wait()
        } else {
            barrier_started.wait_for(1, "rank 0 starting its barrier");
            match g.new_group(&[1, 0]) {
                Err(e) => Err(e),
                Ok(other) => panic!(
                    "rank 1 asks second: expected a mismatch, got a group: {}",
                    other.is_some()
                ),
            }
        }
    })
    .unwrap();
    for (rank, r) in out.into_iter().enumerate() {
        let r = r.unwrap();
        assert!(
            matches!(&r, Err(Error::Mismatch(m)) if m.contains("new_group call 0: rank 1 asked for [1, 0]")),
            "rank {rank}: {r:?}"
        );
    }
    assert_prompt(start);
}

//! Point-to-point operations and the composed collectives (`reduce`, `gather`,
//! `scatter`, `all_to_all`) on the thread backend: results, order, mismatches, bad
//! arguments, timeouts and failure spreading.

use collectives::{
    run_local, run_local_with_timeout, Buffer, Error, P2pOp, ProcessGroup, ReduceOp, MAX_TAG,
};
use std::time::{Duration, Instant};

fn f32s(v: &[f32]) -> Buffer {
    Buffer::F32(v.to_vec())
}

#[test]
fn a_ring_of_sends_and_receives() {
    let out = run_local(4, |g| {
        let (r, n) = (g.rank(), g.size());
        let send = g.send(f32s(&[r as f32; 3]), (r + 1) % n, 5);
        let recv = g.recv(
            Buffer::zeros(collectives::DType::F32, 3),
            (r + n - 1) % n,
            5,
        );
        let got = recv.wait().unwrap();
        // The send gives its buffer back unchanged.
        assert_eq!(send.wait().unwrap(), f32s(&[r as f32; 3]));
        got
    })
    .unwrap();
    for (r, got) in out.into_iter().enumerate() {
        let from = (r + 3) % 4;
        assert_eq!(got.unwrap(), f32s(&[from as f32; 3]));
    }
}

#[test]
fn both_directions_at_once_do_not_deadlock() {
    let out = run_local(2, |g| {
        let peer = 1 - g.rank();
        // Both ranks post their send first: neither blocks the other.
        let works = g.batch_isend_irecv(vec![
            P2pOp::send(Buffer::F64(vec![g.rank() as f64; 1000]), peer, 0),
            P2pOp::recv(Buffer::F64(vec![0.0; 1000]), peer, 0),
        ]);
        let mut results: Vec<Buffer> = works.into_iter().map(|w| w.wait().unwrap()).collect();
        results.pop().unwrap()
    })
    .unwrap();
    assert_eq!(out[0].as_ref().unwrap(), &Buffer::F64(vec![1.0; 1000]));
    assert_eq!(out[1].as_ref().unwrap(), &Buffer::F64(vec![0.0; 1000]));
}

#[test]
fn one_tag_is_in_order_and_tags_are_independent() {
    let out = run_local(2, |g| {
        if g.rank() == 0 {
            let works: Vec<_> = (0..3)
                .map(|i| g.send(f32s(&[i as f32]), 1, 1))
                .chain([g.send(f32s(&[10.0]), 1, 2)])
                .collect();
            works.into_iter().for_each(|w| drop(w.wait().unwrap()));
            Vec::new()
        } else {
            // Tag 2 first, although it was sent last: tags do not wait for each other.
            let late = g.recv(f32s(&[0.0]), 0, 2).wait().unwrap();
            let mut got = vec![late];
            for _ in 0..3 {
                got.push(g.recv(f32s(&[0.0]), 0, 1).wait().unwrap());
            }
            got
        }
    })
    .unwrap();
    let got = out[1].as_ref().unwrap();
    assert_eq!(
        got,
        &vec![f32s(&[10.0]), f32s(&[0.0]), f32s(&[1.0]), f32s(&[2.0])]
    );
}

#[test]
fn raw_bytes_move_but_do_not_reduce() {
    let out = run_local(2, |g| {
        let moved = if g.rank() == 0 {
            g.send(Buffer::U8(b"shape:[3,4]".to_vec()), 1, 0).wait()
        } else {
            g.recv(Buffer::U8(vec![0; 11]), 0, 0).wait()
        };
        let reduced = g.all_reduce(Buffer::U8(vec![1, 2]), ReduceOp::Sum).wait();
        (moved.unwrap(), reduced)
    })
    .unwrap();
    for r in out {
        let (moved, reduced) = r.unwrap();
        assert_eq!(moved, Buffer::U8(b"shape:[3,4]".to_vec()));
        assert!(
            matches!(reduced, Err(Error::InvalidArgument(ref m)) if m.contains("U8")),
            "{reduced:?}"
        );
    }
}

#[test]
fn a_mismatched_receive_fails_on_both_ranks() {
    for (sent, posted) in [
        (f32s(&[1.0, 2.0, 3.0]), f32s(&[0.0, 0.0])),
        (f32s(&[1.0]), f32s(&[0.0, 0.0])),
        (f32s(&[1.0, 2.0]), Buffer::F64(vec![0.0, 0.0])),
    ] {
        let out = run_local(2, |g| {
            if g.rank() == 0 {
                g.send(sent.clone(), 1, 3).wait()
            } else {
                g.recv(posted.clone(), 0, 3).wait()
            }
        })
        .unwrap();
        for r in out {
            let e = r.unwrap().unwrap_err();
            assert!(
                matches!(&e, Error::Mismatch(m) if m.contains("tag 3")),
                "{e}"
            );
        }
    }
}

#[test]
fn bad_peers_and_tags_are_invalid_arguments() {
    let out = run_local(2, |g| {
        [
            g.send(f32s(&[1.0]), 2, 0).wait(),
            g.recv(f32s(&[1.0]), 7, 0).wait(),
            g.send(f32s(&[1.0]), 0, MAX_TAG + 1).wait(),
        ]
    })
    .unwrap();
    for r in out {
        for e in r.unwrap() {
            assert!(matches!(e, Err(Error::InvalidArgument(_))), "{e:?}");
        }
    }
}

#[test]
fn an_unmatched_receive_times_out() {
    let timeout = Duration::from_millis(300);
    let start = Instant::now();
    let out = run_local_with_timeout(2, timeout, |g| {
        if g.rank() == 1 {
            g.recv(f32s(&[0.0]), 0, 9).wait()
        } else {
            // Rank 0 stays in the group, but sends nothing.
            std::thread::sleep(timeout * 2);
            Ok(Buffer::F32(Vec::new()))
        }
    })
    .unwrap();
    let e = out[1].as_ref().unwrap().as_ref().unwrap_err();
    assert!(
        matches!(e, Error::Timeout { missing, .. } if missing == &vec![0]),
        "{e}"
    );
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[test]
fn a_peer_that_drops_its_group_fails_the_pending_receive() {
    let start = Instant::now();
    let out = run_local(2, |g| {
        if g.rank() == 0 {
            std::thread::sleep(Duration::from_millis(50));
            drop(g);
            Ok(Buffer::F32(Vec::new()))
        } else {
            g.recv(f32s(&[0.0]), 0, 0).wait()
        }
    })
    .unwrap();
    let e = out[1].as_ref().unwrap().as_ref().unwrap_err();
    assert!(matches!(e, Error::PeerLost { rank: 0, .. }), "{e}");
    // Failed by the drop, long before the 30-minute default timeout.
    assert!(start.elapsed() < Duration::from_secs(10));
}

#[test]
fn a_continuation_of_a_receive_runs_on_its_rank_s_progress_thread() {
    // Rank 1 attaches the continuation, then lets rank 0 send: the send completes the
    // receive from rank 0's thread, and the continuation must still run on rank 1's.
    let attached = std::sync::Barrier::new(2);
    let out = run_local(2, |g| {
        if g.rank() == 0 {
            attached.wait();
            g.send(f32s(&[1.0]), 1, 0).wait().unwrap();
            String::new()
        } else {
            let work = g.recv(f32s(&[0.0]), 0, 0).then(|r| {
                r?;
                Ok(std::thread::current().name().unwrap_or("").to_string())
            });
            attached.wait();
            work.wait().unwrap()
        }
    })
    .unwrap();
    assert_eq!(out[1].as_ref().unwrap(), "collectives-rank-1");
}

#[test]
fn reduce_gather_and_scatter() {
    let out = run_local(3, |g| {
        let r = g.rank();
        let reduced = g
            .reduce(f32s(&[r as f32, 1.0]), 1, ReduceOp::Sum)
            .wait()
            .unwrap();
        let gathered = g.gather(Buffer::F64(vec![r as f64; 2]), 2).wait().unwrap();
        let chunks = if r == 0 {
            (0..3).map(|j| f32s(&[j as f32 * 10.0; 2])).collect()
        } else {
            Vec::new()
        };
        let scattered = g.scatter(chunks, f32s(&[0.0; 2]), 0).wait().unwrap();
        (reduced, gathered, scattered)
    })
    .unwrap();
    for (r, res) in out.into_iter().enumerate() {
        let (reduced, gathered, scattered) = res.unwrap();
        if r == 1 {
            assert_eq!(reduced, f32s(&[3.0, 3.0]));
        }
        if r == 2 {
            let want: Vec<Buffer> = (0..3).map(|p| Buffer::F64(vec![p as f64; 2])).collect();
            assert_eq!(gathered, want);
        } else {
            assert!(gathered.is_empty());
        }
        assert_eq!(scattered, f32s(&[r as f32 * 10.0; 2]));
    }
}

#[test]
fn a_scatter_the_root_rejects_fails_everywhere_at_once() {
    let start = Instant::now();
    let out = run_local(3, |g| {
        let chunks = if g.rank() == 0 {
            vec![f32s(&[1.0]), f32s(&[2.0])] // one short
        } else {
            Vec::new()
        };
        g.scatter(chunks, f32s(&[0.0]), 0).wait()
    })
    .unwrap();
    let errs: Vec<Error> = out.into_iter().map(|r| r.unwrap().unwrap_err()).collect();
    assert!(matches!(&errs[0], Error::InvalidArgument(m) if m.contains("one chunk per rank")));
    for e in &errs[1..] {
        assert!(matches!(e, Error::Mismatch(_)), "{e}");
    }
    assert!(start.elapsed() < Duration::from_secs(10));
}

#[test]
fn all_to_all_with_equal_and_given_splits() {
    let out = run_local(3, |g| {
        let r = g.rank() as f32;
        // Chunk j of rank r holds 10 r + j.
        let equal = g
            .all_to_all(f32s(&[10.0 * r, 10.0 * r + 1.0, 10.0 * r + 2.0]))
            .wait()
            .unwrap();
        // Rank r sends j + 1 elements to rank j, each 100 r + j.
        let send: Vec<f32> = (0..3)
            .flat_map(|j| std::iter::repeat_n(100.0 * r + j as f32, j + 1))
            .collect();
        let me = g.rank();
        let split = g
            .all_to_all_split(f32s(&send), vec![1, 2, 3], vec![me + 1; 3])
            .wait()
            .unwrap();
        (equal, split)
    })
    .unwrap();
    for (me, res) in out.into_iter().enumerate() {
        let (equal, split) = res.unwrap();
        let want: Vec<f32> = (0..3).map(|p| 10.0 * p as f32 + me as f32).collect();
        assert_eq!(equal, Buffer::F32(want));
        let want: Vec<f32> = (0..3)
            .flat_map(|p| std::iter::repeat_n(100.0 * p as f32 + me as f32, me + 1))
            .collect();
        assert_eq!(split, Buffer::F32(want));
    }
}

#[test]
fn all_to_all_rejects_counts_that_do_not_add_up() {
    let out = run_local(2, |g| {
        g.all_to_all_split(f32s(&[1.0, 2.0, 3.0]), vec![1, 1], vec![1, 1])
            .wait()
    })
    .unwrap();
    for r in out {
        assert!(matches!(r.unwrap(), Err(Error::InvalidArgument(_))));
    }
}

#[test]
fn a_linked_group_charges_point_to_point_messages() {
    use collectives::link::{Charge, Link, LinkOp, Linked};
    let link = Link::gbit(1.0, Duration::from_micros(20)).unwrap();
    let out = run_local(2, |g| {
        let g = Linked::new(g, link, Charge::Account);
        if g.rank() == 0 {
            g.send(f32s(&[1.0; 1000]), 1, 0).wait().unwrap();
        } else {
            g.recv(f32s(&[0.0; 1000]), 0, 0).wait().unwrap();
        }
        // The composed gather sends over the wrapper's own (charged) operations.
        g.gather(f32s(&[2.0; 10]), 0).wait().unwrap();
        (g.take_log(), g.charged())
    })
    .unwrap();
    let (log0, charged0) = out[0].as_ref().unwrap();
    let (log1, charged1) = out[1].as_ref().unwrap();
    assert_eq!(log0, &vec![LinkOp::Send(4000), LinkOp::Recv(40)]);
    assert_eq!(log1, &vec![LinkOp::Recv(4000), LinkOp::Send(40)]);
    assert_eq!(LinkOp::Recv(4000).bytes(), 0);
    // 4000 bytes at 1 Gbit/s (32 us) plus 20 us of latency, then 40 bytes (0.32 us + 20 us).
    let want = Duration::from_nanos(32_000 + 20_000 + 320 + 20_000);
    for c in [charged0, charged1] {
        assert!(c.abs_diff(want) < Duration::from_nanos(10), "{c:?}");
    }
}

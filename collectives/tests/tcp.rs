//! The TCP backend (`collectives::tcp::TcpGroup`): every collective against the thread
//! backend bit for bit on 1 to 4 ranks (threads of this process, each with its own
//! `TcpGroup` over loopback sockets), point-to-point order and tag matching, mismatches
//! on both sides, lost peers, timeouts, refused connections, subgroups, and one job of
//! three processes under `launch`.

mod common;

use collectives::store::TcpStore;
use collectives::{
    run_local, Buffer, DType, Error, P2pOp, ProcessGroup, ReduceOp, TcpGroup, TcpOptions,
};
use half::{bf16, f16};
use std::io::{Read, Write};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// The timeout of the groups whose tests never wait it out.
const LONG: Duration = Duration::from_secs(60);

/// Asserts that what started at `start` ended long before [`LONG`]: it failed at once.
fn assert_prompt(start: Instant) {
    let took = start.elapsed();
    assert!(took < Duration::from_secs(15), "{took:?}");
}

/// Runs `f` on `n` threads, each with its rank of a new TCP group on a store served on
/// loopback; the results in rank order. The groups are dropped as `f` returns.
fn run_tcp<R: Send>(n: usize, timeout: Duration, f: impl Fn(TcpGroup) -> R + Sync) -> Vec<R> {
    let server = TcpStore::server(("127.0.0.1", 0), n, timeout).expect("serve the store");
    let port = server.port();
    let (server, f) = (&server, &f);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                s.spawn(move || {
                    let client;
                    let store = if rank == 0 {
                        server
                    } else {
                        client = TcpStore::client("127.0.0.1", port, timeout).expect("connect");
                        &client
                    };
                    let g = TcpGroup::new(store, rank, n, TcpOptions::with_timeout(timeout))
                        .expect("make the TCP group");
                    f(g)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank panicked"))
            .collect()
    })
}

/// Rank `r`'s input: values of many magnitudes, so that the order of additions shows
/// in the last bits of a sum.
fn values(r: usize, len: usize) -> Vec<f64> {
    (0..len)
        .map(|i| {
            let x = ((i as f64) * 0.618 + (r as f64) * 1.414).sin();
            x * [1.0, 1e3, 1e-3, 7.0][(i + r) % 4]
        })
        .collect()
}

fn buffer(dtype: DType, r: usize, len: usize) -> Buffer {
    let v = values(r, len);
    match dtype {
        DType::F32 => Buffer::F32(v.iter().map(|&x| x as f32).collect()),
        DType::F64 => Buffer::F64(v),
        DType::F16 => Buffer::F16(v.iter().map(|&x| f16::from_f64(x)).collect()),
        DType::BF16 => Buffer::BF16(v.iter().map(|&x| bf16::from_f64(x)).collect()),
        DType::U8 => Buffer::U8(v.iter().map(|&x| (x * 100.0) as i64 as u8).collect()),
    }
}

const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];
const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

/// Every collective the backend implements, on one rank of `g`: the outputs in order.
/// Lengths are odd (not divisible by the group size), empty, and above the 32 KiB
/// one-round limit.
fn script(g: &dyn ProcessGroup) -> Vec<Buffer> {
    let (r, n) = (g.rank(), g.size());
    let mut out = Vec::new();
    for dtype in FLOATS {
        for len in [0, 1, 7, 1001, 20_011] {
            for op in OPS {
                out.push(g.all_reduce(buffer(dtype, r, len), op).wait().unwrap());
            }
        }
        for each in [0, 3, 4099] {
            for op in OPS {
                let b = buffer(dtype, r, each * n);
                out.push(g.reduce_scatter(b, op).wait().unwrap());
            }
        }
    }
    let coalesced = vec![
        buffer(DType::F32, r, 5),
        buffer(DType::F16, r, 30_001),
        buffer(DType::F64, r, 0),
        buffer(DType::BF16, r, 17),
        buffer(DType::F32, r, 12_345),
    ];
    for op in OPS {
        out.extend(
            g.all_reduce_coalesced(coalesced.clone(), op)
                .wait()
                .unwrap(),
        );
    }
    out.push(
        g.all_reduce_wire(buffer(DType::F32, r, 9_999), DType::BF16, ReduceOp::Avg)
            .wait()
            .unwrap(),
    );
    for dtype in [DType::F32, DType::U8, DType::BF16] {
        for len in [0, 13, 50_001] {
            out.push(g.broadcast(buffer(dtype, r, len), n - 1).wait().unwrap());
            out.extend(g.all_gather(buffer(dtype, r, len)).wait().unwrap());
        }
    }
    g.barrier().wait().unwrap();
    // The trait's defaults over this backend's operations.
    out.push(
        g.reduce(buffer(DType::F32, r, 33), 0, ReduceOp::Sum)
            .wait()
            .unwrap(),
    );
    out.extend(g.gather(buffer(DType::U8, r, 9), n - 1).wait().unwrap());
    out.push(g.all_to_all(buffer(DType::F64, r, 5 * n)).wait().unwrap());
    out
}

/// Same type, length and bits.
fn assert_bits(what: &str, a: &[Buffer], b: &[Buffer]) {
    assert_eq!(a.len(), b.len(), "{what}: number of outputs");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(
            (x.dtype(), x.len()),
            (y.dtype(), y.len()),
            "{what}: output {i}"
        );
        assert!(
            x.as_bytes() == y.as_bytes(),
            "{what}: output {i} differs in its bits"
        );
    }
}

#[test]
fn every_collective_matches_the_thread_backend_bit_for_bit() {
    for n in 1..=4 {
        let tcp = run_tcp(n, LONG, |g| script(&g));
        let threads = run_local(n, |g| script(&g)).unwrap();
        for (r, (t, th)) in tcp.iter().zip(threads).enumerate() {
            assert_bits(&format!("{n} ranks, rank {r}"), t, &th.unwrap());
        }
    }
}

#[test]
fn sums_are_exact_and_the_order_of_additions_shows() {
    // Integer values: the sum is exact, whatever the order.
    let out = run_tcp(3, LONG, |g| {
        let v: Vec<f32> = (0..70_001)
            .map(|i| (i % 97) as f32 * (g.rank() + 1) as f32)
            .collect();
        g.all_reduce(Buffer::F32(v), ReduceOp::Sum).wait().unwrap()
    });
    let exact: Vec<f32> = (0..70_001).map(|i| (i % 97) as f32 * 6.0).collect();
    for b in out {
        assert_eq!(b, Buffer::F32(exact.clone()));
    }
    // The inputs of the bit-for-bit test do depend on the order (so that test can fail):
    // rank order and reverse rank order differ somewhere.
    let ins: Vec<Vec<f32>> = (0..3)
        .map(|r| values(r, 20_011).iter().map(|&x| x as f32).collect())
        .collect();
    let differs = (0..20_011).any(|i| {
        let fwd = ins[0][i] + ins[1][i] + ins[2][i];
        let rev = ins[2][i] + ins[1][i] + ins[0][i];
        fwd.to_bits() != rev.to_bits()
    });
    assert!(differs);
}

#[test]
fn point_to_point_is_in_order_per_tag_and_tags_are_independent() {
    let out = run_tcp(3, LONG, |g| {
        let (r, n) = (g.rank(), g.size());
        // A ring, with a batch in both directions.
        let works = g.batch_isend_irecv(vec![
            P2pOp::send(Buffer::F64(vec![r as f64; 40_000]), (r + 1) % n, 3),
            P2pOp::recv(Buffer::F64(vec![0.0; 40_000]), (r + n - 1) % n, 3),
        ]);
        let got: Vec<Buffer> = works.into_iter().map(|w| w.wait().unwrap()).collect();
        assert_eq!(
            got[0],
            Buffer::F64(vec![r as f64; 40_000]),
            "the send's buffer comes back"
        );
        assert_eq!(got[1], Buffer::F64(vec![((r + n - 1) % n) as f64; 40_000]));
        if r == 0 {
            let sends: Vec<_> = (0..3)
                .map(|i| g.send(Buffer::F32(vec![i as f32]), 1, 1))
                .chain([g.send(Buffer::F32(vec![10.0]), 1, 2)])
                .collect();
            for w in sends {
                w.wait().unwrap();
            }
            Vec::new()
        } else if r == 1 {
            // Tag 2 first, though it was sent last; tag 1 in the order sent.
            let mut got = vec![g.recv(Buffer::F32(vec![0.0]), 0, 2).wait().unwrap()];
            for _ in 0..3 {
                got.push(g.recv(Buffer::F32(vec![0.0]), 0, 1).wait().unwrap());
            }
            // To itself.
            let to_self = g.send(Buffer::U8(vec![1, 2, 3]), 1, 9);
            got.push(g.recv(Buffer::U8(vec![0; 3]), 1, 9).wait().unwrap());
            to_self.wait().unwrap();
            got
        } else {
            Vec::new()
        }
    });
    let f = |x: f32| Buffer::F32(vec![x]);
    assert_eq!(
        out[1],
        vec![f(10.0), f(0.0), f(1.0), f(2.0), Buffer::U8(vec![1, 2, 3])]
    );
}

#[test]
fn a_point_to_point_mismatch_fails_both_sides_and_the_pair_goes_on() {
    let out = run_tcp(2, LONG, |g| {
        let first = if g.rank() == 0 {
            g.send(Buffer::F32(vec![1.0; 3]), 1, 4).wait()
        } else {
            g.recv(Buffer::F32(vec![0.0; 4]), 0, 4).wait()
        };
        let second = if g.rank() == 0 {
            g.send(Buffer::F64(vec![2.0; 2]), 1, 4).wait()
        } else {
            g.recv(Buffer::F32(vec![0.0; 2]), 0, 4).wait()
        };
        let third = if g.rank() == 0 {
            g.send(Buffer::F32(vec![5.0; 2]), 1, 4).wait()
        } else {
            g.recv(Buffer::F32(vec![0.0; 2]), 0, 4).wait()
        };
        (first, second, third)
    });
    for (r, (first, second, third)) in out.into_iter().enumerate() {
        match first {
            Err(Error::Mismatch(m)) => {
                assert!(m.contains("F32 x 3") && m.contains("F32 x 4"), "{m}")
            }
            other => panic!("rank {r}: {other:?}"),
        }
        assert!(
            matches!(second, Err(Error::Mismatch(_))),
            "rank {r}: {second:?}"
        );
        assert_eq!(third.unwrap(), Buffer::F32(vec![5.0; 2]), "rank {r}");
    }
}

#[test]
fn bad_arguments_are_typed_errors() {
    let out = run_tcp(3, LONG, |g| {
        let bad_peer = g.send(Buffer::F32(vec![1.0]), 3, 0).wait();
        let bad_tag = g
            .recv(Buffer::F32(vec![1.0]), 0, collectives::MAX_TAG + 1)
            .wait();
        // Every rank rejects: each gets its own error and the group goes on.
        let root = g.broadcast(Buffer::F32(vec![1.0]), 7).wait();
        let u8_sum = g.all_reduce(Buffer::U8(vec![1]), ReduceOp::Sum).wait();
        let odd = g
            .reduce_scatter(Buffer::F32(vec![1.0; 4]), ReduceOp::Sum)
            .wait();
        // One rank rejects: it gets its error, the others a mismatch naming it.
        let root_of = if g.rank() == 1 { 9 } else { 0 };
        let one = g
            .broadcast(Buffer::F32(vec![g.rank() as f32]), root_of)
            .wait();
        let after = g.all_reduce(Buffer::F32(vec![1.0]), ReduceOp::Sum).wait();
        (bad_peer, bad_tag, root, u8_sum, odd, one, after)
    });
    for (r, (bad_peer, bad_tag, root, u8_sum, odd, one, after)) in out.into_iter().enumerate() {
        for e in [
            bad_peer.map(drop),
            bad_tag.map(drop),
            root.map(drop),
            u8_sum.map(drop),
            odd.map(drop),
        ] {
            assert!(
                matches!(e, Err(Error::InvalidArgument(_))),
                "rank {r}: {e:?}"
            );
        }
        match (r, one) {
            (1, Err(Error::InvalidArgument(_))) => {}
            (_, Err(Error::Mismatch(m))) if r != 1 => assert!(m.contains("rank 1 rejected"), "{m}"),
            (_, other) => panic!("rank {r}: {other:?}"),
        }
        assert_eq!(after.unwrap(), Buffer::F32(vec![3.0]), "rank {r}");
    }
}

#[test]
fn a_collective_mismatch_fails_every_rank() {
    let out = run_tcp(3, LONG, |g| {
        let r = g.rank();
        let len = if r == 2 { 6 } else { 5 };
        let lengths = g
            .all_reduce(Buffer::F32(vec![1.0; len]), ReduceOp::Sum)
            .wait();
        let kinds = if r == 0 {
            g.barrier().wait().map(|()| Buffer::F32(Vec::new()))
        } else {
            g.all_reduce(Buffer::F32(vec![1.0]), ReduceOp::Sum).wait()
        };
        let op = if r == 1 { ReduceOp::Max } else { ReduceOp::Sum };
        let ops = g.all_reduce(Buffer::F64(vec![1.0; 40_000]), op).wait();
        let parts = g
            .all_reduce_coalesced(
                vec![
                    Buffer::F32(vec![1.0; 2]),
                    buffer(if r == 2 { DType::F16 } else { DType::BF16 }, r, 3),
                ],
                ReduceOp::Sum,
            )
            .wait();
        // All agree again: the group is still usable.
        let after = g
            .all_reduce(Buffer::F32(vec![2.0; 50_000]), ReduceOp::Sum)
            .wait();
        (lengths, kinds, ops, parts.map(drop), after)
    });
    for (r, (lengths, kinds, ops, parts, after)) in out.into_iter().enumerate() {
        match lengths {
            Err(Error::Mismatch(m)) => assert!(m.contains("F32 x 6") || m.contains("x 6"), "{m}"),
            other => panic!("rank {r}: {other:?}"),
        }
        assert!(
            matches!(kinds, Err(Error::Mismatch(_))),
            "rank {r}: {kinds:?}"
        );
        assert!(matches!(ops, Err(Error::Mismatch(_))), "rank {r}: {ops:?}");
        assert!(
            matches!(parts, Err(Error::Mismatch(_))),
            "rank {r}: {parts:?}"
        );
        assert_eq!(after.unwrap(), Buffer::F32(vec![6.0; 50_000]), "rank {r}");
    }
}

#[test]
fn a_rank_that_drops_its_group_fails_the_others_with_peer_lost() {
    let posted = Arc::new(Barrier::new(3));
    let start = Instant::now();
    let out = run_tcp(3, LONG, |g| {
        g.barrier().wait().unwrap();
        if g.rank() == 2 {
            // Once the others have posted a collective and a receive that need it.
            posted.wait();
            drop(g);
            return Vec::new();
        }
        let pending = g.all_reduce(Buffer::F32(vec![1.0; 100_000]), ReduceOp::Sum);
        let recv = g.recv(Buffer::F32(vec![0.0]), 2, 0);
        posted.wait();
        let first = pending.wait();
        // Later operations that involve it fail at once; those between the others go on.
        let later = g.barrier().wait();
        let send = g.send(Buffer::F32(vec![1.0]), 2, 0).wait();
        let between = if g.rank() == 0 {
            g.send(Buffer::F32(vec![7.0]), 1, 0).wait()
        } else {
            g.recv(Buffer::F32(vec![0.0]), 0, 0).wait()
        };
        vec![
            first.map(drop),
            recv.wait().map(drop),
            later,
            send.map(drop),
            between.map(drop),
        ]
    });
    assert_prompt(start);
    for (r, results) in out.into_iter().enumerate().take(2) {
        let (between, lost) = results.split_last().unwrap();
        for e in lost {
            assert!(
                matches!(e, Err(Error::PeerLost { rank: 2, .. })),
                "rank {r}: {e:?}"
            );
        }
        assert!(between.is_ok(), "rank {r}: {between:?}");
    }
}

#[test]
fn a_rank_that_never_comes_is_a_timeout_naming_it() {
    let short = Duration::from_secs(1);
    let out = run_tcp(3, short, |g| {
        if g.rank() == 1 {
            // Stays (its sockets open) past the others' timeout, then leaves.
            std::thread::sleep(Duration::from_millis(2500));
            return (Ok(()), Ok(Buffer::U8(Vec::new())));
        }
        let start = Instant::now();
        let coll = g
            .all_reduce(Buffer::F32(vec![1.0; 10]), ReduceOp::Sum)
            .wait()
            .map(drop);
        let p2p = g.recv(Buffer::F32(vec![0.0]), 1, 0).wait();
        assert!(start.elapsed() < Duration::from_secs(10));
        (coll, p2p)
    });
    for r in [0, 2] {
        match &out[r].0 {
            Err(Error::Timeout { missing, .. }) => assert!(missing.contains(&1), "{missing:?}"),
            other => panic!("rank {r}: {other:?}"),
        }
        assert!(
            matches!(&out[r].1, Err(Error::Timeout { missing, .. }) if missing == &vec![1]),
            "{:?}",
            out[r].1
        );
    }
}

/// The address the `n`th group on `store` published for `rank`.
fn published(store: &TcpStore, n: usize, rank: usize) -> String {
    let key = format!("collectives/tcp/{n}/addr/{rank}");
    store.wait(&[&key], LONG).unwrap();
    String::from_utf8(store.get(&key).unwrap()).unwrap()
}

#[test]
fn stray_connections_and_wrong_world_sizes_are_refused() {
    let server = TcpStore::server(("127.0.0.1", 0), 2, LONG).unwrap();
    let port = server.port();
    std::thread::scope(|s| {
        let rank0 = s.spawn(|| TcpGroup::new(&server, 0, 2, TcpOptions::with_timeout(LONG)));
        // A connection that is not a rank: refused with a reason, and rank 0 waits on.
        let looker = TcpStore::client("127.0.0.1", port, LONG).unwrap();
        let addr = published(&looker, 1, 0);
        let mut stray = std::net::TcpStream::connect(&addr).unwrap();
        stray
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut answer = Vec::new();
        stray.set_read_timeout(Some(LONG)).unwrap();
        let _ = stray.read_to_end(&mut answer);
        assert_eq!(answer.first(), Some(&1), "refused: {answer:?}");
        // A connection that says nothing and leaves.
        drop(std::net::TcpStream::connect(&addr).unwrap());
        // Then the real rank 1.
        let client = TcpStore::client("127.0.0.1", port, LONG).unwrap();
        let rank1 = TcpGroup::new(&client, 1, 2, TcpOptions::with_timeout(LONG)).unwrap();
        let rank0 = rank0.join().unwrap().unwrap();
        let a = rank0.all_reduce(Buffer::F32(vec![1.0]), ReduceOp::Sum);
        let b = rank1.all_reduce(Buffer::F32(vec![2.0]), ReduceOp::Sum);
        assert_eq!(a.wait().unwrap(), Buffer::F32(vec![3.0]));
        assert_eq!(b.wait().unwrap(), Buffer::F32(vec![3.0]));
    });

    // A rank that believes in another world size is refused by name; the rank it
    // connected to keeps waiting for the real one and names it when its timeout passes.
    let short = Duration::from_secs(2);
    let server = TcpStore::server(("127.0.0.1", 0), 3, LONG).unwrap();
    let port = server.port();
    std::thread::scope(|s| {
        let rank0 = s.spawn(|| TcpGroup::new(&server, 0, 2, TcpOptions::with_timeout(short)));
        let start = Instant::now();
        let client = TcpStore::client("127.0.0.1", port, LONG).unwrap();
        let wrong = TcpGroup::new(&client, 1, 3, TcpOptions::with_timeout(short));
        match wrong {
            Err(Error::Rendezvous { why, ranks }) => {
                assert!(why.contains("world size 3"), "{why}");
                assert_eq!(ranks, vec![1, 0]);
            }
            other => panic!("{other:?}"),
        }
        assert!(start.elapsed() < short, "refused at once");
        match rank0.join().unwrap() {
            Err(Error::Timeout { missing, .. }) => assert_eq!(missing, vec![1]),
            other => panic!("{other:?}"),
        }
    });
}

#[test]
fn subgroups_reuse_the_connections_and_match_the_thread_backend() {
    fn sub_script(g: &dyn ProcessGroup) -> Vec<Buffer> {
        let r = g.rank();
        let sub = g.new_group(&[2, 0]).unwrap();
        let pair = g.new_group(&[1, 2]).unwrap();
        assert_eq!(sub.is_some(), r != 1);
        let mut out = Vec::new();
        // World and subgroup operations interleaved, in flight together.
        let world = g.all_reduce(buffer(DType::F32, r, 40_001), ReduceOp::Sum);
        if let Some(sub) = &sub {
            assert_eq!(sub.size(), 2);
            assert_eq!(sub.rank(), if r == 2 { 0 } else { 1 });
            let s = sub.all_reduce(buffer(DType::F32, r, 40_001), ReduceOp::Avg);
            let p = if sub.rank() == 0 {
                sub.send(Buffer::F64(vec![r as f64; 3]), 1, 0)
            } else {
                sub.recv(Buffer::F64(vec![0.0; 3]), 0, 0)
            };
            out.push(s.wait().unwrap());
            out.push(p.wait().unwrap());
            out.extend(sub.all_gather(buffer(DType::BF16, r, 5)).wait().unwrap());
        }
        if let Some(pair) = &pair {
            out.push(
                pair.reduce_scatter(buffer(DType::F16, r, 8), ReduceOp::Max)
                    .wait()
                    .unwrap(),
            );
        }
        out.push(world.wait().unwrap());
        out
    }
    let tcp = run_tcp(3, LONG, |g| sub_script(&g));
    let threads = run_local(3, |g| sub_script(&g)).unwrap();
    for (r, (t, th)) in tcp.iter().zip(threads).enumerate() {
        assert_bits(&format!("rank {r}"), t, &th.unwrap());
    }
    // The subgroup's send went to world rank 0 from world rank 2.
    assert_eq!(tcp[0][1], Buffer::F64(vec![2.0; 3]));
}

#[test]
fn new_group_with_different_lists_fails_every_rank() {
    let out = run_tcp(2, LONG, |g| {
        let ranks: &[usize] = if g.rank() == 0 { &[0, 1] } else { &[1, 0] };
        let e = g.new_group(ranks).map(|s| s.is_some());
        let after = g.all_reduce(Buffer::F32(vec![1.0]), ReduceOp::Sum).wait();
        (e, after)
    });
    for (r, (e, after)) in out.into_iter().enumerate() {
        assert!(matches!(e, Err(Error::Mismatch(_))), "rank {r}: {e:?}");
        assert_eq!(after.unwrap(), Buffer::F32(vec![2.0]));
    }
}

#[test]
fn three_processes_under_launch_all_reduce_exactly() {
    let exe = common::example("tcp_allreduce");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_launch"))
        .args(["-n", "3", "--timeout", "60", "--"])
        .arg(&exe)
        .arg("65537")
        .output()
        .expect("run launch");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}\n{stdout}\n{stderr}", out.status);
    for rank in 0..3 {
        let line = format!("rank {rank} of 3: all_reduce of 65537 f32 exact, barrier passed");
        assert!(stdout.lines().any(|l| l == line), "{stdout}");
    }
}

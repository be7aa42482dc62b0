//! The NCCL backend on real GPUs (`--features cuda`).
//!
//! At world size 1 (one GPU, where NCCL allows no more): every operation on host and
//! device buffers equals its input (Sum, Avg, Max, Min of one rank; broadcast from rank
//! 0; all_gather gives `[buf]`; reduce_scatter is the identity), with and without debug
//! mode; continuations run on the progress thread; `new_group`; the store rendezvous;
//! abort; the creation timeout when a rank never joins; the missing-library error;
//! point-to-point to self (host and device buffers, in one batch), `U8` buffers (moved,
//! never reduced), the composed gather, scatter and all_to_all, debug mode's
//! point-to-point mismatches, and a receive that times out. With at least two GPUs, two
//! ranks: exact results, point-to-point both ways, debug mode's mismatch report, and a
//! peer that leaves.
//!
//! Without a CUDA driver, NCCL or a device each test prints one `skipped: ...` line and
//! passes. Two tests run a copy of this binary as a child process: the missing-library
//! check (it hides `LD_LIBRARY_PATH`) and the creation timeout (it leaves NCCL's bootstrap
//! waiting for the absent rank).
#![cfg(feature = "cuda")]

use collectives::nccl::{self, NcclGroup, NcclId};
use collectives::store::TcpStore;
use collectives::{Buffer, DType, DeviceBuffer, Error, P2pOp, ProcessGroup, ReduceOp, MAX_TAG};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use half::{bf16, f16};
use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_secs(60);
const SHORT: Duration = Duration::from_secs(2);
/// Set in a child process to the test it must run for its parent.
const CHILD: &str = "COLLECTIVES_NCCL_TEST_CHILD";

/// The number of GPUs, or `None` after printing the one line that says why the test is
/// skipped.
fn gpus() -> Option<usize> {
    // SAFETY: `is_culib_present` only tries to `dlopen` candidate names and closes them.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        println!("skipped: no CUDA driver");
        return None;
    }
    // SAFETY: as above.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        println!("skipped: no NCCL library");
        return None;
    }
    match nccl::device_count() {
        Ok(n) if n > 0 => {}
        other => {
            println!("skipped: no CUDA device ({other:?})");
            return None;
        }
    }
    match nccl::library_version() {
        Ok(v) if v >= (2, 14, 0) => nccl::device_count().ok(),
        other => {
            println!("skipped: NCCL 2.14 or newer is needed, found {other:?}");
            None
        }
    }
}

fn is_child(test: &str) -> bool {
    std::env::var(CHILD).is_ok_and(|v| v == test)
}

/// Runs `test` in a child copy of this binary with `env`, bounded by two minutes, and
/// returns its standard output; fails unless it succeeded.
fn run_child(test: &str, env: &[(&str, &str)]) -> String {
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut child = Command::new(exe)
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, test)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting the child test");
    let mut pipes = (child.stdout.take(), child.stderr.take());
    let out = std::thread::spawn(move || {
        let mut s = String::new();
        pipes.0.as_mut().map(|p| p.read_to_string(&mut s));
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        pipes.1.as_mut().map(|p| p.read_to_string(&mut s));
        s
    });
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for the child") {
            break Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let (out, err) = (
        out.join().unwrap_or_default(),
        err.join().unwrap_or_default(),
    );
    match status {
        Some(s) if s.success() => out,
        Some(s) => panic!("child {test} failed ({s}):\n{out}\n{err}"),
        None => panic!("child {test} did not finish in two minutes:\n{out}\n{err}"),
    }
}

fn one_rank(debug: bool) -> NcclGroup {
    NcclGroup::new(0, 1, 0, NcclId::new().expect("a unique id"), TIMEOUT)
        .expect("a one-rank group")
        .with_debug(debug)
}

/// Exactly representable values, as a buffer of `dtype`.
fn values(dtype: &str, xs: &[f64]) -> Buffer {
    match dtype {
        "f32" => Buffer::F32(xs.iter().map(|&x| x as f32).collect()),
        "f64" => Buffer::F64(xs.to_vec()),
        "f16" => Buffer::F16(xs.iter().map(|&x| f16::from_f64(x)).collect()),
        _ => Buffer::BF16(xs.iter().map(|&x| bf16::from_f64(x)).collect()),
    }
}

const DTYPES: [&str; 4] = ["f32", "f64", "f16", "bf16"];
const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];

#[test]
fn every_operation_at_world_size_one_returns_its_input() {
    if gpus().is_none() {
        return;
    }
    let xs = [1.5, -2.0, 3.25, 0.0, 8.0, -0.5];
    for debug in [false, true] {
        let g = one_rank(debug);
        assert_eq!((g.rank(), g.size(), g.backend()), (0, 1, "nccl"));
        assert_eq!(g.debug(), debug);
        for dtype in DTYPES {
            let buf = values(dtype, &xs);
            for op in OPS {
                let out = g.all_reduce(buf.clone(), op).wait();
                assert_eq!(
                    out,
                    Ok(buf.clone()),
                    "all_reduce {op:?} {dtype} debug={debug}"
                );
            }
            let out = g.broadcast(buf.clone(), 0).wait();
            assert_eq!(out, Ok(buf.clone()), "broadcast {dtype}");
            assert_eq!(
                g.all_gather(buf.clone()).wait(),
                Ok(vec![buf.clone()]),
                "all_gather {dtype}"
            );
            for op in OPS {
                let out = g.reduce_scatter(buf.clone(), op).wait();
                assert_eq!(out, Ok(buf.clone()), "reduce_scatter {op:?} {dtype}");
            }
        }
        let mixed = vec![
            values("f32", &xs),
            values("bf16", &xs[..3]),
            Buffer::F64(Vec::new()),
            values("f16", &xs[1..]),
        ];
        assert_eq!(
            g.all_reduce_coalesced(mixed.clone(), ReduceOp::Avg).wait(),
            Ok(mixed)
        );
        let empty = Buffer::F32(Vec::new());
        assert_eq!(
            g.all_reduce(empty.clone(), ReduceOp::Sum).wait(),
            Ok(empty.clone())
        );
        assert_eq!(g.all_gather(empty.clone()).wait(), Ok(vec![empty]));
        assert_eq!(g.barrier().wait(), Ok(()));
        assert!(matches!(
            g.broadcast(values("f32", &xs), 1).wait(),
            Err(Error::InvalidArgument(_))
        ));
        assert_eq!(g.failure(), None);
    }
}

#[test]
fn continuations_run_on_the_progress_thread_in_order() {
    if gpus().is_none() {
        return;
    }
    let g = one_rank(false);
    let works: Vec<_> = (0..8)
        .map(|i| {
            g.all_reduce(Buffer::F32(vec![i as f32]), ReduceOp::Sum)
                .then(|r| r.map(|b| (b, std::thread::current().name().map(String::from))))
        })
        .collect();
    for (i, w) in works.into_iter().enumerate() {
        let (buf, thread) = w.wait().expect("all_reduce");
        assert_eq!(buf, Buffer::F32(vec![i as f32]));
        assert_eq!(thread.as_deref(), Some("nccl-rank-0"));
    }
    // A chain issued from a continuation runs too (and_then does not block the thread).
    let g = Arc::new(g);
    let g2 = g.clone();
    let chained = g
        .all_reduce(Buffer::F64(vec![2.0]), ReduceOp::Sum)
        .and_then(move |b| g2.all_reduce(b, ReduceOp::Max));
    assert_eq!(chained.wait(), Ok(Buffer::F64(vec![2.0])));
}

/// A continuation that waits for another operation of its own group (which only the
/// progress thread running it could issue) fails at once with `InvalidArgument` instead
/// of blocking that thread, and so the group, forever; the group goes on.
#[test]
fn a_continuation_waiting_on_its_own_group_fails_at_once() {
    if gpus().is_none() {
        return;
    }
    let g = Arc::new(one_rank(false));
    let g2 = g.clone();
    let start = Instant::now();
    let inner = g
        .barrier()
        .then(move |_| Ok(g2.barrier().wait()))
        .wait_timeout(Duration::from_secs(30))
        .expect("the outer work completes");
    assert!(
        matches!(inner, Err(Error::InvalidArgument(_))),
        "expected InvalidArgument, got {inner:?}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "took {:?}",
        start.elapsed()
    );
    assert_eq!(
        g.all_reduce(Buffer::F32(vec![3.0]), ReduceOp::Sum).wait(),
        Ok(Buffer::F32(vec![3.0]))
    );
}

/// Uploads `xs` as `T` on `stream`.
fn upload<T: cudarc::driver::DeviceRepr + Copy>(
    stream: &Arc<CudaStream>,
    xs: &[T],
) -> CudaSlice<T> {
    stream.clone_htod(xs).expect("upload")
}

fn download<T: cudarc::driver::DeviceRepr + Copy + Default>(
    stream: &Arc<CudaStream>,
    s: &CudaSlice<T>,
) -> Vec<T> {
    stream.clone_dtoh(s).expect("download")
}

#[test]
fn device_buffers_at_world_size_one() {
    if gpus().is_none() {
        return;
    }
    let g = one_rank(true);
    // The caller's own stream, not the group's: the group orders itself after it.
    let ctx = CudaContext::new(0).expect("context");
    let stream = ctx.new_stream().expect("stream");
    let xs = [1.5f32, -2.0, 3.25, 0.0];
    for op in OPS {
        let out = g
            .all_reduce_device(upload(&stream, &xs), op)
            .wait()
            .expect("all_reduce_device");
        assert_eq!(download(&stream, &out), xs, "{op:?}");
    }
    let out = g
        .broadcast_device(upload(&stream, &xs), 0)
        .wait()
        .expect("broadcast_device");
    assert_eq!(download(&stream, &out), xs);
    let out = g
        .all_gather_device(upload(&stream, &xs))
        .wait()
        .expect("all_gather_device");
    assert_eq!(download(&stream, &out), xs);
    let out = g
        .reduce_scatter_device(upload(&stream, &xs), ReduceOp::Sum)
        .wait()
        .expect("reduce_scatter_device");
    assert_eq!(download(&stream, &out), xs);
    let hs: Vec<f16> = xs.iter().map(|&x| f16::from_f32(x)).collect();
    let bs: Vec<bf16> = xs.iter().map(|&x| bf16::from_f32(x)).collect();
    let out = g
        .all_reduce_coalesced_device(
            vec![upload(&stream, &hs), upload(&stream, &hs[..2])],
            ReduceOp::Avg,
        )
        .wait()
        .expect("all_reduce_coalesced_device");
    assert_eq!(download(&stream, &out[0]), hs);
    assert_eq!(download(&stream, &out[1]), &hs[..2]);
    let out = g
        .all_reduce_device(upload(&stream, &bs), ReduceOp::Max)
        .wait()
        .expect("bf16");
    assert_eq!(download(&stream, &out), bs);
    let ds = [1.0f64, 1e300, -3.0];
    let out = g
        .all_reduce_device(upload(g.stream(), &ds), ReduceOp::Min)
        .wait()
        .expect("f64");
    assert_eq!(download(g.stream(), &out), ds);
}

#[test]
fn store_rendezvous_at_world_size_one() {
    if gpus().is_none() {
        return;
    }
    let store = TcpStore::server(("127.0.0.1", 0), 1, TIMEOUT).expect("store");
    // Twice: each call uses fresh keys.
    for round in 0..2 {
        let g = NcclGroup::from_store(&store, 0, 1, 0, TIMEOUT).expect("group from the store");
        let buf = Buffer::F32(vec![round as f32, 2.0]);
        assert_eq!(g.all_reduce(buf.clone(), ReduceOp::Sum).wait(), Ok(buf));
    }
}

#[test]
fn new_group_at_world_size_one() {
    if gpus().is_none() {
        return;
    }
    let g = Arc::new(one_rank(false));
    assert!(matches!(g.new_group(&[1]), Err(Error::InvalidArgument(_))));
    assert!(matches!(g.new_group(&[]), Err(Error::InvalidArgument(_))));
    match g.new_group(&[0]) {
        Err(Error::Unsupported(why)) => println!("note: new_group is unsupported here: {why}"),
        Err(e) => panic!("new_group failed: {e}"),
        Ok(None) => panic!("rank 0 is a member of [0]"),
        Ok(Some(sub)) => {
            assert_eq!((sub.rank(), sub.size(), sub.backend()), (0, 1, "nccl"));
            let buf = Buffer::BF16(vec![bf16::from_f32(3.0)]);
            assert_eq!(
                sub.all_reduce(buf.clone(), ReduceOp::Sum).wait(),
                Ok(buf.clone())
            );
            // The parent still works beside its child.
            assert_eq!(g.all_reduce(buf.clone(), ReduceOp::Sum).wait(), Ok(buf));
        }
    }
    // A continuation runs on the progress thread, which must do the split: refused.
    let g2 = g.clone();
    let from_continuation = g
        .barrier()
        .then(move |_| Ok(g2.new_group(&[0]).err()))
        .wait();
    assert!(matches!(
        from_continuation,
        Ok(Some(Error::InvalidArgument(_)))
    ));
}

#[test]
fn abort_fails_later_operations_with_a_typed_error() {
    if gpus().is_none() {
        return;
    }
    let g = one_rank(false);
    let buf = Buffer::F32(vec![1.0]);
    assert_eq!(
        g.all_reduce(buf.clone(), ReduceOp::Sum).wait(),
        Ok(buf.clone())
    );
    g.abort();
    match g.all_reduce(buf.clone(), ReduceOp::Sum).wait() {
        Err(Error::Aborted { .. }) => {}
        other => panic!("expected the abort error, got {other:?}"),
    }
    assert!(matches!(g.barrier().wait(), Err(Error::Aborted { .. })));
    assert!(matches!(g.failure(), Some(Error::Aborted { .. })));
    drop(g);
    // The process is still fine: a new group works.
    let g = one_rank(false);
    assert_eq!(g.all_reduce(buf.clone(), ReduceOp::Sum).wait(), Ok(buf));
}

#[test]
fn creation_times_out_when_a_rank_never_joins() {
    const TEST: &str = "creation_times_out_when_a_rank_never_joins";
    if is_child(TEST) {
        let id = NcclId::new().expect("a unique id");
        let start = Instant::now();
        // Rank 0 of 2; rank 1 never comes.
        match NcclGroup::new(0, 2, 0, id, SHORT) {
            Err(Error::Timeout { .. }) => {}
            other => panic!("expected a timeout, got {other:?}"),
        }
        let took = start.elapsed();
        assert!(
            took >= SHORT && took < SHORT + Duration::from_secs(30),
            "took {took:?}"
        );
        println!("child: creation timed out after {took:?}");
        return;
    }
    if gpus().is_none() {
        return;
    }
    let out = run_child(TEST, &[]);
    assert!(out.contains("child: creation timed out"), "{out}");
}

#[test]
fn a_missing_nccl_library_is_a_typed_error() {
    const TEST: &str = "a_missing_nccl_library_is_a_typed_error";
    /// "checked" when NCCL is missing and both entry points say how to provide it,
    /// "found" when NCCL loads.
    fn check() -> &'static str {
        let hint = |m: &str| m.contains("libnccl.so") && m.contains("LD_LIBRARY_PATH");
        let message = match NcclId::new() {
            Ok(_) => return "found",
            Err(Error::Unavailable(m)) if hint(&m) => m,
            Err(e) => panic!("unexpected error: {e:?}"),
        };
        assert_eq!(
            nccl::library_version(),
            Err(Error::Unavailable(message.clone()))
        );
        let zero = NcclId::from_bytes(&[0; 128]).expect("128 bytes");
        match NcclGroup::new(0, 1, 0, zero, SHORT) {
            Err(Error::Unavailable(m)) if m == message => "checked",
            other => panic!("expected the missing-library error, got {other:?}"),
        }
    }
    if is_child(TEST) {
        println!("child: {}", check());
        return;
    }
    // SAFETY: `is_culib_present` only tries to `dlopen` candidate names and closes them.
    let verdict = if unsafe { cudarc::nccl::sys::is_culib_present() } {
        // Hide NCCL from a child process by clearing the library path.
        let out = run_child(TEST, &[("LD_LIBRARY_PATH", "")]);
        ["checked", "found"]
            .into_iter()
            .find(|v| out.contains(&format!("child: {v}")))
            .unwrap_or("no verdict")
    } else {
        check()
    };
    match verdict {
        "checked" => {}
        "found" => println!(
            "skipped: NCCL is found without LD_LIBRARY_PATH, so its absence cannot be simulated"
        ),
        other => panic!("the child gave {other}"),
    }
}

/// Point-to-point at world size 1: a send to self and a receive from self in one
/// `batch_isend_irecv` (one NCCL group; alone, either would wait for the other forever),
/// in posting order, for every type; bad peers and tags fail on the caller alone; in
/// debug mode a length, type or tag disagreement fails both sides with a mismatch and the
/// group stays usable.
#[test]
fn point_to_point_to_self_at_world_size_one() {
    if gpus().is_none() {
        return;
    }
    let xs = [1.5, -2.0, 3.25, 0.0, 8.0];
    for debug in [false, true] {
        let g = one_rank(debug);
        let mut bufs: Vec<Buffer> = DTYPES.iter().map(|d| values(d, &xs)).collect();
        bufs.push(Buffer::U8(vec![0, 1, 2, 254, 255]));
        bufs.push(Buffer::F32(Vec::new()));
        for buf in bufs {
            let zeros = Buffer::zeros(buf.dtype(), buf.len());
            let works = g.batch_isend_irecv(vec![
                P2pOp::send(buf.clone(), 0, 7),
                P2pOp::recv(zeros, 0, 7),
            ]);
            let got: Vec<_> = works.into_iter().map(|w| w.wait()).collect();
            assert_eq!(
                got,
                vec![Ok(buf.clone()), Ok(buf.clone())],
                "{:?} debug={debug}",
                buf.dtype()
            );
        }
        // Two messages each way arrive in posting order (a receive posted first too).
        let (a, b) = (Buffer::F32(vec![1.0; 3]), Buffer::F32(vec![2.0; 3]));
        let works = g.batch_isend_irecv(vec![
            P2pOp::recv(Buffer::zeros(DType::F32, 3), 0, 1),
            P2pOp::send(a.clone(), 0, 1),
            P2pOp::send(b.clone(), 0, 1),
            P2pOp::recv(Buffer::zeros(DType::F32, 3), 0, 1),
        ]);
        let got: Vec<_> = works.into_iter().map(|w| w.wait()).collect();
        assert_eq!(got, vec![Ok(a.clone()), Ok(a), Ok(b.clone()), Ok(b)]);
        assert!(g.batch_isend_irecv(Vec::new()).is_empty());

        // Bad arguments: this rank alone, nothing queued, the group goes on.
        let one = Buffer::F32(vec![1.0]);
        assert!(matches!(
            g.send(one.clone(), 1, 0).wait(),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            g.recv(one.clone(), 0, MAX_TAG + 1).wait(),
            Err(Error::InvalidArgument(_))
        ));
        let works = g.batch_isend_irecv(vec![
            P2pOp::send(one.clone(), 0, 0),
            P2pOp::recv(one.clone(), 3, 0),
        ]);
        for w in works {
            assert!(matches!(w.wait(), Err(Error::InvalidArgument(_))));
        }
        assert_eq!(g.failure(), None);

        if debug {
            for recv in [
                Buffer::zeros(DType::F32, 4),
                Buffer::zeros(DType::F64, 3),
                Buffer::zeros(DType::F32, 3),
            ] {
                let tag = if recv == Buffer::zeros(DType::F32, 3) {
                    2
                } else {
                    1
                };
                let works = g.batch_isend_irecv(vec![
                    P2pOp::send(Buffer::F32(vec![1.0; 3]), 0, 1),
                    P2pOp::recv(recv, 0, tag),
                ]);
                for w in works {
                    match w.wait() {
                        Err(Error::Mismatch(m)) => assert!(m.contains("rank 0"), "{m}"),
                        other => panic!("expected a mismatch, got {other:?}"),
                    }
                }
            }
            // Two sends and one receive: the counts differ.
            let works = g.batch_isend_irecv(vec![
                P2pOp::send(one.clone(), 0, 0),
                P2pOp::send(one.clone(), 0, 0),
                P2pOp::recv(one.clone(), 0, 0),
            ]);
            for w in works {
                assert!(matches!(w.wait(), Err(Error::Mismatch(_))));
            }
            assert_eq!(g.failure(), None);
        }
        assert_eq!(
            g.all_reduce(one.clone(), ReduceOp::Sum).wait(),
            Ok(one.clone())
        );
    }
}

/// `U8` buffers move (broadcast, all_gather, point-to-point) but every reduction of one
/// is `InvalidArgument` before anything is queued, on host and device buffers alike.
#[test]
fn u8_buffers_move_but_never_reduce() {
    if gpus().is_none() {
        return;
    }
    for debug in [false, true] {
        let g = one_rank(debug);
        let bytes = Buffer::U8((0..=255).collect());
        assert_eq!(g.broadcast(bytes.clone(), 0).wait(), Ok(bytes.clone()));
        assert_eq!(g.all_gather(bytes.clone()).wait(), Ok(vec![bytes.clone()]));
        for op in OPS {
            let bad = [
                g.all_reduce(bytes.clone(), op).wait(),
                g.reduce_scatter(bytes.clone(), op).wait(),
                g.reduce(bytes.clone(), 0, op).wait(),
                g.all_reduce_coalesced(vec![Buffer::F32(vec![1.0]), bytes.clone()], op)
                    .wait()
                    .map(|mut v| v.remove(0)),
            ];
            for r in bad {
                assert!(
                    matches!(r, Err(Error::InvalidArgument(_))),
                    "{op:?} debug={debug}: {r:?}"
                );
            }
        }
        let stream = g.stream().clone();
        let host: Vec<u8> = (0..100).collect();
        let dev = DeviceBuffer::from(upload(&stream, &host));
        match ProcessGroup::all_reduce_device(&g, dev, ReduceOp::Max).wait() {
            Err(Error::InvalidArgument(_)) => {}
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
        match g
            .all_reduce_device(upload(&stream, &host), ReduceOp::Sum)
            .wait()
        {
            Err(Error::InvalidArgument(_)) => {}
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
        let dev = DeviceBuffer::from(upload(&stream, &host));
        let out: CudaSlice<u8> = ProcessGroup::broadcast_device(&g, dev, 0)
            .wait()
            .expect("broadcast_device of bytes")
            .try_into()
            .expect("u8 back");
        assert_eq!(download(&stream, &out), host);
        assert_eq!(g.failure(), None);
        assert_eq!(g.barrier().wait(), Ok(()));
    }
}

/// The composed collectives (trait defaults over NCCL's point-to-point operations and
/// all_reduce) at world size 1 give back their input.
#[test]
fn gather_scatter_all_to_all_at_world_size_one() {
    if gpus().is_none() {
        return;
    }
    let xs = [1.0, 2.0, -3.0, 4.5];
    for debug in [false, true] {
        let g = one_rank(debug);
        for dtype in DTYPES {
            let buf = values(dtype, &xs);
            assert_eq!(
                g.reduce(buf.clone(), 0, ReduceOp::Sum).wait(),
                Ok(buf.clone())
            );
            assert_eq!(g.gather(buf.clone(), 0).wait(), Ok(vec![buf.clone()]));
            let out = Buffer::zeros(buf.dtype(), buf.len());
            assert_eq!(g.scatter(vec![buf.clone()], out, 0).wait(), Ok(buf.clone()));
            assert_eq!(g.all_to_all(buf.clone()).wait(), Ok(buf.clone()));
            assert_eq!(
                g.all_to_all_split(buf.clone(), vec![xs.len()], vec![xs.len()])
                    .wait(),
                Ok(buf.clone())
            );
        }
        let bytes = Buffer::U8(vec![9, 8, 7]);
        assert_eq!(g.gather(bytes.clone(), 0).wait(), Ok(vec![bytes.clone()]));
        assert_eq!(g.all_to_all(bytes.clone()).wait(), Ok(bytes.clone()));
        assert!(matches!(
            g.gather(bytes.clone(), 1).wait(),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            g.scatter(vec![bytes.clone(), bytes.clone()], bytes.clone(), 0)
                .wait(),
            Err(Error::InvalidArgument(_))
        ));
        assert_eq!(g.failure(), None);
    }
}

/// Device buffers sent to and received from self in one batch, in place on the device
/// (from a caller's stream), with and without debug mode; a debug-mode mismatch on
/// device buffers; buffers on their own stream come back intact.
#[test]
fn device_point_to_point_round_trip_at_world_size_one() {
    if gpus().is_none() {
        return;
    }
    let ctx = CudaContext::new(0).expect("context");
    let stream = ctx.new_stream().expect("stream");
    let xs = [1.5f32, -2.0, 3.25, 0.0, 7.0];
    let hs: Vec<bf16> = xs.iter().map(|&x| bf16::from_f32(x)).collect();
    let bytes: Vec<u8> = (0..200).map(|i| (i * 7 % 256) as u8).collect();
    for debug in [false, true] {
        let g = one_rank(debug);
        assert!(g.device_native());
        let works = ProcessGroup::batch_isend_irecv_device(
            &g,
            vec![
                P2pOp::send(upload(&stream, &xs).into(), 0, 0),
                P2pOp::send(upload(&stream, &hs).into(), 0, 0),
                P2pOp::send(upload(&stream, &bytes).into(), 0, 0),
                P2pOp::recv(stream.alloc_zeros::<f32>(xs.len()).unwrap().into(), 0, 0),
                P2pOp::recv(stream.alloc_zeros::<bf16>(hs.len()).unwrap().into(), 0, 0),
                P2pOp::recv(stream.alloc_zeros::<u8>(bytes.len()).unwrap().into(), 0, 0),
            ],
        );
        let mut got: Vec<DeviceBuffer> = works
            .into_iter()
            .map(|w| w.wait().expect("device p2p"))
            .collect();
        let recv_u8: CudaSlice<u8> = got.pop().unwrap().try_into().unwrap();
        let recv_bf16: CudaSlice<bf16> = got.pop().unwrap().try_into().unwrap();
        let recv_f32: CudaSlice<f32> = got.pop().unwrap().try_into().unwrap();
        assert_eq!(download(&stream, &recv_u8), bytes);
        assert_eq!(download(&stream, &recv_bf16), hs);
        assert_eq!(download(&stream, &recv_f32), xs);
        let sent_f32: CudaSlice<f32> = got.remove(0).try_into().unwrap();
        assert_eq!(
            download(&stream, &sent_f32),
            xs,
            "the send comes back unchanged"
        );
        if debug {
            let works = ProcessGroup::batch_isend_irecv_device(
                &g,
                vec![
                    P2pOp::send(upload(&stream, &xs).into(), 0, 0),
                    P2pOp::recv(
                        stream.alloc_zeros::<f32>(xs.len() + 1).unwrap().into(),
                        0,
                        0,
                    ),
                ],
            );
            for w in works {
                assert!(matches!(w.wait(), Err(Error::Mismatch(_))));
            }
        }
        // Bad peer: InvalidArgument at once.
        let r = ProcessGroup::send_device(&g, upload(&stream, &xs).into(), 2, 0).wait();
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
        assert_eq!(g.failure(), None);
    }
}

/// A receive whose send never comes fails with a timeout (or NCCL's own error) within
/// the group's timeout, and fails the group; in a child process, since the abort of a
/// communicator with a receive in flight may leave the device context unusable.
#[test]
fn a_receive_with_no_send_fails_within_the_timeout() {
    const TEST: &str = "a_receive_with_no_send_fails_within_the_timeout";
    if is_child(TEST) {
        let g = NcclGroup::new(0, 1, 0, NcclId::new().expect("a unique id"), SHORT)
            .expect("a one-rank group");
        let start = Instant::now();
        let r = g.recv(Buffer::F32(vec![0.0; 4]), 0, 0).wait();
        let took = start.elapsed();
        assert!(
            matches!(r, Err(Error::Timeout { .. }) | Err(Error::Nccl { .. })),
            "{r:?}"
        );
        assert!(took < SHORT + Duration::from_secs(20), "took {took:?}");
        assert!(g.failure().is_some());
        assert!(g.barrier().wait().is_err());
        println!("child: the receive failed after {took:?} with {r:?}");
        return;
    }
    if gpus().is_none() {
        return;
    }
    let out = run_child(TEST, &[]);
    assert!(out.contains("child: the receive failed"), "{out}");
}

/// Runs `f(rank, group)` on two ranks, one per GPU, joined through a loopback store.
fn two_ranks<R: Send>(
    timeout: Duration,
    f: impl Fn(usize, NcclGroup, &Barrier) -> R + Sync,
) -> Vec<R> {
    let server = TcpStore::server(("127.0.0.1", 0), 2, TIMEOUT).expect("store");
    let port = server.port();
    let meet = Barrier::new(2);
    let (f, meet) = (&f, &meet);
    let server = &server;
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|rank| {
                s.spawn(move || {
                    let client;
                    let store = if rank == 0 {
                        server
                    } else {
                        client = TcpStore::client("127.0.0.1", port, TIMEOUT).expect("client");
                        &client
                    };
                    let g = NcclGroup::from_store(store, rank, 2, rank, timeout)
                        .expect("two-rank group");
                    f(rank, g, meet)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank panicked"))
            .collect()
    })
}

#[test]
fn two_ranks_on_two_gpus() {
    // In a child process: a peer's abort can leave the survivor's device context broken,
    // which must not reach the other tests.
    const TEST: &str = "two_ranks_on_two_gpus";
    if is_child(TEST) {
        two_ranks_checks();
        println!("child: two ranks passed");
        return;
    }
    match gpus() {
        None => return,
        Some(n) if n < 2 => {
            println!("skipped: {n} GPU(s); two ranks need two (NCCL refuses two ranks on one GPU)");
            return;
        }
        Some(_) => {}
    }
    let out = run_child(TEST, &[]);
    assert!(out.contains("child: two ranks passed"), "{out}");
}

fn two_ranks_checks() {
    two_ranks(Duration::from_secs(20), |rank, g, meet| {
        let mine = |len: usize| Buffer::F32(vec![rank as f32 + 1.0; len]);
        let f32s = |x: f32, len: usize| Buffer::F32(vec![x; len]);
        for (op, want) in [
            (ReduceOp::Sum, 3.0),
            (ReduceOp::Avg, 1.5),
            (ReduceOp::Max, 2.0),
            (ReduceOp::Min, 1.0),
        ] {
            assert_eq!(
                g.all_reduce(mine(5), op).wait(),
                Ok(f32s(want, 5)),
                "{op:?}"
            );
        }
        let coalesced = g
            .all_reduce_coalesced(
                vec![mine(3), values("bf16", &[rank as f64; 2])],
                ReduceOp::Sum,
            )
            .wait();
        assert_eq!(coalesced, Ok(vec![f32s(3.0, 3), values("bf16", &[1.0; 2])]));
        assert_eq!(g.broadcast(mine(4), 1).wait(), Ok(f32s(2.0, 4)));
        assert_eq!(
            g.all_gather(mine(2)).wait(),
            Ok(vec![f32s(1.0, 2), f32s(2.0, 2)])
        );
        assert_eq!(
            g.reduce_scatter(mine(4), ReduceOp::Sum).wait(),
            Ok(f32s(3.0, 2))
        );
        assert_eq!(g.barrier().wait(), Ok(()));
        match g.new_group(&[1]) {
            Ok(sub) => assert_eq!(
                sub.map(|s| (s.rank(), s.size())),
                (rank == 1).then_some((0, 1))
            ),
            Err(Error::Unsupported(why)) => println!("note: {why}"),
            Err(e) => panic!("new_group: {e}"),
        }

        // Point-to-point: both ways in one batch (no deadlock), then a gather, a scatter
        // and an all_to_all composed of it.
        let peer = 1 - rank;
        let works = g.batch_isend_irecv(vec![
            P2pOp::send(mine(3), peer, 5),
            P2pOp::recv(f32s(0.0, 3), peer, 5),
        ]);
        let got: Vec<_> = works.into_iter().map(|w| w.wait()).collect();
        assert_eq!(got, vec![Ok(mine(3)), Ok(f32s(peer as f32 + 1.0, 3))]);
        let gathered = g.gather(mine(2), 0).wait();
        let want = if rank == 0 {
            vec![f32s(1.0, 2), f32s(2.0, 2)]
        } else {
            Vec::new()
        };
        assert_eq!(gathered, Ok(want));
        let chunks = if rank == 1 {
            vec![f32s(10.0, 2), f32s(11.0, 2)]
        } else {
            Vec::new()
        };
        assert_eq!(
            g.scatter(chunks, f32s(0.0, 2), 1).wait(),
            Ok(f32s(10.0 + rank as f32, 2))
        );
        let a2a = Buffer::F32(vec![rank as f32 * 10.0, rank as f32 * 10.0 + 1.0]);
        assert_eq!(
            g.all_to_all(a2a).wait(),
            Ok(Buffer::F32(vec![rank as f32, 10.0 + rank as f32]))
        );

        // Debug mode names both operations on both ranks, and the group stays usable.
        let g = g.with_debug(true);
        // A receive longer than the send: a mismatch on both ranks.
        let r = if rank == 0 {
            g.send(mine(3), 1, 0).wait()
        } else {
            g.recv(f32s(0.0, 4), 0, 0).wait()
        };
        assert!(matches!(r, Err(Error::Mismatch(_))), "{r:?}");
        let mismatched = if rank == 0 {
            g.all_reduce(mine(4), ReduceOp::Sum).wait()
        } else {
            g.broadcast(mine(4), 0).wait()
        };
        match mismatched {
            Err(Error::Mismatch(m)) => {
                assert!(m.contains("all_reduce") && m.contains("broadcast"), "{m}")
            }
            other => panic!("expected a mismatch, got {other:?}"),
        }
        assert_eq!(
            g.all_reduce(mine(4), ReduceOp::Sum).wait(),
            Ok(f32s(3.0, 4))
        );

        // A peer that leaves: rank 0's next operation fails within its timeout.
        meet.wait();
        if rank == 1 {
            drop(g);
            meet.wait();
            return;
        }
        meet.wait();
        let start = Instant::now();
        let failed = g.all_reduce(mine(4), ReduceOp::Sum).wait();
        assert!(
            matches!(
                failed,
                Err(Error::Timeout { .. })
                    | Err(Error::Nccl { .. } | Error::Aborted { .. } | Error::Gone { .. })
            ),
            "{failed:?}"
        );
        assert!(start.elapsed() < g.timeout() + Duration::from_secs(10));
        assert!(g.failure().is_some());
        assert!(g.barrier().wait().is_err());
    });
}

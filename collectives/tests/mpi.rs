//! The MPI backend against exact results, one process per rank:
//! `mpirun -np 2 --oversubscribe target/debug/deps/mpi-<hash>` (`cargo xtask test` does
//! this). MPI is per process and initialised once, so this is a plain `main` that runs
//! every check in sequence on the world; every rank runs the same checks, rank 0 prints
//! one line per check and a final `N passed, M failed`, and any failure (on any rank)
//! makes the exit status non-zero.
//!
//! Values are small multiples of 1/2, so every sum is exact in every type and in any
//! order: results are compared for equality. The deterministic reductions (the default)
//! are also compared bit for bit with the thread backend's, run in each process on every
//! rank's inputs, with values whose sums depend on the order of additions; MPI's native
//! reductions (`with_deterministic(false)`) get the exact-value checks.
//!
//! `--timing` (after the executable) runs only a timing of all-reduces of 16 MiB and
//! 4 KiB, the deterministic path against native `MPI_Iallreduce`; rank 0 prints it.

use collectives::mpi::MpiGroup;
use collectives::{run_local, Buffer, DType, Error, ProcessGroup, ReduceOp, ThreadGroup};
use half::{bf16, f16};
use std::sync::Arc;
use std::time::{Duration, Instant};

type Check = fn(&Arc<MpiGroup>) -> Result<(), String>;

const CHECKS: &[(&str, Check)] = &[
    (
        "all_reduce: f32, f16, bf16, f64 x Sum, Avg, Max, Min",
        all_reduce,
    ),
    (
        "all_reduce_coalesced: mixed types and lengths, one call",
        coalesced,
    ),
    (
        "deterministic: all_reduce (every type, op, length) bit-identical to threads",
        identical_all_reduce,
    ),
    (
        "deterministic: all_reduce_wire, coalesced, reduce_scatter bit-identical to threads",
        identical_others,
    ),
    (
        "native MPI reductions (with_deterministic(false)): exact values",
        native,
    ),
    ("broadcast: every root, every type", broadcast),
    ("all_gather: every type, in rank order", all_gather),
    (
        "reduce_scatter: every type and op; indivisible length rejected",
        reduce_scatter,
    ),
    (
        "many operations in flight, barrier, and_then, zip",
        in_flight,
    ),
    ("continuations run on the progress thread", continuations),
    (
        "invalid arguments fail before communicating; init twice is Unsupported",
        invalid,
    ),
    (
        "new_group: reordered ranks, a singleton group, None outside",
        new_group,
    ),
    (
        "new_group: different rank lists are a Mismatch on every rank",
        new_group_mismatch,
    ),
    (
        "debug mode: mismatched operations fail on every rank, naming both",
        debug_mode,
    ),
    (
        "timeout: a missing rank gives Timeout; that communicator is then unusable",
        timeout,
    ),
];

const TYPES: [DType; 4] = [DType::F32, DType::F16, DType::BF16, DType::F64];
const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];

fn main() {
    let world = match MpiGroup::init(Duration::from_secs(60)) {
        Ok(g) => Arc::new(g),
        Err(e) => {
            eprintln!("MpiGroup::init failed: {e}");
            std::process::exit(1);
        }
    };
    let rank = world.rank();
    if std::env::args().any(|a| a == "--timing") {
        let code = match timing(&world) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("rank {rank}: timing: {e}");
                1
            }
        };
        drop(world);
        std::process::exit(code);
    }
    let (mut passed, mut failed) = (0, 0);
    for (name, check) in CHECKS {
        let mine = check(&world);
        if let Err(e) = &mine {
            eprintln!("rank {rank}: {name}: {e}");
        }
        // A check fails if it failed on any rank.
        let any = world
            .all_reduce(
                Buffer::F64(vec![f64::from(u8::from(mine.is_err()))]),
                ReduceOp::Max,
            )
            .wait();
        let ok = matches!(any, Ok(Buffer::F64(ref v)) if v == &[0.0]);
        if rank == 0 {
            println!("{} {name}", if ok { "ok  " } else { "FAIL" });
        }
        if ok {
            passed += 1;
        } else {
            failed += 1;
        }
        if let Err(e) = any {
            eprintln!("rank {rank}: the world group failed ({e}); stopping");
            break;
        }
    }
    if rank == 0 {
        println!("{passed} passed, {failed} failed");
    }
    // Finalises MPI.
    drop(world);
    if failed > 0 {
        std::process::exit(1);
    }
}

/// Rank `rank`'s element `i` of test vector `salt`: a small multiple of 1/2.
fn value(rank: usize, i: usize, salt: usize) -> f64 {
    ((i * 7 + rank * 3 + salt * 5) % 17) as f64 - 8.0 + 0.5 * ((rank + i) % 2) as f64
}

fn buffer(dtype: DType, values: impl Iterator<Item = f64>) -> Buffer {
    match dtype {
        DType::F32 => Buffer::F32(values.map(|x| x as f32).collect()),
        DType::F16 => Buffer::F16(values.map(f16::from_f64).collect()),
        DType::BF16 => Buffer::BF16(values.map(bf16::from_f64).collect()),
        DType::F64 => Buffer::F64(values.collect()),
    }
}

fn input(dtype: DType, rank: usize, len: usize, salt: usize) -> Buffer {
    buffer(dtype, (0..len).map(|i| value(rank, i, salt)))
}

/// The exact reduction over `size` ranks of elements `range` of test vector `salt`, with
/// `Avg` divided as the backends do (in `f32` for the 32- and 16-bit types).
fn reduced(
    dtype: DType,
    size: usize,
    range: std::ops::Range<usize>,
    op: ReduceOp,
    salt: usize,
) -> Buffer {
    buffer(
        dtype,
        range.map(|i| {
            let xs = (0..size).map(|r| value(r, i, salt));
            match op {
                ReduceOp::Sum => xs.sum(),
                ReduceOp::Max => xs.fold(f64::NEG_INFINITY, f64::max),
                ReduceOp::Min => xs.fold(f64::INFINITY, f64::min),
                ReduceOp::Avg if dtype == DType::F64 => xs.sum::<f64>() / size as f64,
                ReduceOp::Avg => f64::from(xs.sum::<f64>() as f32 / size as f32),
            }
        }),
    )
}

fn same<T: PartialEq + std::fmt::Debug>(what: &str, got: T, want: T) -> Result<(), String> {
    if got == want {
        Ok(())
    } else {
        let (got, want) = (format!("{got:?}"), format!("{want:?}"));
        let cut = |s: &str| s.chars().take(300).collect::<String>();
        Err(format!("{what}: got {}, want {}", cut(&got), cut(&want)))
    }
}

fn all_reduce(g: &Arc<MpiGroup>) -> Result<(), String> {
    for dtype in TYPES {
        for op in OPS {
            for len in [0, 1, 1000] {
                let got = g.all_reduce(input(dtype, g.rank(), len, 1), op).wait();
                let want = reduced(dtype, g.size(), 0..len, op, 1);
                same(&format!("{dtype:?} {op:?} x {len}"), got, Ok(want))?;
            }
        }
    }
    Ok(())
}

fn coalesced(g: &Arc<MpiGroup>) -> Result<(), String> {
    let layout = [
        (DType::F32, 5),
        (DType::F16, 3),
        (DType::F64, 4),
        (DType::BF16, 0),
        (DType::BF16, 7),
        (DType::F32, 33),
        (DType::F64, 1),
    ];
    for op in OPS {
        let bufs = layout
            .iter()
            .enumerate()
            .map(|(salt, &(d, n))| input(d, g.rank(), n, salt))
            .collect();
        let want: Vec<Buffer> = layout
            .iter()
            .enumerate()
            .map(|(salt, &(d, n))| reduced(d, g.size(), 0..n, op, salt))
            .collect();
        same(
            &format!("{op:?}"),
            g.all_reduce_coalesced(bufs, op).wait(),
            Ok(want),
        )?;
    }
    same(
        "no buffers",
        g.all_reduce_coalesced(Vec::new(), ReduceOp::Sum).wait(),
        Ok(Vec::new()),
    )
}

fn broadcast(g: &Arc<MpiGroup>) -> Result<(), String> {
    for dtype in TYPES {
        for root in 0..g.size() {
            let mine = if g.rank() == root {
                input(dtype, root, 300, 2)
            } else {
                Buffer::zeros(dtype, 300)
            };
            let got = g.broadcast(mine, root).wait();
            same(
                &format!("{dtype:?} from {root}"),
                got,
                Ok(input(dtype, root, 300, 2)),
            )?;
        }
    }
    Ok(())
}

fn all_gather(g: &Arc<MpiGroup>) -> Result<(), String> {
    for dtype in TYPES {
        for len in [0, 3, 257] {
            let got = g.all_gather(input(dtype, g.rank(), len, 3)).wait();
            let want = (0..g.size()).map(|r| input(dtype, r, len, 3)).collect();
            same(&format!("{dtype:?} x {len}"), got, Ok(want))?;
        }
    }
    Ok(())
}

fn reduce_scatter(g: &Arc<MpiGroup>) -> Result<(), String> {
    let (rank, size) = (g.rank(), g.size());
    for dtype in TYPES {
        for op in OPS {
            for block in [1, 50] {
                let got = g
                    .reduce_scatter(input(dtype, rank, block * size, 4), op)
                    .wait();
                let want = reduced(dtype, size, rank * block..(rank + 1) * block, op, 4);
                same(&format!("{dtype:?} {op:?} block {block}"), got, Ok(want))?;
            }
        }
    }
    match g
        .reduce_scatter(Buffer::zeros(DType::F32, size + 1), ReduceOp::Sum)
        .wait()
    {
        Err(Error::InvalidArgument(_)) if size > 1 => Ok(()),
        Ok(_) if size == 1 => Ok(()),
        other => Err(format!("an indivisible length gave {other:?}")),
    }
}

fn in_flight(g: &Arc<MpiGroup>) -> Result<(), String> {
    let (rank, size) = (g.rank(), g.size());
    let works: Vec<_> = (0..24)
        .map(|k| {
            let dtype = TYPES[k % TYPES.len()];
            g.all_reduce(input(dtype, rank, 10 + k * 31, k), ReduceOp::Sum)
        })
        .collect();
    let barrier = g.barrier();
    let gathers: Vec<_> = (0..4)
        .map(|k| g.all_gather(input(DType::F32, rank, k, k)))
        .collect();
    // Waited for in reverse: nothing depends on the order of waiting.
    for (k, gw) in gathers.into_iter().enumerate().rev() {
        let want = (0..size).map(|r| input(DType::F32, r, k, k)).collect();
        same(&format!("all_gather {k}"), gw.wait(), Ok(want))?;
    }
    same("barrier", barrier.wait(), Ok(()))?;
    for (k, w) in works.into_iter().enumerate().rev() {
        let dtype = TYPES[k % TYPES.len()];
        let want = reduced(dtype, size, 0..10 + k * 31, ReduceOp::Sum, k);
        same(&format!("all_reduce {k}"), w.wait(), Ok(want))?;
    }
    // A collective issued from a continuation (on the progress thread), and two works
    // joined without blocking.
    let g2 = g.clone();
    let chained = g
        .all_reduce(Buffer::F64(vec![1.0]), ReduceOp::Sum)
        .and_then(move |b| g2.all_reduce(b, ReduceOp::Sum));
    let n = size as f64;
    same("and_then", chained.wait(), Ok(Buffer::F64(vec![n * n])))?;
    let zipped = g
        .barrier()
        .zip(g.all_reduce(Buffer::F32(vec![2.0]), ReduceOp::Max));
    same("zip", zipped.wait(), Ok(((), Buffer::F32(vec![2.0]))))
}

fn continuations(g: &Arc<MpiGroup>) -> Result<(), String> {
    if g.size() < 2 {
        return Ok(());
    }
    let all: Vec<usize> = (0..g.size()).collect();
    let sub = g
        .subgroup(&all)
        .map_err(|e| e.to_string())?
        .ok_or("a member got None")?;
    let name =
        |r: collectives::Result<()>| r.map(|()| std::thread::current().name().map(String::from));
    if g.rank() == 0 {
        // The other ranks issue their barrier on `sub` only after the world barrier, so
        // this one is still pending when the continuation is attached.
        let thread = sub.barrier().then(name);
        same("world barrier", g.barrier().wait(), Ok(()))?;
        same(
            "continuation thread",
            thread.wait(),
            Ok(Some("collectives-mpi".to_string())),
        )
    } else {
        same("world barrier", g.barrier().wait(), Ok(()))?;
        same("sub barrier", sub.barrier().wait(), Ok(()))
    }
}

fn invalid(g: &Arc<MpiGroup>) -> Result<(), String> {
    match g.broadcast(Buffer::zeros(DType::F32, 1), g.size()).wait() {
        Err(Error::InvalidArgument(_)) => {}
        other => return Err(format!("a root out of range gave {other:?}")),
    }
    for bad in [vec![], vec![0, 0], vec![0, g.size()]] {
        match g.new_group(&bad) {
            Err(Error::InvalidArgument(_)) => {}
            other => {
                return Err(format!(
                    "new_group({bad:?}) gave {:?}",
                    other.map(|o| o.is_some())
                ))
            }
        }
    }
    match MpiGroup::init(Duration::from_secs(5)) {
        Err(Error::Unsupported(_)) => {}
        other => return Err(format!("a second init gave {other:?}")),
    }
    match g.backend() {
        "mpi" => Ok(()),
        other => Err(format!("backend() is {other:?}")),
    }
}

fn new_group(g: &Arc<MpiGroup>) -> Result<(), String> {
    let (rank, size) = (g.rank(), g.size());
    let reversed: Vec<usize> = (0..size).rev().collect();
    let sub = g
        .new_group(&reversed)
        .map_err(|e| e.to_string())?
        .ok_or("a member of new_group got None")?;
    same(
        "rank in the reversed group",
        (sub.rank(), sub.size()),
        (size - 1 - rank, size),
    )?;
    let got = sub
        .all_reduce(input(DType::F64, rank, 9, 5), ReduceOp::Sum)
        .wait();
    same(
        "all_reduce",
        got,
        Ok(reduced(DType::F64, size, 0..9, ReduceOp::Sum, 5)),
    )?;
    // The subgroup's rank 0 is the world's last rank.
    let mine = if sub.rank() == 0 {
        input(DType::BF16, rank, 20, 6)
    } else {
        Buffer::zeros(DType::BF16, 20)
    };
    same(
        "broadcast from sub-rank 0",
        sub.broadcast(mine, 0).wait(),
        Ok(input(DType::BF16, size - 1, 20, 6)),
    )?;
    drop(sub);

    let single = g.new_group(&[0]).map_err(|e| e.to_string())?;
    match (rank, single) {
        (0, Some(s)) => {
            same("singleton rank and size", (s.rank(), s.size()), (0, 1))?;
            let x = input(DType::F16, 0, 11, 7);
            same(
                "singleton all_reduce",
                s.all_reduce(x.clone(), ReduceOp::Avg).wait(),
                Ok(x),
            )?;
        }
        (0, None) => return Err("rank 0 is outside new_group(&[0])".into()),
        (_, Some(_)) => return Err(format!("rank {rank} is inside new_group(&[0])")),
        (_, None) => {}
    }
    // The world still works, and agrees.
    same("barrier after", g.barrier().wait(), Ok(()))
}

fn new_group_mismatch(g: &Arc<MpiGroup>) -> Result<(), String> {
    if g.size() < 2 {
        return Ok(());
    }
    let list: Vec<usize> = if g.rank() == 0 {
        (0..g.size()).collect()
    } else {
        (0..g.size()).rev().collect()
    };
    match g.new_group(&list) {
        Err(Error::Mismatch(m)) if m.contains("new_group") => Ok(()),
        other => Err(format!(
            "different lists gave {:?}",
            other.map(|o| o.is_some())
        )),
    }
}

fn debug_mode(g: &Arc<MpiGroup>) -> Result<(), String> {
    let (rank, size) = (g.rank(), g.size());
    if size < 2 {
        return Ok(());
    }
    let all: Vec<usize> = (0..size).collect();
    let dbg = g
        .subgroup(&all)
        .map_err(|e| e.to_string())?
        .ok_or("a member got None")?
        .with_debug(true);
    let x = || Buffer::zeros(DType::F32, 8);
    let expect = |what: &str, r: collectives::Result<Buffer>, names: [&str; 2]| match r {
        Err(Error::Mismatch(m)) if names.iter().all(|n| m.contains(n)) => Ok(()),
        other => Err(format!(
            "{what}: got {other:?}, want a Mismatch naming {names:?}"
        )),
    };
    let w = if rank == 0 {
        dbg.all_reduce(x(), ReduceOp::Sum)
    } else {
        dbg.broadcast(x(), 1)
    };
    expect(
        "all_reduce vs broadcast",
        w.wait(),
        ["all_reduce(Sum, F32 x 8)", "broadcast(root 1, F32 x 8)"],
    )?;
    let w = dbg.all_reduce(
        Buffer::zeros(DType::F32, 8 + usize::from(rank > 0)),
        ReduceOp::Sum,
    );
    expect("lengths", w.wait(), ["F32 x 8)", "F32 x 9)"])?;
    let dtype = if rank == 0 { DType::F32 } else { DType::F64 };
    let w = dbg.all_reduce(Buffer::zeros(dtype, 8), ReduceOp::Avg);
    expect(
        "types",
        w.wait(),
        ["all_reduce(Avg, F32 x 8)", "all_reduce(Avg, F64 x 8)"],
    )?;
    let op = if rank == 0 {
        ReduceOp::Sum
    } else {
        ReduceOp::Max
    };
    expect(
        "ops",
        dbg.reduce_scatter(Buffer::zeros(DType::F16, 2 * size), op)
            .wait(),
        ["Sum", "Max"],
    )?;
    // Ranks that chose different reductions would pair different collectives.
    let dbg = dbg.with_deterministic(rank != 0);
    expect(
        "deterministic vs native",
        dbg.all_reduce(x(), ReduceOp::Sum).wait(),
        ["(native MPI reduction)", "(deterministic)"],
    )?;
    let dbg = dbg.with_deterministic(true);
    // The mismatched operations were skipped everywhere: the group still works.
    let got = dbg
        .all_reduce(input(DType::BF16, rank, 64, 8), ReduceOp::Max)
        .wait();
    same(
        "after the mismatches",
        got,
        Ok(reduced(DType::BF16, size, 0..64, ReduceOp::Max, 8)),
    )?;
    same(
        "coalesced in debug mode",
        dbg.all_reduce_coalesced(vec![x(), x()], ReduceOp::Sum)
            .wait(),
        Ok(vec![x(), x()]),
    )
}

fn timeout(g: &Arc<MpiGroup>) -> Result<(), String> {
    let (rank, size) = (g.rank(), g.size());
    if size < 2 {
        return Ok(());
    }
    let all: Vec<usize> = (0..size).collect();
    let limit = Duration::from_secs(1);
    let sub = g
        .subgroup(&all)
        .map_err(|e| e.to_string())?
        .ok_or("a member got None")?
        .with_timeout(limit)
        .map_err(|e| e.to_string())?
        // The late operation below pairs with the abandoned one only without descriptor
        // checks (under COLLECTIVES_DEBUG=1 the world has them), and only with the
        // deterministic all-reduce's stages (whatever COLLECTIVES_MPI_DETERMINISTIC says).
        .with_debug(false)
        .with_deterministic(true);
    // The deterministic all-reduce of a large buffer (over 32 KiB: in two stages): it
    // times out in its all-to-all.
    let block = 16 * 1024;
    let x = || Buffer::F32(vec![1.0; block * size]);
    let mut result = Ok(());
    if rank == 0 {
        // The other ranks do not issue this operation (yet).
        let start = Instant::now();
        let got = sub.all_reduce(x(), ReduceOp::Sum).wait();
        let took = start.elapsed();
        result = match got {
            Err(Error::Timeout { after, .. })
                if after == limit && took >= limit && took < limit * 10 =>
            {
                Ok(())
            }
            other => Err(format!("a missing rank gave {other:?} after {took:?}")),
        };
        if result.is_ok() {
            result = match sub.barrier().wait() {
                Err(Error::Unusable { .. }) => Ok(()),
                other => Err(format!("an operation after the timeout gave {other:?}")),
            };
        }
    }
    same("world barrier", g.barrier().wait(), Ok(()))?;
    if rank != 0 {
        // Now pair the abandoned operation's first stage, so that it completes and rank 0
        // can finalise: a reduce-scatter is that all-to-all alone (equal chunks).
        same(
            "the late reduce_scatter",
            sub.reduce_scatter(x(), ReduceOp::Sum).wait(),
            Ok(Buffer::F32(vec![size as f32; block])),
        )?;
    }
    same("world barrier after", g.barrier().wait(), Ok(()))?;
    result
}

/// Rank `rank`'s element `i` of order-sensitive test vector `salt`: magnitudes from 2^-12
/// to 2^12 of both signs (so sums of three or more depend on the order of additions, in
/// every type), with infinities, signed zeros and NaNs among them (whose results depend
/// on the order for Max and Min, and for the sign of a zero).
fn wide_value(rank: usize, i: usize, salt: usize) -> f64 {
    let h = (i as u64 + 1)
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add((rank as u64 + 1).wrapping_mul(0xc2b2_ae3d_27d4_eb4f))
        .wrapping_add(salt as u64 * 0x1656_67b1_9e37_79f9);
    let h = h ^ (h >> 29);
    if i % 11 == 7 {
        let special = [
            f64::NAN,
            -f64::NAN,
            0.0,
            -0.0,
            f64::INFINITY,
            f64::NEG_INFINITY,
        ];
        return special[(i / 11 + rank + salt) % special.len()];
    }
    let exponent = (h % 25) as i32 - 12;
    let mantissa = 1.0 + ((h >> 8) % 1024) as f64 / 1024.0;
    let sign = if (h >> 20) & 1 == 0 { 1.0 } else { -1.0 };
    sign * mantissa * 2f64.powi(exponent)
}

fn wide(dtype: DType, rank: usize, len: usize, salt: usize) -> Buffer {
    buffer(dtype, (0..len).map(|i| wide_value(rank, i, salt)))
}

/// Every rank's result of `call` on a thread group of `size` ranks (in this process).
fn on_threads<T: Send>(
    size: usize,
    call: impl Fn(&ThreadGroup) -> collectives::Result<T> + Sync,
) -> Result<Vec<T>, String> {
    run_local(size, |g| call(&g))
        .map_err(|e| format!("run_local: {e}"))?
        .into_iter()
        .map(|r| {
            r.and_then(|x| x)
                .map_err(|e| format!("thread backend: {e}"))
        })
        .collect()
}

/// The buffer's bits, with every NaN as one pattern: Rust leaves a NaN's sign and payload
/// unspecified (the compiler may swap an addition's operands), so only NaN-ness is a
/// result; every other value compares bit for bit, signed zeros included.
fn bits(b: &Buffer) -> (DType, Vec<u64>) {
    macro_rules! nan_as_one {
        ($v:expr) => {
            $v.iter()
                .map(|x| {
                    if x.is_nan() {
                        u64::MAX
                    } else {
                        u64::from(x.to_bits())
                    }
                })
                .collect()
        };
    }
    let v: Vec<u64> = match b {
        Buffer::F32(v) => nan_as_one!(v),
        Buffer::F16(v) => nan_as_one!(v),
        Buffer::BF16(v) => nan_as_one!(v),
        Buffer::F64(v) => nan_as_one!(v),
    };
    (b.dtype(), v)
}

fn identical(what: &str, got: collectives::Result<Buffer>, want: &Buffer) -> Result<(), String> {
    let got = got.map_err(|e| format!("{what}: {e}"))?;
    let (g, w) = (bits(&got), bits(want));
    if g == w {
        return Ok(());
    }
    let at = g.1.iter().zip(&w.1).position(|(a, b)| a != b);
    Err(format!(
        "{what}: not bit-identical to the thread backend ({:?} x {} vs {:?} x {}; first \
         difference at element {at:?}: got {:?}, want {:?})",
        g.0,
        g.1.len(),
        w.0,
        w.1.len(),
        at.map(|i| slice_f64(&got, i)),
        at.map(|i| slice_f64(want, i)),
    ))
}

fn slice_f64(b: &Buffer, i: usize) -> f64 {
    match b {
        Buffer::F32(v) => f64::from(v[i]),
        Buffer::F16(v) => v[i].to_f64(),
        Buffer::BF16(v) => v[i].to_f64(),
        Buffer::F64(v) => v[i],
    }
}

fn identical_all_reduce(g: &Arc<MpiGroup>) -> Result<(), String> {
    let (rank, size) = (g.rank(), g.size());
    if !g.deterministic() {
        return Err("the world is not deterministic by default".into());
    }
    // Lengths not divisible by the group size, shorter than it, and across the chunking;
    // up to 32 KiB a buffer is all-gathered whole, above it cut into chunks: both paths.
    let lens = [0, 1, size + 1, 257 * size + 3, 5000, 20_000 * size + 1];
    for (salt, dtype) in TYPES.into_iter().enumerate() {
        for op in OPS {
            for len in lens {
                let got = g.all_reduce(wide(dtype, rank, len, salt), op).wait();
                let want = on_threads(size, |t| {
                    t.all_reduce(wide(dtype, t.rank(), len, salt), op).wait()
                })?;
                identical(&format!("{dtype:?} {op:?} x {len}"), got, &want[rank])?;
            }
        }
    }
    // The test can fail: with three or more ranks, these sums depend on the order.
    if size >= 3 {
        let sum = |order: &mut dyn Iterator<Item = usize>, i: usize| {
            order.fold(0f32, |acc, r| acc + wide_value(r, i, 0) as f32)
        };
        let differ = (0..5000)
            .filter(|&i| sum(&mut (0..size), i) != sum(&mut (0..size).rev(), i))
            .count();
        if differ == 0 {
            return Err("the inputs' sums do not depend on the order".into());
        }
    }
    Ok(())
}

fn identical_others(g: &Arc<MpiGroup>) -> Result<(), String> {
    let (rank, size) = (g.rank(), g.size());
    for wire in [DType::F16, DType::BF16] {
        for (op, len) in OPS
            .into_iter()
            .flat_map(|op| [(op, 1000 * size + 1), (op, 20_000 * size + 1)])
        {
            let got = g
                .all_reduce_wire(wide(DType::F32, rank, len, 9), wire, op)
                .wait();
            let want = on_threads(size, |t| {
                t.all_reduce_wire(wide(DType::F32, t.rank(), len, 9), wire, op)
                    .wait()
            })?;
            identical(
                &format!("all_reduce_wire {wire:?} {op:?}"),
                got,
                &want[rank],
            )?;
        }
    }
    let layout = [
        (DType::F32, 5),
        (DType::F16, 3),
        (DType::F64, 4),
        (DType::BF16, 0),
        (DType::BF16, 7),
        (DType::F32, 1000),
        (DType::F64, 1),
        (DType::F16, 0),
        // Makes the f32 flat large (chunked) while the others stay small (gathered).
        (DType::F32, 10_000),
    ];
    let bufs = |r: usize| -> Vec<Buffer> {
        layout
            .iter()
            .enumerate()
            .map(|(salt, &(d, n))| wide(d, r, n, salt))
            .collect()
    };
    for op in OPS {
        let got = g
            .all_reduce_coalesced(bufs(rank), op)
            .wait()
            .map_err(|e| format!("coalesced {op:?}: {e}"))?;
        let want = on_threads(size, |t| t.all_reduce_coalesced(bufs(t.rank()), op).wait())?;
        same(
            &format!("coalesced {op:?}: buffers"),
            got.len(),
            layout.len(),
        )?;
        for (k, (got, want)) in got.into_iter().zip(&want[rank]).enumerate() {
            identical(&format!("coalesced {op:?}, buffer {k}"), Ok(got), want)?;
        }
    }
    for dtype in TYPES {
        for op in OPS {
            let len = 300 * size;
            let got = g.reduce_scatter(wide(dtype, rank, len, 10), op).wait();
            let want = on_threads(size, |t| {
                t.reduce_scatter(wide(dtype, t.rank(), len, 10), op).wait()
            })?;
            identical(
                &format!("reduce_scatter {dtype:?} {op:?}"),
                got,
                &want[rank],
            )?;
        }
    }
    Ok(())
}

fn native(g: &Arc<MpiGroup>) -> Result<(), String> {
    let all: Vec<usize> = (0..g.size()).collect();
    let sub = g
        .subgroup(&all)
        .map_err(|e| e.to_string())?
        .ok_or("a member got None")?
        .with_deterministic(false);
    let sub = Arc::new(sub);
    all_reduce(&sub)?;
    coalesced(&sub)?;
    reduce_scatter(&sub)?;
    in_flight(&sub)
}

/// Median all-reduce times, deterministic and native, on this group: 16 MiB of `f32`
/// (chunked, two rounds), and 4 KiB (gathered whole, one round), for latency.
fn timing(g: &Arc<MpiGroup>) -> Result<(), String> {
    let all: Vec<usize> = (0..g.size()).collect();
    let native = g
        .subgroup(&all)
        .map_err(|e| e.to_string())?
        .ok_or("a member got None")?
        .with_deterministic(false);
    for (len, reps) in [(4 << 20, 15), (1 << 10, 1000)] {
        let time = |grp: &dyn ProcessGroup| -> Result<Duration, String> {
            let mut times = Vec::new();
            let mut buf = Buffer::F32((0..len).map(|i| (i % 1000) as f32 * 0.001).collect());
            for rep in 0..reps + 2 {
                grp.barrier().wait().map_err(|e| e.to_string())?;
                let start = Instant::now();
                buf = grp
                    .all_reduce(buf, ReduceOp::Avg)
                    .wait()
                    .map_err(|e| e.to_string())?;
                if rep >= 2 {
                    times.push(start.elapsed());
                }
            }
            times.sort();
            Ok(times[times.len() / 2])
        };
        // Alternated, so that load from elsewhere falls on both alike.
        let (mut det, mut nat) = (Vec::new(), Vec::new());
        for _ in 0..3 {
            det.push(time(g.as_ref())?);
            nat.push(time(&native)?);
        }
        det.sort();
        nat.sort();
        if g.rank() == 0 {
            let us = |d: Duration| d.as_secs_f64() * 1e6;
            let gbps = |d: Duration| (len * 4) as f64 / d.as_secs_f64() / 1e9;
            println!(
                "all_reduce of {} KiB f32 (Avg) on {} processes, median of {reps} (best of 3 \
                 medians): deterministic {:.0} us ({:.2} GB/s), native MPI_Iallreduce {:.0} us \
                 ({:.2} GB/s): ratio {:.2}",
                len * 4 / 1024,
                g.size(),
                us(det[0]),
                gbps(det[0]),
                us(nat[0]),
                gbps(nat[0]),
                det[0].as_secs_f64() / nat[0].as_secs_f64()
            );
        }
    }
    Ok(())
}

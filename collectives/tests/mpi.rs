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
use collectives::{
    run_local, Buffer, DType, Error, P2pOp, ProcessGroup, ReduceOp, ThreadGroup, MAX_TAG,
};
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
    ("p2p: send/recv around a ring, every type", p2p_ring),
    (
        "p2p: batch_isend_irecv both directions at once, small and large",
        p2p_both_ways,
    ),
    (
        "p2p: FIFO per tag (mixed lengths), tags independent of each other",
        p2p_order,
    ),
    (
        "p2p: length and dtype mismatches fail on both ranks; the tag stays usable",
        p2p_mismatch,
    ),
    (
        "p2p: bad peer or tag is InvalidArgument; a recv with no sender times out",
        p2p_invalid_and_timeout,
    ),
    (
        "gather, scatter: every root, every type; a bad chunk fails both sides",
        gather_scatter,
    ),
    ("all_to_all, all_to_all_split: every type", all_to_all),
    (
        "U8: moved by broadcast and all_gather; every reduction is InvalidArgument",
        bytes,
    ),
];

const ALL_TYPES: [DType; 5] = [DType::F32, DType::F16, DType::BF16, DType::F64, DType::U8];

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
        // Raw bytes: the values' bit patterns, wrapped (never reduced).
        DType::U8 => Buffer::U8(values.map(|x| (x * 2.0) as i64 as u8).collect()),
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
        Buffer::U8(v) => v.iter().map(|&x| u64::from(x)).collect(),
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
        Buffer::U8(v) => f64::from(v[i]),
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

fn p2p_ring(g: &Arc<MpiGroup>) -> Result<(), String> {
    let (rank, size) = (g.rank(), g.size());
    let (next, prev) = ((rank + 1) % size, (rank + size - 1) % size);
    for (salt, dtype) in ALL_TYPES.into_iter().enumerate() {
        for len in [0, 5, 70_000] {
            let mine = input(dtype, rank, len, salt);
            let sent = g.send(mine.clone(), next, 3);
            let got = g.recv(Buffer::zeros(dtype, len), prev, 3).wait();
            same(
                &format!("{dtype:?} x {len} from rank {prev}"),
                got,
                Ok(input(dtype, prev, len, salt)),
            )?;
            same(
                &format!("{dtype:?} x {len}: the send"),
                sent.wait(),
                Ok(mine),
            )?;
        }
    }
    Ok(())
}

fn p2p_both_ways(g: &Arc<MpiGroup>) -> Result<(), String> {
    let (rank, size) = (g.rank(), g.size());
    // Every rank exchanges with every rank (itself included) in one batch: the sends
    // first, so a backend whose send blocked until its receive would deadlock here.
    for len in [3, 300_000] {
        let mut ops = Vec::new();
        for peer in 0..size {
            ops.push(P2pOp::send(input(DType::F32, rank, len, peer), peer, 9));
        }
        for peer in 0..size {
            ops.push(P2pOp::recv(Buffer::zeros(DType::F32, len), peer, 9));
        }
        let works = g.batch_isend_irecv(ops);
        same("works", works.len(), 2 * size)?;
        for (i, w) in works.into_iter().enumerate() {
            let (peer, got) = (i % size, w.wait());
            let want = if i < size {
                input(DType::F32, rank, len, peer)
            } else {
                input(DType::F32, peer, len, rank)
            };
            same(&format!("op {i} (peer {peer}, len {len})"), got, Ok(want))?;
        }
    }
    Ok(())
}

fn p2p_order(g: &Arc<MpiGroup>) -> Result<(), String> {
    let (rank, size) = (g.rank(), g.size());
    if size < 2 {
        return Ok(());
    }
    // Rank 0 sends to the last rank: six messages on one tag, long and short mixed (a
    // long one travels by rendezvous, a short one eagerly), then one on each of two tags.
    let last = size - 1;
    let lens = [200_000, 1, 0, 50_000, 7, 7];
    if rank == 0 {
        let mut works: Vec<_> = lens
            .iter()
            .enumerate()
            .map(|(i, &n)| g.send(input(DType::F64, rank, n, i), last, 4))
            .collect();
        works.push(g.send(Buffer::U8(vec![1; 10]), last, 11));
        works.push(g.send(Buffer::U8(vec![2; 10]), last, 12));
        for (i, w) in works.into_iter().enumerate() {
            w.wait().map_err(|e| format!("send {i}: {e}"))?;
        }
    } else if rank == last {
        // The later tag first: it must not wait for the earlier one.
        let twelve = g.recv(Buffer::U8(vec![0; 10]), 0, 12).wait();
        same("tag 12", twelve, Ok(Buffer::U8(vec![2; 10])))?;
        let works: Vec<_> = lens
            .iter()
            .map(|&n| g.recv(Buffer::zeros(DType::F64, n), 0, 4))
            .collect();
        for (i, w) in works.into_iter().enumerate().rev() {
            same(
                &format!("message {i} of tag 4"),
                w.wait(),
                Ok(input(DType::F64, 0, lens[i], i)),
            )?;
        }
        let eleven = g.recv(Buffer::U8(vec![0; 10]), 0, 11).wait();
        same("tag 11", eleven, Ok(Buffer::U8(vec![1; 10])))?;
    }
    // A send completes only once its receive has the data: not before it is posted.
    // The ranks leave a barrier within a message latency of each other, and the receiver
    // then sleeps `pause`: a send that waits for its receive takes about `pause`, one
    // that does not, microseconds; half of `pause` tells them apart under any load.
    let pause = Duration::from_millis(300);
    g.barrier()
        .wait()
        .map_err(|e| format!("the barrier before the early send: {e}"))?;
    if rank == 0 {
        let start = Instant::now();
        g.send(Buffer::F32(vec![1.0; 4]), last, 5)
            .wait()
            .map_err(|e| format!("the early send: {e}"))?;
        if start.elapsed() < pause / 2 {
            return Err(format!(
                "a send completed after {:?}, before its receive was posted",
                start.elapsed()
            ));
        }
    } else if rank == last {
        std::thread::sleep(pause);
        same(
            "the late recv",
            g.recv(Buffer::zeros(DType::F32, 4), 0, 5).wait(),
            Ok(Buffer::F32(vec![1.0; 4])),
        )?;
    }
    Ok(())
}

fn p2p_mismatch(g: &Arc<MpiGroup>) -> Result<(), String> {
    let (rank, size) = (g.rank(), g.size());
    if size < 2 {
        return Ok(());
    }
    let peer = size - 1 - rank;
    if rank == peer {
        return Ok(());
    }
    let sender = rank < peer;
    // (sent, posted): shorter, longer (by a lot: a rendezvous message), and the types.
    let cases = [
        (Buffer::zeros(DType::F32, 4), Buffer::zeros(DType::F32, 5)),
        (
            Buffer::zeros(DType::F32, 100_000),
            Buffer::zeros(DType::F32, 4),
        ),
        (Buffer::zeros(DType::F16, 4), Buffer::zeros(DType::BF16, 4)),
        (Buffer::zeros(DType::U8, 8), Buffer::zeros(DType::F64, 1)),
    ];
    for (i, (sent, posted)) in cases.into_iter().enumerate() {
        let got = if sender {
            g.send(sent, peer, 6).wait()
        } else {
            g.recv(posted, peer, 6).wait()
        };
        match got {
            Err(Error::Mismatch(m)) if m.contains("tag 6") => {}
            other => return Err(format!("case {i}: the {} got {other:?}", role(sender))),
        }
    }
    // The tag still pairs the next messages correctly.
    let got = if sender {
        g.send(input(DType::BF16, rank, 33, 2), peer, 6).wait()
    } else {
        g.recv(Buffer::zeros(DType::BF16, 33), peer, 6).wait()
    };
    let from = if sender { rank } else { peer };
    same(
        "after the mismatches",
        got,
        Ok(input(DType::BF16, from, 33, 2)),
    )
}

fn role(sender: bool) -> &'static str {
    if sender {
        "sender"
    } else {
        "receiver"
    }
}

fn p2p_invalid_and_timeout(g: &Arc<MpiGroup>) -> Result<(), String> {
    let (rank, size) = (g.rank(), g.size());
    let bad = [
        g.send(Buffer::zeros(DType::F32, 1), size, 0),
        g.recv(Buffer::zeros(DType::F32, 1), size + 3, 0),
        g.send(Buffer::zeros(DType::F32, 1), 0, MAX_TAG + 1),
        g.recv(Buffer::zeros(DType::F32, 1), 0, u32::MAX),
    ];
    for (i, w) in bad.into_iter().enumerate() {
        match w.wait() {
            Err(Error::InvalidArgument(_)) => {}
            other => return Err(format!("bad call {i} gave {other:?}")),
        }
    }
    // The largest tag itself is fine (to itself).
    let own = g.send(Buffer::F32(vec![1.0]), rank, MAX_TAG);
    same(
        "MAX_TAG to itself",
        g.recv(Buffer::F32(vec![0.0]), rank, MAX_TAG).wait(),
        Ok(Buffer::F32(vec![1.0])),
    )?;
    own.wait().map_err(|e| e.to_string())?;
    if size < 2 {
        return Ok(());
    }
    let limit = Duration::from_secs(1);
    let all: Vec<usize> = (0..size).collect();
    let sub = g
        .subgroup(&all)
        .map_err(|e| e.to_string())?
        .ok_or("a member got None")?
        .with_timeout(limit)
        .map_err(|e| e.to_string())?;
    if rank == 0 {
        let start = Instant::now();
        let got = sub.recv(Buffer::zeros(DType::F32, 3), 1, 8).wait();
        let took = start.elapsed();
        match got {
            Err(Error::Timeout { after, .. })
                if after == limit && took >= limit && took < limit * 10 => {}
            other => {
                return Err(format!(
                    "a recv with no sender gave {other:?} after {took:?}"
                ))
            }
        }
    }
    same("world barrier", g.barrier().wait(), Ok(()))?;
    // The timed-out receive took nothing: a message sent now reaches the next one.
    if rank == 1 {
        sub.send(Buffer::F32(vec![4.0; 3]), 0, 8)
            .wait()
            .map_err(|e| format!("the later send: {e}"))?;
    } else if rank == 0 {
        same(
            "the later recv",
            sub.recv(Buffer::zeros(DType::F32, 3), 1, 8).wait(),
            Ok(Buffer::F32(vec![4.0; 3])),
        )?;
    }
    // The subgroup's collectives are unaffected.
    same("subgroup barrier", sub.barrier().wait(), Ok(()))
}

fn gather_scatter(g: &Arc<MpiGroup>) -> Result<(), String> {
    let (rank, size) = (g.rank(), g.size());
    for (salt, dtype) in ALL_TYPES.into_iter().enumerate() {
        for root in 0..size {
            let len = 3 + root;
            let got = g.gather(input(dtype, rank, len, salt), root).wait();
            let want = if rank == root {
                (0..size).map(|r| input(dtype, r, len, salt)).collect()
            } else {
                Vec::new()
            };
            same(&format!("gather {dtype:?} to {root}"), got, Ok(want))?;
            let chunks = if rank == root {
                (0..size).map(|j| input(dtype, j, len, salt + 7)).collect()
            } else {
                Vec::new()
            };
            let got = g.scatter(chunks, Buffer::zeros(dtype, len), root).wait();
            same(
                &format!("scatter {dtype:?} from {root}"),
                got,
                Ok(input(dtype, rank, len, salt + 7)),
            )?;
        }
    }
    // A root whose chunks do not fit the output: it fails (InvalidArgument), the others'
    // receives fail as mismatches at once.
    let chunks = if rank == 0 {
        vec![Buffer::zeros(DType::F32, 2); size]
    } else {
        Vec::new()
    };
    match g.scatter(chunks, Buffer::zeros(DType::F32, 3), 0).wait() {
        Err(Error::InvalidArgument(_)) if rank == 0 => {}
        Err(Error::Mismatch(_)) if rank != 0 => {}
        other => return Err(format!("a bad scatter gave {other:?}")),
    }
    // Gather of a wrong length on one rank: the root and that rank fail.
    let len = if rank == size - 1 && size > 1 { 4 } else { 3 };
    let got = g.gather(Buffer::zeros(DType::F32, len), 0).wait();
    let mismatched = size > 1 && (rank == 0 || rank == size - 1);
    match got {
        Err(Error::Mismatch(_)) if mismatched => Ok(()),
        Ok(_) if !mismatched => Ok(()),
        other => Err(format!("a gather with one wrong length gave {other:?}")),
    }
}

fn all_to_all(g: &Arc<MpiGroup>) -> Result<(), String> {
    let (rank, size) = (g.rank(), g.size());
    // Element `k` of rank `r`'s buffer is the value `(r, k)` of salt 9.
    let of = |dtype: DType, r: usize, ks: std::ops::Range<usize>| {
        let b = input(dtype, r, ks.end, 9);
        b.try_slice(ks).map_err(|e| e.to_string())
    };
    for dtype in ALL_TYPES {
        let chunk = 4;
        let got = g.all_to_all(input(dtype, rank, chunk * size, 9)).wait();
        let parts: Vec<Buffer> = (0..size)
            .map(|j| of(dtype, j, rank * chunk..(rank + 1) * chunk))
            .collect::<Result<_, _>>()?;
        let want = Buffer::try_concat(&parts).map_err(|e| e.to_string())?;
        same(&format!("all_to_all {dtype:?}"), got, Ok(want))?;
        // Rank `r` sends `r + j + 1` elements to rank `j`.
        let counts = |r: usize| (0..size).map(move |j| r + j + 1);
        let send_counts: Vec<usize> = counts(rank).collect();
        let recv_counts: Vec<usize> = (0..size).map(|j| j + rank + 1).collect();
        let total: usize = send_counts.iter().sum();
        let got = g
            .all_to_all_split(input(dtype, rank, total, 9), send_counts, recv_counts)
            .wait();
        let parts: Vec<Buffer> = (0..size)
            .map(|j| {
                let start: usize = counts(j).take(rank).sum();
                of(dtype, j, start..start + j + rank + 1)
            })
            .collect::<Result<_, _>>()?;
        let want = Buffer::try_concat(&parts).map_err(|e| e.to_string())?;
        same(&format!("all_to_all_split {dtype:?}"), got, Ok(want))?;
    }
    match g.all_to_all(Buffer::zeros(DType::F32, size + 1)).wait() {
        Err(Error::InvalidArgument(_)) => Ok(()),
        other => Err(format!("an indivisible all_to_all gave {other:?}")),
    }
}

fn bytes(g: &Arc<MpiGroup>) -> Result<(), String> {
    let (rank, size) = (g.rank(), g.size());
    let mine = || input(DType::U8, rank, 6 * size, 4);
    let reductions = [
        ("all_reduce", g.all_reduce(mine(), ReduceOp::Sum)),
        ("reduce_scatter", g.reduce_scatter(mine(), ReduceOp::Max)),
        ("reduce", g.reduce(mine(), 0, ReduceOp::Sum)),
    ];
    for (what, w) in reductions {
        match w.wait() {
            Err(Error::InvalidArgument(_)) => {}
            other => return Err(format!("{what} of U8 gave {other:?}")),
        }
    }
    match g
        .all_reduce_coalesced(vec![Buffer::zeros(DType::F32, 2), mine()], ReduceOp::Sum)
        .wait()
    {
        Err(Error::InvalidArgument(_)) => {}
        other => return Err(format!("all_reduce_coalesced with U8 gave {other:?}")),
    }
    for root in 0..size {
        let got = g.broadcast(mine(), root).wait();
        same(
            &format!("broadcast from {root}"),
            got,
            Ok(input(DType::U8, root, 6 * size, 4)),
        )?;
    }
    let got = g.all_gather(mine()).wait();
    let want: Vec<Buffer> = (0..size)
        .map(|r| input(DType::U8, r, 6 * size, 4))
        .collect();
    same("all_gather", got, Ok(want))?;
    // Reductions of other types still work after the rejected ones.
    let got = g.all_reduce(Buffer::F64(vec![1.0]), ReduceOp::Sum).wait();
    same("all_reduce after", got, Ok(Buffer::F64(vec![size as f64])))
}

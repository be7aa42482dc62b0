//! The MPI backend against exact results, one process per rank:
//! `mpirun -np 2 --oversubscribe target/debug/deps/mpi-<hash>` (`cargo xtask test` does
//! this). MPI is per process and initialised once, so this is a plain `main` that runs
//! every check in sequence on the world; every rank runs the same checks, rank 0 prints
//! one line per check and a final `N passed, M failed`, and any failure (on any rank)
//! makes the exit status non-zero.
//!
//! Values are small multiples of 1/2, so every sum is exact in every type and in any
//! order: results are compared for equality.

use collectives::mpi::MpiGroup;
use collectives::{Buffer, DType, Error, ProcessGroup, ReduceOp};
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
        // checks (under COLLECTIVES_DEBUG=1 the world has them).
        .with_debug(false);
    let x = || Buffer::F32(vec![1.0; 4]);
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
                Err(Error::Backend(m)) if m.contains("unusable") => Ok(()),
                other => Err(format!("an operation after the timeout gave {other:?}")),
            };
        }
    }
    same("world barrier", g.barrier().wait(), Ok(()))?;
    if rank != 0 {
        // Now pair the abandoned operation, so that it completes and rank 0 can finalise.
        same(
            "the late all_reduce",
            sub.all_reduce(x(), ReduceOp::Sum).wait(),
            Ok(Buffer::F32(vec![size as f32; 4])),
        )?;
    }
    same("world barrier after", g.barrier().wait(), Ok(()))?;
    result
}

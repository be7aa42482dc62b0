//! One rank of a CPU job over the TCP backend, started by `launch`: all-reduces a vector
//! of rank-dependent values, checks the result against the exact sum, meets the others
//! at a barrier and prints one line. Exits with status 1 on a wrong result.
//!
//! ```text
//! cargo build -p collectives --bins --examples
//! target/debug/launch -n 3 -- target/debug/examples/tcp_allreduce [LEN]
//! ```
//!
//! With `TCP_ALLREDUCE_BENCH=MIB` set, rank 0 also prints the median time of ten
//! all-reduces of `MIB` MiB of `f32` (after two warm-up runs).

use std::process::ExitCode;
use std::time::{Duration, Instant};

use collectives::{Buffer, ProcessGroup, ReduceOp, TcpGroup};

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("tcp_allreduce: {e}");
            ExitCode::from(2)
        }
    }
}

/// Rank `rank`'s element `i`: small integers, so every sum is exact in `f32`.
fn value(rank: usize, i: usize) -> f32 {
    ((i * 7 + rank * 131) % 1000) as f32 - 500.0
}

fn run() -> collectives::Result<bool> {
    let len: usize = match std::env::args().nth(1) {
        Some(a) => a
            .parse()
            .map_err(|_| collectives::Error::InvalidArgument(format!("bad length {a:?}")))?,
        None => 100_003,
    };
    let group = TcpGroup::from_env(Duration::from_secs(60))?;
    let (rank, size) = (group.rank(), group.size());
    let mine: Vec<f32> = (0..len).map(|i| value(rank, i)).collect();
    let got = group.all_reduce(Buffer::F32(mine), ReduceOp::Sum).wait()?;
    let Buffer::F32(got) = got else {
        eprintln!("rank {rank}: the all-reduce returned another type");
        return Ok(false);
    };
    let wrong = (0..len).find(|&i| {
        let exact: f32 = (0..size).map(|r| value(r, i)).sum();
        got.get(i) != Some(&exact)
    });
    if let Some(i) = wrong.or((got.len() != len).then_some(got.len())) {
        eprintln!("rank {rank}: element {i} of the all-reduce is wrong");
        return Ok(false);
    }
    group.barrier().wait()?;
    if let Ok(mib) = std::env::var("TCP_ALLREDUCE_BENCH") {
        let mib: usize = mib.parse().unwrap_or(16);
        let mut buf = Buffer::F32(vec![1.0; mib * 1024 * 1024 / 4]);
        let mut times = Vec::new();
        for run in 0..12 {
            let start = Instant::now();
            buf = group.all_reduce(buf, ReduceOp::Avg).wait()?;
            if run >= 2 {
                times.push(start.elapsed());
            }
        }
        times.sort();
        if rank == 0 {
            println!(
                "all_reduce of {mib} MiB f32 on {size} ranks: median {:.2} ms",
                times[times.len() / 2].as_secs_f64() * 1e3
            );
        }
        group.barrier().wait()?;
    }
    println!("rank {rank} of {size}: all_reduce of {len} f32 exact, barrier passed");
    Ok(true)
}

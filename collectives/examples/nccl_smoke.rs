//! NCCL smoke run: checks an all_reduce on host and device buffers and times a 64 MiB
//! device all_reduce.
//!
//! One rank on GPU 0: `cargo run -p collectives --features cuda --example nccl_smoke`.
//! Several ranks, one GPU each, with this crate's launcher (which sets `RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`):
//! `launch -n 2 -- target/debug/examples/nccl_smoke`.

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("nccl_smoke needs the `cuda` feature: cargo run -p collectives --features cuda --example nccl_smoke");
    std::process::exit(2);
}

#[cfg(feature = "cuda")]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    use collectives::nccl::{self, NcclGroup, NcclId};
    use collectives::{Buffer, ProcessGroup, ReduceOp};
    use std::time::{Duration, Instant};

    let timeout = Duration::from_secs(120);
    let (major, minor, patch) = nccl::library_version()?;
    let group = if std::env::var_os("RANK").is_some() {
        NcclGroup::from_env(timeout)?
    } else {
        NcclGroup::new(0, 1, 0, NcclId::new()?, timeout)?
    };
    let (rank, size) = (group.rank(), group.size());
    println!(
        "rank {rank} of {size}: NCCL {major}.{minor}.{patch}, {} GPU(s), device {}",
        nccl::device_count()?,
        group.device_ordinal()
    );

    // Host buffers: the sum of 1..=size in every element.
    let want = (size * (size + 1) / 2) as f32;
    let sum = group
        .all_reduce(Buffer::F32(vec![rank as f32 + 1.0; 1000]), ReduceOp::Sum)
        .wait()?;
    assert_eq!(sum, Buffer::F32(vec![want; 1000]), "host all_reduce");

    // Device buffers, timed.
    let stream = group.stream().clone();
    let len = 16 << 20; // 64 MiB of f32
    let mut buf = stream.clone_htod(&vec![rank as f32 + 1.0; len])?;
    buf = group.all_reduce_device(buf, ReduceOp::Sum).wait()?;
    let host = stream.clone_dtoh(&buf)?;
    assert!(host.iter().all(|&x| x == want), "device all_reduce");
    let rounds = 20;
    let start = Instant::now();
    for _ in 0..rounds {
        buf = group.all_reduce_device(buf, ReduceOp::Avg).wait()?;
    }
    let per_op = start.elapsed() / rounds;
    let bytes = (len * 4) as f64;
    let algbw = bytes / per_op.as_secs_f64() / 1e9;
    let busbw = algbw * 2.0 * (size as f64 - 1.0) / size as f64;
    println!(
        "rank {rank}: 64 MiB all_reduce in {per_op:?} (algbw {algbw:.1} GB/s, busbw {busbw:.1} GB/s)"
    );
    group.barrier().wait()?;
    Ok(())
}

//! What the all-reduce benchmarks share: the memcpy reference, the timed loop and the
//! row format (nccl-tests definitions).

#![allow(dead_code)]

use collectives::{Buffer, ProcessGroup, ReduceOp};
use std::hint::black_box;
use std::time::{Duration, Instant};

pub const MIB: usize = 1 << 20;

fn flush(buf: &mut [u64]) {
    for (i, x) in buf.iter_mut().enumerate().step_by(8) {
        *x = x.wrapping_add(i as u64);
    }
    black_box(&buf[buf.len() / 2]);
}

pub fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Aggregate memcpy throughput (bytes copied per second) of `threads` threads, 64 MiB
/// each, cold cache, destination already faulted in; median of `reps`.
pub fn memcpy_reference(threads: usize, reps: usize) -> f64 {
    let len = 64 * MIB / 4;
    let srcs: Vec<Vec<f32>> = (0..threads).map(|t| vec![t as f32; len]).collect();
    let mut dsts: Vec<Vec<f32>> = (0..threads).map(|_| vec![1.0f32; len]).collect();
    let mut junk = vec![0u64; 512 * MIB / 8];
    let mut times = Vec::new();
    for _ in 0..reps {
        flush(&mut junk);
        let start = Instant::now();
        std::thread::scope(|s| {
            for (src, dst) in srcs.iter().zip(dsts.iter_mut()) {
                s.spawn(move || dst.copy_from_slice(src));
            }
        });
        times.push(start.elapsed());
    }
    black_box(&dsts);
    (threads * len * 4) as f64 / median(times).as_secs_f64()
}

/// This rank's median time per all-reduce of `bytes` (f32, averaged), each repetition a
/// timed loop after a barrier.
pub fn allreduce_time(g: &dyn ProcessGroup, bytes: usize, reps: usize) -> Duration {
    let len = bytes / 4;
    let iters = (64 * MIB / bytes.max(1)).clamp(2, 200);
    let mut buf = Buffer::F32(vec![1.0; len]);
    buf = g.all_reduce(buf, ReduceOp::Sum).wait().expect("warm-up");
    let mut times = Vec::new();
    for _ in 0..reps {
        g.barrier().wait().expect("barrier");
        let t = Instant::now();
        for _ in 0..iters {
            buf = g.all_reduce(buf, ReduceOp::Avg).wait().expect("all_reduce");
        }
        times.push(t.elapsed() / iters as u32);
    }
    median(times)
}

/// The sizes: 4 KiB to 256 MiB by factors of 4, or four of them with `quick`.
pub fn sizes(quick: bool) -> Vec<usize> {
    if quick {
        vec![4 << 10, 256 << 10, 16 * MIB, 64 * MIB]
    } else {
        (0..=8).map(|k| (4 << 10) << (2 * k)).collect()
    }
}

pub fn header(json: bool) {
    if !json {
        println!(
            "{:<8} {:>5} {:>10} {:>10} {:>12} {:>12} {:>12} {:>9}",
            "backend",
            "ranks",
            "bytes",
            "time",
            "algbw GB/s",
            "busbw GB/s",
            "memcpy GB/s",
            "fraction"
        );
    }
}

pub fn row(json: bool, backend: &str, ranks: usize, bytes: usize, t: f64, memcpy: f64) {
    let algbw = bytes as f64 / t;
    let busbw = algbw * 2.0 * (ranks - 1) as f64 / ranks as f64;
    if json {
        println!(
            "{{\"bench\":\"collectives/all_reduce\",\"backend\":\"{backend}\",\"ranks\":{ranks},\"bytes\":{bytes},\"time_us\":{:.3},\"algbw_gb_per_s\":{:.3},\"busbw_gb_per_s\":{:.3},\"memcpy_gb_per_s\":{:.3},\"fraction_of_memcpy\":{:.4}}}",
            t * 1e6,
            algbw / 1e9,
            busbw / 1e9,
            memcpy / 1e9,
            busbw / memcpy
        );
    } else {
        println!(
            "{:<8} {:>5} {:>10} {:>8.1}us {:>12.2} {:>12.2} {:>12.2} {:>8.1}%",
            backend,
            ranks,
            bytes,
            t * 1e6,
            algbw / 1e9,
            busbw / 1e9,
            memcpy / 1e9,
            100.0 * busbw / memcpy
        );
    }
}

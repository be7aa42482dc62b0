//! Read bandwidth of the skinny products against a plain SIMD sum over the same matrix.
//!
//! Skinny products are memory-bound, so the figure that matters is how close each comes
//! to the speed at which this machine can read `M` at all. The pinned method:
//! - the reference is a SIMD sum (AVX-512, else AVX2, with 8 accumulators) over the same
//!   `M` with the same thread count and the same row split;
//! - at least 512 MiB are streamed through the caches before every timed repetition, so
//!   `M` comes from memory (the L3 here can hold a 64 MiB matrix);
//! - kernel and reference repetitions are interleaved; the median of each is reported.
//!
//! A general library, `gemm`, runs the same products as a comparison row (`gemm-mq`,
//! `gemm-mtp`): the faster of its runs with a column-major and a row-major output.
//!
//! Arguments: `--quick` (n = 4096 only, 5 pairs), `--json` (one object per line),
//! `--reps N`, `--isa avx512|avx2|portable` (the kernels of that instruction set, e.g. the
//! AVX2 kernels on an AVX-512 machine; the reference stays the machine's best read),
//! `--op mq|mtp` and `--rank 1|2|4|8` (only those rows, to compare two builds quickly).
//! Driven by `cargo xtask bench lowrank`.

use lowrank::{Backend, CpuBackend, Dims, Isa};
use std::hint::black_box;
use std::time::{Duration, Instant};

const FLUSH_BYTES: usize = 512 << 20;

struct Args {
    quick: bool,
    json: bool,
    reps: usize,
    isa: Option<Isa>,
    /// `--op mq|mtp`: only that product.
    op: Option<Op>,
    /// `--rank R`: only that rank.
    rank: Option<usize>,
}

fn args() -> Args {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let quick = argv.iter().any(|a| a == "--quick");
    let reps = argv
        .iter()
        .position(|a| a == "--reps")
        .and_then(|i| argv.get(i + 1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(if quick { 5 } else { 7 })
        .max(5);
    let isa =
        argv.iter()
            .position(|a| a == "--isa")
            .map(|i| match argv.get(i + 1).map(String::as_str) {
                Some("avx512") => Isa::Avx512,
                Some("avx2") => Isa::Avx2,
                Some("portable") => Isa::Portable,
                other => {
                    eprintln!("--isa takes avx512, avx2 or portable, got {other:?}");
                    std::process::exit(2)
                }
            });
    let value = |flag: &str| {
        argv.iter()
            .position(|a| a == flag)
            .map(|i| argv.get(i + 1).map(String::as_str).unwrap_or(""))
    };
    let op = value("--op").map(|v| match v {
        "mq" => Op::Mq,
        "mtp" => Op::Mtp,
        other => {
            eprintln!("--op takes mq or mtp, got {other:?}");
            std::process::exit(2)
        }
    });
    let rank = value("--rank").map(|v| match v.parse() {
        Ok(r @ (1 | 2 | 4 | 8)) => r,
        _ => {
            eprintln!("--rank takes 1, 2, 4 or 8, got {v:?}");
            std::process::exit(2)
        }
    });
    Args {
        quick,
        json: argv.iter().any(|a| a == "--json"),
        reps,
        isa,
        op,
        rank,
    }
}

/// Streams a buffer larger than every cache through the cores, evicting `M`.
fn flush(buf: &mut [u64]) {
    for (i, x) in buf.iter_mut().enumerate().step_by(8) {
        *x = x.wrapping_add(i as u64);
    }
    black_box(&buf[buf.len() / 2]);
}

fn sum_slice(x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if Isa::Avx512.is_supported() {
            // SAFETY: AVX-512F is present (checked above).
            return unsafe { sum_avx512(x) };
        }
        if Isa::Avx2.is_supported() {
            // SAFETY: AVX2 is present (checked above).
            return unsafe { sum_avx2(x) };
        }
    }
    x.iter().sum()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sum_avx512(x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_setzero_ps(); 8];
    let chunks = x.chunks_exact(128);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for (u, a) in acc.iter_mut().enumerate() {
            // SAFETY: `c` has 128 elements, so 16 at offset 16 * u are in bounds.
            *a = _mm512_add_ps(*a, unsafe { _mm512_loadu_ps(c.as_ptr().add(16 * u)) });
        }
    }
    let mut s = acc[0];
    for a in &acc[1..] {
        s = _mm512_add_ps(s, *a);
    }
    _mm512_reduce_add_ps(s) + tail
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_avx2(x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_ps(); 8];
    let chunks = x.chunks_exact(64);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for (u, a) in acc.iter_mut().enumerate() {
            // SAFETY: `c` has 64 elements, so 8 at offset 8 * u are in bounds.
            *a = _mm256_add_ps(*a, unsafe { _mm256_loadu_ps(c.as_ptr().add(8 * u)) });
        }
    }
    let mut lanes = [0.0f32; 8];
    let mut s = acc[0];
    for a in &acc[1..] {
        s = _mm256_add_ps(s, *a);
    }
    // SAFETY: `lanes` holds 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), s) };
    lanes.iter().sum::<f32>() + tail
}

/// The reference: a SIMD sum over `m`, split into `threads` contiguous pieces.
fn reference(m: &[f32], threads: usize) -> f32 {
    if threads == 1 {
        return sum_slice(m);
    }
    let chunk = m.len().div_ceil(threads);
    std::thread::scope(|s| {
        let handles: Vec<_> = m
            .chunks(chunk)
            .skip(1)
            .map(|c| s.spawn(move || sum_slice(c)))
            .collect();
        let first = sum_slice(&m[..chunk.min(m.len())]);
        first
            + handles
                .into_iter()
                .map(|h| h.join().unwrap_or(0.0))
                .sum::<f32>()
    })
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

#[derive(Clone, Copy, PartialEq)]
enum Op {
    Mq,
    Mtp,
}

/// The same product through `gemm`, writing a column-major (`col_major`) or row-major
/// output. `M` is row-major `n x n`; the input factor is column-major, as ours.
#[allow(clippy::too_many_arguments)]
fn gemm_product(
    op: Op,
    n: usize,
    r: usize,
    m: &[f32],
    input: &[f32],
    out: &mut [f32],
    col_major: bool,
    threads: usize,
) {
    let par = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    let (n_i, r_i) = (n as isize, r as isize);
    let (dst_cs, dst_rs) = if col_major { (n_i, 1) } else { (1, r_i) };
    // M is row-major: element (i, j) at i * n + j. As the left operand of `M Q` its
    // column stride is 1 and its row stride n; as `Mᵀ` in `Mᵀ P` the two swap.
    let (lhs_cs, lhs_rs) = if op == Op::Mq { (1, n_i) } else { (n_i, 1) };
    // SAFETY: every pointer covers the n x n, n x r and n x r operands described by the
    // strides above; `out` does not alias the inputs.
    unsafe {
        gemm::gemm(
            n,
            r,
            n,
            out.as_mut_ptr(),
            dst_cs,
            dst_rs,
            false,
            m.as_ptr(),
            lhs_cs,
            lhs_rs,
            input.as_ptr(),
            n_i,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            par,
        );
    }
}

fn main() {
    let a = args();
    let cpu = match a.isa {
        None => CpuBackend::new(),
        Some(isa) => CpuBackend::new().with_isa(isa).unwrap_or_else(|e| {
            eprintln!("{e}");
            std::process::exit(2)
        }),
    };
    let isa = cpu.isa();
    let sizes: &[usize] = if a.quick { &[4096] } else { &[4096, 16384] };
    let mut flush_buf = vec![1u64; FLUSH_BYTES / 8];
    if !a.json {
        println!(
            "{:<9} {:>6} {:>6} {:>3} {:>7} {:>9} {:>10} {:>9}",
            "op", "n", "m", "r", "threads", "GB/s", "ref GB/s", "fraction"
        );
    }
    for &n in sizes {
        let m_host: Vec<f32> = (0..n * n)
            .map(|i| ((i % 251) as f32 - 125.0) * 1e-3)
            .collect();
        for op in [Op::Mq, Op::Mtp] {
            if a.op.is_some_and(|only| only != op) {
                continue;
            }
            for r in [1, 2, 4, 8] {
                if a.rank.is_some_and(|only| only != r) {
                    continue;
                }
                let d = Dims::new(1, n, n, r).expect("valid shape");
                let p = vec![0.5f32; d.p_len()];
                let mut q = vec![0.25f32; d.q_len()];
                let mut p_out = vec![0.0f32; d.p_len()];
                for threads in [1, 2] {
                    let be = cpu.clone().with_threads(threads).expect("threads");
                    let (mut tk, mut tr) = (Vec::new(), Vec::new());
                    let (mut tg_col, mut tg_row) = (Vec::new(), Vec::new());
                    let mut g_out = vec![0.0f32; n * r];
                    for _ in 0..a.reps {
                        flush(&mut flush_buf);
                        let t = Instant::now();
                        black_box(reference(&m_host, threads));
                        tr.push(t.elapsed());
                        flush(&mut flush_buf);
                        let t = Instant::now();
                        match op {
                            Op::Mq => be.mq(d, &m_host, &q, &mut p_out),
                            Op::Mtp => be.mtp(d, &m_host, &p, &mut q),
                        }
                        .expect("kernel");
                        tk.push(t.elapsed());
                        black_box((&p_out, &q));
                        let input = if op == Op::Mq { &q } else { &p };
                        for (col_major, times) in [(true, &mut tg_col), (false, &mut tg_row)] {
                            flush(&mut flush_buf);
                            let t = Instant::now();
                            gemm_product(op, n, r, &m_host, input, &mut g_out, col_major, threads);
                            times.push(t.elapsed());
                            black_box(&g_out);
                        }
                    }
                    let gemm_time = median(tg_col).min(median(tg_row));
                    let bytes = (n * n * 4) as f64;
                    let ref_gbs = bytes / median(tr).as_secs_f64() / 1e9;
                    let name = if op == Op::Mq { "mq" } else { "mtp" };
                    for (row, time) in [
                        (name.to_string(), median(tk)),
                        (format!("gemm-{name}"), gemm_time),
                    ] {
                        let gbs = bytes / time.as_secs_f64() / 1e9;
                        report(&a, &row, isa, n, r, threads, gbs, ref_gbs);
                    }
                }
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn report(
    a: &Args,
    name: &str,
    isa: Isa,
    n: usize,
    r: usize,
    threads: usize,
    gbs: f64,
    ref_gbs: f64,
) {
    if a.json {
        println!(
            "{{\"bench\":\"lowrank/{name}\",\"isa\":\"{}\",\"n\":{n},\"m\":{n},\"r\":{r},\"threads\":{threads},\"gb_per_s\":{gbs:.3},\"reference_gb_per_s\":{ref_gbs:.3},\"fraction_of_bandwidth\":{:.4}}}",
            isa.name(),
            gbs / ref_gbs
        );
    } else {
        println!(
            "{:<9} {:>6} {:>6} {:>3} {:>7} {:>9.2} {:>10.2} {:>8.1}%",
            name,
            n,
            n,
            r,
            threads,
            gbs,
            ref_gbs,
            100.0 * gbs / ref_gbs
        );
    }
}

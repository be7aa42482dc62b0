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
//! An unknown flag, a missing value or one that does not parse (`--reps abc`) is an
//! error, exit status 2. Driven by `cargo xtask bench lowrank`.
//!
//! `--roofline` (with `--isa`, `--op`, `--rank`; default rank 8): instead of the table, the
//! in-core limits of each one-thread row, to explain a row below the read bandwidth:
//! - `fma/ns`: fused multiply-adds per nanosecond at the kernels' vector width (12
//!   independent chains in registers), and `fma/line`, the FMAs a 64-byte line of `M`
//!   needs (`r x 16 / lanes`), so `fma GB/s` is the rate the FMA ports alone allow;
//! - `L2 GB/s`: the kernel with `M` resident in L2 (256 x 1024, 1 MiB, repeated), and
//!   `L2 read`: the reference sum over the same `M`;
//! - `cold` and `ref`: the kernel and the reference from memory, as in the table;
//! - `serial`: the fraction the row would reach if its in-core work (the L2 rate) did not
//!   overlap the memory transfer at all, `1 / (1 + ref / L2)`; a measured fraction
//!   between `serial` and 1 says how much of it overlaps.

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
    /// `--roofline`: the in-core limits of the one-thread rows instead of the table.
    roofline: bool,
}

/// The arguments, or exit status 2 with a message for an unknown flag, a missing value or
/// one that does not parse.
fn args() -> Args {
    parse_args().unwrap_or_else(|e| {
        eprintln!("bandwidth: {e}");
        std::process::exit(2)
    })
}

fn parse_args() -> Result<Args, lexopt::Error> {
    use lexopt::prelude::*;
    let (mut quick, mut json, mut roofline) = (false, false, false);
    let (mut reps, mut isa, mut op, mut rank) = (None, None, None, None);
    let mut parser = lexopt::Parser::from_env();
    while let Some(arg) = parser.next()? {
        match arg {
            Long("quick") => quick = true,
            Long("json") => json = true,
            Long("roofline") => roofline = true,
            // `cargo bench` passes `--bench` to a bench without the test harness.
            Long("bench") => {}
            Long("reps") => reps = Some(parser.value()?.parse::<usize>()?),
            Long("isa") => {
                isa = Some(match parser.value()?.string()?.as_str() {
                    "avx512" => Isa::Avx512,
                    "avx2" => Isa::Avx2,
                    "portable" => Isa::Portable,
                    other => {
                        return Err(
                            format!("--isa takes avx512, avx2 or portable, got {other:?}").into(),
                        )
                    }
                })
            }
            Long("op") => {
                op = Some(match parser.value()?.string()?.as_str() {
                    "mq" => Op::Mq,
                    "mtp" => Op::Mtp,
                    other => return Err(format!("--op takes mq or mtp, got {other:?}").into()),
                })
            }
            Long("rank") => {
                let v = parser.value()?.string()?;
                rank = Some(match v.parse() {
                    Ok(r @ (1 | 2 | 4 | 8)) => r,
                    _ => return Err(format!("--rank takes 1, 2, 4 or 8, got {v:?}").into()),
                })
            }
            _ => return Err(arg.unexpected()),
        }
    }
    Ok(Args {
        quick,
        json,
        reps: reps.unwrap_or(if quick { 5 } else { 7 }).max(5),
        isa,
        op,
        rank,
        roofline,
    })
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

/// Fused multiply-adds per nanosecond at `lanes` lanes (16: AVX-512, 8: AVX2), on 12
/// independent chains; `None` where this CPU has no such FMA.
fn fma_per_ns(lanes: usize) -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
        let n = 20_000_000usize;
        // The better of two runs of `f`, in FMAs per nanosecond.
        let best = |f: &dyn Fn() -> f32| {
            let rate = || {
                let t = Instant::now();
                black_box(f());
                12.0 * n as f64 / t.elapsed().as_secs_f64() / 1e9
            };
            rate().max(rate())
        };
        if lanes == 16 && Isa::Avx512.is_supported() {
            // SAFETY: AVX-512F is present (checked above); the function only computes
            // in registers.
            return Some(best(&|| unsafe { fma_chains_avx512(n) }));
        }
        if lanes == 8 && Isa::Avx2.is_supported() && std::is_x86_feature_detected!("fma") {
            // SAFETY: AVX2 and FMA are present (checked above); as above.
            return Some(best(&|| unsafe { fma_chains_avx2(n) }));
        }
    }
    let _ = lanes;
    None
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fma_chains_avx512(n: usize) -> f32 {
    use std::arch::x86_64::*;
    let mut a = [_mm512_set1_ps(1.0); 12];
    let (b, c) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
    for _ in 0..black_box(n) {
        for x in a.iter_mut() {
            *x = _mm512_fmadd_ps(*x, b, c);
        }
    }
    a.iter().map(|&x| _mm512_reduce_add_ps(x)).sum()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_chains_avx2(n: usize) -> f32 {
    use std::arch::x86_64::*;
    let mut a = [_mm256_set1_ps(1.0); 12];
    let (b, c) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
    for _ in 0..black_box(n) {
        for x in a.iter_mut() {
            *x = _mm256_fmadd_ps(*x, b, c);
        }
    }
    let mut lanes = [0.0f32; 8];
    // SAFETY: `lanes` holds 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), a[0]) };
    lanes.iter().sum()
}

/// `--roofline`: for each selected one-thread row, the FMA rate, the kernel and the read
/// reference with `M` in L2, and the kernel and the reference from memory.
fn roofline(a: &Args, cpu: &CpuBackend) {
    let isa = cpu.isa();
    let lanes = match isa {
        Isa::Avx512 => 16,
        _ => 8,
    };
    let fma = fma_per_ns(lanes);
    let be = cpu.clone().with_threads(1).expect("one thread");
    let mut flush_buf = vec![1u64; FLUSH_BYTES / 8];
    println!(
        "{} kernels, one thread; FMA/ns at {lanes} lanes: {}",
        isa.name(),
        fma.map_or("-".into(), |f| format!("{f:.2}"))
    );
    println!(
        "{:<4} {:>2} {:>8} {:>9} {:>7} {:>8} {:>7} {:>6} {:>9} {:>7}",
        "op",
        "r",
        "fma/line",
        "fma GB/s",
        "L2 GB/s",
        "L2 read",
        "cold",
        "ref",
        "fraction",
        "serial"
    );
    for op in [Op::Mq, Op::Mtp] {
        if a.op.is_some_and(|only| only != op) {
            continue;
        }
        let r = a.rank.unwrap_or(8);
        let fma_per_line = (r * 16) as f64 / lanes as f64;
        let fma_gbs = fma.map(|f| 64.0 * f / fma_per_line);
        let run = |d: Dims, m: &[f32], p: &[f32], q: &mut [f32], p_out: &mut [f32]| {
            match op {
                Op::Mq => be.mq(d, m, q, p_out),
                Op::Mtp => be.mtp(d, m, p, q),
            }
            .expect("kernel")
        };
        // M in L2: 256 x 1024 (1 MiB), the best of 5 runs of 64 products.
        let (rows, cols) = (256, 1024);
        let d = Dims::new(1, rows, cols, r).expect("valid shape");
        let m: Vec<f32> = (0..rows * cols).map(|i| (i % 251) as f32 * 1e-3).collect();
        let (p, mut q, mut p_out) = (
            vec![0.5f32; d.p_len()],
            vec![0.25f32; d.q_len()],
            vec![0.0f32; d.p_len()],
        );
        let (mut best_k, mut best_r) = (Duration::MAX, Duration::MAX);
        for _ in 0..5 {
            let t = Instant::now();
            for _ in 0..64 {
                run(d, &m, &p, &mut q, &mut p_out);
            }
            best_k = best_k.min(t.elapsed() / 64);
            let t = Instant::now();
            for _ in 0..64 {
                black_box(sum_slice(&m));
            }
            best_r = best_r.min(t.elapsed() / 64);
        }
        let l2_bytes = (rows * cols * 4) as f64;
        let (l2_k, l2_r) = (
            l2_bytes / best_k.as_secs_f64() / 1e9,
            l2_bytes / best_r.as_secs_f64() / 1e9,
        );
        // From memory, as the table measures.
        let n = 4096;
        let d = Dims::new(1, n, n, r).expect("valid shape");
        let m: Vec<f32> = (0..n * n)
            .map(|i| ((i % 251) as f32 - 125.0) * 1e-3)
            .collect();
        let (p, mut q, mut p_out) = (
            vec![0.5f32; d.p_len()],
            vec![0.25f32; d.q_len()],
            vec![0.0f32; d.p_len()],
        );
        let (mut tk, mut tr) = (Vec::new(), Vec::new());
        for _ in 0..a.reps {
            flush(&mut flush_buf);
            let t = Instant::now();
            black_box(reference(&m, 1));
            tr.push(t.elapsed());
            flush(&mut flush_buf);
            let t = Instant::now();
            run(d, &m, &p, &mut q, &mut p_out);
            tk.push(t.elapsed());
            black_box((&q, &p_out));
        }
        let bytes = (n * n * 4) as f64;
        let cold = bytes / median(tk).as_secs_f64() / 1e9;
        let reference = bytes / median(tr).as_secs_f64() / 1e9;
        println!(
            "{:<4} {r:>2} {fma_per_line:>8.1} {:>9} {l2_k:>7.1} {l2_r:>8.1} {cold:>7.2} {reference:>6.2} {:>9.2} {:>7.2}",
            if op == Op::Mq { "mq" } else { "mtp" },
            fma_gbs.map_or("-".into(), |g| format!("{g:.1}")),
            cold / reference,
            1.0 / (1.0 + reference / l2_k)
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
    if a.roofline {
        roofline(&a, &cpu);
        return;
    }
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

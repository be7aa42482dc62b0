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
//! AVX2 kernels on an AVX-512 machine; the reference from memory stays the machine's best
//! read),
//! `--op mq|mtp` and `--rank 1|2|4|8` (only those rows, to compare two builds quickly).
//! An unknown flag, a missing value or one that does not parse (`--reps abc`) is an
//! error, exit status 2. Driven by `cargo xtask bench lowrank`.
//!
//! `--roofline` (with `--isa`, `--op`, `--rank`; default r = 1, 2, 4, 8): instead of the
//! table, the in-core limits of each one-thread row, to explain a row below the read
//! bandwidth:
//! - `fma/ns`: fused multiply-adds per nanosecond at the kernels' vector width (12
//!   independent chains in registers), and `fma/line`, the FMAs a 64-byte line of `M`
//!   needs (`r x 16 / lanes`), so `fma GB/s` is the rate the FMA ports alone allow;
//! - `L2 strm`: a plain SIMD loop moving the same data with `M` resident in L2 (128 x
//!   1024, 512 KiB; 64 x 1024 with `E` for the fused passes) on 64-byte aligned buffers,
//!   in the vectors of the kernels' instruction set (the best stream loads of that width
//!   allow: with AVX2's 32-byte loads the sum read 0.75-0.80 of what AVX-512's 64-byte
//!   ones read from L2 on an Intel Xeon, Emerald Rapids class), `limit` the lower of the
//!   two bounds (`*` where they are
//!   within 20% of each other: the kernel would have to keep the FMA pipes and the L2
//!   fills both near full at once, so such rows read lower against it), and `L2 GB/s`
//!   the kernel over buffers that start 16 bytes past a line, where the system allocator
//!   puts large blocks (so a kernel that loads split lines pays for it);
//! - `aligned`: `of limit` for the kernel over buffers on a line (what the placement
//!   costs it);
//! - the kernel, the stream and the FMA rate are measured one after the other, seven
//!   times, and each column is the median of the seven (`of limit` the median of the
//!   seven runs' own ratios): a VM's clock and its neighbours move all three between
//!   runs, not within one;
//! - `cold` and `ref`: the kernel and the reference from memory (n = m = 4096), as in the
//!   table for the products; for the fused passes the reference is the stream loop of
//!   the L2 bound (`y += x`, `e = m; m = -m`), so `fraction` is of the same traffic's
//!   plain rate;
//! - `serial`: the fraction the row would reach if its in-core work (the L2 rate) did not
//!   overlap the memory transfer at all, `1 / (1 + ref / L2)`; a measured fraction
//!   between `serial` and 1 says how much of it overlaps.
//! - `plain` and `+pf` (the products, AVX-512 and AVX2 only): the fraction of `ref` that a plain loop
//!   reaches from memory doing the row's multiply-adds a line (`fma/line`, into
//!   independent accumulators) as it reads `M` once in memory order, without and with a
//!   software prefetch 4 KiB ahead ([`fma_stream`]), timed in the same rounds as `cold`:
//!   how much overlap of compute and memory the core gives a walk in memory order with
//!   the row's work. `plain` near `serial` and `+pf` near 1 say the hardware prefetchers
//!   alone leave such a stream serial and a prefetch in the order of the loads is what
//!   overlaps it; a kernel well under `+pf` loses to its walk, not to the machine.
//! - `llc ref` and `llc`: the reference's GB/s and the kernel's fraction of it with 8 MiB
//!   of `M` (and `E`) in the last-level cache (read once, then 8 MiB of other data so
//!   that none of it is left in L2): a stand-in for a core whose memory is faster
//!   than this one's (on the Intel Xeon below it reads 20-35 GB/s where memory gives
//!   10-19, about what one Zen 5 core reads from DRAM). Where `llc ref` is no faster
//!   than `ref`, the LLC did not hold the matrix.

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

/// The machine's best read: [`sum_at`] in the widest vectors this CPU has.
fn sum_slice(x: &[f32]) -> f32 {
    sum_at(x, Isa::Avx512)
}

/// The widest of AVX-512, AVX2 and portable code that this CPU has, no wider than
/// `widest`.
fn stream_isa(widest: Isa) -> Isa {
    let allowed: &[Isa] = match widest {
        Isa::Avx512 => &[Isa::Avx512, Isa::Avx2],
        Isa::Avx2 => &[Isa::Avx2],
        _ => &[],
    };
    allowed
        .iter()
        .copied()
        .find(|i| i.is_supported())
        .unwrap_or(Isa::Portable)
}

/// A sum over `x` in the vectors of [`stream_isa`]`(widest)`.
fn sum_at(x: &[f32], widest: Isa) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        let isa = stream_isa(widest);
        if isa == Isa::Avx512 {
            // SAFETY: AVX-512F is present (`stream_isa` returns only sets this CPU has).
            return unsafe { sum_avx512(x) };
        }
        if isa == Isa::Avx2 {
            // SAFETY: AVX2 is present (`stream_isa` returns only sets this CPU has).
            return unsafe { sum_avx2(x) };
        }
    }
    sum_portable(x)
}

/// A sum in 16 independent lanes of plain Rust, which LLVM vectorises with whatever the
/// build targets (SSE2 on baseline x86-64), as it does the portable kernels: the
/// portable rows' stream. (`x.iter().sum()` is one dependent chain, which LLVM may not
/// reorder: 5.7 GB/s from L2 where this loop reads what the portable kernels' vectors
/// can.)
fn sum_portable(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    let chunks = x.chunks_exact(16);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for (a, v) in acc.iter_mut().zip(c) {
            *a += *v;
        }
    }
    acc.iter().sum::<f32>() + tail
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

/// Floats ahead at which the `e = m; m = -m` loop prefetches both streams into L1, as
/// `pqt_error` does: the loop stands for the best stream of that traffic. Without it
/// each store of `e` waited for the line's read for ownership: with it the loop moved
/// 61-64 GB/s in L2 against 32-46, and 17.7-20.6 GB/s from memory against 9.9-12.3
/// (Intel Xeon, Emerald Rapids class, AVX-512), so `pqt+e`'s fractions of it, 1.2-1.5
/// from memory before, are honest now. 256 to 1024 floats ahead read the same; a sweep
/// into L2 128 KiB ahead besides read the same from memory. The `m += e` loop, which
/// writes only lines it has read, moved the same with the prefetch in L2 and from
/// memory, and less with the sweep (which ran past its 256 KiB in L2), so it has none.
const STREAM_PREFETCH: usize = 128;

/// Prefetches element `i` of `m` and `e` [`STREAM_PREFETCH`] ahead into L1.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn stream_prefetch(m: *const f32, e: *const f32, i: usize) {
    use std::arch::x86_64::*;
    // SAFETY: a prefetch is a hint that never faults, whatever the address; the addresses
    // are formed with `wrapping_add`.
    unsafe {
        _mm_prefetch::<_MM_HINT_T0>(m.wrapping_add(i + STREAM_PREFETCH).cast());
        _mm_prefetch::<_MM_HINT_T0>(e.wrapping_add(i + STREAM_PREFETCH).cast());
    }
}

/// The stream `pqt_error` makes, with nothing computed: `e = m; m = -m` (one read and
/// two writes an element), in the vectors of [`stream_isa`]`(widest)`. (A sign flip,
/// not a scale: repeated in cache, halving would reach subnormal numbers, whose
/// arithmetic takes microcode assists on Intel cores.)
fn split_stream(m: &mut [f32], e: &mut [f32], widest: Isa) {
    #[cfg(target_arch = "x86_64")]
    {
        let isa = stream_isa(widest);
        if isa == Isa::Avx512 {
            // SAFETY: AVX-512F is present (`stream_isa` returns only sets this CPU has).
            return unsafe { split_avx512(m, e) };
        }
        if isa == Isa::Avx2 {
            // SAFETY: AVX2 is present (`stream_isa` returns only sets this CPU has).
            return unsafe { split_avx2(m, e) };
        }
    }
    for (x, y) in m.iter_mut().zip(e.iter_mut()) {
        *y = *x;
        *x = -*x;
    }
}

/// Bytes ahead of its loads at which [`fma_stream`] prefetches (`prefetcht0`, a line at
/// a time): about a DRAM latency's worth of one core's read at 30-40 GB/s.
const PLAIN_PREFETCH_BYTES: usize = 4096;

/// A read of `x` in memory order with `k` fused multiply-adds a vector (the kernels'
/// width at `widest`, [`stream_isa`]) into independent accumulators, `k` in 1, 2, 4, 8:
/// the in-core work of a rank-`k` product a line, with none of a kernel's walk. With
/// `prefetch`, each line [`PLAIN_PREFETCH_BYTES`] ahead is prefetched as the loop
/// reaches its own.
fn fma_stream(x: &[f32], widest: Isa, k: usize, prefetch: bool) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! go {
            ($f:ident) => {
                // SAFETY: `stream_isa` returns only instruction sets this CPU has.
                return unsafe {
                    match (k, prefetch) {
                        (1, false) => $f::<1, false>(x),
                        (1, true) => $f::<1, true>(x),
                        (2, false) => $f::<2, false>(x),
                        (2, true) => $f::<2, true>(x),
                        (4, false) => $f::<4, false>(x),
                        (4, true) => $f::<4, true>(x),
                        (_, false) => $f::<8, false>(x),
                        (_, true) => $f::<8, true>(x),
                    }
                }
            };
        }
        match stream_isa(widest) {
            Isa::Avx512 => go!(fma_stream_avx512),
            Isa::Avx2 => go!(fma_stream_avx2),
            _ => {}
        }
    }
    // No SIMD instruction set (the roofline does not ask for one then): a multiply and
    // an add a lane, which LLVM vectorises, and no prefetch.
    let mut acc = [0.0f32; 16];
    for c in x.chunks_exact(16) {
        for _ in 0..k {
            for (a, v) in acc.iter_mut().zip(c) {
                *a += v * 0.5;
            }
        }
    }
    acc.iter().sum()
}

/// [`fma_stream`] in AVX-512: 16 accumulators, `16 / K` vectors a step, each vector's
/// `K` multiply-adds into accumulators of their own.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fma_stream_avx512<const K: usize, const PF: bool>(x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let nv = 16 / K;
    let mut acc = [_mm512_setzero_ps(); 16];
    let p = _mm512_set1_ps(0.5);
    for c in x.chunks_exact(16 * nv) {
        let base = c.as_ptr();
        if PF {
            for v in 0..nv {
                // A prefetch never faults: the address may lie past `x`.
                _mm_prefetch::<_MM_HINT_T0>(
                    base.wrapping_add(16 * v + PLAIN_PREFETCH_BYTES / 4)
                        .cast::<i8>(),
                );
            }
        }
        for v in 0..nv {
            // SAFETY: `c` holds `16 * nv` floats, so 16 at offset 16 * v are in bounds.
            let xv = unsafe { _mm512_loadu_ps(base.add(16 * v)) };
            for j in 0..K {
                acc[v * K + j] = _mm512_fmadd_ps(p, xv, acc[v * K + j]);
            }
        }
    }
    let mut s = acc[0];
    for a in &acc[1..] {
        s = _mm512_add_ps(s, *a);
    }
    _mm512_reduce_add_ps(s)
}

/// [`fma_stream`] in AVX2: 8 accumulators (of AVX2's 16 registers), `8 / K` vectors a
/// step; two vectors a line, so `2 K` multiply-adds a line as in the AVX2 kernels.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_stream_avx2<const K: usize, const PF: bool>(x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let nv = 8 / K;
    let mut acc = [_mm256_setzero_ps(); 8];
    let p = _mm256_set1_ps(0.5);
    for (i, c) in x.chunks_exact(8 * nv).enumerate() {
        let base = c.as_ptr();
        if PF {
            // One prefetch a line (two vectors): at the even vectors.
            for v in (0..nv).filter(|v| (i * nv + v).is_multiple_of(2)) {
                // A prefetch never faults: the address may lie past `x`.
                _mm_prefetch::<_MM_HINT_T0>(
                    base.wrapping_add(8 * v + PLAIN_PREFETCH_BYTES / 4)
                        .cast::<i8>(),
                );
            }
        }
        for v in 0..nv {
            // SAFETY: `c` holds `8 * nv` floats, so 8 at offset 8 * v are in bounds.
            let xv = unsafe { _mm256_loadu_ps(base.add(8 * v)) };
            for j in 0..K {
                acc[v * K + j] = _mm256_fmadd_ps(p, xv, acc[v * K + j]);
            }
        }
    }
    let mut s = acc[0];
    for a in &acc[1..] {
        s = _mm256_add_ps(s, *a);
    }
    let mut lanes = [0.0f32; 8];
    // SAFETY: `lanes` holds 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), s) };
    lanes.iter().sum()
}

/// The stream `add_mq` makes, with nothing computed: `m += e` (two reads and a write an
/// element), in the vectors of [`stream_isa`]`(widest)`.
fn add_stream(m: &mut [f32], e: &[f32], widest: Isa) {
    #[cfg(target_arch = "x86_64")]
    {
        let isa = stream_isa(widest);
        if isa == Isa::Avx512 {
            // SAFETY: AVX-512F is present (`stream_isa` returns only sets this CPU has).
            return unsafe { add_avx512(m, e) };
        }
        if isa == Isa::Avx2 {
            // SAFETY: AVX2 is present (`stream_isa` returns only sets this CPU has).
            return unsafe { add_avx2(m, e) };
        }
    }
    for (x, y) in m.iter_mut().zip(e) {
        *x += *y;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn add_avx512(m: &mut [f32], e: &[f32]) {
    use std::arch::x86_64::*;
    let n = m.len().min(e.len()) / 16 * 16;
    for i in (0..n).step_by(16) {
        // SAFETY: i + 16 <= n, inside both slices.
        unsafe {
            let x = _mm512_add_ps(
                _mm512_loadu_ps(m.as_ptr().add(i)),
                _mm512_loadu_ps(e.as_ptr().add(i)),
            );
            _mm512_storeu_ps(m.as_mut_ptr().add(i), x);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn add_avx2(m: &mut [f32], e: &[f32]) {
    use std::arch::x86_64::*;
    let n = m.len().min(e.len()) / 8 * 8;
    for i in (0..n).step_by(8) {
        // SAFETY: i + 8 <= n, inside both slices.
        unsafe {
            let x = _mm256_add_ps(
                _mm256_loadu_ps(m.as_ptr().add(i)),
                _mm256_loadu_ps(e.as_ptr().add(i)),
            );
            _mm256_storeu_ps(m.as_mut_ptr().add(i), x);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn split_avx512(m: &mut [f32], e: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = m.len().min(e.len()) / 16 * 16;
    let flip = _mm512_set1_ps(-1.0);
    for i in (0..n).step_by(16) {
        stream_prefetch(m.as_ptr(), e.as_ptr(), i);
        // SAFETY: i + 16 <= n, inside both slices.
        unsafe {
            let x = _mm512_loadu_ps(m.as_ptr().add(i));
            _mm512_storeu_ps(e.as_mut_ptr().add(i), x);
            _mm512_storeu_ps(m.as_mut_ptr().add(i), _mm512_mul_ps(x, flip));
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn split_avx2(m: &mut [f32], e: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = m.len().min(e.len()) / 8 * 8;
    let flip = _mm256_set1_ps(-1.0);
    // Four vectors (two lines of each stream) an iteration, both lines prefetched: with
    // one vector and the prefetch every other iteration behind a branch the loop ran at
    // the front end's pace, which depended on where the build put it (AMD Zen 5, `M` in
    // L2: 245-264 GB/s with the loop inside one 64-byte line of code, 172-194 across two,
    // so `pqt+e`'s AVX2 fractions moved 1.2-1.3 between builds with its code unchanged;
    // two vectors an iteration 210-228). Four read 243-269 across three lines of code.
    let pairs = n / 32 * 32;
    for i in (0..pairs).step_by(32) {
        stream_prefetch(m.as_ptr(), e.as_ptr(), i);
        stream_prefetch(m.as_ptr(), e.as_ptr(), i + 16);
        for v in [i, i + 8, i + 16, i + 24] {
            // SAFETY: v + 8 <= pairs <= n, inside both slices.
            unsafe {
                let x = _mm256_loadu_ps(m.as_ptr().add(v));
                _mm256_storeu_ps(e.as_mut_ptr().add(v), x);
                _mm256_storeu_ps(m.as_mut_ptr().add(v), _mm256_mul_ps(x, flip));
            }
        }
    }
    for i in (pairs..n).step_by(8) {
        // SAFETY: i + 8 <= n, inside both slices.
        unsafe {
            let x = _mm256_loadu_ps(m.as_ptr().add(i));
            _mm256_storeu_ps(e.as_mut_ptr().add(i), x);
            _mm256_storeu_ps(m.as_mut_ptr().add(i), _mm256_mul_ps(x, flip));
        }
    }
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
    fma_rate(lanes, 20_000_000)
}

/// [`fma_per_ns`] over `n` rounds of the 12 chains (the better of two runs).
fn fma_rate(lanes: usize, n: usize) -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
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
    let _ = (lanes, n);
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
    // Every chain reaches the result, or the compiler drops all but one and the rate
    // reads 12 times too high.
    let mut s = a[0];
    for x in &a[1..] {
        s = _mm256_add_ps(s, *x);
    }
    let mut lanes = [0.0f32; 8];
    // SAFETY: `lanes` holds 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), s) };
    lanes.iter().sum()
}

/// What `--roofline` measures: the two products and the two fused error-feedback passes
/// of a PowerSGD step.
#[derive(Clone, Copy, PartialEq)]
enum Kernel {
    /// `P = M Q`.
    Mq,
    /// `Q = Mᵀ P`.
    Mtp,
    /// `M += E; P = M Q` (`add_mq`).
    AddMq,
    /// `M̂ = P Qᵀ; E = M - M̂` (`pqt_error`).
    PqtError,
}

impl Kernel {
    fn name(self) -> &'static str {
        match self {
            Kernel::Mq => "mq",
            Kernel::Mtp => "mtp",
            Kernel::AddMq => "mq+e",
            Kernel::PqtError => "pqt+e",
        }
    }

    /// Bytes each element of `M` moves: 4 for the products (read once), 12 for the fused
    /// passes (`M` read and written, `E` read or written).
    fn bytes_per_element(self) -> usize {
        match self {
            Kernel::Mq | Kernel::Mtp => 4,
            Kernel::AddMq | Kernel::PqtError => 12,
        }
    }

    fn op(self) -> Op {
        match self {
            Kernel::Mq | Kernel::AddMq => Op::Mq,
            Kernel::Mtp | Kernel::PqtError => Op::Mtp,
        }
    }
}

/// One in-cache timing: the per-call time of `calls` calls of `f`.
fn time_calls(calls: usize, mut f: impl FnMut()) -> Duration {
    let t = Instant::now();
    for _ in 0..calls {
        f();
    }
    t.elapsed() / calls as u32
}

fn median_f64(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Bytes past a 64-byte line at which the kernels' in-L2 buffers start: where glibc's
/// `malloc` puts a large block (its 16-byte chunk header after a page), so what
/// training code's `Vec<f32>` gradients see.
const KERNEL_PLACEMENT: usize = 16;

/// A buffer of `len` floats starting `offset` bytes past a 64-byte line.
struct Placed {
    buf: Vec<f32>,
    start: usize,
    len: usize,
}

impl Placed {
    fn new(len: usize, offset: usize, fill: impl Fn(usize) -> f32) -> Placed {
        assert!(offset.is_multiple_of(4) && offset < 64);
        let mut buf = vec![0.0f32; len + 32];
        let start = (buf.as_ptr().align_offset(64) + offset / 4) % 16;
        for (i, x) in buf[start..start + len].iter_mut().enumerate() {
            *x = fill(i);
        }
        Placed { buf, start, len }
    }

    fn get(&self) -> &[f32] {
        &self.buf[self.start..self.start + self.len]
    }

    fn get_mut(&mut self) -> &mut [f32] {
        &mut self.buf[self.start..self.start + self.len]
    }
}

/// `--roofline`: for every kernel and rank (or those `--op` and `--rank` select), one
/// thread, the in-core limit and how close the kernel comes to it with `M` in L2, then
/// the fraction of the reference's bandwidth from memory (the read sum for the
/// products, the same stream loop for the fused passes).
///
/// The in-core limit of a row is the lower of two rates, both measured here:
/// - the FMA bound: the FMA units' rate (12 independent chains in registers) over the
///   FMAs a 64-byte line of `M` needs (`r x 16 / lanes`);
/// - the L2 stream bound: what a plain SIMD loop in the kernels' vectors moves with the
///   same data in L2 (each load a load port's issue slot): the read sum over the same
///   `M` for the products (every kernel reads each line of `M` once; the factors' loads
///   come from L1 and are the kernel's own cost), and `y += x` and `e = m; m = -m` for
///   the fused passes (their traffic).
///
/// `M` is 128 x 1024 (512 KiB; with `E` 2 x 256 KiB, 64 x 1024): half of a 1 MiB L2,
/// so the factors, the accumulators and the other half's prefetches fit beside it.
fn roofline(a: &Args, cpu: &CpuBackend) {
    let isa = cpu.isa();
    let lanes = match isa {
        Isa::Avx512 => 16,
        _ => 8,
    };
    let fma = fma_per_ns(lanes);
    let be = cpu.clone().with_threads(1).expect("one thread");
    let mut flush_buf = vec![1u64; FLUSH_BYTES / 8];
    if !a.json {
        println!(
            "{} kernels, one thread; FMA/ns at {lanes} lanes: {}; limit = min(FMA bound, L2 stream bound), * = the two within 20% (co-limited)",
            isa.name(),
            fma.map_or("-".into(), |f| format!("{f:.2}"))
        );
        println!(
            "{:<6} {:>2} {:>8} {:>9} {:>9} {:>7} {:>7} {:>8} {:>7} {:>7} {:>6} {:>9} {:>7} {:>5} {:>5} {:>7} {:>5}",
            "op",
            "r",
            "fma/line",
            "fma GB/s",
            "L2 strm",
            "limit",
            "L2 GB/s",
            "of limit",
            "aligned",
            "cold",
            "ref",
            "fraction",
            "serial",
            "plain",
            "+pf",
            "llc ref",
            "llc"
        );
    }
    let kernels = [Kernel::Mq, Kernel::Mtp, Kernel::AddMq, Kernel::PqtError];
    let ranks: Vec<usize> = match a.rank {
        Some(r) => vec![r],
        None => vec![1, 2, 4, 8],
    };
    for kernel in kernels {
        if a.op.is_some_and(|only| only != kernel.op()) {
            continue;
        }
        for &r in &ranks {
            roofline_row(a, &be, kernel, r, lanes, fma, &mut flush_buf);
        }
    }
}

/// One row of [`roofline`].
fn roofline_row(
    a: &Args,
    be: &CpuBackend,
    kernel: Kernel,
    r: usize,
    lanes: usize,
    fma: Option<f64>,
    flush_buf: &mut [u64],
) {
    let bpe = kernel.bytes_per_element();
    let fma_per_line = (r * 16) as f64 / lanes as f64;
    let rows = if bpe == 4 { 128 } else { 64 };
    let cols = 1024;
    let d = Dims::new(1, rows, cols, r).expect("valid shape");
    let len = rows * cols;
    // The kernel's `M` and `E` where the system allocator puts large buffers (16 bytes
    // past a 64-byte line), the reference's on a line: the L2 bound is the best stream
    // of the kernels' vector width, and a kernel that loads split lines pays for it here.
    let mut m_buf = Placed::new(len, KERNEL_PLACEMENT, |i| (i % 251) as f32 * 1e-3);
    let mut e_buf = Placed::new(len, KERNEL_PLACEMENT, |i| (i % 17) as f32 * 1e-4);
    let e0_buf = Placed::new(len, KERNEL_PLACEMENT, |_| 0.0);
    let mut m_ref = Placed::new(len, 0, |i| (i % 251) as f32 * 1e-3);
    let mut e_ref = Placed::new(len, 0, |i| (i % 17) as f32 * 1e-4);
    // The kernel once more on buffers on a line: what the placement costs it.
    let mut m_aln = Placed::new(len, 0, |i| (i % 251) as f32 * 1e-3);
    let mut e_aln = Placed::new(len, 0, |i| (i % 17) as f32 * 1e-4);
    let e0_aln = Placed::new(len, 0, |_| 0.0);
    let (m, e, e0) = (m_buf.get_mut(), e_buf.get_mut(), e0_buf.get());
    let (mr, er) = (m_ref.get_mut(), e_ref.get_mut());
    let (ma, ea, e0a) = (m_aln.get_mut(), e_aln.get_mut(), e0_aln.get());
    let (p, mut q, mut p_out) = (
        vec![0.5f32; d.p_len()],
        vec![0.25f32; d.q_len()],
        vec![0.0f32; d.p_len()],
    );
    // About 2 ms of work per timed run.
    let calls = 2_000_000 / (rows * cols * bpe / 64).max(1);
    let traffic = (rows * cols * bpe) as f64;
    // Kernel, stream and FMA rate measured one after the other, 7 times: each run's
    // ratio is of rates measured within milliseconds of each other (a VM's clock and
    // its neighbours move all of them between runs); the medians are reported.
    let (mut kernel_gbs, mut stream_gbs, mut fma_gbs_runs, mut of_limit, mut of_limit_aln) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..7 {
        let mut run = |m: &mut [f32], e: &mut [f32], e0: &[f32]| {
            time_calls(calls, || match kernel {
                Kernel::Mq => be.mq(d, m, &q, &mut p_out).expect("mq"),
                Kernel::Mtp => be.mtp(d, m, &p, &mut q).expect("mtp"),
                // E is zero here, so M keeps its values call after call.
                Kernel::AddMq => be.add_mq(d, m, e0, &q, &mut p_out).expect("add_mq"),
                Kernel::PqtError => be.pqt_error(d, &p, &q, m, e).expect("pqt_error"),
            })
        };
        let kernel_time = run(m, e, e0);
        let aligned_time = run(ma, ea, e0a);
        let stream_time = time_calls(calls, || match kernel {
            Kernel::Mq | Kernel::Mtp => {
                black_box(sum_at(mr, be.isa()));
            }
            Kernel::AddMq => add_stream(mr, er, be.isa()),
            Kernel::PqtError => split_stream(mr, er, be.isa()),
        });
        let l2_k = traffic / kernel_time.as_secs_f64() / 1e9;
        let l2_stream = traffic / stream_time.as_secs_f64() / 1e9;
        // The FMA bound in bytes of the row's traffic: a line of M is 64 bytes of M and
        // 64 * bpe / 4 bytes of traffic.
        let fma_gbs = fma
            .and(fma_rate(lanes, 200_000))
            .map(|f| 64.0 * f / fma_per_line * (bpe / 4) as f64);
        let limit = fma_gbs.map_or(l2_stream, |f| f.min(l2_stream));
        kernel_gbs.push(l2_k);
        stream_gbs.push(l2_stream);
        fma_gbs_runs.extend(fma_gbs);
        of_limit.push(l2_k / limit);
        of_limit_aln.push(traffic / aligned_time.as_secs_f64() / 1e9 / limit);
    }
    let l2_k = median_f64(kernel_gbs);
    let l2_stream = median_f64(stream_gbs);
    let fma_gbs = (!fma_gbs_runs.is_empty()).then(|| median_f64(fma_gbs_runs));
    let of_limit = median_f64(of_limit);
    let of_limit_aln = median_f64(of_limit_aln);
    let limit = fma_gbs.map_or(l2_stream, |f| f.min(l2_stream));
    // Both ceilings within 20%: the row is co-limited (see the module docs).
    let co_limited = fma_gbs.is_some_and(|f| f.min(l2_stream) / f.max(l2_stream) >= 0.8);
    // From memory (n = m = 4096), as the table measures: the products against the read
    // sum over the same M, the fused passes against the stream loop of the same traffic
    // (the L2 column's, now from memory).
    // With the products, the plain loop of the row's work in the kernels' vectors (not
    // for the portable lanes: their multiply-add is a library call, and they have no
    // prefetch instruction).
    let plain = (matches!(kernel, Kernel::Mq | Kernel::Mtp)
        && matches!(be.isa(), Isa::Avx512 | Isa::Avx2))
    .then_some((r, be.isa()));
    let cold = pair_from(
        be,
        kernel,
        r,
        4096,
        a.reps,
        &mut |_, _| flush(flush_buf),
        plain,
    );
    // The same from the last-level cache: 8 MiB of `M` (and `E`) read once, then 8 MiB
    // of other data so that none of it is left in L2.
    let llc_rows = (LLC_SET_BYTES / 4096 / bpe).max(1);
    let llc = pair_from(
        be,
        kernel,
        r,
        llc_rows,
        a.reps,
        &mut |m, e| {
            black_box(sum_slice(m) + sum_slice(e));
            flush(&mut flush_buf[..LLC_SET_BYTES / 8]);
        },
        None,
    );
    if a.json {
        let num = |v: Option<f64>| v.map_or("null".to_string(), |v| format!("{v:.3}"));
        println!(
            "{{\"bench\":\"lowrank/roofline\",\"isa\":\"{}\",\"op\":\"{}\",\"r\":{r},\"fma_per_line\":{fma_per_line},\"fma_gb_per_s\":{},\"l2_stream_gb_per_s\":{l2_stream:.3},\"limit_gb_per_s\":{limit:.3},\"l2_gb_per_s\":{l2_k:.3},\"fraction_of_limit\":{:.4},\"fraction_of_limit_aligned\":{of_limit_aln:.4},\"co_limited\":{co_limited},\"cold_gb_per_s\":{:.3},\"reference_gb_per_s\":{:.3},\"fraction_of_bandwidth\":{:.3},\"llc_gb_per_s\":{:.3},\"llc_reference_gb_per_s\":{:.3},\"fraction_of_llc\":{:.4},\"plain_fraction\":{},\"plain_prefetch_fraction\":{}}}",
            be.isa().name(),
            kernel.name(),
            num(fma_gbs),
            of_limit,
            cold.0,
            cold.1,
            cold.0 / cold.1,
            llc.0,
            llc.1,
            llc.0 / llc.1,
            num(cold.2.map(|p| p.0 / cold.1)),
            num(cold.2.map(|p| p.1 / cold.1)),
        );
    } else {
        let (c, rf, plain) = cold;
        let (fr, se) = (c / rf, 1.0 / (1.0 + rf / l2_k));
        let frac = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{:.2}", v / rf));
        println!(
            "{:<6} {r:>2} {fma_per_line:>8.1} {:>9} {l2_stream:>9.1} {:>7} {l2_k:>7.1} {:>8.2} {of_limit_aln:>7.2} {c:>7.2} {rf:>6.2} {fr:>9.2} {se:>7.2} {:>5} {:>5} {:>7.1} {:>5.2}",
            kernel.name(),
            fma_gbs.map_or("-".into(), |g| format!("{g:.1}")),
            format!("{limit:.1}{}", if co_limited { "*" } else { "" }),
            of_limit,
            frac(plain.map(|p| p.0)),
            frac(plain.map(|p| p.1)),
            llc.1,
            llc.0 / llc.1,
        );
    }
}

/// Bytes of `M` (and `E`) the `llc` columns of [`roofline`] read from the last-level
/// cache, and of other data read after them to push them out of L2 (larger than the
/// L2 of any core the kernels are tuned for). The LLC must hold both: where `llc ref`
/// is no faster than `ref`, it did not.
const LLC_SET_BYTES: usize = 8 << 20;

/// Kernel and reference GB/s over `rows` x 4096 (`M`, and `E` for the fused passes, the
/// reference as in [`roofline_row`]'s cold columns), `prepare(m, e)` run before each
/// timed pass: the medians of `reps` interleaved pairs.
fn pair_from(
    be: &CpuBackend,
    kernel: Kernel,
    r: usize,
    rows: usize,
    reps: usize,
    prepare: &mut dyn FnMut(&[f32], &[f32]),
    plain: Option<(usize, Isa)>,
) -> (f64, f64, Option<(f64, f64)>) {
    let cols = 4096;
    let bpe = kernel.bytes_per_element();
    let d = Dims::new(1, rows, cols, r).expect("valid shape");
    let mut m: Vec<f32> = (0..rows * cols)
        .map(|i| ((i % 251) as f32 - 125.0) * 1e-3)
        .collect();
    let mut e: Vec<f32> = if bpe == 4 {
        Vec::new()
    } else {
        (0..rows * cols).map(|i| (i % 17) as f32 * 1e-6).collect()
    };
    let (p, mut q, mut p_out) = (
        vec![0.5f32; d.p_len()],
        vec![0.25f32; d.q_len()],
        vec![0.0f32; d.p_len()],
    );
    let (mut tk, mut tr, mut tp, mut tpf) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..reps {
        // The plain loop of the row's work ([`fma_stream`]), without and with the
        // prefetch, in the same rounds.
        if let Some((k, isa)) = plain {
            for (pf, times) in [(false, &mut tp), (true, &mut tpf)] {
                prepare(&m, &e);
                let t = Instant::now();
                black_box(fma_stream(&m, isa, k, pf));
                times.push(t.elapsed());
            }
        }
        prepare(&m, &e);
        let t = Instant::now();
        match kernel {
            Kernel::Mq | Kernel::Mtp => {
                black_box(reference(&m, 1));
            }
            Kernel::AddMq => add_stream(&mut m, &e, Isa::Avx512),
            Kernel::PqtError => split_stream(&mut m, &mut e, Isa::Avx512),
        }
        tr.push(t.elapsed());
        prepare(&m, &e);
        let t = Instant::now();
        match kernel {
            Kernel::Mq => be.mq(d, &m, &q, &mut p_out),
            Kernel::Mtp => be.mtp(d, &m, &p, &mut q),
            Kernel::AddMq => be.add_mq(d, &mut m, &e, &q, &mut p_out),
            Kernel::PqtError => be.pqt_error(d, &p, &q, &mut m, &mut e),
        }
        .expect("kernel");
        tk.push(t.elapsed());
        black_box((&q, &p_out));
    }
    let bytes = (rows * cols * bpe) as f64;
    let m_bytes = (rows * cols * 4) as f64;
    (
        bytes / median(tk).as_secs_f64() / 1e9,
        bytes / median(tr).as_secs_f64() / 1e9,
        plain.map(|_| {
            (
                m_bytes / median(tp).as_secs_f64() / 1e9,
                m_bytes / median(tpf).as_secs_f64() / 1e9,
            )
        }),
    )
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

//! How the hook benchmarks measure, written once for the `hooks` suite and the
//! compression report (included with `#[path]`): thread ranks with one CPU thread each,
//! synthetic gradients, the link accounted (never slept), and the read-bandwidth
//! references that the bound ratios divide by.
//!
//! Two references, both a vectorised sum over a buffer larger than the last-level cache:
//! - the **one-thread** read bandwidth ([`read_bandwidth`]), measured once, alone: what
//!   one rank would get with the memory system to itself. `bound_ratio_1t` divides by it;
//! - the **shared** read bandwidth, measured inside [`measure_alternating`] once per step
//!   round (one step of every alternated hook), on the rank threads themselves: after a
//!   barrier every rank sums its own [`SHARED_READ_BYTES`] buffer at the same time, and
//!   the round's per-rank share is those bytes over the SLOWEST rank's time (the hook
//!   times are the slowest rank's too). Two ranks streaming at once share the memory
//!   system (on a 2-core machine two threads read only 1.3-1.45x what one does), and its
//!   bandwidth drifts within seconds when other tenants load it, so each step is divided
//!   by the share measured seconds from it: `bound_ratio` is the median over the steps of
//!   `hook time / (passes * gradient bytes / that round's share)`
//!   ([`Measured::bound_ratio`]).
//!
//! Both bounds assume the gradient streams from DRAM: where the working set of a step
//! ([`working_set_bytes`]) is at most twice the last-level cache ([`llc_bytes`]), part
//! of it stays cached and a ratio below 1 does not mean the hook beat the memory.

#![allow(dead_code)]

pub mod overlap;

use collectives::link::{Charge, Link, LinkOp, Linked};
use collectives::{run_local, ProcessGroup};
use ddp_hooks::{CommHook, GradBucket, HookSpec, Layout, Reducer, ReducerConfig};
use lowrank::{CpuBackend, NormalRng};
use std::hint::black_box;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Ranks of every hook measurement.
pub const RANKS: usize = 2;

/// The instruction set the measured backends use: the machine's best unless a bench set
/// it (`hooks --isa avx2` runs the AVX2 kernels on an AVX-512 machine).
pub static ISA: std::sync::OnceLock<lowrank::Isa> = std::sync::OnceLock::new();

/// Makes the measured backends use the kernels of the instruction set `name` (`avx512`,
/// `avx2`, `portable`) and caps the thread backend's 16-bit loops at the same one
/// (`LOWRANK_CPU_CAPABILITY`, read once, at the first 16-bit reduction or
/// `CpuBackend::new`). Call it at the start of `main`, before any other thread runs.
pub fn select_isa(name: &str) -> Result<(), String> {
    let Some(isa) = lowrank::Isa::supported()
        .into_iter()
        .find(|i| i.name() == name)
    else {
        return Err(format!(
            "--isa {name}: not an instruction set this CPU runs"
        ));
    };
    let _ = ISA.set(isa);
    std::env::set_var("LOWRANK_CPU_CAPABILITY", isa.name());
    Ok(())
}

/// A one-thread CPU backend with the kernels of [`ISA`].
pub fn backend() -> CpuBackend {
    let be = CpuBackend::new().with_threads(1).expect("threads");
    match ISA.get() {
        Some(&isa) => be.with_isa(isa).expect("a supported instruction set"),
        None => be,
    }
}
/// Per-message latency of the modelled link.
pub const LATENCY: Duration = Duration::from_micros(20);
/// Steps run before timing a PowerSGD hook: it is measured with `start_iter=2`, and
/// step 2 (its first compressed step) allocates its memory.
pub const POWERSGD_WARMUP: usize = 3;

/// Steps run before timing `spec`: [`POWERSGD_WARMUP`] for PowerSGD (wrapped or not), one
/// for the others (their first step allocates what later steps reuse).
pub fn warmup(spec: &HookSpec) -> usize {
    match spec {
        HookSpec::PowerSgd(_) | HookSpec::BatchedPowerSgd(_) => POWERSGD_WARMUP,
        HookSpec::Fp16Wrapped(inner) | HookSpec::Bf16Wrapped(inner) => warmup(inner),
        _ => 1,
    }
}
/// Passes over the gradient memory that the fused PowerSGD algorithm makes; the bound
/// that `bound_ratio` compares the hook time with.
pub const BOUND_PASSES: f64 = 7.0;

/// Passes over the gradient memory that a hook's memory traffic amounts to on the thread
/// backend, per rank, for its `bound_ratio`:
/// - PowerSGD (per layer or batched): [`BOUND_PASSES`];
/// - the all-reduce and the 16-bit hooks: 2. Every rank reads its share of every rank's
///   `f32` gradient and writes the (rounded) mean back into each: 4 bytes read and 4
///   written per gradient element. The 16-bit rounding is fused into that pass, so a
///   16-bit hook that costs more than the all-reduce pays for its rounding;
/// - a `fp16+`/`bf16+` wrapper: its inner hook's (the narrowing is fused the same way);
/// - `noop`: none;
/// - the quantisation hooks: none modelled yet (host passes and an all-gather of bytes).
pub fn bound_passes(spec: &HookSpec) -> Option<f64> {
    match spec {
        HookSpec::PowerSgd(_) | HookSpec::BatchedPowerSgd(_) => Some(BOUND_PASSES),
        HookSpec::AllReduce | HookSpec::Fp16 | HookSpec::Bf16 => Some(2.0),
        HookSpec::Fp16Wrapped(inner) | HookSpec::Bf16Wrapped(inner) => bound_passes(inner),
        HookSpec::Noop => None,
        HookSpec::QuantizePerTensor { .. }
        | HookSpec::QuantizePerChannel { .. }
        | HookSpec::PostLocalSgd { .. } => None,
    }
}

/// The median of `v` (the upper one of an even count).
pub fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

/// The median of `v` (the upper one of an even count; NaN for none).
pub fn median_f64(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The time of one read pass over `v`: a sum with 16 independent accumulators (so the
/// compiler vectorises it), the kernel of both bandwidth references.
fn read_pass(v: &[f32]) -> Duration {
    let t = Instant::now();
    let mut acc = [0.0f32; 16];
    for c in v.chunks_exact(16) {
        for (a, x) in acc.iter_mut().zip(c) {
            *a += x;
        }
    }
    black_box(acc);
    t.elapsed()
}

/// Single-thread read bandwidth (bytes/s): [`read_pass`] over 256 MiB, best of 3, with
/// nothing else running.
pub fn read_bandwidth() -> f64 {
    let v = vec![1.0f32; 64 << 20];
    (0..3)
        .map(|_| v.len() as f64 * 4.0 / read_pass(&v).as_secs_f64())
        .fold(0.0, f64::max)
}

/// Bytes each rank reads for one round's shared-bandwidth reference: 64 MiB, so that
/// the [`RANKS`] buffers together are several times a 32 MiB last-level cache and the
/// reads come from DRAM.
pub const SHARED_READ_BYTES: usize = 64 << 20;

/// The last-level cache of this machine (bytes): the largest cache of level 3 that
/// Linux lists for cpu 0 (`/sys/devices/system/cpu/cpu0/cache/index*/`), or, with no
/// level 3, the largest of the highest level listed; `None` where none is listed.
pub fn llc_bytes() -> Option<u64> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    let caches: Vec<(u32, u64)> = dir
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with("index"))
        .filter_map(|e| {
            let read = |f: &str| std::fs::read_to_string(e.path().join(f)).ok();
            let level = read("level")?.trim().parse().ok()?;
            Some((level, parse_cache_size(&read("size")?)?))
        })
        .collect();
    // Level 3 where there is one; otherwise the highest level present.
    let level = if caches.iter().any(|c| c.0 == 3) {
        3
    } else {
        caches.iter().map(|c| c.0).max()?
    };
    caches.iter().filter(|c| c.0 == level).map(|c| c.1).max()
}

/// A cache size as sysfs writes it: `32768K`, `32M`, `1G` or plain bytes (binary units).
pub fn parse_cache_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let (digits, unit) = match s.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => s.split_at(i),
        None => (s, ""),
    };
    let scale = match unit.trim() {
        "" => 1,
        "K" | "k" | "KiB" => 1 << 10,
        "M" | "MiB" => 1 << 20,
        "G" | "GiB" => 1 << 30,
        _ => return None,
    };
    digits.parse::<u64>().ok()?.checked_mul(scale)
}

/// The bytes one step of `spec` streams on all [`RANKS`] ranks together, for its largest
/// bucket of `bucket_bytes` gradient bytes: PowerSGD (per layer or batched, 16-bit wrapped
/// or not) reads and writes the bucket and its error memory, taken as large as the bucket
/// (it covers the bucket's matrices; the 1-D parameters are a small part), so
/// `RANKS * 2 * bucket_bytes`; the all-reduce and the 16-bit hooks read every rank's bucket,
/// `RANKS * bucket_bytes`; `None` for the hooks without a bound ([`bound_passes`]).
pub fn working_set_bytes(spec: &HookSpec, bucket_bytes: usize) -> Option<usize> {
    match spec {
        HookSpec::PowerSgd(_) | HookSpec::BatchedPowerSgd(_) => Some(RANKS * 2 * bucket_bytes),
        HookSpec::Fp16Wrapped(inner) | HookSpec::Bf16Wrapped(inner) => {
            working_set_bytes(inner, bucket_bytes)
        }
        _ => bound_passes(spec).map(|_| RANKS * bucket_bytes),
    }
}

/// Whether a working set `ws_over_llc` times the last-level cache is partly or wholly
/// cache-resident, so that a DRAM bound does not hold: at most 2 as printed (two
/// decimals; 4 x Linear(1024)'s 67.2 MB on a 32 MiB cache is 2.002, and is flagged).
pub fn cache_resident(ws_over_llc: f64) -> bool {
    (ws_over_llc * 100.0).round() <= 200.0
}

/// Normal gradients for every parameter, seeded by rank and parameter.
pub fn synthetic(shapes: &[Vec<usize>], rank: usize) -> Vec<Vec<f32>> {
    shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let mut v = vec![0.0; s.iter().product()];
            NormalRng::new((rank * 1000 + i) as u64).fill(&mut v);
            v
        })
        .collect()
}

/// [`synthetic`] for every rank, one thread per rank.
pub fn synthetic_ranks(shapes: &[Vec<usize>]) -> Vec<Vec<Vec<f32>>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..RANKS)
            .map(|r| s.spawn(move || synthetic(shapes, r)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("gradient generation"))
            .collect()
    })
}

/// One hook's measurement.
pub struct Measured {
    /// Per timed step, the slowest rank's hook time.
    pub steps: Vec<Duration>,
    /// The collectives of one step, as rank 0 issued them.
    pub ops: Vec<LinkOp>,
    /// Per bucket of that step, in launch order: its parameter indices (forward order)
    /// and the collectives it issued, from one untimed step after the timed ones
    /// (see [`Attributed`]). One bucket of every parameter for a `direct` run.
    pub buckets: Vec<(Vec<usize>, Vec<LinkOp>)>,
    /// Per timed step, each rank's share of the shared read bandwidth (bytes/s) in that
    /// step's round: [`SHARED_READ_BYTES`] over the slowest rank's read time.
    pub share_bw: Vec<f64>,
}

impl Measured {
    /// Median hook time over the timed steps.
    pub fn median(&self) -> Duration {
        median(self.steps.clone())
    }

    /// The median over the steps of this hook's time over `base`'s in the same step (both
    /// from one [`measure_alternating`]): a ratio of two hooks that load drifts between
    /// steps do not move.
    pub fn ratio_to(&self, base: &Measured) -> f64 {
        median_f64(
            self.steps
                .iter()
                .zip(&base.steps)
                .map(|(a, b)| a.as_secs_f64() / b.as_secs_f64().max(1e-12))
                .collect(),
        )
    }

    /// `bound_ratio`: the median over the steps of the step's hook time over `passes`
    /// passes of `bytes` at each rank's share of the read bandwidth measured in the same
    /// round ([`share_bw`](Self::share_bw)). 1.00x: the hook streams its memory traffic as
    /// fast as the ranks, reading at once, can.
    pub fn bound_ratio(&self, passes: f64, bytes: usize) -> f64 {
        median_f64(
            self.steps
                .iter()
                .zip(&self.share_bw)
                .map(|(t, bw)| t.as_secs_f64() / (passes * bytes as f64 / bw))
                .collect(),
        )
    }

    /// `bound_ratio_1t`: the median hook time over `passes` passes of `bytes` at the
    /// one-thread read bandwidth `bw` ([`read_bandwidth`]), as if each rank had the memory
    /// system to itself.
    pub fn bound_ratio_1t(&self, passes: f64, bytes: usize, bw: f64) -> f64 {
        self.median().as_secs_f64() / (passes * bytes as f64 / bw)
    }

    /// The median over the rounds of each rank's share of the shared read bandwidth
    /// (bytes/s).
    pub fn share_bandwidth(&self) -> f64 {
        median_f64(self.share_bw.clone())
    }

    /// The gradient bytes of the largest bucket of the attributed step (parameters of
    /// `shapes`).
    pub fn largest_bucket_bytes(&self, shapes: &[Vec<usize>]) -> usize {
        self.buckets
            .iter()
            .map(|(ps, _)| {
                ps.iter()
                    .map(|&p| 4 * shapes[p].iter().product::<usize>())
                    .sum::<usize>()
            })
            .max()
            .unwrap_or(0)
    }

    /// Payload bytes one rank sends per step.
    pub fn bytes_sent(&self) -> usize {
        self.ops.iter().map(LinkOp::bytes).sum()
    }

    /// Modelled link time of one step at `gbit` Gbit/s on [`RANKS`] ranks.
    pub fn link_time(&self, gbit: f64) -> Duration {
        self.link_time_on(gbit, RANKS)
    }

    /// Modelled link time of one step at `gbit` Gbit/s on `ranks` ranks.
    pub fn link_time_on(&self, gbit: f64, ranks: usize) -> Duration {
        let link = Link::gbit(gbit, LATENCY).expect("benchmark link speeds are positive");
        self.ops.iter().map(|&op| link.cost(ranks, op)).sum()
    }

    /// The step's communication profile for the step-time model ([`overlap`]): per
    /// bucket, when the backward pass (over `shapes`) has it ready, its share of
    /// `hook_ms` (by element count) and the link time of its collectives on `ranks`
    /// ranks, as `fixed + per_gbit / gbit` (every link cost is linear in the inverse
    /// bandwidth, so two speeds determine it).
    pub fn profile(&self, shapes: &[Vec<usize>], hook_ms: f64, ranks: usize) -> overlap::Profile {
        let params: Vec<Vec<usize>> = self.buckets.iter().map(|(p, _)| p.clone()).collect();
        let ready = overlap::ready_fractions(shapes, &params);
        let elements = |ps: &[usize]| -> f64 {
            ps.iter()
                .map(|&p| shapes[p].iter().product::<usize>() as f64)
                .sum()
        };
        let total: f64 = params.iter().map(|p| elements(p)).sum::<f64>().max(1.0);
        let cost = |ops: &[LinkOp], gbit: f64| {
            let link = Link::gbit(gbit, LATENCY).expect("positive link speeds");
            ops.iter()
                .map(|&op| link.cost(ranks, op).as_secs_f64() * 1e3)
                .sum::<f64>()
        };
        let buckets = self
            .buckets
            .iter()
            .zip(ready)
            .map(|((ps, ops), ready)| {
                let (at1, at2) = (cost(ops, 1.0), cost(ops, 2.0));
                let per_gbit = 2.0 * (at1 - at2);
                overlap::BucketCost {
                    ready,
                    hook_ms: hook_ms * elements(ps) / total,
                    link_fixed_ms: at1 - per_gbit,
                    link_ms_gbit: per_gbit,
                }
            })
            .collect();
        overlap::Profile { buckets, period: 1 }
    }
}

/// Runs `spec` on `shapes` for [`warmup`] + `steps` steps on [`RANKS`] thread ranks,
/// rank `r` reducing `grads[r]`. `direct`: the hook is called on one bucket holding every
/// parameter; otherwise the reducer buckets them (DDP's default sizes) and the time runs
/// from the first `mark_ready` to the end of `finish`.
pub fn measure(
    shapes: &[Vec<usize>],
    grads: &[Vec<Vec<f32>>],
    spec: &HookSpec,
    direct: bool,
    steps: usize,
) -> Measured {
    measure_alternating(shapes, grads, std::slice::from_ref(spec), direct, steps)
        .pop()
        .expect("one measurement per spec")
}

/// [`measure`] for several hooks at once, alternated step by step on the same ranks:
/// step `i` of every hook runs before step `i + 1` of any, so a drift in the machine's
/// load (other tenants' memory traffic moves this machine's bandwidth by 1.7x within
/// seconds) touches them alike (each step starts at the next hook in turn), and
/// [`Measured::ratio_to`] compares each hook with another step by step. Each hook has its
/// own reducer and its own link log over one shared group; every hook warms up as long as
/// the longest [`warmup`].
///
/// Each timed round (one step of every hook) starts with the shared-bandwidth reference:
/// the ranks meet at a barrier of the group (not logged, so not priced), then each sums
/// its own [`SHARED_READ_BYTES`] buffer; [`Measured::share_bw`] has the round's per-rank
/// share for each of its steps.
pub fn measure_alternating(
    shapes: &[Vec<usize>],
    grads: &[Vec<Vec<f32>>],
    specs: &[HookSpec],
    direct: bool,
    steps: usize,
) -> Vec<Measured> {
    let warmup = specs.iter().map(warmup).max().unwrap_or(0);
    let out = run_local(RANKS, |g| {
        let rank = g.rank();
        let group: Arc<dyn ProcessGroup> = Arc::new(g);
        let link = Link::gbit(1.0, LATENCY).expect("a positive link speed");
        let be = Arc::new(backend());
        let grads = &grads[rank];
        // This rank's buffer of the shared-bandwidth reference, written (so faulted in)
        // before anything is timed.
        let shared = vec![1.0f32; SHARED_READ_BYTES / 4];
        let mut reads = Vec::with_capacity(steps);
        // The whole-model bucket of `direct` runs.
        let direct_bucket = direct.then(|| {
            let layout = Arc::new(Layout::packed(shapes).expect("layout"));
            (grads.concat(), layout)
        });
        // Per hook: how it runs (a hook on the whole bucket, or a reducer) and its log.
        let mut runs: Vec<_> = specs
            .iter()
            .map(|spec| {
                let linked = Linked::new(group.clone(), link, Charge::Account);
                let log = linked.log_handle();
                let hook = spec
                    .build(be.clone(), Arc::new(linked) as Arc<dyn ProcessGroup>)
                    .expect("hook");
                let attributed = Attributed::new(hook, log.clone());
                let marks = attributed.marks.clone();
                let serial = attributed.serial.clone();
                let run = if direct {
                    Run::Direct(Box::new(attributed))
                } else {
                    Run::Reducer(Box::new(
                        Reducer::new(
                            be.clone(),
                            shapes,
                            Box::new(attributed) as Box<dyn CommHook<CpuBackend>>,
                            ReducerConfig::default(),
                        )
                        .expect("reducer"),
                    ))
                };
                HookRun {
                    run,
                    log,
                    times: Vec::with_capacity(steps),
                    marks,
                    serial,
                    timed_ops: Vec::new(),
                    buckets: Vec::new(),
                    spare: None,
                }
            })
            .collect();
        let n = runs.len();
        for step in 0..warmup + steps + 1 {
            // The step after the timed ones attributes each bucket's collectives to it
            // (each bucket waited for before the next starts); it is not timed.
            let attribute = step == warmup + steps;
            if step >= warmup && !attribute {
                // All ranks read at once, from the same instant, as their memory phases
                // overlap in the hooks; between the hook steps, so each step has a
                // reference taken within a round of it.
                group.barrier().wait().expect("barrier");
                reads.push(read_pass(&shared));
            }
            // Each step starts at the next hook, so that no hook always runs right after
            // the same other one.
            for k in 0..n {
                let h = &mut runs[(step + k) % n];
                if attribute {
                    h.timed_ops = std::mem::take(&mut *h.log.lock().expect("log"));
                    h.marks.lock().expect("marks").clear();
                    h.serial.store(true, Ordering::SeqCst);
                }
                if step == warmup {
                    h.log.lock().expect("log").clear();
                }
                let t = match &mut h.run {
                    Run::Direct(hook) => {
                        let bucket = {
                            let (flat, layout) = direct_bucket.as_ref().expect("a direct run");
                            // The bucket's memory is reused step after step, as a
                            // reducer's is: a fresh 16.8 MB buffer each step made the
                            // timed step pay for the allocator (a free inside the timed
                            // region, pages faulted in), not only for the hook.
                            let mut buf = h.spare.take().unwrap_or_default();
                            buf.clear();
                            buf.extend_from_slice(flat);
                            GradBucket::new(0, 1, buf, layout.clone()).expect("bucket")
                        };
                        let t = Instant::now();
                        let out = hook.run(bucket).wait().expect("hook");
                        let elapsed = t.elapsed();
                        h.spare = Some(black_box(out));
                        elapsed
                    }
                    Run::Reducer(reducer) => {
                        for (p, g) in grads.iter().enumerate() {
                            reducer.grad_mut(p).expect("grad").copy_from_slice(g);
                        }
                        let t = Instant::now();
                        for p in (0..shapes.len()).rev() {
                            reducer.mark_ready(p).expect("ready");
                        }
                        reducer.finish().expect("finish");
                        t.elapsed()
                    }
                };
                if attribute {
                    h.serial.store(false, Ordering::SeqCst);
                    let params = match &h.run {
                        Run::Direct(_) => vec![(0..shapes.len()).collect()],
                        Run::Reducer(reducer) => reducer.bucket_params(),
                    };
                    let ops = std::mem::take(&mut *h.log.lock().expect("log"));
                    let marks = h.marks.lock().expect("marks").clone();
                    h.buckets = split_by_bucket(params, &ops, &marks);
                } else {
                    h.times.push(t);
                }
            }
        }
        let runs = runs
            .into_iter()
            .map(|mut h| (h.times.split_off(warmup), h.timed_ops, h.buckets))
            .collect::<Vec<_>>();
        (runs, reads)
    })
    .expect("ranks");
    let (ranks, reads): (Vec<Vec<_>>, Vec<Vec<Duration>>) =
        out.into_iter().map(|r| r.expect("rank")).unzip();
    // Each round's share: the slowest rank's, as the step times are the slowest rank's.
    let share_bw: Vec<f64> = (0..steps)
        .map(|i| {
            let slowest = reads.iter().map(|r| r[i]).max().unwrap_or_default();
            SHARED_READ_BYTES as f64 / slowest.as_secs_f64().max(1e-12)
        })
        .collect();
    (0..specs.len())
        .map(|h| {
            let steps_max = (0..steps)
                .map(|i| ranks.iter().map(|r| r[h].0[i]).max().unwrap_or_default())
                .collect();
            let ops = &ranks[0][h].1;
            let per_step = ops.len() / steps.max(1);
            let ops = ops[..per_step].to_vec();
            let buckets = ranks[0][h].2.clone();
            // The attributed step must have issued what a timed step did, or the
            // per-bucket split would price another step than the table.
            let mut attributed: Vec<LinkOp> = buckets
                .iter()
                .flat_map(|(_, o)| o.iter().copied())
                .collect();
            let mut timed = ops.clone();
            let key = |o: &LinkOp| format!("{o:?}");
            attributed.sort_by_key(key);
            timed.sort_by_key(key);
            assert_eq!(
                attributed, timed,
                "the attributed step issued other collectives than a timed step"
            );
            Measured {
                steps: steps_max,
                ops,
                buckets,
                share_bw: share_bw.clone(),
            }
        })
        .collect()
}

/// One hook of [`measure_alternating`] on one rank.
struct HookRun {
    run: Run,
    log: Arc<Mutex<Vec<LinkOp>>>,
    times: Vec<Duration>,
    marks: Arc<Mutex<Vec<(usize, usize, usize)>>>,
    serial: Arc<AtomicBool>,
    /// The collectives of the timed steps.
    timed_ops: Vec<LinkOp>,
    /// Per bucket of the attributed step: its parameters and collectives.
    buckets: Vec<(Vec<usize>, Vec<LinkOp>)>,
    /// A direct run's bucket memory, handed back by the hook, for the next step.
    spare: Option<Vec<f32>>,
}

/// A hook that, while `serial` is set, waits for each bucket before returning it (as a
/// finished [`collectives::Work`]) and records which collectives of the link log it
/// issued: `(bucket index, log length before, after)`. Unset, it only forwards; the
/// timed steps run with it unset, the attribution step after them with it set.
pub struct Attributed {
    inner: Box<dyn CommHook<CpuBackend>>,
    log: Arc<Mutex<Vec<LinkOp>>>,
    /// The recorded `(bucket, log start, log end)` of the serial buckets.
    pub marks: Arc<Mutex<Vec<(usize, usize, usize)>>>,
    /// Whether buckets are waited for and attributed.
    pub serial: Arc<AtomicBool>,
}

/// How long the attribution step waits for one bucket.
const BUCKET_TIMEOUT: Duration = Duration::from_secs(300);

impl Attributed {
    /// Wraps `inner`, whose group logs its collectives into `log`.
    pub fn new(inner: Box<dyn CommHook<CpuBackend>>, log: Arc<Mutex<Vec<LinkOp>>>) -> Self {
        Attributed {
            inner,
            log,
            marks: Arc::default(),
            serial: Arc::default(),
        }
    }
}

impl CommHook<CpuBackend> for Attributed {
    fn name(&self) -> String {
        self.inner.name()
    }

    fn run(&mut self, bucket: GradBucket<CpuBackend>) -> collectives::Work<Vec<f32>> {
        if !self.serial.load(Ordering::SeqCst) {
            return self.inner.run(bucket);
        }
        let index = bucket.index();
        let before = self.log.lock().expect("log").len();
        let result = self.inner.run(bucket).wait_timeout(BUCKET_TIMEOUT);
        let after = self.log.lock().expect("log").len();
        self.marks
            .lock()
            .expect("marks")
            .push((index, before, after));
        collectives::Work::ready(result)
    }
}

/// Splits the attributed step's log by bucket: bucket `b` (parameters `params[b]`) gets
/// the log entries its mark names (none where it has no mark).
fn split_by_bucket(
    params: Vec<Vec<usize>>,
    ops: &[LinkOp],
    marks: &[(usize, usize, usize)],
) -> Vec<(Vec<usize>, Vec<LinkOp>)> {
    params
        .into_iter()
        .enumerate()
        .map(|(b, ps)| {
            let mine = marks
                .iter()
                .filter(|m| m.0 == b)
                .flat_map(|&(_, lo, hi)| ops.get(lo..hi).unwrap_or_default().iter().copied())
                .collect();
            (ps, mine)
        })
        .collect()
}

/// How [`measure_alternating`] runs one hook.
enum Run {
    /// The hook itself, on one bucket of every parameter.
    Direct(Box<dyn CommHook<CpuBackend>>),
    /// A reducer that buckets the parameters and calls the hook.
    Reducer(Box<Reducer<CpuBackend, Box<dyn CommHook<CpuBackend>>>>),
}

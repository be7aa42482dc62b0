//! How the hook benchmarks measure, written once for the `hooks` suite and the
//! compression report (included with `#[path]`): thread ranks with one CPU thread each,
//! synthetic gradients, the link accounted (never slept), and the read-bandwidth
//! reference that `bound_ratio` divides by.

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

/// Single-thread read bandwidth (bytes/s): a sum over 256 MiB with 16 independent
/// accumulators (so the compiler vectorises it), best of 3.
pub fn read_bandwidth() -> f64 {
    let v = vec![1.0f32; 64 << 20];
    (0..3)
        .map(|_| {
            let t = Instant::now();
            let mut acc = [0.0f32; 16];
            for c in v.chunks_exact(16) {
                for (a, x) in acc.iter_mut().zip(c) {
                    *a += x;
                }
            }
            black_box(acc);
            v.len() as f64 * 4.0 / t.elapsed().as_secs_f64()
        })
        .fold(0.0, f64::max)
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
        let mut r: Vec<f64> = self
            .steps
            .iter()
            .zip(&base.steps)
            .map(|(a, b)| a.as_secs_f64() / b.as_secs_f64().max(1e-12))
            .collect();
        r.sort_by(f64::total_cmp);
        r.get(r.len() / 2).copied().unwrap_or(f64::NAN)
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
/// minutes) touches them alike (each step starts at the next hook in turn), and [`Measured::ratio_to`] compares each hook with
/// another step by step. Each hook has its own reducer and its own link log over one
/// shared group; every hook warms up as long as the longest [`warmup`].
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
                }
            })
            .collect();
        let n = runs.len();
        for step in 0..warmup + steps + 1 {
            // The step after the timed ones attributes each bucket's collectives to it
            // (each bucket waited for before the next starts); it is not timed.
            let attribute = step == warmup + steps;
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
                            GradBucket::new(0, 1, flat.clone(), layout.clone()).expect("bucket")
                        };
                        let t = Instant::now();
                        black_box(hook.run(bucket).wait().expect("hook"));
                        t.elapsed()
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
        runs.into_iter()
            .map(|mut h| (h.times.split_off(warmup), h.timed_ops, h.buckets))
            .collect::<Vec<_>>()
    })
    .expect("ranks");
    let ranks: Vec<Vec<_>> = out.into_iter().map(|r| r.expect("rank")).collect();
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

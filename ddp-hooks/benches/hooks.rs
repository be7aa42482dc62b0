//! Hook and accumulation benchmarks on thread ranks, priced at several link speeds.
//!
//! `hooks` suite: per hook, on 4 x Linear(1024, 1024) (the hook called directly on one
//! 16.8 MB bucket), ResNet-50, BERT-base and GPT-2 small (through the reducer with default
//! buckets, synthetic gradients; `--quick`: 4 x Linear only): the hook time per step (from
//! the first bucket's launch to the last bucket's result, on 2 ranks with one CPU thread
//! each; median over the steps of the slowest rank), the bytes each rank sends, the
//! compression ratio, and the step time at 1, 10 and 100 Gbit/s. Link time is
//! **accounted**, not slept: step time = measured hook time + the ring cost of every
//! recorded collective (no overlap with compute assumed).
//!
//! Two alternations per preset (`measure::measure_alternating`: step `i` of every hook
//! before step `i + 1` of any, on the same ranks, each hook with its own reducer and
//! memories), so that the machine's bandwidth drifts (up to 1.7x within seconds on a
//! shared machine) touch the hooks of one alternation alike: the all-reduce and the
//! 16-bit hooks, and PowerSGD at r = 1, 2, 4. The 16-bit rows give `/ AR`: the median
//! over the steps of their time over the all-reduce's in the same step (the goal of
//! issue 16 is at most 1.5).
//!
//! Bounds, for PowerSGD (7 passes over the gradient memory, the fused algorithm's
//! traffic) and the all-reduce and 16-bit hooks (2 passes: each rank reads and writes 4
//! bytes per element in the fused reduction), `measure::bound_passes`:
//! - `bound` (JSON `bound_ratio`): the median over the steps of the step's hook time over
//!   its passes at each rank's share of the shared read bandwidth measured in the same
//!   step round: at the start of every round the ranks meet at a barrier and each sums
//!   its own 64 MiB at once, and the share is those bytes over the slowest rank's time
//!   (`measure/mod.rs`). It is the bound each rank can reach while the others stream too;
//! - `bound 1t` (`bound_ratio_1t`): the median hook time over the same traffic at the
//!   one-thread read bandwidth measured once at the start, as if each rank had the memory
//!   system alone (two ranks at once get only 1.3-1.45x one thread's bandwidth on a
//!   2-core machine, so this one reads up to that much higher).
//!
//! The header gives both references: `read bandwidth: 1 thread X GB/s, 2 threads Y GB/s
//! total (Z GB/s per rank)`, the 2-thread one the median over the preset's rounds (JSON
//! per row: `read_gbps_1t`, and `share_gbps`, the median per-rank share of the row's
//! rounds).
//!
//! `ws/LLC` (JSON `working_set_bytes`, `llc_bytes`, `null` where unknown): the bytes one
//! step streams on all ranks together for the largest bucket (PowerSGD: its gradient and
//! its error memory, 2 x 2 x 16.8 MB for the direct 4 x Linear bucket; the all-reduce and
//! 16-bit hooks: the gradient, `measure::working_set_bytes`) over the last-level cache
//! (Linux: the largest level-3 cache of cpu 0); `*` where it is at most 2: part of the
//! working set stays cached, and the DRAM bounds do not hold.
//!
//! After each preset's rows, a check row (JSON `{"bench":"ddp-hooks/hooks-check",...}`):
//! PowerSGD's time must not decrease with r beyond noise, `r1/r2 <= 1.1` and
//! `r2/r4 <= 1.1`, each the median over the alternated steps of the two ranks' times in
//! the same step; it prints `ok` or `NOT monotonic` (a report, not a failure: benchmarks
//! are not timed tests).
//!
//! `accum` suite: k = 4 micro-steps of 4 x Linear(1024, 1024) with a real forward and
//! backward pass (batch 32, `gemm`), synchronising only the last micro-step (`accumulate`)
//! against synchronising every one, at 1 and 10 Gbit/s (accounted as above).
//!
//! `batch` suite (run only when named): the per-layer PowerSGD hook with and without
//! `batch_tensors_with_same_shape`, and with it on buckets laid out by shape
//! (`ReducerConfig::layout = BucketLayout::ByShape`: no stacking copies), on one preset (`--preset NAME`, default `bert-base`),
//! r = 1, 2, 4, on 2 ranks of one CPU thread each, for each SIMD instruction set of this
//! CPU (`--isa avx2` or `--isa avx512` for one, also for the `hooks` suite, where it caps
//! the thread backend's 16-bit loops too: `LOWRANK_CPU_CAPABILITY`; `--no-bias` drops the preset's 1-D
//! parameters), the three settings alternated step by step
//! so that load drifts touch both alike; the hook time per step (median, slowest rank),
//! its ratio to the memory bound at the one-thread read bandwidth (as `bound 1t` of the
//! `hooks` suite), and the time of the first compressed step (which allocates the hook's
//! memories).
//!
//! Arguments: `hooks`, `accum` (default both) or `batch`, `--quick`, `--json`, `--steps N`
//! (steps per hook in the `hooks` suite; the median is reported).

#[path = "measure/mod.rs"]
mod measure;
#[path = "models/mod.rs"]
mod models;

use accum::{Accumulator, GradSync};
use collectives::link::{Charge, Link, Linked};
use collectives::{run_local, ProcessGroup};
use ddp_hooks::{BucketLayout, CommHook, HookSpec, PowerSgdConfig, Reducer, ReducerConfig};
use lowrank::{CpuBackend, Isa};
use measure::{median, read_bandwidth, synthetic, BOUND_PASSES, LATENCY, RANKS};
use std::sync::Arc;
use std::time::{Duration, Instant};

struct Args {
    quick: bool,
    json: bool,
    hooks: bool,
    accum: bool,
    batch: bool,
    preset: String,
    isa: Option<String>,
    no_bias: bool,
    /// `--steps N`: steps per hook in the `hooks` suite (default 7, 3 with `--quick`; 15 for
    /// every hook on the directly called 4 x Linear bucket).
    steps: Option<usize>,
}

/// The settings the `batch` suite compares: batching off, on, and on with the buckets
/// laid out by shape ([`BucketLayout::ByShape`], so that no batch is stacked by copy).
const BATCH_SETTINGS: [(bool, BucketLayout); 3] = [
    (false, BucketLayout::Launch),
    (true, BucketLayout::Launch),
    (true, BucketLayout::ByShape),
];

/// Hook times per step of PowerSGD (`cfg`, under each of [`BATCH_SETTINGS`]) on `shapes`
/// through the reducer, on [`RANKS`] ranks with the kernels of `isa`: for each setting,
/// the slowest rank's time of each step, the [`measure::POWERSGD_WARMUP`] steps first
/// (the last of them is the first compressed step, which allocates the hook's
/// memories). All settings run on every rank, alternately, each on its own reducer.
fn batch_runs(
    shapes: &[Vec<usize>],
    grads: &[Vec<Vec<f32>>],
    cfg: &PowerSgdConfig,
    isa: Isa,
    steps: usize,
) -> Vec<Vec<Duration>> {
    let warmup = measure::POWERSGD_WARMUP;
    let out = run_local(RANKS, |g| {
        let rank = g.rank();
        let be = Arc::new(
            CpuBackend::new()
                .with_threads(1)
                .expect("threads")
                .with_isa(isa)
                .expect("isa"),
        );
        // One group for all: each step of one hook finishes before the next's starts,
        // so every rank issues the same collectives in the same order.
        let group: Arc<dyn ProcessGroup> = Arc::new(g);
        let mut reducers: Vec<_> = BATCH_SETTINGS
            .into_iter()
            .map(|(batch, layout)| {
                let group = group.clone();
                let cfg = PowerSgdConfig {
                    batch_tensors_with_same_shape: Some(batch),
                    ..cfg.clone()
                };
                let hook = HookSpec::PowerSgd(cfg)
                    .build(be.clone(), group)
                    .expect("hook");
                let config = ReducerConfig {
                    layout,
                    ..ReducerConfig::default()
                };
                Reducer::new(be.clone(), shapes, hook, config).expect("reducer")
            })
            .collect();
        let mut times = vec![Vec::new(); reducers.len()];
        for _ in 0..warmup + steps {
            for (which, reducer) in reducers.iter_mut().enumerate() {
                for (p, grad) in grads[rank].iter().enumerate() {
                    reducer.grad_mut(p).expect("grad").copy_from_slice(grad);
                }
                let t = Instant::now();
                for p in (0..shapes.len()).rev() {
                    reducer.mark_ready(p).expect("ready");
                }
                reducer.finish().expect("finish");
                times[which].push(t.elapsed());
            }
        }
        times
    })
    .expect("ranks");
    let ranks: Vec<_> = out.into_iter().map(|r| r.expect("rank")).collect();
    (0..BATCH_SETTINGS.len())
        .map(|which| {
            (0..warmup + steps)
                .map(|i| ranks.iter().map(|r| r[which][i]).max().unwrap_or_default())
                .collect()
        })
        .collect()
}

fn batch_suite(a: &Args) {
    let Some((model, shapes, _)) = models::presets().into_iter().find(|p| p.0 == a.preset) else {
        eprintln!("unknown preset `{}`", a.preset);
        std::process::exit(2);
    };
    let isas: Vec<Isa> = Isa::supported()
        .into_iter()
        .filter(|i| *i != Isa::Portable)
        .filter(|i| a.isa.as_deref().is_none_or(|want| want == i.name()))
        .collect();
    let mut shapes = shapes();
    if a.no_bias {
        // Without the 1-D parameters, same-shape matrices lie one after another in the
        // buckets (as a bias-free transformer's projections): batches are mostly in
        // place, so this shows what batching itself does, without the stacking copies.
        shapes.retain(|s| s.len() > 1);
    }
    let model = if a.no_bias {
        format!("{model} without 1-D parameters")
    } else {
        model.to_string()
    };
    let grad_bytes = 4 * models::params(&shapes);
    let grads = measure::synthetic_ranks(&shapes);
    let bw = read_bandwidth();
    let steps = if a.quick { 3 } else { 7 };
    if !a.json {
        println!(
            "{model}: PowerSGD, batch_tensors_with_same_shape off, on, and on with buckets laid out by shape; {RANKS} ranks x 1 thread; read bandwidth {:.1} GB/s",
            bw / 1e9
        );
        println!(
            "{:<8} {:>4} {:>13} {:>11} {:>12} {:>7} {:>7} {:>9} {:>8} {:>9} {:>8} {:>7} {:>7} {:>6}",
            "isa",
            "rank",
            "unbatched ms",
            "batched ms",
            "by-shape ms",
            "on/off",
            "bs/off",
            "bound off",
            "bound on",
            "bound bs",
            "1st off",
            "1st on",
            "1st bs",
            "load"
        );
    }
    for isa in isas {
        for r in [1, 2, 4] {
            let cfg = PowerSgdConfig {
                matrix_approximation_rank: r,
                start_powersgd_iter: 2,
                ..PowerSgdConfig::default()
            };
            let runs = batch_runs(&shapes, &grads, &cfg, isa, steps);
            let first = measure::POWERSGD_WARMUP - 1;
            let ms = |d: Duration| d.as_secs_f64() * 1e3;
            let firsts: Vec<f64> = runs.iter().map(|t| ms(t[first])).collect();
            let [off, on, bs]: [f64; 3] =
                std::array::from_fn(|k| ms(median(runs[k][first + 1..].to_vec())));
            let bound = |ms: f64| ms / (BOUND_PASSES * grad_bytes as f64 / bw * 1e3);
            let load = std::fs::read_to_string("/proc/loadavg")
                .ok()
                .and_then(|l| l.split_whitespace().next().map(str::to_owned))
                .unwrap_or_else(|| "?".into());
            if a.json {
                println!(
                    "{{\"bench\":\"ddp-hooks/batch\",\"model\":\"{model}\",\"isa\":\"{}\",\"rank\":{r},\"ranks\":{RANKS},\"unbatched_ms\":{off:.3},\"batched_ms\":{on:.3},\"by_shape_ms\":{bs:.3},\"bound_ratio_unbatched\":{:.3},\"bound_ratio_batched\":{:.3},\"bound_ratio_by_shape\":{:.3},\"first_step_ms_unbatched\":{:.3},\"first_step_ms_batched\":{:.3},\"first_step_ms_by_shape\":{:.3},\"load\":{load}}}",
                    isa.name(),
                    bound(off),
                    bound(on),
                    bound(bs),
                    firsts[0],
                    firsts[1],
                    firsts[2]
                );
            } else {
                println!(
                    "{:<8} {:>4} {:>13.1} {:>11.1} {:>12.1} {:>6.3}x {:>6.3}x {:>8.2}x {:>7.2}x {:>8.2}x {:>8.0} {:>7.0} {:>7.0} {:>6}",
                    isa.name(),
                    r,
                    off,
                    on,
                    bs,
                    on / off,
                    bs / off,
                    bound(off),
                    bound(on),
                    bound(bs),
                    firsts[0],
                    firsts[1],
                    firsts[2],
                    load
                );
            }
        }
    }
}

/// The tolerance of the monotonicity check: PowerSGD at rank r may take at most this
/// factor of its time at the next rank (per-step medians), within the noise of a step.
const MONOTONIC_TOLERANCE: f64 = 1.1;

/// `ws/LLC` of a row: its working set over the last-level cache, two decimals, with `*`
/// where it is cache-resident ([`measure::cache_resident`]); `?` where the cache size is
/// unknown, empty where the hook has no working set modelled.
fn ws_cell(ws: Option<usize>, llc: Option<u64>) -> String {
    match (ws, llc) {
        (None, _) => String::new(),
        (Some(_), None) => "?".into(),
        (Some(ws), Some(llc)) => {
            let x = ws as f64 / llc as f64;
            let star = if measure::cache_resident(x) { "*" } else { "" };
            format!("{x:.2}{star}")
        }
    }
}

fn hooks_suite(a: &Args) {
    let bw = read_bandwidth();
    let llc = measure::llc_bytes();
    let steps = a.steps.unwrap_or(if a.quick { 3 } else { 7 });
    let mut models = models::presets();
    if a.quick {
        models.truncate(1);
    }
    let specs = [
        ("allreduce", "allreduce", 0),
        ("fp16", "fp16", 0),
        ("bf16", "bf16", 0),
        ("powersgd", "powersgd:rank=1,start_iter=2", 1),
        ("powersgd", "powersgd:rank=2,start_iter=2", 2),
        ("powersgd", "powersgd:rank=4,start_iter=2", 4),
    ];
    let at_rank = |r: usize| {
        specs
            .iter()
            .position(|s| s.0 == "powersgd" && s.2 == r)
            .expect("the suite has PowerSGD at ranks 1, 2 and 4")
    };
    if !a.json {
        println!(
            "link latency {LATENCY:?}; link time accounted; {} kernels; last-level cache {}",
            measure::backend().isa().name(),
            llc.map_or("unknown".into(), |b| format!(
                "{:.1} MiB",
                b as f64 / f64::from(1 << 20)
            ))
        );
        println!(
            "bound: median over the steps of hook time / (passes x gradient bytes at each rank's share of the {RANKS}-thread read bandwidth of the\n       same step round: all ranks read {} MiB each at once, share = bytes / slowest rank's time); passes: 7 PowerSGD, 2 allreduce and fp16/bf16;\nbound 1t: median hook time / the same traffic at the 1-thread read bandwidth (each rank alone on the memory system);\nws/LLC: bytes one step streams, all ranks (PowerSGD: {RANKS} x (largest bucket + its error memory); allreduce, fp16/bf16: {RANKS} x largest\n       bucket) / last-level cache; * = at most 2: partly or wholly cache-resident, so the DRAM bounds do not hold;\n/ AR: median over the steps of time / allreduce's in the same step; check: PowerSGD's r1/r2 and r2/r4 (medians of per-step ratios)\n       must be <= {MONOTONIC_TOLERANCE} (time non-decreasing in r); all-reduce and 16-bit hooks alternate step by step, PowerSGD r = 1, 2, 4 too",
            measure::SHARED_READ_BYTES >> 20
        );
    }
    for (model, shapes, direct) in models {
        let shapes = shapes();
        let grad_bytes = 4 * models::params(&shapes);
        let grads = measure::synthetic_ranks(&shapes);
        let parsed: Vec<HookSpec> = specs
            .iter()
            .map(|(_, spec, _)| spec.parse().expect("spec"))
            .collect();
        // The all-reduce and the 16-bit hooks alternate step by step (their ratio is a
        // goal, and load drifts between separate runs moved it by up to 1.9x), and so do
        // the PowerSGD ranks: measured one by one, a bandwidth drift between their runs
        // put r = 1, 2, 4 in random order. Two alternations, not one: six reducers of
        // GPT-2 small at once would hold twice the memory.
        let stateless = specs.iter().take_while(|s| s.2 == 0).count();
        // The directly called 4 x Linear bucket takes milliseconds a step, and single
        // slow steps move a median of 7: 15 steps there unless `--steps` says.
        let alt_steps = a
            .steps
            .unwrap_or(if direct { steps.max(15) } else { steps });
        let mut measured =
            measure::measure_alternating(&shapes, &grads, &parsed[..stateless], direct, alt_steps);
        measured.extend(measure::measure_alternating(
            &shapes,
            &grads,
            &parsed[stateless..],
            direct,
            alt_steps,
        ));
        // The rounds of both alternations, for the header's figure.
        let shares: Vec<f64> = measured[0]
            .share_bw
            .iter()
            .chain(&measured[stateless].share_bw)
            .copied()
            .collect();
        let rounds = shares.len();
        let share = measure::median_f64(shares);
        if !a.json {
            println!(
                "read bandwidth: 1 thread {:.1} GB/s, {RANKS} threads {:.1} GB/s total ({:.1} GB/s per rank; {model}: median of {rounds} step rounds)",
                bw / 1e9,
                RANKS as f64 * share / 1e9,
                share / 1e9
            );
            println!(
                "{:<13} {:<10} {:>4} {:>9} {:>12} {:>8} {:>11} {:>11} {:>11} {:>7} {:>8} {:>7} {:>7}",
                "model",
                "hook",
                "rank",
                "hook ms",
                "bytes/rank",
                "ratio",
                "1G step ms",
                "10G step ms",
                "100G ms",
                "bound",
                "bound 1t",
                "ws/LLC",
                "/ AR"
            );
        }
        for (((hook, _, r), spec), m) in specs.iter().zip(&parsed).zip(&measured) {
            let sent = m.bytes_sent();
            let ratio = grad_bytes as f64 / sent.max(1) as f64;
            let hook_ms = m.median().as_secs_f64() * 1e3;
            let at = |gbit: f64| hook_ms + m.link_time(gbit).as_secs_f64() * 1e3;
            let passes = measure::bound_passes(spec);
            let bound = passes.map(|p| m.bound_ratio(p, grad_bytes));
            let bound_1t = passes.map(|p| m.bound_ratio_1t(p, grad_bytes, bw));
            let ws = measure::working_set_bytes(spec, m.largest_bucket_bytes(&shapes));
            // Step by step against the all-reduce it alternated with.
            let vs = (*r == 0 && *hook != "allreduce").then(|| m.ratio_to(&measured[0]));
            if a.json {
                println!(
                    "{{\"bench\":\"ddp-hooks/hooks\",\"hook\":\"{hook}\",\"model\":\"{model}\",\"rank\":{r},\"ranks\":{RANKS},\"hook_ms\":{hook_ms:.3},\"bytes_sent\":{sent},\"compression_ratio\":{ratio:.2},\"step_ms_1gbit\":{:.3},\"step_ms_10gbit\":{:.3},\"step_ms_100gbit\":{:.3},\"link\":\"accounted\",\"read_gbps_1t\":{:.3},\"share_gbps\":{:.3},\"llc_bytes\":{}{}{}{}{}}}",
                    at(1.0),
                    at(10.0),
                    at(100.0),
                    bw / 1e9,
                    m.share_bandwidth() / 1e9,
                    llc.map_or("null".into(), |b| b.to_string()),
                    bound.map(|b| format!(",\"bound_ratio\":{b:.3}")).unwrap_or_default(),
                    bound_1t
                        .map(|b| format!(",\"bound_ratio_1t\":{b:.3}"))
                        .unwrap_or_default(),
                    ws.map(|w| format!(",\"working_set_bytes\":{w}"))
                        .unwrap_or_default(),
                    vs.map(|v| format!(",\"vs_allreduce\":{v:.3}")).unwrap_or_default()
                );
            } else {
                println!(
                    "{:<13} {:<10} {:>4} {:>9.2} {:>12} {:>7.1}x {:>11.1} {:>11.1} {:>11.2} {:>7} {:>8} {:>7} {:>7}",
                    model,
                    hook,
                    if *r > 0 { r.to_string() } else { "-".into() },
                    hook_ms,
                    sent,
                    ratio,
                    at(1.0),
                    at(10.0),
                    at(100.0),
                    bound.map(|b| format!("{b:.2}x")).unwrap_or_default(),
                    bound_1t.map(|b| format!("{b:.2}x")).unwrap_or_default(),
                    ws_cell(ws, llc),
                    vs.map(|v| format!("{v:.2}x")).unwrap_or_default()
                );
            }
        }
        // PowerSGD's time must not fall as r grows (more work per matrix at every r):
        // per-step ratios of the alternated steps, which a drift moves alike.
        let (m1, m2, m4) = (
            &measured[at_rank(1)],
            &measured[at_rank(2)],
            &measured[at_rank(4)],
        );
        let (r12, r24) = (m1.ratio_to(m2), m2.ratio_to(m4));
        let monotonic = r12 <= MONOTONIC_TOLERANCE && r24 <= MONOTONIC_TOLERANCE;
        if a.json {
            println!(
                "{{\"bench\":\"ddp-hooks/hooks-check\",\"model\":\"{model}\",\"r1_over_r2\":{r12:.3},\"r2_over_r4\":{r24:.3},\"tolerance\":{MONOTONIC_TOLERANCE},\"monotonic\":{monotonic}}}"
            );
        } else {
            println!(
                "check {model}: r1/r2 {r12:.2}x, r2/r4 {r24:.2}x: {}",
                if monotonic { "ok" } else { "NOT monotonic" }
            );
        }
    }
}

/// One micro-step's forward and backward pass of 4 x Linear(1024, 1024) on a batch of
/// 32, writing each weight's gradient into the reducer (biases: column sums).
fn forward_backward<
    R: std::ops::DerefMut<Target = Reducer<CpuBackend, Box<dyn CommHook<CpuBackend>>>>,
>(
    model: &mut R,
    weights: &[Vec<f32>],
    x0: &[f32],
) {
    let (b, d) = (32usize, 1024usize);
    let mm = |m: usize,
              n: usize,
              k: usize,
              dst: &mut [f32],
              a: &[f32],
              a_t: bool,
              w: &[f32],
              w_t: bool,
              acc: bool| {
        // dst (m x n, row-major) (+)= op(a) (m x k) * op(w) (k x n).
        let (a_cs, a_rs) = if a_t {
            (m as isize, 1)
        } else {
            (1, k as isize)
        };
        let (w_cs, w_rs) = if w_t {
            (k as isize, 1)
        } else {
            (1, n as isize)
        };
        // SAFETY: every operand covers the extents its strides describe; dst does not
        // alias the inputs.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                dst.as_mut_ptr(),
                1,
                n as isize,
                acc,
                a.as_ptr(),
                a_cs,
                a_rs,
                w.as_ptr(),
                w_cs,
                w_rs,
                if acc { 1.0 } else { 0.0 },
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::None,
            )
        }
    };
    let mut acts = vec![x0.to_vec()];
    for w in weights {
        let mut y = vec![0.0f32; b * d];
        mm(
            b,
            d,
            d,
            &mut y,
            acts.last().expect("input"),
            false,
            w,
            true,
            false,
        );
        acts.push(y);
    }
    let mut delta = acts.last().expect("output").clone();
    for l in (0..weights.len()).rev() {
        {
            let gw = model.grad_mut(2 * l).expect("grad");
            mm(d, d, b, gw, &delta, true, &acts[l], false, true);
        }
        {
            let gb = model.grad_mut(2 * l + 1).expect("grad");
            for row in delta.chunks(d) {
                gb.iter_mut().zip(row).for_each(|(g, x)| *g += x);
            }
        }
        model.mark_ready(2 * l + 1).expect("ready");
        model.mark_ready(2 * l).expect("ready");
        let mut prev = vec![0.0f32; b * d];
        mm(b, d, d, &mut prev, &delta, false, &weights[l], false, false);
        delta = prev;
    }
}

fn accum_suite(a: &Args) {
    let k = 4;
    let groups = if a.quick { 2 } else { 4 };
    let shapes = models::linear4();
    if !a.json {
        println!("k = {k} micro-steps of 4 x Linear(1024, 1024), batch 32, {RANKS} ranks; link time accounted");
        println!(
            "{:>10} {:>15} {:>20} {:>8}",
            "link", "accumulate ms", "sync every step ms", "speedup"
        );
    }
    for gbit in [1.0, 10.0] {
        let mut result = Vec::new();
        for sync_every in [false, true] {
            let out = run_local(RANKS, |g| {
                let linked = Linked::new(g, Link::gbit(gbit, LATENCY).unwrap(), Charge::Account);
                let log = linked.log_handle();
                let be = Arc::new(CpuBackend::new().with_threads(1).expect("threads"));
                let hook = HookSpec::AllReduce
                    .build(be.clone(), Arc::new(linked) as Arc<dyn ProcessGroup>)
                    .expect("hook");
                let mut reducer =
                    Reducer::new(be, &shapes, hook, ReducerConfig::default()).expect("reducer");
                let weights: Vec<Vec<f32>> = synthetic(&shapes, 7)
                    .into_iter()
                    .step_by(2)
                    .map(|w| w.iter().map(|x| x * 0.03).collect())
                    .collect();
                let x0 = synthetic(&[vec![32, 1024]], 9).remove(0);
                let mut acc = Accumulator::new(k).expect("k");
                let mut times = Vec::new();
                for _ in 0..groups {
                    log.lock().expect("log").clear();
                    let t = Instant::now();
                    for (step, _) in acc.epoch(0..k) {
                        let mut model = step.apply(&mut reducer);
                        if sync_every {
                            model.set_sync(true);
                        }
                        forward_backward(&mut model, &weights, &x0);
                        model.finish().expect("finish");
                        drop(model);
                        step.zero_grad(|| reducer.zero_grad().expect("zero"));
                    }
                    let link = Link::gbit(gbit, LATENCY).unwrap();
                    let comm: Duration = log
                        .lock()
                        .expect("log")
                        .iter()
                        .map(|&op| link.cost(RANKS, op))
                        .sum();
                    times.push(t.elapsed() + comm);
                }
                median(times[1..].to_vec())
            })
            .expect("ranks");
            result.push(
                out.into_iter()
                    .map(|r| r.expect("rank"))
                    .max()
                    .unwrap_or_default()
                    .as_secs_f64()
                    * 1e3,
            );
        }
        let (acc_ms, every_ms) = (result[0], result[1]);
        if a.json {
            println!(
                "{{\"bench\":\"ddp-hooks/accum\",\"link_gbit\":{gbit},\"k\":{k},\"ranks\":{RANKS},\"accumulate_ms\":{acc_ms:.3},\"sync_every_step_ms\":{every_ms:.3},\"speedup\":{:.3},\"link\":\"accounted\"}}",
                every_ms / acc_ms
            );
        } else {
            println!(
                "{:>8}G {:>15.1} {:>20.1} {:>7.2}x",
                gbit,
                acc_ms,
                every_ms,
                every_ms / acc_ms
            );
        }
    }
}

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    let has = |s: &str| argv.iter().any(|a| a == s);
    let value = |s: &str| {
        argv.iter()
            .position(|a| a == s)
            .and_then(|i| argv.get(i + 1))
            .cloned()
    };
    let batch = has("batch");
    let (hooks, accum) = match (has("hooks"), has("accum")) {
        (false, false) => (!batch, !batch),
        other => other,
    };
    let a = Args {
        quick: has("--quick"),
        json: has("--json"),
        hooks,
        accum,
        batch,
        preset: value("--preset").unwrap_or_else(|| "bert-base".into()),
        isa: value("--isa"),
        no_bias: has("--no-bias"),
        steps: value("--steps").map(|v| match v.parse() {
            Ok(n) if n >= 3 => n,
            _ => {
                eprintln!("--steps takes an integer of at least 3, got {v:?}");
                std::process::exit(2)
            }
        }),
    };
    if a.hooks {
        if let Some(name) = &a.isa {
            if let Err(e) = measure::select_isa(name) {
                eprintln!("{e}");
                std::process::exit(2);
            }
        }
        hooks_suite(&a);
    }
    if a.accum {
        accum_suite(&a);
    }
    if a.batch {
        batch_suite(&a);
    }
}

//! Hook and accumulation benchmarks on thread ranks, priced at several link speeds.
//!
//! `hooks` suite: per hook, on 4 x Linear(1024, 1024) (the hook called directly on one
//! 16.8 MB bucket), ResNet-50, BERT-base and GPT-2 small (through the reducer with default
//! buckets, synthetic gradients; `--quick`: 4 x Linear only): the hook time per step (from the first bucket's launch to the
//! last bucket's result, on 2 ranks with one CPU thread each), the bytes each rank sends,
//! the compression ratio, and the step time at 1, 10 and 100 Gbit/s. Link time is
//! **accounted**, not slept: step time = measured hook time + the ring cost of every
//! recorded collective (no overlap with compute assumed). The all-reduce and the 16-bit
//! hooks run alternated step by step on the same ranks, and the 16-bit rows give `/ AR`:
//! the median over the steps of their time over the all-reduce's in the same step (the
//! goal of issue 16 is at most 1.5), which load drifts between runs do not move. PowerSGD rows also give
//! `bound_ratio`: hook time over 7 passes of the gradient memory at the read bandwidth
//! measured in the same run (the fused algorithm's memory traffic); the all-reduce and
//! 16-bit rows over 2 passes (each rank reads and writes 4 bytes per element in the
//! fused reduction, `measure::bound_passes`).
//!
//! `accum` suite: k = 4 micro-steps of 4 x Linear(1024, 1024) with a real forward and
//! backward pass (batch 32, `gemm`), synchronising only the last micro-step (`accumulate`)
//! against synchronising every one, at 1 and 10 Gbit/s (accounted as above).
//!
//! `batch` suite (run only when named): the per-layer PowerSGD hook with and without
//! `batch_tensors_with_same_shape` on one preset (`--preset NAME`, default `bert-base`),
//! r = 1, 2, 4, on 2 ranks of one CPU thread each, for each SIMD instruction set of this
//! CPU (`--isa avx2` or `--isa avx512` for one, also for the `hooks` suite, where it caps
//! the thread backend's 16-bit loops too: `LOWRANK_CPU_CAPABILITY`; `--no-bias` drops the preset's 1-D
//! parameters), the two settings alternated step by step
//! so that load drifts touch both alike; the hook time per step (median, slowest rank),
//! its ratio to the memory bound as in the `hooks` suite, and the time of the first
//! compressed step (which allocates the hook's memories).
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
use ddp_hooks::{CommHook, HookSpec, PowerSgdConfig, Reducer, ReducerConfig};
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
    /// the alternated all-reduce and 16-bit hooks on the directly called 4 x Linear bucket).
    steps: Option<usize>,
}

/// Hook times per step of PowerSGD (`cfg`, batching off then on) on `shapes` through
/// the reducer, on [`RANKS`] ranks with the kernels of `isa`: for each setting, the
/// slowest rank's time of each step, the [`measure::POWERSGD_WARMUP`] steps first (the
/// last of them is the first compressed step, which allocates the hook's memories). Both hooks run on every rank, alternately,
/// each on its own reducer.
fn batch_pair(
    shapes: &[Vec<usize>],
    grads: &[Vec<Vec<f32>>],
    cfg: &PowerSgdConfig,
    isa: Isa,
    steps: usize,
) -> [Vec<Duration>; 2] {
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
        // One group for both: each step of one hook finishes before the other's starts,
        // so every rank issues the same collectives in the same order.
        let group: Arc<dyn ProcessGroup> = Arc::new(g);
        let mut reducers: Vec<_> = [false, true]
            .into_iter()
            .map(|batch| {
                let group = group.clone();
                let cfg = PowerSgdConfig {
                    batch_tensors_with_same_shape: Some(batch),
                    ..cfg.clone()
                };
                let hook = HookSpec::PowerSgd(cfg)
                    .build(be.clone(), group)
                    .expect("hook");
                Reducer::new(be.clone(), shapes, hook, ReducerConfig::default()).expect("reducer")
            })
            .collect();
        let mut times = [Vec::new(), Vec::new()];
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
    [0, 1].map(|which| {
        (0..warmup + steps)
            .map(|i| ranks.iter().map(|r| r[which][i]).max().unwrap_or_default())
            .collect()
    })
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
            "{model}: PowerSGD, batch_tensors_with_same_shape off vs on, {RANKS} ranks x 1 thread; read bandwidth {:.1} GB/s",
            bw / 1e9
        );
        println!(
            "{:<8} {:>4} {:>14} {:>12} {:>8} {:>10} {:>10} {:>9} {:>9} {:>6}",
            "isa",
            "rank",
            "unbatched ms",
            "batched ms",
            "ratio",
            "bound off",
            "bound on",
            "1st off",
            "1st on",
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
            let [off, on] = batch_pair(&shapes, &grads, &cfg, isa, steps);
            let first = measure::POWERSGD_WARMUP - 1;
            let ms = |d: Duration| d.as_secs_f64() * 1e3;
            let (first_off, first_on) = (ms(off[first]), ms(on[first]));
            let (off, on) = (
                ms(median(off[first + 1..].to_vec())),
                ms(median(on[first + 1..].to_vec())),
            );
            let bound = |ms: f64| ms / (BOUND_PASSES * grad_bytes as f64 / bw * 1e3);
            let load = std::fs::read_to_string("/proc/loadavg")
                .ok()
                .and_then(|l| l.split_whitespace().next().map(str::to_owned))
                .unwrap_or_else(|| "?".into());
            if a.json {
                println!(
                    "{{\"bench\":\"ddp-hooks/batch\",\"model\":\"{model}\",\"isa\":\"{}\",\"rank\":{r},\"ranks\":{RANKS},\"unbatched_ms\":{off:.3},\"batched_ms\":{on:.3},\"bound_ratio_unbatched\":{:.3},\"bound_ratio_batched\":{:.3},\"first_step_ms_unbatched\":{first_off:.3},\"first_step_ms_batched\":{first_on:.3},\"load\":{load}}}",
                    isa.name(),
                    bound(off),
                    bound(on)
                );
            } else {
                println!(
                    "{:<8} {:>4} {:>14.1} {:>12.1} {:>7.3}x {:>9.2}x {:>9.2}x {:>9.0} {:>9.0} {:>6}",
                    isa.name(),
                    r,
                    off,
                    on,
                    on / off,
                    bound(off),
                    bound(on),
                    first_off,
                    first_on,
                    load
                );
            }
        }
    }
}

fn hooks_suite(a: &Args) {
    let bw = read_bandwidth();
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
    if !a.json {
        println!(
            "read bandwidth (1 thread): {:.1} GB/s; link latency {LATENCY:?}; link time accounted; {} kernels",
            bw / 1e9,
            measure::backend().isa().name()
        );
        println!(
            "{:<13} {:<10} {:>4} {:>9} {:>12} {:>8} {:>11} {:>11} {:>11} {:>7} {:>7}",
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
            "/ AR"
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
        // goal, and load drifts between separate runs moved it by up to 1.9x); each
        // PowerSGD rank runs on its own (its goal is `bound`).
        let stateless = specs.iter().take_while(|s| s.2 == 0).count();
        // The directly called 4 x Linear bucket takes about a millisecond a step, and
        // single slow steps move a median of 7: 15 steps there unless `--steps` says.
        let alt_steps = a
            .steps
            .unwrap_or(if direct { steps.max(15) } else { steps });
        let mut measured =
            measure::measure_alternating(&shapes, &grads, &parsed[..stateless], direct, alt_steps);
        for spec in &parsed[stateless..] {
            measured.push(measure::measure(&shapes, &grads, spec, direct, steps));
        }
        for (((hook, _, r), spec), m) in specs.iter().zip(&parsed).zip(&measured) {
            let sent = m.bytes_sent();
            let ratio = grad_bytes as f64 / sent.max(1) as f64;
            let hook_ms = m.median().as_secs_f64() * 1e3;
            let at = |gbit: f64| hook_ms + m.link_time(gbit).as_secs_f64() * 1e3;
            let bound = measure::bound_passes(spec)
                .map(|passes| hook_ms / (passes * grad_bytes as f64 / bw * 1e3));
            // Step by step against the all-reduce it alternated with.
            let vs = (*r == 0 && *hook != "allreduce").then(|| m.ratio_to(&measured[0]));
            if a.json {
                println!(
                    "{{\"bench\":\"ddp-hooks/hooks\",\"hook\":\"{hook}\",\"model\":\"{model}\",\"rank\":{r},\"ranks\":{RANKS},\"hook_ms\":{hook_ms:.3},\"bytes_sent\":{sent},\"compression_ratio\":{ratio:.2},\"step_ms_1gbit\":{:.3},\"step_ms_10gbit\":{:.3},\"step_ms_100gbit\":{:.3},\"link\":\"accounted\"{}{}}}",
                    at(1.0),
                    at(10.0),
                    at(100.0),
                    bound.map(|b| format!(",\"bound_ratio\":{b:.3}")).unwrap_or_default(),
                    vs.map(|v| format!(",\"vs_allreduce\":{v:.3}")).unwrap_or_default()
                );
            } else {
                println!(
                    "{:<13} {:<10} {:>4} {:>9.2} {:>12} {:>7.1}x {:>11.1} {:>11.1} {:>11.2} {:>7} {:>7}",
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
                    vs.map(|v| format!("{v:.2}x")).unwrap_or_default()
                );
            }
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

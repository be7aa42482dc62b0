//! The compression-throughput report: what each hook buys on this machine, at a given
//! network speed. Driven by `cargo xtask bench` (no suite), which draws the progress
//! bar, the table and the chart from the JSON lines this prints.
//!
//! Per model preset (4 x Linear(1024, 1024), ResNet-50, BERT-base, GPT-2 small) and per
//! hook, on 2 thread ranks with one CPU thread each and synthetic gradients (measured as
//! the `hooks` suite measures, `measure/mod.rs`):
//! - the hook time: median over the timed steps of the slowest rank, with the fastest
//!   and slowest step. The all-reduce and the 16-bit hooks run alternated step by step
//!   on the same ranks (`measure::measure_alternating`), and each 16-bit row gives
//!   `vs_allreduce`: the median over the steps of its time over the all-reduce's in the
//!   same step, a ratio that load drifts on a shared machine do not move;
//! - the gradient throughput (gradient bytes per rank over the hook time), the payload
//!   bytes each rank sends per step and the compression ratio (gradient bytes over them);
//! - the bounds, against the hook's memory traffic: 7 passes of the gradient memory for
//!   PowerSGD, 2 for the all-reduce and the 16-bit hooks (`measure::bound_passes`).
//!   `bound_ratio`: the median over the steps of the step's hook time over that traffic at
//!   each rank's share of the shared read bandwidth of the same step round (every round
//!   of `measure::measure_alternating` starts with all ranks reading 64 MiB each at once,
//!   after a barrier; the share is those bytes over the slowest rank's time), so each step
//!   is judged against the bandwidth the ranks got seconds from it, while reading
//!   together; `share_gbps`: the median of those shares. `bound_ratio_1t`: the median hook
//!   time over the same traffic at the one-thread read bandwidth measured at the start
//!   (`read_gbps` of the machine line), as if each rank had the memory system alone;
//! - `working_set_bytes`: what one step streams on all ranks for the largest bucket
//!   (PowerSGD: gradient and error memory; the all-reduce and 16-bit hooks: the gradient;
//!   `measure::working_set_bytes`), and `llc_bytes`, the last-level cache (`null` where
//!   unknown): where the working set is at most twice the cache, part of it stays cached
//!   and the DRAM bounds do not hold;
//! - per link speed (1, 10, 100 and 400 Gbit/s), from the step-time model of
//!   `measure/overlap.rs` on the link model of `collectives::link` (20 us per message,
//!   ring costs at `--ranks N` ranks, default 2): the **communication-only** time (hook
//!   time plus the link time of every collective of one step; no backward, no overlap)
//!   and, with `--backward-ms MS`, the **step** time: the buckets (in launch order, each
//!   with its collectives, attributed by one untimed step after the timed ones) become
//!   ready as a backward of MS ms produces the gradients, and one stream serialises
//!   their hook and link times; each with its speedup over allreduce;
//! - local SGD and DiLoCo rows (periods 4 and 16, H = 16 and 64): they all-reduce the
//!   model (or its pseudo-gradient) once a period, so their time, bytes and link cost are
//!   the all-reduce row's over the period (`amortised_over`);
//! - the break-even bandwidth of each (the speed at which a hook and allreduce take
//!   equally long, found on a log grid and refined by bisection); it is given where the
//!   hook wins below it and loses above it, `null` where one of them wins at every speed
//!   from 0.001 to 10^6 Gbit/s.
//!
//! Output, one JSON object per line: `{"kind":"machine",...}` (CPU, cores, instruction
//! set, one-thread read bandwidth, last-level cache), `{"kind":"plan","rows":N}`, then `{"kind":"start",...}`
//! before each measurement (one for the three alternated hooks) and `{"kind":"row",...}`
//! per row after.
//!
//! Arguments (anything else is an error): `--quick` (4 x Linear and BERT-base, fewer
//! steps), `--models a,b` (presets), `--shapes FILE` (the user's model, a JSON list of
//! parameter shapes, `models/shapes.rs`; alone unless `--models` adds presets),
//! `--ranks N` (the link model's world size, 2 to 2^20; the hooks still run on 2 thread
//! ranks), `--backward-ms MS` (the backward the buckets overlap with), `--steps N` (timed
//! steps of every model), `--isa avx512|avx2|portable` (the kernels and the thread
//! backend's 16-bit loops of that instruction set, as on a CPU that has no wider one).

#[path = "measure/mod.rs"]
mod measure;
#[path = "models/mod.rs"]
mod models;

use ddp_hooks::HookSpec;
use measure::overlap::{self, Profile};
use measure::{LATENCY, RANKS};
use serde_json::{json, Value};
use std::io::Write;

use overlap::SPEEDS;

/// The hooks of the report: (name in the report, spec, PowerSGD rank or 0). The first
/// ones with rank 0 run alternated step by step; the quantization hooks (PyTorch's
/// all-gather based ones, 8 bits an element) run one by one after PowerSGD.
const HOOKS: [(&str, &str, usize); 11] = [
    ("allreduce", "allreduce", 0),
    ("fp16", "fp16", 0),
    ("bf16", "bf16", 0),
    ("powersgd", "powersgd:rank=1,start_iter=2", 1),
    ("powersgd", "powersgd:rank=2,start_iter=2", 2),
    ("powersgd", "powersgd:rank=4,start_iter=2", 4),
    (
        "batched_powersgd",
        "batched_powersgd:rank=2,start_iter=2",
        2,
    ),
    ("fp16+powersgd", "fp16+powersgd:rank=2,start_iter=2", 2),
    ("quantize_per_tensor", "quantize_per_tensor", 0),
    ("quantize_per_channel", "quantize_per_channel", 0),
    ("quantize_per_channel+ef", "quantize_per_channel+ef", 0),
];

struct Args {
    quick: bool,
    models: Option<Vec<String>>,
    steps: Option<usize>,
    isa: Option<String>,
    /// `--shapes FILE`: the user's model.
    shapes: Option<models::shapes::UserModel>,
    /// `--ranks N`: the link model's world size.
    ranks: Option<usize>,
    /// `--backward-ms MS`: the backward pass the buckets overlap with.
    backward_ms: Option<f64>,
}

/// The most ranks `--ranks` takes.
const MAX_LINK_RANKS: usize = 1 << 20;

fn args() -> Result<Args, String> {
    let mut a = Args {
        quick: false,
        models: None,
        steps: None,
        isa: None,
        shapes: None,
        ranks: None,
        backward_ms: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--quick" => a.quick = true,
            "--models" => {
                let v = it.next().ok_or("--models needs a list")?;
                a.models = Some(v.split(',').map(str::to_string).collect());
            }
            "--shapes" => {
                let v = it.next().ok_or("--shapes needs a file")?;
                a.shapes = Some(models::shapes::read(std::path::Path::new(&v))?);
            }
            "--ranks" => {
                let v = it.next().ok_or("--ranks needs a number")?;
                a.ranks = Some(
                    v.parse()
                        .ok()
                        .filter(|n| (2..=MAX_LINK_RANKS).contains(n))
                        .ok_or(format!(
                            "--ranks {v}: expected an integer from 2 to {MAX_LINK_RANKS}"
                        ))?,
                );
            }
            "--backward-ms" => {
                let v = it.next().ok_or("--backward-ms needs milliseconds")?;
                a.backward_ms = Some(
                    v.parse::<f64>()
                        .ok()
                        .filter(|x| x.is_finite() && *x > 0.0 && *x <= 1e7)
                        .ok_or(format!(
                            "--backward-ms {v}: expected a positive number of milliseconds (at most 1e7)"
                        ))?,
                );
            }
            "--steps" => {
                let v = it.next().ok_or("--steps needs a number")?;
                a.steps = Some(
                    v.parse()
                        .ok()
                        .filter(|&n| n > 0)
                        .ok_or(format!("--steps {v}: expected a positive integer"))?,
                );
            }
            "--isa" => a.isa = Some(it.next().ok_or("--isa needs avx512, avx2 or portable")?),
            // `cargo bench` passes `--bench` to every benchmark.
            "--bench" => {}
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    Ok(a)
}

/// Timed steps per model: enough for a stable median, within the report's time budget.
fn steps_for(model: &str, quick: bool) -> usize {
    match (model, quick) {
        ("linear4x1024", false) => 15,
        ("linear4x1024", true) => 7,
        ("resnet50", false) => 9,
        (_, false) => 5,
        (_, true) => 3,
    }
}

/// `"model name"` of `/proc/cpuinfo`, where there is one.
fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

/// `row` with the fields of `more` added.
fn with(mut row: Value, more: serde_json::Map<String, Value>) -> Value {
    if let Value::Object(o) = &mut row {
        o.extend(more);
    }
    row
}

use overlap::round;

fn emit(v: Value) {
    let mut out = std::io::stdout().lock();
    // A closed pipe (the driver gone) ends the run.
    if writeln!(out, "{v}").and_then(|_| out.flush()).is_err() {
        std::process::exit(1);
    }
}

fn main() {
    let a = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("report: {e}");
            std::process::exit(2);
        }
    };
    if let Some(name) = &a.isa {
        if let Err(e) = measure::select_isa(name) {
            eprintln!("report: {e}");
            std::process::exit(2);
        }
    }
    let mut presets = models::presets();
    if let Some(wanted) = &a.models {
        if let Some(bad) = wanted
            .iter()
            .find(|w| !presets.iter().any(|(n, ..)| n == w))
        {
            let known: Vec<_> = presets.iter().map(|(n, ..)| *n).collect();
            eprintln!("report: unknown model `{bad}`; known: {}", known.join(", "));
            std::process::exit(2);
        }
        presets.retain(|(n, ..)| wanted.iter().any(|w| w == n));
    } else if a.shapes.is_some() {
        // The user's model alone, unless `--models` adds presets to compare with.
        presets.clear();
    } else if a.quick {
        presets.retain(|(n, ..)| matches!(*n, "linear4x1024" | "bert-base"));
    }
    for (name, shapes, _) in &presets {
        let published = models::PUBLISHED.iter().find(|(n, _)| n == name);
        let count = models::params(&shapes());
        if published.map(|&(_, c)| c) != Some(count) {
            eprintln!(
                "report: preset {name} has {count} parameters, not the published {published:?}"
            );
            std::process::exit(1);
        }
    }
    // (name, shapes, whether the hook runs on one bucket of everything), in report order.
    let mut runs: Vec<(String, Vec<Vec<usize>>, bool)> = presets
        .iter()
        .map(|(n, shapes, direct)| (n.to_string(), shapes(), *direct))
        .collect();
    if let Some(user) = a.shapes.clone() {
        if models::presets().iter().any(|(n, ..)| *n == user.name) {
            eprintln!(
                "report: --shapes: the model is named `{}`, as a preset is; name it otherwise with {{\"name\": ..., \"shapes\": [...]}}",
                user.name
            );
            std::process::exit(2);
        }
        runs.push((user.name, user.shapes, false));
    }
    let link_ranks = a.ranks.unwrap_or(RANKS);
    let bw = measure::read_bandwidth();
    let llc = measure::llc_bytes();
    let isa = measure::backend().isa();
    emit(json!({
        "kind": "machine",
        "cpu": cpu_model(),
        "cores": std::thread::available_parallelism().map_or(1, |n| n.get()),
        "isa": isa.name(),
        "read_gbps": round(bw / 1e9, 2),
        "llc_bytes": llc,
        "ranks": RANKS,
        "link_ranks": link_ranks,
        "backward_ms": a.backward_ms,
        "threads_per_rank": 1,
        "latency_us": LATENCY.as_secs_f64() * 1e6,
        "link": "accounted",
        "quick": a.quick,
    }));
    emit(json!({"kind": "plan", "rows": runs.len() * (HOOKS.len() + AMORTISED.len())}));
    for (model, shapes, direct) in runs {
        let model = model.as_str();
        let params = models::params(&shapes);
        let grad_bytes = 4 * params;
        let steps = a.steps.unwrap_or_else(|| steps_for(model, a.quick));
        let grads = measure::synthetic_ranks(&shapes);
        let mut base: Option<Profile> = None;
        // The all-reduce and the 16-bit hooks alternate step by step, so that load drifts
        // between them do not move their comparison; the others run one by one.
        let stateless = HOOKS.iter().take_while(|h| h.2 == 0).count();
        let specs: Vec<HookSpec> = HOOKS
            .iter()
            .map(|h| h.1.parse().expect("the report's specs parse"))
            .collect();
        let names: Vec<&str> = HOOKS[..stateless].iter().map(|h| h.0).collect();
        emit(json!({"kind": "start", "model": model, "hook": names.join(" / "), "rank": 0}));
        let alternated =
            measure::measure_alternating(&shapes, &grads, &specs[..stateless], direct, steps);
        let mut alternated = alternated.into_iter();
        let mut allreduce: Option<measure::Measured> = None;
        for ((hook, _, rank), parsed) in HOOKS.into_iter().zip(&specs) {
            let m = match alternated.next() {
                Some(m) => m,
                None => {
                    emit(json!({"kind": "start", "model": model, "hook": hook, "rank": rank}));
                    measure::measure(&shapes, &grads, parsed, direct, steps)
                }
            };
            let vs_allreduce = match &allreduce {
                Some(base) if rank == 0 => Some(round(m.ratio_to(base), 3)),
                _ => None,
            };
            let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
            let hook_ms = ms(m.median());
            let sent = m.bytes_sent();
            let profile = m.profile(&shapes, hook_ms, link_ranks);
            // The buckets must add up to the whole step's hook and link time at every
            // priced speed, or the overlapped figures would price another step.
            for &g in &SPEEDS {
                let whole = hook_ms + ms(m.link_time_on(g, link_ranks));
                let parts = profile.comm_only_ms(g);
                if (parts - whole).abs() > 1e-6 * whole.max(1.0) {
                    eprintln!("report: {model} {hook}: the buckets give {parts} ms at {g} Gbit/s, the whole step {whole} ms");
                    std::process::exit(1);
                }
            }
            let base_profile = base.get_or_insert_with(|| profile.clone()).clone();
            let passes = measure::bound_passes(parsed);
            let bound = passes.map(|p| m.bound_ratio(p, grad_bytes));
            let bound_1t = passes.map(|p| m.bound_ratio_1t(p, grad_bytes, bw));
            let ws = measure::working_set_bytes(parsed, m.largest_bucket_bytes(&shapes));
            let row = json!({
                "kind": "row",
                "model": model,
                "hook": hook,
                "rank": rank,
                "ranks": RANKS,
                "link_ranks": link_ranks,
                "hook_ms": round(hook_ms, 4),
                "hook_ms_min": round(ms(*m.steps.iter().min().expect("steps")), 4),
                "hook_ms_max": round(ms(*m.steps.iter().max().expect("steps")), 4),
                "steps": steps,
                "params": params,
                "gbps": round(grad_bytes as f64 / (hook_ms / 1e3) / 1e9, 4),
                "bytes_sent": sent,
                "compression_ratio": round(grad_bytes as f64 / sent.max(1) as f64, 3),
                "bound_ratio": bound.map(|b| round(b, 3)),
                "bound_ratio_1t": bound_1t.map(|b| round(b, 3)),
                "share_gbps": round(m.share_bandwidth() / 1e9, 3),
                "working_set_bytes": ws,
                "llc_bytes": llc,
                "vs_allreduce": vs_allreduce,
            });
            emit(with(
                row,
                overlap::priced(&profile, &base_profile, a.backward_ms),
            ));
            if allreduce.is_none() {
                // Local SGD and DiLoCo, which all-reduce the whole model (or its
                // pseudo-gradient) once every `period` steps, after the optimizer step:
                // the all-reduce's time, bytes and link cost amortised over the period,
                // not overlapped with the backward.
                for (method, period) in AMORTISED {
                    let p = period as f64;
                    let amortised = Profile {
                        period,
                        ..profile.clone()
                    };
                    let row = json!({
                        "kind": "row",
                        "model": model,
                        "hook": method,
                        "rank": 0,
                        "ranks": RANKS,
                        "link_ranks": link_ranks,
                        "amortised_over": period,
                        "hook_ms": round(hook_ms / p, 4),
                        "hook_ms_min": round(ms(*m.steps.iter().min().expect("steps")) / p, 4),
                        "hook_ms_max": round(ms(*m.steps.iter().max().expect("steps")) / p, 4),
                        "steps": steps,
                        "params": params,
                        "gbps": round(grad_bytes as f64 / (hook_ms / p / 1e3) / 1e9, 4),
                        "bytes_sent": sent / period as usize,
                        "compression_ratio": round(p * grad_bytes as f64 / sent.max(1) as f64, 3),
                        "bound_ratio": null,
                        "bound_ratio_1t": null,
                        "working_set_bytes": null,
                        "llc_bytes": llc,
                        "vs_allreduce": round(1.0 / p, 3),
                    });
                    emit(with(
                        row,
                        overlap::priced(&amortised, &base_profile, a.backward_ms),
                    ));
                }
                allreduce = Some(m);
            }
        }
    }
}

/// The methods that all-reduce once every `period` steps, priced from the all-reduce's
/// row: (name in the report, period).
const AMORTISED: [(&str, u64); 4] = [
    ("local_sgd:period=4", 4),
    ("local_sgd:period=16", 16),
    ("diloco:H=16", 16),
    ("diloco:H=64", 64),
];

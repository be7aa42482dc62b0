//! Pipeline × data parallel: how much of the communication a per-partition launch hides.
//!
//! 2 thread ranks, each running 8 × (Linear(1024, 1024) + ReLU) as a 2-partition pipe
//! (8 layers each, GPipe, `except_last`), batch 256 per rank, `f32`, through
//! [`DistributedPipe`] with the all-reduce hook and with PowerSGD (rank 4, compressing
//! after 2 warm-up steps), in m = 1 and m = 4 micro-batches. Every collective goes through
//! `collectives::link::Linked` with `Charge::Sleep`: after the real operation, the rank's
//! progress thread sleeps for what a ring on a 1 or 10 Gbit/s link (20 µs per message)
//! would take, so communication that is not hidden behind compute lengthens the step.
//!
//! For each hook, launch point and link: **exposed communication** = step time with the
//! sleeping link − step time with no link, as a fraction of the step's total
//! communication time (the link time of all its collectives). Two launch points:
//!
//! - `per-partition`: each partition's buckets go to the hook on its worker right after
//!   its last backward action (the pipe's gradients-final point), while the other
//!   partition still computes;
//! - `after-backward`: every bucket after the whole backward pass, as a data-parallel
//!   wrapper without that point would do.
//!
//! What can hide: partition 1 finishes its backward one stage step before partition 0
//! (GPipe and 1F1B alike), so its communication overlaps partition 0's remaining
//! backward: the whole of it at m = 1, one micro-batch's worth at m = 4. Partition 0's
//! own gradients are final only at the very end, so about half of the communication
//! (its half of the parameters) is exposed under either launch.
//!
//! Two estimates of the exposed time. **Step**: the issue's definition, best step time
//! with the link − best without (on a shared machine noise only adds time, so the best of
//! the repetitions is used, as the `pipe` bench does). **Tail**: the median of
//! [`StepTimes::tail`](ddp_hooks::pipeline::StepTimes) with the link − without, the time
//! from the end of the backward pass to the averaged gradients, taken on the rank that
//! finished its backward last (the other also waits for it). The backward's compute is
//! the same with and without the link (the link only sleeps), so the two measure the
//! same thing; the tail is a short interval spent mostly sleeping, far less disturbed by
//! other processes' load than a whole step.
//!
//! The three link settings share one pipe and one hook per rank (a group that switches
//! between three `Linked` subgroups) and are measured back to back in each repetition, in
//! an order that rotates from one repetition to the next. Step times are the slower
//! rank's. Each estimate is printed with its noise (step: median − best without the link;
//! tail: the interquartile range), which bounds what a difference can resolve.
//!
//! **Oversubscription.** 2 ranks × 2 partitions are 4 compute threads (plus the ranks'
//! progress threads, which sleep for the link or run PowerSGD's products) on however many
//! cores the machine has, unpinned (pinning two ranks' workers to the same cores would
//! only serialise them). On a 2-core machine the partitions' compute is slowed by the
//! sharing, which makes the window in which a partition's communication can hide longer
//! than it would be with a core per worker, but both launch points see the same machine:
//! the fractions compare them. The load average is printed with the figures.
//!
//! A fraction is only as good as the noise allows: where the step's link time is within
//! an estimate's noise (PowerSGD sends about 1% of the all-reduce's bytes here), the row
//! says so (`resolvable` / `tail_resolvable: false` in JSON, `n/r` in the table) instead
//! of printing a fraction to trust.
//!
//! Arguments: `--quick` (3 repetitions), `--json` (one JSON object per row), `--reps N`
//! (default 10), `--chunks M` (one micro-batch count instead of 1 and 4). Run by
//! `cargo bench -p ddp-hooks --features pipe --bench pipeline -- [--quick] [--json]`.

use collectives::link::{Charge, Link, Linked};
use collectives::{run_local, ProcessGroup, ThreadGroup};
use ddp_hooks::pipeline::{DistributedPipe, Launch};
use ddp_hooks::{HookSpec, PowerSgdConfig, ReducerConfig};
use lowrank::CpuBackend;
use pipe::cpu::{CpuTensor, Linear, ReLU};
use pipe::{Batch, Checkpoint, Layer, MicroBatch, Pipe, ScheduleKind};
use serde_json::json;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const RANKS: usize = 2;
const BATCH: usize = 256;
const WIDTH: usize = 1024;
const BLOCKS: usize = 8;
const PARTITIONS: usize = 2;
const LATENCY: Duration = Duration::from_micros(20);
/// Steps before measuring (PowerSGD compresses from its second synchronised step).
const WARM_UP: usize = 3;
/// The link settings: none, then these speeds in Gbit/s.
const GBITS: [f64; 2] = [1.0, 10.0];

struct Args {
    json: bool,
    reps: usize,
    chunks: Vec<usize>,
}

fn args() -> Args {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let quick = argv.iter().any(|a| a == "--quick");
    let value = |name: &str| {
        argv.iter()
            .position(|a| a == name)
            .and_then(|i| argv.get(i + 1))
            .and_then(|s| s.parse::<usize>().ok())
    };
    Args {
        json: argv.iter().any(|a| a == "--json"),
        reps: value("--reps").unwrap_or(if quick { 3 } else { 10 }).max(1),
        chunks: match value("--chunks") {
            Some(m) => vec![m.max(1)],
            None => vec![1, 4],
        },
    }
}

/// A process group that forwards every operation to one of several groups, chosen
/// between steps (the same choice on every rank).
struct Switch {
    groups: Vec<Linked<Box<dyn ProcessGroup>>>,
    which: Arc<AtomicUsize>,
}

impl Switch {
    fn now(&self) -> &Linked<Box<dyn ProcessGroup>> {
        &self.groups[self.which.load(Ordering::Acquire)]
    }
}

collectives::forward_group! {
    impl ProcessGroup for Switch {
        inner: |s| s.now();
    }
}

/// `blocks` × (Linear(width, width) + ReLU).
fn stack() -> Vec<Box<dyn Layer<CpuTensor>>> {
    (0..BLOCKS)
        .flat_map(|b| -> [Box<dyn Layer<CpuTensor>>; 2] {
            [
                Box::new(Linear::new(WIDTH, WIDTH, b as u64)),
                Box::new(ReLU),
            ]
        })
        .collect()
}

fn input(rank: usize) -> CpuTensor {
    let stream = pipe::Stream::new(7, rank as u64, 0);
    CpuTensor::new(
        pipe::ndarray::Array2::from_shape_fn((BATCH, WIDTH), |(r, c)| {
            2.0 * stream.sample(r as u64).uniform(c as u64) - 1.0
        })
        .into_dyn(),
    )
}

/// Loss `½ ‖y‖² / BATCH`: the output gradient is `y / BATCH`.
fn loss(_mb: MicroBatch, y: &Batch<CpuTensor>) -> Result<(f32, Batch<CpuTensor>), pipe::Error> {
    let y = y.tensor(0)?;
    let g = y.array().mapv(|v| v / BATCH as f32);
    Ok((0.0, Batch::single(CpuTensor::new(g))))
}

/// One measured step: the launch point, the link (0: none, `i`: `GBITS[i - 1]`), this
/// rank's step time, and the link time charged for it.
struct Sample {
    launch: Launch,
    link: usize,
    step: Duration,
    /// `StepTimes::tail`: from the end of the backward pass to the averaged gradients.
    tail: Duration,
    comm: Duration,
}

fn rank_run(
    g: ThreadGroup,
    hook: &HookSpec,
    chunks: usize,
    a: &Args,
) -> Result<Vec<Sample>, Box<dyn std::error::Error + Send + Sync>> {
    let rank = g.rank();
    let mut groups = Vec::new();
    for (i, gbit) in [1.0].iter().chain(&GBITS).enumerate() {
        let sub = g.new_group(&[0, 1])?.ok_or("every rank is in the group")?;
        let charge = if i == 0 {
            Charge::Account
        } else {
            Charge::Sleep
        };
        groups.push(Linked::new(sub, Link::gbit(*gbit, LATENCY)?, charge));
    }
    let which = Arc::new(AtomicUsize::new(0));
    let switch = Switch {
        groups,
        which: which.clone(),
    };
    let switch = Arc::new(switch);
    let backend = Arc::new(CpuBackend::new());
    let hook = hook.build(backend.clone(), switch.clone())?;
    let pipe = Pipe::builder(stack(), &[2 * BLOCKS / PARTITIONS; PARTITIONS])
        .chunks(chunks)
        .checkpoint(Checkpoint::ExceptLast)
        .schedule(ScheduleKind::GPipe)
        .build()?;
    let mut ddp = DistributedPipe::new(pipe, backend, hook, ReducerConfig::default())?;
    let x = input(rank);
    for _ in 0..WARM_UP {
        ddp.step(Batch::single(x.clone()), loss)?;
        ddp.zero_grad();
    }
    let mut samples = Vec::new();
    let launches = [Launch::PerPartition, Launch::AfterBackward];
    for rep in 0..a.reps {
        // Rotate the order of the settings from one repetition to the next, so that no
        // setting always follows the same one.
        for l in 0..launches.len() {
            let launch = launches[(l + rep) % launches.len()];
            ddp.set_launch(launch);
            for k in 0..=GBITS.len() {
                let link = (k + rep) % (GBITS.len() + 1);
                which.store(link, Ordering::Release);
                let charged = switch.groups[link].charged();
                g.barrier().wait()?;
                let t = Instant::now();
                ddp.step(Batch::single(x.clone()), loss)?;
                let step = t.elapsed();
                ddp.zero_grad();
                let comm = switch.groups[link].charged() - charged;
                let tail = ddp.last_step_times().ok_or("a step without times")?.tail;
                samples.push(Sample {
                    launch,
                    link,
                    step,
                    tail,
                    comm,
                });
            }
        }
    }
    Ok(samples)
}

/// One step as the report sees it (milliseconds).
struct Step {
    launch: Launch,
    link: usize,
    step: f64,
    tail: f64,
    comm: f64,
}

fn best(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::INFINITY, f64::min)
}

/// The interquartile range.
fn spread(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    at(0.75) - at(0.25)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

fn launch_name(l: Launch) -> &'static str {
    match l {
        Launch::PerPartition => "per-partition",
        Launch::AfterBackward => "after-backward",
    }
}

fn main() {
    let a = args();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let load_before = load();
    let powersgd = PowerSgdConfig {
        matrix_approximation_rank: 4,
        start_powersgd_iter: 2,
        ..PowerSgdConfig::default()
    };
    let hooks = [
        ("allreduce", HookSpec::AllReduce),
        ("powersgd:rank=4", HookSpec::PowerSgd(powersgd)),
    ];
    let mut rows = Vec::new();
    let started = Instant::now();
    for (m, (name, hook)) in a
        .chunks
        .iter()
        .flat_map(|&m| hooks.iter().map(move |h| (m, h)))
    {
        let run = |g| rank_run(g, hook, m, &a).map_err(|e| e.to_string());
        let out = match run_local(RANKS, run) {
            Ok(out) => out,
            Err(e) => {
                eprintln!("pipeline bench: {e}");
                std::process::exit(1);
            }
        };
        let mut per_rank = Vec::new();
        for (r, o) in out.into_iter().enumerate() {
            match o {
                Ok(Ok(samples)) => per_rank.push(samples),
                Ok(Err(e)) => {
                    eprintln!("pipeline bench: rank {r}: {e}");
                    std::process::exit(1);
                }
                Err(e) => {
                    eprintln!("pipeline bench: rank {r}: {e}");
                    std::process::exit(1);
                }
            }
        }
        // Per step: the slower rank's step time (the job's), and the smaller tail (the
        // rank that finished its backward last waits only for what was not hidden; the
        // other also waits for it).
        let steps: Vec<Step> = (0..per_rank[0].len())
            .map(|i| {
                let s = &per_rank[0][i];
                let ms = |d: Duration| d.as_secs_f64() * 1e3;
                let step = per_rank.iter().map(|p| p[i].step).max().unwrap_or(s.step);
                let tail = per_rank.iter().map(|p| p[i].tail).min().unwrap_or(s.tail);
                Step {
                    launch: s.launch,
                    link: s.link,
                    step: ms(step),
                    tail: ms(tail),
                    comm: ms(s.comm),
                }
            })
            .collect();
        for launch in [Launch::PerPartition, Launch::AfterBackward] {
            let of = |link: usize, f: fn(&Step) -> f64| -> Vec<f64> {
                steps
                    .iter()
                    .filter(|s| s.launch == launch && s.link == link)
                    .map(f)
                    .collect()
            };
            let (step_none, tail_none) = (of(0, |s| s.step), of(0, |s| s.tail));
            for (k, gbit) in GBITS.iter().enumerate() {
                let link = k + 1;
                let (step_link, tail_link) = (of(link, |s| s.step), of(link, |s| s.tail));
                let comm = median(of(link, |s| s.comm));
                let exposed = best(&step_link) - best(&step_none);
                let step_noise = median(step_none.clone()) - best(&step_none);
                let tail_exposed = median(tail_link.clone()) - median(tail_none.clone());
                let tail_noise = spread(&tail_none).max(spread(&tail_link));
                rows.push(json!({
                    "hook": name,
                    "launch": launch_name(launch),
                    "gbit": gbit,
                    "ranks": RANKS,
                    "partitions": PARTITIONS,
                    "chunks": m,
                    "reps": step_none.len(),
                    "comm_ms": comm,
                    "best_step_ms_no_link": best(&step_none),
                    "best_step_ms_link": best(&step_link),
                    "median_step_ms_no_link": median(step_none.clone()),
                    "median_step_ms_link": median(step_link.clone()),
                    "step_noise_ms": step_noise,
                    "exposed_ms": exposed,
                    "exposed_fraction": exposed / comm,
                    "resolvable": comm > step_noise,
                    "median_tail_ms_no_link": median(tail_none.clone()),
                    "median_tail_ms_link": median(tail_link.clone()),
                    "tail_noise_ms": tail_noise,
                    "tail_exposed_ms": tail_exposed,
                    "tail_exposed_fraction": tail_exposed / comm,
                    "tail_resolvable": comm > tail_noise,
                }));
            }
        }
    }
    let load_after = load();
    if a.json {
        for r in &rows {
            println!("{r}");
        }
        println!(
            "{}",
            json!({"note": "machine", "cores": cores, "load_before": load_before, "load_after": load_after, "seconds": started.elapsed().as_secs_f64()})
        );
        return;
    }
    println!(
        "pipeline x data parallel: {RANKS} thread ranks x {PARTITIONS} partitions of {BLOCKS} x (Linear({WIDTH}, {WIDTH}) + ReLU), batch {BATCH} per rank, m micro-batches, GPipe, except_last; {} threads unpinned on {cores} cores; link sleeps (Linked, Charge::Sleep, 20 us/message); {} repetitions, slower rank",
        RANKS * PARTITIONS,
        a.reps
    );
    println!("load average before {load_before}, after {load_after}");
    println!(
        "{:>2} {:<16} {:<15} {:>6} {:>8} | {:>8} {:>8} {:>7} {:>8} | {:>7} {:>7} {:>6} {:>8}",
        "m",
        "hook",
        "launch",
        "Gbit/s",
        "comm ms",
        "step ms",
        "+link",
        "noise",
        "exposed",
        "tail ms",
        "+link",
        "noise",
        "exposed"
    );
    for r in &rows {
        let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
        let pct = |k: &str, ok: &str| {
            if r[ok].as_bool().unwrap_or(false) {
                format!("{:.0}%", 100.0 * f(k))
            } else {
                "n/r".into()
            }
        };
        println!(
            "{:>2} {:<16} {:<15} {:>6} {:>8.1} | {:>8.1} {:>8.1} {:>7.1} {:>8} | {:>7.1} {:>7.1} {:>6.1} {:>8}",
            r["chunks"],
            r["hook"].as_str().unwrap_or("?"),
            r["launch"].as_str().unwrap_or("?"),
            f("gbit"),
            f("comm_ms"),
            f("best_step_ms_no_link"),
            f("best_step_ms_link"),
            f("step_noise_ms"),
            pct("exposed_fraction", "resolvable"),
            f("median_tail_ms_no_link"),
            f("median_tail_ms_link"),
            f("tail_noise_ms"),
            pct("tail_exposed_fraction", "tail_resolvable"),
        );
    }
    println!(
        "comm ms: the step's total link time. Step: best step time without and with the sleeping link, noise = median - best without; exposed = (+link - step ms) / comm ms. Tail (from the end of the backward pass to the averaged gradients, the rank that finished last): medians, noise = interquartile range; exposed = (+link - tail ms) / comm ms. n/r: comm ms within the noise, not resolvable. {:.0} s",
        started.elapsed().as_secs_f64()
    );
}

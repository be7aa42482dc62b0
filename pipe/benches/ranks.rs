//! Stages on ranks: what it costs to run a pipe's stages on the ranks of a process group
//! instead of as threads of one pipe.
//!
//! The stack of the `pipe` benchmark (8 × (Linear(1024, 1024) + ReLU), batch 256, `f32`),
//! two stages of 8 layers, m = 8, checkpoint `never`, GPipe and 1F1B, weight gradients
//! deferred, each stage's worker pinned to its own core (0 and 1):
//!
//! - `in-process`: one [`Pipe`] with both stages (the worker threads of one process);
//! - `thread-ranks`: two ranks of a `collectives::ThreadGroup`, each a pipe with its own
//!   stage, activations and gradients over the group's point-to-point operations
//!   ([`GroupTransport`]);
//! - `mpi` (feature `mpi`, where `mpirun` is on `PATH`): two processes under
//!   `mpirun -np 2`, the same over `collectives::MpiGroup`.
//!
//! Each row: the step time (best of several steps in each of three rounds that take the
//! transports in turn; on ranks the slower rank's), the speedup
//! over the same layers run unpipelined on one thread on the whole batch, and its ratio
//! to the in-process pipe's speedup. The overhead rows run near-empty layers
//! (8 × (Linear(4, 4) + ReLU), batch 8, m = 8, GPipe) and report (step time − the same
//! actions run directly in one thread) / the actions of the busiest stage: executor plus
//! transport per action.
//!
//! `cargo bench -p pipe --features collectives --bench ranks -- [--quick] [--json] [--reps N]`
//! (`cargo xtask bench pipe` runs it, with `mpi` where Open MPI is installed). A bad
//! argument exits with status 2.

#[path = "support/stack.rs"]
mod stack;

use std::sync::Arc;
use std::time::Duration;

use pipe::cpu::CpuTensor;
use pipe::{Batch, Checkpoint, Device, GroupTransport, MicroBatch, Pipe, ScheduleKind, Transport};
use stack::{best, direct_step, input, load, ones_loss, stack, zero, Layers};

const BATCH: usize = 256;
const WIDTH: usize = 1024;
const BLOCKS: usize = 8;
const M: usize = 8;
/// The near-empty stack of the overhead rows.
const TINY: (usize, usize) = (8, 4);

struct Args {
    quick: bool,
    json: bool,
    reps: usize,
    /// Rounds over every transport (the best of each is kept).
    rounds: usize,
    /// Internal: this process is one rank under `mpirun`.
    mpi_child: bool,
}

fn args() -> Result<Args, lexopt::Error> {
    use lexopt::prelude::*;
    let mut parser = lexopt::Parser::from_env();
    let mut a = Args {
        quick: false,
        json: false,
        reps: 0,
        rounds: 0,
        mpi_child: false,
    };
    let mut reps = None;
    while let Some(arg) = parser.next()? {
        match arg {
            Long("quick") => a.quick = true,
            Long("json") => a.json = true,
            Long("mpi-child") => a.mpi_child = true,
            Long("reps") => {
                let n: usize = parser.value()?.parse()?;
                if n == 0 {
                    return Err("--reps: expected a positive integer".into());
                }
                reps = Some(n);
            }
            Long("bench") => {}
            _ => return Err(arg.unexpected()),
        }
    }
    a.reps = reps.unwrap_or(if a.quick { 5 } else { 7 });
    a.rounds = if a.quick { 1 } else { 3 };
    Ok(a)
}

/// The layers of stage `stage` (of two) of the stack, or all of them.
fn stage_layers(tiny: bool, stage: Option<usize>) -> Layers {
    let (blocks, width) = if tiny { TINY } else { (BLOCKS, WIDTH) };
    let all = stack(blocks, width);
    match stage {
        None => all,
        Some(s) => all.into_iter().skip(s * blocks).take(blocks).collect(),
    }
}

fn batch_of(tiny: bool) -> CpuTensor {
    if tiny {
        input(M, TINY.1)
    } else {
        input(BATCH, WIDTH)
    }
}

/// A two-stage pipe of `layers` (both stages' or one stage's, `tiny` or not).
fn builder(layers: Layers, tiny: bool, schedule: ScheduleKind) -> pipe::PipeBuilder<CpuTensor> {
    // Layers per stage: half of 2 × blocks.
    let per = if tiny { TINY.0 } else { BLOCKS };
    Pipe::builder(layers, &[per, per])
        .devices(Device::cores(2))
        .chunks(M)
        .checkpoint(Checkpoint::Never)
        .schedule(schedule)
        .defer_weight_grads(true)
}

/// `reps` timed steps (after one warm-up) of `pipe`; `first` feeds the input.
fn steps(pipe: &mut Pipe<CpuTensor>, x: &CpuTensor, first: bool, reps: usize) -> Vec<Duration> {
    (0..=reps)
        .map(|_| {
            pipe.zero_grad();
            let input = if first {
                Batch::single(x.clone())
            } else {
                Batch::new(Vec::new())
            };
            let start = std::time::Instant::now();
            pipe.step(input, ones_loss).expect("step");
            start.elapsed()
        })
        .skip(1)
        .collect()
}

/// The slower rank's time per step, best over the steps.
fn slower(per_rank: &[Vec<Duration>]) -> Duration {
    let reps = per_rank.iter().map(Vec::len).min().unwrap_or(0);
    (0..reps)
        .map(|i| per_rank.iter().map(|t| t[i]).max().unwrap_or_default())
        .min()
        .unwrap_or_default()
}

fn in_process(tiny: bool, schedule: ScheduleKind, reps: usize) -> Duration {
    let mut pipe = builder(stage_layers(tiny, None), tiny, schedule)
        .build()
        .expect("a valid pipe");
    let x = batch_of(tiny);
    steps(&mut pipe, &x, true, reps)
        .into_iter()
        .min()
        .unwrap_or_default()
}

fn thread_ranks(tiny: bool, schedule: ScheduleKind, reps: usize) -> Duration {
    let x = batch_of(tiny);
    let per_rank = collectives::run_local(2, |group| {
        let rank = collectives::ProcessGroup::rank(&group);
        let transport: Arc<dyn Transport> = Arc::new(GroupTransport::new(group));
        let mut pipe = builder(stage_layers(tiny, Some(rank)), tiny, schedule)
            .stages_on_ranks(transport)
            .build()
            .expect("a valid pipe on ranks");
        steps(&mut pipe, &x, rank == 0, reps)
    })
    .expect("thread ranks");
    let per_rank: Vec<Vec<Duration>> = per_rank.into_iter().map(|r| r.expect("a rank")).collect();
    slower(&per_rank)
}

/// One rank under `mpirun`: prints its step times, one JSON line per configuration.
#[cfg(feature = "mpi")]
fn mpi_child(reps: usize) {
    use collectives::ProcessGroup;
    let world = collectives::mpi::MpiGroup::world().expect("MPI");
    let rank = world.rank();
    let transport: Arc<dyn Transport> = Arc::new(GroupTransport::new(world));
    for (tiny, schedule) in configurations() {
        let mut pipe = builder(stage_layers(tiny, Some(rank)), tiny, schedule)
            .stages_on_ranks(transport.clone())
            .build()
            .expect("a valid pipe on ranks");
        let times = steps(&mut pipe, &batch_of(tiny), rank == 0, reps);
        let us: Vec<String> = times
            .iter()
            .map(|t| format!("{:.1}", t.as_secs_f64() * 1e6))
            .collect();
        println!(
            "{{\"mpi_child\":{rank},\"tiny\":{tiny},\"schedule\":\"{schedule}\",\"times_us\":[{}]}}",
            us.join(",")
        );
    }
}

#[cfg(not(feature = "mpi"))]
fn mpi_child(_reps: usize) {
    eprintln!("ranks bench: --mpi-child needs the `mpi` feature");
    std::process::exit(2);
}

fn configurations() -> Vec<(bool, ScheduleKind)> {
    vec![
        (false, ScheduleKind::GPipe),
        (false, ScheduleKind::OneFOneB),
        (true, ScheduleKind::GPipe),
    ]
}

/// Runs this benchmark's MPI ranks under `mpirun -np 2`; per configuration, the slower
/// rank's best step. `None` where it cannot run here (no feature, no `mpirun`, a failure:
/// said on standard error).
fn mpi(reps: usize) -> Option<Vec<((bool, ScheduleKind), Duration)>> {
    if !cfg!(feature = "mpi") {
        return None;
    }
    let on_path = std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join("mpirun").is_file()));
    if !on_path {
        eprintln!("ranks bench: no mpirun on PATH; the mpi rows are skipped");
        return None;
    }
    let exe = std::env::current_exe().ok()?;
    let out = std::process::Command::new("mpirun")
        .args([
            "-np",
            "2",
            "--oversubscribe",
            "--bind-to",
            "none",
            "--timeout",
            "600",
        ])
        .arg(exe)
        .args(["--mpi-child", "--reps", &reps.to_string()])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
        .output()
        .ok()?;
    if !out.status.success() {
        eprintln!(
            "ranks bench: mpirun failed ({}); the mpi rows are skipped:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut rows = Vec::new();
    for config in configurations() {
        let (tiny, schedule) = config;
        let mut per_rank = Vec::new();
        for line in text.lines() {
            let wanted = format!("\"tiny\":{tiny},\"schedule\":\"{schedule}\"");
            if !line.starts_with("{\"mpi_child\"") || !line.contains(&wanted) {
                continue;
            }
            let list = line.split("\"times_us\":[").nth(1)?.trim_end_matches("]}");
            per_rank.push(
                list.split(',')
                    .filter_map(|v| v.parse::<f64>().ok())
                    .map(|us| Duration::from_secs_f64(us * 1e-6))
                    .collect::<Vec<_>>(),
            );
        }
        if per_rank.len() != 2 {
            eprintln!(
                "ranks bench: mpirun printed {} rank(s) for {schedule}",
                per_rank.len()
            );
            return None;
        }
        rows.push((config, slower(&per_rank)));
    }
    Some(rows)
}

/// The actions of `layers` run directly in one thread over the m micro-batches.
fn direct_tiny(reps: usize) -> Duration {
    let x = batch_of(true);
    let mut layers = stage_layers(true, None);
    let plan = MicroBatch::plan(M, M).expect("plan");
    let t = best(reps, || {
        let parts = Batch::single(x.clone()).split_as(&plan).expect("split");
        for (part, &mb) in parts.into_iter().zip(&plan) {
            direct_step(&mut layers, &part.into_single().expect("single"), mb);
        }
    });
    zero(&mut layers);
    t
}

/// The order of the rows: in-process, thread ranks, MPI.
fn transport_order(t: &str) -> usize {
    ["in-process", "thread-ranks", "mpi"]
        .iter()
        .position(|&x| x == t)
        .unwrap_or(3)
}

fn main() {
    let a = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("ranks bench: {e}; arguments: [--quick] [--json] [--reps N]");
            std::process::exit(2);
        }
    };
    if a.mpi_child {
        mpi_child(a.reps);
        return;
    }
    let load_before = load();
    let x = input(BATCH, WIDTH);
    let mut whole_layers = stage_layers(false, None);
    let whole = MicroBatch {
        index: 0,
        offset: 0,
        len: BATCH,
    };
    let baseline = best(a.reps, || direct_step(&mut whole_layers, &x, whole));
    zero(&mut whole_layers);
    let tiny_reps = a.reps * 20;
    let direct = direct_tiny(tiny_reps);

    // (transport, schedule, tiny, step): the best over rounds that take every transport in
    // turn, so that a slow phase of a shared machine does not fall on one transport alone.
    let mut rows: Vec<(&str, ScheduleKind, bool, Duration)> = Vec::new();
    let keep = |rows: &mut Vec<(&'static str, ScheduleKind, bool, Duration)>,
                transport: &'static str,
                schedule: ScheduleKind,
                tiny: bool,
                t: Duration| {
        match rows
            .iter_mut()
            .find(|r| r.0 == transport && r.1 == schedule && r.2 == tiny)
        {
            Some(r) => r.3 = r.3.min(t),
            None => rows.push((transport, schedule, tiny, t)),
        }
    };
    for _ in 0..a.rounds {
        for (tiny, schedule) in configurations() {
            let reps = if tiny { tiny_reps } else { a.reps };
            keep(
                &mut rows,
                "in-process",
                schedule,
                tiny,
                in_process(tiny, schedule, reps),
            );
            keep(
                &mut rows,
                "thread-ranks",
                schedule,
                tiny,
                thread_ranks(tiny, schedule, reps),
            );
        }
        for ((tiny, schedule), t) in mpi(a.reps).unwrap_or_default() {
            keep(&mut rows, "mpi", schedule, tiny, t);
        }
    }
    rows.sort_by_key(|r| (r.2, r.1.to_string(), transport_order(r.0)));
    // The baseline again at the end: the best of both.
    let again = best(a.reps, || direct_step(&mut whole_layers, &x, whole));
    zero(&mut whole_layers);
    let baseline = baseline.min(again);
    let load_after = load();
    let in_process_of = |s: ScheduleKind, tiny: bool| {
        rows.iter()
            .find(|r| r.0 == "in-process" && r.1 == s && r.2 == tiny)
            .map(|r| r.3)
            .unwrap_or_default()
    };
    let actions = 2 * M;
    if !a.json {
        println!(
            "stages on ranks: 8 x (Linear(1024, 1024) + ReLU), batch {BATCH}, m = {M}, 2 stages pinned to cores 0 and 1, checkpoint never; best of {} steps in each of {} round(s)",
            a.reps, a.rounds
        );
        println!(
            "baseline (unpipelined, one thread, whole batch): {:.2} ms/step",
            baseline.as_secs_f64() * 1e3
        );
        println!(
            "{:<13} {:<6} {:>9} {:>8} {:>20}",
            "transport", "sched", "step ms", "speedup", "/ in-process speedup"
        );
    }
    for &(transport, schedule, tiny, step) in rows.iter().filter(|r| !r.2) {
        let speedup = baseline.as_secs_f64() / step.as_secs_f64();
        let ratio = in_process_of(schedule, tiny).as_secs_f64() / step.as_secs_f64();
        if a.json {
            println!(
                "{{\"bench\":\"stages_on_ranks\",\"transport\":\"{transport}\",\"schedule\":\"{schedule}\",\"m\":{M},\"stages\":2,\"step_ms\":{:.3},\"baseline_ms\":{:.3},\"speedup\":{speedup:.4},\"ratio_to_in_process\":{ratio:.4},\"load\":{load_after}}}",
                step.as_secs_f64() * 1e3,
                baseline.as_secs_f64() * 1e3
            );
        } else {
            println!(
                "{transport:<13} {:<6} {:>9.2} {speedup:>8.3} {ratio:>20.3}",
                schedule.to_string(),
                step.as_secs_f64() * 1e3
            );
        }
    }
    for &(transport, _, _, step) in rows.iter().filter(|r| r.2) {
        let per_action = (step.as_secs_f64() - direct.as_secs_f64()) / actions as f64 * 1e6;
        if a.json {
            println!(
                "{{\"bench\":\"stages_on_ranks_overhead\",\"transport\":\"{transport}\",\"schedule\":\"gpipe\",\"m\":{M},\"overhead_us\":{per_action:.2},\"actions\":{actions},\"step_us\":{:.1},\"direct_us\":{:.1}}}",
                step.as_secs_f64() * 1e6,
                direct.as_secs_f64() * 1e6
            );
        } else {
            println!(
                "overhead, {transport}: {per_action:.1} us per action (near-empty layers, gpipe, m = {M}: step {:.1} us, direct {:.1} us, {actions} actions on the busiest stage)",
                step.as_secs_f64() * 1e6,
                direct.as_secs_f64() * 1e6
            );
        }
    }
    if !a.json {
        println!("load average: {load_before} before, {load_after} after");
    }
}

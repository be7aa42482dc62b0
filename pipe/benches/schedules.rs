//! Every schedule on two workers, measured against its simulation: the stack of the
//! `pipe` benchmark (8 × (Linear(1024, 1024) + ReLU), batch 256, `f32`) as 2 stages (one
//! per worker: GPipe, 1F1B, ZB-H1) or 4 stages (two per worker: looped BFS, interleaved
//! 1F1B, interleaved zero bubble, ZBV, DualPipeV), each worker pinned to its own core,
//! checkpoint `never`.
//!
//! Per schedule and m: the step time (best of several), the speedup over the same layers
//! run unpipelined on one thread on the whole batch, the bubble measured on a recorded
//! step (1 − busy time / (workers × makespan)), and the simulator's (`pipe::simulate`,
//! fed the same step's mean action durations and message cost): its bubble, its step
//! time, and the peak of micro-batches held per worker; and the two-core bound: two copies
//! of the whole-batch step run at once on two threads, so that 2 · baseline / their time
//! is the most any schedule on two workers can reach on this machine. Also written:
//! `target/bench/pipe-schedules.svg` (every schedule at m = 8, measured beside simulated)
//! and `target/bench/pipe-trace.json` (ZBV's recorded step as a Chrome trace: open it in
//! Perfetto or chrome://tracing).
//!
//! `cargo bench -p pipe --bench schedules -- [--quick] [--json] [--reps N]`
//! (`cargo xtask bench pipe` runs it). A bad argument exits with status 2.

#[path = "support/stack.rs"]
mod stack;
#[path = "support/timeline.rs"]
mod timeline;

use std::time::Duration;

use pipe::cpu::CpuTensor;
use pipe::simulate::{simulate, Costs};
use pipe::{Batch, Checkpoint, Device, MicroBatch, Pipe, Record, ScheduleKind};
use stack::{best, direct_step, input, load, ones_loss, stack, target_dir, zero};

const BATCH: usize = 256;
const WIDTH: usize = 1024;
const BLOCKS: usize = 8;
const WORKERS: usize = 2;

struct Args {
    quick: bool,
    json: bool,
    reps: usize,
}

fn args() -> Result<Args, lexopt::Error> {
    use lexopt::prelude::*;
    let mut parser = lexopt::Parser::from_env();
    let (mut quick, mut json, mut reps) = (false, false, None);
    while let Some(arg) = parser.next()? {
        match arg {
            Long("quick") => quick = true,
            Long("json") => json = true,
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
    Ok(Args {
        quick,
        json,
        reps: reps.unwrap_or(if quick { 3 } else { 6 }),
    })
}

const KINDS: [ScheduleKind; 8] = ScheduleKind::ALL;

struct Row {
    kind: ScheduleKind,
    m: usize,
    step: Duration,
    bubble: f64,
    simulated_bubble: f64,
    simulated: f64,
    peak: usize,
}

/// The busy fraction's complement over a recorded step's workers.
fn measured_bubble(record: &Record) -> f64 {
    let makespan = record.makespan().as_secs_f64();
    let busy: f64 = record
        .workers()
        .iter()
        .flatten()
        .map(|s| (s.end - s.start).as_secs_f64())
        .sum();
    let workers = record
        .workers()
        .iter()
        .filter(|w| !w.is_empty())
        .count()
        .max(1);
    1.0 - busy / (workers as f64 * makespan.max(1e-12))
}

/// Measures `kind` at `m` micro-batches; returns the row and its recorded step.
fn measure(
    kind: ScheduleKind,
    m: usize,
    reps: usize,
    x: &CpuTensor,
) -> (Row, Record, pipe::Schedule) {
    let stages = WORKERS * kind.stages_per_worker();
    let placement = kind.placement(stages).expect("a placement");
    let devices: Vec<Device> = placement.iter().map(|&w| Device::CpuCore(w)).collect();
    let per = 2 * BLOCKS / stages;
    let split = kind.generate(m, stages).is_ok_and(|s| s.splits_backward());
    let mut pipe = Pipe::builder(stack(BLOCKS, WIDTH), &vec![per; stages])
        .devices(devices)
        .chunks(m)
        .checkpoint(Checkpoint::Never)
        .schedule(kind)
        // Schedules without W actions defer each stage's weight gradients to one flush
        // after its last backward (the pipe bench's setting); zero-bubble schedules place
        // them as W actions.
        .defer_weight_grads(!split)
        .build()
        .expect("a valid pipe");
    let step = best(reps, || {
        pipe.zero_grad();
        pipe.step(Batch::single(x.clone()), ones_loss)
            .expect("step");
    });
    pipe.zero_grad();
    pipe.set_record(true);
    pipe.take_record();
    pipe.step(Batch::single(x.clone()), ones_loss)
        .expect("step");
    let record = pipe.take_record().expect("recording");
    let schedule = kind.generate(m, stages).expect("schedule");
    let sim = Costs::from_record(&record, &schedule).and_then(|c| simulate(&schedule, &c));
    let (simulated_bubble, simulated, peak) = match &sim {
        Ok(s) => (
            s.bubble(),
            s.makespan,
            s.peak_micro_batches.iter().copied().max().unwrap_or(0),
        ),
        Err(e) => {
            eprintln!("schedules bench: {kind} m = {m}: simulation failed: {e}");
            (f64::NAN, f64::NAN, 0)
        }
    };
    let row = Row {
        kind,
        m,
        step,
        bubble: measured_bubble(&record),
        simulated_bubble,
        simulated,
        peak,
    };
    (row, record, schedule)
}

fn main() {
    let a = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("schedules bench: {e}; arguments: [--quick] [--json] [--reps N]");
            std::process::exit(2);
        }
    };
    let load_before = load();
    let x = input(BATCH, WIDTH);
    let mut layers = stack(BLOCKS, WIDTH);
    let whole = MicroBatch {
        index: 0,
        offset: 0,
        len: BATCH,
    };
    let mut baseline = best(a.reps, || direct_step(&mut layers, &x, whole));
    zero(&mut layers);
    let ms: &[usize] = if a.quick { &[8] } else { &[4, 8] };
    let mut rows = Vec::new();
    let mut traces = Vec::new();
    let mut zbv_trace = None;
    for &m in ms {
        for kind in KINDS {
            if kind
                .generate(m, WORKERS * kind.stages_per_worker())
                .is_err()
            {
                continue; // DualPipeV needs m >= 2 workers x 2
            }
            let (row, record, schedule) = measure(kind, m, a.reps, &x);
            if m == 8 {
                if kind == ScheduleKind::Zbv {
                    zbv_trace = Some(pipe::trace::chrome_trace(&record, None));
                }
                traces.push(timeline::Trace {
                    title: format!("{kind}, m = {m}, {WORKERS} workers"),
                    schedule,
                    record,
                });
            }
            rows.push(row);
        }
    }
    let again = best(a.reps, || direct_step(&mut layers, &x, whole));
    baseline = baseline.min(again);
    // What two cores give at best: two copies of the whole-batch step at once, one per
    // thread. No schedule on two workers can beat 2 · baseline / this.
    let mut copies = [stack(BLOCKS, WIDTH), stack(BLOCKS, WIDTH)];
    let both = best(a.reps, || {
        std::thread::scope(|scope| {
            for layers in copies.iter_mut() {
                let x = &x;
                scope.spawn(move || direct_step(layers, x, whole));
            }
        })
    });
    let bound = 2.0 * baseline.as_secs_f64() / both.as_secs_f64();
    let load_after = load();
    let dir = target_dir().join("bench");
    let note = format!(
        "8 x (Linear(1024, 1024) + ReLU), batch 256, f32, 2 workers pinned to cores 0 and 1; measured (top) and simulated (below) per schedule; baseline {:.1} ms; load {load_before}",
        baseline.as_secs_f64() * 1e3
    );
    let written = std::fs::create_dir_all(&dir)
        .and_then(|()| {
            std::fs::write(
                dir.join("pipe-schedules.svg"),
                timeline::svg(&traces, &note),
            )
        })
        .and_then(|()| match &zbv_trace {
            Some(t) => std::fs::write(dir.join("pipe-trace.json"), t),
            None => Ok(()),
        });
    if a.json {
        for r in &rows {
            println!(
                "{{\"bench\":\"schedules\",\"schedule\":\"{}\",\"m\":{},\"workers\":{WORKERS},\"stages\":{},\"step_ms\":{:.3},\"baseline_ms\":{:.3},\"speedup\":{:.4},\"bubble\":{:.4},\"simulated_bubble\":{:.4},\"simulated_ms\":{:.3},\"peak_micro_batches\":{},\"two_core_bound\":{bound:.4},\"load\":{load_after}}}",
                r.kind,
                r.m,
                WORKERS * r.kind.stages_per_worker(),
                r.step.as_secs_f64() * 1e3,
                baseline.as_secs_f64() * 1e3,
                baseline.as_secs_f64() / r.step.as_secs_f64(),
                r.bubble,
                r.simulated_bubble,
                r.simulated * 1e3,
                r.peak
            );
        }
    } else {
        println!(
            "schedules: 8 x (Linear(1024, 1024) + ReLU), batch {BATCH}, {WORKERS} workers pinned to cores 0-1, checkpoint never; best of {} steps",
            a.reps
        );
        println!(
            "baseline (unpipelined, one thread, whole batch): {:.2} ms/step; two copies at once on two threads: {:.2} ms, so no 2-worker schedule can beat {bound:.3}x",
            baseline.as_secs_f64() * 1e3,
            both.as_secs_f64() * 1e3
        );
        println!(
            "{:<20} {:>2} {:>7} {:>9} {:>8} {:>7} {:>9} {:>8} {:>5}",
            "schedule",
            "m",
            "stages",
            "step ms",
            "speedup",
            "bubble",
            "sim. bub",
            "sim. ms",
            "peak"
        );
        for r in &rows {
            println!(
                "{:<20} {:>2} {:>7} {:>9.2} {:>8.3} {:>7.3} {:>9.3} {:>8.2} {:>5}",
                r.kind.to_string(),
                r.m,
                WORKERS * r.kind.stages_per_worker(),
                r.step.as_secs_f64() * 1e3,
                baseline.as_secs_f64() / r.step.as_secs_f64(),
                r.bubble,
                r.simulated_bubble,
                r.simulated * 1e3,
                r.peak
            );
        }
        println!("timeline: {}", dir.join("pipe-schedules.svg").display());
        println!(
            "trace (ZBV, m = 8): {}",
            dir.join("pipe-trace.json").display()
        );
        println!("load average: {load_before} before, {load_after} after");
    }
    if let Err(e) = written {
        eprintln!("schedules bench: could not write {}: {e}", dir.display());
        std::process::exit(1);
    }
}

//! The pipeline benchmark: how close a two-partition pipe comes to the ideal speedup on a
//! compute-bound stack, what the executor costs per action, and a picture of the bubble.
//!
//! - **Throughput rows**: 8 × (Linear(1024, 1024) + ReLU), batch 256, `f32`, two partitions
//!   of 8 layers each, one worker per core (pinned to cores 0 and 1), for m in
//!   {1, 2, 4, 8, 16}, GPipe and 1F1B, checkpoint `never`, `except_last` and `always`.
//!   `speedup` is the training-step throughput (forward and backward of the whole batch)
//!   over the same layers run unpipelined on one thread on the whole batch; `ideal` is
//!   n·m/(m + n − 1). The pipe defers weight gradients
//!   ([`PipeBuilder::defer_weight_grads`](pipe::PipeBuilder::defer_weight_grads)): each
//!   partition computes them after its last backward action, one product per layer over
//!   the whole batch's rows. `held_bytes` is the most the partitions held during the step
//!   (saved activations, checkpointed inputs, and the inputs and output gradients kept for
//!   the deferred weight gradients), summed.
//! - **Per-phase rates**: Linear(1024, 1024)'s forward, input-gradient and weight-gradient
//!   GFLOP/s over the batch whole and in 8 micro-batches (weight gradient per micro-batch
//!   or deferred), one thread.
//! - **GEMM rows** (`support/gemm.rs`): Linear(1024, 1024)'s forward, input-gradient
//!   and weight-gradient products at 32 and 256 rows on `pipe`'s kernel, `matrixmultiply`
//!   and the `gemm` crate, one thread each, GFLOP/s and the ratio to ours.
//! - **Overhead row**: with near-empty layers (8 × (Linear(4, 4) + ReLU), batch 8, m = 8,
//!   GPipe), (pipelined step time − the same actions run directly in one thread) / the
//!   number of actions on the busiest partition.
//! - **Timeline**: `target/bench/pipe-timeline.svg`, one recorded m = 8 step per schedule
//!   (`never`, and GPipe `except_last` to show recomputation) beside its ideal schedule.
//!
//! Every time is the best of several steps (the machine may be shared), the baseline's
//! the best of steps spread over the whole run; the load average is printed with the
//! figures. Arguments: `--quick` (m = 8, `never`, both schedules, the
//! overhead row), `--json` (one JSON object per row), `--reps N`, `--isa avx512|avx2`
//! (`avx2`: `pipe`'s products on its non-AVX-512 path, `ndarray`'s `general_mat_mul`,
//! even where AVX-512F is present). Cargo's own `--bench` argument is ignored; any other
//! argument, or a bad value, is an error (exit status 2). Run by `cargo bench -p pipe --bench pipe -- [--quick] [--json]`
//! (and `cargo xtask bench pipe`).

#[path = "support/gemm.rs"]
mod gemm_rows;
#[path = "support/stack.rs"]
mod stack;
#[path = "support/timeline.rs"]
mod timeline;

use std::fmt::Write as _;
use std::hint::black_box;
use std::time::{Duration, Instant};

use pipe::cpu::{CpuTensor, Linear};
use stack::{avx512, best, direct_step, input, load, ones_loss, stack, target_dir, zero, Layers};

use pipe::{Batch, Checkpoint, Context, Device, Layer, MicroBatch, Phase, Pipe, ScheduleKind};

const BATCH: usize = 256;
const WIDTH: usize = 1024;
const BLOCKS: usize = 8;
const PARTITIONS: usize = 2;

struct Args {
    quick: bool,
    json: bool,
    reps: usize,
    /// `avx2`: `pipe`'s products on its fallback even where AVX-512F is present.
    portable: bool,
}

/// The arguments, or a message for a bad one.
fn args() -> Result<Args, lexopt::Error> {
    use lexopt::prelude::*;
    let mut parser = lexopt::Parser::from_env();
    let (mut quick, mut json, mut reps, mut portable) = (false, false, None, false);
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
            Long("isa") => {
                let isa = parser.value()?.string()?;
                portable = match isa.as_str() {
                    "avx512" => false,
                    "avx2" => true,
                    _ => return Err(format!("--isa {isa}: expected avx512 or avx2").into()),
                };
            }
            // Cargo's own.
            Long("bench") => {}
            _ => return Err(arg.unexpected()),
        }
    }
    Ok(Args {
        quick,
        json,
        reps: reps.unwrap_or(if quick { 6 } else { 7 }),
        portable,
    })
}

struct Row {
    schedule: ScheduleKind,
    m: usize,
    checkpoint: Checkpoint,
    step: Duration,
    speedup: f64,
    ideal: f64,
    held_bytes: usize,
    recompute: Duration,
}

fn build(
    layers: Layers,
    m: usize,
    checkpoint: Checkpoint,
    schedule: ScheduleKind,
) -> Pipe<CpuTensor> {
    let per = layers.len() / PARTITIONS;
    Pipe::builder(layers, &[per; PARTITIONS])
        .devices(Device::cores(PARTITIONS))
        .chunks(m)
        .checkpoint(checkpoint)
        .schedule(schedule)
        .defer_weight_grads(true)
        .build()
        .expect("a valid pipe")
}

/// Times pipelined steps of the stack; returns the row and the layers back.
fn measure(
    layers: Layers,
    x: &CpuTensor,
    m: usize,
    checkpoint: Checkpoint,
    schedule: ScheduleKind,
    reps: usize,
    baseline: Duration,
) -> (Row, Layers) {
    let mut pipe = build(layers, m, checkpoint, schedule);
    let mut held_bytes = 0;
    // Best of `reps` steps after a warm-up, each from zeroed gradients; zeroing is not
    // timed (nor is it in the baseline's steps).
    let mut step = Duration::MAX;
    for rep in 0..=reps {
        pipe.zero_grad();
        let start = Instant::now();
        pipe.step(Batch::single(x.clone()), ones_loss)
            .expect("step");
        let elapsed = start.elapsed();
        held_bytes = pipe.memory().iter().map(|mem| mem.peak).sum();
        if rep > 0 {
            step = step.min(elapsed);
        }
    }
    pipe.zero_grad();
    // One recorded step for the recomputation time on the busiest partition.
    pipe.set_record(true);
    pipe.step(Batch::single(x.clone()), ones_loss)
        .expect("step");
    let record = pipe.take_record().expect("recording");
    let recompute = record
        .workers()
        .iter()
        .map(|spans| {
            spans
                .iter()
                .filter(|s| s.kind == pipe::SpanKind::Recompute)
                .map(|s| s.end - s.start)
                .sum::<Duration>()
        })
        .max()
        .unwrap_or_default();
    let mut layers = pipe.into_layers();
    zero(&mut layers);
    let n = PARTITIONS as f64;
    let row = Row {
        schedule,
        m,
        checkpoint,
        step,
        speedup: baseline.as_secs_f64() / step.as_secs_f64(),
        ideal: n * m as f64 / (m as f64 + n - 1.0),
        held_bytes,
        recompute,
    };
    (row, layers)
}

/// The overhead row: near-empty layers, pipelined against the same actions run directly.
fn overhead(reps: usize) -> (f64, usize, Duration, Duration) {
    const M: usize = 8;
    let x = input(M, 4);
    let mut layers = stack(BLOCKS, 4);
    let plan = MicroBatch::plan(M, M).expect("plan");
    let direct = best(reps, || {
        let parts = Batch::single(x.clone()).split_as(&plan).expect("split");
        for (part, &mb) in parts.into_iter().zip(&plan) {
            direct_step(&mut layers, &part.into_single().expect("single"), mb);
        }
    });
    let mut pipe = build(layers, M, Checkpoint::Never, ScheduleKind::GPipe);
    let pipelined = best(reps, || {
        pipe.step(Batch::single(x.clone()), ones_loss)
            .expect("step");
    });
    let actions = 2 * M; // a forward and a backward per micro-batch on each partition
    let per_action = (pipelined.as_secs_f64() - direct.as_secs_f64()) / actions as f64;
    (per_action * 1e6, actions, pipelined, direct)
}

/// One recorded step for the timeline.
fn trace(
    layers: Layers,
    x: &CpuTensor,
    schedule: ScheduleKind,
    checkpoint: Checkpoint,
) -> (timeline::Trace, Layers) {
    const M: usize = 8;
    let mut pipe = build(layers, M, checkpoint, schedule);
    pipe.step(Batch::single(x.clone()), ones_loss)
        .expect("warm-up step");
    pipe.set_record(true);
    pipe.take_record();
    pipe.step(Batch::single(x.clone()), ones_loss)
        .expect("step");
    let record = pipe.take_record().expect("recording");
    let trace = timeline::Trace {
        title: format!("{schedule}, checkpoint {checkpoint}, m = {M}, n = {PARTITIONS}"),
        schedule: schedule.generate(M, PARTITIONS).expect("schedule"),
        record,
    };
    let mut layers = pipe.into_layers();
    zero(&mut layers);
    (trace, layers)
}

/// GFLOP/s of Linear(1024, 1024)'s phases over the whole batch split into `m`
/// micro-batches, as a partition runs them: the forward pass of every micro-batch, the
/// backward pass without the weight gradient (input and bias gradients) of every
/// micro-batch, and the weight gradient: one product per micro-batch (`deferred` false: a
/// flush after each backward call, what a non-deferring backward call adds) or one flush
/// after all of them.
fn phase_gflops(m: usize, deferred: bool, reps: usize) -> [f64; 3] {
    let mut layer = Linear::new(WIDTH, WIDTH, 0);
    let plan = MicroBatch::plan(BATCH, m).expect("plan");
    let xs: Vec<CpuTensor> = plan.iter().map(|mb| input(mb.len, WIDTH)).collect();
    let flop = 2.0 * (BATCH * WIDTH * WIDTH) as f64;
    let mut saved = Vec::new();
    let forward = best(reps, || {
        saved.clear();
        for (x, &mb) in xs.iter().zip(&plan) {
            let mut ctx = Context::new(true, 0, 0, mb.len).with_micro_batch(mb);
            let (y, s) = layer
                .forward(Batch::single(x.clone()), &mut ctx)
                .expect("forward");
            black_box(y);
            saved.push(s);
        }
    });
    // Returns (backward time, weight gradient time) of one pass over the micro-batches.
    let pass = |layer: &mut Linear| {
        let (mut back, mut weight) = (Duration::ZERO, Duration::ZERO);
        for (s, &mb) in saved.iter().zip(&plan) {
            let mut ctx = Context::new(true, 0, 0, mb.len)
                .with_micro_batch(mb)
                .with_phase(Phase::Backward)
                .with_deferred_weight_grads(true);
            let dy = Batch::single(CpuTensor::ones(&[mb.len, WIDTH]));
            let start = Instant::now();
            black_box(layer.backward(dy, s.clone(), &mut ctx).expect("backward"));
            back += start.elapsed();
            if !deferred {
                let start = Instant::now();
                layer.flush_grads().expect("flush");
                weight += start.elapsed();
            }
        }
        if deferred {
            let start = Instant::now();
            layer.flush_grads().expect("flush");
            weight += start.elapsed();
        }
        (back, weight)
    };
    let (mut back, mut weight) = pass(&mut layer);
    for _ in 0..reps {
        let (b, w) = pass(&mut layer);
        (back, weight) = (back.min(b), weight.min(w));
    }
    layer.zero_grad();
    [forward, back, weight].map(|t| flop / t.as_secs_f64().max(1e-9) / 1e9)
}

fn main() {
    let a = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!(
                "pipe bench: {e}; arguments: [--quick] [--json] [--reps N] [--isa avx512|avx2]"
            );
            std::process::exit(2);
        }
    };
    pipe::cpu::matmul::force_portable(a.portable);
    let isa = if a.portable || !avx512() {
        "avx2"
    } else {
        "avx512"
    };
    let gemm = gemm_rows::rows(WIDTH, if a.quick { 5 } else { 9 });
    let load_before = load();
    let x = input(BATCH, WIDTH);
    let mut layers = stack(BLOCKS, WIDTH);

    // The baseline: the same layers, unpipelined, one thread, the whole batch.
    let whole = MicroBatch {
        index: 0,
        offset: 0,
        len: BATCH,
    };
    let mut baseline = best(a.reps, || direct_step(&mut layers, &x, whole));
    zero(&mut layers);

    let (ms, modes, kinds): (&[usize], &[Checkpoint], &[ScheduleKind]) = if a.quick {
        (
            &[8],
            &[Checkpoint::Never],
            &[ScheduleKind::GPipe, ScheduleKind::OneFOneB],
        )
    } else {
        (
            &[1, 2, 4, 8, 16],
            &[
                Checkpoint::Never,
                Checkpoint::ExceptLast,
                Checkpoint::Always,
            ],
            &[ScheduleKind::GPipe, ScheduleKind::OneFOneB],
        )
    };
    let mut rows = Vec::new();
    for &schedule in kinds {
        for &checkpoint in modes {
            for &m in ms {
                // A baseline step between configurations: on a shared machine the best
                // baseline comes from the whole run, not from its first seconds.
                let again = best(1, || direct_step(&mut layers, &x, whole));
                zero(&mut layers);
                baseline = baseline.min(again);
                let (row, back) = measure(layers, &x, m, checkpoint, schedule, a.reps, baseline);
                layers = back;
                rows.push(row);
            }
        }
    }
    let again = best(a.reps, || direct_step(&mut layers, &x, whole));
    zero(&mut layers);
    baseline = baseline.min(again);
    for row in &mut rows {
        row.speedup = baseline.as_secs_f64() / row.step.as_secs_f64();
    }
    let (overhead_us, actions, pipelined, direct) = overhead(a.reps.max(20) * 5);

    // The timeline.
    let mut traces = Vec::new();
    for (schedule, checkpoint) in [
        (ScheduleKind::GPipe, Checkpoint::Never),
        (ScheduleKind::OneFOneB, Checkpoint::Never),
        (ScheduleKind::GPipe, Checkpoint::ExceptLast),
    ] {
        let (t, back) = trace(layers, &x, schedule, checkpoint);
        layers = back;
        traces.push(t);
    }
    let note = format!(
        "8 x (Linear(1024, 1024) + ReLU), batch 256, f32, 2 partitions pinned to cores 0 and 1; baseline (one thread, whole batch) {:.1} ms; load {}",
        baseline.as_secs_f64() * 1e3,
        load_before
    );
    let svg = timeline::svg(&traces, &note);
    let dir = target_dir().join("bench");
    let path = dir.join("pipe-timeline.svg");
    let written = std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&path, svg));
    let load_after = load();

    if a.json {
        for g in &gemm {
            println!(
                "{{\"gemm\":\"{}\",\"rows\":{},\"isa\":\"{isa}\",\"ours_gflops\":{:.2},\"matrixmultiply_gflops\":{:.2},\"gemm_gflops\":{:.2},\"matrixmultiply_ratio\":{:.3},\"gemm_ratio\":{:.3}}}",
                g.product.name(),
                g.rows,
                g.ours,
                g.matrixmultiply,
                g.gemm,
                g.matrixmultiply / g.ours,
                g.gemm / g.ours
            );
        }
        for r in &rows {
            println!(
                "{{\"schedule\":\"{}\",\"partitions\":{PARTITIONS},\"m\":{},\"checkpoint\":\"{}\",\"speedup\":{:.4},\"ideal\":{:.4},\"held_bytes\":{},\"step_ms\":{:.3},\"baseline_ms\":{:.3},\"load\":{}}}",
                r.schedule,
                r.m,
                r.checkpoint,
                r.speedup,
                r.ideal,
                r.held_bytes,
                r.step.as_secs_f64() * 1e3,
                baseline.as_secs_f64() * 1e3,
                load_after
            );
        }
        println!(
            "{{\"schedule\":\"gpipe\",\"partitions\":{PARTITIONS},\"m\":8,\"overhead_us\":{overhead_us:.2},\"actions\":{actions},\"pipelined_us\":{:.1},\"direct_us\":{:.1}}}",
            pipelined.as_secs_f64() * 1e6,
            direct.as_secs_f64() * 1e6
        );
    } else {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "pipe: 8 x (Linear(1024, 1024) + ReLU), batch {BATCH}, f32, {PARTITIONS} partitions pinned to cores 0-1; best of {} steps",
            a.reps
        );
        let _ = writeln!(
            out,
            "baseline (unpipelined, one thread, whole batch): {:.2} ms/step",
            baseline.as_secs_f64() * 1e3,
        );
        let _ = writeln!(
            out,
            "Linear(1024, 1024) GFLOP/s over batch {BATCH} (forward / input gradient / weight gradient):"
        );
        for (m, deferred, what) in [
            (1, false, "whole batch"),
            (8, false, "8 micro-batches, weight gradient per micro-batch"),
            (
                8,
                true,
                "8 micro-batches, weight gradient deferred to one flush",
            ),
        ] {
            let [f, dx, dw] = phase_gflops(m, deferred, a.reps.max(5));
            let _ = writeln!(out, "  {f:6.1} / {dx:6.1} / {dw:6.1}  {what}");
        }
        let _ = writeln!(
            out,
            "Linear(1024, 1024) products, one thread, {isa} path, GFLOP/s (median of rounds; ratio: library / ours):"
        );
        let _ = writeln!(
            out,
            "  {:<16} {:>4} {:>7} {:>15} {:>6} {:>7} {:>6}",
            "product", "rows", "ours", "matrixmultiply", "ratio", "gemm", "ratio"
        );
        for g in &gemm {
            let _ = writeln!(
                out,
                "  {:<16} {:>4} {:>7.1} {:>15.1} {:>6.2} {:>7.1} {:>6.2}",
                g.product.name(),
                g.rows,
                g.ours,
                g.matrixmultiply,
                g.matrixmultiply / g.ours,
                g.gemm,
                g.gemm / g.ours
            );
        }
        let _ = writeln!(
            out,
            "{:<8} {:<12} {:>3} {:>9} {:>8} {:>6} {:>12} {:>13}",
            "schedule",
            "checkpoint",
            "m",
            "step ms",
            "speedup",
            "ideal",
            "held MiB",
            "recompute ms"
        );
        for r in &rows {
            let _ = writeln!(
                out,
                "{:<8} {:<12} {:>3} {:>9.2} {:>8.3} {:>6.3} {:>12.1} {:>13.2}",
                r.schedule.to_string(),
                r.checkpoint.to_string(),
                r.m,
                r.step.as_secs_f64() * 1e3,
                r.speedup,
                r.ideal,
                r.held_bytes as f64 / (1 << 20) as f64,
                r.recompute.as_secs_f64() * 1e3
            );
        }
        // 1F1B against GPipe, and what except_last costs against the recomputation.
        let find = |s: ScheduleKind, c: Checkpoint| {
            rows.iter()
                .find(|r| r.m == 8 && r.schedule == s && r.checkpoint == c)
        };
        if let (Some(g), Some(o)) = (
            find(ScheduleKind::GPipe, Checkpoint::Never),
            find(ScheduleKind::OneFOneB, Checkpoint::Never),
        ) {
            let _ = writeln!(
                out,
                "m = 8, never: 1F1B throughput / GPipe throughput = {:.3}",
                g.step.as_secs_f64() / o.step.as_secs_f64()
            );
        }
        for s in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
            if let (Some(n), Some(e)) =
                (find(s, Checkpoint::Never), find(s, Checkpoint::ExceptLast))
            {
                let extra = e.step.as_secs_f64() - n.step.as_secs_f64();
                let _ = writeln!(
                    out,
                    "m = 8, {s}: except_last costs {:.2} ms more than never; recomputation on the busiest partition {:.2} ms; ratio {:.2}",
                    extra * 1e3,
                    e.recompute.as_secs_f64() * 1e3,
                    extra / e.recompute.as_secs_f64().max(1e-9)
                );
            }
        }
        let _ = writeln!(
            out,
            "overhead: {overhead_us:.1} us per action ({actions} actions on the busiest partition; near-empty layers, m = 8: pipelined {:.1} us, direct {:.1} us per step)",
            pipelined.as_secs_f64() * 1e6,
            direct.as_secs_f64() * 1e6
        );
        match &written {
            Ok(()) => {
                let _ = writeln!(out, "timeline: {}", path.display());
            }
            Err(e) => {
                let _ = writeln!(out, "timeline: could not write {}: {e}", path.display());
            }
        }
        let _ = writeln!(
            out,
            "load average: {load_before} before, {load_after} after"
        );
        print!("{out}");
    }
    if let Err(e) = written {
        eprintln!("could not write {}: {e}", path.display());
        std::process::exit(1);
    }
}

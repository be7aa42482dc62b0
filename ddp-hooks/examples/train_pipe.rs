//! Pipeline × data parallel training of the teacher-student regression task on a mesh of
//! thread ranks: `--ranks R --pipe P` is P pipeline stages × R/P data-parallel replicas
//! (`ddp_hooks::pipeline::Mesh`; world rank = stage * replicas + replica, Megatron's
//! layout). Each rank holds one stage (one partition of a `pipe::Pipe` whose stages run
//! on the ranks of its replica's pipeline: micro-batches, checkpointing, GPipe or 1F1B),
//! and each stage's gradient buckets go to the communication hook over that stage's
//! replicas as soon as its backward pass is done (`ddp_hooks::pipeline`).
//! `cargo xtask train --pipe 2 --ranks 4` builds and drives it; it also runs on its own:
//!
//! ```sh
//! cargo run --release -p ddp-hooks --features pipe --example train_pipe -- --pipe 2
//! cargo run --release -p ddp-hooks --features pipe --example train_pipe -- \
//!     --pipe 2 --hook powersgd:rank=2,start_iter=10 --checkpoint-mode always --schedule 1f1b
//! ```
//!
//! MLP 64 -> 128 -> 128 -> 32 (ReLU; `pipe`'s layers), teacher a fixed random model of
//! the same shape, inputs N(0, I), target noise 0.01, 2048 samples and batch 64 per
//! replica, SGD lr 0.05 momentum 0.9; 4 ranks as 2 stages × 2 replicas and 1000 steps by
//! default. Prints the final loss on 512 held-out samples, the gradient bytes a rank sent
//! (over its stage's data-parallel group; the activations between stages are not
//! counted), and the step time predicted at 1 and 10 Gbit/s as the `train` example does
//! (measured step time plus the link time of the slowest stage's collectives, which
//! ignores the overlap; `benches/pipeline.rs` measures that). The running loss is the
//! last stage's of replica 0. With `--json`, the same events as `train` (`start`,
//! `step`, `done`), with the pipe's and the mesh's settings added. `--help` lists the
//! arguments; a bad one exits with status 2.

#[path = "mlp/args.rs"]
mod args;

use accum::Accumulator;
use args::{positive, text};
use collectives::link::{Charge, Link, LinkOp, Linked};
use collectives::{run_local, ProcessGroup, ThreadGroup};
use ddp_hooks::pipeline::{DistributedPipe, Mesh};
use ddp_hooks::{HookSpec, ReducerConfig};
use lowrank::{CpuBackend, NormalRng};
use pipe::cpu::{CpuTensor, Linear, ReLU};
use pipe::ndarray::Axis;
use pipe::{Batch, Checkpoint, Layer, MicroBatch, Pipe, ScheduleKind};
use serde_json::json;
use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

const USAGE: &str = "\
arguments:
  --ranks N          thread ranks: --pipe stages x (N / --pipe) replicas (default 4)
  --steps N          optimizer steps (default 1000)
  --hook SPEC        a registry spec: allreduce, fp16, bf16, powersgd:rank=2,start_iter=10,
                     ... (default allreduce)
  --accumulate K     pipelined mini-batches per optimizer step, synchronising only the last
                     (default 1)
  --batch N          samples per mini-batch and replica (default 64; divides 2048)
  --pipe N           pipeline stages, one partition on each rank; 1 to 5, dividing
                     --ranks (default 2)
  --chunks N         micro-batches per mini-batch (default 4)
  --checkpoint-mode MODE
                     activation checkpointing: always, except_last or never
                     (default except_last)
  --schedule NAME    gpipe or 1f1b (default gpipe)
  --compare          allreduce, then PowerSGD at ranks 1, 2 and 4 (start_iter=10)
  --json             one JSON object per line (events, then the result)";

/// Layer widths.
const WIDTHS: [usize; 4] = [64, 128, 128, 32];
/// Training samples per rank.
const SAMPLES: usize = 2048;
/// Held-out samples for the final loss.
const HELD_OUT: usize = 512;
/// Per-message latency of the link the run is priced at.
const LATENCY: Duration = Duration::from_micros(20);
const LR: f32 = 0.05;
const MOMENTUM: f32 = 0.9;

#[derive(Clone, Debug)]
struct Config {
    ranks: usize,
    steps: usize,
    hook: HookSpec,
    hook_text: String,
    accumulate: usize,
    batch: usize,
    pipe: usize,
    chunks: usize,
    checkpoint: Checkpoint,
    schedule: ScheduleKind,
}

fn parse(args: &[String]) -> Result<(Config, Vec<String>, bool), String> {
    let mut c = Config {
        ranks: 4,
        steps: 1000,
        hook: HookSpec::AllReduce,
        hook_text: "allreduce".into(),
        accumulate: 1,
        batch: 64,
        pipe: 2,
        chunks: 4,
        checkpoint: Checkpoint::ExceptLast,
        schedule: ScheduleKind::GPipe,
    };
    let (mut hook, mut compare, mut json_lines) = (None, false, false);
    let mut p = lexopt::Parser::from_args(args.iter().cloned());
    while let Some(arg) = p.next().map_err(|e| e.to_string())? {
        use lexopt::Arg::Long;
        match arg {
            Long("ranks") => c.ranks = positive(&mut p, "--ranks")?,
            Long("steps") => c.steps = positive(&mut p, "--steps")?,
            Long("accumulate") => c.accumulate = positive(&mut p, "--accumulate")?,
            Long("batch") => c.batch = positive(&mut p, "--batch")?,
            Long("pipe") => c.pipe = positive(&mut p, "--pipe")?,
            Long("chunks") => c.chunks = positive(&mut p, "--chunks")?,
            Long("checkpoint-mode") => {
                c.checkpoint = text(&mut p)?
                    .parse()
                    .map_err(|e| format!("--checkpoint-mode: {e}"))?
            }
            Long("schedule") => {
                c.schedule = text(&mut p)?
                    .parse()
                    .map_err(|e| format!("--schedule: {e}"))?
            }
            Long("hook") => hook = Some(text(&mut p)?),
            Long("compare") => compare = true,
            Long("json") => json_lines = true,
            Long(name @ ("save-at" | "checkpoint" | "resume")) => {
                return Err(format!(
                    "--{name}: train_pipe does not save or resume training checkpoints (the train example does); activation checkpointing is --checkpoint-mode"
                ))
            }
            other => return Err(other.unexpected().to_string()),
        }
    }
    if c.pipe > layers_of(&WIDTHS) {
        return Err(format!(
            "--pipe {}: the model has {} layers, so at most {} partitions",
            c.pipe,
            layers_of(&WIDTHS),
            layers_of(&WIDTHS)
        ));
    }
    if !c.ranks.is_multiple_of(c.pipe) {
        return Err(format!(
            "--ranks {} --pipe {}: the ranks must divide into {} stages of equally many replicas",
            c.ranks, c.pipe, c.pipe
        ));
    }
    if !SAMPLES.is_multiple_of(c.batch) {
        return Err(format!(
            "--batch {}: must divide the {SAMPLES} samples of each replica",
            c.batch
        ));
    }
    let hooks = match (compare, hook) {
        (true, Some(_)) => return Err("--compare chooses its hooks; drop --hook".into()),
        (true, None) => [
            "allreduce",
            "powersgd:rank=1,start_iter=10",
            "powersgd:rank=2,start_iter=10",
            "powersgd:rank=4,start_iter=10",
        ]
        .map(String::from)
        .to_vec(),
        (false, h) => vec![h.unwrap_or_else(|| "allreduce".into())],
    };
    for h in &hooks {
        spec(h)?;
    }
    Ok((c, hooks, json_lines))
}

fn spec(text: &str) -> Result<HookSpec, String> {
    text.parse().map_err(|e: ddp_hooks::Error| e.to_string())
}

/// Linear and ReLU layers of an MLP with these widths (ReLU between Linears).
fn layers_of(widths: &[usize]) -> usize {
    2 * (widths.len() - 1) - 1
}

fn mlp(widths: &[usize], seed: u64) -> Vec<Box<dyn Layer<CpuTensor>>> {
    let mut layers: Vec<Box<dyn Layer<CpuTensor>>> = Vec::new();
    for (l, w) in widths.windows(2).enumerate() {
        if l > 0 {
            layers.push(Box::new(ReLU));
        }
        layers.push(Box::new(Linear::new(w[0], w[1], seed + l as u64)));
    }
    layers
}

/// The layers of partition `stage` of `balance`.
fn stage_layers(
    all: Vec<Box<dyn Layer<CpuTensor>>>,
    balance: &[usize],
    stage: usize,
) -> Vec<Box<dyn Layer<CpuTensor>>> {
    let first: usize = balance[..stage].iter().sum();
    all.into_iter().skip(first).take(balance[stage]).collect()
}

/// `layers` split into `parts` consecutive partitions whose sizes differ by at most one.
fn even_balance(layers: usize, parts: usize) -> Vec<usize> {
    (0..parts)
        .map(|j| layers / parts + usize::from(j < layers % parts))
        .collect()
}

fn normal(rows: usize, cols: usize, seed: u64) -> CpuTensor {
    let mut v = vec![0.0; rows * cols];
    NormalRng::new(seed).fill(&mut v);
    CpuTensor::from_shape_vec(&[rows, cols], v).expect("the shape fits the data")
}

/// Inputs and noisy teacher targets.
fn teacher_data(rows: usize, seed: u64) -> Result<(CpuTensor, CpuTensor), pipe::Error> {
    let mut teacher = Pipe::builder(mlp(&WIDTHS, 1000), &[layers_of(&WIDTHS)]).build()?;
    teacher.eval();
    let x = normal(rows, WIDTHS[0], seed);
    let mut y = teacher.forward(Batch::single(x.clone()))?.into_single()?;
    let noise = normal(rows, WIDTHS[3], seed + 1);
    y.array_mut().scaled_add(0.01, noise.array());
    Ok((x, y))
}

/// `½ Σ (y − t)² / denom` over micro-batch `mb` of `target`, and its gradient times
/// `scale`.
fn mse(
    target: &CpuTensor,
    denom: usize,
    scale: f32,
    mb: MicroBatch,
    y: &Batch<CpuTensor>,
) -> Result<(f32, Batch<CpuTensor>), pipe::Error> {
    let y = y.tensor(0)?.array();
    let t = target.array().slice_axis(Axis(0), mb.samples().into());
    let diff = y - &t;
    let loss = 0.5 * diff.iter().map(|d| d * d).sum::<f32>() / denom as f32;
    Ok((
        loss,
        Batch::single(CpuTensor::new(diff.mapv(|d| d * scale / denom as f32))),
    ))
}

fn rows(t: &CpuTensor, start: usize, len: usize) -> CpuTensor {
    CpuTensor::new(
        t.array()
            .slice_axis(Axis(0), (start..start + len).into())
            .to_owned(),
    )
}

enum Event {
    Step { step: usize, loss: f32 },
}

/// What one rank of the mesh ends with.
struct RankOutcome {
    stage: usize,
    replica: usize,
    /// The held-out losses, on the last stage's ranks.
    final_loss: Option<f32>,
    initial_loss: Option<f32>,
    ops: Vec<LinkOp>,
    hook_calls: u64,
    elapsed: Duration,
    /// Of this rank's stage's parameters.
    digest: u64,
}

/// The run, over every rank of the mesh.
struct Outcome {
    final_loss: f32,
    initial_loss: f32,
    /// Gradient bytes sent, over every rank.
    bytes: usize,
    /// The slowest stage's link time for its collectives, at 1 and 10 Gbit/s.
    comm: [Duration; 2],
    /// Hook calls of replica 0's stages together (one model's buckets).
    hook_calls: u64,
    elapsed: Duration,
    /// Replica 0's stages' digests, chained: the whole model's.
    digest: u64,
}

impl Outcome {
    fn bytes_per_step(&self, c: &Config) -> f64 {
        self.bytes as f64 / c.ranks as f64 / c.steps as f64
    }

    /// Measured step time plus the link time of the slowest stage's collectives (no
    /// overlap counted).
    fn step_ms_at(&self, c: &Config, which: usize) -> f64 {
        (self.elapsed + self.comm[which]).as_secs_f64() * 1e3 / c.steps as f64
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The held-out loss of the model on the mesh: every rank of the pipeline runs the
/// forward pass, stage 0 with the inputs; the value on the last stage's ranks.
fn held_out_loss(
    pipe: &mut Pipe<CpuTensor>,
    x: &CpuTensor,
    t: &CpuTensor,
    first: bool,
    last: bool,
) -> Result<Option<f32>, BoxError> {
    pipe.eval();
    let input = if first {
        Batch::single(x.clone())
    } else {
        Batch::new(Vec::new())
    };
    let y = pipe.forward(input);
    pipe.train();
    let y = y?;
    if !last {
        return Ok(None);
    }
    let y = y.into_single()?;
    let d = y.array() - t.array();
    Ok(Some(
        0.5 * d.iter().map(|v| v * v).sum::<f32>() / x.shape()[0] as f32,
    ))
}

/// FNV-1a over the bits of every parameter this rank holds.
fn digest(pipe: &Pipe<CpuTensor>) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for layer in pipe.partitions().iter().flatten() {
        for p in layer.parameters() {
            for x in p.value.array().iter() {
                h = fnv(h, x.to_bits().to_le_bytes());
            }
        }
    }
    h
}

fn fnv<const K: usize>(mut h: u64, bytes: [u8; K]) -> u64 {
    for b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

fn run_rank(
    c: &Config,
    world: ThreadGroup,
    on_event: &dyn Fn(Event),
) -> Result<RankOutcome, BoxError> {
    let mesh = Mesh::new(c.pipe, c.ranks / c.pipe);
    let (stage, replica) = mesh
        .coords(world.rank())
        .ok_or("the world group is larger than the mesh")?;
    let (first, last) = (stage == 0, stage + 1 == c.pipe);
    let (x, t) = teacher_data(SAMPLES, 2 * replica as u64 + 10)?;
    let (hx, ht) = teacher_data(HELD_OUT, 7)?;
    let balance = even_balance(layers_of(&WIDTHS), c.pipe);
    let builder = Pipe::builder(stage_layers(mlp(&WIDTHS, 2), &balance, stage), &balance)
        .chunks(c.chunks)
        .checkpoint(c.checkpoint)
        .schedule(c.schedule);
    let backend = Arc::new(CpuBackend::new().with_threads(1)?);
    let link = Link::gbit(1.0, LATENCY)?;
    let mut log = None;
    let mut ddp = DistributedPipe::on_mesh_with(
        builder,
        mesh,
        Arc::new(world),
        backend.clone(),
        |data| {
            // The stage's data-parallel group, logged.
            let linked = Linked::new(data, link, Charge::Account);
            log = Some(linked.log_handle());
            Ok(c.hook.build(backend.clone(), Arc::new(linked))?)
        },
        ReducerConfig::default(),
    )?;
    let log = log.ok_or("the hook was not built")?;
    let mut velocity: Vec<CpuTensor> = ddp
        .pipe()
        .partitions()
        .iter()
        .flatten()
        .flat_map(|l| {
            l.parameters()
                .into_iter()
                .map(|p| CpuTensor::zeros(p.value.shape()))
        })
        .collect();
    let initial_loss = held_out_loss(ddp.pipe_mut(), &hx, &ht, first, last)?;
    let report_every = (c.steps / 200).max(1);
    let reports = last && replica == 0;
    let mut acc = Accumulator::new(c.accumulate)?;
    let (mut step, mut running) = (0, None::<f32>);
    let started = Instant::now();
    for (micro_step, micro) in acc.epoch(0..c.steps * c.accumulate) {
        let s = (micro * c.batch) % SAMPLES;
        let target = rows(&t, s, c.batch);
        let scale = micro_step.loss_scale();
        let input = if first {
            Batch::single(rows(&x, s, c.batch))
        } else {
            Batch::new(Vec::new())
        };
        let out = micro_step
            .apply(&mut ddp)
            .step(input, |mb, y| mse(&target, c.batch, scale, mb, y))?;
        let loss: f32 = out.losses.iter().sum();
        running = Some(running.map_or(loss, |r| 0.98 * r + 0.02 * loss));
        if !micro_step.sync_gradients() {
            continue;
        }
        let params = ddp.pipe_mut().partitions_mut().iter_mut().flatten();
        let mut v = velocity.iter_mut();
        for layer in params {
            for p in layer.parameters_mut() {
                let v = v.next().ok_or("the model changed its parameters")?;
                v.array_mut()
                    .zip_mut_with(p.grad.array(), |v, g| *v = MOMENTUM * *v + g);
                p.value.array_mut().scaled_add(-LR, v.array());
            }
        }
        ddp.zero_grad();
        step += 1;
        if reports && (step % report_every == 0 || step == c.steps) {
            on_event(Event::Step {
                step,
                loss: running.unwrap_or(f32::NAN),
            });
        }
    }
    let elapsed = started.elapsed();
    let final_loss = held_out_loss(ddp.pipe_mut(), &hx, &ht, first, last)?;
    let ops = std::mem::take(&mut *log.lock().unwrap_or_else(|p| p.into_inner()));
    Ok(RankOutcome {
        stage,
        replica,
        final_loss,
        initial_loss,
        ops,
        hook_calls: ddp.hook_calls(),
        elapsed,
        digest: digest(ddp.pipe()),
    })
}

/// Trains on `c.ranks` thread ranks as a mesh; the run's outcome, after checking that
/// the replicas of every stage end with the same parameters.
fn run_threads(c: &Config, on_event: &(dyn Fn(Event) + Sync)) -> Result<Outcome, String> {
    let outcomes = run_local(c.ranks, |g| {
        run_rank(c, g, on_event).map_err(|e| e.to_string())
    })
    .map_err(|e| e.to_string())?;
    let mut all = Vec::new();
    for (r, o) in outcomes.into_iter().enumerate() {
        all.push(o.map_err(|e| format!("rank {r}: {e}"))??);
    }
    let replicas = c.ranks / c.pipe;
    let (links, latency) = ([1.0, 10.0], LATENCY);
    let mut comm = [Duration::ZERO; 2];
    let mut digest = 0xcbf2_9ce4_8422_2325;
    let mut hook_calls = 0;
    for stage in 0..c.pipe {
        let of_stage = &all[stage * replicas..(stage + 1) * replicas];
        let lead = &of_stage[0];
        if lead.stage != stage || lead.replica != 0 {
            return Err(format!(
                "rank {} is not stage {stage} of replica 0",
                stage * replicas
            ));
        }
        if let Some(o) = of_stage.iter().find(|o| o.digest != lead.digest) {
            return Err(format!(
                "replica {} of stage {stage} ended with other parameters than replica 0",
                o.replica
            ));
        }
        for (slot, gbit) in comm.iter_mut().zip(links) {
            let link = Link::gbit(gbit, latency).map_err(|e| e.to_string())?;
            let stage_comm = of_stage
                .iter()
                .map(|o| {
                    o.ops
                        .iter()
                        .map(|&op| link.cost(replicas, op))
                        .sum::<Duration>()
                })
                .max()
                .unwrap_or_default();
            *slot = (*slot).max(stage_comm);
        }
        digest = fnv(digest, lead.digest.to_le_bytes());
        hook_calls += lead.hook_calls;
    }
    let last = &all[(c.pipe - 1) * replicas];
    let loss = |l: Option<f32>| l.ok_or("the last stage reported no held-out loss");
    Ok(Outcome {
        final_loss: loss(last.final_loss)?,
        initial_loss: loss(last.initial_loss)?,
        bytes: all
            .iter()
            .map(|o| o.ops.iter().map(LinkOp::bytes).sum::<usize>())
            .sum(),
        comm,
        hook_calls,
        elapsed: all.iter().map(|o| o.elapsed).max().unwrap_or_default(),
        digest,
    })
}

fn emit(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}").and_then(|_| out.flush());
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let (base, hooks, json_lines) = match parse(&args) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("train_pipe: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    for hook in hooks {
        let mut c = base.clone();
        c.hook = match spec(&hook) {
            Ok(h) => h,
            Err(e) => {
                eprintln!("train_pipe: {e}");
                return ExitCode::from(2);
            }
        };
        c.hook_text = hook;
        let balance = even_balance(layers_of(&WIDTHS), c.pipe);
        let pipe_json = json!({
            "partitions": c.pipe,
            "stages": c.pipe,
            "replicas": c.ranks / c.pipe,
            "balance": balance,
            "chunks": c.chunks,
            "checkpoint": c.checkpoint.to_string(),
            "schedule": c.schedule.to_string(),
        });
        if json_lines {
            emit(
                &json!({
                    "event": "start",
                    "hook": c.hook_text,
                    "ranks": c.ranks,
                    "steps": c.steps,
                    "accumulate": c.accumulate,
                    "batch": c.batch,
                    "backend": "threads",
                    "pipe": pipe_json,
                })
                .to_string(),
            );
        } else {
            emit(&format!(
                "{}: {} thread ranks = {} stages {balance:?} x {} replicas ({} chunks, checkpoint {}, {}), {} steps, accumulate {}, batch {}",
                c.hook_text,
                c.ranks,
                c.pipe,
                c.ranks / c.pipe,
                c.chunks,
                c.checkpoint,
                c.schedule,
                c.steps,
                c.accumulate,
                c.batch
            ));
        }
        let on_event = |e: Event| {
            let Event::Step { step, loss } = e;
            if json_lines {
                emit(&json!({"event": "step", "step": step, "loss": loss}).to_string());
            } else {
                emit(&format!("step {step}: running loss {loss:.6}"));
            }
        };
        let out = match run_threads(&c, &on_event) {
            Ok(out) => out,
            Err(e) => {
                eprintln!("train_pipe: {e}");
                return ExitCode::FAILURE;
            }
        };
        if json_lines {
            emit(
                &json!({
                    "event": "done",
                    "hook": c.hook_text,
                    "ranks": c.ranks,
                    "steps": c.steps,
                    "accumulate": c.accumulate,
                    "start_step": 0,
                    "final_loss": out.final_loss,
                    "initial_loss": out.initial_loss,
                    "bytes_per_step": out.bytes_per_step(&c),
                    "step_ms_1gbit": out.step_ms_at(&c, 0),
                    "step_ms_10gbit": out.step_ms_at(&c, 1),
                    "seconds": out.elapsed.as_secs_f64(),
                    "digest": format!("{:016x}", out.digest),
                    "hook_calls": out.hook_calls,
                    "backend": format!(" (threads, {} stages x {} replicas)", c.pipe, c.ranks / c.pipe),
                    "pipe": pipe_json,
                })
                .to_string(),
            );
        } else {
            emit(&format!(
                "{}: final loss {:.6} (from {:.6}), {:.0} bytes sent per rank and step, {} hook calls, predicted {:.2} ms/step at 1 Gbit/s, {:.2} at 10 Gbit/s (no overlap counted), model digest {:016x} [{:.1} s]",
                c.hook_text,
                out.final_loss,
                out.initial_loss,
                out.bytes_per_step(&c),
                out.hook_calls,
                out.step_ms_at(&c, 0),
                out.step_ms_at(&c, 1),
                out.digest,
                out.elapsed.as_secs_f64()
            ));
        }
    }
    ExitCode::SUCCESS
}

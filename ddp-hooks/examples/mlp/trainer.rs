//! One rank's training loop, over any process group: the MLP's gradients go through the
//! `ddp-hooks` reducer with the configured hook, `accum`'s `Accumulator` decides which
//! micro-steps synchronise, the group is wrapped in a `Linked` that records every
//! collective (so the run can be priced at any link speed), and checkpoints are saved
//! and loaded at optimizer-step boundaries (the hook's through `CommHook::save_state` and
//! `load_state`, so any registry hook resumes).

use super::checkpoint::{Checkpoint, RunId};
use super::{shapes, teacher_data, Mlp, Sgd, WIDTHS};
use accum::Accumulator;
use collectives::link::{Charge, Link, LinkOp, Linked};
use collectives::{run_local, ProcessGroup};
use ddp_hooks::{CommHook, HookSpec, Reducer, ReducerConfig};
use lowrank::CpuBackend;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Per-message latency of the link the run is priced at.
pub const LATENCY: Duration = Duration::from_micros(20);
/// Held-out samples for the final loss.
const HELD_OUT: usize = 512;

/// A training run.
#[derive(Clone, Debug)]
pub struct Config {
    /// Ranks.
    pub ranks: usize,
    /// Optimizer steps.
    pub steps: usize,
    /// The hook.
    pub hook: HookSpec,
    /// The hook as the user spelled it (checkpoints record it).
    pub hook_text: String,
    /// Micro-steps per optimizer step (gradients accumulate; the last one synchronises).
    pub accumulate: usize,
    /// Samples per micro-step and rank.
    pub batch: usize,
    /// Training samples per rank (cycled through).
    pub samples: usize,
    /// SGD learning rate.
    pub lr: f32,
    /// SGD momentum.
    pub momentum: f32,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            ranks: 2,
            steps: 1000,
            hook: HookSpec::AllReduce,
            hook_text: "allreduce".into(),
            accumulate: 1,
            batch: 64,
            samples: 2048,
            lr: 0.05,
            momentum: 0.9,
        }
    }
}

impl Config {
    /// The identity a checkpoint must match.
    pub fn run_id(&self) -> RunId {
        RunId {
            hook: self.hook_text.clone(),
            ranks: self.ranks,
            steps: self.steps,
            accumulate: self.accumulate,
            batch: self.batch,
        }
    }

    /// Checks the numbers (the hook was checked when parsed).
    pub fn validate(&self) -> Result<(), String> {
        if self.ranks == 0 || self.steps == 0 || self.accumulate == 0 || self.batch == 0 {
            return Err("ranks, steps, accumulate and batch must be at least 1".into());
        }
        if !self.samples.is_multiple_of(self.batch) {
            return Err(format!(
                "the batch ({}) must divide the {} samples of each rank",
                self.batch, self.samples
            ));
        }
        Ok(())
    }
}

/// Checkpointing of one run.
#[derive(Clone, Debug, Default)]
pub struct Plan {
    /// Save every rank's checkpoint into `.1` after `.0` optimizer steps (the run goes on).
    pub save_at: Option<(usize, PathBuf)>,
    /// Continue from the checkpoints in this folder.
    pub resume: Option<PathBuf>,
}

/// What rank 0 reports while it trains.
#[derive(Clone, Debug)]
pub enum Event {
    /// Optimizer steps done, and the running (exponentially averaged) training loss.
    Step { step: usize, loss: f32 },
    /// Checkpoints written after this many steps.
    Saved { step: usize },
}

/// How one rank's run ended.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// Held-out loss at the end.
    pub final_loss: f32,
    /// Held-out loss at the start of this run (after loading, when resuming).
    pub initial_loss: f32,
    /// The step this run started from (0, or the checkpoint's).
    pub start_step: usize,
    /// Payload bytes this rank put into collectives, over the run.
    pub bytes_sent: u64,
    /// Collectives over the run, for pricing.
    pub ops: Vec<LinkOp>,
    /// Wall time of the training loop.
    pub elapsed: Duration,
    /// FNV-1a hash of the final parameters' bits: equal digests, identical models.
    pub digest: u64,
}

impl Outcome {
    /// Optimizer steps this run made.
    pub fn steps_run(&self, config: &Config) -> usize {
        config.steps - self.start_step
    }

    /// Predicted time per optimizer step at `gbit` Gbit/s (ms): the measured wall time per
    /// step plus the ring cost of its collectives (no overlap assumed).
    pub fn step_ms_at(&self, config: &Config, gbit: f64) -> f64 {
        let steps = self.steps_run(config).max(1) as f64;
        let link = Link::gbit(gbit, LATENCY).expect("positive link speeds");
        let comm: Duration = self.ops.iter().map(|&op| link.cost(config.ranks, op)).sum();
        (self.elapsed.as_secs_f64() + comm.as_secs_f64()) * 1e3 / steps
    }

    /// Bytes sent per optimizer step.
    pub fn bytes_per_step(&self, config: &Config) -> f64 {
        self.bytes_sent as f64 / self.steps_run(config).max(1) as f64
    }
}

/// FNV-1a over the bits of every parameter.
pub fn digest(params: &[Vec<f32>]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for x in params.iter().flatten() {
        for b in x.to_bits().to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// Trains rank `group.rank()` of `config`; rank 0 calls `on_event`.
pub fn run_rank<G: ProcessGroup + 'static>(
    group: G,
    config: &Config,
    plan: &Plan,
    on_event: &(dyn Fn(Event) + Sync),
) -> Result<Outcome, String> {
    config.validate()?;
    let rank = group.rank();
    if group.size() != config.ranks {
        return Err(format!(
            "the group has {} ranks, the run {}",
            group.size(),
            config.ranks
        ));
    }
    let teacher = Mlp::random(&WIDTHS, 1);
    let (tx, ty) = teacher_data(&teacher, HELD_OUT, 0.01, 10_000);
    let (x, y) = teacher_data(&teacher, config.samples, 0.01, 100 + rank as u64);
    let shapes = shapes(&WIDTHS);
    let mut model = Mlp::random(&WIDTHS, 2);
    let mut opt = Sgd::new(&model, config.lr, config.momentum);
    let (mut start, mut state) = (0, None);
    if let Some(dir) = &plan.resume {
        let c = Checkpoint::load(dir, rank, &config.run_id())?;
        if c.params.len() != shapes.len() || c.velocity.len() != shapes.len() {
            return Err(format!("{}: the model's shape differs", dir.display()));
        }
        model.params = c.params;
        opt.velocity = c.velocity;
        start = c.step;
        state = Some(c.hook);
    }
    let link = Link::gbit(1.0, LATENCY).map_err(|e| e.to_string())?;
    let linked = Linked::new(group, link, Charge::Account);
    let log = linked.log_handle();
    let be = Arc::new(
        CpuBackend::new()
            .with_threads(1)
            .map_err(|e| e.to_string())?,
    );
    let hook = config
        .hook
        .build(be.clone(), Arc::new(linked))
        .map_err(|e| e.to_string())?;
    if let Some(state) = state {
        hook.load_state(state)
            .map_err(|e| format!("loading the hook's state: {e}"))?;
    }
    let mut reducer =
        Reducer::new(be, &shapes, hook, ReducerConfig::default()).map_err(|e| e.to_string())?;
    let initial_loss = model.loss(&tx, &ty);
    let mut grads: Vec<Vec<f32>> = model.params.iter().map(|p| vec![0.0; p.len()]).collect();
    let (din, dout) = (WIDTHS[0], WIDTHS[WIDTHS.len() - 1]);
    let (batch, k) = (config.batch, config.accumulate);
    let report_every = (config.steps / 200).max(1);
    let mut acc = Accumulator::new(k).map_err(|e| e.to_string())?;
    let mut step = start;
    let mut running = None::<f32>;
    let t = Instant::now();
    for (micro_step, micro) in acc.epoch(start * k..config.steps * k) {
        let s = (micro * batch) % config.samples;
        let loss = model.loss_and_grad(
            &x[s * din..(s + batch) * din],
            &y[s * dout..(s + batch) * dout],
            batch,
            &mut grads,
        );
        running = Some(running.map_or(loss, |r| 0.98 * r + 0.02 * loss));
        {
            // Synchronisation is off for every micro-step but the group's last.
            let mut r = micro_step.apply(&mut reducer);
            let scale = micro_step.loss_scale();
            for p in (0..shapes.len()).rev() {
                let g = r.grad_mut(p).map_err(|e| e.to_string())?;
                g.iter_mut()
                    .zip(&grads[p])
                    .for_each(|(acc, g)| *acc += scale * g);
                r.mark_ready(p).map_err(|e| e.to_string())?;
            }
            r.finish().map_err(|e| e.to_string())?;
        }
        if !micro_step.sync_gradients() {
            continue;
        }
        for p in 0..shapes.len() {
            let g = reducer.grad(p).map_err(|e| e.to_string())?;
            opt.step(&mut model, p, g);
        }
        reducer.zero_grad().map_err(|e| e.to_string())?;
        step += 1;
        if rank == 0 && (step % report_every == 0 || step == config.steps) {
            on_event(Event::Step {
                step,
                loss: running.unwrap_or(f32::NAN),
            });
        }
        if let Some((at, dir)) = &plan.save_at {
            if *at == step {
                Checkpoint {
                    run: config.run_id(),
                    rank,
                    step,
                    params: model.params.clone(),
                    velocity: opt.velocity.clone(),
                    hook: reducer.hook().save_state().map_err(|e| e.to_string())?,
                }
                .save(dir)?;
                if rank == 0 {
                    on_event(Event::Saved { step });
                }
            }
        }
    }
    let elapsed = t.elapsed();
    let ops = std::mem::take(&mut *log.lock().unwrap_or_else(|p| p.into_inner()));
    Ok(Outcome {
        final_loss: model.loss(&tx, &ty),
        initial_loss,
        start_step: start,
        bytes_sent: ops.iter().map(|op| op.bytes() as u64).sum(),
        ops,
        elapsed,
        digest: digest(&model.params),
    })
}

/// Trains on `config.ranks` thread ranks; returns rank 0's outcome after checking that
/// every rank ends with the same model.
pub fn run_threads(
    config: &Config,
    plan: &Plan,
    on_event: &(dyn Fn(Event) + Sync),
) -> Result<Outcome, String> {
    config.validate()?;
    let outs = run_local(config.ranks, |g| run_rank(g, config, plan, on_event))
        .map_err(|e| e.to_string())?;
    let mut outcomes = Vec::with_capacity(outs.len());
    for (rank, out) in outs.into_iter().enumerate() {
        outcomes.push(out.map_err(|e| format!("rank {rank}: {e}"))??);
    }
    let first = outcomes.remove(0);
    if let Some(r) = outcomes.iter().position(|o| o.digest != first.digest) {
        return Err(format!(
            "rank {} ended with a different model than rank 0",
            r + 1
        ));
    }
    Ok(first)
}

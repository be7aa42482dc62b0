//! One rank's training loop, over any process group: the MLP's gradients go through the
//! `ddp-hooks` reducer with the configured hook, `accum`'s `Accumulator` decides which
//! micro-steps synchronise, the group is wrapped in a `Linked` that records every
//! collective (so the run can be priced at any link speed), and checkpoints are saved
//! and loaded at optimizer-step boundaries (the hook's through `CommHook::save_state` and
//! `load_state`, so any registry hook resumes).

use super::checkpoint::{Checkpoint, RunId};
use super::elastic;
use super::{shapes, teacher_data, Mlp, Sgd, WIDTHS};
use accum::Accumulator;
use collectives::link::{Charge, Link, LinkOp, Linked};
use collectives::{run_local, ProcessGroup};
use collectives::{Buffer, ReduceOp};
use ddp_hooks::averaging::{AveragerState, PeriodicModelAverager, PostLocalSgd};
use ddp_hooks::{CommHook, HookSpec, Reducer, ReducerConfig};
use ddp_hooks::{DiLoCo, DiLoCoConfig, DiLoCoState};
use lowrank::CpuBackend;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Per-message latency of the link the run is priced at.
pub const LATENCY: Duration = Duration::from_micros(20);
/// Held-out samples for the final loss.
const HELD_OUT: usize = 512;

/// How the ranks keep their models together.
#[derive(Clone, Debug, PartialEq)]
pub enum Method {
    /// The hook on every synchronised step's gradients (DDP).
    Hook,
    /// Post-local SGD, as PyTorch pairs it: the `PostLocalSgd` hook averages gradients
    /// globally for the first `start` steps and then not at all
    /// (`post_local_gradient_allreduce = false`), and a `PeriodicModelAverager { period,
    /// warmup_steps = start }` averages the parameters after each optimizer step.
    LocalSgd {
        /// Steps between parameter averages.
        period: usize,
        /// `start_localSGD_iter`, and the averager's warmup.
        start: usize,
    },
    /// DiLoCo: `inner_steps` local optimizer steps (SGD with momentum), then an outer
    /// Nesterov step on the pseudo-gradient the configured hook reduces.
    DiLoCo {
        /// Inner steps per outer step (H).
        inner_steps: usize,
        /// Outer learning rate.
        outer_lr: f32,
        /// Outer momentum.
        outer_momentum: f32,
        /// Nesterov outer momentum.
        nesterov: bool,
        /// Streaming fragments (1: the whole model at once).
        fragments: usize,
    },
}

impl Method {
    /// Whether the ranks' models may differ between synchronisations (then the run
    /// averages the parameters once more at its end, so it ends with one model).
    pub fn is_local(&self) -> bool {
        !matches!(self, Method::Hook)
    }
}

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
    /// Per-step hook, local SGD or DiLoCo.
    pub method: Method,
    /// Rank 0 reports the held-out loss every this many steps (and at the start and end).
    pub eval_every: usize,
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
            method: Method::Hook,
            eval_every: 25,
        }
    }
}

impl Config {
    /// The run's name in reports: the hook spec, or the method and its hook
    /// (`local_sgd:period=4,start=10`, `diloco:H=16+allreduce`).
    pub fn label(&self) -> String {
        match &self.method {
            Method::Hook => self.hook_text.clone(),
            Method::LocalSgd { period, start } => {
                format!("local_sgd:period={period},start={start}")
            }
            Method::DiLoCo {
                inner_steps,
                outer_lr,
                outer_momentum,
                nesterov,
                fragments,
            } => {
                let mut l = format!("diloco:H={inner_steps}");
                if (*outer_lr, *outer_momentum, *nesterov) != (0.7, 0.9, true) {
                    l += &format!(
                        ",outer_lr={outer_lr},momentum={outer_momentum},nesterov={nesterov}"
                    );
                }
                if *fragments > 1 {
                    l += &format!(",fragments={fragments}");
                }
                format!("{l}+{}", self.hook_text)
            }
        }
    }

    /// The identity a checkpoint must match.
    pub fn run_id(&self) -> RunId {
        RunId {
            hook: self.label(),
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
        if self.eval_every == 0 {
            return Err("the held-out loss must be reported every 1 or more steps".into());
        }
        match &self.method {
            Method::LocalSgd { period: 0, .. } => {
                return Err("--local-sgd: the period must be at least 1".into())
            }
            Method::DiLoCo {
                inner_steps,
                fragments,
                ..
            } if *inner_steps == 0 || *fragments == 0 => {
                return Err("--diloco and --diloco-fragments must be at least 1".into())
            }
            _ => {}
        }
        if matches!(self.method, Method::LocalSgd { .. }) && self.hook != HookSpec::AllReduce {
            return Err("--local-sgd uses the post-local SGD hook itself: drop --hook".into());
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
    /// Elastic checkpoints (for `torchrun --max-restarts`): every `.1` optimizer steps
    /// into `.0/step-<N>/` (the two newest kept), and at the start the newest step every
    /// rank has, if any (agreed over the group, so a rank killed while saving costs one
    /// save interval, never a mixed restart).
    pub elastic: Option<(PathBuf, usize)>,
    /// Fault injection for the restart tests: rank `.1` kills itself with SIGKILL after
    /// `.0` optimizer steps, on the first attempt only (`TORCHELASTIC_RESTART_COUNT`
    /// unset or 0).
    pub die_at: Option<(usize, usize)>,
}

/// What rank 0 reports while it trains.
#[derive(Clone, Debug)]
pub enum Event {
    /// Optimizer steps done, and the running (exponentially averaged) training loss.
    Step { step: usize, loss: f32 },
    /// Checkpoints written after this many steps.
    Saved { step: usize },
    /// Rank 0's held-out loss after this many steps (every `eval_every`, the first and
    /// the last).
    Eval { step: usize, loss: f32 },
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
    let mut start = 0;
    let mut saved = None;
    if let Some((dir, _)) = &plan.elastic {
        if let Some(step) = elastic::agreed_step(&group, dir)? {
            let c = Checkpoint::load(&elastic::step_dir(dir, step), rank, &config.run_id())?;
            model.params = c.params.clone();
            opt.velocity = c.velocity.clone();
            start = c.step;
            saved = Some(c);
        }
    }
    if let Some(dir) = &plan.resume {
        let c = Checkpoint::load(dir, rank, &config.run_id())?;
        if c.params.len() != shapes.len() || c.velocity.len() != shapes.len() {
            return Err(format!("{}: the model's shape differs", dir.display()));
        }
        model.params = c.params.clone();
        opt.velocity = c.velocity.clone();
        start = c.step;
        saved = Some(c);
    }
    let link = Link::gbit(1.0, LATENCY).map_err(|e| e.to_string())?;
    let linked = Linked::new(group, link, Charge::Account);
    let log = linked.log_handle();
    // Every collective of the run (the hook's, the averager's, DiLoCo's) goes through
    // this one counted group.
    let group: Arc<dyn ProcessGroup> = Arc::new(linked);
    let be = Arc::new(
        CpuBackend::new()
            .with_threads(1)
            .map_err(|e| e.to_string())?,
    );
    let mut sync = ModelSync::new(config, &be, &group, &model)?;
    let hook: Box<dyn CommHook<CpuBackend>> = match &config.method {
        // Pure local SGD after the start: the subgroup is never used.
        Method::LocalSgd { start, .. } => Box::new(
            PostLocalSgd::new(
                be.clone(),
                group.clone(),
                group.clone(),
                *start as u64,
                false,
            )
            .map_err(|e| e.to_string())?,
        ),
        // DiLoCo's inner steps are local; its hook reduces the pseudo-gradient.
        Method::DiLoCo { .. } => HookSpec::Noop
            .build(be.clone(), group.clone())
            .map_err(|e| e.to_string())?,
        Method::Hook => config
            .hook
            .build(be.clone(), group.clone())
            .map_err(|e| e.to_string())?,
    };
    if let Some(c) = saved {
        hook.load_state(c.hook)
            .map_err(|e| format!("loading the hook's state: {e}"))?;
        sync.load(c.averager, c.diloco)?;
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
    // Time rank 0 spends on held-out losses, left out of the step time.
    let mut eval_time = Duration::ZERO;
    if rank == 0 && start == 0 {
        on_event(Event::Eval {
            step: 0,
            loss: initial_loss,
        });
    }
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
        sync.after_step(&mut model)?;
        step += 1;
        if rank == 0 && (step % report_every == 0 || step == config.steps) {
            on_event(Event::Step {
                step,
                loss: running.unwrap_or(f32::NAN),
            });
        }
        if rank == 0 && step % config.eval_every == 0 && step < config.steps {
            let e = Instant::now();
            let loss = model.loss(&tx, &ty);
            eval_time += e.elapsed();
            on_event(Event::Eval { step, loss });
        }
        let save_into = match (&plan.save_at, &plan.elastic) {
            (Some((at, dir)), _) if *at == step => Some(dir.clone()),
            (_, Some((dir, every))) if step % every == 0 && step < config.steps => {
                Some(elastic::step_dir(dir, step))
            }
            _ => None,
        };
        if let Some(dir) = save_into {
            {
                let (averager, diloco) = sync.save()?;
                Checkpoint {
                    run: config.run_id(),
                    rank,
                    step,
                    params: model.params.clone(),
                    velocity: opt.velocity.clone(),
                    hook: reducer.hook().save_state().map_err(|e| e.to_string())?,
                    averager,
                    diloco,
                }
                .save(&dir)?;
                if let Some((root, _)) = &plan.elastic {
                    elastic::prune(root, rank, step)?;
                }
                if rank == 0 {
                    on_event(Event::Saved { step });
                }
            }
        }
        if let Some((at, victim)) = plan.die_at {
            if at == step && rank == victim && elastic::first_attempt() {
                elastic::die();
            }
        }
    }
    if config.method.is_local() {
        // The ranks' models differ since their last synchronisation: one last average,
        // so the run ends with one model (its bytes are counted as the others).
        let mut params: Vec<&mut [f32]> =
            model.params.iter_mut().map(|p| p.as_mut_slice()).collect();
        average(&*group, &mut params)?;
    }
    let elapsed = t.elapsed().saturating_sub(eval_time);
    let final_loss = model.loss(&tx, &ty);
    if rank == 0 {
        on_event(Event::Eval {
            step: config.steps,
            loss: final_loss,
        });
    }
    let ops = std::mem::take(&mut *log.lock().unwrap_or_else(|p| p.into_inner()));
    Ok(Outcome {
        final_loss,
        initial_loss,
        start_step: start,
        bytes_sent: ops.iter().map(|op| op.bytes() as u64).sum(),
        ops,
        elapsed,
        digest: digest(&model.params),
    })
}

/// Averages `params` over `group` in place (divided by the size, then summed, as
/// PyTorch's model averagers do).
fn average(group: &dyn ProcessGroup, params: &mut [&mut [f32]]) -> Result<(), String> {
    let size = group.size() as f32;
    let flat: Vec<f32> = params
        .iter()
        .flat_map(|p| p.iter().map(|&x| x / size))
        .collect();
    let out = group
        .all_reduce(Buffer::from(flat), ReduceOp::Sum)
        .wait_timeout(group.timeout())
        .map_err(|e| e.to_string())?;
    let out = Vec::<f32>::try_from(out).map_err(|e| e.to_string())?;
    let mut offset = 0;
    for p in params.iter_mut() {
        let len = p.len();
        let part = out
            .get(offset..offset + len)
            .ok_or("the averaged parameters came back short")?;
        p.copy_from_slice(part);
        offset += len;
    }
    Ok(())
}

/// What keeps the models together besides the per-step hook: nothing, the local-SGD
/// averager, or DiLoCo's outer loop; called after each optimizer step.
enum ModelSync {
    None,
    Averager(PeriodicModelAverager),
    DiLoCo(Box<DiLoCo<Box<dyn CommHook<CpuBackend>>, CpuBackend>>),
}

impl ModelSync {
    fn new(
        config: &Config,
        be: &Arc<CpuBackend>,
        group: &Arc<dyn ProcessGroup>,
        model: &Mlp,
    ) -> Result<ModelSync, String> {
        Ok(match &config.method {
            Method::Hook => ModelSync::None,
            Method::LocalSgd { period, start } => ModelSync::Averager(
                PeriodicModelAverager::new(*period as u64, *start as u64, group.clone())
                    .map_err(|e| e.to_string())?,
            ),
            Method::DiLoCo {
                inner_steps,
                outer_lr,
                outer_momentum,
                nesterov,
                fragments,
            } => {
                let hook = config
                    .hook
                    .build(be.clone(), group.clone())
                    .map_err(|e| e.to_string())?;
                let params: Vec<&[f32]> = model.params.iter().map(|p| p.as_slice()).collect();
                let d = DiLoCo::with_shapes(
                    DiLoCoConfig {
                        inner_steps: *inner_steps as u64,
                        outer_lr: *outer_lr,
                        outer_momentum: *outer_momentum,
                        nesterov: *nesterov,
                        fragments: *fragments,
                        timeout: group.timeout(),
                    },
                    hook,
                    be.clone(),
                    &params,
                    &shapes(&model.widths),
                )
                .map_err(|e| e.to_string())?;
                ModelSync::DiLoCo(Box::new(d))
            }
        })
    }

    fn after_step(&mut self, model: &mut Mlp) -> Result<(), String> {
        let mut params: Vec<&mut [f32]> =
            model.params.iter_mut().map(|p| p.as_mut_slice()).collect();
        match self {
            ModelSync::None => Ok(()),
            ModelSync::Averager(a) => a
                .average_parameters(&mut params)
                .map(drop)
                .map_err(|e| e.to_string()),
            ModelSync::DiLoCo(d) => d.step(&mut params).map(drop).map_err(|e| e.to_string()),
        }
    }

    /// The averager's and DiLoCo's states, for a checkpoint.
    fn save(&self) -> Result<(Option<AveragerState>, Option<DiLoCoState>), String> {
        Ok(match self {
            ModelSync::None => (None, None),
            ModelSync::Averager(a) => (Some(a.state()), None),
            ModelSync::DiLoCo(d) => (None, Some(d.state().map_err(|e| e.to_string())?)),
        })
    }

    /// Continues from a checkpoint's states (each must be there when its method runs).
    fn load(
        &mut self,
        averager: Option<AveragerState>,
        diloco: Option<DiLoCoState>,
    ) -> Result<(), String> {
        match (self, averager, diloco) {
            (ModelSync::None, None, None) => Ok(()),
            (ModelSync::Averager(a), Some(s), None) => {
                a.load_state(s);
                Ok(())
            }
            (ModelSync::DiLoCo(d), None, Some(s)) => d.load_state(s).map_err(|e| e.to_string()),
            _ => Err("the checkpoint's averaging state does not fit this run's method".into()),
        }
    }
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

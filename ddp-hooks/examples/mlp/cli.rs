//! The arguments of the `train` and `train_mpi` examples, and how they print: plain
//! lines for people, or one JSON object per line (`--json`) for `cargo xtask train`.

use super::args::{positive, text};
use super::trainer::{run_rank, Config, Event, Method, Outcome, Plan};
use collectives::ProcessGroup;
use serde_json::json;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

/// The examples' usage.
pub const USAGE: &str = "\
arguments:
  --ranks N          thread ranks (default 4; train_mpi: the MPI world's size)
  --steps N          optimizer steps (default 1000)
  --hook SPEC        a registry spec: allreduce, fp16, bf16, powersgd:rank=2,start_iter=10,
                     fp16+powersgd:rank=4,start_iter=10, batched_powersgd:... (default allreduce)
  --accumulate K     micro-steps per optimizer step, synchronising only the last (default 1)
  --batch N          samples per micro-step and rank (default 64; divides 2048)
  --local-sgd PERIOD post-local SGD: the post_local_sgd hook averages gradients for the first
                     --local-sgd-start steps, then nothing is sent per step; the parameters are
                     averaged every PERIOD steps from then on (PeriodicModelAverager)
  --local-sgd-start S
                     start_localSGD_iter and the averager's warmup (default 10)
  --diloco H         DiLoCo: H local steps of SGD (lr 0.05, momentum 0.9), then an outer
                     Nesterov step on the pseudo-gradient, which --hook reduces
  --diloco-outer-lr X, --diloco-outer-momentum X
                     the outer optimizer (default 0.7 and 0.9, Nesterov)
  --diloco-fragments F
                     streaming DiLoCo: F fragments synchronised in turn (default 1)
  --eval-every N     report the held-out loss every N steps (default 25)
  --compare          allreduce, then PowerSGD at ranks 1, 2 and 4 (start_iter=10)
  --save-at K --checkpoint DIR
                     also save every rank's checkpoint after K steps
  --resume DIR       continue from the checkpoints in DIR
  --elastic DIR --save-every K
                     elastic checkpoints (for torchrun --max-restarts): save into DIR every K
                     steps, and start from the newest step every rank saved there, if any
  --die-at STEP[:RANK]
                     fault injection for restart tests: rank RANK (default 1) kills itself
                     with SIGKILL after STEP steps, on torchrun's first attempt only
  --json             one JSON object per line (events, then the result)";

/// Parsed arguments.
pub struct Cli {
    /// The run (for `--compare`, the first of them).
    pub config: Config,
    /// Checkpointing.
    pub plan: Plan,
    /// The hooks to train with, in order (one unless `--compare`).
    pub hooks: Vec<String>,
    /// JSON lines instead of text.
    pub json: bool,
}

/// Parses `args` (without the program name); `default_ranks` is the thread examples' 4
/// or the MPI world's size. The error says what is wrong.
pub fn parse(args: &[String], default_ranks: usize) -> Result<Cli, String> {
    let mut config = Config {
        ranks: default_ranks,
        ..Config::default()
    };
    let mut hook = None;
    let mut compare = false;
    let mut json = false;
    let (mut save_at, mut checkpoint, mut resume) = (None, None, None);
    let (mut elastic, mut save_every, mut die_at) = (None, None, None);
    let (mut local_sgd, mut local_sgd_start) = (None, None);
    let (mut diloco, mut fragments, mut outer_lr, mut outer_momentum) = (None, None, None, None);
    let mut p = lexopt::Parser::from_args(args.iter().cloned());
    while let Some(arg) = p.next().map_err(|e| e.to_string())? {
        use lexopt::Arg::Long;
        match arg {
            Long("ranks") => config.ranks = positive(&mut p, "--ranks")?,
            Long("steps") => config.steps = positive(&mut p, "--steps")?,
            Long("accumulate") => config.accumulate = positive(&mut p, "--accumulate")?,
            Long("batch") => config.batch = positive(&mut p, "--batch")?,
            Long("hook") => hook = Some(text(&mut p)?),
            Long("compare") => compare = true,
            Long("local-sgd") => local_sgd = Some(positive(&mut p, "--local-sgd")?),
            Long("local-sgd-start") => {
                local_sgd_start = Some(natural(&mut p, "--local-sgd-start")?)
            }
            Long("diloco") => diloco = Some(positive(&mut p, "--diloco")?),
            Long("diloco-fragments") => fragments = Some(positive(&mut p, "--diloco-fragments")?),
            Long("diloco-outer-lr") => outer_lr = Some(real(&mut p, "--diloco-outer-lr")?),
            Long("diloco-outer-momentum") => {
                outer_momentum = Some(real(&mut p, "--diloco-outer-momentum")?)
            }
            Long("eval-every") => config.eval_every = positive(&mut p, "--eval-every")?,
            Long("save-at") => save_at = Some(positive(&mut p, "--save-at")?),
            Long("checkpoint") => checkpoint = Some(PathBuf::from(text(&mut p)?)),
            Long("resume") => resume = Some(PathBuf::from(text(&mut p)?)),
            Long("elastic") => elastic = Some(PathBuf::from(text(&mut p)?)),
            Long("save-every") => save_every = Some(positive(&mut p, "--save-every")?),
            Long("die-at") => die_at = Some(step_and_rank(&text(&mut p)?)?),
            Long("json") => json = true,
            other => return Err(other.unexpected().to_string()),
        }
    }
    config.method = match (local_sgd, diloco) {
        (Some(_), Some(_)) => return Err("--local-sgd and --diloco: one method at a time".into()),
        (Some(period), None) => {
            if hook.as_deref().is_some_and(|h| h.trim() != "allreduce") {
                return Err("--local-sgd uses the post-local SGD hook itself: drop --hook".into());
            }
            Method::LocalSgd {
                period,
                start: local_sgd_start.unwrap_or(10),
            }
        }
        (None, Some(inner_steps)) => Method::DiLoCo {
            inner_steps,
            outer_lr: outer_lr.unwrap_or(0.7),
            outer_momentum: outer_momentum.unwrap_or(0.9),
            // Nesterov needs a momentum (an outer momentum of 0 is plain outer SGD).
            nesterov: outer_momentum.is_none_or(|m| m > 0.0),
            fragments: fragments.unwrap_or(1),
        },
        (None, None) => Method::Hook,
    };
    if local_sgd.is_none() && local_sgd_start.is_some() {
        return Err("--local-sgd-start needs --local-sgd PERIOD".into());
    }
    if diloco.is_none() && (fragments.is_some() || outer_lr.is_some() || outer_momentum.is_some()) {
        return Err("--diloco-fragments and --diloco-outer-* need --diloco H".into());
    }
    if compare && config.method != Method::Hook {
        return Err("--compare chooses its runs; drop --local-sgd and --diloco".into());
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
    let plan = Plan {
        save_at: match (save_at, checkpoint.clone()) {
            (Some(k), Some(dir)) => Some((k, dir)),
            (None, None) => None,
            (Some(_), None) => return Err("--save-at needs --checkpoint DIR".into()),
            (None, Some(_)) if resume.is_none() => {
                return Err("--checkpoint needs --save-at K".into())
            }
            (None, Some(_)) => None,
        },
        resume,
        elastic: match (elastic, save_every) {
            (Some(dir), Some(k)) => Some((dir, k)),
            (None, None) => None,
            (Some(_), None) => return Err("--elastic DIR needs --save-every K".into()),
            (None, Some(_)) => return Err("--save-every K needs --elastic DIR".into()),
        },
        die_at,
    };
    if let Some((_, victim)) = plan.die_at {
        if victim >= config.ranks {
            return Err(format!(
                "--die-at: rank {victim} is not below {}",
                config.ranks
            ));
        }
    }
    if plan.elastic.is_some() && (plan.save_at.is_some() || plan.resume.is_some()) {
        return Err("--elastic manages its own checkpoints: drop --save-at and --resume".into());
    }
    if compare && (plan.save_at.is_some() || plan.resume.is_some() || plan.elastic.is_some()) {
        return Err("--compare does not checkpoint".into());
    }
    if let Some((k, _)) = &plan.save_at {
        if *k >= config.steps {
            return Err(format!(
                "--save-at {k}: must be below --steps {}",
                config.steps
            ));
        }
    }
    config.hook_text = hooks[0].clone();
    config.hook = spec(&hooks[0])?;
    config.validate()?;
    Ok(Cli {
        config,
        plan,
        hooks,
        json,
    })
}

/// `STEP` or `STEP:RANK` (rank 1 by default), for `--die-at`.
fn step_and_rank(v: &str) -> Result<(usize, usize), String> {
    let bad = || format!("--die-at {v}: expected STEP or STEP:RANK (non-negative integers)");
    let (step, rank) = v.split_once(':').unwrap_or((v, "1"));
    Ok((
        step.parse().map_err(|_| bad())?,
        rank.parse().map_err(|_| bad())?,
    ))
}

/// The next value, a non-negative integer (`name` for the message).
fn natural(p: &mut lexopt::Parser, name: &str) -> Result<usize, String> {
    let v = text(p)?;
    v.parse::<usize>()
        .map_err(|_| format!("{name} {v}: expected a non-negative integer"))
}

/// The next value, a finite non-negative number (`name` for the message).
fn real(p: &mut lexopt::Parser, name: &str) -> Result<f32, String> {
    let v = text(p)?;
    v.parse::<f32>()
        .ok()
        .filter(|x| x.is_finite() && *x >= 0.0)
        .ok_or_else(|| format!("{name} {v}: expected a finite number >= 0"))
}

/// Parses a hook spec; the error is the registry's.
pub fn spec(text: &str) -> Result<ddp_hooks::HookSpec, String> {
    text.parse().map_err(|e: ddp_hooks::Error| e.to_string())
}

/// A note when PowerSGD would not start compressing within the run (its `start_iter`
/// defaults to PyTorch's 1000).
pub fn start_iter_note(config: &Config) -> Option<String> {
    use ddp_hooks::HookSpec::*;
    let inner = match &config.hook {
        Fp16Wrapped(h) | Bf16Wrapped(h) => h.as_ref(),
        h => h,
    };
    match inner {
        PowerSgd(c) | BatchedPowerSgd(c) if c.start_powersgd_iter as usize >= config.steps => {
            Some(format!(
                "note: PowerSGD compresses from step start_iter = {} on, and this run has {} steps: it is allreduce throughout (set start_iter, e.g. powersgd:rank=2,start_iter=10)",
                c.start_powersgd_iter, config.steps
            ))
        }
        _ => None,
    }
}

/// Prints one event (rank 0 only).
pub fn print_event(json_lines: bool, event: Event) {
    let line = match (json_lines, event) {
        (true, Event::Step { step, loss }) => {
            json!({"event": "step", "step": step, "loss": loss}).to_string()
        }
        (true, Event::Saved { step }) => json!({"event": "saved", "step": step}).to_string(),
        (true, Event::Eval { step, loss }) => {
            json!({"event": "eval", "step": step, "loss": loss}).to_string()
        }
        (false, Event::Eval { step, loss }) => format!("step {step}: held-out loss {loss:.6}"),
        (false, Event::Step { step, loss }) => format!("step {step}: running loss {loss:.6}"),
        (false, Event::Saved { step }) => format!("step {step}: checkpoint saved"),
    };
    emit(&line);
}

/// Prints the start of a run.
pub fn print_start(json_lines: bool, config: &Config, backend: &str) {
    let line = if json_lines {
        json!({
            "event": "start",
            "hook": config.label(),
            "hook_spec": config.hook_text,
            "ranks": config.ranks,
            "steps": config.steps,
            "accumulate": config.accumulate,
            "batch": config.batch,
            "backend": backend,
        })
        .to_string()
    } else {
        format!(
            "{}: {} {backend} ranks, {} steps, accumulate {}, batch {}",
            config.label(),
            config.ranks,
            config.steps,
            config.accumulate,
            config.batch
        )
    };
    emit(&line);
}

/// Prints how a run ended.
pub fn print_done(json_lines: bool, config: &Config, out: &Outcome) {
    let line = if json_lines {
        json!({
            "event": "done",
            "hook": config.label(),
            "hook_spec": config.hook_text,
            "ranks": config.ranks,
            "steps": config.steps,
            "accumulate": config.accumulate,
            "start_step": out.start_step,
            "final_loss": out.final_loss,
            "initial_loss": out.initial_loss,
            "bytes_per_step": out.bytes_per_step(config),
            "step_ms_1gbit": out.step_ms_at(config, 1.0),
            "step_ms_10gbit": out.step_ms_at(config, 10.0),
            "seconds": out.elapsed.as_secs_f64(),
            "digest": format!("{:016x}", out.digest),
        })
        .to_string()
    } else {
        format!(
            "{}: final loss {:.6} (from {:.6}), {:.0} bytes sent per rank and step, predicted {:.2} ms/step at 1 Gbit/s, {:.2} at 10 Gbit/s, model digest {:016x} [{:.1} s]",
            config.label(),
            out.final_loss,
            out.initial_loss,
            out.bytes_per_step(config),
            out.step_ms_at(config, 1.0),
            out.step_ms_at(config, 10.0),
            out.digest,
            out.elapsed.as_secs_f64()
        )
    };
    emit(&line);
}

fn emit(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}").and_then(|_| out.flush());
}

/// The main of an example that runs one rank per process (`train_mpi`, `train_dist`):
/// refuses the thread-only flags, makes the group with `join` (the world's size is the
/// rank count), parses the rest, trains, and prints as `train` does (rank 0); with
/// `digest_line`, every rank also prints the digest of its final parameters.
pub fn process_main<G: ProcessGroup + 'static>(
    name: &str,
    backend: &str,
    join: impl FnOnce() -> Result<G, String>,
    digest_line: bool,
) -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(a) = args.iter().find(|a| *a == "--ranks" || *a == "--compare") {
        eprintln!("{name}: {a} is not for multi-process runs (the world's size is the rank count)");
        return ExitCode::from(2);
    }
    let world = match join() {
        Ok(w) => w,
        Err(e) => {
            eprintln!("{name}: joining the job: {e}");
            return ExitCode::FAILURE;
        }
    };
    let rank = world.rank();
    let c = match parse(&args, world.size()) {
        Ok(c) => c,
        Err(e) => {
            if rank == 0 {
                eprintln!("{name}: {e}\n\n{USAGE}");
            }
            return ExitCode::from(2);
        }
    };
    if rank == 0 {
        if let Some(note) = start_iter_note(&c.config) {
            eprintln!("{name}: {note}");
        }
        print_start(c.json, &c.config, backend);
    }
    let json = c.json;
    // The group moves into the run and is dropped (MPI finalised) when it ends.
    match run_rank(world, &c.config, &c.plan, &|e| print_event(json, e)) {
        Ok(out) => {
            if rank == 0 {
                print_done(c.json, &c.config, &out);
            }
            if digest_line {
                println!(
                    "{name}: rank {rank} started at step {} digest {:016x}",
                    out.start_step, out.digest
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{name}: rank {rank}: {e}");
            ExitCode::FAILURE
        }
    }
}

//! `cargo xtask train`: trains the teacher-student MLP with the crates together.
//!
//! The training itself is the `ddp-hooks` example `train` (thread ranks) or `train_mpi`
//! (one process per rank under `mpirun`, built with `collectives/mpi`): the model code
//! lives next to the crate it exercises, and this file only builds the examples, runs
//! them with `--json`, draws a progress bar from their events, and compares runs
//! (`--compare`, the resume check, the MPI check). xtask stays free of the library
//! crates.

use crate::{on_path, workspace_root, Failure};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};

/// How far the MPI run's final loss may be from the thread run's (relative), as the
/// issue asks. With the MPI backend's deterministic reductions (its default) the runs end
/// bit-identical; native `MPI_Iallreduce` (`COLLECTIVES_MPI_DETERMINISTIC=0`) adds in its
/// own order, and PowerSGD carries that rounding into later steps.
const MPI_TOLERANCE: f64 = 1e-5;

/// The MPI backend's switch between its deterministic reductions (`1`, the default) and
/// native `MPI_Iallreduce` (`0`): `collectives::mpi::DETERMINISTIC_ENV`.
const DETERMINISTIC_ENV: &str = "COLLECTIVES_MPI_DETERMINISTIC";

/// How closely the MPI run must match the thread run.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Match {
    /// Final losses within [`MPI_TOLERANCE`] relative (`train --backend mpi`).
    Tolerance,
    /// The same final loss and model digest, bit for bit (`cargo xtask test`).
    BitIdentical,
}

/// The runs of `--compare`, allreduce first (the baseline): (hook spec, the example's
/// extra flags, whether the row is optional: a spec the example does not know yet is
/// left out with a note instead of failing the comparison).
const COMPARE: [(&str, &[&str], bool); 11] = [
    ("allreduce", &[], false),
    ("powersgd:rank=1,start_iter=10", &[], false),
    ("powersgd:rank=2,start_iter=10", &[], false),
    ("powersgd:rank=4,start_iter=10", &[], false),
    ("quantize_per_tensor", &[], false),
    ("quantize_per_channel", &[], false),
    ("quantize_per_channel+ef", &[], true),
    ("allreduce", &["--local-sgd", "4"], false),
    ("allreduce", &["--local-sgd", "16"], false),
    ("allreduce", &["--diloco", "16"], false),
    ("allreduce", &["--diloco", "64"], false),
];

/// The goals `--compare` reports against: (row label prefix, the most its final loss may
/// exceed allreduce's (relative), the least factor of fewer bytes per step it must send).
const GOALS: [(&str, f64, f64); 3] = [
    ("local_sgd:", 0.03, 10.0),
    ("diloco:", 0.03, 10.0),
    ("quantize_per_channel+ef", 0.01, 1.0),
];

/// Where the process group lives.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Backend {
    Threads,
    Mpi,
}

/// What `cargo xtask train` was asked to do: its own flags, and the example's, which it
/// passes through as given (the example parses and checks them: one parser per flag).
pub struct Options {
    /// `--ranks N`: `mpirun -np N` needs it, and the examples get it.
    ranks: usize,
    /// `--hook SPEC`: the run's label, and what `--compare` replaces.
    hook: String,
    compare: bool,
    resume_at: Option<usize>,
    backend: Backend,
    /// `--pipe P`: the `train_pipe` example on a mesh of P pipeline stages × `ranks / P`
    /// data-parallel replicas, one stage on each rank (P must divide `--ranks`).
    pipe: Option<usize>,
    /// Every other argument, for the example (`--steps`, `--accumulate`, `--batch`, and
    /// `train_pipe`'s `--chunks`, `--schedule`, ...).
    example_args: Vec<String>,
}

impl Options {
    /// The example that trains, and the features it needs.
    fn trainer(&self) -> (&'static str, &'static [&'static str]) {
        if self.pipe.is_some() {
            ("train_pipe", &["pipe"])
        } else {
            ("train", &[])
        }
    }
}

/// Why `train` stopped.
pub enum TrainError {
    /// Bad input (exit status 2): xtask's own flags, or the example's verdict on them.
    Usage(String),
    /// A step failed.
    Failed(Failure),
}

impl From<Failure> for TrainError {
    fn from(f: Failure) -> Self {
        TrainError::Failed(f)
    }
}

impl From<std::io::Error> for TrainError {
    fn from(e: std::io::Error) -> Self {
        TrainError::Failed(Failure(e.to_string()))
    }
}

/// Parses the flags of `train` (lexopt): xtask's own, and the example's, kept as given
/// for it; the error is for the usage message. A bad value of an example's flag is the
/// example's to report (it exits with status 2, which is a usage error here too).
pub fn parse(args: &[String]) -> Result<Options, String> {
    let mut o = Options {
        ranks: 4,
        hook: "allreduce".into(),
        compare: false,
        resume_at: None,
        backend: Backend::Threads,
        pipe: None,
        example_args: Vec::new(),
    };
    let mut hook_given = false;
    let mut p = lexopt::Parser::from_args(args.iter().cloned());
    while let Some(arg) = p.next().map_err(|e| e.to_string())? {
        use lexopt::Arg::{Long, Short, Value};
        match arg {
            Long("ranks") => o.ranks = positive(&mut p, "--ranks")?,
            Long("resume-at") => o.resume_at = Some(positive(&mut p, "--resume-at")?),
            Long("pipe") => o.pipe = Some(positive(&mut p, "--pipe")?),
            Long("hook") => {
                o.hook = text(&mut p)?;
                hook_given = true;
            }
            Long("compare") => o.compare = true,
            Long("backend") => {
                o.backend = match text(&mut p)?.as_str() {
                    "threads" => Backend::Threads,
                    "mpi" => Backend::Mpi,
                    other => return Err(format!("unknown backend `{other}`; known: threads, mpi")),
                }
            }
            Long("json" | "save-at" | "checkpoint" | "resume") => {
                return Err(format!(
                    "{}: xtask sets it itself (see --resume-at)",
                    arg_text(&arg)
                ))
            }
            // The example's: passed through in order, values and all.
            Long(name) => {
                let flag = format!("--{name}");
                match p.optional_value() {
                    Some(v) => o.example_args.push(format!("{flag}={}", os(v)?)),
                    None => o.example_args.push(flag),
                }
            }
            Short(c) => o.example_args.push(format!("-{c}")),
            Value(v) => o.example_args.push(os(v)?),
        }
    }
    if o.compare && hook_given {
        return Err("--compare chooses its hooks and methods; drop --hook".into());
    }
    let modes = [o.compare, o.resume_at.is_some(), o.backend == Backend::Mpi];
    if modes.iter().filter(|&&m| m).count() > 1 {
        return Err(
            "--compare, --resume-at and --backend mpi are separate runs: one at a time".into(),
        );
    }
    if o.pipe.is_some() && (o.resume_at.is_some() || o.backend == Backend::Mpi) {
        return Err(
            "--pipe trains on thread ranks without checkpoints: drop --resume-at and --backend mpi"
                .into(),
        );
    }
    if let Some(p) = o.pipe {
        if !o.ranks.is_multiple_of(p) {
            return Err(format!(
                "--ranks {} --pipe {p}: --pipe stages of --ranks / --pipe replicas each, so --pipe must divide --ranks",
                o.ranks
            ));
        }
    }
    Ok(o)
}

/// An argument as UTF-8 text.
fn os(v: std::ffi::OsString) -> Result<String, String> {
    v.into_string()
        .map_err(|v| format!("{}: not valid UTF-8", v.to_string_lossy()))
}

/// A flag as the user wrote it, for a message.
fn arg_text(arg: &lexopt::Arg<'_>) -> String {
    match arg {
        lexopt::Arg::Long(n) => format!("--{n}"),
        lexopt::Arg::Short(c) => format!("-{c}"),
        lexopt::Arg::Value(v) => v.to_string_lossy().into_owned(),
    }
}

/// The next value, as UTF-8 text.
fn text(p: &mut lexopt::Parser) -> Result<String, String> {
    p.value().map_err(|e| e.to_string()).and_then(os)
}

/// The next value, a positive integer (`name` for the message).
fn positive(p: &mut lexopt::Parser, name: &str) -> Result<usize, String> {
    let v = text(p)?;
    v.parse::<usize>()
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("{name} {v}: expected a positive integer"))
}

/// Runs what `o` asks for.
pub fn run(o: Options) -> Result<(), TrainError> {
    if o.compare {
        return compare(&o);
    }
    if let Some(k) = o.resume_at {
        return resume_check(&o, k);
    }
    if o.backend == Backend::Mpi {
        let (threads, mpi) = mpi_pair(&o, true, &[])?;
        summary(&threads);
        summary(&mpi);
        return mpi_verdict(&threads, &mpi, Match::Tolerance);
    }
    let (name, features) = o.trainer();
    let exe = build_example(name, features, true)?;
    let done = run_child(example(&exe, &o, &o.hook), &o.hook)?;
    summary(&done);
    Ok(())
}

/// The short MPI runs of `cargo xtask test`, each against the same run on thread ranks
/// (test builds, shared with `cargo test`), with the deterministic reductions: they must
/// end bit-identical. 2 processes, PowerSGD with accumulation; then 4 processes, PowerSGD
/// for 200 steps (where native `MPI_Iallreduce`, adding in its own order, drifts by
/// 3e-4). Together about 10 s on 2 cores once built.
pub fn mpi_check() -> Result<(), Failure> {
    let run = |ranks: usize, steps: usize, hook: &str, extra: &[&str]| {
        let mut example_args = vec!["--steps".into(), steps.to_string()];
        example_args.extend(extra.iter().map(|a| a.to_string()));
        let o = Options {
            ranks,
            hook: hook.into(),
            compare: false,
            resume_at: None,
            backend: Backend::Mpi,
            pipe: None,
            example_args,
        };
        let (threads, mpi) = mpi_pair(&o, false, &[(DETERMINISTIC_ENV, "1")])?;
        mpi_verdict(&threads, &mpi, Match::BitIdentical)
    };
    let powersgd = "powersgd:rank=2,start_iter=10";
    // PowerSGD with accumulation and without; the quantisation hook with error feedback
    // (all-gathers of bytes), local SGD (parameter averaging) and DiLoCo (the outer step
    // through the hook): each bit-identical to the same run on thread ranks.
    let result = run(2, 60, powersgd, &["--accumulate", "2"])
        .and_then(|()| run(4, 200, powersgd, &["--accumulate", "1"]))
        .and_then(|()| run(2, 40, "quantize_per_channel+ef", &[]))
        .and_then(|()| run(2, 40, "allreduce", &["--local-sgd", "4"]))
        .and_then(|()| run(2, 40, "allreduce", &["--diloco", "8"]));
    match result {
        Ok(()) => Ok(()),
        Err(TrainError::Failed(f)) => Err(f),
        Err(TrainError::Usage(why)) => Err(Failure(why)),
    }
}

/// Builds `cargo build [--release] -p ddp-hooks --example NAME` and returns the binary.
fn build_example(name: &str, features: &[&str], release: bool) -> Result<PathBuf, Failure> {
    let mut args = vec!["build", "-p", "ddp-hooks", "--example", name];
    if release {
        args.push("--release");
    }
    for f in features {
        args.extend(["--features", f]);
    }
    crate::built_target(&args, name)
}

/// The example's arguments for one run of `hook`: xtask's (`--json`, the hook, the
/// ranks, the pipe), then the user's as given.
fn run_args(o: &Options, hook: &str, with_ranks: bool) -> Vec<String> {
    let mut a = vec!["--json".to_string(), "--hook".into(), hook.to_string()];
    if with_ranks {
        a.extend(["--ranks".into(), o.ranks.to_string()]);
    }
    if let Some(p) = o.pipe {
        a.extend(["--pipe".into(), p.to_string()]);
    }
    a.extend(o.example_args.iter().cloned());
    a
}

/// The thread example, run in the workspace root.
fn example(exe: &PathBuf, o: &Options, hook: &str) -> Command {
    let mut cmd = Command::new(exe);
    cmd.args(run_args(o, hook, true))
        .current_dir(workspace_root());
    cmd
}

/// Runs a training child, drawing its progress; returns its `done` event. The example
/// rejecting its arguments (status 2) is a usage error.
fn run_child(mut cmd: Command, label: &str) -> Result<Value, TrainError> {
    cmd.stdout(Stdio::piped()).stderr(Stdio::inherit());
    let mut child = cmd
        .spawn()
        .map_err(|e| Failure(format!("could not start {cmd:?}: {e}")))?;
    let stdout = child.stdout.take().expect("stdout is piped");
    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template("{elapsed:>4} [{bar:30}] {pos}/{len} steps {msg}")
            .expect("a valid template")
            .progress_chars("=> "),
    );
    let mut done = None;
    let mut evals = Vec::new();
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        let Ok(v) = serde_json::from_str::<Value>(&line) else {
            bar.println(line);
            continue;
        };
        match v["event"].as_str() {
            Some("start") => {
                bar.set_length(v["steps"].as_u64().unwrap_or(0));
                bar.set_message(format!(
                    "{label} ({} {} ranks)",
                    v["backend"].as_str().unwrap_or("?"),
                    v["ranks"]
                ));
            }
            Some("step") => {
                bar.set_position(v["step"].as_u64().unwrap_or(0));
                bar.set_message(format!(
                    "{label}: running loss {:.5}",
                    v["loss"].as_f64().unwrap_or(f64::NAN)
                ));
            }
            Some("saved") => bar.println(format!(
                "{label}: checkpoint saved after step {}",
                v["step"]
            )),
            Some("eval") => evals.push(serde_json::json!([v["step"], v["loss"]])),
            Some("done") => done = Some(v),
            _ => bar.println(line),
        }
    }
    let status = child.wait()?;
    bar.finish_and_clear();
    if status.code() == Some(2) {
        return Err(TrainError::Usage(format!(
            "the training example rejected its arguments (see above): {cmd:?}"
        )));
    }
    if !status.success() {
        return Err(Failure(format!("{cmd:?} failed with {status}")).into());
    }
    let mut done: Value = done.ok_or_else(|| Failure(format!("{cmd:?} ended without a result")))?;
    // The held-out losses along the way, as `[[step, loss], ...]`.
    done["evals"] = Value::Array(evals);
    Ok(done)
}

fn num(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or(f64::NAN)
}

/// One run's result, in a few lines.
fn summary(d: &Value) {
    let backend = if d["backend"].is_string() {
        d["backend"].as_str().unwrap_or("")
    } else {
        ""
    };
    println!(
        "{}{}: {} ranks, {} steps, accumulate {}: final loss {:.6} (from {:.6})",
        d["hook"].as_str().unwrap_or("?"),
        backend,
        d["ranks"],
        d["steps"],
        d["accumulate"],
        num(d, "final_loss"),
        num(d, "initial_loss"),
    );
    println!(
        "  {:.0} bytes sent per rank and step; predicted {:.2} ms/step at 1 Gbit/s, {:.2} ms/step at 10 Gbit/s (measured compute + link model); {:.1} s",
        num(d, "bytes_per_step"),
        num(d, "step_ms_1gbit"),
        num(d, "step_ms_10gbit"),
        num(d, "seconds"),
    );
}

/// `--compare`: allreduce, PowerSGD at ranks 1, 2, 4, the quantising hooks, post-local
/// SGD and DiLoCo, then the table, the goals and `target/train/loss.svg`.
fn compare(o: &Options) -> Result<(), TrainError> {
    let (name, features) = o.trainer();
    let exe = build_example(name, features, true)?;
    let mut results = Vec::new();
    let mut skipped = Vec::new();
    for (hook, extra, optional) in COMPARE {
        let mut cmd = example(&exe, o, hook);
        cmd.args(extra);
        let label = if extra.is_empty() {
            hook.to_string()
        } else {
            format!("{hook} {}", extra.join(" "))
        };
        match run_child(cmd, &label) {
            Ok(done) => results.push(done),
            Err(TrainError::Usage(_)) if optional => skipped.push(label),
            Err(e) => return Err(e),
        }
    }
    let base = &results[0];
    let (base_loss, base_bytes) = (num(base, "final_loss"), num(base, "bytes_per_step"));
    println!(
        "{} ranks, {} steps, accumulate {} (teacher-student MLP, held-out loss)",
        o.ranks, base["steps"], base["accumulate"]
    );
    println!(
        "{:<32} {:>11} {:>13} {:>16} {:>12} {:>12}",
        "hook", "final loss", "vs allreduce", "bytes/rank/step", "ms/step 1G", "ms/step 10G"
    );
    for r in &results {
        println!(
            "{:<32} {:>11.6} {:>12.4}x {:>16.0} {:>12.2} {:>12.2}",
            r["hook"].as_str().unwrap_or("?"),
            num(r, "final_loss"),
            num(r, "final_loss") / base_loss,
            num(r, "bytes_per_step"),
            num(r, "step_ms_1gbit"),
            num(r, "step_ms_10gbit"),
        );
    }
    println!("ms/step: measured compute per step on this machine + the link model's cost of the step's collectives (20 us per message)");
    println!("local_sgd and diloco: bytes include the warmup's gradient allreduces and one final parameter average, amortised over the steps");
    for label in &skipped {
        println!("left out: `{label}` (the example does not know it: see its message above)");
    }
    for line in goals(&results, base_loss, base_bytes) {
        println!("{line}");
    }
    let curves: Vec<(String, Vec<(f64, f64)>)> = results
        .iter()
        .map(|r| {
            let points = r["evals"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .map(|p| {
                            (
                                p[0].as_f64().unwrap_or(f64::NAN),
                                p[1].as_f64().unwrap_or(f64::NAN),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
            (r["hook"].as_str().unwrap_or("?").to_string(), points)
        })
        .collect();
    let title = format!(
        "Held-out loss vs step: teacher-student MLP, {} ranks, {} steps",
        o.ranks, base["steps"]
    );
    let dir = crate::target_dir().join("train");
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("loss.svg");
    std::fs::write(&path, crate::train_svg::chart(&title, &curves))?;
    println!("wrote {}", path.display());
    Ok(())
}

/// A line per row that a goal applies to: met or not, and by how much.
fn goals(results: &[Value], base_loss: f64, base_bytes: f64) -> Vec<String> {
    let mut lines = Vec::new();
    for r in results {
        let label = r["hook"].as_str().unwrap_or("?");
        let Some(&(_, loss_tol, fewer)) = GOALS.iter().find(|(p, _, _)| label.starts_with(p))
        else {
            continue;
        };
        let excess = num(r, "final_loss") / base_loss - 1.0;
        let factor = base_bytes / num(r, "bytes_per_step");
        let loss_ok = excess <= loss_tol;
        let bytes_ok = factor >= fewer;
        let mut line = format!(
            "goal {label}: final loss {:+.2}% vs allreduce (goal <= {:+.0}%){}",
            excess * 100.0,
            loss_tol * 100.0,
            if loss_ok { " met" } else { " NOT met" },
        );
        if fewer > 1.0 {
            line += &format!(
                "; {factor:.1}x fewer bytes per step (goal >= {fewer:.0}x){}",
                if bytes_ok { " met" } else { " NOT met" }
            );
        }
        lines.push(line);
    }
    lines
}

/// `--resume-at K`: an uninterrupted run that also saves at step K, then a fresh process
/// that continues from those files; the two must end with bit-identical models.
fn resume_check(o: &Options, k: usize) -> Result<(), TrainError> {
    let exe = build_example("train", &[], true)?;
    let dir = crate::target_dir().join("train").join("checkpoint");
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    let dir_arg = dir.to_string_lossy().to_string();
    let mut whole = example(&exe, o, &o.hook);
    whole.args(["--save-at", &k.to_string(), "--checkpoint", &dir_arg]);
    let a = run_child(whole, &format!("{} (uninterrupted)", o.hook))?;
    let mut resumed = example(&exe, o, &o.hook);
    resumed.args(["--resume", &dir_arg]);
    let b = run_child(resumed, &format!("{} (resumed at {k})", o.hook))?;
    summary(&a);
    let same = a["digest"] == b["digest"] && a["final_loss"] == b["final_loss"];
    println!(
        "resume check: uninterrupted run: final loss {:.9}, model digest {}; restarted from step {k}'s files ({}): final loss {:.9}, model digest {}",
        num(&a, "final_loss"),
        a["digest"].as_str().unwrap_or("?"),
        dir.display(),
        num(&b, "final_loss"),
        b["digest"].as_str().unwrap_or("?"),
    );
    if same {
        println!("resume check: passed (identical models, bit for bit)");
        Ok(())
    } else {
        Err(
            Failure("resume check failed: the resumed run ended with a different model".into())
                .into(),
        )
    }
}

/// The same run on thread ranks and under `mpirun` (with `env` set for the ranks):
/// (threads' result, MPI's result).
fn mpi_pair(
    o: &Options,
    release: bool,
    env: &[(&str, &str)],
) -> Result<(Value, Value), TrainError> {
    if !on_path("mpirun") {
        return Err(Failure(
            "--backend mpi needs Open MPI's mpirun (Debian: libopenmpi-dev openmpi-bin libclang-dev)"
                .into(),
        )
        .into());
    }
    let threads_exe = build_example("train", &[], release)?;
    let mpi_exe = build_example("train_mpi", &["collectives/mpi"], release)?;
    let mut threads = run_child(
        example(&threads_exe, o, &o.hook),
        &format!("{} threads", o.hook),
    )?;
    threads["backend"] = " (threads)".into();
    let mut cmd = crate::mpirun(o.ranks);
    cmd.arg(&mpi_exe)
        .args(run_args(o, &o.hook, false))
        .envs(env.iter().copied())
        .current_dir(workspace_root());
    let mut mpi = run_child(cmd, &format!("{} mpi", o.hook))?;
    mpi["backend"] = " (mpi)".into();
    Ok((threads, mpi))
}

/// The MPI run's final loss and model against the thread run's, printed; a gap over
/// what `need` allows is a failure.
fn mpi_verdict(threads: &Value, mpi: &Value, need: Match) -> Result<(), TrainError> {
    let (a, b) = (num(threads, "final_loss"), num(mpi, "final_loss"));
    let rel = (a - b).abs() / a.abs().max(f64::MIN_POSITIVE);
    let digest = |v: &Value| v["digest"].as_str().unwrap_or("?").to_string();
    let (da, db) = (digest(threads), digest(mpi));
    let identical = a.to_bits() == b.to_bits() && da == db && da != "?";
    let native = std::env::var(DETERMINISTIC_ENV).is_ok_and(|v| v.trim() == "0")
        && !matches!(need, Match::BitIdentical);
    println!(
        "mpi check: final loss {b:.9} under mpirun -np {} vs {a:.9} on thread ranks: relative difference {rel:.2e} (tolerance {MPI_TOLERANCE:.0e}); model digest {db} vs {da}: {} ({} reductions)",
        mpi["ranks"],
        if identical { "bit-identical" } else { "different" },
        if native {
            "native MPI"
        } else {
            "deterministic MPI"
        },
    );
    let ok = match need {
        Match::Tolerance => rel <= MPI_TOLERANCE,
        Match::BitIdentical => identical,
    };
    if ok {
        println!("mpi check: passed");
        return Ok(());
    }
    let why = match need {
        Match::Tolerance => format!("relative difference {rel:.2e} over {MPI_TOLERANCE:.0e}"),
        Match::BitIdentical => format!(
            "the runs are not bit-identical (relative difference {rel:.2e}, digests {db} vs {da})"
        ),
    };
    let hint = if native {
        "with COLLECTIVES_MPI_DETERMINISTIC=0, MPI_Iallreduce adds in its own order and PowerSGD carries the rounding into later steps; unset it for results identical to the thread backend's"
    } else {
        "the MPI backend's deterministic reductions should match the thread backend bit for bit: a difference is a bug in one of them"
    };
    Err(Failure(format!("mpi check failed: {why} ({hint})")).into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_err(a: &[&str]) -> String {
        let a: Vec<String> = a.iter().map(|s| s.to_string()).collect();
        parse(&a).err().expect("an error")
    }

    #[test]
    fn bad_flags_are_errors_that_say_why() {
        for (args, says) in [
            (&["--ranks", "0"][..], "expected a positive integer"),
            (&["--ranks", "abc"][..], "expected a positive integer"),
            (&["--hook"][..], "missing argument"),
            (&["--backend", "nccl"][..], "unknown backend `nccl`"),
            (&["--compare", "--hook", "fp16"][..], "drop --hook"),
            (&["--compare", "--resume-at", "5"][..], "one at a time"),
            (&["--json"][..], "xtask sets it itself"),
        ] {
            let e = parse_err(args);
            assert!(e.contains(says), "{args:?}: {e}");
        }
    }

    #[test]
    fn defaults_are_four_thread_ranks_and_allreduce() {
        let Ok(o) = parse(&[]) else {
            panic!("no arguments is fine")
        };
        assert_eq!((o.ranks, o.hook.as_str()), (4, "allreduce"));
        assert_eq!(o.backend, Backend::Threads);
        assert!(o.example_args.is_empty());
    }

    /// `--pipe P` trains on P stages × ranks / P replicas: P must divide the ranks.
    #[test]
    fn pipe_must_divide_the_ranks() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(parse(&args(&["--pipe", "2", "--ranks", "4"])).is_ok());
        let Err(e) = parse(&args(&["--pipe", "3", "--ranks", "4"])) else {
            panic!("3 stages do not divide 4 ranks")
        };
        assert!(e.contains("--pipe must divide --ranks"), "{e}");
    }

    /// A goal line per local-SGD, DiLoCo and `+ef` row, none for the others.
    #[test]
    fn goals_report_the_rows_they_apply_to() {
        let row = |hook: &str, loss: f64, bytes: f64| serde_json::json!({"hook": hook, "final_loss": loss, "bytes_per_step": bytes});
        let rows = [
            row("allreduce", 1.0, 1000.0),
            row("local_sgd:period=4,start=10", 1.01, 250.0),
            row("diloco:H=64+allreduce", 1.05, 20.0),
            row("quantize_per_channel+ef", 1.001, 250.0),
            row("fp16", 1.0, 500.0),
        ];
        let lines = goals(&rows, 1.0, 1000.0);
        assert_eq!(lines.len(), 3, "{lines:?}");
        assert!(lines[0].contains("met; 4.0x fewer") && lines[0].contains("NOT met"));
        assert!(lines[1].contains("+5.00%") && lines[1].contains("(goal <= +3%) NOT met"));
        assert!(lines[1].contains("50.0x fewer bytes per step (goal >= 10x) met"));
        assert!(lines[2].ends_with("met") && !lines[2].contains("bytes"));
    }

    /// The example's flags reach it as given, in order (its parser checks them).
    #[test]
    fn example_flags_pass_through() {
        let a: Vec<String> = [
            "--steps",
            "10",
            "--ranks",
            "2",
            "--chunks=8",
            "--accumulate",
            "4",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let Ok(o) = parse(&a) else {
            panic!("valid arguments")
        };
        assert_eq!(o.ranks, 2);
        assert_eq!(
            o.example_args,
            ["--steps", "10", "--chunks=8", "--accumulate", "4"]
        );
        assert_eq!(
            run_args(&o, "fp16", true),
            [
                "--json",
                "--hook",
                "fp16",
                "--ranks",
                "2",
                "--steps",
                "10",
                "--chunks=8",
                "--accumulate",
                "4"
            ]
        );
    }
}

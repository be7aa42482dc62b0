//! Project automation, in the `cargo xtask` pattern: a plain binary, so nothing beyond
//! Cargo needs installing.
//!
//! - `cargo xtask test`: the whole test suite, plus optional suites whose system software
//!   is installed (and one line for each one skipped).
//! - `cargo xtask bench [SUITE] [--quick] [--json]`: benchmarks, always in release builds;
//!   with no suite, the compression-throughput report (table, `target/bench/report.jsonl`,
//!   `target/bench/speedup.svg`).
//! - `cargo xtask train [...]`: thread ranks (or `mpirun` processes) train the
//!   teacher-student MLP with a hook chosen by name; `--compare`, `--resume-at K`.
//! - `cargo xtask gpu-check`: builds the CUDA tests and benchmarks into `gpu-check/` with a
//!   script that runs them on a GPU machine.

mod bench;
mod gpu_check;
mod sanitize;
mod test;
mod train;
mod train_svg;

use std::process::{Command, ExitCode};

const USAGE: &str = "\
usage: cargo xtask <command>

commands:
  test                      cargo test --workspace, the CUDA tests (they skip without a GPU),
                            and the optional suites whose system software is installed
  bench [SUITE] [--quick] [--json]
                            benchmarks in release builds. Without SUITE: the compression-throughput
                            report (every hook on 4 x Linear, ResNet-50, BERT-base, GPT-2 small, priced
                            at 1-400 Gbit/s; writes target/bench/report.jsonl and speedup.svg).
                            SUITE: report, lowrank, collectives, hooks, accum, pipe
  train [--hook SPEC] [--ranks N] [--steps N] [--accumulate K] [--batch N] [--pipe P]
        [--compare | --resume-at K | --backend threads|mpi]
                            N thread ranks (default 4) train the teacher-student MLP through the
                            ddp-hooks reducer with the hook SPEC (default allreduce; e.g.
                            powersgd:rank=2,start_iter=10, fp16+powersgd:rank=4,start_iter=10);
                            (--steps, --accumulate, --batch and any other flag go to the
                            training example as given, which checks them);
                            --compare: allreduce vs PowerSGD ranks 1, 2, 4, quantize_per_tensor,
                            quantize_per_channel(+ef), post-local SGD (--local-sgd 4, 16) and
                            DiLoCo (--diloco 16, 64) as a table, and target/train/loss.svg
                            (held-out loss against step);
                            --resume-at K: save at step K, restart from the files, check the end
                            is identical; --backend mpi: the same under mpirun -np N, checked
                            against the thread ranks; --pipe P: a P-stage pipe on a mesh of
                            P stages x N/P replicas (stages on ranks), each stage's buckets
                            reduced over its replicas as soon as its gradients are final
  sanitize                  the collectives and lowrank tests under AddressSanitizer (needs
                            nightly; skipped with a message where it is not installed)
  loom                      the loom models of the thread backend's rendezvous and work handles
  gpu-check                 build the CUDA test binaries and benchmarks into gpu-check/,
                            with gpu-check/run.sh to run them on a GPU machine
";

/// Bad command-line input: the reason, the usage, exit status 2.
fn usage(why: &str) -> ExitCode {
    eprint!("xtask: {why}\n\n{USAGE}");
    ExitCode::from(2)
}

/// A failed step, with what to tell the user.
#[derive(Debug)]
pub struct Failure(pub String);

impl<E: std::fmt::Display> From<E> for Failure {
    fn from(e: E) -> Self {
        Failure(e.to_string())
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("test") => test::run(&args[1..]),
        Some("bench") => match bench::parse(&args[1..]) {
            Ok(options) => bench::run(options),
            Err(why) => return usage(&why),
        },
        Some("train") => match train::parse(&args[1..]) {
            Ok(options) => match train::run(options) {
                Ok(()) => Ok(()),
                Err(train::TrainError::Usage(why)) => return usage(&why),
                Err(train::TrainError::Failed(f)) => Err(f),
            },
            Err(why) => return usage(&why),
        },
        Some("gpu-check") => gpu_check::run(&args[1..]),
        Some("sanitize") => sanitize::sanitize(&args[1..]),
        Some("loom") => sanitize::loom(&args[1..]),
        Some("-h" | "--help" | "help") => {
            print!("{USAGE}");
            Ok(())
        }
        other => {
            eprint!(
                "{}{USAGE}",
                other.map_or(String::new(), |o| format!("unknown command `{o}`\n\n"))
            );
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure(why)) => {
            eprintln!("xtask: {why}");
            ExitCode::FAILURE
        }
    }
}

/// `cargo` with the given arguments, run from the workspace root.
pub fn cargo(args: &[&str]) -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.args(args).current_dir(workspace_root());
    cmd
}

/// Runs a command to completion; a non-zero exit is a [`Failure`] naming it.
pub fn run_status(mut cmd: Command) -> Result<(), Failure> {
    let shown = format!("{cmd:?}");
    eprintln!("xtask: running {shown}");
    let status = cmd
        .status()
        .map_err(|e| Failure(format!("could not start {shown}: {e}")))?;
    if status.success() {
        Ok(())
    } else {
        Err(Failure(format!("{shown} failed with {status}")))
    }
}

/// Cargo's target folder: `CARGO_TARGET_DIR`, or `target` in the workspace root.
pub fn target_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"))
}

/// The workspace root (the parent of this crate's directory).
pub fn workspace_root() -> std::path::PathBuf {
    let here = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    here.parent().unwrap_or(here).to_path_buf()
}

/// Whether `program` is on `PATH`.
pub fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).any(|dir| dir.join(program).is_file()))
        .unwrap_or(false)
}

/// Builds a target without running it (`cargo <subcommand> --no-run`, `subcommand` being
/// `test` or `bench`) and returns its executable, read from Cargo's JSON messages.
pub fn built_executable(
    subcommand: &str,
    args: &[&str],
    target: &str,
) -> Result<std::path::PathBuf, Failure> {
    let mut all = vec![subcommand, "--no-run", "--message-format=json"];
    all.extend_from_slice(args);
    let mut cmd = cargo(&all);
    cmd.stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit());
    eprintln!("xtask: running {cmd:?}");
    let out = cmd
        .output()
        .map_err(|e| Failure(format!("could not start {cmd:?}: {e}")))?;
    if !out.status.success() {
        return Err(Failure(format!("{cmd:?} failed with {}", out.status)));
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["profile"]["test"] == true)
        .filter(|m| m["target"]["name"] == target)
        .find_map(|m| m["executable"].as_str().map(std::path::PathBuf::from))
        .ok_or_else(|| Failure(format!("{cmd:?} named no executable for `{target}`")))
}

/// `mpirun -np <ranks>` with what it needs here: `--oversubscribe` (more ranks than
/// cores), a bound on the whole job, permission to run as root (CI containers), and
/// shared-memory copies that work in containers forbidding cross-process attach.
pub fn mpirun(ranks: usize) -> Command {
    let mut cmd = Command::new("mpirun");
    cmd.args([
        "-np",
        &ranks.to_string(),
        "--oversubscribe",
        "--timeout",
        "600",
    ])
    .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
    .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none");
    cmd
}

//! Project automation, in the `cargo xtask` pattern: a plain binary, so nothing beyond
//! Cargo needs installing.
//!
//! - `cargo xtask test`: the whole test suite, plus optional suites whose system software
//!   is installed (and one line for each one skipped).
//! - `cargo xtask bench [SUITE] [--quick] [--json]`: benchmarks, always in release builds.
//! - `cargo xtask gpu-check`: builds the CUDA tests and benchmarks into `gpu-check/` with a
//!   script that runs them on a GPU machine.

mod bench;
mod gpu_check;
mod test;

use std::process::{Command, ExitCode};

const USAGE: &str = "\
usage: cargo xtask <command>

commands:
  test                      cargo test --workspace, the CUDA tests (they skip without a GPU),
                            and the optional suites whose system software is installed
  bench [SUITE] [--quick] [--json]
                            benchmarks in release builds; SUITE is one of: lowrank, collectives, hooks, accum
                            (default: all)
  gpu-check                 build the CUDA test binaries and benchmarks into gpu-check/,
                            with gpu-check/run.sh to run them on a GPU machine
";

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
        Some("bench") => bench::run(&args[1..]),
        Some("gpu-check") => gpu_check::run(&args[1..]),
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

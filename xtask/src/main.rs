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
mod svg;
mod test;
mod torchrun;
mod train;
mod train_svg;

use std::process::{Command, ExitCode};

const USAGE: &str = "\
usage: cargo xtask <command>

commands:
  test                      cargo test --workspace, the CUDA tests (they skip without a GPU),
                            the multi-process runs (TCP under launch; torchrun where PyTorch
                            imports, with an elastic restart) and the optional suites whose
                            system software is installed
  test processes            the multi-process runs alone
  bench [SUITE] [--quick] [--json]
                            benchmarks in release builds. Without SUITE: the compression-throughput
                            report (every hook on 4 x Linear, ResNet-50, BERT-base, GPT-2 small, priced
                            at 1-400 Gbit/s; writes target/bench/report.jsonl and speedup.svg).
                            SUITE: report, lowrank, collectives, hooks, accum, pipe.
                            The report's flags: --shapes FILE (your model's parameter shapes, JSON),
                            --models A,B, --ranks N (link world size), --steps K, --backward-ms MS
                            (your backward: overlapped step times), --gpu-report FILE (cuda_hooks.jsonl)
                            --isa avx512|avx2|portable: that instruction set's kernels;
                            lowrank --roofline: each kernel in L2 against its in-core limit
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
    if !matches!(
        args.first().map(String::as_str),
        None | Some("-h" | "--help" | "help")
    ) {
        // Outside a workspace, say so before anything else.
        workspace_root();
    }
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

/// The workspace root, found at run time from the current directory (see
/// [`find_workspace`]), once per process. Outside a workspace this prints why and exits
/// with status 1: nothing `cargo xtask` does makes sense there.
///
/// Not the directory xtask was compiled in (`env!("CARGO_MANIFEST_DIR")`): with one
/// `CARGO_TARGET_DIR` shared by two clones, cargo reuses one xtask binary for both, and
/// a compile-time root would send one clone's output into the other.
pub fn workspace_root() -> std::path::PathBuf {
    static ROOT: std::sync::OnceLock<Result<std::path::PathBuf, String>> =
        std::sync::OnceLock::new();
    let root = ROOT.get_or_init(|| {
        std::env::current_dir()
            .map_err(|e| format!("cannot read the current directory: {e}"))
            .and_then(|cwd| find_workspace(&cwd))
    });
    match root {
        Ok(root) => root.clone(),
        Err(why) => {
            eprintln!("xtask: {why}");
            std::process::exit(1);
        }
    }
}

/// The root of the Cargo workspace that `dir` is in: the folder of the manifest that
/// `cargo locate-project --workspace --message-format plain` names when run in `dir`,
/// if that manifest has a `[workspace]` table; otherwise the nearest folder at or above
/// `dir` whose `Cargo.toml` has one ([`walk_up_to_workspace`]). Neither: an error
/// naming `dir`.
pub fn find_workspace(dir: &std::path::Path) -> Result<std::path::PathBuf, String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let located = Command::new(&cargo)
        .args(["locate-project", "--workspace", "--message-format", "plain"])
        .current_dir(dir)
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .output();
    let why = match located {
        Ok(out) if out.status.success() => {
            let manifest = std::path::PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
            if has_workspace_table(&manifest) {
                if let Some(root) = manifest.parent() {
                    return Ok(root.to_path_buf());
                }
            }
            format!("{} has no [workspace] table", manifest.display())
        }
        Ok(out) => String::from_utf8_lossy(&out.stderr).trim().to_string(),
        Err(e) => format!("could not run `{cargo} locate-project`: {e}"),
    };
    walk_up_to_workspace(dir).ok_or_else(|| {
        format!(
            "not inside a Cargo workspace: no Cargo.toml with a [workspace] table in {} or any folder above it (cargo locate-project: {why}); run `cargo xtask` from the workspace",
            dir.display()
        )
    })
}

/// The nearest folder at or above `dir` whose `Cargo.toml` has a `[workspace]` table.
pub fn walk_up_to_workspace(dir: &std::path::Path) -> Option<std::path::PathBuf> {
    dir.ancestors()
        .find(|d| has_workspace_table(&d.join("Cargo.toml")))
        .map(std::path::Path::to_path_buf)
}

/// Whether the manifest at `path` has a `[workspace]` table (a line `[workspace]`).
fn has_workspace_table(path: &std::path::Path) -> bool {
    std::fs::read_to_string(path)
        .map(|s| s.lines().any(|l| l.trim() == "[workspace]"))
        .unwrap_or(false)
}

/// Whether `program` is on `PATH`.
pub fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).any(|dir| dir.join(program).is_file()))
        .unwrap_or(false)
}

/// Runs `cargo ARGS --message-format=json-render-diagnostics` (a `build` of one binary or
/// example) and returns the executable of the artifact named `name`, read from Cargo's
/// JSON messages; the diagnostics go to standard error as usual.
pub fn built_target(args: &[&str], name: &str) -> Result<std::path::PathBuf, Failure> {
    let mut all = args.to_vec();
    all.push("--message-format=json-render-diagnostics");
    artifact(&all, name, false)
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
    artifact(&all, target, true)
}

/// Runs `cargo ARGS` (which ask for JSON messages) and returns the executable of the
/// artifact named `name` (only a test-profile one when `test_profile`).
fn artifact(args: &[&str], name: &str, test_profile: bool) -> Result<std::path::PathBuf, Failure> {
    let mut cmd = cargo(args);
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
        .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == name)
        .filter(|m| !test_profile || m["profile"]["test"] == true)
        .find_map(|m| m["executable"].as_str().map(std::path::PathBuf::from))
        .ok_or_else(|| Failure(format!("{cmd:?} named no executable for `{name}`")))
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::{Path, PathBuf};

    /// A fresh folder under the system's temporary one, removed when dropped.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(tag: &str) -> TempDir {
            let dir = std::env::temp_dir().join(format!(
                "xtask-{tag}-{}-{:?}",
                std::process::id(),
                std::time::SystemTime::now()
            ));
            std::fs::create_dir_all(&dir).unwrap();
            TempDir(dir.canonicalize().unwrap())
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// A minimal workspace, as a second clone would be: a `[workspace]` manifest and one
    /// member package.
    fn workspace(tag: &str) -> TempDir {
        let t = TempDir::new(tag);
        std::fs::write(
            t.0.join("Cargo.toml"),
            "[workspace]\nmembers = [\"member\"]\nresolver = \"2\"\n",
        )
        .unwrap();
        std::fs::create_dir_all(t.0.join("member/src/deep")).unwrap();
        std::fs::write(
            t.0.join("member/Cargo.toml"),
            "[package]\nname = \"member\"\nversion = \"0.1.0\"\nedition = \"2021\"\n",
        )
        .unwrap();
        std::fs::write(t.0.join("member/src/lib.rs"), "").unwrap();
        t
    }

    /// From a member folder of another workspace, the root is that workspace's, not the
    /// one xtask was compiled in; the walk-up fallback agrees.
    #[test]
    fn the_workspace_is_found_from_the_current_directory() {
        let ws = workspace("root");
        let compiled_in = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        for cwd in [
            ws.0.join("member"),
            ws.0.join("member/src/deep"),
            ws.0.clone(),
        ] {
            let root = find_workspace(&cwd).unwrap();
            assert_eq!(root, ws.0, "from {}", cwd.display());
            assert_ne!(root, compiled_in);
            assert_eq!(walk_up_to_workspace(&cwd), Some(ws.0.clone()));
        }
    }

    /// Outside any workspace, the error says so and names the folder.
    #[test]
    fn outside_a_workspace_is_a_clear_error() {
        let t = TempDir::new("none");
        std::fs::create_dir_all(t.0.join("a/b")).unwrap();
        // A package that is not a workspace does not count either.
        std::fs::write(
            t.0.join("a/Cargo.toml"),
            "[package]\nname = \"a\"\nversion = \"0.1.0\"\n",
        )
        .unwrap();
        let dir = t.0.join("a/b");
        if walk_up_to_workspace(&dir).is_some() {
            // The temporary folder itself lies inside a workspace: nothing to check.
            return;
        }
        let e = find_workspace(&dir).unwrap_err();
        assert!(e.contains("not inside a Cargo workspace"), "{e}");
        assert!(e.contains(&dir.display().to_string()), "{e}");
    }
}

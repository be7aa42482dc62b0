//! `cargo xtask test`: every test that can run on this machine, and a line for each
//! optional suite that cannot. The CUDA tests' output is scanned for their `skipped:`
//! lines (a GPU test that cannot run here passes after printing one), and the summary
//! says how many there were and why.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

use crate::{cargo, on_path, run_status, Failure};

/// A suite that needs system software this machine may lack.
struct Optional {
    name: &'static str,
    /// Programs that must be on `PATH`.
    needs: &'static [&'static str],
    /// Debian packages that provide them.
    packages: &'static str,
    /// The `cargo` arguments that run its plain tests.
    cargo_args: &'static [&'static str],
    /// What runs after them, for tests that are not a plain `cargo` command.
    then: Option<fn() -> Result<(), Failure>>,
}

/// The optional suites.
const OPTIONAL: &[Optional] = &[Optional {
    name: "the MPI backend of collectives (mpirun -np 2 and -np 4)",
    needs: &["mpirun", "mpicc"],
    packages: "libopenmpi-dev openmpi-bin libclang-dev",
    // The backend's unit tests, which need no `mpirun`.
    cargo_args: &[
        "test",
        "-p",
        "collectives",
        "--features",
        "mpi",
        "--lib",
        "--",
        "mpi::",
    ],
    then: Some(mpi_suite),
}];

/// The packages and features that every feature-gated test and example of `xtask test`
/// is built with: each crate compiles once, with the union of the suites' features
/// (CUDA, candle, burn, pipeline × data parallel, stages on a group's ranks), where a
/// `cargo test -p CRATE --features F` a suite rebuilt the crates under it each time.
/// (`cargo clippy --all-features` compiles the same union.) The arguments go after the
/// subcommand ([`featured`]).
const FEATURED_ARGS: &[&str] = &[
    "-p",
    "lowrank",
    "-p",
    "collectives",
    "-p",
    "ddp-hooks",
    "-p",
    "pipe",
    "--features",
    "lowrank/cuda,collectives/cuda,ddp-hooks/cuda,ddp-hooks/candle,ddp-hooks/burn,\
     ddp-hooks/pipe,pipe/cuda,pipe/candle,pipe/burn,pipe/collectives",
];

/// The feature-gated integration tests (each name in the packages that have it).
const FEATURED_TESTS: &[&str] = &[
    "cuda",
    "nccl",
    "threads_cuda",
    "cuda_pipe",
    "candle",
    "pipeline",
    "pipeline_mesh",
    "burn",
    "group_transport",
];

/// The feature-gated examples that `xtask test` runs (each checks itself and exits
/// non-zero on a mismatch).
const FEATURED_EXAMPLES: &[&str] = &[
    "cuda_two_streams",
    "burn_ddp",
    "burn_pipe",
    "stages_on_ranks",
];

/// `cargo SUBCOMMAND` with [`FEATURED_ARGS`], then `rest`.
fn featured(subcommand: &str, rest: &[&str]) -> Command {
    cargo(&[&[subcommand], FEATURED_ARGS, rest].concat())
}

/// Compiles the MPI backend's doc example, builds `collectives/tests/mpi.rs` (one process
/// per rank, `harness = false`) and runs it under `mpirun` on two processes, then on four
/// (oversubscribed: its bit-for-bit checks against the thread backend's order need three
/// or more ranks for the order of additions to matter); then short `cargo xtask train
/// --backend mpi` runs (2 and 4 processes) that must end bit-identical to thread ranks,
/// after pipe's `stages_on_ranks` example on two processes (`--mpi`), which checks a
/// two-stage pipe bit for bit against the same pipe in one process.
fn mpi_suite() -> Result<(), Failure> {
    run_status(cargo(&[
        "test",
        "-p",
        "collectives",
        "--features",
        "mpi",
        "--doc",
        "--",
        "mpi",
    ]))?;
    let exe = crate::built_executable(
        "test",
        &["-p", "collectives", "--features", "mpi", "--test", "mpi"],
        "mpi",
    )?;
    for ranks in [2, 4] {
        let mut cmd = crate::mpirun(ranks);
        cmd.arg(&exe);
        run_status(cmd)?;
    }
    // Pipe stages on the two processes of `mpirun`, bit for bit against one process.
    let exe = pipe_example("stages_on_ranks", "mpi")?;
    let mut cmd = crate::mpirun(2);
    cmd.arg(&exe).arg("--mpi");
    run_status(cmd)?;
    // The training example across processes, against the same run on thread ranks.
    crate::train::mpi_check()
}

/// Builds `cargo build -p pipe --features FEATURES --example NAME` (the dev profile: the
/// example runs in well under a second there, and `cargo test --workspace` has already
/// built most of what it needs) and returns the binary.
fn pipe_example(name: &str, features: &str) -> Result<std::path::PathBuf, Failure> {
    crate::built_target(
        &[
            "build",
            "-p",
            "pipe",
            "--features",
            features,
            "--example",
            name,
        ],
        name,
    )
}

pub fn run(args: &[String]) -> Result<(), Failure> {
    match args {
        [] => {}
        [only] if only == "processes" => {
            // Only the multi-process suite (TCP under `launch`, `torchrun` where it runs).
            let torch = crate::torchrun::torch_importable();
            crate::torchrun::suite(torch)?;
            if !torch {
                println!("skipped: the torchrun runs (needs PyTorch: pip install torch)");
            }
            return Ok(());
        }
        [a, ..] => {
            return Err(Failure(format!(
            "`test` takes no arguments but `processes` (the multi-process suite alone), got `{a}`"
        )))
        }
    }
    run_status(cargo(&["test", "--workspace"]))?;
    // The reason of each GPU test that printed `skipped:` in the CUDA runs below.
    let mut gpu_skips = Vec::new();
    // Every feature-gated suite below is built with one feature set ([`FEATURED`]), so
    // each crate compiles once for all of them (one build per suite's own features cost
    // a clean 2-core machine about two minutes each for the CUDA ones alone).
    //
    // The CUDA backends' tests: without a GPU they prove that a missing driver is a
    // clean error, and print `skipped: no CUDA driver`. First `lowrank`'s (its unit tests
    // and `primitives`, filtered to the CUDA ones, with `pipe::cuda`'s unit tests, which
    // NVRTC compiles the kernels in where libnvrtc is found, and the other crates' CUDA
    // unit tests).
    gpu_skips.extend(run_counting_skips(featured(
        "test",
        &["--lib", "--test", "primitives", "--", "cuda", "--nocapture"],
    ))?);
    // Then PowerSGD on CUDA buckets, the NCCL backend, partitions on a GPU; the embedding
    // features: the candle adapters (ddp-hooks, pipe), pipeline × data parallel
    // (ddp-hooks' `pipe` feature, both partitions on every rank and stages on ranks),
    // burn's `BurnDdp` and `BurnLayer`; and stages on the ranks of a `collectives` group
    // (the transport's tests; the `ranks` tests need no feature and ran above).
    let mut suites = vec![];
    for test in FEATURED_TESTS {
        suites.extend(["--test", test]);
    }
    suites.extend(["--", "--nocapture"]);
    gpu_skips.extend(run_counting_skips(featured("test", &suites))?);
    // The examples, from the same build: two CUDA streams (skips without a GPU), burn's
    // two (their own checks against burn alone), and two pipe stages on two thread ranks,
    // bit for bit against the same pipe in one process.
    for example in FEATURED_EXAMPLES {
        let exe = crate::built_target(
            &[&["build"], FEATURED_ARGS, &["--example", example]].concat(),
            example,
        )?;
        let mut cmd = Command::new(exe);
        cmd.current_dir(crate::workspace_root());
        gpu_skips.extend(run_counting_skips(cmd)?);
    }
    // Processes over TCP: the training example under `launch` (bit for bit against thread
    // ranks), then under real `torchrun` where PyTorch is importable, with an elastic
    // restart after a worker is killed.
    let torch = crate::torchrun::torch_importable();
    crate::torchrun::suite(torch)?;
    let mut skipped = Vec::new();
    for suite in OPTIONAL {
        if suite.needs.iter().all(|p| on_path(p)) {
            run_status(cargo(suite.cargo_args))?;
            if let Some(then) = suite.then {
                then()?;
            }
        } else {
            skipped.push(suite);
        }
    }
    for s in &skipped {
        println!(
            "skipped: {} (needs {}; install the Debian packages: {})",
            s.name,
            s.needs.join(", "),
            s.packages
        );
    }
    if !torch {
        println!(
            "skipped: the torchrun runs (2 and 4 workers, an elastic restart) and collectives' live \
             TCPStore tests (needs PyTorch: pip install torch)"
        );
    }
    println!(
        "xtask test: all suites passed ({} optional suite(s) skipped); {}",
        skipped.len() + usize::from(!torch),
        gpu_summary(&gpu_skips)
    );
    Ok(())
}

/// Runs `cmd` as [`run_status`] does (a failure names it, with its exit status), its
/// standard output passed through to ours line by line as it comes (standard error is
/// inherited), and returns the reason of each line that reports a skipped test
/// ([`skip_reason`]).
fn run_counting_skips(cmd: Command) -> Result<Vec<String>, Failure> {
    run_teeing(cmd, &mut std::io::stdout())
}

/// [`run_counting_skips`], passing the output to `out`.
fn run_teeing(mut cmd: Command, out: &mut impl Write) -> Result<Vec<String>, Failure> {
    let shown = format!("{cmd:?}");
    eprintln!("xtask: running {shown}");
    let mut child = cmd
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| Failure(format!("could not start {shown}: {e}")))?;
    let mut reasons = Vec::new();
    let mut read_error = None;
    if let Some(stdout) = child.stdout.take() {
        let mut reader = BufReader::new(stdout);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) => break,
                Ok(_) => {
                    // Shown even if it is not UTF-8; a closed terminal does not stop
                    // the run, whose output is still read to its end.
                    let _ = out.write_all(&line).and_then(|()| out.flush());
                    if let Some(reason) = skip_reason(&String::from_utf8_lossy(&line)) {
                        reasons.push(reason.to_owned());
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // Closing the pipe (dropping the reader) ends the child's writes
                    // rather than leaving it blocked on a full pipe.
                    read_error = Some(e);
                    break;
                }
            }
        }
    }
    let status = child
        .wait()
        .map_err(|e| Failure(format!("could not wait for {shown}: {e}")))?;
    if !status.success() {
        return Err(Failure(format!("{shown} failed with {status}")));
    }
    if let Some(e) = read_error {
        return Err(Failure(format!("reading the output of {shown}: {e}")));
    }
    Ok(reasons)
}

/// The reason in a line that reports a skipped test: one that starts with `skipped:`,
/// or holds it right after libtest's `test NAME ... ` (a result line that another
/// test's output broke into, as happens with `--nocapture`).
fn skip_reason(line: &str) -> Option<&str> {
    let line = line.trim_end();
    let rest = line.strip_prefix("skipped:").or_else(|| {
        line.strip_prefix("test ")
            .and_then(|test| test.split_once(" ... skipped:"))
            .map(|(_, rest)| rest)
    })?;
    Some(rest.trim())
}

/// The summary of the GPU tests skipped: how many, and why (the reasons without their
/// details in parentheses, most frequent first, each with its count when they differ),
/// e.g. `14 GPU test(s) skipped: no CUDA driver`.
fn gpu_summary(reasons: &[String]) -> String {
    let mut counts: Vec<(&str, usize)> = Vec::new();
    for reason in reasons {
        let short = reason.split(" (").next().unwrap_or(reason).trim();
        match counts.iter_mut().find(|(r, _)| *r == short) {
            Some((_, n)) => *n += 1,
            None => counts.push((short, 1)),
        }
    }
    // Stable: reasons equally frequent keep the order they were first seen in.
    counts.sort_by_key(|&(_, n)| std::cmp::Reverse(n));
    let why = match counts.as_slice() {
        [] => String::new(),
        [(only, _)] => format!(": {only}"),
        several => {
            let parts: Vec<String> = several.iter().map(|(r, n)| format!("{r} ({n})")).collect();
            format!(": {}", parts.join(", "))
        }
    };
    format!("{} GPU test(s) skipped{why}", reasons.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skip_lines_are_found_alone_or_after_a_broken_result_line() {
        assert_eq!(
            skip_reason("skipped: no CUDA driver\n"),
            Some("no CUDA driver")
        );
        assert_eq!(
            skip_reason("test nccl_all_reduce ... skipped: no NCCL library"),
            Some("no NCCL library")
        );
        assert_eq!(skip_reason("test nccl_all_reduce ... ok"), None);
        assert_eq!(skip_reason("  skipped: indented, so not a skip line"), None);
        assert_eq!(skip_reason("running 9 tests"), None);
    }

    /// The output passes through, the skip lines are counted, and a failing command is
    /// still a failure naming its status.
    #[cfg(unix)]
    #[test]
    fn a_run_streams_its_output_counts_its_skips_and_keeps_its_status() {
        let script = |exit: u8| {
            let mut cmd = Command::new("sh");
            cmd.args([
                "-c",
                &format!(
                    "echo 'skipped: no CUDA driver'; echo 'test a ... ok'; \
                     echo 'test b ... skipped: no NCCL library (dlopen)'; exit {exit}"
                ),
            ]);
            cmd
        };
        let mut out = Vec::new();
        let reasons = run_teeing(script(0), &mut out).expect("exit 0 passes");
        assert_eq!(reasons, ["no CUDA driver", "no NCCL library (dlopen)"]);
        assert_eq!(
            String::from_utf8_lossy(&out),
            "skipped: no CUDA driver\ntest a ... ok\ntest b ... skipped: no NCCL library (dlopen)\n"
        );
        let failed = run_teeing(script(3), &mut Vec::new()).expect_err("exit 3 fails");
        assert!(
            failed.0.contains("failed with exit status: 3"),
            "{}",
            failed.0
        );
    }

    #[test]
    fn the_summary_counts_every_skip_and_groups_the_reasons() {
        assert_eq!(gpu_summary(&[]), "0 GPU test(s) skipped");
        let driver = |n| vec!["no CUDA driver (DriverError(CUDA_ERROR_NO_DEVICE))".to_owned(); n];
        assert_eq!(
            gpu_summary(&driver(14)),
            "14 GPU test(s) skipped: no CUDA driver"
        );
        let mut mixed = vec!["libnvrtc not found".to_owned()];
        mixed.extend(driver(2));
        assert_eq!(
            gpu_summary(&mixed),
            "3 GPU test(s) skipped: no CUDA driver (2), libnvrtc not found (1)"
        );
    }
}

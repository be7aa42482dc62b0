//! `cargo xtask test`: every test that can run on this machine, and a line for each
//! optional suite that cannot.

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

/// Compiles the MPI backend's doc example, builds `collectives/tests/mpi.rs` (one process
/// per rank, `harness = false`) and runs it under `mpirun` on two processes, then on four
/// (oversubscribed: its bit-for-bit checks against the thread backend's order need three
/// or more ranks for the order of additions to matter); then short `cargo xtask train
/// --backend mpi` runs (2 and 4 processes) that must end bit-identical to thread ranks.
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
    // The training example across processes, against the same run on thread ranks.
    crate::train::mpi_check()
}

pub fn run(args: &[String]) -> Result<(), Failure> {
    if let Some(a) = args.first() {
        return Err(Failure(format!("`test` takes no arguments, got `{a}`")));
    }
    run_status(cargo(&["test", "--workspace"]))?;
    // The CUDA backend's tests, compiled with the `cuda` feature. Without a GPU they
    // prove that a missing driver is a clean error, and print `skipped: no CUDA driver`.
    run_status(cargo(&[
        "test",
        "-p",
        "lowrank",
        "--features",
        "cuda",
        "--test",
        "primitives",
        "--lib",
        "--",
        "cuda",
        "--nocapture",
    ]))?;
    // The same for PowerSGD on CUDA buckets and for the NCCL backend.
    run_status(cargo(&[
        "test",
        "-p",
        "ddp-hooks",
        "--features",
        "cuda",
        "--test",
        "cuda",
        "--",
        "--nocapture",
    ]))?;
    run_status(cargo(&[
        "test",
        "-p",
        "collectives",
        "--features",
        "cuda",
        "--test",
        "nccl",
        "--test",
        "threads_cuda",
        "--",
        "--nocapture",
    ]))?;
    // The embedding features: the candle adapters (ddp-hooks, pipe) and pipeline × data
    // parallel (ddp-hooks' `pipe` feature).
    run_status(cargo(&[
        "test",
        "-p",
        "ddp-hooks",
        "--features",
        "candle,pipe",
        "--test",
        "candle",
        "--test",
        "pipeline",
    ]))?;
    run_status(cargo(&[
        "test",
        "-p",
        "pipe",
        "--features",
        "candle",
        "--test",
        "candle",
    ]))?;
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
    println!(
        "xtask test: all suites passed ({} optional suite(s) skipped)",
        skipped.len()
    );
    Ok(())
}

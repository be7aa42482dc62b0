//! `cargo xtask bench [SUITE] [--quick] [--json]`: the crates' own benchmarks, in release
//! builds. Each suite prints a table (or, with `--json`, one JSON object per line);
//! `--quick` keeps a suite's run under a minute, not counting compilation.

use crate::{cargo, run_status, Failure};

const SUITES: &[&str] = &["lowrank", "collectives", "hooks", "accum"];

pub fn run(args: &[String]) -> Result<(), Failure> {
    let mut quick = false;
    let mut json = false;
    let mut suites = Vec::new();
    for a in args {
        match a.as_str() {
            "--quick" => quick = true,
            "--json" => json = true,
            s if SUITES.contains(&s) => suites.push(s.to_string()),
            other => {
                return Err(Failure(format!(
                    "unknown bench argument `{other}`; suites: {}",
                    SUITES.join(", ")
                )))
            }
        }
    }
    if suites.is_empty() {
        suites = SUITES.iter().map(|s| s.to_string()).collect();
    }
    for suite in &suites {
        match suite.as_str() {
            "lowrank" => lowrank(quick, json)?,
            "collectives" => collectives(quick, json)?,
            "hooks" | "accum" => ddp_hooks(suite, quick, json)?,
            _ => unreachable!("suites are checked above"),
        }
    }
    Ok(())
}

/// The bandwidth table (cold cache, against a SIMD-sum reference and `gemm`), then the
/// criterion benchmarks of every primitive (skipped with `--json`, whose output is only
/// the table's JSON lines).
fn lowrank(quick: bool, json: bool) -> Result<(), Failure> {
    let mut table = vec!["bench", "-q", "-p", "lowrank", "--bench", "bandwidth", "--"];
    if quick {
        table.push("--quick");
    }
    if json {
        table.push("--json");
    }
    run_status(cargo(&table))?;
    if !json {
        let mut crit = vec![
            "bench",
            "-q",
            "-p",
            "lowrank",
            "--bench",
            "primitives",
            "--",
        ];
        if quick {
            crit.push("--quick");
        }
        run_status(cargo(&crit))?;
    }
    Ok(())
}

/// All-reduce bandwidth of the thread backend against memcpy (nccl-tests definitions),
/// then of the MPI backend under `mpirun -np 2` where Open MPI is installed.
fn collectives(quick: bool, json: bool) -> Result<(), Failure> {
    let mut flags = Vec::new();
    if quick {
        flags.push("--quick");
    }
    if json {
        flags.push("--json");
    }
    let mut args = vec![
        "bench",
        "-q",
        "-p",
        "collectives",
        "--bench",
        "allreduce",
        "--",
    ];
    args.extend(&flags);
    run_status(cargo(&args))?;
    if !(crate::on_path("mpirun") && crate::on_path("mpicc")) {
        eprintln!(
            "skipped: the MPI all-reduce bench (install libopenmpi-dev openmpi-bin libclang-dev)"
        );
        return Ok(());
    }
    let exe = crate::built_executable(
        "bench",
        &[
            "-p",
            "collectives",
            "--features",
            "mpi",
            "--bench",
            "allreduce_mpi",
        ],
        "allreduce_mpi",
    )?;
    let mut cmd = crate::mpirun(2);
    cmd.arg(exe).args(&flags);
    run_status(cmd)
}

/// Hook times and link-priced step times (`hooks`), or accumulation against syncing every
/// micro-step (`accum`).
fn ddp_hooks(suite: &str, quick: bool, json: bool) -> Result<(), Failure> {
    let mut args = vec![
        "bench",
        "-q",
        "-p",
        "ddp-hooks",
        "--bench",
        "hooks",
        "--",
        suite,
    ];
    if quick {
        args.push("--quick");
    }
    if json {
        args.push("--json");
    }
    run_status(cargo(&args))
}

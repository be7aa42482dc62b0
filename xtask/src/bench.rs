//! `cargo xtask bench [SUITE] [--quick] [--json]`: the crates' own benchmarks, in release
//! builds.
//!
//! With no suite, the compression-throughput report (`report.rs`, measured by
//! `ddp-hooks/benches/report.rs`): a table on the terminal, `target/bench/report.jsonl`
//! and `target/bench/speedup.svg`. A named suite prints its own table (or, with `--json`,
//! one JSON object per line); `--quick` keeps a suite's run under a minute and the report
//! under 90 seconds, not counting compilation. `--isa avx512|avx2|portable` runs the
//! report, `lowrank`'s bandwidth table and the `hooks` suite on that instruction set's
//! kernels (and the thread backend's 16-bit loops, through `LOWRANK_CPU_CAPABILITY`), as
//! a CPU without a wider one would.

mod report;
mod rows;
mod svg;

use crate::{cargo, run_status, Failure};

/// The suites `bench SUITE` runs; `report` is the default.
const SUITES: &[&str] = &["report", "lowrank", "collectives", "hooks", "accum", "pipe"];

/// What `cargo xtask bench` was asked to do.
pub struct Options {
    quick: bool,
    json: bool,
    suites: Vec<String>,
    /// `--isa NAME`: the instruction set whose kernels `report`, `lowrank` and `hooks`
    /// measure (as on a CPU without a wider one); all the machine has when absent.
    isa: Option<String>,
}

/// The instruction sets `--isa` takes.
const ISAS: &[&str] = &["avx512", "avx2", "portable"];

/// Parses the arguments of `bench`; an unknown one is an error for the usage message.
pub fn parse(args: &[String]) -> Result<Options, String> {
    let mut o = Options {
        quick: false,
        json: false,
        suites: Vec::new(),
        isa: None,
    };
    let mut args = args.iter();
    while let Some(a) = args.next() {
        match a.as_str() {
            "--quick" => o.quick = true,
            "--json" => o.json = true,
            "--isa" => match args.next() {
                Some(v) if ISAS.contains(&v.as_str()) => o.isa = Some(v.clone()),
                v => {
                    return Err(format!(
                        "--isa takes one of {}, got {v:?}",
                        ISAS.join(", ")
                    ))
                }
            },
            s if SUITES.contains(&s) => o.suites.push(s.to_string()),
            other => {
                return Err(format!(
                    "unknown bench argument `{other}`; suites: {} (default: report); flags: --quick, --json, --isa avx512|avx2|portable",
                    SUITES.join(", ")
                ))
            }
        }
    }
    if o.suites.is_empty() {
        o.suites.push("report".into());
    }
    Ok(o)
}

/// Runs the suites in the order given.
pub fn run(o: Options) -> Result<(), Failure> {
    for suite in &o.suites {
        match suite.as_str() {
            "report" => report::run(o.quick, o.json, o.isa.as_deref())?,
            "lowrank" => lowrank(o.quick, o.json, o.isa.as_deref())?,
            "collectives" => collectives(o.quick, o.json)?,
            "hooks" | "accum" => ddp_hooks(suite, o.quick, o.json, o.isa.as_deref())?,
            "pipe" => pipe(o.quick, o.json)?,
            other => return Err(Failure(format!("no suite `{other}`"))),
        }
    }
    Ok(())
}

/// The `pipe` crate's benchmark (speedup over the unpipelined model per schedule,
/// checkpoint mode and micro-batch count, the per-action overhead, the timeline picture),
/// then stages on ranks (`pipe --features collectives`, with `mpi` where `mpirun` is on
/// `PATH`: the same stack on two thread ranks and two processes against the in-process
/// pipe), then pipeline × data parallel (`ddp-hooks --features pipe`: 2 ranks × 2 partitions,
/// exposed communication with a sleeping link, per-partition against after-backward
/// launch).
fn pipe(quick: bool, json: bool) -> Result<(), Failure> {
    let flags = |mut args: Vec<&'static str>| {
        if quick {
            args.push("--quick");
        }
        if json {
            args.push("--json");
        }
        args
    };
    run_status(cargo(&flags(vec![
        "bench", "-q", "-p", "pipe", "--bench", "pipe", "--",
    ])))?;
    run_status(cargo(&flags(vec![
        "bench",
        "-q",
        "-p",
        "pipe",
        "--bench",
        "schedules",
        "--",
    ])))?;
    let features = if crate::on_path("mpirun") {
        "collectives,mpi"
    } else {
        "collectives"
    };
    run_status(cargo(&flags(vec![
        "bench",
        "-q",
        "-p",
        "pipe",
        "--features",
        features,
        "--bench",
        "ranks",
        "--",
    ])))?;
    run_status(cargo(&flags(vec![
        "bench",
        "-q",
        "-p",
        "ddp-hooks",
        "--features",
        "pipe",
        "--bench",
        "pipeline",
        "--",
    ])))
}

/// The bandwidth table (cold cache, against a SIMD-sum reference and `gemm`), then the
/// criterion benchmarks of every primitive (skipped with `--json`, whose output is only
/// the table's JSON lines).
fn lowrank(quick: bool, json: bool, isa: Option<&str>) -> Result<(), Failure> {
    let mut table = vec!["bench", "-q", "-p", "lowrank", "--bench", "bandwidth", "--"];
    if quick {
        table.push("--quick");
    }
    if let Some(isa) = isa {
        table.extend(["--isa", isa]);
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
fn ddp_hooks(suite: &str, quick: bool, json: bool, isa: Option<&str>) -> Result<(), Failure> {
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
    if let Some(isa) = isa {
        args.extend(["--isa", isa]);
    }
    run_status(cargo(&args))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_report_is_the_default_and_unknown_arguments_are_errors() {
        let o = parse(&args(&["--quick"])).unwrap();
        assert_eq!((o.suites, o.quick), (vec!["report".to_string()], true));
        let o = parse(&args(&["hooks", "--json"])).unwrap();
        assert_eq!((o.suites, o.json), (vec!["hooks".to_string()], true));
        let e = parse(&args(&["hook"])).err().unwrap();
        assert!(e.contains("unknown bench argument `hook`"), "{e}");
        let o = parse(&args(&["lowrank", "--isa", "avx2"])).unwrap();
        assert_eq!(o.isa.as_deref(), Some("avx2"));
        for bad in [&["--isa"][..], &["--isa", "sse2"]] {
            let e = parse(&args(bad)).err().unwrap();
            assert!(
                e.contains("--isa takes one of avx512, avx2, portable"),
                "{e}"
            );
        }
    }
}

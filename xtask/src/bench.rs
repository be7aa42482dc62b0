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
//!
//! The report's own flags: `--shapes FILE` (the user's model: a JSON list of parameter
//! shapes, or `{"name": ..., "shapes": [...]}`), `--models A,B` (presets), `--ranks N`
//! (the link model's world size), `--steps K` (timed steps), `--backward-ms MS` (the
//! measured backward pass the buckets overlap with: step times instead of
//! communication-only ones), `--gpu-report FILE` (GPU hook times from `gpu-check`'s
//! `cuda_hooks.jsonl`, merged as rows of their own). All but `--gpu-report` go to the
//! report bench, which checks them again.

mod gpu;
mod report;
mod rows;
mod svg;

/// The presets and the shapes-file reader of the report bench (the same files).
#[path = "../../ddp-hooks/benches/models/mod.rs"]
mod models;
/// The step-time model the report bench prices its rows with (the same file).
#[path = "../../ddp-hooks/benches/measure/overlap.rs"]
mod overlap;

use crate::{cargo, run_status, Failure};
use std::path::PathBuf;

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
    /// `--roofline`: `bench lowrank` measures each kernel against its in-core limit
    /// (`M` in L2) instead of the cold-cache table.
    roofline: bool,
    /// The report's own options.
    report: ReportOptions,
}

/// The options that only the report takes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ReportOptions {
    /// `--shapes FILE`: the user's model (checked here, read again by the bench).
    pub shapes: Option<PathBuf>,
    /// `--models A,B`: presets (checked against the bench's list).
    pub models: Option<String>,
    /// `--ranks N`: the link model's world size.
    pub ranks: Option<usize>,
    /// `--steps K`: timed steps per model.
    pub steps: Option<usize>,
    /// `--backward-ms MS`: the measured backward that the buckets overlap with.
    pub backward_ms: Option<f64>,
    /// `--gpu-report FILE`: GPU hook times to merge (`cuda_hooks.jsonl`).
    pub gpu_report: Option<PathBuf>,
}

impl ReportOptions {
    /// The arguments for the report bench (everything but `--gpu-report`, which xtask
    /// merges itself).
    pub fn bench_args(&self) -> Vec<String> {
        let mut a = Vec::new();
        if let Some(f) = &self.shapes {
            a.extend(["--shapes".to_string(), f.display().to_string()]);
        }
        if let Some(m) = &self.models {
            a.extend(["--models".to_string(), m.clone()]);
        }
        if let Some(n) = self.ranks {
            a.extend(["--ranks".to_string(), n.to_string()]);
        }
        if let Some(k) = self.steps {
            a.extend(["--steps".to_string(), k.to_string()]);
        }
        if let Some(ms) = self.backward_ms {
            a.extend(["--backward-ms".to_string(), ms.to_string()]);
        }
        a
    }

    fn any(&self) -> bool {
        *self != ReportOptions::default()
    }
}

/// The most ranks `--ranks` takes (as the report bench).
const MAX_LINK_RANKS: usize = 1 << 20;

/// The value after `flag`, or an error naming what it takes.
fn value<'a>(
    args: &mut impl Iterator<Item = &'a String>,
    flag: &str,
    what: &str,
) -> Result<&'a String, String> {
    args.next().ok_or_else(|| format!("{flag} takes {what}"))
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
        roofline: false,
        report: ReportOptions::default(),
    };
    let mut args = args.iter();
    while let Some(a) = args.next() {
        match a.as_str() {
            "--quick" => o.quick = true,
            "--json" => o.json = true,
            "--roofline" => o.roofline = true,
            "--isa" => match args.next() {
                Some(v) if ISAS.contains(&v.as_str()) => o.isa = Some(v.clone()),
                v => {
                    return Err(format!(
                        "--isa takes one of {}, got {v:?}",
                        ISAS.join(", ")
                    ))
                }
            },
            "--shapes" => {
                let f = value(&mut args, a, "a JSON file of parameter shapes")?;
                let model = models::shapes::read(std::path::Path::new(f))?;
                if models::presets().iter().any(|(n, ..)| *n == model.name) {
                    return Err(format!(
                        "--shapes {f}: the model is named `{}`, as a preset is; name it otherwise with {{\"name\": ..., \"shapes\": [...]}}",
                        model.name
                    ));
                }
                o.report.shapes = Some(PathBuf::from(f));
            }
            "--models" => {
                let v = value(&mut args, a, "a comma-separated list of presets")?;
                let known: Vec<&str> = models::presets().iter().map(|p| p.0).collect();
                if let Some(bad) = v.split(',').find(|m| !known.contains(m)) {
                    return Err(format!(
                        "--models: unknown model `{bad}`; the presets are {}",
                        known.join(", ")
                    ));
                }
                o.report.models = Some(v.clone());
            }
            "--ranks" => {
                let v = value(&mut args, a, "a world size")?;
                o.report.ranks = Some(
                    v.parse()
                        .ok()
                        .filter(|n| (2..=MAX_LINK_RANKS).contains(n))
                        .ok_or(format!(
                            "--ranks {v}: expected an integer from 2 to {MAX_LINK_RANKS}"
                        ))?,
                );
            }
            "--steps" => {
                let v = value(&mut args, a, "a number of timed steps")?;
                o.report.steps = Some(
                    v.parse()
                        .ok()
                        .filter(|&n: &usize| n > 0)
                        .ok_or(format!("--steps {v}: expected a positive integer"))?,
                );
            }
            "--backward-ms" => {
                let v = value(&mut args, a, "the backward pass's milliseconds")?;
                o.report.backward_ms = Some(
                    v.parse::<f64>()
                        .ok()
                        .filter(|x| x.is_finite() && *x > 0.0 && *x <= 1e7)
                        .ok_or(format!(
                            "--backward-ms {v}: expected a positive number of milliseconds (at most 1e7)"
                        ))?,
                );
            }
            "--gpu-report" => {
                let f = value(&mut args, a, "the cuda_hooks.jsonl that gpu-check wrote")?;
                gpu::read(std::path::Path::new(f))?;
                o.report.gpu_report = Some(PathBuf::from(f));
            }
            s if SUITES.contains(&s) => o.suites.push(s.to_string()),
            other => {
                return Err(format!(
                    "unknown bench argument `{other}`; suites: {} (default: report); flags: --quick, --json, --isa avx512|avx2|portable, --roofline (lowrank); the report's: --shapes FILE, --models A,B, --ranks N, --steps K, --backward-ms MS, --gpu-report FILE",
                    SUITES.join(", ")
                ))
            }
        }
    }
    if o.suites.is_empty() {
        o.suites.push("report".into());
    }
    if o.roofline && o.suites.iter().any(|s| s != "lowrank") {
        return Err("--roofline is `bench lowrank`'s; run it as `bench lowrank --roofline`".into());
    }
    if o.report.any() && o.suites.iter().any(|s| s != "report") {
        return Err(
            "--shapes, --models, --ranks, --steps, --backward-ms and --gpu-report are the report's; run them without another suite"
                .into(),
        );
    }
    Ok(o)
}

/// Runs the suites in the order given.
pub fn run(o: Options) -> Result<(), Failure> {
    for suite in &o.suites {
        match suite.as_str() {
            "report" => report::run(o.quick, o.json, o.isa.as_deref(), &o.report)?,
            "lowrank" => lowrank(o.quick, o.json, o.isa.as_deref(), o.roofline)?,
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
/// the table's JSON lines). With `roofline`, only the in-core table: every kernel and
/// rank with `M` in L2 against the lower of its FMA and L2-stream bounds.
fn lowrank(quick: bool, json: bool, isa: Option<&str>, roofline: bool) -> Result<(), Failure> {
    let mut table = vec!["bench", "-q", "-p", "lowrank", "--bench", "bandwidth", "--"];
    if roofline {
        table.push("--roofline");
    }
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
    if !json && !roofline {
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
    use super::overlap::{break_even, ready_fractions, BucketCost, Profile};
    use super::*;

    fn bucket(ready: f64, hook_ms: f64, link_ms: f64) -> BucketCost {
        // All of the link time scales with the bandwidth: `link_ms` at 1 Gbit/s.
        BucketCost {
            ready,
            hook_ms,
            link_fixed_ms: 0.0,
            link_ms_gbit: link_ms,
        }
    }

    fn profile(buckets: Vec<BucketCost>) -> Profile {
        Profile { buckets, period: 1 }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9 * b.abs().max(1.0)
    }

    /// One bucket, ready at the end of the backward: nothing overlaps, the step is the
    /// backward plus the bucket's hook and link time.
    #[test]
    fn overlap_of_a_single_bucket() {
        let p = profile(vec![bucket(1.0, 3.0, 20.0)]);
        assert!(close(p.comm_only_ms(1.0), 23.0));
        assert!(close(p.step_ms(50.0, 1.0), 50.0 + 3.0 + 20.0));
        assert!(close(p.step_ms(50.0, 10.0), 50.0 + 3.0 + 2.0));
    }

    /// Four buckets ready at 10, 20, 30, 40 ms of a 40 ms backward, each 1 ms of hook.
    /// Link slower than the backward (9 ms a bucket): they queue on the link, the step is
    /// the first ready time plus all their work, 10 + 4 * 10 = 50 ms. Link faster (1 ms a
    /// bucket): each is done 2 ms after it is ready, all hidden but the last, 42 ms. With
    /// no backward, the communication-only time.
    #[test]
    fn overlap_with_a_slow_and_a_fast_link() {
        let slow = profile((1..=4).map(|k| bucket(k as f64 / 4.0, 1.0, 9.0)).collect());
        assert!(close(slow.step_ms(40.0, 1.0), 50.0));
        // Hand-computed: ends 20, 30, 40, 50.
        let fast = profile((1..=4).map(|k| bucket(k as f64 / 4.0, 1.0, 1.0)).collect());
        assert!(close(fast.step_ms(40.0, 1.0), 42.0));
        // At 10 Gbit/s the slow link's buckets take 1.9 ms: 40 + 1.9 = 41.9.
        assert!(close(slow.step_ms(40.0, 10.0), 41.9));
        for p in [&slow, &fast] {
            assert!(close(p.step_ms(0.0, 1.0), p.comm_only_ms(1.0)));
        }
        // The step is never shorter than the backward, nor than the communication.
        assert!(
            fast.step_ms(40.0, 1.0) >= 40.0 && slow.step_ms(40.0, 1.0) >= slow.comm_only_ms(1.0)
        );
        // A bucket that becomes ready while the link is busy waits: 0.25 and 0.3 of a
        // 100 ms backward, 30 ms each: ends 55, then max(30, 55) + 30 = 85, step 100.
        let queued = profile(vec![bucket(0.25, 0.0, 30.0), bucket(0.3, 0.0, 30.0)]);
        assert!(close(queued.step_ms(100.0, 1.0), 100.0));
        assert!(close(queued.step_ms(50.0, 1.0), 12.5 + 60.0));
    }

    /// Amortised rows do not overlap: backward plus their share of the communication.
    #[test]
    fn amortised_rows_add_their_share() {
        let p = Profile {
            buckets: vec![bucket(0.5, 2.0, 10.0), bucket(1.0, 2.0, 10.0)],
            period: 4,
        };
        assert!(close(p.comm_only_ms(1.0), 6.0));
        assert!(close(p.step_ms(50.0, 1.0), 56.0));
    }

    /// Buckets are ready when their last gradient is, the backward running over the
    /// elements in reverse parameter order.
    #[test]
    fn ready_fractions_follow_the_reverse_order() {
        let shapes = vec![vec![10], vec![30], vec![60]];
        // Launch order: the last parameter first.
        let r = ready_fractions(&shapes, &[vec![2], vec![0, 1]]);
        assert!(close(r[0], 0.6) && close(r[1], 1.0), "{r:?}");
        let r = ready_fractions(&shapes, &[vec![1, 2], vec![0]]);
        assert!(close(r[0], 0.9) && close(r[1], 1.0), "{r:?}");
    }

    /// The break-even search finds the closed-form crossing of two lines, and none where
    /// one side wins everywhere.
    #[test]
    fn break_even_matches_the_closed_form() {
        // 15 + 1/g against 5 + 100/g: g = 99 / 10.
        let b = break_even(|g| 15.0 + 1.0 / g, |g| 5.0 + 100.0 / g).unwrap();
        assert!((b - 9.9).abs() < 1e-6, "{b}");
        assert_eq!(break_even(|g| 4.0 + 1.0 / g, |g| 5.0 + 100.0 / g), None);
        assert_eq!(break_even(|g| 9.0 + 150.0 / g, |g| 5.0 + 100.0 / g), None);
        // With a backward that hides the all-reduce at high speed the crossing moves.
        let ar = profile(vec![bucket(0.5, 1.0, 50.0), bucket(1.0, 1.0, 50.0)]);
        let psgd = profile(vec![bucket(0.5, 5.0, 0.5), bucket(1.0, 5.0, 0.5)]);
        let comm = break_even(|g| psgd.comm_only_ms(g), |g| ar.comm_only_ms(g)).unwrap();
        let step = break_even(|g| psgd.step_ms(100.0, g), |g| ar.step_ms(100.0, g)).unwrap();
        assert!((comm - 99.0 / 8.0).abs() < 1e-6, "{comm}");
        // Overlapped, only the last bucket is exposed: 5 + 0.5/g = 1 + 50/g, g = 49.5/4.
        assert!((step - 49.5 / 4.0).abs() < 1e-6, "{step}");
    }

    /// A shapes file as PyTorch prints it, the object form, and every bad file.
    #[test]
    fn shapes_files() {
        use super::models::shapes::{parse, MAX_ELEMENTS};
        let m = parse("[[768, 768], [768], []]", "mine").unwrap();
        assert_eq!(m.name, "mine");
        assert_eq!(m.shapes, vec![vec![768, 768], vec![768], vec![1]]);
        let m = parse(r#"{"name": "my model", "shapes": [[4, 3, 2]]}"#, "f").unwrap();
        assert_eq!(
            (m.name.as_str(), m.shapes),
            ("my model", vec![vec![4, 3, 2]])
        );
        let too_many = format!("[[{MAX_ELEMENTS}], [1]]");
        for (text, want) in [
            ("[[768, 768", "not JSON"),
            ("[]", "empty"),
            (
                "[[768, 0]]",
                "dimension 0 of shape [768,0] is not a positive integer",
            ),
            ("[[768, -1]]", "dimension -1"),
            ("[[1.5]]", "dimension 1.5"),
            ("[768]", "parameter 0: a shape is a list"),
            ("{\"shape\": []}", "unknown key `shape`"),
            ("{\"name\": \"x\"}", "no `shapes`"),
            ("42", "expected a list of shapes"),
            (too_many.as_str(), "200000000 gradient elements"),
            ("[[100000, 100000, 100000, 100000, 100000]]", "200000000"),
        ] {
            let e = parse(text, "f").unwrap_err();
            assert!(e.contains(want), "{text}: {e}");
        }
    }

    /// The report's flags go to the bench as given; bad ones are errors here.
    #[test]
    fn report_flags() {
        let dir = std::env::temp_dir().join(format!("xtask-flags-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("tiny.json");
        std::fs::write(&good, "[[64, 32], [64]]").unwrap();
        let preset = dir.join("preset.json");
        std::fs::write(&preset, r#"{"name": "bert-base", "shapes": [[1]]}"#).unwrap();
        let good_s = good.display().to_string();
        let o = parse(&args(&[
            "--shapes",
            &good_s,
            "--models",
            "bert-base,resnet50",
            "--ranks",
            "64",
            "--steps",
            "3",
            "--backward-ms",
            "50",
        ]))
        .unwrap();
        assert_eq!(o.suites, vec!["report".to_string()]);
        assert_eq!(
            o.report.bench_args(),
            args(&[
                "--shapes",
                &good_s,
                "--models",
                "bert-base,resnet50",
                "--ranks",
                "64",
                "--steps",
                "3",
                "--backward-ms",
                "50"
            ])
        );
        let preset_s = preset.display().to_string();
        for (bad, want) in [
            (vec!["--models", "bert"], "unknown model `bert`; the presets are linear4x1024, resnet50, bert-base, gpt2-small"),
            (vec!["--ranks", "1"], "--ranks 1: expected an integer from 2"),
            (vec!["--ranks"], "--ranks takes"),
            (vec!["--backward-ms", "-3"], "--backward-ms -3"),
            (vec!["--backward-ms", "NaN"], "--backward-ms NaN"),
            (vec!["--steps", "0"], "--steps 0"),
            (vec!["--shapes", "/nonexistent/x.json"], "cannot read it"),
            (vec!["--shapes", &preset_s], "as a preset is"),
            (vec!["--gpu-report", "/nonexistent/c.jsonl"], "cannot read it"),
            (vec!["hooks", "--ranks", "4"], "are the report's"),
            (vec!["--backwards-ms", "4"], "unknown bench argument `--backwards-ms`"),
        ] {
            let e = parse(&args(&bad)).err().unwrap();
            assert!(e.contains(want), "{bad:?}: {e}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

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
        assert!(parse(&args(&["lowrank", "--roofline"])).unwrap().roofline);
        let e = parse(&args(&["hooks", "--roofline"])).err().unwrap();
        assert!(e.contains("`bench lowrank --roofline`"), "{e}");
        for bad in [&["--isa"][..], &["--isa", "sse2"]] {
            let e = parse(&args(bad)).err().unwrap();
            assert!(
                e.contains("--isa takes one of avx512, avx2, portable"),
                "{e}"
            );
        }
    }
}

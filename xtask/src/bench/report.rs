//! The compression-throughput report: runs `ddp-hooks/benches/report.rs` (release),
//! shows a progress bar while it measures, merges the GPU rows of `--gpu-report`, then
//! prints the table and writes `target/bench/report.jsonl`, `report.txt` and
//! `speedup.svg`.

use super::rows::{Machine, Row, SPEEDS};
use super::ReportOptions;
use crate::{built_executable, Failure};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::Value;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};

/// The folder of the report's files: `target/bench` (or under `CARGO_TARGET_DIR`).
fn out_dir() -> PathBuf {
    crate::target_dir().join("bench")
}

/// Builds and runs the report, then writes its files and prints the table (or, with
/// `json`, the JSON lines).
pub fn run(
    quick: bool,
    json: bool,
    isa: Option<&str>,
    options: &ReportOptions,
) -> Result<(), Failure> {
    let gpu = match &options.gpu_report {
        Some(f) => Some(super::gpu::read(f).map_err(Failure)?),
        None => None,
    };
    let exe = built_executable("bench", &["-p", "ddp-hooks", "--bench", "report"], "report")?;
    let started = std::time::Instant::now();
    let mut cmd = Command::new(&exe);
    // The bench runs in the workspace root, so a relative `--shapes` means what it meant
    // where xtask was started only if it is made absolute first.
    let mut options = options.clone();
    if let Some(f) = &options.shapes {
        options.shapes = Some(std::path::absolute(f)?);
    }
    if quick {
        cmd.arg("--quick");
    }
    if let Some(isa) = isa {
        cmd.args(["--isa", isa]);
    }
    cmd.args(options.bench_args());
    cmd.stdout(Stdio::piped()).stderr(Stdio::inherit());
    eprintln!("xtask: running {cmd:?}");
    let mut child = cmd
        .spawn()
        .map_err(|e| Failure(format!("could not start {}: {e}", exe.display())))?;
    let stdout = child.stdout.take().expect("stdout is piped");
    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template("{elapsed:>4} [{bar:30}] {pos}/{len} {msg}")
            .expect("a valid template")
            .progress_chars("=> "),
    );
    let mut machine = None;
    let mut rows = Vec::new();
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        let Ok(v) = serde_json::from_str::<Value>(&line) else {
            bar.println(line);
            continue;
        };
        match v["kind"].as_str() {
            Some("machine") => {
                let m = Machine(v);
                bar.println(m.describe());
                machine = Some(m);
            }
            Some("plan") => bar.set_length(v["rows"].as_u64().unwrap_or(0)),
            Some("start") => {
                let rank = v["rank"].as_u64().unwrap_or(0);
                let rank = if rank > 0 {
                    format!(" rank {rank}")
                } else {
                    String::new()
                };
                bar.set_message(format!(
                    "{} {}{rank}",
                    v["model"].as_str().unwrap_or("?"),
                    v["hook"].as_str().unwrap_or("?")
                ));
            }
            Some("row") => {
                rows.push(Row(v));
                bar.inc(1);
            }
            _ => bar.println(line),
        }
    }
    let status = child.wait()?;
    bar.finish_and_clear();
    if !status.success() {
        return Err(Failure(format!("{} failed with {status}", exe.display())));
    }
    let machine = machine.ok_or_else(|| Failure("the report named no machine".into()))?;
    if rows.is_empty() {
        return Err(Failure("the report measured no rows".into()));
    }
    let notes = match &gpu {
        Some(gpu) => super::gpu::merge(&mut rows, gpu, machine.backward_ms()),
        None => Vec::new(),
    };
    let dir = out_dir();
    std::fs::create_dir_all(&dir)?;
    let jsonl: String = rows.iter().map(|r| r.jsonl() + "\n").collect();
    std::fs::write(dir.join("report.jsonl"), &jsonl)?;
    let text = table(&machine, &rows, &notes);
    std::fs::write(dir.join("report.txt"), &text)?;
    std::fs::write(dir.join("speedup.svg"), super::svg::chart(&machine, &rows))?;
    if json {
        print!("{jsonl}");
    } else {
        print!("{text}");
    }
    eprintln!(
        "xtask: report measured in {:.0} s; wrote {}/report.jsonl, report.txt, speedup.svg",
        started.elapsed().as_secs_f64(),
        dir.display()
    );
    Ok(())
}

/// Bytes with a decimal unit: `16.8 MB`.
fn bytes(b: f64) -> String {
    let (v, unit) = if b >= 1e9 {
        (b / 1e9, "GB")
    } else if b >= 1e6 {
        (b / 1e6, "MB")
    } else if b >= 1e3 {
        (b / 1e3, "kB")
    } else {
        (b, "B")
    };
    format!("{v:.1} {unit}")
}

/// The `ws/LLC` cell of a row: its working set over the last-level cache, with `*` where
/// it is at most 2 as printed (part of it stays cached); `-` where either is unknown.
fn ws_over_llc(r: &Row) -> String {
    let x = r.num("working_set_bytes") / r.num("llc_bytes");
    if !x.is_finite() {
        return "-".into();
    }
    // As the bench flags it: to the two decimals shown.
    let star = if (x * 100.0).round() <= 200.0 {
        "*"
    } else {
        ""
    };
    format!("{x:.2}{star}")
}

/// A millisecond figure with three significant digits or so.
fn ms(x: f64) -> String {
    if x >= 100.0 {
        format!("{x:.0}")
    } else if x >= 10.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.2}")
    }
}

/// A number, or `-` where there is none.
fn or_dash(x: f64, show: impl Fn(f64) -> String) -> String {
    if x.is_finite() {
        show(x)
    } else {
        "-".into()
    }
}

/// The break-even column of the figures keyed `prefix` (`comm_only` or `step`): where
/// the hook stops beating its baseline, or whether one of the two wins at every speed.
fn break_even(row: &Row, base: Option<&Row>, prefix: &str, backward: Option<f64>) -> String {
    if let Some(b) = row.0[format!("{prefix}_break_even_gbit")].as_f64() {
        return format!("< {b:.1} Gbit/s");
    }
    let Some(base) = base else {
        return "-".into();
    };
    if row.label() == base.label() {
        return "-".into();
    }
    // No crossing: the hook wins everywhere or nowhere; its time at 1 Gbit/s says which.
    let backward = if prefix == "step" { backward } else { None };
    if row.time_ms(backward, 1.0) < base.time_ms(backward, 1.0) {
        "always".into()
    } else {
        "never".into()
    }
}

/// One table of priced figures: `prefix` `comm_only` or `step`.
fn priced_table(
    t: &mut String,
    rows: &[Row],
    prefix: &str,
    backward: Option<f64>,
    w: (usize, usize),
) {
    let (wm, wh) = w;
    let _ = write!(t, "{:<wm$} {:<wh$}", "model", "hook");
    for s in SPEEDS {
        let _ = write!(t, " {:>16}", format!("{s} Gbit/s"));
    }
    let _ = writeln!(t, " {:>16}", "break-even");
    for r in rows {
        let base = r.base_in(rows);
        let _ = write!(t, "{:<wm$} {:<wh$}", r.str("model"), r.label());
        for s in SPEEDS {
            let cell = format!(
                "{} ({:.2}x)",
                ms(r.at(&format!("{prefix}_ms_at"), s)),
                r.at(&format!("{prefix}_speedup_at"), s)
            );
            let _ = write!(t, " {cell:>16}");
        }
        let _ = writeln!(t, " {:>16}", break_even(r, base, prefix, backward));
    }
}

/// The terminal table: what was measured, then what it predicts per link speed. `notes`:
/// the GPU merge's.
pub fn table(machine: &Machine, rows: &[Row], notes: &[String]) -> String {
    let mut t = String::new();
    let backward = machine.backward_ms();
    let n = machine.link_ranks();
    let _ = writeln!(t, "compression-throughput report");
    let _ = writeln!(t, "machine: {}", machine.describe());
    let _ = writeln!(t, "method:  {}", machine.method());
    match backward {
        None => {
            let _ = writeln!(
                t,
                "figures: COMMUNICATION-ONLY: hook time + modelled link time per step; no forward or backward, no overlap.\n         Speedups are of the communication alone; pass --backward-ms MS (your measured backward pass) for step times."
            );
        }
        Some(b) => {
            let _ = writeln!(
                t,
                "figures: comm-only ms (hook + link, no compute, no overlap), and step ms: a {b} ms backward producing the\n         buckets in reverse order, each bucket's hook and link starting when it is ready, one stream serialising them;\n         the step ends when the last bucket is reduced (end_k = max(ready_k * {b}, end_k-1) + hook_k + link_k; step = max({b}, end_last))."
            );
        }
    }
    let _ = writeln!(
        t,
        "ranks:   the link is priced for {n} ranks (--ranks N; the hooks ran on {} thread ranks). A ring all-reduce sends 2(N-1)/N of\n         its payload per rank, so the all-reduce's link time grows with N (to twice that of 2 ranks) while PowerSGD's hook\n         time does not: PowerSGD's advantage grows with N (the all-gather based quantize hooks send (N-1)x their payload).",
        machine.0["ranks"]
    );
    for note in notes {
        let _ = writeln!(t, "gpu:     {note}");
    }
    let _ = writeln!(t);
    let wm = rows
        .iter()
        .map(|r| r.str("model").chars().count())
        .max()
        .unwrap_or(0)
        .max(13);
    let wh = rows
        .iter()
        .map(|r| r.label().chars().count())
        .max()
        .unwrap_or(0)
        .max(19);
    let _ = writeln!(
        t,
        "{:<wm$} {:<wh$} {:>20} {:>7} {:>10} {:>8} {:>6} {:>6} {:>7} {:>6}",
        "model",
        "hook",
        "hook ms (min-max)",
        "GB/s",
        "sent/rank",
        "ratio",
        "bound",
        "1t",
        "ws/LLC",
        "/ AR"
    );
    for r in rows {
        let times = |key: &str| {
            r.field(key)
                .as_f64()
                .map_or("-".to_string(), |b| format!("{b:.2}x"))
        };
        let (bound, bound_1t) = (times("bound_ratio"), times("bound_ratio_1t"));
        let ws = ws_over_llc(r);
        let vs = r.0["vs_allreduce"]
            .as_f64()
            .map_or("-".to_string(), |v| format!("{v:.2}x"));
        let hook = if r.num("hook_ms_min").is_finite() {
            format!(
                "{} ({}-{})",
                ms(r.num("hook_ms")),
                ms(r.num("hook_ms_min")),
                ms(r.num("hook_ms_max"))
            )
        } else {
            ms(r.num("hook_ms"))
        };
        let _ = writeln!(
            t,
            "{:<wm$} {:<wh$} {:>20} {:>7} {:>10} {:>7.0}x {:>6} {:>6} {:>7} {:>6}",
            r.str("model"),
            r.label(),
            hook,
            or_dash(r.num("gbps"), |g| format!("{g:.2}")),
            bytes(r.num("bytes_sent")),
            r.num("compression_ratio"),
            bound,
            bound_1t,
            ws,
            vs
        );
    }
    let _ = writeln!(t);
    let _ = writeln!(
        t,
        "comm-only ms (speedup over allreduce) at link speed: hook + link, no forward/backward, no overlap; break-even: the hook is faster below it"
    );
    priced_table(&mut t, rows, "comm_only", backward, (wm, wh));
    if let Some(b) = backward {
        let _ = writeln!(t);
        let _ = writeln!(
            t,
            "step ms (backward {b} ms, overlapped) (speedup over allreduce) at link speed; break-even: the hook is faster below it"
        );
        priced_table(&mut t, rows, "step", backward, (wm, wh));
    }
    let _ = writeln!(
        t,
        "\nhook ms: median of the timed steps (slowest rank per step); GB/s: gradient bytes per rank / hook time;"
    );
    let _ = writeln!(
        t,
        "sent/rank: payload bytes each rank puts into collectives per step; ratio: gradient bytes / sent;"
    );
    let _ = writeln!(
        t,
        "bound: median over the steps of hook time / its memory traffic (7 passes over the gradient for PowerSGD, 2 for allreduce and fp16/bf16)"
    );
    let _ = writeln!(
        t,
        "       at each rank's share of the read bandwidth all ranks got reading at once in the same step round (1.00x = memory-bound);"
    );
    let _ = writeln!(
        t,
        "1t: median hook time / the same traffic at the 1-thread read bandwidth (each rank alone on the memory system);"
    );
    let _ = writeln!(
        t,
        "ws/LLC: bytes one step streams on all ranks for the largest bucket (PowerSGD: gradient + error memory) / last-level cache;"
    );
    let _ = writeln!(
        t,
        "        * = at most 2: partly or wholly cache-resident, so the DRAM bounds do not hold;"
    );
    let _ = writeln!(
        t,
        "/ AR: fp16/bf16 run alternated step by step with allreduce; median over the steps of their time / allreduce's."
    );
    if rows.iter().any(|r| !r.0["device"].is_null()) {
        let _ = writeln!(
            t,
            "gpu rows: hook ms measured on the GPU by gpu-check (NCCL world size 1: the compression's device work and host part); bytes, buckets and link as the CPU row; bound: cuda_hooks' HBM bound."
        );
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::overlap::{priced, BucketCost, Profile};
    use serde_json::json;

    /// A row whose one bucket costs `hook + per_gbit / g` ms, priced against `base`.
    fn row(
        hook: &str,
        hook_ms: f64,
        per_gbit: f64,
        base: Option<&Profile>,
        backward: Option<f64>,
    ) -> (Row, Profile) {
        let p = Profile {
            buckets: vec![BucketCost {
                ready: 1.0,
                hook_ms,
                link_fixed_ms: 0.0,
                link_ms_gbit: per_gbit,
            }],
            period: 1,
        };
        let mut v = json!({"model": "m", "hook": hook, "rank": 0});
        v.as_object_mut()
            .unwrap()
            .extend(priced(&p, base.unwrap_or(&p), backward));
        (Row(v), p)
    }

    /// The break-even column names the crossing, or which side wins everywhere.
    #[test]
    fn break_even_column() {
        let (base, bp) = row("allreduce", 5.0, 100.0, None, None);
        assert_eq!(break_even(&base, Some(&base), "comm_only", None), "-");
        // 15 + 1/g = 5 + 100/g at g = 9.9.
        let (r, _) = row("powersgd", 15.0, 1.0, Some(&bp), None);
        assert_eq!(
            break_even(&r, Some(&base), "comm_only", None),
            "< 9.9 Gbit/s"
        );
        let (r, _) = row("powersgd", 4.0, 1.0, Some(&bp), None);
        assert_eq!(break_even(&r, Some(&base), "comm_only", None), "always");
        let (r, _) = row("fp16", 9.0, 150.0, Some(&bp), None);
        assert_eq!(break_even(&r, Some(&base), "comm_only", None), "never");
    }

    /// `ws/LLC` flags a working set of at most twice the cache as printed (4 x Linear's
    /// 67.2 MB on 32 MiB is 2.002), and a GPU row shows none of the CPU's.
    #[test]
    fn ws_over_llc_column() {
        let r = |ws: u64, device: Option<&str>| {
            Row(json!({"working_set_bytes": ws, "llc_bytes": 32u64 << 20, "device": device}))
        };
        assert_eq!(ws_over_llc(&r(67_174_400, None)), "2.00*");
        assert_eq!(ws_over_llc(&r(16_793_600, None)), "0.50*");
        assert_eq!(ws_over_llc(&r(880_000_000, None)), "26.23");
        assert_eq!(ws_over_llc(&r(67_174_400, Some("NVIDIA H200"))), "-");
        assert_eq!(ws_over_llc(&Row(json!({"working_set_bytes": 1}))), "-");
    }

    /// Without --backward-ms the table says its figures are communication-only and has
    /// no step table; with it, both tables, labelled.
    #[test]
    fn the_table_labels_its_figures() {
        let machine = |b: Option<f64>| {
            Machine(
                json!({"cpu": "c", "cores": 2, "isa": "avx2", "read_gbps": 9.0, "ranks": 2,
                "link_ranks": 16, "threads_per_rank": 1, "latency_us": 20.0, "backward_ms": b}),
            )
        };
        let (base, bp) = row("allreduce", 5.0, 100.0, None, None);
        let (r, _) = row("powersgd", 15.0, 1.0, Some(&bp), None);
        let t = table(&machine(None), &[base, r], &[]);
        assert!(t.contains("COMMUNICATION-ONLY"), "{t}");
        assert!(t.contains("comm-only ms (speedup over allreduce)"), "{t}");
        assert!(!t.contains("step ms (backward"), "{t}");
        assert!(
            t.contains("priced for 16 ranks") && t.contains("advantage grows with N"),
            "{t}"
        );
        let (base, bp) = row("allreduce", 5.0, 100.0, None, Some(50.0));
        let (r, _) = row("powersgd", 15.0, 1.0, Some(&bp), Some(50.0));
        let t = table(&machine(Some(50.0)), &[base, r], &[]);
        assert!(!t.contains("COMMUNICATION-ONLY"), "{t}");
        assert!(t.contains("step ms (backward 50 ms, overlapped)"), "{t}");
        // The step table's 1 Gbit/s cell of PowerSGD: max(50, 50 + 15 + 1) = 66 ms.
        assert!(t.contains("66.0 ("), "{t}");
    }
}

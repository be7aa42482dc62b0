//! The compression-throughput report: runs `ddp-hooks/benches/report.rs` (release),
//! shows a progress bar while it measures, then prints the table and writes
//! `target/bench/report.jsonl`, `report.txt` and `speedup.svg`.

use super::rows::{Machine, Row, SPEEDS};
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
pub fn run(quick: bool, json: bool, isa: Option<&str>) -> Result<(), Failure> {
    let exe = built_executable("bench", &["-p", "ddp-hooks", "--bench", "report"], "report")?;
    let started = std::time::Instant::now();
    let mut cmd = Command::new(&exe);
    if quick {
        cmd.arg("--quick");
    }
    if let Some(isa) = isa {
        cmd.args(["--isa", isa]);
    }
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
    let dir = out_dir();
    std::fs::create_dir_all(&dir)?;
    let jsonl: String = rows.iter().map(|r| r.jsonl() + "\n").collect();
    std::fs::write(dir.join("report.jsonl"), &jsonl)?;
    let text = table(&machine, &rows);
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

/// The break-even column: where the hook stops beating allreduce, or whether one of the
/// two wins at every speed.
fn break_even(row: &Row, base: Option<&Row>) -> String {
    if let Some(b) = row.0["break_even_gbit"].as_f64() {
        return format!("< {b:.1} Gbit/s");
    }
    let Some(base) = base else {
        return "-".into();
    };
    if row.str("hook") == "allreduce" {
        return "-".into();
    }
    // No crossing: the hook wins everywhere or nowhere; its speed at 1 Gbit/s says which.
    if row.step_ms(1.0) < base.step_ms(1.0) {
        "always".into()
    } else {
        "never".into()
    }
}

/// The terminal table: what was measured, then what it predicts per link speed.
pub fn table(machine: &Machine, rows: &[Row]) -> String {
    let mut t = String::new();
    let _ = writeln!(t, "compression-throughput report");
    let _ = writeln!(t, "machine: {}", machine.describe());
    let _ = writeln!(t, "method:  {}", machine.method());
    let _ = writeln!(t);
    let _ = writeln!(
        t,
        "{:<13} {:<19} {:>20} {:>7} {:>10} {:>8} {:>6} {:>6}",
        "model", "hook", "hook ms (min-max)", "GB/s", "sent/rank", "ratio", "bound", "/ AR"
    );
    for r in rows {
        let bound = r.0["bound_ratio"]
            .as_f64()
            .map_or("-".to_string(), |b| format!("{b:.2}x"));
        let vs = r.0["vs_allreduce"]
            .as_f64()
            .map_or("-".to_string(), |v| format!("{v:.2}x"));
        let _ = writeln!(
            t,
            "{:<13} {:<19} {:>20} {:>7.2} {:>10} {:>7.0}x {:>6} {:>6}",
            r.str("model"),
            r.label(),
            format!(
                "{} ({}-{})",
                ms(r.num("hook_ms")),
                ms(r.num("hook_ms_min")),
                ms(r.num("hook_ms_max"))
            ),
            r.num("gbps"),
            bytes(r.num("bytes_sent")),
            r.num("compression_ratio"),
            bound,
            vs
        );
    }
    let _ = writeln!(t);
    let _ = writeln!(
        t,
        "predicted step ms (speedup over allreduce) at link speed; break-even: the hook is faster below it"
    );
    let _ = write!(t, "{:<13} {:<19}", "model", "hook");
    for s in SPEEDS {
        let _ = write!(t, " {:>16}", format!("{s} Gbit/s"));
    }
    let _ = writeln!(t, " {:>16}", "break-even");
    for r in rows {
        let base = rows
            .iter()
            .find(|b| b.str("model") == r.str("model") && b.str("hook") == "allreduce");
        let _ = write!(t, "{:<13} {:<19}", r.str("model"), r.label());
        for s in SPEEDS {
            let cell = format!(
                "{} ({:.2}x)",
                ms(r.at("step_ms_at", s)),
                r.at("speedup_at", s)
            );
            let _ = write!(t, " {cell:>16}");
        }
        let _ = writeln!(t, " {:>16}", break_even(r, base));
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
        "bound: hook time / its memory traffic at the read bandwidth: 7 passes over the gradient for PowerSGD, 2 for allreduce and fp16/bf16 (1.00x = memory-bound);"
    );
    let _ = writeln!(
        t,
        "/ AR: fp16/bf16 run alternated step by step with allreduce; median over the steps of their time / allreduce's."
    );
    t
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The break-even column names the crossing, or which side wins everywhere.
    #[test]
    fn break_even_column() {
        let row = |hook: &str, fixed: f64, per_gbit: f64, b: Option<f64>| {
            Row(json!({"hook": hook, "fixed_ms": fixed, "ms_gbit": per_gbit, "break_even_gbit": b}))
        };
        let base = row("allreduce", 5.0, 100.0, None);
        assert_eq!(break_even(&base, Some(&base)), "-");
        assert_eq!(
            break_even(&row("powersgd", 15.0, 1.0, Some(9.9)), Some(&base)),
            "< 9.9 Gbit/s"
        );
        assert_eq!(
            break_even(&row("powersgd", 4.0, 1.0, None), Some(&base)),
            "always"
        );
        assert_eq!(
            break_even(&row("fp16", 9.0, 150.0, None), Some(&base)),
            "never"
        );
    }
}

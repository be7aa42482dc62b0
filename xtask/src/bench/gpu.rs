//! `cargo xtask bench --gpu-report FILE`: GPU hook times merged into the report, so that
//! the break-even on a GPU uses GPU hook times.
//!
//! FILE is the JSON lines that `gpu-check`'s CUDA bench writes (`ddp-hooks/benches/
//! cuda_hooks.rs`, run by `gpu-check/run.sh`, into `$OUT/cuda_hooks.jsonl`, by default
//! `gpu-check/out/cuda_hooks.jsonl`): one object per line with
//! - `preset`: the model, by the report's name (`bert-base`, ...);
//! - `rank`: PowerSGD's rank (0 for a hook without one);
//! - `hook_ms`: the hook time per step, ms (cuda_hooks: the median step minus the noop
//!   hook's);
//! - optional: `hook` (default `powersgd`, the hook cuda_hooks measures), `path`
//!   (default `device`; cuda_hooks also writes `staged`, `device-by-shape` and
//!   `device-unbatched`),
//!   `device` (the GPU's name; default `unnamed GPU`), `bound_ratio`; other fields are
//!   ignored. Blank lines are skipped; any other line that is not such an object is an
//!   error naming its line.
//!
//! Each GPU row becomes a row of the report labelled `powersgd r2 gpu:device`: the CPU
//! row of the same model, hook and rank gives its buckets, bytes and link times, the GPU
//! its hook time (split over the buckets as the CPU row's is). Its baseline is
//! `allreduce gpu`: the CPU all-reduce's buckets with the GPU file's `allreduce` hook
//! time where it has one, else 0 ms (gpu-check does not time the all-reduce; 0 favours
//! the all-reduce, so a GPU break-even is a lower bound).

use super::overlap::{self, Profile};
use super::rows::Row;
use serde_json::{json, Value};

/// One row of a GPU report.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuRow {
    /// The GPU's name.
    pub device: String,
    /// The hook, by the report's name.
    pub hook: String,
    /// The model, by the report's name.
    pub preset: String,
    /// PowerSGD's rank, 0 for other hooks.
    pub rank: u64,
    /// The bench's path (`device`, `staged`, ...).
    pub path: String,
    /// Hook time per step, ms.
    pub hook_ms: f64,
    /// The GPU bench's own bound ratio, where it gave one.
    pub bound_ratio: Option<f64>,
}

/// Reads and checks a GPU report (see the module docs).
pub fn read(path: &std::path::Path) -> Result<Vec<GpuRow>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("--gpu-report {}: cannot read it: {e}", path.display()))?;
    parse(&text).map_err(|e| format!("--gpu-report {}: {e}", path.display()))
}

/// Parses a GPU report's text.
pub fn parse(text: &str) -> Result<Vec<GpuRow>, String> {
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        if line.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(line).map_err(|e| {
            format!("line {n} is not JSON ({e}); expected the JSON lines of cuda_hooks.jsonl")
        })?;
        if !v.is_object() {
            return Err(format!("line {n}: expected a JSON object, got {line}"));
        }
        let text_field = |k: &str, default: &str| -> Result<String, String> {
            match &v[k] {
                Value::Null => Ok(default.to_string()),
                Value::String(s) if !s.is_empty() => Ok(s.clone()),
                other => Err(format!(
                    "line {n}: `{k}` must be a non-empty string, got {other}"
                )),
            }
        };
        let preset = match &v["preset"] {
            Value::String(s) if !s.is_empty() => s.clone(),
            other => {
                return Err(format!(
                    "line {n}: no `preset` (the model's name), got {other}"
                ))
            }
        };
        let rank = v["rank"]
            .as_u64()
            .ok_or_else(|| format!("line {n}: `rank` must be a whole number, got {}", v["rank"]))?;
        let hook_ms = v["hook_ms"]
            .as_f64()
            .filter(|x| x.is_finite() && *x >= 0.0)
            .ok_or_else(|| {
                format!(
                    "line {n}: `hook_ms` must be a number of milliseconds >= 0, got {}",
                    v["hook_ms"]
                )
            })?;
        rows.push(GpuRow {
            device: text_field("device", "unnamed GPU")?,
            hook: text_field("hook", "powersgd")?,
            preset,
            rank,
            path: text_field("path", "device")?,
            hook_ms,
            bound_ratio: v["bound_ratio"].as_f64(),
        });
    }
    if rows.is_empty() {
        return Err("no rows (expected the JSON lines of cuda_hooks.jsonl)".into());
    }
    Ok(rows)
}

/// The label of the GPU baseline rows.
pub const GPU_BASE: &str = "allreduce gpu";

/// Merges `gpu` into `rows` (the report's CPU rows): after each model's rows, its GPU
/// baseline and a row per GPU row that has a CPU row of the same hook and rank, priced
/// with a backward of `backward` ms (or communication-only). Returns notes for the
/// table: what was merged, and every GPU row left out and why.
pub fn merge(rows: &mut Vec<Row>, gpu: &[GpuRow], backward: Option<f64>) -> Vec<String> {
    let mut notes = Vec::new();
    let mut models: Vec<String> = Vec::new();
    for r in rows.iter() {
        if !models.iter().any(|m| m == r.str("model")) {
            models.push(r.str("model").to_string());
        }
    }
    for g in gpu {
        if !models.contains(&g.preset) {
            notes.push(format!(
                "GPU row {} {} r{} {} left out: {} is not in this report (add it with --models)",
                g.preset, g.hook, g.rank, g.path, g.preset
            ));
        }
    }
    let mut merged = 0;
    for model in &models {
        let mine: Vec<&GpuRow> = gpu.iter().filter(|g| &g.preset == model).collect();
        if mine.is_empty() {
            continue;
        }
        let cpu = |hook: &str, rank: u64| {
            rows.iter().find(|r| {
                r.str("model") == model
                    && r.str("hook") == hook
                    && r.0["rank"].as_u64() == Some(rank)
                    && r.0["device"].is_null()
            })
        };
        let Some(base_cpu) = cpu("allreduce", 0) else {
            notes.push(format!(
                "GPU rows of {model} left out: the report has no allreduce row for it"
            ));
            continue;
        };
        let Some(base_cpu_profile) = Profile::from_row(&base_cpu.0) else {
            notes.push(format!(
                "GPU rows of {model} left out: its allreduce row has no buckets"
            ));
            continue;
        };
        let measured_base = mine.iter().find(|g| g.hook == "allreduce");
        let base_ms = measured_base.map_or(0.0, |g| g.hook_ms);
        let base_profile = base_cpu_profile.with_hook_ms(base_ms);
        let device = mine[0].device.clone();
        let mut new_rows = vec![gpu_row(
            base_cpu,
            &base_profile,
            &base_profile,
            backward,
            json!({
                "label": GPU_BASE,
                "base": GPU_BASE,
                "device": device,
                "hook_ms": base_ms,
                "hook_ms_source": if measured_base.is_some() { "measured" } else { "assumed 0 (not timed by gpu-check)" },
                "bound_ratio": measured_base.and_then(|g| g.bound_ratio),
            }),
        )];
        for g in mine.iter().filter(|g| g.hook != "allreduce") {
            let Some(c) = cpu(&g.hook, g.rank) else {
                notes.push(format!(
                    "GPU row {model} {} r{} {} left out: the report has no CPU row of that hook and rank",
                    g.hook, g.rank, g.path
                ));
                continue;
            };
            let Some(p) = Profile::from_row(&c.0) else {
                notes.push(format!(
                    "GPU row {model} {} r{} left out: its CPU row has no buckets",
                    g.hook, g.rank
                ));
                continue;
            };
            let label = if g.rank > 0 {
                format!("{} r{} gpu:{}", g.hook, g.rank, g.path)
            } else {
                format!("{} gpu:{}", g.hook, g.path)
            };
            new_rows.push(gpu_row(
                c,
                &p.with_hook_ms(g.hook_ms),
                &base_profile,
                backward,
                json!({
                    "label": label,
                    "base": GPU_BASE,
                    "device": g.device,
                    "hook_ms": g.hook_ms,
                    "hook_ms_source": "measured",
                    "bound_ratio": g.bound_ratio,
                }),
            ));
            merged += 1;
        }
        let at = rows
            .iter()
            .rposition(|r| r.str("model") == model)
            .map_or(rows.len(), |i| i + 1);
        rows.splice(at..at, new_rows);
        notes.push(format!(
            "{model}: {} GPU rows from {device}; `{GPU_BASE}` takes {}",
            mine.len() - usize::from(measured_base.is_some()),
            if measured_base.is_some() {
                format!("the file's allreduce hook time, {base_ms} ms")
            } else {
                "0 ms of hook time (gpu-check does not time the all-reduce; 0 favours it, so the GPU break-even is a lower bound)".to_string()
            }
        ));
    }
    if merged == 0 && notes.is_empty() {
        notes.push("no GPU row matched a row of this report".into());
    }
    notes
}

/// A GPU row: the CPU row `cpu` with the fields of `set`, priced from `profile` against
/// `base`.
fn gpu_row(cpu: &Row, profile: &Profile, base: &Profile, backward: Option<f64>, set: Value) -> Row {
    let mut v = cpu.0.clone();
    let o = v.as_object_mut().expect("a row is an object");
    for key in ["hook_ms_min", "hook_ms_max", "vs_allreduce", "steps"] {
        o.insert(key.into(), Value::Null);
    }
    if let Value::Object(set) = set {
        o.extend(set);
    }
    let hook_ms = o["hook_ms"].as_f64().unwrap_or(f64::NAN);
    let grad_bytes = 4.0 * o["params"].as_f64().unwrap_or(f64::NAN);
    o.insert(
        "gbps".into(),
        json!((hook_ms > 0.0).then(|| overlap::round(grad_bytes / (hook_ms / 1e3) / 1e9, 4))),
    );
    o.extend(overlap::priced(profile, base, backward));
    Row(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A CPU row as the bench prints it: two buckets, priced against `base`.
    fn cpu_row(
        hook: &str,
        rank: u64,
        hook_ms: f64,
        link_ms_gbit: f64,
        base: Option<&Profile>,
    ) -> (Row, Profile) {
        let p = Profile {
            buckets: vec![
                overlap::BucketCost {
                    ready: 0.5,
                    hook_ms: hook_ms / 2.0,
                    link_fixed_ms: 0.0,
                    link_ms_gbit: link_ms_gbit / 2.0,
                },
                overlap::BucketCost {
                    ready: 1.0,
                    hook_ms: hook_ms / 2.0,
                    link_fixed_ms: 0.0,
                    link_ms_gbit: link_ms_gbit / 2.0,
                },
            ],
            period: 1,
        };
        let mut v = json!({"kind": "row", "model": "bert-base", "hook": hook, "rank": rank,
            "hook_ms": hook_ms, "params": 1000, "bytes_sent": 10});
        v.as_object_mut()
            .unwrap()
            .extend(overlap::priced(&p, base.unwrap_or(&p), None));
        (Row(v), p)
    }

    /// The merge on a small file in cuda_hooks.jsonl's format: GPU rows take the CPU
    /// rows' link times and their own hook times, against a 0 ms GPU all-reduce.
    #[test]
    fn gpu_rows_are_priced_with_gpu_hook_times() {
        let dir = std::env::temp_dir().join(format!("xtask-gpu-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("cuda_hooks.jsonl");
        std::fs::write(
            &file,
            concat!(
                r#"{"preset":"bert-base","rank":2,"path":"device","hook_ms":4.0,"bound_ms":2.0,"bound_ratio":2.0,"device":"NVIDIA H200"}"#, "\n",
                r#"{"preset":"bert-base","rank":4,"path":"device","hook_ms":5.0,"device":"NVIDIA H200"}"#, "\n",
                "\n",
                r#"{"preset":"gpt2-small","rank":2,"path":"device","hook_ms":5.0,"device":"NVIDIA H200"}"#, "\n",
            ),
        )
        .unwrap();
        let gpu = read(&file).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(gpu.len(), 3);
        assert_eq!(
            (gpu[0].hook.as_str(), gpu[0].path.as_str()),
            ("powersgd", "device")
        );

        // CPU: allreduce 40 ms + 3500/g ms, PowerSGD r2 200 ms + 10/g ms.
        let (ar, ar_p) = cpu_row("allreduce", 0, 40.0, 3500.0, None);
        let (psgd, _) = cpu_row("powersgd", 2, 200.0, 10.0, Some(&ar_p));
        let mut rows = vec![ar, psgd];
        let notes = merge(&mut rows, &gpu, None);
        let labels: Vec<String> = rows.iter().map(Row::label).collect();
        assert_eq!(
            labels,
            [
                "allreduce",
                "powersgd r2",
                GPU_BASE,
                "powersgd r2 gpu:device"
            ]
        );
        // r4 has no CPU row, gpt2-small is not in the report: both said.
        assert!(
            notes
                .iter()
                .any(|n| n.contains("r4") && n.contains("no CPU row")),
            "{notes:?}"
        );
        assert!(
            notes
                .iter()
                .any(|n| n.contains("gpt2-small is not in this report")),
            "{notes:?}"
        );

        let g = &rows[3];
        assert_eq!(g.str("device"), "NVIDIA H200");
        assert_eq!(g.num("hook_ms"), 4.0);
        // comm-only at 1 Gbit/s: 4 + 10 ms against the GPU all-reduce's 0 + 3500 ms.
        assert!((g.at("comm_only_ms_at", "1") - 14.0).abs() < 1e-9);
        assert!((rows[2].at("comm_only_ms_at", "1") - 3500.0).abs() < 1e-9);
        assert!((g.at("comm_only_speedup_at", "1") - 3500.0 / 14.0).abs() < 1e-3);
        // Break-even: 4 + 10/g = 3500/g, g = 3490 / 4; the CPU row's was lower:
        // 200 + 10/g = 40 + 3500/g, g = 3490 / 160.
        let be = g.num("comm_only_break_even_gbit");
        assert!((be - 3490.0 / 4.0).abs() < 1e-2, "{be}");
        assert!((rows[1].num("comm_only_break_even_gbit") - 3490.0 / 160.0).abs() < 1e-2);
    }

    /// Bad lines are errors that name the line.
    #[test]
    fn bad_gpu_reports_are_clear_errors() {
        for (text, want) in [
            ("", "no rows"),
            ("device: NVIDIA H200\n", "line 1 is not JSON"),
            ("{\"rank\":1,\"hook_ms\":1}\n", "line 1: no `preset`"),
            ("\n{\"preset\":\"a\",\"rank\":1}\n", "line 2: `hook_ms`"),
            (
                "{\"preset\":\"a\",\"rank\":-1,\"hook_ms\":1}",
                "`rank` must be a whole number",
            ),
            ("[1]", "expected a JSON object"),
        ] {
            let e = parse(text).unwrap_err();
            assert!(e.contains(want), "{text:?}: {e}");
        }
    }
}

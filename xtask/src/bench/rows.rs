//! The report's data as the benchmark printed it: its rows, the machine it ran on, the
//! link speeds it priced. Read by the table (`report.rs`) and the chart (`svg.rs`).

use super::overlap::Profile;
use serde_json::Value;

/// The link speeds of the report (Gbit/s), as the keys of the `..._at` fields.
pub const SPEEDS: [&str; 4] = ["1", "10", "100", "400"];

/// The fields of `report.jsonl`, in order.
pub const FIELDS: [&str; 25] = [
    "model",
    "hook",
    "rank",
    "label",
    "device",
    "ranks",
    "link_ranks",
    "hook_ms",
    "gbps",
    "bytes_sent",
    "compression_ratio",
    "bound_ratio",
    "bound_ratio_1t",
    "share_gbps",
    "working_set_bytes",
    "llc_bytes",
    "vs_allreduce",
    "base",
    "comm_only_ms_at",
    "comm_only_speedup_at",
    "comm_only_break_even_gbit",
    "backward_ms",
    "step_ms_at",
    "step_speedup_at",
    "step_break_even_gbit",
];

/// The fields of a CPU measurement that a GPU row (one with a `device`, built from a CPU
/// row by `gpu.rs`) does not share: the CPU's bandwidth references and cache.
const CPU_ONLY: [&str; 4] = [
    "bound_ratio_1t",
    "share_gbps",
    "working_set_bytes",
    "llc_bytes",
];

/// One measured row, as the benchmark printed it.
pub struct Row(pub Value);

impl Row {
    /// A string field.
    pub fn str(&self, key: &str) -> &str {
        self.0[key].as_str().unwrap_or("?")
    }

    /// A number field (NaN where absent or `null`).
    pub fn num(&self, key: &str) -> f64 {
        self.field(key).as_f64().unwrap_or(f64::NAN)
    }

    /// A field, `null` for the CPU-only ones ([`CPU_ONLY`]) of a GPU row: it carries
    /// them over from the CPU row it was made from, and they do not describe the GPU.
    pub fn field(&self, key: &str) -> Value {
        if CPU_ONLY.contains(&key) && !self.0["device"].is_null() {
            return Value::Null;
        }
        self.0[key].clone()
    }

    /// The entry of an object keyed by link speed.
    pub fn at(&self, key: &str, speed: &str) -> f64 {
        self.0[key][speed].as_f64().unwrap_or(f64::NAN)
    }

    /// The row's `label` where it has one (GPU rows: `powersgd r2 gpu:device`), else
    /// `hook` with its PowerSGD rank: `powersgd r2`.
    pub fn label(&self) -> String {
        if let Some(l) = self.0["label"].as_str() {
            return l.to_string();
        }
        match self.0["rank"].as_u64() {
            Some(r) if r > 0 => format!("{} r{r}", self.str("hook")),
            _ => self.str("hook").to_string(),
        }
    }

    /// The label of the row this one's speedups are over: `base`, or `allreduce`.
    pub fn base(&self) -> String {
        self.0["base"].as_str().unwrap_or("allreduce").to_string()
    }

    /// This row's baseline among `rows`: the row of the same model labelled
    /// [`base`](Self::base).
    pub fn base_in<'a>(&self, rows: &'a [Row]) -> Option<&'a Row> {
        let (model, base) = (self.str("model"), self.base());
        rows.iter()
            .find(|b| b.str("model") == model && b.label() == base)
    }

    /// The step-time model's profile of the row (its `buckets`).
    pub fn profile(&self) -> Option<Profile> {
        Profile::from_row(&self.0)
    }

    /// The time (ms) at `gbit` Gbit/s the report's figures use: the overlapped step with
    /// a backward of `backward` ms, or without one the communication-only time.
    pub fn time_ms(&self, backward: Option<f64>, gbit: f64) -> f64 {
        match (self.profile(), backward) {
            (Some(p), Some(b)) => p.step_ms(b, gbit),
            (Some(p), None) => p.comm_only_ms(gbit),
            (None, _) => f64::NAN,
        }
    }

    /// The object written to `report.jsonl`: exactly [`FIELDS`], in that order (the
    /// fields a row lacks as `null`, as the CPU-only ones of a GPU row; `label` always,
    /// `base` defaulting to `allreduce`).
    pub(super) fn jsonl(&self) -> String {
        let fields: Vec<String> = FIELDS
            .iter()
            .map(|k| {
                let v = match *k {
                    "label" => Value::from(self.label()),
                    "base" => Value::from(self.base()),
                    _ => self.field(k),
                };
                format!("{}:{v}", Value::from(*k))
            })
            .collect();
        format!("{{{}}}", fields.join(","))
    }
}

/// What the benchmark says about the machine.
pub struct Machine(pub Value);

impl Machine {
    /// One line naming the machine: CPU, cores, instruction set, one-thread read
    /// bandwidth, last-level cache (where the benchmark found one).
    pub fn describe(&self) -> String {
        let m = &self.0;
        let llc = m["llc_bytes"]
            .as_f64()
            .map(|b| format!(" | last-level cache {:.1} MiB", b / f64::from(1 << 20)))
            .unwrap_or_default();
        format!(
            "{} | {} cores | {} kernels | read bandwidth {} GB/s (1 thread){llc}",
            m["cpu"].as_str().unwrap_or("unknown CPU"),
            m["cores"],
            m["isa"].as_str().unwrap_or("?"),
            m["read_gbps"],
        )
    }

    /// One line on how the numbers were made.
    pub fn method(&self) -> String {
        let m = &self.0;
        format!(
            "hooks on {} thread ranks, {} CPU thread each, synthetic gradients; link: ring cost model at {} ranks, {} us per message, accounted (not slept)",
            m["ranks"],
            m["threads_per_rank"],
            self.link_ranks(),
            m["latency_us"]
        )
    }

    /// The link model's world size (`--ranks`).
    pub fn link_ranks(&self) -> u64 {
        self.0["link_ranks"]
            .as_u64()
            .or_else(|| self.0["ranks"].as_u64())
            .unwrap_or(2)
    }

    /// `--backward-ms`, where it was given.
    pub fn backward_ms(&self) -> Option<f64> {
        self.0["backward_ms"].as_f64()
    }

    /// What the priced figures are, for headers and axis titles:
    /// `comm-only ms` or `step ms (backward 50 ms, overlapped)`.
    pub fn figure(&self) -> String {
        match self.backward_ms() {
            Some(b) => format!("step ms (backward {b} ms, overlapped)"),
            None => "comm-only ms".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// `report.jsonl` holds exactly the documented fields, in order, whatever else the
    /// benchmark printed.
    #[test]
    fn jsonl_has_exactly_the_fields() {
        let mut v = json!({"kind": "row", "buckets": [[1.0, 1.0, 0.0, 1.0]], "hook_ms_min": 2.0});
        for (i, f) in FIELDS.iter().enumerate() {
            v[*f] = json!(i);
        }
        let line = Row(v).jsonl();
        let parsed: serde_json::Map<String, Value> = serde_json::from_str(&line).unwrap();
        assert_eq!(parsed.len(), FIELDS.len());
        let order: Vec<usize> = FIELDS
            .iter()
            .map(|f| line.find(&format!("\"{f}\":")).unwrap())
            .collect();
        assert!(order.windows(2).all(|w| w[0] < w[1]), "{line}");
    }
}

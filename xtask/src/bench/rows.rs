//! The report's data as the benchmark printed it: its rows, the machine it ran on, the
//! link speeds it priced. Read by the table (`report.rs`) and the chart (`svg.rs`).

use serde_json::Value;

/// The link speeds of the report (Gbit/s), as the keys of `step_ms_at` and `speedup_at`.
pub const SPEEDS: [&str; 4] = ["1", "10", "100", "400"];

/// The fields of `report.jsonl`, in order.
const FIELDS: [&str; 13] = [
    "model",
    "hook",
    "rank",
    "ranks",
    "hook_ms",
    "gbps",
    "bytes_sent",
    "compression_ratio",
    "bound_ratio",
    "vs_allreduce",
    "step_ms_at",
    "speedup_at",
    "break_even_gbit",
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
        self.0[key].as_f64().unwrap_or(f64::NAN)
    }

    /// The entry of an object keyed by link speed.
    pub fn at(&self, key: &str, speed: &str) -> f64 {
        self.0[key][speed].as_f64().unwrap_or(f64::NAN)
    }

    /// `hook` with its PowerSGD rank: `powersgd r2`.
    pub fn label(&self) -> String {
        match self.0["rank"].as_u64() {
            Some(r) if r > 0 => format!("{} r{r}", self.str("hook")),
            _ => self.str("hook").to_string(),
        }
    }

    /// Step time (ms) at `gbit` Gbit/s from the link model's line `fixed + k / gbit`.
    pub fn step_ms(&self, gbit: f64) -> f64 {
        self.num("fixed_ms") + self.num("ms_gbit") / gbit
    }

    /// The object written to `report.jsonl`: exactly [`FIELDS`], in that order.
    pub(super) fn jsonl(&self) -> String {
        let fields: Vec<String> = FIELDS
            .iter()
            .map(|k| format!("{}:{}", Value::from(*k), self.0[*k]))
            .collect();
        format!("{{{}}}", fields.join(","))
    }
}

/// What the benchmark says about the machine.
pub struct Machine(pub Value);

impl Machine {
    /// One line naming the machine: CPU, cores, instruction set, read bandwidth.
    pub fn describe(&self) -> String {
        let m = &self.0;
        format!(
            "{} | {} cores | {} kernels | read bandwidth {} GB/s (1 thread)",
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
            "{} thread ranks, {} CPU thread each, synthetic gradients; link: ring cost model, {} us per message, accounted (not slept), no overlap",
            m["ranks"], m["threads_per_rank"], m["latency_us"]
        )
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
        let mut v = json!({"kind": "row", "fixed_ms": 1.0, "hook_ms_min": 2.0});
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

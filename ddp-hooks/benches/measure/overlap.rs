//! The report's step-time model, written once for the report bench (which prices its
//! rows with it) and `cargo xtask bench` (which draws the chart's curves, prices the GPU
//! rows of `--gpu-report` with it and unit-tests it); both include this file with
//! `#[path]`. Plain `std` and `serde_json`, nothing else.
//!
//! A step's communication is a list of buckets in launch order. Bucket `k` has
//! - `ready`: the fraction of the backward pass after which its last gradient exists.
//!   The backward produces gradients at a constant rate over the gradient elements, in
//!   reverse parameter order (as autograd does), so bucket `k` is ready at
//!   `ready_k · backward_ms`;
//! - `hook_ms`: its share of the measured hook time (compression, the in-process
//!   collectives, decompression), split over the buckets by element count;
//! - its modelled link time `link_fixed_ms + link_ms_gbit / gbit` (the ring costs of the
//!   collectives it issued, at the link model's world size).
//!
//! **Communication-only** (`comm_only_ms`): `Σ_k (hook_k + link_k)`, no backward, no
//! overlap: what the report priced before it had a compute term.
//!
//! **Overlapped step** (`step_ms`), as DDP's reducer launches buckets as they become
//! ready: one communication stream serialises the buckets (a bucket's hook and link
//! time run back to back, and the next bucket starts after it):
//!
//! ```text
//! end_0 = 0
//! end_k = max(ready_k · backward_ms, end_{k-1}) + hook_k + link_k(gbit)
//! step  = max(backward_ms, end_last)
//! ```
//!
//! With `backward_ms = 0` this is the communication-only figure. Rows amortised over a
//! period (local SGD, DiLoCo) average their one all-reduce over the period and do not
//! overlap it (they average after the optimizer step): `backward_ms + comm_only`.

#![allow(dead_code)]

use serde_json::{json, Value};

/// One bucket of a step, in launch order.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BucketCost {
    /// Fraction of the backward pass after which the bucket is ready, in `[0, 1]`.
    pub ready: f64,
    /// The bucket's share of the hook time, ms.
    pub hook_ms: f64,
    /// The link time's part that does not depend on the bandwidth (latency), ms.
    pub link_fixed_ms: f64,
    /// The link time at 1 Gbit/s minus `link_fixed_ms`: ms times Gbit/s.
    pub link_ms_gbit: f64,
}

impl BucketCost {
    /// The bucket's modelled link time at `gbit` Gbit/s, ms.
    pub fn link_ms(&self, gbit: f64) -> f64 {
        self.link_fixed_ms + self.link_ms_gbit / gbit
    }
}

/// The communication of one step: its buckets and the period it is amortised over.
#[derive(Clone, Debug, PartialEq)]
pub struct Profile {
    /// The buckets, in launch order.
    pub buckets: Vec<BucketCost>,
    /// Steps the communication is spread over (1: every step; local SGD and DiLoCo: their
    /// period, not overlapped with the backward).
    pub period: u64,
}

impl Profile {
    /// Hook plus link time of a step, no backward, no overlap, ms.
    pub fn comm_only_ms(&self, gbit: f64) -> f64 {
        let total: f64 = self
            .buckets
            .iter()
            .map(|b| b.hook_ms + b.link_ms(gbit))
            .sum();
        total / self.period.max(1) as f64
    }

    /// The step with a backward of `backward_ms`, buckets launched as they become ready
    /// and serialised on one stream (see the module docs), ms.
    pub fn step_ms(&self, backward_ms: f64, gbit: f64) -> f64 {
        if self.period > 1 {
            return backward_ms + self.comm_only_ms(gbit);
        }
        let mut end = 0.0f64;
        for b in &self.buckets {
            end = end.max(b.ready * backward_ms) + b.hook_ms + b.link_ms(gbit);
        }
        end.max(backward_ms)
    }

    /// The same profile with the hook time `hook_ms` in all, split over the buckets in
    /// the proportions of this one's (evenly where this one's is zero).
    pub fn with_hook_ms(&self, hook_ms: f64) -> Profile {
        let total: f64 = self.buckets.iter().map(|b| b.hook_ms).sum();
        let n = self.buckets.len().max(1) as f64;
        let buckets = self
            .buckets
            .iter()
            .map(|b| BucketCost {
                hook_ms: if total > 0.0 {
                    hook_ms * b.hook_ms / total
                } else {
                    hook_ms / n
                },
                ..*b
            })
            .collect();
        Profile {
            buckets,
            period: self.period,
        }
    }

    /// The JSON of a row's `buckets`: `[[ready, hook_ms, link_fixed_ms, link_ms_gbit], ...]`.
    pub fn buckets_json(&self) -> Value {
        Value::Array(
            self.buckets
                .iter()
                .map(|b| {
                    json!([
                        round(b.ready, 6),
                        round(b.hook_ms, 6),
                        round(b.link_fixed_ms, 6),
                        round(b.link_ms_gbit, 6)
                    ])
                })
                .collect(),
        )
    }

    /// The profile of a row: its `buckets` and `amortised_over` (absent: 1). `None` where
    /// the row has no well-formed `buckets`.
    pub fn from_row(row: &Value) -> Option<Profile> {
        let buckets = row["buckets"]
            .as_array()?
            .iter()
            .map(|b| {
                let f = |i: usize| b.get(i).and_then(Value::as_f64);
                Some(BucketCost {
                    ready: f(0)?,
                    hook_ms: f(1)?,
                    link_fixed_ms: f(2)?,
                    link_ms_gbit: f(3)?,
                })
            })
            .collect::<Option<Vec<_>>>()?;
        if buckets.is_empty() {
            return None;
        }
        Some(Profile {
            buckets,
            period: row["amortised_over"].as_u64().unwrap_or(1).max(1),
        })
    }
}

/// The link speeds the report prices, Gbit/s (keys `"1"`, `"10"`, `"100"`, `"400"`).
pub const SPEEDS: [f64; 4] = [1.0, 10.0, 100.0, 400.0];

/// An object keyed by link speed (`"1"`, ...), values rounded to 4 decimals.
pub fn keyed(values: impl Iterator<Item = f64>) -> Value {
    Value::Object(
        SPEEDS
            .iter()
            .zip(values)
            .map(|(g, v)| (format!("{g}"), json!(round(v, 4))))
            .collect(),
    )
}

/// What the model prices a row at, as the report's JSON fields: per link speed the
/// communication-only time and its speedup over `base`'s (`comm_only_ms_at`,
/// `comm_only_speedup_at`) and the speed below which it beats `base`
/// (`comm_only_break_even_gbit`); the same for the overlapped step with a backward of
/// `backward` ms (`step_ms_at`, `step_speedup_at`, `step_break_even_gbit`; `null`
/// without one), `backward_ms`, and the profile's `buckets`.
pub fn priced(
    p: &Profile,
    base: &Profile,
    backward: Option<f64>,
) -> serde_json::Map<String, Value> {
    let mut out = serde_json::Map::new();
    let comm = |q: &Profile, g: f64| q.comm_only_ms(g);
    out.insert(
        "comm_only_ms_at".into(),
        keyed(SPEEDS.iter().map(|&g| comm(p, g))),
    );
    out.insert(
        "comm_only_speedup_at".into(),
        keyed(SPEEDS.iter().map(|&g| comm(base, g) / comm(p, g))),
    );
    out.insert(
        "comm_only_break_even_gbit".into(),
        json!(break_even(|g| comm(p, g), |g| comm(base, g)).map(|b| round(b, 3))),
    );
    out.insert("backward_ms".into(), json!(backward));
    match backward {
        Some(b) => {
            let step = |q: &Profile, g: f64| q.step_ms(b, g);
            out.insert(
                "step_ms_at".into(),
                keyed(SPEEDS.iter().map(|&g| step(p, g))),
            );
            out.insert(
                "step_speedup_at".into(),
                keyed(SPEEDS.iter().map(|&g| step(base, g) / step(p, g))),
            );
            out.insert(
                "step_break_even_gbit".into(),
                json!(break_even(|g| step(p, g), |g| step(base, g)).map(|x| round(x, 3))),
            );
        }
        None => {
            for k in ["step_ms_at", "step_speedup_at", "step_break_even_gbit"] {
                out.insert(k.into(), Value::Null);
            }
        }
    }
    out.insert("buckets".into(), p.buckets_json());
    if p.period > 1 {
        out.insert("amortised_over".into(), json!(p.period));
    }
    out
}

/// The lowest and highest link speed (Gbit/s) that [`break_even`] searches.
pub const SEARCH_GBIT: (f64, f64) = (1e-3, 1e6);

/// The link speed below which `hook(gbit)` is faster than `base(gbit)`, where the hook
/// wins at the slowest searched speed ([`SEARCH_GBIT`]) and loses at the fastest: the
/// first speed of a log grid where it stops winning, refined by bisection to a relative
/// 1e-9. `None` where one of the two wins at both ends.
pub fn break_even(hook: impl Fn(f64) -> f64, base: impl Fn(f64) -> f64) -> Option<f64> {
    let f = |g: f64| hook(g) - base(g);
    let (lo, hi) = SEARCH_GBIT;
    if !(f(lo) < 0.0 && f(hi) > 0.0) {
        return None;
    }
    const GRID: usize = 900;
    let at = |i: usize| lo * (hi / lo).powf(i as f64 / GRID as f64);
    let i = (1..=GRID).find(|&i| f(at(i)) >= 0.0)?;
    let (mut a, mut b) = (at(i - 1), at(i));
    while (b - a) > 1e-9 * b {
        let m = (a * b).sqrt();
        if f(m) < 0.0 {
            a = m;
        } else {
            b = m;
        }
    }
    Some(0.5 * (a + b))
}

/// Rounds to `digits` decimals.
pub fn round(x: f64, digits: i32) -> f64 {
    let s = 10f64.powi(digits);
    (x * s).round() / s
}

/// The fraction of the backward pass after which each bucket is ready: the backward
/// produces the gradients of `shapes` in reverse order at a constant rate per element,
/// and a bucket (parameter indices, in launch order) is ready with its last one.
pub fn ready_fractions(shapes: &[Vec<usize>], buckets: &[Vec<usize>]) -> Vec<f64> {
    let sizes: Vec<f64> = shapes
        .iter()
        .map(|s| s.iter().product::<usize>() as f64)
        .collect();
    let total: f64 = sizes.iter().sum::<f64>().max(1.0);
    // done[p]: elements produced once parameter p's gradient exists (reverse order).
    let mut done = vec![0.0; sizes.len()];
    let mut acc = 0.0;
    for p in (0..sizes.len()).rev() {
        acc += sizes[p];
        done[p] = acc / total;
    }
    buckets
        .iter()
        .map(|b| {
            b.iter()
                .filter_map(|&p| done.get(p).copied())
                .fold(0.0, f64::max)
        })
        .collect()
}

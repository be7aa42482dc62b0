//! Chrome trace JSON (`{"traceEvents":[...]}`, which Perfetto and `chrome://tracing` open)
//! of a recorded run ([`chrome_trace`]) or of a simulated one ([`chrome_trace_of`]).
//!
//! One track per worker (`tid` = worker; `pid` = its rank, or 0). Each piece of work is a
//! complete event (`"ph":"X"`) named with PyTorch's labels, `PP:{stage}{letter}{mb}` (such
//! as `PP:1F3`), a recomputation as `PP:1F3 recompute`, the loss as `PP:1F3 loss`, and a
//! deferred weight-gradient flush as `PP:1W flush`; `ts` and `dur` are in microseconds,
//! `args` carries the stage, the micro-batch, the pass letter and the kind. Data crossing
//! workers is a flow (`"ph":"s"` at the producer's last nanosecond, `"ph":"f"` at the
//! consumer's start): from each `F(s, m)` to `F(s + 1, m)`, and from each `B`/`I` of
//! `(s, m)` to the `B`/`I` of `(s − 1, m)`, when the two stages are on different workers.
//!
//! PyTorch's `_dump_chrometrace` writes unit timesteps of a simulated schedule; these are
//! real durations.

use std::collections::HashMap;
use std::fmt::Write;

use crate::error::Error;
use crate::record::{Record, SpanKind};
use crate::schedule::Schedule;
use crate::simulate::{CostsError, Simulation};
use crate::vocab::{Action, Pass};

struct Slice {
    worker: usize,
    action: Action,
    kind: SpanKind,
    /// Microseconds.
    start: f64,
    /// Microseconds.
    end: f64,
}

/// The trace of a recorded run: one complete event per span of `record`, flows for the
/// messages between workers. `ranks[w]`, when given, is worker `w`'s rank (its `pid`);
/// workers beyond it, and all without it, get `pid` 0.
pub fn chrome_trace(record: &Record, ranks: Option<&[usize]>) -> String {
    let slices: Vec<Slice> = record
        .workers()
        .iter()
        .enumerate()
        .flat_map(|(w, spans)| {
            spans.iter().map(move |s| Slice {
                worker: w,
                action: s.action,
                kind: s.kind,
                start: s.start.as_secs_f64() * 1e6,
                end: s.end.as_secs_f64() * 1e6,
            })
        })
        .collect();
    let pid = |w: usize| ranks.and_then(|r| r.get(w)).copied().unwrap_or(0);
    write_trace(&slices, record.workers().len(), pid)
}

/// The trace of a simulated run of `schedule` (its costs read as seconds): one complete
/// event per action, flows for the messages between workers, all with `pid` 0.
///
/// Errors ([`CostsError::SimulationMismatch`], as [`Error::Custom`]) if the simulation's
/// actions are not the schedule's.
pub fn chrome_trace_of(sim: &Simulation, schedule: &Schedule) -> Result<String, Error> {
    let same = sim.workers.len() == schedule.workers().len()
        && sim
            .workers
            .iter()
            .zip(schedule.workers())
            .all(|(t, l)| t.len() == l.len() && t.iter().zip(l).all(|(t, a)| t.action == *a));
    if !same {
        return Err(CostsError::SimulationMismatch.into());
    }
    let slices: Vec<Slice> = sim
        .workers
        .iter()
        .flatten()
        .map(|t| Slice {
            worker: t.worker,
            action: t.action,
            kind: match t.action.pass {
                Pass::Forward => SpanKind::Forward,
                _ => SpanKind::Backward,
            },
            start: t.start * 1e6,
            end: t.end * 1e6,
        })
        .collect();
    Ok(write_trace(&slices, sim.workers.len(), |_| 0))
}

fn name(slice: &Slice) -> String {
    let a = slice.action;
    let label = format!("PP:{}{}{}", a.stage, a.pass.letter(), a.micro_batch);
    match slice.kind {
        SpanKind::Forward | SpanKind::Backward => label,
        SpanKind::Recompute => format!("PP:{}F{} recompute", a.stage, a.micro_batch),
        SpanKind::Loss => format!("{label} loss"),
        SpanKind::WeightGrad if a.pass == Pass::WeightGrad => label,
        SpanKind::WeightGrad => format!("PP:{}W flush", a.stage),
    }
}

fn kind_name(kind: SpanKind) -> &'static str {
    match kind {
        SpanKind::Forward => "forward",
        SpanKind::Recompute => "recompute",
        SpanKind::Backward => "backward",
        SpanKind::Loss => "loss",
        SpanKind::WeightGrad => "weight_grad",
    }
}

fn write_trace(slices: &[Slice], workers: usize, pid: impl Fn(usize) -> usize) -> String {
    let mut events: Vec<String> = Vec::new();
    // A track per worker that ran something (a record has a row per stage, so a schedule
    // with several stages per worker leaves rows empty).
    for w in (0..workers).filter(|&w| slices.iter().any(|s| s.worker == w)) {
        events.push(format!(
            r#"{{"ph":"M","name":"thread_name","pid":{},"tid":{w},"args":{{"name":{}}}}}"#,
            pid(w),
            quote(&format!("worker {w}"))
        ));
    }
    for s in slices {
        let a = s.action;
        events.push(format!(
            r#"{{"name":{},"cat":{},"ph":"X","ts":{},"dur":{},"pid":{},"tid":{},"args":{{"stage":{},"micro_batch":{},"pass":{},"kind":{}}}}}"#,
            quote(&name(s)),
            quote(if s.kind == SpanKind::Loss { "loss" } else { "computation" }),
            number(s.start),
            number((s.end - s.start).max(0.0)),
            pid(s.worker),
            s.worker,
            a.stage,
            a.micro_batch,
            quote(&a.pass.letter().to_string()),
            quote(kind_name(s.kind)),
        ));
    }
    // Each occurrence of an action (a worker's consecutive slices of it): its first slice,
    // where a consumer starts, and the one that makes its data (the forward or backward,
    // not the recompute, loss or flush). A record of several runs has several of each.
    let mut occurrences: HashMap<Action, Vec<(&Slice, Option<&Slice>)>> = HashMap::new();
    let mut k = 0;
    while k < slices.len() {
        let head = &slices[k];
        let mut made = None;
        while k < slices.len() && slices[k].action == head.action && slices[k].worker == head.worker
        {
            if made.is_none() && matches!(slices[k].kind, SpanKind::Forward | SpanKind::Backward) {
                made = Some(&slices[k]);
            }
            k += 1;
        }
        occurrences
            .entry(head.action)
            .or_default()
            .push((head, made));
    }
    let mut flows: Vec<(&Slice, &Slice)> = Vec::new();
    for (a, list) in &occurrences {
        let next = match a.pass {
            Pass::Forward => vec![Action::forward(a.stage + 1, a.micro_batch)],
            Pass::Backward | Pass::InputGrad if a.stage > 0 => vec![
                Action::backward(a.stage - 1, a.micro_batch),
                Action::input_grad(a.stage - 1, a.micro_batch),
            ],
            _ => Vec::new(),
        };
        let Some(consumers) = next.iter().find_map(|c| occurrences.get(c)) else {
            continue;
        };
        for ((_, made), (to, _)) in list.iter().zip(consumers) {
            if let Some(from) = made {
                if to.worker != from.worker {
                    flows.push((from, to));
                }
            }
        }
    }
    flows.sort_by(|x, y| {
        x.0.end
            .total_cmp(&y.0.end)
            .then(x.1.start.total_cmp(&y.1.start))
    });
    for (id, (from, to)) in flows.iter().enumerate() {
        let label = quote(&format!(
            "{} {}",
            if from.action.pass == Pass::Forward {
                "activation"
            } else {
                "gradient"
            },
            name(from)
        ));
        // The start sits inside the producer's slice (its last nanosecond), so viewers
        // bind it to that slice; the end binds to the slice that starts there.
        let at = if from.end - from.start > 0.002 {
            from.end - 0.001
        } else {
            from.start
        };
        events.push(format!(
            r#"{{"name":{label},"cat":"communication","ph":"s","id":{id},"ts":{},"pid":{},"tid":{}}}"#,
            number(at),
            pid(from.worker),
            from.worker
        ));
        events.push(format!(
            r#"{{"name":{label},"cat":"communication","ph":"f","bp":"e","id":{id},"ts":{},"pid":{},"tid":{}}}"#,
            number(to.start),
            pid(to.worker),
            to.worker
        ));
    }
    let mut out = String::from("{\"traceEvents\":[");
    for (k, e) in events.iter().enumerate() {
        if k > 0 {
            out.push(',');
        }
        out.push('\n');
        out.push_str(e);
    }
    out.push_str("\n],\"displayTimeUnit\":\"ms\"}\n");
    out
}

/// A JSON number: microseconds with nanosecond digits; a non-finite value becomes 0.
fn number(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.3}")
    } else {
        "0".to_string()
    }
}

/// A JSON string literal of `s`.
fn quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quote_escapes_json() {
        assert_eq!(quote("a\"b\\c\n\u{1}"), r#""a\"b\\c\n\u0001""#);
        assert_eq!(number(f64::NAN), "0");
        assert_eq!(number(1.5), "1.500");
    }
}

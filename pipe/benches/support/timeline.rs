//! The timeline picture: recorded spans of one step per schedule, one row per partition,
//! beside the ideal schedule (the same actions, each as long as its kind's mean measured
//! duration on its partition, started as soon as its worker and its data allow), drawn as
//! SVG by hand.

use std::collections::HashMap;
use std::fmt::Write;
use std::time::Duration;

use pipe::{Action, Pass, Record, Schedule, SpanKind};

/// One recorded step to draw.
pub struct Trace {
    /// The title: schedule, checkpoint mode, m.
    pub title: String,
    /// The schedule the step ran.
    pub schedule: Schedule,
    /// Its record.
    pub record: Record,
    /// Micro-batches below this were checkpointed (recomputed in the ideal too).
    pub checkpoint_stop: usize,
}

/// A box on a row: kind, label, start and end in seconds from the row set's origin.
struct Bar {
    kind: SpanKind,
    label: String,
    start: f64,
    end: f64,
}

/// Bars per worker.
type Rows = Vec<Vec<Bar>>;

/// Measured bars per worker, from the earliest span.
fn measured(record: &Record) -> Vec<Vec<Bar>> {
    let origin = record
        .workers()
        .iter()
        .flatten()
        .map(|s| s.start)
        .min()
        .unwrap_or_default();
    record
        .workers()
        .iter()
        .map(|spans| {
            spans
                .iter()
                .map(|s| bar(s.kind, s.action, s.start - origin, s.end - origin))
                .collect()
        })
        .collect()
}

fn bar(kind: SpanKind, action: Action, start: Duration, end: Duration) -> Bar {
    let letter = match kind {
        SpanKind::Forward => "F",
        SpanKind::Backward => "B",
        SpanKind::Recompute => "R",
        SpanKind::Loss => "",
        SpanKind::WeightGrad => return named(kind, "W", start, end),
    };
    Bar {
        kind,
        label: format!("{letter}{}", action.micro_batch),
        start: start.as_secs_f64(),
        end: end.as_secs_f64(),
    }
}

fn named(kind: SpanKind, label: &str, start: Duration, end: Duration) -> Bar {
    Bar {
        kind,
        label: label.to_string(),
        start: start.as_secs_f64(),
        end: end.as_secs_f64(),
    }
}

/// Mean measured duration of each kind on each worker.
fn mean_durations(record: &Record) -> Vec<HashMap<SpanKind, f64>> {
    record
        .workers()
        .iter()
        .map(|spans| {
            let mut sums: HashMap<SpanKind, (f64, usize)> = HashMap::new();
            for s in spans {
                let e = sums.entry(s.kind).or_default();
                e.0 += (s.end - s.start).as_secs_f64();
                e.1 += 1;
            }
            sums.into_iter()
                .map(|(k, (total, count))| (k, total / count as f64))
                .collect()
        })
        .collect()
}

/// The ideal run of `schedule`: each worker runs its list in order, each action starts as
/// soon as its worker is free and its data is ready, with zero overhead.
fn ideal(schedule: &Schedule, means: &[HashMap<SpanKind, f64>], stop: usize) -> Vec<Vec<Bar>> {
    let (n, m) = (schedule.stages(), schedule.micro_batches());
    let mut done: HashMap<Action, f64> = HashMap::new();
    let mut free = vec![0.0f64; schedule.workers().len()];
    let mut heads = vec![0usize; schedule.workers().len()];
    let mut bars: Vec<Vec<Bar>> = (0..schedule.workers().len()).map(|_| Vec::new()).collect();
    let d = |w: usize, k: SpanKind| means[w].get(&k).copied().unwrap_or(0.0);
    let total: usize = schedule.workers().iter().map(Vec::len).sum();
    let mut placed = 0;
    while placed < total {
        let mut progressed = false;
        for (w, list) in schedule.workers().iter().enumerate() {
            while let Some(&a) = list.get(heads[w]) {
                let deps: Vec<Action> = match a.pass {
                    Pass::Forward if a.stage > 0 => {
                        vec![Action::forward(a.stage - 1, a.micro_batch)]
                    }
                    Pass::Forward => vec![],
                    Pass::Backward if a.stage + 1 < n => vec![
                        Action::forward(a.stage, a.micro_batch),
                        Action::backward(a.stage + 1, a.micro_batch),
                    ],
                    Pass::Backward => vec![Action::forward(a.stage, a.micro_batch)],
                };
                let Some(ready) = deps
                    .iter()
                    .map(|dep| done.get(dep).copied())
                    .try_fold(0.0f64, |acc, t| t.map(|t| acc.max(t)))
                else {
                    break;
                };
                let mut t = free[w].max(ready);
                let last_backward = a.pass == Pass::Backward
                    && !list[heads[w] + 1..]
                        .iter()
                        .any(|b| b.pass == Pass::Backward && b.stage == a.stage);
                let mut push = |kind: SpanKind, len: f64, t: &mut f64| {
                    let label = match kind {
                        SpanKind::Forward => format!("F{}", a.micro_batch),
                        SpanKind::Backward => format!("B{}", a.micro_batch),
                        SpanKind::Recompute => format!("R{}", a.micro_batch),
                        SpanKind::Loss => String::new(),
                        SpanKind::WeightGrad => "W".to_string(),
                    };
                    bars[w].push(Bar {
                        kind,
                        label,
                        start: *t,
                        end: *t + len,
                    });
                    *t += len;
                };
                match a.pass {
                    Pass::Forward => {
                        push(SpanKind::Forward, d(w, SpanKind::Forward), &mut t);
                        if a.stage + 1 == n {
                            push(SpanKind::Loss, d(w, SpanKind::Loss), &mut t);
                        }
                    }
                    Pass::Backward => {
                        if a.micro_batch < stop {
                            push(SpanKind::Recompute, d(w, SpanKind::Recompute), &mut t);
                        }
                        push(SpanKind::Backward, d(w, SpanKind::Backward), &mut t);
                    }
                }
                done.insert(a, t);
                if last_backward {
                    // The deferred weight gradients, after the stage's last backward; the
                    // gradient it sends on is ready before them.
                    push(SpanKind::WeightGrad, d(w, SpanKind::WeightGrad), &mut t);
                }
                free[w] = t;
                heads[w] += 1;
                placed += 1;
                progressed = true;
            }
        }
        if !progressed {
            break; // a valid schedule always progresses
        }
    }
    let _ = m;
    bars
}

fn color(kind: SpanKind) -> &'static str {
    match kind {
        SpanKind::Forward => "#4c78a8",
        SpanKind::Backward => "#54a24b",
        SpanKind::Recompute => "#f58518",
        SpanKind::Loss => "#b279a2",
        SpanKind::WeightGrad => "#2ca089",
    }
}

/// Busy fraction of the rows: time in bars over rows × makespan.
fn busy(rows: &[Vec<Bar>]) -> (f64, f64) {
    let makespan = rows.iter().flatten().map(|b| b.end).fold(0.0f64, f64::max);
    let work: f64 = rows.iter().flatten().map(|b| b.end - b.start).sum();
    let fraction = if makespan > 0.0 {
        work / (makespan * rows.len() as f64)
    } else {
        0.0
    };
    (makespan, fraction)
}

const WIDTH: f64 = 1100.0;
const LEFT: f64 = 150.0;
const ROW: f64 = 26.0;

/// Draws `rows` at `y` with time scaled by `scale` pixels per second; returns the new y.
fn draw_rows(svg: &mut String, rows: &[Vec<Bar>], y: f64, scale: f64, label: &str) -> f64 {
    let (makespan, fraction) = busy(rows);
    let _ = writeln!(
        svg,
        r##"<text x="10" y="{:.1}" font-size="12" font-weight="bold">{label}</text>"##,
        y + 12.0
    );
    let _ = writeln!(
        svg,
        r##"<text x="{:.1}" y="{:.1}" font-size="11" fill="#555">{:.1} ms, idle {:.0}%</text>"##,
        LEFT,
        y + 12.0,
        makespan * 1e3,
        (1.0 - fraction) * 100.0
    );
    let mut y = y + 18.0;
    for (w, bars) in rows.iter().enumerate() {
        let _ = writeln!(
            svg,
            r##"<text x="20" y="{:.1}" font-size="11">partition {w}</text>"##,
            y + ROW * 0.65
        );
        // Idle: the row's background, hatched.
        let _ = writeln!(
            svg,
            r##"<rect x="{LEFT:.1}" y="{y:.1}" width="{:.1}" height="{:.1}" fill="url(#idle)" stroke="#ccc"/>"##,
            makespan * scale,
            ROW - 4.0
        );
        for b in bars {
            let (x, w) = (LEFT + b.start * scale, ((b.end - b.start) * scale).max(0.5));
            let _ = writeln!(
                svg,
                r##"<rect x="{x:.2}" y="{y:.1}" width="{w:.2}" height="{:.1}" fill="{}" stroke="#fff" stroke-width="0.5"><title>{} {:.2}-{:.2} ms</title></rect>"##,
                ROW - 4.0,
                color(b.kind),
                b.label,
                b.start * 1e3,
                b.end * 1e3
            );
            if w > 16.0 && !b.label.is_empty() {
                let _ = writeln!(
                    svg,
                    r##"<text x="{:.1}" y="{:.1}" font-size="10" fill="#fff" text-anchor="middle">{}</text>"##,
                    x + w / 2.0,
                    y + ROW * 0.55,
                    b.label
                );
            }
        }
        y += ROW;
    }
    y + 8.0
}

/// The whole picture: per trace, the measured rows and the ideal rows on one time scale.
pub fn svg(traces: &[Trace], note: &str) -> String {
    let panels: Vec<(String, Rows, Rows)> = traces
        .iter()
        .map(|t| {
            let means = mean_durations(&t.record);
            (
                t.title.clone(),
                measured(&t.record),
                ideal(&t.schedule, &means, t.checkpoint_stop),
            )
        })
        .collect();
    let longest = panels
        .iter()
        .flat_map(|(_, a, b)| [busy(a).0, busy(b).0])
        .fold(0.0f64, f64::max)
        .max(1e-9);
    let scale = (WIDTH - LEFT - 20.0) / longest;
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r##"<text x="10" y="20" font-size="14" font-weight="bold">pipe: one training step per schedule, measured and ideal</text>"##
    );
    let _ = writeln!(
        svg,
        r##"<text x="10" y="38" font-size="11" fill="#555">{note}</text>"##
    );
    let mut x = LEFT;
    for (kind, name) in [
        (SpanKind::Forward, "forward"),
        (SpanKind::Backward, "backward"),
        (SpanKind::Recompute, "recompute"),
        (SpanKind::Loss, "loss"),
        (SpanKind::WeightGrad, "weight gradients"),
    ] {
        let _ = writeln!(
            svg,
            r##"<rect x="{x:.0}" y="46" width="14" height="12" fill="{}"/><text x="{:.0}" y="56" font-size="11">{name}</text>"##,
            color(kind),
            x + 18.0
        );
        x += 40.0 + 7.0 * name.len() as f64;
    }
    let _ = writeln!(
        svg,
        r##"<rect x="{x:.0}" y="46" width="14" height="12" fill="url(#idle)" stroke="#ccc"/><text x="{:.0}" y="56" font-size="11">idle (bubble)</text>"##,
        x + 18.0
    );
    let mut y = 70.0;
    for (title, measured, ideal) in &panels {
        let _ = writeln!(
            svg,
            r##"<text x="10" y="{:.1}" font-size="13" font-weight="bold" fill="#222">{title}</text>"##,
            y + 12.0
        );
        y += 20.0;
        y = draw_rows(&mut svg, measured, y, scale, "measured");
        y = draw_rows(&mut svg, ideal, y, scale, "ideal");
        y += 12.0;
    }
    svg.push_str("</svg>\n");
    let header = format!(
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{y:.0}" font-family="sans-serif">
<defs><pattern id="idle" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)"><rect width="6" height="6" fill="#f4f4f4"/><line x1="0" y1="0" x2="0" y2="6" stroke="#ddd" stroke-width="2"/></pattern></defs>
<rect width="100%" height="100%" fill="#fff"/>
"##
    );
    header + &svg
}

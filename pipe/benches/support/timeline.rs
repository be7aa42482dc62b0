//! The timeline picture: recorded spans of one step per schedule, one row per worker,
//! beside the simulated ideal (`pipe::simulate`: the same actions, each as long as its
//! mean measured duration, started as soon as its worker and its data allow), drawn as
//! SVG by hand.

use std::fmt::Write;
use std::time::Duration;

use pipe::simulate::{simulate, Costs};
use pipe::{Action, Pass, Record, Schedule, SpanKind};

/// One recorded step to draw.
pub struct Trace {
    /// The title: schedule, checkpoint mode, m.
    pub title: String,
    /// The schedule the step ran.
    pub schedule: Schedule,
    /// Its record.
    pub record: Record,
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

/// The ideal run of `schedule` (`pipe::simulate`): each worker runs its list in order,
/// each action as long as its (stage, pass)'s mean measured duration in `record`, started
/// as soon as its worker is free and its data has arrived, with the record's message
/// cost. Empty rows where the record does not cover the schedule.
fn ideal(schedule: &Schedule, record: &Record) -> Vec<Vec<Bar>> {
    let sim = Costs::from_record(record, schedule).and_then(|c| simulate(schedule, &c));
    let Ok(sim) = sim else {
        return (0..schedule.workers().len()).map(|_| Vec::new()).collect();
    };
    sim.workers
        .iter()
        .map(|actions| {
            actions
                .iter()
                .map(|t| {
                    let (kind, letter) = match t.action.pass {
                        Pass::Forward => (SpanKind::Forward, "F"),
                        Pass::Backward => (SpanKind::Backward, "B"),
                        Pass::InputGrad => (SpanKind::Backward, "I"),
                        Pass::WeightGrad => (SpanKind::WeightGrad, "W"),
                    };
                    Bar {
                        kind,
                        label: format!("{letter}{}", t.action.micro_batch),
                        start: t.start,
                        end: t.end,
                    }
                })
                .collect()
        })
        .collect()
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
            (
                t.title.clone(),
                measured(&t.record),
                ideal(&t.schedule, &t.record),
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

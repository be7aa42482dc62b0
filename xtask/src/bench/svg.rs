//! `speedup.svg`, written by hand: speedup over allreduce against link bandwidth, both
//! axes logarithmic, one line per hook, one panel each for 4 x Linear(1024, 1024),
//! BERT-base and every model that is not a preset (`--shapes`). Lines follow the
//! step-time model between the report's speeds (`overlap.rs`: the communication-only
//! time, or with `--backward-ms` the overlapped step, as the title says); dots mark the
//! four speeds of the table. GPU rows (`--gpu-report`) are drawn against their own
//! baseline.

use super::rows::{Machine, Row, SPEEDS};
use std::fmt::Write as _;

/// The panels: (model in the report, title).
const PANELS: [(&str, &str); 2] = [
    ("linear4x1024", "4 x Linear(1024, 1024)"),
    ("bert-base", "BERT-base"),
];
/// The x axis, Gbit/s: decades from 10^X_MIN to 10^X_MAX.
const X_MIN: i32 = -1;
const X_MAX: i32 = 3;
const COLORS: [&str; 8] = [
    "#1f77b4", "#17becf", "#d62728", "#ff7f0e", "#bcbd22", "#9467bd", "#2ca02c", "#8c564b",
];
const WIDTH: f64 = 1000.0;
const HEIGHT: f64 = 500.0;
const PLOT_W: f64 = 380.0;
const PLOT_H: f64 = 300.0;
const TOP: f64 = 80.0;

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Tick values of a log axis from `10^lo` to `10^hi`: every decade, plus 2 and 5 when
/// the axis spans at most two decades.
fn ticks(lo: i32, hi: i32) -> Vec<f64> {
    let mut t = Vec::new();
    for d in lo..=hi {
        let base = 10f64.powi(d);
        t.push(base);
        if hi - lo <= 2 && d < hi {
            t.push(2.0 * base);
            t.push(5.0 * base);
        }
    }
    t
}

fn tick_label(v: f64) -> String {
    if v >= 1.0 {
        format!("{v:.0}")
    } else {
        let s = format!("{v:.3}");
        s.trim_end_matches('0').to_string()
    }
}

/// The chart for `rows` (those of the panels' models; a panel without rows is left out).
pub fn chart(machine: &Machine, rows: &[Row]) -> String {
    let mut labels: Vec<String> = Vec::new();
    for r in rows {
        let l = r.label();
        if l != r.base() && !labels.contains(&l) {
            labels.push(l);
        }
    }
    let backward = machine.backward_ms();
    // The presets' panels, then one per model that is not a preset (the user's).
    let mut panels: Vec<(String, String)> = PANELS
        .iter()
        .filter(|(m, _)| rows.iter().any(|r| r.str("model") == *m))
        .map(|(m, t)| (m.to_string(), t.to_string()))
        .collect();
    for r in rows {
        let m = r.str("model");
        let preset = super::models::presets().iter().any(|p| p.0 == m);
        if !preset && !panels.iter().any(|(p, _)| p == m) {
            panels.push((m.to_string(), m.to_string()));
        }
    }
    let width = (80.0 + panels.len() as f64 * (PLOT_W + 110.0)).max(WIDTH);
    let color = |label: &str| {
        let i = labels.iter().position(|l| l == label).unwrap_or(0);
        COLORS[i % COLORS.len()]
    };
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{HEIGHT}" viewBox="0 0 {width} {HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        s,
        r#"<rect width="{width}" height="{HEIGHT}" fill="white"/>"#
    );
    let what = match backward {
        Some(b) => format!(
            "{}: a {b} ms backward overlapped with the buckets' hook + link time",
            machine.figure()
        ),
        None => "comm-only ms: measured hook time + link model; no forward/backward, no overlap"
            .to_string(),
    };
    let _ = writeln!(
        s,
        r#"<text x="{}" y="24" text-anchor="middle" font-size="16">Speedup over allreduce vs link bandwidth ({}, {} ranks)</text>"#,
        width / 2.0,
        escape(&what),
        machine.link_ranks()
    );
    let _ = writeln!(
        s,
        r##"<text x="{}" y="44" text-anchor="middle" fill="#555">{}</text>"##,
        width / 2.0,
        escape(&machine.describe())
    );
    let figure = machine.figure();
    for (i, (model, title)) in panels.iter().enumerate() {
        let left = 80.0 + i as f64 * (PLOT_W + 110.0);
        let model_rows: Vec<&Row> = rows.iter().filter(|r| r.str("model") == model).collect();
        panel(
            &mut s,
            left,
            title,
            rows,
            &model_rows,
            &color,
            backward,
            &figure,
        );
    }
    // The legend, under the panels.
    let mut x = 80.0;
    let y = TOP + PLOT_H + 70.0;
    let _ = writeln!(
        s,
        r#"<line x1="{x}" y1="{y}" x2="{}" y2="{y}" stroke="black" stroke-dasharray="4 3"/><text x="{}" y="{}">allreduce</text>"#,
        x + 24.0,
        x + 30.0,
        y + 4.0
    );
    x += 110.0;
    for (n, l) in labels.iter().enumerate() {
        if n == 4 {
            x = 80.0;
        }
        let y = if n < 4 { y } else { y + 22.0 };
        let _ = writeln!(
            s,
            r#"<line x1="{x}" y1="{y}" x2="{}" y2="{y}" stroke="{}" stroke-width="2.5"/><text x="{}" y="{}">{}</text>"#,
            x + 24.0,
            color(l),
            x + 30.0,
            y + 4.0,
            escape(l)
        );
        x += 190.0;
    }
    s.push_str("</svg>\n");
    s
}

/// One panel: axes, grid, the allreduce line at 1 and a curve per hook (over its own
/// baseline among `all`).
#[allow(clippy::too_many_arguments)]
fn panel(
    s: &mut String,
    left: f64,
    title: &str,
    all: &[Row],
    rows: &[&Row],
    color: &dyn Fn(&str) -> &'static str,
    backward: Option<f64>,
    figure: &str,
) {
    let xs: Vec<f64> = (0..=96)
        .map(|k| 10f64.powf(X_MIN as f64 + (X_MAX - X_MIN) as f64 * k as f64 / 96.0))
        .collect();
    let speedup_key = if backward.is_some() {
        "step_speedup_at"
    } else {
        "comm_only_speedup_at"
    };
    let curves: Vec<(&Row, Vec<f64>)> = rows
        .iter()
        .filter(|r| r.label() != r.base())
        .filter_map(|r| {
            let base = r.base_in(all)?;
            let ys = xs
                .iter()
                .map(|&x| base.time_ms(backward, x) / r.time_ms(backward, x))
                .collect();
            Some((*r, ys))
        })
        .collect();
    let finite = curves
        .iter()
        .flat_map(|(_, ys)| ys.iter().copied())
        .filter(|y| y.is_finite() && *y > 0.0);
    let (lo, hi) = finite.fold((1.0f64, 1.0f64), |(lo, hi), y| (lo.min(y), hi.max(y)));
    let (y_lo, y_hi) = (lo.log10().floor() as i32, hi.log10().ceil() as i32);
    let y_hi = y_hi.max(y_lo + 1);
    let px = |x: f64| left + (x.log10() - X_MIN as f64) / (X_MAX - X_MIN) as f64 * PLOT_W;
    let py = |y: f64| TOP + PLOT_H - (y.log10() - y_lo as f64) / (y_hi - y_lo) as f64 * PLOT_H;
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle" font-size="14">{}</text>"#,
        left + PLOT_W / 2.0,
        TOP - 12.0,
        escape(title)
    );
    for x in ticks(X_MIN, X_MAX) {
        let _ = writeln!(
            s,
            r##"<line x1="{0:.1}" y1="{TOP}" x2="{0:.1}" y2="{1}" stroke="#ddd"/><text x="{0:.1}" y="{2}" text-anchor="middle">{3}</text>"##,
            px(x),
            TOP + PLOT_H,
            TOP + PLOT_H + 16.0,
            tick_label(x)
        );
    }
    for y in ticks(y_lo, y_hi) {
        let _ = writeln!(
            s,
            r##"<line x1="{left}" y1="{0:.1}" x2="{1}" y2="{0:.1}" stroke="#ddd"/><text x="{2}" y="{3:.1}" text-anchor="end">{4}x</text>"##,
            py(y),
            left + PLOT_W,
            left - 6.0,
            py(y) + 4.0,
            tick_label(y)
        );
    }
    let _ = writeln!(
        s,
        r#"<rect x="{left}" y="{TOP}" width="{PLOT_W}" height="{PLOT_H}" fill="none" stroke="black"/>"#
    );
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">link bandwidth (Gbit/s)</text>"#,
        left + PLOT_W / 2.0,
        TOP + PLOT_H + 36.0
    );
    let _ = writeln!(
        s,
        r#"<text transform="translate({},{}) rotate(-90)" text-anchor="middle">speedup over allreduce ({})</text>"#,
        left - 48.0,
        TOP + PLOT_H / 2.0,
        escape(figure)
    );
    let _ = writeln!(
        s,
        r#"<line x1="{left}" y1="{0:.1}" x2="{1}" y2="{0:.1}" stroke="black" stroke-dasharray="4 3"/>"#,
        py(1.0),
        left + PLOT_W
    );
    for (r, ys) in &curves {
        let c = color(&r.label());
        let points: Vec<String> = xs
            .iter()
            .zip(ys)
            .filter(|(_, y)| y.is_finite() && **y > 0.0)
            .map(|(&x, &y)| format!("{:.1},{:.1}", px(x), py(y)))
            .collect();
        let _ = writeln!(
            s,
            r#"<polyline points="{}" fill="none" stroke="{c}" stroke-width="2"><title>{}</title></polyline>"#,
            points.join(" "),
            escape(&r.label())
        );
        for speed in SPEEDS {
            let (x, y) = (
                speed.parse::<f64>().unwrap_or(1.0),
                r.at(speedup_key, speed),
            );
            if y.is_finite() && y > 0.0 {
                let _ = writeln!(
                    s,
                    r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{c}"><title>{} at {speed} Gbit/s: {y:.2}x</title></circle>"#,
                    px(x),
                    py(y),
                    escape(&r.label())
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::overlap::{priced, BucketCost, Profile};
    use serde_json::json;

    fn profile(hook_ms: f64, per_gbit: f64) -> Profile {
        Profile {
            buckets: vec![BucketCost {
                ready: 1.0,
                hook_ms,
                link_fixed_ms: 0.0,
                link_ms_gbit: per_gbit,
            }],
            period: 1,
        }
    }

    fn row(model: &str, hook: &str, rank: u64, fixed: f64, per_gbit: f64) -> Row {
        let p = profile(fixed, per_gbit);
        let mut v = json!({"model": model, "hook": hook, "rank": rank});
        v.as_object_mut()
            .unwrap()
            .extend(priced(&p, &profile(5.0, 134.0), None));
        Row(v)
    }

    /// A panel per preset model and per user model, one line per hook, the legend, the
    /// figures named, and balanced tags.
    #[test]
    fn chart_has_a_panel_per_model_and_a_line_per_hook() {
        let rows = vec![
            row("linear4x1024", "allreduce", 0, 5.0, 134.0),
            row("linear4x1024", "powersgd", 2, 13.0, 0.6),
            row("bert-base", "allreduce", 0, 80.0, 3500.0),
            row("bert-base", "powersgd", 2, 600.0, 16.0),
            row("resnet50", "allreduce", 0, 60.0, 800.0),
            row("my model", "allreduce", 0, 6.0, 100.0),
            row("my model", "powersgd", 2, 10.0, 1.0),
        ];
        let svg = chart(
            &Machine(json!({"cpu": "a <cpu>", "cores": 2, "link_ranks": 8})),
            &rows,
        );
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert_eq!(
            svg.matches("<polyline").count(),
            3,
            "one line per hook and panel"
        );
        assert_eq!(
            svg.matches("<circle").count(),
            12,
            "a dot per speed and line"
        );
        assert!(svg.contains("4 x Linear(1024, 1024)") && svg.contains("BERT-base"));
        assert!(svg.contains(">my model<"), "the user's model has a panel");
        assert!(
            svg.contains("comm-only ms") && svg.contains("8 ranks"),
            "the figures are named"
        );
        assert!(svg.contains("a &lt;cpu&gt;"), "text is escaped");
        assert_eq!(svg.matches("<text").count(), svg.matches("</text>").count());
    }
}

//! `speedup.svg`, written by hand: speedup over allreduce against link bandwidth, both
//! axes logarithmic, one line per hook, one panel each for 4 x Linear(1024, 1024),
//! BERT-base and every model that is not a preset (`--shapes`). Lines follow the
//! step-time model between the report's speeds (`overlap.rs`: the communication-only
//! time, or with `--backward-ms` the overlapped step, as the title says); dots mark the
//! four speeds of the table. GPU rows (`--gpu-report`) are drawn against their own
//! baseline.

use super::rows::{Machine, Row, SPEEDS};
use crate::svg::{self, escape, Plot};
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
    svg::open(&mut s, width, HEIGHT);
    let what = match backward {
        Some(b) => format!(
            "{}: a {b} ms backward overlapped with the buckets' hook + link time",
            machine.figure()
        ),
        None => "comm-only ms: measured hook time + link model; no forward/backward, no overlap"
            .to_string(),
    };
    let title = format!(
        "Speedup over allreduce vs link bandwidth ({what}, {} ranks)",
        machine.link_ranks()
    );
    svg::centered_text(&mut s, width / 2.0, 24.0, r#" font-size="16""#, &title);
    let described = machine.describe();
    svg::centered_text(&mut s, width / 2.0, 44.0, r##" fill="#555""##, &described);
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
    let dashed = r#"stroke="black" stroke-dasharray="4 3""#;
    svg::legend_entry(&mut s, x, y, dashed, "allreduce");
    x += 110.0;
    for (n, l) in labels.iter().enumerate() {
        if n == 4 {
            x = 80.0;
        }
        let y = if n < 4 { y } else { y + 22.0 };
        let stroke = format!(r#"stroke="{}" stroke-width="2.5""#, color(l));
        svg::legend_entry(&mut s, x, y, &stroke, l);
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
    let ys = svg::decades(lo, hi);
    let plot = Plot {
        left,
        top: TOP,
        width: PLOT_W,
        height: PLOT_H,
    };
    let px = |x: f64| left + (x.log10() - X_MIN as f64) / (X_MAX - X_MIN) as f64 * PLOT_W;
    let py = |y: f64| plot.log_y(y, ys);
    let size = r#" font-size="14""#;
    svg::centered_text(s, left + PLOT_W / 2.0, TOP - 12.0, size, title);
    for x in svg::log_ticks(X_MIN, X_MAX) {
        plot.x_tick(s, px(x), &svg::tick_label(x, 3));
    }
    for y in svg::log_ticks(ys.0, ys.1) {
        plot.y_tick(s, py(y), &format!("{}x", svg::tick_label(y, 3)));
    }
    let y_title = format!("speedup over allreduce ({figure})");
    plot.frame(s, "link bandwidth (Gbit/s)", &y_title, 48.0);
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
        svg::polyline(s, &points, c, 2.0, "", &r.label());
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

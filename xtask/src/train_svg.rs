//! `loss.svg`, written by hand (in the style of `bench/svg.rs`): the held-out loss
//! against the optimizer step, one line per run of `cargo xtask train --compare`, the
//! step axis linear, the loss axis logarithmic (the losses fall by decades).

use std::fmt::Write as _;

const COLORS: [&str; 12] = [
    "#000000", "#1f77b4", "#17becf", "#aec7e8", "#d62728", "#ff7f0e", "#ffbb78", "#2ca02c",
    "#98df8a", "#9467bd", "#c5b0d5", "#8c564b",
];
const WIDTH: f64 = 900.0;
const HEIGHT: f64 = 560.0;
const LEFT: f64 = 80.0;
const TOP: f64 = 60.0;
const PLOT_W: f64 = 520.0;
const PLOT_H: f64 = 420.0;

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Tick values of a log axis from `10^lo` to `10^hi`: every decade, plus 2 and 5 when
/// the axis spans at most two decades.
fn log_ticks(lo: i32, hi: i32) -> Vec<f64> {
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
        let s = format!("{v:.4}");
        s.trim_end_matches('0').to_string()
    }
}

/// A round step between x ticks: about 5 of them up to `max`.
fn x_step(max: f64) -> f64 {
    let raw = (max / 5.0).max(1.0);
    let mag = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|&s| s >= raw)
        .unwrap_or(10.0 * mag)
}

/// The chart: `curves` are (label, `[(step, loss)]`); points that are not finite and
/// positive are left out, and so is a curve without any.
pub fn chart(title: &str, curves: &[(String, Vec<(f64, f64)>)]) -> String {
    let ok = |&(x, y): &(f64, f64)| x.is_finite() && y.is_finite() && y > 0.0;
    let x_max = curves
        .iter()
        .flat_map(|(_, p)| p.iter().filter(|p| ok(p)).map(|p| p.0))
        .fold(1.0f64, f64::max);
    let (lo, hi) = curves
        .iter()
        .flat_map(|(_, p)| p.iter().filter(|p| ok(p)).map(|p| p.1))
        .fold((f64::INFINITY, 0.0f64), |(lo, hi), y| {
            (lo.min(y), hi.max(y))
        });
    let (lo, hi) = if lo.is_finite() { (lo, hi) } else { (0.1, 1.0) };
    let y_lo = lo.log10().floor() as i32;
    let y_hi = (hi.log10().ceil() as i32).max(y_lo + 1);
    let px = |x: f64| LEFT + x / x_max * PLOT_W;
    let py = |y: f64| TOP + PLOT_H - (y.log10() - y_lo as f64) / (y_hi - y_lo) as f64 * PLOT_H;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        s,
        r#"<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>"#
    );
    let _ = writeln!(
        s,
        r#"<text x="{}" y="28" text-anchor="middle" font-size="16">{}</text>"#,
        WIDTH / 2.0,
        escape(title)
    );
    let step = x_step(x_max);
    let mut x = 0.0;
    while x <= x_max + 1e-9 {
        let _ = writeln!(
            s,
            r##"<line x1="{0:.1}" y1="{TOP}" x2="{0:.1}" y2="{1}" stroke="#ddd"/><text x="{0:.1}" y="{2}" text-anchor="middle">{3}</text>"##,
            px(x),
            TOP + PLOT_H,
            TOP + PLOT_H + 16.0,
            x
        );
        x += step;
    }
    for y in log_ticks(y_lo, y_hi) {
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" y1="{0:.1}" x2="{1}" y2="{0:.1}" stroke="#ddd"/><text x="{2}" y="{3:.1}" text-anchor="end">{4}</text>"##,
            py(y),
            LEFT + PLOT_W,
            LEFT - 6.0,
            py(y) + 4.0,
            tick_label(y)
        );
    }
    let _ = writeln!(
        s,
        r#"<rect x="{LEFT}" y="{TOP}" width="{PLOT_W}" height="{PLOT_H}" fill="none" stroke="black"/>"#
    );
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">optimizer step</text>"#,
        LEFT + PLOT_W / 2.0,
        TOP + PLOT_H + 36.0
    );
    let _ = writeln!(
        s,
        r#"<text transform="translate({},{}) rotate(-90)" text-anchor="middle">held-out loss (MSE, log scale)</text>"#,
        LEFT - 52.0,
        TOP + PLOT_H / 2.0
    );
    let mut legend_y = TOP + 10.0;
    let legend_x = LEFT + PLOT_W + 24.0;
    for (i, (label, points)) in curves.iter().enumerate() {
        let points: Vec<String> = points
            .iter()
            .filter(|p| ok(p))
            .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
            .collect();
        if points.is_empty() {
            continue;
        }
        let c = COLORS[i % COLORS.len()];
        // The baseline (the first curve) dashed, the others solid.
        let dash = if i == 0 {
            r#" stroke-dasharray="5 3""#
        } else {
            ""
        };
        let _ = writeln!(
            s,
            r#"<polyline points="{}" fill="none" stroke="{c}" stroke-width="1.8"{dash}><title>{}</title></polyline>"#,
            points.join(" "),
            escape(label)
        );
        let _ = writeln!(
            s,
            r#"<line x1="{legend_x}" y1="{legend_y}" x2="{}" y2="{legend_y}" stroke="{c}" stroke-width="2.5"{dash}/><text x="{}" y="{}">{}</text>"#,
            legend_x + 24.0,
            legend_x + 30.0,
            legend_y + 4.0,
            escape(label)
        );
        legend_y += 20.0;
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A line and a legend entry per curve with points, log ticks, balanced tags.
    #[test]
    fn chart_has_a_line_per_curve_and_a_legend() {
        let curves = vec![
            (
                "allreduce".to_string(),
                vec![(0.0, 0.5), (25.0, 0.1), (50.0, 0.02)],
            ),
            (
                "diloco:H=16+<x>".to_string(),
                vec![(0.0, 0.5), (25.0, 0.2), (50.0, f64::NAN)],
            ),
            ("empty".to_string(), vec![(0.0, f64::NAN)]),
        ];
        let svg = chart("loss", &curves);
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert_eq!(svg.matches("<polyline").count(), 2, "one line per curve");
        assert!(svg.contains("diloco:H=16+&lt;x&gt;"), "labels are escaped");
        assert!(
            !svg.contains(">empty<"),
            "a curve without points is left out"
        );
        assert!(
            svg.contains(">0.01<") && svg.contains(">1<"),
            "decade ticks"
        );
        assert_eq!(svg.matches("<text").count(), svg.matches("</text>").count());
    }

    #[test]
    fn x_ticks_are_round() {
        assert_eq!(x_step(1000.0), 200.0);
        assert_eq!(x_step(300.0), 100.0);
        assert_eq!(x_step(3.0), 1.0);
    }
}

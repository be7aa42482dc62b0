//! `loss.svg`, written by hand (in the style of `bench/svg.rs`): the held-out loss
//! against the optimizer step, one line per run of `cargo xtask train --compare`, the
//! step axis linear, the loss axis logarithmic (the losses fall by decades).

use crate::svg::{self, Plot};

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
    let ys = svg::decades(lo, hi);
    let plot = Plot {
        left: LEFT,
        top: TOP,
        width: PLOT_W,
        height: PLOT_H,
    };
    let px = |x: f64| LEFT + x / x_max * PLOT_W;
    let py = |y: f64| plot.log_y(y, ys);
    let mut s = String::new();
    svg::open(&mut s, WIDTH, HEIGHT);
    svg::centered_text(&mut s, WIDTH / 2.0, 28.0, r#" font-size="16""#, title);
    let step = x_step(x_max);
    let mut x = 0.0;
    while x <= x_max + 1e-9 {
        plot.x_tick(&mut s, px(x), &x.to_string());
        x += step;
    }
    for y in svg::log_ticks(ys.0, ys.1) {
        plot.y_tick(&mut s, py(y), &svg::tick_label(y, 4));
    }
    plot.frame(
        &mut s,
        "optimizer step",
        "held-out loss (MSE, log scale)",
        52.0,
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
        svg::polyline(&mut s, &points, c, 1.8, dash, label);
        let stroke = format!(r#"stroke="{c}" stroke-width="2.5"{dash}"#);
        svg::legend_entry(&mut s, legend_x, legend_y, &stroke, label);
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

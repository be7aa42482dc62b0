//! What the hand-written SVG charts share (`train_svg.rs`'s `loss.svg`, `bench/svg.rs`'s
//! `speedup.svg`): escaping, log-axis ticks and their labels, the document's head, and a
//! plot's grid, frame, axis titles, lines and legend entries. Each writer appends one
//! element per line to the chart's `String`.

use std::fmt::Write as _;

/// `s` with `&`, `<` and `>` escaped for SVG text and attributes.
pub fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Tick values of a log axis from `10^lo` to `10^hi`: every decade, plus 2 and 5 when
/// the axis spans at most two decades.
pub fn log_ticks(lo: i32, hi: i32) -> Vec<f64> {
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

/// A tick's label: whole numbers from 1 up, below 1 at most `decimals` decimals with the
/// trailing zeros cut.
pub fn tick_label(v: f64, decimals: usize) -> String {
    if v >= 1.0 {
        format!("{v:.0}")
    } else {
        let s = format!("{v:.decimals$}");
        s.trim_end_matches('0').to_string()
    }
}

/// The decades of a log axis that holds `lo..=hi` (both positive): at least one.
pub fn decades(lo: f64, hi: f64) -> (i32, i32) {
    let y_lo = lo.log10().floor() as i32;
    let y_hi = (hi.log10().ceil() as i32).max(y_lo + 1);
    (y_lo, y_hi)
}

/// The document's opening tag and its white background.
pub fn open(s: &mut String, width: f64, height: f64) {
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        s,
        r#"<rect width="{width}" height="{height}" fill="white"/>"#
    );
}

/// Text centred on `x`, escaped; `attrs` (each with a leading space) styles it.
pub fn centered_text(s: &mut String, x: f64, y: f64, attrs: &str, text: &str) {
    let _ = writeln!(
        s,
        r#"<text x="{x}" y="{y}" text-anchor="middle"{attrs}>{}</text>"#,
        escape(text)
    );
}

/// A line through `points` (`"x,y"` in pixels) with its label as a tooltip; `dash`
/// (empty or with a leading space) adds to its stroke.
pub fn polyline(
    s: &mut String,
    points: &[String],
    color: &str,
    stroke_width: f64,
    dash: &str,
    label: &str,
) {
    let _ = writeln!(
        s,
        r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="{stroke_width}"{dash}><title>{}</title></polyline>"#,
        points.join(" "),
        escape(label)
    );
}

/// A legend entry at (`x`, `y`): a short line drawn with `stroke` (its attributes) and
/// the label after it.
pub fn legend_entry(s: &mut String, x: f64, y: f64, stroke: &str, label: &str) {
    let _ = writeln!(
        s,
        r#"<line x1="{x}" y1="{y}" x2="{}" y2="{y}" {stroke}/><text x="{}" y="{}">{}</text>"#,
        x + 24.0,
        x + 30.0,
        y + 4.0,
        escape(label)
    );
}

/// A plot's area in the picture, in pixels.
pub struct Plot {
    /// Its left edge.
    pub left: f64,
    /// Its top edge.
    pub top: f64,
    /// Its width.
    pub width: f64,
    /// Its height.
    pub height: f64,
}

impl Plot {
    /// The pixel row of `y` on a log axis over the decades `(lo, hi)`.
    pub fn log_y(&self, y: f64, (lo, hi): (i32, i32)) -> f64 {
        self.top + self.height - (y.log10() - lo as f64) / (hi - lo) as f64 * self.height
    }

    /// A vertical grid line at pixel column `x` and its label under the plot.
    pub fn x_tick(&self, s: &mut String, x: f64, label: &str) {
        let _ = writeln!(
            s,
            r##"<line x1="{0:.1}" y1="{1}" x2="{0:.1}" y2="{2}" stroke="#ddd"/><text x="{0:.1}" y="{3}" text-anchor="middle">{4}</text>"##,
            x,
            self.top,
            self.top + self.height,
            self.top + self.height + 16.0,
            label
        );
    }

    /// A horizontal grid line at pixel row `y` and its label left of the plot.
    pub fn y_tick(&self, s: &mut String, y: f64, label: &str) {
        let _ = writeln!(
            s,
            r##"<line x1="{1}" y1="{0:.1}" x2="{2}" y2="{0:.1}" stroke="#ddd"/><text x="{3}" y="{4:.1}" text-anchor="end">{5}</text>"##,
            y,
            self.left,
            self.left + self.width,
            self.left - 6.0,
            y + 4.0,
            label
        );
    }

    /// The plot's border, the x axis' title under it and the y axis' title turned,
    /// `y_gap` pixels left of it.
    pub fn frame(&self, s: &mut String, x_title: &str, y_title: &str, y_gap: f64) {
        let _ = writeln!(
            s,
            r#"<rect x="{}" y="{}" width="{}" height="{}" fill="none" stroke="black"/>"#,
            self.left, self.top, self.width, self.height
        );
        centered_text(
            s,
            self.left + self.width / 2.0,
            self.top + self.height + 36.0,
            "",
            x_title,
        );
        let _ = writeln!(
            s,
            r#"<text transform="translate({},{}) rotate(-90)" text-anchor="middle">{}</text>"#,
            self.left - y_gap,
            self.top + self.height / 2.0,
            escape(y_title)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_and_labels() {
        assert_eq!(log_ticks(0, 3), vec![1.0, 10.0, 100.0, 1000.0]);
        assert_eq!(log_ticks(0, 1), vec![1.0, 2.0, 5.0, 10.0]);
        assert_eq!(tick_label(0.0125, 3), "0.013");
        assert_eq!(tick_label(0.0125, 4), "0.0125");
        assert_eq!(tick_label(0.5, 3), "0.5");
        assert_eq!(tick_label(200.0, 3), "200");
        assert_eq!(decades(0.02, 0.5), (-2, 0));
        assert_eq!(decades(1.0, 1.0), (0, 1));
        assert_eq!(escape("a<b>&c"), "a&lt;b&gt;&amp;c");
    }
}

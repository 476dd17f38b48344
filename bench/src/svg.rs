//! Line charts as plain SVG text: latency against volumes present (scale) and
//! time against data size (snapshot). Log-scale y, since the drivers differ by
//! orders of magnitude.

use std::fmt::Write;

use crate::report::Medians;

const W: f64 = 720.0;
const H: f64 = 420.0;
const L: f64 = 80.0;
const R: f64 = 200.0;
const T: f64 = 40.0;
const B: f64 = 60.0;
const COLORS: [&str; 6] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
];

struct Series {
    label: String,
    points: Vec<(f64, f64)>,
    dashed: bool,
}

/// The points `(x, median)` of the figures named `{scenario}/{x}/{metric}`, in
/// the order of x; `x` reads the x value from its label.
fn points(
    m: &Medians,
    scenario: &str,
    metric: &str,
    x: impl Fn(&str) -> Option<f64>,
) -> Vec<(f64, f64)> {
    let mut pts: Vec<(f64, f64)> = m
        .iter()
        .filter_map(|(k, v)| {
            let rest = k.strip_prefix(scenario)?.strip_prefix('/')?;
            let (label, name) = rest.split_once('/')?;
            (name == metric).then(|| Some((x(label)?, *v)))?
        })
        .collect();
    pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    pts
}

pub fn scale(names: &[String], meds: &[Medians]) -> Option<String> {
    let mut series = Vec::new();
    for (i, m) in meds.iter().enumerate() {
        for (op, dashed) in [("create", false), ("delete", true)] {
            let pts = points(m, "scale", &format!("{op}_p50_ms"), |n| n.parse().ok());
            if !pts.is_empty() {
                series.push(Series {
                    label: format!("{} {op} p50", names[i]),
                    points: pts,
                    dashed,
                });
            }
        }
    }
    chart(
        "Volume operation latency against volumes present",
        "volumes present",
        "p50 latency (ms, log)",
        &series,
        |x| format!("{x:.0}"),
    )
}

pub fn snapshot(names: &[String], meds: &[Medians]) -> Option<String> {
    let mut series = Vec::new();
    for (i, m) in meds.iter().enumerate() {
        for op in ["create_snapshot", "restore", "clone"] {
            let pts = points(m, "snapshot", &format!("{op}_ms"), mib);
            if !pts.is_empty() {
                series.push(Series {
                    label: format!("{} {op}", names[i]),
                    points: pts,
                    dashed: i > 0,
                });
            }
        }
    }
    chart(
        "Snapshot, restore and clone time against data size",
        "data in the volume (MiB)",
        "time (ms, log)",
        &series,
        |x| format!("{x:.0}"),
    )
}

/// The MiB a size label (100MiB, 4GiB) names.
pub fn mib(label: &str) -> Option<f64> {
    if let Some(g) = label.strip_suffix("GiB") {
        return g.parse::<f64>().ok().map(|g| g * 1024.0);
    }
    label.strip_suffix("MiB")?.parse().ok()
}

/// Where values land in the plot: x linear from 0, y in decades `lo..=hi`.
struct Frame {
    xmax: f64,
    lo: f64,
    hi: f64,
}

impl Frame {
    fn of(pts: &[(f64, f64)]) -> Frame {
        let xmax = pts.iter().map(|p| p.0).fold(0.0, f64::max).max(1.0);
        let ymin = pts.iter().map(|p| p.1).fold(f64::INFINITY, f64::min);
        let ymax = pts.iter().map(|p| p.1).fold(0.0, f64::max);
        let (lo, hi) = (
            ymin.log10().floor(),
            ymax.log10().ceil().max(ymin.log10().floor() + 1.0),
        );
        Frame { xmax, lo, hi }
    }

    fn px(&self, x: f64) -> f64 {
        L + x / self.xmax * (W - L - R)
    }

    fn py(&self, y: f64) -> f64 {
        T + (self.hi - y.max(1e-9).log10()) / (self.hi - self.lo) * (H - T - B)
    }
}

fn chart(
    title: &str,
    xlabel: &str,
    ylabel: &str,
    series: &[Series],
    fmt_x: impl Fn(f64) -> String,
) -> Option<String> {
    let pts: Vec<(f64, f64)> = series
        .iter()
        .flat_map(|s| s.points.iter().copied())
        .filter(|p| p.1 > 0.0)
        .collect();
    if pts.is_empty() {
        return None;
    }
    let frame = Frame::of(&pts);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="15">{}</text>"#,
        W / 2.0,
        esc(title)
    );
    axes(&mut s, &frame, &pts, fmt_x);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
        (L + W - R) / 2.0,
        H - 18.0,
        esc(xlabel)
    );
    let _ = writeln!(
        s,
        r#"<text transform="translate(18 {}) rotate(-90)" text-anchor="middle">{}</text>"#,
        (T + H - B) / 2.0,
        esc(ylabel)
    );
    for (i, se) in series.iter().enumerate() {
        line(&mut s, &frame, i, se);
    }
    s.push_str("</svg>\n");
    Some(s)
}

/// Axes, decades on y, the measured x values on x.
fn axes(s: &mut String, frame: &Frame, pts: &[(f64, f64)], fmt_x: impl Fn(f64) -> String) {
    let _ = writeln!(
        s,
        r#"<line x1="{L}" y1="{}" x2="{}" y2="{}" stroke="black"/>"#,
        H - B,
        W - R,
        H - B
    );
    let _ = writeln!(
        s,
        r#"<line x1="{L}" y1="{T}" x2="{L}" y2="{}" stroke="black"/>"#,
        H - B
    );
    let mut d = frame.lo;
    while d <= frame.hi {
        let y = frame.py(10f64.powf(d));
        let _ = writeln!(
            s,
            r##"<line x1="{L}" y1="{y:.1}" x2="{}" y2="{y:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
            W - R,
            L - 6.0,
            y + 4.0,
            fmt_y(10f64.powf(d))
        );
        d += 1.0;
    }
    let mut xs: Vec<f64> = pts.iter().map(|p| p.0).collect();
    xs.sort_by(|a, b| a.total_cmp(b));
    xs.dedup();
    for x in xs {
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{}</text>"#,
            frame.px(x),
            H - B + 18.0,
            fmt_x(x)
        );
    }
}

/// The `i`th series: its line, a dot with a tooltip at each point, and its
/// entry in the legend.
fn line(s: &mut String, frame: &Frame, i: usize, se: &Series) {
    let c = COLORS[i % COLORS.len()];
    let dash = if se.dashed {
        r#" stroke-dasharray="6 4""#
    } else {
        ""
    };
    let path: Vec<String> = se
        .points
        .iter()
        .map(|&(x, y)| format!("{:.1},{:.1}", frame.px(x), frame.py(y)))
        .collect();
    let _ = writeln!(
        s,
        r#"<polyline points="{}" fill="none" stroke="{c}" stroke-width="2"{dash}/>"#,
        path.join(" ")
    );
    for &(x, y) in &se.points {
        let _ = writeln!(
            s,
            r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{c}"><title>{}: {}</title></circle>"#,
            frame.px(x),
            frame.py(y),
            esc(&se.label),
            fmt_y(y)
        );
    }
    let ly = T + 10.0 + i as f64 * 18.0;
    let _ = writeln!(
        s,
        r#"<line x1="{}" y1="{ly}" x2="{}" y2="{ly}" stroke="{c}" stroke-width="2"{dash}/><text x="{}" y="{}">{}</text>"#,
        W - R + 12.0,
        W - R + 36.0,
        W - R + 42.0,
        ly + 4.0,
        esc(&se.label)
    );
}

fn fmt_y(y: f64) -> String {
    if y >= 1.0 {
        format!("{y:.0}")
    } else {
        format!("{y}")
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

//! Criterion's results as a line chart: median time per message against the benchmark's
//! parameter (the duplicate ratio, or the number of connections), one line per function.
//!
//! Criterion keeps each benchmark's latest results in
//! `<criterion dir>/<group>/<function>/<parameter>/new/`: `benchmark.json` names it (its
//! directory names are sanitized, the JSON keeps the real ones) and `estimates.json` holds the
//! estimates in nanoseconds per iteration. One iteration is one message in these benchmarks.
//! The SVG is written by hand: axes, ticks, grid, one polyline with markers per series, a legend.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::Deserialize;

#[derive(Debug, thiserror::Error)]
pub enum ChartError {
    #[error("reading {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("parsing {path}: {source}")]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{path}: parameter {value:?} is not a number")]
    Parameter { path: PathBuf, value: String },
    #[error("no criterion results under {0} (run `cargo bench -p inventory-benches` first)")]
    NoResults(PathBuf),
}

/// One benchmark's median, in microseconds per message.
#[derive(Debug, Clone, PartialEq)]
pub struct Point {
    pub parameter: f64,
    pub micros: f64,
}

/// One function of the group (a mode), its points in parameter order.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub name: String,
    pub points: Vec<Point>,
}

#[derive(Deserialize)]
struct BenchmarkJson {
    function_id: Option<String>,
    value_str: Option<String>,
}

#[derive(Deserialize)]
struct EstimatesJson {
    median: Estimate,
}

#[derive(Deserialize)]
struct Estimate {
    point_estimate: f64,
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, ChartError> {
    let text = std::fs::read_to_string(path).map_err(|source| ChartError::Io {
        path: path.to_owned(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|source| ChartError::Json {
        path: path.to_owned(),
        source,
    })
}

fn subdirectories(path: &Path) -> Result<Vec<PathBuf>, ChartError> {
    let io = |source| ChartError::Io {
        path: path.to_owned(),
        source,
    };
    let mut dirs = Vec::new();
    for entry in std::fs::read_dir(path).map_err(io)? {
        let entry = entry.map_err(io)?;
        if entry.file_type().map_err(io)?.is_dir() && entry.file_name() != "report" {
            dirs.push(entry.path());
        }
    }
    dirs.sort();
    Ok(dirs)
}

/// The medians of every `<function>/<parameter>` benchmark of `group`, series sorted by name.
pub fn read_group(criterion_dir: &Path, group: &str) -> Result<Vec<Series>, ChartError> {
    let group_dir = criterion_dir.join(group);
    let mut series: Vec<Series> = Vec::new();
    for function_dir in subdirectories(&group_dir)? {
        for parameter_dir in subdirectories(&function_dir)? {
            let new = parameter_dir.join("new");
            let benchmark_path = new.join("benchmark.json");
            if !benchmark_path.is_file() {
                continue;
            }
            let benchmark: BenchmarkJson = read_json(&benchmark_path)?;
            let estimates: EstimatesJson = read_json(&new.join("estimates.json"))?;
            let dir_name = |dir: &Path| {
                dir.file_name()
                    .map(|name| name.to_string_lossy().into_owned())
                    .unwrap_or_default()
            };
            let name = benchmark
                .function_id
                .unwrap_or_else(|| dir_name(&function_dir));
            let value = benchmark
                .value_str
                .unwrap_or_else(|| dir_name(&parameter_dir));
            let parameter = value.parse::<f64>().map_err(|_| ChartError::Parameter {
                path: benchmark_path.clone(),
                value: value.clone(),
            })?;
            let point = Point {
                parameter,
                micros: estimates.median.point_estimate / 1_000.0,
            };
            match series.iter_mut().find(|existing| existing.name == name) {
                Some(existing) => existing.points.push(point),
                None => series.push(Series {
                    name,
                    points: vec![point],
                }),
            }
        }
    }
    if series.is_empty() {
        return Err(ChartError::NoResults(group_dir));
    }
    for line in &mut series {
        line.points
            .sort_by(|a, b| a.parameter.total_cmp(&b.parameter));
    }
    series.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(series)
}

/// How a table shows a median.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// Microseconds per message.
    Micros,
    /// Messages per second: one over the time per message.
    PerSecond,
}

/// The medians as a Markdown table: one row per series, one column per parameter value.
pub fn markdown_table(series: &[Series], parameter_label: &str, unit: Unit) -> String {
    let parameters = parameters(series);
    let mut out = format!("| mode \\ {parameter_label} |");
    for parameter in &parameters {
        let _ = write!(out, " {} |", format_number(*parameter));
    }
    out.push_str("\n| --- |");
    for _ in &parameters {
        out.push_str(" ---: |");
    }
    out.push('\n');
    for line in series {
        let _ = write!(out, "| {} |", line.name);
        for parameter in &parameters {
            match line
                .points
                .iter()
                .find(|point| point.parameter == *parameter)
            {
                Some(point) => {
                    let value = match unit {
                        Unit::Micros => point.micros,
                        Unit::PerSecond => 1e6 / point.micros,
                    };
                    let _ = write!(out, " {value:.0} |");
                }
                None => out.push_str(" – |"),
            }
        }
        out.push('\n');
    }
    out
}

fn parameters(series: &[Series]) -> Vec<f64> {
    let mut all: Vec<f64> = series
        .iter()
        .flat_map(|line| line.points.iter().map(|point| point.parameter))
        .collect();
    all.sort_by(f64::total_cmp);
    all.dedup();
    all
}

/// A straight line through a series' medians against the duplicate ratio: what a fresh message
/// costs (the line at 0 %) and what a duplicate costs (the line at 100 %). A mode's cost at
/// ratio `r` is `fresh × (1 − r) + duplicate × r`, if the cost of each kind of message does not
/// depend on the mix.
#[derive(Debug, Clone, PartialEq)]
pub struct Fit {
    pub name: String,
    pub fresh: f64,
    pub duplicate: f64,
}

/// The least-squares line through `series` (parameter in percent); `None` with fewer than two
/// distinct ratios.
pub fn fit(series: &Series) -> Option<Fit> {
    let n = series.points.len() as f64;
    let xs = || series.points.iter().map(|point| point.parameter / 100.0);
    let mean_x = xs().sum::<f64>() / n;
    let mean_y = series.points.iter().map(|point| point.micros).sum::<f64>() / n;
    let spread: f64 = xs().map(|x| (x - mean_x).powi(2)).sum();
    if series.points.len() < 2 || spread <= f64::EPSILON {
        return None;
    }
    let covariance: f64 = series
        .points
        .iter()
        .map(|point| (point.parameter / 100.0 - mean_x) * (point.micros - mean_y))
        .sum();
    let slope = covariance / spread;
    let fresh = mean_y - slope * mean_x;
    Some(Fit {
        name: series.name.clone(),
        fresh,
        duplicate: fresh + slope,
    })
}

/// The duplicate ratio, in percent, at which `a` and `b` cost the same; `None` if their lines
/// are parallel. Below it the mode cheaper on fresh messages wins. A value outside 0–100 means
/// one mode is cheaper at every ratio.
pub fn break_even(a: &Fit, b: &Fit) -> Option<f64> {
    // fresh_a + (dup_a - fresh_a) r = fresh_b + (dup_b - fresh_b) r
    let slope_difference = (b.duplicate - b.fresh) - (a.duplicate - a.fresh);
    if slope_difference.abs() <= f64::EPSILON {
        return None;
    }
    Some((a.fresh - b.fresh) / slope_difference * 100.0)
}

/// Labels of the chart.
#[derive(Debug, Clone)]
pub struct Labels {
    pub title: String,
    pub x_axis: String,
    pub y_axis: String,
}

const WIDTH: f64 = 860.0;
const HEIGHT: f64 = 500.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 250.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 60.0;
const COLOURS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

/// A step of 1, 2 or 5 times a power of ten giving about `ticks` ticks up to `max`.
fn nice_step(max: f64, ticks: f64) -> f64 {
    let raw = (max / ticks).max(f64::MIN_POSITIVE);
    let magnitude = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|factor| factor * magnitude)
        .find(|step| *step >= raw)
        .unwrap_or(10.0 * magnitude)
}

fn format_number(value: f64) -> String {
    if (value - value.round()).abs() < 1e-9 {
        format!("{value:.0}")
    } else {
        format!("{value}")
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// The series as a standalone SVG document. The x axis spans the parameters given (from 0),
/// the y axis from 0 to a round value above the largest median.
pub fn render_svg(series: &[Series], labels: &Labels) -> String {
    let parameters = parameters(series);
    let x_max = parameters.last().copied().unwrap_or(1.0).max(1.0);
    let x_min = parameters.first().copied().unwrap_or(0.0).min(0.0);
    let y_peak = series
        .iter()
        .flat_map(|line| line.points.iter().map(|point| point.micros))
        .fold(0.0, f64::max);
    let y_step = nice_step(y_peak.max(1.0), 6.0);
    let y_max = (y_peak / y_step).ceil().max(1.0) * y_step;
    let plot_width = WIDTH - LEFT - RIGHT;
    let plot_height = HEIGHT - TOP - BOTTOM;
    let x_of = |value: f64| LEFT + (value - x_min) / (x_max - x_min) * plot_width;
    let y_of = |value: f64| TOP + plot_height - value / y_max * plot_height;

    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="13">"#
    );
    let _ = writeln!(
        svg,
        r#"<rect x="0" y="0" width="{WIDTH}" height="{HEIGHT}" fill="white"/>"#
    );
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="28" text-anchor="middle" font-size="16" font-weight="bold">{}</text>"#,
        LEFT + plot_width / 2.0,
        escape(&labels.title)
    );

    // Horizontal grid lines and the y ticks.
    let mut tick = 0.0;
    while tick <= y_max + y_step / 2.0 {
        let y = y_of(tick);
        let _ = writeln!(
            svg,
            r##"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#e0e0e0"/>"##,
            LEFT + plot_width
        );
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
            LEFT - 8.0,
            y + 4.0,
            format_number(tick)
        );
        tick += y_step;
    }
    // The x ticks: one per parameter measured.
    for parameter in &parameters {
        let x = x_of(*parameter);
        let _ = writeln!(
            svg,
            r##"<line x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}" stroke="#333"/>"##,
            TOP + plot_height,
            TOP + plot_height + 5.0
        );
        let _ = writeln!(
            svg,
            r#"<text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            TOP + plot_height + 20.0,
            format_number(*parameter)
        );
    }
    // The axes and their labels.
    let _ = writeln!(
        svg,
        r##"<path d="M {LEFT} {TOP} V {:.1} H {:.1}" fill="none" stroke="#333"/>"##,
        TOP + plot_height,
        LEFT + plot_width
    );
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
        LEFT + plot_width / 2.0,
        HEIGHT - 18.0,
        escape(&labels.x_axis)
    );
    let _ = writeln!(
        svg,
        r#"<text transform="translate(22 {:.1}) rotate(-90)" text-anchor="middle">{}</text>"#,
        TOP + plot_height / 2.0,
        escape(&labels.y_axis)
    );

    // One line per series, with a marker at each point, and its legend entry.
    for (index, line) in series.iter().enumerate() {
        let colour = COLOURS[index % COLOURS.len()];
        let points: Vec<String> = line
            .points
            .iter()
            .map(|point| format!("{:.1},{:.1}", x_of(point.parameter), y_of(point.micros)))
            .collect();
        let _ = writeln!(
            svg,
            r#"<polyline points="{}" fill="none" stroke="{colour}" stroke-width="2"/>"#,
            points.join(" ")
        );
        for point in &line.points {
            let _ = writeln!(
                svg,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3.5" fill="{colour}"><title>{}: {:.0} µs at {}</title></circle>"#,
                x_of(point.parameter),
                y_of(point.micros),
                escape(&line.name),
                point.micros,
                format_number(point.parameter)
            );
        }
        let legend_x = LEFT + plot_width + 20.0;
        let legend_y = TOP + 10.0 + 24.0 * index as f64;
        let _ = writeln!(
            svg,
            r#"<line x1="{legend_x:.1}" y1="{legend_y:.1}" x2="{:.1}" y2="{legend_y:.1}" stroke="{colour}" stroke-width="3"/>"#,
            legend_x + 24.0
        );
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}">{}</text>"#,
            legend_x + 32.0,
            legend_y + 4.0,
            escape(&line.name)
        );
    }
    svg.push_str("</svg>\n");
    svg
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<Series> {
        vec![
            Series {
                name: "a<b".into(),
                points: vec![
                    Point {
                        parameter: 0.0,
                        micros: 100.0,
                    },
                    Point {
                        parameter: 50.0,
                        micros: 340.0,
                    },
                ],
            },
            Series {
                name: "c".into(),
                points: vec![Point {
                    parameter: 50.0,
                    micros: 80.0,
                }],
            },
        ]
    }

    #[test]
    fn a_fit_recovers_fresh_and_duplicate_costs_and_their_break_even() {
        let line = |name: &str, fresh: f64, duplicate: f64| Series {
            name: name.into(),
            points: [0.0, 10.0, 50.0, 90.0]
                .into_iter()
                .map(|parameter| Point {
                    parameter,
                    micros: fresh + (duplicate - fresh) * parameter / 100.0,
                })
                .collect(),
        };
        let catch = fit(&line("catch", 1000.0, 1400.0)).unwrap_or_else(|| panic!("a fit"));
        let pre = fit(&line("pre", 1100.0, 300.0)).unwrap_or_else(|| panic!("a fit"));
        assert!((catch.fresh - 1000.0).abs() < 1e-6 && (catch.duplicate - 1400.0).abs() < 1e-6);
        // 1000 + 400 r = 1100 - 800 r  =>  r = 100 / 1200
        let even = break_even(&pre, &catch).unwrap_or_else(|| panic!("a break-even"));
        assert!((even - 100.0 / 12.0).abs() < 1e-6, "{even}");
        assert_eq!(
            fit(&line("one", 1.0, 1.0)).map(|f| f.name),
            Some("one".into())
        );
        assert!(
            fit(&Series {
                name: "flat".into(),
                points: vec![Point {
                    parameter: 10.0,
                    micros: 1.0
                }]
            })
            .is_none()
        );
    }

    #[test]
    fn steps_are_round() {
        assert_eq!(nice_step(340.0, 6.0), 100.0);
        assert_eq!(nice_step(9.0, 6.0), 2.0);
        assert_eq!(nice_step(1_000.0, 4.0), 500.0);
    }

    #[test]
    fn the_svg_has_a_line_and_legend_per_series_and_escapes_names() {
        let svg = render_svg(
            &sample(),
            &Labels {
                title: "t".into(),
                x_axis: "x".into(),
                y_axis: "y".into(),
            },
        );
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("a&lt;b"));
        assert!(!svg.contains("a<b"));
        assert!(svg.trim_end().ends_with("</svg>"));
    }

    #[test]
    fn the_table_has_a_column_per_parameter_and_a_dash_for_gaps() {
        let table = markdown_table(&sample(), "duplicates %", Unit::Micros);
        assert!(table.starts_with("| mode \\ duplicates % | 0 | 50 |"));
        assert!(table.contains("| c | – | 80 |"));
        let rates = markdown_table(&sample(), "connections", Unit::PerSecond);
        assert!(rates.contains("| c | – | 12500 |"), "{rates}");
    }

    #[test]
    fn criterion_directories_are_read_by_their_json() {
        let dir = std::env::temp_dir().join(format!("chart-test-{}", std::process::id()));
        let new = dir.join("g").join("mode_a").join("10").join("new");
        std::fs::create_dir_all(&new).unwrap_or_else(|error| panic!("{error}"));
        std::fs::create_dir_all(dir.join("g").join("report"))
            .unwrap_or_else(|error| panic!("{error}"));
        let write = |name: &str, text: &str| {
            std::fs::write(new.join(name), text).unwrap_or_else(|error| panic!("{error}"));
        };
        write(
            "benchmark.json",
            r#"{"group_id":"g","function_id":"mode a","value_str":"10"}"#,
        );
        write(
            "estimates.json",
            r#"{"mean":{"point_estimate":1.0},"median":{"point_estimate":2500.0}}"#,
        );
        let series = read_group(&dir, "g");
        let _ = std::fs::remove_dir_all(&dir);
        let series = series.unwrap_or_else(|error| panic!("{error}"));
        assert_eq!(
            series,
            vec![Series {
                name: "mode a".into(),
                points: vec![Point {
                    parameter: 10.0,
                    micros: 2.5
                }]
            }]
        );
    }
}

//! `--plot DIR`: SVG charts of a run with `plotters` (SVG backend only, so no system fonts
//! or freetype are needed): latency CDFs of time to first token and inter-token latency,
//! output throughput over time and the prefix-cache hit rate over time.

use std::path::{Path, PathBuf};

use anyhow::Context;
use plotters::prelude::*;

use super::driver::RunOutput;
use super::report::Report;

const SIZE: (u32, u32) = (900, 520);
const COLORS: [RGBColor; 3] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
];

/// Points of the empirical CDF of `samples`: (value, fraction of samples <= value).
pub fn cdf(samples: &[f64]) -> Vec<(f64, f64)> {
    let mut v: Vec<f64> = samples.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    let n = v.len() as f64;
    v.iter()
        .enumerate()
        .map(|(i, &x)| (x, (i + 1) as f64 / n))
        .collect()
}

struct Series {
    name: String,
    points: Vec<(f64, f64)>,
}

/// One line chart; an empty chart (no data) is still written, with its caption, so the set
/// of files does not depend on the run.
fn line_chart(
    path: &Path,
    caption: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[Series],
    y_range: Option<(f64, f64)>,
) -> anyhow::Result<()> {
    let draw = || -> Result<(), Box<dyn std::error::Error>> {
        let root = SVGBackend::new(path, SIZE).into_drawing_area();
        root.fill(&WHITE)?;
        let all = series.iter().flat_map(|s| s.points.iter());
        let x_max = all.clone().map(|p| p.0).fold(0.0, f64::max).max(1e-3) * 1.05;
        let (y_min, y_max) =
            y_range.unwrap_or_else(|| (0.0, all.map(|p| p.1).fold(0.0, f64::max).max(1e-3) * 1.1));
        let mut chart = ChartBuilder::on(&root)
            .caption(caption, ("sans-serif", 22))
            .margin(15)
            .x_label_area_size(45)
            .y_label_area_size(65)
            .build_cartesian_2d(0.0..x_max, y_min..y_max)?;
        chart
            .configure_mesh()
            .x_desc(x_desc)
            .y_desc(y_desc)
            .draw()?;
        for (i, s) in series.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            chart
                .draw_series(LineSeries::new(
                    s.points.iter().copied(),
                    color.stroke_width(2),
                ))?
                .label(s.name.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
            // Markers where points are few: a window with one sample still shows it.
            if s.points.len() < 60 {
                chart.draw_series(s.points.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
            }
        }
        if series.len() > 1 || series.iter().any(|s| !s.name.is_empty()) {
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .position(SeriesLabelPosition::LowerRight)
                .draw()?;
        }
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| anyhow::anyhow!("drawing {}: {e}", path.display()))
}

/// Write every chart into `dir` (created if missing); returns the files written.
pub fn write_all(dir: &Path, out: &RunOutput, report: &Report) -> anyhow::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let ok = || out.records.iter().filter(|r| r.outcome.is_success());
    let ttft: Vec<f64> = ok()
        .filter_map(|r| r.ttft.map(|d| d.as_secs_f64() * 1000.0))
        .collect();
    let itl: Vec<f64> = ok()
        .flat_map(|r| r.itl.iter().map(|d| d.as_secs_f64() * 1000.0))
        .collect();
    let mut written = Vec::new();

    let path = dir.join("ttft_cdf.svg");
    line_chart(
        &path,
        "Time to first token (CDF)",
        "TTFT (ms)",
        "fraction of requests",
        &[Series {
            name: format!("TTFT, {} requests", ttft.len()),
            points: cdf(&ttft),
        }],
        Some((0.0, 1.0)),
    )?;
    written.push(path);

    let path = dir.join("itl_cdf.svg");
    line_chart(
        &path,
        "Inter-token latency (CDF)",
        "ITL (ms)",
        "fraction of gaps",
        &[Series {
            name: format!("ITL, {} gaps", itl.len()),
            points: cdf(&itl),
        }],
        Some((0.0, 1.0)),
    )?;
    written.push(path);

    let path = dir.join("throughput.svg");
    line_chart(
        &path,
        "Output token throughput over time",
        "time (s)",
        "tokens/s",
        &[Series {
            name: "output tokens/s".into(),
            points: report
                .timeline
                .iter()
                .map(|p| (p.t_s, p.output_token_throughput))
                .collect(),
        }],
        None,
    )?;
    written.push(path);

    // The router's counters when known; otherwise the cached share of finished requests'
    // usage.
    let path = dir.join("hit_rate.svg");
    let series = if report.router_prefix_cache.is_some() {
        let pick = |f: fn(&super::report::RouterPoint) -> Option<f64>| {
            report
                .router_timeline
                .iter()
                .filter_map(|p| f(p).map(|r| (p.t_s, r)))
                .collect()
        };
        vec![
            Series {
                name: "router local hit rate".into(),
                points: pick(|p| p.local_hit_rate),
            },
            Series {
                name: "router external hit rate".into(),
                points: pick(|p| p.external_hit_rate),
            },
        ]
    } else {
        vec![Series {
            name: "cached share of prompt tokens (usage)".into(),
            points: report
                .timeline
                .iter()
                .filter(|p| p.prompt_tokens > 0)
                .map(|p| (p.t_s, p.cached_tokens as f64 / p.prompt_tokens as f64))
                .collect(),
        }]
    };
    line_chart(
        &path,
        "Prefix-cache hit rate over time",
        "time (s)",
        "hit rate",
        &series,
        Some((0.0, 1.0)),
    )?;
    written.push(path);
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cdf_ends_at_one_and_is_monotone() {
        let c = cdf(&[3.0, 1.0, 2.0, 2.0]);
        assert_eq!(c.first(), Some(&(1.0, 0.25)));
        assert_eq!(c.last(), Some(&(3.0, 1.0)));
        assert!(c.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].1 < w[1].1));
    }

    #[test]
    fn writes_an_svg() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.svg");
        line_chart(
            &path,
            "t",
            "x",
            "y",
            &[Series {
                name: "s".into(),
                points: vec![(0.0, 0.0), (1.0, 1.0)],
            }],
            None,
        )
        .unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains("<svg") && text.contains("polyline"), "{text}");
    }
}

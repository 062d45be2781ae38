//! The soak's chart: one SVG, four panels over the same time axis (server
//! RSS, server CPU, p99 latency, delivered events/s), with every fault
//! drawn as a vertical line in each panel. Drawn with plotters' SVG
//! backend.

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;

use super::faults::{Mark, DISK_FREED, DISK_FULL, KILLED, RESTARTED};
use super::sample::Sample;

#[derive(Debug, thiserror::Error)]
pub enum ChartError {
    #[error("drawing the chart: {0}")]
    Draw(String),
    #[error("writing {path}: {source}")]
    Write {
        path: String,
        source: std::io::Error,
    },
}

const WIDTH: u32 = 1100;
const PANEL_HEIGHT: u32 = 260;

/// One panel: its title, unit, colour and value of a sample.
struct Panel {
    title: &'static str,
    unit: &'static str,
    color: RGBColor,
    value: fn(&Sample) -> Option<f64>,
}

const PANELS: [Panel; 4] = [
    Panel {
        title: "server RSS",
        unit: "MiB",
        color: RGBColor(31, 119, 180),
        value: |s| s.rss_mib,
    },
    Panel {
        title: "server CPU",
        unit: "% of one core",
        color: RGBColor(44, 160, 44),
        value: |s| s.cpu_pct,
    },
    Panel {
        title: "p99 latency, event ts to receipt",
        unit: "ms",
        color: RGBColor(148, 103, 189),
        value: |s| s.p99_ms,
    },
    Panel {
        title: "delivered",
        unit: "events/s",
        color: RGBColor(255, 127, 14),
        value: |s| Some(s.events_per_s),
    },
];

/// The colour of a fault's line.
fn mark_color(what: &str) -> RGBColor {
    match what {
        KILLED => RGBColor(214, 39, 40),
        RESTARTED => RGBColor(140, 140, 140),
        DISK_FULL => RGBColor(188, 128, 0),
        DISK_FREED => RGBColor(23, 190, 207),
        _ => RGBColor(0, 0, 0),
    }
}

/// Writes the chart of `samples` and `marks` to `path`.
pub fn write(
    path: &Path,
    title: &str,
    samples: &[Sample],
    marks: &[Mark],
) -> Result<(), ChartError> {
    let mut svg = String::new();
    {
        let height = PANEL_HEIGHT * PANELS.len() as u32 + 40;
        let root = SVGBackend::with_string(&mut svg, (WIDTH, height)).into_drawing_area();
        root.fill(&WHITE).map_err(draw)?;
        let root = root.titled(title, ("sans-serif", 20)).map_err(draw)?;
        let areas = root.split_evenly((PANELS.len(), 1));
        let minutes = samples.last().map_or(1.0, |s| s.t_s / 60.0).max(0.1);
        for (i, (area, panel)) in areas.iter().zip(PANELS.iter()).enumerate() {
            draw_panel(area, panel, samples, marks, minutes, i == 0)?;
        }
        root.present().map_err(draw)?;
    }
    std::fs::write(path, svg).map_err(|source| ChartError::Write {
        path: path.display().to_string(),
        source,
    })
}

fn draw_panel(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    panel: &Panel,
    samples: &[Sample],
    marks: &[Mark],
    minutes: f64,
    legend: bool,
) -> Result<(), ChartError> {
    let top = samples
        .iter()
        .filter_map(panel.value)
        .fold(0.0f64, f64::max);
    let top = if top > 0.0 { top * 1.15 } else { 1.0 };
    let mut chart = ChartBuilder::on(area)
        .caption(
            format!("{} ({})", panel.title, panel.unit),
            ("sans-serif", 15),
        )
        .margin(8)
        .x_label_area_size(32)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0..minutes, 0.0..top)
        .map_err(draw)?;
    chart
        .configure_mesh()
        .x_desc("minutes")
        .y_desc(panel.unit)
        .light_line_style(RGBColor(235, 235, 235))
        .draw()
        .map_err(draw)?;
    // One line per stretch with values: no line across a server that was
    // down, nor from one process to the next.
    let restarts: Vec<f64> = marks
        .iter()
        .filter(|m| m.what == RESTARTED)
        .map(|m| m.t_s)
        .collect();
    let mut stretches: Vec<Vec<(f64, f64)>> = vec![Vec::new()];
    let mut previous_t = f64::NEG_INFINITY;
    for s in samples {
        let restarted = restarts.iter().any(|r| (previous_t..s.t_s).contains(r));
        previous_t = s.t_s;
        match (panel.value)(s) {
            Some(v) => {
                if restarted {
                    stretches.push(Vec::new());
                }
                if let Some(last) = stretches.last_mut() {
                    last.push((s.t_s / 60.0, v));
                }
            }
            None => stretches.push(Vec::new()),
        }
    }
    for stretch in stretches.into_iter().filter(|s| !s.is_empty()) {
        chart
            .draw_series(LineSeries::new(stretch, panel.color.stroke_width(2)))
            .map_err(draw)?;
    }
    let mut labelled: Vec<&str> = Vec::new();
    for m in marks {
        let x = m.t_s / 60.0;
        let color = mark_color(m.what);
        let series = chart
            .draw_series(LineSeries::new(
                vec![(x, 0.0), (x, top)],
                color.stroke_width(1),
            ))
            .map_err(draw)?;
        if legend && !labelled.contains(&m.what) {
            labelled.push(m.what);
            series
                .label(m.what)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
        }
    }
    if legend && !labelled.is_empty() {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(draw)?;
    }
    Ok(())
}

fn draw(e: impl std::fmt::Display) -> ChartError {
    ChartError::Draw(e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_an_svg_with_a_line_per_stretch_and_the_faults() {
        let samples: Vec<Sample> = (0..12)
            .map(|i| Sample {
                t_s: i as f64 * 5.0,
                load1: None,
                rss_mib: (i != 6).then_some(100.0 + i as f64),
                cpu_pct: (i != 6).then_some(20.0),
                events_per_s: 3000.0,
                p50_ms: Some(1.0),
                p99_ms: Some(4.0),
                resumes: 3,
                store_errors: 0,
                errors: 0,
                violations: 0,
            })
            .collect();
        let marks = [
            Mark {
                t_s: 28.0,
                what: KILLED,
            },
            Mark {
                t_s: 29.0,
                what: RESTARTED,
            },
        ];
        let dir = std::env::temp_dir().join(format!("soak-chart-{}", ulid::Ulid::new()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("chart.svg");
        write(&path, "soak", &samples, &marks).expect("chart");
        let svg = std::fs::read_to_string(&path).expect("read back");
        let _ = std::fs::remove_dir_all(&dir);
        assert!(svg.trim_start().starts_with("<svg"), "{svg}");
        assert!(svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("server RSS") && svg.contains(KILLED));
    }
}

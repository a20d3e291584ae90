//! A/B reports of training runs: PNG charts (reward, loss, KL, step time, peak memory;
//! every run on the same axes) and a markdown summary.

use crate::train::StepMetrics;
use plotters::prelude::*;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// Errors of reading runs and drawing charts.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// A run folder or its metrics could not be read.
    #[error("{path}: {reason}")]
    Run {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// Drawing or writing the output failed.
    #[error("report: {0}")]
    Output(String),
}

/// One run's metrics and label.
pub struct Run {
    /// `folder (impl)`.
    pub label: String,
    /// One entry per step.
    pub steps: Vec<StepMetrics>,
}

impl Run {
    /// Reads `dir/metrics.jsonl` (and `dir/config.yaml` for the loss path's name).
    pub fn load(dir: &Path) -> Result<Self, ReportError> {
        let path = dir.join("metrics.jsonl");
        let bad = |reason: String| ReportError::Run {
            path: path.clone(),
            reason,
        };
        let text = std::fs::read_to_string(&path).map_err(|e| bad(e.to_string()))?;
        let steps = text
            .lines()
            .enumerate()
            .map(|(i, l)| serde_json::from_str(l).map_err(|e| bad(format!("line {}: {e}", i + 1))))
            .collect::<Result<Vec<StepMetrics>, _>>()?;
        if steps.is_empty() {
            return Err(bad("no steps".into()));
        }
        let implementation = std::fs::read_to_string(dir.join("config.yaml"))
            .ok()
            .and_then(|y| serde_yaml_ng::from_str::<serde_yaml_ng::Value>(&y).ok())
            .and_then(|v| v["loss"]["impl"].as_str().map(str::to_string))
            .unwrap_or_else(|| "?".into());
        let name = dir
            .file_name()
            .map_or_else(|| dir.display().to_string(), |n| n.to_string_lossy().into());
        Ok(Run {
            label: format!("{name} ({implementation})"),
            steps,
        })
    }

    fn grpo(&self) -> impl Iterator<Item = &StepMetrics> {
        self.steps.iter().filter(|s| s.phase == "grpo")
    }

    /// Mean of `f` over the last `k` GRPO steps.
    pub fn last_mean(&self, k: usize, f: impl Fn(&StepMetrics) -> Option<f64>) -> Option<f64> {
        let v: Vec<f64> = self.grpo().filter_map(f).collect();
        let tail = &v[v.len().saturating_sub(k)..];
        (!tail.is_empty()).then(|| tail.iter().sum::<f64>() / tail.len() as f64)
    }

    /// Mean of `f` over the first `k` GRPO steps.
    pub fn first_mean(&self, k: usize, f: impl Fn(&StepMetrics) -> Option<f64>) -> Option<f64> {
        let v: Vec<f64> = self.grpo().filter_map(f).take(k).collect();
        (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
    }

    /// Peak bytes over the GRPO steps.
    pub fn peak_bytes(&self) -> Option<u64> {
        self.grpo().filter_map(|s| s.peak_bytes).max()
    }
}

/// A chart: file name, title, y label, and the value of a step.
type Series = (
    &'static str,
    &'static str,
    &'static str,
    fn(&StepMetrics) -> Option<f64>,
);

const CHARTS: [Series; 6] = [
    (
        "reward.png",
        "GRPO reward (mean over completions)",
        "reward",
        |s| s.reward_mean,
    ),
    ("accuracy.png", "GRPO accuracy", "accuracy", |s| s.accuracy),
    ("loss.png", "loss (warm-up CE, then GRPO)", "loss", |s| {
        Some(s.loss)
    }),
    ("kl.png", "KL to the reference policy", "kl", |s| s.kl),
    ("step_time.png", "step time", "seconds", |s| {
        Some(s.step_time_s)
    }),
    ("peak_memory.png", "peak memory per step", "MiB", |s| {
        s.peak_bytes.map(|b| b as f64 / (1u64 << 20) as f64)
    }),
];

fn chart(
    runs: &[Run],
    out: &Path,
    (file, title, ylabel, value): &Series,
) -> Result<(), ReportError> {
    let e = |e: String| ReportError::Output(format!("{file}: {e}"));
    let series: Vec<Vec<(f64, f64)>> = runs
        .iter()
        .map(|r| {
            r.steps
                .iter()
                .filter_map(|s| Some((s.step as f64, value(s)?)))
                .collect()
        })
        .collect();
    let points = series.iter().flatten();
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in points {
        (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
    }
    if x0 > x1 {
        return Ok(());
    }
    let pad = ((y1 - y0) * 0.05).max(1e-9);
    let path = out.join(file);
    let root = BitMapBackend::new(&path, (900, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(x.to_string()))?;
    let mut c = ChartBuilder::on(&root)
        .caption(*title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(x0..x1.max(x0 + 1.0), (y0 - pad)..(y1 + pad))
        .map_err(|x| e(x.to_string()))?;
    c.configure_mesh()
        .x_desc("step")
        .y_desc(*ylabel)
        .draw()
        .map_err(|x| e(x.to_string()))?;
    for (k, (run, points)) in runs.iter().zip(series).enumerate() {
        let color = Palette99::pick(k).to_rgba();
        c.draw_series(LineSeries::new(points, color.stroke_width(2)))
            .map_err(|x| e(x.to_string()))?
            .label(run.label.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    c.configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|x| e(x.to_string()))?;
    root.present().map_err(|x| e(x.to_string()))
}

fn fmt(x: Option<f64>, digits: usize) -> String {
    x.map_or_else(|| "-".into(), |v| format!("{v:.digits$}"))
}

/// The markdown summary of `runs`: per run `time/train/step_avg_last10_s`, peak
/// memory and final accuracy; with two runs, B/A ratios and how far the first steps'
/// losses are apart.
pub fn summary(runs: &[Run]) -> String {
    let mut md = String::from(
        "| run | GRPO steps | time/train/step_avg_last10_s | update_avg_last10_s | peak memory (MiB) | reward first 10 → last 10 | final accuracy (last 10 mean) |\n|---|---|---|---|---|---|---|\n",
    );
    for r in runs {
        let peak = r.peak_bytes().map(|b| b as f64 / (1u64 << 20) as f64);
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} → {} | {} |",
            r.label,
            r.grpo().count(),
            fmt(r.last_mean(10, |s| Some(s.step_time_s)), 3),
            fmt(r.last_mean(10, |s| Some(s.update_time_s)), 3),
            fmt(peak, 1),
            fmt(r.first_mean(10, |s| s.reward_mean), 3),
            fmt(r.last_mean(10, |s| s.reward_mean), 3),
            fmt(r.last_mean(10, |s| s.accuracy), 3),
        );
    }
    if let [a, b] = runs {
        let ratio = |x: Option<f64>, y: Option<f64>| fmt(x.zip(y).map(|(x, y)| y / x), 3);
        let _ = writeln!(
            md,
            "\nB/A ({} over {}): step time {}, update time {}, peak memory {}.",
            b.label,
            a.label,
            ratio(
                a.last_mean(10, |s| Some(s.step_time_s)),
                b.last_mean(10, |s| Some(s.step_time_s))
            ),
            ratio(
                a.last_mean(10, |s| Some(s.update_time_s)),
                b.last_mean(10, |s| Some(s.update_time_s))
            ),
            ratio(
                a.peak_bytes().map(|x| x as f64),
                b.peak_bytes().map(|x| x as f64)
            ),
        );
        let _ = writeln!(
            md,
            "\n| step | phase | loss A | loss B | absolute difference | relative difference |\n|---|---|---|---|---|---|"
        );
        let row = |md: &mut String, step: String, x: &StepMetrics, y: &StepMetrics| {
            let diff = (x.loss - y.loss).abs();
            let rel = diff / x.loss.abs().max(y.loss.abs()).max(1e-30);
            let _ = writeln!(
                md,
                "| {step} | {} | {:.9e} | {:.9e} | {diff:.2e} | {rel:.2e} |",
                x.phase, x.loss, y.loss
            );
        };
        for (x, y) in a.steps.iter().zip(&b.steps).take(5) {
            row(&mut md, x.step.to_string(), x, y);
        }
        if let (Some(x), Some(y)) = (a.grpo().next(), b.grpo().next()) {
            row(&mut md, format!("{} (first GRPO)", x.step), x, y);
        }
    }
    md
}

/// Reads `runs`, writes the charts and `summary.md` into `out`, and returns the summary.
pub fn report(runs: &[PathBuf], out: &Path) -> Result<String, ReportError> {
    let runs = runs
        .iter()
        .map(|d| Run::load(d))
        .collect::<Result<Vec<_>, _>>()?;
    std::fs::create_dir_all(out)
        .map_err(|e| ReportError::Output(format!("{}: {e}", out.display())))?;
    // Charts need a font; DejaVu Sans is embedded so no system font is required.
    let _ =
        plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular());
    for c in &CHARTS {
        chart(&runs, out, c)?;
    }
    let md = format!(
        "# Training report\n\nRuns: {}.\n\n{}\nCharts: {}.\n",
        runs.iter()
            .map(|r| r.label.as_str())
            .collect::<Vec<_>>()
            .join(", "),
        summary(&runs),
        CHARTS
            .iter()
            .map(|c| format!("![{}]({})", c.1, c.0))
            .collect::<Vec<_>>()
            .join(" ")
    );
    std::fs::write(out.join("summary.md"), &md).map_err(|e| ReportError::Output(e.to_string()))?;
    Ok(md)
}

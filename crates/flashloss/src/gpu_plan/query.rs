//! A planning query without a device (`flashloss plan`): the plan `auto` would take for
//! a call without a budget on a named GPU (or one of a given memory), its budget, its
//! peak against the unfused path's, and a time predicted by the rate model
//! ([`super::half_rate_rows`]) from the same-run cuBLAS rates recorded on that GPU.
//!
//! The time model: a plan's products take `FLOPs · (1 + 480 / rows) / rate` (the unfused
//! path is [`super::materialized_plan`], one block of all `N` rows), and its row kernels
//! move `bytes per logit · N · V` at [`DeviceKind::hbm_bytes_per_s`]. Both constants are
//! a model, fitted to few runs (docs/results/gpu.md): at the issue shape on the H200 it
//! predicts the bf16 chunk at 53.8 ms (measured 53.76 at 17878ef), the unfused path at
//! 52.7 ms (measured 55.2) and the f32 single-pass of 1729 rows at 62.6 ms (measured
//! 58.15).

use super::budget::plan_on;
use super::{CallShape, DefaultBudget, default_budget, half_rate_rows, materialized_plan};
use crate::element::DType;
use crate::error::{Error, Result};
use crate::fused::{FusedOptions, HeadGrad, Mode, Plan};
use serde::Serialize;

const GIB: f64 = (1u64 << 30) as f64;

/// A GPU the query knows: its memory and the rates measured on it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct DeviceKind {
    /// The name `--device` takes.
    pub name: &'static str,
    /// Device memory in bytes (what `nvidia-smi` reports as total).
    pub memory_bytes: usize,
    /// The same-run cuBLAS bf16 GEMM rate `[N, H] × [H, V]`, FLOP/s.
    pub bf16_flops_per_s: f64,
    /// The f32 head's rate (the unfused f32 path's 6NHV over its time), FLOP/s.
    pub f32_flops_per_s: f64,
    /// The row kernels' effective HBM rate, bytes/s (0.63 of the peak: the H200's 3.0
    /// TB/s of docs/results/gpu.md's prediction, 0.63 · 4.8 TB/s).
    pub hbm_bytes_per_s: f64,
    /// Where the rates come from.
    pub source: &'static str,
}

/// The GPUs with recorded rates.
pub const KINDS: [DeviceKind; 2] = [
    DeviceKind {
        name: "h100-80gb",
        memory_bytes: 81_559 << 20,
        bf16_flops_per_s: 705e12,
        f32_flops_per_s: 51e12,
        hbm_bytes_per_s: 0.63 * 3.35e12,
        source: "H100 80GB HBM3 at fa8bd11 (docs/results/data/gpu_h100_2026-11-23.md): \
                 same-run cuBLAS bf16 GEMM ~705 TFLOP/s; f32 head: the unfused path's \
                 30.6 TFLOP in 600 ms",
    },
    DeviceKind {
        name: "h200",
        memory_bytes: 143_771 << 20,
        bf16_flops_per_s: 666e12,
        f32_flops_per_s: 51e12,
        hbm_bytes_per_s: 0.63 * 4.8e12,
        source: "H200 at 17878ef (docs/results/gpu.md): same-run cuBLAS GEMM 666-671 \
                 TFLOP/s, 143771 MiB; f32 head: the H100's rate (not measured on an H200)",
    },
];

/// The kind named `name` ([`DeviceKind::name`]).
pub fn kind(name: &str) -> Result<DeviceKind> {
    KINDS
        .into_iter()
        .find(|k| k.name == name)
        .ok_or_else(|| Error::InvalidArgument {
            arg: "device",
            reason: format!(
                "unknown device {name:?} (known: {}; or give the memory instead)",
                KINDS.map(|k| k.name).join(", ")
            ),
        })
}

/// What the query asks: a call at `shape` on a device of `memory_bytes` with
/// `free_bytes` free (`None`: the memory less the call's arguments and outputs).
#[derive(Debug, Clone, Copy)]
pub struct PlanQuery {
    /// The call.
    pub shape: CallShape,
    /// The device (`None`: its memory alone, no predicted time).
    pub kind: Option<DeviceKind>,
    /// Device memory in bytes.
    pub memory_bytes: usize,
    /// Free bytes when the call plans (`None`: memory less the arguments and outputs).
    pub free_bytes: Option<usize>,
    /// The mode (`auto` for the default call).
    pub mode: Mode,
}

/// What `flashloss plan` is given, by name: a device (`--device`) or its memory
/// (`--memory-gib`), the free memory (`--free-gib`, optional), the call and the mode.
#[derive(Debug, Clone, Default)]
pub struct QueryArgs {
    /// A known device ([`KINDS`]).
    pub device: Option<String>,
    /// Device memory in GiB (instead of, or overriding, the device's).
    pub memory_gib: Option<f64>,
    /// Free memory in GiB when the call plans.
    pub free_gib: Option<f64>,
    /// Rows, hidden size, vocabulary.
    pub n: usize,
    /// Hidden size.
    pub h: usize,
    /// Vocabulary entries.
    pub v: usize,
    /// `bf16` or `f32`.
    pub dtype: String,
    /// `grpo` or `ce` (token-level losses with the head's gradients: the same plans).
    pub loss: String,
    /// `auto` (the default call), `auto_f32`, `two_pass`, `single_pass` or `compact`.
    pub mode: String,
}

fn bad(arg: &'static str, reason: String) -> Error {
    Error::InvalidArgument { arg, reason }
}

impl QueryArgs {
    /// The query these names ask.
    pub fn query(&self) -> Result<PlanQuery> {
        let kind = self.device.as_deref().map(kind).transpose()?;
        let gib = |x: f64, arg| {
            (x.is_finite() && x > 0.0)
                .then_some((x * GIB) as usize)
                .ok_or_else(|| bad(arg, format!("must be a positive number, got {x}")))
        };
        let memory_bytes = match (self.memory_gib, kind) {
            (Some(m), _) => gib(m, "memory_gib")?,
            (None, Some(k)) => k.memory_bytes,
            (None, None) => return Err(bad("device", "give --device or --memory-gib".into())),
        };
        let free_bytes = self.free_gib.map(|f| gib(f, "free_gib")).transpose()?;
        let dtype = match self.dtype.as_str() {
            "bf16" => DType::Bf16,
            "f32" => DType::F32,
            d => return Err(bad("dtype", format!("expected bf16 or f32, got {d:?}"))),
        };
        if !matches!(self.loss.as_str(), "grpo" | "ce") {
            return Err(bad(
                "loss",
                format!("expected grpo or ce, got {:?}", self.loss),
            ));
        }
        let mode = match self.mode.as_str() {
            "auto" => Mode::Auto,
            "auto_f32" => Mode::AutoF32,
            "two_pass" => Mode::TwoPass,
            "single_pass" => Mode::SinglePass,
            "compact" => Mode::Compact,
            m => return Err(bad("mode", format!("unknown mode {m:?}"))),
        };
        if self.n == 0 || self.h == 0 || self.v == 0 {
            return Err(bad("n", "n, h and v must be positive".into()));
        }
        Ok(PlanQuery {
            shape: CallShape {
                n: self.n,
                h: self.h,
                v: self.v,
                dtype,
                grads: Some(HeadGrad::Full),
            },
            kind,
            memory_bytes,
            free_bytes,
            mode,
        })
    }
}

/// The answer: the plan auto would take, its budget, peak and predicted time.
#[derive(Debug, Clone, Serialize)]
pub struct PlanReport {
    /// The device's name, if a known one was asked.
    pub device: Option<&'static str>,
    /// The call.
    pub shape: CallShape,
    /// Device memory (GiB).
    pub memory_gib: f64,
    /// Free memory when the call plans (GiB).
    pub free_gib: f64,
    /// `two_pass`, `single_pass` (f32 statistics) or `compact` (the bf16 chunk).
    pub mode: &'static str,
    /// Rows per block.
    pub block_rows: usize,
    /// Vocabulary entries per two-pass tile.
    pub vocab_tile: usize,
    /// The default budget and what bounded it.
    pub budget: DefaultBudget,
    /// The budget in MiB.
    pub budget_mib: f64,
    /// The plan's peak: arguments, outputs, workspace (GiB).
    pub peak_gib: f64,
    /// The unfused path's peak (GiB).
    pub unfused_peak_gib: f64,
    /// `peak_gib / unfused_peak_gib`.
    pub peak_ratio: f64,
    /// Predicted time of the plan and of the unfused path (ms), and their ratio; none
    /// without a known device.
    pub predicted_ms: Option<f64>,
    /// Predicted time of the unfused path (ms).
    pub unfused_predicted_ms: Option<f64>,
    /// `predicted_ms / unfused_predicted_ms`.
    pub time_ratio: Option<f64>,
    /// Where the rates come from.
    pub rate_source: Option<&'static str>,
    /// The plan itself.
    pub plan: Plan,
}

/// The plan's name as `mode` takes it.
fn mode_name(plan: &Plan) -> &'static str {
    match (plan.single_pass, plan.compact) {
        (false, _) => "two_pass",
        (true, false) => "single_pass",
        (true, true) => "compact",
    }
}

/// Bytes the row kernels move per logit (docs/results/gpu.md's table): f32 statistics
/// read 4, the gradient read 4 and its bf16 `dZ` written 2; the bf16 chunk 2 + 2 + 2; an
/// f32 head's `dZ` in place 4 + 4 + 4.
fn row_bytes_per_logit(plan: &Plan, dtype: DType) -> f64 {
    match (plan.compact, dtype) {
        (true, _) => 6.0,
        (false, DType::F32) => 12.0,
        (false, _) => 10.0,
    }
}

/// The rate model's time of `plan` on `kind` (seconds).
pub fn predicted_seconds(plan: &Plan, shape: &CallShape, kind: &DeviceKind) -> f64 {
    let (n, h, v) = (shape.n, shape.h, shape.v);
    let rate = match shape.dtype {
        DType::F32 => kind.f32_flops_per_s,
        _ => kind.bf16_flops_per_s,
    };
    let products = plan.flops(n, h, v) * (1.0 + half_rate_rows() / plan.block_rows as f64) / rate;
    let rows = row_bytes_per_logit(plan, shape.dtype) * (n * v) as f64 / kind.hbm_bytes_per_s;
    products + rows
}

/// Answers `q`: the plan of a call without a budget.
pub fn answer(q: &PlanQuery) -> Result<PlanReport> {
    let s = &q.shape;
    let free = q
        .free_bytes
        .unwrap_or_else(|| q.memory_bytes.saturating_sub(s.base_bytes()));
    let opts = FusedOptions {
        mode: q.mode,
        head_grad: s.grads.unwrap_or(HeadGrad::Full),
        ..FusedOptions::default()
    };
    let plan = plan_on(s, free, &opts, true)?;
    let budget = default_budget(s, free);
    let unfused = materialized_plan(s.n, s.v, s.dtype);
    let (peak, unfused_peak) = (s.peak_bytes(&plan), s.unfused_peak_bytes());
    let time = |p: &Plan| q.kind.map(|k| predicted_seconds(p, s, &k) * 1e3);
    let (t, t0) = (time(&plan), time(&unfused));
    Ok(PlanReport {
        device: q.kind.map(|k| k.name),
        shape: *s,
        memory_gib: q.memory_bytes as f64 / GIB,
        free_gib: free as f64 / GIB,
        mode: mode_name(&plan),
        block_rows: plan.block_rows,
        vocab_tile: plan.vocab_tile,
        budget,
        budget_mib: budget.bytes as f64 / (1u64 << 20) as f64,
        peak_gib: peak as f64 / GIB,
        unfused_peak_gib: unfused_peak as f64 / GIB,
        peak_ratio: peak as f64 / unfused_peak as f64,
        predicted_ms: t,
        unfused_predicted_ms: t0,
        time_ratio: t.zip(t0).map(|(a, b)| a / b),
        rate_source: q.kind.map(|k| k.source),
        plan,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask(device: &str, dtype: DType, mode: Mode) -> PlanReport {
        let kind = kind(device).unwrap();
        let shape = CallShape {
            n: 8192,
            h: 4096,
            v: 151_936,
            dtype,
            grads: Some(HeadGrad::Full),
        };
        answer(&PlanQuery {
            shape,
            kind: Some(kind),
            memory_bytes: kind.memory_bytes,
            free_bytes: None,
            mode,
        })
        .unwrap()
    }

    /// Every plan auto can take at `shape` within `budget` (block rows 1..=4096 of each
    /// kind), with its predicted time: none within 0.5x the unfused peak is faster.
    fn fastest_within_half_peak(r: &PlanReport, kind: &DeviceKind) -> f64 {
        let s = &r.shape;
        let mut best = f64::INFINITY;
        for rows in (256..=4096).step_by(64) {
            for (single_pass, compact, per) in
                [(false, false, 6), (true, false, 6), (true, true, 2)]
            {
                let cols = if single_pass { s.v } else { r.vocab_tile };
                let plan = Plan {
                    single_pass,
                    compact,
                    block_rows: rows,
                    workspace_bytes: rows * cols * per,
                    ..r.plan
                };
                if s.peak_bytes(&plan) * 2 <= s.unfused_peak_bytes()
                    && (!single_pass || rows >= 1024)
                {
                    best = best.min(predicted_seconds(&plan, s, kind) * 1e3);
                }
            }
        }
        best
    }

    /// An 80 GB H100 and a 141 GB H200 at N = 8192, H = 4096, V = 151936: bf16 takes the
    /// chunk at 4096 rows within 0.5x the unfused peak, the fastest plan within it; f32
    /// cannot reach 0.5x (its arguments and outputs alone are 0.51x) and keeps the CPU's
    /// 160 MiB two-pass plan.
    #[test]
    fn h100_and_h200_take_the_fastest_plan_within_half_the_unfused_peak() {
        for device in ["h100-80gb", "h200"] {
            let k = kind(device).unwrap();
            let bf16 = ask(device, DType::Bf16, Mode::Auto);
            assert_eq!((bf16.mode, bf16.block_rows), ("compact", 4096), "{bf16:?}");
            assert!(bf16.peak_ratio <= 0.5 && bf16.peak_ratio > 0.45, "{bf16:?}");
            let t = bf16.predicted_ms.unwrap();
            assert!(
                t <= fastest_within_half_peak(&bf16, &k) + 1e-9,
                "{device}: {t}"
            );
            assert!(bf16.time_ratio.unwrap() < 1.05, "{bf16:?}");
            let f32_stats = ask(device, DType::Bf16, Mode::AutoF32);
            assert_eq!(f32_stats.mode, "single_pass");
            assert!(f32_stats.peak_ratio <= 0.5, "{f32_stats:?}");
            let f32_head = ask(device, DType::F32, Mode::Auto);
            assert_eq!(f32_head.mode, "two_pass");
            assert_eq!(
                f32_head.budget.bound,
                super::super::budget::BudgetBound::Floor
            );
            assert!(f32_head.peak_ratio > 0.5 && f32_head.peak_ratio < 0.55);
        }
        // The H200's recorded run: the chunk at 4196 rows took 53.76 ms.
        let h200 = ask("h200", DType::Bf16, Mode::Auto);
        assert!((h200.predicted_ms.unwrap() - 53.8).abs() < 1.0, "{h200:?}");
        assert!(kind("a100").is_err());
    }

    /// The names the CLI passes: a device or a memory, a known dtype, loss and mode.
    #[test]
    fn query_args_name_the_call() {
        let args = QueryArgs {
            device: Some("h200".into()),
            n: 8192,
            h: 4096,
            v: 151_936,
            dtype: "bf16".into(),
            loss: "ce".into(),
            mode: "auto".into(),
            ..QueryArgs::default()
        };
        let q = args.query().unwrap();
        assert_eq!(q.memory_bytes, 143_771 << 20);
        let r = answer(&q).unwrap();
        assert_eq!((r.mode, r.block_rows), ("compact", 4096));
        // Memory alone: the same plan, no predicted time.
        let mem = QueryArgs {
            device: None,
            memory_gib: Some(80.0),
            ..args.clone()
        };
        let r = answer(&mem.query().unwrap()).unwrap();
        assert_eq!((r.mode, r.predicted_ms), ("compact", None));
        // Little free memory: a quarter of a GiB is a 128 MiB share, under the floor.
        let tight = QueryArgs {
            free_gib: Some(0.25),
            ..args.clone()
        };
        let r = answer(&tight.query().unwrap()).unwrap();
        assert_eq!((r.mode, r.budget_mib), ("two_pass", 160.0));
        for bad in [
            QueryArgs {
                device: None,
                ..args.clone()
            },
            QueryArgs {
                dtype: "f8".into(),
                ..args.clone()
            },
            QueryArgs {
                loss: "kto".into(),
                ..args.clone()
            },
            QueryArgs {
                mode: "fast".into(),
                ..args.clone()
            },
            QueryArgs {
                free_gib: Some(-1.0),
                ..args.clone()
            },
        ] {
            assert!(bad.query().is_err(), "{bad:?}");
        }
    }
}

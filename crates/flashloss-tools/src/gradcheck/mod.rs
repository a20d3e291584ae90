//! `flashloss gradcheck`: random inputs, the f64 reference and a kernel side by side,
//! and tolerance gates (spec: "Numerical tolerances"). Kernels: the logits-level GRPO
//! kernel (gradient w.r.t. logits), and the fused LM-head GRPO, cross-entropy and
//! log-prob kernels (gradients w.r.t. hidden states, weight and bias).

use crate::inputs::GrpoInputs;
use crate::{Error, Result};
use flashloss::{DType, GrpoLoss};
use half::{bf16, f16};
use linear::check_linear;

mod case;
mod config;
mod linear;
mod logits;
mod logprobs;
mod logprobs_gates;
mod report;

pub(crate) use case::{LinearCase, ce_targets, inject_fault};
pub use config::{
    Backend, Fault, FaultKind, GradcheckConfig, Kernel, LogprobsConfig, Objective, Tolerance,
};
pub use logits::check_inputs;
pub use logprobs::EXACT_MAX_HIDDEN;
pub(crate) use logprobs::Outputs;
pub(crate) use logprobs_gates::output_gates;
pub(crate) use report::grad_gate;
pub use report::{Gate, GradcheckReport};

/// Runs gradcheck as configured.
pub fn run(cfg: &GradcheckConfig) -> Result<GradcheckReport> {
    run_with(cfg, &mut |_| {})
}

/// [`run`], telling `note` what it is doing: the config and the memory plan are
/// checked first ([`GradcheckConfig::check_plan`]), before any input is drawn.
pub fn run_with(cfg: &GradcheckConfig, note: &mut dyn FnMut(&str)) -> Result<GradcheckReport> {
    let planned = cfg.check_plan()?;
    note(&format!(
        "{:?} {:?} [B={}, T={}, V={}{}] {:?}: drawing inputs, running the kernel and the f64 reference (about {:.1} MiB)",
        cfg.kernel,
        cfg.objective,
        cfg.batch,
        cfg.seq_len,
        cfg.vocab,
        if cfg.kernel == Kernel::Linear {
            format!(", H={}", cfg.hidden)
        } else {
            String::new()
        },
        cfg.dtype,
        planned as f64 / 1048576.0
    ));
    match (cfg.kernel, cfg.objective) {
        (Kernel::Logits, Objective::Ce) => Err(Error::from(flashloss::Error::InvalidArgument {
            arg: "objective",
            reason: "ce is checked on kernel `linear` (there is no logits-level CE kernel)".into(),
        })),
        (Kernel::Logits, Objective::Logprobs) => {
            Err(Error::from(flashloss::Error::InvalidArgument {
                arg: "objective",
                reason: "logprobs is checked on kernel `linear` (the fused LM head's log-probs)"
                    .into(),
            }))
        }
        (Kernel::Logits, Objective::Grpo) => {
            let loss = GrpoLoss::new(cfg.loss.clone())?;
            let inputs = GrpoInputs::try_random(&cfg.input_spec(), cfg.seed)?;
            match cfg.dtype {
                DType::F32 => check_inputs(cfg, &loss, &inputs, inputs.logits.clone()),
                DType::Bf16 => {
                    let data = inputs.logits.iter().map(|&x| bf16::from_f32(x)).collect();
                    check_inputs(cfg, &loss, &inputs, data)
                }
                DType::F16 => {
                    let data = inputs.logits.iter().map(|&x| f16::from_f32(x)).collect();
                    check_inputs(cfg, &loss, &inputs, data)
                }
            }
        }
        (Kernel::Linear, _) => match cfg.dtype {
            DType::F32 => check_linear::<f32>(cfg),
            DType::Bf16 => check_linear::<bf16>(cfg),
            DType::F16 => check_linear::<f16>(cfg),
        },
    }
}

//! `flashloss gradcheck` on the fused LM-head path: every gradient gate is present and
//! passes for GRPO and CE in both modes and dtypes, and a gate can fail.

use flashloss::DType;
use flashloss::Mode;
use flashloss_tools::gradcheck::{self, GradcheckConfig, Kernel, Objective, Tolerance};

fn config(objective: Objective, dtype: DType, mode: Mode) -> GradcheckConfig {
    let mut cfg = GradcheckConfig {
        kernel: Kernel::Linear,
        objective,
        batch: 2,
        seq_len: 9,
        hidden: 35,
        vocab: 2057,
        dtype,
        mode,
        ..GradcheckConfig::default()
    };
    cfg.loss.beta = 0.04;
    cfg.ce.label_smoothing = 0.1;
    cfg.ce.softcap = Some(20.0);
    cfg
}

#[test]
fn linear_gates_pass_and_can_fail() {
    for objective in [Objective::Grpo, Objective::Ce] {
        for dtype in [DType::F32, DType::Bf16] {
            for mode in [Mode::SinglePass, Mode::TwoPass] {
                let cfg = config(objective, dtype, mode);
                let r = gradcheck::run(&cfg).unwrap();
                let case = r.kernel.clone();
                for name in ["loss", "logp", "dhidden", "dweight", "dbias"] {
                    assert!(r.gate(name).is_some(), "{case}: gate {name} missing");
                }
                assert_eq!(
                    r.gate("entropy").is_some(),
                    objective == Objective::Grpo,
                    "{case}"
                );
                assert!(r.passed, "{case}: {:?}", r.gates);
                let strict = GradcheckConfig {
                    tolerance: Tolerance {
                        grad_rel: Some(0.0),
                        grad_atol: Some(0.0),
                        ..Tolerance::default()
                    },
                    ..cfg
                };
                let r = gradcheck::run(&strict).unwrap();
                assert!(!r.passed, "{case}: zero tolerance must fail");
            }
        }
    }
}

#[test]
fn ce_needs_the_linear_kernel() {
    let cfg = GradcheckConfig {
        objective: Objective::Ce,
        ..GradcheckConfig::default()
    };
    assert_eq!(
        gradcheck::run(&cfg).unwrap_err().to_string(),
        "argument `objective`: ce is checked on kernel `linear` (there is no logits-level CE kernel)"
    );
}

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
        for dtype in [DType::F32, DType::Bf16, DType::F16] {
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

/// Padded sequences put masked rows between live ones; every mode leaves them out of
/// its blocks (gathering the live rows' hidden states, scattering their dH). Small
/// blocks, so that gaps fall inside blocks and between them, on every product engine
/// this CPU has.
#[test]
fn blocks_skip_masked_rows_between_live_ones() {
    use flashloss::{Bf16Products, FusedOptions, fused::mib_to_bytes};
    let reserve = flashloss::cpu::gemm_reserve_bytes() as f64 / f64::from(1 << 20);
    let engines = match flashloss::cpu::Avx512Bf16::detect() {
        Some(_) => vec![Bf16Products::Widened, Bf16Products::Avx512Bf16],
        None => {
            eprintln!("skipped: bf16 products on avx512bf16 (this CPU has no AVX512-BF16)");
            vec![Bf16Products::Widened]
        }
    };
    for objective in [Objective::Grpo, Objective::Ce] {
        for (dtype, products) in [(DType::F32, &engines[..1]), (DType::Bf16, &engines[..])] {
            for (&bf16_products, mode) in products
                .iter()
                .flat_map(|p| [Mode::SinglePass, Mode::Compact, Mode::TwoPass].map(move |m| (p, m)))
            {
                let mut cfg = config(objective, dtype, mode);
                (cfg.batch, cfg.seq_len, cfg.masked_fraction) = (5, 13, 0.4);
                cfg.bf16_products = bf16_products;
                let n = cfg.batch * cfg.seq_len;
                // The largest budget (in steps of 1/1024 MiB above the reserve) whose
                // blocks hold 2 to 6 rows.
                let rows_at = |mib: f64| {
                    let opts = FusedOptions {
                        bf16_products,
                        mode,
                        budget_bytes: Some(mib_to_bytes(mib)),
                        grad_output: 1.0,
                        head_grad: Default::default(),
                    };
                    flashloss::cpu::plan(
                        n,
                        cfg.hidden,
                        cfg.vocab,
                        (dtype, Default::default()),
                        &opts,
                        true,
                    )
                    .map_or(0, |p| p.block_rows)
                };
                cfg.budget_mib = (1..1024)
                    .rev()
                    .map(|k| reserve + k as f64 / 1024.0)
                    .find(|&mib| (2..=6).contains(&rows_at(mib)))
                    .expect("a budget of 2 to 6 rows a block");
                let r = gradcheck::run(&cfg).unwrap();
                assert!(r.passed, "{} {bf16_products:?}: {:?}", r.kernel, r.gates);
            }
        }
    }
}

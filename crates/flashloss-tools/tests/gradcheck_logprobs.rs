//! `flashloss gradcheck` with `objective: logprobs` (the fused LM head's log-probs): the
//! gates are present and pass on several shapes, dtypes, modes and requests (Σp²,
//! candidate sets, the truncated support, an upstream of lse, a frozen head), on one rank
//! and sharded; an injected `perturb` fault makes them FAIL; bad values of the
//! `logprobs` keys are config errors naming the key.

use flashloss::{DType, HeadGrad, Mode, Parallel};
use flashloss_tools::gradcheck::{
    self, Fault, FaultKind, GradcheckConfig, GradcheckReport, Kernel, LogprobsConfig, Objective,
};
use flashloss_tools::{Error, config_file, sharded_check};

const SHIPPED: &str = include_str!("../../../configs/gradcheck/linear_logprobs.yaml");
/// The GPU check's log-prob config (scripts/gpu/gradchecks.sh, `device: cuda`).
const GPU: &str = include_str!("../../../configs/gradcheck/gpu/linear_logprobs.yaml");

/// The GPU check's truncated-support config (scripts/gpu/gradchecks.sh).
const GPU_SUPPORT: &str =
    include_str!("../../../configs/gradcheck/gpu/linear_logprobs_support.yaml");

/// GRPO under a support, which scripts/gpu/gradchecks.sh runs with `device=cuda`.
const GRPO_SUPPORT: &str = include_str!("../../../configs/gradcheck/linear_grpo_support.yaml");

/// The `--set`s scripts/gpu/gradchecks.sh runs `GPU_SUPPORT` with (besides the dtype).
const GPU_SUPPORT_RUNS: &[&[&str]] = &[
    &[],
    &[
        "logprobs.top_k=400",
        "logprobs.min_p=0.02",
        "logprobs.temperature=0.7",
        "logprobs.gather_k=5",
    ],
    &["logprobs.top_k=4500"],
];

/// A small head (V not a multiple of 256, masked rows) with every request on.
fn config(dtype: DType, support: bool) -> GradcheckConfig {
    let logprobs = LogprobsConfig {
        temperature: 0.8,
        return_sum_p2: true,
        gather_k: 4,
        top_k: support.then_some(150),
        top_p: support.then_some(0.85),
        min_p: support.then_some(0.01),
        lse_grad: true,
    };
    GradcheckConfig {
        kernel: Kernel::Linear,
        objective: Objective::Logprobs,
        batch: 2,
        seq_len: 9,
        hidden: 29,
        vocab: 1031,
        dtype,
        masked_fraction: 0.3,
        logprobs,
        ..GradcheckConfig::default()
    }
}

fn gates_of(r: &GradcheckReport) -> Vec<&str> {
    r.gates.iter().map(|g| g.name).collect()
}

#[test]
fn the_shipped_config_passes_every_gate() {
    let cfg: GradcheckConfig = config_file::parse(SHIPPED, &[]).unwrap();
    for head_grad in [HeadGrad::Full, HeadGrad::Frozen] {
        let r = gradcheck::run(&GradcheckConfig {
            head_grad,
            ..cfg.clone()
        })
        .unwrap();
        assert!(r.passed, "{head_grad:?}: {:?}", r.gates);
        let mut want = vec![
            "loss",
            "logp",
            "entropy",
            "lse",
            "sum_p2",
            "gathered",
            "support_logp",
            "support_lse",
            "support_outside",
            "support_size",
            "masked_rows",
            "support_skipped",
            "dhidden",
        ];
        match head_grad {
            HeadGrad::Full => want.extend(["dweight", "dbias"]),
            HeadGrad::Frozen => want.push("frozen_head_grads"),
        }
        assert_eq!(gates_of(&r), want);
        assert!(r.loss_ref.is_finite() && r.loss_ref != 0.0);
    }
}

/// The GPU check's log-prob runs (every mode, f32 and bf16, a frozen head, f16), on the CPU:
/// the config is valid, asks Σp², lse and candidate sets, and the CPU passes it, so a
/// failure on the device is the device's.
#[test]
fn the_gpu_config_passes_on_the_cpu() {
    let on_cpu = |sets: &[&str]| -> GradcheckConfig {
        let sets: Vec<String> = ["device=cpu"]
            .iter()
            .chain(sets)
            .map(|s| s.to_string())
            .collect();
        config_file::parse(GPU, &sets).unwrap()
    };
    let cuda: GradcheckConfig = config_file::parse(GPU, &[]).unwrap();
    assert_eq!(cuda.device, gradcheck::Backend::Cuda);
    let mut runs: Vec<[&str; 2]> = Vec::new();
    for dtype in ["dtype=f32", "dtype=bf16"] {
        for extra in [
            "mode=auto",
            "mode=two_pass",
            "mode=single_pass",
            "head_grad=frozen",
        ] {
            runs.push([dtype, extra]);
        }
    }
    runs.push(["dtype=f16", "mode=two_pass"]);
    for sets in runs {
        let r = gradcheck::run(&on_cpu(&sets)).unwrap();
        assert!(r.passed, "{sets:?}: {:?}", r.gates);
        for gate in ["lse", "sum_p2", "gathered"] {
            assert!(r.gate(gate).is_some(), "{sets:?}: no gate {gate}");
        }
        assert!(r.gate("support_outside").is_none(), "{sets:?}");
    }
}

/// The GPU check's support runs pass on the CPU (what the device must match), every
/// support gate present.
#[test]
fn the_gpu_support_config_passes_on_the_cpu() {
    let cuda: GradcheckConfig = config_file::parse(GPU_SUPPORT, &[]).unwrap();
    assert_eq!(cuda.device, gradcheck::Backend::Cuda);
    for dtype in ["dtype=f32", "dtype=bf16"] {
        for sets in GPU_SUPPORT_RUNS {
            let sets: Vec<String> = (["device=cpu", dtype].iter().chain(sets.iter()))
                .map(|s| s.to_string())
                .collect();
            let cfg: GradcheckConfig = config_file::parse(GPU_SUPPORT, &sets).unwrap();
            assert!(cfg.logprobs.top_p.is_some(), "{sets:?}");
            let r = gradcheck::run(&cfg).unwrap();
            assert!(r.passed, "{sets:?}: {:?}", r.gates);
            assert!(
                r.gate("support_outside").is_some(),
                "{sets:?}: no support gate"
            );
        }
        let sets = vec![dtype.to_string()];
        let cfg: GradcheckConfig = config_file::parse(GRPO_SUPPORT, &sets).unwrap();
        let r = gradcheck::run(&cfg).unwrap();
        assert!(r.passed, "GRPO {sets:?}: {:?}", r.gates);
        assert!(r.gate("support_outside").is_some(), "GRPO {sets:?}");
    }
}

#[test]
fn passes_on_shapes_dtypes_modes_and_requests() {
    let mut runs = 0;
    for dtype in [DType::F32, DType::Bf16, DType::F16] {
        for support in [false, true] {
            let modes: &[Mode] = match support {
                true => &[Mode::Auto, Mode::TwoPass],
                false => &[Mode::SinglePass, Mode::TwoPass, Mode::Compact],
            };
            for &mode in modes {
                for (batch, seq_len, hidden, vocab, seed) in
                    [(2, 9, 29, 1031, 0), (3, 4, 7, 257, 5)]
                {
                    let cfg = GradcheckConfig {
                        mode,
                        batch,
                        seq_len,
                        hidden,
                        vocab,
                        seed,
                        ..config(dtype, support)
                    };
                    let r = gradcheck::run(&cfg).unwrap();
                    let case = format!("{} V={vocab} H={hidden}", r.kernel);
                    assert!(r.passed, "{case}: {:?}", r.gates);
                    assert_eq!(r.gate("support_outside").is_some(), support, "{case}");
                    runs += 1;
                }
            }
        }
    }
    assert_eq!(runs, 30);
    // Only logp and entropy asked, no bias, grad_output 2.5 at T = 1.
    let cfg = GradcheckConfig {
        bias: false,
        grad_output: 2.5,
        logprobs: LogprobsConfig::default(),
        ..config(DType::F32, false)
    };
    let r = gradcheck::run(&cfg).unwrap();
    assert!(r.passed, "{:?}", r.gates);
    let names = gates_of(&r);
    assert_eq!(
        names,
        [
            "loss",
            "logp",
            "entropy",
            "lse",
            "masked_rows",
            "dhidden",
            "dweight"
        ]
    );
}

#[test]
fn sharded_runs_pass_on_every_rank() {
    for (parallel, ranks, vocab_groups) in [
        (Parallel::Vocab, 3, None),
        (Parallel::Token, 2, None),
        (Parallel::Grid2d, 4, Some(2)),
    ] {
        for support in [false, true] {
            let cfg = GradcheckConfig {
                parallel,
                vocab_groups,
                ..config(DType::F32, support)
            };
            for r in sharded_check::run(&cfg, ranks).unwrap() {
                let r = r.unwrap();
                let case = format!("{parallel:?} support={support} rank {}", r.rank);
                assert!(r.report.passed, "{case}: {:?}", r.report.gates);
                assert!(r.report.gate("gathered").is_some(), "{case}");
                assert_eq!(r.report.gate("support_size").is_some(), support, "{case}");
            }
        }
    }
}

#[test]
fn a_perturbed_kernel_input_fails_the_gates() {
    let fault = Some(Fault {
        rank: 0,
        kind: FaultKind::Perturb,
    });
    for support in [false, true] {
        let cfg = GradcheckConfig {
            fault,
            ..config(DType::F32, support)
        };
        let r = gradcheck::run(&cfg).unwrap();
        assert!(!r.passed, "support={support}");
        for name in [
            "loss", "logp", "entropy", "lse", "sum_p2", "gathered", "dhidden", "dweight",
        ] {
            assert!(
                !r.gate(name).unwrap().passed,
                "support={support}: {name} passed"
            );
        }
        // The same config without the fault passes: the fault made the difference.
        assert!(
            gradcheck::run(&GradcheckConfig { fault: None, ..cfg })
                .unwrap()
                .passed
        );
    }
    // Sharded: rank 1's kernel sees the perturbed hidden states; every rank's gates see it.
    let cfg = GradcheckConfig {
        parallel: Parallel::Vocab,
        fault: Some(Fault {
            rank: 1,
            kind: FaultKind::Perturb,
        }),
        ..config(DType::F32, true)
    };
    for r in sharded_check::run(&cfg, 3).unwrap() {
        let r = r.unwrap();
        assert!(!r.report.passed, "rank {}", r.rank);
    }
    // A NaN on the one rank is the kernel's error naming the hidden states.
    let cfg = GradcheckConfig {
        fault: Some(Fault {
            rank: 0,
            kind: FaultKind::Nan,
        }),
        ..config(DType::F32, true)
    };
    let err = gradcheck::run(&cfg).unwrap_err().to_string();
    assert_eq!(err, "argument `hidden`: value NaN at index 0 is not finite");
}

#[test]
fn bad_logprobs_values_are_errors_naming_the_key() {
    for (set, key) in [
        ("logprobs.top_k=0", "logprobs.top_k"),
        ("logprobs.top_p=0", "logprobs.top_p"),
        ("logprobs.top_p=1.5", "logprobs.top_p"),
        ("logprobs.top_p=.nan", "logprobs.top_p"),
        ("logprobs.min_p=-0.1", "logprobs.min_p"),
        ("logprobs.min_p=2", "logprobs.min_p"),
        ("logprobs.temperature=0", "logprobs.temperature"),
        ("logprobs.temperature=.inf", "logprobs.temperature"),
        ("logprobs.gather_k=-1", "logprobs.gather_k"),
        ("logprobs.gather_k=1.5", "logprobs.gather_k"),
        ("logprobs.lse_grad=3", "logprobs.lse_grad"),
        ("logprobs.topk=3", "logprobs.topk"),
        ("mode=single_pass", "mode"),
        ("mode=compact", "mode"),
        ("hidden=2049", "hidden"),
        ("gather_k=3", "gather_k"),
        (
            "logprobs.gather_k=18446744073709551615",
            "batch·seq_len·logprobs.gather_k",
        ),
    ] {
        let err = config_file::parse::<GradcheckConfig>(SHIPPED, &[set.to_string()])
            .and_then(|cfg| gradcheck::run(&cfg));
        match err {
            Err(Error::ConfigFile { key: got, .. }) => assert_eq!(got, key, "{set}"),
            other => panic!("{set}: {:?}", other.map(|r| r.passed)),
        }
    }
    // The `logprobs` keys belong to objective `logprobs`.
    let err = config_file::parse::<GradcheckConfig>(
        SHIPPED,
        &["objective=grpo".into(), "vocab=300".into()],
    )
    .and_then(|cfg| gradcheck::run(&cfg));
    assert!(
        matches!(&err, Err(Error::ConfigFile { key, .. }) if key == "logprobs"),
        "{:?}",
        err.map(|r| r.passed)
    );
    // ... on kernel `linear`.
    let cfg = GradcheckConfig {
        kernel: Kernel::Logits,
        objective: Objective::Logprobs,
        ..GradcheckConfig::default()
    };
    assert_eq!(
        gradcheck::run(&cfg).unwrap_err().to_string(),
        "argument `objective`: logprobs is checked on kernel `linear` (the fused LM head's log-probs)"
    );
}

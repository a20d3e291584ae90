//! Property tests of validation: valid inputs with random garbage edited in (ids out of
//! range, NaN and ±inf and huge values in every per-token input and in the logits or
//! the head, buffers one element short, a layout that does not match, garbage loss
//! knobs, a NaN `grad_output`) never panic, and never give a NaN: every call returns a
//! typed error, or finite loss and gradients. The YAML configs with random `--set`
//! overrides never panic either. 1000 + 500 + 1000 cases per run (`PROPTEST_CASES`).

use flashloss::device::{CeCall, GrpoCall};
use flashloss::{
    CeConfig, CrossEntropy, Device, FusedOptions, GrpoLoss, GrpoLossConfig, LogitsLayout, LossType,
    Mode, PerSeqOrTokenBuf,
};
use flashloss_tools::bench::BenchConfig;
use flashloss_tools::config_file;
use flashloss_tools::gradcheck::GradcheckConfig;
use flashloss_tools::inputs::{GrpoInputs, HeadInputs, InputSpec};
use proptest::prelude::*;

fn cases(default: u32) -> ProptestConfig {
    let n = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default);
    ProptestConfig {
        cases: n,
        ..ProptestConfig::default()
    }
}

fn garbage_f32() -> impl Strategy<Value = f32> {
    prop_oneof![
        Just(f32::NAN),
        Just(f32::INFINITY),
        Just(f32::NEG_INFINITY),
        Just(1e30f32),
        Just(-1e30f32),
        Just(f32::MAX),
        -200.0f32..200.0,
        any::<f32>(),
    ]
}

fn garbage_f64() -> impl Strategy<Value = f64> {
    prop_oneof![
        Just(f64::NAN),
        Just(f64::INFINITY),
        Just(-1.0),
        Just(0.0),
        Just(1e-30),
        Just(1e30),
        -10.0f64..10.0,
        any::<f64>(),
    ]
}

/// One edit of valid inputs.
#[derive(Debug, Clone)]
enum Edit {
    TargetId(usize, i64),
    Advantage(usize, f32),
    OldLogp(usize, f32),
    RefLogp(usize, f32),
    Sampler(usize, f32),
    Logit(usize, f32),
    Hidden(usize, f32),
    Weight(usize, f32),
    ShortMask,
    ShortTargets,
    ShortOldLogp,
    ShortAdvantages,
    ShortHidden,
    LayoutBatch(usize),
    GradOutput(f32),
    Loss(usize, f64),
    Ce(usize, f64),
}

fn edit() -> impl Strategy<Value = Edit> {
    let i = 0usize..64;
    prop_oneof![
        (i.clone(), prop_oneof![any::<i64>(), -2i64..40]).prop_map(|(i, x)| Edit::TargetId(i, x)),
        (i.clone(), garbage_f32()).prop_map(|(i, x)| Edit::Advantage(i, x)),
        (i.clone(), garbage_f32()).prop_map(|(i, x)| Edit::OldLogp(i, x)),
        (i.clone(), garbage_f32()).prop_map(|(i, x)| Edit::RefLogp(i, x)),
        (i.clone(), garbage_f32()).prop_map(|(i, x)| Edit::Sampler(i, x)),
        (0usize..4096, garbage_f32()).prop_map(|(i, x)| Edit::Logit(i, x)),
        (0usize..512, garbage_f32()).prop_map(|(i, x)| Edit::Hidden(i, x)),
        (0usize..512, garbage_f32()).prop_map(|(i, x)| Edit::Weight(i, x)),
        Just(Edit::ShortMask),
        Just(Edit::ShortTargets),
        Just(Edit::ShortOldLogp),
        Just(Edit::ShortAdvantages),
        Just(Edit::ShortHidden),
        (0usize..5).prop_map(Edit::LayoutBatch),
        garbage_f32().prop_map(Edit::GradOutput),
        (0usize..8, garbage_f64()).prop_map(|(k, x)| Edit::Loss(k, x)),
        (0usize..4, garbage_f64()).prop_map(|(k, x)| Edit::Ce(k, x)),
    ]
}

/// The inputs of one case after its edits.
struct Case {
    x: GrpoInputs,
    head: HeadInputs<f32>,
    layout: LogitsLayout,
    grad_output: f32,
    loss: GrpoLossConfig,
    ce: CeConfig,
}

fn set<T: Copy>(buf: &mut [T], i: usize, x: T) {
    if !buf.is_empty() {
        let k = i % buf.len();
        buf[k] = x;
    }
}

fn build(b: usize, t: usize, v: usize, h: usize, seed: u64, edits: &[Edit]) -> Case {
    let spec = InputSpec {
        batch: b,
        seq_len: t,
        vocab: v,
        sampler_ratio: true,
        ..InputSpec::default()
    };
    let mut x = GrpoInputs::random(&spec, seed);
    let mut head = HeadInputs::<f32>::random(b * t, h, v, true, seed);
    let mut layout = LogitsLayout::contiguous(b, t, v);
    let mut grad_output = 1.0;
    let mut loss = GrpoLossConfig {
        beta: 0.04,
        entropy_coef: 0.01,
        loss_type: LossType::Grpo,
        ..GrpoLossConfig::default()
    };
    let mut ce = CeConfig::default();
    let d = &mut x.data;
    for e in edits {
        match e.clone() {
            Edit::TargetId(i, id) => set(&mut d.target_ids, i, id),
            Edit::Advantage(i, a) => match &mut d.advantages {
                PerSeqOrTokenBuf::Sequence(s) | PerSeqOrTokenBuf::Token(s) => set(s, i, a),
            },
            Edit::OldLogp(i, a) => set(d.old_logp.as_mut().unwrap(), i, a),
            Edit::RefLogp(i, a) => set(d.ref_logp.as_mut().unwrap(), i, a),
            Edit::Sampler(i, a) => match d.sampler_ratio.as_mut().unwrap() {
                PerSeqOrTokenBuf::Sequence(s) | PerSeqOrTokenBuf::Token(s) => set(s, i, a),
            },
            Edit::Logit(i, z) => set(&mut x.logits, i, z),
            Edit::Hidden(i, z) => set(&mut head.hidden, i, z),
            Edit::Weight(i, z) => set(&mut head.weight, i, z),
            Edit::ShortMask => {
                d.mask.pop();
            }
            Edit::ShortTargets => {
                d.target_ids.pop();
            }
            Edit::ShortOldLogp => {
                d.old_logp.as_mut().unwrap().pop();
            }
            Edit::ShortAdvantages => match &mut d.advantages {
                PerSeqOrTokenBuf::Sequence(s) | PerSeqOrTokenBuf::Token(s) => {
                    s.pop();
                }
            },
            Edit::ShortHidden => {
                head.hidden.pop();
            }
            Edit::LayoutBatch(b2) => layout = LogitsLayout::contiguous(b2, t, v),
            Edit::GradOutput(g) => grad_output = g,
            Edit::Loss(k, val) => match k {
                0 => loss.epsilon_low = val,
                1 => loss.epsilon_high = val,
                2 => loss.beta = val,
                3 => loss.temperature = val,
                4 => loss.entropy_coef = val,
                5 => loss.delta = Some(val),
                6 => loss.num_items_in_batch = Some(val),
                _ => loss.sapo_temperature_pos = val,
            },
            Edit::Ce(k, val) => match k {
                0 => ce.label_smoothing = val,
                1 => ce.z_loss = val,
                2 => ce.softcap = Some(val),
                _ => ce.temperature = val,
            },
        }
    }
    Case {
        x,
        head,
        layout,
        grad_output,
        loss,
        ce,
    }
}

fn all_finite(xs: &[f32]) -> bool {
    xs.iter().all(|x| x.is_finite())
}

proptest! {
    #![proptest_config(cases(1000))]
    #[test]
    fn garbage_is_an_error_or_finite(
        b in 1usize..3, t in 1usize..5, v in 1usize..40, h in 1usize..6, seed in 0u64..100,
        edits in proptest::collection::vec(edit(), 0..4),
        in_place in any::<bool>(),
    ) {
        let c = build(b, t, v, h, seed, &edits);
        let Ok(loss) = GrpoLoss::new(c.loss.clone()) else { return Ok(()) };
        let batch = c.x.batch();

        // Logits level, out of place or in place.
        let mut logits = c.x.logits.clone();
        let mut out = vec![0.0f32; logits.len()];
        let device = Device::cpu();
        let fwd = match in_place {
            true => device.grpo_logits_in_place(&loss, &batch, &mut logits, &c.layout, c.grad_output),
            false => device.grpo_logits(&loss, &batch, &logits, &c.layout, c.grad_output, &mut out),
        };
        if let Ok(fwd) = fwd {
            prop_assert!(fwd.loss.is_finite(), "logits loss {}", fwd.loss);
            let grad = if in_place { &logits } else { &out };
            prop_assert!(all_finite(grad), "logits gradient not finite");
        } else if in_place {
            // A failed step leaves the logits as they were.
            let bits = |xs: &[f32]| xs.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&logits), bits(&c.x.logits));
        }

        // The fused LM head, both modes.
        for mode in [Mode::SinglePass, Mode::TwoPass] {
            let opts = FusedOptions { bf16_products: Default::default(), mode, budget_bytes: Some(flashloss::cpu::gemm_reserve_bytes() + (1 << 20)), grad_output: c.grad_output, head_grad: Default::default() };
            let inputs = c.head.inputs();
            if let Ok(out) = device.with_host_grads(&inputs, GrpoCall::new(&loss, &batch, &opts)) {
                prop_assert!(out.loss.is_finite(), "linear loss {}", out.loss);
                prop_assert!(all_finite(&out.grads.dhidden) && all_finite(&out.grads.dweight));
            }
            let ce = CrossEntropy::new(c.ce.clone());
            let out = ce.and_then(|ce| device.with_host_grads(&inputs, CeCall::new(&ce, batch.target_ids, &opts)));
            if let Ok(out) = out {
                prop_assert!(out.loss.is_finite(), "ce loss {}", out.loss);
                prop_assert!(all_finite(&out.grads.dhidden) && all_finite(&out.grads.dweight));
            }
        }
    }
}

const GRADCHECK: &str = include_str!("../../../configs/gradcheck/default.yaml");
const BENCH: &str = include_str!("../../../configs/bench/default.yaml");

fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("batch".to_string()),
        Just("vocab".to_string()),
        Just("masked_fraction".to_string()),
        Just("loss.temperature".to_string()),
        Just("loss.loss_type".to_string()),
        Just("tolerance.grad_rel".to_string()),
        Just("fault.rank".to_string()),
        Just("tokens".to_string()),
        Just("grpo.beta".to_string()),
        Just("a.b.c".to_string()),
        "[a-z_.]{0,12}",
    ]
}

fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("0".to_string()),
        Just("-1".to_string()),
        Just("1e400".to_string()),
        Just(".nan".to_string()),
        Just("18446744073709551616".to_string()),
        Just("[1, 2]".to_string()),
        Just("{a: 1}".to_string()),
        Just("~".to_string()),
        Just("grpo".to_string()),
        any::<i64>().prop_map(|x| x.to_string()),
        any::<f64>().prop_map(|x| x.to_string()),
        ".{0,12}",
    ]
}

proptest! {
    #![proptest_config(cases(500))]
    #[test]
    fn config_overrides_never_panic(
        overrides in proptest::collection::vec(
            prop_oneof![
                4 => (key(), value()).prop_map(|(k, v)| format!("{k}={v}")),
                1 => ".{0,16}",
            ],
            0..4,
        ),
        garbage in ".{0,40}",
    ) {
        for text in [GRADCHECK, BENCH, garbage.as_str()] {
            if let Ok(cfg) = config_file::parse::<GradcheckConfig>(text, &overrides) {
                let _ = cfg.validate();
            }
            if let Ok(cfg) = config_file::parse::<BenchConfig>(text, &overrides) {
                let _ = cfg.validate();
            }
        }
    }
}

proptest! {
    #![proptest_config(cases(1000))]
    #[test]
    fn validated_gradcheck_configs_draw_without_panicking(
        b in 1usize..4, t in 1usize..6, v in 1usize..50,
        masked_fraction in 0.0f64..=1.0, logit_std in prop_oneof![1e-6f64..1e-3, 0.1f64..5.0, 1e3f64..1e5],
        seed in any::<u64>(),
    ) {
        let cfg = GradcheckConfig { batch: b, seq_len: t, vocab: v, masked_fraction, logit_std, seed, ..GradcheckConfig::default() };
        prop_assert!(cfg.validate().is_ok());
        let x = GrpoInputs::try_random(&cfg.input_spec(), seed).unwrap();
        prop_assert_eq!(x.logits.len(), b * t * v);
        prop_assert!(x.data.target_ids.iter().all(|&y| (0..v as i64).contains(&y)));
    }
}

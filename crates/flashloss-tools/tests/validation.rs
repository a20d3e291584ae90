//! Every validation error, with its message checked; config files with unknown keys
//! or wrong types are rejected naming the key.

use flashloss::cpu::{grpo_logits_forward, selective_log_softmax};
use flashloss::{
    GrpoLoss, GrpoLossConfig, ImportanceSamplingLevel, LogitsLayout, LossType, PerSeqOrToken,
    Temperature,
};
use flashloss_tools::config_file;
use flashloss_tools::gradcheck::GradcheckConfig;
use flashloss_tools::inputs::{GrpoInputs, InputSpec};

type Edit = Box<dyn FnOnce(&mut GrpoLossConfig)>;

fn config_error(f: impl FnOnce(&mut GrpoLossConfig)) -> String {
    let mut c = GrpoLossConfig {
        loss_type: LossType::Grpo,
        ..GrpoLossConfig::default()
    };
    f(&mut c);
    GrpoLoss::new(c).unwrap_err().to_string()
}

#[test]
fn invalid_configs_are_rejected_at_construction() {
    use ImportanceSamplingLevel::*;
    let cases: Vec<(Edit, &str)> = vec![
        (
            Box::new(|c| {
                c.loss_type = LossType::Cispo;
                c.delta = Some(2.0);
            }),
            "`delta`: delta is valid only for the clipped family (grpo, bnpo, dr_grpo, dapo, luspo), not cispo",
        ),
        (
            Box::new(|c| c.delta = Some(0.9)),
            "`delta`: must be finite and > 1, got 0.9",
        ),
        (
            Box::new(|c| {
                c.loss_type = LossType::Vespo;
                c.importance_sampling_level = Sequence;
            }),
            "`importance_sampling_level`: vespo supports only importance_sampling_level = token",
        ),
        (
            Box::new(|c| c.loss_type = LossType::DrGrpo),
            "`max_completion_length`: dr_grpo requires max_completion_length >= 1",
        ),
        (
            Box::new(|c| c.temperature = 0.0),
            "`temperature`: must be finite and > 0 with 1/temperature within f32, got 0",
        ),
        (
            Box::new(|c| c.epsilon_low = 1.5),
            "`epsilon_low`: must be in [0, 1), got 1.5",
        ),
        (
            Box::new(|c| c.beta = -0.1),
            "`beta`: must be >= 0, got -0.1",
        ),
        (
            Box::new(|c| c.entropy_coef = f64::NAN),
            "`entropy_coef`: must be finite, got NaN",
        ),
        (
            Box::new(|c| {
                c.loss_type = LossType::Dapo;
                c.num_items_in_batch = Some(0.0);
            }),
            "`num_items_in_batch`: must be finite and > 0, got 0",
        ),
        (
            Box::new(|c| {
                c.loss_type = LossType::Cispo;
                c.epsilon_high = 0.0;
            }),
            "`epsilon_high`: cispo caps the ratio at epsilon_high, which must be > 0",
        ),
    ];
    for (f, want) in cases {
        let got = config_error(f);
        assert_eq!(got, format!("invalid loss config: {want}"));
    }
}

/// Issue 33: a loss type's unused parameters are not validated (Liger's tests pass
/// `sapo_temperature_neg=False` to bnpo), and an error names the argument that is wrong.
#[test]
fn only_the_loss_types_parameters_are_validated() {
    use LossType::*;
    let accepted = |t: LossType, f: &dyn Fn(&mut GrpoLossConfig)| {
        let mut c = GrpoLossConfig {
            loss_type: t,
            max_completion_length: Some(8),
            epsilon_high: if t == Cispo { 5.0 } else { 0.2 },
            ..GrpoLossConfig::default()
        };
        f(&mut c);
        GrpoLoss::new(c).map(|_| ()).map_err(|e| e.to_string())
    };
    let sapo_off = |c: &mut GrpoLossConfig| {
        c.sapo_temperature_pos = 0.0;
        c.sapo_temperature_neg = f64::NAN;
    };
    let vespo_off = |c: &mut GrpoLossConfig| {
        c.vespo_k_pos = f64::INFINITY;
        c.vespo_lambda_neg = f64::NAN;
    };
    let eps_off = |c: &mut GrpoLossConfig| c.epsilon_low = 1.5;
    for t in LossType::ALL {
        assert_eq!(t == Sapo, accepted(t, &sapo_off).is_err(), "{t:?} sapo");
        assert_eq!(t == Vespo, accepted(t, &vespo_off).is_err(), "{t:?} vespo");
        assert_eq!(t.is_clipped(), accepted(t, &eps_off).is_err(), "{t:?} eps");
        let items = accepted(t, &|c| c.num_items_in_batch = Some(0.0)).is_err();
        assert_eq!(matches!(t, Dapo | Cispo | Vespo), items, "{t:?} items");
    }
    let neg = accepted(Sapo, &|c| c.sapo_temperature_neg = 0.0).unwrap_err();
    assert_eq!(
        neg,
        "invalid loss config: `sapo_temperature_neg`: must be > 0, got 0"
    );
    let pos = accepted(Sapo, &|c| c.sapo_temperature_pos = -1.0).unwrap_err();
    assert_eq!(
        pos,
        "invalid loss config: `sapo_temperature_pos`: must be > 0, got -1"
    );
    let k = accepted(Vespo, &|c| c.vespo_k_neg = f64::NAN).unwrap_err();
    assert_eq!(
        k,
        "invalid loss config: `vespo_k_neg`: must be finite, got NaN"
    );
}

#[test]
fn trl_1_16_levels_and_defaults_are_accepted() {
    use ImportanceSamplingLevel::*;
    // Every loss type at token level, every one but vespo at sequence level.
    for t in LossType::ALL {
        for level in [Token, Sequence] {
            let c = GrpoLossConfig {
                loss_type: t,
                importance_sampling_level: level,
                max_completion_length: Some(8),
                epsilon_high: if t == LossType::Cispo { 5.0 } else { 0.2 },
                ..GrpoLossConfig::default()
            };
            let ok = GrpoLoss::new(c).is_ok();
            assert_eq!(
                ok,
                !(t == LossType::Vespo && level == Sequence),
                "{t:?} {level:?}"
            );
            assert_eq!(ok, t.allows_level(level), "{t:?} {level:?}");
        }
    }
    let d = GrpoLossConfig::default();
    assert_eq!(d.loss_type, LossType::Dapo, "TRL 1.16 default");
    assert!(d.use_bias_correction_kl, "TRL 1.16 default");
    assert_eq!(d.beta, 0.0);
}

fn inputs() -> GrpoInputs {
    GrpoInputs::random(
        &InputSpec {
            batch: 2,
            seq_len: 4,
            vocab: 50,
            masked_fraction: 0.0,
            ..InputSpec::default()
        },
        1,
    )
}

fn forward_error<'a>(x: &'a GrpoInputs, f: impl FnOnce(&mut flashloss::GrpoBatch<'a>)) -> String {
    let loss = GrpoLoss::new(GrpoLossConfig {
        beta: 0.04,
        loss_type: LossType::Grpo,
        ..GrpoLossConfig::default()
    })
    .unwrap();
    let mut batch = x.batch();
    f(&mut batch);
    let layout = LogitsLayout::contiguous(2, 4, 50);
    grpo_logits_forward(&loss, &batch, &x.logits, &layout)
        .unwrap_err()
        .to_string()
}

#[test]
fn bad_inputs_name_the_argument_and_index() {
    let mut x = inputs();
    let short = vec![0i64; 7];
    assert_eq!(
        forward_error(&x, |b| b.target_ids = &short),
        "argument `target_ids`: expected 8 elements for shape [B=2, T=4], got 7"
    );
    let mask = vec![true; 9];
    assert_eq!(
        forward_error(&x, |b| b.mask = &mask),
        "argument `mask`: expected 8 elements for shape [B=2, T=4], got 9"
    );
    let adv = vec![1.0f32; 3];
    assert_eq!(
        forward_error(&x, |b| b.advantages = PerSeqOrToken::Sequence(&adv)),
        "argument `advantages`: expected 2 elements for shape [B=2], got 3"
    );
    let adv_nan = vec![1.0f32, f32::NAN];
    assert_eq!(
        forward_error(&x, |b| b.advantages = PerSeqOrToken::Sequence(&adv_nan)),
        "argument `advantages`: value NaN at index 1 is not finite"
    );
    assert_eq!(
        forward_error(&x, |b| b.ref_logp = None),
        "argument `ref_logp`: required when beta > 0 (beta = 0.04)"
    );
    let rho = vec![1.0f32, 1.0, -0.5, 1.0, 1.0, 1.0, 1.0, 1.0];
    assert_eq!(
        forward_error(&x, |b| b.sampler_ratio = Some(PerSeqOrToken::Token(&rho))),
        "argument `importance_sampling_ratio`: value -0.5 at index 2 is negative"
    );
    let short_mask = vec![true; 7];
    assert_eq!(
        forward_error(&x, |b| b.policy_mask = Some(&short_mask)),
        "argument `policy_mask`: expected 8 elements for shape [B=2, T=4], got 7"
    );
    assert_eq!(
        forward_error(&x, |b| b.entropy_mask = Some(&mask)),
        "argument `entropy_mask`: expected 8 elements for shape [B=2, T=4], got 9"
    );
    let mut old = x.data.old_logp.clone().unwrap();
    old[5] = f32::INFINITY;
    assert_eq!(
        forward_error(&x, |b| b.old_logp = Some(&old)),
        "argument `old_logp`: value inf at index 5 is not finite"
    );
    x.data.target_ids[6] = 50;
    assert_eq!(
        forward_error(&x, |_| {}),
        "argument `target_ids`: id 50 at index 6 (sequence 1, position 2) is outside [0, 50)"
    );
    // Masked positions are never read: padding ids and NaN logp there are fine.
    x.data.mask[6] = false;
    x.data.old_logp.as_mut().unwrap()[6] = f32::NAN;
    let loss = GrpoLoss::new(GrpoLossConfig {
        loss_type: LossType::Grpo,
        ..GrpoLossConfig::default()
    })
    .unwrap();
    let layout = LogitsLayout::contiguous(2, 4, 50);
    assert!(grpo_logits_forward(&loss, &x.batch(), &x.logits, &layout).is_ok());
}

#[test]
fn bad_layouts_and_backward_arguments() {
    let x = inputs();
    let loss = GrpoLoss::new(GrpoLossConfig {
        loss_type: LossType::Grpo,
        ..GrpoLossConfig::default()
    })
    .unwrap();
    let batch = x.batch();
    let run = |layout: LogitsLayout, data: &[f32]| {
        grpo_logits_forward(&loss, &batch, data, &layout)
            .unwrap_err()
            .to_string()
    };
    let mut layout = LogitsLayout::contiguous(2, 4, 50);
    assert_eq!(
        run(layout, &x.logits[..399]),
        "argument `logits`: expected 400 elements for shape [B=2, T=4, V=50] with strides (200, 50), got 399"
    );
    layout.row_stride = 49;
    assert_eq!(
        run(layout, &x.logits),
        "argument `logits`: row_stride 49 is smaller than vocab 50"
    );
    layout = LogitsLayout::contiguous(2, 4, 50);
    layout.seq_stride = 150;
    assert_eq!(
        run(layout, &x.logits),
        "argument `logits`: seq_stride 150 makes sequences overlap (need >= 200)"
    );
    assert_eq!(
        run(LogitsLayout::contiguous(2, 3, 50), &x.logits),
        "argument `logits`: layout is [B=2, T=3] but the batch is [B=2, T=4]"
    );
    let f = grpo_logits_forward(
        &loss,
        &batch,
        &x.logits,
        &LogitsLayout::contiguous(2, 4, 50),
    )
    .unwrap();
    let mut out = vec![0.0f32; 399];
    assert_eq!(
        f.backward(&x.logits, 1.0, &mut out)
            .unwrap_err()
            .to_string(),
        "argument `dlogits`: expected 400 elements for shape [N=8, V=50], got 399"
    );
    let mut out = vec![0.0f32; 400];
    assert_eq!(
        f.backward(&x.logits, f32::NAN, &mut out)
            .unwrap_err()
            .to_string(),
        "argument `grad_output`: value NaN at index 0 is not finite"
    );
    let zero = LogitsLayout::contiguous(0, 4, 50);
    assert_eq!(
        selective_log_softmax(&x.logits, &zero, &[], None, Temperature::default())
            .unwrap_err()
            .to_string(),
        "argument `logits`: batch, seq_len and vocab must be >= 1, got [B=0, T=4, V=50]"
    );
    // The temperature is checked once, where it is made.
    assert_eq!(
        Temperature::new(0.0).unwrap_err().to_string(),
        "argument `temperature`: must be finite and > 0 with 1/temperature within f32, got 0"
    );
}

#[test]
fn config_files_reject_unknown_keys_and_wrong_types() {
    let parse = |text: &str, sets: &[&str]| {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        config_file::parse::<GradcheckConfig>(text, &sets)
    };
    let err = parse("batch: 2\nbatchh: 3\n", &[]).unwrap_err().to_string();
    assert!(err.contains("unknown field `batchh`"), "{err}");
    let err = parse("loss:\n  betta: 0.1\n", &[]).unwrap_err().to_string();
    assert!(
        err.starts_with("config loss.betta: unknown field `betta`"),
        "{err}"
    );
    let err = parse("loss:\n  beta: high\n", &[]).unwrap_err().to_string();
    assert!(err.starts_with("config loss.beta: invalid type"), "{err}");
    let err = parse("vocab: -3\n", &[]).unwrap_err().to_string();
    assert!(err.starts_with("config vocab:"), "{err}");
    let err = parse("", &["loss.loss_type=ppo"]).unwrap_err().to_string();
    assert!(
        err.starts_with("config loss.loss_type: unknown variant `ppo`"),
        "{err}"
    );
    let err = parse("", &["no_equals_sign"]).unwrap_err().to_string();
    assert!(err.contains("key=value"), "{err}");
    let cfg = parse(
        "batch: 2\nloss:\n  beta: 0.1\n",
        &["loss.beta=0.25", "vocab=77"],
    )
    .unwrap();
    assert_eq!((cfg.batch, cfg.vocab, cfg.loss.beta), (2, 77, 0.25));
    for file in [
        "default",
        "qwen_vocab",
        "qwen_vocab_bf16",
        "linear_logprobs",
    ] {
        let path = format!(
            "{}/../../configs/gradcheck/{file}.yaml",
            env!("CARGO_MANIFEST_DIR")
        );
        config_file::load::<GradcheckConfig>(std::path::Path::new(&path), &[])
            .unwrap_or_else(|e| panic!("{file}: {e}"));
    }
}

/// Gradient buffers of the wrong size, or a bias gradient without a bias, are errors
/// naming the buffer and the head's shape (the check every backend's fused kernel runs).
#[test]
fn gradient_buffers_must_match_the_head() {
    use flashloss::LinearGrads;
    use flashloss_tools::inputs::HeadInputs;
    let head = HeadInputs::<f32>::random(5, 3, 7, false, 0);
    let inputs = head.inputs();
    let good = LinearGrads::zeros(&inputs);
    assert!(good.check(&inputs, Default::default()).is_ok());
    let mut short = good.clone();
    short.dhidden.pop();
    assert_eq!(
        short
            .check(&inputs, Default::default())
            .unwrap_err()
            .to_string(),
        "argument `dhidden`: expected 15 elements for shape [N=5, H=3], got 14"
    );
    let mut wide = good.clone();
    wide.dweight.push(0.0);
    assert_eq!(
        wide.check(&inputs, Default::default())
            .unwrap_err()
            .to_string(),
        "argument `dweight`: expected 21 elements for shape [V=7, H=3], got 22"
    );
    let with_bias = LinearGrads {
        dbias: Some(vec![0.0; 7]),
        ..good
    };
    assert_eq!(
        with_bias
            .check(&inputs, Default::default())
            .unwrap_err()
            .to_string(),
        "argument `dbias`: must be present exactly when the head has a bias"
    );
}

//! The oracle checked against central finite differences in f64: `dlogits` of the
//! reference equals `(L(z + h e_k) - L(z - h e_k)) / 2h` for every logit `k`.
//! (cispo and vespo detach their coefficients, and an absent old policy detaches the
//! ratio's denominator, so finite differences of L do not see what autograd sees;
//! those are checked through the dual-number path only.)

mod common;
use common::*;
use flashloss::policy::Normalizers;
use flashloss::reference::grpo_reference;
use flashloss::{GrpoLoss, LossType};
use flashloss_tools::inputs::{GrpoInputs, InputSpec};

#[test]
fn reference_gradients_match_central_differences() {
    let spec = InputSpec {
        batch: 2,
        seq_len: 4,
        vocab: 7,
        masked_fraction: 0.2,
        sampler_ratio: true,
        ..InputSpec::default()
    };
    let mut checked = 0;
    for (t, level) in valid_types() {
        if matches!(t, LossType::Cispo | LossType::Vespo) {
            continue;
        }
        for (beta, bias, temperature, ent, delta) in [
            (0.0, false, 1.0, 0.0, None),
            (0.04, false, 0.7, 0.02, None),
            (0.1, true, 1.3, 0.0, Some(1.3)),
        ] {
            let mut cfg = base_config(t, level);
            cfg.beta = beta;
            cfg.use_bias_correction_kl = bias;
            cfg.temperature = temperature;
            cfg.entropy_coef = ent;
            if t.is_clipped() {
                cfg.delta = delta;
            }
            let loss = GrpoLoss::new(cfg).unwrap();
            for seed in 0..3 {
                let inputs = GrpoInputs::random(&spec, seed);
                let batch = inputs.batch();
                let norm = Normalizers::local(&batch);
                let z: Vec<f64> = inputs.logits.iter().map(|&x| x as f64).collect();
                let r = grpo_reference(&loss, &batch, norm, &z, spec.vocab, 1.0);
                let max = r.dlogits.iter().fold(0.0f64, |m, x| m.max(x.abs()));
                let h = 1e-6;
                for k in 0..z.len() {
                    let mut zp = z.clone();
                    zp[k] += h;
                    let mut zm = z.clone();
                    zm[k] -= h;
                    let lp = grpo_reference(&loss, &batch, norm, &zp, spec.vocab, 1.0).loss;
                    let lm = grpo_reference(&loss, &batch, norm, &zm, spec.vocab, 1.0).loss;
                    let fd = (lp - lm) / (2.0 * h);
                    assert!(
                        (fd - r.dlogits[k]).abs() <= 1e-6 * max.max(1e-3),
                        "{} {level:?} seed {seed} logit {k}: fd {fd} vs reference {}",
                        t.name(),
                        r.dlogits[k]
                    );
                    checked += 1;
                }
            }
        }
    }
    assert!(checked > 5000, "checked {checked}");
}

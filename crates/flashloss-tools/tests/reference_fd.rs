//! The oracle checked against central finite differences in f64: `dlogits` of the
//! reference equals `(L(z + h e_k) - L(z - h e_k)) / 2h` for every logit `k`.
//! (cispo and vespo detach their coefficients, and an absent old policy detaches the
//! ratio's denominator, so finite differences of L do not see what autograd sees;
//! those are checked through the dual-number path only.)

use crate::common;
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

/// The log-prob reference's `dlogits` (logp, entropy, lse and candidates with repeats and
/// the target among them) against central differences of its own outputs.
#[test]
fn logp_reference_gradients_match_central_differences() {
    use flashloss::reference::{LogpRefRows, LogpRefUpstream, logp_reference};
    let (n, v, k) = (3, 6, 4);
    let z: Vec<f64> = (0..n * v)
        .map(|i| ((i * 7 % 13) as f64 - 6.0) * 0.4)
        .collect();
    let targets = [1i64, 5, 0];
    let live = [true, false, true];
    let ids = [1i64, 1, 3, 0, 9, 9, 9, 9, 5, 0, 0, 2];
    let rows = LogpRefRows {
        targets: &targets,
        live: &live,
        temperature: 0.8,
        gather_ids: &ids,
        k,
    };
    let (g_logp, g_h, g_lse) = (
        [0.3f32, 1.0, -0.4],
        [0.2f32, 1.0, 0.5],
        [-0.6f32, 1.0, 0.25],
    );
    let g_gathered: Vec<f32> = (0..n * k).map(|i| 0.1 * i as f32 - 0.5).collect();
    let up = LogpRefUpstream {
        logp: &g_logp,
        entropy: &g_h,
        lse: &g_lse,
        gathered: &g_gathered,
        grad_output: 0.75,
    };
    let f = |z: &[f64]| {
        let r = logp_reference(z, v, rows, LogpRefUpstream::default());
        let per_row: f64 = (0..n)
            .map(|i| {
                g_logp[i] as f64 * r.logp[i]
                    + g_h[i] as f64 * r.entropy[i]
                    + g_lse[i] as f64 * r.lse[i]
            })
            .sum();
        let gathered: f64 = (r.gathered.iter().zip(&g_gathered))
            .map(|(x, &c)| x * c as f64)
            .sum();
        0.75 * (per_row + gathered)
    };
    let r = logp_reference(&z, v, rows, up);
    for at in 0..n * v {
        let (mut hi, mut lo) = (z.clone(), z.clone());
        hi[at] += 1e-6;
        lo[at] -= 1e-6;
        let fd = (f(&hi) - f(&lo)) / 2e-6;
        assert!(
            (r.dlogits[at] - fd).abs() <= 1e-7 * fd.abs().max(1.0),
            "dlogits[{at}]: {} vs {fd}",
            r.dlogits[at]
        );
    }
    // Σπ² and the max logit of row 0, written out.
    let s: Vec<f64> = z[..v].iter().map(|x| x / 0.8).collect();
    let m = s.iter().cloned().fold(f64::MIN, f64::max);
    let sum: f64 = s.iter().map(|x| (x - m).exp()).sum();
    let p2: f64 = s.iter().map(|x| ((x - m).exp() / sum).powi(2)).sum();
    assert!((r.sum_p2[0] - p2).abs() <= 1e-14 && r.max_logit[0] == m);
    assert_eq!((r.logp[1], r.sum_p2[1], r.dlogits[v]), (0.0, 0.0, 0.0));
}

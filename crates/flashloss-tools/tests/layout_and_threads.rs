//! Strided layouts, in-place backward, thread-count invariance (identical bits), and
//! the selective log-softmax and unfused baseline against the reference.

use crate::common;
use common::*;
use flashloss::cpu::{grpo_logits_forward, grpo_logits_unfused, selective_log_softmax};
use flashloss::policy::Normalizers;
use flashloss::reference::{grpo_reference, row_softmax};
use flashloss::{GrpoLoss, ImportanceSamplingLevel, LogitsLayout, LossType};
use flashloss_tools::inputs::GrpoInputs;

fn loss(t: LossType, level: ImportanceSamplingLevel) -> GrpoLoss {
    let mut cfg = base_config(t, level);
    cfg.beta = 0.04;
    cfg.entropy_coef = 0.01;
    cfg.temperature = 0.8;
    GrpoLoss::new(cfg).unwrap()
}

/// Forward + backward under a pool of `threads`: (loss bits, per-row stat bits, dlogits bits).
fn run_bits(threads: usize, l: &GrpoLoss, x: &GrpoInputs) -> (u64, Vec<u32>, Vec<u32>) {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    pool.install(|| {
        let layout = LogitsLayout::contiguous(x.data.batch, x.data.seq_len, x.vocab);
        let f = grpo_logits_forward(l, &x.batch(), &x.logits, &layout).unwrap();
        let mut d = vec![f32::NAN; x.logits.len()];
        f.backward(&x.logits, 1.0, &mut d).unwrap();
        let stats = f
            .stats
            .iter()
            .flat_map(|s| [s.logp.to_bits(), s.lse.to_bits(), s.entropy.to_bits()])
            .collect();
        (
            f.loss.to_bits(),
            stats,
            d.iter().map(|v| v.to_bits()).collect(),
        )
    })
}

#[test]
fn results_are_bitwise_identical_for_any_thread_count() {
    let x = draw(3, 41, 10007, 3);
    for (t, level) in [
        (LossType::Grpo, ImportanceSamplingLevel::Token),
        (LossType::Dapo, ImportanceSamplingLevel::Sequence),
        (LossType::Vespo, ImportanceSamplingLevel::Token),
    ] {
        let l = loss(t, level);
        let one = run_bits(1, &l, &x);
        assert_eq!(one, run_bits(2, &l, &x), "{} 1 vs 2 threads", t.name());
        assert_eq!(one, run_bits(8, &l, &x), "{} 1 vs 8 threads", t.name());
    }
}

#[test]
fn strided_model_output_needs_no_copy_and_in_place_keeps_the_gaps() {
    // A [B, T+1, V] model output of which the first T positions are the completion.
    let (b, t, v) = (3, 6, 2311);
    let x = draw(b, t, v, 4);
    let layout = LogitsLayout {
        batch: b,
        seq_len: t,
        vocab: v,
        row_stride: v,
        seq_stride: (t + 1) * v,
    };
    let mut strided = vec![123.0f32; b * (t + 1) * v];
    for row in 0..b * t {
        let off = layout.offset(row);
        strided[off..off + v].copy_from_slice(&x.logits[row * v..(row + 1) * v]);
    }
    for (lt, level) in valid_types() {
        let l = loss(lt, level);
        let dense = LogitsLayout::contiguous(b, t, v);
        let fd = grpo_logits_forward(&l, &x.batch(), &x.logits, &dense).unwrap();
        let fs = grpo_logits_forward(&l, &x.batch(), &strided, &layout).unwrap();
        assert_eq!(fd.loss.to_bits(), fs.loss.to_bits(), "{}", lt.name());
        assert_eq!(fd.stats, fs.stats);
        let mut dd = vec![f32::NAN; b * t * v];
        fd.backward(&x.logits, 1.0, &mut dd).unwrap();
        let mut ds = vec![f32::NAN; b * t * v];
        fs.backward(&strided, 1.0, &mut ds).unwrap();
        assert_eq!(dd, ds);
        let mut in_place = strided.clone();
        fs.backward_in_place(&mut in_place, 1.0).unwrap();
        for row in 0..b * t {
            let off = layout.offset(row);
            assert_eq!(&in_place[off..off + v], &dd[row * v..(row + 1) * v]);
        }
        for seq in 0..b {
            let gap = seq * (t + 1) * v + t * v;
            assert!(in_place[gap..gap + v].iter().all(|&z| z == 123.0));
        }
    }
}

#[test]
fn selective_log_softmax_matches_the_reference() {
    for temperature in [1.0, 0.6] {
        let x = draw(2, 5, 4097, 8);
        let layout = LogitsLayout::contiguous(2, 5, 4097);
        let stats = selective_log_softmax(
            &x.logits,
            &layout,
            &x.data.target_ids,
            None,
            flashloss::Temperature::new(temperature).unwrap(),
        )
        .unwrap();
        for (i, st) in stats.iter().enumerate() {
            let row: Vec<f64> = x.logits[i * 4097..(i + 1) * 4097]
                .iter()
                .map(|&z| z as f64)
                .collect();
            let r = row_softmax(&row, temperature);
            let logp = r.log_probs[x.data.target_ids[i] as usize];
            assert!((st.logp as f64 - logp).abs() <= 1e-5 * logp.abs().max(1.0));
            assert!((st.lse as f64 - r.lse).abs() <= 1e-5 * r.lse.abs().max(1.0));
            assert!((st.entropy as f64 - r.entropy).abs() <= 1e-5 * r.entropy.max(1.0));
        }
    }
}

#[test]
fn unfused_baseline_matches_the_reference() {
    let x = draw(3, 7, 3001, 12);
    for (lt, level) in valid_types() {
        let l = loss(lt, level);
        let batch = x.batch();
        let layout = LogitsLayout::contiguous(3, 7, 3001);
        let (value, d) = grpo_logits_unfused(&l, &batch, &x.logits, &layout, 1.0).unwrap();
        let z: Vec<f64> = x.logits.iter().map(|&v| v as f64).collect();
        let r = grpo_reference(&l, &batch, Normalizers::local(&batch), &z, 3001, 1.0);
        assert!(
            (value - r.loss).abs() <= 1e-5 * r.loss.abs().max(1.0),
            "{}",
            lt.name()
        );
        let max = r.dlogits.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        let err = d
            .iter()
            .zip(&r.dlogits)
            .fold(0.0f64, |m, (a, b)| m.max((*a as f64 - b).abs()));
        assert!(err <= 1e-4 * max, "{}: {err} vs max {max}", lt.name());
    }
}

/// The one-`exp` kernel (exponentials staged in `dlogits`): the same forward bits as
/// the two-`exp` kernel, the gradient within f32 rounding of it and of the f64
/// reference, with and without an entropy term, and identical bits for any thread count.
#[test]
fn staged_one_exp_kernel_matches_and_is_thread_invariant() {
    use flashloss::cpu::grpo_logits_forward_staged;
    let x = draw(3, 41, 10007, 5);
    let layout = LogitsLayout::contiguous(x.data.batch, x.data.seq_len, x.vocab);
    for entropy_coef in [0.0, 0.01] {
        let mut cfg = base_config(LossType::Grpo, ImportanceSamplingLevel::Token);
        cfg.beta = 0.04;
        cfg.entropy_coef = entropy_coef;
        cfg.temperature = 0.8;
        let l = GrpoLoss::new(cfg).unwrap();
        let staged = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                let mut d = vec![f32::NAN; x.logits.len()];
                let f =
                    grpo_logits_forward_staged(&l, &x.batch(), &x.logits, &layout, &mut d).unwrap();
                f.backward(&x.logits, 0.5, &mut d).unwrap();
                (f.forward, d)
            })
        };
        let (f, d) = staged(2);
        let plain = grpo_logits_forward(&l, &x.batch(), &x.logits, &layout).unwrap();
        assert_eq!(f.loss.to_bits(), plain.loss.to_bits());
        let mut want = vec![0.0f32; x.logits.len()];
        plain.backward(&x.logits, 0.5, &mut want).unwrap();
        let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let err = d
            .iter()
            .zip(&want)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            err <= 1e-6 * scale,
            "entropy {entropy_coef}: {err} of {scale}"
        );
        let z: Vec<f64> = x.logits.iter().map(|&v| v as f64).collect();
        let r = grpo_reference(
            &l,
            &x.batch(),
            Normalizers::local(&x.batch()),
            &z,
            x.vocab,
            0.5,
        );
        assert_close("staged dlogits", &d, &r.dlogits, 1e-4);
        for threads in [1, 8] {
            let (f2, d2) = staged(threads);
            assert_eq!(f.loss.to_bits(), f2.loss.to_bits());
            assert!(d.iter().zip(&d2).all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }
}

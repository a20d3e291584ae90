//! The fused LM-head kernels (GRPO, cross-entropy and log-probs: `logprobs_gates`)
//! against the reference: loss, logp (and entropy for GRPO), dH, dW, dbias (a frozen
//! head: dH, and no dW or dbias).

use super::case::{LinearCase, ObjectiveRun, ce_targets, mode_name};
use super::config::{GradcheckConfig, Objective};
use super::logprobs_gates::check_logprobs;
use super::report::{
    Gate, GradcheckReport, grad_gate, grad_gate_scaled, implied_loss, loss_gate, max_abs, worst_rel,
};
use crate::Result;
use crate::inputs::HeadInputs;
use flashloss::batch::LinearInputs;
use flashloss::device::{CeCall, GrpoCall};
use flashloss::policy::{Normalizers, reduction_weight_sum};
use flashloss::reference::{ce_reference, grpo_reference, linear_grads};
use flashloss::{Bf16Products, CrossEntropy, Element, GrpoLoss};
use std::time::Instant;

/// The fused LM-head kernel (GRPO, CE or log-probs) vs the reference on a random head
/// of shape `[N = B·T, H] × [V, H]`: the objective's own gates, then dH, dW, dbias. The
/// gradient buffers start as NaN-free zeros (the kernel adds into them). A `nan` or
/// `perturb` fault on rank 0 hits the kernel's copy of the hidden states.
pub(super) fn check_linear<E: Element>(cfg: &GradcheckConfig) -> Result<GradcheckReport> {
    let case = LinearCase::<E>::new(cfg)?;
    let inputs = case.head.inputs();
    let faulty = case.faulty_head(cfg, 0);
    let kernel_inputs = faulty.as_ref().map_or(inputs, HeadInputs::inputs);
    let start = Instant::now();
    let run = match cfg.objective {
        Objective::Grpo => check_grpo(cfg, &case, &kernel_inputs)?,
        Objective::Ce => check_ce(cfg, &case, &kernel_inputs)?,
        Objective::Logprobs => check_logprobs(cfg, &case, &kernel_inputs)?,
    };
    let kernel_seconds = start.elapsed().as_secs_f64();
    let tol = cfg.tolerance.resolved(E::DTYPE);
    let mut gates = run.gates;
    let (dh, dw, db) = linear_grads(&inputs, &run.dlogits_ref);
    let bf16_products = run.plan.and_then(|p| p.bf16_products);
    let (scale_dh, scale_dw) = match bf16_products {
        Some(Bf16Products::Avx512Bf16) => rounded_dz_scales(&inputs, &run.dlogits_ref),
        _ => (max_abs(&dh), max_abs(&dw)),
    };
    let grads = &run.grads;
    let f64s = |x: &[f32]| x.iter().map(|&v| v as f64).collect::<Vec<_>>();
    gates.push(grad_gate_scaled(
        "dhidden",
        f64s(&grads.dhidden).into_iter(),
        &dh,
        scale_dh,
        &tol,
        1.0,
    ));
    if !cfg.head_grad.has_dweight() {
        // A frozen head: the entries of dW and dbias that came back (none).
        let returned = grads.dweight.len() + grads.dbias.as_ref().map_or(0, Vec::len);
        gates.push(Gate::new("frozen_head_grads", returned as f64, 0.0));
    } else {
        gates.push(grad_gate_scaled(
            "dweight",
            f64s(&grads.dweight).into_iter(),
            &dw,
            scale_dw,
            &tol,
            run.summed_rows,
        ));
        if let Some(got) = &grads.dbias {
            gates.push(grad_gate(
                "dbias",
                f64s(got).into_iter(),
                &db,
                &tol,
                run.summed_rows,
            ));
        }
    }
    let mut report = GradcheckReport::new(run.name, run.loss, run.metrics, kernel_seconds, gates);
    if bf16_products.is_some() {
        report.bf16_choice = Some(flashloss::cpu::bf16_products_choice(cfg.bf16_products)?);
    }
    Ok(report)
}

/// GRPO: loss (with the slack of the reference's loss on the kernel's statistics),
/// logp, entropy.
fn check_grpo<E: Element>(
    cfg: &GradcheckConfig,
    case: &LinearCase<E>,
    inputs: &LinearInputs<E>,
) -> Result<ObjectiveRun> {
    let n = cfg.batch * cfg.seq_len;
    let tol = cfg.tolerance.resolved(E::DTYPE);
    let loss = GrpoLoss::new(cfg.loss.clone())?;
    let batch = case.tokens.batch();
    let norm = Normalizers::local(&batch);
    let out = cfg
        .device
        .open()?
        .with_host_grads(inputs, GrpoCall::new(&loss, &batch, &case.opts))?;
    let r = grpo_reference(&loss, &batch, norm, &case.z, cfg.vocab, cfg.grad_output);
    // Under a truncated support the tokens outside it are masked (spec, addition 13).
    let live: Vec<usize> = (0..n).filter(|&i| batch.mask[i] && !r.outside[i]).collect();
    let implied = implied_loss(&loss, &batch, norm, &out.stats);
    let mut gates = vec![
        loss_gate(
            (r.loss, out.loss),
            implied,
            tol.loss_rel.unwrap_or_default(),
        ),
        Gate::new(
            "logp",
            worst_rel(live.iter().map(|&i| (out.stats[i].logp, r.logp[i]))),
            tol.logp_rel.unwrap_or_default(),
        ),
        Gate::new(
            "entropy",
            worst_rel(live.iter().map(|&i| (out.stats[i].entropy, r.entropy[i]))),
            tol.logp_rel.unwrap_or_default(),
        ),
    ];
    if loss.support().is_some() {
        let outside = out.support.as_ref().map(|s| &s.outside);
        let differ = (0..n).filter(|&i| outside.is_none_or(|o| o[i] != r.outside[i]));
        gates.push(Gate::new("support_outside", differ.count() as f64, 0.0));
    }
    Ok(ObjectiveRun {
        name: format!("linear grpo {:?} {}", E::DTYPE, mode_name(&out.plan)),
        loss: (r.loss, out.loss),
        metrics: Some((r.metrics, out.metrics)),
        gates,
        dlogits_ref: r.dlogits,
        summed_rows: reduction_weight_sum(&loss, &batch, norm) * cfg.grad_output.abs(),
        grads: out.grads,
        plan: Some(out.plan),
    })
}

/// Cross-entropy: loss (no slack: each row's `-logp` plus its options, weighted), logp.
fn check_ce<E: Element>(
    cfg: &GradcheckConfig,
    case: &LinearCase<E>,
    inputs: &LinearInputs<E>,
) -> Result<ObjectiveRun> {
    let n = cfg.batch * cfg.seq_len;
    let tol = cfg.tolerance.resolved(E::DTYPE);
    let ce = CrossEntropy::new(cfg.ce.clone())?;
    let targets = ce_targets(&case.tokens, &ce);
    let device = cfg.device.open()?;
    let out = device.with_host_grads(inputs, CeCall::new(&ce, &targets, &case.opts))?;
    let r = ce_reference(&ce, &targets, &case.z, cfg.vocab, cfg.grad_output, None);
    let live: Vec<usize> = (0..n).filter(|&i| ce.counts(targets[i])).collect();
    let gates = vec![
        loss_gate((r.loss, out.loss), r.loss, tol.loss_rel.unwrap_or_default()),
        Gate::new(
            "logp",
            worst_rel(live.iter().map(|&i| (out.stats[i].logp, r.logp[i]))),
            tol.logp_rel.unwrap_or_default(),
        ),
    ];
    Ok(ObjectiveRun {
        name: format!("linear ce {:?} {}", E::DTYPE, mode_name(&out.plan)),
        loss: (r.loss, out.loss),
        metrics: None,
        gates,
        dlogits_ref: r.dlogits,
        summed_rows: ce.reduction_weight_sum(&targets) * cfg.grad_output.abs(),
        grads: out.grads,
        plan: Some(out.plan),
    })
}

/// The scales of the dH and dW gates under bf16 products, which round `dZ` to bf16:
/// the rounding error is bounded entrywise by `2^-9·(|dZ|·|W|)` and `2^-9·(|dZ|ᵀ·|H|)`,
/// so the gates are relative to `max(|dZ|·|W|)` and `max(|dZ|ᵀ·|H|)`. They equal
/// `max|dH|` and `max|dW|` where a row's terms do not cancel; where they do (a
/// vocabulary of 2, `dZ = [a, -a]`), the error is that of the terms, not of their
/// difference (docs/spec/losses.md, flashloss addition 4).
fn rounded_dz_scales<E: Element>(inputs: &LinearInputs<E>, dlogits: &[f64]) -> (f64, f64) {
    let abs = |x: &[E]| -> Vec<E> { x.iter().map(|v| E::from_f32(v.to_f32().abs())).collect() };
    let (hidden, weight) = (abs(inputs.hidden), abs(inputs.weight));
    let abs_inputs = LinearInputs {
        hidden: &hidden,
        weight: &weight,
        layout: flashloss::WeightLayout::VocabMajor,
        bias: None,
        ..*inputs
    };
    let dz: Vec<f64> = dlogits.iter().map(|x| x.abs()).collect();
    let (dh, dw, _) = linear_grads(&abs_inputs, &dz);
    (max_abs(&dh), max_abs(&dw))
}

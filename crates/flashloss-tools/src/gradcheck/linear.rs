//! The fused LM-head kernels (GRPO and cross-entropy) against the reference: loss,
//! logp (and entropy for GRPO), dH, dW, dbias (a frozen head: dH, and no dW or dbias).

use super::config::{GradcheckConfig, Objective};
use super::report::{
    Gate, GradcheckReport, grad_gate, grad_gate_scaled, implied_loss, loss_gate, max_abs, worst_rel,
};
use crate::Result;
use crate::inputs::{GrpoInputs, HeadInputs};
use flashloss::batch::LinearInputs;
use flashloss::policy::{Normalizers, reduction_weight_sum};
use flashloss::reference::{ce_reference, grpo_reference, linear_grads, linear_logits};
use flashloss::{Bf16Products, CrossEntropy, Element, GrpoLoss};
use flashloss::{FusedOptions, LinearGrads, Plan};
use std::time::Instant;

/// The fused LM-head kernel (GRPO or CE) vs the reference on a random head of shape
/// `[N = B·T, H] × [V, H]`: loss, logp (and entropy for GRPO), dH, dW, dbias. The
/// gradient buffers start as NaN-free zeros (the kernel adds into them).
pub(super) fn check_linear<E: Element>(cfg: &GradcheckConfig) -> Result<GradcheckReport> {
    let (n, v) = (cfg.batch * cfg.seq_len, cfg.vocab);
    let LinearCase {
        head,
        tokens,
        z,
        opts,
    } = LinearCase::<E>::new(cfg)?;
    let inputs = head.inputs();
    let tol = cfg.tolerance.resolved(E::DTYPE);
    let device = cfg.device.open()?;
    let grads: LinearGrads;
    let plan: Plan;
    let start = Instant::now();
    let (name, loss_pair, metrics, mut gates, dlogits_ref, summed_rows) = match cfg.objective {
        Objective::Grpo => {
            let loss = GrpoLoss::new(cfg.loss.clone())?;
            let batch = tokens.batch();
            let norm = Normalizers::local(&batch);
            let mut out = device.grpo_linear(&loss, &batch, &inputs, &opts)?;
            grads = std::mem::replace(&mut out.grads, LinearGrads::empty());
            plan = out.plan;
            let r = grpo_reference(&loss, &batch, norm, &z, v, cfg.grad_output);
            let live: Vec<usize> = (0..n).filter(|&i| batch.mask[i]).collect();
            let implied = implied_loss(&loss, &batch, norm, &out.stats);
            let gates = vec![
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
            let name = format!("linear grpo {:?} {}", E::DTYPE, mode_name(&out.plan));
            let rows = reduction_weight_sum(&loss, &batch, norm) * cfg.grad_output.abs();
            (
                name,
                (r.loss, out.loss),
                Some((r.metrics, out.metrics)),
                gates,
                r.dlogits,
                rows,
            )
        }
        Objective::Ce => {
            let ce = CrossEntropy::new(cfg.ce.clone())?;
            let targets = ce_targets(&tokens, &ce);
            let mut out = device.ce_linear(&ce, &targets, None, &inputs, &opts)?;
            grads = std::mem::replace(&mut out.grads, LinearGrads::empty());
            plan = out.plan;
            let r = ce_reference(&ce, &targets, &z, v, cfg.grad_output, None);
            let live: Vec<usize> = (0..n).filter(|&i| ce.counts(targets[i])).collect();
            let gates = vec![
                // No slack: the CE loss is each row's `-logp` (plus its options), weighted.
                loss_gate((r.loss, out.loss), r.loss, tol.loss_rel.unwrap_or_default()),
                Gate::new(
                    "logp",
                    worst_rel(live.iter().map(|&i| (out.stats[i].logp, r.logp[i]))),
                    tol.logp_rel.unwrap_or_default(),
                ),
            ];
            let name = format!("linear ce {:?} {}", E::DTYPE, mode_name(&out.plan));
            let rows = ce.reduction_weight_sum(&targets) * cfg.grad_output.abs();
            (name, (r.loss, out.loss), None, gates, r.dlogits, rows)
        }
    };
    let kernel_seconds = start.elapsed().as_secs_f64();
    let (dh, dw, db) = linear_grads(&inputs, &dlogits_ref);
    let (scale_dh, scale_dw) = match plan.bf16_products {
        Some(Bf16Products::Avx512Bf16) => rounded_dz_scales(&inputs, &dlogits_ref),
        _ => (max_abs(&dh), max_abs(&dw)),
    };
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
        return Ok(GradcheckReport::new(
            name,
            loss_pair,
            metrics,
            kernel_seconds,
            gates,
        ));
    }
    gates.push(grad_gate_scaled(
        "dweight",
        f64s(&grads.dweight).into_iter(),
        &dw,
        scale_dw,
        &tol,
        summed_rows,
    ));
    if let Some(got) = &grads.dbias {
        gates.push(grad_gate(
            "dbias",
            f64s(got).into_iter(),
            &db,
            &tol,
            summed_rows,
        ));
    }
    Ok(GradcheckReport::new(
        name,
        loss_pair,
        metrics,
        kernel_seconds,
        gates,
    ))
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

/// The random inputs of a fused LM-head check: a head, per-token GRPO inputs whose old
/// and reference logp follow the head's policy, the head's f64 logits, the options.
pub(crate) struct LinearCase<E> {
    pub(crate) head: HeadInputs<E>,
    pub(crate) tokens: GrpoInputs,
    pub(crate) z: Vec<f64>,
    pub(crate) opts: FusedOptions,
}

impl<E: Element> LinearCase<E> {
    pub(crate) fn new(cfg: &GradcheckConfig) -> flashloss::Result<Self> {
        let (n, h, v) = (cfg.batch * cfg.seq_len, cfg.hidden, cfg.vocab);
        let head = HeadInputs::<E>::try_random(n, h, v, cfg.bias, cfg.seed)?;
        let mut tokens = GrpoInputs::try_random(&cfg.input_spec(), cfg.seed + 1)?;
        tokens.logits = Vec::new();
        let z = linear_logits(&head.inputs());
        tokens.follow_policy(&z, cfg.loss.temperature);
        let opts = FusedOptions {
            bf16_products: cfg.bf16_products,
            head_grad: cfg.head_grad,
            ..FusedOptions::from_mib(cfg.mode, cfg.budget_mib, cfg.grad_output as f32)
        };
        Ok(LinearCase {
            head,
            tokens,
            z,
            opts,
        })
    }
}

/// CE targets of GRPO inputs: the target ids, `ignore_index` at masked positions.
pub(crate) fn ce_targets(tokens: &GrpoInputs, ce: &CrossEntropy) -> Vec<i64> {
    let ignore = ce.config().ignore_index;
    let data = &tokens.data;
    (0..data.mask.len())
        .map(|i| {
            if data.mask[i] {
                data.target_ids[i]
            } else {
                ignore
            }
        })
        .collect()
}

fn mode_name(plan: &flashloss::Plan) -> &'static str {
    if plan.compact {
        "compact"
    } else if plan.single_pass {
        "single_pass"
    } else {
        "two_pass"
    }
}

//! The logits-level GRPO kernel against the reference: loss, logp, entropy, the policy
//! stage's `∂L/∂logp` and `∂L/∂H`, and `dlogits`.

use super::config::GradcheckConfig;
use super::report::{Gate, GradcheckReport, grad_gate, implied_loss, loss_gate, worst_rel};
use crate::Result;
use crate::inputs::GrpoInputs;
use flashloss::policy::Normalizers;
use flashloss::reference::{dense_f64, grpo_reference};
use flashloss::{Element, GrpoLoss, LogitsLayout};
use std::time::Instant;

/// Compares kernel and reference on given inputs (`logits` in the storage dtype,
/// dense `[B, T, V]`); `cfg` gives `grad_output`, `in_place` and the gates.
pub fn check_inputs<E: Element>(
    cfg: &GradcheckConfig,
    loss: &GrpoLoss,
    inputs: &GrpoInputs,
    mut logits: Vec<E>,
) -> Result<GradcheckReport> {
    let batch = inputs.batch();
    let layout = LogitsLayout::contiguous(batch.batch, batch.seq_len, inputs.vocab);
    batch.validate(layout.vocab, loss)?;
    let reference = grpo_reference(
        loss,
        &batch,
        Normalizers::local(&batch),
        &dense_f64(&logits, &layout),
        layout.vocab,
        cfg.grad_output,
    );

    let start = Instant::now();
    let device = cfg.device.open()?;
    let g = cfg.grad_output as f32;
    let (fwd, dlogits) = if cfg.in_place {
        let fwd = device.grpo_logits_in_place(loss, &batch, &mut logits, &layout, g)?;
        (fwd, logits)
    } else {
        let mut out = vec![E::from_f32(f32::NAN); layout.rows() * layout.vocab];
        let fwd = device.grpo_logits(loss, &batch, &logits, &layout, g, &mut out)?;
        (fwd, out)
    };
    let kernel_seconds = start.elapsed().as_secs_f64();

    let live: Vec<usize> = (0..layout.rows()).filter(|&i| batch.mask[i]).collect();
    let tol = cfg.tolerance.resolved(E::DTYPE);
    let logp_err = worst_rel(live.iter().map(|&i| (fwd.stats[i].logp, reference.logp[i])));
    let entropy_err = worst_rel(
        live.iter()
            .map(|&i| (fwd.stats[i].entropy, reference.entropy[i])),
    );
    let implied = implied_loss(loss, &batch, Normalizers::local(&batch), &fwd.stats);
    let gates = vec![
        loss_gate(
            (reference.loss, fwd.loss),
            implied,
            tol.loss_rel.unwrap_or_default(),
        ),
        Gate::new("logp", logp_err, tol.logp_rel.unwrap_or_default()),
        Gate::new("entropy", entropy_err, tol.logp_rel.unwrap_or_default()),
        grad_gate(
            "dlogp",
            fwd.dlogp().iter().map(|&x| x as f64),
            &reference.dlogp,
            &tol,
            1.0,
        ),
        grad_gate(
            "dentropy",
            fwd.dentropy().iter().map(|&x| x as f64),
            &reference.dentropy,
            &tol,
            1.0,
        ),
        grad_gate(
            "dlogits",
            dlogits.iter().map(|x| x.to_f32() as f64),
            &reference.dlogits,
            &tol,
            1.0,
        ),
    ];
    Ok(GradcheckReport::new(
        format!("logits grpo {:?}", E::DTYPE),
        (reference.loss, fwd.loss),
        Some((reference.metrics, fwd.metrics)),
        kernel_seconds,
        gates,
    ))
}

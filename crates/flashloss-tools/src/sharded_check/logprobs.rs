//! Objective `logprobs` sharded: the single-rank call on the whole case, and a rank's
//! call (`logp_linear_grads_sharded_with`) on its token group's rows and vocabulary
//! shard, whose outputs are gated against the single-rank run's on its rows (the
//! objective over those rows, every statistic, the support's outputs; f32 rounding).

use super::rank::SHARDED_REL;
use crate::gradcheck::{Gate, GradcheckConfig, LinearCase, Outputs, output_gates};
use crate::inputs::HeadInputs;
use flashloss::device::LogpCall;
use flashloss::{Element, Grid, HeadArgs, LinearGrads, Result, Shard};
use std::ops::Range;

/// The single-rank run of the whole case: its outputs and gradients.
pub(super) fn one_rank<E: Element>(
    cfg: &GradcheckConfig,
    case: &LinearCase<E>,
) -> Result<(Outputs, LinearGrads)> {
    let lp = case
        .logprobs
        .as_ref()
        .expect("objective logprobs has its case");
    let inputs = case.head.inputs();
    let mut grads = LinearGrads::zeros_for(&inputs, cfg.head_grad);
    let (rows, request, upstream) = lp.call(0..lp.live.len());
    let head = HeadArgs::Host {
        inputs: &inputs,
        grads: grads.view(),
    };
    let device = cfg.device.open()?;
    let out = device.logprobs(
        head,
        LogpCall::grads(rows, upstream, &case.opts, cfg.seq_len).request(&request),
    )?;
    Ok((Outputs::of(&out), grads))
}

/// This rank's call on `head` (rows `rows` of the case, the vocabulary of `shard`):
/// the single-rank objective over those rows and this rank's, the output gates against
/// `one`, and this rank's gradients.
pub(super) fn rank_step<E: Element>(
    cfg: &GradcheckConfig,
    case: &LinearCase<E>,
    (grid, shard, rows): (&Grid, Shard, Range<usize>),
    head: &HeadInputs<E>,
    one: &Outputs,
) -> Result<((f64, f64), Vec<Gate>, LinearGrads)> {
    let lp = case
        .logprobs
        .as_ref()
        .expect("objective logprobs has its case");
    let inputs = head.inputs();
    let mut grads = LinearGrads::zeros_for(&inputs, cfg.head_grad);
    let (call_rows, request, upstream) = lp.call(rows.clone());
    let args = HeadArgs::Host {
        inputs: &inputs,
        grads: grads.view(),
    };
    let device = cfg.device.open()?;
    let out = device.logprobs(
        args,
        LogpCall::grads(call_rows, upstream, &case.opts, cfg.seq_len)
            .request(&request)
            .sharded(grid, shard),
    )?;
    let got = Outputs::of(&out);
    let g = cfg.grad_output;
    let want = one.slice(rows.clone(), lp.k);
    let loss = (
        lp.objective(&want, rows.start, g).0,
        lp.objective(&got, rows.start, g).0,
    );
    let gates = output_gates(lp, (&got, one), rows.start, (SHARDED_REL, SHARDED_REL), g);
    Ok((loss, gates, grads))
}

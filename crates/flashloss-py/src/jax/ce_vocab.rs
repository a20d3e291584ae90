//! The handlers of cross-entropy over a vocabulary-split head (`vocab_axis` of
//! `linear_cross_entropy` inside `jax.shard_map`), cut at the collectives as the GRPO
//! step is ([`super::vocab`]): `flashloss_ce_vocab_partial` is pass A on the device's
//! block (per-row max, `Σexp`, `Σexp·s`, the target's logit, `Σ s` for label
//! smoothing, under the loss's soft-cap and temperature); JAX merges them over the axis;
//! `flashloss_ce_vocab_grads` is the row stage (loss, per-row losses) and pass B on the
//! block from the merged statistics.

use super::ffi::CallFrame;
use super::frame::{Frame, Named, Result, bad, handle};
use super::handlers::{by_dtype, ce_upstream, grads, head, options, weight_layout};
use super::vocab::{merged_stats, offset_of};
use crate::device::cpu;
use flashloss::rows::RowStats;
use flashloss::{CeConfig, CrossEntropy, HeadArgs, LinearInputs, Shard};
use std::ffi::c_void;

/// The loss (spec field `config`, a `CeConfig`) and the block's place: argument
/// `offset` (one int) and spec field `vocab` (the whole vocabulary's size).
fn loss_and_shard(f: &Frame, offset: &Named) -> Result<(CrossEntropy, Shard)> {
    let ce = CrossEntropy::new(f.spec()?.config::<CeConfig>()?)?;
    let offset = offset_of(offset)?;
    let vocab = f.spec()?.i64("vocab")?;
    if vocab < 1 {
        return Err(bad("vocab", format!("must be >= 1, got {vocab}")));
    }
    let vocab = vocab as usize;
    Ok((ce, Shard { offset, vocab }))
}

/// Pass A. Arguments: hidden `[N, H]`, weight (block), bias (block or `[0]`), targets
/// `[N]` (ids of the whole vocabulary), offset; spec fields: budget_mib, config, mode,
/// vocab, weight_layout. Results `[N]` each: max, sum, weighted, target logit, logit sum.
unsafe extern "C" fn ce_vocab_partial(frame: *mut CallFrame) -> *mut c_void {
    // SAFETY: XLA's frame.
    unsafe {
        handle(frame, |f| {
            let (x, w, b) = (f.arg(0, "hidden")?, f.arg(1, "weight")?, f.arg(2, "bias")?);
            let layout = weight_layout(f)?;
            let targets = f.arg(3, "targets")?.ids()?;
            let (ce, shard) = loss_and_shard(f, &f.arg(4, "offset")?)?;
            let opts = options(f)?;
            let part = by_dtype!(x, E, code => {
                let inputs: LinearInputs<E> = head((&x, &w, &b), layout, code)?;
                Ok(cpu().ce_partial_row_states(HeadArgs::host(&inputs), shard, &ce, &targets, &opts)?)
            })?;
            let names = ["max", "sum", "weighted", "target_logit", "logit_sum"];
            let mut outs = Vec::with_capacity(names.len());
            for (k, name) in names.into_iter().enumerate() {
                outs.push(f.ret(k, name)?.f32s_mut()?);
            }
            for (i, st) in part.states.iter().enumerate() {
                let row = [
                    st.max,
                    st.sum as f32,
                    st.weighted as f32,
                    part.target_logits[i],
                    part.sums[i] as f32,
                ];
                for (o, v) in outs.iter_mut().zip(row) {
                    o[i] = v;
                }
            }
            Ok(())
        })
    }
}

/// The row stage and pass B. Arguments: hidden, weight (block), bias, targets `[N]`,
/// offset, the merged max, log_sum, entropy, logp, mean_logit (`[N]` each), grad_rows
/// (`[N]` for reduction none, `[0]` otherwise), grad_lse (`[N]`: the upstream gradient
/// of each row's log-sum-exp, `∂lse/∂s_j = p_j`; `[0]` for none); spec fields:
/// budget_mib, config, mode, vocab, weight_layout, head_grad, grad_output. Results:
/// loss, row_loss `[N]`, dhidden (the block's part), dweight (the weight's shape), dbias
/// (the block's; both `[0]` for a frozen head): the gradients of
/// `grad_output·L + Σ_i grad_lse_i·lse_i`.
unsafe extern "C" fn ce_vocab_grads(frame: *mut CallFrame) -> *mut c_void {
    // SAFETY: XLA's frame.
    unsafe {
        handle(frame, |f| {
            let (x, w, b) = (f.arg(0, "hidden")?, f.arg(1, "weight")?, f.arg(2, "bias")?);
            let layout = weight_layout(f)?;
            let targets = f.arg(3, "targets")?.ids()?;
            let (ce, shard) = loss_and_shard(f, &f.arg(4, "offset")?)?;
            let opts = options(f)?;
            let inv_temp = (1.0 / ce.config().temperature) as f32;
            let n = targets.len();
            let names = ["max", "log_sum", "entropy", "logp", "mean_logit"];
            let mut cols = Vec::with_capacity(names.len());
            for (k, name) in names.into_iter().enumerate() {
                let a = f.arg(5 + k, name)?;
                a.expect_dims(&[n])?;
                cols.push(a.f32s()?);
            }
            let stats = (0..n)
                .map(|i| RowStats {
                    logp: cols[3][i],
                    mean_logit: cols[4][i],
                    ..merged_stats(cols[0][i], cols[1][i], cols[2][i], inv_temp)
                })
                .collect();
            let upstream = ce_upstream(f, 10, n)?;
            let out = by_dtype!(x, E, code => {
                let inputs: LinearInputs<E> = head((&x, &w, &b), layout, code)?;
                let args = HeadArgs::Host { inputs: &inputs, grads: grads(f, 2)? };
                Ok(cpu().ce_accumulate_row_grads(args, shard, &ce, &targets, stats, upstream, &opts)?)
            })?;
            f.ret(0, "loss")?.f32s_mut()?[0] = out.loss as f32;
            f.ret(1, "row_loss")?
                .f32s_mut()?
                .copy_from_slice(&out.row_loss);
            Ok(())
        })
    }
}

/// The handlers by target name.
pub fn targets() -> Vec<(&'static str, super::ffi::Handler)> {
    vec![
        ("flashloss_ce_vocab_partial", ce_vocab_partial),
        ("flashloss_ce_vocab_grads", ce_vocab_grads),
    ]
}

//! The handlers of a GRPO step over a vocabulary-split head (`vocab_axis` inside
//! `jax.shard_map`): the step is cut at the collectives, which JAX runs between the
//! calls. `flashloss_vocab_partial` is pass A on the device's shard (per-row max, `Σexp`,
//! `Σexp·s`, the target's raw logit); JAX merges them with `lax.pmax`/`psum`;
//! `flashloss_grpo_policy` is the O(N) policy stage on the merged statistics;
//! `flashloss_vocab_grads` is pass B on the shard from the merged statistics and the
//! policy's coefficients (dH is then summed over the axis by JAX).

use super::ffi::CallFrame;
use super::frame::{Frame, Named, Result, bad, handle};
use super::handlers::{Tokens, by_dtype, grads, head, options, vocab_hidden, weight_layout};
use crate::device::cpu;
use flashloss::fused::{FusedOptions, RowGrad};
use flashloss::policy::{Normalizers, policy_stage};
use flashloss::range::check_policy_rows;
use flashloss::rows::{RowInputs, RowStats, RowTransform};
use flashloss::sharding::local_ids;
use flashloss::{GrpoLoss, HeadArgs, LinearInputs, Temperature, WeightLayout};
use std::ffi::c_void;
use std::ops::Range;

/// The first vocabulary id of a device's block: argument `offset` (one int).
pub(super) fn offset_of(offset: &Named) -> Result<usize> {
    let o = offset.ids()?;
    match o.as_slice() {
        [o] if *o >= 0 => Ok(*o as usize),
        _ => Err(bad(
            "offset",
            format!("expected one non-negative id, got {o:?}"),
        )),
    }
}

/// A row's statistics over the whole vocabulary from its merged max and `log Σexp`
/// (`lse = max·inv_temp + log Σexp`) and entropy; the other fields zero.
pub(super) fn merged_stats(max: f32, log_sum: f32, entropy: f32, inv_temp: f32) -> RowStats {
    RowStats {
        max,
        log_sum,
        lse: (max as f64 * inv_temp as f64 + log_sum as f64) as f32,
        entropy,
        ..RowStats::default()
    }
}

/// The arguments both passes share: hidden, weight (shard), bias, ids `[N]`, mask
/// `[N]`, offset, and the spec fields budget_mib, mode, temperature, weight_layout.
struct ShardCall<'a> {
    x: Named<'a>,
    w: Named<'a>,
    b: Named<'a>,
    layout: WeightLayout,
    ids: Vec<i64>,
    live: Vec<bool>,
    range: Range<usize>,
    targets: Vec<i64>,
    transform: RowTransform,
    opts: FusedOptions,
}

impl<'a> ShardCall<'a> {
    /// The arguments, with the options `opts_of` reads (pass B's: with `head_grad`).
    fn read(f: &Frame<'a>, opts_of: fn(&Frame) -> Result<FusedOptions>) -> Result<Self> {
        let t = Temperature::new(f.spec()?.f64("temperature")?)?;
        let (x, w, b) = (f.arg(0, "hidden")?, f.arg(1, "weight")?, f.arg(2, "bias")?);
        let (ids, live) = (f.arg(3, "ids")?.ids()?, f.arg(4, "mask")?.bools()?);
        let start = offset_of(&f.arg(5, "offset")?)?;
        let layout = weight_layout(f)?;
        let range = start..start + vocab_hidden(&x, &w, layout)?.0;
        let targets = local_ids(&ids, &range);
        let (transform, opts) = (RowTransform::with_temperature(t), opts_of(f)?);
        Ok(ShardCall {
            x,
            w,
            b,
            layout,
            ids,
            live,
            range,
            targets,
            transform,
            opts,
        })
    }

    /// The rows of a pass: targets local to the shard.
    fn rows(&self) -> RowInputs<'_> {
        RowInputs {
            targets: &self.targets,
            live: &self.live,
            transform: self.transform,
        }
    }
}

/// Pass A. Arguments: hidden, weight (shard), bias (shard or `[0]`), ids `[N]`, mask
/// `[N]`, offset; spec fields: budget_mib, mode, temperature, weight_layout. Results `[N]`
/// each: max, sum, weighted, target logit, sum2 (`S₂ = Σ exp(2(z-μ)/T)`, for `Σp²`).
unsafe extern "C" fn vocab_partial(frame: *mut CallFrame) -> *mut c_void {
    // SAFETY: XLA's frame.
    unsafe {
        handle(frame, |f| {
            let c = ShardCall::read(f, options)?;
            let (x, w, b, opts) = (&c.x, &c.w, &c.b, &c.opts);
            let part = by_dtype!(x, E, code => {
                let inputs: LinearInputs<E> = head((x, w, b), c.layout, code)?;
                Ok(cpu().partial_row_states(HeadArgs::host(&inputs), c.rows(), opts)?)
            })?;
            let outs = [
                f.ret(0, "max")?,
                f.ret(1, "sum")?,
                f.ret(2, "weighted")?,
                f.ret(3, "target_logit")?,
                f.ret(4, "sum2")?,
            ];
            let [mx, sum, wt, tgt, sum2] = outs.map(|o| o.f32s_mut());
            let (mx, sum, wt, tgt, sum2) = (mx?, sum?, wt?, tgt?, sum2?);
            for (i, st) in part.states.iter().enumerate() {
                (mx[i], sum[i], wt[i]) = (st.max, st.sum as f32, st.weighted as f32);
                (tgt[i], sum2[i]) = (part.target_logits[i], st.sum2 as f32);
            }
            Ok(())
        })
    }
}

/// The policy stage on merged statistics. Arguments: logp, entropy `[B, T]`,
/// completion_ids, completion_mask, advantages, old and ref logp,
/// importance_sampling_ratio; spec fields: config,
/// vocab (the whole vocabulary's size, for the ids' check).
/// Results: loss, dlogp, dentropy, kl `[B, T]`, metrics.
unsafe extern "C" fn grpo_policy(frame: *mut CallFrame) -> *mut c_void {
    // SAFETY: XLA's frame.
    unsafe {
        handle(frame, |f| {
            let loss = GrpoLoss::new(f.spec()?.config()?)?;
            loss.check_full_softmax("the vocab-parallel policy stage")?;
            let tokens = Tokens::read(f, 2)?;
            let batch = tokens.batch();
            let n = tokens.b * tokens.t;
            let (logp, entropy) = (f.arg(0, "logp")?, f.arg(1, "entropy")?);
            logp.expect_dims(&[tokens.b, tokens.t])?;
            entropy.expect_dims(&[tokens.b, tokens.t])?;
            let (logp, entropy) = (logp.f32s()?, entropy.f32s()?);
            let vocab = f.spec()?.i64("vocab")?;
            if vocab < 1 {
                return Err(bad("vocab", format!("must be >= 1, got {vocab}")));
            }
            batch.validate(vocab as usize, &loss)?;
            let policy = policy_stage(&loss, &batch, Normalizers::local(&batch), logp, entropy);
            let scale = RowTransform::grpo(&loss).grad_scale(1.0);
            let live = |i: usize| batch.mask[i];
            check_policy_rows(&policy, |i| entropy[i], 0..n, live, tokens.t, Some(scale))?;
            f.ret(0, "loss")?.f32s_mut()?[0] = policy.loss as f32;
            f.ret(1, "dlogp")?
                .f32s_mut()?
                .copy_from_slice(&policy.dlogp);
            f.ret(2, "dentropy")?
                .f32s_mut()?
                .copy_from_slice(&policy.dentropy);
            f.ret(3, "kl")?.f32s_mut()?.copy_from_slice(&policy.kl);
            let m = &policy.metrics;
            let metrics = [
                m.kl_mean,
                m.entropy_mean,
                m.clip_ratio_low,
                m.clip_ratio_high,
                m.clip_ratio_region,
            ];
            for (o, x) in f.ret(4, "metrics")?.f32s_mut()?.iter_mut().zip(metrics) {
                *o = x as f32;
            }
            Ok(())
        })
    }
}

/// Pass B. Arguments: hidden, weight (shard), bias, ids `[N]`, mask `[N]`, offset, and
/// the merged max, log_sum, entropy with the policy's dlogp, dentropy (`[N]` each), and
/// dlse (`[N]`: the upstream gradient of each row's log-sum-exp, `∂lse/∂s_j = p_j`, so
/// it adds to `coef_p`; `[0]` for none);
/// spec fields: budget_mib, mode, temperature, weight_layout, head_grad. Results: dhidden
/// (this shard's part), dweight (the weight's shape), dbias (the shard's; both `[0]`
/// for a frozen head).
unsafe extern "C" fn vocab_grads(frame: *mut CallFrame) -> *mut c_void {
    // SAFETY: XLA's frame.
    unsafe {
        handle(frame, |f| {
            let c = ShardCall::read(f, options)?;
            let (x, w, b, opts) = (&c.x, &c.w, &c.b, &c.opts);
            let (ids, live, range, transform) = (&c.ids, &c.live, &c.range, c.transform);
            let n = ids.len();
            let names = ["max", "log_sum", "entropy", "dlogp", "dentropy"];
            let mut cols = Vec::with_capacity(5);
            for (k, name) in names.into_iter().enumerate() {
                let a = f.arg(6 + k, name)?;
                a.expect_dims(&[n])?;
                cols.push(a.f32s()?);
            }
            let dlse = f.arg(11, "dlse")?;
            let dlse = match dlse.numel() {
                0 => None,
                _ => {
                    dlse.expect_dims(&[n])?;
                    Some(dlse.f32s()?)
                }
            };
            let grads_of: Vec<RowGrad> = (0..n)
                .map(|i| {
                    let (mx, ls) = (cols[0][i], cols[1][i]);
                    let c = transform.grpo_coefs(1.0, cols[3][i], cols[4][i]);
                    let stats = merged_stats(mx, ls, cols[2][i], transform.inv_temp);
                    let lse_p = dlse.map_or(0.0, |d| transform.grad_scale(d[i] as f64));
                    let g = RowGrad {
                        stats,
                        coef_p: (c.p as f64 + lse_p) as f32,
                        coef_h: c.h,
                        coef_uniform: 0.0,
                        coef_target: c.target,
                        target: ids[i].max(0) as usize,
                        support: None,
                    };
                    match live[i] {
                        true => g.on_shard(range),
                        false => RowGrad::default(),
                    }
                })
                .collect();
            by_dtype!(x, E, code => {
                let inputs: LinearInputs<E> = head((x, w, b), c.layout, code)?;
                let args = HeadArgs::Host { inputs: &inputs, grads: grads(f, 0)? };
                Ok(cpu().accumulate_row_grads(args, c.rows(), &grads_of, opts, n)?)
            })
        })
    }
}

/// The handlers by target name.
pub fn targets() -> Vec<(&'static str, super::ffi::Handler)> {
    vec![
        ("flashloss_vocab_partial", vocab_partial),
        ("flashloss_grpo_policy", grpo_policy),
        ("flashloss_vocab_grads", vocab_grads),
    ]
}

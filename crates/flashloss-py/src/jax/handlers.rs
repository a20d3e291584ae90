//! The XLA FFI handlers of `flashloss.jax` (CPU): each reads its call frame, calls the
//! process's CPU [`flashloss::Device`] and writes its results. The loss and the
//! gradients of `hidden`, `weight`, `bias` come out of one fused call (the backward of the
//! JAX op only scales them by the cotangent). Argument order is that of
//! `python/flashloss/jax/ffi/ops.py`. Every handler takes one attribute, `spec` (the JSON
//! of [`crate::spec::Spec`], parsed by [`Frame::spec`] as the torch entry points parse
//! theirs); the "spec fields" each handler's documentation names are its fields. Every
//! handler that takes a weight reads `weight_layout` (`"vh"`: `[V, H]`, `"hv"`: `[H, V]`,
//! a Flax kernel), and its `dweight` result has the weight's shape.

use super::ffi::CallFrame;
use super::frame::{Frame, Named, Result, bad, handle};
use crate::device::cpu;
use flashloss::device::{CeCall, CeUpstream, GrpoCall, LogpCall};
use flashloss::fused::LogpRows;
use flashloss::fused::{FusedOptions, LinearGradsMut};
use flashloss::policy::GrpoMetrics;
use flashloss::{
    CeConfig, CrossEntropy, Element, GrpoBatch, GrpoLoss, GrpoLossConfig, HeadArgs, LinearInputs,
    LogitsLayout, PerSeqOrToken, Temperature, WeightLayout,
};
use std::ffi::c_void;

/// The options of the call's spec (`mode`, `budget_mib`, `grad_output`, `head_grad`: see
/// [`crate::spec::Spec::options`]).
pub(super) fn options(f: &Frame) -> Result<FusedOptions> {
    Ok(f.spec()?.options()?)
}

/// The spec's `weight_layout`: `"vh"` (`[V, H]`) or `"hv"` (`[H, V]`).
pub(super) fn weight_layout(f: &Frame) -> Result<WeightLayout> {
    Ok(f.spec()?.weight_layout()?)
}

/// `(V, H)` of `weight` in `layout`, checked 2-D and of the hidden size `H` of `hidden`
/// `[..., H]`.
pub(super) fn vocab_hidden(
    hidden: &Named,
    weight: &Named,
    layout: WeightLayout,
) -> Result<(usize, usize)> {
    let (wd, hd) = (weight.dims(), hidden.dims());
    let Some(&h) = hd.last() else {
        return Err(bad(
            "hidden",
            format!("expected shape [..., H], got {hd:?}"),
        ));
    };
    let h = h as usize;
    let (v, wh) = match *wd {
        [a, b] => layout.vocab_hidden([a as usize, b as usize]),
        _ => (0, usize::MAX),
    };
    if wh != h {
        let want = match layout {
            WeightLayout::VocabMajor => format!("[V, H={h}]"),
            WeightLayout::HiddenMajor => format!("[H={h}, V]"),
        };
        let name = layout.name();
        return Err(bad(
            "weight",
            format!(
                "expected shape {want} (weight_layout {name:?}) for `hidden` {hd:?}, got {wd:?}"
            ),
        ));
    }
    Ok((v, h))
}

/// `hidden [..., H]`, `weight` (`[V, H]` or `[H, V]` as `layout`), `bias [V]` (or `[0]`:
/// none) of element type `E`.
pub(super) fn head<'a, E: Element>(
    (hidden, weight, bias): (&Named<'a>, &Named<'a>, &Named<'a>),
    layout: WeightLayout,
    (code, name): (i32, &str),
) -> Result<LinearInputs<'a, E>> {
    let (v, h) = vocab_hidden(hidden, weight, layout)?;
    // SAFETY: `E` is the element type of `code` (chosen by the caller from the dtype).
    let (x, w, b) = unsafe {
        (
            hidden.slice::<E>(code, name)?,
            weight.slice::<E>(code, name)?,
            bias.slice::<E>(code, name)?,
        )
    };
    if !b.is_empty() && b.len() != v {
        return Err(bad(
            "bias",
            format!("expected shape [V={v}], got {:?}", bias.dims()),
        ));
    }
    Ok(LinearInputs {
        hidden: x,
        weight: w,
        layout,
        bias: (!b.is_empty()).then_some(b),
        tokens: x.len() / h.max(1),
        hidden_size: h,
        vocab: v,
    })
}

/// The head's gradient results, zeroed (XLA's result buffers are uninitialized).
pub(super) fn grads<'a>(f: &Frame<'a>, first: usize) -> Result<LinearGradsMut<'a>> {
    let dh = f.ret(first, "dhidden")?.f32s_mut()?;
    let dw = f.ret(first + 1, "dweight")?.f32s_mut()?;
    let db = f.ret(first + 2, "dbias")?.f32s_mut()?;
    for g in [&mut *dh, &mut *dw, &mut *db] {
        g.fill(0.0);
    }
    Ok(LinearGradsMut {
        dhidden: dh,
        dweight: dw,
        dbias: (!db.is_empty()).then_some(db),
    })
}

/// Per-token `[B, T]` f32 values, or `None` for an empty (`[0]`) argument.
fn per_token<'a>(a: &Named<'a>, bt: [usize; 2]) -> Result<Option<&'a [f32]>> {
    if a.numel() == 0 {
        return Ok(None);
    }
    a.expect_dims(&bt)?;
    a.f32s().map(Some)
}

/// The sampler's importance ratio ρ (TRL's `importance_sampling_ratio`): `[0]` for
/// none, `[B]` or `[B, 1]` per sequence, `[B, T]` per token.
fn sampler_ratio<'a>(a: &Named<'a>, [b, t]: [usize; 2]) -> Result<Option<PerSeqOrToken<'a>>> {
    let d: Vec<usize> = a.dims().iter().map(|&x| x.max(0) as usize).collect();
    match d[..] {
        [0] => Ok(None),
        [rows] | [rows, 1] if rows == b => Ok(Some(PerSeqOrToken::Sequence(a.f32s()?))),
        [rows, cols] if rows == b && cols == t => Ok(Some(PerSeqOrToken::Token(a.f32s()?))),
        _ => Err(bad(
            "importance_sampling_ratio",
            format!(
                "expected shape [B={b}], [B, 1] or [B, T] with B·T = {}, got {d:?}",
                b * t
            ),
        )),
    }
}

/// The per-token inputs of a GRPO step: arguments `first..first + 6` (ids `[B, T]`,
/// mask, advantages `[B]` or `[B, T]`, old and reference logp `[B, T]` or `[0]`, the
/// sampler ratio `[B]`, `[B, 1]`, `[B, T]` or `[0]`).
pub(super) struct Tokens<'a> {
    pub(super) b: usize,
    pub(super) t: usize,
    ids: Vec<i64>,
    mask: Vec<bool>,
    adv: &'a [f32],
    old: Option<&'a [f32]>,
    reference: Option<&'a [f32]>,
    ratio: Option<PerSeqOrToken<'a>>,
}

impl<'a> Tokens<'a> {
    pub(super) fn read(f: &Frame<'a>, first: usize) -> Result<Self> {
        let ids = f.arg(first, "completion_ids")?;
        let d = ids.dims();
        if d.len() != 2 {
            return Err(bad(
                "completion_ids",
                format!("expected shape [B, T], got {d:?}"),
            ));
        }
        let (b, t) = (d[0] as usize, d[1] as usize);
        let mask = f.arg(first + 1, "completion_mask")?;
        mask.expect_dims(&[b, t])?;
        let adv = f.arg(first + 2, "advantages")?;
        if adv.numel() != b && adv.numel() != b * t {
            return Err(bad(
                "advantages",
                format!("expected shape [B={b}] or [B, T], got {:?}", adv.dims()),
            ));
        }
        Ok(Tokens {
            b,
            t,
            ids: ids.ids()?,
            mask: mask.bools()?,
            adv: adv.f32s()?,
            old: per_token(&f.arg(first + 3, "old_per_token_logps")?, [b, t])?,
            reference: per_token(&f.arg(first + 4, "ref_per_token_logps")?, [b, t])?,
            ratio: sampler_ratio(&f.arg(first + 5, "importance_sampling_ratio")?, [b, t])?,
        })
    }

    pub(super) fn batch(&self) -> GrpoBatch<'_> {
        GrpoBatch {
            batch: self.b,
            seq_len: self.t,
            target_ids: &self.ids,
            mask: &self.mask,
            advantages: match self.adv.len() == self.b && self.b * self.t != self.b {
                true => PerSeqOrToken::Sequence(self.adv),
                false => PerSeqOrToken::Token(self.adv),
            },
            old_logp: self.old,
            ref_logp: self.reference,
            sampler_ratio: self.ratio,
            policy_mask: None,
            entropy_mask: None,
        }
    }
}

/// Writes a GRPO step's per-token outputs and its loss and metrics.
pub(super) fn grpo_outputs(
    f: &Frame,
    first: usize,
    loss: f64,
    m: &GrpoMetrics,
    stats: &[flashloss::RowStats],
    kl: &[f32],
) -> Result<()> {
    f.ret(0, "loss")?.f32s_mut()?[0] = loss as f32;
    let (lp, ent) = (
        f.ret(first, "logp")?.f32s_mut()?,
        f.ret(first + 1, "entropy")?.f32s_mut()?,
    );
    for ((s, l), e) in stats.iter().zip(lp.iter_mut()).zip(ent.iter_mut()) {
        (*l, *e) = (s.logp, s.entropy);
    }
    f.ret(first + 2, "kl")?.f32s_mut()?.copy_from_slice(kl);
    let metrics = [
        m.kl_mean,
        m.entropy_mean,
        m.clip_ratio_low,
        m.clip_ratio_high,
        m.clip_ratio_region,
    ];
    for (o, x) in f
        .ret(first + 3, "metrics")?
        .f32s_mut()?
        .iter_mut()
        .zip(metrics)
    {
        *o = x as f32;
    }
    Ok(())
}

/// `E` from the dtype of `x`: f32, bf16 or f16.
macro_rules! by_dtype {
    ($x:expr, $E:ident, $code:ident => $body:expr) => {
        match $x.dtype() {
            $crate::jax::ffi::dtype::F32 => {
                type $E = f32;
                let $code = ($crate::jax::ffi::dtype::F32, "float32");
                $body
            }
            $crate::jax::ffi::dtype::BF16 => {
                type $E = half::bf16;
                let $code = ($crate::jax::ffi::dtype::BF16, "bfloat16");
                $body
            }
            $crate::jax::ffi::dtype::F16 => {
                type $E = half::f16;
                let $code = ($crate::jax::ffi::dtype::F16, "float16");
                $body
            }
            other => Err($crate::jax::frame::bad(
                $x.name,
                format!("expected float32, bfloat16 or float16, got XLA dtype {other}"),
            )),
        }
    };
}
pub(super) use by_dtype;

/// GRPO from hidden states. Arguments: hidden, weight, bias, completion_ids,
/// completion_mask, advantages, old and ref logp, importance_sampling_ratio; spec fields: budget_mib, config (the
/// JSON of `GrpoLossConfig`), mode, weight_layout, head_grad. Results: loss, dhidden,
/// dweight, dbias (`[0]` each for a frozen head), logp, entropy, kl, metrics
/// `[kl, entropy, clip low, high, region]`.
unsafe extern "C" fn grpo_linear(frame: *mut CallFrame) -> *mut c_void {
    // SAFETY: XLA's frame.
    unsafe {
        handle(frame, |f| {
            let loss = GrpoLoss::new(f.spec()?.config::<GrpoLossConfig>()?)?;
            let opts = options(f)?;
            let (x, w, bias) = (f.arg(0, "hidden")?, f.arg(1, "weight")?, f.arg(2, "bias")?);
            let layout = weight_layout(f)?;
            let tokens = Tokens::read(f, 3)?;
            let batch = tokens.batch();
            let out = by_dtype!(x, E, code => {
                let inputs = head::<E>((&x, &w, &bias), layout, code)?;
                let args = HeadArgs::Host { inputs: &inputs, grads: grads(f, 1)? };
                Ok(cpu().grpo(args, GrpoCall::new(&loss, &batch, &opts))?)
            })?;
            grpo_outputs(f, 4, out.loss, &out.metrics, &out.stats, &out.kl)
        })
    }
}

/// Cross-entropy from hidden states. Arguments: hidden, weight, bias, targets `[N]`,
/// grad_rows `[N]` (reduction none; `[0]` otherwise), grad_lse `[N]` (the upstream
/// gradient of each row's log-sum-exp; `[0]` for none); spec fields: budget_mib, config
/// (the JSON of `CeConfig`), mode, weight_layout, head_grad, grad_output. Results: loss,
/// dhidden, dweight, dbias (`[0]` each for a frozen head: the gradients of
/// `grad_output·L + Σ_i grad_lse_i·lse_i`), row_loss `[N]`, count, lse `[N]` (0 where
/// ignored).
unsafe extern "C" fn ce_linear(frame: *mut CallFrame) -> *mut c_void {
    // SAFETY: XLA's frame.
    unsafe {
        handle(frame, |f| {
            let ce = CrossEntropy::new(f.spec()?.config::<CeConfig>()?)?;
            let opts = options(f)?;
            let (x, w, bias) = (f.arg(0, "hidden")?, f.arg(1, "weight")?, f.arg(2, "bias")?);
            let layout = weight_layout(f)?;
            let targets = f.arg(3, "targets")?.ids()?;
            let upstream = ce_upstream(f, 4, targets.len())?;
            let out = by_dtype!(x, E, code => {
                let inputs = head::<E>((&x, &w, &bias), layout, code)?;
                let args = HeadArgs::Host { inputs: &inputs, grads: grads(f, 1)? };
                Ok(cpu().cross_entropy(args, CeCall::new(&ce, &targets, &opts).upstream(upstream))?)
            })?;
            ce_outputs(f, &out)
        })
    }
}

/// The per-row upstream gradients of a CE call: arguments `first` (grad_rows) and
/// `first + 1` (grad_lse), each `[N]` or `[0]` (none).
pub(super) fn ce_upstream<'a>(f: &Frame<'a>, first: usize, n: usize) -> Result<CeUpstream<'a>> {
    let [rows, lse] = [(first, "grad_rows"), (first + 1, "grad_lse")].map(|(i, name)| {
        let a = f.arg(i, name)?;
        if a.numel() == 0 {
            return Ok(None);
        }
        a.expect_dims(&[n])?;
        a.f32s().map(Some)
    });
    Ok(CeUpstream {
        rows: rows?,
        lse: lse?,
    })
}

/// Writes a CE call's loss (result 0), per-row losses (4), counted rows (5) and each
/// row's log-sum-exp (6).
pub(super) fn ce_outputs(f: &Frame, out: &flashloss::fused::CeLinearOutput) -> Result<()> {
    f.ret(0, "loss")?.f32s_mut()?[0] = out.loss as f32;
    f.ret(4, "row_loss")?
        .f32s_mut()?
        .copy_from_slice(&out.row_loss);
    f.ret(5, "count")?.f32s_mut()?[0] = out.count as f32;
    write_lse(f, 6, &out.stats)
}

/// Writes each row's log-sum-exp (0 where the row was not computed) into result `index`.
fn write_lse(f: &Frame, index: usize, stats: &[flashloss::RowStats]) -> Result<()> {
    let lse = f.ret(index, "lse")?.f32s_mut()?;
    lse.iter_mut().zip(stats).for_each(|(o, s)| *o = s.lse);
    Ok(())
}

/// Per-row CE losses without gradients (reduction `none`'s forward: one statistics
/// pass). Arguments: hidden, weight, bias, targets `[N]`; spec fields: budget_mib,
/// config, weight_layout. Results: row_loss, lse `[N]` (0 where ignored).
unsafe extern "C" fn ce_rows(frame: *mut CallFrame) -> *mut c_void {
    // SAFETY: XLA's frame.
    unsafe {
        handle(frame, |f| {
            let ce = CrossEntropy::new(f.spec()?.config::<CeConfig>()?)?;
            let opts = options(f)?.two_pass();
            let (x, w, bias) = (f.arg(0, "hidden")?, f.arg(1, "weight")?, f.arg(2, "bias")?);
            let layout = weight_layout(f)?;
            let targets = f.arg(3, "targets")?.ids()?;
            let out = by_dtype!(x, E, code => {
                let inputs = head::<E>((&x, &w, &bias), layout, code)?;
                Ok(cpu().cross_entropy(HeadArgs::host(&inputs), CeCall::new(&ce, &targets, &opts).forward())?)
            })?;
            f.ret(0, "row_loss")?
                .f32s_mut()?
                .copy_from_slice(&out.row_loss);
            write_lse(f, 1, &out.stats)
        })
    }
}

/// Per-row log-probs and entropy (no gradient). Arguments: hidden, weight, bias, ids
/// `[N]`, mask `[N]`; spec fields: budget_mib, temperature, weight_layout. Results: logp,
/// entropy `[N]`.
unsafe extern "C" fn logp_linear(frame: *mut CallFrame) -> *mut c_void {
    // SAFETY: XLA's frame.
    unsafe {
        handle(frame, |f| {
            let temperature = Temperature::new(f.spec()?.f64("temperature")?)?;
            let budget = options(f)?.budget_bytes;
            let (x, w, bias) = (f.arg(0, "hidden")?, f.arg(1, "weight")?, f.arg(2, "bias")?);
            let layout = weight_layout(f)?;
            let ids = f.arg(3, "ids")?.ids()?;
            let mask = f.arg(4, "mask")?.bools()?;
            let n = ids.len();
            let stats = by_dtype!(x, E, code => {
                let inputs = head::<E>((&x, &w, &bias), layout, code)?;
                let device = cpu();
                Ok(device.logprobs(HeadArgs::host(&inputs), LogpCall::forward(LogpRows { targets: &ids, mask: Some(&mask), temperature }, &FusedOptions::forward(budget), n)).map(|o| o.stats)?)
            })?;
            let (lp, ent) = (
                f.ret(0, "logp")?.f32s_mut()?,
                f.ret(1, "entropy")?.f32s_mut()?,
            );
            for ((s, l), e) in stats.iter().zip(lp.iter_mut()).zip(ent.iter_mut()) {
                (*l, *e) = (s.logp, s.entropy);
            }
            Ok(())
        })
    }
}

/// GRPO on materialized logits `[B, T, V]` (f32 or bf16; the gradient in their dtype,
/// no f32 copy of bf16 logits). Arguments: logits, completion_ids, completion_mask,
/// advantages, old and ref logp, importance_sampling_ratio; spec field: config. Results: loss, dlogits, logp,
/// entropy, kl, metrics.
unsafe extern "C" fn grpo_logits(frame: *mut CallFrame) -> *mut c_void {
    // SAFETY: XLA's frame.
    unsafe {
        handle(frame, |f| {
            let loss = GrpoLoss::new(f.spec()?.config::<GrpoLossConfig>()?)?;
            let z = f.arg(0, "logits")?;
            let tokens = Tokens::read(f, 1)?;
            let layout = logits_layout(&z, &tokens)?;
            let batch = tokens.batch();
            let dz = f.ret(1, "dlogits")?;
            let fwd = by_dtype!(z, E, code => {
                let logits = z.slice::<E>(code.0, code.1)?;
                let out = dz.slice_mut::<E>(code.0, code.1)?;
                Ok(cpu().grpo_logits(&loss, &batch, logits, &layout, 1.0, out)?)
            })?;
            grpo_outputs(f, 2, fwd.loss, &fwd.metrics, &fwd.stats, &fwd.kl)
        })
    }
}

/// The dense layout of logits `[B, T, V]` for `tokens`' `[B, T]`.
fn logits_layout(z: &Named, tokens: &Tokens) -> Result<LogitsLayout> {
    let d = z.dims();
    if d.len() != 3 || d[0] as usize != tokens.b || d[1] as usize != tokens.t {
        let (b, t) = (tokens.b, tokens.t);
        return Err(bad(
            "logits",
            format!("expected shape [B={b}, T={t}, V], got {d:?}"),
        ));
    }
    Ok(LogitsLayout::contiguous(tokens.b, tokens.t, d[2] as usize))
}

/// Per-token GRPO losses on logits `[B, T, V]`, unreduced (Liger's `reduce=False`).
/// Arguments: logits, completion_ids, completion_mask, advantages, old and ref logp,
/// importance_sampling_ratio, grad_rows `[B, T]` (each token's upstream gradient; ones for the losses themselves);
/// spec field: config. Results: token_loss `g·ℓ_tot`, kl, clipped (0/1) `[B, T]` f32, and
/// dlogits (the logits' shape and dtype: `∂(Σ g·ℓ_tot)/∂logits`; `[0]` for none).
unsafe extern "C" fn grpo_logits_rows(frame: *mut CallFrame) -> *mut c_void {
    // SAFETY: XLA's frame.
    unsafe {
        handle(frame, |f| {
            let loss = GrpoLoss::new(f.spec()?.config::<GrpoLossConfig>()?)?;
            let z = f.arg(0, "logits")?;
            let tokens = Tokens::read(f, 1)?;
            let layout = logits_layout(&z, &tokens)?;
            let batch = tokens.batch();
            let g = f.arg(7, "grad_rows")?;
            g.expect_dims(&[tokens.b, tokens.t])?;
            let g = g.f32s()?;
            let dz = f.ret(3, "dlogits")?;
            let fwd = by_dtype!(z, E, code => {
                let logits = z.slice::<E>(code.0, code.1)?;
                let out = (dz.numel() > 0).then(|| dz.slice_mut::<E>(code.0, code.1)).transpose()?;
                Ok(cpu().grpo_logits_per_token(&loss, &batch, logits, &layout, g, out)?)
            })?;
            let rows = f.ret(0, "token_loss")?.f32s_mut()?;
            rows.iter_mut()
                .zip(&fwd.token_loss)
                .for_each(|(o, &x)| *o = x as f32);
            f.ret(1, "kl")?.f32s_mut()?.copy_from_slice(&fwd.kl);
            let clip = f.ret(2, "clipped")?.f32s_mut()?;
            clip.iter_mut()
                .zip(&fwd.clip)
                .for_each(|(o, &c)| *o = (c != 0) as u8 as f32);
            Ok(())
        })
    }
}

/// The handlers of whole (unsplit) heads and logits, by target name.
pub fn targets() -> Vec<(&'static str, super::ffi::Handler)> {
    vec![
        ("flashloss_grpo_linear", grpo_linear),
        ("flashloss_ce_linear", ce_linear),
        ("flashloss_ce_rows", ce_rows),
        ("flashloss_logp_linear", logp_linear),
        ("flashloss_grpo_logits", grpo_logits),
        ("flashloss_grpo_logits_rows", grpo_logits_rows),
    ]
}

//! The handlers of `linear_logprobs` under vLLM V1's truncated support (`top_k`, `top_p`,
//! `min_p`; spec: "Per-token statistics beyond logp and entropy") on a whole head:
//! `flashloss_logp_support` is the forward (every row's statistics, `Σp²` and, under the
//! support `K_i`, `logp^K_i = s_{i,y_i} - lse^K_i`, `-inf` where the target is outside
//! `K_i`), `flashloss_logp_support_grads` the gradient of
//! `Σ_i g_i·logp^K_i + e_i·H_i + c_i·lse_i` with every `K_i` held fixed
//! (`∂logp^K_i/∂s_ij = 1[j = y_i] - p^K_ij` on `K_i`, 0 elsewhere). A head split over a
//! mesh axis is refused by the caller: the support is not vocab-parallel here.

use super::ffi::CallFrame;
use super::frame::{Frame, Named, Result, bad, handle};
use super::handlers::{by_dtype, grads, head, options, weight_layout};
use crate::device::cpu;
use flashloss::SupportFilter;
use flashloss::device::LogpCall;
use flashloss::fused::FusedOptions;
use flashloss::fused::{LogpRequest, LogpRows, LogpUpstream};
use flashloss::{HeadArgs, LinearInputs, Temperature};
use std::ffi::c_void;

/// The filters from the spec fields `top_k` (`0`: none), `top_p` and `min_p` (`1` and
/// `0`: none, as vLLM), checked.
fn filter(f: &Frame) -> Result<SupportFilter> {
    let spec = f.spec()?;
    let (k, p, m) = (spec.i64("top_k")?, spec.f64("top_p")?, spec.f64("min_p")?);
    Ok(SupportFilter::of_caller(Some(k), Some(p), Some(m))?)
}

/// The rows' arguments: ids `[N]` (argument 3), mask `[N]` (4); the spec field
/// `temperature`.
struct SupportRows {
    ids: Vec<i64>,
    mask: Vec<bool>,
    temperature: Temperature,
}

impl SupportRows {
    fn read(f: &Frame) -> Result<Self> {
        let ids = f.arg(3, "ids")?.ids()?;
        let mask = f.arg(4, "mask")?;
        mask.expect_dims(&[ids.len()])?;
        let temperature = Temperature::new(f.spec()?.f64("temperature")?)?;
        Ok(SupportRows {
            ids,
            mask: mask.bools()?,
            temperature,
        })
    }

    fn rows(&self) -> LogpRows<'_> {
        LogpRows {
            targets: &self.ids,
            mask: Some(&self.mask),
            temperature: self.temperature,
        }
    }
}

/// `[N]` f32 values of argument `i`, or `None` for `[0]`.
fn optional_rows<'a>(a: &Named<'a>, n: usize) -> Result<Option<&'a [f32]>> {
    if a.numel() == 0 {
        return Ok(None);
    }
    a.expect_dims(&[n])?;
    a.f32s().map(Some)
}

/// The forward. Arguments: hidden, weight, bias, ids `[N]`, mask `[N]`; spec fields:
/// budget_mib, mode, temperature, weight_layout, top_k, top_p, min_p. Results `[N]` f32
/// each (0 where masked): logp^K (`-inf` outside the support), entropy, lse (the full
/// softmax's), max (`max_j s_j`), sum_p2, outside (1 where the target is outside).
unsafe extern "C" fn logp_support(frame: *mut CallFrame) -> *mut c_void {
    // SAFETY: XLA's frame.
    unsafe {
        handle(frame, |f| {
            let (x, w, b) = (f.arg(0, "hidden")?, f.arg(1, "weight")?, f.arg(2, "bias")?);
            let layout = weight_layout(f)?;
            let rows = SupportRows::read(f)?;
            let request = LogpRequest {
                sum_p2: true,
                support: Some(filter(f)?),
                ..LogpRequest::default()
            };
            let budget = options(f)?.budget_bytes;
            let n = rows.ids.len();
            let out = by_dtype!(x, E, code => {
                let inputs: LinearInputs<E> = head((&x, &w, &b), layout, code)?;
                Ok(cpu().logprobs(HeadArgs::host(&inputs), LogpCall::forward(rows.rows(), &FusedOptions::forward(budget), n).request(&request))?)
            })?;
            let (Some(support), Some(p2)) = (&out.support, &out.sum_p2) else {
                return Err(bad("support", "the kernel returned no support outputs"));
            };
            let names = ["logp", "entropy", "lse", "max", "sum_p2", "outside"];
            let mut outs = Vec::with_capacity(names.len());
            for (k, name) in names.into_iter().enumerate() {
                outs.push(f.ret(k, name)?.f32s_mut()?);
            }
            for i in 0..n {
                let (st, live) = (&out.stats[i], rows.mask[i]);
                let row = [
                    support.logp[i],
                    st.entropy,
                    st.lse,
                    out.max_logit[i],
                    p2[i],
                    (live && support.outside[i]) as u8 as f32,
                ];
                for (o, v) in outs.iter_mut().zip(row) {
                    o[i] = if live { v } else { 0.0 };
                }
            }
            Ok(())
        })
    }
}

/// The gradient. Arguments: hidden, weight, bias, ids `[N]`, mask `[N]`, grad_logp `[N]`
/// (of logp^K), grad_entropy and grad_lse (`[N]` or `[0]`: none); spec fields:
/// budget_mib, mode, temperature, weight_layout, top_k, top_p, min_p, head_grad. Results:
/// dhidden, dweight, dbias (`[0]` each for a frozen head).
unsafe extern "C" fn logp_support_grads(frame: *mut CallFrame) -> *mut c_void {
    // SAFETY: XLA's frame.
    unsafe {
        handle(frame, |f| {
            let (x, w, b) = (f.arg(0, "hidden")?, f.arg(1, "weight")?, f.arg(2, "bias")?);
            let layout = weight_layout(f)?;
            let rows = SupportRows::read(f)?;
            let request = LogpRequest {
                support: Some(filter(f)?),
                ..LogpRequest::default()
            };
            let opts = options(f)?;
            let n = rows.ids.len();
            let g = f.arg(5, "grad_logp")?;
            g.expect_dims(&[n])?;
            let upstream = LogpUpstream {
                logp: g.f32s()?,
                entropy: optional_rows(&f.arg(6, "grad_entropy")?, n)?,
                lse: optional_rows(&f.arg(7, "grad_lse")?, n)?,
                gathered: None,
            };
            by_dtype!(x, E, code => {
                let inputs: LinearInputs<E> = head((&x, &w, &b), layout, code)?;
                let args = HeadArgs::Host { inputs: &inputs, grads: grads(f, 0)? };
                let call = (rows.rows(), &request);
                cpu().logprobs(args, LogpCall::grads(call.0, upstream, &opts, n).request(call.1))?;
                Ok(())
            })
        })
    }
}

/// The handlers by target name.
pub fn targets() -> Vec<(&'static str, super::ffi::Handler)> {
    vec![
        ("flashloss_logp_support", logp_support),
        ("flashloss_logp_support_grads", logp_support_grads),
    ]
}

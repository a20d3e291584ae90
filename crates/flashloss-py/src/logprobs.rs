//! The log-prob entry points of `flashloss._native`: per-token `logp` and entropy of
//! `(hidden·weightᵀ + bias)/temperature` at `ids` `[B, T]` (or any shape of N elements),
//! with what a call asks beyond them (each row's `lse`, max scaled logit and `Σp²`, the
//! log-probs of candidate ids `gather_ids` `[..., K]`, the log-probs under the truncated
//! support of `top_k`/`top_p`/`min_p`), and their gradient w.r.t. hidden, weight and bias for upstream
//! gradients of `logp`, entropy, `lse` and the candidates' log-probs. The head on the
//! CPU, or on a GPU (a `cuda` build: borrowed, on `stream`, PyTorch's current one); the
//! per-row inputs and outputs are CPU tensors either way (the Python side stages them). A
//! vocab-parallel `group` splits the head's vocabulary.

use crate::args::{BOOL, F32, Grads, HeadTensors, I64};
use crate::dist::VocabGroup;
use crate::front::{call_head, with_element};
use crate::losses::{agreed, budget, head_shard, write_f32, write_stats};
use crate::tensor::{Tensor, arg_error};
use flashloss::device::LogpCall;
use flashloss::fused::{FusedOptions, GatherIds, LogpOutput, LogpRequest, LogpRows, LogpUpstream};
use flashloss::{Grid, SupportFilter, Temperature};
use pyo3::prelude::*;

/// The optional inputs of a log-prob call: candidate ids `[..., K]` (the ids' shape and
/// K ≥ 1) and the support filters.
struct Extras<'py> {
    gather: Option<Tensor<'py>>,
    k: usize,
    support: Option<SupportFilter>,
}

impl<'py> Extras<'py> {
    fn new(
        ids: &Tensor,
        gather_ids: Option<&Bound<'py, PyAny>>,
        (top_k, top_p, min_p): (Option<i64>, Option<f64>, Option<f64>),
    ) -> PyResult<Self> {
        let gather = Tensor::optional("gather_ids", gather_ids, I64)?;
        let k = match &gather {
            None => 0,
            Some(g) => match g.shape.split_last() {
                Some((&k, lead)) if lead == ids.shape && k >= 1 => k,
                _ => {
                    return Err(arg_error(
                        "gather_ids",
                        format!(
                            "expected shape {:?} + [K] with K ≥ 1 (ids' shape and K candidates per token), got {:?}",
                            ids.shape, g.shape
                        ),
                    ));
                }
            },
        };
        let top_k = top_k
            .map(|k| {
                usize::try_from(k)
                    .map_err(|_| arg_error("top_k", format!("must be at least 1, got {k}")))
            })
            .transpose()?;
        let filter = SupportFilter {
            top_k,
            top_p,
            min_p,
        };
        let support = (filter != SupportFilter::default()).then_some(filter);
        Ok(Extras { gather, k, support })
    }

    /// The request (`sum_p2`: whether `Σp²` is asked).
    fn request(&self, sum_p2: bool) -> PyResult<LogpRequest<'_>> {
        let gather_ids = match &self.gather {
            Some(g) => Some(GatherIds {
                ids: g.i64s()?,
                k: self.k,
            }),
            None => None,
        };
        Ok(LogpRequest {
            sum_p2,
            gather_ids,
            support: self.support,
        })
    }
}

/// A log-prob call's ids (`N` elements), mask (of the ids' shape) and temperature,
/// checked against `head`.
fn logp_rows<'py>(
    head: &HeadTensors,
    ids: &Bound<'py, PyAny>,
    mask: Option<&Bound<'py, PyAny>>,
    temperature: f64,
) -> PyResult<(Tensor<'py>, Option<Vec<bool>>, Temperature)> {
    let ids = Tensor::new("ids", ids, I64)?;
    if ids.numel() != head.tokens {
        return Err(arg_error(
            "ids",
            format!(
                "has {} elements but hidden has {} rows",
                ids.numel(),
                head.tokens
            ),
        ));
    }
    let mask = Tensor::optional("mask", mask, BOOL)?;
    if let Some(m) = &mask {
        m.expect_shape(&ids.shape)?;
    }
    let mask = mask.map(|m| m.bools()).transpose()?;
    let t = Temperature::new(temperature).map_err(|e| arg_error("temperature", e))?;
    Ok((ids, mask, t))
}

/// Per-token `logp` and entropy at `ids` (where `mask`, if given, is set), written into
/// `out_logp`, `out_entropy`; and, where their tensors are given, each token's `lse`,
/// max scaled logit and `Σp²` (`[N]` f32) and the log-probs of `gather_ids` `[..., K]`
/// (`out_gathered`, of their shape); `top_k`/`top_p`/`min_p` ask for the truncated
/// support: `out_logp` then holds `logp^K` (`-inf` where the target is outside the
/// support; the entropy and `lse` stay the full softmax's) and `out_outside` (f32, 1.0
/// where outside), if given, the flags. No gradient.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (hidden, weight, bias, ids, mask, temperature, budget_mib, out_logp, out_entropy,
    group=None, out_lse=None, out_max=None, out_sum_p2=None, gather_ids=None, out_gathered=None,
    top_k=None, top_p=None, min_p=None, out_outside=None, stream=0))]
pub fn logp_linear<'py>(
    py: Python<'py>,
    hidden: &Bound<'py, PyAny>,
    weight: &Bound<'py, PyAny>,
    bias: Option<&Bound<'py, PyAny>>,
    ids: &Bound<'py, PyAny>,
    mask: Option<&Bound<'py, PyAny>>,
    temperature: f64,
    budget_mib: f64,
    out_logp: &Bound<'py, PyAny>,
    out_entropy: &Bound<'py, PyAny>,
    group: Option<&Bound<'py, PyAny>>,
    out_lse: Option<&Bound<'py, PyAny>>,
    out_max: Option<&Bound<'py, PyAny>>,
    out_sum_p2: Option<&Bound<'py, PyAny>>,
    gather_ids: Option<&Bound<'py, PyAny>>,
    out_gathered: Option<&Bound<'py, PyAny>>,
    top_k: Option<i64>,
    top_p: Option<f64>,
    min_p: Option<f64>,
    out_outside: Option<&Bound<'py, PyAny>>,
    stream: usize,
) -> PyResult<()> {
    let group = VocabGroup::new(group)?;
    let parsed = (|| {
        let opts = budget("two_pass", budget_mib)?;
        let head = HeadTensors::new(hidden, weight, bias)?;
        let (ids, mask, t) = logp_rows(&head, ids, mask, temperature)?;
        let extras = Extras::new(&ids, gather_ids, (top_k, top_p, min_p))?;
        Ok((opts, head, ids, mask, t, extras))
    })();
    let (opts, head, ids, mask, temperature, extras) = agreed(py, group.as_ref(), parsed)?;
    let seq_len = ids.shape.last().copied().unwrap_or(1);
    let rows = LogpRows {
        targets: ids.i64s()?,
        mask: mask.as_deref(),
        temperature,
    };
    let request = extras.request(out_sum_p2.is_some())?;
    let budget = opts.budget_bytes;
    let out = match &group {
        None => {
            with_element!(head.hidden.dtype, E => call_head::<E, _>(py, &head, None, stream, |d, h| {
                d.logprobs(h, LogpCall::forward(rows, &FusedOptions::forward(budget), seq_len).request(&request))
            }))?
        }
        Some(g) => {
            let shard = head_shard(py, g, &head)?;
            with_element!(head.hidden.dtype, E => call_head::<E, _>(py, &head, None, stream, |d, h| {
                d.logprobs(h, LogpCall::forward(rows, &FusedOptions::forward(budget), seq_len).request(&request).sharded(&Grid::vocab(&g.0), shard))
            }))?
        }
    };
    let mut logp = Tensor::new("out_logp", out_logp, F32)?;
    write_stats(
        &out.stats,
        &mut logp,
        &mut Tensor::new("out_entropy", out_entropy, F32)?,
    )?;
    write_support(&out, &mut logp, out_outside)?;
    write_extras(&out, (out_lse, out_max, out_sum_p2, out_gathered))
}

/// Under a truncated support: its `logp^K` over `logp` (`-inf` where the target is
/// outside it) and the outside flags (1.0 where outside) into `out_outside`.
fn write_support(
    out: &LogpOutput,
    logp: &mut Tensor,
    out_outside: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    match (&out.support, out_outside) {
        (Some(s), outside) => {
            write_f32(&s.logp, logp)?;
            if let Some(t) = outside {
                let flags: Vec<f32> = s.outside.iter().map(|&o| f32::from(u8::from(o))).collect();
                write_f32(&flags, &mut Tensor::new("out_outside", t, F32)?)?;
            }
            Ok(())
        }
        (None, Some(_)) => Err(arg_error(
            "out_outside",
            "given without the input that asks for it (top_k, top_p or min_p)",
        )),
        (None, None) => Ok(()),
    }
}

/// Writes the outputs a call asked beyond `logp` and entropy into their tensors.
fn write_extras(out: &LogpOutput, (lse, max, sum_p2, gathered): Outputs) -> PyResult<()> {
    let lse_values: Vec<f32> = out.stats.iter().map(|s| s.lse).collect();
    let named = [
        ("out_lse", lse, Some(&lse_values)),
        ("out_max", max, Some(&out.max_logit)),
        ("out_sum_p2", sum_p2, out.sum_p2.as_ref()),
        ("out_gathered", gathered, out.gathered.as_ref()),
    ];
    for (arg, tensor, values) in named {
        let Some(tensor) = tensor else { continue };
        let Some(values) = values else {
            return Err(arg_error(
                arg,
                "given without the input that asks for it (gather_ids)",
            ));
        };
        write_f32(values, &mut Tensor::new(arg, tensor, F32)?)?;
    }
    Ok(())
}

/// The optional output tensors of [`logp_linear`]: `lse`, max, `Σp²`, gathered.
type Outputs<'a, 'py> = (
    Option<&'a Bound<'py, PyAny>>,
    Option<&'a Bound<'py, PyAny>>,
    Option<&'a Bound<'py, PyAny>>,
    Option<&'a Bound<'py, PyAny>>,
);

/// The gradient of `Σ_i grad_logp_i·logp_i + grad_entropy_i·H_i + grad_lse_i·lse_i +
/// Σ_k grad_gathered_ik·logp_ik` of [`logp_linear`]'s outputs (`[N]` f32 each, `[..., K]`
/// for the candidates'; None: zero) w.r.t. hidden, weight and bias, added into `grad_*`
/// (no `grad_weight`: a frozen head, dH alone).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (hidden, weight, bias, ids, mask, grad_logp, grad_entropy, temperature, mode,
    budget_mib, grad_hidden, grad_weight, grad_bias, group=None, grad_lse=None, gather_ids=None,
    grad_gathered=None, top_k=None, top_p=None, min_p=None, stream=0))]
pub fn logp_linear_grads<'py>(
    py: Python<'py>,
    hidden: &Bound<'py, PyAny>,
    weight: &Bound<'py, PyAny>,
    bias: Option<&Bound<'py, PyAny>>,
    ids: &Bound<'py, PyAny>,
    mask: Option<&Bound<'py, PyAny>>,
    grad_logp: &Bound<'py, PyAny>,
    grad_entropy: Option<&Bound<'py, PyAny>>,
    temperature: f64,
    mode: &str,
    budget_mib: f64,
    grad_hidden: &Bound<'py, PyAny>,
    grad_weight: Option<&Bound<'py, PyAny>>,
    grad_bias: Option<&Bound<'py, PyAny>>,
    group: Option<&Bound<'py, PyAny>>,
    grad_lse: Option<&Bound<'py, PyAny>>,
    gather_ids: Option<&Bound<'py, PyAny>>,
    grad_gathered: Option<&Bound<'py, PyAny>>,
    top_k: Option<i64>,
    top_p: Option<f64>,
    min_p: Option<f64>,
    stream: usize,
) -> PyResult<()> {
    let group = VocabGroup::new(group)?;
    let parsed = (|| {
        let head = HeadTensors::new(hidden, weight, bias)?;
        let (ids, mask, t) = logp_rows(&head, ids, mask, temperature)?;
        let extras = Extras::new(&ids, gather_ids, (top_k, top_p, min_p))?;
        let grads = Grads::new(&head, grad_hidden, grad_weight, grad_bias)?;
        let opts = FusedOptions {
            head_grad: grads.head_grad(),
            ..budget(mode, budget_mib)?
        };
        let g_logp = Tensor::new("grad_logp", grad_logp, F32)?;
        let g_entropy = Tensor::optional("grad_entropy", grad_entropy, F32)?;
        let g_lse = Tensor::optional("grad_lse", grad_lse, F32)?;
        for g in [Some(&g_logp), g_entropy.as_ref(), g_lse.as_ref()]
            .into_iter()
            .flatten()
        {
            g.expect_shape(&ids.shape)?;
        }
        let g_gathered = Tensor::optional("grad_gathered", grad_gathered, F32)?;
        if let (Some(g), Some(ids)) = (&g_gathered, &extras.gather) {
            g.expect_shape(&ids.shape)?;
        }
        let upstream = (g_logp, g_entropy, g_lse, g_gathered);
        Ok((head, ids, mask, t, extras, grads, opts, upstream))
    })();
    let (head, ids, mask, temperature, extras, mut grads, opts, upstream) =
        agreed(py, group.as_ref(), parsed)?;
    let seq_len = ids.shape.last().copied().unwrap_or(1);
    let rows = LogpRows {
        targets: ids.i64s()?,
        mask: mask.as_deref(),
        temperature,
    };
    let request = extras.request(false)?;
    let (g_logp, g_entropy, g_lse, g_gathered) = &upstream;
    let upstream = LogpUpstream {
        lse: optional_f32s(g_lse)?,
        gathered: optional_f32s(g_gathered)?,
        ..LogpUpstream::new(g_logp.f32s()?, optional_f32s(g_entropy)?)
    };
    let call = (rows, &request);
    match &group {
        None => with_element!(head.hidden.dtype, E => call_head::<E, _>(
            py, &head, Some(&mut grads), stream,
            |d, h| d.logprobs(h, LogpCall::grads(call.0, upstream, &opts, seq_len).request(call.1)),
        ))?,
        Some(g) => {
            let shard = head_shard(py, g, &head)?;
            with_element!(head.hidden.dtype, E => call_head::<E, _>(
                py, &head, Some(&mut grads), stream,
                |d, h| d.logprobs(h, LogpCall::grads(call.0, upstream, &opts, seq_len).request(call.1).sharded(&Grid::vocab(&g.0), shard)),
            ))?
        }
    };
    Ok(())
}

/// The values of an optional f32 tensor.
fn optional_f32s<'a>(t: &'a Option<Tensor>) -> PyResult<Option<&'a [f32]>> {
    t.as_ref().map(|t| t.f32s()).transpose()
}

//! The log-prob entry points of `flashloss._native`: per-token `logp` and entropy of
//! `(hidden·weightᵀ + bias)/temperature` at `ids` `[B, T]` (or any shape of N elements),
//! with what a call asks beyond them (each row's `lse`, max scaled logit and `Σp²`, the
//! log-probs of candidate ids `gather_ids` `[..., K]`, the log-probs under the truncated
//! support of `top_k`/`top_p`/`min_p`), and their gradient w.r.t. hidden, weight and bias for upstream
//! gradients of `logp`, entropy, `lse` and the candidates' log-probs. The head on the
//! CPU, or on a GPU (a `cuda` build: borrowed, on `stream`, PyTorch's current one); the
//! per-row inputs and outputs are CPU tensors either way (the Python side stages them). A
//! vocab-parallel `group` splits the head's vocabulary.

use crate::args::{BOOL, F32, GradArrays, Grads, HeadArrays, HeadTensors, I64};
use crate::dist::VocabGroup;
use crate::front::{call_head, with_element};
use crate::losses::{agreed, vocab, vocab_split, write_f32, write_stats};
use crate::spec::Spec;
use crate::tensor::{Tensor, arg_error};
use flashloss::device::LogpCall;
use flashloss::fused::{FusedOptions, GatherIds, LogpOutput, LogpRequest, LogpRows, LogpUpstream};
use flashloss::{SupportFilter, Temperature};
use pyo3::exceptions::PyValueError;
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
        let filter = SupportFilter::of_caller(top_k, top_p, min_p)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
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
    (ids, mask): &(Bound<'py, PyAny>, Option<Bound<'py, PyAny>>),
    temperature: f64,
) -> PyResult<(Tensor<'py>, Option<Vec<bool>>, Temperature)> {
    let mask = mask.as_ref();
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
/// The arrays a log-prob call writes: `(out_logp, out_entropy [N] f32; out_lse, out_max,
/// out_sum_p2 [N], out_gathered [..., K], out_outside [N]: each where asked)`.
type LogpOuts<'py> = (
    Bound<'py, PyAny>,
    Bound<'py, PyAny>,
    Option<Bound<'py, PyAny>>,
    Option<Bound<'py, PyAny>>,
    Option<Bound<'py, PyAny>>,
    Option<Bound<'py, PyAny>>,
    Option<Bound<'py, PyAny>>,
);

/// Per-row `logp` and entropy of the head's logits divided by `spec`'s `temperature` at
/// `rows` `(ids, mask)`, and what the outputs ask (see [`LogpOuts`]): the candidates'
/// log-probs at `gather_ids`, a truncated support of `spec`'s `top_k`, `top_p`, `min_p`.
/// Two-pass within `spec`'s `budget_mib`.
#[pyfunction]
#[allow(clippy::too_many_arguments)] // the arrays by role, the spec, stream, group
#[pyo3(signature = (head, rows, outs, gather_ids, spec, stream=0, group=None))]
pub fn logp_linear<'py>(
    py: Python<'py>,
    head: HeadArrays<'py>,
    rows: (Bound<'py, PyAny>, Option<Bound<'py, PyAny>>),
    outs: LogpOuts<'py>,
    gather_ids: Option<&Bound<'py, PyAny>>,
    spec: &str,
    stream: usize,
    group: Option<&Bound<'py, PyAny>>,
) -> PyResult<()> {
    let group = VocabGroup::new(group)?;
    let parsed = (|| {
        let spec = Spec::parse(spec)?;
        let opts = spec.options()?.two_pass();
        let head = HeadTensors::of(&head)?;
        let (ids, mask, t) = logp_rows(&head, &rows, spec.f64("temperature")?)?;
        let extras = Extras::new(&ids, gather_ids, spec.filters())?;
        Ok((opts, head, ids, mask, t, extras))
    })();
    let (opts, head, ids, mask, temperature, extras) = agreed(py, group.as_ref(), parsed)?;
    let (out_logp, out_entropy, out_lse, out_max, out_sum_p2, out_gathered, out_outside) = outs;
    let seq_len = ids.shape.last().copied().unwrap_or(1);
    let rows = LogpRows {
        targets: ids.i64s()?,
        mask: mask.as_deref(),
        temperature,
    };
    let request = extras.request(out_sum_p2.is_some())?;
    let call = LogpCall::forward(rows, &opts, seq_len).request(&request);
    let split = vocab_split(py, group.as_ref(), &head)?;
    let call = LogpCall {
        vocab: vocab(&split),
        ..call
    };
    let out = with_element!(head.hidden.dtype, E => call_head::<E, _>(
        py, &head, None, stream, |d, h| d.logprobs(h, call),
    ))?;
    let mut logp = Tensor::new("out_logp", &out_logp, F32)?;
    write_stats(
        &out.stats,
        &mut logp,
        &mut Tensor::new("out_entropy", &out_entropy, F32)?,
    )?;
    write_support(&out, &mut logp, out_outside.as_ref())?;
    let extras = (out_lse.as_ref(), out_max.as_ref(), out_sum_p2.as_ref());
    write_extras(&out, (extras.0, extras.1, extras.2, out_gathered.as_ref()))
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
/// Σ_k grad_gathered_ik·logp_ik` of [`logp_linear`]'s outputs w.r.t. hidden, weight and
/// bias, added into `grads` (no `grad_weight`: a frozen head, dH alone). `upstream` is
/// `(grad_logp, grad_entropy, grad_lse, grad_gathered)` (`[N]` f32 each, `[..., K]` for
/// the candidates'; None: zero); `spec` has `temperature`, `mode`, `budget_mib` and the
/// filters.
#[pyfunction]
#[allow(clippy::too_many_arguments)] // the arrays by role, the spec, stream, group
#[pyo3(signature = (head, rows, upstream, grads, gather_ids, spec, stream=0, group=None))]
pub fn logp_linear_grads<'py>(
    py: Python<'py>,
    head: HeadArrays<'py>,
    rows: (Bound<'py, PyAny>, Option<Bound<'py, PyAny>>),
    upstream: LogpUpstreamArrays<'py>,
    grads: GradArrays<'py>,
    gather_ids: Option<&Bound<'py, PyAny>>,
    spec: &str,
    stream: usize,
    group: Option<&Bound<'py, PyAny>>,
) -> PyResult<()> {
    let group = VocabGroup::new(group)?;
    let (grad_logp, grad_entropy, grad_lse, grad_gathered) = &upstream;
    let parsed = (|| {
        let spec = Spec::parse(spec)?;
        let head = HeadTensors::of(&head)?;
        let (ids, mask, t) = logp_rows(&head, &rows, spec.f64("temperature")?)?;
        let extras = Extras::new(&ids, gather_ids, spec.filters())?;
        let grads = Grads::new(&head, &grads)?;
        let opts = FusedOptions {
            head_grad: grads.head_grad(),
            ..spec.options()?
        };
        let g_logp = Tensor::new("grad_logp", grad_logp, F32)?;
        let g_entropy = Tensor::optional("grad_entropy", grad_entropy.as_ref(), F32)?;
        let g_lse = Tensor::optional("grad_lse", grad_lse.as_ref(), F32)?;
        for g in [Some(&g_logp), g_entropy.as_ref(), g_lse.as_ref()]
            .into_iter()
            .flatten()
        {
            g.expect_shape(&ids.shape)?;
        }
        let g_gathered = Tensor::optional("grad_gathered", grad_gathered.as_ref(), F32)?;
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
    let call = LogpCall::grads(rows, upstream, &opts, seq_len).request(&request);
    let split = vocab_split(py, group.as_ref(), &head)?;
    let call = LogpCall {
        vocab: vocab(&split),
        ..call
    };
    with_element!(head.hidden.dtype, E => call_head::<E, _>(
        py, &head, Some(&mut grads), stream, |d, h| d.logprobs(h, call),
    ))?;
    Ok(())
}

/// The upstream gradients of a log-prob call: `(grad_logp, grad_entropy, grad_lse,
/// grad_gathered)`.
type LogpUpstreamArrays<'py> = (
    Bound<'py, PyAny>,
    Option<Bound<'py, PyAny>>,
    Option<Bound<'py, PyAny>>,
    Option<Bound<'py, PyAny>>,
);

/// The values of an optional f32 tensor.
fn optional_f32s<'a>(t: &'a Option<Tensor>) -> PyResult<Option<&'a [f32]>> {
    t.as_ref().map(|t| t.f32s()).transpose()
}

//! The arguments of the entry points, read from their tensors: the LM head
//! ([`HeadTensors`]), its f32 gradient buffers ([`Grads`]) and a GRPO step's per-token inputs
//! ([`BatchTensors`]), each checked (shape, dtype, device) with errors naming the
//! argument.

use crate::tensor::{DType, Tensor, arg_error};
use flashloss::fused::{HeadGrad, LinearGradsMut};
use flashloss::{Element, GrpoBatch, LinearInputs, PerSeqOrToken};
use half::{bf16, f16};
use pyo3::prelude::*;

type Any<'py> = Bound<'py, PyAny>;

/// A native call's LM head: `(hidden, weight, bias)`.
pub(crate) type HeadArrays<'py> = (Any<'py>, Any<'py>, Option<Any<'py>>);

/// The f32 buffers a call adds the head's gradients into: `(grad_hidden, grad_weight,
/// grad_bias)` (no `grad_weight`: a frozen head).
pub(crate) type GradArrays<'py> = (Any<'py>, Option<Any<'py>>, Option<Any<'py>>);

/// A GRPO step's per-token arrays: `(completion_ids, completion_mask, advantages,
/// old_per_token_logps, ref_per_token_logps, importance_sampling_ratio, policy_mask,
/// entropy_mask)`.
pub(crate) type BatchArrays<'py> = (
    Any<'py>,
    Any<'py>,
    Any<'py>,
    Option<Any<'py>>,
    Option<Any<'py>>,
    Option<Any<'py>>,
    Option<Any<'py>>,
    Option<Any<'py>>,
);

pub(crate) const FLOAT: &[DType] = &[DType::F32, DType::Bf16, DType::F16];
pub(crate) const F32: &[DType] = &[DType::F32];
pub(crate) const I64: &[DType] = &[DType::I64];
pub(crate) const BOOL: &[DType] = &[DType::Bool];

/// The kernels' element types, read from a tensor of that dtype.
pub(crate) trait TorchElement: Element {
    fn slice<'a>(t: &'a Tensor) -> PyResult<&'a [Self]>;

    /// # Safety
    /// As [`Tensor::f32s_mut`].
    unsafe fn slice_mut<'a>(t: &'a mut Tensor) -> PyResult<&'a mut [Self]>;
}

impl TorchElement for f32 {
    fn slice<'a>(t: &'a Tensor) -> PyResult<&'a [f32]> {
        t.f32s()
    }

    unsafe fn slice_mut<'a>(t: &'a mut Tensor) -> PyResult<&'a mut [f32]> {
        // SAFETY: the caller's promise.
        unsafe { t.f32s_mut() }
    }
}

impl TorchElement for bf16 {
    fn slice<'a>(t: &'a Tensor) -> PyResult<&'a [bf16]> {
        t.bf16s()
    }

    unsafe fn slice_mut<'a>(t: &'a mut Tensor) -> PyResult<&'a mut [bf16]> {
        // SAFETY: the caller's promise.
        unsafe { t.bf16s_mut() }
    }
}

impl TorchElement for f16 {
    fn slice<'a>(t: &'a Tensor) -> PyResult<&'a [f16]> {
        t.f16s()
    }

    unsafe fn slice_mut<'a>(t: &'a mut Tensor) -> PyResult<&'a mut [f16]> {
        // SAFETY: the caller's promise.
        unsafe { t.f16s_mut() }
    }
}

/// The LM head: `hidden` `[..., H]` and `weight` `[V, H]` of one dtype, `bias` `[V]`.
pub(crate) struct HeadTensors<'py> {
    pub(crate) hidden: Tensor<'py>,
    pub(crate) weight: Tensor<'py>,
    pub(crate) bias: Option<Tensor<'py>>,
    pub(crate) tokens: usize,
    pub(crate) hidden_size: usize,
    pub(crate) vocab: usize,
}

impl<'py> HeadTensors<'py> {
    pub(crate) fn of(head: &HeadArrays<'py>) -> PyResult<Self> {
        Self::new(&head.0, &head.1, head.2.as_ref())
    }

    pub(crate) fn new(
        hidden: &Bound<'py, PyAny>,
        weight: &Bound<'py, PyAny>,
        bias: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Self> {
        let hidden = Tensor::new("hidden", hidden, FLOAT)?;
        let weight = Tensor::new("weight", weight, FLOAT)?;
        let bias = Tensor::optional("bias", bias, FLOAT)?;
        if weight.shape.len() != 2 {
            return Err(arg_error(
                "weight",
                format!("expected shape [V, H], got {:?}", weight.shape),
            ));
        }
        let (vocab, hidden_size) = (weight.shape[0], weight.shape[1]);
        if hidden.shape.last() != Some(&hidden_size) {
            return Err(arg_error(
                "hidden",
                format!(
                    "expected shape [..., H={hidden_size}] (H from weight [V, H]), got {:?}",
                    hidden.shape
                ),
            ));
        }
        if weight.dtype != hidden.dtype {
            return Err(arg_error(
                "weight",
                format!(
                    "dtype {:?} differs from hidden's {:?}",
                    weight.dtype, hidden.dtype
                ),
            ));
        }
        if let Some(b) = &bias {
            // The CPU reads the bias in the head's dtype, the GPU kernels in f32 (the
            // Python side widens it: `flashloss.torch`).
            let want = if hidden.cuda.is_some() {
                DType::F32
            } else {
                hidden.dtype
            };
            if b.dtype != want {
                let reason = match hidden.cuda {
                    Some(_) => format!("on a GPU the kernels read it in F32, got {:?}", b.dtype),
                    None => format!("dtype {:?} differs from hidden's {want:?}", b.dtype),
                };
                return Err(arg_error("bias", reason));
            }
        }
        if let Some(b) = &bias {
            b.expect_shape(&[vocab])?;
        }
        Ok(HeadTensors {
            tokens: hidden.numel() / hidden_size.max(1),
            hidden,
            weight,
            bias,
            hidden_size,
            vocab,
        })
    }

    pub(crate) fn inputs<E: TorchElement>(&self) -> PyResult<LinearInputs<'_, E>> {
        Ok(LinearInputs {
            hidden: E::slice(&self.hidden)?,
            weight: E::slice(&self.weight)?,
            layout: flashloss::WeightLayout::VocabMajor,
            bias: self.bias.as_ref().map(E::slice).transpose()?,
            tokens: self.tokens,
            hidden_size: self.hidden_size,
            vocab: self.vocab,
        })
    }
}

fn device_mismatch(t: &Tensor, hidden: &Tensor) -> String {
    let name = |d: Option<usize>| d.map_or("cpu".to_string(), |o| format!("cuda:{o}"));
    format!(
        "is on {} but `hidden` is on {}",
        name(t.cuda),
        name(hidden.cuda)
    )
}

/// f32 gradient tensors shaped like the head's inputs: `grad_hidden`, and for a
/// trainable head `grad_weight` and `grad_bias` (iff `bias`); a frozen head has neither
/// (`grad_weight` None).
pub(crate) struct Grads<'py> {
    pub(crate) hidden: Tensor<'py>,
    pub(crate) weight: Option<Tensor<'py>>,
    pub(crate) bias: Option<Tensor<'py>>,
}

impl<'py> Grads<'py> {
    pub(crate) fn new(
        head: &HeadTensors,
        (hidden, weight, bias): &GradArrays<'py>,
    ) -> PyResult<Self> {
        let (weight, bias) = (weight.as_ref(), bias.as_ref());
        let g = Grads {
            hidden: Tensor::new("grad_hidden", hidden, F32)?,
            weight: Tensor::optional("grad_weight", weight, F32)?,
            bias: Tensor::optional("grad_bias", bias, F32)?,
        };
        for t in std::iter::once(&g.hidden).chain(&g.weight).chain(&g.bias) {
            if t.cuda != head.hidden.cuda {
                return Err(arg_error(t.arg, device_mismatch(t, &head.hidden)));
            }
        }
        g.hidden.expect_shape(&head.hidden.shape)?;
        if let Some(gw) = &g.weight {
            gw.expect_shape(&head.weight.shape)?;
        }
        match (&g.bias, &head.bias, &g.weight) {
            (Some(gb), Some(b), Some(_)) => gb.expect_shape(&b.shape)?,
            (None, None, _) | (None, Some(_), None) => {}
            (Some(_), _, None) => {
                return Err(arg_error(
                    "grad_bias",
                    "given without grad_weight (a frozen head has neither)",
                ));
            }
            _ => return Err(arg_error("grad_bias", "given exactly when bias is")),
        }
        Ok(g)
    }

    /// Which of the head's gradients these buffers hold: frozen without `grad_weight`.
    pub(crate) fn head_grad(&self) -> HeadGrad {
        match self.weight {
            Some(_) => HeadGrad::Full,
            None => HeadGrad::Frozen,
        }
    }

    /// # Safety
    /// The gradient tensors must not alias each other or any input.
    pub(crate) unsafe fn view(&mut self) -> PyResult<LinearGradsMut<'_>> {
        // SAFETY: the caller's promise.
        unsafe {
            Ok(LinearGradsMut {
                dhidden: self.hidden.f32s_mut()?,
                dweight: match self.weight.as_mut() {
                    Some(w) => w.f32s_mut()?,
                    None => &mut [],
                },
                dbias: self.bias.as_mut().map(|b| b.f32s_mut()).transpose()?,
            })
        }
    }
}

/// Per-sequence `[B]` or `[B, 1]` (TRL's shape for its `sequence_*` importance-sampling
/// modes and its unsqueezed advantages), or per-token `[B, T]` f32 values.
fn per_seq_or_token<'a>(t: &'a Tensor, b: usize, n: usize) -> PyResult<PerSeqOrToken<'a>> {
    let v = t.f32s()?;
    match t.shape[..] {
        [rows] | [rows, 1] if rows == b => Ok(PerSeqOrToken::Sequence(v)),
        [_, _] if v.len() == n && t.shape[0] == b => Ok(PerSeqOrToken::Token(v)),
        _ => Err(arg_error(
            t.arg,
            format!(
                "expected shape [B={b}], [B, 1] or [B, T] with B·T = {n}, got {:?}",
                t.shape
            ),
        )),
    }
}

/// The per-token inputs of a GRPO step, borrowed from their tensors.
pub(crate) struct BatchTensors<'py> {
    pub(crate) ids: Tensor<'py>,
    pub(crate) mask: Vec<bool>,
    pub(crate) advantages: Tensor<'py>,
    pub(crate) old_logp: Option<Tensor<'py>>,
    pub(crate) ref_logp: Option<Tensor<'py>>,
    pub(crate) sampler_ratio: Option<Tensor<'py>>,
    pub(crate) policy_mask: Option<Vec<bool>>,
    pub(crate) entropy_mask: Option<Vec<bool>>,
}

impl<'py> BatchTensors<'py> {
    pub(crate) fn new(arrays: &BatchArrays<'py>) -> PyResult<Self> {
        let (ids, mask, advantages) = (&arrays.0, &arrays.1, &arrays.2);
        let (old_logp, ref_logp, sampler_ratio) =
            (arrays.3.as_ref(), arrays.4.as_ref(), arrays.5.as_ref());
        let (policy_mask, entropy_mask) = (arrays.6.as_ref(), arrays.7.as_ref());
        let ids = Tensor::new("completion_ids", ids, I64)?;
        if ids.shape.len() != 2 {
            return Err(arg_error(
                "completion_ids",
                format!("expected shape [B, T], got {:?}", ids.shape),
            ));
        }
        let mask_t = Tensor::new("completion_mask", mask, BOOL)?;
        mask_t.expect_shape(&ids.shape)?;
        let per_token = |arg, t: Option<&Bound<'py, PyAny>>| -> PyResult<Option<Tensor<'py>>> {
            let t = Tensor::optional(arg, t, F32)?;
            if let Some(t) = &t {
                t.expect_shape(&ids.shape)?;
            }
            Ok(t)
        };
        let token_mask = |arg, t: Option<&Bound<'py, PyAny>>| -> PyResult<Option<Vec<bool>>> {
            let Some(t) = Tensor::optional(arg, t, BOOL)? else {
                return Ok(None);
            };
            t.expect_shape(&ids.shape)?;
            t.bools().map(Some)
        };
        Ok(BatchTensors {
            policy_mask: token_mask("policy_mask", policy_mask)?,
            entropy_mask: token_mask("entropy_mask", entropy_mask)?,
            mask: mask_t.bools()?,
            advantages: Tensor::new("advantages", advantages, F32)?,
            old_logp: per_token("old_per_token_logps", old_logp)?,
            ref_logp: per_token("ref_per_token_logps", ref_logp)?,
            sampler_ratio: Tensor::optional("importance_sampling_ratio", sampler_ratio, F32)?,
            ids,
        })
    }

    pub(crate) fn batch(&self) -> PyResult<GrpoBatch<'_>> {
        let (b, t) = (self.ids.shape[0], self.ids.shape[1]);
        Ok(GrpoBatch {
            batch: b,
            seq_len: t,
            target_ids: self.ids.i64s()?,
            mask: &self.mask,
            advantages: per_seq_or_token(&self.advantages, b, b * t)?,
            old_logp: self.old_logp.as_ref().map(|t| t.f32s()).transpose()?,
            ref_logp: self.ref_logp.as_ref().map(|t| t.f32s()).transpose()?,
            sampler_ratio: self
                .sampler_ratio
                .as_ref()
                .map(|r| per_seq_or_token(r, b, b * t))
                .transpose()?,
            policy_mask: self.policy_mask.as_deref(),
            entropy_mask: self.entropy_mask.as_deref(),
        })
    }
}

//! The fused LM-head's buffers on the device: the head ([`GpuInputs`]), its gradients in
//! f32 ([`GpuGrads`]), and the cuBLAS handle with the logits and `dZ` tiles
//! ([`GpuWorkspace`]), kept across calls as a training loop would. Every allocation goes
//! through [`Gpu`]'s accounting; new tiles are poisoned with NaN.

use super::blas::{CUBLAS_WORKSPACE_BYTES, GemmShape, Operand, gemm};
use super::device::{DeviceBuffer, Gpu, GpuElement, device_error};
use crate::batch::{HeadShape, LinearInputs};
use crate::error::{Error, Result};
use crate::fused::{HeadGrad, LinearGrads, Plan, check_grad_lens};
use crate::weight_layout::WeightLayout;
use cudarc::cublas::CudaBlas;
use half::bf16;

/// An LM head on the device: hidden states `[N, H]`, weight `[V, H]` (row-major, in
/// `E`), bias `[V]` (widened to f32).
pub struct GpuInputs<E> {
    /// `[N, H]`.
    pub hidden: DeviceBuffer<E>,
    /// `[V, H]`, or `[H, V]` (`layout`).
    pub weight: DeviceBuffer<E>,
    /// `[V]`.
    pub bias: Option<DeviceBuffer<f32>>,
    /// N.
    pub tokens: usize,
    /// H.
    pub hidden_size: usize,
    /// V.
    pub vocab: usize,
    /// How `weight` (and `dW`) are laid out.
    pub layout: WeightLayout,
}

impl<E> GpuInputs<E> {
    /// `(N, H, V)`.
    pub fn shape(&self) -> HeadShape {
        HeadShape {
            tokens: self.tokens,
            hidden_size: self.hidden_size,
            vocab: self.vocab,
        }
    }
}

impl<E: GpuElement> GpuInputs<E> {
    /// The weight from vocabulary entry `j` on as a cuBLAS operand: row `j` of `[V, H]`,
    /// column `j` of `[H, V]`.
    pub(crate) fn weight_from(&self, gpu: &Gpu, j: usize) -> Operand {
        let at = match self.layout {
            WeightLayout::VocabMajor => j * self.hidden_size,
            WeightLayout::HiddenMajor => j,
        };
        Operand {
            addr: gpu.addr(&self.weight, at),
            dtype: E::BLAS_TYPE,
        }
    }

    /// The hidden states from row `r` on as a cuBLAS operand.
    pub(crate) fn hidden_from(&self, gpu: &Gpu, r: usize) -> Operand {
        Operand {
            addr: gpu.addr(&self.hidden, r * self.hidden_size),
            dtype: E::BLAS_TYPE,
        }
    }

    /// `Z[rows, vt] = H[rows]·W[vocab]ᵀ` (row stride `ldz`) with `A` the weight
    /// ([`GpuInputs::weight_from`]) and `B` the hidden states, in this head's layout.
    pub(crate) fn logits_shape(&self, rows: usize, vt: usize, ldz: usize) -> GemmShape {
        let h = self.hidden_size;
        match self.layout {
            WeightLayout::VocabMajor => GemmShape::logits(rows, vt, h, ldz),
            WeightLayout::HiddenMajor => GemmShape::logits_hv(rows, vt, h, ldz, self.vocab),
        }
    }

    /// `dH[rows] += dZ[rows, vt]·W[vocab]` with `A` the weight and `B` `dZ`.
    pub(crate) fn dhidden_shape(&self, rows: usize, vt: usize, ldz: usize) -> GemmShape {
        let h = self.hidden_size;
        match self.layout {
            WeightLayout::VocabMajor => GemmShape::dhidden(rows, vt, h, ldz),
            WeightLayout::HiddenMajor => GemmShape::dhidden_hv(rows, vt, h, ldz, self.vocab),
        }
    }

    /// Checks `inputs` on the host (shapes, finite values) and copies them to the device.
    pub fn upload(gpu: &Gpu, inputs: &LinearInputs<E>) -> Result<Self> {
        inputs.validate()?;
        let bias = match inputs.bias {
            Some(b) => Some(gpu.upload(&b.iter().map(|x| x.to_f32()).collect::<Vec<_>>())?),
            None => None,
        };
        Ok(GpuInputs {
            hidden: gpu.upload(inputs.hidden)?,
            weight: gpu.upload(inputs.weight)?,
            bias,
            tokens: inputs.tokens,
            hidden_size: inputs.hidden_size,
            vocab: inputs.vocab,
            layout: inputs.layout,
        })
    }
}

/// Gradients of a head on the device, accumulated in f32.
pub struct GpuGrads {
    /// `dH` `[N, H]`.
    pub dhidden: DeviceBuffer<f32>,
    /// `dW` in the weight's layout (none for a frozen head).
    pub dweight: Option<DeviceBuffer<f32>>,
    /// `dbias` `[V]` (when the head has a bias and is not frozen).
    pub dbias: Option<DeviceBuffer<f32>>,
}

impl GpuGrads {
    /// Zeroed gradients for `head`'s shapes: dH, and dW and dbias as `head_grad` forms
    /// them.
    pub fn zeros<E>(gpu: &Gpu, head: &GpuInputs<E>, head_grad: HeadGrad) -> Result<Self> {
        let (n, h, v) = (head.tokens, head.hidden_size, head.vocab);
        let full = head_grad.has_dweight();
        Ok(GpuGrads {
            dhidden: gpu.zeros(n * h)?,
            dweight: if full { Some(gpu.zeros(v * h)?) } else { None },
            dbias: match head.bias {
                Some(_) if full => Some(gpu.zeros(v)?),
                _ => None,
            },
        })
    }

    /// Host copies (an empty `dweight` for a frozen head).
    pub fn download(&self, gpu: &Gpu) -> Result<LinearGrads> {
        Ok(LinearGrads {
            dhidden: gpu.download(&self.dhidden)?,
            dweight: match &self.dweight {
                Some(d) => gpu.download(d)?,
                None => Vec::new(),
            },
            dbias: match &self.dbias {
                Some(d) => Some(gpu.download(d)?),
                None => None,
            },
        })
    }

    /// Checks that the buffers match `head`'s shapes (and bias presence) for
    /// `head_grad`.
    pub fn check<E>(&self, head: &GpuInputs<E>, head_grad: HeadGrad) -> Result<()> {
        check_grad_lens(
            head.shape(),
            (head.layout, head_grad),
            head.bias.is_some(),
            self.dhidden.len(),
            self.dweight.as_ref().map_or(0, DeviceBuffer::len),
            self.dbias.as_ref().map(DeviceBuffer::len),
        )
    }
}

/// The cuBLAS handle with its (counted) workspace, and the logits and `dZ` tiles, kept
/// across calls as a training loop would. New tiles are poisoned with NaN.
pub struct GpuWorkspace {
    pub(crate) blas: CudaBlas,
    _blas_workspace: DeviceBuffer<u8>,
    pub(crate) logits: Option<DeviceBuffer<f32>>,
    pub(crate) dz: Option<DeviceBuffer<bf16>>,
}

impl GpuWorkspace {
    /// A cuBLAS handle on the GPU's stream with a workspace of
    /// [`CUBLAS_WORKSPACE_BYTES`] allocated through the GPU's accounting.
    pub fn new(gpu: &Gpu) -> Result<Self> {
        let blas =
            CudaBlas::new(gpu.stream().clone()).map_err(|e| device_error("cublasCreate", e))?;
        let workspace = gpu.zeros::<u8>(CUBLAS_WORKSPACE_BYTES)?;
        let addr = gpu.addr(&workspace, 0);
        // SAFETY: the workspace outlives the handle's use of it (both live in `self`,
        // and the handle is only used through `self`).
        unsafe {
            cudarc::cublas::sys::cublasSetWorkspace_v2(
                *blas.handle(),
                addr as *mut std::ffi::c_void,
                CUBLAS_WORKSPACE_BYTES,
            )
        }
        .result()
        .map_err(|e| device_error("cublasSetWorkspace", e))?;
        Ok(GpuWorkspace {
            blas,
            _blas_workspace: workspace,
            logits: None,
            dz: None,
        })
    }

    /// Issues the handle's products on `gpu`'s stream (the device's own, or a caller's
    /// borrowed for one call).
    pub(crate) fn bind(&mut self, gpu: &Gpu) -> Result<()> {
        // SAFETY: the stream outlives the calls made on it: the device's own stream
        // lives as long as the device, and a borrowed one is re-bound to the device's
        // own before the call that borrowed it returns.
        unsafe { self.blas.set_stream(gpu.stream().clone()) }
            .map_err(|e| device_error("cublasSetStream", e))
    }

    /// Bytes of tiles held (the cuBLAS workspace aside).
    pub fn bytes(&self) -> usize {
        self.logits.as_ref().map_or(0, |b| 4 * b.len())
            + self.dz.as_ref().map_or(0, |b| 2 * b.len())
    }

    /// Lets the tiles go (the next [`GpuWorkspace::prepare`] makes new ones): a call
    /// whose buffers are lent for its length keeps none past it.
    pub(crate) fn release_tiles(&mut self) {
        self.logits = None;
        self.dz = None;
    }

    /// Tiles for `plan`, `[block_rows, cols]` each: f32 logits, and a bf16 `dZ` tile for
    /// bf16 heads; a compact plan's bf16 chunk alone, which holds the logits and then
    /// `dZ` in place. Buffers of another size are replaced by NaN-poisoned ones.
    pub(crate) fn prepare(
        &mut self,
        gpu: &Gpu,
        plan: &Plan,
        vocab: usize,
        bf16_dz: bool,
    ) -> Result<()> {
        let need = plan.block_rows * plan.block_cols(vocab);
        let logits_need = (!plan.compact).then_some(need);
        if self.logits.as_ref().map(DeviceBuffer::len) != logits_need {
            self.logits = None;
            if let Some(len) = logits_need {
                self.logits = Some(gpu.nans(len)?);
            }
        }
        let dz_need = (bf16_dz || plan.compact).then_some(need);
        if self.dz.as_ref().map(DeviceBuffer::len) != dz_need {
            self.dz = None;
            if let Some(len) = dz_need {
                self.dz = Some(gpu.nans(len)?);
            }
        }
        Ok(())
    }
}

/// The whole `[N, V]` f32 logits `hidden · weightᵀ` of `head` into `out` (one cuBLAS
/// product: the GEMM rate the fused kernels are measured against).
pub fn head_logits<E: GpuElement>(
    gpu: &Gpu,
    head: &GpuInputs<E>,
    ws: &GpuWorkspace,
    out: &mut DeviceBuffer<f32>,
) -> Result<()> {
    let (n, v) = (head.tokens, head.vocab);
    if out.len() != n * v {
        return Err(Error::ShapeMismatch {
            arg: "logits",
            shape: format!("[N={n}, V={v}]"),
            expected: n * v,
            actual: out.len(),
        });
    }
    gemm(
        &ws.blas,
        head.logits_shape(n, v, v),
        head.weight_from(gpu, 0),
        head.hidden_from(gpu, 0),
        Operand::f32(gpu.addr(out, 0)),
        0.0,
    )
}

/// The error of a pass that adds gradients on a head made without gradient buffers.
pub(crate) fn no_grads() -> Error {
    Error::InvalidArgument {
        arg: "grads",
        reason: "this head has no gradient buffers (a log-prob head)".into(),
    }
}

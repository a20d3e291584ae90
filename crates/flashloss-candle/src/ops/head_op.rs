//! What the fused ops share: the process's CPU device, candle's errors and storage views,
//! the saved gradients, and [`HeadOp`], the `CustomOp2` of a head loss (a leaf below the
//! ops).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor, WithDType};
use flashloss::{Device, Element};
use std::sync::{Arc, LazyLock, Mutex};

/// The CPU device the ops run on (one per process: its workspace is kept between
/// steps).
pub fn device() -> &'static Device {
    static CPU: LazyLock<Device> = LazyLock::new(Device::cpu);
    &CPU
}

/// A flashloss error as a candle error (keeps the message: argument, shape, index).
pub fn wrap(e: flashloss::Error) -> candle_core::Error {
    candle_core::Error::wrap(e)
}

/// The elements of a contiguous CPU storage, or an error naming `arg`.
pub fn contiguous<'a, E: WithDType>(
    storage: &'a CpuStorage,
    layout: &Layout,
    arg: &str,
) -> Result<&'a [E]> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle_core::bail!("{arg}: must be contiguous (call .contiguous() first)")
    };
    Ok(&storage.as_slice::<E>()?[start..end])
}

/// `(rows, cols)` of a rank-2 layout, or an error naming `arg`.
pub(crate) fn matrix_dims(layout: &Layout, arg: &str) -> Result<(usize, usize)> {
    match layout.dims() {
        &[r, c] => Ok((r, c)),
        d => candle_core::bail!("{arg}: expected a matrix [rows, cols], got shape {d:?}"),
    }
}

/// `(dhidden, dweight)` of a forward, once computed.
type GradPair = Option<(Vec<f32>, Vec<f32>)>;

/// Gradients that the forward computed and the backward hands out once, scaled.
#[derive(Default)]
pub(crate) struct SavedGrads(Arc<Mutex<GradPair>>);

impl SavedGrads {
    pub(crate) fn store(&self, dhidden: Vec<f32>, dweight: Vec<f32>) {
        *self.0.lock().expect("saved grads lock") = Some((dhidden, dweight));
    }

    /// `(grad_res · dhidden, grad_res · dweight)` as tensors shaped and typed like
    /// `hidden` and `weight`. The saved gradients are taken (freed): a second backward
    /// through the same forward is an error.
    pub(crate) fn take_scaled(
        &self,
        op: &str,
        hidden: &Tensor,
        weight: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let Some((dh, dw)) = self.0.lock().expect("saved grads lock").take() else {
            candle_core::bail!("{op}: backward called twice on one forward")
        };
        let g = grad_res.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        let as_arg = |d: Vec<f32>, arg: &Tensor| -> Result<Tensor> {
            Tensor::from_vec(d, arg.shape(), arg.device())?
                .affine(g, 0.0)?
                .to_dtype(arg.dtype())
        };
        Ok((Some(as_arg(dh, hidden)?), Some(as_arg(dw, weight)?)))
    }
}

/// Runs `f` on the storages as `f32` or `bf16` slices (both the same dtype).
pub(crate) fn with_elements<R>(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
    f: impl FnOnce(Either<'_>) -> Result<R>,
) -> Result<R> {
    match (s1, s2) {
        (CpuStorage::F32(_), CpuStorage::F32(_)) => f(Either::F32(
            contiguous(s1, l1, "hidden")?,
            contiguous(s2, l2, "weight")?,
        )),
        (CpuStorage::BF16(_), CpuStorage::BF16(_)) => f(Either::BF16(
            contiguous(s1, l1, "hidden")?,
            contiguous(s2, l2, "weight")?,
        )),
        _ => candle_core::bail!(
            "hidden and weight: must both be f32 or both bf16, got {:?} and {:?}",
            s1.dtype(),
            s2.dtype()
        ),
    }
}

/// Hidden and weight slices of one element type.
pub(crate) enum Either<'a> {
    F32(&'a [f32], &'a [f32]),
    BF16(&'a [half::bf16], &'a [half::bf16]),
}

/// `LinearInputs` over `(hidden [n, h], weight [v, h])`, no bias.
pub(crate) fn linear_inputs<'a, E: Element>(
    hidden: &'a [E],
    weight: &'a [E],
    n: usize,
    h: usize,
    v: usize,
) -> flashloss::LinearInputs<'a, E> {
    flashloss::LinearInputs {
        hidden,
        weight,
        layout: flashloss::WeightLayout::VocabMajor,
        bias: None,
        tokens: n,
        hidden_size: h,
        vocab: v,
    }
}

/// A fused LM-head loss: from `hidden [n, h]` and `weight [v, h]` slices to the loss,
/// storing `∂L/∂hidden` and `∂L/∂weight` in `grads`.
pub(crate) trait HeadLoss {
    /// The op's name in candle errors.
    const NAME: &'static str;

    fn run<E: Element>(
        &self,
        inputs: &flashloss::LinearInputs<E>,
        grads: &SavedGrads,
    ) -> Result<f32>;
}

/// The candle op of a [`HeadLoss`]: a scalar f32 output whose backward hands out the
/// saved gradients scaled by the upstream gradient.
pub(crate) struct HeadOp<K> {
    pub(crate) loss: K,
    pub(crate) grads: SavedGrads,
}

impl<K: HeadLoss> CustomOp2 for HeadOp<K> {
    fn name(&self) -> &'static str {
        K::NAME
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (n, h) = matrix_dims(l1, "hidden")?;
        let (v, h2) = matrix_dims(l2, "weight")?;
        if h != h2 {
            candle_core::bail!("weight: hidden size {h2} does not match hidden's [N={n}, H={h}]")
        }
        let loss = with_elements(s1, l1, s2, l2, |e| match e {
            Either::F32(x, w) => self.loss.run(&linear_inputs(x, w, n, h, v), &self.grads),
            Either::BF16(x, w) => self.loss.run(&linear_inputs(x, w, n, h, v), &self.grads),
        })?;
        Ok((CpuStorage::F32(vec![loss]), Shape::from(())))
    }

    fn bwd(
        &self,
        hidden: &Tensor,
        weight: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        self.grads.take_scaled(K::NAME, hidden, weight, grad_res)
    }
}

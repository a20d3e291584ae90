//! The fused linear cross-entropy as a candle `CustomOp2` on `(hidden, weight)`.

use super::{Either, SavedGrads, linear_inputs, matrix_dims, with_elements, wrap};
use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};
use flashloss::cpu::{FusedOptions, ce_linear as kernel};
use flashloss::{CrossEntropy, Element, Reduction};

struct FusedCeLinear {
    ce: CrossEntropy,
    targets: Vec<i64>,
    budget_bytes: usize,
    grads: SavedGrads,
}

impl FusedCeLinear {
    fn run<E: Element>(
        &self,
        hidden: &[E],
        weight: &[E],
        n: usize,
        h: usize,
        v: usize,
    ) -> Result<f32> {
        let opts = FusedOptions {
            budget_bytes: self.budget_bytes,
            ..FusedOptions::default()
        };
        let out = kernel(
            &self.ce,
            &self.targets,
            &linear_inputs(hidden, weight, n, h, v),
            &opts,
        )
        .map_err(wrap)?;
        self.grads.store(out.grads.dhidden, out.grads.dweight);
        Ok(out.loss as f32)
    }
}

impl CustomOp2 for FusedCeLinear {
    fn name(&self) -> &'static str {
        "flashloss-ce-linear"
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
            Either::F32(x, w) => self.run(x, w, n, h, v),
            Either::BF16(x, w) => self.run(x, w, n, h, v),
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
        self.grads
            .take_scaled(self.name(), hidden, weight, grad_res)
    }
}

/// The cross-entropy of logits `hidden · weightᵀ` (hidden `[N, H]`, weight `[V, H]`)
/// at `targets` `[N]` (rows at `ignore_index` take no part), reduced by mean or sum,
/// as a scalar f32 tensor that backpropagates into both. Reduction `none` is not an
/// op output: use the kernel (`flashloss::cpu::ce_linear_into`) with per-row gradients.
pub fn ce_linear(
    hidden: &Tensor,
    weight: &Tensor,
    ce: &CrossEntropy,
    targets: Vec<i64>,
    budget_bytes: usize,
) -> Result<Tensor> {
    if ce.config().reduction == Reduction::None {
        candle_core::bail!("ce.reduction: the candle op returns a scalar; use mean or sum")
    }
    let op = FusedCeLinear {
        ce: ce.clone(),
        targets,
        budget_bytes,
        grads: SavedGrads::default(),
    };
    hidden.contiguous()?.apply_op2(&weight.contiguous()?, op)
}

//! [`CudaHead`]: an LM head in device memory, the GPU's [`Head`]: it validates the
//! head's buffers on the device, plans (`plan.rs`), makes the passes (`passes.rs`) and
//! sums gradients over a collective (through the host).

use super::device::{DeviceBuffer, Gpu, GpuElement, device_error};
use super::head::{GpuGrads, GpuInputs, GpuWorkspace, no_grads};
use super::passes::GpuPasses;
use super::plan::{materialized_plan, plan_on_device};
use crate::batch::HeadShape;
use crate::collective::Collective;
use crate::error::{Error, Result};
use crate::fused::{FusedOptions, FusedPasses, GradPart, Head, HeadGrad, Plan};
use crate::gpu_plan::CallShape;
use crate::range::grad_out_of_range;
use crate::rows::RowInputs;

/// Checks that every entry of the head's hidden states, weight and bias is finite: one
/// scan each, their answers down in one copy (a second copy, of the first bad value,
/// only for the error).
fn check_finite<E: GpuElement>(gpu: &Gpu, head: &GpuInputs<E>) -> Result<()> {
    let mut scans = vec![gpu.scan(&head.hidden), gpu.scan(&head.weight)];
    scans.extend(head.bias.as_ref().map(|b| gpu.scan(b)));
    let found = gpu.first_non_finite_of(&scans)?;
    let bad = |arg, index, value: f32| {
        Err(Error::NonFinite {
            arg,
            index,
            value: value as f64,
        })
    };
    if let Some(index) = found[0] {
        return bad("hidden", index, gpu.value_at(&head.hidden, index)?.to_f32());
    }
    if let Some(index) = found[1] {
        return bad("weight", index, gpu.value_at(&head.weight, index)?.to_f32());
    }
    match (&head.bias, found.get(2).copied().flatten()) {
        (Some(b), Some(index)) => bad("bias", index, gpu.value_at(b, index)?),
        _ => Ok(()),
    }
}

/// An LM head in device memory with its gradients (added into, in f32) and a
/// workspace kept across steps: the GPU's [`Head`]. The per-row inputs stay on the
/// host; the per-row loss stages run there between the device passes.
pub struct CudaHead<'a, E> {
    /// The GPU.
    pub gpu: &'a Gpu,
    /// Hidden states, weight, bias.
    pub head: &'a GpuInputs<E>,
    /// The cuBLAS handle and tiles.
    pub ws: &'a mut GpuWorkspace,
    /// Where the gradients are added (none for a loss without gradients, e.g. log-probs).
    pub grads: Option<&'a mut GpuGrads>,
    /// Run [`materialized_plan`] (the unfused baseline) instead of planning to the budget.
    pub materialized: bool,
}

impl<E: GpuElement> Head for CudaHead<'_, E> {
    fn shape(&self) -> HeadShape {
        self.head.shape()
    }

    fn validate(&self, grads: Option<HeadGrad>) -> Result<()> {
        let head = self.head;
        check_finite(self.gpu, head)?;
        match (&self.grads, grads) {
            (Some(g), Some(head_grad)) => g.check(head, head_grad),
            (None, Some(_)) => Err(no_grads()),
            (_, None) => Ok(()),
        }
    }

    fn check_grads(&self, seq_len: usize) -> Result<()> {
        let Some(g) = &self.grads else {
            return Ok(());
        };
        let h = self.head.hidden_size;
        let bufs: Vec<(&'static str, &DeviceBuffer<f32>)> =
            std::iter::once(("dhidden", &g.dhidden))
                .chain(g.dweight.as_ref().map(|w| ("dweight", w)))
                .chain(g.dbias.as_ref().map(|b| ("dbias", b)))
                .collect();
        // Every buffer scanned, the answers down in one copy.
        let scans: Vec<_> = bufs.iter().map(|(_, b)| self.gpu.scan(*b)).collect();
        let found = self.gpu.first_non_finite_of(&scans)?;
        for ((quantity, buf), k) in bufs.into_iter().zip(found) {
            if let Some(k) = k {
                let value = self.gpu.value_at(buf, k)?;
                return Err(grad_out_of_range(quantity, k, value, h, seq_len));
            }
        }
        Ok(())
    }

    fn plan(&self, opts: &FusedOptions, single_pass_allowed: bool) -> Result<Plan> {
        let (n, v) = (self.head.tokens, self.head.vocab);
        if self.materialized {
            return Ok(materialized_plan(n, v, E::DTYPE));
        }
        // A call without a budget plans from the device's free memory, its arguments and
        // gradient buffers already allocated.
        let shape = CallShape {
            n,
            h: self.head.hidden_size,
            v,
            dtype: E::DTYPE,
            grads: self.grads.as_ref().map(|_| opts.head_grad),
        };
        plan_on_device(self.gpu, &shape, opts, single_pass_allowed)
    }

    fn passes<'s>(
        &'s mut self,
        rows: RowInputs<'s>,
        plan: Plan,
    ) -> Result<Box<dyn FusedPasses + 's>> {
        let passes = GpuPasses::new(
            self.gpu,
            self.head,
            rows,
            plan,
            &mut *self.ws,
            self.grads.as_deref_mut(),
        )?;
        Ok(Box::new(passes))
    }

    fn all_reduce(&mut self, comm: &dyn Collective, part: GradPart) -> Result<()> {
        let gpu = self.gpu;
        let grads = self.grads.as_deref_mut().ok_or_else(no_grads)?;
        let bufs = match part {
            GradPart::Hidden => vec![&mut grads.dhidden],
            GradPart::Head => grads
                .dweight
                .iter_mut()
                .chain(grads.dbias.as_mut())
                .collect(),
        };
        for buf in bufs {
            let mut host = gpu.download(buf)?;
            comm.all_reduce_sum_f32(&mut host)?;
            gpu.stream()
                .memcpy_htod(&host, buf.slice_mut())
                .map_err(|e| device_error("copying summed gradients to the device", e))?;
        }
        gpu.synchronize()
    }
}

//! [`CudaHead`]: an LM head in device memory, the GPU's [`Head`]: it validates the
//! head's buffers on the device, plans (`plan.rs`), makes the passes (`passes.rs`) and
//! sums gradients over a collective (through the host).

use super::device::{DeviceBuffer, Gpu, GpuElement, device_error};
use super::head::{GpuGrads, GpuInputs, GpuWorkspace, no_grads};
use super::passes::GpuPasses;
use super::plan::{materialized_plan, plan};
use crate::batch::HeadShape;
use crate::collective::Collective;
use crate::error::{Error, Result};
use crate::fused::{FusedOptions, FusedPasses, GradPart, Head, HeadGrad, Plan};
use crate::range::grad_out_of_range;
use crate::rows::RowInputs;

/// Checks that every entry of the device buffer `buf` (argument `arg`) is finite.
fn check_finite<T: GpuElement>(gpu: &Gpu, arg: &'static str, buf: &DeviceBuffer<T>) -> Result<()> {
    match gpu.first_non_finite(buf)? {
        Some(index) => Err(Error::NonFinite {
            arg,
            index,
            value: gpu.value_at(buf, index)?.to_f32() as f64,
        }),
        None => Ok(()),
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
        let (gpu, head) = (self.gpu, self.head);
        check_finite(gpu, "hidden", &head.hidden)?;
        check_finite(gpu, "weight", &head.weight)?;
        if let Some(b) = &head.bias {
            check_finite(gpu, "bias", b)?;
        }
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
        for (quantity, buf) in std::iter::once(("dhidden", &g.dhidden))
            .chain(g.dweight.as_ref().map(|w| ("dweight", w)))
            .chain(g.dbias.as_ref().map(|b| ("dbias", b)))
        {
            if let Some(k) = self.gpu.first_non_finite(buf)? {
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
        plan(n, v, E::DTYPE, opts, single_pass_allowed)
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

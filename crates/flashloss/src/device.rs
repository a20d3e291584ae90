//! The front door: a [`Device`] is a backend (the CPU, or a GPU of the CUDA backend)
//! with the state it keeps between calls (the CPU's logits workspace; the GPU's cuBLAS
//! handle and tiles), and one method per loss. Every binding goes through it: the
//! tools, the candle ops, the training loop, the Python and JAX packages. Below it the
//! drivers of [`crate::fused`] are written once over a backend's [`Head`], and they
//! validate the inputs and check the gradients for every backend.
//!
//! A call takes the LM head where the caller holds it ([`HeadArgs`]): in host memory
//! (on a GPU device, copied there and back), or borrowed device buffers. The
//! workspace is sized by each call's plan and reused while the plan's sizes repeat,
//! as a training loop's do (fresh multi-MiB buffers cost page faults on every step).
//! Calls on one `Device` from several threads take turns.

use crate::batch::{GrpoBatch, LinearInputs, LogitsLayout};
use crate::cpu::{CpuHead, Workspace};
use crate::cross_entropy::CrossEntropy;
use crate::element::Element;
use crate::error::{Error, Result};
use crate::fused::{
    self, CeLinearOutput, FusedOptions, GrpoLinearOutput, Head, HeadGrad, LinearGrads,
    LinearGradsMut, LogpOutput, RowGrad,
};
use crate::grpo_config::GrpoLoss;
use crate::grpo_logits::GrpoLogitsForward;
use crate::policy::Normalizers;
use crate::rows::RowStats;
use crate::rows::{PartialStats, RowInputs};
use crate::sharding::Shard;
use std::sync::{Mutex, MutexGuard};

mod calls;

pub use calls::{CeCall, CeUpstream, GrpoCall, LogpCall, Returns, Vocab};

/// A backend and the state it keeps between calls.
pub struct Device {
    backend: Backend,
    state: Mutex<State>,
}

enum Backend {
    Cpu,
    #[cfg(feature = "cuda")]
    Cuda(std::sync::Arc<crate::cuda::Gpu>),
}

/// What a device keeps between calls.
#[derive(Default)]
struct State {
    cpu: Workspace,
    #[cfg(feature = "cuda")]
    gpu: Option<crate::cuda::GpuWorkspace>,
}

/// An LM head (hidden `[N, H]`, weight `[V, H]`, bias `[V]`) and the f32 gradient
/// buffers a call adds into, where the caller holds them.
pub enum HeadArgs<'a, E> {
    /// In host memory.
    Host {
        /// Hidden states, weight, bias.
        inputs: &'a LinearInputs<'a, E>,
        /// Where `dH`, `dW`, `dbias` are added (empty for a loss without gradients).
        grads: LinearGradsMut<'a>,
    },
    /// In a GPU's memory, borrowed from the caller (elements of type `E`).
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::BorrowedHead),
}

impl<'a, E> HeadArgs<'a, E> {
    /// Host inputs without gradient buffers (log-probs).
    pub fn host(inputs: &'a LinearInputs<'a, E>) -> Self {
        HeadArgs::Host {
            inputs,
            grads: LinearGradsMut {
                dhidden: &mut [],
                dweight: &mut [],
                dbias: None,
            },
        }
    }
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.backend {
            Backend::Cpu => write!(f, "cpu"),
            #[cfg(feature = "cuda")]
            Backend::Cuda(gpu) => write!(f, "cuda ({})", gpu.arch()),
        }
    }
}

impl Device {
    fn new(backend: Backend) -> Self {
        Device {
            backend,
            state: Mutex::default(),
        }
    }

    /// The CPU backend (rayon over the global thread pool), with an empty workspace.
    pub fn cpu() -> Device {
        Device::new(Backend::Cpu)
    }

    /// GPU `ordinal` (a build with the `cuda` feature and an NVIDIA driver).
    pub fn cuda(ordinal: usize) -> Result<Device> {
        #[cfg(feature = "cuda")]
        {
            let gpu = crate::cuda::Gpu::new(ordinal)?;
            Ok(Device::new(Backend::Cuda(std::sync::Arc::new(gpu))))
        }
        #[cfg(not(feature = "cuda"))]
        {
            Err(Error::InvalidArgument {
                arg: "device",
                reason: format!(
                    "cuda:{ordinal} needs a build with `--features cuda` (this one has the CPU backend only)"
                ),
            })
        }
    }

    /// `cpu`, `cuda` (GPU 0) or `cuda:N`.
    pub fn parse(name: &str) -> Result<Device> {
        match name {
            "cpu" => Ok(Device::cpu()),
            "cuda" => Device::cuda(0),
            _ => match name.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(ordinal)) => Device::cuda(ordinal),
                _ => Err(Error::InvalidArgument {
                    arg: "device",
                    reason: format!("unknown device {name:?}: use cpu, cuda or cuda:N"),
                }),
            },
        }
    }

    /// Whether this is the CPU backend.
    pub fn is_cpu(&self) -> bool {
        matches!(self.backend, Backend::Cpu)
    }

    /// The GPU of a CUDA device (its memory accounting and host waits), `None` on the CPU.
    #[cfg(feature = "cuda")]
    pub fn gpu(&self) -> Option<&std::sync::Arc<crate::cuda::Gpu>> {
        match &self.backend {
            Backend::Cuda(gpu) => Some(gpu),
            Backend::Cpu => None,
        }
    }

    /// Bytes the device keeps between calls (its workspaces).
    pub fn workspace_bytes(&self) -> Result<usize> {
        let state = self.state()?;
        #[cfg(feature = "cuda")]
        let gpu = state.gpu.as_ref().map_or(0, |w| w.bytes());
        #[cfg(not(feature = "cuda"))]
        let gpu = 0;
        Ok(state.cpu.bytes() + gpu)
    }

    fn state(&self) -> Result<MutexGuard<'_, State>> {
        // A call that panicked left at worst a workspace of stale values, which every
        // kernel overwrites before reading: take it back.
        Ok(self
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()))
    }

    /// Runs `work` on a head over `args` on this device, with the device's workspace.
    fn run<E: Element, R>(
        &self,
        args: HeadArgs<E>,
        work: impl FnOnce(&mut dyn Head) -> Result<R>,
    ) -> Result<R> {
        let mut state = self.state()?;
        match (&self.backend, args) {
            (Backend::Cpu, HeadArgs::Host { inputs, grads }) => work(&mut CpuHead {
                inputs,
                ws: &mut state.cpu,
                grads,
            }),
            #[cfg(feature = "cuda")]
            (Backend::Cuda(gpu), HeadArgs::Host { inputs, grads }) => {
                crate::cuda::run_on_host_buffers(gpu, &mut state.gpu, inputs, grads, work)
            }
            #[cfg(feature = "cuda")]
            (Backend::Cuda(gpu), HeadArgs::Cuda(head)) => {
                crate::cuda::run_on_borrowed(gpu, &mut state.gpu, head, E::DTYPE, work)
            }
            #[cfg(feature = "cuda")]
            (Backend::Cpu, HeadArgs::Cuda(_)) => Err(Error::InvalidArgument {
                arg: "hidden",
                reason: "is in a GPU's memory but the device is the CPU".into(),
            }),
        }
    }

    /// The GRPO loss of `call.batch` on the head's logits `hidden · weightᵀ + bias`, its
    /// gradients added into the head's buffers (see [`fused::grpo_linear`],
    /// [`fused::grpo_linear_sharded`]).
    pub fn grpo<E: Element>(&self, head: HeadArgs<E>, call: GrpoCall) -> Result<GrpoLinearOutput> {
        let GrpoCall {
            loss,
            batch,
            vocab,
            opts,
        } = call;
        match vocab {
            Vocab::Whole => {
                let norm = Normalizers::local(batch);
                self.run(head, |h| fused::grpo_linear(h, loss, batch, norm, opts))
            }
            Vocab::Sharded { grid, shard } => self.run(head, |h| {
                fused::grpo_linear_sharded(grid, h, shard, loss, batch, opts)
            }),
        }
    }

    /// The cross-entropy of the head's logits at `call.targets`: the per-row losses
    /// alone ([`Returns::Forward`], one rank), or with the gradients of the upstream
    /// added into the head's buffers (see [`fused::ce_row_losses`],
    /// [`fused::ce_linear_lse`], [`fused::ce_linear_sharded`]).
    pub fn cross_entropy<E: Element>(
        &self,
        head: HeadArgs<E>,
        call: CeCall,
    ) -> Result<CeLinearOutput> {
        let CeCall {
            ce,
            targets,
            vocab,
            returns,
            opts,
        } = call;
        match (vocab, returns) {
            (Vocab::Whole, Returns::Forward) => {
                self.run(head, |h| fused::ce_row_losses(h, ce, targets, opts))
            }
            (Vocab::Whole, Returns::Grads(up)) => self.run(head, |h| {
                fused::ce_linear_lse(h, ce, targets, up.rows, up.lse, opts)
            }),
            (Vocab::Sharded { grid, shard }, Returns::Grads(up)) if up.lse.is_none() => self
                .run(head, |h| {
                    fused::ce_linear_sharded(grid, h, shard, ce, targets, up.rows, opts)
                }),
            (Vocab::Sharded { .. }, returns) => Err(Error::InvalidArgument {
                arg: match returns {
                    Returns::Forward => "returns",
                    Returns::Grads(_) => "grad_lse",
                },
                reason: "a sharded cross-entropy returns its gradients, of the row losses only"
                    .into(),
            }),
        }
    }

    /// Per-row `logp`, `lse`, entropy and max logit of the head's scaled logits, what
    /// `call.request` adds, and for [`Returns::Grads`] their gradients added into the
    /// head's buffers (see [`fused::logp_linear_with`], [`fused::logp_linear_grads_with`]
    /// and their sharded forms). A forward runs two-pass within `opts.budget_bytes`.
    pub fn logprobs<E: Element>(&self, head: HeadArgs<E>, call: LogpCall) -> Result<LogpOutput> {
        let LogpCall {
            rows,
            request,
            vocab,
            returns,
            opts,
            seq_len,
        } = call;
        let budget = opts.budget_bytes;
        match (vocab, returns) {
            (Vocab::Whole, Returns::Forward) => self.run(head, |h| {
                fused::logp_linear_with(h, rows, &request, budget, seq_len)
            }),
            (Vocab::Whole, Returns::Grads(up)) => self.run(head, |h| {
                fused::logp_linear_grads_with(h, rows, &request, up, opts, seq_len)
            }),
            (Vocab::Sharded { grid, shard }, Returns::Forward) => self.run(head, |h| {
                fused::logp_linear_sharded_with(grid, h, shard, rows, &request, budget, seq_len)
            }),
            (Vocab::Sharded { grid, shard }, Returns::Grads(up)) => self.run(head, |h| {
                let call = (rows, &request, up);
                fused::logp_linear_grads_sharded_with(grid, h, shard, call, opts, seq_len)
            }),
        }
    }

    // The stages of a fused step, for a caller that merges a vocabulary shard's partial
    // row states with its own collectives (the JAX handlers under `shard_map`): pass A
    // gives each row's partial softmax state on this head; the caller merges them and
    // forms each row's gradient; pass B adds them. A distinct concept from the losses
    // above (no grid: the caller is the collective), with their argument order: the
    // head, what the call is on, its data, the options.

    /// Pass A of a fused step on this head (a vocabulary shard, for a caller that merges
    /// the shards with its own collectives): see [`fused::partial_row_states`].
    pub fn partial_row_states<E: Element>(
        &self,
        head: HeadArgs<E>,
        rows: RowInputs,
        opts: &FusedOptions,
    ) -> Result<PartialStats> {
        self.run(head, |h| fused::partial_row_states(h, rows, opts))
    }

    /// Pass B of a fused step on this head from one [`RowGrad`] per row: see
    /// [`fused::accumulate_row_grads`].
    pub fn accumulate_row_grads<E: Element>(
        &self,
        head: HeadArgs<E>,
        rows: RowInputs,
        grads: &[RowGrad],
        opts: &FusedOptions,
        seq_len: usize,
    ) -> Result<()> {
        self.run(head, |h| {
            fused::accumulate_row_grads(h, rows, grads, opts, seq_len)
        })
    }

    /// Cross-entropy's pass A on this head, the [`Shard`] of the vocabulary it holds
    /// (see [`fused::ce_partial_row_states`]).
    pub fn ce_partial_row_states<E: Element>(
        &self,
        head: HeadArgs<E>,
        shard: Shard,
        ce: &CrossEntropy,
        targets: &[i64],
        opts: &FusedOptions,
    ) -> Result<PartialStats> {
        self.run(head, |h| {
            fused::ce_partial_row_states(h, shard, ce, targets, opts)
        })
    }

    /// Cross-entropy's row stage and pass B on this head's [`Shard`] from the merged
    /// statistics `stats`, with the gradients of `upstream` (see
    /// [`fused::ce_accumulate_row_grads`]).
    #[allow(clippy::too_many_arguments)]
    pub fn ce_accumulate_row_grads<E: Element>(
        &self,
        head: HeadArgs<E>,
        shard: Shard,
        ce: &CrossEntropy,
        targets: &[i64],
        stats: Vec<RowStats>,
        upstream: CeUpstream,
        opts: &FusedOptions,
    ) -> Result<CeLinearOutput> {
        let up = (upstream.rows, upstream.lse);
        self.run(head, |h| {
            fused::ce_accumulate_row_grads(h, shard, ce, targets, up, stats, opts)
        })
    }

    /// The logits-level GRPO loss of `batch` on host logits `[B, T, V]` laid out as
    /// `layout`, forward and backward: `grad_output · ∂L/∂z` is written into `dlogits`
    /// (dense `[N, V]`). Returns the forward's outputs (loss, metrics, per-row
    /// statistics). On the CPU an f32 `dlogits` takes the one-`exp` kernel
    /// (exponentials staged in `dlogits`, what `flashloss bench` times), bf16 the
    /// two-`exp` kernel.
    pub fn grpo_logits<E: Element>(
        &self,
        loss: &GrpoLoss,
        batch: &GrpoBatch,
        logits: &[E],
        layout: &LogitsLayout,
        grad_output: f32,
        dlogits: &mut [E],
    ) -> Result<GrpoLogitsForward> {
        match &self.backend {
            Backend::Cpu => match E::as_f32_mut(dlogits) {
                Some(d) => {
                    let staged =
                        crate::cpu::grpo_logits_forward_staged(loss, batch, logits, layout, d)?;
                    staged.backward(logits, grad_output, d)?;
                    Ok(staged.forward)
                }
                None => {
                    let fwd = crate::cpu::grpo_logits_forward(loss, batch, logits, layout)?;
                    fwd.backward(logits, grad_output, dlogits)?;
                    Ok(fwd)
                }
            },
            #[cfg(feature = "cuda")]
            Backend::Cuda(gpu) => crate::cuda::grpo_logits_host(
                gpu,
                loss,
                batch,
                logits,
                layout,
                grad_output,
                dlogits,
            ),
        }
    }

    /// The per-token GRPO losses on host logits (Liger's `reduce=False`): the forward of
    /// `Σ_i g_i·ℓ_tot,i` with `grad_rows` `[N]` (each token's upstream gradient; ones
    /// for the losses themselves, [`GrpoLogitsForward::token_loss`]), and, given
    /// `dlogits` (dense `[N, V]`), its gradient written there. CPU backend only.
    pub fn grpo_logits_per_token<E: Element>(
        &self,
        loss: &GrpoLoss,
        batch: &GrpoBatch,
        logits: &[E],
        layout: &LogitsLayout,
        grad_rows: &[f32],
        dlogits: Option<&mut [E]>,
    ) -> Result<GrpoLogitsForward> {
        if !self.is_cpu() {
            return Err(Error::InvalidArgument {
                arg: "logits",
                reason: "per-token GRPO losses run on the CPU backend only (so far)".into(),
            });
        }
        let fwd =
            crate::cpu::grpo_logits_forward_per_token(loss, batch, logits, layout, grad_rows)?;
        if let Some(d) = dlogits {
            fwd.backward(logits, 1.0, d)?;
        }
        Ok(fwd)
    }

    /// [`Device::grpo_logits`] with the gradient written over `logits` (the two-`exp`
    /// kernel: the logits are read again after the statistics).
    pub fn grpo_logits_in_place<E: Element>(
        &self,
        loss: &GrpoLoss,
        batch: &GrpoBatch,
        logits: &mut [E],
        layout: &LogitsLayout,
        grad_output: f32,
    ) -> Result<GrpoLogitsForward> {
        match &self.backend {
            Backend::Cpu => {
                let fwd = crate::cpu::grpo_logits_forward(loss, batch, logits, layout)?;
                fwd.backward_in_place(logits, grad_output)?;
                Ok(fwd)
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(gpu) => {
                let z = logits.to_vec();
                crate::cuda::grpo_logits_host(gpu, loss, batch, &z, layout, grad_output, logits)
            }
        }
    }
}

/// A loss's call whose gradients [`Device::with_host_grads`] can hold in host memory.
pub trait LossCall: Copy {
    /// What the call returns (with a `grads` field).
    type Output;
    /// Which of the head's gradients the call forms.
    fn head_grad(&self) -> HeadGrad;
    /// The call's method on `device`.
    fn run<E: Element>(self, device: &Device, head: HeadArgs<E>) -> Result<Self::Output>;
    /// `out` with `grads` in it.
    fn with_grads(out: Self::Output, grads: LinearGrads) -> Self::Output;
}

impl LossCall for GrpoCall<'_> {
    type Output = GrpoLinearOutput;
    fn head_grad(&self) -> HeadGrad {
        self.opts.head_grad
    }
    fn run<E: Element>(self, device: &Device, head: HeadArgs<E>) -> Result<GrpoLinearOutput> {
        device.grpo(head, self)
    }
    fn with_grads(out: GrpoLinearOutput, grads: LinearGrads) -> GrpoLinearOutput {
        GrpoLinearOutput { grads, ..out }
    }
}

impl LossCall for CeCall<'_> {
    type Output = CeLinearOutput;
    fn head_grad(&self) -> HeadGrad {
        self.opts.head_grad
    }
    fn run<E: Element>(self, device: &Device, head: HeadArgs<E>) -> Result<CeLinearOutput> {
        device.cross_entropy(head, self)
    }
    fn with_grads(out: CeLinearOutput, grads: LinearGrads) -> CeLinearOutput {
        CeLinearOutput { grads, ..out }
    }
}

impl Device {
    /// Runs `call` on host `inputs` with zeroed gradient buffers of its own (`dH`, and
    /// `dW`, `dbias` as the call's `head_grad` asks) and returns its output with them in
    /// `grads`: the one convenience for a caller that keeps no buffers of its own.
    pub fn with_host_grads<E: Element, C: LossCall>(
        &self,
        inputs: &LinearInputs<E>,
        call: C,
    ) -> Result<C::Output> {
        let mut grads = LinearGrads::zeros_for(inputs, call.head_grad());
        let head = HeadArgs::Host {
            inputs,
            grads: grads.view(),
        };
        let out = call.run(self, head)?;
        Ok(C::with_grads(out, grads))
    }
}

#[cfg(test)]
mod tests {
    use super::Device;

    /// A binding keeps one device per process and calls it from any thread.
    #[test]
    fn device_is_send_and_sync() {
        fn shared<T: Send + Sync>() {}
        shared::<Device>();
    }
}

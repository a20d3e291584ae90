//! The kernels' steps on the GPU (feature `cuda`; without it, an error saying so): the
//! logits-level GRPO kernel and the fused LM-head kernels on GPU 0.

/// The logits-level kernel on the GPU (feature `cuda`).
pub(super) mod logits {
    use crate::gradcheck::config::GradcheckConfig;
    #[cfg(not(feature = "cuda"))]
    use flashloss::Error;
    use flashloss::Result;
    use flashloss::batch::{GrpoBatch, LogitsLayout};
    use flashloss::config::GrpoLoss;
    use flashloss::cpu::GrpoLogitsForward;
    use flashloss::element::Element;

    /// Forward and backward on GPU 0; `dlogits` comes back in the logits' dtype
    /// (poisoned with NaN before the kernel when not in place).
    #[cfg(feature = "cuda")]
    pub(crate) fn step<E: Element>(
        cfg: &GradcheckConfig,
        loss: &GrpoLoss,
        batch: &GrpoBatch,
        logits: &[E],
        layout: &LogitsLayout,
    ) -> Result<(GrpoLogitsForward, Vec<E>)> {
        use flashloss::cuda::{Gpu, GpuElement, grpo_logits_backward, grpo_logits_forward};
        use flashloss::element::DType;
        use half::bf16;
        fn typed<T: GpuElement>(
            cfg: &GradcheckConfig,
            loss: &GrpoLoss,
            batch: &GrpoBatch,
            host: &[T],
            layout: &LogitsLayout,
        ) -> Result<(GrpoLogitsForward, Vec<f32>)> {
            let gpu = Gpu::new(0)?;
            let mut logits = gpu.upload(host)?;
            let fwd = grpo_logits_forward(&gpu, loss, batch, &logits, layout)?;
            let g = cfg.grad_output as f32;
            let out = if cfg.in_place {
                grpo_logits_backward(&gpu, &fwd, &mut logits, g, None)?;
                gpu.download(&logits)?
            } else {
                let poison = vec![T::from_f32(f32::NAN); layout.rows() * layout.vocab];
                let mut dlogits = gpu.upload(&poison)?;
                grpo_logits_backward(&gpu, &fwd, &mut logits, g, Some(&mut dlogits))?;
                gpu.download(&dlogits)?
            };
            Ok((fwd, out.iter().map(|x| x.to_f32()).collect()))
        }
        // The element type is the config's dtype: these conversions are exact.
        let (fwd, out) = match E::DTYPE {
            DType::F32 => {
                let host: Vec<f32> = logits.iter().map(|x| x.to_f32()).collect();
                typed(cfg, loss, batch, &host, layout)?
            }
            DType::Bf16 => {
                let host: Vec<bf16> = logits.iter().map(|x| bf16::from_f32(x.to_f32())).collect();
                typed(cfg, loss, batch, &host, layout)?
            }
        };
        Ok((fwd, out.into_iter().map(E::from_f32).collect()))
    }

    /// Without feature `cuda`: an error saying so.
    #[cfg(not(feature = "cuda"))]
    pub(crate) fn step<E: Element>(
        _: &GradcheckConfig,
        _: &GrpoLoss,
        _: &GrpoBatch,
        _: &[E],
        _: &LogitsLayout,
    ) -> Result<(GrpoLogitsForward, Vec<E>)> {
        Err(Error::Device {
            reason: "this build has no CUDA backend: build with `--features cuda`".into(),
        })
    }
}

/// The fused LM-head kernels on the GPU (feature `cuda`): GPU 0, the head uploaded,
/// gradients zeroed on the device and copied back.
pub(super) mod linear {
    use crate::inputs::HeadInputs;
    use flashloss::batch::GrpoBatch;
    use flashloss::config::GrpoLoss;
    use flashloss::cpu::{CeLinearOutput, FusedOptions, GrpoLinearOutput, LinearGrads};
    use flashloss::cross_entropy::CrossEntropy;
    use flashloss::element::Element;
    use flashloss::policy::Normalizers;
    use flashloss::{Error, Result};

    /// Which loss to run (read only by the CUDA build).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) enum Job<'a> {
        Grpo(&'a GrpoLoss, &'a GrpoBatch<'a>, Normalizers),
        Ce(&'a CrossEntropy, &'a [i64]),
    }

    /// What the job returned (built only by the CUDA build).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) enum Done {
        Grpo(GrpoLinearOutput),
        Ce(CeLinearOutput),
    }

    impl Done {
        pub(crate) fn grpo(self) -> Result<GrpoLinearOutput> {
            match self {
                Done::Grpo(out) => Ok(out),
                Done::Ce(_) => Err(mismatch()),
            }
        }

        pub(crate) fn ce(self) -> Result<CeLinearOutput> {
            match self {
                Done::Ce(out) => Ok(out),
                Done::Grpo(_) => Err(mismatch()),
            }
        }
    }

    fn mismatch() -> Error {
        Error::Device {
            reason: "the GPU job returned another loss's output".into(),
        }
    }

    /// Runs `job` on GPU 0 on `head` (converted exactly to the GPU's element type).
    #[cfg(feature = "cuda")]
    pub(crate) fn step<E: Element>(
        head: &HeadInputs<E>,
        job: Job,
        opts: &FusedOptions,
    ) -> Result<(Done, LinearGrads)> {
        use flashloss::cuda::{
            Gpu, GpuElement, GpuGrads, GpuHead, GpuWorkspace, ce_linear_into, grpo_linear_into,
        };
        use flashloss::element::DType;
        use half::bf16;
        fn typed<T: GpuElement>(
            head: &HeadInputs<T>,
            job: Job,
            opts: &FusedOptions,
        ) -> Result<(Done, LinearGrads)> {
            let gpu = Gpu::new(0)?;
            let dev = GpuHead::upload(&gpu, &head.inputs())?;
            let mut grads = GpuGrads::zeros(&gpu, &dev)?;
            let mut ws = GpuWorkspace::new(&gpu)?;
            let done = match job {
                Job::Grpo(loss, batch, norm) => Done::Grpo(grpo_linear_into(
                    &gpu, loss, batch, norm, &dev, opts, &mut ws, &mut grads,
                )?),
                Job::Ce(ce, targets) => Done::Ce(ce_linear_into(
                    &gpu, ce, targets, None, &dev, opts, &mut ws, &mut grads,
                )?),
            };
            Ok((done, grads.download(&gpu)?))
        }
        fn convert<E: Element, T: Element>(head: &HeadInputs<E>) -> HeadInputs<T> {
            let to = |x: &[E]| x.iter().map(|v| T::from_f32(v.to_f32())).collect();
            HeadInputs {
                hidden: to(&head.hidden),
                weight: to(&head.weight),
                bias: head.bias.as_deref().map(to),
                n: head.n,
                h: head.h,
                v: head.v,
            }
        }
        // The element type is the config's dtype: these conversions are exact.
        match E::DTYPE {
            DType::F32 => typed(&convert::<E, f32>(head), job, opts),
            DType::Bf16 => typed(&convert::<E, bf16>(head), job, opts),
        }
    }

    /// Without feature `cuda`: an error saying so.
    #[cfg(not(feature = "cuda"))]
    pub(crate) fn step<E: Element>(
        _: &HeadInputs<E>,
        _: Job,
        _: &FusedOptions,
    ) -> Result<(Done, LinearGrads)> {
        Err(Error::Device {
            reason: "this build has no CUDA backend: build with `--features cuda`".into(),
        })
    }
}

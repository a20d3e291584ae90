//! The logits-level GRPO kernel's step on GPU 0 (feature `cuda`; without it, an error
//! saying so). The fused LM-head kernels reach the GPU through `flashloss::Device`.

/// The logits-level kernel on the GPU (feature `cuda`).
pub(super) mod logits {
    use crate::gradcheck::config::GradcheckConfig;
    #[cfg(not(feature = "cuda"))]
    use flashloss::Error;
    use flashloss::GrpoLogitsForward;
    use flashloss::Result;
    use flashloss::batch::{GrpoBatch, LogitsLayout};
    use flashloss::config::GrpoLoss;
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

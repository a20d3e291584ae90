//! Helpers shared by the integration tests.
#![allow(dead_code)]

use flashloss::{DType, GrpoLossConfig, ImportanceSamplingLevel, LossType};
use flashloss_tools::gradcheck::{self, GradcheckConfig};

/// A small gradcheck config at an odd shape (V not a multiple of the vocab tile).
pub fn small(batch: usize, seq_len: usize, vocab: usize, loss: GrpoLossConfig) -> GradcheckConfig {
    GradcheckConfig {
        batch,
        seq_len,
        vocab,
        loss,
        ..GradcheckConfig::default()
    }
}

/// Runs gradcheck and asserts every gate passed, naming the case on failure.
pub fn assert_passes(cfg: &GradcheckConfig, case: &str) {
    let report = gradcheck::run(cfg).unwrap_or_else(|e| panic!("{case}: {e}"));
    let failed: Vec<String> = report
        .gates
        .iter()
        .filter(|g| !g.passed)
        .map(|g| format!("{} {:.3e} > {:.3e}", g.name, g.value, g.limit))
        .collect();
    assert!(report.passed, "{case}: failed gates {failed:?}");
    assert!(report.loss_kernel.is_finite(), "{case}: loss not finite");
}

/// Every valid (loss type, level) pair with the loss's other knobs at defaults.
pub fn valid_types() -> Vec<(LossType, ImportanceSamplingLevel)> {
    let mut out = Vec::new();
    for t in LossType::ALL {
        for level in [
            ImportanceSamplingLevel::Token,
            ImportanceSamplingLevel::Sequence,
        ] {
            if t.allows_level(level) {
                out.push((t, level));
            }
        }
    }
    out
}

/// A loss config of type `t` at `level` with what that type requires set.
pub fn base_config(t: LossType, level: ImportanceSamplingLevel) -> GrpoLossConfig {
    GrpoLossConfig {
        loss_type: t,
        importance_sampling_level: level,
        max_completion_length: (t == LossType::DrGrpo).then_some(24),
        epsilon_high: if t == LossType::Cispo { 5.0 } else { 0.2 },
        ..GrpoLossConfig::default()
    }
}

/// The dtype-agnostic default config with bf16 logits.
pub fn bf16(mut cfg: GradcheckConfig) -> GradcheckConfig {
    cfg.dtype = DType::Bf16;
    cfg
}

/// The dtype-agnostic default config with f16 logits.
pub fn f16(mut cfg: GradcheckConfig) -> GradcheckConfig {
    cfg.dtype = DType::F16;
    cfg
}

/// Random GRPO inputs of the default spec at `[B, T, V]`.
pub fn draw(
    batch: usize,
    seq_len: usize,
    vocab: usize,
    seed: u64,
) -> flashloss_tools::inputs::GrpoInputs {
    flashloss_tools::inputs::GrpoInputs::random(
        &flashloss_tools::inputs::InputSpec {
            batch,
            seq_len,
            vocab,
            ..Default::default()
        },
        seed,
    )
}

#[allow(unused_imports)]
pub use flashloss_tools::inputs::HeadInputs as Head;

pub fn max_abs(x: &[f64]) -> f64 {
    x.iter().fold(0.0, |m, v| m.max(v.abs()))
}

/// Asserts `max|got - want| ≤ rel·max|want| + 1e-7`.
pub fn assert_close(name: &str, got: &[f32], want: &[f64], rel: f64) {
    assert_eq!(got.len(), want.len(), "{name} length");
    let scale = max_abs(want).max(1e-12);
    let err = got
        .iter()
        .zip(want)
        .fold(0.0f64, |m, (g, w)| m.max((*g as f64 - w).abs()));
    assert!(
        err <= rel * scale + 1e-7,
        "{name}: max error {err:.3e}, max |ref| {scale:.3e}"
    );
}

/// Asserts `max|got - want| ≤ rel·max|want|` for dH, dW and dbias (which must be there)
/// of `grads` against `want`, printing each error as a fraction of the largest entry
/// (`--nocapture`) under `case`.
pub fn assert_grads_of_largest(
    case: &str,
    grads: &flashloss::LinearGrads,
    (dh, dw, db): (&[f64], &[f64], &[f64]),
    rel: f64,
) {
    let db_got = grads.dbias.as_deref().expect("a bias gradient");
    for (name, got, want) in [
        ("dH", &grads.dhidden[..], dh),
        ("dW", &grads.dweight[..], dw),
        ("dbias", db_got, db),
    ] {
        let scale = max_abs(want);
        let err = got
            .iter()
            .zip(want)
            .fold(0.0f64, |m, (g, w)| m.max((*g as f64 - w).abs()));
        eprintln!("{case} {name}: error {:.2e} of the largest", err / scale);
        assert!(err <= rel * scale, "{case} {name}");
    }
}

/// Gradient tolerance (of the largest reference gradient) of [`flashloss::Mode::Compact`]
/// in f32: its block keeps probabilities as f16 exponentials (relative 2^-11 each).
pub const COMPACT_GRAD_TOL: f64 = 1e-3;

/// What [`assert_modes_agree_and_threads_invariant`] compares of a fused step.
pub struct FusedRun {
    pub loss: f64,
    pub grads: flashloss::LinearGrads,
    pub single_pass: bool,
}

/// Single-pass equals two-pass within f32 rounding, and 1, 2 and 8 threads give
/// identical bits in each mode. `run(opts)` runs the fused step with `opts`.
pub fn assert_modes_agree_and_threads_invariant(
    run: &(dyn Fn(&flashloss::FusedOptions) -> FusedRun + Sync),
) {
    use flashloss::{FusedOptions, Mode};
    let run_with = |mode: Mode, threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            run(&FusedOptions {
                bf16_products: Default::default(),
                mode,
                budget_bytes: Some(8 << 20),
                grad_output: 1.0,
                head_grad: Default::default(),
            })
        })
    };
    let single = run_with(Mode::SinglePass, 2);
    let two = run_with(Mode::TwoPass, 2);
    assert!(single.single_pass && !two.single_pass);
    assert!((single.loss - two.loss).abs() <= 1e-6 * single.loss.abs().max(1.0));
    let close = |a: &[f32], b: &[f32]| {
        let scale = a.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-5 * scale)
    };
    assert!(close(&single.grads.dhidden, &two.grads.dhidden));
    assert!(close(&single.grads.dweight, &two.grads.dweight));
    let compact = run_with(Mode::Compact, 2);
    assert!(compact.single_pass);
    assert!((compact.loss - two.loss).abs() <= 1e-6 * two.loss.abs().max(1.0));
    let near = |a: &[f32], b: &[f32]| {
        let scale = a.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        a.iter()
            .zip(b)
            .all(|(x, y)| (x - y).abs() <= COMPACT_GRAD_TOL as f32 * scale)
    };
    assert!(near(&two.grads.dhidden, &compact.grads.dhidden));
    assert!(near(&two.grads.dweight, &compact.grads.dweight));
    for mode in [Mode::SinglePass, Mode::TwoPass, Mode::Compact] {
        let one = run_with(mode, 1);
        for threads in [2, 8] {
            let other = run_with(mode, threads);
            let case = format!("{mode:?}, {threads} threads");
            assert_eq!(one.loss.to_bits(), other.loss.to_bits(), "{case}: loss");
            assert_eq!(one.grads.dhidden, other.grads.dhidden, "{case}: dH");
            assert_eq!(one.grads.dweight, other.grads.dweight, "{case}: dW");
            assert_eq!(one.grads.dbias, other.grads.dbias, "{case}: dbias");
        }
    }
}

/// The fused LM-head steps on the CPU backend in the call shapes these tests use: fresh
/// buffers through a [`flashloss::Device`], caller's buffers through a
/// [`flashloss::cpu::CpuHead`], sharded runs on a [`flashloss::Grid`].
pub mod cpu_steps {
    use flashloss::collective::Collective;
    use flashloss::cpu::{CpuHead, Workspace};
    use flashloss::device::{CeCall, GrpoCall, LogpCall};
    use flashloss::fused;
    use flashloss::fused::LogpRows;
    use flashloss::{
        CeLinearOutput, CrossEntropy, Device, Element, FusedOptions, Grid, GrpoBatch,
        GrpoLinearOutput, GrpoLoss, LinearGrads, LinearInputs, Result, RowStats, Shard,
    };

    /// A rank's shard of the head: its weight rows are entries `offset..` of `vocab`.
    pub struct VocabShard<'a, E> {
        pub inputs: LinearInputs<'a, E>,
        pub offset: usize,
        pub vocab: usize,
    }

    impl<E> VocabShard<'_, E> {
        fn shard(&self) -> Shard {
            Shard {
                offset: self.offset,
                vocab: self.vocab,
            }
        }
    }

    pub fn grpo_linear<E: Element>(
        loss: &GrpoLoss,
        batch: &GrpoBatch,
        inputs: &LinearInputs<E>,
        opts: &FusedOptions,
    ) -> Result<GrpoLinearOutput> {
        Device::cpu().with_host_grads(inputs, GrpoCall::new(loss, batch, opts))
    }

    pub fn ce_linear<E: Element>(
        ce: &CrossEntropy,
        targets: &[i64],
        inputs: &LinearInputs<E>,
        opts: &FusedOptions,
    ) -> Result<CeLinearOutput> {
        Device::cpu().with_host_grads(inputs, CeCall::new(ce, targets, opts))
    }

    pub fn ce_linear_into<E: Element>(
        ce: &CrossEntropy,
        targets: &[i64],
        grad_rows: Option<&[f32]>,
        inputs: &LinearInputs<E>,
        opts: &FusedOptions,
        ws: &mut Workspace,
        grads: &mut LinearGrads,
    ) -> Result<CeLinearOutput> {
        let head = &mut CpuHead {
            inputs,
            ws,
            grads: grads.view(),
        };
        fused::ce_linear(head, ce, targets, grad_rows, opts)
    }

    pub fn logp_linear<E: Element>(
        inputs: &LinearInputs<E>,
        targets: &[i64],
        mask: Option<&[bool]>,
        temperature: f64,
        budget_bytes: usize,
        seq_len: usize,
    ) -> Result<Vec<RowStats>> {
        let t = flashloss::Temperature::new(temperature)?;
        let head = flashloss::HeadArgs::host(inputs);
        Device::cpu()
            .logprobs(
                head,
                LogpCall::forward(
                    LogpRows {
                        targets,
                        mask,
                        temperature: t,
                    },
                    &FusedOptions::forward(budget_bytes),
                    seq_len,
                ),
            )
            .map(|o| o.stats)
    }

    pub fn grpo_linear_token_parallel<E: Element>(
        comm: &dyn Collective,
        loss: &GrpoLoss,
        batch: &GrpoBatch,
        inputs: &LinearInputs<E>,
        opts: &FusedOptions,
    ) -> Result<GrpoLinearOutput> {
        let shard = Shard::whole(inputs.vocab);
        Device::cpu().with_host_grads(
            inputs,
            GrpoCall::new(loss, batch, opts).sharded(&Grid::token(comm), shard),
        )
    }

    pub fn ce_linear_token_parallel<E: Element>(
        comm: &dyn Collective,
        ce: &CrossEntropy,
        targets: &[i64],
        inputs: &LinearInputs<E>,
        opts: &FusedOptions,
    ) -> Result<CeLinearOutput> {
        let shard = Shard::whole(inputs.vocab);
        Device::cpu().with_host_grads(
            inputs,
            CeCall::new(ce, targets, opts).sharded(&Grid::token(comm), shard),
        )
    }

    pub fn grpo_linear_grid<E: Element>(
        grid: &Grid,
        loss: &GrpoLoss,
        batch: &GrpoBatch,
        shard: &VocabShard<E>,
        opts: &FusedOptions,
    ) -> Result<GrpoLinearOutput> {
        Device::cpu().with_host_grads(
            &shard.inputs,
            GrpoCall::new(loss, batch, opts).sharded(grid, shard.shard()),
        )
    }

    pub fn ce_linear_grid<E: Element>(
        grid: &Grid,
        ce: &CrossEntropy,
        targets: &[i64],
        shard: &VocabShard<E>,
        opts: &FusedOptions,
    ) -> Result<CeLinearOutput> {
        Device::cpu().with_host_grads(
            &shard.inputs,
            CeCall::new(ce, targets, opts).sharded(grid, shard.shard()),
        )
    }

    pub fn grpo_linear_vocab_parallel<E: Element>(
        comm: &dyn Collective,
        loss: &GrpoLoss,
        batch: &GrpoBatch,
        shard: &VocabShard<E>,
        opts: &FusedOptions,
    ) -> Result<GrpoLinearOutput> {
        grpo_linear_grid(&Grid::vocab(comm), loss, batch, shard, opts)
    }

    pub fn ce_linear_vocab_parallel<E: Element>(
        comm: &dyn Collective,
        ce: &CrossEntropy,
        targets: &[i64],
        shard: &VocabShard<E>,
        opts: &FusedOptions,
    ) -> Result<CeLinearOutput> {
        ce_linear_grid(&Grid::vocab(comm), ce, targets, shard, opts)
    }
}

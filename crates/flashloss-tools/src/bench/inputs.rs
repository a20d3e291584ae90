//! The inputs of a bench: one sequence of per-token GRPO inputs, and for level
//! `linear` hidden states and an LM head drawn from normals (never zeros).

use super::config::{BenchConfig, Level, LossKind};
use crate::inputs::{GrpoInputs, InputSpec};
use flashloss::{Element, GrpoLoss, memory};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};

/// Per-token GRPO inputs of one sequence of N tokens over V, with the logits `[N, V]`
/// at level `logits` only (an LM head makes them at level `linear`), and the last
/// `padding·N` tokens padding (masked; CE targets at its ignore index).
pub(crate) fn token_inputs(cfg: &BenchConfig) -> flashloss::Result<GrpoInputs> {
    let spec = InputSpec {
        batch: 1,
        seq_len: cfg.tokens,
        vocab: cfg.vocab,
        masked_fraction: 0.0,
        draw_logits: cfg.level == Level::Logits,
        ..InputSpec::default()
    };
    let mut tokens = GrpoInputs::try_random(&spec, cfg.seed)?;
    let live = cfg.tokens - (cfg.padding * cfg.tokens as f64).round() as usize;
    tokens.data.mask[live..].fill(false);
    if cfg.loss == LossKind::Ce {
        tokens.data.target_ids[live..].fill(cfg.ce.ignore_index);
    }
    Ok(tokens)
}

/// The inputs of a level-`linear` bench: hidden `[N, H]` ~ N(0, 1), weight `[V, H]`
/// ~ N(0, 4/H) (never zeros), and one sequence's per-token GRPO inputs, on-policy (old
/// logp unset: ratio 1 keeps the loss meaningful without a logits pass).
pub(crate) fn linear_inputs<E: Element>(
    cfg: &BenchConfig,
    loss: &GrpoLoss,
) -> flashloss::Result<(Vec<E>, Vec<E>, GrpoInputs)> {
    let (n, h, v) = (cfg.tokens, cfg.hidden, cfg.vocab);
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed);
    let normal = Normal::new(0.0f32, 1.0).expect("valid");
    let w_scale = 2.0 / (h as f32).sqrt();
    let mut hidden: Vec<E> = memory::try_with_capacity("hidden [N, H]", n * h)?;
    hidden.extend((0..n * h).map(|_| E::from_f32(normal.sample(&mut rng))));
    let mut weight: Vec<E> = memory::try_with_capacity("weight [V, H]", v * h)?;
    weight.extend((0..v * h).map(|_| E::from_f32(normal.sample(&mut rng) * w_scale)));
    let mut tokens = token_inputs(cfg)?;
    on_policy_head_step(&mut tokens, loss);
    Ok((hidden, weight, tokens))
}

/// Per-token inputs of a benched LM-head step: no logits (the head makes them),
/// on-policy (old logp absent, ratio 1), reference logp only where β > 0 needs it.
pub(crate) fn on_policy_head_step(tokens: &mut GrpoInputs, loss: &GrpoLoss) {
    tokens.logits = Vec::new();
    tokens.data.old_logp = None;
    tokens.data.ref_logp = tokens
        .data
        .ref_logp
        .take()
        .filter(|_| loss.config().beta > 0.0);
}

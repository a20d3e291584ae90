//! The inputs of a fused LM-head check ([`LinearCase`]), what one objective's run gives
//! the gradient gates ([`ObjectiveRun`]), and the faults a rank's kernel inputs take.

use super::config::{FaultKind, GradcheckConfig, Objective};
use super::logprobs::{LogprobsCase, exact_grid, sample};
use super::report::Gate;
use crate::inputs::{GrpoInputs, HeadInputs};
use flashloss::policy::GrpoMetrics;
use flashloss::reference::linear_logits;
use flashloss::{CrossEntropy, Element, FusedOptions, GrpoLoss, LinearGrads, Plan};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// What one objective's run gives the head's gradient gates: the report's name, loss
/// pair and metrics, its own gates, the reference's `dlogits` `[N, V]`, what a summed
/// gradient entry adds up ([`grad_gate`]'s `rows`), the kernel's gradients and plan
/// (none where the backend does not say).
pub(super) struct ObjectiveRun {
    pub(super) name: String,
    pub(super) loss: (f64, f64),
    pub(super) metrics: Option<(GrpoMetrics, GrpoMetrics)>,
    pub(super) gates: Vec<Gate>,
    pub(super) dlogits_ref: Vec<f64>,
    pub(super) summed_rows: f64,
    pub(super) grads: LinearGrads,
    pub(super) plan: Option<Plan>,
}

/// The random inputs of a fused LM-head check: a head, per-token GRPO inputs whose old
/// and reference logp follow the head's policy, the head's f64 logits, the options, and
/// objective `logprobs`'s upstream gradients and request (its head on the exact grid
/// under a truncated support: [`exact_grid`]).
pub(crate) struct LinearCase<E> {
    pub(crate) head: HeadInputs<E>,
    pub(crate) tokens: GrpoInputs,
    pub(crate) z: Vec<f64>,
    pub(crate) opts: FusedOptions,
    pub(crate) logprobs: Option<LogprobsCase>,
}

impl<E: Element> LinearCase<E> {
    pub(crate) fn new(cfg: &GradcheckConfig) -> flashloss::Result<Self> {
        let (n, h, v) = (cfg.batch * cfg.seq_len, cfg.hidden, cfg.vocab);
        let mut head = HeadInputs::<E>::try_random(n, h, v, cfg.bias, cfg.seed)?;
        let logprobs = cfg.objective == Objective::Logprobs;
        let grpo_support = cfg.objective == Objective::Grpo
            && GrpoLoss::new(cfg.loss.clone())?.support().is_some();
        if (logprobs && cfg.logprobs.support().is_some()) || grpo_support {
            exact_grid(&mut head);
        }
        let mut tokens = GrpoInputs::try_random(&cfg.input_spec(), cfg.seed + 1)?;
        tokens.logits = Vec::new();
        let z = linear_logits(&head.inputs());
        if grpo_support {
            sampled_targets(&mut tokens, &z, cfg);
        }
        tokens.follow_policy(&z, cfg.loss.temperature);
        let logprobs = match logprobs {
            true => Some(LogprobsCase::new(cfg, &tokens, &z)?),
            false => None,
        };
        let opts = FusedOptions {
            bf16_products: cfg.bf16_products,
            head_grad: cfg.head_grad,
            ..FusedOptions::from_mib(cfg.mode, cfg.budget_mib, cfg.grad_output as f32)
        };
        Ok(LinearCase {
            head,
            tokens,
            z,
            opts,
            logprobs,
        })
    }

    /// `rank`'s copy of the head where a `nan` or `perturb` fault hits it.
    pub(crate) fn faulty_head(&self, cfg: &GradcheckConfig, rank: usize) -> Option<HeadInputs<E>> {
        let kind = cfg.fault.filter(|f| f.rank == rank)?.kind;
        let mut head = self.head.clone();
        inject_fault(kind, &mut head.hidden).then_some(head)
    }
}

/// A sampler's targets for GRPO under a truncated support: 3/4 of the rows drawn from
/// the head's `softmax(z/T)` (mostly inside the support), the others kept uniform
/// (mostly outside, so masked), seeded by `seed + 3`.
fn sampled_targets(tokens: &mut GrpoInputs, z: &[f64], cfg: &GradcheckConfig) {
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed.wrapping_add(3));
    let v = cfg.vocab;
    for (i, id) in tokens.data.target_ids.iter_mut().enumerate() {
        if rng.random_bool(0.75) {
            *id = sample(&z[i * v..(i + 1) * v], cfg.loss.temperature, rng.random());
        }
    }
}

/// Scale of the hidden states (or logits) that a `perturb` fault gives a rank's kernel.
const PERTURB: f32 = 1.0 + 1.0 / 16.0;

/// A `nan` fault's NaN in `data[0]`, or a `perturb` fault's scaling of `data`; whether
/// `kind` changed `data` (the other faults act on the rank, not its inputs).
pub(crate) fn inject_fault<E: Element>(kind: FaultKind, data: &mut [E]) -> bool {
    match kind {
        FaultKind::Nan => data[0] = E::from_f32(f32::NAN),
        FaultKind::Perturb => {
            for x in data.iter_mut() {
                *x = E::from_f32(x.to_f32() * PERTURB);
            }
        }
        FaultKind::Panic | FaultKind::Hang | FaultKind::Exit => return false,
    }
    true
}

/// CE targets of GRPO inputs: the target ids, `ignore_index` at masked positions.
pub(crate) fn ce_targets(tokens: &GrpoInputs, ce: &CrossEntropy) -> Vec<i64> {
    let ignore = ce.config().ignore_index;
    let data = &tokens.data;
    (0..data.mask.len())
        .map(|i| {
            if data.mask[i] {
                data.target_ids[i]
            } else {
                ignore
            }
        })
        .collect()
}

/// The plan's mode, as the report names it.
pub(super) fn mode_name(plan: &Plan) -> &'static str {
    if plan.compact {
        "compact"
    } else if plan.single_pass {
        "single_pass"
    } else {
        "two_pass"
    }
}

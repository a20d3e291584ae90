//! Random GRPO inputs with realistic statistics, for gradcheck, bench and tests:
//! Gaussian logits (never zeros) with the sampled token lifted above the rest,
//! right-padded masks, old and reference logp near the current policy's; random LM
//! heads.

use flashloss::batch::{GrpoBatch, GrpoBatchData, LinearInputs, PerSeqOrTokenBuf};
use flashloss::element::Element;
use flashloss::memory;
use flashloss::reference::row_softmax;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};
use std::ops::Range;

/// What to draw.
#[derive(Debug, Clone, PartialEq)]
pub struct InputSpec {
    /// B.
    pub batch: usize,
    /// T.
    pub seq_len: usize,
    /// V.
    pub vocab: usize,
    /// Expected fraction of masked (padding) positions.
    pub masked_fraction: f64,
    /// Standard deviation of the logits.
    pub logit_std: f64,
    /// Draw old-policy logp (else on-policy, ratio 1).
    pub old_logp: bool,
    /// Draw reference-policy logp.
    pub ref_logp: bool,
    /// Draw a sampler importance ratio per token.
    pub sampler_ratio: bool,
    /// Advantages per token `[B, T]` instead of per sequence `[B]`.
    pub per_token_advantages: bool,
    /// Draw a policy mask (TRL's off-policy mask): each sequence is masked out whole
    /// with this probability, and each remaining token with half of it. 0: no mask.
    pub policy_mask_fraction: f64,
    /// Draw an entropy mask (top-entropy tokens): each token is masked out with this
    /// probability, and the last sequence entirely when it is ≥ 0.5. 0: no mask.
    pub entropy_mask_fraction: f64,
    /// Draw the dense logits `[B, T, V]` (unset where an LM head makes them: old and
    /// reference logp are then drawn near a uniform policy's).
    pub draw_logits: bool,
}

impl Default for InputSpec {
    fn default() -> Self {
        InputSpec {
            batch: 3,
            seq_len: 17,
            vocab: 1000,
            masked_fraction: 0.2,
            logit_std: 2.0,
            old_logp: true,
            ref_logp: true,
            sampler_ratio: false,
            per_token_advantages: false,
            policy_mask_fraction: 0.0,
            entropy_mask_fraction: 0.0,
            draw_logits: true,
        }
    }
}

/// Random inputs: dense logits and the per-token inputs they go with;
/// [`GrpoInputs::batch`] borrows the latter as a [`GrpoBatch`].
#[derive(Debug, Clone)]
pub struct GrpoInputs {
    /// V.
    pub vocab: usize,
    /// Dense logits `[B, T, V]` in f32 (empty when the logits come from an LM head).
    pub logits: Vec<f32>,
    /// Target ids, mask, advantages, old and reference logp, sampler ratio.
    pub data: GrpoBatchData,
}

/// The exact log-softmax of row `row` at `id`, in f64.
fn logp_of(row: &[f32], id: usize) -> f64 {
    let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = row.iter().map(|&z| (z as f64 - max).exp()).sum();
    row[id] as f64 - max - sum.ln()
}

impl GrpoInputs {
    /// Draws inputs from `spec` with a seeded ChaCha8 generator; panics where
    /// [`GrpoInputs::try_random`] returns an error (tests).
    pub fn random(spec: &InputSpec, seed: u64) -> Self {
        Self::try_random(spec, seed).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Draws inputs from `spec` with a seeded ChaCha8 generator. Sizes of zero, a
    /// `[B, T, V]` that overflows, and logits that cannot be allocated are errors.
    pub fn try_random(spec: &InputSpec, seed: u64) -> flashloss::Result<Self> {
        let (b, t, v) = (spec.batch, spec.seq_len, spec.vocab);
        if b == 0 || t == 0 || v == 0 {
            return Err(flashloss::Error::InvalidArgument {
                arg: "batch",
                reason: format!("batch, seq_len and vocab must be >= 1, got [B={b}, T={t}, V={v}]"),
            });
        }
        let len = match spec.draw_logits {
            true => b
                .checked_mul(t)
                .and_then(|n| n.checked_mul(v))
                .unwrap_or(usize::MAX),
            false => 0,
        };
        let mut logits: Vec<f32> = memory::try_with_capacity("logits [B, T, V]", len)?;
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let normal = Normal::new(0.0f64, spec.logit_std.max(1e-3)).map_err(|e| {
            flashloss::Error::InvalidArgument {
                arg: "logit_std",
                reason: format!("{e}, got {}", spec.logit_std),
            }
        })?;
        logits.extend((0..len).map(|_| normal.sample(&mut rng) as f32));
        let mut target_ids = vec![0i64; b * t];
        for (i, id) in target_ids.iter_mut().enumerate() {
            *id = rng.random_range(0..v) as i64;
            let lift = rng.random_range(1.0..5.0f32);
            if let Some(z) = logits.get_mut(i * v + *id as usize) {
                *z += lift;
            }
        }
        let mut mask = vec![false; b * t];
        for seq in 0..b {
            let pad = (spec.masked_fraction * t as f64 * rng.random_range(0.0..2.0)).round();
            let len = t.saturating_sub(pad as usize);
            mask[seq * t..seq * t + len].fill(true);
        }
        let n_adv = if spec.per_token_advantages { b * t } else { b };
        let advantages: Vec<f32> = (0..n_adv)
            .map(|_| Normal::new(0.0, 1.0).unwrap().sample(&mut rng))
            .collect();
        let advantages = if spec.per_token_advantages {
            PerSeqOrTokenBuf::Token(advantages)
        } else {
            PerSeqOrTokenBuf::Sequence(advantages)
        };
        let logp: Vec<f64> = (0..b * t)
            .map(|i| match logits.get(i * v..(i + 1) * v) {
                Some(row) => logp_of(row, target_ids[i] as usize),
                None => -(v as f64).ln(),
            })
            .collect();
        let mut near = |on: bool, std: f64| {
            on.then(|| {
                let noise = Normal::new(0.0, std).unwrap();
                logp.iter()
                    .map(|&lp| (lp + noise.sample(&mut rng)) as f32)
                    .collect::<Vec<f32>>()
            })
        };
        let old_logp = near(spec.old_logp, 0.15);
        let ref_logp = near(spec.ref_logp, 0.3);
        let sampler_ratio = spec.sampler_ratio.then(|| {
            PerSeqOrTokenBuf::Token((0..b * t).map(|_| rng.random_range(0.5..1.5f32)).collect())
        });
        let p = spec.policy_mask_fraction;
        let policy_mask = (p > 0.0).then(|| {
            let mut keep = vec![true; b * t];
            for seq in keep.chunks_mut(t) {
                if rng.random_bool(p.min(1.0)) {
                    seq.fill(false);
                }
                for k in seq.iter_mut() {
                    *k &= !rng.random_bool((p / 2.0).min(1.0));
                }
            }
            keep
        });
        let q = spec.entropy_mask_fraction;
        let entropy_mask = (q > 0.0).then(|| {
            let mut keep: Vec<bool> = (0..b * t).map(|_| !rng.random_bool(q.min(1.0))).collect();
            if q >= 0.5 {
                keep[(b - 1) * t..].fill(false);
            }
            keep
        });
        Ok(GrpoInputs {
            vocab: v,
            logits,
            data: GrpoBatchData {
                batch: b,
                seq_len: t,
                target_ids,
                mask,
                advantages,
                old_logp,
                ref_logp,
                sampler_ratio,
                policy_mask,
                entropy_mask,
            },
        })
    }

    /// Sets old and reference logp near the policy of dense f64 logits `z` `[B·T, V]`
    /// at `temperature` (ratios near 1, as in training), for inputs whose logits come
    /// from elsewhere (an LM head).
    pub fn follow_policy(&mut self, z: &[f64], temperature: f64) {
        let (v, data) = (self.vocab, &mut self.data);
        for i in 0..data.batch * data.seq_len {
            let row = row_softmax(&z[i * v..(i + 1) * v], temperature);
            let lp = row.log_probs[data.target_ids[i] as usize] as f32;
            let wiggle = ((i * 7) % 5) as f32 * 0.06 - 0.12;
            if let Some(old) = data.old_logp.as_mut() {
                old[i] = lp + wiggle;
            }
            if let Some(reference) = data.ref_logp.as_mut() {
                reference[i] = lp - 0.5 * wiggle + 0.05;
            }
        }
    }

    /// The sequences `seqs` alone (a token-parallel rank's share), logits included.
    pub fn sequences(&self, seqs: Range<usize>) -> GrpoInputs {
        let (data, t, v) = (&self.data, self.data.seq_len, self.vocab);
        let rows = seqs.start * t..seqs.end * t;
        let per_token = |x: &Option<Vec<f32>>| x.as_ref().map(|x| x[rows.clone()].to_vec());
        let bools = |x: &Option<Vec<bool>>| x.as_ref().map(|x| x[rows.clone()].to_vec());
        let either = |x: &PerSeqOrTokenBuf| match x {
            PerSeqOrTokenBuf::Sequence(x) => PerSeqOrTokenBuf::Sequence(x[seqs.clone()].to_vec()),
            PerSeqOrTokenBuf::Token(x) => PerSeqOrTokenBuf::Token(x[rows.clone()].to_vec()),
        };
        GrpoInputs {
            vocab: v,
            logits: if self.logits.is_empty() {
                Vec::new()
            } else {
                self.logits[rows.start * v..rows.end * v].to_vec()
            },
            data: GrpoBatchData {
                batch: seqs.len(),
                seq_len: t,
                target_ids: data.target_ids[rows.clone()].to_vec(),
                mask: data.mask[rows.clone()].to_vec(),
                advantages: either(&data.advantages),
                old_logp: per_token(&data.old_logp),
                ref_logp: per_token(&data.ref_logp),
                sampler_ratio: data.sampler_ratio.as_ref().map(either),
                policy_mask: bools(&data.policy_mask),
                entropy_mask: bools(&data.entropy_mask),
            },
        }
    }

    /// Borrows the per-token inputs as a [`GrpoBatch`].
    pub fn batch(&self) -> GrpoBatch<'_> {
        self.data.batch()
    }
}

/// A random LM head: hidden `[N, H]` uniform in (-1, 1), weight `[V, H]` uniform in
/// ±3/√H (logits of std ~1), optional bias uniform in ±0.5.
#[derive(Debug, Clone)]
pub struct HeadInputs<E> {
    /// `[N, H]`.
    pub hidden: Vec<E>,
    /// `[V, H]`.
    pub weight: Vec<E>,
    /// `[V]`.
    pub bias: Option<Vec<E>>,
    /// N.
    pub n: usize,
    /// H.
    pub h: usize,
    /// V.
    pub v: usize,
}

impl<E: Element> HeadInputs<E> {
    /// Draws a head with a seeded ChaCha8 generator; panics where
    /// [`HeadInputs::try_random`] returns an error (tests).
    pub fn random(n: usize, h: usize, v: usize, bias: bool, seed: u64) -> Self {
        Self::try_random(n, h, v, bias, seed).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Draws a head with a seeded ChaCha8 generator; a head that cannot be allocated
    /// is an error.
    pub fn try_random(
        n: usize,
        h: usize,
        v: usize,
        bias: bool,
        seed: u64,
    ) -> flashloss::Result<Self> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut draw = |what: &str, len: Option<usize>, scale: f32| -> flashloss::Result<Vec<E>> {
            let len = len.unwrap_or(usize::MAX);
            let mut out = memory::try_with_capacity(what, len)?;
            out.extend((0..len).map(|_| E::from_f32(rng.random_range(-1.0..1.0f32) * scale)));
            Ok(out)
        };
        let hidden = draw("hidden [N, H]", n.checked_mul(h), 1.0)?;
        let weight = draw("weight [V, H]", v.checked_mul(h), 3.0 / (h as f32).sqrt())?;
        let bias = if bias {
            Some(draw("bias [V]", Some(v), 0.5)?)
        } else {
            None
        };
        Ok(HeadInputs {
            hidden,
            weight,
            bias,
            n,
            h,
            v,
        })
    }

    /// Hidden rows `rows` with the whole weight and bias (a token-parallel rank's share).
    pub fn rows(&self, rows: Range<usize>) -> Self {
        HeadInputs {
            hidden: self.hidden[rows.start * self.h..rows.end * self.h].to_vec(),
            n: rows.len(),
            ..self.clone()
        }
    }

    /// Every hidden row with weight and bias rows `vocab` (a vocab-parallel shard).
    pub fn vocab_shard(&self, vocab: Range<usize>) -> Self {
        HeadInputs {
            weight: self.weight[vocab.start * self.h..vocab.end * self.h].to_vec(),
            bias: self.bias.as_ref().map(|b| b[vocab.clone()].to_vec()),
            v: vocab.len(),
            ..self.clone()
        }
    }

    /// Borrows the head as [`LinearInputs`].
    pub fn inputs(&self) -> LinearInputs<'_, E> {
        LinearInputs {
            hidden: &self.hidden,
            weight: &self.weight,
            layout: flashloss::WeightLayout::VocabMajor,
            bias: self.bias.as_deref(),
            tokens: self.n,
            hidden_size: self.h,
            vocab: self.v,
        }
    }
}

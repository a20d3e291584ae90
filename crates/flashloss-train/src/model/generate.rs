//! Batched sampling with a KV cache: left-padded prompts, temperature and top-p,
//! seeded.

use super::qwen2::{KvCache, Qwen2, attention_mask};
use candle_core::{Result, Tensor};
use rand::Rng;
use serde::{Deserialize, Serialize};

/// How completions are sampled.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Sampling {
    /// Logits are divided by this; 0 means greedy.
    pub temperature: f64,
    /// Nucleus sampling: draw from the smallest set of tokens whose probability is at
    /// least `top_p` (1 = the whole vocabulary).
    pub top_p: f64,
    /// Completion length cap (tokens, the end-of-sequence token included).
    pub max_new_tokens: usize,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling {
            temperature: 1.0,
            top_p: 1.0,
            max_new_tokens: 16,
        }
    }
}

/// Draws one token id from `logits` (one row).
fn sample_row(logits: &[f32], s: &Sampling, rng: &mut impl Rng) -> u32 {
    let argmax = || {
        (0..logits.len())
            .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
            .unwrap_or(0) as u32
    };
    if s.temperature <= 0.0 {
        return argmax();
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let mut probs: Vec<(u32, f64)> = logits
        .iter()
        .enumerate()
        .map(|(j, &z)| (j as u32, ((z as f64 - max) / s.temperature).exp()))
        .collect();
    let mut total: f64 = probs.iter().map(|p| p.1).sum();
    if s.top_p < 1.0 {
        probs.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let (mut kept, mut mass) = (0, 0.0);
        while kept < probs.len() && mass < s.top_p * total {
            mass += probs[kept].1;
            kept += 1;
        }
        probs.truncate(kept.max(1));
        total = mass.max(probs[0].1);
    }
    let mut u = rng.random::<f64>() * total;
    for &(j, p) in &probs {
        if u < p {
            return j;
        }
        u -= p;
    }
    probs.last().map_or_else(argmax, |p| p.0)
}

/// Samples a completion for each prompt (one sequence per prompt; repeat prompts for
/// groups). Prompts are left-padded with `pad` into one batch; a sequence stops after
/// `eos` or `max_new_tokens`. Returns each completion's tokens, `eos` included when
/// it was drawn.
pub fn generate(
    model: &Qwen2,
    prompts: &[Vec<u32>],
    eos: u32,
    pad: u32,
    sampling: &Sampling,
    rng: &mut impl Rng,
) -> Result<Vec<Vec<u32>>> {
    let b = prompts.len();
    let Padded {
        ids,
        positions,
        valid,
        len: p,
        ..
    } = Padded::left(prompts, pad)?;
    let mut key_valid: Vec<Vec<bool>> = valid.chunks(p).map(<[bool]>::to_vec).collect();
    let head = model.head_weight()?.t()?;
    let mut cache = KvCache::default();
    let mut next_pos: Vec<u32> = prompts.iter().map(|q| q.len() as u32).collect();
    let mut done = vec![false; b];
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); b];
    let (mut step_ids, mut step_pos, mut t_new) = (ids, positions, p);
    for _ in 0..sampling.max_new_tokens {
        let flat: Vec<bool> = key_valid.iter().flatten().copied().collect();
        let mask = attention_mask(&flat, b, t_new)?;
        let hidden = model.forward(&step_ids, &step_pos, b, &mask, Some(&mut cache))?;
        let last = hidden.narrow(1, t_new - 1, 1)?.squeeze(1)?;
        let logits: Vec<Vec<f32>> = last.matmul(&head)?.to_vec2()?;
        step_ids = Vec::with_capacity(b);
        step_pos = Vec::with_capacity(b);
        for (i, row) in logits.iter().enumerate() {
            let token = if done[i] {
                pad
            } else {
                sample_row(row, sampling, rng)
            };
            if !done[i] {
                out[i].push(token);
                done[i] = token == eos;
            }
            key_valid[i].push(true);
            step_ids.push(token);
            step_pos.push(next_pos[i]);
            next_pos[i] += 1;
        }
        t_new = 1;
        if done.iter().all(|&d| d) {
            break;
        }
    }
    Ok(out)
}

/// Sequences padded into one `[B, len]` batch.
#[derive(Debug, Clone, PartialEq)]
pub struct Padded {
    /// Token ids `[B, len]` (`pad` where padded).
    pub ids: Vec<u32>,
    /// Position of each token in its own sequence `[B, len]` (0 on left padding).
    pub positions: Vec<u32>,
    /// False on padding `[B, len]`.
    pub valid: Vec<bool>,
    /// B.
    pub batch: usize,
    /// The padded length.
    pub len: usize,
}

impl Padded {
    /// Left-pads `seqs` to the longest (prompts, so that all end at the same column).
    pub fn left(seqs: &[Vec<u32>], pad: u32) -> Result<Self> {
        let len = seqs.iter().map(Vec::len).max().unwrap_or(0);
        if seqs.is_empty() || seqs.iter().any(Vec::is_empty) {
            candle_core::bail!("prompts: need at least one prompt and no empty prompt")
        }
        let mut out = Padded {
            ids: Vec::with_capacity(seqs.len() * len),
            positions: Vec::with_capacity(seqs.len() * len),
            valid: Vec::with_capacity(seqs.len() * len),
            batch: seqs.len(),
            len,
        };
        for seq in seqs {
            let padding = len - seq.len();
            out.ids
                .extend(std::iter::repeat_n(pad, padding).chain(seq.iter().copied()));
            out.positions
                .extend((0..len).map(|i| i.saturating_sub(padding) as u32));
            out.valid.extend((0..len).map(|i| i >= padding));
        }
        Ok(out)
    }

    /// Appends `tails[b]` (right-padded to the longest, or to `min_len`) after row `b`;
    /// positions continue from each row's last valid position.
    pub fn append_right(&self, tails: &[Vec<u32>], pad: u32, min_len: usize) -> Result<Self> {
        if tails.len() != self.batch {
            candle_core::bail!("completions: {} for {} prompts", tails.len(), self.batch)
        }
        let extra = tails.iter().map(Vec::len).max().unwrap_or(0).max(min_len);
        let len = self.len + extra;
        let mut out = Padded {
            ids: Vec::with_capacity(self.batch * len),
            positions: Vec::with_capacity(self.batch * len),
            valid: Vec::with_capacity(self.batch * len),
            batch: self.batch,
            len,
        };
        for (b, tail) in tails.iter().enumerate() {
            let row = b * self.len..(b + 1) * self.len;
            let start = self.valid[row.clone()].iter().filter(|&&v| v).count() as u32;
            out.ids.extend_from_slice(&self.ids[row.clone()]);
            out.positions
                .extend_from_slice(&self.positions[row.clone()]);
            out.valid.extend_from_slice(&self.valid[row]);
            out.ids.extend(
                tail.iter()
                    .copied()
                    .chain(std::iter::repeat_n(pad, extra - tail.len())),
            );
            out.positions.extend((0..extra as u32).map(|j| start + j));
            out.valid.extend((0..extra).map(|j| j < tail.len()));
        }
        Ok(out)
    }

    /// Final-norm hidden states `[B, len, H]` of the whole batch (no cache).
    pub fn hidden(&self, model: &Qwen2) -> Result<Tensor> {
        let mask = attention_mask(&self.valid, self.batch, self.len)?;
        model.forward(&self.ids, &self.positions, self.batch, &mask, None)
    }
}

/// The logits `[B, V]` at the last position of each left-padded prompt, from one full
/// forward without a cache (the check of the cached path).
pub fn last_logits(model: &Qwen2, prompts: &[Vec<u32>], pad: u32) -> Result<Tensor> {
    let padded = Padded::left(prompts, pad)?;
    let hidden = padded.hidden(model)?;
    hidden
        .narrow(1, padded.len - 1, 1)?
        .squeeze(1)?
        .matmul(&model.head_weight()?.t()?)
}

//! GRPO training on the GSM8K-format task: a supervised warm-up with the
//! cross-entropy, then GRPO (G completions per prompt, group-normalized advantages,
//! old and reference log-probs from no-grad passes, KL β, any loss type, AdamW), with
//! the loss computed by the path `loss.impl` picks. One JSON line of metrics per step,
//! checkpoints every k steps, resume with no lost step.

mod checkpoint;
mod config;
mod losses;
mod optim;

pub use config::{
    GrpoConfig, LossImpl, LossSwitch, ModelSource, SftConfig, TaskConfig, TokenizerSource,
    TrainConfig,
};
pub use optim::{AdamW, OptimConfig};

use crate::model::{Padded, Params, Qwen2, generate};
use crate::task::{Problem, load_gsm8k, reward};
use crate::tokenizer::Tokenizer;
use candle_core::{Result, Tensor};
use flashloss::fused::mib_to_bytes;
use flashloss::{CrossEntropy, GrpoBatchData, GrpoLoss, PerSeqOrTokenBuf};
use losses::LossPath;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::time::Instant;

/// One step's metrics (one JSON line of `metrics.jsonl`). GRPO-only fields are absent
/// on warm-up steps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// Global step (warm-up steps first).
    pub step: usize,
    /// `sft` or `grpo`.
    pub phase: String,
    /// The loss that was differentiated.
    pub loss: f64,
    /// Mean reward of the step's completions.
    pub reward_mean: Option<f64>,
    /// Standard deviation of the rewards.
    pub reward_std: Option<f64>,
    /// Fraction of completions with the right final answer.
    pub accuracy: Option<f64>,
    /// Mean KL to the reference policy.
    pub kl: Option<f64>,
    /// Fraction of tokens clipped below.
    pub clip_ratio_low: Option<f64>,
    /// Fraction of tokens clipped above.
    pub clip_ratio_high: Option<f64>,
    /// Fraction of tokens clipped either way.
    pub clip_ratio_region: Option<f64>,
    /// Mean token entropy.
    pub entropy: Option<f64>,
    /// Mean completion length in tokens.
    pub completion_length: Option<f64>,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
    /// Wall time of the whole step.
    pub step_time_s: f64,
    /// Of which sampling completions.
    pub generate_time_s: f64,
    /// Of which the loss, its backward and the optimizer.
    pub update_time_s: f64,
    /// Peak bytes allocated during the step (tracking allocator; absent without it).
    pub peak_bytes: Option<u64>,
}

/// A GRPO batch: sequences, their completion targets and the no-grad log-probs.
struct Rollout {
    padded: Padded,
    prompt_len: usize,
    inputs: GrpoBatchData,
    rewards: Vec<f64>,
    correct: Vec<bool>,
}

impl Rollout {
    /// Hidden states `[B·T, H]` at the positions that predict the completion tokens
    /// (prompt end − 1 onward) under `model`.
    fn completion_hidden(&self, model: &Qwen2) -> Result<Tensor> {
        let (b, t) = (self.inputs.batch, self.inputs.seq_len);
        let hidden = self.padded.hidden(model)?;
        let h = hidden.dim(2)?;
        hidden
            .narrow(1, self.prompt_len - 1, t)?
            .reshape((b * t, h))
    }
}

/// The training state.
pub struct Trainer {
    cfg: TrainConfig,
    params: Params,
    reference: Option<Params>,
    optim: AdamW,
    tokenizer: Tokenizer,
    dataset: Option<Vec<Problem>>,
    path: LossPath,
    rollout: Option<Rollout>,
    /// Steps completed.
    pub done: usize,
}

fn step_rng(seed: u64, step: usize, stream: u64) -> ChaCha8Rng {
    let mut rng =
        ChaCha8Rng::seed_from_u64(seed ^ (step as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    rng.set_stream(stream);
    rng
}

fn err(e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::msg(e.to_string())
}

impl Trainer {
    /// Builds the model, tokenizer and task of `cfg`, resuming from `out_dir`'s
    /// checkpoint when `cfg.resume` and one is there.
    pub fn new(cfg: TrainConfig) -> Result<Self> {
        let loss = GrpoLoss::new(cfg.loss.grpo.clone()).map_err(err)?;
        let ce = CrossEntropy::new(cfg.loss.ce.clone()).map_err(err)?;
        if cfg.grpo.group_size == 0
            || cfg.grpo.prompts_per_step == 0
            || cfg.grpo.num_iterations == 0
        {
            candle_core::bail!("grpo: prompts_per_step, group_size and num_iterations must be >= 1")
        }
        if cfg.sft.steps > 0 && cfg.sft.batch_size == 0 {
            candle_core::bail!("sft.batch_size: must be >= 1")
        }
        if cfg.grpo.sampling.max_new_tokens == 0 {
            candle_core::bail!("grpo.sampling.max_new_tokens: must be >= 1")
        }
        let params = match &cfg.model.pretrained {
            Some(dir) => Params::from_pretrained(dir)?,
            None => Params::random(&cfg.model.config, cfg.seed)?,
        };
        let tokenizer = match &cfg.tokenizer.file {
            Some(f) => Tokenizer::from_file(f, &cfg.tokenizer.eos_token)?,
            None => Tokenizer::Chars,
        };
        if tokenizer.vocab_size() > params.config.vocab_size {
            candle_core::bail!(
                "model.config.vocab_size: {} is smaller than the tokenizer's {}",
                params.config.vocab_size,
                tokenizer.vocab_size()
            )
        }
        let dataset = cfg.task.gsm8k.as_deref().map(load_gsm8k).transpose()?;
        let path = LossPath::new(
            cfg.loss.implementation,
            loss,
            ce,
            mib_to_bytes(cfg.loss.budget_mib as f64),
        );
        let mut trainer = Trainer {
            optim: AdamW::new(cfg.optim.clone()),
            cfg,
            params,
            reference: None,
            tokenizer,
            dataset,
            path,
            rollout: None,
            done: 0,
        };
        if trainer.cfg.resume {
            checkpoint::restore(&mut trainer)?;
        }
        Ok(trainer)
    }

    /// Warm-up plus GRPO steps.
    pub fn total_steps(&self) -> usize {
        self.cfg.sft.steps + self.cfg.steps
    }

    /// The parameters being trained.
    pub fn params(&self) -> &Params {
        &self.params
    }

    /// Runs the remaining steps, appending each step's metrics to
    /// `out_dir/metrics.jsonl` and passing them to `on_step`.
    pub fn run(&mut self, mut on_step: impl FnMut(&StepMetrics)) -> Result<()> {
        std::fs::create_dir_all(&self.cfg.out_dir).map_err(err)?;
        let yaml = serde_yaml_ng::to_string(&self.cfg).map_err(err)?;
        std::fs::write(self.cfg.out_dir.join("config.yaml"), yaml).map_err(err)?;
        // A run from step 0 (no checkpoint, or `resume: false`) starts its metrics over:
        // lines a killed run wrote before its first checkpoint run again.
        let mut metrics = std::fs::OpenOptions::new()
            .create(true)
            .append(self.done > 0)
            .write(true)
            .truncate(self.done == 0)
            .open(self.cfg.out_dir.join("metrics.jsonl"))
            .map_err(err)?;
        while self.done < self.total_steps() {
            let m = self.step()?;
            writeln!(metrics, "{}", serde_json::to_string(&m).map_err(err)?).map_err(err)?;
            metrics.flush().map_err(err)?;
            on_step(&m);
            let every = self.cfg.checkpoint_every;
            let at_end = self.done == self.total_steps();
            // A batch that later steps reuse (μ > 1) is not saved: checkpoints fall between
            // generations, except the last one.
            if at_end || (self.rollout.is_none() && every > 0 && self.done.is_multiple_of(every)) {
                checkpoint::save(self)?;
            }
        }
        Ok(())
    }

    /// One step (warm-up or GRPO), timed, with its peak memory.
    pub fn step(&mut self) -> Result<StepMetrics> {
        let tracking = flashloss::memory::is_tracking();
        flashloss::memory::reset_peak();
        let start = Instant::now();
        let step = self.done;
        let mut m = if step < self.cfg.sft.steps {
            self.sft_step(step)?
        } else {
            if step == self.cfg.sft.steps && self.reference.is_none() {
                // GRPO starts: a fresh optimizer, and the reference policy is the warm-up's result.
                self.optim = AdamW::new(self.cfg.optim.clone());
                self.reference = Some(Params::from_tensors(
                    &self.params.config,
                    &self.params.tensors(),
                )?);
            }
            self.grpo_step(step)?
        };
        m.step_time_s = start.elapsed().as_secs_f64();
        m.peak_bytes = tracking.then(|| flashloss::memory::peak() as u64);
        self.done += 1;
        Ok(m)
    }

    fn problem(&self, rng: &mut ChaCha8Rng) -> Problem {
        match &self.dataset {
            Some(d) => d[rng.random_range(0..d.len())].clone(),
            None => self.cfg.task.arithmetic.sample(rng),
        }
    }

    fn sft_step(&mut self, step: usize) -> Result<StepMetrics> {
        let mut rng = step_rng(self.cfg.seed, step, 0);
        let ignore = self.cfg.loss.ce.ignore_index;
        let mut seqs = Vec::new();
        let mut prompt_lens = Vec::new();
        for _ in 0..self.cfg.sft.batch_size {
            let p = self.problem(&mut rng);
            let prompt = self.tokenizer.encode(&p.prompt())?;
            let mut seq = prompt.clone();
            seq.extend(self.tokenizer.encode(&p.answer)?);
            seq.push(self.tokenizer.eos());
            prompt_lens.push(prompt.len());
            seqs.push(seq);
        }
        let update = Instant::now();
        let pad = self.tokenizer.pad();
        // Right-padded sequences: a one-token left part (no padding), then the rest.
        let padded = Padded::left(
            &seqs.iter().map(|s| s[..1].to_vec()).collect::<Vec<_>>(),
            pad,
        )?
        .append_right(
            &seqs.iter().map(|s| s[1..].to_vec()).collect::<Vec<_>>(),
            pad,
            0,
        )?;
        let len = padded.len;
        let mut targets = Vec::with_capacity(seqs.len() * (len - 1));
        for (seq, &p) in seqs.iter().zip(&prompt_lens) {
            targets.extend((1..len).map(|j| {
                if j >= p && j < seq.len() {
                    seq[j] as i64
                } else {
                    ignore
                }
            }));
        }
        let model = self.params.model(true);
        let hidden = padded.hidden(&model)?.narrow(1, 0, len - 1)?;
        let hidden = hidden.reshape((seqs.len() * (len - 1), self.params.config.hidden_size))?;
        let loss = self.path.ce(&hidden, model.head_weight()?, targets)?;
        let (loss_value, grad_norm) = self.update(&loss, self.cfg.sft.lr)?;
        Ok(StepMetrics {
            step,
            phase: "sft".into(),
            loss: loss_value,
            reward_mean: None,
            reward_std: None,
            accuracy: None,
            kl: None,
            clip_ratio_low: None,
            clip_ratio_high: None,
            clip_ratio_region: None,
            entropy: None,
            completion_length: None,
            grad_norm,
            step_time_s: 0.0,
            generate_time_s: 0.0,
            update_time_s: update.elapsed().as_secs_f64(),
            peak_bytes: None,
        })
    }

    /// Backward, then one AdamW step; returns the loss value and the gradient norm.
    fn update(&mut self, loss: &Tensor, lr: f64) -> Result<(f64, f64)> {
        let value = loss.to_scalar::<f32>()? as f64;
        if !value.is_finite() {
            candle_core::bail!("loss: {value} at step {}", self.done)
        }
        let grads = loss.backward()?;
        let norm = self.optim.step(&self.params, &grads, lr)?;
        Ok((value, norm))
    }

    /// Samples G completions per prompt with the current policy and scores them.
    fn rollout(&self, step: usize) -> Result<Rollout> {
        let g = &self.cfg.grpo;
        let mut rng = step_rng(self.cfg.seed, step, 1);
        let problems: Vec<Problem> = (0..g.prompts_per_step)
            .map(|_| self.problem(&mut rng))
            .collect();
        let mut prompts = Vec::new();
        for p in &problems {
            let ids = self.tokenizer.encode(&p.prompt())?;
            prompts.extend(std::iter::repeat_n(ids, g.group_size));
        }
        let (pad, eos) = (self.tokenizer.pad(), self.tokenizer.eos());
        let policy = self.params.model(false);
        let completions = generate(&policy, &prompts, eos, pad, &g.sampling, &mut rng)?;
        let (mut rewards, mut correct) = (Vec::new(), Vec::new());
        for (k, c) in completions.iter().enumerate() {
            let text = self.tokenizer.decode(c)?;
            let (r, ok) = reward(
                &text,
                &problems[k / g.group_size],
                self.cfg.task.format_reward,
            );
            rewards.push(r);
            correct.push(ok);
        }
        let prompt = Padded::left(&prompts, pad)?;
        let padded = prompt.append_right(&completions, pad, 0)?;
        let (p_len, c_len) = (prompt.len, padded.len - prompt.len);
        let mut target_ids = Vec::with_capacity(completions.len() * c_len);
        let mut mask = Vec::with_capacity(completions.len() * c_len);
        for c in &completions {
            target_ids.extend((0..c_len).map(|j| c.get(j).map_or(pad as i64, |&t| t as i64)));
            mask.extend((0..c_len).map(|j| j < c.len()));
        }
        let advantages = group_advantages(&rewards, g.group_size);
        let mut rollout = Rollout {
            padded,
            prompt_len: p_len,
            inputs: GrpoBatchData {
                batch: completions.len(),
                seq_len: c_len,
                target_ids,
                mask,
                advantages: PerSeqOrTokenBuf::Sequence(advantages),
                old_logp: None,
                ref_logp: None,
                sampler_ratio: None,
                policy_mask: None,
                entropy_mask: None,
            },
            rewards,
            correct,
        };
        if g.num_iterations > 1 {
            rollout.inputs.old_logp = Some(self.no_grad_logp(&rollout, &self.params)?);
        }
        if self.cfg.loss.grpo.beta > 0.0 {
            let reference = self.reference.as_ref().unwrap_or(&self.params);
            rollout.inputs.ref_logp = Some(self.no_grad_logp(&rollout, reference)?);
        }
        Ok(rollout)
    }

    /// The rollout's completion log-probs under `params`, without autograd.
    fn no_grad_logp(&self, rollout: &Rollout, params: &Params) -> Result<Vec<f32>> {
        let model = params.model(false);
        let hidden = rollout.completion_hidden(&model)?;
        self.path
            .logp(&hidden, model.head_weight()?, &rollout.inputs)
    }

    fn grpo_step(&mut self, step: usize) -> Result<StepMetrics> {
        let start = Instant::now();
        let rollout = match self.rollout.take() {
            Some(r) => r,
            None => self.rollout(step)?,
        };
        let generate_time_s = start.elapsed().as_secs_f64();
        let update = Instant::now();
        let model = self.params.model(true);
        let hidden = rollout.completion_hidden(&model)?;
        let (loss, out) = self
            .path
            .grpo(&hidden, model.head_weight()?, &rollout.inputs)?;
        let (loss_value, grad_norm) = self.update(&loss, self.cfg.grpo.lr)?;
        let update_time_s = update.elapsed().as_secs_f64();
        let n = rollout.rewards.len() as f64;
        let mean = rollout.rewards.iter().sum::<f64>() / n;
        let var = rollout
            .rewards
            .iter()
            .map(|r| (r - mean).powi(2))
            .sum::<f64>()
            / n;
        let lengths = rollout.inputs.mask.iter().filter(|&&m| m).count() as f64;
        let metrics = StepMetrics {
            step,
            phase: "grpo".into(),
            loss: loss_value,
            reward_mean: Some(mean),
            reward_std: Some(var.sqrt()),
            accuracy: Some(rollout.correct.iter().filter(|&&c| c).count() as f64 / n),
            kl: Some(out.metrics.kl_mean),
            clip_ratio_low: Some(out.metrics.clip_ratio_low),
            clip_ratio_high: Some(out.metrics.clip_ratio_high),
            clip_ratio_region: Some(out.metrics.clip_ratio_region),
            entropy: Some(out.metrics.entropy_mean),
            completion_length: Some(lengths / n),
            grad_norm,
            step_time_s: 0.0,
            generate_time_s,
            update_time_s,
            peak_bytes: None,
        };
        let grpo_step = step - self.cfg.sft.steps;
        if !(grpo_step + 1).is_multiple_of(self.cfg.grpo.num_iterations) {
            self.rollout = Some(rollout);
        }
        Ok(metrics)
    }
}

/// `(r - mean_g) / (std_g + 1e-4)` within each group of `g` (unbiased std, as TRL).
pub fn group_advantages(rewards: &[f64], g: usize) -> Vec<f32> {
    rewards
        .chunks(g)
        .flat_map(|group| {
            let n = group.len() as f64;
            let mean = group.iter().sum::<f64>() / n;
            let var = group.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
            let std = var.sqrt();
            group
                .iter()
                .map(move |r| ((r - mean) / (std + 1e-4)) as f32)
        })
        .collect()
}

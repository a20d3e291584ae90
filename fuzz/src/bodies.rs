//! What each fuzz target does with one input, shared by the libFuzzer targets
//! (`fuzz/fuzz_targets/*.rs`, run with `cargo fuzz`) and the corpus replay in the
//! workspace's tests (`crates/flashloss-cli/tests/fuzz_corpus.rs`). A body panics only
//! where the code under test broke a promise: a panic, a NaN or infinite result.

use flashloss::device::{CeCall, GrpoCall};
use flashloss::{
    CeConfig, CrossEntropy, Device, FusedOptions, GrpoLoss, GrpoLossConfig, LogitsLayout, LossType,
    Mode, PerSeqOrTokenBuf,
};
use flashloss_tools::bench::BenchConfig;
use flashloss_tools::config_file;
use flashloss_tools::gradcheck::GradcheckConfig;
use flashloss_tools::inputs::{GrpoInputs, HeadInputs, InputSpec};
use flashloss_train::model::{Params, Qwen2Config};
use flashloss_train::train::TrainConfig;

/// A YAML config and `--set` overrides: lines that start with `@` are overrides (the
/// `@` dropped), the others the YAML text. Parsed as every tool's config and validated.
pub fn config_overrides(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let (sets, yaml): (Vec<&str>, Vec<&str>) = text.lines().partition(|l| l.starts_with('@'));
    let overrides: Vec<String> = sets.iter().map(|l| l[1..].to_string()).collect();
    let yaml = yaml.join("\n");
    if let Ok(cfg) = config_file::parse::<GradcheckConfig>(&yaml, &overrides) {
        let _ = cfg.check_plan();
    }
    if let Ok(cfg) = config_file::parse::<BenchConfig>(&yaml, &overrides) {
        let _ = cfg.check_plan();
    }
    if let Ok(cfg) = config_file::parse::<TrainConfig>(&yaml, &overrides) {
        let _ = cfg.model.config.validate();
        let _ = GrpoLoss::new(cfg.loss.grpo.clone());
        let _ = CrossEntropy::new(cfg.loss.ce.clone());
    }
}

/// The tiny architecture the safetensors inputs are loaded against.
pub fn tiny_config() -> Qwen2Config {
    Qwen2Config {
        vocab_size: 48,
        hidden_size: 8,
        intermediate_size: 8,
        num_hidden_layers: 1,
        num_attention_heads: 2,
        num_key_value_heads: 1,
        max_position_embeddings: 16,
        rope_theta: 10_000.0,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: false,
    }
}

/// The train crate's loaders; the first byte picks one: 0 a `config.json`, 1 a
/// `model.safetensors` (or checkpoint) against [`tiny_config`], 2 a `tokenizer.json`.
pub fn loaders(data: &[u8]) {
    let Some((&kind, rest)) = data.split_first() else {
        return;
    };
    match kind % 3 {
        0 => {
            // What Qwen2Config::from_file does after reading the file.
            if let Ok(c) = serde_json::from_slice::<Qwen2Config>(rest) {
                let _ = c.validate();
            }
        }
        1 => {
            if let Ok(tensors) =
                candle_core::safetensors::load_buffer(rest, &candle_core::Device::Cpu)
            {
                let _ = Params::from_tensors(&tiny_config(), &tensors);
            }
        }
        _ => {
            let path = std::env::temp_dir().join(format!(
                "flashloss_fuzz_tokenizer_{}.json",
                std::process::id()
            ));
            if std::fs::write(&path, rest).is_ok() {
                // `Tokenizer::from_file` catches the tokenizers library's panics on
                // malformed files (fuzz/regressions/loaders/tokenizer-decoder-panic*) and
                // returns an error; libFuzzer's panic hook aborts before any catch, so it
                // is set aside for this one call (an abort is still found).
                let hook = std::panic::take_hook();
                std::panic::set_hook(Box::new(|_| {}));
                let loaded =
                    flashloss_train::tokenizer::Tokenizer::from_file(&path, "<|endoftext|>");
                std::panic::set_hook(hook);
                if let Ok(t) = loaded {
                    let _ = t.encode("12 + 3 = 15 #### 15");
                }
                let _ = std::fs::remove_file(&path);
            }
        }
    }
}

/// Reads values off the input: bytes, then f32 bit patterns (NaN, ±inf, subnormals).
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn byte(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }
    fn f32(&mut self) -> f32 {
        f32::from_le_bytes([self.byte(), self.byte(), self.byte(), self.byte()])
    }
    fn small(&mut self, n: u8) -> usize {
        (self.byte() % n) as usize
    }
}

fn all_finite(xs: &[f32]) -> bool {
    xs.iter().all(|x| x.is_finite())
}

/// The batch and head validation and the kernels behind it: a small valid batch and
/// head with values from the input written over them (ids, advantages, log-probs,
/// sampler ratios, logits, hidden states, weights), the loss's knobs from the input.
/// Every call returns a typed error, or finite loss and gradients.
pub fn batch_validation(data: &[u8]) {
    let mut r = Reader(data);
    let (b, t, v, h) = (
        1 + r.small(3),
        1 + r.small(4),
        1 + r.small(24),
        1 + r.small(5),
    );
    let spec = InputSpec {
        batch: b,
        seq_len: t,
        vocab: v,
        sampler_ratio: r.byte() & 1 == 1,
        per_token_advantages: r.byte() & 1 == 1,
        ..InputSpec::default()
    };
    let mut x = GrpoInputs::random(&spec, r.byte() as u64);
    let mut head = HeadInputs::<f32>::random(b * t, h, v, true, 7);
    let types = LossType::ALL;
    let mut loss = GrpoLossConfig {
        loss_type: types[r.small(types.len() as u8)],
        beta: if r.byte() & 1 == 1 { 0.04 } else { 0.0 },
        entropy_coef: if r.byte() & 1 == 1 { 0.01 } else { 0.0 },
        max_completion_length: Some(t),
        ..GrpoLossConfig::default()
    };
    if loss.loss_type == LossType::Luspo {
        loss.importance_sampling_level = flashloss::ImportanceSamplingLevel::Sequence;
    }
    if r.byte() & 1 == 1 {
        loss.temperature = r.f32() as f64;
    }
    let mut grad_output = 1.0f32;
    let n = b * t;
    for _ in 0..r.small(8) {
        let i = r.byte() as usize;
        match r.small(9) {
            0 => x.data.target_ids[i % n] = r.f32() as i64,
            1 => match &mut x.data.advantages {
                PerSeqOrTokenBuf::Sequence(s) | PerSeqOrTokenBuf::Token(s) => {
                    let k = i % s.len();
                    s[k] = r.f32()
                }
            },
            2 => x.data.old_logp.as_mut().unwrap()[i % n] = r.f32(),
            3 => x.data.ref_logp.as_mut().unwrap()[i % n] = r.f32(),
            4 => {
                if let Some(PerSeqOrTokenBuf::Sequence(s) | PerSeqOrTokenBuf::Token(s)) =
                    x.data.sampler_ratio.as_mut()
                {
                    let k = i % s.len();
                    s[k] = r.f32()
                }
            }
            5 => {
                let k = i % x.logits.len();
                x.logits[k] = r.f32()
            }
            6 => {
                let k = i % head.hidden.len();
                head.hidden[k] = r.f32()
            }
            7 => x.data.mask[i % n] = r.byte() & 1 == 1,
            _ => grad_output = r.f32(),
        }
    }
    let Ok(loss) = GrpoLoss::new(loss) else {
        return;
    };
    let batch = x.batch();
    let layout = LogitsLayout::contiguous(b, t, v);
    let mut logits = x.logits.clone();
    let device = Device::cpu();
    if let Ok(fwd) = device.grpo_logits_in_place(&loss, &batch, &mut logits, &layout, grad_output) {
        assert!(fwd.loss.is_finite(), "logits-level loss {}", fwd.loss);
        assert!(all_finite(&logits), "logits-level gradient not finite");
    }
    let inputs = head.inputs();
    for mode in [Mode::SinglePass, Mode::TwoPass] {
        let opts = FusedOptions {
            bf16_products: Default::default(),
            mode,
            budget_bytes: Some(flashloss::cpu::gemm_reserve_bytes() + (1 << 20)),
            grad_output,
            head_grad: Default::default(),
        };
        if let Ok(out) = device.with_host_grads(&inputs, GrpoCall::new(&loss, &batch, &opts)) {
            assert!(out.loss.is_finite(), "fused GRPO loss {}", out.loss);
            assert!(all_finite(&out.grads.dhidden) && all_finite(&out.grads.dweight));
        }
        let ce = CrossEntropy::new(CeConfig::default()).unwrap();
        if let Ok(out) = device.with_host_grads(&inputs, CeCall::new(&ce, batch.target_ids, &opts))
        {
            assert!(out.loss.is_finite(), "fused CE loss {}", out.loss);
            assert!(all_finite(&out.grads.dhidden) && all_finite(&out.grads.dweight));
        }
    }
}

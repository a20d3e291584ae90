//! The model's hyper-parameters, read from a Hugging Face Qwen2 `config.json` (other
//! keys there are ignored) or given in a training config.

use candle_core::Result;
use serde::{Deserialize, Serialize};
use std::path::Path;

fn default_rope_theta() -> f64 {
    10_000.0
}

fn default_rms_norm_eps() -> f64 {
    1e-6
}

/// Qwen2 hyper-parameters (Hugging Face names).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Qwen2Config {
    /// V: rows of the embedding and of the LM head.
    pub vocab_size: usize,
    /// H: the residual stream width.
    pub hidden_size: usize,
    /// The SwiGLU MLP's inner width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads; head dim = hidden_size / num_attention_heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention); divides num_attention_heads.
    pub num_key_value_heads: usize,
    /// Longest sequence the rotary table covers.
    pub max_position_embeddings: usize,
    /// RoPE base θ.
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    /// RMSNorm ε.
    #[serde(default = "default_rms_norm_eps")]
    pub rms_norm_eps: f64,
    /// The LM head is the embedding matrix (no `lm_head.weight`).
    #[serde(default)]
    pub tie_word_embeddings: bool,
}

impl Qwen2Config {
    /// Reads a Hugging Face `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| candle_core::Error::msg(format!("{}: {e}", path.display())))?;
        let config: Qwen2Config = serde_json::from_str(&text)
            .map_err(|e| candle_core::Error::msg(format!("{}: {e}", path.display())))?;
        config.validate()?;
        Ok(config)
    }

    /// Head dimension D = hidden_size / num_attention_heads.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    /// Checks sizes: all ≥ 1, heads divide the width, kv heads divide heads, even D.
    pub fn validate(&self) -> Result<()> {
        let fields = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        if let Some((name, _)) = fields.iter().find(|(_, v)| *v == 0) {
            candle_core::bail!("model.{name}: must be >= 1")
        }
        if !self.hidden_size.is_multiple_of(self.num_attention_heads)
            || !self.head_dim().is_multiple_of(2)
        {
            candle_core::bail!(
                "model.num_attention_heads: hidden_size {} must split into heads of an even size, got {} heads",
                self.hidden_size,
                self.num_attention_heads
            )
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            candle_core::bail!(
                "model.num_key_value_heads: {} must divide num_attention_heads {}",
                self.num_key_value_heads,
                self.num_attention_heads
            )
        }
        Ok(())
    }

    /// Every parameter's Hugging Face name and shape, in a fixed order.
    pub fn parameter_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let (h, i, v) = (self.hidden_size, self.intermediate_size, self.vocab_size);
        let kv = self.num_key_value_heads * self.head_dim();
        let mut shapes = vec![("model.embed_tokens.weight".to_string(), vec![v, h])];
        for l in 0..self.num_hidden_layers {
            let p = format!("model.layers.{l}");
            shapes.extend([
                (format!("{p}.input_layernorm.weight"), vec![h]),
                (format!("{p}.self_attn.q_proj.weight"), vec![h, h]),
                (format!("{p}.self_attn.q_proj.bias"), vec![h]),
                (format!("{p}.self_attn.k_proj.weight"), vec![kv, h]),
                (format!("{p}.self_attn.k_proj.bias"), vec![kv]),
                (format!("{p}.self_attn.v_proj.weight"), vec![kv, h]),
                (format!("{p}.self_attn.v_proj.bias"), vec![kv]),
                (format!("{p}.self_attn.o_proj.weight"), vec![h, h]),
                (format!("{p}.post_attention_layernorm.weight"), vec![h]),
                (format!("{p}.mlp.gate_proj.weight"), vec![i, h]),
                (format!("{p}.mlp.up_proj.weight"), vec![i, h]),
                (format!("{p}.mlp.down_proj.weight"), vec![h, i]),
            ]);
        }
        shapes.push(("model.norm.weight".to_string(), vec![h]));
        if !self.tie_word_embeddings {
            shapes.push(("lm_head.weight".to_string(), vec![v, h]));
        }
        shapes
    }
}

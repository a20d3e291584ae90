//! The Qwen2 forward pass with candle ops that all backpropagate.

use super::config::Qwen2Config;
use candle_core::{D, Device, Result, Tensor};
use std::collections::BTreeMap;

/// Keys and values of every layer for the positions seen so far, `[B, kv_heads, S, D]`.
#[derive(Default)]
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
}

/// The additive attention mask `[B, 1, T_new, S]` for queries at cache positions
/// `S - T_new ..` over keys `0 .. S`: 0 where key `k` is visible (`k ≤ q` and
/// `key_valid[b][k]`, or `k = q`, so no row is empty), `-∞` elsewhere.
/// `key_valid` is `[B, S]`, row-major.
pub fn attention_mask(key_valid: &[bool], batch: usize, t_new: usize) -> Result<Tensor> {
    let s = key_valid.len() / batch.max(1);
    if s * batch != key_valid.len() || t_new > s {
        candle_core::bail!(
            "key_valid: {} entries do not form [B={batch}, S >= T_new={t_new}]",
            key_valid.len()
        )
    }
    let mut mask = vec![0f32; batch * t_new * s];
    for b in 0..batch {
        for q in 0..t_new {
            let qpos = s - t_new + q;
            for k in 0..s {
                let visible = k == qpos || (k < qpos && key_valid[b * s + k]);
                if !visible {
                    mask[(b * t_new + q) * s + k] = f32::NEG_INFINITY;
                }
            }
        }
    }
    Tensor::from_vec(mask, (batch, 1, t_new, s), &Device::Cpu)
}

/// A Qwen2 decoder over named weights (tracked `Var` tensors or detached copies).
pub struct Qwen2 {
    config: Qwen2Config,
    weights: BTreeMap<String, Tensor>,
    /// RoPE frequencies `θ^(-2j/D)`, `j < D/2`.
    inv_freq: Vec<f64>,
}

/// `x · wᵀ (+ b)` on the last dimension of `x`.
fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let mut dims = x.dims().to_vec();
    let last = dims.pop().unwrap_or(1);
    let rows: usize = dims.iter().product();
    let mut y = x.reshape((rows, last))?.matmul(&w.t()?)?;
    if let Some(b) = b {
        y = y.broadcast_add(b)?;
    }
    dims.push(w.dim(0)?);
    y.reshape(dims)
}

/// `x / sqrt(mean(x²) + ε) · w` over the last dimension.
fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let inv = (x.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
    x.broadcast_mul(&inv)?.broadcast_mul(w)
}

/// Softmax over the last dimension from differentiable ops (max shift detached).
fn softmax(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

/// `x·cos + rotate_half(x)·sin` with `rotate_half(x) = [-x₂, x₁]` (Hugging Face layout).
fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    let x1 = x.narrow(D::Minus1, 0, d / 2)?;
    let x2 = x.narrow(D::Minus1, d / 2, d / 2)?;
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    x.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?
}

/// `[B, kv, S, D] → [B, kv·rep, S, D]`, each kv head serving `rep` query heads.
fn repeat_kv(x: &Tensor, rep: usize) -> Result<Tensor> {
    if rep == 1 {
        return Ok(x.clone());
    }
    let (b, kv, s, d) = x.dims4()?;
    Tensor::cat(&vec![x; rep], 2)?.reshape((b, kv * rep, s, d))
}

impl Qwen2 {
    /// A model over `weights` (names and shapes of [`Qwen2Config::parameter_shapes`]).
    pub fn new(config: Qwen2Config, weights: BTreeMap<String, Tensor>) -> Self {
        let d = config.head_dim();
        let inv_freq = (0..d / 2)
            .map(|j| config.rope_theta.powf(-2.0 * j as f64 / d as f64))
            .collect();
        Qwen2 {
            config,
            weights,
            inv_freq,
        }
    }

    /// The architecture.
    pub fn config(&self) -> &Qwen2Config {
        &self.config
    }

    fn w(&self, name: &str) -> Result<&Tensor> {
        self.weights
            .get(name)
            .ok_or_else(|| candle_core::Error::msg(format!("model: no parameter {name}")))
    }

    /// The LM head `[V, H]`: `lm_head.weight`, or the embedding when tied.
    pub fn head_weight(&self) -> Result<&Tensor> {
        if self.config.tie_word_embeddings {
            self.w("model.embed_tokens.weight")
        } else {
            self.w("lm_head.weight")
        }
    }

    /// `(cos, sin)` `[B, 1, T, D]` at `positions` `[B, T]`.
    fn rotary(&self, positions: &[u32], batch: usize) -> Result<(Tensor, Tensor)> {
        let d = self.config.head_dim();
        let t = positions.len() / batch;
        let mut cos = Vec::with_capacity(positions.len() * d);
        let mut sin = Vec::with_capacity(positions.len() * d);
        for &p in positions {
            if p as usize >= self.config.max_position_embeddings {
                candle_core::bail!(
                    "positions: {p} is beyond max_position_embeddings {}",
                    self.config.max_position_embeddings
                )
            }
            let angles: Vec<f64> = self.inv_freq.iter().map(|f| p as f64 * f).collect();
            for _ in 0..2 {
                cos.extend(angles.iter().map(|a| a.cos() as f32));
                sin.extend(angles.iter().map(|a| a.sin() as f32));
            }
        }
        let shape = (batch, 1, t, d);
        Ok((
            Tensor::from_vec(cos, shape, &Device::Cpu)?,
            Tensor::from_vec(sin, shape, &Device::Cpu)?,
        ))
    }

    /// Final-norm hidden states `[B, T, H]` of token `ids` `[B, T]` at `positions`,
    /// with additive `mask` `[B, 1, T, S]` ([`attention_mask`]). With a cache, the new
    /// keys and values are appended and attention covers the cached positions too.
    pub fn forward(
        &self,
        ids: &[u32],
        positions: &[u32],
        batch: usize,
        mask: &Tensor,
        mut cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        let c = &self.config;
        if ids.len() != positions.len() || batch == 0 || !ids.len().is_multiple_of(batch) {
            candle_core::bail!(
                "ids: {} ids and {} positions do not form [B={batch}, T]",
                ids.len(),
                positions.len()
            )
        }
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= c.vocab_size) {
            candle_core::bail!(
                "ids: token {bad} is out of range for vocab_size {}",
                c.vocab_size
            )
        }
        let t = ids.len() / batch;
        let (h, d) = (c.hidden_size, c.head_dim());
        let (heads, kv_heads) = (c.num_attention_heads, c.num_key_value_heads);
        let ids_t = Tensor::from_vec(ids.to_vec(), ids.len(), &Device::Cpu)?;
        let mut x = self
            .w("model.embed_tokens.weight")?
            .index_select(&ids_t, 0)?
            .reshape((batch, t, h))?;
        let (cos, sin) = self.rotary(positions, batch)?;
        if let Some(cache) = cache.as_deref_mut() {
            cache.layers.resize(c.num_hidden_layers, None);
        }
        for l in 0..c.num_hidden_layers {
            let p = |s: &str| format!("model.layers.{l}.{s}");
            let xn = rms_norm(&x, self.w(&p("input_layernorm.weight"))?, c.rms_norm_eps)?;
            let proj = |name: &str, n_heads: usize| -> Result<Tensor> {
                let w = self.w(&p(&format!("self_attn.{name}.weight")))?;
                let b = self.w(&p(&format!("self_attn.{name}.bias")))?;
                linear(&xn, w, Some(b))?
                    .reshape((batch, t, n_heads, d))?
                    .transpose(1, 2)
            };
            let q = rope(&proj("q_proj", heads)?, &cos, &sin)?;
            let mut k = rope(&proj("k_proj", kv_heads)?, &cos, &sin)?;
            let mut v = proj("v_proj", kv_heads)?;
            if let Some(cache) = cache.as_deref_mut() {
                if let Some((ck, cv)) = &cache.layers[l] {
                    k = Tensor::cat(&[ck, &k], 2)?;
                    v = Tensor::cat(&[cv, &v], 2)?;
                }
                cache.layers[l] = Some((k.clone(), v.clone()));
            }
            let k = repeat_kv(&k, heads / kv_heads)?;
            let v = repeat_kv(&v, heads / kv_heads)?;
            let scores = (q.contiguous()?.matmul(&k.t()?.contiguous()?)? / (d as f64).sqrt())?;
            let attn = softmax(&scores.broadcast_add(mask)?)?.matmul(&v.contiguous()?)?;
            let attn = attn.transpose(1, 2)?.reshape((batch, t, h))?;
            x = (x + linear(&attn, self.w(&p("self_attn.o_proj.weight"))?, None)?)?;
            let xn = rms_norm(
                &x,
                self.w(&p("post_attention_layernorm.weight"))?,
                c.rms_norm_eps,
            )?;
            let gate = linear(&xn, self.w(&p("mlp.gate_proj.weight"))?, None)?.silu()?;
            let up = linear(&xn, self.w(&p("mlp.up_proj.weight"))?, None)?;
            x = (x + linear(&(gate * up)?, self.w(&p("mlp.down_proj.weight"))?, None)?)?;
        }
        rms_norm(&x, self.w("model.norm.weight")?, c.rms_norm_eps)
    }
}

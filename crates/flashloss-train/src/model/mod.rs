//! A Qwen2-architecture decoder written with candle ops that all have a backward
//! (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP, tied or untied LM
//! head), so every parameter trains; Hugging Face `config.json` + `model.safetensors`
//! loading; generation with a KV cache.

mod config;
mod generate;
mod params;
mod qwen2;

pub use config::Qwen2Config;
pub use generate::{Padded, Sampling, generate, last_logits};
pub use params::Params;
pub use qwen2::{KvCache, Qwen2, attention_mask};

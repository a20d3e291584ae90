//! The model's parameters as candle `Var`s under their Hugging Face names: random
//! initialization, safetensors load and save.

use super::config::Qwen2Config;
use super::qwen2::Qwen2;
use candle_core::{DType, Device, Result, Tensor, Var};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// Trainable parameters by Hugging Face name (f32).
pub struct Params {
    /// The architecture.
    pub config: Qwen2Config,
    /// `name → Var`, in name order.
    pub vars: BTreeMap<String, Var>,
}

impl Params {
    /// Seeded random weights: N(0, 0.02²) matrices, unit norms, zero biases (as
    /// Hugging Face initializes Qwen2).
    pub fn random(config: &Qwen2Config, seed: u64) -> Result<Self> {
        config.validate()?;
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let normal = Normal::new(0.0f32, 0.02).expect("valid normal");
        let mut vars = BTreeMap::new();
        for (name, shape) in config.parameter_shapes() {
            let n: usize = shape.iter().product();
            let values: Vec<f32> = if name.ends_with("norm.weight") {
                vec![1.0; n]
            } else if name.ends_with(".bias") {
                vec![0.0; n]
            } else {
                (0..n).map(|_| normal.sample(&mut rng)).collect()
            };
            let t = Tensor::from_vec(values, shape, &Device::Cpu)?;
            vars.insert(name, Var::from_tensor(&t)?);
        }
        Ok(Params {
            config: config.clone(),
            vars,
        })
    }

    /// Loads `tensors` (e.g. a `model.safetensors`), checking that every parameter of
    /// `config` is there with its shape; weights are converted to f32. Extra tensors
    /// are an error (a wrong architecture), except `lm_head.weight` of a tied model.
    pub fn from_tensors(config: &Qwen2Config, tensors: &HashMap<String, Tensor>) -> Result<Self> {
        config.validate()?;
        let shapes = config.parameter_shapes();
        let mut vars = BTreeMap::new();
        for (name, shape) in &shapes {
            let Some(t) = tensors.get(name) else {
                candle_core::bail!("checkpoint: missing tensor {name} (expected shape {shape:?})")
            };
            if t.dims() != shape.as_slice() {
                candle_core::bail!(
                    "checkpoint: tensor {name} has shape {:?}, expected {shape:?}",
                    t.dims()
                )
            }
            let t = t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?;
            vars.insert(name.clone(), Var::from_tensor(&t)?);
        }
        let known = |n: &str| shapes.iter().any(|(s, _)| s == n) || n == "lm_head.weight";
        if let Some(extra) = tensors.keys().filter(|n| !known(n)).min() {
            candle_core::bail!("checkpoint: unexpected tensor {extra} for this config")
        }
        Ok(Params {
            config: config.clone(),
            vars,
        })
    }

    /// Loads a Hugging Face model folder: `config.json` and `model.safetensors`.
    pub fn from_pretrained(dir: &Path) -> Result<Self> {
        let config = Qwen2Config::from_file(&dir.join("config.json"))?;
        let tensors = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu)?;
        Self::from_tensors(&config, &tensors)
    }

    /// Writes a Hugging Face model folder (`config.json`, `model.safetensors`).
    pub fn save_pretrained(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(candle_core::Error::wrap)?;
        let json = serde_json::to_string_pretty(&self.config).map_err(candle_core::Error::wrap)?;
        std::fs::write(dir.join("config.json"), json).map_err(candle_core::Error::wrap)?;
        candle_core::safetensors::save(&self.tensors(), dir.join("model.safetensors"))
    }

    /// The current values, by name.
    pub fn tensors(&self) -> HashMap<String, Tensor> {
        self.vars
            .iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().detach()))
            .collect()
    }

    /// The model over these parameters: `tracked` builds the autograd graph into the
    /// `Var`s (training); otherwise the weights are detached (generation, no-grad passes).
    pub fn model(&self, tracked: bool) -> Qwen2 {
        let weights = self
            .vars
            .iter()
            .map(|(n, v)| {
                let t = if tracked {
                    v.as_tensor().clone()
                } else {
                    v.as_tensor().detach()
                };
                (n.clone(), t)
            })
            .collect();
        Qwen2::new(self.config.clone(), weights)
    }
}

//! AdamW (decoupled weight decay, as `torch.optim.AdamW`) with global-norm gradient
//! clipping, whose state is saved in checkpoints (so a resumed run continues the same
//! trajectory).

use candle_core::backprop::GradStore;
use candle_core::{Result, Tensor};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};

use crate::model::Params;

/// Optimizer settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimConfig {
    /// β₁.
    pub beta1: f64,
    /// β₂.
    pub beta2: f64,
    /// ε.
    pub eps: f64,
    /// Decoupled weight decay λ: `p ← p - lr·λ·p`.
    pub weight_decay: f64,
    /// Gradients are scaled so their global L2 norm is at most this (0 = off).
    pub max_grad_norm: f64,
}

impl Default for OptimConfig {
    fn default() -> Self {
        OptimConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            max_grad_norm: 1.0,
        }
    }
}

/// AdamW moments per parameter and the step count.
pub struct AdamW {
    config: OptimConfig,
    /// Steps taken (t).
    pub t: u64,
    m: BTreeMap<String, Tensor>,
    v: BTreeMap<String, Tensor>,
}

impl AdamW {
    /// Fresh state (zero moments).
    pub fn new(config: OptimConfig) -> Self {
        AdamW {
            config,
            t: 0,
            m: BTreeMap::new(),
            v: BTreeMap::new(),
        }
    }

    /// One update of every parameter from `grads` (a parameter without a gradient is
    /// an error: the model must train all of them). Returns the gradients' global norm
    /// before clipping.
    pub fn step(&mut self, params: &Params, grads: &GradStore, lr: f64) -> Result<f64> {
        let mut named = Vec::with_capacity(params.vars.len());
        let mut sq = 0f64;
        for (name, var) in &params.vars {
            let Some(g) = grads.get(var.as_tensor()) else {
                candle_core::bail!("optimizer: parameter {name} received no gradient")
            };
            sq += g.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
            named.push((name, var, g));
        }
        let norm = sq.sqrt();
        if !norm.is_finite() {
            candle_core::bail!(
                "optimizer: gradient norm is {norm}; step skipped, parameters unchanged"
            )
        }
        let c = &self.config;
        let clip = if c.max_grad_norm > 0.0 && norm > c.max_grad_norm {
            c.max_grad_norm / (norm + 1e-6)
        } else {
            1.0
        };
        self.t += 1;
        let (b1, b2) = (c.beta1, c.beta2);
        let (bc1, bc2) = (1.0 - b1.powi(self.t as i32), 1.0 - b2.powi(self.t as i32));
        for (name, var, g) in named {
            let g = (g * clip)?;
            let m = match self.m.get(name) {
                Some(m) => ((m * b1)? + (&g * (1.0 - b1))?)?,
                None => (&g * (1.0 - b1))?,
            };
            let v = match self.v.get(name) {
                Some(v) => ((v * b2)? + (g.sqr()? * (1.0 - b2))?)?,
                None => (g.sqr()? * (1.0 - b2))?,
            };
            let p = var.as_tensor().detach();
            let decayed = (&p * (1.0 - lr * c.weight_decay))?;
            let update = ((&m / bc1)? / ((&v / bc2)?.sqrt()? + c.eps)?)?;
            var.set(&(decayed - (update * lr)?)?)?;
            self.m.insert(name.clone(), m);
            self.v.insert(name.clone(), v);
        }
        Ok(norm)
    }

    /// The moments as named tensors (`adam_m/<name>`, `adam_v/<name>`).
    pub fn state(&self) -> HashMap<String, Tensor> {
        let m = self
            .m
            .iter()
            .map(|(n, t)| (format!("adam_m/{n}"), t.clone()));
        let v = self
            .v
            .iter()
            .map(|(n, t)| (format!("adam_v/{n}"), t.clone()));
        m.chain(v).collect()
    }

    /// Restores moments from [`AdamW::state`]'s tensors and the step count.
    pub fn restore(&mut self, tensors: &HashMap<String, Tensor>, t: u64) {
        self.t = t;
        for (key, tensor) in tensors {
            if let Some(n) = key.strip_prefix("adam_m/") {
                self.m.insert(n.to_string(), tensor.clone());
            } else if let Some(n) = key.strip_prefix("adam_v/") {
                self.v.insert(n.to_string(), tensor.clone());
            }
        }
    }
}

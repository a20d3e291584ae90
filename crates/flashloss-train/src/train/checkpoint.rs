//! Checkpoints: `out_dir/checkpoint.safetensors` (parameters, reference policy, AdamW
//! moments) and `out_dir/checkpoint.json` (steps done, AdamW t), written to temporary
//! files and renamed, so an interruption leaves the previous checkpoint whole.
//! Resuming truncates `metrics.jsonl` to the checkpoint's steps: every step after it
//! runs again from the same state and seeds, so no step is lost or doubled.

use super::{Trainer, err};
use crate::model::Params;
use candle_core::{Device, Result, Tensor};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

#[derive(Serialize, Deserialize)]
struct State {
    done: usize,
    adam_t: u64,
}

/// Saves `trainer`'s state after `trainer.done` steps.
pub(super) fn save(trainer: &Trainer) -> Result<()> {
    let dir = &trainer.cfg.out_dir;
    let mut tensors: HashMap<String, Tensor> = trainer
        .params
        .tensors()
        .into_iter()
        .map(|(n, t)| (format!("param/{n}"), t))
        .collect();
    if let Some(r) = &trainer.reference {
        tensors.extend(
            r.tensors()
                .into_iter()
                .map(|(n, t)| (format!("reference/{n}"), t)),
        );
    }
    tensors.extend(trainer.optim.state());
    let tmp = dir.join("checkpoint.safetensors.tmp");
    candle_core::safetensors::save(&tensors, &tmp)?;
    std::fs::rename(&tmp, dir.join("checkpoint.safetensors")).map_err(err)?;
    let state = State {
        done: trainer.done,
        adam_t: trainer.optim.t,
    };
    let tmp = dir.join("checkpoint.json.tmp");
    std::fs::write(&tmp, serde_json::to_string(&state).map_err(err)?).map_err(err)?;
    std::fs::rename(&tmp, dir.join("checkpoint.json")).map_err(err)
}

/// Loads `out_dir`'s checkpoint into `trainer` when there is one.
pub(super) fn restore(trainer: &mut Trainer) -> Result<()> {
    let dir = trainer.cfg.out_dir.clone();
    let Ok(json) = std::fs::read_to_string(dir.join("checkpoint.json")) else {
        return Ok(());
    };
    let state: State = serde_json::from_str(&json).map_err(err)?;
    let all = candle_core::safetensors::load(dir.join("checkpoint.safetensors"), &Device::Cpu)?;
    let part = |prefix: &str| -> HashMap<String, Tensor> {
        all.iter()
            .filter_map(|(k, t)| Some((k.strip_prefix(prefix)?.to_string(), t.clone())))
            .collect()
    };
    let config = trainer.params.config.clone();
    trainer.params = Params::from_tensors(&config, &part("param/"))?;
    let reference = part("reference/");
    if !reference.is_empty() {
        trainer.reference = Some(Params::from_tensors(&config, &reference)?);
    }
    trainer.optim.restore(&all, state.adam_t);
    trainer.done = state.done;
    let metrics = dir.join("metrics.jsonl");
    if let Ok(text) = std::fs::read_to_string(&metrics) {
        let kept: String = text
            .lines()
            .take(state.done)
            .map(|l| format!("{l}\n"))
            .collect();
        std::fs::write(&metrics, kept).map_err(err)?;
    }
    Ok(())
}

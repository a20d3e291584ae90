//! Checkpoints: `out_dir/checkpoint-<steps>.safetensors` (parameters, reference policy,
//! AdamW moments) and the record `out_dir/checkpoint.json` (steps done, AdamW t, the
//! tensors' file with its size and checksum, and the run's config). Crash-safe under
//! `kill -9` at any moment:
//!
//! 1. the tensors go to a new file (temporary name, synced, renamed);
//! 2. the new record is written to `checkpoint.json.tmp` and synced;
//! 3. the current record is copied to `checkpoint.prev.json` (temporary, renamed);
//! 4. `checkpoint.json.tmp` is renamed over `checkpoint.json`: the commit;
//! 5. tensor files that neither record names are removed.
//!
//! At every point `checkpoint.json` names a whole tensor file, and the previous one is
//! kept (`checkpoint.prev.json`). Resuming checks that the config matches the one the
//! checkpoint was written with in every key that changes the run (all but `steps`,
//! `out_dir`, `resume` and `checkpoint_every`), and that the tensor file has the
//! recorded size and checksum; a mismatch or a corrupt file is an error naming the key
//! or the file, and nothing is removed. Resuming truncates `metrics.jsonl` (atomically)
//! to the checkpoint's steps: every step after it runs again from the same state and
//! seeds, so no step is lost or doubled.

use super::{Trainer, err};
use crate::model::Params;
use candle_core::{Device, Result, Tensor};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

/// Config keys that do not change what the steps compute.
const RUN_INDEPENDENT: [&str; 4] = ["steps", "out_dir", "resume", "checkpoint_every"];

/// The checkpoint record (`checkpoint.json`). Records written before the file name,
/// checksum and config were kept read with those absent (`checkpoint.safetensors`,
/// unchecked).
#[derive(Serialize, Deserialize)]
struct State {
    done: usize,
    adam_t: u64,
    #[serde(default = "legacy_file")]
    file: String,
    #[serde(default)]
    bytes: Option<u64>,
    #[serde(default)]
    checksum: Option<String>,
    #[serde(default)]
    config: Option<Value>,
}

fn legacy_file() -> String {
    "checkpoint.safetensors".into()
}

/// FNV-1a (64-bit) of a file's bytes, as hex: detects truncation and corruption.
fn checksum(path: &Path) -> Result<(u64, String)> {
    let bytes = std::fs::read(path).map_err(|e| err(format!("{}: {e}", path.display())))?;
    let mut h: u64 = 0xcbf29ce484222325;
    for &b in &bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    Ok((bytes.len() as u64, format!("{h:016x}")))
}

/// Writes `bytes` to `path` through a synced temporary file and a rename.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp).map_err(err)?;
    f.write_all(bytes).map_err(err)?;
    f.sync_all().map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}

fn sync_dir(dir: &Path) {
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
}

/// The config as JSON without the keys that do not change the run.
fn run_config(trainer: &Trainer) -> Result<Value> {
    let mut v = serde_json::to_value(&trainer.cfg).map_err(err)?;
    if let Value::Object(m) = &mut v {
        for k in RUN_INDEPENDENT {
            m.remove(k);
        }
    }
    Ok(v)
}

/// The first dotted key where `now` differs from `saved`, with both values.
fn first_difference(saved: &Value, now: &Value, path: &str) -> Option<(String, String, String)> {
    match (saved, now) {
        (Value::Object(a), Value::Object(b)) => {
            let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
            keys.sort();
            keys.dedup();
            keys.into_iter().find_map(|k| {
                let key = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                let (x, y) = (
                    a.get(k).unwrap_or(&Value::Null),
                    b.get(k).unwrap_or(&Value::Null),
                );
                first_difference(x, y, &key)
            })
        }
        (a, b) if a == b => None,
        (a, b) => Some((path.to_string(), a.to_string(), b.to_string())),
    }
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
    let file = format!("checkpoint-{}.safetensors", trainer.done);
    let tmp = dir.join(format!("{file}.tmp"));
    candle_core::safetensors::save(&tensors, &tmp)?;
    std::fs::File::open(&tmp)
        .and_then(|f| f.sync_all())
        .map_err(err)?;
    std::fs::rename(&tmp, dir.join(&file)).map_err(err)?;
    let (bytes, sum) = checksum(&dir.join(&file))?;
    let state = State {
        done: trainer.done,
        adam_t: trainer.optim.t,
        file,
        bytes: Some(bytes),
        checksum: Some(sum),
        config: Some(run_config(trainer)?),
    };
    let record = serde_json::to_vec(&state).map_err(err)?;
    let tmp = dir.join("checkpoint.json.tmp");
    {
        let mut f = std::fs::File::create(&tmp).map_err(err)?;
        f.write_all(&record).map_err(err)?;
        f.sync_all().map_err(err)?;
    }
    let current = dir.join("checkpoint.json");
    if let Ok(previous) = std::fs::read(&current) {
        write_atomic(&dir.join("checkpoint.prev.json"), &previous)?;
    }
    std::fs::rename(&tmp, &current).map_err(err)?;
    sync_dir(dir);
    remove_unreferenced(dir)
}

/// Removes tensor files that neither record names, and temporaries: what a `kill -9`
/// between writing a file and committing or cleaning up left behind (called after a
/// save and after a resume, never while a temporary is in use).
fn remove_unreferenced(dir: &Path) -> Result<()> {
    let named: Vec<String> = ["checkpoint.json", "checkpoint.prev.json"]
        .iter()
        .filter_map(|r| std::fs::read(dir.join(r)).ok())
        .filter_map(|b| serde_json::from_slice::<State>(&b).ok())
        .map(|s| s.file)
        .collect();
    for entry in std::fs::read_dir(dir).map_err(err)?.flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        let ours = name.starts_with("checkpoint") || name.starts_with("metrics");
        let stale = ours
            && (name.ends_with(".tmp")
                || (name.ends_with(".safetensors") && !named.contains(&name)));
        if stale {
            let _ = std::fs::remove_file(entry.path());
        }
    }
    Ok(())
}

/// What a resume says when the checkpoint cannot be used.
fn unusable(dir: &Path, what: String) -> candle_core::Error {
    let prev = std::fs::read(dir.join("checkpoint.prev.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<State>(&b).ok());
    let hint = match prev {
        Some(p) => format!(
            "; nothing was removed: the previous checkpoint (after {} steps) is recorded in checkpoint.prev.json, and copying it over checkpoint.json resumes from it",
            p.done
        ),
        None => "; nothing was removed".into(),
    };
    err(format!("resume from {}: {what}{hint}", dir.display()))
}

/// Loads `out_dir`'s checkpoint into `trainer` when there is one.
pub(super) fn restore(trainer: &mut Trainer) -> Result<()> {
    let dir = trainer.cfg.out_dir.clone();
    let record = dir.join("checkpoint.json");
    let bytes = match std::fs::read(&record) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(unusable(&dir, format!("cannot read checkpoint.json: {e}"))),
    };
    let state: State = serde_json::from_slice(&bytes)
        .map_err(|e| unusable(&dir, format!("checkpoint.json is corrupted: {e}")))?;
    if let Some(saved) = &state.config {
        let now = run_config(trainer)?;
        if let Some((key, was, is)) = first_difference(saved, &now, "") {
            return Err(unusable(
                &dir,
                format!(
                    "config key `{key}` is {is} but the checkpoint was written with {was}; it changes the run (use a new out_dir, or resume: false to start over)"
                ),
            ));
        }
    }
    let path = dir.join(&state.file);
    if let (Some(want_bytes), Some(want_sum)) = (state.bytes, &state.checksum) {
        let (got_bytes, got_sum) = checksum(&path)
            .map_err(|e| unusable(&dir, format!("cannot read {}: {e}", state.file)))?;
        if got_bytes != want_bytes {
            return Err(unusable(
                &dir,
                format!(
                    "{} is truncated or damaged: {got_bytes} bytes, the record says {want_bytes}",
                    state.file
                ),
            ));
        }
        if &got_sum != want_sum {
            return Err(unusable(
                &dir,
                format!(
                    "{} is corrupted: checksum {got_sum}, the record says {want_sum}",
                    state.file
                ),
            ));
        }
    }
    let all = candle_core::safetensors::load(&path, &Device::Cpu)
        .map_err(|e| unusable(&dir, format!("{} cannot be loaded: {e}", state.file)))?;
    let part = |prefix: &str| -> HashMap<String, Tensor> {
        all.iter()
            .filter_map(|(k, t)| Some((k.strip_prefix(prefix)?.to_string(), t.clone())))
            .collect()
    };
    let config = trainer.params.config.clone();
    trainer.params = Params::from_tensors(&config, &part("param/"))
        .map_err(|e| unusable(&dir, format!("{}: {e}", state.file)))?;
    let reference = part("reference/");
    if !reference.is_empty() {
        trainer.reference = Some(
            Params::from_tensors(&config, &reference)
                .map_err(|e| unusable(&dir, format!("{}: {e}", state.file)))?,
        );
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
        write_atomic(&metrics, kept.as_bytes())?;
    }
    remove_unreferenced(&dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn differences_name_the_dotted_key() {
        let a: Value = serde_json::json!({"loss": {"grpo": {"beta": 0.04}}, "seed": 0});
        let b: Value = serde_json::json!({"loss": {"grpo": {"beta": 0.1}}, "seed": 0});
        let (key, was, is) = first_difference(&a, &b, "").unwrap();
        assert_eq!(
            (key.as_str(), was.as_str(), is.as_str()),
            ("loss.grpo.beta", "0.04", "0.1")
        );
        assert!(first_difference(&a, &a, "").is_none());
        let c: Value = serde_json::json!({"seed": 0});
        assert_eq!(first_difference(&a, &c, "").unwrap().0, "loss");
    }
}

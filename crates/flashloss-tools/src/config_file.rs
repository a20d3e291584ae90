//! YAML configs (through `serde_yaml_ng`) with `--set dotted.key=value` overrides.
//! Unknown keys and wrong types are errors that name the dotted key.

use crate::{Error, Result};
use serde::de::DeserializeOwned;
use serde_yaml_ng::{Mapping, Value};
use std::path::Path;

/// Reads `path` as YAML, applies the `key=value` overrides and deserializes into `T`.
pub fn load<T: DeserializeOwned>(path: &Path, overrides: &[String]) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::ConfigFile {
        key: "<file>".into(),
        reason: format!("cannot read {}: {e}", path.display()),
    })?;
    parse(&text, overrides)
}

/// Parses YAML `text`, applies the overrides (`a.b=value`, value read as YAML) and
/// deserializes into `T`.
pub fn parse<T: DeserializeOwned>(text: &str, overrides: &[String]) -> Result<T> {
    let mut root: Value = serde_yaml_ng::from_str(text).map_err(|e| Error::ConfigFile {
        key: "<file>".into(),
        reason: e.to_string(),
    })?;
    if root.is_null() {
        root = Value::Mapping(Mapping::new());
    }
    for o in overrides {
        apply_override(&mut root, o)?;
    }
    serde_path_to_error::deserialize(root).map_err(|e| {
        let path = e.path().to_string();
        Error::ConfigFile {
            key: if path == "." { "<root>".into() } else { path },
            reason: e.into_inner().to_string(),
        }
    })
}

fn apply_override(root: &mut Value, item: &str) -> Result<()> {
    let bad = |reason: String| Error::ConfigFile {
        key: item.split('=').next().unwrap_or(item).to_string(),
        reason,
    };
    let (key, raw) = item
        .split_once('=')
        .ok_or_else(|| bad("an override must look like key=value".into()))?;
    let value: Value =
        serde_yaml_ng::from_str(raw).map_err(|e| bad(format!("bad value {raw:?}: {e}")))?;
    let mut node = root;
    let parts: Vec<&str> = key.split('.').collect();
    for (k, part) in parts.iter().enumerate() {
        let map = match node {
            Value::Mapping(m) => m,
            _ => return Err(bad(format!("`{}` is not a mapping", parts[..k].join(".")))),
        };
        let name = Value::String(part.to_string());
        if k + 1 == parts.len() {
            map.insert(name, value);
            return Ok(());
        }
        node = map
            .entry(name)
            .or_insert_with(|| Value::Mapping(Mapping::new()));
    }
    unreachable!("split always yields at least one part")
}

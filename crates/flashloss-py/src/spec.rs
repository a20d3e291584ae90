//! The one spec of a native call, parsed here for the torch entry points and the JAX
//! handlers alike: the JSON object
//!
//! ```text
//! {"config": {...}, "mode": "auto", "budget_mib": 160.0, "grad_output": 1.0,
//!  "head_grad": "full", "weight_layout": "vh", "temperature": 1.0,
//!  "top_k": 0, "top_p": 1.0, "min_p": 0.0, "vocab": 0,
//!  "names": {"target_ids": "completion_ids", ...}}
//! ```
//!
//! where `config` is the loss's Rust config (`GrpoLossConfig`, `CeConfig`; unknown keys
//! are errors) and each other field is present where the call takes it. Python builds it
//! in one place (`flashloss._spec.native.call_spec`); an error names the field (or the
//! config's key).

use flashloss::WeightLayout;
use flashloss::fused::{FusedOptions, HeadGrad, Mode};
use serde::Deserialize;
use serde::de::DeserializeOwned;

/// An argument's error: its name and why.
#[derive(Debug)]
pub(crate) struct ArgError {
    pub(crate) arg: String,
    pub(crate) reason: String,
}

fn err(arg: &str, reason: impl std::fmt::Display) -> ArgError {
    ArgError {
        arg: arg.into(),
        reason: reason.to_string(),
    }
}

impl From<ArgError> for pyo3::PyErr {
    fn from(e: ArgError) -> Self {
        crate::tensor::arg_error(&e.arg, e.reason)
    }
}

/// A parsed spec (see the module's documentation).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Spec {
    config: Option<serde_json::Value>,
    mode: Option<Mode>,
    budget_mib: Option<f64>,
    grad_output: Option<f64>,
    head_grad: Option<HeadGrad>,
    weight_layout: Option<String>,
    temperature: Option<f64>,
    top_k: Option<i64>,
    top_p: Option<f64>,
    min_p: Option<f64>,
    vocab: Option<i64>,
    /// The caller's names of the core's arguments (`target_ids` -> `completion_ids`), which
    /// a handler's errors use (see [`Spec::reword`]).
    names: Option<std::collections::BTreeMap<String, String>>,
}

/// A loss's config from its JSON alone (the trace-time checks of `flashloss.jax`), with
/// the message a spec's `config` gives.
pub(crate) fn config_from_json<C: DeserializeOwned>(json: &str) -> Result<C, ArgError> {
    let de = &mut serde_json::Deserializer::from_str(json);
    let value = serde_path_to_error::deserialize(de).map_err(|e| json_error(e, "config"))?;
    config_value(&value)
}

fn config_value<C: DeserializeOwned>(value: &serde_json::Value) -> Result<C, ArgError> {
    serde_path_to_error::deserialize(value).map_err(|e| json_error(e, "config"))
}

/// A JSON error named by its path (`whole` at the top; a config's keys by their own
/// name, inside a spec or alone), its message without serde_json's "at line L column C":
/// the config alone and inside a spec number their columns differently, and a check at
/// trace time must give the handler's very message.
fn json_error(e: serde_path_to_error::Error<serde_json::Error>, whole: &str) -> ArgError {
    let path = e.path().to_string();
    let arg = match path.as_str() {
        "." => whole,
        p => p.strip_prefix("config.").unwrap_or(p),
    };
    let inner = e.into_inner();
    let message = inner.to_string();
    let at = format!(" at line {} column {}", inner.line(), inner.column());
    err(arg, message.strip_suffix(&at).unwrap_or(&message))
}

impl Spec {
    /// Parses `json`; an unknown or mistyped field is an error naming it.
    pub(crate) fn parse(json: &str) -> Result<Spec, ArgError> {
        let de = &mut serde_json::Deserializer::from_str(json);
        serde_path_to_error::deserialize(de).map_err(|e| json_error(e, "spec"))
    }

    /// `message` in the caller's names: each ``argument `x` `` whose `x` the spec's
    /// `names` maps names the caller's argument instead.
    pub(crate) fn reword(&self, message: &str) -> String {
        let mut out = message.to_string();
        for (core, caller) in self.names.iter().flatten() {
            out = out.replace(
                &format!("argument `{core}`"),
                &format!("argument `{caller}`"),
            );
        }
        out
    }

    /// The loss's config; an error names its key (e.g. `loss_type`).
    pub(crate) fn config<C: DeserializeOwned>(&self) -> Result<C, ArgError> {
        let value = self
            .config
            .as_ref()
            .ok_or_else(|| err("config", "missing"))?;
        config_value(value)
    }

    /// The options: `mode` (default auto), `budget_mib` (positive; absent: unset, the
    /// backend's default: the CPU's 160 MiB, the GPU's from its memory), `grad_output`
    /// (default 1, finite) and `head_grad` (default full).
    pub(crate) fn options(&self) -> Result<FusedOptions, ArgError> {
        let mib = self.budget_mib;
        if let Some(mib) = mib
            && !(mib.is_finite() && mib > 0.0)
        {
            return Err(err(
                "budget_mib",
                format!("must be a positive number, got {mib}"),
            ));
        }
        let g = self.grad_output.unwrap_or(1.0);
        if !g.is_finite() {
            return Err(err("grad_output", format!("must be finite, got {g}")));
        }
        let mode = self.mode.unwrap_or_default();
        Ok(FusedOptions {
            head_grad: self.head_grad.unwrap_or(HeadGrad::Full),
            ..FusedOptions::from_mib(mode, mib, g as f32)
        })
    }

    /// `weight_layout`: `"vh"` (`[V, H]`, the default) or `"hv"` (`[H, V]`).
    pub(crate) fn weight_layout(&self) -> flashloss::Result<WeightLayout> {
        WeightLayout::from_name(self.weight_layout.as_deref().unwrap_or("vh"))
    }

    /// The sampler filters `(top_k, top_p, min_p)`, each optional.
    pub(crate) fn filters(&self) -> (Option<i64>, Option<f64>, Option<f64>) {
        (self.top_k, self.top_p, self.min_p)
    }

    /// A required float field.
    pub(crate) fn f64(&self, name: &'static str) -> Result<f64, ArgError> {
        let v = match name {
            "temperature" => self.temperature,
            "top_p" => self.top_p,
            "min_p" => self.min_p,
            "grad_output" => self.grad_output,
            _ => None,
        };
        v.ok_or_else(|| err(name, "missing"))
    }

    /// A required integer field.
    pub(crate) fn i64(&self, name: &'static str) -> Result<i64, ArgError> {
        let v = match name {
            "top_k" => self.top_k,
            "vocab" => self.vocab,
            _ => None,
        };
        v.ok_or_else(|| err(name, "missing"))
    }
}

#[cfg(test)]
mod tests {
    use super::Spec;
    use flashloss::fused::{HeadGrad, Mode};

    #[test]
    fn parses_and_checks_each_field() {
        let s =
            Spec::parse(r#"{"config": {"a": 1}, "mode": "two_pass", "budget_mib": 2}"#).unwrap();
        let o = s.options().unwrap();
        assert_eq!(
            (o.mode, o.head_grad, o.grad_output),
            (Mode::TwoPass, HeadGrad::Full, 1.0)
        );
        assert_eq!(o.budget_bytes, Some(2 << 20));
        let e = Spec::parse(r#"{"budget": 2}"#).unwrap_err();
        assert!(e.reason.contains("unknown field"), "{e:?}");
        let e = Spec::parse(r#"{"mode": "fast"}"#).unwrap_err();
        assert_eq!(e.arg, "mode");
        let e = Spec::parse(r#"{"budget_mib": -1}"#)
            .unwrap()
            .options()
            .unwrap_err();
        assert_eq!(e.arg, "budget_mib");
        // No budget: unset, the backend's default (CPU 160 MiB; CUDA from the device).
        let unset = Spec::parse("{}").unwrap().options().unwrap();
        assert_eq!(unset.budget_bytes, None);
        assert_eq!(unset.budget(), 160 << 20);
        #[derive(serde::Deserialize, Debug)]
        #[serde(deny_unknown_fields)]
        #[allow(dead_code)]
        struct C {
            loss_type: u8,
        }
        let e = Spec::parse(r#"{"config": {"loss_type": "x"}}"#)
            .unwrap()
            .config::<C>()
            .unwrap_err();
        assert_eq!(e.arg, "loss_type");
        assert!(Spec::parse("{}").unwrap().config::<C>().is_err());
    }

    /// The trace-time check of a config alone gives the handler's very error, for a bad
    /// value and for text that is not JSON (Python writes a NaN as `NaN`).
    #[test]
    fn a_config_alone_and_in_a_spec_give_one_error() {
        #[derive(serde::Deserialize, Debug)]
        #[allow(dead_code)]
        struct C {
            loss_type: u8,
            beta: f32,
        }
        for config in [
            r#"{"loss_type": "x", "beta": 0}"#,
            r#"{"loss_type": 1, "beta": NaN}"#,
        ] {
            let alone = super::config_from_json::<C>(config).unwrap_err();
            let spec = format!(r#"{{"config": {config}, "budget_mib": 1}}"#);
            let inside = Spec::parse(&spec)
                .and_then(|s| s.config::<C>())
                .unwrap_err();
            assert_eq!((&alone.arg, &alone.reason), (&inside.arg, &inside.reason));
            assert!(
                ["loss_type", "beta"].contains(&alone.arg.as_str()),
                "{alone:?}"
            );
            assert!(!alone.reason.contains("column"), "{alone:?}");
        }
    }
}

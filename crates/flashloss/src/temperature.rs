//! The sampling temperature `T` of every loss, checked once where it is made
//! ([`Temperature::new`]); kernels take a [`Temperature`], so they never see an invalid
//! one.

use crate::error::{Error, Result};

/// A sampling temperature `T`, checked once ([`Temperature::new`]): finite, > 0, and
/// `1/T` within f32 (the kernels scale logits by it in f32).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Temperature(f64);

impl Temperature {
    /// `temperature`, or an error naming `temperature`.
    pub fn new(temperature: f64) -> Result<Self> {
        let t = temperature;
        if t.is_finite() && t > 0.0 && ((1.0 / t) as f32).is_finite() {
            Ok(Temperature(t))
        } else {
            Err(Error::InvalidArgument {
                arg: "temperature",
                reason: format!("must be finite and > 0 with 1/temperature within f32, got {t}"),
            })
        }
    }

    /// A temperature of a config that [`Temperature::new`] has already accepted.
    pub(crate) fn checked(temperature: f64) -> Self {
        debug_assert!(Temperature::new(temperature).is_ok());
        Temperature(temperature)
    }

    /// [`Temperature::new`] for a config's field: the error names the field.
    pub(crate) fn of_config(temperature: f64) -> Result<Self> {
        Temperature::new(temperature).map_err(|e| match e {
            Error::InvalidArgument { arg, reason } => Error::InvalidConfig { field: arg, reason },
            other => other,
        })
    }

    /// `T`.
    pub fn get(self) -> f64 {
        self.0
    }
}

impl Default for Temperature {
    fn default() -> Self {
        Temperature(1.0)
    }
}

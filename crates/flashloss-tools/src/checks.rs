//! The one place where the tools' configs are checked before anything is drawn or
//! allocated: every numeric field against its class (a size is >= 1, a fraction is in
//! [0, 1], a scale or a budget is finite and > 0, a factor is finite), each error a
//! [`Error::ConfigFile`] naming the dotted key; and the memory a run plans against what
//! the machine has available ([`flashloss::Error::OutOfMemory`] with the bytes asked and
//! available) before its inputs are drawn.

use crate::bench::{BenchConfig, Impl, Level, LossKind};
use crate::gradcheck::{
    Backend, EXACT_MAX_HIDDEN, GradcheckConfig, Kernel, LogprobsConfig, Objective,
};
use crate::{Error, Result};
use flashloss::fused::plan::DEFAULT_BUDGET_MIB;
use flashloss::memory::{bytes_of, check_fits};
use flashloss::{CrossEntropy, GrpoLoss, Mode};

fn bad(key: &str, reason: String) -> Error {
    Error::ConfigFile {
        key: key.to_string(),
        reason,
    }
}

/// A size: an integer >= 1.
pub fn size(key: &str, value: usize) -> Result<()> {
    if value == 0 {
        return Err(bad(key, "must be >= 1, got 0".into()));
    }
    Ok(())
}

/// A fraction: finite and in [0, 1].
pub fn fraction(key: &str, value: f64) -> Result<()> {
    if !(0.0..=1.0).contains(&value) {
        return Err(bad(
            key,
            format!("must be a fraction in [0, 1], got {value}"),
        ));
    }
    Ok(())
}

/// A scale, duration or budget: finite and > 0.
pub fn positive(key: &str, value: f64) -> Result<()> {
    if !(value.is_finite() && value > 0.0) {
        return Err(bad(key, format!("must be finite and > 0, got {value}")));
    }
    Ok(())
}

/// A factor: finite.
pub fn finite(key: &str, value: f64) -> Result<()> {
    if !value.is_finite() {
        return Err(bad(key, format!("must be finite, got {value}")));
    }
    Ok(())
}

/// A tolerance: unset, or finite and >= 0.
pub fn tolerance(key: &str, value: Option<f64>) -> Result<()> {
    match value {
        Some(x) if !(x.is_finite() && x >= 0.0) => {
            Err(bad(key, format!("must be finite and >= 0, got {x}")))
        }
        _ => Ok(()),
    }
}

/// `a · b · ...` of sizes, or an error naming `key` when it overflows `usize`.
pub fn product(key: &str, dims: &[usize]) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| bad(key, format!("the product of {dims:?} overflows")))
}

/// Bytes of `count` elements of `elem` bytes each, summed (saturating).
fn bytes(parts: &[(u128, usize)]) -> u64 {
    parts
        .iter()
        .fold(0u64, |acc, &(n, e)| acc.saturating_add(bytes_of(n, e)))
}

impl GradcheckConfig {
    /// Checks every numeric field and the loss configs; the first error names its key.
    pub fn validate(&self) -> Result<()> {
        size("batch", self.batch)?;
        size("seq_len", self.seq_len)?;
        size("vocab", self.vocab)?;
        size("hidden", self.hidden)?;
        if let Some(g) = self.vocab_groups {
            size("vocab_groups", g)?;
        }
        fraction("masked_fraction", self.masked_fraction)?;
        fraction("policy_mask_fraction", self.policy_mask_fraction)?;
        fraction("entropy_mask_fraction", self.entropy_mask_fraction)?;
        positive("logit_std", self.logit_std)?;
        finite("grad_output", self.grad_output)?;
        positive("budget_mib", self.budget_mib)?;
        positive("timeout_s", self.timeout_s)?;
        let t = &self.tolerance;
        tolerance("tolerance.loss_rel", t.loss_rel)?;
        tolerance("tolerance.logp_rel", t.logp_rel)?;
        tolerance("tolerance.grad_rel", t.grad_rel)?;
        tolerance("tolerance.grad_atol", t.grad_atol)?;
        product(
            "batch·seq_len·vocab",
            &[self.batch, self.seq_len, self.vocab],
        )?;
        let grpo = GrpoLoss::new(self.loss.clone())?;
        CrossEntropy::new(self.ce.clone())?;
        if self.objective == Objective::Grpo && grpo.support().is_some() {
            self.exact_hidden()?;
        }
        self.validate_logprobs()
    }

    /// Under a truncated support the head is drawn where every f32 logit is exact: at
    /// most [`EXACT_MAX_HIDDEN`] columns.
    fn exact_hidden(&self) -> Result<()> {
        if self.hidden > EXACT_MAX_HIDDEN {
            return Err(bad(
                "hidden",
                format!(
                    "must be <= {EXACT_MAX_HIDDEN} with top_k/top_p/min_p (the head is drawn \
                     where every f32 logit is exact, so that kernel and reference decide the \
                     support on the same values), got {}",
                    self.hidden
                ),
            ));
        }
        Ok(())
    }

    /// The `logprobs` section belongs to objective `logprobs`: a temperature > 0, the
    /// support's filters in range (naming `logprobs.top_k` etc.), run two-pass on a head
    /// of at most [`EXACT_MAX_HIDDEN`] columns (whose logits are then exact).
    fn validate_logprobs(&self) -> Result<()> {
        let lp = &self.logprobs;
        if self.objective != Objective::Logprobs {
            if *lp != LogprobsConfig::default() {
                return Err(bad("logprobs", "needs objective `logprobs`".into()));
            }
            return Ok(());
        }
        positive("logprobs.temperature", lp.temperature)?;
        product(
            "batch·seq_len·logprobs.gather_k",
            &[self.batch, self.seq_len, lp.gather_k],
        )?;
        let Some(filter) = lp.support() else {
            return Ok(());
        };
        filter.check().map_err(|e| match e {
            flashloss::Error::InvalidArgument { arg, reason } => {
                bad(&format!("logprobs.{arg}"), reason)
            }
            e => Error::Kernel(e),
        })?;
        if matches!(self.mode, Mode::SinglePass | Mode::Compact) {
            return Err(bad(
                "mode",
                "top_k/top_p/min_p run two-pass; use two_pass, auto or auto_f32".into(),
            ));
        }
        self.exact_hidden()
    }

    /// Host bytes a one-rank gradcheck holds at its peak (inputs, the f64 reference and
    /// the kernel's outputs), a slight overestimate.
    pub fn planned_bytes(&self) -> u64 {
        let n = self.batch as u128 * self.seq_len as u128;
        let (v, h) = (self.vocab as u128, self.hidden as u128);
        let elem = self.dtype.size();
        let per_token = (n, 64);
        match self.kernel {
            // f32 logits drawn, their storage copy, the kernel's dlogits, the f64 dense
            // logits and the f64 reference dlogits (and its row buffers).
            Kernel::Logits => bytes(&[(n * v, 4 + 2 * elem + 8 + 8), (4 * v, 8), per_token]),
            // The head in storage and f32 grads, f64 reference logits and dlogits
            // [N, V] (and the f32 logits the token inputs are drawn with), f64
            // reference grads, and the workspace budget.
            // Objective `logprobs` adds its candidates (ids, upstream, outputs, the
            // reference's) and each row's reference support (flags and gradient).
            Kernel::Linear => {
                let head = (n + v) * h + v;
                let budget = (self.budget_mib.max(0.0) * 1048576.0) as u128;
                let logprobs = self.objective == Objective::Logprobs;
                let candidates = n * self.logprobs.gather_k as u128 * u128::from(logprobs);
                let supports = n * v * u128::from(logprobs && self.logprobs.support().is_some());
                bytes(&[
                    (head, elem + 4 + 8),
                    (n * v, 4 + 8 + 8),
                    (budget, 1),
                    (4 * v, 8),
                    per_token,
                    (candidates, 8 + 4 + 4 + 8 + 8),
                    (supports, 8 + 1),
                ])
            }
        }
    }

    /// [`GradcheckConfig::validate`], then the plan against the memory available.
    pub fn check_plan(&self) -> Result<u64> {
        self.validate()?;
        let planned = self.planned_bytes();
        check_fits("gradcheck (inputs, kernel outputs, f64 reference)", planned)?;
        Ok(planned)
    }
}

impl BenchConfig {
    /// Checks every numeric field and the loss configs; the first error names its key.
    pub fn validate(&self) -> Result<()> {
        size("tokens", self.tokens)?;
        size("batch", self.batch)?;
        size("hidden", self.hidden)?;
        size("vocab", self.vocab)?;
        size("repeat", self.repeat)?;
        if let Some(g) = self.vocab_groups {
            size("vocab_groups", g)?;
        }
        if !self.tokens.is_multiple_of(self.batch) {
            return Err(bad(
                "batch",
                format!("must divide tokens = {}, got {}", self.tokens, self.batch),
            ));
        }
        if let Some(mib) = self.budget_mib {
            positive("budget_mib", mib)?;
        }
        fraction("padding", self.padding)?;
        product("tokens·vocab", &[self.tokens, self.vocab])?;
        product("tokens·hidden", &[self.tokens, self.hidden])?;
        product("vocab·hidden", &[self.vocab, self.hidden])?;
        GrpoLoss::new(self.grpo.clone())?;
        CrossEntropy::new(self.ce.clone())?;
        self.validate_logprobs()
    }

    /// A `logprobs` bench runs at level `linear`; `gather_k` and the support's keys
    /// (`top_k`, `top_p`, `min_p`, in range) belong to it (and the support to GRPO at
    /// level `linear`), on either device.
    fn validate_logprobs(&self) -> Result<()> {
        let logprobs = self.loss == LossKind::Logprobs;
        if logprobs && self.level != Level::Linear {
            return Err(bad(
                "loss",
                "logprobs is benchmarked at level `linear`".into(),
            ));
        }
        if let Some(f) = self.support() {
            let grpo_linear = self.loss == LossKind::Grpo && self.level == Level::Linear;
            if !(logprobs || grpo_linear) {
                let key = f.first_set().unwrap_or("top_k");
                return Err(bad(
                    key,
                    "needs loss `logprobs` or `grpo` at level `linear`".into(),
                ));
            }
            f.check().map_err(|e| match e {
                flashloss::Error::InvalidArgument { arg, reason } => bad(arg, reason),
                e => Error::Kernel(e),
            })?;
        }
        if self.gather_k > 0 && !logprobs {
            return Err(bad("gather_k", "needs loss `logprobs`".into()));
        }
        Ok(())
    }

    /// Host bytes of what every run of this bench needs (its inputs, the fused step and
    /// the same-run reference), and of what the baseline adds.
    pub fn planned_bytes(&self) -> (u64, u64) {
        let (n, v, h) = (self.tokens as u128, self.vocab as u128, self.hidden as u128);
        let elem = self.dtype.size();
        let per_token = (n, 64);
        if self.device == Backend::Cuda {
            // The host draws the head and the per-token inputs; the rest is on the
            // device (checked against its free memory by the GPU bench).
            return (bytes(&[((n + v) * h, elem), per_token]), 0);
        }
        match self.level {
            // Logits drawn in f32 and stored, the fused dlogits, the copy reference's
            // two f32 buffers; the baseline's three f32 [N, V] buffers.
            Level::Logits => (
                bytes(&[(n * v, 4 + 2 * elem + 8), per_token]),
                bytes(&[(n * v, 12)]),
            ),
            // The head in storage and f32 grads, the workspace budget, the GEMM
            // reference's f32 [N, V] and f32 operands; the baseline's four f32 [N, V]
            // buffers and widened inputs.
            Level::Linear => {
                let head = (n + v) * h;
                let mib = self.budget_mib.unwrap_or(DEFAULT_BUDGET_MIB);
                let budget = (mib.max(0.0) * 1048576.0) as u128;
                (
                    bytes(&[(head, elem + 4 + 4), (budget, 1), (n * v, 4), per_token]),
                    bytes(&[(n * v, 16), (head, 4)]),
                )
            }
        }
    }

    /// [`BenchConfig::validate`], then the plan against the memory available: an error
    /// when the fused run cannot fit; whether the baseline fits too (a bench with
    /// `impl: baseline` alone must fit it).
    pub fn check_plan(&self) -> Result<bool> {
        self.validate()?;
        let (common, baseline) = self.planned_bytes();
        check_fits("bench inputs, fused step and same-run reference", common)?;
        let with_baseline = check_fits("bench baseline", common.saturating_add(baseline));
        match (self.implementation, with_baseline) {
            (Impl::Baseline, Err(e)) => Err(e.into()),
            (_, r) => Ok(r.is_ok()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes() {
        assert!(size("x", 0).is_err() && size("x", 1).is_ok());
        for bad in [-0.1, 1.5, f64::NAN, f64::INFINITY] {
            assert!(fraction("f", bad).is_err(), "{bad}");
        }
        assert!(fraction("f", 0.0).is_ok() && fraction("f", 1.0).is_ok());
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(positive("p", bad).is_err(), "{bad}");
        }
        assert!(finite("g", -2.0).is_ok() && finite("g", f64::NAN).is_err());
        assert!(product("p", &[usize::MAX, 2]).is_err());
        assert_eq!(product("p", &[3, 4]).unwrap(), 12);
    }
}

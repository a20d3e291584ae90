//! The sampler's truncation filters (docs/spec/losses.md, "Truncated support"): vLLM V1
//! applies min-p, then top-k, then top-p to the scaled logits `s = z/T`; the support `K`
//! is what survives. Spec layer: no backend.

use crate::error::{Error, Result};

/// The filters of a truncated support, applied in vLLM's order (min-p, top-k, top-p); an
/// unset filter (`None`, `top_k ≥ V`, `top_p = 1`, `min_p = 0`) keeps every entry.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SupportFilter {
    /// Keep the entries whose logit is at least the k-th largest (ties kept); `≥ 1`.
    pub top_k: Option<usize>,
    /// Keep the smallest set of largest probabilities whose mass reaches it; `(0, 1]`.
    pub top_p: Option<f64>,
    /// Keep `p_j ≥ min_p · max_j p_j`; `[0, 1]`.
    pub min_p: Option<f64>,
}

impl SupportFilter {
    /// The filters of a caller's `top_k` (`None` or 0: none), `top_p` and `min_p`, checked:
    /// the one rule of every native entry (the bindings' own is `flashloss._spec.SamplerFilters`).
    pub fn of_caller(top_k: Option<i64>, top_p: Option<f64>, min_p: Option<f64>) -> Result<Self> {
        let top_k = match top_k {
            None | Some(0) => None,
            Some(k) => Some(usize::try_from(k).map_err(|_| Error::InvalidArgument {
                arg: "top_k",
                reason: format!("must be at least 1 (0: none), got {k}"),
            })?),
        };
        let filter = SupportFilter {
            top_k,
            top_p,
            min_p,
        };
        filter.check()?;
        Ok(filter)
    }

    /// The name of the first filter set, in vLLM's argument order (`top_k`, `top_p`,
    /// `min_p`): what an error about the filter names. `None` when none is set.
    pub fn first_set(&self) -> Option<&'static str> {
        [
            ("top_k", self.top_k.is_some()),
            ("top_p", self.top_p.is_some()),
            ("min_p", self.min_p.is_some()),
        ]
        .into_iter()
        .find_map(|(name, set)| set.then_some(name))
    }

    /// Checks the ranges (`top_k ≥ 1`, `0 < top_p ≤ 1`, `0 ≤ min_p ≤ 1`), naming the
    /// argument.
    pub fn check(&self) -> Result<()> {
        let bad = |arg: &'static str, reason: String| Err(Error::InvalidArgument { arg, reason });
        if self.top_k == Some(0) {
            return bad("top_k", "must be at least 1 (None: no top-k)".into());
        }
        if let Some(p) = self.top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
            return bad("top_p", format!("must be in (0, 1], got {p}"));
        }
        if let Some(m) = self.min_p.filter(|m| !(0.0..=1.0).contains(m)) {
            return bad("min_p", format!("must be in [0, 1], got {m}"));
        }
        Ok(())
    }
}

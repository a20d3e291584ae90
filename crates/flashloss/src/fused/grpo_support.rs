//! GRPO under the sampler's truncated support (spec, flashloss addition 13): with
//! `top_k`/`top_p`/`min_p` in the loss config, each row's `logp` is
//! `logp^K = s_y - lse^K` over the support `K` of vLLM V1's filters ([`super::support`]),
//! a token whose target is outside its `K` is masked (`m' = m·1[y∈K]`, in every term,
//! normalizer and metric), and the gradient holds `K` fixed:
//!
//! `dz_j = (g/T)·[dlogp·(1[j=y] - p^K_j)·1[j∈K] - dentropy·p_j·(log p_j + H)]`
//!
//! (the entropy stays the full softmax's). Two-pass: pass A with the support's search
//! (and its extra passes), the policy stage on `logp^K` and `m'`, then pass B:
//! `2NHV·(1 + extra) + 6NHV` FLOPs (`4NHV` on a frozen head).

use super::logp::{LogpCall, LogpRows, pass_a, pass_b};
use super::logp_request::{LogpRequest, LogpUpstream, SupportStats};
use super::passes::FusedPasses;
use super::plan::FusedOptions;
use crate::batch::GrpoBatch;
use crate::collective::Collective;
use crate::error::{Error, Result};
use crate::grpo_config::GrpoLoss;
use crate::policy::{Normalizers, PolicyOutput, policy_stage};
use crate::range::check_policy_rows;
use crate::rows::{RowInputs, RowStats, RowTransform, check_row_stats};
use crate::sharding::VocabSplit;
use crate::support_filter::SupportFilter;
use crate::temperature::Temperature;
use std::ops::Range;

/// A GRPO step under a support: every row's statistics with `logp^K`, `lse^K` in place
/// of `logp`, `lse` (`logp^K = -inf` where the target is outside), the policy stage's
/// outputs on the mask `m'` with its normalizers, and the support's outputs.
pub(crate) struct SupportedGrpo {
    pub(crate) stats: Vec<RowStats>,
    pub(crate) policy: PolicyOutput,
    pub(crate) support: SupportStats,
    /// The normalizers the policy stage ran with (the outside tokens taken off).
    pub(crate) norm: Normalizers,
}

/// The GRPO step of `batch` under `filter` on the head's vocabulary `range` (of the
/// whole vocabulary's `vocab` entries; `split` merges the shards' statistics).
/// `norm` are the normalizers of the batch's own mask (all-reduced over `tokens` in a
/// sharded run); the tokens outside their support are taken off them, summed over
/// `tokens`.
pub(crate) fn grpo_support(
    passes: &mut dyn FusedPasses,
    (loss, batch, filter): (&GrpoLoss, &GrpoBatch, SupportFilter),
    (norm, tokens): (Normalizers, Option<&dyn Collective>),
    (inputs, opts): (&RowInputs, &FusedOptions),
    (range, vocab, split): (Range<usize>, usize, Option<&VocabSplit>),
) -> Result<SupportedGrpo> {
    let rows = LogpRows {
        targets: batch.target_ids,
        mask: Some(batch.mask),
        temperature: Temperature::checked(loss.config().temperature),
    };
    let request = LogpRequest {
        support: Some(filter),
        ..LogpRequest::default()
    };
    let (n, t) = (batch.rows(), batch.seq_len);
    // Every failure before the normalizers' all-reduce goes into `found`, so that every
    // rank of a token group takes part in it.
    let found = LogpCall::new((rows, request, None), n, vocab, opts, t).and_then(|call| {
        let (stats, _, run) = pass_a(passes, &call, (inputs, range), split)?;
        let run = run.ok_or_else(|| Error::InvalidArgument {
            arg: "top_k/top_p/min_p",
            reason: "the truncated support did not run".into(),
        })?;
        Ok((run.stats(&stats, &call.live), stats, run, call))
    });
    let norm = without_outside(norm, tokens, batch, found.as_ref().map(|f| &f.0.outside))?;
    let (support, mut stats, run, call) = found?;
    let mask: Vec<bool> = (0..n)
        .map(|i| batch.mask[i] && !support.outside[i])
        .collect();
    let masked = GrpoBatch {
        mask: &mask,
        ..*batch
    };
    let logp: Vec<f32> = (0..n)
        .map(|i| if mask[i] { support.logp[i] } else { 0.0 })
        .collect();
    let entropy: Vec<f32> = stats.iter().map(|s| s.entropy).collect();
    let policy = policy_stage(loss, &masked, norm, &logp, &entropy);
    let live = |i: usize| mask[i];
    check_row_stats(&stats, live, batch.target_ids, t)?;
    let scale = Some(RowTransform::grpo(loss).grad_scale(opts.grad_output as f64));
    check_policy_rows(&policy, |i| entropy[i], 0..n, live, t, scale)?;
    let upstream = LogpUpstream::new(&policy.dlogp, Some(&policy.dentropy));
    let call = call.with_upstream(upstream)?;
    pass_b(passes, &call, (&stats, run.rows.as_deref()), split)?;
    for (i, st) in stats.iter_mut().enumerate().filter(|(i, _)| batch.mask[*i]) {
        (st.logp, st.lse) = (support.logp[i], support.lse[i]);
    }
    Ok(SupportedGrpo {
        stats,
        policy,
        support,
        norm,
    })
}

/// `norm` less the live tokens `outside` their support (the token count and the
/// entropy bonus's), summed over `tokens`; a rank that failed before (`Err`) still
/// takes part, and every rank then fails.
pub(crate) fn without_outside(
    norm: Normalizers,
    tokens: Option<&dyn Collective>,
    batch: &GrpoBatch,
    outside: std::result::Result<&Vec<bool>, &Error>,
) -> Result<Normalizers> {
    let mut dropped = match outside {
        Ok(outside) => {
            let kept = norm.without(batch, outside);
            let tokens = norm.token_count - kept.token_count;
            [tokens, norm.entropy_count - kept.entropy_count, 0.0]
        }
        Err(_) => [0.0, 0.0, 1.0],
    };
    if let Some(c) = tokens {
        c.all_reduce_sum_f64(&mut dropped)?;
    }
    if dropped[2] > 0.0 && outside.is_ok() {
        return Err(Error::Collective {
            reason: "another rank's pass over the vocabulary failed".into(),
        });
    }
    Ok(Normalizers {
        batch_size: norm.batch_size,
        token_count: norm.token_count - dropped[0],
        entropy_count: norm.entropy_count - dropped[1],
    })
}

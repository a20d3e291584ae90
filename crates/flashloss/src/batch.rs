//! The inputs of a GRPO step, their shapes and their validation.
//!
//! A batch is B sequences of T completion positions, flattened to N = B·T rows with
//! `row = b·T + t`. Rule for every `[B, T]` input: only positions with `mask = true`
//! are read, so padding may hold anything (e.g. `-100` ids).

use crate::element::Element;
use crate::error::{Error, Result};
use crate::grpo_config::GrpoLoss;
use crate::weight_layout::WeightLayout;
use rayon::prelude::*;

/// Where row `(b, t)` of a `[B, T, V]` logits buffer starts: `b·seq_stride + t·row_stride`.
/// Strides larger than `T·V` and `V` let a slice of a `[B, T+1, V]` model output be
/// passed without a copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogitsLayout {
    /// B, the number of sequences.
    pub batch: usize,
    /// T, completion positions per sequence.
    pub seq_len: usize,
    /// V, the vocabulary size (elements read per row).
    pub vocab: usize,
    /// Elements between positions t and t+1 of a sequence (≥ V).
    pub row_stride: usize,
    /// Elements between sequences b and b+1 (≥ (T-1)·row_stride + V).
    pub seq_stride: usize,
}

impl LogitsLayout {
    /// A dense `[B, T, V]` layout.
    pub fn contiguous(batch: usize, seq_len: usize, vocab: usize) -> Self {
        LogitsLayout {
            batch,
            seq_len,
            vocab,
            row_stride: vocab,
            seq_stride: seq_len * vocab,
        }
    }

    /// N = B·T.
    pub fn rows(&self) -> usize {
        self.batch * self.seq_len
    }

    /// Offset of row `row = b·T + t`.
    pub fn offset(&self, row: usize) -> usize {
        (row / self.seq_len) * self.seq_stride + (row % self.seq_len) * self.row_stride
    }

    /// Smallest buffer length that holds every row.
    pub fn required_len(&self) -> usize {
        if self.rows() == 0 {
            0
        } else {
            self.offset(self.rows() - 1) + self.vocab
        }
    }

    /// Checks sizes, that rows do not overlap, and that `len` elements hold them all.
    pub fn validate(&self, arg: &'static str, len: usize) -> Result<()> {
        let bad = |reason: String| Err(Error::InvalidArgument { arg, reason });
        if self.batch == 0 || self.seq_len == 0 || self.vocab == 0 {
            return bad(format!(
                "batch, seq_len and vocab must be >= 1, got [B={}, T={}, V={}]",
                self.batch, self.seq_len, self.vocab
            ));
        }
        if self.row_stride < self.vocab {
            return bad(format!(
                "row_stride {} is smaller than vocab {}",
                self.row_stride, self.vocab
            ));
        }
        if self.batch > 1 && self.seq_stride < (self.seq_len - 1) * self.row_stride + self.vocab {
            return bad(format!(
                "seq_stride {} makes sequences overlap (need >= {})",
                self.seq_stride,
                (self.seq_len - 1) * self.row_stride + self.vocab
            ));
        }
        if len < self.required_len() {
            return Err(Error::ShapeMismatch {
                arg,
                shape: format!(
                    "[B={}, T={}, V={}] with strides ({}, {})",
                    self.batch, self.seq_len, self.vocab, self.seq_stride, self.row_stride
                ),
                expected: self.required_len(),
                actual: len,
            });
        }
        Ok(())
    }

    /// Checks that `len` elements are a dense `[N, V]` buffer of this layout's rows (a
    /// gradient written dense whatever the logits' strides).
    pub fn validate_dense(&self, arg: &'static str, len: usize) -> Result<()> {
        let (n, v) = (self.rows(), self.vocab);
        if len != n * v {
            return Err(Error::ShapeMismatch {
                arg,
                shape: format!("[N={n}, V={v}]"),
                expected: n * v,
                actual: len,
            });
        }
        Ok(())
    }
}

/// A value given either once per sequence (`[B]`) or once per token (`[B, T]`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PerSeqOrToken<'a> {
    /// One value per sequence, `[B]`.
    Sequence(&'a [f32]),
    /// One value per token, `[B, T]`.
    Token(&'a [f32]),
}

impl PerSeqOrToken<'_> {
    /// The value for row `row = b·T + t`.
    #[inline]
    pub fn at(&self, row: usize, seq_len: usize) -> f32 {
        match self {
            PerSeqOrToken::Sequence(v) => v[row / seq_len],
            PerSeqOrToken::Token(v) => v[row],
        }
    }
}

/// The per-token inputs of a GRPO step (everything but the logits or hidden states).
#[derive(Debug, Clone, Copy)]
pub struct GrpoBatch<'a> {
    /// B.
    pub batch: usize,
    /// T.
    pub seq_len: usize,
    /// Sampled token ids `[B, T]`, in `[0, V)` where the mask is set.
    pub target_ids: &'a [i64],
    /// Completion mask `[B, T]`.
    pub mask: &'a [bool],
    /// Advantages `[B]` or `[B, T]`, finite.
    pub advantages: PerSeqOrToken<'a>,
    /// Old-policy logp `[B, T]`; absent means on-policy (ratio 1).
    pub old_logp: Option<&'a [f32]>,
    /// Reference-policy logp `[B, T]`; required when β > 0.
    pub ref_logp: Option<&'a [f32]>,
    /// Detached sampler importance ratio ρ `[B]` or `[B, T]` (vLLM-style correction,
    /// TRL's `importance_sampling_ratio`): `ℓ_tot,i = ℓ_i·e_i·ρ_i + β·kl_i`; for vespo
    /// it enters `log w_b` instead (`+ Σ_t m·clamp(log ρ_t, ln 1e-8, 20)`).
    pub sampler_ratio: Option<PerSeqOrToken<'a>>,
    /// Per-token policy mask `[B, T]` (TRL's off-policy sequence mask, broadcast to
    /// tokens): `false` zeroes the policy term `ℓ_i` only (not the KL, not the
    /// entropy bonus). Absent means all `true`.
    pub policy_mask: Option<&'a [bool]>,
    /// Top-entropy-quantile mask `[B, T]` (TRL's `entropy_mask`): `false` zeroes the
    /// policy term `ℓ_i` and drops the token from the entropy bonus's mean
    /// (`m' = m · entropy_mask`). Absent means all `true`.
    pub entropy_mask: Option<&'a [bool]>,
}

fn check_len(arg: &'static str, len: usize, expected: usize, shape: String) -> Result<()> {
    if len == expected {
        Ok(())
    } else {
        Err(Error::ShapeMismatch {
            arg,
            shape,
            expected,
            actual: len,
        })
    }
}

impl GrpoBatch<'_> {
    /// N = B·T.
    pub fn rows(&self) -> usize {
        self.batch * self.seq_len
    }

    /// `e_i`: 1 where both [`GrpoBatch::policy_mask`] and [`GrpoBatch::entropy_mask`]
    /// (when given) are set, else 0. It multiplies the policy term `ℓ_i`. (A row past
    /// a mask's end, in a batch not yet validated, counts as unset.)
    #[inline]
    pub fn policy_weight(&self, row: usize) -> f64 {
        let on = |m: Option<&[bool]>| m.is_none_or(|m| m.get(row) == Some(&true));
        (on(self.policy_mask) && on(self.entropy_mask)) as u8 as f64
    }

    /// `m'_i`: whether row `row` counts in the entropy bonus (`mask`, and
    /// [`GrpoBatch::entropy_mask`] when given).
    /// Like [`GrpoBatch::policy_weight`], safe on a batch not yet validated (as
    /// [`crate::policy::Normalizers::local`] may be called before the kernel checks it).
    #[inline]
    pub fn in_entropy_bonus(&self, row: usize) -> bool {
        self.mask.get(row) == Some(&true)
            && self.entropy_mask.is_none_or(|e| e.get(row) == Some(&true))
    }

    fn bt(&self) -> String {
        format!("[B={}, T={}]", self.batch, self.seq_len)
    }

    /// Checks every shape, every id (in `[0, vocab)`) and every value (finite; ρ ≥ 0)
    /// that the loss will read, naming the argument and index of the first bad one.
    pub fn validate(&self, vocab: usize, loss: &GrpoLoss) -> Result<()> {
        if self.batch == 0 || self.seq_len == 0 {
            return Err(Error::InvalidArgument {
                arg: "batch",
                reason: format!(
                    "batch and seq_len must be >= 1, got [B={}, T={}]",
                    self.batch, self.seq_len
                ),
            });
        }
        let n = self.rows();
        check_len("target_ids", self.target_ids.len(), n, self.bt())?;
        check_len("mask", self.mask.len(), n, self.bt())?;
        self.check_per_seq_or_token("advantages", &self.advantages, false)?;
        if let Some(rho) = &self.sampler_ratio {
            self.check_per_seq_or_token("importance_sampling_ratio", rho, true)?;
        }
        for (arg, values) in [
            ("policy_mask", self.policy_mask),
            ("entropy_mask", self.entropy_mask),
        ] {
            if let Some(v) = values {
                check_len(arg, v.len(), n, self.bt())?;
            }
        }
        for (arg, values) in [("old_logp", self.old_logp), ("ref_logp", self.ref_logp)] {
            if let Some(v) = values {
                check_len(arg, v.len(), n, self.bt())?;
                self.check_masked_finite(arg, v)?;
            }
        }
        if loss.config().beta > 0.0 && self.ref_logp.is_none() {
            return Err(Error::InvalidArgument {
                arg: "ref_logp",
                reason: format!("required when beta > 0 (beta = {})", loss.config().beta),
            });
        }
        for (i, (&id, &m)) in self.target_ids.iter().zip(self.mask).enumerate() {
            if m && (id < 0 || id as u64 >= vocab as u64) {
                return Err(Error::TokenOutOfRange {
                    arg: "target_ids",
                    index: i,
                    seq: i / self.seq_len,
                    pos: i % self.seq_len,
                    id,
                    vocab,
                });
            }
        }
        Ok(())
    }

    fn check_per_seq_or_token(
        &self,
        arg: &'static str,
        values: &PerSeqOrToken,
        non_negative: bool,
    ) -> Result<()> {
        let bad = |index: usize, value: f32| {
            if non_negative && value.is_finite() {
                Err(Error::InvalidArgument {
                    arg,
                    reason: format!("value {value} at index {index} is negative"),
                })
            } else {
                Err(Error::NonFinite {
                    arg,
                    index,
                    value: value as f64,
                })
            }
        };
        let ok = |v: f32| v.is_finite() && (!non_negative || v >= 0.0);
        match values {
            PerSeqOrToken::Sequence(v) => {
                check_len(arg, v.len(), self.batch, format!("[B={}]", self.batch))?;
                match v.iter().position(|&x| !ok(x)) {
                    Some(i) => bad(i, v[i]),
                    None => Ok(()),
                }
            }
            PerSeqOrToken::Token(v) => {
                check_len(arg, v.len(), self.rows(), self.bt())?;
                match (0..v.len()).find(|&i| self.mask[i] && !ok(v[i])) {
                    Some(i) => bad(i, v[i]),
                    None => Ok(()),
                }
            }
        }
    }

    fn check_masked_finite(&self, arg: &'static str, v: &[f32]) -> Result<()> {
        match (0..v.len()).find(|&i| self.mask[i] && !v[i].is_finite()) {
            Some(index) => Err(Error::NonFinite {
                arg,
                index,
                value: v[index] as f64,
            }),
            None => Ok(()),
        }
    }
}

/// An owned [`PerSeqOrToken`]: values once per sequence (`[B]`) or once per token
/// (`[B, T]`).
#[derive(Debug, Clone, PartialEq)]
pub enum PerSeqOrTokenBuf {
    /// One value per sequence, `[B]`.
    Sequence(Vec<f32>),
    /// One value per token, `[B, T]`.
    Token(Vec<f32>),
}

impl PerSeqOrTokenBuf {
    /// Borrows the values as a [`PerSeqOrToken`].
    pub fn view(&self) -> PerSeqOrToken<'_> {
        match self {
            PerSeqOrTokenBuf::Sequence(v) => PerSeqOrToken::Sequence(v),
            PerSeqOrTokenBuf::Token(v) => PerSeqOrToken::Token(v),
        }
    }
}

/// The per-token inputs of a GRPO step with owned buffers, for callers that build a
/// batch and keep it (a trainer's rollout, random test inputs); [`GrpoBatchData::batch`]
/// borrows it as the [`GrpoBatch`] the kernels take. Same fields, shapes and rules as
/// [`GrpoBatch`].
#[derive(Debug, Clone, PartialEq)]
pub struct GrpoBatchData {
    /// B.
    pub batch: usize,
    /// T.
    pub seq_len: usize,
    /// Sampled token ids `[B, T]`, in `[0, V)` where the mask is set.
    pub target_ids: Vec<i64>,
    /// Completion mask `[B, T]`.
    pub mask: Vec<bool>,
    /// Advantages `[B]` or `[B, T]`, finite.
    pub advantages: PerSeqOrTokenBuf,
    /// Old-policy logp `[B, T]`; absent means on-policy (ratio 1).
    pub old_logp: Option<Vec<f32>>,
    /// Reference-policy logp `[B, T]`; required when β > 0.
    pub ref_logp: Option<Vec<f32>>,
    /// Detached sampler importance ratio ρ `[B]` or `[B, T]`.
    pub sampler_ratio: Option<PerSeqOrTokenBuf>,
    /// Per-token policy mask `[B, T]` (TRL's off-policy mask); absent means all `true`.
    pub policy_mask: Option<Vec<bool>>,
    /// Top-entropy-quantile mask `[B, T]`; absent means all `true`.
    pub entropy_mask: Option<Vec<bool>>,
}

impl GrpoBatchData {
    /// Borrows the buffers as a [`GrpoBatch`].
    pub fn batch(&self) -> GrpoBatch<'_> {
        GrpoBatch {
            batch: self.batch,
            seq_len: self.seq_len,
            target_ids: &self.target_ids,
            mask: &self.mask,
            advantages: self.advantages.view(),
            old_logp: self.old_logp.as_deref(),
            ref_logp: self.ref_logp.as_deref(),
            sampler_ratio: self.sampler_ratio.as_ref().map(PerSeqOrTokenBuf::view),
            policy_mask: self.policy_mask.as_deref(),
            entropy_mask: self.entropy_mask.as_deref(),
        }
    }
}

/// `(N, H, V)` of a head: `[N, H]` hidden states, a `V × H` weight (V: the entries this
/// head holds, a shard's `V_r` in a vocab-parallel run).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadShape {
    /// N rows.
    pub tokens: usize,
    /// H.
    pub hidden_size: usize,
    /// V.
    pub vocab: usize,
}

/// The LM head's inputs: hidden states `[N, H]`, a weight `W` of `V × H` (`[V, H]` or
/// `[H, V]`: [`LinearInputs::layout`]) and an optional bias `[V]`, so that
/// `z_ij = Σ_k hidden_ik·W_jk + bias_j`.
#[derive(Debug, Clone, Copy)]
pub struct LinearInputs<'a, E> {
    /// `[N, H]`, row-major.
    pub hidden: &'a [E],
    /// `[V, H]` or `[H, V]` ([`LinearInputs::layout`]), row-major.
    pub weight: &'a [E],
    /// How `weight` lies in memory; `dW` is written the same way.
    pub layout: WeightLayout,
    /// `[V]`.
    pub bias: Option<&'a [E]>,
    /// N.
    pub tokens: usize,
    /// H.
    pub hidden_size: usize,
    /// V.
    pub vocab: usize,
}

impl HeadShape {
    /// Checks that every dimension is at least 1.
    pub fn check(&self) -> Result<()> {
        let (n, h, v) = (self.tokens, self.hidden_size, self.vocab);
        if n == 0 || h == 0 || v == 0 {
            return Err(Error::InvalidArgument {
                arg: "hidden",
                reason: format!(
                    "tokens, hidden_size and vocab must be >= 1, got [N={n}, H={h}, V={v}]"
                ),
            });
        }
        Ok(())
    }
}

impl<E> LinearInputs<'_, E> {
    /// `(N, H, V)`.
    pub fn shape(&self) -> HeadShape {
        HeadShape {
            tokens: self.tokens,
            hidden_size: self.hidden_size,
            vocab: self.vocab,
        }
    }
}

impl<E: Element> LinearInputs<'_, E> {
    /// Checks sizes, buffer lengths, and that every value is finite.
    pub fn validate(&self) -> Result<()> {
        self.shape().check()?;
        let (n, h, v) = (self.tokens, self.hidden_size, self.vocab);
        check_len(
            "hidden",
            self.hidden.len(),
            n * h,
            format!("[N={n}, H={h}]"),
        )?;
        check_len("weight", self.weight.len(), v * h, self.layout.shape(v, h))?;
        if let Some(b) = self.bias {
            check_len("bias", b.len(), v, format!("[V={v}]"))?;
        }
        for (arg, values) in [
            ("hidden", self.hidden),
            ("weight", self.weight),
            ("bias", self.bias.unwrap_or(&[])),
        ] {
            if let Some(index) = first_non_finite(values) {
                return Err(Error::NonFinite {
                    arg,
                    index,
                    value: values[index].to_f32() as f64,
                });
            }
        }
        Ok(())
    }
}

/// The index of the first entry of `values` that is not finite. Chunks are tested in
/// parallel with a branch-free fold (it vectorizes; a per-element `position_first`
/// costs more than the fused step's exponentials at an LM head's size), then the first
/// bad chunk is searched.
pub(crate) fn first_non_finite<E: Element>(values: &[E]) -> Option<usize> {
    const CHUNK: usize = 1 << 14;
    let bad = |x: &E| !x.to_f32().is_finite();
    let chunk = values
        .par_chunks(CHUNK)
        .position_first(|c| c.iter().fold(false, |any, x| any | bad(x)))?;
    let start = chunk * CHUNK;
    values[start..].iter().position(bad).map(|i| start + i)
}

#[cfg(test)]
mod tests {
    use super::first_non_finite;
    use half::bf16;

    #[test]
    fn first_non_finite_finds_the_first_bad_entry_across_chunks() {
        let n = 3 * (1 << 14) + 17;
        assert_eq!(first_non_finite(&vec![1.0f32; n]), None);
        assert_eq!(first_non_finite::<f32>(&[]), None);
        for (first, second) in [(0, 5), (16_383, 16_384), (16_384, n - 1), (n - 1, n - 1)] {
            let mut x = vec![0.5f32; n];
            x[second] = f32::NAN;
            x[first] = f32::NEG_INFINITY;
            assert_eq!(first_non_finite(&x), Some(first));
            let y: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
            assert_eq!(first_non_finite(&y), Some(first));
        }
    }
}

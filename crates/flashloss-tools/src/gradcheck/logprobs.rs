//! The inputs of objective `logprobs` (the log-prob primitive, `linear_logprobs`) and
//! its f64 reference: on the linear gradcheck's head and mask, seeded random targets (3/4
//! sampled from the head's `softmax(z/T)`, a quarter uniform), upstream gradients
//! `g_logp`, `g_H` (and `g_lse`, the candidates' `c_ik` where asked), candidate ids
//! `k_ik` (a quarter the target, repeats allowed) and the truncated support's filters.
//! The objective is
//!
//! `L = g·Σ_i [g_logp_i·logp_i + g_H_i·H_i + g_lse_i·lse_i + Σ_k c_ik·logp_ik]`
//!
//! over live rows, with `logp^K_i` in place of `logp_i` under a truncated support (a row
//! whose target is outside its support takes no part); its gradient w.r.t. the raw
//! logits is `reference::logp_reference`'s plus `g·g_logp_i·∂logp^K_i/∂z`
//! (`reference::support_row`, the support held fixed).
//!
//! Masked rows get NaN upstream gradients and candidate ids of -1: a kernel that reads
//! them fails. Under a truncated support the head is drawn on a grid on which every f32
//! logit is exact in any summation order ([`exact_grid`]), so kernel and reference decide
//! the support on the same values; rows whose decision is within `MIN_MARGIN` of flipping
//! (top-p's f64 sums, summed in another order) take no upstream gradient of `logp^K` and
//! are not compared.

use super::config::GradcheckConfig;
use crate::inputs::{GrpoInputs, HeadInputs};
use flashloss::SupportFilter;
use flashloss::fused::{GatherIds, LogpRequest, LogpRows, LogpUpstream};
use flashloss::reference::{LogpRefRows, LogpRefUpstream, SupportRow};
use flashloss::reference::{LogpReference, logp_reference, support_row};
use flashloss::{Element, Result, Temperature};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};
use std::ops::Range;

/// Rows whose support decision is nearer than this to flipping are not compared.
const MIN_MARGIN: f64 = 1e-9;

/// Step of the hidden states' grid under a truncated support (`|a|·2^-6 ≤ 1`, 7 bits).
const HIDDEN_STEP: f32 = 1.0 / 64.0;

/// Largest hidden size whose logits are exact on [`exact_grid`]: `H·64·127` (the
/// products) plus `2^15` (the bias) below `2^24`, in units of the products' grid.
pub const EXACT_MAX_HIDDEN: usize = 2048;

/// The inputs of one log-prob check beyond the head: rows, request, upstream gradients
/// and the reference's supports.
pub(crate) struct LogprobsCase {
    targets: Vec<i64>,
    pub(crate) live: Vec<bool>,
    temperature: Temperature,
    pub(crate) sum_p2: bool,
    /// Candidates per row (0: none).
    pub(crate) k: usize,
    /// `[N, k]`, -1 on masked rows.
    ids: Vec<i64>,
    pub(crate) support: Option<SupportFilter>,
    g_logp: Vec<f32>,
    g_entropy: Vec<f32>,
    g_lse: Option<Vec<f32>>,
    /// `[N, k]`.
    g_gathered: Vec<f32>,
    /// Each live row's reference support (under a truncated support).
    support_rows: Vec<Option<SupportRow>>,
    /// Live rows whose support outputs are compared: away from a boundary.
    pub(crate) compared: Vec<bool>,
}

/// Puts `head` on the grid on which every f32 logit is exact: hidden states on
/// multiples of 2^-6 (`|a| ≤ 64`), weight entries on multiples of `2^-e` with `|b| ≤ 127`,
/// the bias on multiples of 2^-6. In units of `2^-(6+e)` a product is an integer of at
/// most `64·127`, the bias one of at most `2^(5+e)` (`e ≤ 10` for `H ≤ 2048`), so for `H ≤`
/// [`EXACT_MAX_HIDDEN`] every partial sum stays below `2^24` units and is exact in f32 in
/// any order (bf16 and f16 hold every value too).
pub(crate) fn exact_grid<E: Element>(head: &mut HeadInputs<E>) {
    let w_max = head
        .weight
        .iter()
        .fold(0f32, |m, x| m.max(x.to_f32().abs()));
    let w_step = (2f32).powi(-(127.0 / w_max.max(f32::MIN_POSITIVE)).log2().floor() as i32);
    let snap = |x: &mut E, step: f32| *x = E::from_f32((x.to_f32() / step).round() * step);
    head.hidden.iter_mut().for_each(|x| snap(x, HIDDEN_STEP));
    head.weight.iter_mut().for_each(|x| snap(x, w_step));
    for b in head.bias.iter_mut().flatten() {
        snap(b, HIDDEN_STEP);
    }
}

/// The entry of `softmax(z/T)` at which the cumulative probability passes `u ∈ [0, 1)`.
pub(super) fn sample(z: &[f64], temperature: f64, u: f64) -> i64 {
    let max = z.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x));
    let w: Vec<f64> = z.iter().map(|&x| ((x - max) / temperature).exp()).collect();
    let mut left = u * w.iter().sum::<f64>();
    let last = z.len() - 1;
    (w.iter().position(|&p| {
        left -= p;
        left < 0.0
    }))
    .unwrap_or(last) as i64
}

impl LogprobsCase {
    /// Draws the upstream gradients and candidate ids (seed `seed + 2`) for `tokens` on
    /// a head of raw logits `z` `[N, V]`, and each live row's reference support.
    pub(crate) fn new(cfg: &GradcheckConfig, tokens: &GrpoInputs, z: &[f64]) -> Result<Self> {
        let lp = &cfg.logprobs;
        let live = tokens.data.mask.clone();
        let (n, v, k) = (live.len(), cfg.vocab, lp.gather_k);
        let temperature = Temperature::new(lp.temperature)?;
        let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed.wrapping_add(2));
        // A sampler's tokens (mostly inside a truncated support) and a quarter drawn
        // uniformly (mostly outside).
        let targets: Vec<i64> = (0..n)
            .map(|i| match rng.random_bool(0.75) {
                true => sample(&z[i * v..(i + 1) * v], lp.temperature, rng.random()),
                false => rng.random_range(0..v) as i64,
            })
            .collect();
        let normal = Normal::new(0.0f32, 1.0).expect("a unit normal");
        let mut draw = |per_row: usize| -> Vec<f32> {
            (0..n * per_row)
                .map(|at| match live[at / per_row] {
                    true => normal.sample(&mut rng),
                    false => f32::NAN,
                })
                .collect()
        };
        let mut g_logp = draw(1);
        let g_entropy = draw(1);
        let g_lse = lp.lse_grad.then(|| draw(1));
        let g_gathered = draw(k);
        let ids = (0..n * k)
            .map(|at| match (live[at / k], rng.random_bool(0.25)) {
                (false, _) => -1,
                (true, true) => targets[at / k],
                (true, false) => rng.random_range(0..v) as i64,
            })
            .collect();
        let support = lp.support();
        let support_rows: Vec<Option<SupportRow>> = (0..n)
            .map(|i| {
                let f = support.filter(|_| live[i])?;
                let row = &z[i * v..(i + 1) * v];
                Some(support_row(row, lp.temperature, targets[i] as usize, f))
            })
            .collect();
        let compared: Vec<bool> = (0..n)
            .map(|i| {
                live[i]
                    && support_rows[i]
                        .as_ref()
                        .is_none_or(|s| s.margin >= MIN_MARGIN)
            })
            .collect();
        for i in (0..n).filter(|&i| live[i] && !compared[i]) {
            g_logp[i] = 0.0;
        }
        Ok(LogprobsCase {
            targets,
            live,
            temperature,
            sum_p2: lp.return_sum_p2,
            k,
            ids,
            support,
            g_logp,
            g_entropy,
            g_lse,
            g_gathered,
            support_rows,
            compared,
        })
    }

    /// The rows `rows` of the call: their targets, mask and temperature, the request
    /// (their candidate ids) and the upstream gradients.
    pub(crate) fn call(
        &self,
        rows: Range<usize>,
    ) -> (LogpRows<'_>, LogpRequest<'_>, LogpUpstream<'_>) {
        let k = self.k;
        let per_row = rows.start * k..rows.end * k;
        let call_rows = LogpRows {
            targets: &self.targets[rows.clone()],
            mask: Some(&self.live[rows.clone()]),
            temperature: self.temperature,
        };
        let request = LogpRequest {
            sum_p2: self.sum_p2,
            gather_ids: (k > 0).then(|| GatherIds {
                ids: &self.ids[per_row.clone()],
                k,
            }),
            support: self.support,
        };
        let upstream = LogpUpstream {
            logp: &self.g_logp[rows.clone()],
            entropy: Some(&self.g_entropy[rows.clone()]),
            lse: self.g_lse.as_ref().map(|g| &g[rows.clone()]),
            gathered: (k > 0).then(|| &self.g_gathered[per_row]),
        };
        (call_rows, request, upstream)
    }

    /// The reference on raw logits `z` `[N, V]` with `grad_output` `g`: its outputs and
    /// the objective's gradient w.r.t. the raw logits `[N, V]`.
    pub(crate) fn reference(&self, z: &[f64], v: usize, g: f64) -> (Outputs, Vec<f64>) {
        let rows = LogpRefRows {
            targets: &self.targets,
            live: &self.live,
            temperature: self.temperature.get(),
            gather_ids: &self.ids,
            k: self.k,
        };
        let up = LogpRefUpstream {
            logp: if self.support.is_some() {
                &[]
            } else {
                &self.g_logp
            },
            entropy: &self.g_entropy,
            lse: self.g_lse.as_deref().unwrap_or(&[]),
            gathered: &self.g_gathered,
            grad_output: g,
        };
        let mut r = logp_reference(z, v, rows, up);
        for (i, s) in
            (self.support_rows.iter().enumerate()).filter_map(|(i, s)| Some((i, s.as_ref()?)))
        {
            let scale = g * self.g_logp[i] as f64;
            for (d, ds) in r.dlogits[i * v..(i + 1) * v].iter_mut().zip(&s.dlogp) {
                *d += scale * ds;
            }
        }
        let dlogits = std::mem::take(&mut r.dlogits);
        (self.reference_outputs(r), dlogits)
    }

    fn reference_outputs(&self, r: LogpReference) -> Outputs {
        let rows = &self.support_rows;
        let of = |f: &dyn Fn(&SupportRow) -> f64| {
            rows.iter().map(|s| s.as_ref().map_or(0.0, f)).collect()
        };
        let support = self.support.map(|_| SupportOutputs {
            logp: of(&|s| s.logp),
            lse: of(&|s| s.lse),
            size: rows
                .iter()
                .map(|s| s.as_ref().map_or(0, |s| s.size as u64))
                .collect(),
            outside: (rows.iter().zip(&self.targets))
                .map(|(s, &y)| s.as_ref().is_some_and(|s| !s.in_support[y as usize]))
                .collect(),
        });
        Outputs {
            logp: r.logp,
            entropy: r.entropy,
            lse: r.lse,
            sum_p2: self.sum_p2.then_some(r.sum_p2),
            gathered: r.gathered,
            support,
        }
    }

    /// The objective `L` over the rows of `out` (row `r` of `out` is row `offset + r`)
    /// and the scale of its rounding, `|g|·Σ |g_t|·max(|x_t|, 1)` over its terms.
    pub(crate) fn objective(&self, out: &Outputs, offset: usize, g: f64) -> (f64, f64) {
        let (mut value, mut scale) = (0.0, 0.0);
        let mut add = |grad: f32, x: f64| {
            if grad != 0.0 {
                value += g * grad as f64 * x;
                scale += (g * grad as f64).abs() * x.abs().max(1.0);
            }
        };
        for r in (0..out.logp.len()).filter(|&r| self.live[offset + r]) {
            let i = offset + r;
            match &out.support {
                None => add(self.g_logp[i], out.logp[r]),
                Some(s) if !s.outside[r] => add(self.g_logp[i], s.logp[r]),
                Some(_) => {}
            }
            add(self.g_entropy[i], out.entropy[r]);
            if let Some(g_lse) = &self.g_lse {
                add(g_lse[i], out.lse[r]);
            }
            for c in 0..self.k {
                add(
                    self.g_gathered[i * self.k + c],
                    out.gathered[r * self.k + c],
                );
            }
        }
        (value, scale)
    }

    /// `|g|·Σ_i (|g_logp_i| + |g_H_i| + |g_lse_i| + Σ_k |c_ik|)` over live rows: what a
    /// summed gradient entry (dW, dbias) adds up (the gradient gates' absolute floor).
    pub(crate) fn summed_rows(&self, g: f64) -> f64 {
        let at = |x: &[f32], i: usize, k: usize| -> f64 {
            x[i * k..(i + 1) * k].iter().map(|v| v.abs() as f64).sum()
        };
        (0..self.live.len())
            .filter(|&i| self.live[i])
            .map(|i| {
                let lse = self.g_lse.as_ref().map_or(0.0, |x| at(x, i, 1));
                at(&self.g_logp, i, 1)
                    + at(&self.g_entropy, i, 1)
                    + lse
                    + at(&self.g_gathered, i, self.k)
            })
            .sum::<f64>()
            * g.abs()
    }
}

/// The outputs of a log-prob call in f64 (a kernel's widened, or the reference's), zero
/// on masked rows.
#[derive(Debug, Clone)]
pub(crate) struct Outputs {
    pub(crate) logp: Vec<f64>,
    pub(crate) entropy: Vec<f64>,
    pub(crate) lse: Vec<f64>,
    pub(crate) sum_p2: Option<Vec<f64>>,
    /// `[N, k]`.
    pub(crate) gathered: Vec<f64>,
    pub(crate) support: Option<SupportOutputs>,
}

/// The truncated support's outputs.
#[derive(Debug, Clone)]
pub(crate) struct SupportOutputs {
    /// `logp^K` (`-inf` outside).
    pub(crate) logp: Vec<f64>,
    /// `lse^K`.
    pub(crate) lse: Vec<f64>,
    /// `|K|`.
    pub(crate) size: Vec<u64>,
    /// Whether the target is outside the support.
    pub(crate) outside: Vec<bool>,
}

impl Outputs {
    /// A kernel's outputs.
    pub(crate) fn of(out: &flashloss::fused::LogpOutput) -> Self {
        let f64s = |x: &[f32]| x.iter().map(|&v| v as f64).collect::<Vec<_>>();
        Outputs {
            logp: out.stats.iter().map(|s| s.logp as f64).collect(),
            entropy: out.stats.iter().map(|s| s.entropy as f64).collect(),
            lse: out.stats.iter().map(|s| s.lse as f64).collect(),
            sum_p2: out.sum_p2.as_deref().map(f64s),
            gathered: out.gathered.as_deref().map(f64s).unwrap_or_default(),
            support: out.support.as_ref().map(|s| SupportOutputs {
                logp: f64s(&s.logp),
                lse: f64s(&s.lse),
                size: s.size.clone(),
                outside: s.outside.clone(),
            }),
        }
    }
}

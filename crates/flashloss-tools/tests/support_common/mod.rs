//! Helpers of the truncated-support tests (`logp_support.rs`, `logp_support_split.rs`):
//! heads of exact values, the filters in both APIs, a forward call and its comparison with
//! the f64 reference.
#![allow(dead_code)]

use flashloss::SupportFilter;
use flashloss::cpu::{CpuHead, Workspace};
use flashloss::fused::{self, LogpOutput, LogpRequest, LogpRows, SupportStats};
use flashloss::reference::support_row;
use flashloss::{Element, HeadGrad, LinearGrads, LinearInputs, Temperature, WeightLayout};

/// A head of exact values: hidden `k/4`, weight `k/8`, bias `k/16` (small integers `k`),
/// so every logit is a multiple of 1/32 below 2^10 and exact in f32 and bf16. `ties`:
/// vocabulary rows from 64 on repeat three patterns (thousands of tied logits), and the
/// last hidden row is zero (a row whose logits are all the bias, or all equal).
pub struct ExactHead<E> {
    pub hidden: Vec<E>,
    pub weight: Vec<E>,
    pub bias: Option<Vec<E>>,
    pub n: usize,
    pub h: usize,
    pub v: usize,
}

impl<E: Element> ExactHead<E> {
    pub fn new((n, h, v): (usize, usize, usize), bias: bool, ties: bool, seed: u64) -> Self {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut int = |range: i64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state % (2 * range as u64 + 1)) as i64 - range) as f32
        };
        let mut hidden: Vec<f32> = (0..n * h).map(|_| int(4) / 4.0).collect();
        let mut weight: Vec<f32> = (0..v * h).map(|_| int(4) / 8.0).collect();
        if ties {
            for j in 64..v {
                let pattern = j % 3;
                for k in 0..h {
                    weight[j * h + k] = weight[pattern * h + k];
                }
            }
            hidden[(n - 1) * h..].fill(0.0);
        }
        let bias = bias.then(|| (0..v).map(|_| E::from_f32(int(8) / 16.0)).collect());
        ExactHead {
            hidden: hidden.into_iter().map(E::from_f32).collect(),
            weight: weight.into_iter().map(E::from_f32).collect(),
            bias,
            n,
            h,
            v,
        }
    }

    pub fn inputs(&self) -> LinearInputs<'_, E> {
        LinearInputs {
            hidden: &self.hidden,
            weight: &self.weight,
            layout: WeightLayout::VocabMajor,
            bias: self.bias.as_deref(),
            tokens: self.n,
            hidden_size: self.h,
            vocab: self.v,
        }
    }
}

pub const fn filter(top_k: Option<usize>, top_p: Option<f64>, min_p: Option<f64>) -> SupportFilter {
    SupportFilter {
        top_k,
        top_p,
        min_p,
    }
}

/// Every combination of the filters, each unset, set to cut, or set to its no-op value.
pub fn combinations(v: usize) -> Vec<SupportFilter> {
    let mut out = Vec::new();
    for top_k in [None, Some(1), Some(37), Some(v)] {
        for top_p in [None, Some(0.35), Some(0.9), Some(1.0)] {
            for min_p in [None, Some(0.0), Some(0.05)] {
                out.push(filter(top_k, top_p, min_p));
            }
        }
    }
    out
}

/// A budget of a few rows per block beyond the GEMM reserve (several blocks and tiles).
pub fn small_budget() -> usize {
    flashloss::cpu::gemm_reserve_bytes() + (3 << 20) / 2
}

pub struct Call<'a> {
    pub targets: &'a [i64],
    pub mask: Option<&'a [bool]>,
    pub temperature: f64,
}

impl Call<'_> {
    pub fn rows(&self) -> LogpRows<'_> {
        LogpRows {
            targets: self.targets,
            mask: self.mask,
            temperature: Temperature::new(self.temperature).unwrap(),
        }
    }
}

pub fn forward<E: Element>(inputs: &LinearInputs<E>, call: &Call, f: SupportFilter) -> LogpOutput {
    let mut ws = Workspace::new();
    let mut grads = LinearGrads::zeros_for(inputs, HeadGrad::Frozen);
    let mut head = CpuHead {
        inputs,
        ws: &mut ws,
        grads: grads.view(),
    };
    let request = LogpRequest {
        support: Some(f),
        ..LogpRequest::default()
    };
    fused::logp_linear_with(
        &mut head,
        call.rows(),
        &request,
        small_budget(),
        inputs.tokens,
    )
    .unwrap()
}

/// Compares the support outputs of `out` with the reference on every live row whose
/// margin is at least `min_margin`; returns the rows compared.
pub fn check_forward(
    case: &str,
    out: &LogpOutput,
    z: &[f64],
    call: &Call,
    f: SupportFilter,
    min_margin: f64,
) -> usize {
    let s: &SupportStats = out.support.as_ref().expect("support outputs");
    let (n, v) = (call.targets.len(), z.len() / call.targets.len());
    let mut compared = 0;
    for i in 0..n {
        if !call.mask.is_none_or(|m| m[i]) {
            assert_eq!(
                (s.logp[i], s.lse[i], s.size[i], s.outside[i]),
                (0.0, 0.0, 0, false)
            );
            continue;
        }
        let y = call.targets[i] as usize;
        let want = support_row(&z[i * v..(i + 1) * v], call.temperature, y, f);
        assert!(
            s.lse[i].is_finite() && !s.logp[i].is_nan(),
            "{case} row {i}"
        );
        if want.margin < min_margin {
            continue;
        }
        compared += 1;
        let what = format!("{case} row {i}");
        assert_eq!(s.size[i], want.size as u64, "{what}: size");
        assert_eq!(s.outside[i], !want.in_support[y], "{what}: outside");
        let close = |a: f32, b: f64| (a as f64 - b).abs() <= 1e-5 * b.abs().max(1.0);
        assert!(
            close(s.lse[i], want.lse),
            "{what}: lse {} vs {}",
            s.lse[i],
            want.lse
        );
        match s.outside[i] {
            true => assert_eq!(s.logp[i], f32::NEG_INFINITY, "{what}"),
            false => assert!(
                close(s.logp[i], want.logp),
                "{what}: logp {} vs {}",
                s.logp[i],
                want.logp
            ),
        }
    }
    compared
}

/// `head`'s vocabulary entries `range` (weight rows and bias).
pub fn shard_of<E: Element>(head: &ExactHead<E>, range: std::ops::Range<usize>) -> ExactHead<E> {
    ExactHead {
        hidden: head.hidden.clone(),
        weight: head.weight[range.start * head.h..range.end * head.h].to_vec(),
        bias: head.bias.as_ref().map(|b| b[range.clone()].to_vec()),
        n: head.n,
        h: head.h,
        v: range.len(),
    }
}

impl ExactHead<f32> {
    /// A head of random floats (`flashloss_tools::inputs::HeadInputs`), as an `ExactHead`.
    pub fn random((n, h, v): (usize, usize, usize), seed: u64) -> Self {
        let r = flashloss_tools::inputs::HeadInputs::<f32>::random(n, h, v, true, seed);
        ExactHead {
            hidden: r.hidden.clone(),
            weight: r.weight.clone(),
            bias: r.bias.clone(),
            n,
            h,
            v,
        }
    }
}

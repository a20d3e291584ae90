//! Log-probs under the sampler's truncated support (top-k / top-p / min-p in vLLM V1's
//! order) through `logp_linear_with` and `logp_linear_grads_with` on the CPU head,
//! against the f64 reference (`reference::support_row`): `logp^K`, `lse^K`, the support
//! size, targets outside the support (`-inf`, zero gradient, counted), and dH, dW, dbias.
//! Exact inputs (small integers scaled by powers of two, temperatures 1 and 1/2) make
//! every f32 logit exact in any summation order, so ties reproduce and the kernel and the
//! reference decide on the same values; random floats compare the rows away from a
//! boundary (the reference's margin).

mod common;
use common::assert_close;
use flashloss::cpu::{CpuHead, Workspace};
use flashloss::fused::{
    self, LogpOutput, LogpRequest, LogpRows, LogpUpstream, SupportFilter, SupportStats,
};
use flashloss::reference::{SupportFilters, linear_grads, linear_logits, row_softmax, support_row};
use flashloss::{
    Element, Error, FusedOptions, HeadGrad, LinearGrads, LinearInputs, Mode, Temperature,
    WeightLayout,
};
use half::bf16;

/// A head of exact values: hidden `k/4`, weight `k/8`, bias `k/16` (small integers `k`),
/// so every logit is a multiple of 1/32 below 2^10 and exact in f32 and bf16. `ties`:
/// vocabulary rows from 64 on repeat three patterns (thousands of tied logits), and the
/// last hidden row is zero (a row whose logits are all the bias, or all equal).
struct ExactHead<E> {
    hidden: Vec<E>,
    weight: Vec<E>,
    bias: Option<Vec<E>>,
    n: usize,
    h: usize,
    v: usize,
}

impl<E: Element> ExactHead<E> {
    fn new((n, h, v): (usize, usize, usize), bias: bool, ties: bool, seed: u64) -> Self {
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

    fn inputs(&self) -> LinearInputs<'_, E> {
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

fn filter(top_k: Option<usize>, top_p: Option<f64>, min_p: Option<f64>) -> SupportFilter {
    SupportFilter {
        top_k,
        top_p,
        min_p,
    }
}

fn as_reference(f: SupportFilter) -> SupportFilters {
    SupportFilters {
        top_k: f.top_k,
        top_p: f.top_p,
        min_p: f.min_p,
    }
}

/// Every combination of the filters, each unset, set to cut, or set to its no-op value.
fn combinations(v: usize) -> Vec<SupportFilter> {
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
fn small_budget() -> usize {
    flashloss::cpu::gemm_reserve_bytes() + (3 << 20) / 2
}

struct Call<'a> {
    targets: &'a [i64],
    mask: Option<&'a [bool]>,
    temperature: f64,
}

impl Call<'_> {
    fn rows(&self) -> LogpRows<'_> {
        LogpRows {
            targets: self.targets,
            mask: self.mask,
            temperature: Temperature::new(self.temperature).unwrap(),
        }
    }
}

fn forward<E: Element>(inputs: &LinearInputs<E>, call: &Call, f: SupportFilter) -> LogpOutput {
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
fn check_forward(
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
        let want = support_row(&z[i * v..(i + 1) * v], call.temperature, y, as_reference(f));
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

#[test]
fn exact_rows_every_combination_of_the_filters() {
    let (n, h, v) = (7, 12, 2311);
    for (bias, ties) in [(false, false), (true, true), (false, true)] {
        let head = ExactHead::<f32>::new((n, h, v), bias, ties, 3);
        let inputs = head.inputs();
        let z = linear_logits(&inputs);
        let targets: Vec<i64> = (0..n as i64).map(|i| (i * 577 + 11) % v as i64).collect();
        let mask: Vec<bool> = (0..n).map(|i| i != 2).collect();
        for temperature in [1.0, 0.5] {
            let call = Call {
                targets: &targets,
                mask: Some(&mask),
                temperature,
            };
            let plain = forward(&inputs, &call, filter(None, None, None));
            for f in combinations(v) {
                let case = format!("bias={bias} ties={ties} T={temperature} {f:?}");
                let out = forward(&inputs, &call, f);
                check_forward(&case, &out, &z, &call, f, 1e-9);
                let s = out.support.as_ref().unwrap();
                let cuts = f.top_k.is_some_and(|k| k < v)
                    || f.top_p.is_some_and(|p| p < 1.0)
                    || f.min_p.is_some_and(|m| m > 0.0);
                if !cuts {
                    // Unset filters: the plain call's statistics, bitwise.
                    for i in (0..n).filter(|&i| mask[i]) {
                        assert_eq!(s.logp[i].to_bits(), plain.stats[i].logp.to_bits(), "{case}");
                        assert_eq!(s.size[i], v as u64, "{case}");
                    }
                }
            }
        }
    }
}

/// The reference gradient `g_out·(g_logp·∂logp^K/∂z + g_H·∂H/∂z)` `[N, V]` (the entropy
/// the full softmax's), zero on masked rows.
fn reference_dz(
    z: &[f64],
    call: &Call,
    f: SupportFilter,
    (g_logp, g_h): (&[f32], &[f32]),
    g_out: f64,
) -> Vec<f64> {
    let (n, v) = (call.targets.len(), z.len() / call.targets.len());
    let t = call.temperature;
    let mut dz = vec![0.0; n * v];
    for i in (0..n).filter(|&i| call.mask.is_none_or(|m| m[i])) {
        let row = &z[i * v..(i + 1) * v];
        let sup = support_row(row, t, call.targets[i] as usize, as_reference(f));
        let sm = row_softmax(row, t);
        for j in 0..v {
            let (lp, p) = (sm.log_probs[j], sm.log_probs[j].exp());
            let dh = if p > 0.0 {
                -p * (lp + sm.entropy) / t
            } else {
                0.0
            };
            dz[i * v + j] = g_out * (g_logp[i] as f64 * sup.dlogp[j] + g_h[i] as f64 * dh);
        }
    }
    dz
}

/// Gradients of `E` against the reference for each filter, full and frozen heads.
fn check_grads<E: Element>(bias: bool, ties: bool, tol: f64) {
    let (n, h, v) = (6, 10, 2077);
    check_grads_of(
        &ExactHead::<E>::new((n, h, v), bias, ties, 17),
        (0.5, true),
        tol,
    );
}

/// Gradients of `head` at `temperature` against the reference for each filter, full and
/// frozen heads, with an upstream of the entropy where `entropy`.
fn check_grads_of<E: Element>(head: &ExactHead<E>, (temperature, entropy): (f64, bool), tol: f64) {
    let (n, h, v, bias) = (head.n, head.h, head.v, head.bias.is_some());
    let inputs = head.inputs();
    let z = linear_logits(&inputs);
    let targets: Vec<i64> = (0..n as i64).map(|i| (i * 331 + 64) % v as i64).collect();
    let mask: Vec<bool> = (0..n).map(|i| i != 1).collect();
    let g_logp: Vec<f32> = (0..n).map(|i| 0.75 - 0.25 * i as f32).collect();
    let g_h: Vec<f32> = (0..n)
        .map(|i| {
            if entropy {
                0.125 * (i % 3) as f32 - 0.125
            } else {
                0.0
            }
        })
        .collect();
    let call = Call {
        targets: &targets,
        mask: Some(&mask),
        temperature,
    };
    for f in [
        filter(Some(5), None, None),
        filter(None, Some(0.6), None),
        filter(Some(300), Some(0.8), Some(0.01)),
        filter(None, None, Some(0.2)),
    ] {
        let dz = reference_dz(&z, &call, f, (&g_logp, &g_h), 0.75);
        let (dh, dw, db) = linear_grads(&inputs, &dz);
        for head_grad in [HeadGrad::Full, HeadGrad::Frozen] {
            let case = format!(
                "{:?} bias={bias} T={temperature} {f:?} {head_grad:?}",
                E::DTYPE
            );
            let opts = FusedOptions {
                head_grad,
                budget_bytes: small_budget(),
                grad_output: 0.75,
                ..FusedOptions::from_mib(Mode::Auto, 1.0, 1.0)
            };
            let mut grads = LinearGrads::zeros_for(&inputs, head_grad);
            grads.dhidden[h..2 * h].fill(7.0); // the masked row stays as it was
            let mut ws = Workspace::new();
            let mut cpu = CpuHead {
                inputs: &inputs,
                ws: &mut ws,
                grads: grads.view(),
            };
            let request = LogpRequest {
                support: Some(f),
                ..LogpRequest::default()
            };
            let up = LogpUpstream::new(&g_logp, Some(&g_h));
            let out = fused::logp_linear_grads_with(&mut cpu, call.rows(), &request, up, &opts, n)
                .unwrap_or_else(|e| panic!("{case}: {e}"));
            check_forward(&case, &out, &z, &call, f, 1e-9);
            assert!(
                grads.dhidden[h..2 * h].iter().all(|&x| x == 7.0),
                "{case}: masked row"
            );
            grads.dhidden[h..2 * h].fill(0.0);
            assert_close(&format!("{case} dH"), &grads.dhidden, &dh, tol);
            if head_grad == HeadGrad::Full {
                assert_close(&format!("{case} dW"), &grads.dweight, &dw, tol);
                if let Some(got) = &grads.dbias {
                    assert_close(&format!("{case} dbias"), got, &db, tol);
                }
            }
        }
    }
}

#[test]
fn gradients_hold_the_support_fixed_f32() {
    check_grads::<f32>(true, false, 1e-4);
    check_grads::<f32>(false, true, 1e-4);
    // Random floats at T = 0.7: pass B must recompute pass A's logits bitwise (rows
    // outside the support take no gradient, yet keep their place in the row blocks).
    let random = flashloss_tools::inputs::HeadInputs::<f32>::random(6, 10, 2077, true, 19);
    let head = ExactHead {
        hidden: random.hidden.clone(),
        weight: random.weight.clone(),
        bias: random.bias.clone(),
        n: 6,
        h: 10,
        v: 2077,
    };
    check_grads_of(&head, (0.7, false), 1e-4);
}

#[test]
fn gradients_hold_the_support_fixed_bf16() {
    check_grads::<bf16>(true, true, 1e-2);
}

#[test]
fn targets_outside_the_support_get_minus_inf_and_no_gradient() {
    let (n, h, v) = (5, 8, 999);
    let head = ExactHead::<f32>::new((n, h, v), true, false, 23);
    let inputs = head.inputs();
    let z = linear_logits(&inputs);
    // Each row's smallest logit as its target: outside any top-k below V.
    let targets: Vec<i64> = (0..n)
        .map(|i| {
            let row = &z[i * v..(i + 1) * v];
            (0..v).min_by(|&a, &b| row[a].total_cmp(&row[b])).unwrap() as i64
        })
        .collect();
    let call = Call {
        targets: &targets,
        mask: None,
        temperature: 1.0,
    };
    let f = filter(Some(10), None, None);
    let g_logp = vec![1.0f32; n];
    let opts = FusedOptions::from_mib(Mode::TwoPass, 64.0, 1.0);
    let mut grads = LinearGrads::zeros_for(&inputs, HeadGrad::Full);
    let mut ws = Workspace::new();
    let mut cpu = CpuHead {
        inputs: &inputs,
        ws: &mut ws,
        grads: grads.view(),
    };
    let request = LogpRequest {
        support: Some(f),
        ..LogpRequest::default()
    };
    let up = LogpUpstream::new(&g_logp, None);
    let out = fused::logp_linear_grads_with(&mut cpu, call.rows(), &request, up, &opts, n).unwrap();
    let s = out.support.as_ref().unwrap();
    assert!(s.outside.iter().all(|&o| o));
    assert!(s.logp.iter().all(|&l| l == f32::NEG_INFINITY));
    assert!(s.lse.iter().all(|l| l.is_finite()));
    assert!(
        out.stats.iter().all(|st| st.logp.is_finite()),
        "the plain logp stays"
    );
    let all_zero = |x: &[f32]| x.iter().all(|&g| g == 0.0);
    assert!(
        all_zero(&grads.dhidden) && all_zero(&grads.dweight),
        "no gradient, no NaN"
    );
    assert!(all_zero(grads.dbias.as_deref().unwrap()));
}

#[test]
fn random_rows_away_from_a_boundary() {
    let (n, h, v) = (24, 32, 3001);
    let head = flashloss_tools::inputs::HeadInputs::<f32>::random(n, h, v, true, 41);
    let inputs = head.inputs();
    let z = linear_logits(&inputs);
    let targets: Vec<i64> = (0..n as i64).map(|i| (i * 997 + 3) % v as i64).collect();
    let call = Call {
        targets: &targets,
        mask: None,
        temperature: 0.7,
    };
    for f in combinations(v) {
        let out = forward(&inputs, &call, f);
        let compared = check_forward(&format!("random {f:?}"), &out, &z, &call, f, 1e-5);
        assert!(compared >= n / 2, "{f:?}: {compared} rows compared");
    }
}

#[test]
fn flat_rows_take_extra_passes_and_ties_split_by_index() {
    // Every logit of the zero hidden row equal: top-p keeps the upper indices.
    let (n, h, v) = (3, 8, 5003);
    let head = ExactHead::<f32>::new((n, h, v), false, true, 5);
    let inputs = head.inputs();
    let z = linear_logits(&inputs);
    let targets: Vec<i64> = vec![2, 100, v as i64 - 1];
    let call = Call {
        targets: &targets,
        mask: None,
        temperature: 1.0,
    };
    for f in [
        filter(None, Some(0.5), None),
        filter(Some(600), None, None),
        filter(Some(2), Some(0.3), None),
    ] {
        let out = forward(&inputs, &call, f);
        check_forward(&format!("{f:?}"), &out, &z, &call, f, 0.0);
        let s = out.support.as_ref().unwrap();
        assert!(
            s.extra_passes >= 1,
            "{f:?}: the buffer holds no flat row's cut"
        );
    }
    let f = filter(None, Some(0.5), None);
    let s = forward(&inputs, &call, f).support.unwrap();
    // The flat row keeps the upper half of its indices: ⌈V/2⌉ entries, the last inside.
    assert_eq!(s.size[n - 1], v.div_ceil(2) as u64);
    assert!(!s.outside[n - 1]);
}

#[test]
fn bad_filters_are_errors_naming_the_argument() {
    let head = ExactHead::<f32>::new((2, 4, 50), false, false, 1);
    let inputs = head.inputs();
    let targets = [1i64, 2];
    let call = Call {
        targets: &targets,
        mask: None,
        temperature: 1.0,
    };
    for (f, arg) in [
        (filter(Some(0), None, None), "top_k"),
        (filter(None, Some(0.0), None), "top_p"),
        (filter(None, Some(1.5), None), "top_p"),
        (filter(None, Some(f64::NAN), None), "top_p"),
        (filter(None, None, Some(-0.1)), "min_p"),
        (filter(None, None, Some(1.1)), "min_p"),
        (filter(None, None, Some(f64::NAN)), "min_p"),
    ] {
        let mut ws = Workspace::new();
        let mut grads = LinearGrads::zeros_for(&inputs, HeadGrad::Frozen);
        let mut cpu = CpuHead {
            inputs: &inputs,
            ws: &mut ws,
            grads: grads.view(),
        };
        let request = LogpRequest {
            support: Some(f),
            ..LogpRequest::default()
        };
        match fused::logp_linear_with(&mut cpu, call.rows(), &request, 64 << 20, 2) {
            Err(Error::InvalidArgument { arg: got, .. }) => assert_eq!(got, arg, "{f:?}"),
            other => panic!("{f:?}: {other:?}"),
        }
    }
}

#[test]
fn candidates_and_a_support_in_one_call() {
    let (n, h, v) = (5, 12, 1777);
    let head = ExactHead::<f32>::new((n, h, v), true, true, 29);
    let inputs = head.inputs();
    let targets: Vec<i64> = (0..n as i64).map(|i| (i * 97 + 70) % v as i64).collect();
    let ids: Vec<i64> = (0..n as i64 * 3).map(|x| (x * 389) % v as i64).collect();
    let call = Call {
        targets: &targets,
        mask: None,
        temperature: 0.5,
    };
    let f = filter(Some(40), Some(0.7), None);
    let run = |gather: bool, support: bool| {
        let mut ws = Workspace::new();
        let mut grads = LinearGrads::zeros_for(&inputs, HeadGrad::Frozen);
        let mut cpu = CpuHead {
            inputs: &inputs,
            ws: &mut ws,
            grads: grads.view(),
        };
        let request = LogpRequest {
            gather_ids: gather.then_some(fused::GatherIds { ids: &ids, k: 3 }),
            support: support.then_some(f),
            ..LogpRequest::default()
        };
        fused::logp_linear_with(&mut cpu, call.rows(), &request, small_budget(), n).unwrap()
    };
    let both = run(true, true);
    assert_eq!(both.gathered, run(true, false).gathered);
    assert_eq!(both.support, run(false, true).support);
}

/// `head`'s vocabulary entries `range` (weight rows and bias).
fn shard_of<E: Element>(head: &ExactHead<E>, range: std::ops::Range<usize>) -> ExactHead<E> {
    ExactHead {
        hidden: head.hidden.clone(),
        weight: head.weight[range.start * head.h..range.end * head.h].to_vec(),
        bias: head.bias.as_ref().map(|b| b[range.clone()].to_vec()),
        n: head.n,
        h: head.h,
        v: range.len(),
    }
}

#[test]
fn vocab_parallel_over_three_ranks_matches_one_rank() {
    let exact = ExactHead::<f32>::new((5, 10, 3001), true, true, 13);
    let filters = [
        filter(Some(20), None, None),
        filter(None, Some(0.5), None),
        filter(Some(700), Some(0.8), Some(0.01)),
        filter(Some(5000), None, None),
    ];
    check_vocab_parallel(&exact, 0.5, &filters);
    // Random floats at T = 0.9 over a small vocabulary (every buffer whole).
    let random = flashloss_tools::inputs::HeadInputs::<f32>::random(15, 16, 37, true, 8);
    let head = ExactHead {
        hidden: random.hidden.clone(),
        weight: random.weight.clone(),
        bias: random.bias.clone(),
        n: 15,
        h: 16,
        v: 37,
    };
    let filters = [
        filter(Some(5), None, None),
        filter(None, Some(0.7), None),
        filter(Some(12), Some(0.8), Some(0.05)),
    ];
    check_vocab_parallel(&head, 0.9, &filters);
}

/// `head` split over three ranks against one rank, for each of `filters`.
fn check_vocab_parallel(head: &ExactHead<f32>, temperature: f64, filters: &[SupportFilter]) {
    use flashloss::collective::{Collective, run_in_process};
    use flashloss::{Device, Grid, HeadArgs, Shard, shard_range};
    let (n, h, v) = (head.n, head.h, head.v);
    let inputs = head.inputs();
    let z = linear_logits(&inputs);
    let targets: Vec<i64> = (0..n as i64).map(|i| (i * 613 + 2) % v as i64).collect();
    let mask: Vec<bool> = (0..n).map(|i| i != 3).collect();
    let g_logp: Vec<f32> = (0..n).map(|i| 1.0 - 0.25 * i as f32).collect();
    let call = Call {
        targets: &targets,
        mask: Some(&mask),
        temperature,
    };
    let opts = FusedOptions {
        budget_bytes: small_budget(),
        ..FusedOptions::from_mib(Mode::TwoPass, 1.0, 1.0)
    };
    let up = LogpUpstream::new(&g_logp, None);
    for &f in filters {
        let request = LogpRequest {
            support: Some(f),
            ..LogpRequest::default()
        };
        let mut one = LinearGrads::zeros(&inputs);
        let args = HeadArgs::Host {
            inputs: &inputs,
            grads: one.view(),
        };
        let device = Device::cpu();
        let one_out = device
            .logp_linear_grads_with_into(args, (call.rows(), &request), up, &opts, n)
            .unwrap();
        check_forward(&format!("one rank {f:?}"), &one_out, &z, &call, f, 1e-5);
        let results = run_in_process(3, std::time::Duration::from_secs(60), |comm| {
            let range = shard_range(v, comm.world_size(), comm.rank());
            let part = shard_of(head, range.clone());
            let inputs = part.inputs();
            let shard = Shard {
                offset: range.start,
                vocab: v,
            };
            let grid = Grid::vocab(comm);
            let mut grads = LinearGrads::zeros(&inputs);
            let args = HeadArgs::Host {
                inputs: &inputs,
                grads: grads.view(),
            };
            let out = Device::cpu().logp_linear_grads_sharded_with_into(
                &grid,
                shard,
                args,
                (call.rows(), &request),
                up,
                &opts,
                n,
            )?;
            Ok((range, out, grads))
        });
        let one_support = one_out.support.as_ref().unwrap();
        for (rank, res) in results.into_iter().enumerate() {
            let (range, out, grads) = res.unwrap_or_else(|e| panic!("{f:?} rank {rank}: {e}"));
            let case = format!("{f:?} rank {rank}");
            let s = out.support.as_ref().unwrap();
            assert_eq!(s.size, one_support.size, "{case}: sizes");
            assert_eq!(s.outside, one_support.outside, "{case}: outside");
            assert_eq!(s.extra_passes, one_support.extra_passes, "{case}: passes");
            for i in 0..n {
                let near = |a: f32, b: f32| (a - b).abs() <= 1e-6 * b.abs().max(1.0) || a == b;
                assert!(near(s.lse[i], one_support.lse[i]), "{case} row {i}: lse");
                assert!(near(s.logp[i], one_support.logp[i]), "{case} row {i}: logp");
            }
            let dh: Vec<f64> = one.dhidden.iter().map(|&x| x as f64).collect();
            assert_close(&format!("{case} dH"), &grads.dhidden, &dh, 1e-4);
            let dw: Vec<f64> = one.dweight[range.start * h..range.end * h]
                .iter()
                .map(|&x| x as f64)
                .collect();
            assert_close(&format!("{case} dW"), &grads.dweight, &dw, 1e-4);
        }
    }
}

//! Log-probs under the truncated support beside candidate sets in one call, and split
//! over three vocabulary shards in-process against one rank (exact ties and random floats
//! at T = 0.9: the same supports, extra passes, `logp^K`, `lse^K` and gradients).

use crate::common;
use crate::support_common;
use common::assert_close;
use flashloss::SupportFilter;
use flashloss::cpu::{CpuHead, Workspace};
use flashloss::device::LogpCall;
use flashloss::fused::{self, LogpRequest, LogpUpstream};
use flashloss::reference::linear_logits;
use flashloss::{FusedOptions, HeadGrad, LinearGrads, Mode};
use support_common::*;

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
    let head = ExactHead::random((15, 16, 37), 8);
    let filters = [
        filter(Some(5), None, None),
        filter(None, Some(0.7), None),
        filter(Some(12), Some(0.8), Some(0.05)),
    ];
    check_vocab_parallel(&head, 0.9, &filters);
}

#[test]
fn vocab_parallel_top_p_alone_merges_pass_a_histograms() {
    // Flat random rows: each shard bins its part in pass A; the merged histograms name
    // the cut's bin on every rank alike, and one pass collects it.
    let head = ExactHead::random((6, 16, 12_007), 21);
    let filters = [
        filter(None, Some(0.5), None),
        filter(None, Some(0.95), None),
    ];
    let passes = check_vocab_parallel(&head, 0.8, &filters);
    assert_eq!(passes, [1, 1]);
}

/// `head` split over three ranks against one rank, for each of `filters`: the extra
/// passes of each.
fn check_vocab_parallel(
    head: &ExactHead<f32>,
    temperature: f64,
    filters: &[SupportFilter],
) -> Vec<usize> {
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
        budget_bytes: Some(small_budget()),
        ..FusedOptions::from_mib(Mode::TwoPass, 1.0, 1.0)
    };
    let up = LogpUpstream::new(&g_logp, None);
    let mut passes = Vec::new();
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
            .logprobs(
                args,
                LogpCall::grads(call.rows(), up, &opts, n).request(&request),
            )
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
            let out = Device::cpu().logprobs(
                args,
                LogpCall::grads(call.rows(), up, &opts, n)
                    .request(&request)
                    .sharded(&grid, shard),
            )?;
            Ok((range, out, grads))
        });
        let one_support = one_out.support.as_ref().unwrap();
        passes.push(one_support.extra_passes);
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
    passes
}

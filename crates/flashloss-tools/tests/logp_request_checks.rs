//! Log-prob requests split over 3 vocabulary shards in-process (each rank gathers the
//! candidates it holds; the one-hot terms stay on the shard holding the id) equal one
//! rank; bad requests are typed errors naming the argument and index: `gather_ids` out
//! of range or of the wrong shape, cotangents without ids or not finite, the support
//! filter's ranges, a single pass asked with a truncated support; rows with only the
//! candidates' one-hot terms get them in every mode.

use crate::common;
use common::*;
use flashloss::SupportFilter;
use flashloss::collective::{Collective, run_in_process};
use flashloss::device::LogpCall;
use flashloss::fused::{GatherIds, LogpOutput, LogpRequest, LogpRows, LogpUpstream};
use flashloss::{
    Device, Error, FusedOptions, Grid, HeadArgs, HeadGrad, LinearGrads, Mode, Shard, Temperature,
    shard_range,
};
use std::time::Duration;

const N: usize = 10;
const H: usize = 12;
const V: usize = 2500;
const K: usize = 6;

struct Rows {
    targets: Vec<i64>,
    mask: Vec<bool>,
    ids: Vec<i64>,
    g_logp: Vec<f32>,
    g_lse: Vec<f32>,
    g_gathered: Vec<f32>,
}

fn rows() -> Rows {
    Rows {
        targets: (0..N as i64).map(|i| (i * 613 + 5) % V as i64).collect(),
        mask: (0..N).map(|i| i != 4).collect(),
        // Ids on every shard (shards of ~833), repeats and the target.
        ids: (0..N as i64)
            .flat_map(|i| {
                [
                    (i * 613 + 5) % V as i64,
                    0,
                    832,
                    833,
                    V as i64 - 1,
                    (i * 389) % V as i64,
                ]
            })
            .collect(),
        g_logp: (0..N).map(|i| 0.4 - 0.07 * i as f32).collect(),
        g_lse: (0..N).map(|i| 0.1 * (i % 3) as f32 - 0.1).collect(),
        g_gathered: (0..N * K).map(|i| 0.05 * (i % 7) as f32 - 0.15).collect(),
    }
}

impl Rows {
    fn logp_rows(&self) -> LogpRows<'_> {
        LogpRows {
            targets: &self.targets,
            mask: Some(&self.mask),
            temperature: Temperature::new(0.9).unwrap(),
        }
    }

    fn request(&self) -> LogpRequest<'_> {
        LogpRequest {
            sum_p2: true,
            gather_ids: Some(GatherIds {
                ids: &self.ids,
                k: K,
            }),
            support: None,
        }
    }

    fn upstream(&self) -> LogpUpstream<'_> {
        LogpUpstream {
            lse: Some(&self.g_lse),
            gathered: Some(&self.g_gathered),
            ..LogpUpstream::new(&self.g_logp, None)
        }
    }
}

fn opts(mode: Mode, head_grad: HeadGrad) -> FusedOptions {
    FusedOptions {
        head_grad,
        grad_output: 0.75,
        ..FusedOptions::from_mib(mode, 64.0, 1.0)
    }
}

fn close(name: &str, got: &[f32], want: &[f32]) {
    let want: Vec<f64> = want.iter().map(|&x| x as f64).collect();
    assert_close(name, got, &want, 1e-5);
}

fn same_outputs(name: &str, got: &LogpOutput, want: &LogpOutput) {
    let col = |o: &LogpOutput, f: fn(&flashloss::RowStats) -> f32| {
        o.stats.iter().map(f).collect::<Vec<_>>()
    };
    close(
        &format!("{name} logp"),
        &col(got, |s| s.logp),
        &col(want, |s| s.logp),
    );
    close(
        &format!("{name} lse"),
        &col(got, |s| s.lse),
        &col(want, |s| s.lse),
    );
    close(&format!("{name} max"), &got.max_logit, &want.max_logit);
    close(
        &format!("{name} sum_p2"),
        got.sum_p2.as_ref().unwrap(),
        want.sum_p2.as_ref().unwrap(),
    );
    close(
        &format!("{name} gathered"),
        got.gathered.as_ref().unwrap(),
        want.gathered.as_ref().unwrap(),
    );
}

#[test]
fn vocab_parallel_over_three_ranks_matches_one_rank() {
    let head = Head::<f32>::random(N, H, V, true, 3);
    let r = rows();
    let device = Device::cpu();
    let one_fwd = device
        .logprobs(
            HeadArgs::host(&head.inputs()),
            LogpCall::forward(r.logp_rows(), &FusedOptions::forward(64 << 20), N)
                .request(&r.request()),
        )
        .unwrap();
    for head_grad in [HeadGrad::Full, HeadGrad::Frozen] {
        let o = opts(Mode::Auto, head_grad);
        let mut one = LinearGrads::zeros_for(&head.inputs(), head_grad);
        let args = HeadArgs::Host {
            inputs: &head.inputs(),
            grads: one.view(),
        };
        let one_out = device
            .logprobs(
                args,
                LogpCall::grads(r.logp_rows(), r.upstream(), &o, N).request(&r.request()),
            )
            .unwrap();
        let results = run_in_process(3, Duration::from_secs(60), |comm| {
            let range = shard_range(V, comm.world_size(), comm.rank());
            let part = head.vocab_shard(range.clone());
            let inputs = part.inputs();
            let shard = Shard {
                offset: range.start,
                vocab: V,
            };
            let grid = Grid::vocab(comm);
            let device = Device::cpu();
            let call = (r.logp_rows(), &r.request());
            let fwd = device.logprobs(
                HeadArgs::host(&inputs),
                LogpCall::forward(call.0, &FusedOptions::forward(1 << 26), N)
                    .request(call.1)
                    .sharded(&grid, shard),
            )?;
            let mut grads = LinearGrads::zeros_for(&inputs, head_grad);
            let args = HeadArgs::Host {
                inputs: &inputs,
                grads: grads.view(),
            };
            let out = device.logprobs(
                args,
                LogpCall::grads(call.0, r.upstream(), &o, N)
                    .request(call.1)
                    .sharded(&grid, shard),
            )?;
            Ok((range, fwd, out, grads))
        });
        for (rank, res) in results.into_iter().enumerate() {
            let (range, fwd, out, grads) = res.unwrap();
            let case = format!("{head_grad:?} rank {rank}");
            same_outputs(&format!("{case} forward"), &fwd, &one_fwd);
            same_outputs(&format!("{case} grads call"), &out, &one_out);
            close(&format!("{case} dH"), &grads.dhidden, &one.dhidden);
            if head_grad == HeadGrad::Full {
                close(
                    &format!("{case} dW"),
                    &grads.dweight,
                    &one.dweight[range.start * H..range.end * H],
                );
                close(
                    &format!("{case} dbias"),
                    grads.dbias.as_ref().unwrap(),
                    &one.dbias.as_ref().unwrap()[range],
                );
            }
        }
    }
}

/// The error of a grads call with `request` and `upstream` (two-pass unless `mode`).
fn grads_error(request: &LogpRequest, upstream: LogpUpstream, mode: Mode) -> Error {
    let head = Head::<f32>::random(N, H, V, false, 8);
    let r = rows();
    let inputs = head.inputs();
    let mut grads = LinearGrads::zeros(&inputs);
    let args = HeadArgs::Host {
        inputs: &inputs,
        grads: grads.view(),
    };
    Device::cpu()
        .logprobs(
            args,
            LogpCall::grads(r.logp_rows(), upstream, &opts(mode, HeadGrad::Full), N)
                .request(request),
        )
        .unwrap_err()
}

fn forward_error(request: &LogpRequest) -> Error {
    let head = Head::<f32>::random(N, H, V, false, 8);
    let r = rows();
    Device::cpu()
        .logprobs(
            HeadArgs::host(&head.inputs()),
            LogpCall::forward(r.logp_rows(), &FusedOptions::forward(64 << 20), 5).request(request),
        )
        .unwrap_err()
}

#[test]
fn bad_requests_are_typed_errors() {
    let r = rows();
    let with_ids = |ids: &[i64], k| -> Error {
        let request = LogpRequest {
            gather_ids: Some(GatherIds { ids, k }),
            ..LogpRequest::default()
        };
        forward_error(&request)
    };
    // Out of range on a live row (row 3, slot 2), and -1: named with the index.
    for bad in [V as i64, -1] {
        let mut ids = r.ids.clone();
        ids[3 * K + 2] = bad;
        match with_ids(&ids, K) {
            Error::TokenOutOfRange {
                arg,
                index,
                id,
                vocab,
                seq,
                pos,
            } => {
                assert_eq!(
                    (arg, index, id, vocab, seq, pos),
                    ("gather_ids", 3 * K + 2, bad, V, 0, 3)
                );
            }
            e => panic!("{e}"),
        }
    }
    // On a masked row (4): never read.
    let mut ids = r.ids.clone();
    ids[4 * K] = V as i64 + 9;
    let head = Head::<f32>::random(N, H, V, false, 8);
    let ok = LogpRequest {
        gather_ids: Some(GatherIds { ids: &ids, k: K }),
        ..LogpRequest::default()
    };
    let out = Device::cpu()
        .logprobs(
            HeadArgs::host(&head.inputs()),
            LogpCall::forward(r.logp_rows(), &FusedOptions::forward(64 << 20), N).request(&ok),
        )
        .unwrap();
    assert!(
        out.gathered.unwrap()[4 * K..5 * K]
            .iter()
            .all(|&x| x == 0.0)
    );
    assert!(matches!(
        with_ids(&r.ids[1..], K),
        Error::ShapeMismatch {
            arg: "gather_ids",
            ..
        }
    ));
    assert!(matches!(
        with_ids(&[], 0),
        Error::InvalidArgument {
            arg: "gather_ids",
            ..
        }
    ));
    // Cotangents without ids, of the wrong shape, not finite.
    let plain = LogpRequest::default();
    let e = grads_error(&plain, r.upstream(), Mode::TwoPass);
    assert!(
        matches!(
            e,
            Error::InvalidArgument {
                arg: "grad_gathered",
                ..
            }
        ),
        "{e}"
    );
    let short = LogpUpstream {
        gathered: Some(&r.g_gathered[1..]),
        ..r.upstream()
    };
    let e = grads_error(&r.request(), short, Mode::TwoPass);
    assert!(
        matches!(
            e,
            Error::ShapeMismatch {
                arg: "grad_gathered",
                ..
            }
        ),
        "{e}"
    );
    let mut nan = r.g_gathered.clone();
    nan[2 * K + 1] = f32::NAN;
    let e = grads_error(
        &r.request(),
        LogpUpstream {
            gathered: Some(&nan),
            ..r.upstream()
        },
        Mode::TwoPass,
    );
    assert!(
        matches!(e, Error::NonFinite { arg: "grad_gathered", index, .. } if index == 2 * K + 1),
        "{e}"
    );
    let mut inf = r.g_lse.clone();
    inf[5] = f32::INFINITY;
    let e = grads_error(
        &plain,
        LogpUpstream {
            lse: Some(&inf),
            ..LogpUpstream::new(&r.g_logp, None)
        },
        Mode::TwoPass,
    );
    assert!(
        matches!(
            e,
            Error::NonFinite {
                arg: "grad_lse",
                index: 5,
                ..
            }
        ),
        "{e}"
    );
    // A single pass cannot take a truncated support (candidates it can).
    let support = LogpRequest {
        support: Some(SupportFilter {
            top_k: Some(5),
            ..SupportFilter::default()
        }),
        ..r.request()
    };
    let upstream = LogpUpstream::new(&r.g_logp, None);
    for mode in [Mode::SinglePass, Mode::Compact] {
        let e = grads_error(&support, upstream, mode);
        assert!(
            matches!(e, Error::InvalidArgument { arg: "mode", .. }),
            "{e}"
        );
    }
}

/// Rows whose dense gradient is zero (no upstream but cotangents summing to 0 per row)
/// still take their candidates' one-hot terms: every mode gives the two-pass gradients,
/// which are not zero; masked rows' cotangents add nothing.
#[test]
fn one_hot_terms_alone_in_every_mode() {
    let head = Head::<f32>::random(N, H, V, true, 21);
    let r = rows();
    let zeros = vec![0.0f32; N];
    // Per row (c, -c, 2c, -2c, 0, 0): Σ_k c_ik = 0, so coef_p = 0 and RowGrad is zero.
    let c: Vec<f32> = (0..N * K)
        .map(|at| {
            let c = 0.1 + 0.02 * (at / K) as f32;
            [c, -c, 2.0 * c, -2.0 * c, 0.0, 0.0][at % K]
        })
        .collect();
    let upstream = LogpUpstream {
        gathered: Some(&c),
        ..LogpUpstream::new(&zeros, None)
    };
    let run = |mode: Mode| {
        let mut grads = LinearGrads::zeros(&head.inputs());
        let args = HeadArgs::Host {
            inputs: &head.inputs(),
            grads: grads.view(),
        };
        let call = (r.logp_rows(), &r.request());
        let o = opts(mode, HeadGrad::Full);
        let out = Device::cpu()
            .logprobs(
                args,
                LogpCall::grads(call.0, upstream, &o, N).request(call.1),
            )
            .unwrap_or_else(|e| panic!("{mode:?}: {e}"));
        (out, grads)
    };
    let (want_out, want) = run(Mode::TwoPass);
    assert!(want.dhidden.iter().any(|&x| x != 0.0), "dH is zero");
    for mode in [Mode::Auto, Mode::SinglePass, Mode::Compact] {
        let (out, got) = run(mode);
        same_outputs(&format!("{mode:?}"), &out, &want_out);
        let tol = 1e-5;
        let as_f64 = |x: &[f32]| x.iter().map(|&x| x as f64).collect::<Vec<_>>();
        assert_close(
            &format!("{mode:?} dH"),
            &got.dhidden,
            &as_f64(&want.dhidden),
            tol,
        );
        assert_close(
            &format!("{mode:?} dW"),
            &got.dweight,
            &as_f64(&want.dweight),
            tol,
        );
        let (db, db_want) = (got.dbias.unwrap(), want.dbias.as_ref().unwrap().clone());
        assert_close(&format!("{mode:?} dbias"), &db, &as_f64(&db_want), tol);
    }
}

#[test]
fn support_filters_are_checked() {
    let filter = |top_k, top_p, min_p| LogpRequest {
        support: Some(SupportFilter {
            top_k,
            top_p,
            min_p,
        }),
        ..LogpRequest::default()
    };
    let named = |e: Error| match e {
        Error::InvalidArgument { arg, .. } => arg,
        e => panic!("{e}"),
    };
    assert_eq!(named(forward_error(&filter(Some(0), None, None))), "top_k");
    for p in [0.0, -0.5, 1.5, f64::NAN] {
        assert_eq!(named(forward_error(&filter(None, Some(p), None))), "top_p");
    }
    for m in [-0.1, 1.01, f64::NAN] {
        assert_eq!(named(forward_error(&filter(None, None, Some(m)))), "min_p");
    }
}

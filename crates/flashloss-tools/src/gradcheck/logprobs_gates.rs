//! The gates of objective `logprobs` (see `logprobs`): a kernel's outputs against the
//! reference's (or, sharded, a one-rank run's), and the one-rank check on the fused
//! LM-head kernel through [`flashloss::Device::logprobs`].

use super::case::{LinearCase, ObjectiveRun, mode_name};
use super::config::GradcheckConfig;
use super::logprobs::{LogprobsCase, Outputs};
use super::report::{Gate, max_abs_diff_by};
use crate::Result;
use flashloss::device::LogpCall;
use flashloss::{Element, HeadArgs, LinearGrads, LinearInputs};

/// `max |got - want| / max(|want|, 1)` over pairs (NaN propagates).
fn worst_rel(pairs: impl Iterator<Item = (f64, f64)>) -> f64 {
    max_abs_diff_by(pairs.map(|(g, w)| (g - w).abs() / w.abs().max(1.0)))
}

/// The gates of `got` (row `r` is row `offset + r` of the case) against `want` (rows
/// of the whole case): `loss` (the objective, relative to the scale of its rounding,
/// within `loss_rel`), `logp`, `entropy`, `lse`, `sum_p2` (relative to itself),
/// `gathered`, and under a truncated support `support_logp` and `support_lse` (within
/// `rel`) and `support_outside`, `support_size` (mismatches, on the rows compared);
/// `masked_rows`: masked rows with an output that is not zero.
pub(crate) fn output_gates(
    case: &LogprobsCase,
    (got, want): (&Outputs, &Outputs),
    offset: usize,
    (rel, loss_rel): (f64, f64),
    g: f64,
) -> Vec<Gate> {
    let rows = || (0..got.logp.len()).map(move |r| (r, offset + r));
    let live = || rows().filter(|&(_, i)| case.live[i]);
    let pairs = |x: &[f64], y: &[f64]| live().map(|(r, i)| (x[r], y[i])).collect::<Vec<_>>();
    let (l_got, _) = case.objective(got, offset, g);
    let want_rows = want.slice(offset..offset + got.logp.len(), case.k);
    let (l_want, scale) = case.objective(&want_rows, offset, g);
    let mut gates = vec![
        Gate::new("loss", (l_got - l_want).abs() / scale.max(1.0), loss_rel),
        Gate::new(
            "logp",
            worst_rel(pairs(&got.logp, &want.logp).into_iter()),
            rel,
        ),
        Gate::new(
            "entropy",
            worst_rel(pairs(&got.entropy, &want.entropy).into_iter()),
            rel,
        ),
        Gate::new(
            "lse",
            worst_rel(pairs(&got.lse, &want.lse).into_iter()),
            rel,
        ),
    ];
    if case.sum_p2 {
        let (x, y) = (
            got.sum_p2.as_deref().unwrap_or(&[]),
            want.sum_p2.as_deref().unwrap_or(&[]),
        );
        // Σp² ∈ (0, 1]: relative to itself (a missing output is NaN).
        let errors = live().map(|(r, i)| match (x.get(r), y.get(i)) {
            (Some(a), Some(b)) => (a - b).abs() / b.abs(),
            _ => f64::NAN,
        });
        gates.push(Gate::new("sum_p2", max_abs_diff_by(errors), rel));
    }
    if case.k > 0 {
        let k = case.k;
        let errors = live().flat_map(|(r, i)| {
            (0..k).map(
                move |c| match (got.gathered.get(r * k + c), want.gathered.get(i * k + c)) {
                    (Some(&a), Some(&b)) => (a - b).abs() / b.abs().max(1.0),
                    _ => f64::NAN,
                },
            )
        });
        gates.push(Gate::new("gathered", max_abs_diff_by(errors), rel));
    }
    if case.support.is_some() {
        gates.extend(support_gates(case, (got, want), offset, rel));
    }
    let nonzero = rows()
        .filter(|&(r, i)| !case.live[i] && !got.masked_row_is_zero(r, case.k))
        .count();
    gates.push(Gate::new("masked_rows", nonzero as f64, 0.0));
    gates
}

/// `support_logp` and `support_lse` (within `rel`, on the rows compared, `logp^K` where
/// the target is inside), `support_outside` (rows whose outside flag differs, or whose
/// `logp^K` is not `-inf` where outside) and `support_size` (rows whose `|K|` differs).
fn support_gates(
    case: &LogprobsCase,
    (got, want): (&Outputs, &Outputs),
    offset: usize,
    rel: f64,
) -> Vec<Gate> {
    let (Some(x), Some(y)) = (&got.support, &want.support) else {
        return vec![Gate::new("support_outside", f64::NAN, 0.0)];
    };
    let compared: Vec<(usize, usize)> = (0..got.logp.len())
        .map(|r| (r, offset + r))
        .filter(|&(_, i)| case.compared[i])
        .collect();
    let inside = compared.iter().filter(|&&(_, i)| !y.outside[i]);
    let logp = worst_rel(inside.map(|&(r, i)| (x.logp[r], y.logp[i])));
    let lse = worst_rel(compared.iter().map(|&(r, i)| (x.lse[r], y.lse[i])));
    let outside = (compared.iter())
        .filter(|&&(r, i)| {
            x.outside[r] != y.outside[i] || (x.outside[r] && x.logp[r] != f64::NEG_INFINITY)
        })
        .count();
    let size = compared
        .iter()
        .filter(|&&(r, i)| x.size[r] != y.size[i])
        .count();
    vec![
        Gate::new("support_logp", logp, rel),
        Gate::new("support_lse", lse, rel),
        Gate::new("support_outside", outside as f64, 0.0),
        Gate::new("support_size", size as f64, 0.0),
    ]
}

impl Outputs {
    /// Rows `rows` of whole-case outputs with `k` candidates per row.
    pub(crate) fn slice(&self, rows: std::ops::Range<usize>, k: usize) -> Outputs {
        let cut = |x: &[f64]| x[rows.clone()].to_vec();
        Outputs {
            logp: cut(&self.logp),
            entropy: cut(&self.entropy),
            lse: cut(&self.lse),
            sum_p2: self.sum_p2.as_deref().map(cut),
            gathered: self.gathered[rows.start * k..rows.end * k].to_vec(),
            support: self
                .support
                .as_ref()
                .map(|s| super::logprobs::SupportOutputs {
                    logp: cut(&s.logp),
                    lse: cut(&s.lse),
                    size: s.size[rows.clone()].to_vec(),
                    outside: s.outside[rows.clone()].to_vec(),
                }),
        }
    }

    /// Whether every output of row `r` is zero (as a masked row's must be).
    fn masked_row_is_zero(&self, r: usize, k: usize) -> bool {
        let zero = |x: Option<&f64>| x.is_none_or(|&v| v == 0.0);
        let s = self.support.as_ref();
        [self.logp.get(r), self.entropy.get(r), self.lse.get(r)]
            .into_iter()
            .chain([self.sum_p2.as_ref().and_then(|x| x.get(r))])
            .chain((0..k).map(|c| self.gathered.get(r * k + c)))
            .chain([s.and_then(|s| s.logp.get(r)), s.and_then(|s| s.lse.get(r))])
            .all(zero)
            && s.is_none_or(|s| s.size[r] == 0 && !s.outside[r])
    }
}

/// The one-rank check of objective `logprobs`: the kernel on `kernel_inputs` (the
/// case's head, or a faulty copy of it), the reference on the case's logits. Adds
/// `support_skipped` (the fraction of live rows whose support decision is too near a
/// boundary to compare; at most a half) under a truncated support.
pub(super) fn check_logprobs<E: Element>(
    cfg: &GradcheckConfig,
    case: &LinearCase<E>,
    kernel_inputs: &LinearInputs<E>,
) -> Result<ObjectiveRun> {
    let lp = case
        .logprobs
        .as_ref()
        .expect("objective logprobs has its case");
    let (n, v) = (lp.live.len(), cfg.vocab);
    let device = cfg.device.open()?;
    let mut grads = LinearGrads::zeros_for(kernel_inputs, cfg.head_grad);
    let (rows, request, upstream) = lp.call(0..n);
    let head = HeadArgs::Host {
        inputs: kernel_inputs,
        grads: grads.view(),
    };
    let seq_len = cfg.seq_len;
    let out = device.logprobs(
        head,
        LogpCall::grads(rows, upstream, &case.opts, seq_len).request(&request),
    )?;
    let plan = match cfg.device {
        super::Backend::Cpu => Some(flashloss::cpu::plan(
            n,
            cfg.hidden,
            v,
            (E::DTYPE, kernel_inputs.layout),
            &case.opts,
            request.grads_single_pass_allowed(),
        )?),
        super::Backend::Cuda => None,
    };
    let g = cfg.grad_output;
    let (want, dlogits_ref) = lp.reference(&case.z, v, g);
    let got = Outputs::of(&out);
    let tol = cfg.tolerance.resolved(E::DTYPE);
    let rel = tol.logp_rel.unwrap_or_default();
    let mut gates = output_gates(
        lp,
        (&got, &want),
        0,
        (rel, tol.loss_rel.unwrap_or_default()),
        g,
    );
    if lp.support.is_some() {
        let live = lp.live.iter().filter(|&&l| l).count();
        let compared = lp.compared.iter().filter(|&&c| c).count();
        let skipped = (live - compared) as f64 / live.max(1) as f64;
        gates.push(Gate::new("support_skipped", skipped, 0.5));
    }
    let loss = (lp.objective(&want, 0, g).0, lp.objective(&got, 0, g).0);
    let mode = plan.as_ref().map_or("cuda", mode_name);
    Ok(ObjectiveRun {
        name: format!("linear logprobs {:?} {mode}", E::DTYPE),
        loss,
        metrics: None,
        gates,
        dlogits_ref,
        summed_rows: lp.summed_rows(g),
        grads,
        plan,
    })
}

//! The truncated support's decisions and extra passes ([`super`]) against the
//! f64 reference ([`crate::reference::support_row`]) on dense rows shown tile by tile, as
//! a backend's passes show them: peaked, flat and sampled rows, ties beyond the buffer,
//! min-p and top-k cuts below it, a top-k beyond the largest buffer, every combination of
//! the filters.

use super::device_top::DeviceRow;
use super::{RowSupport, Truncation, support_buffers, support_passes};
use crate::error::{Error, Result};
use crate::fused::key::{order_key, scaled};
use crate::fused::plan::{HeadGrad, Plan};
use crate::fused::{FusedPasses, GradsOf, RowGrad, SinglePassHooks, SparseGrads, TileVisitor};
use crate::reference::support_row;
use crate::rows::{OnlineSoftmax, PartialStats, RowInputs, RowStats, RowTransform};
use crate::support_filter::SupportFilter;
use crate::temperature::Temperature;

/// Rows `[n, v]` of logits shown in tiles of `tile` entries, the `live` rows only.
pub(super) struct Dense {
    pub(super) z: Vec<f32>,
    pub(super) n: usize,
    pub(super) v: usize,
    pub(super) tile: usize,
    pub(super) inv_temp: f32,
    pub(super) targets: Vec<i64>,
    pub(super) live: Vec<bool>,
    /// Shown as the CUDA backend shows them: pass A's top keys selected "on the device"
    /// (`super::device_top`'s model of the kernel), extra passes only to the rows still
    /// searching.
    pub(super) device: bool,
}

impl Dense {
    fn live_rows(&self) -> Vec<usize> {
        (0..self.n).filter(|&i| self.live[i]).collect()
    }

    fn tiles(&self, mut each: impl FnMut(std::ops::Range<usize>, &[f32])) {
        for start in (0..self.v).step_by(self.tile) {
            let end = (start + self.tile).min(self.v);
            let tile: Vec<f32> = (self.live_rows().into_iter())
                .flat_map(|i| self.z[i * self.v + start..i * self.v + end].iter().copied())
                .collect();
            each(start..end, &tile);
        }
    }
}

impl FusedPasses for Dense {
    fn plan(&self) -> Plan {
        Plan {
            single_pass: false,
            compact: false,
            block_rows: self.n,
            vocab_tile: self.tile,
            workspace_bytes: 0,
            gemm_reserve_bytes: 0,
            bf16_products: None,
            head_grad: HeadGrad::Full,
        }
    }

    fn row_states(&mut self) -> Result<PartialStats> {
        self.row_states_visiting(&mut NoVisitor)
    }

    fn row_states_visiting(&mut self, visitor: &mut dyn TileVisitor) -> Result<PartialStats> {
        let mut out = PartialStats::empty(self.n, self.inv_temp);
        let rows = self.live_rows();
        let inv_temp = self.inv_temp;
        let targets = self.targets.clone();
        let device = self.device;
        let top = |v: &mut dyn TileVisitor| v.device_sinks().top.map(|t| (t.cap, t.offset));
        let (cap, offset) = (device.then(|| top(visitor)).flatten()).unwrap_or((0, 0));
        let mut device_rows = vec![DeviceRow::new(cap); self.n];
        self.tiles(|vocab, tile| {
            let cols = vocab.len();
            for (&i, row) in rows.iter().zip(tile.chunks(cols)) {
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let sum = row
                    .iter()
                    .map(|&x| (((x - max) * inv_temp) as f64).exp())
                    .sum();
                out.states[i].merge(OnlineSoftmax {
                    inv_temp,
                    max,
                    sum,
                    weighted: 0.0,
                    sum2: 0.0,
                });
                let y = targets[i] as usize;
                if vocab.contains(&y) {
                    out.target_logits[i] = row[y - vocab.start];
                }
                if device {
                    let id = |o: usize| offset + vocab.start + o;
                    let keys: Vec<u64> = (row.iter().enumerate())
                        .map(|(o, &x)| order_key(scaled(x, inv_temp), id(o)))
                        .collect();
                    device_rows[i].push_tile(&keys);
                }
            }
            if !device {
                visitor.visit(&rows, vocab, tile, cols);
            }
        });
        if let Some(top) = device.then(|| visitor.device_sinks().top).flatten() {
            *top.tops = Some(device_rows.iter().map(DeviceRow::keys).collect());
        }
        Ok(out)
    }

    fn visit_tiles(&mut self, visitor: &mut dyn TileVisitor) -> Result<()> {
        let mut rows = self.live_rows();
        if self.device {
            let wanted = visitor.rows_wanted().expect("an extra pass names its rows");
            rows.retain(|&i| wanted[i]);
        }
        let v = self.v;
        for start in (0..v).step_by(self.tile) {
            let end = (start + self.tile).min(v);
            let tile: Vec<f32> = (rows.iter())
                .flat_map(|&i| self.z[i * v + start..i * v + end].iter().copied())
                .collect();
            visitor.visit(&rows, start..end, &tile, end - start);
        }
        Ok(())
    }

    fn accumulate_grads(&mut self, _: &[RowGrad]) -> Result<()> {
        Err(no_head("accumulate_grads"))
    }

    fn single_pass(&mut self, _: &mut GradsOf) -> Result<Vec<RowStats>> {
        Err(no_head("single_pass"))
    }

    fn accumulate_grads_sparse(&mut self, _: &[RowGrad], _: &SparseGrads) -> Result<()> {
        Err(no_head("accumulate_grads_sparse"))
    }

    fn single_pass_hooked(&mut self, _: &mut GradsOf, _: SinglePassHooks) -> Result<Vec<RowStats>> {
        Err(no_head("single_pass_hooked"))
    }
}

/// What a test's dense rows cannot do: they have no head.
fn no_head(feature: &'static str) -> Error {
    Error::Unsupported {
        feature,
        reason: "a test's dense rows have no head".into(),
    }
}

struct NoVisitor;

impl TileVisitor for NoVisitor {
    fn visit(&mut self, _: &[usize], _: std::ops::Range<usize>, _: &[f32], _: usize) {}
}

/// A small deterministic generator: uniform in `[0, 1)` and standard normal.
pub(super) struct Rng(pub(super) u64);

impl Rng {
    pub(super) fn uniform(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }

    pub(super) fn normal(&mut self) -> f64 {
        let (u, v) = (self.uniform().max(1e-300), self.uniform());
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }
}

/// Runs the support of `z` (`[n, v]`) at `temperature` and compares every row with the
/// reference (rows whose margin is below `min_margin` only for finiteness); returns the
/// extra passes.
fn check(
    case: &str,
    z: Vec<f32>,
    (n, v): (usize, usize),
    temperature: f64,
    f: SupportFilter,
    min_margin: f64,
) -> usize {
    check_live(case, z, (n, v, &vec![true; n]), temperature, f, min_margin)
}

/// The support of `z` (`[n, v]`) at `temperature` on the `live` rows: every row's
/// [`RowSupport`], the extra passes and the rows' targets.
pub(super) fn run_support(
    z: Vec<f32>,
    (n, v, live): (usize, usize, &[bool]),
    temperature: f64,
    f: SupportFilter,
) -> (Vec<RowSupport>, usize, Vec<i64>) {
    run_support_on(false, z, (n, v, live), temperature, f)
}

/// [`run_support`] on the host's passes or (`device`) as the CUDA backend runs them.
fn run_support_on(
    device: bool,
    z: Vec<f32>,
    (n, v, live): (usize, usize, &[bool]),
    temperature: f64,
    f: SupportFilter,
) -> (Vec<RowSupport>, usize, Vec<i64>) {
    let mut rng = Rng(v as u64 * 31 + n as u64);
    let targets: Vec<i64> = (0..n).map(|_| (rng.uniform() * v as f64) as i64).collect();
    let transform = RowTransform::with_temperature(Temperature::new(temperature).unwrap());
    let mut dense = Dense {
        z,
        n,
        v,
        tile: 333.min(v / 3 + 1),
        inv_temp: transform.inv_temp,
        targets: targets.clone(),
        live: live.to_vec(),
        device,
    };
    let rows = RowInputs {
        targets: &targets,
        live,
        transform,
    };
    let t = Truncation::new(f.top_k, f.top_p, f.min_p, v).expect("a filter that cuts");
    let mut buffers = support_buffers(&t, n, transform.inv_temp, (0..v, v));
    let partial = dense.row_states_visiting(&mut buffers).unwrap();
    let (got, extra) =
        support_passes(&mut dense, (buffers, &partial), (&rows, &targets), &t, None).unwrap();
    (got, extra, targets)
}

/// [`check`] on the `live` rows (the others must come out as default).
pub(super) fn check_live(
    case: &str,
    z: Vec<f32>,
    (n, v, live): (usize, usize, &[bool]),
    temperature: f64,
    f: SupportFilter,
    min_margin: f64,
) -> usize {
    check_on(false, case, z, (n, v, live), (temperature, f, min_margin))
}

/// [`check_live`] on the host's passes or (`device`) as the CUDA backend runs them.
fn check_on(
    device: bool,
    case: &str,
    z: Vec<f32>,
    (n, v, live): (usize, usize, &[bool]),
    (temperature, f, min_margin): (f64, SupportFilter, f64),
) -> usize {
    let case = &format!("{case}{}", if device { " (device)" } else { "" });
    let (got, extra, targets) = run_support_on(device, z.clone(), (n, v, live), temperature, f);
    let mut compared = 0;
    for i in 0..n {
        if !live[i] {
            assert_eq!(got[i], RowSupport::default(), "{case} row {i}: not live");
            continue;
        }
        let zi: Vec<f64> = z[i * v..(i + 1) * v].iter().map(|&x| x as f64).collect();
        let want = support_row(&zi, temperature, targets[i] as usize, f);
        let g: &RowSupport = &got[i];
        assert!(
            g.lse.is_finite() && !g.logp.is_nan(),
            "{case} row {i}: {g:?}"
        );
        if want.margin < min_margin {
            continue;
        }
        compared += 1;
        let what = format!("{case} row {i} (margin {:.2e})", want.margin);
        assert_eq!(g.size, want.size as u64, "{what}: size");
        assert_eq!(
            g.outside, !want.in_support[targets[i] as usize],
            "{what}: outside"
        );
        let close = |a: f32, b: f64| (a as f64 - b).abs() <= 2e-6 * b.abs().max(1.0);
        assert!(
            close(g.lse, want.lse),
            "{what}: lse {} vs {}",
            g.lse,
            want.lse
        );
        match g.outside {
            true => assert_eq!(g.logp, f32::NEG_INFINITY, "{what}"),
            false => assert!(
                close(g.logp, want.logp),
                "{what}: logp {} vs {}",
                g.logp,
                want.logp
            ),
        }
    }
    let n_live = live.iter().filter(|&&l| l).count();
    assert!(
        2 * compared >= n_live,
        "{case}: {compared} of {n_live} rows away from a boundary"
    );
    extra
}

pub(super) fn filters(
    top_k: Option<usize>,
    top_p: Option<f64>,
    min_p: Option<f64>,
) -> SupportFilter {
    SupportFilter {
        top_k,
        top_p,
        min_p,
    }
}

/// Every combination of the three filters, each unset or at one of two values.
fn combinations() -> Vec<SupportFilter> {
    let mut out = Vec::new();
    for top_k in [None, Some(1), Some(40)] {
        for top_p in [None, Some(0.3), Some(0.92)] {
            for min_p in [None, Some(0.02), Some(0.5)] {
                if top_k.is_some() || top_p.is_some() || min_p.is_some() {
                    out.push(filters(top_k, top_p, min_p));
                }
            }
        }
    }
    out
}

#[test]
fn sampled_peaked_and_flat_rows_every_combination() {
    let (n, v) = (6, 1531);
    let mut rng = Rng(5);
    for (kind, scale) in [("sampled", 2.0), ("peaked", 8.0), ("flat", 0.05)] {
        let z: Vec<f32> = (0..n * v).map(|_| (rng.normal() * scale) as f32).collect();
        for temperature in [1.0, 0.7] {
            for f in combinations() {
                let case = format!("{kind} T={temperature} {f:?}");
                check(&case, z.clone(), (n, v), temperature, f, 1e-9);
            }
        }
    }
}

#[test]
fn flat_rows_with_top_p_alone_take_extra_passes() {
    let (n, v) = (3, 20_000);
    let mut rng = Rng(9);
    let z: Vec<f32> = (0..n * v).map(|_| (rng.normal() * 0.3) as f32).collect();
    for top_p in [0.1, 0.5, 0.95] {
        let extra = check(
            "flat top-p",
            z.clone(),
            (n, v),
            1.0,
            filters(None, Some(top_p), None),
            1e-9,
        );
        // Pass A's histogram names the cut's bin: one pass collects it.
        assert_eq!(extra, 1, "top_p {top_p}: {extra} extra passes");
    }
    // Top-p after a min-p cut below the buffer: the first pass sums the mass, and the
    // cut lies in the buffer (0.1) or below it (0.9).
    for top_p in [0.01, 0.9] {
        let f = filters(None, Some(top_p), Some(0.1));
        let extra = check("flat min-p top-p", z.clone(), (n, v), 1.0, f, 1e-9);
        assert!(extra >= 1, "{f:?}: {extra}");
    }
    // min-p far below the buffer: the mass of what it keeps takes a pass.
    let extra = check(
        "flat min-p",
        z.clone(),
        (n, v),
        1.0,
        filters(None, None, Some(0.1)),
        1e-9,
    );
    assert_eq!(extra, 1);
    // A peaked row decides from its buffer alone.
    let mut peaked = z;
    for i in 0..n {
        peaked[i * v + 17 * i] = 30.0;
    }
    let extra = check(
        "peaked top-p",
        peaked,
        (n, v),
        1.0,
        filters(Some(50), Some(0.9), None),
        1e-9,
    );
    assert_eq!(extra, 0);
}

/// Filters whose cuts fall inside runs of thousands of tied values (values in {0, 1, 2, 3}).
fn tie_filters() -> [SupportFilter; 6] {
    [
        filters(Some(3), None, None),
        filters(Some(5000), None, None),
        filters(None, Some(0.5), None),
        filters(None, Some(0.9), None),
        filters(Some(7000), Some(0.6), None),
        filters(None, Some(0.77), Some(0.3)),
    ]
}

#[test]
fn ties_beyond_the_buffer_are_kept_or_cut_by_index() {
    // Values in {0, 1, 2, 3}: thousands of ties at each.
    let (n, v) = (4, 12_007);
    let z: Vec<f32> = (0..n * v).map(|x| ((x * 7 + x / v) % 4) as f32).collect();
    for f in tie_filters() {
        let extra = check(&format!("ties {f:?}"), z.clone(), (n, v), 1.0, f, 1e-10);
        assert!(extra >= 1, "{f:?}: the buffer cannot hold the ties");
    }
}

#[test]
fn top_k_beyond_the_largest_buffer_is_searched() {
    let (n, v) = (2, 30_000);
    let mut rng = Rng(3);
    let z: Vec<f32> = (0..n * v).map(|_| (rng.normal() * 2.0) as f32).collect();
    for f in [
        filters(Some(9000), None, None),
        filters(Some(9000), Some(0.5), Some(1e-9)),
    ] {
        let extra = check(&format!("{f:?}"), z.clone(), (n, v), 0.5, f, 1e-9);
        assert!(extra >= 2, "{f:?}: {extra}");
    }
}

#[test]
fn random_shapes_scales_ties_and_filters() {
    let mut rng = Rng(77);
    for case in 0..150 {
        let v = 2 + (rng.uniform() * 6000.0) as usize;
        let n = 1 + (rng.uniform() * 4.0) as usize;
        let scale = [0.01, 0.5, 3.0, 20.0][case % 4];
        // Quantized values make ties; a fraction of cases keep full floats.
        let levels = [0.0, 4.0, 64.0][(case / 4) % 3];
        let z: Vec<f32> = (0..n * v)
            .map(|_| {
                let x = rng.normal() * scale;
                if levels > 0.0 {
                    (x * levels).round() / levels
                } else {
                    x
                }
            })
            .map(|x| x as f32)
            .collect();
        let pick = |rng: &mut Rng, p: f64| rng.uniform() < p;
        let top_k = pick(&mut rng, 0.5).then(|| 1 + (rng.uniform() * v as f64 * 0.6) as usize);
        let top_p = pick(&mut rng, 0.5).then(|| 0.02 + rng.uniform() * 0.97);
        let min_p = pick(&mut rng, 0.4).then(|| rng.uniform().powi(3));
        let f = filters(top_k, top_p, min_p);
        if Truncation::new(top_k, top_p, min_p, v).is_none() {
            continue;
        }
        let temperature = [1.0, 0.5, 0.8][case % 3];
        check(
            &format!("case {case} v={v} {f:?}"),
            z,
            (n, v),
            temperature,
            f,
            1e-9,
        );
    }
}

/// The CUDA backend's path (pass A's top keys from the device kernel's model, no
/// histogram and no pass-A mass, extra passes over the searching rows only) decides
/// every row as the reference does: peaked, flat and sampled rows under every
/// combination, ties beyond the buffer, a top-k beyond the largest buffer, masked rows.
#[test]
fn the_device_path_matches_the_reference() {
    let (n, v) = (5, 1531);
    let mut rng = Rng(15);
    let mut live = vec![true; n];
    live[3] = false;
    for (kind, scale) in [("sampled", 2.0), ("peaked", 8.0), ("flat", 0.05)] {
        let z: Vec<f32> = (0..n * v).map(|_| (rng.normal() * scale) as f32).collect();
        for f in combinations() {
            let case = format!("{kind} {f:?}");
            check_on(true, &case, z.clone(), (n, v, &live), (0.7, f, 1e-9));
        }
    }
    let (n, v) = (3, 12_007);
    let ties: Vec<f32> = (0..n * v).map(|x| ((x * 7 + x / v) % 4) as f32).collect();
    let flat: Vec<f32> = (0..n * v).map(|_| (rng.normal() * 0.3) as f32).collect();
    let all = vec![true; n];
    for f in tie_filters() {
        let extra = check_on(
            true,
            &format!("ties {f:?}"),
            ties.clone(),
            (n, v, &all),
            (1.0, f, 1e-10),
        );
        assert!(extra >= 1, "{f:?}: the buffer cannot hold the ties");
        check_on(
            true,
            &format!("flat {f:?}"),
            flat.clone(),
            (n, v, &all),
            (1.0, f, 1e-9),
        );
    }
    let f = filters(Some(9000), Some(0.5), Some(1e-9));
    check_on(
        true,
        "top-k beyond the buffer",
        flat,
        (n, v, &all),
        (0.5, f, 1e-9),
    );
}

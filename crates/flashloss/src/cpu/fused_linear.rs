//! The machinery shared by the fused LM-head kernels: logits exist only as a
//! `[block_rows, vocab_tile]` tile (two-pass) or a `[block_rows, V]` block (single-pass)
//! in a workspace sized from a memory budget; tile products go through `gemm`; bf16
//! hidden states and weights are widened one block or tile at a time, never whole.
//!
//! Pass A ([`row_stats`]) streams the vocabulary to get each row's softmax statistics.
//! Pass B ([`accumulate_grads`]) recomputes each tile, turns it into `dZ` in place and
//! accumulates `dH += dZ·W`, `dW += dZᵀ·H`, `dbias += Σ_rows dZ`. Together 8NHV FLOPs.
//! [`single_pass`] keeps a block's logits whole, so it needs no recomputation: 6NHV.

use super::matmul::{MatRef, matmul};
use super::online_softmax::{OnlineSoftmax, RowStats};
use super::simd;
use crate::batch::LinearInputs;
use crate::element::Element;
use crate::error::{Error, Result};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::ops::Range;

/// How the fused kernel recomputes logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Single-pass when the loss allows it and the budget holds a useful row block.
    #[default]
    Auto,
    /// Logits of a row block kept whole: 6NHV (token-level losses only).
    SinglePass,
    /// Statistics first, then recompute: 8NHV, smallest workspace.
    TwoPass,
}

impl Mode {
    /// Whether a plan runs single-pass: as asked, or in auto mode when the loss allows
    /// it (`allowed`: false for losses that reduce over sequences) and the budget holds
    /// a useful row block (`rows_useful`, the backend's threshold). Asking for
    /// single-pass where the loss does not allow it is an error.
    pub(crate) fn single_pass(self, allowed: bool, rows_useful: bool) -> Result<bool> {
        match self {
            Mode::SinglePass if !allowed => Err(Error::InvalidArgument {
                arg: "mode",
                reason: "single_pass needs a token-level loss (sequence-level ratios and vespo reduce over whole sequences first); use two_pass or auto".into(),
            }),
            Mode::SinglePass => Ok(true),
            Mode::TwoPass => Ok(false),
            Mode::Auto => Ok(allowed && rows_useful),
        }
    }
}

/// Options of the fused LM-head kernels.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FusedOptions {
    /// Recomputation strategy.
    pub mode: Mode,
    /// Bytes the kernel's workspace may use (logit tiles, widened bf16 tiles).
    pub budget_bytes: usize,
    /// Upstream gradient `∂(outer loss)/∂L`.
    pub grad_output: f32,
}

impl Default for FusedOptions {
    fn default() -> Self {
        FusedOptions {
            mode: Mode::Auto,
            budget_bytes: 64 << 20,
            grad_output: 1.0,
        }
    }
}

/// Block sizes chosen from the budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Plan {
    /// True for single-pass.
    pub single_pass: bool,
    /// Rows per block.
    pub block_rows: usize,
    /// Vocabulary entries per tile.
    pub vocab_tile: usize,
    /// Bytes of the kernel's own tiles and widened blocks.
    pub workspace_bytes: usize,
    /// Bytes reserved for `gemm`'s packing buffers ([`GEMM_SCRATCH_PER_THREAD`] per thread).
    pub gemm_reserve_bytes: usize,
}

impl Plan {
    /// FLOPs of the whole step: `2NHV` per logits computation, plus `4NHV` for dH, dW.
    pub fn flops(&self, n: usize, h: usize, v: usize) -> f64 {
        let nhv = n as f64 * h as f64 * v as f64;
        if self.single_pass {
            6.0 * nhv
        } else {
            8.0 * nhv
        }
    }
}

/// Packing buffers the `gemm` crate allocates per thread (measured: up to ~1.5 MiB; kept
/// with a margin). The budget covers them for one thread per core of the machine, so
/// they are reserved first; the plan then does not depend on the thread pool's size
/// (results are bitwise identical for any thread count). A pool with more threads than
/// cores adds this much per extra thread beyond the budget.
pub const GEMM_SCRATCH_PER_THREAD: usize = 2 << 20;

/// The GEMM reserve of this machine: [`GEMM_SCRATCH_PER_THREAD`] per core, plus one for
/// the calling thread (which packs too when it is not a pool worker).
pub fn gemm_reserve_bytes() -> usize {
    GEMM_SCRATCH_PER_THREAD * (std::thread::available_parallelism().map_or(1, |c| c.get()) + 1)
}

/// Single-pass blocks with fewer rows than this make poor GEMMs (measured: 100-row
/// blocks reach 47-58% of the GEMM rate, 512-row two-pass tiles 88%); auto mode then
/// chooses two-pass.
const MIN_SINGLE_PASS_ROWS: usize = 256;
/// Widest vocabulary tile of one GEMM call.
const VOCAB_TILE_MAX: usize = 2048;

/// Largest row block (beyond it GEMMs gain nothing and the workspace grows).
const MAX_BLOCK_ROWS: usize = 512;

/// Chooses the mode and block sizes: the largest blocks whose workspace fits the
/// budget less the GEMM reserve. `single_pass_allowed` is false for losses that reduce
/// over sequences.
pub fn plan(
    n: usize,
    h: usize,
    v: usize,
    widen: bool,
    opts: &FusedOptions,
    single_pass_allowed: bool,
) -> Result<Plan> {
    let gemm_reserve_bytes = gemm_reserve_bytes();
    let budget = opts
        .budget_bytes
        .checked_sub(gemm_reserve_bytes)
        .ok_or_else(|| Error::InvalidArgument {
            arg: "budget_bytes",
            reason: format!(
                "{} bytes is below the GEMM packing reserve of {gemm_reserve_bytes} bytes ({GEMM_SCRATCH_PER_THREAD} per core and one more)",
                opts.budget_bytes
            ),
        })?;
    // Every GEMM runs on one vocabulary tile: `gemm` packs a whole `kc × vocab_tile`
    // panel for dW, so the tile bounds its packing too. A widened bf16 weight tile holds
    // vocab_tile × H f32; keep it within a quarter of the budget.
    let mut vocab_tile = v.min(VOCAB_TILE_MAX);
    while widen && vocab_tile > 64 && vocab_tile * h * 4 > budget / 4 {
        vocab_tile /= 2;
    }
    let widened = |rows: usize| {
        if widen {
            (vocab_tile + rows) * h * 4
        } else {
            0
        }
    };
    let fits = |rows: usize, cols: usize| rows * cols * 4 + widened(rows) <= budget;
    let largest = |cols: usize| {
        let mut rows = n.min(MAX_BLOCK_ROWS);
        while rows > 0 && !fits(rows, cols) {
            rows -= 1;
        }
        rows
    };
    let single_rows = largest(v);
    let single = opts.mode.single_pass(
        single_pass_allowed,
        single_rows >= MIN_SINGLE_PASS_ROWS.min(n),
    )?;
    let (rows, cols) = if single {
        (single_rows, v)
    } else {
        (largest(vocab_tile), vocab_tile)
    };
    if rows == 0 {
        return Err(Error::InvalidArgument {
            arg: "budget_bytes",
            reason: format!(
                "{} bytes (less the GEMM reserve of {gemm_reserve_bytes}) cannot hold one row of {} logits{}",
                opts.budget_bytes,
                cols,
                if widen {
                    " and a widened weight tile"
                } else {
                    ""
                }
            ),
        });
    }
    Ok(Plan {
        single_pass: single,
        block_rows: rows,
        vocab_tile,
        workspace_bytes: rows * cols * 4 + widened(rows),
        gemm_reserve_bytes,
    })
}

/// What turns a row's logits into its gradient: with
/// `p_j = exp((z_j - max)·inv_temp - log_sum)`,
/// `dz_j = (coef_p·p_j + coef_h·p_j·(log p_j + H) + coef_uniform + [j = target]·coef_target)
/// · slope_j`, where `slope_j` is the soft-cap's `1 - (z_j/cap)²` (1 without one).
#[derive(Debug, Clone, Copy, Default)]
pub struct RowGrad {
    /// Softmax statistics of the row.
    pub stats: RowStats,
    /// Multiplies `p_j`.
    pub coef_p: f32,
    /// Multiplies `p_j·(log p_j + H)`.
    pub coef_h: f32,
    /// Added to every entry.
    pub coef_uniform: f32,
    /// Added at the target.
    pub coef_target: f32,
    /// Target id (unused when `coef_target` is 0).
    pub target: usize,
}

impl RowGrad {
    /// Whether every coefficient is 0 (the row's gradient is zero).
    pub(crate) fn is_zero(&self) -> bool {
        self.coef_p == 0.0
            && self.coef_h == 0.0
            && self.coef_uniform == 0.0
            && self.coef_target == 0.0
    }
}

/// Rows `rows` of `m` (row-major `[*, cols]`) as f32: borrowed for f32, widened into
/// `buf` otherwise.
fn rows_f32<'a, E: Element>(
    m: &'a [E],
    cols: usize,
    rows: Range<usize>,
    buf: &'a mut Vec<f32>,
) -> Cow<'a, [f32]> {
    let src = &m[rows.start * cols..rows.end * cols];
    match E::as_f32(src) {
        Some(s) => Cow::Borrowed(s),
        None => {
            buf.resize(src.len(), 0.0);
            simd::load(src, buf);
            Cow::Borrowed(&buf[..])
        }
    }
}

/// Reusable workspace of the fused LM-head kernels (logit tiles, widened bf16 blocks).
/// Keeping one across steps, as a training loop does, saves the page faults of fresh
/// memory on every call; its size is what the plan chose within the budget.
#[derive(Debug, Default)]
pub struct Workspace {
    logits: Vec<f32>,
    hidden: Vec<f32>,
    weight: Vec<f32>,
}

impl Workspace {
    /// An empty workspace (buffers grow on first use).
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        4 * (self.logits.capacity() + self.hidden.capacity() + self.weight.capacity())
    }

    fn prepare(&mut self, plan: &Plan, v: usize) -> &mut Self {
        let cols = if plan.single_pass { v } else { plan.vocab_tile };
        let need = plan.block_rows * cols;
        if self.logits.len() != need {
            self.logits = Vec::new();
            self.logits.resize(need, 0.0);
        }
        self
    }
}

/// `z[rows, 0..vt]` (row stride `ld`) = `softcap(hidden[rows] · weight[vocab]ᵀ + bias[vocab])`.
#[allow(clippy::too_many_arguments)]
fn logits_tile(
    z: &mut [f32],
    ld: usize,
    hidden: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    softcap: Option<f32>,
    rows: usize,
    h: usize,
    vt: usize,
) {
    matmul(
        z,
        ld,
        MatRef::row_major(hidden, rows, h),
        MatRef::row_major(weight, vt, h).t(),
        false,
    );
    if bias.is_some() || softcap.is_some() {
        z.par_chunks_mut(ld).take(rows).for_each(|row| {
            let row = &mut row[..vt];
            if let Some(b) = bias {
                row.iter_mut().zip(b).for_each(|(x, c)| *x += c);
            }
            if let Some(cap) = softcap {
                simd::softcap(row, cap);
            }
        });
    }
}

/// Inputs of a fused LM-head pass.
pub struct Problem<'a, E> {
    /// Hidden states, weight, bias.
    pub inputs: &'a LinearInputs<'a, E>,
    /// Target ids `[N]` (read where `live`).
    pub targets: &'a [i64],
    /// Rows that take part `[N]`.
    pub live: &'a [bool],
    /// `1 / T_temp`.
    pub inv_temp: f32,
    /// Logit soft-cap applied to every tile (cross-entropy only).
    pub softcap: Option<f32>,
    /// Whether [`RowStats::mean_logit`] is wanted (label smoothing).
    pub mean_logit: bool,
}

impl<E: Element> Problem<'_, E> {
    fn bias_f32(&self) -> Option<Vec<f32>> {
        self.inputs
            .bias
            .map(|b| b.iter().map(|x| x.to_f32()).collect())
    }

    fn inv_cap(&self) -> f32 {
        self.softcap.map_or(0.0, |c| 1.0 / c)
    }

    /// Final statistics of live row `i` from its state, target logit and logit sum over
    /// a vocabulary of `vocab` entries.
    fn finish(
        &self,
        i: usize,
        state: &OnlineSoftmax,
        target_logit: f32,
        sum: f64,
        vocab: usize,
    ) -> RowStats {
        if !self.live[i] {
            return RowStats::default();
        }
        let mut st = RowStats::finish(state, target_logit);
        if self.mean_logit {
            st.mean_logit = (sum / vocab as f64 * self.inv_temp as f64) as f32;
        }
        st
    }

    fn vocab_tiles(&self, vt: usize) -> impl Iterator<Item = Range<usize>> + use<E> {
        let v = self.inputs.vocab;
        (0..v).step_by(vt).map(move |s| s..(s + vt).min(v))
    }

    fn row_blocks(&self, nb: usize) -> impl Iterator<Item = Range<usize>> + use<E> {
        let n = self.inputs.tokens;
        (0..n).step_by(nb).map(move |s| s..(s + nb).min(n))
    }
}

/// Merges the statistics of a `[rows, cols]` tile (row stride `ld`) whose columns are
/// vocabulary entries `vocab`, captures target logits that fall in it and, if the
/// problem wants mean logits, adds each row's sum into `sums`.
#[allow(clippy::too_many_arguments)]
fn merge_tile_stats<E: Element>(
    p: &Problem<E>,
    z: &[f32],
    ld: usize,
    rows: Range<usize>,
    vocab: &Range<usize>,
    states: &mut [OnlineSoftmax],
    target_logits: &mut [f32],
    sums: &mut [f64],
) {
    let cols = vocab.len();
    z.par_chunks(ld)
        .zip(states.par_iter_mut())
        .zip(target_logits.par_iter_mut())
        .zip(sums.par_iter_mut())
        .enumerate()
        .take(rows.len())
        .for_each(|(r, (((row, state), target_logit), sum))| {
            let i = rows.start + r;
            if !p.live[i] {
                return;
            }
            let row = &row[..cols];
            state.merge(OnlineSoftmax::of_tile(row, p.inv_temp));
            if p.mean_logit {
                *sum += simd::sum(row);
            }
            let y = p.targets[i] as usize;
            if vocab.contains(&y) {
                *target_logit = row[y - vocab.start];
            }
        });
}

/// Turns a `[rows, cols]` tile of logits (row stride `ld`, vocabulary entries `vocab`)
/// into `dZ` in place; `inv_cap` is `1/cap` of the soft-cap the logits went through
/// (0: none).
fn grad_tile(
    z: &mut [f32],
    ld: usize,
    vocab: &Range<usize>,
    grads: &[RowGrad],
    inv_temp: f32,
    inv_cap: f32,
) {
    let cols = vocab.len();
    z.par_chunks_mut(ld)
        .zip(grads.par_iter())
        .for_each(|(row, g)| {
            let row = &mut row[..cols];
            if g.is_zero() {
                row.fill(0.0);
                return;
            }
            let target = vocab.contains(&g.target).then(|| g.target - vocab.start);
            let target_slope = target.map(|t| simd::softcap_slope(row[t], inv_cap));
            simd::softmax_grad(
                row,
                &simd::SoftmaxGrad {
                    max: g.stats.max,
                    scale: inv_temp,
                    log_sum: g.stats.log_sum,
                    coef_p: g.coef_p,
                    coef_h: g.coef_h,
                    entropy: g.stats.entropy,
                    uniform: g.coef_uniform,
                    inv_cap,
                },
            );
            if let (Some(t), Some(slope)) = (target, target_slope) {
                row[t] += g.coef_target * slope;
            }
        });
}

/// Gradients of the LM head, accumulated in f32.
#[derive(Debug, Clone)]
pub struct LinearGrads {
    /// `dH` `[N, H]`.
    pub dhidden: Vec<f32>,
    /// `dW` `[V, H]`.
    pub dweight: Vec<f32>,
    /// `dbias` `[V]` (when the head has a bias).
    pub dbias: Option<Vec<f32>>,
}

impl LinearGrads {
    /// Zeroed gradients for `inputs`' shapes.
    pub fn zeros<E>(inputs: &LinearInputs<E>) -> Self {
        let (n, h, v) = (inputs.tokens, inputs.hidden_size, inputs.vocab);
        LinearGrads {
            dhidden: vec![0.0; n * h],
            dweight: vec![0.0; v * h],
            dbias: inputs.bias.map(|_| vec![0.0; v]),
        }
    }

    /// No buffers (what the `_into` kernels return; the gradients went to the caller's).
    pub fn empty() -> Self {
        LinearGrads {
            dhidden: Vec::new(),
            dweight: Vec::new(),
            dbias: None,
        }
    }

    /// `dW` rounded to the weight's dtype `E` (accumulation stays f32).
    pub fn dweight_as<E: Element>(&self) -> Vec<E> {
        let mut out = vec![E::default(); self.dweight.len()];
        simd::store(&self.dweight, &mut out);
        out
    }

    /// Checks that the buffers match `inputs`' shapes (and bias presence).
    pub fn check<E>(&self, inputs: &LinearInputs<E>) -> Result<()> {
        check_grad_lens(
            (inputs.tokens, inputs.hidden_size, inputs.vocab),
            inputs.bias.is_some(),
            self.dhidden.len(),
            self.dweight.len(),
            self.dbias.as_ref().map(Vec::len),
        )
    }
}

/// Checks gradient buffers of `dhidden`, `dweight` and `dbias` elements against a head
/// of shape `(N, H, V)` (a bias buffer exactly when the head has a bias); any backend's.
pub(crate) fn check_grad_lens(
    (n, h, v): (usize, usize, usize),
    has_bias: bool,
    dhidden: usize,
    dweight: usize,
    dbias: Option<usize>,
) -> Result<()> {
    let bad = |arg: &'static str, shape: String, expected: usize, actual: usize| {
        Err(Error::ShapeMismatch {
            arg,
            shape,
            expected,
            actual,
        })
    };
    if dhidden != n * h {
        return bad("dhidden", format!("[N={n}, H={h}]"), n * h, dhidden);
    }
    if dweight != v * h {
        return bad("dweight", format!("[V={v}, H={h}]"), v * h, dweight);
    }
    match (dbias, has_bias) {
        (Some(db), true) if db != v => bad("dbias", format!("[V={v}]"), v, db),
        (None, true) | (Some(_), false) => Err(Error::InvalidArgument {
            arg: "dbias",
            reason: "must be present exactly when the head has a bias".into(),
        }),
        _ => Ok(()),
    }
}

/// `dH[rows] += dZ·W[vocab]`, `dW[vocab] += dZᵀ·H[rows]`, `dbias[vocab] += Σ_rows dZ`
/// for one `[rows, cols]` gradient tile `dz` (row stride `ld`).
#[allow(clippy::too_many_arguments)]
fn accumulate_tile(
    grads: &mut LinearGrads,
    dz: &[f32],
    ld: usize,
    hidden: &[f32],
    weight: &[f32],
    rows: &Range<usize>,
    vocab: &Range<usize>,
    h: usize,
) {
    let (nb, vt) = (rows.len(), vocab.len());
    let dz_view = MatRef {
        data: dz,
        rows: nb,
        cols: vt,
        row_stride: ld,
        col_stride: 1,
    };
    matmul(
        &mut grads.dhidden[rows.start * h..rows.end * h],
        h,
        dz_view,
        MatRef::row_major(weight, vt, h),
        true,
    );
    matmul(
        &mut grads.dweight[vocab.start * h..vocab.end * h],
        h,
        dz_view.t(),
        MatRef::row_major(hidden, nb, h),
        true,
    );
    if let Some(db) = grads.dbias.as_mut() {
        let db = &mut db[vocab.clone()];
        for row in dz.chunks(ld).take(nb) {
            db.iter_mut().zip(&row[..vt]).for_each(|(d, x)| *d += x);
        }
    }
}

/// One recomputed logits tile: rows `rows` × vocabulary entries `vocab`, dense
/// `[rows, vocab]` in `z`, with the f32 hidden rows and weight rows it came from.
struct Tile<'t> {
    rows: Range<usize>,
    vocab: Range<usize>,
    z: &'t mut [f32],
    hidden: &'t [f32],
    weight: &'t [f32],
}

/// Forms every `[block_rows, vocab_tile]` logits tile in the workspace and hands it to
/// `each`; row blocks for which `skip` is true are not computed.
fn for_each_tile<E: Element>(
    p: &Problem<E>,
    plan: &Plan,
    ws: &mut Workspace,
    skip: impl Fn(&Range<usize>) -> bool,
    mut each: impl FnMut(Tile),
) {
    let h = p.inputs.hidden_size;
    let bias = p.bias_f32();
    let scratch = ws.prepare(
        &Plan {
            single_pass: false,
            ..*plan
        },
        p.inputs.vocab,
    );
    for rows in p.row_blocks(plan.block_rows).filter(|r| !skip(r)) {
        let hid = rows_f32(p.inputs.hidden, h, rows.clone(), &mut scratch.hidden);
        for vocab in p.vocab_tiles(plan.vocab_tile) {
            let w = rows_f32(p.inputs.weight, h, vocab.clone(), &mut scratch.weight);
            let z = &mut scratch.logits[..rows.len() * vocab.len()];
            logits_tile(
                z,
                vocab.len(),
                &hid,
                &w,
                bias.as_ref().map(|b| &b[vocab.clone()]),
                p.softcap,
                rows.len(),
                h,
                vocab.len(),
            );
            each(Tile {
                rows: rows.clone(),
                vocab,
                z,
                hidden: &hid,
                weight: &w,
            });
        }
    }
}

/// Per-row softmax state of a pass over (part of) the vocabulary, before finishing:
/// what vocabulary shards merge across ranks.
#[derive(Debug, Clone)]
pub struct PartialStats {
    /// Online-softmax state per row.
    pub states: Vec<OnlineSoftmax>,
    /// Raw logit of each row's target where the pass saw it (0 elsewhere).
    pub target_logits: Vec<f32>,
    /// `Σ_j z_j` per row (when the problem wants mean logits; 0 otherwise).
    pub sums: Vec<f64>,
}

impl PartialStats {
    /// Final [`RowStats`]; `vocab` is the full vocabulary size (for the mean logit).
    pub fn finish<E: Element>(&self, p: &Problem<E>, vocab: usize) -> Vec<RowStats> {
        (0..self.states.len())
            .map(|i| {
                p.finish(
                    i,
                    &self.states[i],
                    self.target_logits[i],
                    self.sums[i],
                    vocab,
                )
            })
            .collect()
    }
}

/// Pass A over the vocabulary the problem holds: every live row's partial statistics.
pub fn row_states<E: Element>(p: &Problem<E>, plan: &Plan, ws: &mut Workspace) -> PartialStats {
    let n = p.inputs.tokens;
    let mut out = PartialStats {
        states: vec![OnlineSoftmax::empty(p.inv_temp); n],
        target_logits: vec![0.0f32; n],
        sums: vec![0.0f64; n],
    };
    for_each_tile(
        p,
        plan,
        ws,
        |_| false,
        |t| {
            merge_tile_stats(
                p,
                t.z,
                t.vocab.len(),
                t.rows.clone(),
                &t.vocab,
                &mut out.states[t.rows.clone()],
                &mut out.target_logits[t.rows.clone()],
                &mut out.sums[t.rows.clone()],
            );
        },
    );
    out
}

/// Pass A: softmax statistics of every live row (zeroed [`RowStats`] elsewhere).
pub fn row_stats<E: Element>(p: &Problem<E>, plan: &Plan, ws: &mut Workspace) -> Vec<RowStats> {
    row_states(p, plan, ws).finish(p, p.inputs.vocab)
}

/// Pass B: recomputes every tile, turns it into `dZ` with `grads` (one per row) and
/// adds the LM head's gradients into `out`.
pub fn accumulate_grads<E: Element>(
    p: &Problem<E>,
    plan: &Plan,
    grads: &[RowGrad],
    ws: &mut Workspace,
    out: &mut LinearGrads,
) {
    let h = p.inputs.hidden_size;
    let no_gradient = |rows: &Range<usize>| rows.clone().all(|i| grads[i].is_zero());
    for_each_tile(p, plan, ws, no_gradient, |t| {
        let ld = t.vocab.len();
        grad_tile(
            t.z,
            ld,
            &t.vocab,
            &grads[t.rows.clone()],
            p.inv_temp,
            p.inv_cap(),
        );
        accumulate_tile(out, t.z, ld, t.hidden, t.weight, &t.rows, &t.vocab, h);
    });
}

/// Given a block's rows and every row's stats so far, the block's [`RowGrad`]s.
pub type GradsOf<'a> = dyn FnMut(Range<usize>, &[RowStats]) -> Vec<RowGrad> + 'a;

/// Single pass: per row block, all its logits (tile by tile into a `[rows, V]` block),
/// its statistics, then `grads_of(rows, stats)` gives the block's [`RowGrad`]s, and the
/// gradients are added into `out` from the block still in memory. Returns every row's
/// stats.
pub fn single_pass<E: Element>(
    p: &Problem<E>,
    plan: &Plan,
    grads_of: &mut GradsOf,
    ws: &mut Workspace,
    out: &mut LinearGrads,
) -> Vec<RowStats> {
    let (n, h, v) = (p.inputs.tokens, p.inputs.hidden_size, p.inputs.vocab);
    let vt = plan.vocab_tile;
    let bias = p.bias_f32();
    let scratch = ws.prepare(plan, v);
    let mut stats = vec![RowStats::default(); n];
    for rows in p.row_blocks(plan.block_rows) {
        let nb = rows.len();
        let hid = rows_f32(p.inputs.hidden, h, rows.clone(), &mut scratch.hidden);
        let block = &mut scratch.logits[..nb * v];
        let mut states = vec![OnlineSoftmax::empty(p.inv_temp); nb];
        let mut target_logits = vec![0.0f32; nb];
        let mut sums = vec![0.0f64; nb];
        for vocab in p.vocab_tiles(vt) {
            let w = rows_f32(p.inputs.weight, h, vocab.clone(), &mut scratch.weight);
            let z = &mut block[vocab.start..];
            logits_tile(
                z,
                v,
                &hid,
                &w,
                bias.as_ref().map(|b| &b[vocab.clone()]),
                p.softcap,
                nb,
                h,
                vocab.len(),
            );
            merge_tile_stats(
                p,
                z,
                v,
                rows.clone(),
                &vocab,
                &mut states,
                &mut target_logits,
                &mut sums,
            );
        }
        for (r, i) in rows.clone().enumerate() {
            stats[i] = p.finish(i, &states[r], target_logits[r], sums[r], v);
        }
        let grads = grads_of(rows.clone(), &stats);
        let all = 0..v;
        grad_tile(block, v, &all, &grads, p.inv_temp, p.inv_cap());
        for vocab in p.vocab_tiles(vt) {
            let w = rows_f32(p.inputs.weight, h, vocab.clone(), &mut scratch.weight);
            accumulate_tile(out, &block[vocab.start..], v, &hid, &w, &rows, &vocab, h);
        }
    }
    stats
}

/// The passes of a fused LM-head kernel on one backend (the CPU here, the GPU in
/// `cuda`), over one problem, plan, workspace and gradient buffers: what the loss
/// drivers ([`super::grpo_linear`], [`super::ce_linear`]) call around their per-row
/// stages, so that each loss is written once for every backend.
pub(crate) trait FusedPasses {
    /// The plan the passes run.
    fn plan(&self) -> Plan;

    /// Pass A: softmax statistics of every live row (zeroed elsewhere).
    fn row_stats(&mut self) -> Result<Vec<RowStats>>;

    /// Pass B: the head's gradients of every row's [`RowGrad`], added into the output.
    fn accumulate_grads(&mut self, grads: &[RowGrad]) -> Result<()>;

    /// Single pass (see [`single_pass`]); returns every row's stats.
    fn single_pass(&mut self, grads_of: &mut GradsOf) -> Result<Vec<RowStats>>;
}

/// The CPU's [`FusedPasses`].
pub(crate) struct CpuPasses<'a, E> {
    /// The problem.
    pub(crate) problem: Problem<'a, E>,
    /// Its plan.
    pub(crate) plan: Plan,
    /// Tiles and widened blocks.
    pub(crate) ws: &'a mut Workspace,
    /// Where the gradients are added.
    pub(crate) out: &'a mut LinearGrads,
}

impl<E: Element> FusedPasses for CpuPasses<'_, E> {
    fn plan(&self) -> Plan {
        self.plan
    }

    fn row_stats(&mut self) -> Result<Vec<RowStats>> {
        Ok(row_stats(&self.problem, &self.plan, self.ws))
    }

    fn accumulate_grads(&mut self, grads: &[RowGrad]) -> Result<()> {
        accumulate_grads(&self.problem, &self.plan, grads, self.ws, self.out);
        Ok(())
    }

    fn single_pass(&mut self, grads_of: &mut GradsOf) -> Result<Vec<RowStats>> {
        Ok(single_pass(
            &self.problem,
            &self.plan,
            grads_of,
            self.ws,
            self.out,
        ))
    }
}

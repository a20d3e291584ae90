//! What a backend offers the fused LM-head losses: a [`Head`] (hidden states `[N, H]`,
//! weight `[V, H]` or `[H, V]`, optional bias `[V]`, gradient buffers and a workspace, in host or
//! device memory) plans its work and runs [`FusedPasses`] over it. Pass A streams the
//! vocabulary for each row's softmax state; pass B recomputes each tile, turns it into
//! `dZ` with one [`RowGrad`] per row and adds `dH += dZ·W`, `dW += dZᵀ·H`,
//! `dbias += Σ_rows dZ` (8NHV FLOPs in all); a single pass keeps a row block's logits
//! whole between its statistics and its gradients (6NHV). A frozen head
//! ([`HeadGrad::Frozen`]) has no `dW`/`dbias` buffers and skips their products. The loss
//! drivers (GRPO, cross-entropy, log-probs, sharded) are written once over these. Two
//! hooks serve statistics beyond the softmax state (two-pass plans only): a
//! [`TileVisitor`] sees every logits tile of pass A or of an extra pass, and
//! [`SparseGrads`] add per-row one-hot terms to pass B.

use super::plan::{FusedOptions, HeadGrad, Plan};
use super::terms::{RowGrad, TileVisitor};
use crate::batch::{HeadShape, LinearInputs};
use crate::collective::Collective;
use crate::element::Element;
use crate::error::{Error, Result};
use crate::rows::{PartialStats, RowInputs, RowStats};
use crate::sharding::local_ids;
use crate::weight_layout::WeightLayout;
use std::ops::Range;

/// Sparse terms of pass B beside the rows' [`RowGrad`]s: per row `k` pairs (id local to
/// the head's vocabulary, coefficient), adding `dz_ij += coef_ik·slope_j·[j = id_ik]`
/// (`slope_j` the soft-cap's, as for [`RowGrad::coef_target`]; like it, a coefficient
/// already holds the `g/T` of the scaled logits). Repeats add up; a negative id (another
/// vocabulary shard holds it) adds nothing. Candidate sets' one-hot terms.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SparseGrads {
    /// Pairs per row.
    pub k: usize,
    /// Local ids `[N, k]` (negative: not on this head).
    pub ids: Vec<i64>,
    /// Coefficients `[N, k]`.
    pub coefs: Vec<f32>,
}

impl SparseGrads {
    /// Row `i`'s ids and coefficients.
    pub fn row(&self, i: usize) -> (&[i64], &[f32]) {
        let span = i * self.k..(i + 1) * self.k;
        (&self.ids[span.clone()], &self.coefs[span])
    }

    /// Whether row `i` adds nothing.
    pub fn row_is_zero(&self, i: usize) -> bool {
        let (ids, coefs) = self.row(i);
        ids.iter().zip(coefs).all(|(&id, &c)| id < 0 || c == 0.0)
    }

    /// The terms restricted to a vocabulary shard `range` (ids of the whole vocabulary
    /// become shard-local; the others -1).
    pub fn on_shard(&self, range: &Range<usize>) -> SparseGrads {
        SparseGrads {
            k: self.k,
            ids: local_ids(&self.ids, range),
            coefs: self.coefs.clone(),
        }
    }

    /// Checks the terms against a head of `n` rows and `vocab` entries: `[n, k]` ids and
    /// coefficients, ids below `vocab`.
    pub fn check(&self, n: usize, vocab: usize) -> Result<()> {
        for (arg, len) in [
            ("sparse ids", self.ids.len()),
            ("sparse coefs", self.coefs.len()),
        ] {
            if len != n * self.k {
                return Err(Error::ShapeMismatch {
                    arg,
                    shape: format!("[N={n}, K={}]", self.k),
                    expected: n * self.k,
                    actual: len,
                });
            }
        }
        match self.ids.iter().position(|&id| id >= vocab as i64) {
            Some(at) => Err(Error::InvalidArgument {
                arg: "sparse ids",
                reason: format!(
                    "id {} at [{}, {}] is outside the head's {vocab} entries",
                    self.ids[at],
                    at / self.k,
                    at % self.k
                ),
            }),
            None => Ok(()),
        }
    }
}

/// Given a block's rows and every row's stats so far, the block's [`RowGrad`]s.
pub type GradsOf<'a> = dyn FnMut(Range<usize>, &[RowStats]) -> Vec<RowGrad> + 'a;

/// The pass hooks a single pass takes ([`FusedPasses::single_pass_hooked`]): a visitor
/// of every logits tile (before it is stored) and sparse terms added to each block's
/// `dZ` (ids local to the head; without a soft-cap, whose slope the stored block no
/// longer holds exactly).
#[derive(Default)]
pub struct SinglePassHooks<'h> {
    /// Sees every logits tile of the live rows.
    pub visitor: Option<&'h mut dyn TileVisitor>,
    /// Added to the rows' [`RowGrad`]s.
    pub sparse: Option<&'h SparseGrads>,
}

/// The passes of a fused LM-head kernel over one head, plan, workspace and gradient
/// buffers, on one backend.
pub trait FusedPasses {
    /// The plan the passes run.
    fn plan(&self) -> Plan;

    /// Pass A over the vocabulary the head holds: every live row's partial state.
    fn row_states(&mut self) -> Result<PartialStats>;

    /// Pass B: the head's gradients of every row's [`RowGrad`], added into its buffers.
    fn accumulate_grads(&mut self, grads: &[RowGrad]) -> Result<()>;

    /// Pass A with `visitor` seeing every logits tile (two-pass plans only; see
    /// [`TileVisitor`]).
    fn row_states_visiting(&mut self, visitor: &mut dyn TileVisitor) -> Result<PartialStats>;

    /// An extra pass that only forms the logits tiles of the live rows and hands each to
    /// `visitor` (two-pass plans only).
    fn visit_tiles(&mut self, visitor: &mut dyn TileVisitor) -> Result<()>;

    /// Pass B with the [`SparseGrads`] `sparse` added to the rows' [`RowGrad`]s (two-pass
    /// plans only; ids local to the head).
    fn accumulate_grads_sparse(&mut self, grads: &[RowGrad], sparse: &SparseGrads) -> Result<()>;

    /// Single pass: per row block, its logits over the whole vocabulary, its statistics,
    /// then `grads_of(rows, stats)` gives the block's [`RowGrad`]s and the gradients are
    /// added from the block still in memory. Returns every row's stats.
    fn single_pass(&mut self, grads_of: &mut GradsOf) -> Result<Vec<RowStats>>;

    /// [`FusedPasses::single_pass`] with `hooks`: the visitor sees each logits tile as
    /// it is formed, and the sparse terms join the block's `dZ`.
    fn single_pass_hooked(
        &mut self,
        grads_of: &mut GradsOf,
        hooks: SinglePassHooks,
    ) -> Result<Vec<RowStats>>;
}

/// Which gradients a sharded run sums across ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GradPart {
    /// `dH` (vocabulary shards of the same rows).
    Hidden,
    /// `dW` and `dbias` (token groups holding the same head shard).
    Head,
}

/// An LM head with its gradient buffers and workspace on one backend: host buffers on
/// the CPU (`cpu::CpuHead`), device buffers on the GPU (`cuda::CudaHead`).
pub trait Head {
    /// Its shape.
    fn shape(&self) -> HeadShape;

    /// Checks the head's inputs (finite values) and, given `grads` (which of the head's
    /// gradients a step forms), that the gradient buffers match it. The drivers check
    /// the shape first ([`check_head`]).
    fn validate(&self, grads: Option<HeadGrad>) -> Result<()>;

    /// Checks the gradient buffers after a step: the first entry that is not finite is
    /// the error of [`crate::range::grad_out_of_range`] (`seq_len` places a `dH` row in
    /// its sequence). A sum over the vocabulary or the tokens can leave f32 where every
    /// row's gradient is in range.
    fn check_grads(&self, seq_len: usize) -> Result<()>;

    /// The plan of this backend for `opts`; `single_pass_allowed` is false for losses
    /// that reduce over sequences.
    fn plan(&self, opts: &FusedOptions, single_pass_allowed: bool) -> Result<Plan>;

    /// The passes over `rows` with `plan`, adding into the head's gradient buffers.
    fn passes<'s>(
        &'s mut self,
        rows: RowInputs<'s>,
        plan: Plan,
    ) -> Result<Box<dyn FusedPasses + 's>>;

    /// Sums `part` of the gradients over `comm`'s ranks.
    fn all_reduce(&mut self, comm: &dyn Collective, part: GradPart) -> Result<()>;
}

/// Checks a head before a driver runs on it: its shape ([`HeadShape::check`]), then the
/// backend's [`Head::validate`] (`grads`: the gradients the step forms, none for
/// statistics only).
pub(crate) fn check_head(head: &dyn Head, grads: Option<HeadGrad>) -> Result<()> {
    head.shape().check()?;
    head.validate(grads)
}

/// Gradients of an LM head in host memory, accumulated in f32.
#[derive(Debug, Clone)]
pub struct LinearGrads {
    /// `dH` `[N, H]`.
    pub dhidden: Vec<f32>,
    /// `dW`, `[V, H]` or `[H, V]` as the weight (empty for a frozen head).
    pub dweight: Vec<f32>,
    /// `dbias` `[V]` (when the head has a bias and is not frozen).
    pub dbias: Option<Vec<f32>>,
}

impl LinearGrads {
    /// Zeroed gradients for `inputs`' shapes, a trainable head's.
    pub fn zeros<E>(inputs: &LinearInputs<E>) -> Self {
        Self::zeros_for(inputs, HeadGrad::Full)
    }

    /// Zeroed gradients for `inputs`' shapes: `dH`, and `dW` and `dbias` as `head_grad`
    /// forms them (a frozen head gets none: an empty `dweight`, no `dbias`).
    pub fn zeros_for<E>(inputs: &LinearInputs<E>, head_grad: HeadGrad) -> Self {
        let (n, h, v) = (inputs.tokens, inputs.hidden_size, inputs.vocab);
        let full = head_grad.has_dweight();
        LinearGrads {
            dhidden: vec![0.0; n * h],
            dweight: if full { vec![0.0; v * h] } else { Vec::new() },
            dbias: inputs.bias.filter(|_| full).map(|_| vec![0.0; v]),
        }
    }

    /// `dW` rounded to the weight's dtype `E` (round to nearest even; the
    /// accumulation stays f32).
    pub fn dweight_as<E: Element>(&self) -> Vec<E> {
        self.dweight.iter().map(|&x| E::from_f32(x)).collect()
    }

    /// No buffers (what the drivers return; the gradients went to the head's buffers).
    pub fn empty() -> Self {
        LinearGrads {
            dhidden: Vec::new(),
            dweight: Vec::new(),
            dbias: None,
        }
    }

    /// Checks that the buffers match `inputs`' shapes (and bias presence) for
    /// `head_grad`.
    pub fn check<E>(&self, inputs: &LinearInputs<E>, head_grad: HeadGrad) -> Result<()> {
        check_grad_lens(
            inputs.shape(),
            (inputs.layout, head_grad),
            inputs.bias.is_some(),
            self.dhidden.len(),
            self.dweight.len(),
            self.dbias.as_ref().map(Vec::len),
        )
    }

    /// A view of the buffers, for a head that adds into them.
    pub fn view(&mut self) -> LinearGradsMut<'_> {
        LinearGradsMut {
            dhidden: &mut self.dhidden,
            dweight: &mut self.dweight,
            dbias: self.dbias.as_deref_mut(),
        }
    }
}

/// Gradient buffers of an LM head in host memory that a head adds into, in f32,
/// wherever they were allocated (a [`LinearGrads`], or a caller's tensors).
#[derive(Debug)]
pub struct LinearGradsMut<'a> {
    /// `dH` `[N, H]`.
    pub dhidden: &'a mut [f32],
    /// `dW`, `[V, H]` or `[H, V]` as the weight (empty for a frozen head).
    pub dweight: &'a mut [f32],
    /// `dbias` `[V]` (when the head has a bias and is not frozen).
    pub dbias: Option<&'a mut [f32]>,
}

impl LinearGradsMut<'_> {
    /// Checks that the buffers match `inputs`' shapes (and bias presence) for
    /// `head_grad`.
    pub fn check<E>(&self, inputs: &LinearInputs<E>, head_grad: HeadGrad) -> Result<()> {
        check_grad_lens(
            inputs.shape(),
            (inputs.layout, head_grad),
            inputs.bias.is_some(),
            self.dhidden.len(),
            self.dweight.len(),
            self.dbias.as_ref().map(|b| b.len()),
        )
    }

    /// Sums `part` over `comm`'s ranks.
    pub fn all_reduce(&mut self, comm: &dyn Collective, part: GradPart) -> Result<()> {
        match part {
            GradPart::Hidden => comm.all_reduce_sum_f32(self.dhidden),
            GradPart::Head => {
                comm.all_reduce_sum_f32(self.dweight)?;
                match self.dbias.as_deref_mut() {
                    Some(db) => comm.all_reduce_sum_f32(db),
                    None => Ok(()),
                }
            }
        }
    }
}

/// Checks gradient buffers of `dhidden`, `dweight` and `dbias` elements against a head
/// of `shape` with its weight in `layout` for `head_grad` (a trainable head: `dW` of
/// the weight's size and a bias buffer exactly when the head has a bias; a frozen one:
/// neither); any backend's.
pub fn check_grad_lens(
    shape: HeadShape,
    (layout, head_grad): (WeightLayout, HeadGrad),
    has_bias: bool,
    dhidden: usize,
    dweight: usize,
    dbias: Option<usize>,
) -> Result<()> {
    let (n, h, v) = (shape.tokens, shape.hidden_size, shape.vocab);
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
    if !head_grad.has_dweight() {
        return match (dweight, dbias) {
            (0, None) => Ok(()),
            (0, Some(_)) => Err(Error::InvalidArgument {
                arg: "dbias",
                reason: "must be absent for a frozen head (head_grad frozen)".into(),
            }),
            _ => bad("dweight", "[0] (a frozen head)".into(), 0, dweight),
        };
    }
    if dweight != v * h {
        return bad("dweight", layout.shape(v, h), v * h, dweight);
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

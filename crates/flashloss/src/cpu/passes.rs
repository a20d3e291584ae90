//! The fused LM-head passes on the CPU: logits exist only as a
//! `[block_rows, vocab_tile]` tile (two-pass) or a `[block_rows, V]` block
//! (single-pass) in a [`Workspace`] sized from the memory budget, less `gemm`'s
//! packing buffers. [`CpuHead`] is the CPU's [`Head`]: inputs and gradients in host
//! memory. A frozen head's plan ([`HeadGrad::Frozen`]) holds no `dW` tile, `dZᵀ` or
//! second `dZ` packing, and its passes run no `dW`/`dbias` product.

use super::products::{DzPacks, Engine, Hidden, Weight};
use super::row_blocks::{RowBlock, live_row_blocks};
use super::single_pass::{DZ_T_PACK_ENTRIES, TILE_STATE_BYTES, single_pass};
use super::tiles::{
    LANES, Problem, Workspace, accumulate_tile, grad_tile, grad_tile_sparse, logits_tile,
    merge_tile_stats,
};
use crate::batch::{HeadShape, LinearInputs};
use crate::collective::Collective;
use crate::element::{DType, Element};
use crate::error::{Error, Result};
use crate::fused::{
    Bf16Products, Block, FusedOptions, FusedPasses, GradPart, GradsOf, Head, HeadGrad,
    LinearGradsMut, Plan, PlanLimits, RowGrad, SinglePassHooks, SparseGrads, TileVisitor,
    plan_blocks, tile_budget,
};
use crate::range::check_linear_grads;
use crate::rows::{PartialStats, RowInputs, RowStats};
use crate::weight_layout::WeightLayout;
use half::f16;
use std::ops::Range;

/// Packing buffers the `gemm` crate allocates per thread (measured: 2 MiB at the
/// target shape's tiles, `examples/gemm_scratch`). The budget covers them for one
/// thread per core of the machine, so they are reserved first; the plan then does not
/// depend on the thread pool's size (results are bitwise identical for any thread
/// count). A pool with more threads than cores adds this much per extra thread beyond
/// the budget.
pub const GEMM_SCRATCH_PER_THREAD: usize = 2 << 20;

/// The GEMM reserve of this machine: [`GEMM_SCRATCH_PER_THREAD`] per core, plus one for
/// the calling thread (which packs too when it is not a pool worker).
pub fn gemm_reserve_bytes() -> usize {
    GEMM_SCRATCH_PER_THREAD * (std::thread::available_parallelism().map_or(1, |c| c.get()) + 1)
}

/// Auto mode's rate model (see [`PlanLimits::half_rate_rows`]): a block of `k` rows
/// runs its products at about `k / (k + HALF_RATE_ROWS)` of the plain GEMM rate on this
/// CPU (fitted to docs/results/cpu_bench.md: 100-row single-pass blocks at 47-58%, 512-row
/// two-pass tiles at 81-95%).
const HALF_RATE_ROWS: f64 = 96.0;
/// Widest vocabulary tile of one GEMM call.
const VOCAB_TILE_MAX: usize = 2048;
/// Largest row block (beyond it GEMMs gain nothing and the workspace grows).
const MAX_BLOCK_ROWS: usize = 512;

/// The CPU's plan for a head of `n × h × v`: the largest blocks whose workspace fits
/// the budget less the GEMM reserve. `dtype`: the inputs' (bf16 and f16 are widened a
/// tile at a time; bf16 may instead be packed for bf16 products, `opts.bf16_products`
/// resolved for this CPU); `layout`: the weight's (a single-pass lane holds its tile's
/// `dW` for an `[H, V]` one, unless the head is frozen: `opts.head_grad`).
pub fn plan(
    n: usize,
    h: usize,
    v: usize,
    (dtype, layout): (DType, WeightLayout),
    opts: &FusedOptions,
    single_pass_allowed: bool,
) -> Result<Plan> {
    // Inputs that are widened a tile at a time (or packed): bf16 and f16.
    let narrow = dtype != DType::F32;
    let products = (dtype == DType::Bf16)
        .then(|| Engine::resolve(opts.bf16_products))
        .transpose()?;
    // bf16 products pack `dZ` for dH and for dW, 2 bytes an entry each (`gemm` packs
    // its own); a frozen head has no dW product.
    let has_dweight = opts.head_grad.has_dweight();
    let dz_pack_bytes = match (products == Some(Bf16Products::Avx512Bf16), has_dweight) {
        (false, _) => 0,
        (true, true) => 4,
        (true, false) => 2,
    };
    let reserve = gemm_reserve_bytes();
    let mut limits = PlanLimits {
        reserve_bytes: reserve,
        reserve_name: format!(
            "the GEMM packing reserve of {reserve} bytes ({GEMM_SCRATCH_PER_THREAD} per core and one more)"
        ),
        vocab_tile: v.min(VOCAB_TILE_MAX),
        max_block_rows: MAX_BLOCK_ROWS,
        min_single_pass_rows: 1,
        half_rate_rows: HALF_RATE_ROWS,
        has_compact: true,
        extra_name: if narrow {
            " and a widened weight tile"
        } else {
            ""
        },
    };
    // A widened bf16 weight tile (and a lane's `dW` tile of an `[H, V]` weight) holds
    // vocab_tile × H f32; keep it within a quarter of the budget.
    let lane_dweight = layout == WeightLayout::HiddenMajor && has_dweight;
    let budget = tile_budget(opts, &limits)?;
    while (narrow || lane_dweight)
        && limits.vocab_tile > 64
        && limits.vocab_tile * h * 4 > budget / 4
    {
        limits.vocab_tile /= 2;
    }
    let vocab_tile = limits.vocab_tile;
    // Widened f32 blocks, or packed bf16 ones of the same bytes (two packings at 2 bytes
    // an entry: the hidden block for its two products, a weight tile for the logits and
    // for dH).
    let widened = |rows: usize, tiles: usize| {
        if narrow {
            (tiles * vocab_tile + rows) * h * 4
        } else {
            0
        }
    };
    // A single-pass block: per row V logits (f32, or f16 exponentials compact) and a max
    // and softmax states per tile; per lane a `[rows, vocab_tile]` f32 tile, `gemm`'s
    // packed dZᵀ (and a widened weight tile) and its dH rows; the block's hidden rows
    // gathered where masked rows fall between live ones (f32, or bf16 for packing).
    let lane_tile = vocab_tile
        + match dz_pack_bytes {
            0 => vocab_tile.min(DZ_T_PACK_ENTRIES),
            bytes => vocab_tile * bytes / 4,
        };
    let lane_row = LANES * (lane_tile + h) * 4;
    let lane_dweight = if lane_dweight {
        LANES * vocab_tile * h * 4
    } else {
        0
    };
    let gathered_row = h * if dtype == DType::Bf16 { 2 } else { 4 };
    let whole_row =
        v.div_ceil(vocab_tile.max(1)) * (4 + TILE_STATE_BYTES) + lane_row + gathered_row;
    // Two-pass: the logits tile, a transposed `[rows, vocab_tile]` gradient tile for dW
    // (a trainable head's) and the packed `dZ`; the dH lanes, and gathered hidden rows
    // for blocks with gaps.
    let transposed = if has_dweight { 4 } else { 0 };
    let tile_row = vocab_tile * (4 + transposed + dz_pack_bytes) + LANES * h * 4 + gathered_row;
    let planned = plan_blocks(
        n,
        v,
        &limits,
        |rows, block| match block {
            Block::Tile => rows * tile_row + widened(rows, 1),
            Block::Whole => rows * (v * 4 + whole_row) + widened(rows, LANES) + lane_dweight,
            Block::Compact => rows * (v * 2 + whole_row) + widened(rows, LANES) + lane_dweight,
        },
        opts,
        single_pass_allowed,
    )?;
    Ok(Plan {
        bf16_products: products,
        ..planned
    })
}

/// One recomputed logits tile: the rows of `block` × vocabulary entries `vocab` (tile
/// `index` of the block's `tiles`), dense `[rows, vocab]` in `z`, with the hidden rows
/// and weight rows it came from.
struct Tile<'t> {
    block: &'t RowBlock,
    vocab: Range<usize>,
    index: usize,
    tiles: usize,
    z: &'t mut [f32],
    hidden: Hidden<'t>,
    weight: Weight<'t>,
    /// Scratch for the tile transposed and packed, and the block's dH lanes.
    scratch: (&'t mut Vec<f32>, &'t mut DzPacks, &'t mut Vec<f32>),
}

/// Forms every `[block_rows, vocab_tile]` logits tile of the rows of `blocks` in the
/// workspace and hands it to `each` (with its weight tile ready for dH, and its hidden
/// block for dW where the plan forms it, when `for_grads`).
fn for_each_tile<E: Element>(
    p: &Problem<E>,
    plan: &Plan,
    ws: &mut Workspace,
    (blocks, for_grads): (&[RowBlock], bool),
    mut each: impl FnMut(Tile),
) {
    let h = p.inputs.hidden_size;
    let (bias, engine) = (p.bias_f32(), p.engine);
    let threads = rayon::current_num_threads();
    let scratch = ws.prepare(plan.block_rows, plan.vocab_tile);
    for block in blocks.iter().filter(|b| !b.ids.is_empty()) {
        let nb = block.ids.len();
        let with_dweight = for_grads && plan.head_grad.has_dweight();
        let hid = (scratch.hidden).load_rows(engine, (p.inputs, with_dweight), block, threads);
        let tiles = p.inputs.vocab.div_ceil(plan.vocab_tile);
        for (index, vocab) in p.vocab_tiles(plan.vocab_tile).enumerate() {
            let w = scratch
                .weight
                .load(engine, (p.inputs, &vocab), (true, for_grads), threads);
            let z = &mut scratch.logits[..nb * vocab.len()];
            logits_tile(
                z,
                vocab.len(),
                hid,
                w,
                bias.as_ref().map(|b| &b[vocab.clone()]),
                p.rows.transform.softcap,
                (nb, h, vocab.len()),
                threads,
            );
            each(Tile {
                block,
                vocab,
                index,
                tiles,
                z,
                hidden: hid,
                weight: w,
                scratch: (
                    &mut scratch.dz_t,
                    &mut scratch.dz_pack,
                    &mut scratch.dh_lanes,
                ),
            });
        }
    }
}

/// Pass A over the vocabulary the problem holds: every live row's partial state (the
/// tiles hold live rows only), each tile shown to `visitor` after its statistics.
fn row_states<E: Element>(
    p: &Problem<E>,
    plan: &Plan,
    ws: &mut Workspace,
    mut visitor: Option<&mut dyn TileVisitor>,
) -> PartialStats {
    let mut out = PartialStats::empty(p.inputs.tokens, p.rows.transform.inv_temp);
    let blocks = p.live_row_blocks(plan.block_rows);
    for_each_tile(p, plan, ws, (&blocks, false), |t| {
        let ld = t.vocab.len();
        merge_tile_stats(&p.rows, t.z, ld, t.block, &t.vocab, &mut out);
        if let Some(v) = visitor.as_mut() {
            v.visit(&t.block.ids, t.vocab.clone(), t.z, ld);
        }
    });
    out
}

/// Pass B: recomputes the tiles of the rows with a gradient, turns them into `dZ` with
/// `grads` (one per row) and the `sparse` terms, and adds the LM head's gradients into
/// `out`.
fn accumulate_grads<E: Element>(
    p: &Problem<E>,
    plan: &Plan,
    (grads, sparse): (&[RowGrad], Option<&SparseGrads>),
    ws: &mut Workspace,
    out: &mut LinearGradsMut,
) {
    let t = &p.rows.transform;
    // A truncated support's membership compares recomputed logits with keys of pass A:
    // its rows are cut into pass A's blocks, so that every logit is bitwise the same.
    let blocks = if grads.iter().any(|g| g.support.is_some()) {
        p.live_row_blocks(plan.block_rows)
    } else {
        let with_gradient: Vec<bool> = (grads.iter().enumerate())
            .map(|(i, g)| !g.is_zero() || sparse.is_some_and(|s| !s.row_is_zero(i)))
            .collect();
        live_row_blocks(&with_gradient, plan.block_rows)
    };
    let mut block_grads = Vec::with_capacity(plan.block_rows);
    for_each_tile(p, plan, ws, (&blocks, true), |tile| {
        let ld = tile.vocab.len();
        block_grads.clear();
        block_grads.extend(tile.block.ids.iter().map(|&i| grads[i]));
        let (inv_temp, inv_cap) = (t.inv_temp, t.inv_cap());
        match sparse {
            None => grad_tile(tile.z, ld, &tile.vocab, &block_grads, inv_temp, inv_cap),
            Some(s) => {
                let rows = (&block_grads[..], &tile.block.ids[..], s);
                grad_tile_sparse(tile.z, ld, &tile.vocab, rows, inv_temp, inv_cap);
            }
        }
        accumulate_tile(
            out,
            (tile.z, ld, plan.head_grad),
            (tile.hidden, tile.weight),
            (tile.block, tile.index, tile.tiles),
            &tile.vocab,
            p.inputs,
            tile.scratch,
        );
    });
}

/// The CPU's [`FusedPasses`].
struct CpuPasses<'a, 'g, E> {
    problem: Problem<'a, E>,
    plan: Plan,
    ws: &'a mut Workspace,
    out: &'a mut LinearGradsMut<'g>,
}

impl<E: Element> FusedPasses for CpuPasses<'_, '_, E> {
    fn plan(&self) -> Plan {
        self.plan
    }

    fn row_states(&mut self) -> Result<PartialStats> {
        Ok(row_states(&self.problem, &self.plan, self.ws, None))
    }

    fn accumulate_grads(&mut self, grads: &[RowGrad]) -> Result<()> {
        let (p, plan) = (&self.problem, &self.plan);
        accumulate_grads(p, plan, (grads, None), self.ws, self.out);
        Ok(())
    }

    fn row_states_visiting(&mut self, visitor: &mut dyn TileVisitor) -> Result<PartialStats> {
        Ok(row_states(
            &self.problem,
            &self.plan,
            self.ws,
            Some(visitor),
        ))
    }

    fn visit_tiles(&mut self, visitor: &mut dyn TileVisitor) -> Result<()> {
        let (p, plan) = (&self.problem, &self.plan);
        let blocks = p.live_row_blocks(plan.block_rows);
        for_each_tile(p, plan, self.ws, (&blocks, false), |t| {
            visitor.visit(&t.block.ids, t.vocab.clone(), t.z, t.vocab.len());
        });
        Ok(())
    }

    fn accumulate_grads_sparse(&mut self, grads: &[RowGrad], sparse: &SparseGrads) -> Result<()> {
        let (p, plan) = (&self.problem, &self.plan);
        sparse.check(p.inputs.tokens, p.inputs.vocab)?;
        accumulate_grads(p, plan, (grads, Some(sparse)), self.ws, self.out);
        Ok(())
    }

    fn single_pass(&mut self, grads_of: &mut GradsOf) -> Result<Vec<RowStats>> {
        self.single_pass_hooked(grads_of, SinglePassHooks::default())
    }

    fn single_pass_hooked(
        &mut self,
        grads_of: &mut GradsOf,
        hooks: SinglePassHooks,
    ) -> Result<Vec<RowStats>> {
        let (p, plan) = (&self.problem, &self.plan);
        if let Some(sparse) = hooks.sparse {
            sparse.check(p.inputs.tokens, p.inputs.vocab)?;
            if p.rows.transform.softcap.is_some() {
                return Err(Error::InvalidArgument {
                    arg: "softcap",
                    reason: "a single pass takes sparse terms without a soft-cap only; \
                             run two-pass"
                        .into(),
                });
            }
        }
        Ok(if plan.compact {
            single_pass::<E, f16>(p, plan, (grads_of, hooks), self.ws, self.out)
        } else {
            single_pass::<E, f32>(p, plan, (grads_of, hooks), self.ws, self.out)
        })
    }
}

/// An LM head in host memory with its gradients (added into, in f32) and a workspace
/// kept across steps, as a training loop does (fresh memory costs page faults).
pub struct CpuHead<'a, E> {
    /// Hidden states, weight, bias.
    pub inputs: &'a LinearInputs<'a, E>,
    /// Tiles and widened blocks.
    pub ws: &'a mut Workspace,
    /// Where the gradients are added.
    pub grads: LinearGradsMut<'a>,
}

impl<E: Element> Head for CpuHead<'_, E> {
    fn shape(&self) -> HeadShape {
        self.inputs.shape()
    }

    fn validate(&self, grads: Option<HeadGrad>) -> Result<()> {
        self.inputs.validate()?;
        match grads {
            Some(head_grad) => self.grads.check(self.inputs, head_grad),
            None => Ok(()),
        }
    }

    fn check_grads(&self, seq_len: usize) -> Result<()> {
        let g = &self.grads;
        let h = self.inputs.hidden_size;
        let dweight = (&g.dweight[..], self.inputs.layout);
        check_linear_grads(g.dhidden, dweight, g.dbias.as_deref(), h, seq_len)
    }

    fn plan(&self, opts: &FusedOptions, single_pass_allowed: bool) -> Result<Plan> {
        let s = self.shape();
        plan(
            s.tokens,
            s.hidden_size,
            s.vocab,
            (E::DTYPE, self.inputs.layout),
            opts,
            single_pass_allowed,
        )
    }

    fn passes<'s>(
        &'s mut self,
        rows: RowInputs<'s>,
        plan: Plan,
    ) -> Result<Box<dyn FusedPasses + 's>> {
        Ok(Box::new(CpuPasses {
            problem: Problem {
                inputs: self.inputs,
                rows,
                engine: Engine::of(&plan)?,
            },
            plan,
            ws: &mut *self.ws,
            out: &mut self.grads,
        }))
    }

    fn all_reduce(&mut self, comm: &dyn Collective, part: GradPart) -> Result<()> {
        self.grads.all_reduce(comm, part)
    }
}

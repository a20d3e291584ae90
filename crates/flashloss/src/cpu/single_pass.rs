//! The single-pass block of the fused LM-head step on the CPU. Per block of rows, each
//! vocabulary tile's logits `z` are formed once, merged into the rows' online-softmax
//! states and kept: in f32 as the logits themselves, or in a compact block as
//! `e = exp((z - μ)/T)` in f16 with the row's tile max `μ` (2 bytes a logit instead of
//! 4; `e ≤ 1` is rounded to a relative 2^-11). Once the block's `lse` is known, each
//! tile comes back as `dZᵀ` `[cols, rows]`: an f32 block's through [`grad_row`], the
//! two-pass formula on the same logits (so a row's `dZ`, and with the lanes of
//! [`LANES`] its dH, are the two-pass plan's bits); a compact block's with
//! `p_j = e_j·exp((μ - max)/T - log_sum)`. Then `dH += dZ·W`, `dW += dZᵀ·H` and
//! `dbias += Σ_rows dZ`. The block is kept tile by tile (tile `k`: `[rows, cols_k]` at
//! `rows · vocab_start_k`).
//!
//! The tiles are dealt to [`LANES`] lanes, tile `k` to lane `k mod LANES`; each lane has
//! its own f32 tile and `1/LANES` of the threads for its products. On two cores, two
//! single-threaded products side by side ran the logits and dH tiles 3% and 11% faster
//! than one product on both cores (`examples/tile_gemm_rate`). Each lane adds into its
//! own dH rows, which are added to dH after the block in lane order, and the tiles' row
//! states merge in tile order: the result does not depend on the thread count, and a
//! row's numbers are the two-pass plan's.
//!
//! A block holds live rows only ([`super::row_blocks::live_row_blocks`]): a masked or ignored
//! row has no statistics and a zero gradient, so its hidden state joins none of the
//! three products (a padded batch pays for the rows it trains on).
//!
//! A `[V, H]` weight's `dW` tile is a block of its rows, which a lane adds into directly;
//! an `[H, V]` weight's is a block of its columns, interleaved with the other lane's:
//! the lane forms `Hᵀ·dZ` `[h, cols]` in its own buffer and adds its rows into the
//! column block's row segments. A frozen head (`Plan::head_grad`) has neither: its
//! tiles give `dH` alone (4NHV FLOPs a step instead of 6NHV).
//!
//! The pass hooks ([`SinglePassHooks`]): a visitor sees each lane's logits tile as it is
//! formed (the lanes take turns under a lock), and each sparse term `(id, c)` of a row
//! adds `c` at `(id - vocab.start, r)` of the `dZᵀ` tile holding `id` (no soft-cap: the
//! slope is 1).

use super::matmul::MatRef;
use super::products::{self, DweightTile};
use super::simd;
use super::tiles::{
    LANES, Lane, Problem, Workspace, add_column_sums, add_lanes, grad_row, logits_tile,
    resize_fresh,
};
use crate::element::Element;
use crate::fused::{GradsOf, LinearGradsMut, Plan, RowGrad, SinglePassHooks, SparseGrads};
use crate::rows::{OnlineSoftmax, PartialStats, RowInputs, RowStats};
use crate::weight_layout::WeightLayout;
use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;
use std::ops::Range;
use std::sync::{Mutex, PoisonError};

/// Bytes per block row and tile of a tile's softmax states, kept apart until they merge
/// in tile order ([`PartialStats`]: a state, a target logit, a sum).
pub const TILE_STATE_BYTES: usize = std::mem::size_of::<OnlineSoftmax>() + 4 + 8;

/// Vocabulary entries of `dZᵀ` per block row that `gemm` packs for a lane's dH
/// product, beyond its per-thread buffer: its `kc` of at most 512 (measured: 1 MiB at
/// 512 rows, `examples/gemm_scratch`).
pub const DZ_T_PACK_ENTRIES: usize = 512;

/// Vocabulary entries per task when a block's tile becomes `dZᵀ`, and rows transposed
/// together (a 16 KiB group of row segments, in L1).
const STRIP: usize = 256;
const ROW_GROUP: usize = 16;

/// What a single-pass block keeps of each logit: the logit `z` in f32, or its
/// exponential `e` in f16 (compact).
pub(crate) trait Stored: Copy + Default + Send + Sync {
    /// Whether the block keeps the logits (else the exponentials).
    const LOGITS: bool;
    /// `dst = src` rounded to this type.
    fn store(src: &[f32], dst: &mut [Self]);
    /// `dst = src` widened to f32.
    fn load(src: &[Self], dst: &mut [f32]);
    /// The workspace's block of this type: its f32 logits buffer or its f16 block.
    fn block<'w>(f32s: &'w mut Vec<f32>, f16s: &'w mut Vec<f16>) -> &'w mut Vec<Self>;
}

impl Stored for f32 {
    const LOGITS: bool = true;
    fn store(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn load(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn block<'w>(f32s: &'w mut Vec<f32>, _: &'w mut Vec<f16>) -> &'w mut Vec<f32> {
        f32s
    }
}

impl Stored for f16 {
    const LOGITS: bool = false;
    fn store(src: &[f32], dst: &mut [f16]) {
        dst.convert_from_f32_slice(src);
    }
    fn load(src: &[f16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn block<'w>(_: &'w mut Vec<f32>, f16s: &'w mut Vec<f16>) -> &'w mut Vec<f16> {
        f16s
    }
}

/// The single pass: per row block, every tile's logits (shown to the hooks' visitor),
/// the rows' statistics, then `grads_of(rows, stats)` gives the block's [`RowGrad`]s and
/// the gradients (with the hooks' sparse terms) are added into `out` from the block of
/// `S`.
pub(crate) fn single_pass<E: Element, S: Stored>(
    problem: &Problem<E>,
    plan: &Plan,
    (grads_of, hooks): (&mut GradsOf, SinglePassHooks),
    ws: &mut Workspace,
    out: &mut LinearGradsMut,
) -> Vec<RowStats> {
    let visitor = hooks.visitor.map(Mutex::new);
    let sparse = hooks.sparse;
    let (inputs, p) = (problem.inputs, &problem.rows);
    let (n, h, v) = (inputs.tokens, inputs.hidden_size, inputs.vocab);
    let (vt, t) = (plan.vocab_tile, &p.transform);
    let tiles: Vec<Range<usize>> = problem.vocab_tiles(vt).collect();
    let bias = problem.bias_f32();
    let engine = problem.engine;
    let threads = (rayon::current_num_threads() / LANES).max(1);
    let with_dweight = plan.head_grad.has_dweight();
    ws.prepare_lanes(
        plan.block_rows,
        (tiles.len(), vt),
        (h, with_dweight.then_some(inputs.layout)),
        LANES,
    );
    let Workspace {
        logits,
        hidden,
        exps,
        tile_max,
        lanes,
        ..
    } = ws;
    let exps_block = S::block(logits, exps);
    resize_fresh(exps_block, plan.block_rows * v);
    let mut stats = vec![RowStats::default(); n];
    for block in problem.live_row_blocks(plan.block_rows) {
        let (ids, nb) = (&block.ids[..], block.ids.len());
        if nb == 0 {
            grads_of(block.span, &stats);
            continue;
        }
        let all_threads = rayon::current_num_threads();
        let hid = hidden.load_rows(engine, (inputs, with_dweight), &block, all_threads);
        let exps = deal(
            &mut exps_block[..nb * v],
            tiles.iter().map(|c| nb * c.len()),
        );
        let maxima = deal(&mut tile_max[..nb * tiles.len()], tiles.iter().map(|_| nb));
        // Each tile's states apart, merged in tile order as the two-pass plan merges them.
        let parts: Vec<Vec<PartialStats>> = (lanes.par_iter_mut().zip(exps).zip(maxima))
            .enumerate()
            .map(|(l, ((lane, exps), maxima))| {
                let mut parts = Vec::new();
                let lane_tiles = tiles.iter().skip(l).step_by(LANES);
                for ((vocab, e), mu) in lane_tiles.zip(exps).zip(maxima) {
                    let mut part = PartialStats::empty(nb, t.inv_temp);
                    let cols = vocab.len();
                    let for_logits = (true, false);
                    let w = (lane.weight).load(engine, (inputs, vocab), for_logits, threads);
                    let z = &mut lane.tile[..nb * cols];
                    let b = bias.as_ref().map(|b| &b[vocab.clone()]);
                    logits_tile(z, cols, hid, w, b, t.softcap, (nb, h, cols), threads);
                    if let Some(v) = &visitor {
                        let mut v = v.lock().unwrap_or_else(PoisonError::into_inner);
                        v.visit(ids, vocab.clone(), z, cols);
                    }
                    store_tile(p, z, ids, vocab, e, mu, &mut part);
                    parts.push(part);
                }
                parts
            })
            .collect();
        let mut part = PartialStats::empty(nb, t.inv_temp);
        (0..tiles.len()).for_each(|k| part.merge(&parts[k % LANES][k / LANES]));
        for (r, &i) in ids.iter().enumerate() {
            stats[i] = part.finish_row(r, i, p, v);
        }
        let span_grads = grads_of(block.span.clone(), &stats);
        let grads: Vec<RowGrad> = ids
            .iter()
            .map(|&i| span_grads[i - block.span.start])
            .collect();
        let no_sparse = |s: &SparseGrads| ids.iter().all(|&i| s.row_is_zero(i));
        if grads.iter().all(RowGrad::is_zero) && sparse.is_none_or(no_sparse) {
            continue;
        }
        let dweight = match with_dweight {
            true => deal_dweight(&mut out.dweight[..], inputs.layout, &tiles, h),
            false => (0..LANES).map(|_| Vec::new()).collect(),
        };
        let mut dbias = match out.dbias.as_deref_mut() {
            Some(db) => deal(db, tiles.iter().map(|c| c.len())),
            None => (0..LANES).map(|_| Vec::new()).collect(),
        };
        let (exps, maxima) = (&exps_block[..nb * v], &tile_max[..nb * tiles.len()]);
        (lanes.par_iter_mut().zip(dweight).zip(dbias.par_iter_mut()))
            .enumerate()
            .for_each(|(l, ((lane, dweight), dbias))| {
                let Lane {
                    tile,
                    weight,
                    dz_pack,
                    dhidden,
                    dweight: dw_cols,
                } = lane;
                let dh = &mut dhidden[..nb * h];
                dh.fill(0.0);
                let mut dbias = dbias.iter_mut();
                let mut dweight = dweight.into_iter();
                let lane_tiles = tiles.iter().enumerate().skip(l).step_by(LANES);
                for (k, vocab) in lane_tiles {
                    let cols = vocab.len();
                    let dz_t = &mut tile[..cols * nb];
                    let e = &exps[nb * vocab.start..nb * vocab.end];
                    let mu = &maxima[k * nb..(k + 1) * nb];
                    grad_tile_t(dz_t, e, mu, vocab, &grads, t.inv_temp, t.inv_cap());
                    if let Some(s) = sparse {
                        add_sparse_t(dz_t, vocab, ids, s);
                    }
                    let for_dhidden = (false, true);
                    let w = weight.load(engine, (inputs, vocab), for_dhidden, threads);
                    let dz_t = MatRef::row_major(&dz_t[..], cols, nb);
                    products::add_dhidden(dh, h, dz_t.t(), w, dz_pack, threads);
                    let Some(mut dw) = dweight.next() else {
                        continue; // a frozen head: dH alone
                    };
                    let layout = inputs.layout;
                    match layout {
                        WeightLayout::VocabMajor => {
                            let (data, ld) = (&mut *dw[0], h);
                            let dw = DweightTile {
                                data,
                                ld,
                                h,
                                layout,
                            };
                            products::add_dweight(dw, dz_t, hid, dz_pack, threads);
                        }
                        WeightLayout::HiddenMajor => {
                            let data = &mut dw_cols[..h * cols];
                            data.fill(0.0);
                            let dw_tile = DweightTile {
                                data,
                                ld: cols,
                                h,
                                layout,
                            };
                            products::add_dweight(dw_tile, dz_t, hid, dz_pack, threads);
                            (dw.par_iter_mut().zip(dw_cols.par_chunks(cols)))
                                .for_each(|(d, x)| d.iter_mut().zip(x).for_each(|(d, x)| *d += x));
                        }
                    }
                    if let Some(db) = dbias.next() {
                        add_column_sums(db, dz_t.data, nb);
                    }
                }
            });
        let lane_dh: Vec<&[f32]> = lanes.iter().map(|l| &l.dhidden[..nb * h]).collect();
        add_lanes(block.rows_of(out.dhidden, h), &lane_dh, h);
    }
    stats
}

/// `buf` cut into consecutive pieces of `lens` elements.
fn split<T>(mut buf: &mut [T], lens: impl Iterator<Item = usize>) -> Vec<&mut [T]> {
    lens.map(|len| {
        let (piece, rest) = std::mem::take(&mut buf).split_at_mut(len);
        buf = rest;
        piece
    })
    .collect()
}

/// Splits `buf` into consecutive pieces of `lens` elements and deals piece `k` to lane
/// `k mod LANES`.
fn deal<T>(buf: &mut [T], lens: impl Iterator<Item = usize>) -> Vec<Vec<&mut [T]>> {
    let mut lanes: Vec<Vec<&mut [T]>> = (0..LANES).map(|_| Vec::new()).collect();
    for (k, piece) in split(buf, lens).into_iter().enumerate() {
        lanes[k % LANES].push(piece);
    }
    lanes
}

/// `dW` (`h` wide, in `layout`) cut by vocabulary tile and dealt as [`deal`] deals the
/// tiles: per lane, per tile, its rows (one piece of `[V, H]`) or its columns' row
/// segments (`h` pieces of `[H, V]`).
fn deal_dweight<'a>(
    dw: &'a mut [f32],
    layout: WeightLayout,
    tiles: &[Range<usize>],
    h: usize,
) -> Vec<Vec<Vec<&'a mut [f32]>>> {
    let mut lanes: Vec<Vec<Vec<&mut [f32]>>> = (0..LANES)
        .map(|l| {
            tiles
                .iter()
                .skip(l)
                .step_by(LANES)
                .map(|_| Vec::new())
                .collect()
        })
        .collect();
    let pieces: Vec<(usize, &mut [f32])> = match layout {
        WeightLayout::VocabMajor => {
            let pieces = split(dw, tiles.iter().map(|c| c.len() * h));
            pieces.into_iter().enumerate().collect()
        }
        WeightLayout::HiddenMajor => {
            let v = tiles.last().map_or(0, |c| c.end);
            (dw.chunks_mut(v.max(1)))
                .flat_map(|row| {
                    split(row, tiles.iter().map(Range::len))
                        .into_iter()
                        .enumerate()
                })
                .collect()
        }
    };
    for (k, piece) in pieces {
        lanes[k % LANES][k / LANES].push(piece);
    }
    lanes
}

/// Merges a `[rows, cols]` logits tile `z` of the live rows `ids` (vocabulary entries
/// `vocab`) into their states `part` and stores it as the block's tile (`[rows, cols]`):
/// `z`, or `e = exp((z - μ)/T)` ([`Stored::LOGITS`]), and the row max `μ` in `tile_max`
/// (a row of `-inf` logits keeps 0).
fn store_tile<S: Stored>(
    p: &RowInputs,
    z: &[f32],
    ids: &[usize],
    vocab: &Range<usize>,
    exps: &mut [S],
    tile_max: &mut [f32],
    part: &mut PartialStats,
) {
    let cols = vocab.len();
    let inv_temp = p.transform.inv_temp;
    let states = part.states.par_iter_mut().zip(&mut part.target_logits);
    (z.par_chunks(cols).zip(exps.par_chunks_mut(cols)))
        .zip(tile_max.par_iter_mut().zip(states))
        .zip(part.sums.par_iter_mut())
        .enumerate()
        .for_each_init(
            || vec![0.0f32; cols],
            |buf, (r, (((row, e), (mu, (state, target_logit))), sum))| {
                *mu = simd::max(row);
                if p.transform.mean_logit {
                    *sum += simd::sum(row);
                }
                let y = p.targets[ids[r]];
                if y >= 0 && vocab.contains(&(y as usize)) {
                    *target_logit = row[y as usize - vocab.start];
                }
                if *mu == f32::NEG_INFINITY {
                    e.fill(S::default());
                    return;
                }
                // An f32 block keeps the logits and sums as the two-pass plan's tiles do
                // (`exp_sums`); a compact one keeps the exponentials it sums.
                let (s, u, q) = if S::LOGITS {
                    S::store(row, e);
                    simd::exp_sums(row, *mu, inv_temp)
                } else {
                    let sums = simd::exp_sums_store(row, buf, *mu, inv_temp);
                    S::store(buf, e);
                    sums
                };
                state.merge(OnlineSoftmax {
                    inv_temp,
                    max: *mu,
                    sum: s,
                    weighted: u,
                    sum2: q,
                });
            },
        );
}

/// Turns a block's tile (`exps` `[rows, cols]`, maxima `tile_max`, vocabulary entries
/// `vocab`) into `dZᵀ` `[cols, rows]` in `dz_t`. Strips of [`STRIP`] entries run in
/// parallel; each forms [`ROW_GROUP`] rows' segments at a time and writes them
/// transposed, a run of `ROW_GROUP` floats per entry.
fn grad_tile_t<S: Stored>(
    dz_t: &mut [f32],
    exps: &[S],
    tile_max: &[f32],
    vocab: &Range<usize>,
    grads: &[RowGrad],
    inv_temp: f32,
    inv_cap: f32,
) {
    let (rows, cols) = (grads.len(), vocab.len());
    dz_t.par_chunks_mut(STRIP * rows).enumerate().for_each_init(
        || vec![0.0f32; ROW_GROUP * STRIP],
        |buf, (s, out)| {
            let j0 = s * STRIP;
            let width = out.len() / rows;
            let part = vocab.start + j0..vocab.start + j0 + width;
            for r0 in (0..rows).step_by(ROW_GROUP) {
                let group = ROW_GROUP.min(rows - r0);
                for (rr, seg) in buf.chunks_mut(width).take(group).enumerate() {
                    let r = r0 + rr;
                    let e = &exps[r * cols + j0..][..width];
                    grad_segment(seg, e, tile_max[r], &part, &grads[r], inv_temp, inv_cap);
                }
                for j in 0..width {
                    let dst = &mut out[j * rows + r0..][..group];
                    for (rr, d) in dst.iter_mut().enumerate() {
                        *d = buf[rr * width + j];
                    }
                }
            }
        },
    );
}

/// Adds the `sparse` terms of the block's rows `ids` that fall in `vocab` into its
/// `dZᵀ` tile `[cols, rows]`: `dz_t[id - vocab.start, r] += c` (slope 1: no soft-cap).
fn add_sparse_t(dz_t: &mut [f32], vocab: &Range<usize>, ids: &[usize], sparse: &SparseGrads) {
    let nb = ids.len();
    for (r, &i) in ids.iter().enumerate() {
        let (row_ids, coefs) = sparse.row(i);
        for (&id, &c) in row_ids.iter().zip(coefs) {
            if id >= 0 && vocab.contains(&(id as usize)) {
                dz_t[(id as usize - vocab.start) * nb + r] += c;
            }
        }
    }
}

/// One row's `dZ` over vocabulary entries `part` from its stored logits (through
/// [`grad_row`]), or from its stored exponentials `e` and tile max `mu`:
/// `p_j = e_j·exp((μ - max)/T - log_sum)`; compact rows with an entropy term or a
/// soft-cap get their logits back as `z_j = μ + ln(e_j)·T` and go through [`grad_row`].
fn grad_segment<S: Stored>(
    row: &mut [f32],
    e: &[S],
    mu: f32,
    part: &Range<usize>,
    g: &RowGrad,
    inv_temp: f32,
    inv_cap: f32,
) {
    if g.is_zero() || g.stats.max == f32::NEG_INFINITY {
        row.fill(0.0);
        return;
    }
    S::load(e, row);
    if S::LOGITS {
        return grad_row(row, part, g, inv_temp, inv_cap);
    }
    if g.coef_h == 0.0 && inv_cap == 0.0 {
        let c = simd::exp((mu - g.stats.max) * inv_temp - g.stats.log_sum);
        simd::scale_add(row, g.coef_p * c, g.coef_uniform);
        if part.contains(&g.target) {
            row[g.target - part.start] += g.coef_target;
        }
        return;
    }
    let temp = 1.0 / inv_temp;
    row.iter_mut().for_each(|x| {
        // An underflowed exponential (p = 0) gets a logit below exp's range.
        *x = mu + if *x > 0.0 { x.ln() } else { -104.0 } * temp
    });
    grad_row(row, part, g, inv_temp, inv_cap);
}

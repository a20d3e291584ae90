//! The CPU's tile kernels of the fused LM-head passes: a logits tile
//! `z = softcap(H[rows]·W[vocab]ᵀ + bias)` through `gemm`, its softmax states merged
//! into each row's, the tile turned into `dZ` in place, and its products
//! `dH += dZ·W`, `dW += dZᵀ·H`, `dbias += Σ_rows dZ`, the products on the plan's
//! engine (`super::products`: bf16 inputs widened one block or tile at a time into the
//! [`Workspace`], never whole, or packed for `vdpbf16ps`).

use super::matmul::{MatRef, matmul};
use super::online_softmax::tile_state;
use super::products::{
    self, DweightTile, DzPacks, Engine, Hidden, HiddenBlock, Weight, WeightTile,
};
use super::row_blocks::{RowBlock, live_row_blocks};
use super::simd;
use super::support_grad::support_grad_row;
use crate::batch::LinearInputs;
use crate::element::Element;
use crate::fused::{HeadGrad, LinearGradsMut, RowGrad, SparseGrads};
use crate::rows::{PartialStats, RowInputs};
use crate::weight_layout::WeightLayout;
use rayon::prelude::*;
use std::ops::Range;

/// Inputs of a fused LM-head pass on the CPU, and the engine of its products.
pub(crate) struct Problem<'a, E> {
    pub(crate) inputs: &'a LinearInputs<'a, E>,
    pub(crate) rows: RowInputs<'a>,
    pub(crate) engine: Engine,
}

impl<E: Element> Problem<'_, E> {
    /// The bias in f32 (`None` without one).
    pub(crate) fn bias_f32(&self) -> Option<Vec<f32>> {
        self.inputs
            .bias
            .map(|b| b.iter().map(|x| x.to_f32()).collect())
    }

    /// The vocabulary tiles of `vt` entries (the last may be narrower).
    pub(crate) fn vocab_tiles(&self, vt: usize) -> impl Iterator<Item = Range<usize>> + use<E> {
        let v = self.inputs.vocab;
        (0..v).step_by(vt).map(move |s| s..(s + vt).min(v))
    }

    /// Blocks of up to `nb` live rows ([`live_row_blocks`]).
    pub(crate) fn live_row_blocks(&self, nb: usize) -> Vec<RowBlock> {
        live_row_blocks(&self.rows.live[..self.inputs.tokens], nb)
    }
}

/// Lanes of a block's dH: tile `k` of a block adds its `dZ·W` into lane `k mod LANES`
/// (zero at the block's start), and the lanes are added into the block's dH rows in
/// lane order. Both passes sum so (a single-pass block's lanes also run side by side,
/// `super::single_pass`), so a row's dH is the same bits in either plan and in any
/// block: `dH_in + L_0 + L_1`, each `L_l` its tiles' products in tile order.
pub const LANES: usize = 2;

/// Reusable workspace of the fused LM-head kernels (logit tiles, widened or packed bf16
/// blocks). Keeping one across steps, as a training loop does, saves the page faults of
/// fresh memory on every call; its size is what the plan chose within the budget.
#[derive(Debug, Default)]
pub struct Workspace {
    pub(crate) logits: Vec<f32>,
    pub(crate) hidden: HiddenBlock,
    pub(crate) weight: WeightTile,
    /// A packed `dZ` (bf16 products).
    pub(crate) dz_pack: DzPacks,
    /// A compact single-pass block (f16; an f32 block is kept in `logits`).
    pub(crate) exps: Vec<half::f16>,
    /// The per-(tile, row) maxima `μ_tile` of a single-pass block, `[tiles, rows]`.
    pub(crate) tile_max: Vec<f32>,
    /// A single-pass block's lanes.
    pub(crate) lanes: Vec<Lane>,
    /// A gradient tile transposed, `dZᵀ` `[vocab_tile, rows]`, for the dW product.
    pub(crate) dz_t: Vec<f32>,
    /// A two-pass block's dH lanes ([`LANES`] × `[rows, h]`).
    pub(crate) dh_lanes: Vec<f32>,
}

/// One lane of a single-pass block (`super::single_pass`): its f32 tile (logits `[rows, cols]`,
/// then `dZᵀ` `[cols, rows]`), its weight tile (widened or packed), its packed `dZ`, the
/// dH rows it adds into and, for an `[H, V]` weight, its tile's `dW` `[h, cols]` (added
/// into dW's columns, which the lanes' tiles interleave).
#[derive(Debug, Default)]
pub(crate) struct Lane {
    pub(crate) tile: Vec<f32>,
    pub(crate) weight: WeightTile,
    pub(crate) dz_pack: DzPacks,
    pub(crate) dhidden: Vec<f32>,
    pub(crate) dweight: Vec<f32>,
}

/// Sizes `buf` to `len` zeros when its length differs (a fresh buffer, so that a
/// smaller plan does not keep the larger capacity).
pub(crate) fn resize_fresh<T: Clone + Default>(buf: &mut Vec<T>, len: usize) {
    if buf.len() != len {
        *buf = Vec::new();
        buf.resize(len, T::default());
    }
}

impl Workspace {
    /// An empty workspace (buffers grow on first use).
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        let lanes: usize = self
            .lanes
            .iter()
            .map(|l| {
                4 * (l.tile.capacity() + l.dhidden.capacity() + l.dweight.capacity())
                    + l.weight.bytes()
                    + l.dz_pack.bytes()
            })
            .sum();
        4 * (self.logits.capacity() + self.tile_max.capacity())
            + 4 * (self.dz_t.capacity() + self.dh_lanes.capacity())
            + self.hidden.bytes()
            + self.weight.bytes()
            + self.dz_pack.bytes()
            + lanes
            + 2 * self.exps.capacity()
    }

    /// Sizes the logits buffer for `rows × cols`.
    pub(crate) fn prepare(&mut self, rows: usize, cols: usize) -> &mut Self {
        resize_fresh(&mut self.logits, rows * cols);
        self
    }

    /// Sizes the tile maxima and lanes of a single-pass block of `rows` rows in `tiles`
    /// tiles of up to `vocab_tile` entries, with `lanes` lanes, for hidden size `h` (and
    /// the layout of the dW it forms: none for a frozen head).
    pub(crate) fn prepare_lanes(
        &mut self,
        rows: usize,
        (tiles, vocab_tile): (usize, usize),
        (h, dweight): (usize, Option<WeightLayout>),
        lanes: usize,
    ) {
        resize_fresh(&mut self.tile_max, rows * tiles);
        self.lanes.resize_with(lanes, Lane::default);
        let dweight = match dweight {
            Some(WeightLayout::HiddenMajor) => h * vocab_tile,
            Some(WeightLayout::VocabMajor) | None => 0,
        };
        for lane in self.lanes.iter_mut() {
            resize_fresh(&mut lane.tile, rows * vocab_tile);
            resize_fresh(&mut lane.dhidden, rows * h);
            resize_fresh(&mut lane.dweight, dweight);
        }
    }
}

/// `z[rows, 0..vt]` (row stride `ld`) = `softcap(hidden[rows] · weight[vocab]ᵀ + bias[vocab])`,
/// the product on at most `threads` threads.
#[allow(clippy::too_many_arguments)]
pub(crate) fn logits_tile(
    z: &mut [f32],
    ld: usize,
    hidden: Hidden,
    weight: Weight,
    bias: Option<&[f32]>,
    softcap: Option<f32>,
    (rows, h, vt): (usize, usize, usize),
    threads: usize,
) {
    products::logits(z, ld, hidden, weight, (rows, h, vt), threads);
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

/// Merges the statistics of a `[rows, cols]` tile (row stride `ld`) of the live rows of
/// `block`, whose columns are vocabulary entries `vocab`, into their entries of `out`
/// (every row's), captures target logits that fall in it and, if the rows want mean
/// logits, adds each row's sum.
pub(crate) fn merge_tile_stats(
    p: &RowInputs,
    z: &[f32],
    ld: usize,
    block: &RowBlock,
    vocab: &Range<usize>,
    out: &mut PartialStats,
) {
    let cols = vocab.len();
    let states = block.entries_of(&mut out.states);
    let target_logits = block.entries_of(&mut out.target_logits);
    let sums = block.entries_of(&mut out.sums);
    (z.par_chunks(ld).zip(&block.ids))
        .zip(states)
        .zip(target_logits)
        .zip(sums)
        .for_each(|((((row, &i), state), target_logit), sum)| {
            let row = &row[..cols];
            state.merge(tile_state(row, p.transform.inv_temp));
            if p.transform.mean_logit {
                *sum += simd::sum(row);
            }
            let y = p.targets[i];
            if y >= 0 && vocab.contains(&(y as usize)) {
                *target_logit = row[y as usize - vocab.start];
            }
        });
}

/// Turns a `[rows, cols]` tile of logits (row stride `ld`, vocabulary entries `vocab`)
/// into `dZ` in place; `inv_cap` is `1/cap` of the soft-cap the logits went through
/// (0: none).
pub(crate) fn grad_tile(
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
        .for_each(|(row, g)| grad_row(&mut row[..cols], vocab, g, inv_temp, inv_cap));
}

/// [`grad_tile`] with sparse terms: `rows` are the tile rows' [`RowGrad`]s, their global
/// ids and the [`SparseGrads`] of every row; each id in `vocab` adds
/// `coef·slope(z_j)` at its entry (the slope read before the tile becomes `dZ`).
pub(crate) fn grad_tile_sparse(
    z: &mut [f32],
    ld: usize,
    vocab: &Range<usize>,
    (grads, ids, sparse): (&[RowGrad], &[usize], &SparseGrads),
    inv_temp: f32,
    inv_cap: f32,
) {
    let cols = vocab.len();
    let (lo, hi) = (vocab.start as i64, vocab.end as i64);
    (z.par_chunks_mut(ld)
        .zip(grads.par_iter())
        .zip(ids.par_iter()))
    .for_each_init(Vec::new, |adds: &mut Vec<(usize, f32)>, ((row, g), &i)| {
        let row = &mut row[..cols];
        let (row_ids, coefs) = sparse.row(i);
        adds.clear();
        for (&id, &c) in row_ids.iter().zip(coefs) {
            if (lo..hi).contains(&id) && c != 0.0 {
                let j = (id - lo) as usize;
                let slope = if inv_cap == 0.0 {
                    1.0
                } else {
                    simd::softcap_slope(row[j], inv_cap)
                };
                adds.push((j, c * slope));
            }
        }
        grad_row(row, vocab, g, inv_temp, inv_cap);
        adds.iter().for_each(|&(j, d)| row[j] += d);
    });
}

/// [`grad_tile`] for one row's logits `row` at vocabulary entries `vocab`.
pub(crate) fn grad_row(
    row: &mut [f32],
    vocab: &Range<usize>,
    g: &RowGrad,
    inv_temp: f32,
    inv_cap: f32,
) {
    if g.is_zero() {
        row.fill(0.0);
        return;
    }
    let target = vocab.contains(&g.target).then(|| g.target - vocab.start);
    let target_slope = target.map(|t| simd::softcap_slope(row[t], inv_cap));
    let params = simd::SoftmaxGrad {
        max: g.stats.max,
        scale: inv_temp,
        log_sum: g.stats.log_sum,
        coef_p: g.coef_p,
        coef_h: g.coef_h,
        entropy: g.stats.entropy,
        uniform: g.coef_uniform,
        inv_cap,
    };
    match &g.support {
        Some(term) => support_grad_row(row, vocab.start, (&params, term)),
        None => simd::softmax_grad(row, &params),
    }
    if let (Some(t), Some(slope)) = (target, target_slope) {
        row[t] += g.coef_target * slope;
    }
}

/// `dH[block] += dZ·W[vocab]` through the block's lanes ([`LANES`]), and for a trainable
/// head (`head_grad`) `dW[vocab] += dZᵀ·H[block]`, `dbias[vocab] += Σ_rows dZ`, for the
/// gradient tile `dz` of the rows of `block` (`[rows, cols]`, row stride `ld`) of
/// `inputs`' head; `tile` is its index among the block's `tiles`. `dz_t`, `dz_pack` and
/// `dh_lanes` are scratch.
pub(crate) fn accumulate_tile<E>(
    grads: &mut LinearGradsMut,
    (dz, ld, head_grad): (&[f32], usize, HeadGrad),
    (hidden, weight): (Hidden, Weight),
    (block, tile, tiles): (&RowBlock, usize, usize),
    vocab: &Range<usize>,
    inputs: &LinearInputs<E>,
    (dz_t, dz_pack, dh_lanes): (&mut Vec<f32>, &mut DzPacks, &mut Vec<f32>),
) {
    let (nb, vt, h) = (block.ids.len(), vocab.len(), inputs.hidden_size);
    if nb == 0 || vt == 0 {
        return;
    }
    let dz_view = MatRef {
        data: dz,
        rows: nb,
        cols: vt,
        row_stride: ld,
        col_stride: 1,
    };
    let threads = rayon::current_num_threads();
    if tile == 0 {
        dh_lanes.clear();
        dh_lanes.resize(LANES * nb * h, 0.0);
    }
    let lane = &mut dh_lanes[(tile % LANES) * nb * h..][..nb * h];
    products::add_dhidden(lane, h, dz_view, weight, dz_pack, threads);
    if tile + 1 == tiles {
        let lanes: Vec<&[f32]> = dh_lanes.chunks(nb * h).collect();
        add_lanes(block.rows_of(grads.dhidden, h), &lanes, h);
    }
    if !head_grad.has_dweight() {
        return;
    }
    // `dZᵀ` dense: `gemm` copies a transposed view into fresh memory on every call.
    transpose_into(dz, ld, nb, vt, dz_t);
    let dz_t = MatRef::row_major(&dz_t[..], vt, nb);
    let dw = DweightTile::of(grads.dweight, inputs, vocab);
    products::add_dweight(dw, dz_t, hidden, dz_pack, threads);
    if let Some(db) = grads.dbias.as_deref_mut() {
        add_column_sums(&mut db[vocab.clone()], dz_t.data, nb);
    }
}

/// Adds the lanes' dH (each `[rows, h]`) into the block's dH `rows`, lane by lane.
pub(crate) fn add_lanes(rows: Vec<&mut [f32]>, lanes: &[&[f32]], h: usize) {
    rows.into_par_iter().enumerate().for_each(|(r, d)| {
        for lane in lanes {
            let x = &lane[r * h..(r + 1) * h];
            d.iter_mut().zip(x).for_each(|(d, x)| *d += x);
        }
    });
}

/// `dW_tile += dZᵀ·H` and `dbias_tile += Σ_rows dZ` for a `[rows, cols]` gradient tile
/// `dz` (row stride `ld`) of the rows whose hidden states are `hidden` `[rows, h]`.
/// `dZᵀ` is materialized in `dz_t` (reused): given as a transposed view, `gemm` copies
/// it into a fresh allocation on every call (4 MiB of page faults per 512 × 2048 tile,
/// measured) and runs slower on it.
#[allow(clippy::too_many_arguments)]
pub(crate) fn add_head_tile_grads(
    dz: &[f32],
    ld: usize,
    rows: usize,
    cols: usize,
    hidden: &[f32],
    h: usize,
    dweight: &mut [f32],
    dbias: Option<&mut [f32]>,
    dz_t: &mut Vec<f32>,
) {
    if rows == 0 || cols == 0 {
        return;
    }
    transpose_into(dz, ld, rows, cols, dz_t);
    matmul(
        dweight,
        h,
        MatRef::row_major(dz_t, cols, rows),
        MatRef::row_major(hidden, rows, h),
        true,
    );
    if let Some(db) = dbias {
        add_column_sums(db, dz_t, rows);
    }
}

/// `dbias += Σ_rows dZ` from `dZᵀ` (`[cols, rows]`, dense): each entry sums its column
/// in row order, as a loop over rows would.
pub(crate) fn add_column_sums(dbias: &mut [f32], dz_t: &[f32], rows: usize) {
    dbias
        .par_iter_mut()
        .zip(dz_t.par_chunks(rows))
        .for_each(|(d, col)| *d = col.iter().fold(*d, |s, x| s + x));
}

/// `dst = srcᵀ`, dense `[cols, rows]`, of the `[rows, cols]` matrix `src` (row stride
/// `ld`); `dst`'s capacity is reused. Parallel over strips of 32 columns (32 output rows
/// written in step, each read a 128-byte segment per source row).
pub(crate) fn transpose_into(src: &[f32], ld: usize, rows: usize, cols: usize, dst: &mut Vec<f32>) {
    const STRIP: usize = 32;
    dst.resize(rows * cols, 0.0);
    dst.par_chunks_mut(STRIP * rows)
        .enumerate()
        .for_each(|(s, out)| {
            let j0 = s * STRIP;
            let width = out.len() / rows;
            for i in 0..rows {
                let row = &src[i * ld + j0..i * ld + j0 + width];
                for (jj, &x) in row.iter().enumerate() {
                    out[jj * rows + i] = x;
                }
            }
        });
}

#[cfg(test)]
mod tests {
    use super::transpose_into;

    #[test]
    fn transpose_of_strided_odd_tiles() {
        for (rows, cols, ld) in [(1, 1, 1), (3, 70, 75), (37, 33, 40), (64, 32, 32)] {
            let src: Vec<f32> = (0..rows * ld).map(|i| i as f32).collect();
            let mut dst = vec![f32::NAN; 5];
            transpose_into(&src, ld, rows, cols, &mut dst);
            assert_eq!(dst.len(), rows * cols);
            for i in 0..rows {
                for j in 0..cols {
                    assert_eq!(
                        dst[j * rows + i],
                        src[i * ld + j],
                        "[{rows}x{cols}] ({i},{j})"
                    );
                }
            }
        }
    }
}

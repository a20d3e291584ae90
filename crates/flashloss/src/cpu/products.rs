//! The three products of a fused step on a row block and a vocabulary tile,
//! `Z = H·Wᵀ`, `dH += dZ·W` and `dW += dZᵀ·H`, on the engine the plan chose: f32 through
//! `gemm` (bf16 inputs widened a block or a tile at a time), or, for a bf16 head on a CPU
//! with AVX512-BF16 where it is the faster ([`super::bf16_choice`]), bf16 operands on
//! `vdpbf16ps` with f32 accumulation
//! ([`super::bf16_gemm`]; `dZ` is rounded to bf16 for the two gradient products).
//! The hidden block is prepared once per row block (widened, or packed for both of its
//! products) and read by every tile.
//!
//! A weight tile is a `[cols, h]` view of `W` ([`weight_tile`]): rows of a `[V, H]`
//! weight, or columns (rows `V` apart) of an `[H, V]` one; both products read it through
//! its strides (`gemm` and the packers take any strides). `dW`'s tile is written in the
//! weight's layout: `dW_tile += dZᵀ·H` as `[cols, h]`, or `dW_tileᵀ += Hᵀ·dZ` as
//! `[h, cols]` rows `V` apart.

use super::bf16_choice::{bf16_products_choice, no_avx512bf16};
use super::bf16_gemm::{Avx512Bf16, PackedA, PackedB};
use super::matmul::{MatRef, matmul_on};
use super::row_blocks::RowBlock;
use super::simd;
use crate::batch::LinearInputs;
use crate::element::Element;
use crate::error::Result;
use crate::fused::{Bf16Products, Plan};
use crate::weight_layout::WeightLayout;
use half::bf16;
use std::ops::Range;

/// The engine of a plan's products.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Engine {
    /// f32 operands (`gemm`).
    F32,
    /// bf16 operands (`vdpbf16ps`).
    Bf16(Avx512Bf16),
}

impl Engine {
    /// What a bf16 head runs for `asked` on this CPU
    /// ([`super::bf16_choice::bf16_products_choice`]: `auto` takes `FLASHLOSS_BF16_PRODUCTS`
    /// where set, else the faster path as measured on this CPU).
    pub(crate) fn resolve(asked: Bf16Products) -> Result<Bf16Products> {
        Ok(bf16_products_choice(asked)?.runs)
    }

    /// The engine of `plan`; an error for a plan that names bf16 products this CPU
    /// lacks (a plan made elsewhere: [`Engine::resolve`] checked the CPU's own).
    pub(crate) fn of(plan: &Plan) -> Result<Self> {
        match plan.bf16_products {
            Some(Bf16Products::Avx512Bf16) => Avx512Bf16::detect()
                .map(Engine::Bf16)
                .ok_or_else(no_avx512bf16),
            _ => Ok(Engine::F32),
        }
    }
}

/// A row block's hidden states `[rows, h]` as the products read them.
#[derive(Debug, Default)]
pub(crate) struct HiddenBlock {
    /// f32 rows (bf16 widened, or rows gathered; consecutive f32 rows are borrowed).
    wide: Vec<f32>,
    /// bf16 rows gathered for packing.
    gathered: Vec<bf16>,
    /// A of the logits (pairs along `h`).
    logits: PackedA,
    /// B of a `[V, H]` dW (pairs along the rows).
    dweight: PackedB,
    /// A of an `[H, V]` dW, `Hᵀ` (pairs along the rows).
    dweight_t: PackedA,
}

/// A borrowed [`HiddenBlock`] (or f32 input rows).
#[derive(Clone, Copy)]
pub(crate) enum Hidden<'a> {
    F32(&'a [f32]),
    Bf16(Avx512Bf16, &'a HiddenBlock),
}

impl HiddenBlock {
    /// Bytes held.
    pub(crate) fn bytes(&self) -> usize {
        4 * self.wide.capacity()
            + 2 * self.gathered.capacity()
            + self.logits.bytes()
            + self.dweight.bytes()
            + self.dweight_t.bytes()
    }

    /// Packs `rows` `[n, h]` for the logits and, given its layout, for dW.
    fn pack(&mut self, rows: MatRef<bf16>, dweight: Option<WeightLayout>, threads: usize) {
        self.logits.pack_a(rows, threads);
        match dweight {
            Some(WeightLayout::VocabMajor) => self.dweight.pack_b(rows, threads),
            Some(WeightLayout::HiddenMajor) => self.dweight_t.pack_a(rows.t(), threads),
            None => {}
        }
    }

    /// Rows `rows` of `hidden` (`[*, h]`) for `engine`'s products (dW in `layout`, or
    /// none: statistics only, or a frozen head).
    fn load<'a, E: Element>(
        &'a mut self,
        engine: Engine,
        (hidden, h, layout): (&'a [E], usize, Option<WeightLayout>),
        rows: Range<usize>,
        threads: usize,
    ) -> Hidden<'a> {
        let (n, src) = (rows.len(), &hidden[rows.start * h..rows.end * h]);
        match (engine, E::as_bf16(src)) {
            (Engine::Bf16(cpu), Some(bf)) => {
                self.pack(MatRef::row_major(bf, n, h), layout, threads);
                Hidden::Bf16(cpu, self)
            }
            _ => Hidden::F32(widened(src, &mut self.wide)),
        }
    }

    /// The rows of `block` of `inputs`' hidden states for `engine`'s products (the dW
    /// product too `with_dweight`): [`HiddenBlock::load`] where they are consecutive,
    /// else gathered (and widened or packed).
    pub(crate) fn load_rows<'a, E: Element>(
        &'a mut self,
        engine: Engine,
        (inputs, with_dweight): (&LinearInputs<'a, E>, bool),
        block: &RowBlock,
        threads: usize,
    ) -> Hidden<'a> {
        let (hidden, h) = (inputs.hidden, inputs.hidden_size);
        let layout = with_dweight.then_some(inputs.layout);
        if let Some(rows) = block.range() {
            return self.load(engine, (hidden, h, layout), rows, threads);
        }
        let (ids, n) = (&block.ids, block.ids.len());
        match (engine, E::as_bf16(hidden)) {
            (Engine::Bf16(cpu), Some(bf)) => {
                let mut gathered = std::mem::take(&mut self.gathered);
                gathered.clear();
                ids.iter()
                    .for_each(|&i| gathered.extend_from_slice(&bf[i * h..(i + 1) * h]));
                self.pack(MatRef::row_major(&gathered[..], n, h), layout, threads);
                self.gathered = gathered;
                Hidden::Bf16(cpu, self)
            }
            _ => {
                self.wide.resize(n * h, 0.0);
                (self.wide.chunks_mut(h).zip(ids))
                    .for_each(|(dst, &i)| simd::load(&hidden[i * h..(i + 1) * h], dst));
                Hidden::F32(&self.wide)
            }
        }
    }
}

/// Vocabulary entries `vocab` of `inputs`' weight as a `[cols, h]` view: rows of a
/// `[V, H]` weight, columns of an `[H, V]` one.
pub(crate) fn weight_tile<'a, E>(
    inputs: &LinearInputs<'a, E>,
    vocab: &Range<usize>,
) -> MatRef<'a, E> {
    let (v, h) = (inputs.vocab, inputs.hidden_size);
    let (sv, sh) = inputs.layout.strides(v, h);
    MatRef {
        data: &inputs.weight[vocab.start * sv..],
        rows: vocab.len(),
        cols: h,
        row_stride: sv,
        col_stride: sh,
    }
}

/// A vocabulary tile's weight `[cols, h]` as the products read them.
#[derive(Debug, Default)]
pub(crate) struct WeightTile {
    wide: Vec<f32>,
    /// B of the logits (pairs along `h`).
    logits: PackedB,
    /// B of `dH` (pairs along the vocabulary).
    dhidden: PackedB,
}

/// A borrowed [`WeightTile`] (or an f32 input view, `[cols, h]`): f32 serves both
/// products, a bf16 tile the ones it was packed for.
#[derive(Clone, Copy)]
pub(crate) enum Weight<'a> {
    F32(MatRef<'a, f32>),
    Bf16 {
        cpu: Avx512Bf16,
        logits: Option<&'a PackedB>,
        dhidden: Option<&'a PackedB>,
    },
}

impl WeightTile {
    /// Bytes held.
    pub(crate) fn bytes(&self) -> usize {
        4 * self.wide.capacity() + self.logits.bytes() + self.dhidden.bytes()
    }

    /// Vocabulary entries `vocab` of `inputs`' weight for `engine`'s products: the
    /// logits and/or dH (`(for_logits, for_dhidden)`; an f32 tile serves both).
    pub(crate) fn load<'a, E: Element>(
        &'a mut self,
        engine: Engine,
        (inputs, vocab): (&LinearInputs<'a, E>, &Range<usize>),
        (for_logits, for_dhidden): (bool, bool),
        threads: usize,
    ) -> Weight<'a> {
        let view = weight_tile(inputs, vocab);
        match (engine, E::as_bf16(view.data)) {
            (Engine::Bf16(cpu), Some(bf)) => {
                let view = view.over(bf);
                if for_logits {
                    self.logits.pack_b(view.t(), threads);
                }
                if for_dhidden {
                    self.dhidden.pack_b(view, threads);
                }
                Weight::Bf16 {
                    cpu,
                    logits: for_logits.then_some(&self.logits),
                    dhidden: for_dhidden.then_some(&self.dhidden),
                }
            }
            _ => Weight::F32(widened_view(view, &mut self.wide)),
        }
    }
}

/// `src` as f32: itself, or widened into `buf`.
fn widened<'a, E: Element>(src: &'a [E], buf: &'a mut Vec<f32>) -> &'a [f32] {
    match E::as_f32(src) {
        Some(s) => s,
        None => {
            buf.resize(src.len(), 0.0);
            simd::load(src, buf);
            buf
        }
    }
}

/// `view` (contiguous rows or contiguous columns) as f32: itself, or its lines widened
/// into `buf`, dense, in the same orientation.
fn widened_view<'a, E: Element>(view: MatRef<'a, E>, buf: &'a mut Vec<f32>) -> MatRef<'a, f32> {
    if let Some(data) = E::as_f32(view.data) {
        return view.over(data);
    }
    let (rows, cols) = (view.rows, view.cols);
    let by_rows = view.col_stride == 1;
    let (lines, len, stride) = match by_rows {
        true => (rows, cols, view.row_stride),
        false => (cols, rows, view.col_stride),
    };
    buf.resize(lines * len, 0.0);
    (buf.chunks_mut(len.max(1)).enumerate())
        .for_each(|(i, dst)| simd::load(&view.data[i * stride..i * stride + len], dst));
    match by_rows {
        true => MatRef::row_major(buf, rows, cols),
        false => MatRef::row_major(buf, cols, rows).t(),
    }
}

/// The packed `dZ` of the bf16 products: A of dH and of a `[V, H]` dW, B of an `[H, V]`
/// dW.
#[derive(Debug, Default)]
pub(crate) struct DzPacks {
    a: PackedA,
    b: PackedB,
}

impl DzPacks {
    /// Bytes held.
    pub(crate) fn bytes(&self) -> usize {
        self.a.bytes() + self.b.bytes()
    }
}

/// A vocabulary tile's part of `dW` in the weight's layout: `[cols, h]` (`[V, H]`) or
/// `[h, cols]` (`[H, V]`), rows `ld` apart.
pub(crate) struct DweightTile<'a> {
    pub(crate) data: &'a mut [f32],
    pub(crate) ld: usize,
    pub(crate) h: usize,
    pub(crate) layout: WeightLayout,
}

impl<'a> DweightTile<'a> {
    /// The part of vocabulary entries `vocab` of the whole `dweight` of `inputs`' head.
    pub(crate) fn of<E>(
        dweight: &'a mut [f32],
        inputs: &LinearInputs<E>,
        vocab: &Range<usize>,
    ) -> Self {
        let (v, h, layout) = (inputs.vocab, inputs.hidden_size, inputs.layout);
        let (sv, ld) = match layout {
            WeightLayout::VocabMajor => (h, h),
            WeightLayout::HiddenMajor => (1, v),
        };
        DweightTile {
            data: &mut dweight[vocab.start * sv..],
            ld,
            h,
            layout,
        }
    }
}

/// `z[rows, cols]` (row stride `ld`) `= H·Wᵀ` on up to `threads` threads.
pub(crate) fn logits(
    z: &mut [f32],
    ld: usize,
    hidden: Hidden,
    weight: Weight,
    (rows, h, cols): (usize, usize, usize),
    threads: usize,
) {
    match (hidden, weight) {
        (Hidden::F32(hid), Weight::F32(w)) => {
            debug_assert_eq!((w.rows, w.cols), (cols, h));
            matmul_on(
                z,
                ld,
                MatRef::row_major(hid, rows, h),
                w.t(),
                false,
                threads,
            )
        }
        (
            Hidden::Bf16(cpu, hid),
            Weight::Bf16 {
                logits: Some(w), ..
            },
        ) => cpu.gemm(z, ld, &hid.logits, w, false, threads),
        _ => unreachable!("one engine per plan, a weight tile packed for the logits"),
    }
}

/// `dH[rows, h] += dZ·W` for the gradient tile `dz` `[rows, cols]` (any strides);
/// `scratch` holds the packed `dZ`.
pub(crate) fn add_dhidden(
    dh: &mut [f32],
    h: usize,
    dz: MatRef,
    weight: Weight,
    scratch: &mut DzPacks,
    threads: usize,
) {
    match weight {
        Weight::F32(w) => matmul_on(dh, h, dz, w, true, threads),
        Weight::Bf16 {
            cpu,
            dhidden: Some(w),
            ..
        } => {
            scratch.a.pack_a(dz, threads);
            cpu.gemm(dh, h, &scratch.a, w, true, threads)
        }
        Weight::Bf16 { .. } => unreachable!("a weight tile not packed for dH"),
    }
}

/// `dW_tile += dZᵀ·H` for `dz_t` `[cols, rows]` (any strides; the f32 engine reads it
/// fastest dense), into `dw` in its layout; `scratch` holds the packed `dZ`.
pub(crate) fn add_dweight(
    dw: DweightTile,
    dz_t: MatRef,
    hidden: Hidden,
    scratch: &mut DzPacks,
    threads: usize,
) {
    let ld = dw.ld;
    match (hidden, dw.layout) {
        (Hidden::F32(hid), layout) => {
            let hid = MatRef::row_major(hid, dz_t.cols, dw.h);
            match layout {
                WeightLayout::VocabMajor => matmul_on(dw.data, ld, dz_t, hid, true, threads),
                WeightLayout::HiddenMajor => {
                    matmul_on(dw.data, ld, hid.t(), dz_t.t(), true, threads)
                }
            }
        }
        (Hidden::Bf16(cpu, hid), WeightLayout::VocabMajor) => {
            scratch.a.pack_a(dz_t, threads);
            cpu.gemm(dw.data, ld, &scratch.a, &hid.dweight, true, threads)
        }
        (Hidden::Bf16(cpu, hid), WeightLayout::HiddenMajor) => {
            scratch.b.pack_b(dz_t.t(), threads);
            cpu.gemm(dw.data, ld, &hid.dweight_t, &scratch.b, true, threads)
        }
    }
}

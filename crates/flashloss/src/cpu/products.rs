//! The three products of a fused step on a row block and a vocabulary tile,
//! `Z = H·Wᵀ`, `dH += dZ·W` and `dW += dZᵀ·H`, on the engine the plan chose: f32 through
//! `gemm` (bf16 inputs widened a block or a tile at a time), or, for a bf16 head on a CPU
//! with AVX512-BF16, bf16 operands on `vdpbf16ps` with f32 accumulation
//! ([`super::bf16_gemm`]; `dZ` is rounded to bf16 for the two gradient products).
//! The hidden block is prepared once per row block (widened, or packed for both of its
//! products) and read by every tile.

use super::bf16_gemm::{Avx512Bf16, PackedA, PackedB};
use super::matmul::{MatRef, matmul_on};
use super::simd;
use super::tiles::RowBlock;
use crate::element::Element;
use crate::error::{Error, Result};
use crate::fused::{Bf16Products, Plan};
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

/// The environment variable that chooses for [`Bf16Products::Auto`] in every binding
/// (`auto`, `widened`, `avx512bf16`), as `ONEDNN_MAX_CPU_ISA` does for oneDNN; an option
/// other than `auto` wins over it.
pub const BF16_PRODUCTS_ENV: &str = "FLASHLOSS_BF16_PRODUCTS";

impl Engine {
    /// What a bf16 head runs for `asked` (`auto`: [`BF16_PRODUCTS_ENV`] where set) on this
    /// CPU; an error where the CPU lacks it or the variable holds another value.
    pub(crate) fn resolve(asked: Bf16Products) -> Result<Bf16Products> {
        let asked = match (asked, std::env::var(BF16_PRODUCTS_ENV)) {
            (Bf16Products::Auto, Ok(name)) => {
                Bf16Products::from_name(&name).ok_or_else(|| Error::InvalidArgument {
                    arg: BF16_PRODUCTS_ENV,
                    reason: format!("{name:?} is not one of auto, widened, avx512bf16"),
                })?
            }
            _ => asked,
        };
        match (asked, Avx512Bf16::detect()) {
            (Bf16Products::Widened, _) | (Bf16Products::Auto, None) => Ok(Bf16Products::Widened),
            (_, Some(_)) => Ok(Bf16Products::Avx512Bf16),
            (Bf16Products::Avx512Bf16, None) => Err(no_avx512bf16()),
        }
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

/// The error of bf16 products asked for on a CPU without AVX512-BF16.
fn no_avx512bf16() -> Error {
    Error::InvalidArgument {
        arg: "bf16_products",
        reason: "avx512bf16 asked for, and this CPU has no AVX512-BF16 (vdpbf16ps)".into(),
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
    /// B of `dW` (pairs along the rows).
    dweight: PackedB,
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
    }

    /// Rows `rows` of `hidden` (`[*, h]`) for `engine`'s products.
    pub(crate) fn load<'a, E: Element>(
        &'a mut self,
        engine: Engine,
        hidden: &'a [E],
        h: usize,
        rows: Range<usize>,
        threads: usize,
    ) -> Hidden<'a> {
        let (n, src) = (rows.len(), &hidden[rows.start * h..rows.end * h]);
        match (engine, E::as_bf16(src)) {
            (Engine::Bf16(cpu), Some(bf)) => {
                let view = MatRef::row_major(bf, n, h);
                self.logits.pack_a(view, threads);
                self.dweight.pack_b(view, threads);
                Hidden::Bf16(cpu, self)
            }
            _ => Hidden::F32(widened(src, &mut self.wide)),
        }
    }

    /// The rows of `block` of `hidden` for `engine`'s products: [`HiddenBlock::load`]
    /// where they are consecutive, else gathered (and widened or packed).
    pub(crate) fn load_rows<'a, E: Element>(
        &'a mut self,
        engine: Engine,
        hidden: &'a [E],
        h: usize,
        block: &RowBlock,
        threads: usize,
    ) -> Hidden<'a> {
        if let Some(rows) = block.range() {
            return self.load(engine, hidden, h, rows, threads);
        }
        let (ids, n) = (&block.ids, block.ids.len());
        match (engine, E::as_bf16(hidden)) {
            (Engine::Bf16(cpu), Some(bf)) => {
                self.gathered.clear();
                ids.iter()
                    .for_each(|&i| self.gathered.extend_from_slice(&bf[i * h..(i + 1) * h]));
                let view = MatRef::row_major(&self.gathered[..], n, h);
                self.logits.pack_a(view, threads);
                self.dweight.pack_b(view, threads);
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

/// A vocabulary tile's weight rows `[cols, h]` as the products read them.
#[derive(Debug, Default)]
pub(crate) struct WeightTile {
    wide: Vec<f32>,
    /// B of the logits (pairs along `h`).
    logits: PackedB,
    /// B of `dH` (pairs along the vocabulary).
    dhidden: PackedB,
}

/// A borrowed [`WeightTile`] (or f32 input rows): f32 serves both products, a bf16 tile
/// the ones it was packed for.
#[derive(Clone, Copy)]
pub(crate) enum Weight<'a> {
    F32(&'a [f32]),
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

    /// Rows `vocab` of `weight` (`[*, h]`) for `engine`'s products: the logits and/or dH
    /// (`(for_logits, for_dhidden)`; an f32 tile serves both).
    pub(crate) fn load<'a, E: Element>(
        &'a mut self,
        engine: Engine,
        weight: &'a [E],
        (h, vocab): (usize, Range<usize>),
        (for_logits, for_dhidden): (bool, bool),
        threads: usize,
    ) -> Weight<'a> {
        let (cols, src) = (vocab.len(), &weight[vocab.start * h..vocab.end * h]);
        match (engine, E::as_bf16(src)) {
            (Engine::Bf16(cpu), Some(bf)) => {
                let view = MatRef::row_major(bf, cols, h);
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
            _ => Weight::F32(widened(src, &mut self.wide)),
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
        (Hidden::F32(hid), Weight::F32(w)) => matmul_on(
            z,
            ld,
            MatRef::row_major(hid, rows, h),
            MatRef::row_major(w, cols, h).t(),
            false,
            threads,
        ),
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
    scratch: &mut PackedA,
    threads: usize,
) {
    match weight {
        Weight::F32(w) => matmul_on(dh, h, dz, MatRef::row_major(w, dz.cols, h), true, threads),
        Weight::Bf16 {
            cpu,
            dhidden: Some(w),
            ..
        } => {
            scratch.pack_a(dz, threads);
            cpu.gemm(dh, h, scratch, w, true, threads)
        }
        Weight::Bf16 { .. } => unreachable!("a weight tile not packed for dH"),
    }
}

/// `dW[cols, h] += dZᵀ·H` for `dz_t` `[cols, rows]` (any strides; the f32 engine reads it
/// fastest dense); `scratch` holds the packed `dZᵀ`.
pub(crate) fn add_dweight(
    dw: &mut [f32],
    h: usize,
    dz_t: MatRef,
    hidden: Hidden,
    scratch: &mut PackedA,
    threads: usize,
) {
    match hidden {
        Hidden::F32(hid) => {
            let hid = MatRef::row_major(hid, dz_t.cols, h);
            matmul_on(dw, h, dz_t, hid, true, threads)
        }
        Hidden::Bf16(cpu, hid) => {
            scratch.pack_a(dz_t, threads);
            cpu.gemm(dw, h, scratch, &hid.dweight, true, threads)
        }
    }
}

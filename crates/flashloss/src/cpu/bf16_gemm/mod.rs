//! bf16 products with f32 accumulation, `C (+)= A·B`, on AVX512-BF16's `vdpbf16ps`:
//! each f32 lane does `c_j += a_2p·b_2p,j + a_2p+1·b_2p+1,j` (the bf16 products are exact
//! in f32, the sums are rounded to nearest even; denormal inputs read as zero and
//! denormal results are flushed). One instruction is 64 FLOPs against the f32 FMA's 32.
//!
//! Operands are packed in pairs along `k` into u32 words (`x_2p` in the low half,
//! `x_2p+1` in the high half): A in panels of [`MR`] rows, `[m/MR][k/2][MR]`, B in panels
//! of [`NR`] columns, `[n/NR][k/2][NR]` (an odd `k`'s last pair has a zero high half; a
//! partial panel's missing rows feed only lanes of C that are never stored). A
//! micro-kernel holds an `MR × NR` tile of C in `2·MR` registers over a block of
//! [`KC_PAIRS`] pairs of `k` (its A and B blocks streamed from L2), adding each block's
//! sums into C in order. Operands come from bf16 (exact) or f32 (rounded to nearest
//! even) strided views; on contiguous `k` the packer transposes 16 × 16 words in
//! registers, f32 lines of a contiguous outer dimension are rounded 16 at a time. Every
//! entry of C sums its `k` terms in the same order whatever the thread count.

use super::matmul::MatRef;
use crate::element::Element;
use half::bf16;
use rayon::prelude::*;

/// Rows of an A panel (the register tile's height: `2·MR` accumulators of 16 lanes).
pub const MR: usize = 14;
/// Columns of a B panel (two 16-lane vectors).
pub const NR: usize = 32;

/// An element a packer reads: its bf16 bits.
pub trait Bf16Bits: Element {
    /// The bf16 bits (f32 rounded to nearest even).
    fn bits(self) -> u16;

    /// The 16 pair words of the 32 elements at `src` (word `j`: element `2j` low,
    /// `2j + 1` high), on AVX512-BF16.
    ///
    /// # Safety
    /// 32 elements are readable at `src`, and the CPU has AVX512F and AVX512-BF16.
    #[cfg(target_arch = "x86_64")]
    unsafe fn words16(src: *const Self) -> std::arch::x86_64::__m512i;
}

impl Bf16Bits for bf16 {
    #[inline(always)]
    fn bits(self) -> u16 {
        self.to_bits()
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn words16(src: *const Self) -> std::arch::x86_64::__m512i {
        // SAFETY: the caller's contract (64 bytes readable).
        unsafe { std::arch::x86_64::_mm512_loadu_si512(src.cast()) }
    }
}

impl Bf16Bits for f32 {
    #[inline(always)]
    fn bits(self) -> u16 {
        crate::element::bf16_bits(self)
    }

    /// Rounded to nearest even by `vcvtne2ps2bf16`, which reads denormals as zero, as
    /// `vdpbf16ps` reads them anyway: the products are those of [`Bf16Bits::bits`].
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn words16(src: *const Self) -> std::arch::x86_64::__m512i {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract (32 floats readable, the CPU features).
        unsafe {
            let (lo, hi) = (_mm512_loadu_ps(src), _mm512_loadu_ps(src.add(16)));
            std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo))
        }
    }
}

/// Operand words in panels of `P` along the outer dimension: `[outer/P][k/2][P]`.
#[derive(Debug, Default)]
pub struct Packed<const P: usize> {
    words: Vec<u32>,
    outer: usize,
    pairs: usize,
}

/// An A operand `[m, k]`, in panels of [`MR`] rows.
pub type PackedA = Packed<MR>;
/// A B operand `[k, n]`, in panels of [`NR`] columns.
pub type PackedB = Packed<NR>;

impl<const P: usize> Packed<P> {
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        4 * self.words.capacity()
    }

    /// Bytes a packed `[outer, k]` operand takes.
    pub fn bytes_for(outer: usize, k: usize) -> usize {
        4 * outer.div_ceil(P) * P * k.div_ceil(2)
    }

    /// Packs `view`, `[outer, k]` with pairs along `k` (a view's columns), on up to
    /// `threads` threads. The buffer is reused.
    fn pack<S: Bf16Bits>(&mut self, view: MatRef<S>, threads: usize) {
        let (outer, k) = (view.rows, view.cols);
        let pairs = k.div_ceil(2);
        let panel_words = P * pairs;
        self.outer = outer;
        self.pairs = pairs;
        // Words a packer leaves (a partial panel's missing rows) keep what they held:
        // they feed only lanes of C that the micro-kernel does not store.
        self.words.resize(outer.div_ceil(P) * panel_words, 0);
        let simd = Avx512Bf16::detect();
        let pack_panel = |(q, dst): (usize, &mut [u32])| pack_panel::<S, P>(dst, view, q * P, simd);
        if threads > 1 && outer * k >= 1 << 16 {
            self.words
                .par_chunks_mut(panel_words)
                .enumerate()
                .for_each(pack_panel);
        } else {
            self.words
                .chunks_mut(panel_words.max(1))
                .enumerate()
                .for_each(pack_panel);
        }
    }
}

impl PackedA {
    /// Packs the A operand `a` `[m, k]`.
    pub fn pack_a<S: Bf16Bits>(&mut self, a: MatRef<S>, threads: usize) {
        self.pack(a, threads);
    }
}

impl PackedB {
    /// Packs the B operand `b` `[k, n]`.
    pub fn pack_b<S: Bf16Bits>(&mut self, b: MatRef<S>, threads: usize) {
        self.pack(b.t(), threads);
    }
}

#[inline(always)]
fn pair<S: Bf16Bits>(lo: S, hi: S) -> u32 {
    lo.bits() as u32 | (hi.bits() as u32) << 16
}

/// Pairs transposed per block when `k` is contiguous: the block's `[PAIR_BLOCK][P]`
/// words (at most 4 KiB) stay in L1 while every row writes into it.
const PAIR_BLOCK: usize = 32;

/// One panel: outer rows `o0..o0 + P` of `view` (`[outer, k]`) into `dst` `[k/2][P]`.
/// Contiguous `k`: on AVX512-BF16 (`simd`) 16 rows × 16 pairs at a time, transposed in
/// registers, the rest [`PAIR_BLOCK`] pairs at a time; a contiguous outer dimension
/// interleaves two lines of `k` (runs of `P`, vectorized).
fn pack_panel<S: Bf16Bits, const P: usize>(
    dst: &mut [u32],
    view: MatRef<S>,
    o0: usize,
    simd: Option<Avx512Bf16>,
) {
    let (k, pairs) = (view.cols, view.cols.div_ceil(2));
    let live = P.min(view.rows - o0);
    let (rs, cs, d) = (view.row_stride, view.col_stride, view.data);
    if cs == 1 {
        let mut done = 0;
        #[cfg(target_arch = "x86_64")]
        if simd.is_some() {
            done = k / 32 * 16;
            let rows: Vec<&[S]> = (0..live).map(|i| &d[(o0 + i) * rs..][..2 * done]).collect();
            // SAFETY: `simd` proves the CPU features; each row holds `2·done` elements.
            unsafe { kernel::pack_pairs16::<S, P>(dst, &rows, done) };
        }
        for p0 in (done..pairs).step_by(PAIR_BLOCK) {
            let p1 = (p0 + PAIR_BLOCK).min(pairs);
            let block = &mut dst[p0 * P..p1 * P];
            for i in 0..live {
                let row = &d[(o0 + i) * rs + 2 * p0..][..k.min(2 * p1) - 2 * p0];
                let twos = row.chunks_exact(2);
                if let [last] = twos.remainder() {
                    block[(p1 - 1 - p0) * P + i] = last.bits() as u32;
                }
                for (q, two) in twos.enumerate() {
                    block[q * P + i] = pair(two[0], two[1]);
                }
            }
        }
    } else if rs == 1 {
        let mut done = 0;
        // f32 lines are rounded 16 at a time by hand (bf16 lines interleave as fast as
        // memory allows in the compiler's own vectors).
        #[cfg(target_arch = "x86_64")]
        if let (Some(_), Some(d)) = (simd, S::as_f32(d)) {
            done = k / 2;
            let line = |c: usize| &d[c * cs + o0..][..live];
            let lines: Vec<_> = (0..done).map(|p| (line(2 * p), line(2 * p + 1))).collect();
            // SAFETY: `simd` proves the CPU features; each line holds `live ≤ P` elements.
            unsafe { kernel::pack_lines16::<P>(dst, &lines) };
        }
        for (p, out) in dst.chunks_exact_mut(P).enumerate().skip(done) {
            let lo = &d[2 * p * cs + o0..][..live];
            if 2 * p + 1 < k {
                let hi = &d[(2 * p + 1) * cs + o0..][..live];
                for ((w, &l), &h) in out.iter_mut().zip(lo).zip(hi) {
                    *w = pair(l, h);
                }
            } else {
                for (w, &l) in out.iter_mut().zip(lo) {
                    *w = l.bits() as u32;
                }
            }
        }
    } else {
        for i in 0..live {
            for p in 0..pairs {
                let at = |c: usize| d[(o0 + i) * rs + c * cs];
                let hi = if 2 * p + 1 < k {
                    at(2 * p + 1).bits()
                } else {
                    0
                };
                dst[p * P + i] = at(2 * p).bits() as u32 | (hi as u32) << 16;
            }
        }
    }
}

/// Pairs of `k` per micro-kernel call. Each call reads and writes its 14 × 32 tile of C
/// (out of cache for a fused step's `[rows, vocab_tile]` tiles), so long calls pay off:
/// with `m, n, k` of the fused step's three products on two threads, 128 pairs (the B
/// block in L1) ran at 349-388 GFLOP/s, 256 at 383-407, 512 at 400-435 (the A and B
/// blocks, 28 and 64 KiB, then stream from L2), 1024 no faster.
const KC_PAIRS: usize = 512;

/// Proof that this CPU runs AVX512-BF16 (`vdpbf16ps`): the products' entry point.
#[derive(Debug, Clone, Copy)]
pub struct Avx512Bf16(());

impl Avx512Bf16 {
    /// `Some` when the CPU has AVX512F and AVX512-BF16 (checked at run time).
    pub fn detect() -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512bf16")
        {
            return Some(Avx512Bf16(()));
        }
        None
    }

    /// `c = a·b` (or `c += a·b` when `accumulate`), `c` row-major `[a.m, b.n]` with rows
    /// `ldc` apart, rows of C split over up to `threads` threads. Panics on inconsistent
    /// shapes: callers pass validated sizes.
    pub fn gemm(
        self,
        c: &mut [f32],
        ldc: usize,
        a: &PackedA,
        b: &PackedB,
        accumulate: bool,
        threads: usize,
    ) {
        let (m, n, pairs) = (a.outer, b.outer, a.pairs);
        assert_eq!(pairs, b.pairs, "inner dimensions");
        if m == 0 || n == 0 {
            return;
        }
        assert!(ldc >= n && c.len() >= (m - 1) * ldc + n, "matrix bounds");
        let a_panels = m.div_ceil(MR);
        let chunk_panels = if threads > 1 && m * n * pairs >= 1 << 17 {
            a_panels.div_ceil(threads)
        } else {
            a_panels
        };
        let c = &mut c[..(m - 1) * ldc + n];
        if pairs == 0 {
            if !accumulate {
                c.chunks_mut(ldc).for_each(|row| row[..n].fill(0.0));
            }
            return;
        }
        let run = |(chunk, c): (usize, &mut [f32])| {
            let first = chunk * chunk_panels;
            let panels = chunk_panels.min(a_panels - first);
            for k0 in (0..pairs).step_by(KC_PAIRS) {
                let kc = KC_PAIRS.min(pairs - k0);
                for (q, b_panel) in b.words.chunks_exact(NR * pairs).enumerate() {
                    let b_block = &b_panel[k0 * NR..][..kc * NR];
                    let (col, nr) = (q * NR, NR.min(n - q * NR));
                    for ip in 0..panels {
                        let row = (first + ip) * MR;
                        let a_block = &a.words[(first + ip) * MR * pairs + k0 * MR..][..kc * MR];
                        let (mr, at) = (MR.min(m - row), ip * MR * ldc + col);
                        assert!(c.len() >= at + (mr - 1) * ldc + nr, "tile bounds");
                        let add = accumulate || k0 > 0;
                        // SAFETY: `self` proves the CPU features; the blocks hold `kc`
                        // words per row or column and the tile lies within `c` (checked).
                        #[cfg(target_arch = "x86_64")]
                        unsafe {
                            kernel::tile(kc, a_block, b_block, &mut c[at..], ldc, mr, nr, add)
                        };
                    }
                }
            }
        };
        if chunk_panels < a_panels {
            c.par_chunks_mut(chunk_panels * MR * ldc)
                .enumerate()
                .for_each(run);
        } else {
            run((0, c));
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod kernel {
    use super::{Bf16Bits, MR, NR};
    use std::arch::x86_64::*;

    /// Pairs `0..pairs` (a multiple of 16) of `rows` (at most `P`, each `2·pairs`
    /// elements) into a panel `dst` `[pairs..][P]`: per 16 rows and 16 pairs, the rows'
    /// words are loaded, transposed in registers and stored a pair (16 rows) at a time.
    /// Words of rows beyond `rows.len()` are zero (in a 16-row group) or left as they are.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn pack_pairs16<S: Bf16Bits, const P: usize>(
        dst: &mut [u32],
        rows: &[&[S]],
        pairs: usize,
    ) {
        assert!(rows.len() <= P && dst.len() >= pairs * P, "panel bounds");
        for (g, group) in rows.chunks(16).enumerate() {
            let (i0, width) = (16 * g, 16.min(P - 16 * g));
            let mask = ((1u32 << width) - 1) as __mmask16;
            for p0 in (0..pairs).step_by(16) {
                let mut r = [_mm512_setzero_si512(); 16];
                for (v, row) in r.iter_mut().zip(group) {
                    assert!(row.len() >= 2 * p0 + 32, "row bounds");
                    // SAFETY: 32 elements from `2·p0` lie in `row` (checked).
                    *v = unsafe { S::words16(row.as_ptr().add(2 * p0)) };
                }
                transpose16(&mut r);
                for (t, v) in r.iter().enumerate() {
                    // SAFETY: `(p0 + t)·P + i0 + width ≤ pairs·P ≤ dst.len()`.
                    unsafe {
                        let at = dst.as_mut_ptr().add((p0 + t) * P + i0);
                        _mm512_mask_storeu_epi32(at.cast(), mask, *v)
                    };
                }
            }
        }
    }

    /// Pair words of the f32 `lines` (pair `p`: its two lines of the panel's outer
    /// dimension, at most `P` elements each, rounded to nearest even) into a panel `dst`
    /// `[pairs][P]`, 16 elements at a time.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn pack_lines16<const P: usize>(dst: &mut [u32], lines: &[(&[f32], &[f32])]) {
        // `vpermw` indices that zip a vector's two 16-element halves: `[0, 16, 1, 17, …]`.
        let zip = std::array::from_fn::<u16, 32, _>(|j| (j / 2 + 16 * (j % 2)) as u16);
        // SAFETY: 64 bytes read from a local array.
        let zip = unsafe { _mm512_loadu_si512(zip.as_ptr().cast()) };
        assert!(dst.len() >= lines.len() * P, "panel bounds");
        for (p, (lo, hi)) in lines.iter().enumerate() {
            let live = lo.len();
            assert!(live <= P && hi.len() == live, "line bounds");
            for i0 in (0..live).step_by(16) {
                let mask = ((1u32 << (live - i0).min(16)) - 1) as __mmask16;
                // SAFETY: the masked elements lie in the lines (`i0 + popcount ≤ live`),
                // the masked words in the panel's pair `p` (`live ≤ P`).
                unsafe {
                    let lo = _mm512_maskz_loadu_ps(mask, lo.as_ptr().add(i0));
                    let hi = _mm512_maskz_loadu_ps(mask, hi.as_ptr().add(i0));
                    let halves =
                        std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo));
                    let words = _mm512_permutexvar_epi16(zip, halves);
                    _mm512_mask_storeu_epi32(dst.as_mut_ptr().add(p * P + i0).cast(), mask, words);
                }
            }
        }
    }

    /// `r` ← `rᵀ` (16 × 16 words): four rounds of `r'[2i] = zip_lo(r[i], r[i + 8])`,
    /// `r'[2i + 1] = zip_hi(r[i], r[i + 8])` (a perfect shuffle: after log₂16 rounds,
    /// row `j` holds word `j` of every row, in row order).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn transpose16(r: &mut [__m512i; 16]) {
        let lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
        let hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
        for _ in 0..4 {
            let mut out = [_mm512_setzero_si512(); 16];
            for i in 0..8 {
                out[2 * i] = _mm512_permutex2var_epi32(r[i], lo, r[i + 8]);
                out[2 * i + 1] = _mm512_permutex2var_epi32(r[i], hi, r[i + 8]);
            }
            *r = out;
        }
    }

    /// `c[i, j] (+)= Σ_p a[p, i]·b[p, j]` for `i < mr`, `j < nr`: an A panel `[pairs][MR]`
    /// and a B panel `[pairs][NR]` of bf16 pairs; `c` rows are `ldc` apart.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn tile(
        pairs: usize,
        a: &[u32],
        b: &[u32],
        c: &mut [f32],
        ldc: usize,
        mr: usize,
        nr: usize,
        accumulate: bool,
    ) {
        let mut lo = [_mm512_setzero_ps(); MR];
        let mut hi = [_mm512_setzero_ps(); MR];
        let (a, b, c) = (a.as_ptr(), b.as_ptr(), c.as_mut_ptr());
        // SAFETY: the caller passes panels of `pairs·MR` and `pairs·NR` words and a tile
        // of `mr` rows of `nr` columns within `c`; the masks keep to the `nr` columns.
        unsafe {
            for p in 0..pairs {
                let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(p * NR).cast()));
                let b1: __m512bh =
                    std::mem::transmute(_mm512_loadu_si512(b.add(p * NR + 16).cast()));
                let ap = a.add(p * MR);
                for i in 0..MR {
                    let ai: __m512bh = std::mem::transmute(_mm512_set1_epi32(*ap.add(i) as i32));
                    lo[i] = _mm512_dpbf16_ps(lo[i], ai, b0);
                    hi[i] = _mm512_dpbf16_ps(hi[i], ai, b1);
                }
            }
            let mask = |cols: usize| ((1u32 << cols.min(16)) - 1) as __mmask16;
            let (m0, m1) = (mask(nr), mask(nr.saturating_sub(16)));
            for i in 0..mr {
                let row = c.add(i * ldc);
                let (mut x0, mut x1) = (lo[i], hi[i]);
                if accumulate {
                    x0 = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, row), x0);
                    x1 = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, row.add(16)), x1);
                }
                _mm512_mask_storeu_ps(row, m0, x0);
                _mm512_mask_storeu_ps(row.add(16), m1, x1);
            }
        }
    }
}

#[cfg(test)]
mod tests;

//! Tile primitives of the CPU kernels: a branch-free `exp` that the compiler
//! vectorizes, and reductions over 16 independent lanes (a fixed order, so results do
//! not depend on threads). Each public function is compiled for AVX-512, AVX2+FMA and
//! baseline x86-64 and picks the best at run time.

use crate::element::Element;
use half::bf16;
use multiversion::multiversion;

/// Lanes of every reduction: one AVX-512 register of f32.
const LANES: usize = 16;

/// `exp(x)` in f32, within 2 ulp; 0 below -87 (no denormals), NaN stays NaN.
/// Range reduction `x = n·ln2 + r`, `|r| ≤ ln2/2`, then a degree-7 polynomial
/// (Cephes `expf` coefficients) and `2^n` built from the exponent bits.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    exp_clamped(x, if x > 88.0 { 88.0 } else { x })
}

/// [`exp`] for arguments known to be ≤ 0 (shifted by a max): skips the upper clamp.
#[inline(always)]
pub fn exp_nonpositive(x: f32) -> f32 {
    exp_clamped(x, x)
}

/// `exp(x)` given `xc`, `x` already clamped from above to 88.
#[inline(always)]
fn exp_clamped(x: f32, xc: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5·2^23: adding it rounds to an integer held in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let xc = if xc < -87.0 { -87.0 } else { xc };
    let t = xc * LOG2E + ROUND;
    let n = t - ROUND;
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    let k = t.to_bits().wrapping_sub(ROUND.to_bits()) as i32;
    let two_n = f32::from_bits(((k + 127) as u32) << 23);
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 5e-1;
    let y = (p * (r * r) + r) + 1.0;
    if x < -87.0 { 0.0 } else { y * two_n }
}

/// Widens `src` to f32 into `dst`.
#[inline]
pub fn load<E: Element>(src: &[E], dst: &mut [f32]) {
    if let Some(src) = E::as_bf16(src) {
        return load_bf16(src, dst);
    }
    for (d, s) in dst.iter_mut().zip(src) {
        *d = s.to_f32();
    }
}

/// [`load`] of bf16 (`Element::to_f32`, a shift of the bits), vectorized.
#[multiversion(targets("x86_64+avx512f+avx512vl+avx2+fma", "x86_64+avx2+fma"))]
fn load_bf16(src: &[bf16], dst: &mut [f32]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = Element::to_f32(s);
    }
}

/// [`store`] to bf16 (`Element::from_f32`: round to nearest even, branch-free), vectorized.
#[multiversion(targets("x86_64+avx512f+avx512vl+avx2+fma", "x86_64+avx2+fma"))]
fn store_bf16(src: &[f32], dst: &mut [bf16]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = Element::from_f32(s);
    }
}

/// Widens `src` to f32 and multiplies by `scale` (`1/T_temp`) into `dst`.
#[inline]
pub fn load_scaled<E: Element>(src: &[E], scale: f32, dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = s.to_f32() * scale;
    }
}

/// Rounds `src` into `dst`'s element type. f32 destinations are written with
/// non-temporal stores where the CPU has AVX-512: the output is not read again soon,
/// and streaming stores skip reading each destination line before writing it.
#[inline]
pub fn store<E: Element>(src: &[f32], dst: &mut [E]) {
    if let Some(dst) = E::as_f32_mut(dst) {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked just above).
            unsafe { stream_store_avx512(src, dst) };
            return;
        }
        dst.copy_from_slice(&src[..dst.len()]);
        return;
    }
    if let Some(dst) = E::as_bf16_mut(dst) {
        return store_bf16(src, dst);
    }
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = E::from_f32(s);
    }
}

/// Copies `src` into `dst` with 64-byte non-temporal stores on the aligned middle.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn stream_store_avx512(src: &[f32], dst: &mut [f32]) {
    use std::arch::x86_64::{_mm_sfence, _mm512_loadu_ps, _mm512_stream_ps};
    let n = dst.len();
    let head = (dst.as_ptr().align_offset(64)).min(n);
    dst[..head].copy_from_slice(&src[..head]);
    let mut j = head;
    while j + 16 <= n {
        // SAFETY: j + 16 ≤ n ≤ src.len(); dst + j is 64-byte aligned by construction.
        unsafe {
            let v = _mm512_loadu_ps(src.as_ptr().add(j));
            _mm512_stream_ps(dst.as_mut_ptr().add(j), v);
        }
        j += 16;
    }
    dst[j..].copy_from_slice(&src[j..n]);
    // Order the streaming stores before any later ordinary access.
    _mm_sfence();
}

/// `max_j x_j` (`-inf` for an empty or all `-inf` slice; NaN entries are skipped).
#[multiversion(targets("x86_64+avx512f+avx512vl+avx2+fma", "x86_64+avx2+fma"))]
pub fn max(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for k in 0..LANES {
            acc[k] = if c[k] > acc[k] { c[k] } else { acc[k] };
        }
    }
    acc.iter()
        .chain(tail)
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m })
}

/// `Σ_j x_j`: f32 lanes over blocks of `F32_BLOCK` vectors, then f64.
#[multiversion(targets("x86_64+avx512f+avx512vl+avx2+fma", "x86_64+avx2+fma"))]
pub fn sum(x: &[f32]) -> f64 {
    let mut total = [0.0f64; LANES];
    let blocks = x.chunks_exact(LANES * F32_BLOCK);
    let tail = blocks.remainder();
    for block in blocks {
        let mut s32 = [0.0f32; LANES];
        for c in block.chunks_exact(LANES) {
            for k in 0..LANES {
                s32[k] += c[k];
            }
        }
        for k in 0..LANES {
            total[k] += s32[k] as f64;
        }
    }
    for (k, &v) in tail.iter().enumerate() {
        total[k % LANES] += v as f64;
    }
    total.iter().sum()
}

/// Vectors of [`LANES`] summed in f32 before they are added to the f64 lane sums:
/// few enough that small terms beside a large one are not lost, many enough that the
/// f64 work is negligible.
const F32_BLOCK: usize = 8;

/// `(Σ_j e_j, Σ_j e_j·d_j, Σ_j e_j²)` with `d_j = (x_j - shift)·scale ≤ 0`,
/// `e_j = exp(d_j)`, for `shift ≥ max_j x_j`; `-inf` entries contribute 0 to all. Subtracting before
/// scaling keeps `d_j` exact when `x` and `scale = 1/T_temp` are large; the sums run in
/// f32 lanes over blocks of `F32_BLOCK` vectors, then in f64 lanes.
#[multiversion(targets("x86_64+avx512f+avx512vl+avx2+fma", "x86_64+avx2+fma"))]
pub fn exp_sums(x: &[f32], shift: f32, scale: f32) -> (f64, f64, f64) {
    let mut sum = [0.0f64; LANES];
    let mut weighted = [0.0f64; LANES];
    let mut sum2 = [0.0f64; LANES];
    let blocks = x.chunks_exact(LANES * F32_BLOCK);
    let tail = blocks.remainder();
    for block in blocks {
        let mut s32 = [0.0f32; LANES];
        let mut w32 = [0.0f32; LANES];
        let mut q32 = [0.0f32; LANES];
        for c in block.chunks_exact(LANES) {
            for k in 0..LANES {
                let d = (c[k] - shift) * scale;
                let e = exp_nonpositive(d);
                s32[k] += e;
                w32[k] += if e > 0.0 { e * d } else { 0.0 };
                q32[k] += e * e;
            }
        }
        for k in 0..LANES {
            sum[k] += s32[k] as f64;
            weighted[k] += w32[k] as f64;
            sum2[k] += q32[k] as f64;
        }
    }
    for (k, &v) in tail.iter().enumerate() {
        let d = (v - shift) * scale;
        let e = exp_nonpositive(d);
        sum[k % LANES] += e as f64;
        weighted[k % LANES] += if e > 0.0 { (e * d) as f64 } else { 0.0 };
        sum2[k % LANES] += (e * e) as f64;
    }
    let total = |x: [f64; LANES]| x.iter().sum();
    (total(sum), total(weighted), total(sum2))
}

/// `x_j ← a·x_j + b`.
#[multiversion(targets("x86_64+avx512f+avx512vl+avx2+fma", "x86_64+avx2+fma"))]
pub fn scale_add(x: &mut [f32], a: f32, b: f32) {
    for v in x.iter_mut() {
        *v = a * *v + b;
    }
}

/// [`exp_sums`] that also writes `e_j` into `dst` (the one-`exp` logits kernel, the
/// single pass).
#[multiversion(targets("x86_64+avx512f+avx512vl+avx2+fma", "x86_64+avx2+fma"))]
pub fn exp_sums_store(x: &[f32], dst: &mut [f32], shift: f32, scale: f32) -> (f64, f64, f64) {
    let mut sum = [0.0f64; LANES];
    let mut weighted = [0.0f64; LANES];
    let mut sum2 = [0.0f64; LANES];
    let n = x.len().min(dst.len());
    let (x, dst) = (&x[..n], &mut dst[..n]);
    let full = n - n % (LANES * F32_BLOCK);
    for (block, out) in x[..full]
        .chunks_exact(LANES * F32_BLOCK)
        .zip(dst[..full].chunks_exact_mut(LANES * F32_BLOCK))
    {
        let mut s32 = [0.0f32; LANES];
        let mut w32 = [0.0f32; LANES];
        let mut q32 = [0.0f32; LANES];
        for (c, o) in block.chunks_exact(LANES).zip(out.chunks_exact_mut(LANES)) {
            for k in 0..LANES {
                let d = (c[k] - shift) * scale;
                let e = exp_nonpositive(d);
                o[k] = e;
                s32[k] += e;
                w32[k] += if e > 0.0 { e * d } else { 0.0 };
                q32[k] += e * e;
            }
        }
        for k in 0..LANES {
            sum[k] += s32[k] as f64;
            weighted[k] += w32[k] as f64;
            sum2[k] += q32[k] as f64;
        }
    }
    for (k, (&v, o)) in x[full..].iter().zip(&mut dst[full..]).enumerate() {
        let d = (v - shift) * scale;
        let e = exp_nonpositive(d);
        *o = e;
        sum[k % LANES] += e as f64;
        weighted[k % LANES] += if e > 0.0 { (e * d) as f64 } else { 0.0 };
        sum2[k % LANES] += (e * e) as f64;
    }
    let total = |x: [f64; LANES]| x.iter().sum();
    (total(sum), total(weighted), total(sum2))
}

/// [`softmax_grad`]'s general formula (no soft-cap, no uniform term) from stored
/// exponentials: `p_j = c·e_j`, `log p_j = (z_j - max)·scale - log_sum`; writes the
/// gradient over `e`.
#[multiversion(targets("x86_64+avx512f+avx512vl+avx2+fma", "x86_64+avx2+fma"))]
pub fn rescaled_grad(e: &mut [f32], z: &[f32], c: f32, g: &SoftmaxGrad) {
    for (v, &x) in e.iter_mut().zip(z) {
        let p = c * *v;
        let log_p = (x - g.max) * g.scale - g.log_sum;
        let h = if p > 0.0 {
            p * (log_p + g.entropy)
        } else {
            0.0
        };
        *v = g.coef_p * p + g.coef_h * h;
    }
}

/// `tanh(x)` in f32 (within a few ulp): an odd polynomial below 0.625 in magnitude
/// (Cephes `tanhf` coefficients), else `1 - 2/(exp(2|x|) + 1)` with the sign of x.
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let a = x.abs();
    let z = x * x;
    let small =
        ((((-5.704_988_7e-3 * z + 2.063_909e-2) * z - 5.373_971_6e-2) * z + 1.333_144_2e-1) * z
            - 3.333_328e-1)
            * z
            * x
            + x;
    let large = 1.0 - 2.0 / (exp(2.0 * a) + 1.0);
    if a < 0.625 {
        small
    } else if x < 0.0 {
        -large
    } else {
        large
    }
}

/// Logit soft-cap in place: `z ← cap·tanh(z/cap)`.
#[multiversion(targets("x86_64+avx512f+avx512vl+avx2+fma", "x86_64+avx2+fma"))]
pub fn softcap(z: &mut [f32], cap: f32) {
    let inv = 1.0 / cap;
    for v in z.iter_mut() {
        *v = cap * tanh(*v * inv);
    }
}

/// Coefficients of [`softmax_grad`]: `log p_j = (x_j - max)·scale - log_sum`.
#[derive(Debug, Clone, Copy, Default)]
pub struct SoftmaxGrad {
    /// Row max of the raw logits.
    pub max: f32,
    /// `1 / T_temp`.
    pub scale: f32,
    /// `log Σ exp((x - max)·scale)`.
    pub log_sum: f32,
    /// Multiplies `p_j`.
    pub coef_p: f32,
    /// Multiplies `p_j·(log p_j + entropy)`.
    pub coef_h: f32,
    /// Row entropy `H`.
    pub entropy: f32,
    /// Added to every element (label smoothing's `-ε/V` term).
    pub uniform: f32,
    /// `1/cap` of a logit soft-cap whose output `x` is (0: none): the result is
    /// multiplied by the cap's slope `1 - (x/cap)²`.
    pub inv_cap: f32,
}

/// The soft-cap slope `1 - (x/cap)²` at a capped logit `x` (1 without a cap).
#[inline(always)]
pub fn softcap_slope(x: f32, inv_cap: f32) -> f32 {
    let t = x * inv_cap;
    1.0 - t * t
}

/// The softmax-gradient tile over logits `x`: with `p_j = exp(log p_j)`, writes
/// `x_j ← (coef_p·p_j + coef_h·p_j·(log p_j + entropy) + uniform)·slope(x_j)`
/// (entropy term 0 where `p_j = 0`; slope 1 without a soft-cap).
#[multiversion(targets("x86_64+avx512f+avx512vl+avx2+fma", "x86_64+avx2+fma"))]
pub fn softmax_grad(x: &mut [f32], g: &SoftmaxGrad) {
    let SoftmaxGrad {
        max,
        scale,
        log_sum,
        coef_p,
        coef_h,
        uniform,
        inv_cap,
        ..
    } = *g;
    if coef_h == 0.0 && uniform == 0.0 && inv_cap == 0.0 {
        for v in x.iter_mut() {
            *v = coef_p * exp_nonpositive((*v - max) * scale - log_sum);
        }
    } else if inv_cap == 0.0 {
        general_grad::<false>(x, g);
    } else {
        general_grad::<true>(x, g);
    }
}

/// [`softmax_grad`] with every term; `CAPPED` multiplies by the soft-cap slope (kept
/// out of the uncapped loop, where `-inf` logits would make it NaN).
#[inline(always)]
fn general_grad<const CAPPED: bool>(x: &mut [f32], g: &SoftmaxGrad) {
    for v in x.iter_mut() {
        let log_p = (*v - g.max) * g.scale - g.log_sum;
        let p = exp_nonpositive(log_p);
        let h = if p > 0.0 {
            p * (log_p + g.entropy)
        } else {
            0.0
        };
        let d = g.coef_p * p + g.coef_h * h + g.uniform;
        *v = if CAPPED {
            d * softcap_slope(*v, g.inv_cap)
        } else {
            d
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_f64_within_two_ulp() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let got = exp(x) as f64;
            let want = (x as f64).exp();
            worst = worst.max(((got - want) / want).abs());
            x += 0.000_37;
        }
        assert!(worst < 2.5e-7, "worst relative error {worst}");
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-100.0), 0.0);
        assert!(exp(f32::NAN).is_nan());
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn tanh_matches_f64() {
        let mut worst = 0.0f64;
        let mut x = -12.0f32;
        while x < 12.0 {
            let got = tanh(x) as f64;
            let want = (x as f64).tanh();
            worst = worst.max((got - want).abs() / want.abs().max(1e-30));
            x += 0.000_71;
        }
        assert!(worst < 1e-6, "worst relative error {worst}");
        assert_eq!(tanh(0.0), 0.0);
        assert_eq!(tanh(100.0), 1.0);
        assert_eq!(tanh(-100.0), -1.0);
        assert!(tanh(f32::NAN).is_nan());
    }

    #[test]
    fn reductions_handle_tails_and_neg_inf() {
        let x: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin() * 5.0).collect();
        let want_max = x.iter().cloned().fold(f32::MIN, f32::max);
        assert_eq!(max(&x), want_max);
        let (s, w, q) = exp_sums(&x, want_max, 1.0);
        let s_ref: f64 = x.iter().map(|&v| ((v - want_max) as f64).exp()).sum();
        let q_ref: f64 = x.iter().map(|&v| (2.0 * (v - want_max) as f64).exp()).sum();
        assert!(((q - q_ref) / q_ref).abs() < 1e-6);
        let w_ref: f64 = x
            .iter()
            .map(|&v| ((v - want_max) as f64).exp() * (v - want_max) as f64)
            .sum();
        assert!(((s - s_ref) / s_ref).abs() < 1e-6);
        assert!(((w - w_ref) / w_ref).abs() < 1e-5);
        let neg = [f32::NEG_INFINITY; 20];
        assert_eq!(max(&neg), f32::NEG_INFINITY);
        let mut with_inf = x.clone();
        with_inf[3] = f32::NEG_INFINITY;
        let (s2, w2, q2) = exp_sums(&with_inf, want_max, 1.0);
        assert!(s2.is_finite() && w2.is_finite() && q2.is_finite());
    }
}

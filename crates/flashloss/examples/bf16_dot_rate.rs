//! Issue 15, item 5: would an AVX-512 BF16 dot-product path beat widening bf16 tiles to
//! f32 for the `gemm` crate? The compute bound of each, on one core: 24 independent
//! accumulators (enough to hide latency), no memory traffic.
//!
//! - `vdpbf16ps zmm`: 16 lanes × 2 bf16 products × 2 FLOPs = 64 FLOPs per instruction;
//! - `vfmadd231ps zmm`: 16 lanes × 2 FLOPs = 32 FLOPs per instruction.
//!
//! If `vdpbf16ps` issues as often as the FMA, a bf16 path has twice the f32 peak; if at
//! half the rate, the same peak, and it would only save the widening (O(V·H) per row
//! block, against O(rows·V·H) FLOPs). Prints one JSON object.
//!
//! `cargo run --release -p flashloss --example bf16_dot_rate`

use std::time::Instant;

const ACCUMULATORS: usize = 24;
const ITERATIONS: usize = 20_000_000;

#[cfg(target_arch = "x86_64")]
mod probe {
    use super::{ACCUMULATORS, ITERATIONS};
    use std::arch::x86_64::*;
    use std::hint::black_box;

    /// `ITERATIONS × ACCUMULATORS` `vdpbf16ps`; returns a sum so nothing is elided.
    #[target_feature(enable = "avx512bf16,avx512f")]
    pub unsafe fn dpbf16() -> f32 {
        let mut acc = [_mm512_setzero_ps(); ACCUMULATORS];
        // SAFETY (transmute): __m512i and __m512bh are both 512 bits of lanes.
        let (a, b) = unsafe {
            (
                std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(black_box(0x3f80_3f80))),
                std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(black_box(0x0001_0001))),
            )
        };
        for _ in 0..black_box(ITERATIONS) {
            for x in acc.iter_mut() {
                *x = _mm512_dpbf16_ps(*x, a, b);
            }
        }
        let sum = acc
            .iter()
            .fold(_mm512_setzero_ps(), |s, &x| _mm512_add_ps(s, x));
        _mm512_reduce_add_ps(sum)
    }

    /// `ITERATIONS × ACCUMULATORS` `vfmadd231ps`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn fma_f32() -> f32 {
        let mut acc = [_mm512_setzero_ps(); ACCUMULATORS];
        let (a, b) = (
            _mm512_set1_ps(black_box(1.000_000_1)),
            _mm512_set1_ps(black_box(1e-30)),
        );
        for _ in 0..black_box(ITERATIONS) {
            for x in acc.iter_mut() {
                *x = _mm512_fmadd_ps(*x, a, b);
            }
        }
        let sum = acc
            .iter()
            .fold(_mm512_setzero_ps(), |s, &x| _mm512_add_ps(s, x));
        _mm512_reduce_add_ps(sum)
    }
}

/// GFLOP/s of `run`, whose instructions each do `flops_per_instruction`: the best of 3.
fn rate(run: impl Fn() -> f32, flops_per_instruction: usize) -> f64 {
    let flops = (ITERATIONS * ACCUMULATORS * flops_per_instruction) as f64;
    (0..3)
        .map(|_| {
            let start = Instant::now();
            std::hint::black_box(run());
            flops / start.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}

fn main() {
    #[cfg(target_arch = "x86_64")]
    {
        let has_bf16 = is_x86_feature_detected!("avx512bf16");
        let has_f = is_x86_feature_detected!("avx512f");
        // SAFETY: each probe runs only where its target features were detected.
        let fma = has_f.then(|| rate(|| unsafe { probe::fma_f32() }, 32));
        let bf16 = has_bf16.then(|| rate(|| unsafe { probe::dpbf16() }, 64));
        let ratio = fma.zip(bf16).map(|(f, b)| b / f);
        println!(
            "{{\"avx512f\": {has_f}, \"avx512bf16\": {has_bf16}, \"fma_f32_gflops_per_core\": {}, \"dpbf16_gflops_per_core\": {}, \"dpbf16_over_fma\": {}}}",
            json(fma),
            json(bf16),
            json(ratio)
        );
    }
    #[cfg(not(target_arch = "x86_64"))]
    println!("{{\"avx512bf16\": false}}");
}

fn json(x: Option<f64>) -> String {
    x.map_or("null".into(), |v| format!("{v:.1}"))
}

//! Issue 24, item 1, measured alone: the fused step's three tile products on a bf16 head,
//! widened to f32 for the `gemm` crate (what shipped) against bf16 operands on
//! `vdpbf16ps` (`flashloss::cpu::bf16_gemm`, packing included), in the single-pass
//! block's layout: two lanes side by side, one thread each, tile `k` in lane `k mod 2`,
//! one block of `ROWS` rows over the whole vocabulary.
//!
//! Prediction (written before the first run): the probe `bf16_dot_rate` gives 117 (f32
//! FMA) and 235 (`vdpbf16ps`) GFLOP/s per core here. The `gemm` crate's f32 tiles ran at
//! ~85% of the f32 peak (docs/results/cpu_bench.md), ~100 GFLOP/s a core; the bf16 micro-kernel
//! (28 accumulators, one `vdpbf16ps` per cycle) should reach ~85% of its peak in the
//! loop, less ~5% for packing the weight tile twice and `dZ` twice: ~180-190 GFLOP/s a
//! core, 1.7-1.9x the widened f32 products.
//!
//! `cargo run --release -p flashloss --example bf16_tile_rate` (prints JSON).

use flashloss::cpu::Avx512Bf16;
use flashloss::cpu::bf16_gemm::{PackedA, PackedB};
use flashloss::cpu::matmul::{MatRef, matmul_on};
use half::bf16;
use rayon::prelude::*;
use std::time::Instant;

const H: usize = 1024;
const VOCAB_TILE: usize = 2048;
const TILES: usize = 74;
const ROWS: usize = 256;
const LANES: usize = 2;

#[derive(Clone, Copy, Debug)]
enum Product {
    /// `Z[rows, vt] = H[rows]·W[tile]ᵀ`.
    Logits,
    /// `dH[rows] += dZ·W[tile]`, `dZ` read from `dZᵀ` `[vt, rows]`.
    DHidden,
    /// `dW[tile] += dZᵀ·H[rows]`.
    DWeight,
}

/// Per-lane buffers: the f32 tile (`Z` or `dZᵀ`), a widened weight tile, the output.
#[derive(Default)]
struct Lane {
    tile: Vec<f32>,
    wide: Vec<f32>,
    out: Vec<f32>,
    pa: PackedA,
    pb: PackedB,
}

/// Seconds for `product` over every tile, widened f32 (`cpu` None) or bf16.
fn run(product: Product, cpu: Option<Avx512Bf16>, hid: &[bf16], w: &[bf16]) -> f64 {
    let hid_f32: Vec<f32> = hid.iter().map(|x| x.to_f32()).collect();
    let (mut hid_a, mut hid_b) = (PackedA::default(), PackedB::default());
    let mut lanes: Vec<Lane> = (0..LANES)
        .map(|_| Lane {
            tile: vec![1e-3; ROWS * VOCAB_TILE],
            out: vec![0.0; VOCAB_TILE.max(ROWS) * H],
            ..Lane::default()
        })
        .collect();
    let start = Instant::now();
    if cpu.is_some() {
        // Once per row block.
        hid_a.pack_a(MatRef::row_major(hid, ROWS, H), 1);
        hid_b.pack_b(MatRef::row_major(hid, ROWS, H), 1);
    }
    lanes.par_iter_mut().enumerate().for_each(|(l, lane)| {
        for k in (l..TILES).step_by(LANES) {
            let wt = &w[k * VOCAB_TILE * H..][..VOCAB_TILE * H];
            let dz_t = MatRef::row_major(&lane.tile[..], VOCAB_TILE, ROWS);
            match cpu {
                None => {
                    lane.wide.resize(wt.len(), 0.0);
                    lane.wide
                        .iter_mut()
                        .zip(wt)
                        .for_each(|(d, x)| *d = x.to_f32());
                    let wide = MatRef::row_major(&lane.wide[..], VOCAB_TILE, H);
                    let hid = MatRef::row_major(&hid_f32[..], ROWS, H);
                    match product {
                        Product::Logits => {
                            matmul_on(&mut lane.tile, VOCAB_TILE, hid, wide.t(), false, 1)
                        }
                        Product::DHidden => matmul_on(&mut lane.out, H, dz_t.t(), wide, true, 1),
                        Product::DWeight => matmul_on(&mut lane.out, H, dz_t, hid, true, 1),
                    }
                }
                Some(cpu) => {
                    let wt = MatRef::row_major(wt, VOCAB_TILE, H);
                    match product {
                        Product::Logits => {
                            lane.pb.pack_b(wt.t(), 1);
                            cpu.gemm(&mut lane.tile, VOCAB_TILE, &hid_a, &lane.pb, false, 1);
                        }
                        Product::DHidden => {
                            lane.pa.pack_a(dz_t.t(), 1);
                            lane.pb.pack_b(wt, 1);
                            cpu.gemm(&mut lane.out, H, &lane.pa, &lane.pb, true, 1);
                        }
                        Product::DWeight => {
                            lane.pa.pack_a(dz_t, 1);
                            cpu.gemm(&mut lane.out, H, &lane.pa, &hid_b, true, 1);
                        }
                    }
                }
            }
        }
    });
    std::hint::black_box(&lanes);
    start.elapsed().as_secs_f64()
}

fn main() {
    let Some(cpu) = Avx512Bf16::detect() else {
        println!("{{\"skipped\": \"this CPU has no AVX512-BF16\"}}");
        return;
    };
    rayon::ThreadPoolBuilder::new()
        .num_threads(LANES)
        .build_global()
        .unwrap();
    let value = |i: usize| bf16::from_f32(((i * 7919 % 1000) as f32 - 500.0) * 1e-3);
    let hid: Vec<bf16> = (0..ROWS * H).map(value).collect();
    let w: Vec<bf16> = (0..TILES * VOCAB_TILE * H).map(|i| value(i + 13)).collect();
    let flops = 2.0 * (ROWS * H * TILES * VOCAB_TILE) as f64;
    let mut fields = Vec::new();
    for product in [Product::Logits, Product::DHidden, Product::DWeight] {
        // Warm-up, then the median of three, widened and bf16 alternating.
        let (mut wide, mut dot) = (Vec::new(), Vec::new());
        for round in 0..4 {
            let a = run(product, None, &hid, &w);
            let b = run(product, Some(cpu), &hid, &w);
            if round > 0 {
                wide.push(a);
                dot.push(b);
            }
        }
        let median = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let (wide, dot) = (flops / median(wide) / 1e9, flops / median(dot) / 1e9);
        fields.push(format!(
            "\"{product:?}\": {{\"widened_f32_gflops\": {wide:.1}, \"avx512bf16_gflops\": {dot:.1}, \"speedup\": {:.2}}}",
            dot / wide
        ));
    }
    println!(
        "{{\"rows\": {ROWS}, \"hidden\": {H}, \"vocab_tile\": {VOCAB_TILE}, \"tiles\": {TILES}, \"lanes\": {LANES}, {}}}",
        fields.join(", ")
    );
}

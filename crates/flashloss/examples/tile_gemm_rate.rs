//! The rate of the fused step's three tile products, one product at a time on every
//! thread against two lanes of single-threaded products side by side (the compact
//! block's lanes), set against the plain `[N,H]×[H,V]` GEMM of the same run. Inputs are
//! constant (the rate does not depend on them); each product streams a different
//! weight tile, as the fused step does.
//!
//! `cargo run --release -p flashloss --example tile_gemm_rate` (prints JSON).

use flashloss::cpu::matmul::{MatRef, matmul_on};
use rayon::prelude::*;
use std::time::Instant;

const N: usize = 2048;
const H: usize = 1024;
const VOCAB_TILE: usize = 2048;
const TILES: usize = 74;
const ROWS: usize = 512;

/// One tile product: `dst (+)= a·b` with the tile buffers of the fused step.
#[derive(Clone, Copy)]
enum Product {
    /// `Z[rows, vt] = H[rows]·W[tile]ᵀ`.
    Logits,
    /// `dH[rows] += dZ·W[tile]`, `dZ` read from `dZᵀ` `[vt, rows]`.
    DHidden,
    /// `dW[tile] += dZᵀ·H[rows]`.
    DWeight,
}

/// Runs `product` for every (row block, tile), `lanes` lanes side by side (tile `k` in
/// lane `k mod lanes`), each product on `threads` threads; returns seconds.
fn run(product: Product, lanes: usize, threads: usize, hid: &[f32], w: &[f32]) -> f64 {
    let mut bufs: Vec<(Vec<f32>, Vec<f32>)> = (0..lanes)
        .map(|_| {
            (
                vec![0.5f32; ROWS * VOCAB_TILE],
                vec![0.0f32; ROWS.max(VOCAB_TILE) * H],
            )
        })
        .collect();
    let start = Instant::now();
    for block in 0..N / ROWS {
        let h_blk = MatRef::row_major(&hid[block * ROWS * H..(block + 1) * ROWS * H], ROWS, H);
        bufs.par_iter_mut()
            .enumerate()
            .for_each(|(lane, (tile, out))| {
                for k in (lane..TILES).step_by(lanes) {
                    let w_tile = MatRef::row_major(
                        &w[k * VOCAB_TILE * H..][..VOCAB_TILE * H],
                        VOCAB_TILE,
                        H,
                    );
                    match product {
                        Product::Logits => {
                            matmul_on(tile, VOCAB_TILE, h_blk, w_tile.t(), false, threads)
                        }
                        Product::DHidden => {
                            let dz = MatRef {
                                data: tile,
                                rows: ROWS,
                                cols: VOCAB_TILE,
                                row_stride: 1,
                                col_stride: ROWS,
                            };
                            matmul_on(out, H, dz, w_tile, true, threads);
                        }
                        Product::DWeight => {
                            let dz_t = MatRef::row_major(tile, VOCAB_TILE, ROWS);
                            matmul_on(out, H, dz_t, h_blk, true, threads);
                        }
                    }
                }
            });
    }
    start.elapsed().as_secs_f64()
}

fn main() {
    let v = VOCAB_TILE * TILES;
    let hid: Vec<f32> = (0..N * H).map(|i| (i % 97) as f32 * 0.01).collect();
    let w: Vec<f32> = (0..v * H).map(|i| (i % 89) as f32 * 0.01).collect();
    let threads = rayon::current_num_threads();
    let gflops = |s: f64| 2.0 * (N * H * v) as f64 / s / 1e9;
    let mut z = vec![0.0f32; N * v];
    let plain = (0..2)
        .map(|_| {
            let start = Instant::now();
            let a = MatRef::row_major(&hid, N, H);
            matmul_on(
                &mut z,
                v,
                a,
                MatRef::row_major(&w, v, H).t(),
                false,
                threads,
            );
            start.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min);
    drop(z);
    let mut fields = vec![format!("\"plain_gemm_gflops\": {:.1}", gflops(plain))];
    for (name, product) in [
        ("logits", Product::Logits),
        ("dhidden", Product::DHidden),
        ("dweight", Product::DWeight),
    ] {
        let one = (0..2)
            .map(|_| run(product, 1, threads, &hid, &w))
            .fold(f64::INFINITY, f64::min);
        let lanes = (0..2)
            .map(|_| run(product, 2, (threads / 2).max(1), &hid, &w))
            .fold(f64::INFINITY, f64::min);
        fields.push(format!("\"{name}_one_product_gflops\": {:.1}", gflops(one)));
        fields.push(format!("\"{name}_two_lanes_gflops\": {:.1}", gflops(lanes)));
    }
    println!("{{{}}}", fields.join(", "));
}

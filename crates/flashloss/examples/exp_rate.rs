//! Issue 24, item 3: what a logits-level kernel with one `exp` per logit would cost in
//! compute alone, on bf16 logits. Each core runs, over a cache-resident 2048-entry tile
//! (`VOCAB_TILE`), the steps such a kernel needs per logit: widen bf16 → f32, the max,
//! `e = exp(z - max)` stored with its sums (`exp_sums_store`), the rescale `c·e + b`,
//! and the rounding to bf16. No memory traffic: the sum of the steps is a floor on the
//! kernel's time, to set against the memory-bound target (80% of the copy bandwidth).
//! Prints one JSON object: ns per logit per core for each step, and the floor for
//! N × V logits on all cores.
//!
//! `cargo run --release -p flashloss --example exp_rate [-- N V]`

use flashloss::cpu::simd;
use half::bf16;
use rayon::prelude::*;
use std::hint::black_box;
use std::time::Instant;

const TILE: usize = flashloss::cpu::VOCAB_TILE;
const REPEATS: usize = 40_000;

/// One step of the kernel on a core's buffers.
type Step<'a> = &'a (dyn Fn(&mut Buffers) + Sync);

/// Seconds per call of `step` on every core at once (each core its own buffers).
fn per_call(step: Step) -> f64 {
    let threads = rayon::current_num_threads();
    let mut all: Vec<Buffers> = (0..threads).map(Buffers::new).collect();
    let start = Instant::now();
    all.par_iter_mut().for_each(|b| {
        for _ in 0..REPEATS {
            step(b);
        }
    });
    start.elapsed().as_secs_f64() / REPEATS as f64
}

struct Buffers {
    logits: Vec<bf16>,
    z: Vec<f32>,
    e: Vec<f32>,
    out: Vec<bf16>,
    sink: f64,
}

impl Buffers {
    fn new(seed: usize) -> Self {
        let logits = (0..TILE)
            .map(|j| bf16::from_f32(((j * 7919 + seed) % 1000) as f32 * 0.02 - 10.0))
            .collect();
        Buffers {
            logits,
            z: vec![0.0; TILE],
            e: vec![0.0; TILE],
            out: vec![bf16::ZERO; TILE],
            sink: 0.0,
        }
    }
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let (n, v) = (
        args.first().copied().unwrap_or(2048),
        args.get(1).copied().unwrap_or(151_936),
    );
    let steps: [(&str, Step); 5] = [
        ("widen_bf16", &|b| {
            simd::load(black_box(&b.logits[..]), &mut b.z)
        }),
        ("max", &|b| b.sink += simd::max(black_box(&b.z[..])) as f64),
        ("exp_sums_store", &|b| {
            b.sink += simd::exp_sums_store(black_box(&b.z[..]), &mut b.e, 0.0, 1.0).0
        }),
        ("rescale", &|b| {
            simd::scale_add(black_box(&mut b.e[..]), 0.5, 1e-9)
        }),
        ("round_bf16", &|b| {
            simd::store(black_box(&b.e[..]), &mut b.out)
        }),
    ];
    let cores = rayon::current_num_threads();
    let mut fields = Vec::new();
    let mut total = 0.0;
    for (name, step) in steps {
        per_call(step);
        let ns = per_call(step) * 1e9 / TILE as f64;
        total += ns;
        fields.push(format!("\"{name}_ns_per_logit_per_core\": {ns:.4}"));
    }
    let floor_s = total * 1e-9 * (n * v) as f64 / cores as f64;
    println!(
        "{{{}, \"one_exp_ns_per_logit_per_core\": {total:.4}, \"cores\": {cores}, \"logits\": {}, \"one_exp_floor_s\": {floor_s:.4}}}",
        fields.join(", "),
        n * v
    );
}

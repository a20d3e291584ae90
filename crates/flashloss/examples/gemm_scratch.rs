//! Peak bytes the `gemm` crate allocates for each tile product of a compact lane
//! (f32, a block of 512 rows, a 2048-entry vocabulary tile, H = 1024), on one thread
//! and on two: the per-thread packing buffer that the CPU plan reserves (allocated by a
//! thread's first product and kept, so only the first product shows it), and what every
//! dH product adds to pack `dZᵀ`.
//!
//! `cargo run --release -p flashloss --example gemm_scratch` (prints JSON).

use flashloss::cpu::matmul::{MatRef, matmul_on};
use flashloss::memory;

#[global_allocator]
static A: memory::TrackingAllocator = memory::TrackingAllocator;

fn main() {
    let (rows, h, vt) = (512usize, 1024usize, 2048usize);
    let hid = vec![0.5f32; rows * h];
    let w = vec![0.25f32; vt * h];
    let mut tile = vec![0.0f32; rows * vt];
    let mut dh = vec![0.0f32; rows * h];
    let mut dw = vec![0.0f32; vt * h];
    let mut fields = Vec::new();
    for threads in [1, 2] {
        let mut peak_of = |name: &str, product: &mut dyn FnMut()| {
            let base = memory::in_use();
            memory::reset_peak();
            product();
            fields.push(format!(
                "\"{name}_{threads}_threads_bytes\": {}",
                memory::peak() - base
            ));
        };
        let h_blk = MatRef::row_major(&hid, rows, h);
        let w_tile = MatRef::row_major(&w, vt, h);
        peak_of("logits", &mut || {
            matmul_on(&mut tile, vt, h_blk, w_tile.t(), false, threads)
        });
        let dz = MatRef {
            data: &tile,
            rows,
            cols: vt,
            row_stride: 1,
            col_stride: rows,
        };
        peak_of("dhidden", &mut || {
            matmul_on(&mut dh, h, dz, w_tile, true, threads)
        });
        let dz_t = MatRef::row_major(&tile, vt, rows);
        peak_of("dweight", &mut || {
            matmul_on(&mut dw, h, dz_t, h_blk, true, threads)
        });
    }
    println!("{{{}}}", fields.join(", "));
}

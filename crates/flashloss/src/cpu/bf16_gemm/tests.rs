//! The bf16 products against f64 sums of the rounded operands, and the packers' rounding.
use super::*;

fn round(x: f32) -> f64 {
    bf16::from_f32(x).to_f64()
}

/// Random-ish values over several binades.
fn values(len: usize, seed: u32) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let t = (i as f32 * 0.6180339 + seed as f32 * 0.1234).fract();
            (t - 0.5) * (1.0 + (i % 7) as f32 * 3.0)
        })
        .collect()
}

/// The branch-free rounding (`element::bf16_bits`) equals `half`'s
/// round-to-nearest-even on finite values (ties, carries into the exponent, the
/// largest finite values, denormals) and keeps a NaN a NaN.
#[test]
fn f32_rounds_to_nearest_even_like_half() {
    let mut bits: Vec<u32> = (0..200_000u32)
        .map(|i| i.wrapping_mul(2_654_435_761))
        .collect();
    bits.extend([
        0x3f80_8000,
        0x3f81_8000,
        0x3f80_7fff,
        0x7f7f_ffff,
        0x0000_8000,
        0x807f_ffff,
    ]);
    for b in bits {
        let x = f32::from_bits(b);
        let got = Bf16Bits::bits(x);
        if x.is_nan() {
            assert!(bf16::from_bits(got).is_nan(), "{b:#x}");
        } else {
            assert_eq!(got, bf16::from_f32(x).to_bits(), "{b:#x}");
        }
    }
}

/// `c (+)= a·b` in f64 on the bf16-rounded operands, against the packed product
/// through every packer path (contiguous `k`, contiguous outer, neither), with
/// poisoned entries beyond the tile left alone and one and three threads equal.
#[test]
fn matches_f64_products_of_rounded_operands() {
    let Some(cpu) = Avx512Bf16::detect() else {
        eprintln!("skipped: this CPU has no AVX512-BF16");
        return;
    };
    for (m, k, n) in [
        (1, 1, 1),
        (13, 7, 33),
        (14, 64, 32),
        (29, 101, 70),
        (45, 256, 97),
        (17, 4 * KC_PAIRS + 3, 40), // three k blocks, the last one partial
    ] {
        for (layout, accumulate) in [(0, false), (1, true), (2, false)] {
            let a_data = values(m * k + 5, 1);
            let b_data = values(k * n + 5, 2);
            // layout 0: a row-major, b row-major; 1: both transposed; 2: strided.
            let (a, b) = match layout {
                0 => (
                    MatRef::row_major(&a_data, m, k),
                    MatRef::row_major(&b_data, k, n),
                ),
                1 => (
                    MatRef::row_major(&a_data, k, m).t(),
                    MatRef::row_major(&b_data, n, k).t(),
                ),
                _ => (
                    MatRef {
                        data: &a_data,
                        rows: m,
                        cols: k,
                        row_stride: 1,
                        col_stride: m,
                    },
                    MatRef {
                        data: &b_data,
                        rows: k,
                        cols: n,
                        row_stride: n,
                        col_stride: 1,
                    },
                ),
            };
            let a16: Vec<bf16> = a_data.iter().map(|&x| bf16::from_f32(x)).collect();
            let a16 = MatRef {
                data: &a16[..],
                rows: a.rows,
                cols: a.cols,
                row_stride: a.row_stride,
                col_stride: a.col_stride,
            };
            let ldc = n + 3;
            let init = values(m * ldc, 3);
            let mut results = Vec::new();
            for threads in [1, 3] {
                // Buffers that held NaNs: words the packers leave must not matter.
                let (mut pa, mut pb) = (PackedA::default(), PackedB::default());
                let nans = vec![f32::NAN; (m + 15) * (k + 33) + (k + 33) * (n + 31)];
                pa.pack_a(MatRef::row_major(&nans, m + 15, k + 33), 1);
                pb.pack_b(MatRef::row_major(&nans, k + 33, n + 31), 1);
                // bf16 sources: layout 1's (contiguous along m) and, on 3 threads,
                // layout 0's (contiguous along k; equal to the f32 source's results).
                if layout == 1 || (layout == 0 && threads == 3) {
                    pa.pack_a(a16, threads);
                } else {
                    pa.pack_a(a, threads);
                }
                pb.pack_b(b, threads);
                let mut c = init.clone();
                c.iter_mut().enumerate().for_each(|(i, x)| {
                    if i % ldc >= n {
                        *x = f32::NAN;
                    }
                });
                cpu.gemm(&mut c, ldc, &pa, &pb, accumulate, threads);
                for i in 0..m {
                    for j in 0..ldc {
                        let got = c[i * ldc + j];
                        if j >= n {
                            assert!(got.is_nan(), "({i},{j}) beyond the tile was written");
                            continue;
                        }
                        let get = |v: MatRef<f32>, r: usize, s: usize| {
                            v.data[r * v.row_stride + s * v.col_stride]
                        };
                        let dot: f64 = (0..k)
                            .map(|p| round(get(a, i, p)) * round(get(b, p, j)))
                            .sum();
                        let want = dot
                            + if accumulate {
                                init[i * ldc + j] as f64
                            } else {
                                0.0
                            };
                        let scale: f64 = (0..k)
                            .map(|p| (round(get(a, i, p)) * round(get(b, p, j))).abs())
                            .sum::<f64>()
                            + init[i * ldc + j].abs() as f64;
                        assert!(
                            (got as f64 - want).abs()
                                <= 1e-6 * scale.max(1e-30) * (k as f64).sqrt(),
                            "[{m}x{k}x{n}] layout {layout} ({i},{j}): {got} vs {want}"
                        );
                    }
                }
                results.push(c);
            }
            let bits = |c: &Vec<f32>| c.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&results[0]),
                bits(&results[1]),
                "thread counts (or bf16 and f32 sources) differ"
            );
        }
    }
}

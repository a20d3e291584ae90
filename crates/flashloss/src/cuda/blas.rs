//! cuBLAS products of the fused LM-head kernels: `C = op(A)·op(B) + beta·C` through
//! `cublasGemmEx` with f32 or bf16 operands, f32 accumulation, and `C` in f32 (the
//! gradients, the f32 logits tile) or bf16 (a compact plan's logits chunk, `beta = 0`). cuBLAS is
//! column-major: a row-major `[r, c]` matrix with row stride `ld` is its column-major
//! transpose `[c, r]` with leading dimension `ld`; [`GemmShape`] maps each row-major
//! product onto those arguments.

use super::device::device_error;
use crate::error::{Error, Result};
use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t,
};
use cudarc::cublas::{CudaBlas, result as blas};

pub use crate::gpu_plan::CUBLAS_WORKSPACE_BYTES;

/// Column-major cuBLAS arguments `C[m, n] (ldc) = op(A)[m, k] (lda) · op(B)[k, n] (ldb)`
/// of a row-major product; `trans_a`/`trans_b` mean `op = ᵀ`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmShape {
    /// `op(A) = Aᵀ`.
    pub trans_a: bool,
    /// `op(B) = Bᵀ`.
    pub trans_b: bool,
    /// Rows of `C` (column-major).
    pub m: usize,
    /// Columns of `C`.
    pub n: usize,
    /// The contracted dimension.
    pub k: usize,
    /// Leading dimension of `A`.
    pub lda: usize,
    /// Leading dimension of `B`.
    pub ldb: usize,
    /// Leading dimension of `C`.
    pub ldc: usize,
}

impl GemmShape {
    /// `Z[rows, vt] (row stride ldz) = H[rows, h] · W[vt, h]ᵀ` with `A = W`, `B = H`:
    /// column-major `Zᵀ[vt, rows] = (W as [h, vt])ᵀ · (H as [h, rows])`.
    pub fn logits(rows: usize, vt: usize, h: usize, ldz: usize) -> Self {
        GemmShape {
            trans_a: true,
            trans_b: false,
            m: vt,
            n: rows,
            k: h,
            lda: h,
            ldb: h,
            ldc: ldz,
        }
    }

    /// `dH[rows, h] += dZ[rows, vt] (row stride ldz) · W[vt, h]` with `A = W`, `B = dZ`:
    /// column-major `dHᵀ[h, rows] = (W as [h, vt]) · (dZ as [vt, rows])`.
    pub fn dhidden(rows: usize, vt: usize, h: usize, ldz: usize) -> Self {
        GemmShape {
            trans_a: false,
            trans_b: false,
            m: h,
            n: rows,
            k: vt,
            lda: h,
            ldb: ldz,
            ldc: h,
        }
    }

    /// `dW[vt, h] += dZ[rows, vt]ᵀ (row stride ldz) · H[rows, h]` with `A = H`,
    /// `B = dZ`: column-major `dWᵀ[h, vt] = (H as [h, rows]) · (dZ as [vt, rows])ᵀ`.
    pub fn dweight(rows: usize, vt: usize, h: usize, ldz: usize) -> Self {
        GemmShape {
            trans_a: false,
            trans_b: true,
            m: h,
            n: vt,
            k: rows,
            lda: h,
            ldb: ldz,
            ldc: h,
        }
    }
    /// `[H, V]` weight (row stride `v`, its vocabulary block from column `vocab.start`):
    /// `Z[rows, vt] = H[rows, h] · W[:, vocab]` with `A = W`, `B = H`: column-major
    /// `Zᵀ[vt, rows] = (W as [vt, h], ld v) · (H as [h, rows])`.
    pub fn logits_hv(rows: usize, vt: usize, h: usize, ldz: usize, v: usize) -> Self {
        GemmShape {
            trans_a: false,
            trans_b: false,
            m: vt,
            n: rows,
            k: h,
            lda: v,
            ldb: h,
            ldc: ldz,
        }
    }

    /// `[H, V]` weight: `dH[rows, h] += dZ[rows, vt] · W[:, vocab]ᵀ` with `A = W`,
    /// `B = dZ`: column-major `dHᵀ[h, rows] = (W as [vt, h], ld v)ᵀ · (dZ as [vt, rows])`.
    pub fn dhidden_hv(rows: usize, vt: usize, h: usize, ldz: usize, v: usize) -> Self {
        GemmShape {
            trans_a: true,
            trans_b: false,
            m: h,
            n: rows,
            k: vt,
            lda: v,
            ldb: ldz,
            ldc: h,
        }
    }

    /// `[H, V]` weight: `dW[:, vocab] += H[rows, h]ᵀ · dZ[rows, vt]` (dW `[H, V]`, row
    /// stride `v`) with `A = dZ`, `B = H`: column-major
    /// `(dW as [vt, h], ld v) = (dZ as [vt, rows]) · (H as [h, rows])ᵀ`.
    pub fn dweight_hv(rows: usize, vt: usize, h: usize, ldz: usize, v: usize) -> Self {
        GemmShape {
            trans_a: false,
            trans_b: true,
            m: vt,
            n: h,
            k: rows,
            lda: ldz,
            ldb: h,
            ldc: v,
        }
    }
}

fn int_arg(what: &str, x: usize) -> Result<i32> {
    i32::try_from(x).map_err(|_| Error::InvalidArgument {
        arg: "hidden",
        reason: format!("{what} = {x} exceeds cuBLAS's 32-bit dimension limit"),
    })
}

/// An operand: its device address and cuBLAS type.
#[derive(Clone, Copy)]
pub(crate) struct Operand {
    pub(crate) addr: u64,
    pub(crate) dtype: cudaDataType_t,
}

impl Operand {
    /// An f32 matrix at `addr`.
    pub(crate) fn f32(addr: u64) -> Self {
        Operand {
            addr,
            dtype: cudaDataType_t::CUDA_R_32F,
        }
    }

    /// A bf16 matrix at `addr`.
    pub(crate) fn bf16(addr: u64) -> Self {
        Operand {
            addr,
            dtype: cudaDataType_t::CUDA_R_16BF,
        }
    }

    /// Whether the matrix is bf16.
    pub(crate) fn is_bf16(&self) -> bool {
        self.dtype == cudaDataType_t::CUDA_R_16BF
    }
}

/// `C = A·B + beta·C` as `shape` says, f32 accumulation, `C` rounded to its type.
pub(crate) fn gemm(
    blas: &CudaBlas,
    shape: GemmShape,
    a: Operand,
    b: Operand,
    c: Operand,
    beta: f32,
) -> Result<()> {
    let op = |t: bool| {
        if t {
            cublasOperation_t::CUBLAS_OP_T
        } else {
            cublasOperation_t::CUBLAS_OP_N
        }
    };
    let alpha = 1.0f32;
    // SAFETY: the callers pass addresses of live buffers that hold the matrices the
    // shape describes; alpha and beta are host f32 (the handle's default pointer mode).
    unsafe {
        blas::gemm_ex(
            *blas.handle(),
            op(shape.trans_a),
            op(shape.trans_b),
            int_arg("m", shape.m)?,
            int_arg("n", shape.n)?,
            int_arg("k", shape.k)?,
            (&alpha as *const f32).cast(),
            a.addr as *const std::ffi::c_void,
            a.dtype,
            int_arg("lda", shape.lda)?,
            b.addr as *const std::ffi::c_void,
            b.dtype,
            int_arg("ldb", shape.ldb)?,
            (&beta as *const f32).cast(),
            c.addr as *mut std::ffi::c_void,
            c.dtype,
            int_arg("ldc", shape.ldc)?,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| device_error("cublasGemmEx", e))
}

#[cfg(test)]
mod tests {
    use super::GemmShape;

    /// `C = op(A)·op(B) + C` on column-major host buffers, as cuBLAS computes it.
    fn column_major_gemm(s: GemmShape, a: &[f64], b: &[f64], c: &mut [f64]) {
        let at = |i: usize, p: usize| {
            if s.trans_a {
                a[p + i * s.lda]
            } else {
                a[i + p * s.lda]
            }
        };
        let bt = |p: usize, j: usize| {
            if s.trans_b {
                b[j + p * s.ldb]
            } else {
                b[p + j * s.ldb]
            }
        };
        for j in 0..s.n {
            for i in 0..s.m {
                let dot: f64 = (0..s.k).map(|p| at(i, p) * bt(p, j)).sum();
                c[i + j * s.ldc] += dot;
            }
        }
    }

    fn matrix(len: usize, seed: usize) -> Vec<f64> {
        (0..len)
            .map(|i| ((i * 7 + seed * 13) % 11) as f64 - 5.0)
            .collect()
    }

    /// Each shape, run as cuBLAS would on the row-major buffers, is the row-major
    /// product it names; a logits tile with row stride wider than the tile (single
    /// pass) leaves the other columns alone.
    #[test]
    fn gemm_shapes_compute_the_row_major_products() {
        let (rows, vt, h, ldz) = (5, 3, 4, 7);
        let hidden = matrix(rows * h, 1);
        let weight = matrix(vt * h, 2);
        let dz = matrix(rows * ldz, 3);

        let mut z = vec![100.0; rows * ldz];
        column_major_gemm(
            GemmShape::logits(rows, vt, h, ldz),
            &weight,
            &hidden,
            &mut z,
        );
        for r in 0..rows {
            for c in 0..ldz {
                let want = if c < vt {
                    100.0
                        + (0..h)
                            .map(|p| hidden[r * h + p] * weight[c * h + p])
                            .sum::<f64>()
                } else {
                    100.0
                };
                assert_eq!(z[r * ldz + c], want, "z[{r}, {c}]");
            }
        }

        let mut dh = vec![0.0; rows * h];
        column_major_gemm(GemmShape::dhidden(rows, vt, h, ldz), &weight, &dz, &mut dh);
        for r in 0..rows {
            for c in 0..h {
                let want: f64 = (0..vt).map(|j| dz[r * ldz + j] * weight[j * h + c]).sum();
                assert_eq!(dh[r * h + c], want, "dh[{r}, {c}]");
            }
        }

        let mut dw = vec![0.0; vt * h];
        column_major_gemm(GemmShape::dweight(rows, vt, h, ldz), &hidden, &dz, &mut dw);
        for j in 0..vt {
            for c in 0..h {
                let want: f64 = (0..rows).map(|r| dz[r * ldz + j] * hidden[r * h + c]).sum();
                assert_eq!(dw[j * h + c], want, "dw[{j}, {c}]");
            }
        }
    }

    /// The `[H, V]` shapes, on the vocabulary block `[c0, c0 + vt)` of a weight and a dW
    /// of `v` columns (their addresses offset by `c0`), compute the same products; the
    /// other columns of dW are left alone.
    #[test]
    fn hidden_major_shapes_compute_the_row_major_products() {
        let (rows, vt, h, ldz, v, c0) = (5, 3, 4, 7, 11, 6);
        let hidden = matrix(rows * h, 1);
        let w_hv = matrix(h * v, 2);
        let dz = matrix(rows * ldz, 3);
        let w = |j: usize, c: usize| w_hv[c * v + c0 + j];

        let mut z = vec![0.0; rows * ldz];
        column_major_gemm(
            GemmShape::logits_hv(rows, vt, h, ldz, v),
            &w_hv[c0..],
            &hidden,
            &mut z,
        );
        for r in 0..rows {
            for j in 0..vt {
                let want: f64 = (0..h).map(|c| hidden[r * h + c] * w(j, c)).sum();
                assert_eq!(z[r * ldz + j], want, "z[{r}, {j}]");
            }
        }

        let mut dh = vec![0.0; rows * h];
        column_major_gemm(
            GemmShape::dhidden_hv(rows, vt, h, ldz, v),
            &w_hv[c0..],
            &dz,
            &mut dh,
        );
        for r in 0..rows {
            for c in 0..h {
                let want: f64 = (0..vt).map(|j| dz[r * ldz + j] * w(j, c)).sum();
                assert_eq!(dh[r * h + c], want, "dh[{r}, {c}]");
            }
        }

        let mut dw = vec![100.0; h * v];
        column_major_gemm(
            GemmShape::dweight_hv(rows, vt, h, ldz, v),
            &dz,
            &hidden,
            &mut dw[c0..],
        );
        for c in 0..h {
            for col in 0..v {
                let want = match col.checked_sub(c0).filter(|&j| j < vt) {
                    Some(j) => {
                        100.0
                            + (0..rows)
                                .map(|r| dz[r * ldz + j] * hidden[r * h + c])
                                .sum::<f64>()
                    }
                    None => 100.0,
                };
                assert_eq!(dw[c * v + col], want, "dw[{c}, {col}]");
            }
        }
    }
}

//! A bounds-checked wrapper over the `gemm` crate (AVX-512 micro-kernels, rayon).

use gemm::Parallelism;

/// A read-only matrix view: element `(r, c)` is `data[r·row_stride + c·col_stride]`.
#[derive(Debug, Clone, Copy)]
pub struct MatRef<'a, T = f32> {
    /// Backing storage.
    pub data: &'a [T],
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// Elements between rows.
    pub row_stride: usize,
    /// Elements between columns.
    pub col_stride: usize,
}

impl<'a, T> MatRef<'a, T> {
    /// A dense row-major `[rows, cols]` view.
    pub fn row_major(data: &'a [T], rows: usize, cols: usize) -> Self {
        MatRef {
            data,
            rows,
            cols,
            row_stride: cols,
            col_stride: 1,
        }
    }

    /// The transpose (no copy).
    pub fn t(self) -> Self {
        MatRef {
            data: self.data,
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
        }
    }

    /// The same shape and strides over `data` (the same elements in another type).
    pub fn over<'b, U>(self, data: &'b [U]) -> MatRef<'b, U> {
        MatRef {
            data,
            rows: self.rows,
            cols: self.cols,
            row_stride: self.row_stride,
            col_stride: self.col_stride,
        }
    }

    fn fits(&self) -> bool {
        self.rows == 0
            || self.cols == 0
            || (self.rows - 1) * self.row_stride + (self.cols - 1) * self.col_stride
                < self.data.len()
    }
}

/// `dst = a · b` (or `dst += a · b` when `accumulate`), `dst` row-major
/// `[a.rows, b.cols]` with rows `dst_stride` apart, on the pool's threads. Panics on
/// inconsistent shapes: callers pass validated sizes.
pub fn matmul(dst: &mut [f32], dst_stride: usize, a: MatRef, b: MatRef, accumulate: bool) {
    let threads = rayon::current_num_threads();
    matmul_on(dst, dst_stride, a, b, accumulate, threads);
}

/// [`matmul`] on at most `threads` threads. `gemm` splits the output among threads and
/// sums every entry's `k` terms in the same order, so the result does not depend on
/// `threads`.
pub fn matmul_on(
    dst: &mut [f32],
    dst_stride: usize,
    a: MatRef,
    b: MatRef,
    accumulate: bool,
    threads: usize,
) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert_eq!(k, b.rows, "inner dimensions");
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        dst_stride >= n && dst.len() >= (m - 1) * dst_stride + n && a.fits() && b.fits(),
        "matrix bounds"
    );
    if k == 0 {
        if !accumulate {
            dst.chunks_mut(dst_stride)
                .take(m)
                .for_each(|r| r[..n].fill(0.0));
        }
        return;
    }
    let parallelism = if threads > 1 && m * n * k >= 1 << 18 {
        Parallelism::Rayon(threads)
    } else {
        Parallelism::None
    };
    // SAFETY: the views were checked to lie within their slices and `dst` holds m·n.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_stride as isize,
            accumulate,
            a.data.as_ptr(),
            a.col_stride as isize,
            a.row_stride as isize,
            b.data.as_ptr(),
            b.col_stride as isize,
            b.row_stride as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_a_naive_product_with_transposes_and_accumulation() {
        let (m, k, n) = (7, 13, 5);
        let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let bt: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.11).cos()).collect();
        let mut dst = vec![1.0f32; m * n];
        let bv = MatRef::row_major(&bt, n, k).t();
        matmul(&mut dst, n, MatRef::row_major(&a, m, k), bv, true);
        for i in 0..m {
            for j in 0..n {
                let want: f32 = 1.0 + (0..k).map(|p| a[i * k + p] * bt[j * k + p]).sum::<f32>();
                assert!((dst[i * n + j] - want).abs() < 1e-5);
            }
        }
    }
}

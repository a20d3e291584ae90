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

/// Depth of one `gemm` call. `gemm` sums an entry's `k` terms in blocks whose depth it
/// picks from the product's shape (at most 512 for small products, a figure from the
/// caches for the rest), so a deeper product is cut here into calls of at most this
/// depth, added in order: each entry's sum is then the same whatever `m` and `n`.
const CALL_DEPTH: usize = 512;

/// The smallest `m·n` that `gemm`'s general kernels take: at most this many entries
/// (and for `m` or `n` of 1) it runs dot products along `k` or a matrix-vector product,
/// which sum in another order.
const SMALL_PRODUCT: usize = 256;

/// [`matmul`] on at most `threads` threads. Every entry sums its `k` terms in the same
/// order whatever the shape's other sides, the strides and `threads` (`gemm` splits the
/// output among threads): a row of `a` gives the same bits in any batch of rows. A
/// product too small for `gemm`'s general kernels runs padded ([`SMALL_PRODUCT`]).
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
    let padded = general_shape(m, n);
    if padded != (m, n) {
        return matmul_padded(dst, dst_stride, (a, b), accumulate, padded, threads);
    }
    let parallelism = if threads > 1 && m * n * k >= 1 << 18 {
        Parallelism::Rayon(threads)
    } else {
        Parallelism::None
    };
    for k0 in (0..k).step_by(CALL_DEPTH) {
        let depth = CALL_DEPTH.min(k - k0);
        let (a_data, b_data) = (&a.data[k0 * a.col_stride..], &b.data[k0 * b.row_stride..]);
        // SAFETY: the views were checked to lie within their slices (a block of them lies
        // within the same slices from its first element) and `dst` holds m·n.
        unsafe {
            gemm::gemm(
                m,
                n,
                depth,
                dst.as_mut_ptr(),
                1,
                dst_stride as isize,
                accumulate || k0 > 0,
                a_data.as_ptr(),
                a.col_stride as isize,
                a.row_stride as isize,
                b_data.as_ptr(),
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
}

/// The shape, at least `m × n`, of a product that `gemm` runs on its general kernels.
fn general_shape(m: usize, n: usize) -> (usize, usize) {
    let (m, n) = (m.max(2), n.max(2));
    if m * n > SMALL_PRODUCT {
        (m, n)
    } else {
        (SMALL_PRODUCT / n + 1, n)
    }
}

/// [`matmul_on`] of a small product padded with zeros to `rows × cols`: `a` copied where
/// it gains rows, `b` where it gains columns, `dst` always (it is at most `rows × cols`);
/// the entries of `a`'s rows are summed as in any larger product.
fn matmul_padded(
    dst: &mut [f32],
    dst_stride: usize,
    (a, b): (MatRef, MatRef),
    accumulate: bool,
    (rows, cols): (usize, usize),
    threads: usize,
) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    let at = |x: &MatRef, r: usize, c: usize| x.data[r * x.row_stride + c * x.col_stride];
    let pa: Vec<f32> = match rows > m {
        true => (0..rows * k)
            .map(|i| if i / k < m { at(&a, i / k, i % k) } else { 0.0 })
            .collect(),
        false => Vec::new(),
    };
    let pb: Vec<f32> = match cols > n {
        true => (0..k * cols)
            .map(|i| {
                if i % cols < n {
                    at(&b, i / cols, i % cols)
                } else {
                    0.0
                }
            })
            .collect(),
        false => Vec::new(),
    };
    let a = if rows > m {
        MatRef::row_major(&pa, rows, k)
    } else {
        a
    };
    let b = if cols > n {
        MatRef::row_major(&pb, k, cols)
    } else {
        b
    };
    let mut pd = vec![0.0f32; rows * cols];
    for r in 0..m {
        pd[r * cols..r * cols + n].copy_from_slice(&dst[r * dst_stride..r * dst_stride + n]);
    }
    matmul_on(&mut pd, cols, a, b, accumulate, threads);
    for r in 0..m {
        dst[r * dst_stride..r * dst_stride + n].copy_from_slice(&pd[r * cols..r * cols + n]);
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

    /// A row of `a` gives the same bits alone, among a few rows or many, beside a
    /// narrow or a wide `b`, at depths around the call depth.
    #[test]
    fn a_row_gives_the_same_bits_in_any_product() {
        for (k, n) in [(13, 1), (700, 3), (1500, 40), (513, 300), (2048, 17)] {
            let a: Vec<f32> = (0..200 * k).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.11).cos()).collect();
            let bv = MatRef::row_major(&b, k, n);
            let product = |rows: std::ops::Range<usize>, threads: usize| {
                let m = rows.len();
                let mut dst = vec![0.5f32; m * n];
                let av = MatRef::row_major(&a[rows.start * k..rows.end * k], m, k);
                matmul_on(&mut dst, n, av, bv, true, threads);
                dst
            };
            let all = product(0..200, 2);
            for (rows, threads) in [(7..8, 1), (5..9, 2), (0..70, 1), (150..200, 2)] {
                let got = product(rows.clone(), threads);
                let want = &all[rows.start * n..rows.end * n];
                assert!(
                    got.iter()
                        .zip(want)
                        .all(|(x, y)| x.to_bits() == y.to_bits()),
                    "k={k} n={n} rows {rows:?}"
                );
            }
        }
    }
}

// Sparse terms of a row block's gradient tile (candidate sets' one-hot terms,
// fused::SparseGrads), compiled at run time with NVRTC (header
// flashloss.cuh: load/store).
//
// dz[r * ld + (id - col0)] += coef for every pair (id, coef) = (ids[r * k + slot],
// coefs[r * k + slot]) of rows [0, rows) whose id falls in the tile's vocabulary entries
// [col0, col0 + cols) (ids local to the head; -1: none). No soft-cap slope: the callers
// refuse a soft-cap with sparse terms (a log-prob call has none). One thread per row, its
// slots in order, so repeated ids add up in a fixed order (bitwise reproducible). `ids`
// and `coefs` start at the block's first row. A bf16 tile is read, added to in f32 and
// rounded back (to nearest even).

#include "flashloss.cuh"

#define BLOCK 256

template <typename T>
__device__ void sparse_add(T* dz, long long ld, int rows, long long col0, int cols,
                           const long long* __restrict__ ids, const float* __restrict__ coefs,
                           int k) {
    long long r = (long long)blockIdx.x * BLOCK + threadIdx.x;
    if (r >= rows) return;
    for (int slot = 0; slot < k; ++slot) {
        long long id = ids[r * k + slot];
        long long j = id - col0;
        float c = coefs[r * k + slot];
        if (id < 0 || j < 0 || j >= cols || c == 0.0f) continue;
        store(dz, r * ld + j, load(dz, r * ld + j) + c);
    }
}

extern "C" __global__ void __launch_bounds__(BLOCK)
sparse_add_f32(float* dz, long long ld, int rows, long long col0, int cols,
               const long long* ids, const float* coefs, int k) {
    sparse_add(dz, ld, rows, col0, cols, ids, coefs, k);
}

extern "C" __global__ void __launch_bounds__(BLOCK)
sparse_add_bf16(bf16_bits* dz, long long ld, int rows, long long col0, int cols,
                const long long* ids, const float* coefs, int k) {
    sparse_add(dz, ld, rows, col0, cols, ids, coefs, k);
}

// Candidate sets (gather_ids) on the GPU, compiled at run time with NVRTC (header
// flashloss.cuh: logit).
//
// From one logits tile (f32, or a compact plan's bf16 chunk) (rows [0, rows) of a row block, row stride ldz, vocabulary
// entries [col0, col0 + cols) of the head), the logits the loss sees,
// x = cap * tanh((z + b) / cap) (bias b optional, inv_cap = 0: no soft-cap), at each
// row's candidate ids: ids[r * k + slot] is an id local to the head (-1: not gathered:
// a masked row, or an id another vocabulary shard holds), and out[r * k + slot] gets x
// where the id falls in the tile (other entries are left as they are). `ids` and `out`
// start at the block's first row; `bias` at the tile's first entry. One block per row
// (blockIdx.x = r < rows), its threads over the slots: each entry is written by one
// thread, so repeats are harmless and the result does not depend on the launch.

#include "flashloss.cuh"

#define BLOCK 64

template <typename T>
__device__ void gather_logits(const T* __restrict__ z, long long ldz, long long col0, int cols,
                              const float* __restrict__ bias, float cap, float inv_cap,
                              const long long* __restrict__ ids, int k, float* __restrict__ out) {
    long long r = blockIdx.x;
    const T* zr = z + r * ldz;
    for (int slot = threadIdx.x; slot < k; slot += BLOCK) {
        long long at = r * k + slot;
        long long id = ids[at];
        long long j = id - col0;
        if (id < 0 || j < 0 || j >= cols) continue;
        out[at] = logit(load(zr, j), bias, j, cap, inv_cap);
    }
}

extern "C" __global__ void __launch_bounds__(BLOCK)
gather_logits_f32(const float* __restrict__ z, long long ldz, long long col0, int cols,
                  const float* __restrict__ bias, float cap, float inv_cap,
                  const long long* __restrict__ ids, int k, float* __restrict__ out) {
    gather_logits(z, ldz, col0, cols, bias, cap, inv_cap, ids, k, out);
}

extern "C" __global__ void __launch_bounds__(BLOCK)
gather_logits_bf16(const bf16_bits* __restrict__ z, long long ldz, long long col0, int cols,
                   const float* __restrict__ bias, float cap, float inv_cap,
                   const long long* __restrict__ ids, int k, float* __restrict__ out) {
    gather_logits(z, ldz, col0, cols, bias, cap, inv_cap, ids, k, out);
}

// A truncated support on the GPU (fused/support/, cuda/support.rs), compiled at run time
// with NVRTC (header flashloss.cuh). Not run on a GPU yet: compiled and ptxas-checked, and
// written step for step as its host model (fused/support/device_top.rs), which the tests
// run against the host's top buffer and the f64 reference.
//
// top_keys_f32: pass A's per-row top keys. A row's buffer `buf[r * c .. r * c + c)` holds
// `count[r]` keys in no order (u64 keys of the support's order, ids of the whole
// vocabulary); one f32 logits tile (rows [0, rows) of a row block, row stride ldz, columns
// [0, cols) whose ids are id0 + j) is merged into it: afterwards the buffer holds the
// top min(c, seen) keys of everything seen, and dropped[r] says a key was left out. One
// block per row; masked rows (live[r] = 0) are skipped. Keys at or below the floor (a full
// buffer's smallest) cannot enter; the others are appended while they fit, else the c-th
// largest key t of buffer and tile is found by an MSB-first radix select (8-bit digits,
// stopping where the chosen digit's bin holds exactly what is still wanted), and the
// buffer's slots below t (and its empty ones) take the tile's keys >= t.
//
// rows_logits_f32: the logits the loss sees (bias, soft-cap) of some rows of a tile,
// packed into `out` [n, cols] (the rows an extra pass hands to the host).

#include "flashloss.cuh"

#define BLOCK 256
#define RADIX 256
// Most keys a row's buffer holds (fused/support: MAX_BUFFER).
#define MAX_CAP 4096

__device__ __forceinline__ unsigned long long tile_key(const float* zr, long long j,
                                                       long long id0, const float* bias,
                                                       float cap, float inv_cap,
                                                       float inv_temp) {
    return order_key(scaled(logit(zr[j], bias, j, cap, inv_cap), inv_temp), id0 + j);
}

extern "C" __global__ void __launch_bounds__(BLOCK)
top_keys_f32(const float* __restrict__ z, long long ldz, int cols, long long id0,
             const float* __restrict__ bias, float cap, float inv_cap, float inv_temp,
             const unsigned char* __restrict__ live, unsigned long long* __restrict__ buf,
             int* __restrict__ count, unsigned char* __restrict__ dropped, int c) {
    __shared__ unsigned int hist[RADIX];
    __shared__ int holes[MAX_CAP];
    __shared__ unsigned long long sh_floor, sh_prefix;
    __shared__ unsigned int sh_fresh, sh_want, sh_done;
    __shared__ int sh_at, sh_holes;
    long long r = blockIdx.x;
    if (live && !live[r]) return;
    const float* zr = z + r * ldz;
    unsigned long long* b = buf + r * (long long)c;
    int held = count[r];
    if (threadIdx.x == 0) {
        if ((long long)held + cols > c) dropped[r] = 1;
        sh_floor = held == c ? ~0ull : 0ull;
        sh_fresh = 0;
        sh_at = held;
        sh_holes = 0;
    }
    __syncthreads();
    if (held == c)
        for (int i = threadIdx.x; i < held; i += BLOCK) atomicMin(&sh_floor, b[i]);
    __syncthreads();
    unsigned long long fl = sh_floor;
    unsigned int fresh = 0;
    for (int j = threadIdx.x; j < cols; j += BLOCK)
        fresh += tile_key(zr, j, id0, bias, cap, inv_cap, inv_temp) > fl;
    atomicAdd(&sh_fresh, fresh);
    __syncthreads();
    unsigned int n_fresh = sh_fresh;
    if (n_fresh == 0) return;
    if ((long long)held + n_fresh <= c) {
        for (int j = threadIdx.x; j < cols; j += BLOCK) {
            unsigned long long k = tile_key(zr, j, id0, bias, cap, inv_cap, inv_temp);
            if (k > fl) b[atomicAdd(&sh_at, 1)] = k;
        }
        if (threadIdx.x == 0) count[r] = held + (int)n_fresh;
        return;
    }
    unsigned long long prefix = 0ull, mask = 0ull;
    unsigned int want = (unsigned int)c;
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (int d = threadIdx.x; d < RADIX; d += BLOCK) hist[d] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < held; i += BLOCK) {
            unsigned long long k = b[i];
            if ((k & mask) == prefix) atomicAdd(&hist[(k >> shift) & 255ull], 1u);
        }
        for (int j = threadIdx.x; j < cols; j += BLOCK) {
            unsigned long long k = tile_key(zr, j, id0, bias, cap, inv_cap, inv_temp);
            if (k > fl && (k & mask) == prefix) atomicAdd(&hist[(k >> shift) & 255ull], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned int acc = 0;
            int d = RADIX - 1;
            while (d > 0 && acc + hist[d] < want) acc += hist[d--];
            sh_want = want - acc;
            sh_prefix = prefix | ((unsigned long long)d << shift);
            sh_done = hist[d] == want - acc;
        }
        __syncthreads();
        prefix = sh_prefix;
        want = sh_want;
        mask |= 255ull << shift;
        if (sh_done) break;
    }
    unsigned long long t = prefix;
    for (int i = threadIdx.x; i < c; i += BLOCK)
        if (i >= held || b[i] < t) holes[atomicAdd(&sh_holes, 1)] = i;
    __syncthreads();
    if (threadIdx.x == 0) sh_at = 0;
    __syncthreads();
    for (int j = threadIdx.x; j < cols; j += BLOCK) {
        unsigned long long k = tile_key(zr, j, id0, bias, cap, inv_cap, inv_temp);
        if (k > fl && k >= t) b[holes[atomicAdd(&sh_at, 1)]] = k;
    }
    if (threadIdx.x == 0) count[r] = c;
}

extern "C" __global__ void __launch_bounds__(BLOCK)
rows_logits_f32(const float* __restrict__ z, long long ldz, int cols,
                const float* __restrict__ bias, float cap, float inv_cap,
                const int* __restrict__ rows, float* __restrict__ out) {
    long long i = blockIdx.x;
    const float* zr = z + (long long)rows[i] * ldz;
    for (int j = threadIdx.x; j < cols; j += BLOCK)
        out[i * cols + j] = logit(zr[j], bias, j, cap, inv_cap);
}

// Row kernels of the CUDA backend, compiled at run time with NVRTC (header flashloss.cuh:
// load/store of f32 and bf16, logit, the support's keys).
// One block per row on a 1-D grid (blockIdx.x = row: up to 2^31 - 1 rows), 256 threads.
//
// Rows are laid out as the CPU's LogitsLayout: row r = b*T + t starts at
// b*seq_stride + t*row_stride (a dense [rows, ld] tile is T = rows, row_stride = ld).
// A row holds raw logits z_j (f32 or bf16); the logits the loss sees are
// x_j = cap * tanh((z_j + b_j) / cap) with an optional bias b and soft-cap (inv_cap = 0:
// none). Statistics are those of the CPU kernel's OnlineSoftmax, in f32:
//   mu = max_j x_j,  S = sum_j exp((x_j - mu) * inv_temp),
//   U = sum_j exp((x_j - mu) * inv_temp) * (x_j - mu) * inv_temp,
//   S2 = sum_j exp(2 (x_j - mu) * inv_temp),
// so that lse = mu * inv_temp + log S, H = log S - U / S and sum_j p_j^2 = S2 / S^2.

#include "flashloss.cuh"

#define BLOCK 256
#define NEG_INF (-__int_as_float(0x7f800000))

// Where row `row` starts.
struct Layout {
    long long seq_len, row_stride, seq_stride;
};

__device__ __forceinline__ long long row_offset(Layout l, long long row) {
    return (row / l.seq_len) * l.seq_stride + (row % l.seq_len) * l.row_stride;
}

// Online-softmax state (mu, S, U, S2) and its merge (the CPU's OnlineSoftmax::merge).
struct State {
    float mu, s, u, s2;
};

__device__ __forceinline__ State merge(State a, State b, float inv_temp) {
    if (b.mu == NEG_INF) return a;
    if (a.mu == NEG_INF) return b;
    float mu = fmaxf(a.mu, b.mu);
    float da = (a.mu - mu) * inv_temp, db = (b.mu - mu) * inv_temp;
    float fa = __expf(da), fb = __expf(db);
    State out;
    out.mu = mu;
    out.s = fa * a.s + fb * b.s;
    out.u = fa * (a.u + da * a.s) + fb * (b.u + db * b.s);
    out.s2 = fa * fa * a.s2 + fb * fb * b.s2;
    return out;
}

__device__ State block_merge(State st, float inv_temp) {
    __shared__ float sh_mu[BLOCK / 32], sh_s[BLOCK / 32], sh_u[BLOCK / 32], sh_s2[BLOCK / 32];
    for (int off = 16; off > 0; off >>= 1) {
        State o;
        o.mu = __shfl_down_sync(0xffffffffu, st.mu, off);
        o.s = __shfl_down_sync(0xffffffffu, st.s, off);
        o.u = __shfl_down_sync(0xffffffffu, st.u, off);
        o.s2 = __shfl_down_sync(0xffffffffu, st.s2, off);
        st = merge(st, o, inv_temp);
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        sh_mu[warp] = st.mu;
        sh_s[warp] = st.s;
        sh_u[warp] = st.u;
        sh_s2[warp] = st.s2;
    }
    __syncthreads();
    if (warp == 0) {
        State w;
        w.mu = lane < BLOCK / 32 ? sh_mu[lane] : NEG_INF;
        w.s = lane < BLOCK / 32 ? sh_s[lane] : 0.0f;
        w.u = lane < BLOCK / 32 ? sh_u[lane] : 0.0f;
        w.s2 = lane < BLOCK / 32 ? sh_s2[lane] : 0.0f;
        for (int off = 16; off > 0; off >>= 1) {
            State o;
            o.mu = __shfl_down_sync(0xffffffffu, w.mu, off);
            o.s = __shfl_down_sync(0xffffffffu, w.s, off);
            o.u = __shfl_down_sync(0xffffffffu, w.u, off);
            o.s2 = __shfl_down_sync(0xffffffffu, w.s2, off);
            w = merge(w, o, inv_temp);
        }
        st = w;
    }
    return st;  // valid in thread 0
}

__device__ float block_sum(float v) {
    __shared__ float sh[BLOCK / 32];
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < BLOCK / 32 ? sh[lane] : 0.0f;
        for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
    }
    return v;  // valid in thread 0
}

// Per-row state of columns [0, cols) of a row part whose column 0 is vocabulary id
// `col_offset`, merged into the running arrays (mu, s, u, target logit, logit sum) when
// `merge_into` is set, written over them otherwise. Rows whose `live` flag is 0 are
// skipped (their running values stay as they are). The target logit is taken where
// targets[row] falls in this part. `st_s2` (S2) may be null: not formed.
template <typename T>
__device__ void row_states(const T* __restrict__ z, Layout lz, int cols, long long col_offset,
                           const float* __restrict__ bias, float inv_temp, float cap,
                           float inv_cap, const long long* __restrict__ targets,
                           const unsigned char* __restrict__ live, int merge_into,
                           float* st_mu, float* st_s, float* st_u, float* st_target,
                           float* st_sum, float* st_s2) {
    long long row = blockIdx.x;
    if (live && !live[row]) return;
    const T* zr = z + row_offset(lz, row);
    State st;
    st.mu = NEG_INF;
    st.s = 0.0f;
    st.u = 0.0f;
    st.s2 = 0.0f;
    float sum = 0.0f;
    // Two sweeps per thread: the max of its columns, then its sums against that max.
    for (int j = threadIdx.x; j < cols; j += BLOCK)
        st.mu = fmaxf(st.mu, logit(load(zr, j), bias, j, cap, inv_cap));
    if (st.mu != NEG_INF) {
        for (int j = threadIdx.x; j < cols; j += BLOCK) {
            float x = logit(load(zr, j), bias, j, cap, inv_cap);
            float d = (x - st.mu) * inv_temp;
            float e = __expf(d);
            st.s += e;
            st.u += e * d;
            st.s2 += e * e;
            sum += x;
        }
    }
    State total = block_merge(st, inv_temp);
    float total_sum = block_sum(sum);
    if (threadIdx.x == 0) {
        long long y = targets[row] - col_offset;
        if (merge_into) {
            State prev;
            prev.mu = st_mu[row];
            prev.s = st_s[row];
            prev.u = st_u[row];
            prev.s2 = st_s2 ? st_s2[row] : 0.0f;
            total = merge(prev, total, inv_temp);
            total_sum += st_sum[row];
        } else {
            st_target[row] = 0.0f;
        }
        st_mu[row] = total.mu;
        st_s[row] = total.s;
        st_u[row] = total.u;
        st_sum[row] = total_sum;
        if (st_s2) st_s2[row] = total.s2;
        if (y >= 0 && y < cols) st_target[row] = logit(load(zr, y), bias, y, cap, inv_cap);
    }
}

// A row's gradient coefficients (the CPU's RowGrad): with
// p_j = exp((x_j - mu) * inv_temp - log_sum),
// dz_j = (coef_p p_j + coef_h p_j (log p_j + H) + coef_uniform + [j = target] coef_target
//         + sup_coef p^K_j [key_j >= cut]) * slope_j, slope_j = 1 - (x_j / cap)^2 (1 without
// a cap), with a truncated support's term (fused::SupportTerm; sup_coef = 0: none):
// p^K_j = exp(min((x_j - mu) * inv_temp - sup_log_sum, 0)) and key_j the support's key of
// the scaled logit (flashloss.cuh: order_key) at id sup_offset + col_offset + j.
struct RowCoef {
    float mu, log_sum, entropy, coef_p, coef_h, coef_uniform, coef_target;
    long long target;  // vocabulary id of the target (-1: none)
    float sup_coef, sup_log_sum;
    unsigned long long cut;
    long long sup_offset;  // the head's first id in the whole vocabulary
};

// dz of columns [0, cols) written to `out` (laid out as `lo`; may be `z` itself: each
// element is read, then written, by the same thread). Column 0 is vocabulary id
// `col_offset` (the target is matched as `col_offset + j == target`).
template <typename TZ, typename TO>
__device__ void row_grad(const TZ* z, Layout lz, int cols, long long col_offset,
                         const float* __restrict__ bias, float inv_temp, float cap,
                         float inv_cap, const RowCoef* __restrict__ coefs, TO* out, Layout lo) {
    long long row = blockIdx.x;
    RowCoef c = coefs[row];
    const TZ* zr = z + row_offset(lz, row);
    TO* o = out + row_offset(lo, row);
    bool zero = c.coef_p == 0.0f && c.coef_h == 0.0f && c.coef_uniform == 0.0f &&
                c.coef_target == 0.0f && c.sup_coef == 0.0f;
    for (int j = threadIdx.x; j < cols; j += BLOCK) {
        float g = 0.0f;
        if (!zero) {
            float x = logit(load(zr, j), bias, j, cap, inv_cap);
            float lp = (x - c.mu) * inv_temp - c.log_sum;
            float p = __expf(lp);
            g = c.coef_p * p + c.coef_uniform;
            if (c.coef_h != 0.0f && p > 0.0f) g += c.coef_h * p * (lp + c.entropy);
            if (col_offset + j == c.target) g += c.coef_target;
            if (c.sup_coef != 0.0f &&
                order_key(scaled(x, inv_temp), c.sup_offset + col_offset + j) >= c.cut)
                g += c.sup_coef * __expf(fminf((x - c.mu) * inv_temp - c.sup_log_sum, 0.0f));
            if (inv_cap != 0.0f) {
                float t = x * inv_cap;
                g *= 1.0f - t * t;
            }
        }
        store(o, j, g);
    }
}

extern "C" __global__ void __launch_bounds__(BLOCK)
row_states_f32(const float* z, Layout lz, int cols, long long col_offset, const float* bias,
               float inv_temp, float cap, float inv_cap, const long long* targets,
               const unsigned char* live, int merge_into, float* st_mu, float* st_s,
               float* st_u, float* st_target, float* st_sum, float* st_s2) {
    row_states(z, lz, cols, col_offset, bias, inv_temp, cap, inv_cap, targets, live, merge_into,
               st_mu, st_s, st_u, st_target, st_sum, st_s2);
}

extern "C" __global__ void __launch_bounds__(BLOCK)
row_states_bf16(const bf16_bits* z, Layout lz, int cols, long long col_offset,
                const float* bias, float inv_temp, float cap, float inv_cap,
                const long long* targets, const unsigned char* live, int merge_into,
                float* st_mu, float* st_s, float* st_u, float* st_target, float* st_sum,
                float* st_s2) {
    row_states(z, lz, cols, col_offset, bias, inv_temp, cap, inv_cap, targets, live, merge_into,
               st_mu, st_s, st_u, st_target, st_sum, st_s2);
}

extern "C" __global__ void __launch_bounds__(BLOCK)
row_grad_f32(const float* z, Layout lz, int cols, long long col_offset, const float* bias,
             float inv_temp, float cap, float inv_cap, const RowCoef* coefs, float* out,
             Layout lo) {
    row_grad(z, lz, cols, col_offset, bias, inv_temp, cap, inv_cap, coefs, out, lo);
}

extern "C" __global__ void __launch_bounds__(BLOCK)
row_grad_bf16(const bf16_bits* z, Layout lz, int cols, long long col_offset, const float* bias,
              float inv_temp, float cap, float inv_cap, const RowCoef* coefs, bf16_bits* out,
              Layout lo) {
    row_grad(z, lz, cols, col_offset, bias, inv_temp, cap, inv_cap, coefs, out, lo);
}

// f32 logits (a fused kernel's tile) to a bf16 gradient tile (the operand of the bf16
// cuBLAS products that follow).
extern "C" __global__ void __launch_bounds__(BLOCK)
row_grad_f32_to_bf16(const float* z, Layout lz, int cols, long long col_offset,
                     const float* bias, float inv_temp, float cap, float inv_cap,
                     const RowCoef* coefs, bf16_bits* out, Layout lo) {
    row_grad(z, lz, cols, col_offset, bias, inv_temp, cap, inv_cap, coefs, out, lo);
}

// dbias[j] += sum over `rows` rows of dz[r * ld + j], j < cols: one thread per column
// (adjacent threads read adjacent columns), rows summed in order.
template <typename T>
__device__ void col_sums(const T* dz, long long ld, int rows, int cols, float* out) {
    long long j = (long long)blockIdx.x * BLOCK + threadIdx.x;
    if (j >= cols) return;
    float acc = 0.0f;
    for (int r = 0; r < rows; ++r) acc += load(dz, r * ld + j);
    out[j] += acc;
}

extern "C" __global__ void __launch_bounds__(BLOCK)
col_sums_f32(const float* dz, long long ld, int rows, int cols, float* out) {
    col_sums(dz, ld, rows, cols, out);
}

extern "C" __global__ void __launch_bounds__(BLOCK)
col_sums_bf16(const bf16_bits* dz, long long ld, int rows, int cols, float* out) {
    col_sums(dz, ld, rows, cols, out);
}

// Poison: every 32-bit or 16-bit word of a buffer set to `bits` (NaN before a kernel
// runs, so elements it does not write show). Grid-stride loop.
extern "C" __global__ void __launch_bounds__(BLOCK)
fill_u32(unsigned int* p, long long n, unsigned int bits) {
    for (long long i = (long long)blockIdx.x * BLOCK + threadIdx.x; i < n;
         i += (long long)gridDim.x * BLOCK)
        p[i] = bits;
}

extern "C" __global__ void __launch_bounds__(BLOCK)
fill_u16(unsigned short* p, long long n, unsigned short bits) {
    for (long long i = (long long)blockIdx.x * BLOCK + threadIdx.x; i < n;
         i += (long long)gridDim.x * BLOCK)
        p[i] = bits;
}

// The first index of a non-finite entry (exponent bits all set: an infinity or a NaN),
// as an atomic minimum into `*first` (which starts at ~0: none). `mask` is the
// exponent field of the word width (0x7f800000 for f32, 0x7f80 for bf16). Grid-stride
// loop.
extern "C" __global__ void __launch_bounds__(BLOCK)
first_non_finite_u32(const unsigned int* p, long long n, unsigned int mask,
                     unsigned long long* first) {
    for (long long i = (long long)blockIdx.x * BLOCK + threadIdx.x; i < n;
         i += (long long)gridDim.x * BLOCK)
        if ((p[i] & mask) == mask) atomicMin(first, (unsigned long long)i);
}

extern "C" __global__ void __launch_bounds__(BLOCK)
first_non_finite_u16(const unsigned short* p, long long n, unsigned short mask,
                     unsigned long long* first) {
    for (long long i = (long long)blockIdx.x * BLOCK + threadIdx.x; i < n;
         i += (long long)gridDim.x * BLOCK)
        if ((p[i] & mask) == mask) atomicMin(first, (unsigned long long)i);
}

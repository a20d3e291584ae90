// What every kernel source of the CUDA backend shares, written once: NVRTC gets this file
// as a header of each program (`kernels.rs`, HEADERS), so a source says
// #include "flashloss.cuh".
#pragma once

typedef unsigned short bf16_bits;

// Elements as f32: f32 as is, bf16 (its bits in a u16) widened exactly, and stored back
// rounded to nearest even (NaN kept a quiet NaN).
__device__ __forceinline__ float load(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float load(const bf16_bits* p, long long i) {
    return __uint_as_float(((unsigned int)p[i]) << 16);
}
__device__ __forceinline__ void store(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void store(bf16_bits* p, long long i, float v) {
    unsigned int bits = __float_as_uint(v);
    if (v != v) {
        p[i] = (bf16_bits)0x7fc0;
        return;
    }
    bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
    p[i] = (bf16_bits)(bits >> 16);
}

// The logit the loss sees: bias (at column `col`, null: none), then soft-cap (inv_cap = 0:
// none).
__device__ __forceinline__ float logit(float z, const float* bias, long long col, float cap,
                                       float inv_cap) {
    if (bias) z += bias[col];
    return inv_cap != 0.0f ? cap * tanhf(z * inv_cap) : z;
}

// A truncated support's order (fused/support/key.rs): the scaled logit s = fl(x * inv_temp)
// with -0 made +0 (no contraction: the product is rounded, then +0 added), and the key
// ord(s) << 32 | id, ord the monotone u32 image of s's bits.
__device__ __forceinline__ float scaled(float x, float inv_temp) {
    return __fadd_rn(__fmul_rn(x, inv_temp), 0.0f);
}

__device__ __forceinline__ unsigned long long order_key(float s, long long id) {
    unsigned int bits = __float_as_uint(s);
    unsigned int ord = (bits >> 31) ? ~bits : (bits | 0x80000000u);
    return ((unsigned long long)ord << 32) | (unsigned long long)id;
}

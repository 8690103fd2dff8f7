// bf16 as raw 16-bit words for the standalone kernels (layer_norm.cu, cross_entropy.cu, embedding.cu, rope.cu,
// the optimizer kernels): one bf16 as a float, the rounding of a float to bf16, and the 16-byte vector of eight
// bf16 loaded into or stored from eight floats. compile.py pastes this file where a kernel includes it, so a
// kernel's cached build changes when it does.

#pragma once

typedef unsigned short bf16_bits;

__device__ __forceinline__ float pl_bf16_float(bf16_bits b) { return __uint_as_float((unsigned int)b << 16); }

__device__ __forceinline__ bf16_bits pl_bf16(float f) {  // round to nearest even; NaN stays NaN
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_bits)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_bits)(u >> 16);
}

// Eight bf16 (one 16-byte word) <-> eight floats; element 0 is the low half of the first 32-bit word.
__device__ __forceinline__ void pl_load8(const bf16_bits* p, float v[8]) {
    const uint4 w = *reinterpret_cast<const uint4*>(p);
    const unsigned int u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        v[2 * k] = __uint_as_float(u[k] << 16);
        v[2 * k + 1] = __uint_as_float(u[k] & 0xffff0000u);
    }
}

__device__ __forceinline__ void pl_store8(bf16_bits* p, const float v[8]) {
    unsigned int u[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) u[k] = (unsigned int)pl_bf16(v[2 * k]) | ((unsigned int)pl_bf16(v[2 * k + 1]) << 16);
    *reinterpret_cast<uint4*>(p) = make_uint4(u[0], u[1], u[2], u[3]);
}

// Cross-entropy of bf16 logits [rows, V] against int64 labels, fp32 math (kernels/cross_entropy.py).
//
//   forward   lse = log sum_j exp(x_j) in one pass (a running maximum and a sum rescaled when it grows: the online
//             softmax of Transformer Engine's cross-entropy), loss = lse - x[label]; lse [rows] kept for backward
//   backward  dx_j = (exp(x_j - lse) - [j == label]) g / rows, g the loss's gradient read from device memory:
//             one read of x, one bf16 write of dx, no fp32 copy of either
//
// A warp takes a row at a time (grid-stride over rows); lane l reads the row's 16-byte vectors (8 bf16) l, l + 32,
// ...: V % 8 == 0 and each row 16-byte aligned (cross_entropy.py checks). The lanes combine their (max, sum) pairs
// by an xor butterfly, the same pairs in the same order on every run: repeatable. A label outside [0, V) makes that
// row's loss and gradient NaN.

#include "bf16.cuh"

#define PL_CE_NEG_INF (-__int_as_float(0x7f800000))
#define PL_CE_NAN __int_as_float(0x7fffffff)

// exp(a - b) with exp(-inf - -inf) = 0: a sum whose maximum is still -inf holds nothing.
__device__ __forceinline__ float pl_ce_rescale(float a, float b) { return a == PL_CE_NEG_INF ? 0.f : expf(a - b); }

extern "C" __global__ void pl_ce_forward(const bf16_bits* __restrict__ x, const long long* __restrict__ label,
                                         float* __restrict__ lse, float* __restrict__ loss, long long rows, int vocab,
                                         long long row_stride) {
    const int lane = threadIdx.x & 31;
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    for (long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows; r += warps) {
        const bf16_bits* row = x + r * row_stride;
        float m = PL_CE_NEG_INF, s = 0.f;
#pragma unroll 4
        for (int c = lane * 8; c < vocab; c += 256) {
            float v[8];
            pl_load8(row + c, v);
            float top = m;
#pragma unroll
            for (int k = 0; k < 8; ++k) top = fmaxf(top, v[k]);
            const float base = top == PL_CE_NEG_INF ? 0.f : top;
            float part = 0.f;
#pragma unroll
            for (int k = 0; k < 8; ++k) part += expf(v[k] - base);
            s = s * pl_ce_rescale(m, top) + part;
            m = top;
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            const float om = __shfl_xor_sync(0xffffffffu, m, offset);
            const float os = __shfl_xor_sync(0xffffffffu, s, offset);
            const float top = fmaxf(m, om);
            s = s * pl_ce_rescale(m, top) + os * pl_ce_rescale(om, top);
            m = top;
        }
        if (lane == 0) {
            const long long t = label[r];
            const float picked = (t >= 0 && t < vocab) ? pl_bf16_float(row[t]) : PL_CE_NAN;
            const float l = m + logf(s);
            lse[r] = l;
            loss[r] = l - picked;
        }
    }
}

extern "C" __global__ void pl_ce_backward(const bf16_bits* __restrict__ x, const long long* __restrict__ label,
                                          const float* __restrict__ lse, const float* __restrict__ grad_loss,
                                          bf16_bits* __restrict__ dx, long long rows, int vocab,
                                          long long row_stride) {
    const int lane = threadIdx.x & 31;
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    const float scale = grad_loss[0] / (float)rows;
    for (long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows; r += warps) {
        const bf16_bits* row = x + r * row_stride;
        bf16_bits* out = dx + r * (long long)vocab;
        const long long t = label[r];
        const float l = (t >= 0 && t < vocab) ? lse[r] : PL_CE_NAN;
#pragma unroll 4
        for (int c = lane * 8; c < vocab; c += 256) {
            float v[8];
            pl_load8(row + c, v);
#pragma unroll
            for (int k = 0; k < 8; ++k) v[k] = (expf(v[k] - l) - (c + k == t ? 1.f : 0.f)) * scale;
            pl_store8(out + c, v);
        }
    }
}

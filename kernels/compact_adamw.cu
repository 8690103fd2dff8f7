// Compact AdamW (kernels/compact_adamw.py): one multi-tensor launch updates every parameter of a group.
//
// Per element (bf16 parameter p, int16 remainder r, bf16 gradient g, bf16 moments m and v):
//   master bits = (p as uint16 << 16) + (r sign-extended), mod 2^32: the exact fp32 master weight
//   AdamW in fp32, as torch's fused AdamW orders it:
//     w -= lr * wd * w;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g g
//     w -= (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
//   split w: r = low 16 bits (as int16), p = high 16 bits + bit 15 (the bf16 nearest w, ties away from zero);
//   a NaN master becomes a quiet bf16 NaN of the same sign with r = 0 (its payload is not kept)
//   m and v stored as bf16, round to nearest even.
// Transformer Engine's FusedAdam with store_param_remainders does the same split (AdamFunctorMasterParamRemainder
// in transformer_engine/common/multi_tensor/adam.cu); the NaN rule is ours, so that a NaN stays a NaN in the model.
//
// Work: one block per chunk of `chunk` elements of one tensor. The tables are built once on the host
// (compact_adamw.py) and stay on the device, so a launch passes pointers only and can be captured in a CUDA graph:
//   table [7, T] int64: rows param, remainder, grad, exp_avg, exp_avg_sq pointers; numel; 1 when all five
//                       pointers are 8-byte aligned (4 elements per load), else 0
//   chunks [2, C] int64: each block's tensor index and first element
// lr and the step count are device scalars (fp32): the step count before this step, advanced afterwards by
// pl_compact_adamw_advance. found_inf (nullable): when non-zero the step changes nothing (torch's fused kernels'
// contract, used by the non-finite guard).

#include "bf16.cuh"
#include "multi_tensor.cuh"

typedef bf16_bits pl_u16;
typedef unsigned int pl_u32;

struct PlAdamCoef {
    float beta1, beta2, one_minus_beta1, one_minus_beta2, eps, lr_wd, step_size, bc2_sqrt;
};

__device__ __forceinline__ void pl_compact_update(pl_u16& p, pl_u16& r, pl_u16 g16, pl_u16& m16, pl_u16& v16,
                                                  const PlAdamCoef& c) {
    pl_u32 bits = (((pl_u32)p) << 16) + (pl_u32)(int)(short)r;
    float w = __uint_as_float(bits);
    const float g = pl_bf16_float(g16);
    const float m = c.beta1 * pl_bf16_float(m16) + c.one_minus_beta1 * g;
    const float v = c.beta2 * pl_bf16_float(v16) + c.one_minus_beta2 * g * g;
    w -= c.lr_wd * w;
    const float denom = sqrtf(v) / c.bc2_sqrt + c.eps;
    w -= c.step_size * m / denom;
    bits = __float_as_uint(w);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {  // NaN: a quiet bf16 NaN, no remainder
        p = (pl_u16)((bits >> 16) | 0x40u);
        r = 0;
    } else {
        p = (pl_u16)((bits >> 16) + ((bits >> 15) & 1u));
        r = (pl_u16)(bits & 0xffffu);
    }
    m16 = pl_bf16(m);
    v16 = pl_bf16(v);
}

extern "C" __global__ void pl_compact_adamw(const long long* __restrict__ table, int tensors,
                                            const long long* __restrict__ chunks, int n_chunks, long long chunk,
                                            const float* __restrict__ lr_ptr, const float* __restrict__ step_ptr,
                                            const float* __restrict__ found_inf, float beta1, float beta2, float eps,
                                            float weight_decay) {
    if (found_inf != nullptr && *found_inf != 0.0f) return;
    const PlChunk share = pl_chunk(table, tensors, 5, chunks, n_chunks, chunk);
    const int t = share.t;
    const long long start = share.start, end = share.end;
    pl_u16* p = reinterpret_cast<pl_u16*>(table[t]);
    pl_u16* r = reinterpret_cast<pl_u16*>(table[tensors + t]);
    const pl_u16* g = reinterpret_cast<const pl_u16*>(table[2 * tensors + t]);
    pl_u16* m = reinterpret_cast<pl_u16*>(table[3 * tensors + t]);
    pl_u16* v = reinterpret_cast<pl_u16*>(table[4 * tensors + t]);

    const float lr = *lr_ptr, step = *step_ptr + 1.0f;
    PlAdamCoef c;
    c.beta1 = beta1;
    c.beta2 = beta2;
    c.one_minus_beta1 = 1.0f - beta1;
    c.one_minus_beta2 = 1.0f - beta2;
    c.eps = eps;
    c.lr_wd = lr * weight_decay;
    c.step_size = lr / (1.0f - powf(beta1, step));
    c.bc2_sqrt = sqrtf(1.0f - powf(beta2, step));

    long long e = start + threadIdx.x;  // the scalar loop's first element (all of them without vectors)
    if (share.vectors) {
        const long long quads = (end - start) >> 2;
        for (long long q = threadIdx.x; q < quads; q += blockDim.x) {
            const long long i = start + (q << 2);
            PlQuad pq, rq, gq, mq, vq;
            pq.u = *reinterpret_cast<const uint2*>(p + i);
            rq.u = *reinterpret_cast<const uint2*>(r + i);
            gq.u = *reinterpret_cast<const uint2*>(g + i);
            mq.u = *reinterpret_cast<const uint2*>(m + i);
            vq.u = *reinterpret_cast<const uint2*>(v + i);
#pragma unroll
            for (int k = 0; k < 4; ++k) pl_compact_update(pq.h[k], rq.h[k], gq.h[k], mq.h[k], vq.h[k], c);
            *reinterpret_cast<uint2*>(p + i) = pq.u;
            *reinterpret_cast<uint2*>(r + i) = rq.u;
            *reinterpret_cast<uint2*>(m + i) = mq.u;
            *reinterpret_cast<uint2*>(v + i) = vq.u;
        }
        e = start + (quads << 2) + threadIdx.x;  // the tail: fewer than 4 elements
    }
    for (; e < end; e += blockDim.x) {
        pl_u16 pe = p[e], re = r[e], me = m[e], ve = v[e];
        pl_compact_update(pe, re, g[e], me, ve, c);
        p[e] = pe;
        r[e] = re;
        m[e] = me;
        v[e] = ve;
    }
}

// One thread: the step count advances unless found_inf is set (after every group's pl_compact_adamw).
extern "C" __global__ void pl_compact_adamw_advance(float* step, const float* __restrict__ found_inf) {
    if (found_inf == nullptr || *found_inf == 0.0f) *step += 1.0f;
}

// torch's fused AdamW (aten/src/ATen/native/cuda/fused_adam_utils.cuh, ADAMW mode, fp32 opmath) in our own
// multi-tensor launches over bf16 parameters (kernels/fused_adamw.py), at the memory's rate:
//   pl_master_adamw  fp32 master weights and fp32 moments, bf16 gradients upcast in registers, every parameter
//                    written as its master's bf16 rounding (MasterAdamW, --precision master): 28 bytes of memory
//                    traffic per parameter (MasterAdamW's CPU path, an fp32 scratch, torch's fused AdamW and a
//                    copy back, moves about 40)
//   pl_bf16_adamw    bf16 parameters, gradients and moments, each parameter's own step count (torch's AdamW over
//                    bf16 parameters, --precision bf16): 14 bytes per parameter, as torch's kernel, which moves them
//                    more slowly
//
// The arithmetic is torch's: every scalar in fp32 (lr from a device scalar, the step count t from one; beta1,
// beta2, eps and weight decay rounded from the host's doubles), the bias corrections from powf, the moments through
// the same fused multiply-adds. On the weight w (the master, or the bf16 parameter upcast), the gradient g and the
// moments m and v:
//     w -= lr * wd * w
//     m = fma(b1, m, fma(-b1, g, g));  v = fma(b2, v, fma(-b2, g g, g g))
//     w -= (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
// Every bf16 store rounds to nearest even; a NaN becomes 0x7fc0, as c10::BFloat16 rounds.
//
// Work: one block per chunk of `chunk` elements of one tensor. The tables are built once on the host
// (kernels/multi_tensor.py) and stay on the device, so a launch passes pointers only and can be captured in a CUDA
// graph:
//   pl_master_adamw's table [7, T] int64: rows param, grad, master, exp_avg, exp_avg_sq pointers; numel; 1 when
//                       the 4-element vector path may run (the bf16 pointers 8-byte and the fp32 ones 16-byte
//                       aligned), else 0. The step count is one device scalar for every tensor.
//   pl_bf16_adamw's table [7, T] int64: rows param, grad, exp_avg, exp_avg_sq pointers; the step count's pointer
//                       (one per tensor); numel; the vector flag
//   chunks [2, C] int64: each block's tensor index and first element
// The step counts are advanced by the caller before the launch, as torch does. found_inf (nullable): when it holds
// 1 the step changes nothing (the test torch's fused kernels make).

#include "bf16.cuh"
#include "multi_tensor.cuh"

typedef bf16_bits pl_u16;
typedef unsigned int pl_u32;

// Not bf16.cuh's pl_bf16, which keeps a NaN's sign and payload: torch's fused AdamW stores c10::BFloat16's NaN.
__device__ __forceinline__ pl_u16 pl_round_to_bf16(float f) {  // nearest even; NaN -> 0x7fc0 (c10::BFloat16's)
    pl_u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (pl_u16)0x7fc0u;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (pl_u16)(u >> 16);
}

struct PlAdamWCoef {
    float lr, beta1, beta2, weight_decay, eps, bias_correction1, bias_correction2_sqrt;
};

__device__ __forceinline__ PlAdamWCoef pl_adamw_coef(float lr, float step, double beta1, double beta2, double eps,
                                                     double weight_decay) {
    PlAdamWCoef c;
    c.lr = lr;
    c.beta1 = (float)beta1;
    c.beta2 = (float)beta2;
    c.weight_decay = (float)weight_decay;
    c.eps = (float)eps;
    c.bias_correction1 = 1 - powf(c.beta1, step);
    c.bias_correction2_sqrt = sqrtf(1 - powf(c.beta2, step));
    return c;
}

// One element, in torch's adam_math's types and order (see the header).
__device__ __forceinline__ void pl_adamw_update(float& param, float grad, float& exp_avg, float& exp_avg_sq,
                                                const PlAdamWCoef& c) {
    if (c.weight_decay != 0) param -= c.lr * c.weight_decay * param;
    exp_avg = fmaf(c.beta1, exp_avg, fmaf(-c.beta1, grad, grad));
    exp_avg_sq = fmaf(c.beta2, exp_avg_sq, fmaf(-c.beta2, grad * grad, grad * grad));
    const float step_size = c.lr / c.bias_correction1;
    const float denom = (sqrtf(exp_avg_sq) / c.bias_correction2_sqrt) + c.eps;
    param -= step_size * exp_avg / denom;
}

extern "C" __global__ void pl_master_adamw(const long long* __restrict__ table, int tensors,
                                           const long long* __restrict__ chunks, int n_chunks, long long chunk,
                                           const float* __restrict__ lr_ptr, const float* __restrict__ step_ptr,
                                           const float* __restrict__ found_inf, double beta1, double beta2,
                                           double eps, double weight_decay) {
    if (found_inf != nullptr && *found_inf == 1.0f) return;
    const PlChunk share = pl_chunk(table, tensors, 5, chunks, n_chunks, chunk);
    const int t = share.t;
    const long long start = share.start, end = share.end;
    pl_u16* p = reinterpret_cast<pl_u16*>(table[t]);
    const pl_u16* g = reinterpret_cast<const pl_u16*>(table[tensors + t]);
    float* w = reinterpret_cast<float*>(table[2 * tensors + t]);
    float* m = reinterpret_cast<float*>(table[3 * tensors + t]);
    float* v = reinterpret_cast<float*>(table[4 * tensors + t]);

    const PlAdamWCoef c = pl_adamw_coef(*lr_ptr, *step_ptr, beta1, beta2, eps, weight_decay);

    long long e = start + threadIdx.x;  // the scalar loop's first element (all of them without vectors)
    if (share.vectors) {
        const long long quads = (end - start) >> 2;
        for (long long q = threadIdx.x; q < quads; q += blockDim.x) {
            const long long i = start + (q << 2);
            PlQuad pq, gq;
            gq.u = *reinterpret_cast<const uint2*>(g + i);
            float4 wq = *reinterpret_cast<const float4*>(w + i);
            float4 mq = *reinterpret_cast<const float4*>(m + i);
            float4 vq = *reinterpret_cast<const float4*>(v + i);
            pl_adamw_update(wq.x, pl_bf16_float(gq.h[0]), mq.x, vq.x, c);
            pl_adamw_update(wq.y, pl_bf16_float(gq.h[1]), mq.y, vq.y, c);
            pl_adamw_update(wq.z, pl_bf16_float(gq.h[2]), mq.z, vq.z, c);
            pl_adamw_update(wq.w, pl_bf16_float(gq.h[3]), mq.w, vq.w, c);
            pq.h[0] = pl_round_to_bf16(wq.x);
            pq.h[1] = pl_round_to_bf16(wq.y);
            pq.h[2] = pl_round_to_bf16(wq.z);
            pq.h[3] = pl_round_to_bf16(wq.w);
            *reinterpret_cast<float4*>(w + i) = wq;
            *reinterpret_cast<float4*>(m + i) = mq;
            *reinterpret_cast<float4*>(v + i) = vq;
            *reinterpret_cast<uint2*>(p + i) = pq.u;
        }
        e = start + (quads << 2) + threadIdx.x;  // the tail: fewer than 4 elements
    }
    for (; e < end; e += blockDim.x) {
        float we = w[e], me = m[e], ve = v[e];
        pl_adamw_update(we, pl_bf16_float(g[e]), me, ve, c);
        w[e] = we;
        m[e] = me;
        v[e] = ve;
        p[e] = pl_round_to_bf16(we);
    }
}

extern "C" __global__ void pl_bf16_adamw(const long long* __restrict__ table, int tensors,
                                         const long long* __restrict__ chunks, int n_chunks, long long chunk,
                                         const float* __restrict__ lr_ptr, const float* __restrict__ found_inf,
                                         double beta1, double beta2, double eps, double weight_decay) {
    if (found_inf != nullptr && *found_inf == 1.0f) return;
    const PlChunk share = pl_chunk(table, tensors, 5, chunks, n_chunks, chunk);
    const int t = share.t;
    const long long start = share.start, end = share.end;
    pl_u16* p = reinterpret_cast<pl_u16*>(table[t]);
    const pl_u16* g = reinterpret_cast<const pl_u16*>(table[tensors + t]);
    pl_u16* m = reinterpret_cast<pl_u16*>(table[2 * tensors + t]);
    pl_u16* v = reinterpret_cast<pl_u16*>(table[3 * tensors + t]);
    const float* step_ptr = reinterpret_cast<const float*>(table[4 * tensors + t]);
    const PlAdamWCoef c = pl_adamw_coef(*lr_ptr, *step_ptr, beta1, beta2, eps, weight_decay);

    long long e = start + threadIdx.x;  // the scalar loop's first element (all of them without vectors)
    if (share.vectors) {
        const long long quads = (end - start) >> 2;
        for (long long q = threadIdx.x; q < quads; q += blockDim.x) {
            const long long i = start + (q << 2);
            PlQuad pq, gq, mq, vq;
            pq.u = *reinterpret_cast<const uint2*>(p + i);
            gq.u = *reinterpret_cast<const uint2*>(g + i);
            mq.u = *reinterpret_cast<const uint2*>(m + i);
            vq.u = *reinterpret_cast<const uint2*>(v + i);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                float we = pl_bf16_float(pq.h[k]), me = pl_bf16_float(mq.h[k]);
                float ve = pl_bf16_float(vq.h[k]);
                pl_adamw_update(we, pl_bf16_float(gq.h[k]), me, ve, c);
                pq.h[k] = pl_round_to_bf16(we);
                mq.h[k] = pl_round_to_bf16(me);
                vq.h[k] = pl_round_to_bf16(ve);
            }
            *reinterpret_cast<uint2*>(p + i) = pq.u;
            *reinterpret_cast<uint2*>(m + i) = mq.u;
            *reinterpret_cast<uint2*>(v + i) = vq.u;
        }
        e = start + (quads << 2) + threadIdx.x;  // the tail: fewer than 4 elements
    }
    for (; e < end; e += blockDim.x) {
        float we = pl_bf16_float(p[e]), me = pl_bf16_float(m[e]), ve = pl_bf16_float(v[e]);
        pl_adamw_update(we, pl_bf16_float(g[e]), me, ve, c);
        p[e] = pl_round_to_bf16(we);
        m[e] = pl_round_to_bf16(me);
        v[e] = pl_round_to_bf16(ve);
    }
}

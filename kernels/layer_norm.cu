// LayerNorm over the last dimension of x [rows, H], bf16 in and out, fp32 statistics (kernels/layer_norm.py).
//
//   forward   y = (x - mean) rstd g + b; mean and rstd [rows] (fp32) are kept for the backward
//   backward  dx = rstd (g dy - mean(g dy) - xhat mean(g dy xhat)),  xhat = (x - mean) rstd
//             dg = sum over rows of dy xhat,  db = sum over rows of dy
//
// A block of PL_LN_THREADS threads takes one row at a time (grid-stride over rows); thread t holds the row's 16-byte
// vectors (8 elements) t, t + PL_LN_THREADS, ... in registers, V of them at most: H % 8 == 0 and
// H <= 8 * PL_LN_THREADS * V (kernels/layer_norm.py picks the smallest V). The mean and the variance are two sums
// over the values in registers (no second read of x). In the backward each thread keeps the dg and db sums of the
// columns it owns over the rows its block takes and writes them as the block's partial sums [blocks, H] (fp32);
// pl_ln_reduce adds the partials in block order, so every run sums in the same order (bitwise repeatable, as the
// graph == eager tests need).

#define PL_LN_THREADS 256

typedef unsigned short bf16_bits;

__device__ __forceinline__ bf16_bits pl_ln_bf16(float f) {  // round to nearest even; NaN stays NaN
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_bits)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_bits)(u >> 16);
}

// Eight bf16 (one 16-byte word) <-> eight floats; element 0 is the low half of the first 32-bit word.
__device__ __forceinline__ void pl_ln_load8(const bf16_bits* p, float v[8]) {
    const uint4 w = *reinterpret_cast<const uint4*>(p);
    const unsigned int u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        v[2 * k] = __uint_as_float(u[k] << 16);
        v[2 * k + 1] = __uint_as_float(u[k] & 0xffff0000u);
    }
}

__device__ __forceinline__ void pl_ln_store8(bf16_bits* p, const float v[8]) {
    unsigned int u[4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
        u[k] = (unsigned int)pl_ln_bf16(v[2 * k]) | ((unsigned int)pl_ln_bf16(v[2 * k + 1]) << 16);
    *reinterpret_cast<uint4*>(p) = make_uint4(u[0], u[1], u[2], u[3]);
}

// The sum of v over the block, returned to every thread (a fixed order: repeatable). `scratch`: 32 floats of shared
// memory; the leading barrier lets a second call reuse it once every thread has read the first call's result.
__device__ __forceinline__ float pl_ln_block_sum(float v, float* scratch) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < (int)(blockDim.x >> 5) ? scratch[lane] : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
    return t;
}

template <int V>
__device__ __forceinline__ void pl_ln_forward(const bf16_bits* __restrict__ x, const bf16_bits* __restrict__ g,
                                              const bf16_bits* __restrict__ b, bf16_bits* __restrict__ y,
                                              float* __restrict__ mean_out, float* __restrict__ rstd_out,
                                              long long rows, int H, float eps) {
    __shared__ float scratch[32];
    const int vecs = H >> 3;
    const float inv_h = 1.f / (float)H;
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const bf16_bits* xr = x + r * H;
        float v[V][8];
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const int c = j * PL_LN_THREADS + threadIdx.x;
            if (c < vecs) {
                pl_ln_load8(xr + c * 8, v[j]);
#pragma unroll
                for (int k = 0; k < 8; ++k) s += v[j][k];
            }
        }
        const float mean = pl_ln_block_sum(s, scratch) * inv_h;
        float q = 0.f;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            if (j * PL_LN_THREADS + threadIdx.x < vecs) {
#pragma unroll
                for (int k = 0; k < 8; ++k) {
                    const float d = v[j][k] - mean;
                    q += d * d;
                }
            }
        }
        const float rstd = rsqrtf(pl_ln_block_sum(q, scratch) * inv_h + eps);
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const int c = j * PL_LN_THREADS + threadIdx.x;
            if (c < vecs) {
                float gv[8], bv[8], o[8];
                pl_ln_load8(g + c * 8, gv);
                pl_ln_load8(b + c * 8, bv);
#pragma unroll
                for (int k = 0; k < 8; ++k) o[k] = (v[j][k] - mean) * rstd * gv[k] + bv[k];
                pl_ln_store8(y + r * H + c * 8, o);
            }
        }
        if (threadIdx.x == 0) {
            mean_out[r] = mean;
            rstd_out[r] = rstd;
        }
    }
}

template <int V>
__device__ __forceinline__ void pl_ln_backward(const bf16_bits* __restrict__ dy, const bf16_bits* __restrict__ x,
                                               const bf16_bits* __restrict__ g, const float* __restrict__ mean_in,
                                               const float* __restrict__ rstd_in, bf16_bits* __restrict__ dx,
                                               float* __restrict__ dg_part, float* __restrict__ db_part,
                                               long long rows, int H) {
    __shared__ float scratch[32];
    const int vecs = H >> 3;
    const float inv_h = 1.f / (float)H;
    float gv[V][8], dgs[V][8], dbs[V][8];
#pragma unroll
    for (int j = 0; j < V; ++j) {
        const int c = j * PL_LN_THREADS + threadIdx.x;
        if (c < vecs) pl_ln_load8(g + c * 8, gv[j]);
#pragma unroll
        for (int k = 0; k < 8; ++k) dgs[j][k] = dbs[j][k] = 0.f;
    }
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const float mean = mean_in[r], rstd = rstd_in[r];
        float xh[V][8], wdy[V][8];
        float s1 = 0.f, s2 = 0.f;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const int c = j * PL_LN_THREADS + threadIdx.x;
            if (c < vecs) {
                float xv[8], dv[8];
                pl_ln_load8(x + r * H + c * 8, xv);
                pl_ln_load8(dy + r * H + c * 8, dv);
#pragma unroll
                for (int k = 0; k < 8; ++k) {
                    xh[j][k] = (xv[k] - mean) * rstd;
                    wdy[j][k] = dv[k] * gv[j][k];
                    s1 += wdy[j][k] * xh[j][k];
                    s2 += wdy[j][k];
                    dgs[j][k] += dv[k] * xh[j][k];
                    dbs[j][k] += dv[k];
                }
            }
        }
        const float c1 = pl_ln_block_sum(s1, scratch) * inv_h;
        const float c2 = pl_ln_block_sum(s2, scratch) * inv_h;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const int c = j * PL_LN_THREADS + threadIdx.x;
            if (c < vecs) {
                float o[8];
#pragma unroll
                for (int k = 0; k < 8; ++k) o[k] = (wdy[j][k] - xh[j][k] * c1 - c2) * rstd;
                pl_ln_store8(dx + r * H + c * 8, o);
            }
        }
    }
#pragma unroll
    for (int j = 0; j < V; ++j) {
        const int c = j * PL_LN_THREADS + threadIdx.x;
        if (c < vecs) {
            float* dgp = dg_part + (long long)blockIdx.x * H + c * 8;
            float* dbp = db_part + (long long)blockIdx.x * H + c * 8;
            *reinterpret_cast<float4*>(dgp) = make_float4(dgs[j][0], dgs[j][1], dgs[j][2], dgs[j][3]);
            *reinterpret_cast<float4*>(dgp + 4) = make_float4(dgs[j][4], dgs[j][5], dgs[j][6], dgs[j][7]);
            *reinterpret_cast<float4*>(dbp) = make_float4(dbs[j][0], dbs[j][1], dbs[j][2], dbs[j][3]);
            *reinterpret_cast<float4*>(dbp + 4) = make_float4(dbs[j][4], dbs[j][5], dbs[j][6], dbs[j][7]);
        }
    }
}

#define PL_LN_ENTRIES(V)                                                                                            \
    extern "C" __global__ void __launch_bounds__(PL_LN_THREADS) pl_ln_forward_##V(                                  \
        const bf16_bits* x, const bf16_bits* g, const bf16_bits* b, bf16_bits* y, float* mean, float* rstd,         \
        long long rows, int H, float eps) {                                                                         \
        pl_ln_forward<V>(x, g, b, y, mean, rstd, rows, H, eps);                                                     \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(PL_LN_THREADS) pl_ln_backward_##V(                                 \
        const bf16_bits* dy, const bf16_bits* x, const bf16_bits* g, const float* mean, const float* rstd,         \
        bf16_bits* dx, float* dg_part, float* db_part, long long rows, int H) {                                     \
        pl_ln_backward<V>(dy, x, g, mean, rstd, dx, dg_part, db_part, rows, H);                                    \
    }

PL_LN_ENTRIES(1)
PL_LN_ENTRIES(2)
PL_LN_ENTRIES(4)

// dg, db [H] (bf16) = the sums of the backward's partials [parts, H] (fp32), in part order.
extern "C" __global__ void pl_ln_reduce(const float* __restrict__ dg_part, const float* __restrict__ db_part,
                                        bf16_bits* __restrict__ dg, bf16_bits* __restrict__ db, int parts, int H) {
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= H) return;
    float a = 0.f, c = 0.f;
    for (int p = 0; p < parts; ++p) {
        a += dg_part[(long long)p * H + col];
        c += db_part[(long long)p * H + col];
    }
    dg[col] = pl_ln_bf16(a);
    db[col] = pl_ln_bf16(c);
}

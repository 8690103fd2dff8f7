// LayerNorm over the last dimension of x [rows, H], bf16 in and out, fp32 statistics (kernels/layer_norm.py).
//
//   forward   y = (x - mean) rstd g + b; mean and rstd [rows] (fp32) are kept for the backward
//   backward  dx = rstd (g dy - mean(g dy) - xhat mean(g dy xhat)),  xhat = (x - mean) rstd
//             dg = sum over rows of dy xhat,  db = sum over rows of dy
//   residual  (pl_ln_backward_res_*) the gradient dr of a residual branch that also reads x is added to dx in the
//             same pass, and (pl_ln_backward_res_sum_*) its column sums kept as a third partial: a pre-norm block
//             y = x + f(norm(x)) gets x's whole gradient, and the bias gradient of f's last Linear, from one kernel
//
// A block of PL_LN_THREADS threads takes R rows at a time (grid-stride over groups of R rows); thread t holds each
// row's 16-byte vectors (8 elements) t, t + PL_LN_THREADS, ... in registers, V of them at most: H % 8 == 0 and
// H <= 8 * PL_LN_THREADS * V (kernels/layer_norm.py picks the smallest V), and R = PL_LN_ROW_VECTORS / V (at least
// 1). The mean and the variance are two sums over the values in registers (no second read of x). In the backward
// each thread keeps the dg and db sums of the columns it owns over the rows its block takes and writes them as the
// block's partial sums [blocks, H] (fp32); pl_ln_reduce adds the partials in a fixed order, so every run sums in the
// same order (bitwise repeatable, as the graph == eager tests need).

#define PL_LN_THREADS 256
#ifndef PL_LN_ROW_VECTORS
#define PL_LN_ROW_VECTORS 4  // 16-byte vectors of each tensor a thread loads per block pass: R = this / V rows
#endif
#ifndef PL_LN_BWD_BLOCKS
#define PL_LN_BWD_BLOCKS 2  // backward blocks per multiprocessor below V = 4 (BACKWARD_BLOCKS_PER_SM in layer_norm.py)
#endif
#define PL_LN_ROWS(V) ((PL_LN_ROW_VECTORS / (V)) > 0 ? (PL_LN_ROW_VECTORS / (V)) : 1)
// The residual backward with sums holds a fourth column accumulator: at V = 2 it takes half the rows at a time,
// which keeps it within the registers two blocks per multiprocessor leave (128 a thread) without spilling.
#define PL_LN_ROWS_RES_SUM(V) ((V) == 2 ? PL_LN_ROWS(V) / 2 : PL_LN_ROWS(V))

#include "bf16.cuh"

// The sums of v[0..N) over the block, returned to every thread in v (a fixed order: repeatable). `scratch`: 32 N
// floats of shared memory; the leading barrier lets a second call reuse it once every thread has read the first
// call's result. N sums share the two barriers: a block that takes R rows at a time pays them once per R rows.
template <int N>
__device__ __forceinline__ void pl_ln_block_sums(float (&v)[N], float* scratch) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v[i] += __shfl_xor_sync(0xffffffffu, v[i], o);
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) {
#pragma unroll
        for (int i = 0; i < N; ++i) scratch[i * 32 + warp] = v[i];
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < N; ++i) {
        float t = lane < (int)(blockDim.x >> 5) ? scratch[i * 32 + lane] : 0.f;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
        v[i] = t;
    }
}

// A block takes R rows at a time (rows r0 .. r0 + R - 1, grid-stride over groups of R): every thread issues the
// loads of all R rows before it waits on any, so V * R 16-byte vectors per thread are in flight, and the R rows'
// sums share one pair of barriers.
template <int V, int R>
__device__ __forceinline__ void pl_ln_forward(const bf16_bits* __restrict__ x, const bf16_bits* __restrict__ g,
                                              const bf16_bits* __restrict__ b, bf16_bits* __restrict__ y,
                                              float* __restrict__ mean_out, float* __restrict__ rstd_out,
                                              long long rows, int H, float eps) {
    __shared__ float scratch[32 * R];
    const int vecs = H >> 3;
    const float inv_h = 1.f / (float)H;
    for (long long r0 = (long long)blockIdx.x * R; r0 < rows; r0 += (long long)gridDim.x * R) {
        float v[R][V][8];
        float s[R];
#pragma unroll
        for (int i = 0; i < R; ++i) {
            s[i] = 0.f;
#pragma unroll
            for (int j = 0; j < V; ++j) {
                const int c = j * PL_LN_THREADS + threadIdx.x;
                if (c < vecs && r0 + i < rows) {
                    pl_load8(x + (r0 + i) * H + c * 8, v[i][j]);
                } else {
#pragma unroll
                    for (int k = 0; k < 8; ++k) v[i][j][k] = 0.f;
                }
            }
        }
#pragma unroll
        for (int i = 0; i < R; ++i) {
#pragma unroll
            for (int j = 0; j < V; ++j) {
#pragma unroll
                for (int k = 0; k < 8; ++k) s[i] += v[i][j][k];
            }
        }
        pl_ln_block_sums<R>(s, scratch);
        float mean[R], q[R];
#pragma unroll
        for (int i = 0; i < R; ++i) {
            mean[i] = s[i] * inv_h;
            q[i] = 0.f;
#pragma unroll
            for (int j = 0; j < V; ++j) {
                if (j * PL_LN_THREADS + threadIdx.x < vecs) {
#pragma unroll
                    for (int k = 0; k < 8; ++k) {
                        const float d = v[i][j][k] - mean[i];
                        q[i] += d * d;
                    }
                }
            }
        }
        pl_ln_block_sums<R>(q, scratch);
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const int c = j * PL_LN_THREADS + threadIdx.x;
            if (c < vecs) {
                float gv[8], bv[8];
                pl_load8(g + c * 8, gv);
                pl_load8(b + c * 8, bv);
#pragma unroll
                for (int i = 0; i < R; ++i) {
                    if (r0 + i < rows) {
                        const float rstd = rsqrtf(q[i] * inv_h + eps);
                        float o[8];
#pragma unroll
                        for (int k = 0; k < 8; ++k) o[k] = (v[i][j][k] - mean[i]) * rstd * gv[k] + bv[k];
                        pl_store8(y + (r0 + i) * H + c * 8, o);
                    }
                }
            }
        }
#pragma unroll
        for (int i = 0; i < R; ++i) {  // thread i writes row i's statistics (registers indexed at compile time)
            if (threadIdx.x == i && r0 + i < rows) {
                mean_out[r0 + i] = mean[i];
                rstd_out[r0 + i] = rsqrtf(q[i] * inv_h + eps);
            }
        }
    }
}

// RES: 0 the LayerNorm alone; 1 dr [rows, H] added to dx; 2 also dr's column sums into dr_part.
template <int V, int R, int RES>
__device__ __forceinline__ void pl_ln_backward(const bf16_bits* __restrict__ dy, const bf16_bits* __restrict__ x,
                                               const bf16_bits* __restrict__ g, const float* __restrict__ mean_in,
                                               const float* __restrict__ rstd_in, const bf16_bits* __restrict__ dr,
                                               bf16_bits* __restrict__ dx, float* __restrict__ dg_part,
                                               float* __restrict__ db_part, float* __restrict__ dr_part,
                                               long long rows, int H) {
    __shared__ float scratch[32 * 2 * R];
    const int vecs = H >> 3;
    const float inv_h = 1.f / (float)H;
    float gv[V][8], dgs[V][8], dbs[V][8], drs[V][8];
#pragma unroll
    for (int j = 0; j < V; ++j) {
        const int c = j * PL_LN_THREADS + threadIdx.x;
        if (c < vecs) pl_load8(g + c * 8, gv[j]);
#pragma unroll
        for (int k = 0; k < 8; ++k) dgs[j][k] = dbs[j][k] = drs[j][k] = 0.f;
    }
    for (long long r0 = (long long)blockIdx.x * R; r0 < rows; r0 += (long long)gridDim.x * R) {
        float xh[R][V][8], dv[R][V][8];
        float sums[2 * R];  // s1 (mean of g dy xhat) of row i at i, s2 (mean of g dy) at R + i
#pragma unroll
        for (int i = 0; i < R; ++i) {
#pragma unroll
            for (int j = 0; j < V; ++j) {
                const int c = j * PL_LN_THREADS + threadIdx.x;
                if (c < vecs && r0 + i < rows) {
                    pl_load8(x + (r0 + i) * H + c * 8, xh[i][j]);
                    pl_load8(dy + (r0 + i) * H + c * 8, dv[i][j]);
                } else {
#pragma unroll
                    for (int k = 0; k < 8; ++k) xh[i][j][k] = dv[i][j][k] = 0.f;
                }
            }
        }
#pragma unroll
        for (int i = 0; i < R; ++i) {
            const bool live = r0 + i < rows;
            const float mean = live ? mean_in[r0 + i] : 0.f, rstd = live ? rstd_in[r0 + i] : 0.f;
            float s1 = 0.f, s2 = 0.f;
#pragma unroll
            for (int j = 0; j < V; ++j) {
                if (j * PL_LN_THREADS + threadIdx.x < vecs) {
#pragma unroll
                    for (int k = 0; k < 8; ++k) {
                        xh[i][j][k] = (xh[i][j][k] - mean) * rstd;  // 0 on a row past the end (rstd 0)
                        const float w = dv[i][j][k] * gv[j][k];
                        s1 += w * xh[i][j][k];
                        s2 += w;
                        dgs[j][k] += dv[i][j][k] * xh[i][j][k];
                        dbs[j][k] += dv[i][j][k];
                    }
                }
            }
            sums[i] = s1;
            sums[R + i] = s2;
        }
        pl_ln_block_sums<2 * R>(sums, scratch);
#pragma unroll
        for (int i = 0; i < R; ++i) {
            if (r0 + i >= rows) continue;
            const float rstd = rstd_in[r0 + i], c1 = sums[i] * inv_h, c2 = sums[R + i] * inv_h;
#pragma unroll
            for (int j = 0; j < V; ++j) {
                const int c = j * PL_LN_THREADS + threadIdx.x;
                if (c < vecs) {
                    float o[8];
#pragma unroll
                    for (int k = 0; k < 8; ++k) o[k] = (dv[i][j][k] * gv[j][k] - xh[i][j][k] * c1 - c2) * rstd;
                    if (RES) {  // read here, after the row sums: registers for the R rows' x and dy only
                        float rv[8];
                        pl_load8(dr + (r0 + i) * H + c * 8, rv);
#pragma unroll
                        for (int k = 0; k < 8; ++k) {
                            o[k] += rv[k];
                            if (RES == 2) drs[j][k] += rv[k];
                        }
                    }
                    pl_store8(dx + (r0 + i) * H + c * 8, o);
                }
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
            if (RES == 2) {
                float* drp = dr_part + (long long)blockIdx.x * H + c * 8;
                *reinterpret_cast<float4*>(drp) = make_float4(drs[j][0], drs[j][1], drs[j][2], drs[j][3]);
                *reinterpret_cast<float4*>(drp + 4) = make_float4(drs[j][4], drs[j][5], drs[j][6], drs[j][7]);
            }
        }
    }
}

// Entries per register capacity V (16-byte vectors of a row per thread); R = PL_LN_ROW_VECTORS / V rows at a time
// keeps that many vectors per thread in flight whatever the width. PL_LN_BWD_BLOCKS backward blocks fit a
// multiprocessor below V = 4 (the launch makes that many per multiprocessor).
#define PL_LN_BWD_BOUNDS(V) __launch_bounds__(PL_LN_THREADS, V < 4 ? PL_LN_BWD_BLOCKS : 1)
#define PL_LN_ENTRIES(V)                                                                                            \
    extern "C" __global__ void __launch_bounds__(PL_LN_THREADS) pl_ln_forward_##V(                                  \
        const bf16_bits* x, const bf16_bits* g, const bf16_bits* b, bf16_bits* y, float* mean, float* rstd,         \
        long long rows, int H, float eps) {                                                                         \
        pl_ln_forward<V, PL_LN_ROWS(V)>(x, g, b, y, mean, rstd, rows, H, eps);                                      \
    }                                                                                                               \
    extern "C" __global__ void PL_LN_BWD_BOUNDS(V) pl_ln_backward_##V(                                              \
        const bf16_bits* dy, const bf16_bits* x, const bf16_bits* g, const float* mean, const float* rstd,         \
        bf16_bits* dx, float* dg_part, float* db_part, long long rows, int H) {                                     \
        pl_ln_backward<V, PL_LN_ROWS(V), 0>(dy, x, g, mean, rstd, nullptr, dx, dg_part, db_part, nullptr, rows, H); \
    }                                                                                                               \
    extern "C" __global__ void PL_LN_BWD_BOUNDS(V) pl_ln_backward_res_##V(                                          \
        const bf16_bits* dy, const bf16_bits* x, const bf16_bits* g, const float* mean, const float* rstd,         \
        const bf16_bits* dr, bf16_bits* dx, float* dg_part, float* db_part, long long rows, int H) {               \
        pl_ln_backward<V, PL_LN_ROWS(V), 1>(dy, x, g, mean, rstd, dr, dx, dg_part, db_part, nullptr, rows, H);      \
    }                                                                                                               \
    extern "C" __global__ void PL_LN_BWD_BOUNDS(V) pl_ln_backward_res_sum_##V(                                      \
        const bf16_bits* dy, const bf16_bits* x, const bf16_bits* g, const float* mean, const float* rstd,         \
        const bf16_bits* dr, bf16_bits* dx, float* dg_part, float* db_part, float* dr_part, long long rows,        \
        int H) {                                                                                                    \
        pl_ln_backward<V, PL_LN_ROWS_RES_SUM(V), 2>(dy, x, g, mean, rstd, dr, dx, dg_part, db_part, dr_part, rows,  \
                                                    H);                                                             \
    }

PL_LN_ENTRIES(1)
PL_LN_ENTRIES(2)
PL_LN_ENTRIES(4)

// N outputs [H] (bf16: dg, db and, after a residual backward with sums, dr's) = the sums of the backward's partials
// [parts, H] (fp32), N arrays of them. A block of PL_LN_THREADS threads takes 32 columns: warp w sums parts w, w + 8,
// ... of its lane's column in order, then the block adds the eight warps' sums in warp order. A fixed order (bitwise
// repeatable) that reads the partials with 8 x (columns / 32) warps in parallel instead of one thread per column
// walking every part.
#define PL_LN_REDUCE_WARPS (PL_LN_THREADS / 32)
template <int N>
__device__ __forceinline__ void pl_ln_reduce_n(const float* const (&part)[N], bf16_bits* const (&out)[N], int parts,
                                               int H) {
    __shared__ float partial[N][PL_LN_REDUCE_WARPS][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int col = blockIdx.x * 32 + lane;
    float a[N];
#pragma unroll
    for (int n = 0; n < N; ++n) a[n] = 0.f;
    if (col < H) {
        for (int p = warp; p < parts; p += PL_LN_REDUCE_WARPS) {
#pragma unroll
            for (int n = 0; n < N; ++n) a[n] += part[n][(long long)p * H + col];
        }
    }
#pragma unroll
    for (int n = 0; n < N; ++n) partial[n][warp][lane] = a[n];
    __syncthreads();
    if (warp == 0 && col < H) {
#pragma unroll
        for (int n = 0; n < N; ++n) {
            float t = 0.f;
#pragma unroll
            for (int w = 0; w < PL_LN_REDUCE_WARPS; ++w) t += partial[n][w][lane];
            out[n][col] = pl_bf16(t);
        }
    }
}

extern "C" __global__ void __launch_bounds__(PL_LN_THREADS) pl_ln_reduce(
    const float* __restrict__ dg_part, const float* __restrict__ db_part, bf16_bits* __restrict__ dg,
    bf16_bits* __restrict__ db, int parts, int H) {
    const float* const part[2] = {dg_part, db_part};
    bf16_bits* const out[2] = {dg, db};
    pl_ln_reduce_n<2>(part, out, parts, H);
}

extern "C" __global__ void __launch_bounds__(PL_LN_THREADS) pl_ln_reduce3(
    const float* __restrict__ dg_part, const float* __restrict__ db_part, const float* __restrict__ dr_part,
    bf16_bits* __restrict__ dg, bf16_bits* __restrict__ db, bf16_bits* __restrict__ dr_sum, int parts, int H) {
    const float* const part[3] = {dg_part, db_part, dr_part};
    bf16_bits* const out[3] = {dg, db, dr_sum};
    pl_ln_reduce_n<3>(part, out, parts, H);
}

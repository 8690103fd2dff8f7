// The token embedding's weight gradient (kernels/embedding.py): dW[v, :] = the sum over tokens t with ids[t] == v of
// dy[t, :], bf16 in and out, fp32 sums; every row of dW is written (zeros for the ids a batch does not hold).
//
// ceil(V / PL_EMB_ROWS) x (column tiles of 8 * PL_EMB_THREADS) blocks: block b owns PL_EMB_ROWS vocabulary rows
// (b / tiles) and one column tile (b % tiles); each thread keeps 8 fp32 sums per row (one 16-byte vector of
// columns). The block scans the ids a tile of PL_EMB_THREADS at a time: each thread tests one id against the
// block's rows, the warps' ballots go to shared memory, and every thread then adds the matching tokens' vectors in
// token order. That is the same order on every run (repeatable) without a sort or atomics. The scan reads every id
// once per block, so embedding.py takes this kernel only where V x tokens is small enough for that to cost less
// than torch's sort (SCAN_LIMIT). hidden % 8 == 0 and dy, dW 16-byte aligned (embedding.py checks); an id outside
// [0, V) adds to no row.

#define PL_EMB_THREADS 256
#define PL_EMB_ROWS 4
#define PL_EMB_WARPS (PL_EMB_THREADS / 32)

#include "bf16.cuh"

extern "C" __global__ void pl_embedding_backward(const long long* __restrict__ ids, const bf16_bits* __restrict__ dy,
                                                 bf16_bits* __restrict__ dw, long long tokens, long long vocab,
                                                 int hidden) {
    __shared__ unsigned int hits[PL_EMB_ROWS][PL_EMB_WARPS];
    const int tiles = (hidden + 8 * PL_EMB_THREADS - 1) / (8 * PL_EMB_THREADS);
    const long long first = (long long)(blockIdx.x / tiles) * PL_EMB_ROWS;
    const int col = ((int)(blockIdx.x % tiles) * PL_EMB_THREADS + threadIdx.x) * 8;
    const bool active = col < hidden;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float acc[PL_EMB_ROWS][8];
#pragma unroll
    for (int r = 0; r < PL_EMB_ROWS; ++r)
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[r][k] = 0.f;
    for (long long base = 0; base < tokens; base += PL_EMB_THREADS) {
        const long long t = base + threadIdx.x;
        const long long row = t < tokens ? ids[t] - first : -1;
#pragma unroll
        for (int r = 0; r < PL_EMB_ROWS; ++r) {
            const unsigned int mask = __ballot_sync(0xffffffffu, row == r);
            if (lane == 0) hits[r][warp] = mask;
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < PL_EMB_ROWS; ++r) {
            for (int w = 0; w < PL_EMB_WARPS; ++w) {
                unsigned int m = hits[r][w];
                while (m != 0u) {
                    const int bit = __ffs(m) - 1;
                    m &= m - 1u;
                    if (!active) continue;
                    float v[8];
                    pl_load8(dy + (base + w * 32 + bit) * hidden + col, v);
#pragma unroll
                    for (int k = 0; k < 8; ++k) acc[r][k] += v[k];
                }
            }
        }
        __syncthreads();  // every thread has read this tile's hits before the next tile overwrites them
    }
    if (!active) return;
#pragma unroll
    for (int r = 0; r < PL_EMB_ROWS; ++r) {
        if (first + r >= vocab) break;
        pl_store8(dw + (first + r) * hidden + col, acc[r]);
    }
}

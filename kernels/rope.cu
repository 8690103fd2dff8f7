// Rotary position embedding on the packed qkv of a GPT block (kernels/rope.py), bf16 in and out, fp32 math.
//
// Layout: qkv [B, T, 3, heads, D] (the qkv Linear's output viewed), D = head width, h = D / 2. Rotate-half pairs:
// dimension i < h pairs with i + h; at position t with angle table entries c = cos[t, i], s = sin[t, i]:
//   forward   a' = a c - b s,   b' = b c + a s          (in place on q and k; v untouched)
//   backward  da = da' c + db' s,   db = db' c - da' s   (the transposed rotation)
// The backward also packs: it reads dq, dk, dv as the attention backward returns them ([B, heads, T, D], any
// strides) and writes one packed dqkv [B, T, 3, heads, D], so no separate concatenation of the three gradients runs.
// Each thread takes four consecutive pairs of one row (8-byte bf16 loads and stores of both halves, 16-byte cos/sin
// loads; D % 8 == 0, the pointers and strides aligned: kernels/rope.py checks); the h / 4 threads of a row are
// consecutive (coalesced), a block covers blockDim.x / (h / 4) rows per step. Index math stays 32-bit while the
// row count fits: 64-bit division is a long software routine on the GPU.

#include "bf16.cuh"

// Row r of the flat loop (r < rows = B * T * parts * heads) -> (head, part, b, t).
struct PlRow {
    int head, part, t;
    long long b, bt;
};

__device__ __forceinline__ PlRow pl_row(long long r, int heads, int parts, int seq) {
    PlRow x;
    if (r <= 0x7fffffffLL) {
        unsigned int u = (unsigned int)r;
        x.head = (int)(u % (unsigned int)heads);
        u /= (unsigned int)heads;
        x.part = (int)(u % (unsigned int)parts);
        u /= (unsigned int)parts;
        x.bt = u;
        x.t = (int)(u % (unsigned int)seq);
        x.b = u / (unsigned int)seq;
    } else {
        x.head = (int)(r % heads);
        r /= heads;
        x.part = (int)(r % parts);
        x.bt = r / parts;
        x.t = (int)(x.bt % seq);
        x.b = x.bt / seq;
    }
    return x;
}

// Four bf16 (one 8-byte word) <-> four floats; element 0 is the low half of the first 32-bit word.
__device__ __forceinline__ void pl_load4(const bf16_bits* p, float v[4]) {
    const uint2 w = *reinterpret_cast<const uint2*>(p);
    v[0] = __uint_as_float(w.x << 16);
    v[1] = __uint_as_float(w.x & 0xffff0000u);
    v[2] = __uint_as_float(w.y << 16);
    v[3] = __uint_as_float(w.y & 0xffff0000u);
}

__device__ __forceinline__ void pl_store4(bf16_bits* p, const float v[4]) {
    uint2 w;
    w.x = (unsigned int)pl_bf16(v[0]) | ((unsigned int)pl_bf16(v[1]) << 16);
    w.y = (unsigned int)pl_bf16(v[2]) | ((unsigned int)pl_bf16(v[3]) << 16);
    *reinterpret_cast<uint2*>(p) = w;
}

__device__ __forceinline__ void pl_angles(const float* cos_t, const float* sin_t, int t, int dim, int i, float c[4],
                                          float s[4]) {
    const float4 cv = *reinterpret_cast<const float4*>(cos_t + (long long)t * dim + i);
    const float4 sv = *reinterpret_cast<const float4*>(sin_t + (long long)t * dim + i);
    c[0] = cv.x; c[1] = cv.y; c[2] = cv.z; c[3] = cv.w;
    s[0] = sv.x; s[1] = sv.y; s[2] = sv.z; s[3] = sv.w;
}

// Rotate four pairs read from src (halves at i and i + h) into dst: a' = a c - b s', b' = b c + a s' with s' = sign s
// (the forward's rotation with sign 1, the backward's transposed one with sign -1: the angle negated).
__device__ __forceinline__ void pl_rotate4(const bf16_bits* src, bf16_bits* dst, const float* cos_t,
                                           const float* sin_t, int t, int dim, int i, int h, float sign) {
    float a[4], b[4], c[4], s[4], ra[4], rb[4];
    pl_angles(cos_t, sin_t, t, dim, i, c, s);
    pl_load4(src + i, a);
    pl_load4(src + i + h, b);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float sk = sign * s[k];
        ra[k] = a[k] * c[k] - b[k] * sk;
        rb[k] = b[k] * c[k] + a[k] * sk;
    }
    pl_store4(dst + i, ra);
    pl_store4(dst + i + h, rb);
}

// cos / sin: fp32 tables [seq, D] (the second half repeats the first); rows = B * T * 2 * heads (q and k).
extern "C" __global__ void pl_rope_forward(bf16_bits* __restrict__ qkv, const float* __restrict__ cos_t,
                                           const float* __restrict__ sin_t, long long rows, int seq, int heads,
                                           int dim) {
    const int h = dim >> 1, quads = h >> 2, per_block = blockDim.x / quads;
    const int slot = threadIdx.x / quads, i = (threadIdx.x % quads) * 4;
    if (slot >= per_block) return;
    for (long long r = (long long)blockIdx.x * per_block + slot; r < rows; r += (long long)gridDim.x * per_block) {
        const PlRow x = pl_row(r, heads, 2, seq);  // part 0: q, 1: k
        bf16_bits* row = qkv + ((x.bt * 3 + x.part) * heads + x.head) * (long long)dim;
        pl_rotate4(row, row, cos_t, sin_t, x.t, dim, i, h, 1.f);
    }
}

// d{q,k,v}: [B, heads, T, D] with element strides (sb, sh, st; the last dimension contiguous), the same for all
// three; dqkv: contiguous [B, T, 3, heads, D]; rows = B * T * 3 * heads. v's gradient is copied word for word.
extern "C" __global__ void pl_rope_backward_pack(const bf16_bits* __restrict__ dq, const bf16_bits* __restrict__ dk,
                                                 const bf16_bits* __restrict__ dv, bf16_bits* __restrict__ dqkv,
                                                 const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                                 long long rows, int seq, int heads, int dim, long long sb,
                                                 long long sh, long long st) {
    const int h = dim >> 1, quads = h >> 2, per_block = blockDim.x / quads;
    const int slot = threadIdx.x / quads, i = (threadIdx.x % quads) * 4;
    if (slot >= per_block) return;
    for (long long r = (long long)blockIdx.x * per_block + slot; r < rows; r += (long long)gridDim.x * per_block) {
        const PlRow x = pl_row(r, heads, 3, seq);
        const bf16_bits* src = (x.part == 0 ? dq : x.part == 1 ? dk : dv) + x.b * sb + x.head * sh + x.t * st;
        bf16_bits* dst = dqkv + ((x.bt * 3 + x.part) * heads + x.head) * (long long)dim;
        if (x.part == 2) {
            *reinterpret_cast<uint2*>(dst + i) = *reinterpret_cast<const uint2*>(src + i);
            *reinterpret_cast<uint2*>(dst + i + h) = *reinterpret_cast<const uint2*>(src + i + h);
            continue;
        }
        pl_rotate4(src, dst, cos_t, sin_t, x.t, dim, i, h, -1.f);
    }
}

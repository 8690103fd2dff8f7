// Rotary position embedding on the packed qkv of a GPT block (kernels/rope.py), bf16 in and out, fp32 math.
//
// Layout: qkv [B, T, 3, heads, D] (the qkv Linear's output viewed), D = head width, h = D / 2. Rotate-half pairs:
// dimension i < h pairs with i + h; at position t with angle table entries c = cos[t, i], s = sin[t, i]:
//   forward   a' = a c - b s,   b' = b c + a s          (in place on q and k; v untouched)
//   backward  da = da' c + db' s,   db = db' c - da' s   (the transposed rotation)
// The backward also packs: it reads dq, dk, dv as the attention backward returns them ([B, heads, T, D], any
// strides) and writes one packed dqkv [B, T, 3, heads, D], so no separate concatenation of the three gradients runs.
// One thread per (b, t, part, head, i < h) pair; consecutive threads take consecutive i (coalesced).

typedef unsigned short bf16_bits;

__device__ __forceinline__ float pl_bf16_to_float(bf16_bits x) {
    return __uint_as_float(((unsigned int)x) << 16);
}

__device__ __forceinline__ bf16_bits pl_float_to_bf16(float f) {  // round to nearest even; NaN stays NaN
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_bits)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_bits)(u >> 16);
}

// Pair p of the flat loop -> (i < h, head, part < parts, bt = b * seq + t), i varying fastest.
struct PlPair {
    int i, head, part;
    long long bt;
};

__device__ __forceinline__ PlPair pl_pair(long long p, int h, int heads, int parts) {
    PlPair x;
    x.i = (int)(p % h);
    long long r = p / h;
    x.head = (int)(r % heads);
    r /= heads;
    x.part = (int)(r % parts);
    x.bt = r / parts;
    return x;
}

// cos / sin: fp32 tables [max_seq, D] (the second half repeats the first); pairs = B * T * 2 * heads * h.
extern "C" __global__ void pl_rope_forward(bf16_bits* __restrict__ qkv, const float* __restrict__ cos_t,
                                           const float* __restrict__ sin_t, long long pairs, int seq, int heads,
                                           int dim) {
    const int h = dim >> 1;
    for (long long p = (long long)blockIdx.x * blockDim.x + threadIdx.x; p < pairs;
         p += (long long)gridDim.x * blockDim.x) {
        const PlPair x = pl_pair(p, h, heads, 2);  // part 0: q, 1: k
        const int i = x.i, t = (int)(x.bt % seq);
        bf16_bits* row = qkv + ((x.bt * 3 + x.part) * heads + x.head) * (long long)dim;
        const float c = cos_t[(long long)t * dim + i], s = sin_t[(long long)t * dim + i];
        const float a = pl_bf16_to_float(row[i]), b = pl_bf16_to_float(row[i + h]);
        row[i] = pl_float_to_bf16(a * c - b * s);
        row[i + h] = pl_float_to_bf16(b * c + a * s);
    }
}

// d{q,k,v}: [B, heads, T, D] with element strides (sb, sh, st; the last dimension contiguous), the same for all
// three; dqkv: contiguous [B, T, 3, heads, D]; pairs = B * T * 3 * heads * h.
extern "C" __global__ void pl_rope_backward_pack(const bf16_bits* __restrict__ dq, const bf16_bits* __restrict__ dk,
                                                 const bf16_bits* __restrict__ dv, bf16_bits* __restrict__ dqkv,
                                                 const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                                 long long pairs, int seq, int heads, int dim, long long sb,
                                                 long long sh, long long st) {
    const int h = dim >> 1;
    for (long long p = (long long)blockIdx.x * blockDim.x + threadIdx.x; p < pairs;
         p += (long long)gridDim.x * blockDim.x) {
        const PlPair x = pl_pair(p, h, heads, 3);
        const int i = x.i, t = (int)(x.bt % seq);
        const long long b = x.bt / seq;
        const bf16_bits* src = (x.part == 0 ? dq : x.part == 1 ? dk : dv) + b * sb + x.head * sh + t * st;
        bf16_bits* dst = dqkv + ((x.bt * 3 + x.part) * heads + x.head) * (long long)dim;
        if (x.part == 2) {
            dst[i] = src[i];
            dst[i + h] = src[i + h];
            continue;
        }
        const float c = cos_t[(long long)t * dim + i], s = sin_t[(long long)t * dim + i];
        const float da = pl_bf16_to_float(src[i]), db = pl_bf16_to_float(src[i + h]);
        dst[i] = pl_float_to_bf16(da * c + db * s);
        dst[i + h] = pl_float_to_bf16(db * c - da * s);
    }
}

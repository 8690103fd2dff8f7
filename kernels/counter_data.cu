// Synthetic data from a counter-based hash (distributed/counter_data.py): element i of the buffer of (seed,
// iteration, global microbatch, stream) is a standard normal computed from nothing but those numbers and i, so a
// captured CUDA graph can make the data of whatever iteration a device-side counter names (no host work per
// iteration, which is what lets a looped graph run many iterations from one launch).
//
// The integer part is splitmix64's finalizer (Steele, Lea, Flood 2014) and is reproduced bit for bit by the torch
// reference on the CPU; the normal is Box-Muller on two 24-bit uniforms in fp32 (libm differences only).

typedef unsigned long long u64;

__device__ __forceinline__ u64 pl_mix64(u64 z) {
    z ^= z >> 30;
    z *= 0xBF58476D1CE4E5B9ull;
    z ^= z >> 27;
    z *= 0x94D049BB133111EBull;
    z ^= z >> 31;
    return z;
}

#define PL_GOLDEN 0x9E3779B97F4A7C15ull

// out[0..n): seed_mix = mix64(seed) and salt = (2 * global_mb + stream + 1) * golden are made on the host; the
// iteration is read on the device (int64, one element).
extern "C" __global__ void pl_counter_normal(float* __restrict__ out, long long n, u64 seed_mix, u64 salt,
                                             const long long* __restrict__ iteration) {
    const u64 key = pl_mix64(pl_mix64(seed_mix ^ ((u64)(*iteration) * PL_GOLDEN)) ^ salt);
    const float scale = 5.9604644775390625e-08f;  // 2^-24
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const u64 h = pl_mix64(key + (u64)(i + 1) * PL_GOLDEN);
        const float u1 = ((float)(h >> 40) + 0.5f) * scale;               // (0, 1): log is finite
        const float u2 = ((float)((h >> 16) & 0xFFFFFFull) + 0.5f) * scale;
        out[i] = sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
    }
}

// Candidate residual-add kernels of tools/gpu_probes/residual_add_probe.py: out[i] = TO(float(x[i]) + float(y[i])),
// the sum rounded once (to fp32, then round-to-nearest-even to bf16 for a bf16 result), as torch's `x + y` does.
//
// One plain pass, no shared memory. Each thread moves U chunks of E elements; a chunk of an operand is one or more
// 16-byte vectors (8 bytes for the narrower operand when E is set by the wider one). The U chunks of a thread lie
// blockDim.x chunks apart, so each of the U loads is coalesced across the block, and all 2 x U loads are issued before
// the first add. Template parameters (the probe instantiates them by name):
//   TX, TY, TO  float | bf16
//   E           elements per chunk
//   U           chunks per thread per step
//   LD          loads: 0 ld.global, 1 ld.global.nc.L1::no_allocate, 2 ld.global.cs (evict-first)
//   ST          stores: 0 st.global, 1 st.global.cs (evict-first)
//   PERSIST     0: one step per block (the grid covers the tensor, as torch's kernels do);
//               1: grid-stride loop over a grid of resident blocks
// The scalar tail (n % E elements) is done by the last block. Pointers are 16-byte aligned (the probe checks).

typedef unsigned int u32;
typedef unsigned long long u64;

// bf16 as its bit pattern: no cuda_bf16.h needed under NVRTC
struct bf16 {
  unsigned short bits;
};

__device__ __forceinline__ unsigned short f32_to_bf16_bits(float f) {
  unsigned short r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
}

// two bf16 in one word, element 0 in the low half (little endian, as in memory)
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// ---- element access: a chunk is held as 32-bit words ----

template <class T> struct io;

template <> struct io<float> {
  static constexpr int kBytes = 4;
  __device__ static __forceinline__ float get(const u32* w, int i) { return __uint_as_float(w[i]); }
  template <int E> __device__ static __forceinline__ void pack(const float (&f)[E], u32* w) {
#pragma unroll
    for (int i = 0; i < E; ++i) w[i] = __float_as_uint(f[i]);
  }
  __device__ static __forceinline__ float load(const float* p, unsigned i) { return p[i]; }
  __device__ static __forceinline__ void store(float* p, unsigned i, float f) { p[i] = f; }
};

template <> struct io<bf16> {
  static constexpr int kBytes = 2;
  __device__ static __forceinline__ float get(const u32* w, int i) {
    const u32 v = w[i >> 1];
    return __uint_as_float((i & 1) ? (v & 0xffff0000u) : (v << 16));
  }
  template <int E> __device__ static __forceinline__ void pack(const float (&f)[E], u32* w) {
#pragma unroll
    for (int i = 0; i < E / 2; ++i) w[i] = pack_bf16x2(f[2 * i], f[2 * i + 1]);
  }
  __device__ static __forceinline__ float load(const bf16* p, unsigned i) {
    return __uint_as_float(static_cast<u32>(p[i].bits) << 16);
  }
  __device__ static __forceinline__ void store(bf16* p, unsigned i, float f) { p[i].bits = f32_to_bf16_bits(f); }
};

// ---- 16- and 8-byte global accesses with cache hints; volatile keeps the program order (loads before adds) ----

template <int LD> __device__ __forceinline__ void ld16(const u32* p, u32* w) {
  if constexpr (LD == 0) {
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "l"(p));
  } else if constexpr (LD == 1) {
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "l"(p));
  } else {
    asm volatile("ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "l"(p));
  }
}

template <int LD> __device__ __forceinline__ void ld8(const u32* p, u32* w) {
  if constexpr (LD == 0) {
    asm volatile("ld.global.v2.u32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "l"(p));
  } else if constexpr (LD == 1) {
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "l"(p));
  } else {
    asm volatile("ld.global.cs.v2.u32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "l"(p));
  }
}

template <int ST> __device__ __forceinline__ void st16(u32* p, const u32* w) {
  if constexpr (ST == 0) {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};"
                 :: "l"(p), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3]) : "memory");
  } else {
    asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};"
                 :: "l"(p), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3]) : "memory");
  }
}

template <int ST> __device__ __forceinline__ void st8(u32* p, const u32* w) {
  if constexpr (ST == 0) {
    asm volatile("st.global.v2.u32 [%0], {%1, %2};" :: "l"(p), "r"(w[0]), "r"(w[1]) : "memory");
  } else {
    asm volatile("st.global.cs.v2.u32 [%0], {%1, %2};" :: "l"(p), "r"(w[0]), "r"(w[1]) : "memory");
  }
}

// W words: one 8-byte access (W = 2) or W / 4 16-byte ones
template <int LD, int W> __device__ __forceinline__ void ld_words(const u32* p, u32* w) {
  static_assert(W == 2 || W % 4 == 0, "a chunk is 8 bytes or whole 16-byte vectors");
  if constexpr (W == 2) {
    ld8<LD>(p, w);
  } else {
#pragma unroll
    for (int i = 0; i < W; i += 4) ld16<LD>(p + i, w + i);
  }
}

template <int ST, int W> __device__ __forceinline__ void st_words(u32* p, const u32* w) {
  static_assert(W == 2 || W % 4 == 0, "a chunk is 8 bytes or whole 16-byte vectors");
  if constexpr (W == 2) {
    st8<ST>(p, w);
  } else {
#pragma unroll
    for (int i = 0; i < W; i += 4) st16<ST>(p + i, w + i);
  }
}

template <class TX, class TY, class TO, int E, int U, int LD, int ST, int PERSIST>
__global__ void ra(const TX* __restrict__ x, const TY* __restrict__ y, TO* __restrict__ o, long long n64) {
  constexpr int WX = E * io<TX>::kBytes / 4, WY = E * io<TY>::kBytes / 4, WO = E * io<TO>::kBytes / 4;
  const unsigned n = static_cast<unsigned>(n64);
  const unsigned nchunks = n / E;
  const unsigned step = U * blockDim.x;
  const u32* xw = reinterpret_cast<const u32*>(x);
  const u32* yw = reinterpret_cast<const u32*>(y);
  u32* ow = reinterpret_cast<u32*>(o);
  for (unsigned base = blockIdx.x * step; base < nchunks; base += gridDim.x * step) {
    const bool full = base + step <= nchunks;  // no bounds test per chunk in all but the last step
    u32 wx[U][WX], wy[U][WY];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const unsigned c = base + u * blockDim.x + threadIdx.x;
      if (full || c < nchunks) {
        ld_words<LD, WX>(xw + static_cast<u64>(c) * WX, wx[u]);
        ld_words<LD, WY>(yw + static_cast<u64>(c) * WY, wy[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const unsigned c = base + u * blockDim.x + threadIdx.x;
      if (full || c < nchunks) {
        float f[E];
#pragma unroll
        for (int e = 0; e < E; ++e) f[e] = io<TX>::get(wx[u], e) + io<TY>::get(wy[u], e);
        u32 wo[WO];
        io<TO>::template pack<E>(f, wo);
        st_words<ST, WO>(ow + static_cast<u64>(c) * WO, wo);
      }
    }
    if (!PERSIST) break;
  }
  const unsigned t0 = nchunks * E;  // n % E < E <= blockDim.x elements left
  if (blockIdx.x == gridDim.x - 1 && threadIdx.x < n - t0) {
    const unsigned i = t0 + threadIdx.x;
    io<TO>::store(o, i, io<TX>::load(x, i) + io<TY>::load(y, i));
  }
}

// The elementwise ops of the default block: bias + GELU forward and backward, residual add.
//
// One compilation is one op with fixed element types, chosen by macros (see compile.py):
//   PL_OP      1 = bias_gelu forward, 2 = bias_gelu backward, 3 = residual add
//   PL_TX      x's type (float or pl::bf16_t); for the backward also grad's and grad_x's type
//   PL_TBIAS   bias type (ops 1, 2)
//   PL_TY      y's type (op 3); PL_TOUT the result type (op 3)
//   launch shape (ws_pipeline.cuh): PL_COMPUTE_WARPS, PL_TILE_CHUNKS, PL_STAGES, PL_DIRECT_STORE, PL_VEC
//   (E = PL_VEC x 16 bytes of the narrowest operand)
// Entry points, all extern "C":
//   pl_main     the warp-specialized kernel over the 16-byte-aligned body (ws_pipeline.cuh); PL_THREADS threads
//   pl_scalar   a plain grid-stride kernel, used when the operands cannot share one alignment (and for tiny sizes)
//   pl_flat     (op 3 only) the residual add's one-pass vector kernel over the aligned body, head and tail
//   pl_reduce   (op 2 only) the bias gradient: a deterministic column sum of the per-block partial sums, plus the
//               scalar head and tail elements of the vector path
//
// GELU is the exact one: gelu(v) = v Phi(v) = 0.5 v (1 + erf(v / sqrt 2)); gelu'(v) = Phi(v) + v phi(v). All
// arithmetic is fp32 (Phi: phi_cdf_acc for fp32 results, < 1e-6 relative; phi_cdf_fast for bf16 results; PL_GELU 0
// = normcdff everywhere); bf16 results are rounded to nearest even once. The bias is added in fp32 (torch's
// reference first rounds the bias to x's dtype and the sum to x's dtype; the fused kernel is the more accurate).
#include "ws_pipeline.cuh"

#ifndef PL_OP
#define PL_OP 1
#endif
#ifndef PL_TX
#define PL_TX float
#endif
#ifndef PL_TBIAS
#define PL_TBIAS float
#endif
#ifndef PL_TY
#define PL_TY float
#endif
#ifndef PL_TOUT
#define PL_TOUT float
#endif

namespace pl {

__device__ __forceinline__ float ldg_f32(const float* p) { return __ldg(p); }
__device__ __forceinline__ float ldg_f32(const bf16_t* p) {
  return __uint_as_float(static_cast<u32>(__ldg(reinterpret_cast<const unsigned short*>(p))) << 16);
}

// GELU through Phi(v) = normcdff(v) (CUDA math: erfcf(-v / sqrt 2) with the product's rounding compensated, max
// 5 ulp over the whole range). Not 0.5 (1 + erff(v / sqrt 2)): for v < 0 that sum cancels (erff -> -1), the
// absolute error ~3e-8 of erff becomes a relative error of 1e-3 at v = -4 and erff rounds to exactly -1 below
// v = -5.54, where gelu(v) would come out 0. PL_GELU selects cheaper forms of the same erfc (phi_cdf_fast,
// phi_cdf_acc); normcdff is PL_GELU 0.
__device__ __forceinline__ float phi_cdf(float v) { return normcdff(v); }

// exp(-v^2 / 2) / sqrt(2 pi) with v^2 split exactly into hi + lo (fma), so the argument's rounding (v^2/2 ulps,
// 12 ulps at v = 5) does not reach the result: exp(-hi/2) exp(-lo/2), the second factor ~ 1 - lo/2. |v| is
// clamped at 20 (phi is 0 in fp32 beyond 14) so that v^2 cannot overflow into inf * 0 = NaN.
__device__ __forceinline__ float phi_pdf(float v) {
  const float a = fminf(fabsf(v), 20.0f);
  const float hi = a * a;
  const float lo = fmaf(a, a, -hi);
  return 0.39894228040143268f * expf(-0.5f * hi) * (1.0f - 0.5f * lo);
}

// PL_GELU: how Phi is evaluated (gelu_mode below maps it per result type):
//   0 normcdff for every result type (the exact reference, kept for comparisons),
//   1 the default: phi_cdf_fast for bf16 results, phi_cdf_acc for fp32 results,
//   2 bf16 results: the plain 0.5 (1 + erff(v / sqrt 2)) (kept only so the benchmark can time it in the same run
//     as the default); fp32 results: normcdff,
//   3 phi_cdf_acc for every result type,
//   4 as 1, except bf16 results of the forward: phi_cdf_lite (plan field p1; the backward keeps phi_cdf_fast).
#ifndef PL_GELU
#define PL_GELU 1
#endif

// MUFU approximations without the denormal guards of __fdividef / __expf (ftz): the reciprocal's argument is
// >= 1, and ex2 of an argument below -126 flushing to 0 means Phi < 1e-38.
__device__ __forceinline__ float ex2_approx(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ float rcp_approx(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// A cheaper Phi for bf16 results (8-bit significand: rounding alone is 2^-9 = 2e-3 relative), in the form of
// Abramowitz-Stegun 7.1.26: erfc(z) = t P(t) exp(-z^2), t = 1 / (1 + p z), z = |v| / sqrt 2 >= 0, with p = 0.45 and a
// degree-5 P refitted (weighted least squares with Lawson iterations in float64: bench/kernel_tools/fit_phi.py) for
// RELATIVE error over all z: max 2.8e-5 on erfc, so Phi(v) and gelu(v) are within 3.5e-5 relative for every v (checked
// in fp32 on [-13, 10], tests/unit/test_kernels_dispatch.py), also deep in the left tail where A&S's own coefficients
// drift to 1e-2 (v = -8). About 17 instructions with one MUFU.RCP and one MUFU.EX2 (erff: ~30). Never used for fp32
// results. Also returns e = exp(-v^2 / 2), which the backward's phi(v) reuses.
__device__ __forceinline__ float phi_cdf_fast(float v, float& e) {
  const float t = rcp_approx(fmaf(fabsf(v), 0.45f * 0.70710678118654752f, 1.0f));
  // P's coefficients halved (Phi = erfc / 2), highest power first
  float p = fmaf(t, 0.5f * -0.12634821285968728f, 0.5f * 0.2682330378805142f);
  p = fmaf(t, p, 0.5f * 0.11135057033300631f);
  p = fmaf(t, p, 0.5f * 0.23974045749651607f);
  p = fmaf(t, p, 0.5f * 0.253159813190026f);
  p = fmaf(t, p, 0.5f * 0.2538924487501417f);
  e = ex2_approx(v * v * -0.72134752044448170f);  // exp(-v^2 / 2) = 2^(-v^2 log2(e) / 2)
  const float half_erfc = t * p * e;              // Phi(-|v|)
  return v < 0.0f ? half_erfc : 1.0f - half_erfc;
}
__device__ __forceinline__ float phi_cdf_fast(float v) {
  float e;
  return phi_cdf_fast(v, e);
}

// A cheaper Phi still, for bf16 forward results only (PL_GELU 4, plan field p1): phi_cdf_fast's erfc form with p = 0.45
// and P of degree 3 (bench/kernel_tools/fit_phi.fit(0.45, 4)): max 7.8e-4 relative on erfc, so Phi and gelu within
// 7.8e-4 relative for every v (tests/unit/test_kernels_dispatch.py, fp32 model on [-13, 10]); bf16's own rounding is
// 2.0e-3 to 3.9e-3 relative (half an ulp), and the norm error of bf16 results moves from 1.6619e-3 (correctly rounded)
// to 1.6623e-3 (5% of elements round to the neighbouring bf16). Two FMAs fewer per element than phi_cdf_fast, of ~18.5
// instructions per element in the bf16 forward's loop (SASS, w16.s3.t1024.d1.l1): for the forward, whose issue rate is
// close to its memory rate.
__device__ __forceinline__ float phi_cdf_lite(float v) {
  const float t = rcp_approx(fmaf(fabsf(v), 0.45f * 0.70710678118654752f, 1.0f));
  // P's coefficients halved (Phi = erfc / 2), highest power first
  float p = fmaf(t, 0.5f * 0.29437845665652956f, 0.5f * 0.19834764859822462f);
  p = fmaf(t, p, 0.5f * 0.2539672082077663f);
  p = fmaf(t, p, 0.5f * 0.25408173810285867f);
  const float e = ex2_approx(v * v * -0.72134752044448170f);  // exp(-v^2 / 2)
  const float half_erfc = t * p * e;                          // Phi(-|v|)
  return v < 0.0f ? half_erfc : 1.0f - half_erfc;
}

// Phi for fp32 results (PL_GELU 1, the default; 3 also for bf16): the same erfc form as phi_cdf_fast, erfc(z) = t P(t)
// exp(-z^2), t = 1 / (1 + p z), refitted for fp32 (bench/kernel_tools/fit_phi.py: p = 0.4, P of degree 8, max 1.3e-7
// relative on erfc over all z), and exp(-v^2 / 2) = 2^(-v^2 log2(e) / 2) evaluated so that no argument rounding reaches
// the result: v^2 = hi + lo exactly (fma, as phi_pdf), the product x = hi * C rounded, and what the rounding dropped
// (the product's error, C's own float32 error, lo * C) collected in r (|r| < 2^-16) and applied as 2^r = 1 + r ln 2. A
// float32 model of exactly this sequence (fit_phi.model_acc32) is within 5.4e-7 relative of float64 for gelu, 5.0e-7
// for Phi, 4.5e-7 for gelu' (relative to its terms) over |v| <= 10, plus at most 3 ulp (3.6e-7) from MUFU.RCP /
// MUFU.EX2: < 1e-6 per element; normcdff (5 ulp) stays as PL_GELU 0. About 26 instructions with 2 MUFU ops (normcdff:
// ~45, with a division). |v| is clamped at 20 (Phi(-20) = 0 in fp32) so that v^2 stays finite (inf would make lo = -inf
// and r * e0 = NaN). Also returns e = exp(-v^2 / 2).
__device__ __forceinline__ float phi_cdf_acc(float v, float& e) {
  const float a = fminf(fabsf(v), 20.0f);
  const float t = rcp_approx(fmaf(a, 0.4f * 0.70710678118654752f, 1.0f));
  // P's coefficients halved (Phi = erfc / 2), highest power first (fit_phi.ACC_COEFFS)
  float p = fmaf(t, 0.5f * 0.05025735994305048f, 0.5f * -0.1828845096544581f);
  p = fmaf(t, p, 0.5f * 0.1690612871201941f);
  p = fmaf(t, p, 0.5f * -0.005589969411778523f);
  p = fmaf(t, p, 0.5f * 0.1414245264182734f);
  p = fmaf(t, p, 0.5f * 0.16854340181834646f);
  p = fmaf(t, p, 0.5f * 0.2078425628500767f);
  p = fmaf(t, p, 0.5f * 0.22566960249285803f);
  p = fmaf(t, p, 0.5f * 0.22567586191585753f);
  const float hi = a * a;
  const float lo = fmaf(a, a, -hi);            // v^2 = hi + lo
  const float C = -0.72134752044448170f;       // -log2(e) / 2
  const float x = hi * C;
  float r = fmaf(hi, C, -x);                   // rounding error of hi * C
  r = fmaf(hi, -9.629815167500055e-09f, r);    // C's own rounding: -log2(e)/2 - C
  r = fmaf(lo, C, r);                          // lo * C
  const float e0 = ex2_approx(x);
  e = fmaf(e0, r * 0.69314718055994531f, e0);  // 2^(x + r) = 2^x (1 + r ln 2)
  const float half_erfc = (t * p) * e;         // Phi(-|v|)
  return v < 0.0f ? half_erfc : 1.0f - half_erfc;
}
__device__ __forceinline__ float phi_cdf_acc(float v) {
  float e;
  return phi_cdf_acc(v, e);
}

template <int MODE>
__device__ __forceinline__ float phi_cdf_t(float v) {
  if constexpr (MODE == 1) return phi_cdf_fast(v);
  else if constexpr (MODE == 2) return 0.5f * (1.0f + erff(v * 0.70710678118654752f));
  else if constexpr (MODE == 3) return phi_cdf_acc(v);
  else if constexpr (MODE == 4) return phi_cdf_lite(v);
  else return phi_cdf(v);
}

template <int MODE>
__device__ __forceinline__ float gelu_t(float v) { return v * phi_cdf_t<MODE>(v); }

// The Phi evaluation (MODE of phi_cdf_t) for results of `bytes` bytes under PL_GELU (see above); PL_GELU 4 gives
// bf16 results MODE 4 (phi_cdf_lite in gelu_t; gelu_grad_t's last branch, phi_cdf_fast, for the backward).
__host__ __device__ constexpr int gelu_mode(int bytes) {  // __device__: NVRTC compiles no host code
  return bytes == 2 ? PL_GELU : (PL_GELU == 1 || PL_GELU == 3 || PL_GELU == 4 ? 3 : 0);
}

__device__ __forceinline__ float gelu_f(float v) { return gelu_t<0>(v); }

// gelu'(v) = Phi(v) + v phi(v); no cancellation for v << 0 (Phi ~ phi / |v|), only near the root v = -0.7518,
// where the result is small against its terms (an fp32 sum: error ~ eps (Phi + |v| phi)).
template <int MODE>
__device__ __forceinline__ float gelu_grad_t(float v) {
  if constexpr (MODE == 0) {
    return phi_cdf(v) + v * phi_pdf(v);
  } else if constexpr (MODE == 2) {  // the plain erff form
    return phi_cdf_t<2>(v) + v * (0.39894228040143268f * expf(-0.5f * v * v));
  } else if constexpr (MODE == 3) {
    // fp32 results: phi(v) = e / sqrt(2 pi) from phi_cdf_acc's exp (accurate to ~1 ulp, argument split)
    float e;
    const float cdf = phi_cdf_acc(v, e);
    return fmaf(v * 0.39894228040143268f, e, cdf);
  } else {
    // bf16 results: phi(v) from the same MUFU.EX2 as Phi (relative error ~1e-6 at v = 5, bf16's is 2e-3)
    float e;
    const float cdf = phi_cdf_fast(v, e);
    return fmaf(v * 0.39894228040143268f, e, cdf);
  }
}

__device__ __forceinline__ float gelu_grad_f(float v) { return gelu_grad_t<0>(v); }

// E bias values starting at column `col`; `vec` (uniform) says the host checked that col is a multiple of E,
// H a multiple of E and the bias pointer aligned, so the E values are one aligned vector without wrap-around.
template <class TB, int E>
__device__ __forceinline__ void load_bias(const TB* __restrict__ bias, int col, int H, int vec, float (&bb)[E]) {
  constexpr int BYTES = E * static_cast<int>(sizeof(TB));
  if (vec) {
    if constexpr (BYTES % 16 == 0) {
      const uint4* q = reinterpret_cast<const uint4*>(bias + col);
#pragma unroll
      for (int j = 0; j < BYTES / 16; ++j) {
        const uint4 v = __ldg(q + j);
        const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          if constexpr (sizeof(TB) == 4) {
            bb[4 * j + i] = __uint_as_float(w[i]);
          } else {
            bb[8 * j + 2 * i + 0] = __uint_as_float(w[i] << 16);
            bb[8 * j + 2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
          }
        }
      }
      return;
    } else {
      static_assert(BYTES == 8, "bias vector is 8 bytes (4 bf16) when not whole 16-byte vectors");
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(bias + col));
      bb[0] = __uint_as_float(v.x << 16);
      bb[1] = __uint_as_float(v.x & 0xffff0000u);
      bb[2] = __uint_as_float(v.y << 16);
      bb[3] = __uint_as_float(v.y & 0xffff0000u);
      return;
    }
  }
#pragma unroll
  for (int k = 0; k < E; ++k) {
    int c = col + k;
    if (H >= E) {
      c = (c >= H) ? c - H : c;
    } else {
      c = c % H;
    }
    bb[k] = ldg_f32(bias + c);
  }
}

// Columns of a compute thread's slots for the current tile. Slot s of compute thread ct in tile t holds body
// chunk t * TILE + ct + s * NCT, whose first element is head + chunk * E; its column advances by
// (gridDim.x * TILE * E) mod H from one tile to the next.
template <int E>
struct Columns {
  int col[kChunksPerThread];
  int delta;
  __device__ __forceinline__ void begin(int ct, long long head, int H) {
#pragma unroll
    for (int s = 0; s < kChunksPerThread; ++s) {
      const long long chunk = static_cast<long long>(blockIdx.x) * kTileChunks + ct + s * kComputeThreads;
      col[s] = static_cast<int>((head + chunk * E) % H);
    }
    delta = static_cast<int>((static_cast<long long>(gridDim.x) * kTileChunks * E) % H);
  }
  __device__ __forceinline__ void advance(int H) {
#pragma unroll
    for (int s = 0; s < kChunksPerThread; ++s) {
      const int c = col[s] + delta;
      col[s] = (c >= H) ? c - H : c;
    }
  }
};

template <class TX, class TBIAS>
struct BiasGeluFwd {
  typedef TX TA;
  typedef TX TB;  // unused: no second input
  typedef TX TC;
  static constexpr int E = PL_VEC * 16 / static_cast<int>(sizeof(TX));
  static constexpr bool HAS_B = false;
  // The cheap Phi where the result is bf16 (its rounding dwarfs the approximation); the accurate one for fp32.
  static constexpr int kGelu = gelu_mode(sizeof(TX));

  const TX* x;
  TX* y;
  const TBIAS* bias;
  long long n, head, body_end;
  int H, bias_vec;
  Columns<E> cols;

  __device__ __forceinline__ void begin(int ct) { cols.begin(ct, head, H); }
  __device__ __forceinline__ void next_tile() { cols.advance(H); }
  __device__ __forceinline__ void end(int) {}
  __device__ __forceinline__ void chunk(int s, const float (&a)[E], const float (&)[E], float (&c)[E]) {
    float bb[E];
    load_bias<TBIAS, E>(bias, cols.col[s], H, bias_vec, bb);
#pragma unroll
    for (int k = 0; k < E; ++k) c[k] = gelu_t<kGelu>(a[k] + bb[k]);
  }
  __device__ __forceinline__ void scalar(long long e) {
    y[e] = from_f32<TX>(gelu_t<kGelu>(to_f32(x[e]) + ldg_f32(bias + e % H)));
  }
  __device__ __forceinline__ void head_tail(int lane) {
    for (long long e = lane; e < head; e += 32) scalar(e);
    for (long long e = body_end + lane; e < n; e += 32) scalar(e);
  }
};

template <class TX, class TBIAS>
struct BiasGeluBwd {
  typedef TX TA;  // grad
  typedef TX TB;  // x
  typedef TX TC;  // grad_x
  static constexpr int E = PL_VEC * 16 / static_cast<int>(sizeof(TX));
  static constexpr bool HAS_B = true;
  // As in the forward: the cheap Phi and pdf only for bf16 grad_x (the bias gradient sums fp32 products of those
  // values: their ~1e-7 absolute error per element is far under the bf16 bound of the bias gradient too); fp32
  // grad_x takes phi_cdf_acc and its exp.
  static constexpr int kGelu = gelu_mode(sizeof(TX));

  const TBIAS* bias;
  float* part;  // gridDim.x * TILE * E partial bias-gradient sums, one per (block, slot element)
  long long head;
  int H, bias_vec;
  Columns<E> cols;
  float acc[kChunksPerThread][E];

  __device__ __forceinline__ void begin(int ct) {
    cols.begin(ct, head, H);
#pragma unroll
    for (int s = 0; s < kChunksPerThread; ++s)
#pragma unroll
      for (int k = 0; k < E; ++k) acc[s][k] = 0.f;
  }
  __device__ __forceinline__ void next_tile() { cols.advance(H); }
  __device__ __forceinline__ void chunk(int s, const float (&g)[E], const float (&xv)[E], float (&c)[E]) {
    float bb[E];
    load_bias<TBIAS, E>(bias, cols.col[s], H, bias_vec, bb);
#pragma unroll
    for (int k = 0; k < E; ++k) {
      c[k] = g[k] * gelu_grad_t<kGelu>(xv[k] + bb[k]);
      acc[s][k] += c[k];
    }
  }
  // The host picks gridDim.x so that gridDim.x * TILE * E is a multiple of H: a slot's column is then the same
  // in every tile, so the per-thread sums are sums over one column each, and the partials array, read as rows of
  // H, has column (head + k) % H at position k of every row.
  __device__ __forceinline__ void end(int ct) {
    float* out = part + static_cast<long long>(blockIdx.x) * kTileChunks * E;
#pragma unroll
    for (int s = 0; s < kChunksPerThread; ++s)
#pragma unroll
      for (int k = 0; k < E; ++k) out[(ct + s * kComputeThreads) * E + k] = acc[s][k];
  }
  __device__ __forceinline__ void head_tail(int) {}  // pl_reduce does the head and tail elements
};

template <class TX, class TY, class TOUT>
struct ResidualAdd {
  typedef TX TA;
  typedef TY TB;
  typedef TOUT TC;
  static constexpr int MIN_SIZE = sizeof(TX) < sizeof(TY) ? static_cast<int>(sizeof(TX)) : static_cast<int>(sizeof(TY));
  static constexpr int E = PL_VEC * 16 / MIN_SIZE;
  static constexpr bool HAS_B = true;

  const TX* x;
  const TY* y;
  TOUT* out;
  long long n, head, body_end;

  __device__ __forceinline__ void begin(int) {}
  __device__ __forceinline__ void next_tile() {}
  __device__ __forceinline__ void end(int) {}
  __device__ __forceinline__ void chunk(int, const float (&a)[E], const float (&b)[E], float (&c)[E]) {
#pragma unroll
    for (int k = 0; k < E; ++k) c[k] = a[k] + b[k];
  }
  __device__ __forceinline__ void head_tail(int lane) {
    for (long long e = lane; e < head; e += 32) out[e] = from_f32<TOUT>(to_f32(x[e]) + to_f32(y[e]));
    for (long long e = body_end + lane; e < n; e += 32) out[e] = from_f32<TOUT>(to_f32(x[e]) + to_f32(y[e]));
  }
};

}  // namespace pl

typedef PL_TX TX;
typedef PL_TBIAS TBIAS;
typedef PL_TY TY;
typedef PL_TOUT TOUT;

#if PL_OP == 1

// x, y: the whole tensors; the body starts `head` elements in and holds `nchunks` chunks of E elements.
extern "C" __global__ void __launch_bounds__(PL_THREADS)
    pl_main(const TX* __restrict__ x, TX* __restrict__ y, const TBIAS* __restrict__ bias, long long n, long long head,
            long long nchunks, int H, int bias_vec) {
  typedef pl::BiasGeluFwd<TX, TBIAS> Op;
  Op op;
  op.x = x;
  op.y = y;
  op.bias = bias;
  op.n = n;
  op.head = head;
  op.body_end = head + nchunks * Op::E;
  op.H = H;
  op.bias_vec = bias_vec;
  pl::run_engine(op, reinterpret_cast<const unsigned char*>(x + head), nullptr,
                 reinterpret_cast<unsigned char*>(y + head), nchunks);
}

extern "C" __global__ void pl_scalar(const TX* __restrict__ x, TX* __restrict__ y, const TBIAS* __restrict__ bias,
                                     long long n, int H) {
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long e = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += stride) {
    y[e] = pl::from_f32<TX>(pl::gelu_f(pl::to_f32(x[e]) + pl::ldg_f32(bias + e % H)));
  }
}

#elif PL_OP == 2

extern "C" __global__ void __launch_bounds__(PL_THREADS)
    pl_main(const TX* __restrict__ grad, const TX* __restrict__ x, TX* __restrict__ gx,
            const TBIAS* __restrict__ bias, float* __restrict__ part, long long head, long long nchunks, int H,
            int bias_vec) {
  typedef pl::BiasGeluBwd<TX, TBIAS> Op;
  Op op;
  op.bias = bias;
  op.part = part;
  op.head = head;
  op.H = H;
  op.bias_vec = bias_vec;
  pl::run_engine(op, reinterpret_cast<const unsigned char*>(grad + head),
                 reinterpret_cast<const unsigned char*>(x + head), reinterpret_cast<unsigned char*>(gx + head),
                 nchunks);
}

// Thread gid of `nthreads` (a multiple of H) handles elements gid, gid + nthreads, ...: all in column gid % H, so
// part[gid] is a sum over one column and `part`, read as rows of H, has column k at position k.
extern "C" __global__ void pl_scalar(const TX* __restrict__ grad, const TX* __restrict__ x, TX* __restrict__ gx,
                                     const TBIAS* __restrict__ bias, float* __restrict__ part, long long n, int H,
                                     long long nthreads) {
  const long long gid = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (gid >= nthreads) return;
  const float b = pl::ldg_f32(bias + gid % H);
  float acc = 0.f;
  for (long long e = gid; e < n; e += nthreads) {
    const float c = pl::to_f32(grad[e]) * pl::gelu_grad_f(pl::to_f32(x[e]) + b);
    gx[e] = pl::from_f32<TX>(c);
    acc += c;
  }
  part[gid] = acc;
}

// Block (32, 32), grid ceil(H / 32). dbias[(shift + k) % H] = sum over rows r of part[r * H + k], in a fixed
// order (deterministic), plus the elements of [0, head) and [tail_start, n) in that column, whose grad_x this
// kernel also writes.
extern "C" __global__ void __launch_bounds__(1024)
    pl_reduce(const float* __restrict__ part, long long rows, int H, long long shift, const TX* __restrict__ grad,
              const TX* __restrict__ x, TX* __restrict__ gx, const TBIAS* __restrict__ bias, long long n,
              long long head, long long tail_start, TBIAS* __restrict__ dbias) {
  __shared__ float red[32][33];
  const int k = blockIdx.x * 32 + threadIdx.x;
  float s = 0.f;
  if (k < H) {
    for (long long r = threadIdx.y; r < rows; r += 32) s += part[r * H + k];
  }
  red[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || k >= H) return;
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < 32; ++i) total += red[i][threadIdx.x];
  const int col = static_cast<int>((shift + k) % H);
  const float b = pl::ldg_f32(bias + col);
  for (long long e = 0; e < head; ++e) {
    if (e % H == col) {
      const float c = pl::to_f32(grad[e]) * pl::gelu_grad_f(pl::to_f32(x[e]) + b);
      gx[e] = pl::from_f32<TX>(c);
      total += c;
    }
  }
  for (long long e = tail_start; e < n; ++e) {
    if (e % H == col) {
      const float c = pl::to_f32(grad[e]) * pl::gelu_grad_f(pl::to_f32(x[e]) + b);
      gx[e] = pl::from_f32<TX>(c);
      total += c;
    }
  }
  dbias[col] = pl::from_f32<TBIAS>(total);
}

#elif PL_OP == 3

extern "C" __global__ void __launch_bounds__(PL_THREADS)
    pl_main(const TX* __restrict__ x, const TY* __restrict__ y, TOUT* __restrict__ out, long long n, long long head,
            long long nchunks) {
  typedef pl::ResidualAdd<TX, TY, TOUT> Op;
  Op op;
  op.x = x;
  op.y = y;
  op.out = out;
  op.n = n;
  op.head = head;
  op.body_end = head + nchunks * Op::E;
  pl::run_engine(op, reinterpret_cast<const unsigned char*>(x + head),
                 reinterpret_cast<const unsigned char*>(y + head), reinterpret_cast<unsigned char*>(out + head),
                 nchunks);
}

extern "C" __global__ void pl_scalar(const TX* __restrict__ x, const TY* __restrict__ y, TOUT* __restrict__ out,
                                     long long n) {
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long e = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += stride) {
    out[e] = pl::from_f32<TOUT>(pl::to_f32(x[e]) + pl::to_f32(y[e]));
  }
}

namespace pl {

__device__ __forceinline__ uint4 ld_global_v4(const void* p) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ void st_global_v4_plain(void* p, const uint4& v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// A chunk of E elements of T moved between global memory and fp32 registers as 16-byte vectors, with plain
// ld/st.global whatever PL_HINT says (no cache hint measured faster here); ChunkIO widens and rounds the vectors
// in registers, as it does the engine's shared-memory tiles.
template <class T, int E>
__device__ __forceinline__ void flat_load(const T* p, float (&f)[E]) {
  constexpr int V = E * static_cast<int>(sizeof(T)) / 16;
  uint4 raw[V];
#pragma unroll
  for (int j = 0; j < V; ++j) raw[j] = ld_global_v4(reinterpret_cast<const uint4*>(p) + j);
  ChunkIO<T, E>::load(reinterpret_cast<const unsigned char*>(raw), f);
}

template <class T, int E>
__device__ __forceinline__ void flat_store(T* p, const float (&f)[E]) {
  constexpr int V = E * static_cast<int>(sizeof(T)) / 16;
  uint4 raw[V];
  ChunkIO<T, E>::store(reinterpret_cast<unsigned char*>(raw), f);
#pragma unroll
  for (int j = 0; j < V; ++j) st_global_v4_plain(reinterpret_cast<uint4*>(p) + j, raw[j]);
}

}  // namespace pl

// The residual add's vector path: one plain pass, one chunk of E elements per thread, a grid that covers the body
// (no shared memory, no warp roles). A pure stream gains nothing from the engine's staging: this is the shape of
// torch's own elementwise kernel, which the engine trailed by 2-5 % beyond L2 (tools/gpu_probes/residual_add_probe.py
// sweeps the alternatives). Block 0 also adds the scalar head and tail (fewer than E elements each).
#define PL_FLAT_THREADS 256
extern "C" __global__ void __launch_bounds__(PL_FLAT_THREADS)
    pl_flat(const TX* __restrict__ x, const TY* __restrict__ y, TOUT* __restrict__ out, long long n, long long head,
            long long nchunks) {
  constexpr int E = pl::ResidualAdd<TX, TY, TOUT>::E;
  const long long c = static_cast<long long>(blockIdx.x) * PL_FLAT_THREADS + threadIdx.x;
  if (c < nchunks) {
    const long long e = head + c * E;
    float a[E], b[E], r[E];
    pl::flat_load<TX, E>(x + e, a);
    pl::flat_load<TY, E>(y + e, b);
#pragma unroll
    for (int k = 0; k < E; ++k) r[k] = a[k] + b[k];
    pl::flat_store<TOUT, E>(out + e, r);
  }
  if (blockIdx.x == 0 && threadIdx.x < E) {
    const long long body_end = head + nchunks * E;
    const long long h = threadIdx.x, t = body_end + threadIdx.x;
    if (h < head) out[h] = pl::from_f32<TOUT>(pl::to_f32(x[h]) + pl::to_f32(y[h]));
    if (t < n) out[t] = pl::from_f32<TOUT>(pl::to_f32(x[t]) + pl::to_f32(y[t]));
  }
}

#else
#error "PL_OP must be 1, 2 or 3"
#endif

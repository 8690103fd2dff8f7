// Warp-specialized streaming engine: one loader warp, PL_COMPUTE_WARPS compute warps, one storer warp.
//
//   loader  --(in_pipe: cp.async 16 B per lane, LDGSTS)-->  compute  --(out_pipe: st.shared)-->  storer
//
// Shared memory is double-buffered, per stage [A | B | C] (inputs A, B and result C), so the block holds
// [A0|B0|C0|A1|B1|C1]. Two block-scoped cuda::pipeline objects order the hand-offs: the loader is the producer of
// in_pipe and the compute warps its consumers; the compute warps are the producers of out_pipe and the storer
// its consumer. The grid is persistent: block b walks tiles b, b + gridDim.x, ... and every role walks the same
// sequence, so the stage index (tile iteration % STAGES) agrees between the roles.
//
// A tile is PL_TILE_CHUNKS chunks; a chunk is E consecutive elements, E = 16 / (smallest element size streamed),
// so each streamed operand's chunk is a whole number of 16-byte vectors. The host guarantees that all streamed
// pointers reach 16-byte alignment after the same number of leading elements (the scalar head); the engine is
// handed pointers to the aligned body and the number of whole chunks in it. Elements before (head) and after
// (tail) the body are the op's business (scalar code).
//
// Compiled by NVRTC (through CuPy) and by nvcc for the SASS report; no host headers are needed.
#pragma once

#include <cuda/pipeline>

#ifndef PL_COMPUTE_WARPS
#define PL_COMPUTE_WARPS 4
#endif
#ifndef PL_TILE_CHUNKS
#define PL_TILE_CHUNKS 512
#endif
#ifndef PL_STAGES
#define PL_STAGES 2
#endif
// 1: the compute warps store results straight from registers to global memory (16-byte vector stores, coalesced
// across the warp) and the C buffers are not in shared memory; the storer warp then only does the scalar head and
// tail. 0: results go through shared memory to the storer warp (the book's design). See README.md.
#ifndef PL_DIRECT_STORE
#define PL_DIRECT_STORE 0
#endif
// 16-byte vectors per chunk of the narrowest operand (1 or 2): 2 makes each compute lane own 32 contiguous bytes.
#ifndef PL_VEC
#define PL_VEC 1
#endif

// How the loader warp moves a tile global -> shared:
//   0 cp.async, 16 bytes per lane (LDGSTS), completion through the block-scoped cuda::pipeline in_pipe (the book's);
//   1 Hopper bulk copies: one elected lane issues one cp.async.bulk per operand tile (UBLKCP in SASS; the TMA unit
//     moves the whole tile, no per-16-byte instructions), completing on a per-stage "full" mbarrier by transaction
//     bytes; the compute threads free a stage by arriving on its "empty" mbarrier. sm_90 or newer.
#ifndef PL_LOADER
#define PL_LOADER 0
#endif
// How the storer warp writes a result tile shared -> global (PL_DIRECT_STORE 0 only):
//   0 16-byte st.global per lane (the book's);
//   1 one cp.async.bulk shared -> global per tile (TMA store, bulk_group) from lane 0: the compute threads fence
//     their st.shared for the async proxy (fence.proxy.async.shared::cta) before handing the tile over, and the
//     storer frees the C buffer only after cp.async.bulk.wait_group.read 0 (the TMA unit has read it). sm_90.
#ifndef PL_STORER
#define PL_STORER 0
#endif
// Cache hints for data touched once (the op streams each byte through exactly once):
//   0 none (the default);
//   1 results stored with st.global.cs (cache-streaming: evict-first in L2), direct stores only;
//   2 as 1, and the bulk loader's tiles read with an L2 evict_first policy (cp.async.bulk ... .L2::cache_hint).
// Meant for the pure streaming ops (residual add), where the inputs and outputs together exceed L2: lines used
// once should not push out lines still to be read.
#ifndef PL_HINT
#define PL_HINT 0
#endif

#define PL_THREADS (32 * (PL_COMPUTE_WARPS + 2))

namespace pl {

typedef unsigned int u32;
typedef unsigned long long u64;

// bf16 is carried as its bit pattern: NVRTC then needs no cuda_bf16.h, and the conversions below are the same
// round-to-nearest-even that torch uses.
struct bf16_t {
  unsigned short bits;
};

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(bf16_t v) { return __uint_as_float(static_cast<u32>(v.bits) << 16); }

__device__ __forceinline__ unsigned short f32_to_bf16_bits(float f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  unsigned short r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
#else
  u32 u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<unsigned short>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<unsigned short>(u >> 16);
#endif
}

template <class T> __device__ __forceinline__ T from_f32(float f);
template <> __device__ __forceinline__ float from_f32<float>(float f) { return f; }
template <> __device__ __forceinline__ bf16_t from_f32<bf16_t>(float f) {
  bf16_t r;
  r.bits = f32_to_bf16_bits(f);
  return r;
}

// Two bf16 in one 32-bit word: element 0 in the low half (little endian, as in memory).
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));  // d.hi = first source, d.lo = second
  return r;
#else
  return static_cast<u32>(f32_to_bf16_bits(lo)) | (static_cast<u32>(f32_to_bf16_bits(hi)) << 16);
#endif
}

// ---- chunks of E elements in shared memory (16-byte vector accesses) <-> float registers ----

template <class T, int E>
__device__ __forceinline__ void load_chunk(const unsigned char* p, float (&f)[E]);

template <class T, int E>
__device__ __forceinline__ void store_chunk(unsigned char* p, const float (&f)[E]);

template <int E>
__device__ __forceinline__ void load_chunk_f32(const unsigned char* p, float (&f)[E]) {
  static_assert(E % 4 == 0, "fp32 chunk must be whole 16-byte vectors");
  const float4* q = reinterpret_cast<const float4*>(p);
#pragma unroll
  for (int j = 0; j < E / 4; ++j) {
    const float4 v = q[j];
    f[4 * j + 0] = v.x;
    f[4 * j + 1] = v.y;
    f[4 * j + 2] = v.z;
    f[4 * j + 3] = v.w;
  }
}

template <int E>
__device__ __forceinline__ void store_chunk_f32(unsigned char* p, const float (&f)[E]) {
  float4* q = reinterpret_cast<float4*>(p);
#pragma unroll
  for (int j = 0; j < E / 4; ++j) q[j] = make_float4(f[4 * j + 0], f[4 * j + 1], f[4 * j + 2], f[4 * j + 3]);
}

template <int E>
__device__ __forceinline__ void load_chunk_bf16(const unsigned char* p, float (&f)[E]) {
  static_assert(E % 8 == 0, "bf16 chunk must be whole 16-byte vectors");
  const uint4* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int j = 0; j < E / 8; ++j) {
    const uint4 v = q[j];
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[8 * j + 2 * i + 0] = __uint_as_float(w[i] << 16);
      f[8 * j + 2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
}

template <int E>
__device__ __forceinline__ void store_chunk_bf16(unsigned char* p, const float (&f)[E]) {
  uint4* q = reinterpret_cast<uint4*>(p);
#pragma unroll
  for (int j = 0; j < E / 8; ++j) {
    uint4 v;
    v.x = pack_bf16x2(f[8 * j + 0], f[8 * j + 1]);
    v.y = pack_bf16x2(f[8 * j + 2], f[8 * j + 3]);
    v.z = pack_bf16x2(f[8 * j + 4], f[8 * j + 5]);
    v.w = pack_bf16x2(f[8 * j + 6], f[8 * j + 7]);
    q[j] = v;
  }
}

// Direct stores (PL_DIRECT_STORE): st.global.v4 from registers. The pointer is a generic address of global
// memory, which the global window maps one to one (what the compiler's own cvta.to.global does); through a plain
// uint4* NVRTC emits generic st.v4 (ST.E.128) since it cannot prove the space.
__device__ __forceinline__ void st_global_v4(unsigned char* p, u32 a, u32 b, u32 c, u32 d) {
#if PL_HINT >= 1
  asm volatile("st.global.cs.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
#else
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
#endif
}

template <int E>
__device__ __forceinline__ void store_chunk_f32_global(unsigned char* p, const float (&f)[E]) {
#pragma unroll
  for (int j = 0; j < E / 4; ++j)
    st_global_v4(p + 16 * j, __float_as_uint(f[4 * j + 0]), __float_as_uint(f[4 * j + 1]),
                 __float_as_uint(f[4 * j + 2]), __float_as_uint(f[4 * j + 3]));
}

template <int E>
__device__ __forceinline__ void store_chunk_bf16_global(unsigned char* p, const float (&f)[E]) {
#pragma unroll
  for (int j = 0; j < E / 8; ++j)
    st_global_v4(p + 16 * j, pack_bf16x2(f[8 * j + 0], f[8 * j + 1]), pack_bf16x2(f[8 * j + 2], f[8 * j + 3]),
                 pack_bf16x2(f[8 * j + 4], f[8 * j + 5]), pack_bf16x2(f[8 * j + 6], f[8 * j + 7]));
}

template <class T, int E> struct ChunkIO;
template <int E> struct ChunkIO<float, E> {
  static __device__ __forceinline__ void load(const unsigned char* p, float (&f)[E]) { load_chunk_f32<E>(p, f); }
  static __device__ __forceinline__ void store(unsigned char* p, const float (&f)[E]) { store_chunk_f32<E>(p, f); }
  static __device__ __forceinline__ void store_global(unsigned char* p, const float (&f)[E]) {
    store_chunk_f32_global<E>(p, f);
  }
};
template <int E> struct ChunkIO<bf16_t, E> {
  static __device__ __forceinline__ void load(const unsigned char* p, float (&f)[E]) { load_chunk_bf16<E>(p, f); }
  static __device__ __forceinline__ void store(unsigned char* p, const float (&f)[E]) { store_chunk_bf16<E>(p, f); }
  static __device__ __forceinline__ void store_global(unsigned char* p, const float (&f)[E]) {
    store_chunk_bf16_global<E>(p, f);
  }
};

// ---- thread groups for cuda::make_pipeline: a contiguous range of warps, synchronized by a named barrier ----
// make_pipeline needs size(), thread_rank() and sync() of the group of threads that take part; the loader does
// not take part in out_pipe and the storer not in in_pipe, so neither pipeline can use the whole block.

template <int FIRST_WARP, int NWARPS, int BARRIER_ID>
struct WarpRange {
  __device__ unsigned long long size() const { return 32ull * NWARPS; }
  __device__ unsigned long long thread_rank() const { return threadIdx.x - 32u * FIRST_WARP; }
  __device__ void sync() const { asm volatile("bar.sync %0, %1;" ::"n"(BARRIER_ID), "n"(32 * NWARPS) : "memory"); }
};

// All PL_THREADS threads, reached from each role's own code (a named barrier counts arrivals, not program points,
// as in CUTLASS's warp-specialized kernels). Used once after the pipelines are made and once before they are
// destroyed: the states' mbarriers are initialized by one thread behind a partial (named) barrier and invalidated
// by the last thread to quit, ordered only by an atomic counter; a full-block barrier on both sides makes that
// ordering plain, at the cost of two barriers per block per launch.
constexpr int kAllRolesBarrier = 3;  // 1 and 2 are the WarpRange groups
__device__ __forceinline__ void all_roles_sync() {
  asm volatile("bar.sync %0, %1;" ::"n"(kAllRolesBarrier), "n"(PL_THREADS) : "memory");
}

// ---- the bulk loader's mbarriers (PL_LOADER 1): PTX as CUTLASS's SM90 pipelines use it ----

__device__ __forceinline__ u32 smem_u32(const void* p) { return static_cast<u32>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void mbar_init(u64* bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
// One arrival (release: this thread's earlier shared-memory reads are ordered before the phase completes).
__device__ __forceinline__ void mbar_arrive(u64* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");  // '_': no state
}
// One arrival that also expects `bytes` of transactions (the bulk copies' complete_tx) before the phase completes.
__device__ __forceinline__ void mbar_arrive_expect_tx(u64* bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
// Waits until the phase of parity `parity` has completed (acquire: the tile's bytes are then visible).
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
  const u32 addr = smem_u32(bar);
  u32 done = 0;
  do {
    asm volatile("{\n\t.reg .pred p;\n\t"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
                 "selp.u32 %0, 1, 0, p;\n\t}"
                 : "=r"(done) : "r"(addr), "r"(parity) : "memory");
  } while (!done);
}
// `bytes` (a multiple of 16; both addresses 16-byte aligned) shared -> global by the TMA unit, in a bulk group.
__device__ __forceinline__ void bulk_copy_s2g(unsigned char* dst, const unsigned char* src, u32 bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
               ::"l"(dst), "r"(smem_u32(src)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// This thread's bulk groups have finished reading shared memory (READ_ONLY) or are complete.
template <bool READ_ONLY>
__device__ __forceinline__ void bulk_wait_all() {
  if constexpr (READ_ONLY) {
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
  } else {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  }
}
// This thread's st.shared so far are visible to the async proxy (the TMA unit's reads).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// `bytes` (a multiple of 16; both addresses 16-byte aligned) global -> shared by the TMA unit, completing on `bar`.
__device__ __forceinline__ void bulk_copy_g2s(unsigned char* dst, const unsigned char* src, u32 bytes, u64* bar) {
#if PL_HINT >= 2
  u64 policy;  // every line of the tile: first to go from L2 (read once)
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
               ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)), "l"(policy) : "memory");
#else
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
#endif
}

// The compute side of the bulk loader's hand-off, with the two calls compute_tiles makes of a cuda::pipeline
// consumer. Every compute thread walks the stages in the same order as the loader: stage s of round r is full when
// phase r of full[s] completes (parity r & 1); each compute thread's release is one arrival of the
// kComputeThreads that complete phase r of empty[s], which the loader waits for before refilling the stage.
struct BulkInPipe {
  u64* full;
  u64* empty;
  int stage;
  u32 phase;
  __device__ __forceinline__ void consumer_wait() { mbar_wait(full + stage, phase); }
  __device__ __forceinline__ void consumer_release() {
    mbar_arrive(empty + stage);
    if (++stage == PL_STAGES) {
      stage = 0;
      phase ^= 1u;
    }
  }
};

// ---- the engine ----

constexpr int kComputeWarps = PL_COMPUTE_WARPS;
constexpr int kComputeThreads = 32 * PL_COMPUTE_WARPS;
constexpr int kTileChunks = PL_TILE_CHUNKS;
constexpr int kStages = PL_STAGES;
constexpr bool kDirectStore = PL_DIRECT_STORE != 0;
constexpr bool kBulkLoader = PL_LOADER == 1;
constexpr bool kBulkStorer = PL_STORER == 1;
static_assert(PL_STORER == 0 || PL_STORER == 1, "PL_STORER is 0 (st.global) or 1 (cp.async.bulk)");
static_assert(!(kBulkStorer && kDirectStore), "PL_STORER 1 needs the storer warp (PL_DIRECT_STORE 0)");
#if PL_STORER == 1 && defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#error "PL_STORER=1 (cp.async.bulk) needs sm_90 or newer"
#endif
static_assert(PL_LOADER == 0 || PL_LOADER == 1, "PL_LOADER is 0 (cp.async) or 1 (cp.async.bulk)");
#if PL_LOADER == 1 && defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#error "PL_LOADER=1 (cp.async.bulk) needs sm_90 or newer"
#endif
static_assert(kStages >= 1 && kStages <= 8, "pipeline stages");
static_assert(PL_VEC == 1 || PL_VEC == 2, "PL_VEC is 1 or 2");
static_assert(kTileChunks % kComputeThreads == 0, "each compute thread owns the same number of chunks per tile");
constexpr int kChunksPerThread = kTileChunks / kComputeThreads;

// Copies `bytes` (a multiple of 16) from global to shared memory, 16 bytes per lane per step.
template <class Pipe>
__device__ __forceinline__ void copy_tile_async(unsigned char* dst, const unsigned char* src, int bytes, int lane,
                                                Pipe& pipe) {
  const int units = bytes >> 4;
#pragma unroll 4
  for (int u = lane; u < units; u += 32) {
    cuda::memcpy_async(static_cast<void*>(dst + 16 * u), static_cast<const void*>(src + 16 * u),
                       cuda::aligned_size_t<16>(16), pipe);
  }
}

// The compute warps' loop (compute thread ct). InPipe: a cuda::pipeline consumer (LDGSTS loader) or BulkInPipe.
// DIRECT: results go from registers to global memory (gc is the aligned body), out_pipe is unused (the caller
// passes in_pipe for it) and the C buffers are not in shared
// memory. Otherwise results go to the stage's C buffer and out_pipe hands it to the storer.
// Byte sizes of one op's chunks (E elements of each input and of the output) and of one pipeline stage's
// [A | B | C] tiles in shared memory; the loader, compute and storer warps all address the stages with these.
template <class Op>
struct TileBytes {
  static constexpr int A_CB = Op::E * sizeof(typename Op::TA);
  static constexpr int B_CB = Op::HAS_B ? Op::E * sizeof(typename Op::TB) : 0;
  static constexpr int C_CB = Op::E * sizeof(typename Op::TC);
  static_assert(A_CB % 16 == 0 && B_CB % 16 == 0 && C_CB % 16 == 0, "chunks are whole 16-byte vectors");
  static constexpr int A = kTileChunks * A_CB;
  static constexpr int B = kTileChunks * B_CB;
  static constexpr int C = kDirectStore ? 0 : kTileChunks * C_CB;  // no C buffers with direct stores
  static constexpr int STAGE = A + B + C;
};

template <class Op, bool DIRECT, class InPipe, class OutPipe>
__device__ __forceinline__ void compute_tiles(Op& op, InPipe& in_pipe, OutPipe& out_pipe,
                                              unsigned char* smem, unsigned char* __restrict__ gc,
                                              long long nchunks, long long ntiles, int ct) {
  typedef typename Op::TA TA;
  typedef typename Op::TB TB;
  typedef typename Op::TC TC;
  typedef TileBytes<Op> L;
  constexpr int E = Op::E;
  op.begin(ct);
  int stage = 0;
  for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
    const long long c0 = t * kTileChunks;
    const int valid = static_cast<int>(min(static_cast<long long>(kTileChunks), nchunks - c0));
    const unsigned char* sa = smem + stage * L::STAGE;
    const unsigned char* sb = sa + L::A;
    unsigned char* sc = smem + stage * L::STAGE + L::A + L::B;
    in_pipe.consumer_wait();
    if constexpr (!DIRECT) out_pipe.producer_acquire();
#pragma unroll
    for (int s = 0; s < kChunksPerThread; ++s) {
      const int ch = ct + s * kComputeThreads;
      if (ch < valid) {
        float a[E], b[E], c[E];
        ChunkIO<TA, E>::load(sa + ch * L::A_CB, a);
        if constexpr (Op::HAS_B) {
          ChunkIO<TB, E>::load(sb + ch * L::B_CB, b);
        } else {
#pragma unroll
          for (int k = 0; k < E; ++k) b[k] = 0.f;
        }
        op.chunk(s, a, b, c);
        if constexpr (DIRECT) {
          ChunkIO<TC, E>::store_global(gc + (c0 + ch) * L::C_CB, c);  // STG.128 from registers
        } else {
          ChunkIO<TC, E>::store(sc + ch * L::C_CB, c);
        }
      }
    }
    if constexpr (!DIRECT) {
      if constexpr (kBulkStorer) fence_proxy_async_shared();  // the TMA store reads what this thread wrote
      out_pipe.producer_commit();
    }
    in_pipe.consumer_release();
    op.next_tile();
    stage = (stage + 1 == kStages) ? 0 : stage + 1;
  }
  op.end(ct);
  all_roles_sync();
}

/* Op concept (see elementwise.cu):
     typedef TA, TB, TC;  static constexpr int E; static constexpr bool HAS_B;
     __device__ void begin(int ct);                 // compute thread ct, before its first tile
     __device__ void chunk(int s, const float (&a)[E], const float (&b)[E], float (&c)[E]);   // slot s
     __device__ void next_tile();                   // after each tile (columns advance by the grid stride)
     __device__ void end(int ct);                   // after the last tile
     __device__ void head_tail(int lane);           // scalar head/tail, done by block 0's storer warp
*/
template <class Op>
__device__ __forceinline__ void run_engine(Op& op, const unsigned char* __restrict__ ga,
                                           const unsigned char* __restrict__ gb, unsigned char* __restrict__ gc,
                                           long long nchunks) {
  typedef TileBytes<Op> L;

  extern __shared__ __align__(128) unsigned char smem[];
  // As in the CUDA programming guide: the states are left unconstructed (warning 20054 says so) and
  // make_pipeline initializes their barriers.
#pragma nv_diag_suppress 20054
  __shared__ cuda::pipeline_shared_state<cuda::thread_scope_block, kStages> in_state;
  __shared__ cuda::pipeline_shared_state<cuda::thread_scope_block, kStages> out_state;
#pragma nv_diag_default 20054
  // the bulk loader's per-stage barriers (unused with PL_LOADER 0)
  __shared__ __align__(8) u64 bulk_full[kStages];
  __shared__ __align__(8) u64 bulk_empty[kStages];
  typedef WarpRange<0, 1 + kComputeWarps, 1> LoadComputeGroup;
  typedef WarpRange<1, kComputeWarps + 1, 2> ComputeStoreGroup;

  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const long long ntiles = (nchunks + kTileChunks - 1) / kTileChunks;

  if constexpr (kBulkLoader) {
    // Barriers made by one thread before the first all-roles barrier, which every role passes before using them.
    if (threadIdx.x == 0) {
      for (int s = 0; s < kStages; ++s) {
        mbar_init(bulk_full + s, 1);                // the loader's arrive.expect_tx; then the tile's bytes
        mbar_init(bulk_empty + s, kComputeThreads);  // every compute thread's release
      }
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // visible to the TMA unit (async proxy)
    }
  }

  if (kBulkLoader && warp == 0) {
    // Bulk loader: lane 0 issues, per stage, one cp.async.bulk per operand tile; the warp stays converged (the
    // all-roles barrier is bar.sync, warp-aligned), lanes 1-31 only walk the loop.
    all_roles_sync();
    int stage = 0;
    u32 round = 0;
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
      const long long c0 = t * kTileChunks;
      const int valid = static_cast<int>(min(static_cast<long long>(kTileChunks), nchunks - c0));
      unsigned char* s = smem + stage * L::STAGE;
      if (lane == 0) {
        if (round > 0) mbar_wait(bulk_empty + stage, (round - 1) & 1u);  // the compute threads freed it
        const u32 a_bytes = static_cast<u32>(valid * L::A_CB);
        const u32 b_bytes = Op::HAS_B ? static_cast<u32>(valid * L::B_CB) : 0u;
        mbar_arrive_expect_tx(bulk_full + stage, a_bytes + b_bytes);
        bulk_copy_g2s(s, ga + c0 * L::A_CB, a_bytes, bulk_full + stage);
        if constexpr (Op::HAS_B) bulk_copy_g2s(s + L::A, gb + c0 * L::B_CB, b_bytes, bulk_full + stage);
      }
      __syncwarp();
      if (++stage == kStages) {
        stage = 0;
        ++round;
      }
    }
    all_roles_sync();
  } else if (kBulkLoader && warp <= kComputeWarps) {
    BulkInPipe in_pipe{bulk_full, bulk_empty, 0, 0u};
    const int ct = threadIdx.x - 32;
    if constexpr (kDirectStore) {
      all_roles_sync();
      compute_tiles<Op, true>(op, in_pipe, in_pipe, smem, gc, nchunks, ntiles, ct);  // no out_pipe: direct
    } else {
      cuda::pipeline<cuda::thread_scope_block> out_pipe =
          cuda::make_pipeline(ComputeStoreGroup(), &out_state, cuda::pipeline_role::producer);
      all_roles_sync();
      compute_tiles<Op, false>(op, in_pipe, out_pipe, smem, gc, nchunks, ntiles, ct);
    }
  } else if (warp == 0) {
    // Loader: fill stage after stage while the compute warps work on the other one.
    cuda::pipeline<cuda::thread_scope_block> in_pipe =
        cuda::make_pipeline(LoadComputeGroup(), &in_state, cuda::pipeline_role::producer);
    all_roles_sync();
    int stage = 0;
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
      const long long c0 = t * kTileChunks;
      const int valid = static_cast<int>(min(static_cast<long long>(kTileChunks), nchunks - c0));
      unsigned char* s = smem + stage * L::STAGE;
      in_pipe.producer_acquire();
      copy_tile_async(s, ga + c0 * L::A_CB, valid * L::A_CB, lane, in_pipe);
      if constexpr (Op::HAS_B) copy_tile_async(s + L::A, gb + c0 * L::B_CB, valid * L::B_CB, lane, in_pipe);
      in_pipe.producer_commit();
      stage = (stage + 1 == kStages) ? 0 : stage + 1;
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    all_roles_sync();
  } else if (warp <= kComputeWarps) {
    cuda::pipeline<cuda::thread_scope_block> in_pipe =
        cuda::make_pipeline(LoadComputeGroup(), &in_state, cuda::pipeline_role::consumer);
    const int ct = threadIdx.x - 32;
    if constexpr (kDirectStore) {
      all_roles_sync();
      compute_tiles<Op, true>(op, in_pipe, in_pipe, smem, gc, nchunks, ntiles, ct);
    } else {
      cuda::pipeline<cuda::thread_scope_block> out_pipe =
          cuda::make_pipeline(ComputeStoreGroup(), &out_state, cuda::pipeline_role::producer);
      all_roles_sync();
      compute_tiles<Op, false>(op, in_pipe, out_pipe, smem, gc, nchunks, ntiles, ct);
    }
  } else if constexpr (kDirectStore) {
    // Storer with direct stores: only the scalar head and tail (global memory only, no shared memory).
    all_roles_sync();
    if (blockIdx.x == 0) op.head_tail(lane);
    all_roles_sync();
  } else {
    // Storer: shared -> global, 16 bytes per lane, coalesced.
    cuda::pipeline<cuda::thread_scope_block> out_pipe =
        cuda::make_pipeline(ComputeStoreGroup(), &out_state, cuda::pipeline_role::consumer);
    all_roles_sync();
    if (blockIdx.x == 0) op.head_tail(lane);
    int stage = 0;
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
      const long long c0 = t * kTileChunks;
      const int valid = static_cast<int>(min(static_cast<long long>(kTileChunks), nchunks - c0));
      const uint4* sc = reinterpret_cast<const uint4*>(smem + stage * L::STAGE + L::A + L::B);
      uint4* g = reinterpret_cast<uint4*>(gc + c0 * L::C_CB);
      const int units = (valid * L::C_CB) >> 4;
      out_pipe.consumer_wait();
      if constexpr (kBulkStorer) {
        // one TMA store of the whole tile; the C buffer is handed back only once the TMA unit has read it
        if (lane == 0) {
          bulk_copy_s2g(reinterpret_cast<unsigned char*>(g), reinterpret_cast<const unsigned char*>(sc),
                        static_cast<u32>(units) * 16u);
          bulk_wait_all<true>();
        }
      } else {
#pragma unroll 4
        for (int u = lane; u < units; u += 32) g[u] = sc[u];
      }
      // All lanes' shared-memory reads of this stage are done before any lane releases it (each lane's release
      // only orders its own reads; the barrier counts all 32, so this is belt and braces for racecheck).
      __syncwarp();
      out_pipe.consumer_release();
      stage = (stage + 1 == kStages) ? 0 : stage + 1;
    }
    if constexpr (kBulkStorer) {
      if (lane == 0) bulk_wait_all<false>();  // the last tiles' global writes done before the block ends
    }
    __syncwarp();
    all_roles_sync();
  }
}

}  // namespace pl

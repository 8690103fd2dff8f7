// Small kernels that ask compute-sanitizer's racecheck one question each (tools/gpu_probes/racecheck_probe.py runs them):
// which synchronization does the tool follow? The engine's cp.async plan (w8.s2) draws hazards on one word of
// libcu++'s pipeline_shared_state, between make_pipeline's barrier init and its refcount atomics, while the
// hand-offs of tile data show none. These probes separate "the tool does not follow a partial named barrier"
// from "make_pipeline races": controls with a real race and with __syncthreads, named barriers over all or part
// of the block, and the engine's two-pipeline arrangement with partial groups (as ws_pipeline.cuh makes them) and
// with whole-block groups. Every kernel also writes a result the driver checks, so a probe that did not run fails.
#include <cuda/pipeline>

namespace {

constexpr int kStages = 2;


template <int FIRST_WARP, int NWARPS, int BARRIER_ID>
struct WarpRange {  // as ws_pipeline.cuh: a contiguous range of warps, synchronized by a named barrier
  __device__ unsigned long long size() const { return 32ull * NWARPS; }
  __device__ unsigned long long thread_rank() const { return threadIdx.x - 32u * FIRST_WARP; }
  __device__ void sync() const { asm volatile("bar.sync %0, %1;" ::"n"(BARRIER_ID), "n"(32 * NWARPS) : "memory"); }
};

struct WholeBlock {  // every thread of the block, synchronized by __syncthreads
  __device__ unsigned long long size() const { return blockDim.x; }
  __device__ unsigned long long thread_rank() const { return threadIdx.x; }
  __device__ void sync() const { __syncthreads(); }
};

__device__ __forceinline__ void named_sync_all() {  // the engine's all_roles_sync (every thread of the block)
  asm volatile("bar.sync 3, %0;" ::"r"(blockDim.x) : "memory");
}

}  // namespace

// ---- controls and barriers: thread 0 writes a shared word, thread 32 reads it ----

extern "C" __global__ void probe_race(int* out) {  // no barrier: a real race the tool must report
  __shared__ int s;
  if (threadIdx.x == 0) s = 7;
  if (threadIdx.x == 32) {
    out[1] = s;  // 0 or 7: the read is the point (the probe's answer is the tool's report)
    out[0] = 7;
  }
}

extern "C" __global__ void probe_race_ordered(int* out) {  // no barrier, but the write surely comes first
  __shared__ int s[32];
  const int lane = threadIdx.x & 31;
  if (threadIdx.x < 32) s[lane] = 1000 + lane;  // warp 0 writes 32 words
  if (threadIdx.x >= 32 && threadIdx.x < 64) {
    __nanosleep(100000);  // warp 1 reads them ~100 us later: a read-after-write with no barrier between
    out[2 + lane] = s[lane];
    s[lane] = 2000 + lane;  // and a write-after-write
  }
  if (threadIdx.x == 0) out[0] = 7;
}

extern "C" __global__ void probe_syncthreads(int* out) {
  __shared__ int s;
  if (threadIdx.x == 0) s = 7;
  __syncthreads();
  if (threadIdx.x == 32) out[0] = s;
}

extern "C" __global__ void probe_named_all(int* out) {  // bar.sync 3, 96: a named barrier over the whole block
  __shared__ int s;
  if (threadIdx.x == 0) s = 7;
  named_sync_all();
  if (threadIdx.x == 32) out[0] = s;
}

extern "C" __global__ void probe_named_part(int* out) {  // bar.sync 1, 64: warps 0-1 only, warp 2 elsewhere
  __shared__ int s;
  if (threadIdx.x < 64) {
    if (threadIdx.x == 0) s = 7;
    asm volatile("bar.sync 1, 64;" ::: "memory");
    if (threadIdx.x == 32) out[0] = s;
  }
}

extern "C" __global__ void probe_named_part_atomic(int* out) {  // make_pipeline's pattern on one word
  __shared__ unsigned s;
  if (threadIdx.x < 64) {
    if (threadIdx.x == 0) s = 0;
    asm volatile("bar.sync 1, 64;" ::: "memory");
    if ((threadIdx.x & 31) == 0) atomicAdd(&s, 32u);
    asm volatile("bar.sync 1, 64;" ::: "memory");
    if (threadIdx.x == 32) out[0] = static_cast<int>(s) - 57;  // 64 - 57 = 7
  }
}

// ---- the engine's arrangement: loader warp 0 -> NC compute warps -> storer warp NC + 1, two 2-stage pipelines ----
// out[i] = in[i] + 1 over ntiles tiles of 32 x NC x 4 ints (a grid of one block walks them all, wrapping its
// stages). Compute warp w owns 16 bytes per lane of the tile; the loader and the storer walk the whole tile.

template <bool kWholeBlock, int NC>
__device__ void pipeline_probe(const int* __restrict__ in, int* __restrict__ out, int ntiles) {
  constexpr int kTileInts = 32 * NC * 4;
#pragma nv_diag_suppress 20054
  __shared__ cuda::pipeline_shared_state<cuda::thread_scope_block, kStages> in_state;
  __shared__ cuda::pipeline_shared_state<cuda::thread_scope_block, kStages> out_state;
#pragma nv_diag_default 20054
  __shared__ __align__(16) int a[kStages][kTileInts];
  __shared__ __align__(16) int c[kStages][kTileInts];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, ct = threadIdx.x - 32;
  constexpr int kStorer = NC + 1;
  using cuda::pipeline_role;
  if constexpr (kWholeBlock) {
    // Every thread makes both pipelines (so the groups are the whole block, synchronized by __syncthreads): the
    // storer is one more consumer of in_pipe (it only waits and releases) and the loader one more producer of
    // out_pipe (it only acquires and commits), so each barrier counts the whole block.
    auto in_pipe = cuda::make_pipeline(WholeBlock(), &in_state,
                                       warp == 0 ? pipeline_role::producer : pipeline_role::consumer);
    auto out_pipe = cuda::make_pipeline(WholeBlock(), &out_state,
                                        warp == kStorer ? pipeline_role::consumer : pipeline_role::producer);
    for (int t = 0; t < ntiles; ++t) {
      const int st = t % kStages;
      if (warp == 0) {
        in_pipe.producer_acquire();
        for (int u = lane; u < kTileInts / 4; u += 32)
          cuda::memcpy_async(&a[st][4 * u], &in[t * kTileInts + 4 * u], cuda::aligned_size_t<16>(16), in_pipe);
        in_pipe.producer_commit();
        out_pipe.producer_acquire();
        out_pipe.producer_commit();
      } else if (warp <= NC) {
        in_pipe.consumer_wait();
        out_pipe.producer_acquire();
        for (int k = 0; k < 4; ++k) c[st][4 * ct + k] = a[st][4 * ct + k] + 1;
        out_pipe.producer_commit();
        in_pipe.consumer_release();
      } else {
        in_pipe.consumer_wait();
        in_pipe.consumer_release();
        out_pipe.consumer_wait();
        for (int u = lane; u < kTileInts; u += 32) out[t * kTileInts + u] = c[st][u];
        out_pipe.consumer_release();
      }
    }
    __syncthreads();
  } else {
    typedef WarpRange<0, 1 + NC, 1> LoadCompute;
    typedef WarpRange<1, NC + 1, 2> ComputeStore;
    if (warp == 0) {
      auto in_pipe = cuda::make_pipeline(LoadCompute(), &in_state, pipeline_role::producer);
      named_sync_all();
      for (int t = 0; t < ntiles; ++t) {
        const int st = t % kStages;
        in_pipe.producer_acquire();
        for (int u = lane; u < kTileInts / 4; u += 32)
          cuda::memcpy_async(&a[st][4 * u], &in[t * kTileInts + 4 * u], cuda::aligned_size_t<16>(16), in_pipe);
        in_pipe.producer_commit();
      }
      named_sync_all();
    } else if (warp <= NC) {
      auto in_pipe = cuda::make_pipeline(LoadCompute(), &in_state, pipeline_role::consumer);
      auto out_pipe = cuda::make_pipeline(ComputeStore(), &out_state, pipeline_role::producer);
      named_sync_all();
      for (int t = 0; t < ntiles; ++t) {
        const int st = t % kStages;
        in_pipe.consumer_wait();
        out_pipe.producer_acquire();
        for (int k = 0; k < 4; ++k) c[st][4 * ct + k] = a[st][4 * ct + k] + 1;
        out_pipe.producer_commit();
        in_pipe.consumer_release();
      }
      named_sync_all();
    } else {
      auto out_pipe = cuda::make_pipeline(ComputeStore(), &out_state, pipeline_role::consumer);
      named_sync_all();
      for (int t = 0; t < ntiles; ++t) {
        const int st = t % kStages;
        out_pipe.consumer_wait();
        for (int u = lane; u < kTileInts; u += 32) out[t * kTileInts + u] = c[st][u];
        out_pipe.consumer_release();
      }
      named_sync_all();
    }
  }
}

extern "C" __global__ void probe_pipelines_partial(const int* in, int* out, int ntiles) {
  pipeline_probe<false, 1>(in, out, ntiles);
}

extern "C" __global__ void probe_pipelines_whole(const int* in, int* out, int ntiles) {
  pipeline_probe<true, 1>(in, out, ntiles);
}

// the engine's w8.s2 geometry: 8 compute warps, 320 threads
extern "C" __global__ void probe_pipelines_partial_w8(const int* in, int* out, int ntiles) {
  pipeline_probe<false, 8>(in, out, ntiles);
}

extern "C" __global__ void probe_pipelines_whole_w8(const int* in, int* out, int ntiles) {
  pipeline_probe<true, 8>(in, out, ntiles);
}

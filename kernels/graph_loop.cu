// The loop control of a looped CUDA graph (distributed/graph_loop.py): one thread, run after each replayed
// iteration inside the body of a WHILE conditional node. It advances the device-side data slot (the ring slot the
// next iteration copies its inputs from) and tells the node whether to run the body again: the loop ends when the
// slot wraps to 0, i.e. after `per_launch` iterations, and leaves the slot at 0 for the next launch.
//
// cudaGraphSetConditional is a device-runtime builtin that the driver resolves when the module is loaded (no
// -rdc and no cudadevrt link needed); it is declared here because NVRTC's include path has no
// cuda_device_runtime_api.h. The handle is an opaque 64-bit value made by cudaGraphConditionalHandleCreate.

typedef unsigned long long pl_graph_conditional_handle;
extern "C" __device__ void cudaGraphSetConditional(pl_graph_conditional_handle handle, unsigned int value);

extern "C" __global__ void pl_graph_loop_next(pl_graph_conditional_handle handle, long long* slot,
                                              long long per_launch) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const long long next = (*slot + 1) % per_launch;
    *slot = next;
    cudaGraphSetConditional(handle, next != 0 ? 1u : 0u);
}

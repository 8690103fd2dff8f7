// A memset as a kernel (distributed/cudagraph/memset_nodes.py puts it in a captured graph in place of the small
// memset nodes that cuBLASLt and cuDNN add before their kernels: the GPU starts a kernel node sooner after its
// predecessor than a memset node). The same writes as cudaMemset2D with these parameters: `height` rows of `width`
// elements of `element_size` bytes (1, 2 or 4), rows `pitch` bytes apart, each element `value`.

extern "C" __global__ void pl_graph_memset(unsigned char* __restrict__ dst, int value, int element_size,
                                           long long width, long long height, long long pitch) {
    const long long n = width * height;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        unsigned char* p = dst + (i / width) * pitch + (i % width) * element_size;
        if (element_size == 4) *reinterpret_cast<unsigned int*>(p) = (unsigned int)value;
        else if (element_size == 2) *reinterpret_cast<unsigned short*>(p) = (unsigned short)value;
        else *p = (unsigned char)value;
    }
}

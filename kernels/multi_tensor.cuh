// A block's share of a multi-tensor optimizer launch (compact_adamw.cu, fused_adamw.cu), read from the tables
// kernels/multi_tensor.py builds: `table` holds `lists` rows of pointers, then every tensor's numel, then its vector
// flag; `chunks` holds each block's tensor index and first element.

#pragma once

struct PlChunk {
    int t;                  // the tensor
    long long start, end;   // its elements [start, end)
    bool vectors;           // every pointer of the tensor takes the 4-element vector path
};

__device__ __forceinline__ PlChunk pl_chunk(const long long* table, int tensors, int lists, const long long* chunks,
                                            int n_chunks, long long chunk) {
    PlChunk c;
    c.t = (int)chunks[blockIdx.x];
    c.start = chunks[n_chunks + blockIdx.x];
    const long long n = table[lists * tensors + c.t];
    c.end = c.start + chunk < n ? c.start + chunk : n;
    c.vectors = table[(lists + 1) * tensors + c.t] != 0;
    return c;
}

// Four 16-bit elements as one 8-byte word: the vector path's loads and stores.
union PlQuad {
    uint2 u;
    unsigned short h[4];
};

// Small device helpers shared by the fused forward's kernels (cuda/rwkv7_fused.cu) and the persistent step
// (cuda/rwkv7_step.cu), for CUDA (or the CPU emulator's stand-ins of its headers, test/kernel_emu); the HIP ports keep
// their own (their shuffles take a width).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

__device__ __forceinline__ float sigmoidf(float x) { return 1.0f / (1.0f + __expf(-x)); }
__device__ __forceinline__ float round_half(float x) { return __half2float(__float2half_rn(x)); }

// Eight halves of a 16-byte vector as floats. By value: a reference into global memory made memcpy load bytes.
__device__ __forceinline__ void unpack8(uint4 u, float (&out)[8]) {
    __half h[8];
    memcpy(h, &u, sizeof(u));
#pragma unroll
    for (int e = 0; e < 8; ++e) out[e] = __half2float(h[e]);
}

// The shared-memory address of p (PTX operands of asynchronous copies and mbarriers).
__device__ __forceinline__ uint32_t shared_address(const void* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
#else
    return 0u;
#endif
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over the block, in a fixed order; `scratch` holds one float per warp and must not be reused by another
// reduction until every thread has passed a later barrier.
template <int WARPS>
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    v = warp_sum(v);
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
    __syncthreads();
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) total += scratch[w];
    return total;
}

__device__ __forceinline__ uint4 pack8(const float (&in)[8]) {
    __half h[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) h[e] = __float2half_rn(in[e]);
    uint4 u;
    memcpy(&u, h, sizeof(u));
    return u;
}

// Stand-in for <cuda_runtime.h> when a kernel source is compiled for the CPU emulation (emu_device.h).
// The runtime API part is only what the launchers of the kernel files name, so that the helpers above
// their `extern "C"` interface compile; the harnesses launch the kernels themselves (emu::run_grid), and
// these stubs launch nothing.
#pragma once
#include "emu_device.h"

template <typename T>
T __shfl_xor_sync(unsigned, T v, int mask, int width = 32) { return emu::shfl_xor(v, mask, width); }
template <typename T>
T __shfl_up_sync(unsigned, T v, unsigned delta, int width = 32) { return emu::shfl_up(v, delta, width); }
template <typename T>
T __shfl_down_sync(unsigned, T v, unsigned delta, int width = 32) { return emu::shfl_down(v, delta, width); }
template <typename T>
T __shfl_sync(unsigned, T v, int src, int width = 32) { return emu::shfl(v, src, width); }
inline unsigned __ballot_sync(unsigned, int predicate) { return static_cast<unsigned>(emu::ballot(predicate != 0)); }
// every lane of the warp (the kernels call it warp-uniformly): a barrier of the warp's fibers
inline void __syncwarp(unsigned = 0xffffffffu) { emu::warps[threadIdx.x / EMU_WARP].bar.wait(); }

enum cudaError_t : int {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorNotSupported = 801,
};
typedef struct CUstream_st* cudaStream_t;
enum cudaDeviceAttr : int { cudaDevAttrMultiProcessorCount = 16, cudaDevAttrComputeCapabilityMajor = 75 };
enum cudaLaunchAttributeID : int { cudaLaunchAttributeProgrammaticStreamSerialization = 5 };
struct cudaLaunchAttributeValue {
    int programmaticStreamSerializationAllowed;
};
struct cudaLaunchAttribute {
    cudaLaunchAttributeID id;
    cudaLaunchAttributeValue val;
};
struct cudaLaunchConfig_t {
    dim3 gridDim, blockDim;
    size_t dynamicSmemBytes;
    cudaStream_t stream;
    cudaLaunchAttribute* attrs;
    unsigned numAttrs;
};

inline cudaError_t cudaGetDevice(int* device) {
    *device = 0;
    return cudaSuccess;
}
inline cudaError_t cudaSetDevice(int) { return cudaSuccess; }
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr, int) {
    *value = 0;
    return cudaErrorNotSupported;
}
template <typename Kernel>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, Kernel, int, size_t) {
    *blocks = 0;
    return cudaErrorNotSupported;
}
inline cudaError_t cudaGetLastError() { return cudaErrorNotSupported; }
inline const char* cudaGetErrorString(cudaError_t) { return "CPU emulation: no CUDA runtime"; }
template <typename... KernelArgs, typename... Args>
cudaError_t cudaLaunchKernelEx(const cudaLaunchConfig_t*, void (*)(KernelArgs...), Args&&...) {
    return cudaErrorNotSupported;
}


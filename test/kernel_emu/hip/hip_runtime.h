// Stand-in for <hip/hip_runtime.h> when a HIP kernel source is compiled for the CPU emulation
// (../emu_device.h); the warp (wavefront) width is EMU_WARP: 64 as on CDNA, or 32 as on RDNA.
#pragma once
#include "../emu_device.h"

constexpr int warpSize = EMU_WARP;
template <typename T>
T __shfl_xor(T v, int mask, int width = warpSize) { return emu::shfl_xor(v, mask, width); }
template <typename T>
T __shfl_up(T v, unsigned delta, int width = warpSize) { return emu::shfl_up(v, delta, width); }
template <typename T>
T __shfl_down(T v, unsigned delta, int width = warpSize) { return emu::shfl_down(v, delta, width); }
template <typename T>
T __shfl(T v, int src, int width = warpSize) { return emu::shfl(v, src, width); }

enum hipError_t : int {
    hipSuccess = 0,
    hipErrorInvalidValue = 1,
    hipErrorInvalidConfiguration = 9,
    hipErrorNotSupported = 801,
};
typedef struct ihipStream_t* hipStream_t;
inline hipError_t hipGetDevice(int* device) {
    *device = 0;
    return hipSuccess;
}
inline hipError_t hipSetDevice(int) { return hipSuccess; }
enum hipDeviceAttribute_t : int { hipDeviceAttributeMultiprocessorCount = 63 };
inline hipError_t hipDeviceGetAttribute(int* value, hipDeviceAttribute_t, int) {
    *value = 0;
    return hipErrorNotSupported;
}
inline hipError_t hipGetLastError() { return hipErrorNotSupported; }
inline const char* hipGetErrorString(hipError_t) { return "CPU emulation: no HIP runtime"; }

namespace emu {
// A 16-byte vector with .x .. .w, for clang's ext_vector_type(4) typedefs (emu_build.py), and a plain
// load for __builtin_nontemporal_load (a clang builtin that g++ lacks).
struct alignas(16) u32x4 {
    unsigned x, y, z, w;
};
template <typename T>
T nontemporal_load(const T* p) { return *p; }
}  // namespace emu
#define __builtin_nontemporal_load(p) emu::nontemporal_load(p)

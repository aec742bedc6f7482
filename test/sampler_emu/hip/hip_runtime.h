// Stand-in for <hip/hip_runtime.h> when hip/sampler.hip is compiled for the CPU emulation
// (../emu_device.h); the warp width is EMU_WARP (64 as on CDNA, or 32 as on RDNA).
#pragma once
#include "../emu_device.h"

constexpr int warpSize = EMU_WARP;
template <typename T>
T __shfl_xor(T v, int o) { return emu::shfl_xor(v, o); }
template <typename T>
T __shfl_up(T v, unsigned o) { return emu::shfl_up(v, o); }
template <typename T>
T __shfl_down(T v, unsigned o) { return emu::shfl_down(v, o); }

// Stand-in for <cuda_runtime.h> when cuda/sampler.cu is compiled for the CPU emulation (emu_device.h).
#pragma once
#include "emu_device.h"

template <typename T>
T __shfl_xor_sync(unsigned, T v, int o) { return emu::shfl_xor(v, o); }
template <typename T>
T __shfl_up_sync(unsigned, T v, unsigned o) { return emu::shfl_up(v, o); }
template <typename T>
T __shfl_down_sync(unsigned, T v, unsigned o) { return emu::shfl_down(v, o); }

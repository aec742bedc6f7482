// 4 int8 packed in a word -> 4 exact floats without I2F, which runs at a quarter of the FP32 rate on
// sm_90 and capped the int8 GEMVs below memory bandwidth. Flipping the sign bits turns byte b
// (-128..127) into b + 128 (0..255); PRMT puts that byte under the exponent of 2^23 (0x4B000000),
// giving the float 2^23 + b + 128, and one subtraction leaves b. Device code only: the including file
// has included its runtime (CUDA, HIP, or the CPU emulator's stand-ins). Shared by cuda/ and hip/.
#pragma once

#include <cstdint>

__device__ __forceinline__ void int8x4_to_float(uint32_t word, float* out) {
    constexpr float kBias = 8388608.0f + 128.0f;
    const uint32_t biased = word ^ 0x80808080u;
    out[0] = __uint_as_float(__byte_perm(biased, 0x4B000000u, 0x7540)) - kBias;
    out[1] = __uint_as_float(__byte_perm(biased, 0x4B000000u, 0x7541)) - kBias;
    out[2] = __uint_as_float(__byte_perm(biased, 0x4B000000u, 0x7542)) - kBias;
    out[3] = __uint_as_float(__byte_perm(biased, 0x4B000000u, 0x7543)) - kBias;
}

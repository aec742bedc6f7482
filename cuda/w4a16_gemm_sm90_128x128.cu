// One tile of the Hopper GEMM for 4-bit GemLite weights (cuda/w8a16_gemm_sm90.cuh): 128 output channels x 128 batch
// rows (a file of its own: the JIT build compiles the tiles side by side).
#define W8A16_SM90_DEFINE_TEMPLATE
#include "w8a16_gemm_sm90.cuh"

namespace w8a16_sm90 {
W8A16_SM90_INSTANTIATE(Uint4Groups, 128, 128, Half)
}  // namespace w8a16_sm90

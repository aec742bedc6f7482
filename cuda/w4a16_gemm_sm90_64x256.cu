// One tile of the Hopper GEMM for 4-bit GemLite weights (cuda/w8a16_gemm_sm90.cuh): 64 output channels x 256 batch
// rows (a file of its own: the JIT build compiles the tiles side by side).
#define W8A16_SM90_DEFINE_TEMPLATE
#include "w8a16_gemm_sm90.cuh"

namespace w8a16_sm90 {
W8A16_SM90_INSTANTIATE(Uint4Groups, 64, 256, Half)
}  // namespace w8a16_sm90

// One tile of the Hopper W8A16 GEMM with split K (cuda/w8a16_gemm_sm90.cuh): 64 output channels x 128 batch rows,
// fp32 partial products (a file of its own: the JIT build compiles the tiles side by side).
#define W8A16_SM90_DEFINE_TEMPLATE
#include "w8a16_gemm_sm90.cuh"

namespace w8a16_sm90 {
W8A16_SM90_INSTANTIATE(Int8Rows, 64, 128, float)
}  // namespace w8a16_sm90

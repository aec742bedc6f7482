// HIP port of the GEMV of cuda/w8a16_gemm.cu: y = x @ (w * scale[:, None])^T, int8 weights, fp16 activations.
//
// Same layout, math and launcher interface as the CUDA file (read its header comment). One team of 32
// threads reduces one output channel; the shuffles pass width 32, so a team is a whole wavefront on
// RDNA (wave32) and half of one on CDNA (wave64) and the code is the same for both. There is no CUTLASS
// on ROCm: w8a16_gemm_launch reports that it is not built, and the Python side dequantizes for larger
// batches.
//
// Build: torch.utils.cpp_extension on a ROCm build of torch compiles this file with hipcc together with
// cuda/w8a16_gemm_op.cpp (which only sees the C launchers below). Compile-checked, not run.

#include <hip/hip_runtime.h>
#include <hip/hip_fp16.h>

#include <climits>
#include <cstdint>

#include "../cuda/int8x4.cuh"

namespace w8a16 {

constexpr int kGemvMaxRows = 8;
constexpr int kTeam = 32;                        // threads per output channel
constexpr int kTeamsPerBlock = 8;
constexpr int kLaneWeights = 16;                 // int8 weights per thread per step: one 16-byte load
constexpr int kTeamStep = kTeam * kLaneWeights;
constexpr int kGemmNotBuilt = 20000;

// fp16 bits -> float (torch builds with __HIP_NO_HALF_CONVERSIONS__: convert explicitly).
__device__ __forceinline__ float half_bits_to_float(uint16_t bits) {
    __half_raw raw;
    raw.x = bits;
    return __half2float(__half(raw));
}

__device__ __forceinline__ float dot16(const float* wf, uint4 xa, uint4 xb) {
    const uint32_t words[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        sum = fmaf(wf[2 * i], half_bits_to_float(static_cast<uint16_t>(words[i] & 0xFFFFu)), sum);
        sum = fmaf(wf[2 * i + 1], half_bits_to_float(static_cast<uint16_t>(words[i] >> 16)), sum);
    }
    return sum;
}

template <int M>
__global__ void __launch_bounds__(kTeamsPerBlock * kTeam)
    gemv_kernel(const __half* __restrict__ x, const int8_t* __restrict__ w, const __half* __restrict__ scale,
                __half* __restrict__ y, int N, int K) {
    const int lane = threadIdx.x % kTeam;
    const int n = blockIdx.x * kTeamsPerBlock + threadIdx.x / kTeam;
    // A team past the last channel still joins the shuffles (a wave64 holds two teams), and only skips
    // the loads and the store.
    const bool active = n < N;
    const int8_t* row = w + static_cast<int64_t>(active ? n : 0) * K;

    float acc[M];
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = 0.0f;

    for (int k = lane * kLaneWeights; active && k < K; k += kTeamStep) {
        const uint4 packed = *reinterpret_cast<const uint4*>(row + k);
        float wf[kLaneWeights];
        int8x4_to_float(packed.x, wf);
        int8x4_to_float(packed.y, wf + 4);
        int8x4_to_float(packed.z, wf + 8);
        int8x4_to_float(packed.w, wf + 12);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const uint4* xp = reinterpret_cast<const uint4*>(x + static_cast<int64_t>(m) * K + k);
            acc[m] += dot16(wf, xp[0], xp[1]);
        }
    }

#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int offset = kTeam / 2; offset > 0; offset >>= 1) acc[m] += __shfl_xor(acc[m], offset, kTeam);
    }
    if (active && lane == 0) {
        const float s = __half2float(scale[n]);
#pragma unroll
        for (int m = 0; m < M; ++m) y[static_cast<int64_t>(m) * N + n] = __float2half_rn(acc[m] * s);
    }
}

template <int M>
hipError_t launch_gemv(const void* x, const void* w, const void* scale, void* y, int N, int K, hipStream_t stream) {
    const dim3 grid(static_cast<unsigned>((N + kTeamsPerBlock - 1) / kTeamsPerBlock));
    gemv_kernel<M><<<grid, kTeamsPerBlock * kTeam, 0, stream>>>(
        static_cast<const __half*>(x), static_cast<const int8_t*>(w), static_cast<const __half*>(scale),
        static_cast<__half*>(y), N, K);
    return hipGetLastError();
}

hipError_t gemv(int64_t M, int64_t N, int64_t K, const void* x, const void* w, const void* scale, void* y,
                hipStream_t stream) {
    if (N <= 0 || K <= 0 || N > INT_MAX || K > INT_MAX || K % kLaneWeights) return hipErrorInvalidValue;
    const int n = static_cast<int>(N), k = static_cast<int>(K);
    switch (M) {
        case 1: return launch_gemv<1>(x, w, scale, y, n, k, stream);
        case 2: return launch_gemv<2>(x, w, scale, y, n, k, stream);
        case 3: return launch_gemv<3>(x, w, scale, y, n, k, stream);
        case 4: return launch_gemv<4>(x, w, scale, y, n, k, stream);
        case 5: return launch_gemv<5>(x, w, scale, y, n, k, stream);
        case 6: return launch_gemv<6>(x, w, scale, y, n, k, stream);
        case 7: return launch_gemv<7>(x, w, scale, y, n, k, stream);
        case 8: return launch_gemv<8>(x, w, scale, y, n, k, stream);
        default: return hipErrorInvalidValue;
    }
}

}  // namespace w8a16

extern "C" int w8a16_gemv_max_rows() { return w8a16::kGemvMaxRows; }

extern "C" int w8a16_gemm_available() { return 0; }

extern "C" int w8a16_gemv_launch(int device, int64_t stream, int64_t M, int64_t N, int64_t K, const void* x,
                                 const void* w, const void* scale, void* y) {
    int previous = -1;
    hipError_t err = hipGetDevice(&previous);
    if (err != hipSuccess) return err;
    if (previous != device && (err = hipSetDevice(device)) != hipSuccess) return err;
    err = w8a16::gemv(M, N, K, x, w, scale, y, reinterpret_cast<hipStream_t>(stream));
    if (previous != device) (void)hipSetDevice(previous);
    return err;
}

extern "C" int w8a16_gemm_launch(int, int64_t, int64_t, int64_t, int64_t, const void*, const void*, const void*,
                                 void*) {
    return w8a16::kGemmNotBuilt;
}

// The Hopper GEMMs (int8 and 4-bit weights) exist only in CUDA sm_90a builds: no tiles here, and every launch
// says so (the torch binding, cuda/w8a16_gemm_op.cpp, links against these names on both platforms).
extern "C" int w8a16_gemm_sm90_tiles() { return 0; }

extern "C" int w8a16_gemm_sm90_tile(int, int) { return -1; }

extern "C" int w8a16_gemm_sm90_launch(int, int64_t, int64_t, int64_t, int64_t, const void*, const void*,
                                      const void*, void*, int, int, void*, int64_t) {
    return w8a16::kGemmNotBuilt;
}

extern "C" int w4a16_gemm_sm90_launch(int, int64_t, int64_t, int64_t, int64_t, const void*, const void*,
                                      const void*, const void*, int64_t, void*, int, int, void*, int64_t) {
    return w8a16::kGemmNotBuilt;
}

extern "C" const char* w8a16_error_string(int code) {
    if (code == w8a16::kGemmNotBuilt) return "the W8A16 GEMM is not built on ROCm (no CUTLASS)";
    return hipGetErrorString(static_cast<hipError_t>(code));
}

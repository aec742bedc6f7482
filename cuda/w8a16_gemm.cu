// W8A16 linear layer: y = x @ (w * scale[:, None])^T with int8 weights and fp16 activations.
//
// Plain CUDA C++ (no torch headers): the torch binding is cuda/w8a16_gemm_op.cpp, the HIP port of the
// GEMV hip/w8a16_gemm.hip, the Python side infer/ops/linear_w8a16.py (which also holds the reference:
// dequantize + matmul).
//
// Layout (every tensor contiguous and 16-byte aligned)
//   x      [M, K] fp16  activations, row-major
//   w      [N, K] int8  weights in nn.Linear layout, symmetric per output channel
//   scale  [N]    fp16  per-output-channel scale: the weight of channel n is w[n, :] * scale[n]
//   y      [M, N] fp16  output, row-major
//   K % 16 == 0 (GEMV: one 16-byte load per lane; GEMM: the int8 operand's alignment), N % 8 == 0 (GEMM)
//
// Two kernels, chosen by the caller on M:
//  * GEMV, M <= kGemvMaxRows (decode at small batch, bound by reading the weights): one warp per output
//    channel streams the channel's K weights exactly once, 16 per lane per step, and multiplies them
//    with all M activation rows in fp32. The activations are tiny and read by every warp, so they come
//    from L1/L2; the weights are loaded with the streaming hint so they do not evict them. The warp's
//    sum times scale[n] is rounded to fp16 once.
//  * GEMM, larger M (only when compiled with -DW8A16_WITH_CUTLASS and the CUTLASS headers): a CUTLASS
//    2.x GemmUniversal for SM80 tensor cores (runs on sm_80 and later, sm_90 included) with the
//    mixed-input upcast operator: the int8 operand is converted to fp16 in registers, products are
//    accumulated in fp32, and a broadcast epilogue multiplies each output column n by scale[n] before the
//    single rounding to fp16, so no fp32 workspace or second kernel is needed.
//  * On Hopper (sm_90a builds, -DW8A16_WITH_CUTLASS_SM90): the GEMM of cuda/w8a16_gemm_sm90.cu, CUTLASS 3's
//    TMA + WGMMA mixed-input kernel with the same math; the SM80 GEMM stays as the fallback the Python
//    side switches to if it fails its self-test. The same kernel also takes 4-bit GemLite weights
//    (w4a16_gemm_sm90_launch; infer/quant/gemlite_linear.py).
//
// The launchers take raw pointers, a device index and the stream as an integer (the caller's current
// stream, so a launch can be captured in a CUDA graph) and return 0 or an error code for
// w8a16_error_string.

#include <cuda_runtime.h>
#include <cuda_fp16.h>

#include <climits>
#include <cstdint>
#include <cstring>

#include "int8x4.cuh"

#if defined(W8A16_WITH_CUTLASS)
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/thread/activation.h"
#include "cutlass/epilogue/thread/linear_combination_bias_elementwise.h"
#include "cutlass/functional.h"
#include "cutlass/gemm/device/gemm_universal_with_broadcast.h"
#include "cutlass_run.cuh"
#endif

#if defined(W8A16_WITH_CUTLASS_SM90)
// cuda/w8a16_gemm_sm90.cu: the same product with CUTLASS 3's Hopper mixed-input WGMMA kernel, in one of
// w8a16_gemm_sm90_tile_count() tiles (-1: chosen per problem).
// splits > 1: split K, fp32 partial products in partials [splits, partial_rows, N].
int w8a16_gemm_sm90(int64_t M, int64_t N, int64_t K, const void* x, const void* w, const void* scale, void* y,
                    cudaStream_t stream, int status_base, int tile, int splits, void* partials, int64_t partial_rows);
int w8a16_gemm_sm90_tile_count();
int w8a16_gemm_sm90_tile_shape(int tile, int which);
// The same kernel for 4-bit GemLite weights (A16W4_HQQ_INT, K-major words): see cuda/w8a16_gemm_sm90.cuh.
// (splits as above)
int w4a16_gemm_sm90(int64_t M, int64_t N, int64_t K, const void* x, const void* words, const void* scale,
                    const void* zero, int64_t group, void* y, cudaStream_t stream, int status_base, int tile,
                    int splits, void* partials, int64_t partial_rows);
#endif

namespace w8a16 {

constexpr int kGemvMaxRows = 8;                 // GEMV instantiations: M = 1..8
constexpr int kWarpsPerBlock = 8;               // one output channel per warp
constexpr int kLaneWeights = 16;                // int8 weights per lane per step: one 16-byte load
constexpr int kWarpStep = 32 * kLaneWeights;    // weights of one channel a warp consumes per step

// Error codes beyond cudaError_t (which are all below 10000).
constexpr int kGemmNotBuilt = 20000;            // compiled without CUTLASS

// sum_i wf[i] * x[i] over 16 fp16 activations held in two 16-byte vectors, in fp32.
__device__ __forceinline__ float dot16(const float* wf, uint4 xa, uint4 xb) {
    uint32_t words[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        __half2 h;
        memcpy(&h, &words[i], sizeof(h));
        const float2 f = __half22float2(h);
        sum = fmaf(wf[2 * i], f.x, sum);
        sum = fmaf(wf[2 * i + 1], f.y, sum);
    }
    return sum;
}

template <int M>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    gemv_kernel(const __half* __restrict__ x, const int8_t* __restrict__ w, const __half* __restrict__ scale,
                __half* __restrict__ y, int N, int K) {
    const int lane = threadIdx.x & 31;
    const int n = blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5);
    if (n >= N) return;  // uniform per warp: the whole warp leaves, so the shuffles below stay full-warp
    const int8_t* row = w + static_cast<int64_t>(n) * K;

    float acc[M];
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = 0.0f;

#pragma unroll 4
    for (int k = lane * kLaneWeights; k < K; k += kWarpStep) {
        const uint4 packed = __ldcs(reinterpret_cast<const uint4*>(row + k));  // read once: streaming
        float wf[kLaneWeights];
        int8x4_to_float(packed.x, wf);
        int8x4_to_float(packed.y, wf + 4);
        int8x4_to_float(packed.z, wf + 8);
        int8x4_to_float(packed.w, wf + 12);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const uint4* xp = reinterpret_cast<const uint4*>(x + static_cast<int64_t>(m) * K + k);
            acc[m] += dot16(wf, __ldg(xp), __ldg(xp + 1));
        }
    }

#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], offset);
    }
    if (lane == 0) {
        const float s = __half2float(scale[n]);
#pragma unroll
        for (int m = 0; m < M; ++m) y[static_cast<int64_t>(m) * N + n] = __float2half_rn(acc[m] * s);
    }
}

template <int M>
cudaError_t launch_gemv(const void* x, const void* w, const void* scale, void* y, int N, int K, cudaStream_t stream) {
    const dim3 grid(static_cast<unsigned>((N + kWarpsPerBlock - 1) / kWarpsPerBlock));
    gemv_kernel<M><<<grid, kWarpsPerBlock * 32, 0, stream>>>(
        static_cast<const __half*>(x), static_cast<const int8_t*>(w), static_cast<const __half*>(scale),
        static_cast<__half*>(y), N, K);
    return cudaGetLastError();
}

cudaError_t gemv(int64_t M, int64_t N, int64_t K, const void* x, const void* w, const void* scale, void* y,
                 cudaStream_t stream) {
    if (N <= 0 || K <= 0 || N > INT_MAX || K > INT_MAX || K % kLaneWeights) return cudaErrorInvalidValue;
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
        default: return cudaErrorInvalidValue;
    }
}

#if defined(W8A16_WITH_CUTLASS)
constexpr int kCutlassStatusBase = 10000;       // + cutlass::Status of a failed CUTLASS call

// z[m, n] = acc[m, n] * scale[n]: the epilogue's "bias" vector is the per-channel scale and its binary
// op a product. Alignment 8 fp16 (16 bytes) for x, y and the scale, 16 int8 for w.
using Element = cutlass::half_t;
using EpilogueOp = cutlass::epilogue::thread::LinearCombinationBiasElementwise<
    Element, float, float, Element, Element, 8, cutlass::epilogue::thread::Identity<float>, cutlass::multiplies<float>,
    /*StoreT=*/false, Element>;
// Tile configuration from CUTLASS's own SM80 f16 x s8 mixed-input kernel list; 64-wide N tiles keep
// more thread blocks in flight for the small-M decode batches (not yet tuned on the H200).
using Gemm = cutlass::gemm::device::GemmUniversalWithBroadcast<
    Element, cutlass::layout::RowMajor,       // x [M, K]
    int8_t, cutlass::layout::ColumnMajor,     // w [N, K] row-major is w^T [K, N] column-major
    Element, cutlass::layout::RowMajor,       // y [M, N]
    float, cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80, cutlass::gemm::GemmShape<128, 64, 64>,
    cutlass::gemm::GemmShape<64, 32, 64>, cutlass::gemm::GemmShape<16, 8, 16>, EpilogueOp,
    cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<8>, /*Stages=*/4, /*AlignmentA=*/8,
    /*AlignmentB=*/16, cutlass::arch::OpMultiplyAddMixedInputUpcast>;

int gemm(int64_t M, int64_t N, int64_t K, const void* x, const void* w, const void* scale, void* y,
         cudaStream_t stream) {
    if (M <= 0 || N <= 0 || K <= 0 || M > INT_MAX || N > INT_MAX || K > INT_MAX) return cudaErrorInvalidValue;
    const int m = static_cast<int>(M), n = static_cast<int>(N), k = static_cast<int>(K);
    typename Gemm::Arguments args(
        cutlass::gemm::GemmUniversalMode::kGemm, {m, n, k}, /*batch_count=*/1, typename EpilogueOp::Params(1.0f, 0.0f),
        x, w, /*ptr_C=*/nullptr, y, /*ptr_Vector=*/const_cast<void*>(scale), /*ptr_Tensor=*/nullptr,
        /*batch strides (unused with batch_count 1)*/ 0, 0, 0, 0, 0, 0,
        /*lda=*/k, /*ldb=*/k, /*ldc=*/n, /*ldd=*/n, /*ldr=*/0, /*ldt=*/0);
    return run_cutlass_gemm<Gemm>(args, stream, kCutlassStatusBase);
}
#endif

// Run `fn` on `device` (restoring the caller's current device after).
template <typename Fn>
int on_device(int device, Fn fn) {
    int previous = -1;
    cudaError_t err = cudaGetDevice(&previous);
    if (err != cudaSuccess) return err;
    if (previous != device && (err = cudaSetDevice(device)) != cudaSuccess) return err;
    const int result = fn();
    if (previous != device) (void)cudaSetDevice(previous);
    return result;
}

}  // namespace w8a16

extern "C" int w8a16_gemv_max_rows() { return w8a16::kGemvMaxRows; }

extern "C" int w8a16_gemm_available() {
#if defined(W8A16_WITH_CUTLASS)
    return 1;
#else
    return 0;
#endif
}

// y[M, N] = x[M, K] @ (w[N, K] * scale[N, None])^T with the GEMV (1 <= M <= w8a16_gemv_max_rows()).
extern "C" int w8a16_gemv_launch(int device, int64_t stream, int64_t M, int64_t N, int64_t K, const void* x,
                                 const void* w, const void* scale, void* y) {
    return w8a16::on_device(device, [&] {
        return static_cast<int>(w8a16::gemv(M, N, K, x, w, scale, y, reinterpret_cast<cudaStream_t>(stream)));
    });
}

// The same product with the CUTLASS GEMM (any M >= 1); kGemmNotBuilt without CUTLASS.
extern "C" int w8a16_gemm_launch(int device, int64_t stream, int64_t M, int64_t N, int64_t K, const void* x,
                                 const void* w, const void* scale, void* y) {
#if defined(W8A16_WITH_CUTLASS)
    return w8a16::on_device(device, [&] {
        return w8a16::gemm(M, N, K, x, w, scale, y, reinterpret_cast<cudaStream_t>(stream));
    });
#else
    (void)device, (void)stream, (void)M, (void)N, (void)K, (void)x, (void)w, (void)scale, (void)y;
    return w8a16::kGemmNotBuilt;
#endif
}

// The Hopper GEMM's tiles (0 without it, in builds other than sm_90a) and each one's output channels
// (which 0) or batch rows (which 1) per CTA.
extern "C" int w8a16_gemm_sm90_tiles() {
#if defined(W8A16_WITH_CUTLASS_SM90)
    return w8a16_gemm_sm90_tile_count();
#else
    return 0;
#endif
}

extern "C" int w8a16_gemm_sm90_tile(int tile, int which) {
#if defined(W8A16_WITH_CUTLASS_SM90)
    return w8a16_gemm_sm90_tile_shape(tile, which);
#else
    (void)tile, (void)which;
    return -1;
#endif
}

// The same product with the Hopper GEMM in tile `tile` (-1: chosen per problem), K split in `splits` (> 1: fp32
// partials [splits, partial_rows, N]); kGemmNotBuilt without it.
extern "C" int w8a16_gemm_sm90_launch(int device, int64_t stream, int64_t M, int64_t N, int64_t K, const void* x,
                                      const void* w, const void* scale, void* y, int tile, int splits, void* partials,
                                      int64_t partial_rows) {
#if defined(W8A16_WITH_CUTLASS_SM90)
    return w8a16::on_device(device, [&] {
        return w8a16_gemm_sm90(M, N, K, x, w, scale, y, reinterpret_cast<cudaStream_t>(stream),
                               w8a16::kCutlassStatusBase, tile, splits, partials, partial_rows);
    });
#else
    (void)device, (void)stream, (void)M, (void)N, (void)K, (void)x, (void)w, (void)scale, (void)y, (void)tile,
        (void)splits, (void)partials, (void)partial_rows;
    return w8a16::kGemmNotBuilt;
#endif
}

// y[M, N] = x[M, K] @ W^T for 4-bit W (words [N, K / 8], fp16 scale and zero [K / group, N]) with the Hopper
// GEMM in tile `tile` (-1: chosen per problem), K split in `splits` (> 1: fp32 partials [splits, partial_rows, N]);
// kGemmNotBuilt without it.
extern "C" int w4a16_gemm_sm90_launch(int device, int64_t stream, int64_t M, int64_t N, int64_t K, const void* x,
                                      const void* words, const void* scale, const void* zero, int64_t group, void* y,
                                      int tile, int splits, void* partials, int64_t partial_rows) {
#if defined(W8A16_WITH_CUTLASS_SM90)
    return w8a16::on_device(device, [&] {
        return w4a16_gemm_sm90(M, N, K, x, words, scale, zero, group, y, reinterpret_cast<cudaStream_t>(stream),
                               w8a16::kCutlassStatusBase, tile, splits, partials, partial_rows);
    });
#else
    (void)device, (void)stream, (void)M, (void)N, (void)K, (void)x, (void)words, (void)scale, (void)zero,
        (void)group, (void)y, (void)tile, (void)splits, (void)partials, (void)partial_rows;
    return w8a16::kGemmNotBuilt;
#endif
}

extern "C" const char* w8a16_error_string(int code) {
    if (code == w8a16::kGemmNotBuilt) return "this build of the W8A16 extension has no CUTLASS GEMM";
#if defined(W8A16_WITH_CUTLASS)
    if (code >= w8a16::kCutlassStatusBase)
        return cutlass::cutlassGetStatusString(static_cast<cutlass::Status>(code - w8a16::kCutlassStatusBase));
#endif
    return cudaGetErrorString(static_cast<cudaError_t>(code));
}

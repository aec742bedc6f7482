// W8A16 GEMM for Hopper (sm_90a): y[M, N] = x[M, K] @ (w[N, K] * scale[N, None])^T with int8 w, fp16 x and y,
// as a template over the tile and schedule. Each cuda/w8a16_gemm_sm90_<tile>.cu instantiates one tile (so
// the JIT build compiles them in parallel); cuda/w8a16_gemm_sm90.cu picks one per problem.
//
// The kernel is CUTLASS 3's warp-specialized TMA + WGMMA mainloop for mixed inputs: the int8 tile is
// loaded by TMA, converted to fp16 in registers and fed to WGMMA as its register operand. The narrow type
// must be that operand (A), so the product is computed transposed: D^T[N, M] = w[N, K] . x[M, K]^T, and
// D^T in column-major order is y in row-major order. Accumulation is fp32; the epilogue multiplies row n
// of D^T by scale[n] (a column-vector broadcast) and rounds once to fp16: the math of the SM80 kernel and
// the GEMV. Compiled with -DNDEBUG: CUTLASS's device asserts are calls that make ptxas serialize the
// WGMMA pipeline (warning C7510).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#if defined(W8A16_SM90_DEFINE_TEMPLATE)
#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass_run.cuh"
#endif

namespace w8a16_sm90 {

// y = x . (w * scale)^T for x [m, k], w [n, k]: TILE_M output channels x TILE_N batch rows per CTA, K step 64 (128 bytes of fp16). Ping-pong (two
// consumer warpgroups on alternate tiles) for 64-channel tiles, cooperative (both on one tile) for 128.
template <int TILE_M, int TILE_N>
int gemm(int m, int n, int k, const void* x, const void* w, const void* scale, void* y, cudaStream_t stream,
         int status_base);


#if defined(W8A16_SM90_DEFINE_TEMPLATE)
using namespace cute;
using Half = cutlass::half_t;
constexpr int kAlignW = 16;  // int8 elements per 16-byte TMA access
constexpr int kAlignX = 8;   // fp16 elements per 16-byte access

template <int TILE_M, int TILE_N>
struct Config {
    static constexpr bool kPingPong = TILE_M == 64;
    using TileShape = Shape<Int<TILE_M>, Int<TILE_N>, _64>;
    using ClusterShape = Shape<_1, _1, _1>;
    using KernelSchedule = cute::conditional_t<kPingPong, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                                               cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
    using EpilogueSchedule = cute::conditional_t<kPingPong, cutlass::epilogue::TmaWarpSpecialized,
                                                 cutlass::epilogue::TmaWarpSpecializedCooperative>;

    // D^T[n, m] = acc[n, m] * scale[n]: the scale is indexed by the row of D^T (the output channel).
    using ScaleRows = cutlass::epilogue::fusion::Sm90ColBroadcast<0, TileShape, Half, float>;
    using ScaleProduct = cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, Half, float,
                                                                cutlass::FloatRoundStyle::round_to_nearest>;
    using Fusion = cutlass::epilogue::fusion::Sm90EVT<ScaleProduct, ScaleRows,
                                                      cutlass::epilogue::fusion::Sm90AccFetch>;

    using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
        cutlass::epilogue::collective::EpilogueTileAuto, float, float,
        void, cutlass::layout::ColumnMajor, kAlignX,  // no source operand C
        Half, cutlass::layout::ColumnMajor, kAlignX,  // D^T [N, M] column-major = y [M, N] row-major
        EpilogueSchedule, Fusion>::CollectiveOp;

    using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
        int8_t, cutlass::layout::RowMajor, kAlignW,   // w [N, K]: K-major, as the converted operand must be
        Half, cutlass::layout::ColumnMajor, kAlignX,  // x [M, K] as the K x M operand B: K-major
        float, TileShape, ClusterShape,
        cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
        KernelSchedule>::CollectiveOp;

    using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
    using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// Strides (row, column, batch) of a packed K-major operand [rows, K] and of a packed column-major
// [rows, cols] output; the unit stride is a static _1 in both types and stays as it is.
template <class Stride>
Stride k_major(int rows, int k) {
    Stride s{};
    get<0>(s) = k;
    get<2>(s) = static_cast<int64_t>(rows) * k;
    return s;
}

template <class Stride>
Stride column_major(int rows, int cols) {
    Stride s{};
    get<1>(s) = rows;
    get<2>(s) = static_cast<int64_t>(rows) * cols;
    return s;
}

// 0, a cudaError_t, or status_base + cutlass::Status of a failed CUTLASS call (run_cutlass_gemm).
template <int TILE_M, int TILE_N>
int gemm(int m, int n, int k, const void* x, const void* w, const void* scale, void* y, cudaStream_t stream,
         int status_base) {
    using C = Config<TILE_M, TILE_N>;
    using Kernel = typename C::Kernel;
    typename C::Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {n, m, k, 1},
        {static_cast<const int8_t*>(w), k_major<typename Kernel::StrideA>(n, k),
         static_cast<const Half*>(x), k_major<typename Kernel::StrideB>(m, k)},
        {{}, nullptr, column_major<typename Kernel::StrideC>(n, m),
         static_cast<Half*>(y), column_major<typename Kernel::StrideD>(n, m)}};
    // Fusion arguments, children first: the scale vector, the accumulator, then the product.
    args.epilogue.thread = {{static_cast<const Half*>(scale)}, {}, {}};
    return run_cutlass_gemm<typename C::Gemm>(args, stream, status_base);
}

#define W8A16_SM90_INSTANTIATE(TILE_M, TILE_N)                                                              \
    template int gemm<TILE_M, TILE_N>(int, int, int, const void*, const void*, const void*, void*, cudaStream_t, \
                                      int);
#endif  // W8A16_SM90_DEFINE_TEMPLATE

}  // namespace w8a16_sm90

// Mixed-input GEMMs for Hopper (sm_90a), y[M, N] = x[M, K] @ W[N, K]^T with fp16 x and y, as a template over
// the weight format and the tile. Each cuda/w8a16_gemm_sm90_<tile>.cu (int8) and cuda/w4a16_gemm_sm90_<tile>.cu
// (4-bit) instantiates one (so the JIT build compiles them side by side); cuda/w8a16_gemm_sm90.cu picks one per
// problem. Weight formats:
//  * Int8Rows (W8A16): int8 w[N, K] with an fp16 scale per output channel, W = w * scale[N, None].
//  * Uint4Groups (GemLite A16W4_HQQ_INT): 4-bit codes q[N, K], 8 to a 32-bit word along K (k in bits 4(k % 8) ..
//    4(k % 8) + 3, i.e. GemLite's [K/8, N] words transposed), fp16 scale and zero [K/group, N]:
//    W[n, k] = fp16(q * scale + zero) of k's group, the weights the fused 4-bit GEMV rebuilds.
//
// The kernel is CUTLASS 3's warp-specialized TMA + WGMMA mainloop for mixed inputs: the narrow tile is
// loaded by TMA, converted to fp16 in registers (4-bit: with its group's scale and zero) and fed to WGMMA as its
// register operand. The narrow type must be that operand (A) and K-major, so the product is computed transposed:
// D^T[N, M] = W[N, K] . x[M, K]^T, and D^T in column-major order is y in row-major order. Accumulation is fp32,
// rounded once to fp16; for int8 the epilogue first multiplies row n of D^T by scale[n] (a column-vector
// broadcast): the math of the SM80 kernel and the GEMV. Compiled with -DNDEBUG: CUTLASS's device asserts are
// calls that make ptxas serialize the WGMMA pipeline (warning C7510).
//
// Split K (Out = float): the K range is cut into `splits` equal parts run as the GEMM's batch mode (L), each
// writing its fp32 partial product [M, N] to partials[split]; cuda/w8a16_gemm_sm90.cu then sums them in split
// order and rounds once. A matrix with few output tiles and a long K (the FFN value) then keeps every SM busy.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cutlass/half.h"

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

using Half = cutlass::half_t;

struct Int8Rows {};     // the weight formats above
struct Uint4Groups {};

// One product: x [m, k], w [n, k] (Uint4Groups: k / 8 words per row), scale [n] (Int8Rows) or scale and zero
// [k / group, n] (Uint4Groups); y [m, n] fp16, or with Out = float the partials [splits, m, n] (k / splits a
// multiple of 64 and of the group).
struct Problem {
    int m, n, k;
    const void* x;
    const void* w;
    const void* scale;
    const void* zero;
    int group;
    void* y;
    int splits;
};

// y = x . W^T: TILE_M output channels x TILE_N batch rows per CTA, K step 64 (128 bytes of fp16). Ping-pong (two
// consumer warpgroups on alternate tiles) for 64-channel tiles, cooperative (both on one tile) for 128. Out: the
// output element, cutlass::half_t (y) or float (split-K partials).
template <class Weight, int TILE_M, int TILE_N, class Out>
int gemm(const Problem& p, cudaStream_t stream, int status_base);


#if defined(W8A16_SM90_DEFINE_TEMPLATE)
using namespace cute;
constexpr int kAlignX = 8;  // fp16 elements per 16-byte access

template <class Weight>
struct Format;
template <>
struct Format<Int8Rows> {
    using Element = int8_t;
    using Stored = int8_t;
    static constexpr int kAlign = 16;  // elements per 16-byte TMA access
};
template <>
struct Format<Uint4Groups> {
    using Element = cute::tuple<cutlass::uint4b_t, Half, Half>;  // codes, scale, zero: W = q * scale + zero
    using Stored = cutlass::uint4b_t;
    static constexpr int kAlign = 32;
};

template <class Weight, int TILE_M, int TILE_N, class Out>
struct Config {
    static constexpr bool kPingPong = TILE_M == 64;
    using TileShape = Shape<Int<TILE_M>, Int<TILE_N>, _64>;
    using ClusterShape = Shape<_1, _1, _1>;
    using KernelSchedule = cute::conditional_t<kPingPong, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                                               cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
    using EpilogueSchedule = cute::conditional_t<kPingPong, cutlass::epilogue::TmaWarpSpecialized,
                                                 cutlass::epilogue::TmaWarpSpecializedCooperative>;

    // int8: D^T[n, m] = acc[n, m] * scale[n], the scale indexed by the row of D^T (the output channel);
    // 4-bit: D^T = acc (the scales were applied to the weights).
    using ScaleRows = cutlass::epilogue::fusion::Sm90ColBroadcast<0, TileShape, Half, float>;
    using ScaleProduct = cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, Out, float,
                                                                cutlass::FloatRoundStyle::round_to_nearest>;
    using Fusion = cute::conditional_t<
        cute::is_same_v<Weight, Int8Rows>,
        cutlass::epilogue::fusion::Sm90EVT<ScaleProduct, ScaleRows, cutlass::epilogue::fusion::Sm90AccFetch>,
        cutlass::epilogue::fusion::LinearCombination<Out, float, void, float>>;
    static constexpr int kAlignOut = 16 / static_cast<int>(sizeof(Out));  // elements per 16-byte store

    using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
        cutlass::epilogue::collective::EpilogueTileAuto, float, float,
        void, cutlass::layout::ColumnMajor, kAlignOut,  // no source operand C
        Out, cutlass::layout::ColumnMajor, kAlignOut,   // D^T [N, M] column-major = y [M, N] row-major
        EpilogueSchedule, Fusion>::CollectiveOp;

    using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
        typename Format<Weight>::Element, cutlass::layout::RowMajor, Format<Weight>::kAlign,  // W [N, K]: K-major
        Half, cutlass::layout::ColumnMajor, kAlignX,  // x [M, K] as the K x M operand B: K-major
        float, TileShape, ClusterShape,
        cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
        KernelSchedule>::CollectiveOp;

    using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
    using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// Strides (row, column, batch) with the unit stride, a static _1 in every stride type, left as it is: a K-major
// operand [rows, K] whose batches are the consecutive K slices of `split` elements (the whole K when not split),
// and a column-major tensor of `cols` columns of `rows` with `batch` elements from one batch to the next (the
// output, `rows` x `cols` per batch; the 4-bit scales and zeros, [K / group, N] row-major, a slice of groups
// per batch).
template <class Stride>
Stride k_major(int rows, int k, int split) {
    Stride s{};
    get<0>(s) = k;
    get<2>(s) = split == k ? static_cast<int64_t>(rows) * k : split;
    return s;
}

template <class Stride>
Stride column_major(int rows, int64_t batch) {
    Stride s{};
    get<1>(s) = rows;
    get<2>(s) = batch;
    return s;
}

// 0, a cudaError_t, or status_base + cutlass::Status of a failed CUTLASS call (run_cutlass_gemm).
template <class Weight, int TILE_M, int TILE_N, class Out>
int gemm(const Problem& p, cudaStream_t stream, int status_base) {
    using C = Config<Weight, TILE_M, TILE_N, Out>;
    using Kernel = typename C::Kernel;
    using Arguments = typename C::Gemm::Arguments;
    // the slices' shape (whole groups and K steps) is checked by the caller, cuda/w8a16_gemm_sm90.cu
    const int splits = cute::is_same_v<Out, float> ? p.splits : 1;
    const int k = p.k / splits;  // each batch's (split's) K
    const auto* w = static_cast<const typename Format<Weight>::Stored*>(p.w);
    const auto* x = static_cast<const Half*>(p.x);
    const auto* scale = static_cast<const Half*>(p.scale);
    const auto dw = k_major<typename Kernel::StrideA>(p.n, p.k, k);
    const auto dx = k_major<typename Kernel::StrideB>(p.m, p.k, k);
    const int64_t outputs = static_cast<int64_t>(p.n) * p.m;
    const typename C::Epilogue::Arguments epilogue{
        {}, nullptr, column_major<typename Kernel::StrideC>(p.n, outputs),
        static_cast<Out*>(p.y), column_major<typename Kernel::StrideD>(p.n, outputs)};
    Arguments args;
    if constexpr (cute::is_same_v<Weight, Int8Rows>) {
        args = Arguments{cutlass::gemm::GemmUniversalMode::kGemm, {p.n, p.m, k, splits}, {w, dw, x, dx}, epilogue};
        // Fusion arguments, children first: the scale vector, the accumulator, then the product.
        args.epilogue.thread = {{scale}, {}, {}};
    } else {
        const auto ds = column_major<typename C::Mainloop::StrideScale>(p.n, static_cast<int64_t>(p.n) * (k / p.group));
        args = Arguments{cutlass::gemm::GemmUniversalMode::kGemm, {p.n, p.m, k, splits},
                         {w, dw, x, dx, scale, ds, p.group, static_cast<const Half*>(p.zero)}, epilogue};
        args.epilogue.thread.alpha = 1.0f;
        args.epilogue.thread.beta = 0.0f;
    }
    // Output tiles in channel order first: a wave of CTAs then shares a few slabs of x rows and streams W, instead
    // of sharing a few channels and re-reading all of x (CUTLASS's heuristic walks the rows first whenever there
    // are no more row tiles than channel tiles: a 16 x 1,024-token prompt read its 128 MB x once per wave).
    args.scheduler.raster_order = decltype(args.scheduler.raster_order)::AlongM;
    return run_cutlass_gemm<typename C::Gemm>(args, stream, status_base);
}

#define W8A16_SM90_INSTANTIATE(WEIGHT, TILE_M, TILE_N, OUT) \
    template int gemm<WEIGHT, TILE_M, TILE_N, OUT>(const Problem&, cudaStream_t, int);
#endif  // W8A16_SM90_DEFINE_TEMPLATE

}  // namespace w8a16_sm90

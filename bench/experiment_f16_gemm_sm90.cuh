// Experiment (bench/experiment_f16_gemm.py): fp16 x fp16 GEMMs on CUTLASS 3's Hopper TMA + WGMMA kernels, with
// the persistent data-parallel or the stream-K tile scheduler, against cuBLAS on the large-batch decode shapes.
// Same layout as the W8A16 Hopper GEMM (cuda/w8a16_gemm_sm90.cuh): y[M, N] = x[M, K] @ W[N, K]^T is computed as
// D^T[N, M] = W . x^T, W the K-major A operand, x the K-major B operand, D^T column-major = y row-major; L
// products side by side (stacked W [L, N, K], x [L, M, K], y [L, M, N]). beta = 1 adds y's previous contents
// (the residual of the output projection and the FFN value), beta = 0 overwrites y. The configurations are
// instantiated in two files (bench/experiment_f16_gemm_sm90{,_streamk}.cu) so that they build side by side.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"

namespace f16_experiment {

using namespace cute;
using Half = cutlass::half_t;

template <int TILE_M, int TILE_N, class Scheduler>
struct Config {
    static constexpr bool kPingPong = TILE_M == 64;
    using TileShape = Shape<Int<TILE_M>, Int<TILE_N>, _64>;
    using ClusterShape = Shape<_1, _1, _1>;
    using KernelSchedule = cute::conditional_t<kPingPong, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                                               cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
    using EpilogueSchedule = cute::conditional_t<kPingPong, cutlass::epilogue::TmaWarpSpecialized,
                                                 cutlass::epilogue::TmaWarpSpecializedCooperative>;
    using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
        cutlass::epilogue::collective::EpilogueTileAuto, float, float,
        Half, cutlass::layout::ColumnMajor, 8, Half, cutlass::layout::ColumnMajor, 8,
        EpilogueSchedule, cutlass::epilogue::fusion::LinearCombination<Half, float, Half, float>>::CollectiveOp;
    using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Half, cutlass::layout::RowMajor, 8,
        Half, cutlass::layout::ColumnMajor, 8, float, TileShape, ClusterShape,
        cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
        KernelSchedule>::CollectiveOp;
    using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue, Scheduler>;
    using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// Packed strides (the unit stride, a static _1, left as it is): a K-major operand [rows, k] per batch, and a
// column-major [rows, cols] output per batch.
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

struct Problem {
    int m, n, k, l;
    const void* x;
    const void* w;
    void* y;
    float beta;
    int splits;    // stream-K configs: 0 = CUTLASS's heuristic (stream-K), s > 1 = split K in s
    void* workspace;
    size_t workspace_bytes;
    int sms;
};

// 0 on success; -1 workspace too small (the size needed is returned by workspace_size); 1000 + cutlass::Status.
template <int TILE_M, int TILE_N, class Scheduler>
int run(const Problem& p, cudaStream_t stream, bool size_only, size_t* needed) {
    using C = Config<TILE_M, TILE_N, Scheduler>;
    using Kernel = typename C::Kernel;
    const auto dw = k_major<typename Kernel::StrideA>(p.n, p.k);
    const auto dx = k_major<typename Kernel::StrideB>(p.m, p.k);
    const auto dy = column_major<typename Kernel::StrideD>(p.n, p.m);
    const auto dc = column_major<typename Kernel::StrideC>(p.n, p.m);
    typename C::Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm, {p.n, p.m, p.k, p.l},
        {static_cast<const Half*>(p.w), dw, static_cast<const Half*>(p.x), dx},
        {{}, static_cast<const Half*>(p.y), dc, static_cast<Half*>(p.y), dy}};
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = p.beta;
    args.hw_info.sm_count = p.sms;
    using Raster = decltype(args.scheduler.raster_order);
    args.scheduler.raster_order = Raster::AlongM;  // channel tiles first: a wave shares x's rows, streams W
    if constexpr (cute::is_same_v<Scheduler, cutlass::gemm::StreamKScheduler>) {
        using Mode = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90StreamKParams::DecompositionMode;
        args.scheduler.splits = p.splits > 1 ? p.splits : 1;
        args.scheduler.decomposition_mode = p.splits > 1 ? Mode::SplitK : Mode::StreamK;
    }
    typename C::Gemm op;
    cutlass::Status status = op.can_implement(args);
    if (status != cutlass::Status::kSuccess) return 1000 + static_cast<int>(status);
    const size_t bytes = C::Gemm::get_workspace_size(args);
    if (size_only) {
        *needed = bytes;
        return 0;
    }
    if (bytes > p.workspace_bytes) return -1;
    status = op.initialize(args, p.workspace, stream);
    if (status == cutlass::Status::kSuccess) status = op.run(stream);
    if (status != cutlass::Status::kSuccess) {
        const cudaError_t launch = cudaGetLastError();
        return launch != cudaSuccess ? static_cast<int>(launch) : 1000 + static_cast<int>(status);
    }
    return 0;
}

using Run = int (*)(const Problem&, cudaStream_t, bool, size_t*);
int persistent_configs(const Run** runs, const char* const** names);
int streamk_configs(const Run** runs, const char* const** names);

}  // namespace f16_experiment

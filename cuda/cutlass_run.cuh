// Running a CUTLASS device-level GEMM (2.x or 3.x adapter) from the W8A16 launchers: cuda/w8a16_gemm.cu
// (SM80) and cuda/w8a16_gemm_sm90.cuh (Hopper). Include after the CUTLASS headers.
#pragma once

#include <cuda_runtime.h>

// Check, initialize and launch `Gemm` on `stream`: 0, a cudaError_t of the launch, or status_base + the
// cutlass::Status of a failed call. No workspace is passed (a launch being captured into a CUDA graph
// could not allocate one), so a problem that asks for one fails with kErrorWorkspaceNull.
template <class Gemm>
int run_cutlass_gemm(const typename Gemm::Arguments& args, cudaStream_t stream, int status_base) {
    Gemm op;
    cutlass::Status status = op.can_implement(args);
    if (status == cutlass::Status::kSuccess && Gemm::get_workspace_size(args) != 0)
        status = cutlass::Status::kErrorWorkspaceNull;
    if (status == cutlass::Status::kSuccess) status = op.initialize(args, /*workspace=*/nullptr, stream);
    if (status == cutlass::Status::kSuccess) status = op.run(stream);
    if (status != cutlass::Status::kSuccess) {
        const cudaError_t launch = cudaGetLastError();
        return launch != cudaSuccess ? static_cast<int>(launch) : status_base + static_cast<int>(status);
    }
    return cudaSuccess;
}

// Experiment (bench/experiment_f16_gemm.py): the stream-K configurations of the fp16 CUTLASS GEMM
// (bench/experiment_f16_gemm_sm90.cuh), in a file of their own so that they build beside the others.
#include "experiment_f16_gemm_sm90.cuh"

namespace f16_experiment {

using cutlass::gemm::StreamKScheduler;

namespace {
constexpr Run kRuns[] = {run<128, 128, StreamKScheduler>, run<128, 256, StreamKScheduler>,
                         run<256, 128, StreamKScheduler>, run<128, 64, StreamKScheduler>};
constexpr const char* kNames[] = {"128x128 stream-K", "128x256 stream-K", "256x128 stream-K", "128x64 stream-K"};
}  // namespace

int streamk_configs(const Run** runs, const char* const** names) {
    *runs = kRuns, *names = kNames;
    return sizeof(kRuns) / sizeof(kRuns[0]);
}

}  // namespace f16_experiment

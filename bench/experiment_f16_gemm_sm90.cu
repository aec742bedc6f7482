// Experiment (bench/experiment_f16_gemm.py): the data-parallel configurations of the fp16 CUTLASS GEMM
// (bench/experiment_f16_gemm_sm90.cuh) and the C interface over all of them.
#include "experiment_f16_gemm_sm90.cuh"

namespace f16_experiment {

using cutlass::gemm::PersistentScheduler;

namespace {
constexpr Run kRuns[] = {run<128, 128, PersistentScheduler>, run<64, 256, PersistentScheduler>,
                         run<64, 128, PersistentScheduler>};
constexpr const char* kNames[] = {"128x128", "64x256 pingpong", "64x128 pingpong"};
}  // namespace

int persistent_configs(const Run** runs, const char* const** names) {
    *runs = kRuns, *names = kNames;
    return sizeof(kRuns) / sizeof(kRuns[0]);
}

}  // namespace f16_experiment

namespace {

using f16_experiment::Problem, f16_experiment::Run;

// Configuration `config`: the data-parallel ones, then the stream-K ones.
bool find(int config, Run* run, const char** name) {
    const Run* runs;
    const char* const* names;
    int count = f16_experiment::persistent_configs(&runs, &names);
    if (config >= count) {
        config -= count;
        count = f16_experiment::streamk_configs(&runs, &names);
    }
    if (config < 0 || config >= count) return false;
    *run = runs[config], *name = names[config];
    return true;
}

}  // namespace

extern "C" int f16_gemm_configs() {
    const Run* runs;
    const char* const* names;
    return f16_experiment::persistent_configs(&runs, &names) + f16_experiment::streamk_configs(&runs, &names);
}

extern "C" const char* f16_gemm_config_name(int config) {
    Run run;
    const char* name = "";
    return find(config, &run, &name) ? name : "";
}

// y[l] (+)= x[l] @ w[l]^T for l < L with configuration `config`; with `needed`, nothing runs: *needed is set to
// the workspace the problem asks for. Returns 0, a cudaError_t, -1 (workspace too small), -2 (bad config) or
// 1000 + cutlass::Status.
extern "C" int f16_gemm_launch(int config, int64_t stream, int M, int N, int K, int L, const void* x, const void* w,
                               void* y, float beta, int splits, void* workspace, size_t workspace_bytes, int sms,
                               size_t* needed) {
    Run run;
    const char* name;
    if (!find(config, &run, &name)) return -2;
    const Problem p{M, N, K, L, x, w, y, beta, splits, workspace, workspace_bytes, sms};
    return run(p, reinterpret_cast<cudaStream_t>(stream), needed != nullptr, needed);
}

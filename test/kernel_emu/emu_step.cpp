// CPU harness for cuda/rwkv7_step.cu (KERNEL_SOURCE: the file cut before its launchers, see emu_build.py): builds a
// step's program with the file's own builder from the caller's entries (infer/ops/persistent.py's) and runs the
// persistent kernel on a co-resident grid of `grid` blocks (emu::run_resident_grid: the blocks' threads
// interleaved, so its grid barriers really wait). Host memory stands in for device memory.
// timeline: null, or [phases][2][timeline_stride >= grid] (StepArgs::timeline). Returns 0, -1 for dims the builder
// refuses, or 1 + a block of a deadlock.
#include "emu_device.h"

#include KERNEL_SOURCE

#include <vector>

EMU_EXPORT int emu_step_entries(int which) { return step::entry_count(which); }
EMU_EXPORT int64_t emu_step_workspace(const int64_t* dims, int which) {
    return step::workspace_size(step::dims_from(dims), which);
}

EMU_EXPORT int emu_step_run(const int64_t* dims, const int64_t* model, const int64_t* layers, const int64_t* token,
                            const int64_t* slot, unsigned* sync, int prefetch, int grid, unsigned seed,
                            unsigned long long* timeline, int timeline_stride) {
    const step::Dims d = step::dims_from(dims);
    if (step::dims_unsupported(d) || grid <= 0) return -1;
    std::vector<step::Phase> phases(step::max_phases(d));
    const int n = step::build_program(d, model, layers, phases.data());
    const auto ptr = [](int64_t p) { return reinterpret_cast<void*>(static_cast<intptr_t>(p)); };
    const step::StepArgs args{phases.data(), n, token, slot, d.num_slots, d.V,
                              static_cast<const __half*>(ptr(model[step::kEmb])),
                              static_cast<__half*>(ptr(model[step::kX])),
                              static_cast<float*>(ptr(model[step::kLogits])), sync,
                              static_cast<unsigned*>(ptr(model[step::kDeps])), step::deps_count(d), prefetch,
                              timeline, timeline_stride};
    const int staged = step::staged_halves(d);
    const size_t smem = step::shared_bytes(d);
    const auto kernel = d.state_half ? step::step_kernel<__half> : step::step_kernel<float>;
    return emu::run_resident_grid(grid, step::kThreads, smem, [&] { kernel(args, staged); }, seed);
}

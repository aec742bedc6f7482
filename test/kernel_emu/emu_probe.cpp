// CPU harness for bench/probe_persistent.cu (KERNEL_SOURCE: the file cut before its host driver, see
// emu_build.py): builds the phases of one decode step of a (tiny) model over buffers the caller owns, in the
// probe's order (probe::buffer_shape), and runs them: one launch per phase on a grid of `grid` blocks, or the
// whole step in one persistent launch on a one-block grid (whose grid barriers then complete at once; the
// emulation runs a grid's blocks one after another, so a larger persistent grid would wait forever).
// Returns 0, -1 for arguments the emulation cannot run, or 1 + the block that deadlocked.
#include "emu_device.h"

#include KERNEL_SOURCE

#include <vector>

namespace {
probe::Dims dims_from(const int* d) { return probe::Dims{d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]}; }
}  // namespace

EMU_EXPORT int emu_probe_buffer_count(const int* dims) { return probe::buffer_count(dims_from(dims)); }

EMU_EXPORT void emu_probe_buffer_shape(const int* dims, int i, int64_t* elems, int* half) {
    bool h = false;
    probe::buffer_shape(dims_from(dims), i, *elems, h);
    *half = h;
}

EMU_EXPORT int emu_probe_phase_count(const int* dims, int fold) {
    const probe::Dims d = dims_from(dims);
    const int n = probe::buffer_count(d);
    std::vector<void*> none(n, nullptr);
    std::vector<probe::Phase> phases(probe::max_phases(d));
    return probe::build_phases(d, none.data(), fold, phases.data());
}

EMU_EXPORT int emu_probe_step(const int* dims, void* const* buffers, int fold, int persistent, int prefetch,
                              int grid, unsigned seed) {
    const probe::Dims d = dims_from(dims);
    if (probe::shared_bytes(d) > sizeof(float) * probe::kEmuSharedFloats || grid <= 0 || (persistent && grid != 1))
        return -1;
    std::vector<probe::Phase> phases(probe::max_phases(d));
    const int n = probe::build_phases(d, buffers, fold, phases.data());
    unsigned arrivals = 0;
    const probe::Control ctl{&arrivals, prefetch, 0};
    if (persistent)
        return emu::run_grid(1, probe::kThreads, [&] { probe::probe_kernel(phases.data(), 0, n - 1, ctl); }, seed);
    for (int p = 0; p < n; ++p) {
        const int r = emu::run_grid(static_cast<unsigned>(grid), probe::kThreads,
                                    [&] { probe::probe_kernel(phases.data(), p, p, ctl); }, seed + p);
        if (r) return r;
    }
    return 0;
}

// CPU harness: runs the kernel of cuda/sampler.cu or hip/sampler.hip (KERNEL_SOURCE: the file cut
// before its launcher, which includes the stand-in runtime header of this folder) one block at a
// time, its kThreads threads as fibers. See emu_device.h.
#include "emu_device.h"

#include KERNEL_SOURCE

#include <ucontext.h>

#include <algorithm>
#include <functional>
#include <numeric>
#include <random>
#include <vector>

namespace {

constexpr size_t kStack = 256 * 1024;
ucontext_t scheduler;
std::vector<ucontext_t> fibers;
std::vector<char> stacks;
std::vector<char> finished;
int current = 0;
std::function<void()> body;

void fiber_main() {
    body();
    finished[current] = 1;  // returns to `scheduler` through uc_link
    ++emu::progress;
}

// false when the block deadlocked: its threads wait at barriers that can no longer complete (they
// took different paths); the waiting fibers are abandoned.
bool run_block(const std::function<void()>& kernel, int threads) {
    using namespace rwkv_sampler;
    fibers.assign(threads, ucontext_t{});
    stacks.resize(static_cast<size_t>(threads) * kStack);
    finished.assign(threads, 0);
    std::vector<emu::Warp> warps(threads / EMU_WARP);
    for (auto& w : warps) w.bar.expected = EMU_WARP;
    emu::warps = warps.data();
    emu::block_barrier = emu::Barrier{};
    emu::block_barrier.expected = threads;
    body = kernel;
    for (int t = 0; t < threads; ++t) {
        getcontext(&fibers[t]);
        fibers[t].uc_stack.ss_sp = &stacks[t * kStack];
        fibers[t].uc_stack.ss_size = kStack;
        fibers[t].uc_link = &scheduler;
        makecontext(&fibers[t], fiber_main, 0);
    }
    // Sweeps in a fresh random order until every fiber has returned, so that the kernel's result
    // cannot lean on one particular interleaving between its barriers.
    std::vector<int> order(threads);
    std::iota(order.begin(), order.end(), 0);
    std::mt19937 rng(static_cast<unsigned>(blockIdx.x) * 7919u + 1u);
    for (int left = threads; left > 0;) {
        const unsigned long long before = emu::progress;
        left = 0;
        std::shuffle(order.begin(), order.end(), rng);
        for (const int t : order) {
            if (finished[t]) continue;
            current = t;
            threadIdx.x = static_cast<unsigned>(t);
            swapcontext(&scheduler, &fibers[t]);
            left += !finished[t];
        }
        if (left > 0 && emu::progress == before) return false;  // a whole sweep of waiting only
    }
    return true;
}

}  // namespace

void emu::yield() { swapcontext(&fibers[current], &scheduler); }

extern "C" int emu_sampler(int64_t B, int64_t V, int64_t p_stride, const float* p, const int64_t* top_k, int64_t ks,
                           const float* top_p, int64_t tps, const float* u, int64_t us, const int64_t* greedy,
                           int64_t gs, float* tau, int64_t* drawn) {
    using namespace rwkv_sampler;
    const bool vec = V % 4 == 0 && p_stride % 4 == 0 && reinterpret_cast<uintptr_t>(p) % 16 == 0;
    for (int64_t row = 0; row < B; ++row) {
        blockIdx.x = static_cast<unsigned>(row);
        const bool ok = run_block(
            [&] {
                if (vec)
                    sampler_kernel<true>(V, p_stride, p, top_k, ks, top_p, tps, u, us, greedy, gs, tau, drawn);
                else
                    sampler_kernel<false>(V, p_stride, p, top_k, ks, top_p, tps, u, us, greedy, gs, tau, drawn);
            },
            kThreads);
        if (!ok) return 1 + static_cast<int>(row);  // deadlock in this row
    }
    return 0;
}

// CPU harness: runs the kernel of cuda/sampler.cu or hip/sampler.hip (KERNEL_SOURCE: the file cut
// before its launcher, which includes the stand-in runtime header of this folder) one block per row,
// its kThreads threads as fibers. See emu_device.h.
#include "emu_device.h"

#include KERNEL_SOURCE

EMU_EXPORT int emu_sampler(int64_t B, int64_t V, int64_t p_stride, const float* p, const int64_t* top_k, int64_t ks,
                           const float* top_p, int64_t tps, const float* u, int64_t us, const int64_t* greedy,
                           int64_t gs, float* tau, int64_t* drawn) {
    using namespace rwkv_sampler;
    const bool vec = V % 4 == 0 && p_stride % 4 == 0 && reinterpret_cast<uintptr_t>(p) % 16 == 0;
    for (int64_t row = 0; row < B; ++row) {
        blockIdx = dim3(static_cast<unsigned>(row));
        const bool ok = emu::run_block(
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

EMU_EXPORT int emu_sampler_prepare(int64_t B, int64_t V, int64_t vv, int half, const void* logits, int64_t ls,
                                   const float* pen, int64_t ps, const int64_t* slots, const int64_t* bias_ids,
                                   const float* bias_vals, int64_t nb, int64_t bs, const float* temp, int64_t ts,
                                   const int64_t* k1, const int64_t* k2, int64_t ks, const int64_t* steps, float* s,
                                   int64_t ss, int64_t* tok, bool* dead, int64_t* fallback, float* u) {
    using namespace rwkv_sampler;
    for (int64_t row = 0; row < B; ++row) {
        blockIdx = dim3(static_cast<unsigned>(row));
        const bool ok = emu::run_block(
            [&] {
                if (half)
                    prepare_kernel<__half>(V, vv, static_cast<const __half*>(logits), ls, pen, ps, slots, bias_ids,
                                           bias_vals, nb, bs, temp, ts, k1, k2, ks, steps, s, ss, tok, dead,
                                           fallback, u);
                else
                    prepare_kernel<float>(V, vv, static_cast<const float*>(logits), ls, pen, ps, slots, bias_ids,
                                          bias_vals, nb, bs, temp, ts, k1, k2, ks, steps, s, ss, tok, dead, fallback,
                                          u);
            },
            kThreads);
        if (!ok) return 1 + static_cast<int>(row);
    }
    return 0;
}

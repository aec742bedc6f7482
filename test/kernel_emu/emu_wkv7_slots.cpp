// CPU harness for the WKV-7 slot kernel of cuda/wkv7_slots.cu or hip/wkv7_slots.hip (KERNEL_SOURCE: the
// file cut before its C launcher, see emu_build.py): the arguments of wkv7_slots_launch (minus device and
// stream), one block of 64 threads per (row, head), run block by block (emu::run_grid). Returns 0, -1 for
// a dtype code the launcher would refuse, or 1 + the block that deadlocked. See emu_device.h.
#include "emu_device.h"

#include KERNEL_SOURCE

namespace {
#ifdef EMU_HIP
using Bf16 = wkv7::bf16_bits;  // the HIP port reads bfloat16 as raw bits
#else
using Bf16 = __nv_bfloat16;
#endif

template <typename T, typename S>
int run(int64_t B, int64_t H, int64_t num_slots, int64_t num_tokens, void* state, const int64_t* slots,
        const int64_t* starts, const int64_t* lasts, const void* r, const float* w, const void* k, const void* v,
        const void* a, const void* b, float* y) {
    const int h = static_cast<int>(H);
    return emu::run_grid(static_cast<unsigned>(B * H), wkv7::N, [&] {
        wkv7::wkv7_slots_kernel<T, S>(h, num_slots, num_tokens, static_cast<S*>(state), slots, starts, lasts,
                                      static_cast<const T*>(r), w, static_cast<const T*>(k),
                                      static_cast<const T*>(v), static_cast<const T*>(a),
                                      static_cast<const T*>(b), y);
    });
}

template <typename T>
int run_act(int state_dtype, int64_t B, int64_t H, int64_t num_slots, int64_t num_tokens, void* state,
            const int64_t* slots, const int64_t* starts, const int64_t* lasts, const void* r, const float* w,
            const void* k, const void* v, const void* a, const void* b, float* y) {
    if (state_dtype == wkv7::kFloat32)
        return run<T, float>(B, H, num_slots, num_tokens, state, slots, starts, lasts, r, w, k, v, a, b, y);
    if (state_dtype == wkv7::kFloat16)
        return run<T, __half>(B, H, num_slots, num_tokens, state, slots, starts, lasts, r, w, k, v, a, b, y);
    return -1;
}
}  // namespace

EMU_EXPORT int emu_wkv7_slots(int act_dtype, int state_dtype, int64_t B, int64_t H, int64_t num_slots,
                              int64_t num_tokens, void* state, const int64_t* slots, const int64_t* starts,
                              const int64_t* lasts, const void* r, const float* w, const void* k, const void* v,
                              const void* a, const void* b, float* y) {
    if (B <= 0 || H <= 0) return -1;
    switch (act_dtype) {
        case wkv7::kFloat32:
            return run_act<float>(state_dtype, B, H, num_slots, num_tokens, state, slots, starts, lasts, r, w, k, v,
                                  a, b, y);
        case wkv7::kFloat16:
            return run_act<__half>(state_dtype, B, H, num_slots, num_tokens, state, slots, starts, lasts, r, w, k, v,
                                   a, b, y);
        case wkv7::kBFloat16:
            return run_act<Bf16>(state_dtype, B, H, num_slots, num_tokens, state, slots, starts, lasts, r, w, k, v,
                                 a, b, y);
        default:
            return -1;
    }
}

// CPU harness for the fused forward kernels of cuda/rwkv7_fused.cu or hip/rwkv7_fused.hip
// (KERNEL_SOURCE: the file cut before its C launchers, see emu_build.py). Each entry point takes the
// arguments of the launcher of the same name (minus device and stream), makes the same checks, packs
// the kernel arguments with the launchers' own functions (make_mix_args, make_time_mix_args,
// pack_gemv) and runs the grid block by block (emu::run_grid). Returns 0, -1 for
// arguments the launcher would refuse, or 1 + the block that deadlocked. See emu_device.h.
#include "emu_device.h"

#include KERNEL_SOURCE

// span: run ln_shift_mix_span_kernel (kLnSpan tokens per block) instead of the per-token kernel; the launcher
// picks it with ln_span_for (exported below).
EMU_EXPORT int emu_fused_ln_shift_mix(int64_t T, int64_t C, int64_t num_slots, const void* x, const void* ln_w,
                                      const void* ln_b, void* shift, const int32_t* prev, const int64_t* slots,
                                      const int64_t* lasts, const void* const* mix, void* const* out, int count,
                                      int span) {
    using namespace fused;
    if (T <= 0 || C <= 0 || C % 8 || C > kLnThreads * kMaxVec * 8 || count < 1 || count > kMaxMix) return -1;
    const MixArgs args = make_mix_args(mix, out, count);
    const int vecs = ln_vecs(C);
    const auto x_ = static_cast<const __half*>(x);
    const auto w_ = static_cast<const __half*>(ln_w);
    const auto b_ = static_cast<const __half*>(ln_b);
    const auto shift_ = static_cast<__half*>(shift);
    if (span) {
        auto kernel = vecs == 1   ? ln_shift_mix_span_kernel<1>
                      : vecs == 2 ? ln_shift_mix_span_kernel<2>
                                  : ln_shift_mix_span_kernel<kMaxVec>;
        return emu::run_grid(static_cast<unsigned>((T + kLnSpan - 1) / kLnSpan), kLnThreads, [&] {
            kernel(T, static_cast<int>(C), num_slots, x_, w_, b_, shift_, prev, slots, lasts, args);
        });
    }
    auto kernel = vecs == 1 ? ln_shift_mix_kernel<1> : vecs == 2 ? ln_shift_mix_kernel<2> : ln_shift_mix_kernel<kMaxVec>;
    return emu::run_grid(static_cast<unsigned>(T), kLnThreads, [&] {
        kernel(static_cast<int>(C), num_slots, x_, w_, b_, shift_, prev, slots, lasts, args);
    });
}

EMU_EXPORT int emu_ln_span_for(int64_t T, int64_t B, int64_t C) { return fused::ln_span_for(T, B, C) ? 1 : 0; }

// kernel: the one to run (TimeMixKernel); the launcher picks it with time_mix_kernel_for (exported below), or
// kTimeMixPipelined: time_mix_pipelined_kernel (CUDA only) on two blocks per head, each walking several rows (the
// launcher's grid on a GPU is as many blocks as fit at once). max_len: the longest row (the split kernel's finishing
// grid covers that many tokens per row). parts: the split kernel's blocks per (row, head), 2 or 4 (the launcher
// picks it with split_parts, exported below).
constexpr int kTimeMixPipelined = 5;
EMU_EXPORT int emu_fused_time_mix(int state_dtype, int64_t B, int64_t H, int64_t num_slots, int64_t num_tokens,
                                  void* state, const int64_t* slots, const int64_t* starts, const int64_t* lasts,
                                  const void* const* tensors, const void* const* params, int first_layer,
                                  int kernel, int64_t max_len, int parts) {
    using namespace fused;
    if (B <= 0 || H <= 0 || max_len < 1 || (parts != 2 && parts != 4)) return -1;
    const TimeMixArgs p = make_time_mix_args(tensors, params, first_layer);
    const int h = static_cast<int>(H);
    const unsigned grid = static_cast<unsigned>(B * H);
    std::vector<float> scratch(static_cast<size_t>(split_scratch_floats(num_tokens, H)), __int_as_float(0x7fc00000));
    auto run = [&](auto* pool, auto decode_kernel, auto prefill_kernel, auto chunked_kernel, auto split2_kernel,
                   auto split4_kernel) {
        if (kernel == kTimeMixSplit) {
            const int rc = emu::run_grid(grid * parts, split_threads(parts), [&] {
                (parts == 2 ? split2_kernel : split4_kernel)(h, num_slots, num_tokens, pool, slots, starts, lasts, p,
                                                             scratch.data());
            });
            if (rc) return rc;
            const auto finish_grid = static_cast<unsigned>(finish_blocks(B, H, max_len));
            return emu::run_grid(finish_grid, N, [&] {
                time_mix_finish_kernel(h, B, num_slots, num_tokens, slots, starts, lasts, p, scratch.data());
            });
        }
#ifdef FUSED_TIME_MIX_PIPELINED
        if (kernel == kTimeMixPipelined) {  // (CUDA only)
            using S = std::remove_pointer_t<decltype(pool)>;
            return emu::run_grid(static_cast<unsigned>(2 * H), N, [&] {
                time_mix_pipelined_kernel<S>(h, num_slots, num_tokens, int64_t(grid), pool, slots, starts, lasts, p);
            });
        }
#else
        if (kernel == kTimeMixPipelined) return -1;
#endif
#ifdef FUSED_TIME_MIX_TC
        if (kernel == kTimeMixChunkedTc) {  // (CUDA only)
            return emu::run_grid(grid, N, [&] {
                time_mix_chunked_tc_kernel(h, num_slots, num_tokens, pool, slots, starts, lasts, p);
            });
        }
#else
        if (kernel == 4) return -1;  // kTimeMixChunkedTc: not in the HIP port's TimeMixKernel
#endif
        auto chosen = kernel == kTimeMixPrefill ? prefill_kernel : kernel == kTimeMixChunked ? chunked_kernel : decode_kernel;
        return emu::run_grid(grid, kernel == kTimeMixPrefill ? kPrefillThreads : N, [&] {
            chosen(h, num_slots, num_tokens, pool, slots, starts, lasts, p);
        });
    };
    if (state_dtype == wkv7::kFloat32)
        return run(static_cast<float*>(state), time_mix_kernel<float>, time_mix_prefill_kernel<float>,
                   time_mix_chunked_kernel<float>, time_mix_split_kernel<float, 2>, time_mix_split_kernel<float, 4>);
    if (state_dtype == wkv7::kFloat16)
        return run(static_cast<__half*>(state), time_mix_kernel<__half>, time_mix_prefill_kernel<__half>,
                   time_mix_chunked_kernel<__half>, time_mix_split_kernel<__half, 2>,
                   time_mix_split_kernel<__half, 4>);
    return -1;
}

// The launchers' environment knobs (env_int, env_flag), read here without caching.
EMU_EXPORT long long emu_env_int(const char* name, long long fallback) { return fused::env_int(name, fallback); }
EMU_EXPORT int emu_env_flag(const char* name, int fallback) { return fused::env_flag(name, fallback != 0) ? 1 : 0; }

EMU_EXPORT int emu_split_parts(unsigned grid, int multiprocessors) { return fused::split_parts(grid, multiprocessors); }

EMU_EXPORT int emu_time_mix_kernel_for(const void* const* tensors, int first_layer, unsigned grid, int prefill) {
    const void* params[8] = {};
    return fused::time_mix_kernel_for(fused::make_time_mix_args(tensors, params, first_layer), grid, prefill);
}

template <int M>
int run_gemv(const fused::GemvArgs& args, int blocks, bool wide, unsigned ordered) {
#ifdef FUSED_WIDE_BANDS
    if (wide) {
        return emu::run_grid(static_cast<unsigned>(blocks), fused::kWideBandWarps * 32,
                             [&] { fused::gemv_wide_band_kernel<M>(args); });
    }
#endif
    return emu::run_grid(static_cast<unsigned>(blocks), fused::kGemvWarps * 32, [&] { fused::gemv_kernel<M>(args); },
                         1, ordered);
}

// stage, sync: a staged launch (CUDA source only; null: none): the blocks before the first consumer's run first.
int gemv_emulated(int64_t M, int count, const void* const* w, const void* const* scale, const void* const* zero,
                  const void* const* x, void* const* y, const void* const* residual, const int64_t* n,
                  const int64_t* k, const int64_t* group, const int* weight_type, const int* epilogue, int wide,
                  const int* stage, void* sync) {
    using namespace fused;
    if (count < 1 || count > kMaxTasks || M < 1 || M > kGemvMaxRows) return -1;
    for (int i = 0; i < count; ++i)
        if (!gemv_takes(n[i], k[i], weight_type[i], group[i])) return -1;
    GemvArgs args{};
    const int blocks = pack_gemv(args, count, w, scale, zero, x, y, residual, n, k, group, weight_type, epilogue);
    unsigned ordered = 0;
#ifdef FUSED_GEMV_STAGES
    if (stage != nullptr) {
        if (!stage_gemv(args, stage, static_cast<unsigned*>(sync))) return -1;
        for (int i = count - 1; i >= 0; --i)
            if (stage[i] == 2) ordered = static_cast<unsigned>(args.task[i].first_block);
    }
#else
    if (stage != nullptr || sync != nullptr) return -1;
#endif
#ifdef FUSED_WIDE_BANDS
    // wide: gemv_wide_band_kernel, which takes bands only (the launcher's gemv_wide_bands also asks for few blocks,
    // a matter of speed: not asked here, so that small cases run it)
    if (wide && !gemv_all_bands(args)) return -1;
#endif
    switch (M) {
        case 1: return run_gemv<1>(args, blocks, wide, ordered);
        case 2: return run_gemv<2>(args, blocks, wide, ordered);
        case 3: return run_gemv<3>(args, blocks, wide, ordered);
        case 4: return run_gemv<4>(args, blocks, wide, ordered);
        case 5: return run_gemv<5>(args, blocks, wide, ordered);
        case 6: return run_gemv<6>(args, blocks, wide, ordered);
        case 7: return run_gemv<7>(args, blocks, wide, ordered);
        default: return run_gemv<8>(args, blocks, wide, ordered);
    }
}

EMU_EXPORT int emu_fused_gemv(int64_t M, int count, const void* const* w, const void* const* scale,
                              const void* const* zero, const void* const* x, void* const* y,
                              const void* const* residual, const int64_t* n, const int64_t* k, const int64_t* group,
                              const int* weight_type, const int* epilogue, int wide) {
    return gemv_emulated(M, count, w, scale, zero, x, y, residual, n, k, group, weight_type, epilogue, wide, nullptr,
                         nullptr);
}

EMU_EXPORT int emu_fused_gemv_staged(int64_t M, int count, const void* const* w, const void* const* scale,
                                     const void* const* zero, const void* const* x, void* const* y,
                                     const void* const* residual, const int64_t* n, const int64_t* k,
                                     const int64_t* group, const int* weight_type, const int* epilogue,
                                     const int* stage, void* sync) {
    return gemv_emulated(M, count, w, scale, zero, x, y, residual, n, k, group, weight_type, epilogue, 0, stage, sync);
}

#ifdef FUSED_GEMV_STREAM
template <int M>
int run_stream_gemv(const fused::GemvArgs& args, int blocks) {
    auto kernel = args.task[0].k == 2048 ? fused::gemv_stream_kernel<M, 1> : fused::gemv_stream_kernel<M, 2>;
    return emu::run_grid(static_cast<unsigned>(blocks), fused::kStreamThreads, [&] { kernel(args); });
}

// The launcher's streamed launch (gemv_stream_kernel as plan_stream_gemv plans it for `multiprocessors`); -1 where
// the launch would not stream.
EMU_EXPORT int emu_fused_gemv_stream(int64_t M, int count, const void* const* w, const void* const* x,
                                     void* const* y, const void* const* residual, const int64_t* n, const int64_t* k,
                                     const int* epilogue, int multiprocessors) {
    using namespace fused;
    if (count < 1 || count > kMaxTasks || M < 1 || M > kGemvMaxRows) return -1;
    std::vector<const void*> none(count, nullptr);
    std::vector<int64_t> group(count, 0);
    std::vector<int> half(count, kWeightHalf);
    for (int i = 0; i < count; ++i)
        if (!gemv_takes(n[i], k[i], kWeightHalf, 0)) return -1;
    GemvArgs args{};
    pack_gemv(args, count, w, none.data(), none.data(), x, y, residual, n, k, group.data(), half.data(), epilogue);
    const int blocks = plan_stream_gemv(args, multiprocessors);
    if (blocks == 0) return -1;
    switch (M) {
        case 1: return run_stream_gemv<1>(args, blocks);
        case 2: return run_stream_gemv<2>(args, blocks);
        case 3: return run_stream_gemv<3>(args, blocks);
        case 4: return run_stream_gemv<4>(args, blocks);
        case 5: return run_stream_gemv<5>(args, blocks);
        case 6: return run_stream_gemv<6>(args, blocks);
        case 7: return run_stream_gemv<7>(args, blocks);
        default: return run_stream_gemv<8>(args, blocks);
    }
}

// plan_stream_gemv's grid and channels per block for tasks of these shapes (fp16; residual: any task adds one).
EMU_EXPORT int emu_plan_stream_gemv(int count, const int64_t* n, const int64_t* k, int residual, int multiprocessors,
                                    int* block_rows) {
    using namespace fused;
    if (count < 1 || count > kMaxTasks) return -1;
    GemvArgs args{};
    static const __half some = __half{};
    for (int i = 0; i < count; ++i) {
        args.task[i].n = static_cast<int>(n[i]);
        args.task[i].k = static_cast<int>(k[i]);
        args.task[i].weight_type = kWeightHalf;
        args.task[i].residual = residual ? &some : nullptr;
    }
    args.count = count;
    const int blocks = plan_stream_gemv(args, multiprocessors);
    for (int i = 0; i < count; ++i) block_rows[i] = args.task[i].block_rows;
    return blocks;
}
#endif

// min_blocks: the planner's threshold for two ballots per warp (the launcher's: kSparseMinBlocks); seed: the
// order of the blocks.
// scale: int8 weights' (sources with FUSED_SPARSE_INT8), else null.
EMU_EXPORT int emu_fused_sparse_gemv(int64_t M, const void* x, const void* w, const void* scale, void* y,
                                     const void* residual, void* partial, void* arrivals, int64_t n, int64_t k,
                                     int64_t min_blocks, unsigned seed) {
    using namespace fused;
#ifdef FUSED_SPARSE_INT8
    const bool int8 = scale != nullptr;
    if (!sparse_gemv_takes(M, n, k, int8)) return -1;
    const SparseGemvArgs args = make_sparse_gemv_args(n, k, min_blocks, x, w, scale, y, residual, partial, arrivals);
#else
    if (scale != nullptr || !sparse_gemv_takes(M, n, k)) return -1;
    const SparseGemvArgs args = make_sparse_gemv_args(n, k, min_blocks, x, w, y, residual, partial, arrivals);
#endif
    const unsigned grid = static_cast<unsigned>(args.strips * args.slices);
    auto run = [&](auto kernel) { return emu::run_grid(grid, kSparseStrip, [&] { kernel(args); }, seed); };
#ifdef FUSED_SPARSE_INT8
    return with_sparse_gemv_kernel(M, int8, run);
#else
    switch (M) {
        case 1: return run(sparse_gemv_kernel<1>);
        case 2: return run(sparse_gemv_kernel<2>);
        case 3: return run(sparse_gemv_kernel<3>);
        default: return run(sparse_gemv_kernel<4>);
    }
#endif
}

// The sparse GEMV's plan for a K-major [k, n] weight: {ballots, slices, strips, workspace floats}.
EMU_EXPORT void emu_fused_sparse_gemv_plan(int64_t n, int64_t k, int64_t min_blocks, int64_t* out) {
    const fused::SparseGemvArgs args = fused::plan_sparse_gemv(n, k, min_blocks);
    out[0] = args.ballots;
    out[1] = args.slices;
    out[2] = args.strips;
    out[3] = int64_t(args.slices) * fused::kSparseMaxRows * n;  // fp16 weights' rows
}

// The splits that pack_gemv plans for each task (the rest of GemvTask is not read): warps per output
// channel, or for 4-bit tasks the halvings of the block's band of channels; and the channels per warp.
EMU_EXPORT void emu_fused_gemv_splits(int count, const int64_t* n, const int64_t* k, const int* weight_type,
                                      int* splits, int* rows_per_warp) {
    fused::GemvArgs args{};
    for (int i = 0; i < count; ++i) {
        args.task[i].n = static_cast<int>(n[i]);
        args.task[i].k = static_cast<int>(k[i]);
        args.task[i].weight_type = weight_type[i];
    }
    args.count = count;
    fused::plan_gemv_splits(args);
    for (int i = 0; i < count; ++i) {
        splits[i] = args.task[i].splits;
        rows_per_warp[i] = args.task[i].rows_per_warp;
    }
}

#ifdef FUSED_WIDE_BANDS
// Whether the CUDA launcher runs a launch of these tasks (weights as pack_gemv gets them) on gemv_wide_band_kernel.
EMU_EXPORT int emu_gemv_wide_bands(int count, const int64_t* n, const int64_t* k, const int64_t* group,
                                   const int* weight_type) {
    const void* none[fused::kMaxTasks] = {};
    void* out[fused::kMaxTasks] = {};
    const int epilogue[fused::kMaxTasks] = {};
    fused::GemvArgs args{};
    const int blocks = fused::pack_gemv(args, count, none, none, none, none, out, none, n, k, group, weight_type, epilogue);
    return fused::gemv_wide_bands(args, blocks) ? 1 : 0;
}
#endif

// The emulation's fp16 conversions, for the test that holds them to torch's, and its fp16 fma (__hfma2).
EMU_EXPORT void emu_f32_to_f16(const float* in, uint16_t* out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) out[i] = __half_as_ushort(__float2half_rn(in[i]));
}
EMU_EXPORT void emu_f16_to_f32(const uint16_t* in, float* out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) out[i] = __half2float(__ushort_as_half(in[i]));
}
EMU_EXPORT void emu_f16_fma(const uint16_t* a, const uint16_t* b, const uint16_t* c, uint16_t* out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        const __half r = emu::fma_half(__ushort_as_half(a[i]), __ushort_as_half(b[i]), __ushort_as_half(c[i]));
        out[i] = __half_as_ushort(r);
    }
}

// Columns n0 .. n0 + width - 1 of a 4-bit GemLite matrix's W^T into out [K, width] (uint4_dequantize_kernel).
EMU_EXPORT int emu_fused_uint4_dequantize(const void* words, const void* scale, const void* zero, int64_t N, int64_t K,
                                          int64_t group, int64_t n0, int64_t width, void* out) {
    using namespace fused;
    if (width <= 0 || K <= 0 || n0 < 0 || n0 + width > N || group <= 0 || group % 8 || K % group) return -1;
    return emu::run_grid(dequantize_blocks(K, width), kDequantThreads, [&] {
        uint4_dequantize_kernel(static_cast<const uint32_t*>(words), static_cast<const __half*>(scale),
                                static_cast<const __half*>(zero), N, K, group, n0, width, static_cast<__half*>(out));
    });
}

EMU_EXPORT int emu_fused_relu_square(int64_t n, void* x) {
    using namespace fused;
    if (n <= 0) return -1;
    return emu::run_grid(relu_square_blocks(n), kReluSquareThreads,
                         [&] { relu_square_kernel(static_cast<__half*>(x), n); });
}

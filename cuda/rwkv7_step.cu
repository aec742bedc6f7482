// One decode step of one sequence (batch 1, fp16 weights) as ONE persistent kernel: every block of a
// co-resident grid walks every phase of every layer, with a grid-wide barrier between phases, instead of the
// fused path's ~8 launches a layer chained by PDL (cuda/rwkv7_fused.cu). Opt-in (RWKV_PERSISTENT=1,
// infer/ops/persistent.py): on an H100 it runs at 0.56x the launches' speed (1.5B 409 against 731 tok/s). Timed per
// phase (bench/profile_persistent.py; docs/BENCHMARKS.md, thirty-sixth session): not bound by its barriers (~1 us
// each) or by the bytes in flight, but by a fixed ~6-8 us of every phase (staging, first round trip, slowest warp's
// tail) that no other work overlaps while every block waits at every barrier: 97 us a 1.5B layer against ~57.
//
// Why: at batch 1 a 1.5B layer reads ~20 us of weights at 4.3 TB/s but takes ~48 us as launches, each
// launch waiting for the whole of the one before (thirtieth session). A grid barrier costs ~1 us, and each
// warp loads its first weights of the next phase (or a time-mix thread its state) before it waits, so the
// memory stays busy across the barrier.
//
// The phases of a step (x: the residual stream, fp16, in a workspace; every intermediate rounded to fp16
// where the fused path stores fp16, so both paths compute the same math in the same precision):
//   embed      x = emb[token] (block 0)
//   per layer:
//   rkv        every block: LN1(x) and the six token-shift mixes into shared memory (the norm's constants copied
//              in while the block waits at the barrier before); r, k, v = W x_m and the
//              LoRA first halves tanh(W1 x_w), W1 x_a, sigmoid(W1 x_g), W1 x_v (not in layer 0)
//   lora       dw, da, g, dv = W2 h (the second halves); block 0 saves LN1(x) as the layer's att shift state
//   tmix       per head (a block each): decay, gates, kk, the WKV update of the 64x64 state, y = S r, group
//              norm, bonus, output gate -> y_att
//   out        x += Wo y_att
//   ffnk       every block: LN2(x) and its mix; hidden = relu(Fk x_k)^2
//   ffnv       K-major FFN value: partial sums of the rows of hidden's nonzero entries (a warp: a 256-column
//              tile over a chunk of rows); block 0 saves LN2(x) as the ffn shift state.
//              Row-major FFN value: x += Fv hidden, one GEMV phase (and no reduce).
//   reduce     x += the partial sums, each column's in chunk order (a fixed order: the same bits whatever the
//              grid)
//   head       every block: LN_out(x); logits = Head x (fp32 out, rounded to fp16 first, as the fused path)
// A GEMV unit (one row, or a group of short rows) is one warp's; a unit's sums do not depend on the warp or
// block that computes it, so the result is the same bits on any grid. Merged phases (Dims::merge, the default): the
// lora phase's units join the rkv phase and the sparse ffnv units the ffnk phase, waiting on counters of the rows
// they read instead of a grid barrier (see build_program); the shift states are then saved a phase later (tmix,
// reduce).
//
// The part above the C launchers (including the host-side program builder) is also compiled for the CPU by
// test/kernel_emu (test_step_emulated.py runs the kernel on co-resident grids of a few blocks against the
// readable forward).

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "device_common.cuh"

#include <cmath>
#include <cstdint>
#include <cstring>

namespace step {

constexpr int N = 64;  // head size
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kLoads = 4;  // 16-byte weight loads a lane holds (and prefetches before a barrier)
constexpr int kMaxTasks = 11;  // r/k/v, four LoRA first halves and, merged, four second halves
constexpr int kMaxMix = 6;
constexpr int kReduceLanes = 16;  // lanes summing one column's partial sums
constexpr int kTile = 256;        // columns of a sparse FFN-value unit (8 a lane)
constexpr float kLnEps = 1e-5f;
constexpr float kExpMinusHalf = 0.606531f;
constexpr float kGroupNormEps = 64e-5f;  // head_size * 1e-5

enum Kind : int { kEmbed = 0, kGemv = 1, kTimeMix = 2, kSparse = 3, kReduce = 4 };
enum Act : int { kNone = 0, kTanh = 1, kSigmoid = 2, kRelu2 = 3 };

// One matrix of a GEMV phase: y[row] (+)= act(W[row, :k] . xs[x_off : x_off + k]) for row < rows (W row-major,
// row stride ld; xs the phase's fp16 input in shared memory, or xg in global memory); `lanes` lanes share a row (a
// power of two), so a unit is 32 / lanes rows. y32 (the head): fp32 outputs instead of y. unit0: the phase's index
// of its first unit. Dependencies inside a phase (merged phases): a unit first waits until *dep >= dep_target, and
// when its outputs are stored adds its row count to done[row / done_div].
struct Task {
    const __half* w;
    __half* y;
    float* y32;
    const __half* xg;
    const unsigned* dep;
    unsigned* done;
    int rows, k, ld, x_off, act, accumulate, lanes, unit0;
    unsigned dep_target;
    int done_div;
};

// A GEMV phase's input: a layer norm folded into every block (of x, with the token shift against `shift` and
// nmix mixes: xs[m * C + i] = xn_i + (shift_i - xn_i) mix_m[i]; nmix 0: xs = xn), or fp16 values copied in.
struct Stage {
    const __half *ln_w, *ln_b;
    const __half* shift;  // the layer's shift state of slot 0 (+ slot * C); null: no shift (the head)
    const __half* mix[kMaxMix];
    int nmix;
    const __half* src;  // no norm: `halves` values (a multiple of 8) copied from src
    int halves;
};

struct Phase {
    int kind, ntasks, units;
    Task t[kMaxTasks];
    Stage stage;
    __half* save_shift;  // block 0 first writes the previous phase's LN(x) here (slot 0; + slot * C)
    // time mix (per channel [C] unless said)
    const __half *r, *k, *v, *dw, *da, *dv, *g;
    __half *v_first, *out;
    const float *w0, *r_k, *lnx_w, *lnx_b;
    const __half *a0, *v0, *k_k, *k_a;
    void* state;  // the layer's WKV states of slot 0 (+ slot * H * N * N), fp32 or fp16
    int first_layer, heads;
    // sparse FFN value (fv [F, C] K-major, hidden [F]) and its reduce into x; merged into the FFN key's phase, its
    // units follow the GEMV units (gemv_units of them: all of a GEMV phase's units unless merged), each first waiting
    // until chunk_done[chunk] counts its rows
    const __half *fv, *hidden;
    float* partial;  // [C][chunks]
    __half* x;
    const unsigned* chunk_done;
    int F, chunks, chunk_rows, tiles, gemv_units;
    int C;
};

struct StepArgs {
    const Phase* phases;
    int nphases;
    const int64_t* token;  // device scalars: graph replays read the current ones
    const int64_t* slot;
    int64_t num_slots, vocab;
    const __half* emb;
    __half* x;
    float* logits;
    unsigned* sync;  // [2]: grid-barrier arrivals, blocks done (both zero between launches)
    unsigned* deps;  // [ndeps]: the merged phases' counters (zero between launches)
    int ndeps;
    int prefetch;    // load the next phase's first weights (or state) before waiting at the barrier
    // Null, or where each block writes when it starts and ends each phase (ns): timeline[(p * 2 + 0 / 1) * stride +
    // block] (bench/profile_persistent.py: where a step's time goes)
    unsigned long long* timeline;
    int timeline_stride;
};

// ---------------------------------------------------------------------------------------------- helpers
__device__ __forceinline__ uint4 load_weights(const __half* p) {
#if defined(__CUDA_ARCH__)
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
#else
    return *reinterpret_cast<const uint4*>(p);
#endif
}

// Values written by other blocks of this launch: read at L2, never a stale L1 line.
__device__ __forceinline__ float load_act(const __half* p) { return __half2float(__ldcg(p)); }
__device__ __forceinline__ uint4 load_act8(const __half* p) { return __ldcg(reinterpret_cast<const uint4*>(p)); }

__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
#if defined(__CUDA_ARCH__)
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
#else
    return *static_cast<const volatile unsigned*>(p);
#endif
}

// Polls *counter until it reaches target; a wait of ~seconds traps instead of hanging the device.
__device__ __forceinline__ void spin_until(const unsigned* counter, unsigned target) {
    for (unsigned spins = 0; load_acquire(counter) < target; ++spins) {
#if defined(EMU_WARP)
        emu::yield();  // the emulation's blocks are fibers of one thread
#elif defined(__CUDA_ARCH__)
        if (spins > (1u << 24)) __trap();
#endif
    }
}

// A clock for the timeline: the GPU's global nanosecond timer; the emulation's blocks get a logical clock (they are
// fibers of one thread, so its ticks order events across blocks as the barriers do).
__device__ __forceinline__ unsigned long long clock_ns() {
#if defined(EMU_WARP)
    static unsigned long long ticks = 0;
    return ++ticks;
#elif defined(__CUDA_ARCH__)
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
#else
    return 0;
#endif
}

// A grid barrier in two halves, so that a block can do work of its own between them: every block of the
// (co-resident) grid arrives once per barrier, and the n-th barrier of a launch completes when the arrivals reach
// n * gridDim.x.
__device__ __forceinline__ void grid_arrive(unsigned* arrivals) {
    __syncthreads();  // the block's results are stored
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(arrivals, 1u);
    }
}

__device__ __forceinline__ void grid_wait(const unsigned* arrivals, unsigned target) {
    if (threadIdx.x == 0) {
        spin_until(arrivals, target);
        __threadfence();
    }
    __syncthreads();
}

__device__ __forceinline__ float activate(float v, int act) {
    switch (act) {
        case kTanh: return tanhf(v);
        case kSigmoid: return sigmoidf(v);
        case kRelu2: {
            const float r = fmaxf(v, 0.0f);
            return r * r;
        }
        default: return v;
    }
}

// The block's sum of v, in a fixed order (scratch: kWarps floats, free again when this returns).
__device__ __forceinline__ float block_total(float v, float* scratch) {
    const float s = block_sum<kWarps>(v, scratch);
    __syncthreads();
    return s;
}

// Shared memory of a block: the LN(x) kept for the next phase's shift-state save (C halves), a folded norm's weight
// and bias (2C halves), the staged input (staged_halves), then fp32 scratch (kScratch floats: reductions, and the
// time mix's per-head vectors).
constexpr int kScratch = 5 * N + 4 * kWarps;

struct Shared {
    __half* saved;
    __half* norm;
    __half* xs;
    float* scratch;
};

// A warp waits until *counter >= target (a counter other warps of the grid raise with their results stored), then
// reads what they wrote at L2 (load_act).
__device__ __forceinline__ void warp_wait(const unsigned* counter, unsigned target) {
    if ((threadIdx.x & 31) == 0) spin_until(counter, target);
    __syncwarp();
}

// A warp's results are stored: `count` more rows done (lane 0 raises the counter after the warp's stores).
__device__ __forceinline__ void warp_signal(unsigned* counter, unsigned count) {
    __syncwarp();
    if ((threadIdx.x & 31) == 0) {
        __threadfence();
        atomicAdd(counter, count);
    }
}

// ---------------------------------------------------------------------------------------------- staging
// LN(x) of the block (rounded to fp16, as the stored shift state is) into sh.saved, then the mixes into sh.xs. A
// thread holds 8-vectors v = threadIdx.x + j * kThreads of x in registers (one trip to L2, for x and the shift state;
// the norm's constants were preloaded, preload_norm): the fold is on the critical path of two phases a layer.
constexpr int kNormVecs = 2;  // C <= kNormVecs * kThreads * 8 = 4096 (dims_unsupported)

// A folded norm's constants (its weight and bias into sh.norm, each mix into its place in sh.xs, where stage_norm
// turns it into the mixed input), loaded while the block waits at the grid barrier before the phase: they are off
// the phase's critical path then, which keeps one trip to L2 (for x and the shift state).
__device__ void preload_norm(const Stage& st, int C, const Shared& sh) {
    const uint4 *w = reinterpret_cast<const uint4*>(st.ln_w), *b = reinterpret_cast<const uint4*>(st.ln_b);
    for (int v = threadIdx.x; v < C / 8; v += kThreads) {
        reinterpret_cast<uint4*>(sh.norm)[v] = __ldg(w + v);
        reinterpret_cast<uint4*>(sh.norm + C)[v] = __ldg(b + v);
        for (int m = 0; m < st.nmix; ++m)
            reinterpret_cast<uint4*>(sh.xs + m * C)[v] = __ldg(reinterpret_cast<const uint4*>(st.mix[m]) + v);
    }
}

__device__ void stage_norm(const Stage& st, const __half* x, int C, int64_t slot, const Shared& sh) {
    const int vecs = C / 8;
    const __half* shift = st.shift ? st.shift + slot * C : nullptr;
    float xv[kNormVecs][8];
    uint4 prev[kNormVecs];
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < kNormVecs; ++j) {
        const int v = threadIdx.x + j * kThreads;
        if (v < vecs) {
            unpack8(load_act8(x + v * 8), xv[j]);
            if (shift) prev[j] = load_act8(shift + v * 8);
#pragma unroll
            for (int e = 0; e < 8; ++e) s += xv[j][e];
        }
    }
    const float mean = block_total(s, sh.scratch) / C;
    float q = 0.0f;
#pragma unroll
    for (int j = 0; j < kNormVecs; ++j) {
        if (threadIdx.x + j * kThreads < vecs) {
#pragma unroll
            for (int e = 0; e < 8; ++e) q = fmaf(xv[j][e] - mean, xv[j][e] - mean, q);
        }
    }
    const float rstd = rsqrtf(block_total(q, sh.scratch) / C + kLnEps);
#pragma unroll
    for (int j = 0; j < kNormVecs; ++j) {
        const int v = threadIdx.x + j * kThreads;
        if (v >= vecs) continue;
        float w[8], b[8], xn[8];
        unpack8(reinterpret_cast<const uint4*>(sh.norm)[v], w);
        unpack8(reinterpret_cast<const uint4*>(sh.norm + C)[v], b);
#pragma unroll
        for (int e = 0; e < 8; ++e) xn[e] = round_half((xv[j][e] - mean) * rstd * w[e] + b[e]);
        const uint4 packed = pack8(xn);
        *reinterpret_cast<uint4*>(sh.saved + v * 8) = packed;
        if (st.nmix == 0) {
            *reinterpret_cast<uint4*>(sh.xs + v * 8) = packed;
            continue;
        }
        float d[8];
        unpack8(prev[j], d);
#pragma unroll
        for (int e = 0; e < 8; ++e) d[e] -= xn[e];
        for (int m = 0; m < st.nmix; ++m) {  // in place: the preloaded mix becomes the mixed input
            float mix[8], out[8];
            uint4* at = reinterpret_cast<uint4*>(sh.xs + m * C) + v;
            unpack8(*at, mix);
#pragma unroll
            for (int e = 0; e < 8; ++e) out[e] = fmaf(d[e], mix[e], xn[e]);
            *at = pack8(out);
        }
    }
}

__device__ void stage_input(const Phase& ph, const __half* x, int64_t slot, const Shared& sh) {
    if (ph.stage.ln_w) {
        stage_norm(ph.stage, x, ph.C, slot, sh);
    } else {
        for (int i = threadIdx.x * 8; i < ph.stage.halves; i += kThreads * 8)
            *reinterpret_cast<uint4*>(sh.xs + i) = load_act8(ph.stage.src + i);
    }
    __syncthreads();
}

// ---------------------------------------------------------------------------------------------- GEMV
__device__ void sparse_unit(const Phase& ph, int u);  // the FFN value's units (below), merged into a GEMV phase

struct Unit {
    int task, local;
};

__device__ __forceinline__ Unit find_unit(const Phase& ph, int u) {
    int t = 0;
    while (t + 1 < ph.ntasks && u >= ph.t[t + 1].unit0) ++t;
    return {t, u - ph.t[t].unit0};
}

// This lane's row of a unit and its place among the row's lanes.
__device__ __forceinline__ void unit_lane(const Task& tk, int local, int& row, int& sub) {
    const int lane = threadIdx.x & 31;
    row = local * (32 / tk.lanes) + lane / tk.lanes;
    sub = lane % tk.lanes;
}

// Batch b of the lane's 16-byte pieces of its row: piece c = sub + (b * kLoads + e) * lanes (zero past the row).
__device__ __forceinline__ void load_batch(const Task& tk, int row, int sub, int b, uint4 (&buf)[kLoads]) {
    const int chunks = tk.k >> 3;
    const __half* w = tk.w + static_cast<size_t>(row) * tk.ld;
#pragma unroll
    for (int e = 0; e < kLoads; ++e) {
        const int c = sub + (b * kLoads + e) * tk.lanes;
        buf[e] = row < tk.rows && c < chunks ? load_weights(w + static_cast<size_t>(c) * 8) : make_uint4(0, 0, 0, 0);
    }
}

__device__ __forceinline__ void load_first_batch(const Task& tk, int local, uint4 (&buf)[kLoads]) {
    int row, sub;
    unit_lane(tk, local, row, sub);
    load_batch(tk, row, sub, 0, buf);
}

// One unit; `cur` holds its first batch already when `loaded`. With the warp's next unit given (`has_after`), its
// first batch is loaded into `cur` during this unit's last batch, so a warp's loads never stop between units.
__device__ __forceinline__ void gemv_unit(const Task& tk, int local, const __half* xs, uint4 (&cur)[kLoads],
                                          bool loaded, bool has_after, const Task& after, int after_local) {
    int row, sub;
    unit_lane(tk, local, row, sub);
    const int chunks = tk.k >> 3;
    const int batches = ((chunks + tk.lanes - 1) / tk.lanes + kLoads - 1) / kLoads;  // the same for every lane
    if (!loaded) load_batch(tk, row, sub, 0, cur);
    float acc = 0.0f;
    for (int b = 0; b < batches; ++b) {
        uint4 next[kLoads];
        const bool more = b + 1 < batches || has_after;
        if (b + 1 < batches) {
            load_batch(tk, row, sub, b + 1, next);
        } else if (has_after) {
            load_first_batch(after, after_local, next);
        }
#pragma unroll
        for (int e = 0; e < kLoads; ++e) {
            const int c = sub + (b * kLoads + e) * tk.lanes;
            if (c < chunks) {
                float w[8], xv[8];
                unpack8(cur[e], w);
                unpack8(tk.xg ? load_act8(tk.xg + c * 8) : *reinterpret_cast<const uint4*>(xs + tk.x_off + c * 8), xv);
#pragma unroll
                for (int j = 0; j < 8; ++j) acc = fmaf(w[j], xv[j], acc);
            }
        }
        if (more) {
#pragma unroll
            for (int e = 0; e < kLoads; ++e) cur[e] = next[e];
        }
    }
    for (int o = tk.lanes >> 1; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (sub == 0 && row < tk.rows) {
        const float v = activate(acc, tk.act);
        if (tk.y32) {
            tk.y32[row] = round_half(v);
        } else {
            tk.y[row] = __float2half_rn(tk.accumulate ? load_act(tk.y + row) + v : v);
        }
    }
    if (tk.done) {
        const int first = local * (32 / tk.lanes);
        warp_signal(tk.done + first / tk.done_div, static_cast<unsigned>(min(32 / tk.lanes, tk.rows - first)));
    }
}

__device__ void gemv_phase(const Phase& ph, const __half* x, int64_t slot, const Shared& sh, uint4 (&pre)[kLoads],
                           bool loaded) {
    const int units = ph.units;
    if (static_cast<int>(blockIdx.x) * kWarps >= units) return;  // no unit for this block: nothing to stage
    stage_input(ph, x, slot, sh);
    const int stride = gridDim.x * kWarps;
    int u = blockIdx.x * kWarps + (threadIdx.x >> 5);
    if (u >= units) return;
    // the GEMV units, then (a merged phase) the sparse FFN value's units
    Unit un = find_unit(ph, u);
    for (; u < ph.gemv_units; u += stride) {
        const bool last = u + stride >= ph.gemv_units;
        const Unit next_un = last ? un : find_unit(ph, u + stride);
        const Task& tk = ph.t[un.task];
        if (tk.dep) warp_wait(tk.dep, tk.dep_target);
        gemv_unit(tk, un.local, sh.xs, pre, loaded, !last, ph.t[next_un.task], next_un.local);
        loaded = !last;
        un = next_un;
    }
    for (; u < units; u += stride) sparse_unit(ph, u - ph.gemv_units);
}

// ---------------------------------------------------------------------------------------------- time mix
// Block b takes heads b, b + gridDim.x, ...; thread t owns state row t / 4 (a value channel) and its 16 columns
// 16 (t % 4) + j (key channels).
template <typename S>
__device__ __forceinline__ const S* state_of(const Phase& ph, int64_t slot, int head) {
    const S* base = static_cast<const S*>(ph.state) + slot * static_cast<int64_t>(ph.heads) * N * N;
    return base + (static_cast<int64_t>(head) * N + (threadIdx.x >> 2)) * N + (threadIdx.x & 3) * 16;
}

// The thread's 16 state values as raw 16-byte pieces (fp32: four; fp16: two).
template <typename S>
__device__ __forceinline__ void load_state(const Phase& ph, int64_t slot, int head, uint4 (&buf)[kLoads]) {
    const S* s = state_of<S>(ph, slot, head);
    constexpr int pieces = 16 * static_cast<int>(sizeof(S)) / 16;
#pragma unroll
    for (int e = 0; e < pieces; ++e) buf[e] = __ldcg(reinterpret_cast<const uint4*>(s) + e);
}

__device__ __forceinline__ void unpack_state(const uint4 (&buf)[kLoads], float (&s)[16], float) { memcpy(s, buf, 64); }
__device__ __forceinline__ void unpack_state(const uint4 (&buf)[kLoads], float (&s)[16], __half) {
    unpack8(buf[0], *reinterpret_cast<float(*)[8]>(s));
    unpack8(buf[1], *reinterpret_cast<float(*)[8]>(s + 8));
}

__device__ __forceinline__ void store_state(float* dst, const float (&s)[16]) {
#pragma unroll
    for (int e = 0; e < 4; ++e)
        reinterpret_cast<float4*>(dst)[e] = make_float4(s[4 * e], s[4 * e + 1], s[4 * e + 2], s[4 * e + 3]);
}
__device__ __forceinline__ void store_state(__half* dst, const float (&s)[16]) {
    reinterpret_cast<uint4*>(dst)[0] = pack8(*reinterpret_cast<const float(*)[8]>(s));
    reinterpret_cast<uint4*>(dst)[1] = pack8(*reinterpret_cast<const float(*)[8]>(s + 8));
}

// Sums of the values of the threads t % 4 == 0 (one per state row), over the block (fixed order).
__device__ __forceinline__ float rows_sum(float v, float* part) {
    return block_total((threadIdx.x & 3) ? 0.0f : v, part);
}

template <typename S>
__device__ void time_mix_head(const Phase& ph, int64_t slot, int head, float* sh, uint4 (&pre)[kLoads], bool loaded) {
    const int t = threadIdx.x, row = t >> 2, col0 = (t & 3) * 16;
    float *rr = sh, *ww = sh + N, *kn = sh + 2 * N, *aa = sh + 3 * N, *bb = sh + 4 * N, *part = sh + 5 * N;
    // Every load of the head first, in one trip (a barrier keeps the compiler from moving loads across it): thread
    // t < 64 channel t's key-axis inputs, every thread its row's value inputs (and its state, unless prefetched).
    const int c = head * N + row;
    const int ck = head * N + (t & (N - 1));
    const float r_in = load_act(ph.r + ck), k_in = load_act(ph.k + ck), da = load_act(ph.da + ck);
    const float dw = load_act(ph.dw + ck);
    float v = load_act(ph.v + c);
    const float v_first = ph.first_layer ? 0.0f : load_act(ph.v_first + c);
    const float dv = ph.first_layer ? 0.0f : load_act(ph.dv + c);
    const float g = load_act(ph.g + c);
    if (!loaded) load_state<S>(ph, slot, head, pre);
    // 1. the head's key-axis vectors (thread t < 64: channel t), kk's norm and the bonus sum
    float kkr = 0.0f, a = 0.0f, bonus_part = 0.0f;
    if (t < N) {
        a = sigmoidf(__half2float(ph.a0[ck]) + da);
        kkr = k_in * __half2float(ph.k_k[ck]);
        const float knv = k_in * (1.0f + (a - 1.0f) * __half2float(ph.k_a[ck]));
        rr[t] = r_in;
        ww[t] = __expf(-kExpMinusHalf * sigmoidf(ph.w0[ck] + dw));
        kn[t] = knv;
        bonus_part = r_in * knv * ph.r_k[ck];
    }
    const float norm = sqrtf(block_total(kkr * kkr, part));
    const float bonus = block_total(bonus_part, part);
    if (t < N) {
        const float kk = kkr / fmaxf(norm, 1e-12f);
        aa[t] = -kk;
        bb[t] = kk * a;
    }
    __syncthreads();
    // 2. this row's value, the state update and y = S r (a row's four threads sum by shuffles)
    if (ph.first_layer) {
        if ((t & 3) == 0) ph.v_first[c] = __float2half_rn(v);
    } else {
        v = v + (v_first - v) * sigmoidf(__half2float(ph.v0[c]) + dv);
    }
    float s[16];
    unpack_state(pre, s, S{});
    float sa = 0.0f;
#pragma unroll
    for (int j = 0; j < 16; ++j) sa = fmaf(s[j], aa[col0 + j], sa);
    sa += __shfl_xor_sync(0xffffffffu, sa, 1);
    sa += __shfl_xor_sync(0xffffffffu, sa, 2);
    float y = 0.0f;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        s[j] = fmaf(s[j], ww[col0 + j], fmaf(sa, bb[col0 + j], v * kn[col0 + j]));
        y = fmaf(s[j], rr[col0 + j], y);
    }
    store_state(const_cast<S*>(state_of<S>(ph, slot, head)), s);
    y += __shfl_xor_sync(0xffffffffu, y, 1);
    y += __shfl_xor_sync(0xffffffffu, y, 2);
    // 3. group norm over the head's 64 rows, the bonus, the gate
    const float mean = rows_sum(y, part) * (1.0f / N);
    const float var = rows_sum((y - mean) * (y - mean), part) * (1.0f / N);
    if ((t & 3) == 0) {
        const float yn = (y - mean) * rsqrtf(var + kGroupNormEps) * ph.lnx_w[c] + ph.lnx_b[c];
        ph.out[c] = __float2half_rn(round_half(yn + bonus * v) * g);
    }
}

template <typename S>
__device__ void time_mix_phase(const Phase& ph, int64_t slot, const Shared& sh, uint4 (&pre)[kLoads], bool loaded) {
    for (int head = blockIdx.x; head < ph.heads; head += gridDim.x) {
        time_mix_head<S>(ph, slot, head, sh.scratch, pre, loaded && head == static_cast<int>(blockIdx.x));
        __syncthreads();  // the next head reuses the shared vectors
    }
}

// ---------------------------------------------------------------------------------------------- FFN value
// Unit u: columns [kTile * (u % tiles), + kTile) (8 a lane) over rows [chunk_rows * (u / tiles), + chunk_rows) of
// the K-major matrix, reading only the rows whose hidden value is nonzero; the unit's sums go to
// partial[column][chunk]. The hidden values of 64 rows come in two loads a lane (handed round by shuffles), a ballot
// lists the nonzero ones, and the weight rows of kSparseBatch of those are in flight together: a walk of 64 rows is
// ceil(nonzero / kSparseBatch) trips to memory (16 before the ballot, whatever the zeros).
constexpr int kSparseBatch = 4;  // 8 spill (the kernel's registers are capped at 128 for 2 blocks a multiprocessor)

__device__ void sparse_unit(const Phase& ph, int u) {
    const int lane = threadIdx.x & 31;
    const int chunk = u / ph.tiles, col = (u % ph.tiles) * kTile + lane * 8;
    const int j1 = min((chunk + 1) * ph.chunk_rows, ph.F);
    if (ph.chunk_done) warp_wait(ph.chunk_done + chunk, static_cast<unsigned>(j1 - chunk * ph.chunk_rows));
    const bool mine = col < ph.C;  // lanes past the width still take part in the shuffles
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (int j0 = chunk * ph.chunk_rows; j0 < j1; j0 += 64) {
        // rows j0 + lane and j0 + 32 + lane (zero past j1), and the warp's mask of the nonzero ones: the warp walks
        // only those, kSparseBatch at a time in row order (the sums of the dense walk: zero rows add nothing)
        const float lo = j0 + lane < j1 ? load_act(ph.hidden + j0 + lane) : 0.0f;
        const float hi = j0 + 32 + lane < j1 ? load_act(ph.hidden + j0 + 32 + lane) : 0.0f;
        uint64_t rows = static_cast<uint64_t>(__ballot_sync(0xffffffffu, hi != 0.0f)) << 32 |
                        __ballot_sync(0xffffffffu, lo != 0.0f);
        while (rows) {
            float h[kSparseBatch];
            uint4 w[kSparseBatch];
#pragma unroll
            for (int e = 0; e < kSparseBatch; ++e) {
                const int r = rows ? __ffsll(static_cast<long long>(rows)) - 1 : -1;  // the same in every lane
                rows &= rows - 1;
                h[e] = r < 0 ? 0.0f : __shfl_sync(0xffffffffu, r < 32 ? lo : hi, r & 31);
                if (r >= 0 && mine) w[e] = load_weights(ph.fv + static_cast<size_t>(j0 + r) * ph.C + col);
            }
#pragma unroll
            for (int e = 0; e < kSparseBatch; ++e) {
                if (h[e] == 0.0f || !mine) continue;
                float wf[8];
                unpack8(w[e], wf);
#pragma unroll
                for (int q = 0; q < 8; ++q) acc[q] = fmaf(h[e], wf[q], acc[q]);
            }
        }
    }
    if (mine) {
#pragma unroll
        for (int q = 0; q < 8; ++q) ph.partial[static_cast<size_t>(col + q) * ph.chunks + chunk] = acc[q];
    }
}

__device__ void sparse_phase(const Phase& ph) {
    const int units = ph.tiles * ph.chunks;
    for (int u = blockIdx.x * kWarps + (threadIdx.x >> 5); u < units; u += gridDim.x * kWarps) sparse_unit(ph, u);
}

// x[c] += the sum of column c's partial sums: kReduceLanes lanes a column, each summing chunks lane, lane + lanes,
// ... in order, then a fixed butterfly.
__device__ void reduce_phase(const Phase& ph) {
    constexpr int per_warp = 32 / kReduceLanes;
    const int lane = threadIdx.x & 31, sub = lane % kReduceLanes;
    const int groups = (ph.C + per_warp - 1) / per_warp;
    for (int u = blockIdx.x * kWarps + (threadIdx.x >> 5); u < groups; u += gridDim.x * kWarps) {
        const int c = u * per_warp + lane / kReduceLanes;
        float s = 0.0f;
        if (c < ph.C) {
            const float* p = ph.partial + static_cast<size_t>(c) * ph.chunks;
#pragma unroll 8
            for (int q = sub; q < ph.chunks; q += kReduceLanes) s += __ldcg(p + q);
        }
#pragma unroll
        for (int o = kReduceLanes / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (sub == 0 && c < ph.C) ph.x[c] = __float2half_rn(load_act(ph.x + c) + s);
    }
}

// ---------------------------------------------------------------------------------------------- the kernel
// The next phase's first weights (GEMV) or this block's first head's state (time mix), loaded before the barrier
// that starts it: constant weights, and a state only that phase touches. Returns whether `pre` holds them.
template <typename S>
__device__ bool prefetch(const Phase& ph, int64_t slot, uint4 (&pre)[kLoads]) {
    if (ph.kind == kGemv) {
        const int first = blockIdx.x * kWarps + (threadIdx.x >> 5);
        if (first >= ph.gemv_units) return false;
        const Unit un = find_unit(ph, first);
        load_first_batch(ph.t[un.task], un.local, pre);
        return true;
    }
    if (ph.kind == kTimeMix && static_cast<int>(blockIdx.x) < ph.heads) {
        load_state<S>(ph, slot, blockIdx.x, pre);
        return true;
    }
    return false;
}

template <typename S>
__device__ void run_phase(const Phase& ph, const StepArgs& a, int64_t token, int64_t slot, const Shared& sh,
                          uint4 (&pre)[kLoads], bool loaded) {
    if (ph.save_shift && blockIdx.x == 0) {
        __half* dst = ph.save_shift + slot * ph.C;
        for (int i = threadIdx.x; i < ph.C; i += kThreads) dst[i] = sh.saved[i];
    }
    switch (ph.kind) {
        case kEmbed:
            if (blockIdx.x == 0) {
                for (int i = threadIdx.x; i < ph.C; i += kThreads)
                    a.x[i] = token >= 0 && token < a.vocab ? a.emb[token * ph.C + i]
                                                           : __float2half_rn(__int_as_float(0x7fc00000));
            }
            break;
        case kTimeMix: time_mix_phase<S>(ph, slot, sh, pre, loaded); break;
        case kSparse: sparse_phase(ph); break;
        case kReduce: reduce_phase(ph); break;
        default: gemv_phase(ph, a.x, slot, sh, pre, loaded); break;
    }
}

template <typename S>
__global__ void __launch_bounds__(kThreads, 2) step_kernel(StepArgs a, int staged_halves) {
#if defined(EMU_WARP)
    unsigned char* smem = emu::block_shared;
#else
    extern __shared__ __align__(16) unsigned char smem[];
#endif
    const int C = a.phases[0].C;
    __half* halves = reinterpret_cast<__half*>(smem);
    const Shared sh{halves, halves + C, halves + 3 * C, reinterpret_cast<float*>(halves + 3 * C + staged_halves)};
    const int64_t token = *a.token, slot = *a.slot;
    if (slot < 0 || slot >= a.num_slots) {  // the same for every block: none reaches a barrier
        if (blockIdx.x == 0) {
            for (int64_t i = threadIdx.x; i < a.vocab; i += kThreads) a.logits[i] = __int_as_float(0x7fc00000);
        }
        return;
    }
    // the timeline's mark: the block's start (0) or end (1) of phase p, the end once all its threads are done (before
    // it arrives at the barrier, so that every end precedes every start of the next phase)
    const auto mark = [&](int p, int which) {
        if (!a.timeline) return;
        if (which) __syncthreads();
        if (threadIdx.x == 0)
            a.timeline[static_cast<int64_t>(p * 2 + which) * a.timeline_stride + blockIdx.x] = clock_ns();
    };
    uint4 pre[kLoads];
    for (int p = 0; p < a.nphases; ++p) {
        const Phase& ph = a.phases[p];
        const bool loaded = a.prefetch && prefetch<S>(ph, slot, pre);
        if (p > 0) {
            mark(p - 1, 1);
            grid_arrive(a.sync);
            if (ph.stage.ln_w) preload_norm(ph.stage, C, sh);  // the phase folds a norm (every fold follows a barrier)
            grid_wait(a.sync, static_cast<unsigned>(p) * gridDim.x);
        }
        mark(p, 0);
        run_phase<S>(ph, a, token, slot, sh, pre, loaded);
    }
    mark(a.nphases - 1, 1);
    // The last block out zeroes the counters for the next launch: every block is past its last barrier and wait.
    unsigned* last_out = reinterpret_cast<unsigned*>(sh.scratch);
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        *last_out = atomicAdd(a.sync + 1, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (*last_out) {
        for (int i = threadIdx.x; i < a.ndeps; i += kThreads) a.deps[i] = 0;
        if (threadIdx.x == 0) {
            a.sync[0] = 0;
            a.sync[1] = 0;
        }
    }
}

// ---------------------------------------------------------------------------------------------- the program
// What the host passes for a model: dims, the model-wide pointers and per layer kLayerEntries int64 entries
// (pointers, and each matrix's row stride after its pointer), in these orders (infer/ops/persistent.py builds
// them from the same lists).
struct Dims {
    int L, C, F, V, rw, ra, rv, rg, ffn_k_major, state_half;
    int64_t num_slots;
    int merge;  // merged phases (see build_program)
};
enum ModelEntry : int { kEmb, kLnOutW, kLnOutB, kHead, kHeadLd, kAttShift, kFfnShift, kWkv, kX, kLoraH, kR, kK, kV,
                        kDw, kDa, kDv, kG, kVFirst, kY, kHidden, kPartial, kDeps, kLogits, kModelEntries };
enum LayerEntry : int {
    kLn1W, kLn1B, kLn2W, kLn2B, kMixR, kMixW, kMixK, kMixV, kMixA, kMixG, kFfnMix, kA0, kV0, kKK, kKA, kW0, kRK, kLnxW,
    kLnxB, kWr, kWrLd, kWk, kWkLd, kWv, kWvLd, kWo, kWoLd, kW1, kW1Ld, kA1, kA1Ld, kV1, kV1Ld, kG1, kG1Ld, kW2, kW2Ld,
    kA2, kA2Ld, kV2, kV2Ld, kG2, kG2Ld, kFk, kFkLd, kFv, kFvLd, kLayerEntries
};

inline int lanes_for(int k) {
    int lanes = 1;
    while (lanes < 32 && lanes * 8 < k) lanes *= 2;
    return lanes;
}

// The chunking of the sparse FFN value: a function of the shape only (the sums' order must not depend on the grid).
// 32 rows (64 above 2,048 columns): 2,048 (1.5B) or 4,096 (7.2B) units, about one or two a warp of an H100/H200 at 2
// blocks a multiprocessor, each walking ~16 or ~32 nonzero rows of a random model.
inline int sparse_tiles(const Dims& d) { return (d.C + kTile - 1) / kTile; }
inline int sparse_chunk_rows(const Dims& d) { return sparse_tiles(d) > 8 ? 64 : 32; }
inline int sparse_chunks(const Dims& d) { return (d.F + sparse_chunk_rows(d) - 1) / sparse_chunk_rows(d); }

inline int max_phases(const Dims& d) { return 1 + 7 * d.L + 1; }
inline int staged_halves(const Dims& d) {
    int h = kMaxMix * d.C;
    if (!d.ffn_k_major && d.F > h) h = d.F;
    const int R = d.rw + d.ra + d.rv + d.rg;
    return R > h ? R : h;
}
inline size_t shared_bytes(const Dims& d) {
    return static_cast<size_t>(3 * d.C + staged_halves(d)) * sizeof(__half) + kScratch * sizeof(float);
}
// Workspace elements the model entries point to: x..hidden (fp16), partial (fp32), deps (uint32), logits (fp32).
inline int64_t partial_floats(const Dims& d) {
    return d.ffn_k_major ? static_cast<int64_t>(d.C) * sparse_chunks(d) : 0;
}
// the merged phases' counters, per layer: LoRA first-half rows done, then FFN key rows done per sparse chunk
inline int deps_per_layer(const Dims& d) { return 1 + sparse_chunks(d); }
inline int deps_count(const Dims& d) { return d.merge ? d.L * deps_per_layer(d) : 0; }
inline int64_t workspace_size(const Dims& d, int which) { return which == 0 ? partial_floats(d) : deps_count(d); }

// Whether the builder can take these dims (nonzero: which rule fails).
inline int dims_unsupported(const Dims& d) {
    if (d.C % N || d.C > kNormVecs * kThreads * 8 || d.L < 1 || d.V < 1) return 1;
    if (d.rw % 8 || d.ra % 8 || d.rv % 8 || d.rg % 8 || d.F % 8) return 2;  // staged 16 bytes at a time
    return 0;
}

constexpr int kDims = 12;  // entries of the host's dims (dims_from)

// Entry counts of this build: model (which 0), per layer (1), dims (2).
inline int entry_count(int which) {
    return which == 0 ? static_cast<int>(kModelEntries) : which == 1 ? static_cast<int>(kLayerEntries) : kDims;
}

// dims as the host passes them: L, C, F, V, rw, ra, rv, rg, ffn_k_major, state_half, num_slots, merge
// (infer/ops/persistent.py's step_dims)
inline Dims dims_from(const int64_t* d) {
    return Dims{static_cast<int>(d[0]), static_cast<int>(d[1]), static_cast<int>(d[2]), static_cast<int>(d[3]),
                static_cast<int>(d[4]), static_cast<int>(d[5]), static_cast<int>(d[6]), static_cast<int>(d[7]),
                static_cast<int>(d[8]), static_cast<int>(d[9]), d[10],   static_cast<int>(d[11])};
}

// The phases of one step into out (room for max_phases(d)); returns their count. With d.merge, two of a layer's
// seven grid barriers become waits of the units that need them on counters: the LoRA second halves join the r/k/v
// phase (after every unit of it, waiting for the LoRA first halves' rows, read from global memory), and with a
// K-major FFN value its sparse units join the FFN key's phase (each waiting for its chunk's hidden rows). Units are
// taken in order, so every unit waited for comes before its waiter in every warp's queue: no deadlock.
inline int build_program(const Dims& d, const int64_t* model, const int64_t* layers, Phase* out) {
    const int C = d.C, F = d.F, R = d.rw + d.ra + d.rv + d.rg;
    auto half_at = [](int64_t p) { return reinterpret_cast<__half*>(static_cast<intptr_t>(p)); };
    auto float_at = [](int64_t p) { return reinterpret_cast<float*>(static_cast<intptr_t>(p)); };
    __half *x = half_at(model[kX]), *h = half_at(model[kLoraH]);
    int n = 0;
    auto add = [&](int kind) -> Phase& {
        Phase& p = out[n++];
        memset(&p, 0, sizeof(p));
        p.kind = kind;
        p.C = C;
        return p;
    };
    auto task = [](Phase& p, int64_t w, int64_t ld, __half* y, float* y32, int rows, int k, int x_off, int act,
                   int accumulate) -> Task& {
        Task& t = p.t[p.ntasks++];
        t = Task{reinterpret_cast<const __half*>(static_cast<intptr_t>(w)), y, y32, nullptr, nullptr, nullptr, rows, k,
                 static_cast<int>(ld), x_off, act, accumulate, lanes_for(k), p.units, 0u, 1};
        p.units += (rows + 32 / t.lanes - 1) / (32 / t.lanes);
        p.gemv_units = p.units;
        return t;
    };
    unsigned* deps = reinterpret_cast<unsigned*>(static_cast<intptr_t>(model[kDeps]));
    auto norm = [&](Phase& p, int64_t w, int64_t b, int64_t shift) {
        p.stage.ln_w = half_at(w), p.stage.ln_b = half_at(b), p.stage.shift = half_at(shift);
    };
    add(kEmbed);
    for (int l = 0; l < d.L; ++l) {
        const int64_t* e = layers + static_cast<int64_t>(l) * kLayerEntries;
        const bool first = l == 0;
        const int64_t att_shift = model[kAttShift] + static_cast<int64_t>(l) * d.num_slots * C * 2;
        const int64_t ffn_shift = model[kFfnShift] + static_cast<int64_t>(l) * d.num_slots * C * 2;
        // mixes staged in the order r, w, k, v, a, g (the checkpoint's)
        Phase& rkv = add(kGemv);
        norm(rkv, e[kLn1W], e[kLn1B], att_shift);
        rkv.stage.nmix = 6;
        for (int m = 0; m < 6; ++m) rkv.stage.mix[m] = half_at(e[kMixR + m]);
        unsigned* layer_deps = d.merge ? deps + static_cast<int64_t>(l) * deps_per_layer(d) : nullptr;
        Task* firsts[4] = {
            &task(rkv, e[kW1], e[kW1Ld], h, nullptr, d.rw, C, 1 * C, kTanh, 0),
            &task(rkv, e[kA1], e[kA1Ld], h + d.rw, nullptr, d.ra, C, 4 * C, kNone, 0),
            &task(rkv, e[kG1], e[kG1Ld], h + d.rw + d.ra + d.rv, nullptr, d.rg, C, 5 * C, kSigmoid, 0),
            first ? nullptr : &task(rkv, e[kV1], e[kV1Ld], h + d.rw + d.ra, nullptr, d.rv, C, 3 * C, kNone, 0)};
        unsigned first_rows = 0;
        for (Task* t : firsts) {
            if (t && layer_deps) t->done = layer_deps, t->done_div = t->rows, first_rows += t->rows;
        }
        task(rkv, e[kWr], e[kWrLd], half_at(model[kR]), nullptr, C, C, 0 * C, kNone, 0);
        task(rkv, e[kWk], e[kWkLd], half_at(model[kK]), nullptr, C, C, 2 * C, kNone, 0);
        task(rkv, e[kWv], e[kWvLd], half_at(model[kV]), nullptr, C, C, 3 * C, kNone, 0);

        Phase& lora = d.merge ? rkv : add(kGemv);
        const int lora0 = lora.ntasks;
        if (!d.merge) lora.stage.src = h, lora.stage.halves = R, lora.save_shift = half_at(att_shift);
        task(lora, e[kW2], e[kW2Ld], half_at(model[kDw]), nullptr, C, d.rw, 0, kNone, 0);
        task(lora, e[kA2], e[kA2Ld], half_at(model[kDa]), nullptr, C, d.ra, d.rw, kNone, 0);
        task(lora, e[kG2], e[kG2Ld], half_at(model[kG]), nullptr, C, d.rg, d.rw + d.ra + d.rv, kNone, 0);
        if (!first) task(lora, e[kV2], e[kV2Ld], half_at(model[kDv]), nullptr, C, d.rv, d.rw + d.ra, kNone, 0);
        for (int i = lora0; d.merge && i < lora.ntasks; ++i) {  // merged: x from global memory, after the first halves
            Task& t = lora.t[i];
            t.xg = h + t.x_off, t.dep = layer_deps, t.dep_target = first_rows;
        }

        Phase& tm = add(kTimeMix);
        if (d.merge) tm.save_shift = half_at(att_shift);
        tm.r = half_at(model[kR]), tm.k = half_at(model[kK]), tm.v = half_at(model[kV]);
        tm.dw = half_at(model[kDw]), tm.da = half_at(model[kDa]), tm.dv = half_at(model[kDv]);
        tm.g = half_at(model[kG]);
        tm.v_first = half_at(model[kVFirst]), tm.out = half_at(model[kY]);
        tm.w0 = float_at(e[kW0]), tm.r_k = float_at(e[kRK]);
        tm.lnx_w = float_at(e[kLnxW]), tm.lnx_b = float_at(e[kLnxB]);
        tm.a0 = half_at(e[kA0]), tm.v0 = half_at(e[kV0]), tm.k_k = half_at(e[kKK]), tm.k_a = half_at(e[kKA]);
        tm.state = reinterpret_cast<void*>(static_cast<intptr_t>(
            model[kWkv] + static_cast<int64_t>(l) * d.num_slots * C * N * (d.state_half ? 2 : 4)));
        tm.first_layer = first, tm.heads = C / N;

        Phase& o = add(kGemv);
        o.stage.src = half_at(model[kY]), o.stage.halves = C;
        task(o, e[kWo], e[kWoLd], x, nullptr, C, C, 0, kNone, 1);

        Phase& fk = add(kGemv);
        norm(fk, e[kLn2W], e[kLn2B], ffn_shift);
        fk.stage.nmix = 1, fk.stage.mix[0] = half_at(e[kFfnMix]);
        Task& key = task(fk, e[kFk], e[kFkLd], half_at(model[kHidden]), nullptr, F, C, 0, kRelu2, 0);

        if (d.ffn_k_major) {
            const bool merged = layer_deps != nullptr;
            Phase& fv = merged ? fk : add(kSparse);
            if (merged) {  // the sparse units after the key's, each waiting for its chunk's rows
                key.done = layer_deps + 1, key.done_div = sparse_chunk_rows(d);
                fv.chunk_done = key.done;
                fv.units += sparse_tiles(d) * sparse_chunks(d);
            } else {
                fv.save_shift = half_at(ffn_shift);
            }
            fv.fv = half_at(e[kFv]), fv.hidden = half_at(model[kHidden]), fv.partial = float_at(model[kPartial]);
            fv.F = F, fv.tiles = sparse_tiles(d), fv.chunk_rows = sparse_chunk_rows(d), fv.chunks = sparse_chunks(d);
            Phase& red = add(kReduce);
            red.partial = fv.partial, red.x = x, red.chunks = fv.chunks;
            if (merged) red.save_shift = half_at(ffn_shift);
        } else {
            Phase& fv = add(kGemv);
            fv.save_shift = half_at(ffn_shift);
            fv.stage.src = half_at(model[kHidden]), fv.stage.halves = F;
            task(fv, e[kFv], e[kFvLd], x, nullptr, C, F, 0, kNone, 1);
        }
    }
    Phase& head = add(kGemv);
    norm(head, model[kLnOutW], model[kLnOutB], 0);
    task(head, model[kHead], model[kHeadLd], nullptr, float_at(model[kLogits]), d.V, C, 0, kNone, 0);
    return n;
}

}  // namespace step

// ================================================================================================== launchers
extern "C" int rwkv7_step_entry_marker() { return 0; }  // the emulation cuts the file here

namespace {

constexpr int kErrUnsupported = -1000;  // dims the builder cannot take
constexpr int kErrEntries = -1001;      // the model or layer entries do not match this build's
constexpr int kMaxDevices = 64;

}  // namespace

extern "C" int rwkv7_step_entries(int which) { return step::entry_count(which); }
extern "C" int64_t rwkv7_step_phase_bytes() { return sizeof(step::Phase); }
extern "C" int64_t rwkv7_step_max_phases(const int64_t* dims) { return step::max_phases(step::dims_from(dims)); }
// The workspace a step needs besides its fp16 vectors: fp32 partial sums (which 0) and uint32 counters (which 1).
extern "C" int64_t rwkv7_step_workspace(const int64_t* dims, int which) {
    return step::workspace_size(step::dims_from(dims), which);
}

// The phases of one step into `out` (host memory, rwkv7_step_max_phases * rwkv7_step_phase_bytes bytes); returns
// their count, or a negative error (rwkv7_step_error_string). model_entries/layer_entries: the counts the caller
// built its entries for (a mismatch with this build is an error, not a misread).
extern "C" int64_t rwkv7_step_build(const int64_t* dims, const int64_t* model, int model_entries, const int64_t* layers,
                         int layer_entries, void* out) {
    const step::Dims d = step::dims_from(dims);
    if (model_entries != step::kModelEntries || layer_entries != step::kLayerEntries) return kErrEntries;
    if (step::dims_unsupported(d)) return kErrUnsupported;
    return step::build_program(d, model, layers, static_cast<step::Phase*>(out));
}

// One step: `phases` (device memory, as built), token and slot device scalars (int64), emb [V, C], x [C], logits [V]
// and deps (rwkv7_step_workspace(dims, 1) counters) as in the model entries, sync: two unsigned; sync and deps zeroed
// (the kernel leaves them zero). The grid is every multiprocessor times blocks_per_sm (at most what fits), launched
// cooperatively (all blocks resident). timeline: null, or nphases * 2 * timeline_stride entries (at least the grid's
// blocks a row) for StepArgs::timeline.
extern "C" int rwkv7_step_launch(int device, int64_t stream, const void* phases, int nphases, const int64_t* dims,
                      const int64_t* token, const int64_t* slot, const void* emb, void* x, float* logits,
                      unsigned* sync, unsigned* deps, int prefetch, int blocks_per_sm,
                      unsigned long long* timeline, int timeline_stride) {
    const step::Dims d = step::dims_from(dims);
    if (step::dims_unsupported(d)) return kErrUnsupported;
    if (nphases < 2 || blocks_per_sm < 1) return cudaErrorInvalidValue;
    if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
    int previous = 0;
    cudaError_t err = cudaGetDevice(&previous);
    if (err == cudaSuccess && previous != device) err = cudaSetDevice(device);
    if (err != cudaSuccess) return err;
    auto kernel = d.state_half ? step::step_kernel<__half> : step::step_kernel<float>;
    const size_t smem = step::shared_bytes(d);
    // The shared-memory limit, multiprocessors and resident blocks of the kernel on the device, queried once for each
    // shared-memory size (a model's): an eager step launches it every token.
    struct Residency {
        size_t smem;
        int sms, resident;
    };
    static Residency known[kMaxDevices][2] = {};
    Residency& r = known[device][d.state_half ? 1 : 0];
    if (r.smem != smem) {
        err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
        if (err == cudaSuccess) err = cudaDeviceGetAttribute(&r.sms, cudaDevAttrMultiProcessorCount, device);
        if (err == cudaSuccess)
            err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&r.resident, kernel, step::kThreads, smem);
        r.smem = err == cudaSuccess ? smem : 0;
    }
    if (err == cudaSuccess && r.resident < 1) err = cudaErrorCooperativeLaunchTooLarge;
    const int per_sm = blocks_per_sm < r.resident ? blocks_per_sm : r.resident;
    if (err == cudaSuccess && timeline && timeline_stride < r.sms * per_sm) err = cudaErrorInvalidValue;
    if (err == cudaSuccess) {
        step::StepArgs args{static_cast<const step::Phase*>(phases), nphases, token, slot, d.num_slots, d.V,
                            static_cast<const __half*>(emb), static_cast<__half*>(x), logits, sync, deps,
                            step::deps_count(d), prefetch, timeline, timeline_stride};
        const int staged = step::staged_halves(d);
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(static_cast<unsigned>(r.sms * per_sm));
        cfg.blockDim = dim3(step::kThreads);
        cfg.dynamicSmemBytes = smem;
        cfg.stream = reinterpret_cast<cudaStream_t>(stream);
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeCooperative;
        attr[0].val.cooperative = 1;
        cfg.attrs = attr;
        cfg.numAttrs = 1;
        err = cudaLaunchKernelEx(&cfg, kernel, args, staged);
    }
    if (previous != device) cudaSetDevice(previous);
    return err;
}

extern "C" const char* rwkv7_step_error_string(int code) {
    if (code == kErrUnsupported) return "the model's shape is not supported by the persistent step kernel";
    if (code == kErrEntries) return "the model/layer entry counts do not match the persistent step kernel's build";
    return cudaGetErrorString(static_cast<cudaError_t>(code));
}


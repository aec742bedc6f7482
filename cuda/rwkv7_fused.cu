// Fused kernels of the RWKV-7 forward ("x070"): fewer, larger launches for the small element-wise
// steps around the matrix products. Plain CUDA C++ (no torch headers); the torch binding is
// cuda/rwkv7_fused_op.cpp. The math is the readable reference in infer/model.py (spec:
// ../shared/spec/rwkv7-math.md §2-§3); every intermediate is kept in fp32 and rounded once.
//
// 1. ln_shift_mix: layer norm of each token + token shift + the mixing vectors, one block per token.
//      xn = LN(x[t]);  prev = LN(x[t-1]) inside a row, or the slot's saved shift state at a row start
//      out_m[t] = xn + (prev - xn) * mix_m          (m < 6: x_r, x_w, x_k, x_v, x_a, x_g or ffn x_k)
//    The block of a row's first token also stores LN(x[last token of the row]) into the slot's shift
//    state, after reading it: one block owns each slot, so there is no race and no extra launch.
//
// 2. time_mix: everything between the projections/LoRAs and the output projection, one block of 64
//    threads per (row, head), thread i = channel h*64+i, looping over the row's tokens:
//      w = exp(-e^-0.5 sigmoid(w0 + dw)),  a = sigmoid(a0 + da),  kk = normalize_head(k * k_k)
//      k' = k (1 + (a-1) k_a),  v' = v + (v_first - v) sigmoid(v0 + dv)   (layer 0: v' = v, v_first := v)
//      S = S diag(w) + (S (-kk)) (kk a)^T + v' k'^T,   y = S r               (state in fp32 registers)
//      out = fp16(group_norm_head(y) + sum_head(r k' r_k) v') * g
//
// 3. gemv: y = x W^T for a few rows of x (decode), several matrices per launch ("tasks"), one warp
//    per output channel reading the weight row once with 16-byte loads (a long row split among up to 8
//    warps of one block, summed in shared memory); fp16 or int8 (+ per-channel fp16 scale) weights;
//    optional tanh/sigmoid on the input, relu^2 on the output, residual add.
//
// Every launcher takes the stream to launch on (graph-capturable) and returns a cudaError_t as int.

#include "int8x4.cuh"
#include "wkv7_state.cuh"

#include <climits>
#include <cstdint>
#include <cstdlib>
#include <utility>

namespace fused {

using wkv7::N;

constexpr int kLnThreads = 256;
constexpr int kMaxVec = 4;          // 16-byte vectors (8 halves) per thread: C <= 256 * 4 * 8 = 8192
constexpr int kMaxMix = 6;
constexpr float kLnEps = 1e-5f;
constexpr float kExpMinusHalf = 0.606531f;
constexpr float kGroupNormEps = 64e-5f;  // head_size * 1e-5

__device__ __forceinline__ float sigmoidf(float x) { return 1.0f / (1.0f + __expf(-x)); }
__device__ __forceinline__ float h2f(__half x) { return __half2float(x); }
__device__ __forceinline__ float round_half(float x) { return __half2float(__float2half_rn(x)); }

// Programmatic dependent launch (Hopper and newer): each kernel is launched allowed to start while
// its predecessor finishes. It may only touch data no running kernel writes (weights, its own layer's
// state) before dependency_wait(), which returns once the predecessor has completed and its writes
// are visible; it lets its own successor launch only after that wait, so at most two kernels overlap.
__device__ __forceinline__ void dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

__device__ __forceinline__ void unpack8(uint4 u, float (&out)[8]) {  // by value: a reference into global memory made memcpy load bytes
    __half h[8];
    memcpy(h, &u, sizeof(u));
#pragma unroll
    for (int e = 0; e < 8; ++e) out[e] = __half2float(h[e]);
}

__device__ __forceinline__ void load8(const __half* p, float (&out)[8]) {
    unpack8(*reinterpret_cast<const uint4*>(p), out);
}

__device__ __forceinline__ void store8(__half* p, const float (&in)[8]) {
    __half h[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) h[e] = __float2half_rn(in[e]);
    uint4 u;
    memcpy(&u, h, sizeof(u));
    *reinterpret_cast<uint4*>(p) = u;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over the block; `scratch` holds one float per warp and must not be reused by another
// reduction until every thread has passed a later barrier.
template <int WARPS>
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    v = warp_sum(v);
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
    __syncthreads();
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) total += scratch[w];
    return total;
}

// ------------------------------------------------------------------------------------ ln_shift_mix
struct MixArgs {
    const __half* mix[kMaxMix];
    __half* out[kMaxMix];
    int count;
};

// Layer norm of one C-wide fp16 row held as up to VECS 8-vectors per thread, rounded to fp16
// (the stored token-shift state is fp16, so every consumer sees the same values). w and b are this
// thread's vectors of the norm's weight and bias, loaded by the caller.
template <int VECS>
__device__ __forceinline__ void layer_norm_row(const __half* __restrict__ x, const uint4 (&w)[VECS],
                                               const uint4 (&b)[VECS], int vecs, float (&out)[VECS][8],
                                               float* scratch) {
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < VECS; ++j) {
        const int v = threadIdx.x + j * kLnThreads;
        if (v < vecs) {
            load8(x + v * 8, out[j]);
#pragma unroll
            for (int e = 0; e < 8; ++e) sum += out[j][e];
        }
    }
    const float inv_c = 1.0f / float(vecs * 8);
    const float mean = block_sum<kLnThreads / 32>(sum, scratch) * inv_c;
    float sq = 0.0f;
#pragma unroll
    for (int j = 0; j < VECS; ++j) {
        if (threadIdx.x + j * kLnThreads < vecs) {
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const float d = out[j][e] - mean;
                sq += d * d;
            }
        }
    }
    const float rstd = rsqrtf(block_sum<kLnThreads / 32>(sq, scratch + kLnThreads / 32) * inv_c + kLnEps);
#pragma unroll
    for (int j = 0; j < VECS; ++j) {
        if (threadIdx.x + j * kLnThreads < vecs) {
            float wv[8], bv[8];
            unpack8(w[j], wv);
            unpack8(b[j], bv);
#pragma unroll
            for (int e = 0; e < 8; ++e) out[j][e] = round_half((out[j][e] - mean) * rstd * wv[e] + bv[e]);
        }
    }
    __syncthreads();  // scratch is free again
}

// prev[t] >= 0: index of the previous token of t's row; prev[t] < 0: t starts row -prev[t]-1.
// VECS: 8-vectors per thread, the fewest that cover C (registers grow with it).
template <int VECS>
__global__ void __launch_bounds__(kLnThreads, VECS <= 2 ? 2 : 1)
ln_shift_mix_kernel(int C, int64_t num_slots, const __half* __restrict__ x, const __half* __restrict__ ln_w,
                    const __half* __restrict__ ln_b, __half* __restrict__ shift, const int32_t* __restrict__ prev,
                    const int64_t* __restrict__ slots, const int64_t* __restrict__ lasts, MixArgs args) {
    __shared__ float scratch[2 * kLnThreads / 32];
    const int64_t t = blockIdx.x;
    const int vecs = C / 8;

    // Before the wait, everything no kernel of this step writes: the norm's parameters, the batch's
    // indices, and at a row start the slot's saved shift state (only this layer's own launch writes it).
    // At decode this kernel is a chain of dependent loads, so each one taken off the chain is latency saved.
    uint4 w[VECS], b[VECS];
#pragma unroll
    for (int j = 0; j < VECS; ++j) {
        const int v = threadIdx.x + j * kLnThreads;
        if (v < vecs) {
            w[j] = *reinterpret_cast<const uint4*>(ln_w + v * 8);
            b[j] = *reinterpret_cast<const uint4*>(ln_b + v * 8);
        }
    }
    const int p = prev[t];
    float pv[VECS][8];
    int64_t last = -1;
    __half* saved = nullptr;  // the slot's shift state when t starts a row with a valid slot
    if (p < 0) {
        const int64_t row = -int64_t(p) - 1;
        const int64_t slot = slots[row];
        last = lasts[row];
        if (slot >= 0 && slot < num_slots) saved = shift + slot * C;  // a bad slot is left alone (its row reads zeros)
#pragma unroll
        for (int j = 0; j < VECS; ++j) {
            const int v = threadIdx.x + j * kLnThreads;
            if (v >= vecs) continue;
            if (saved) {
                load8(saved + v * 8, pv[j]);
            } else {
#pragma unroll
                for (int e = 0; e < 8; ++e) pv[j][e] = 0.0f;
            }
        }
    }
    dependency_wait();

    float xn[VECS][8];
    layer_norm_row(x + t * C, w, b, vecs, xn, scratch);
    if (p >= 0) {
        layer_norm_row(x + int64_t(p) * C, w, b, vecs, pv, scratch);
    } else if (saved) {
        // The new shift state: the normalised input of the row's last token. Each thread writes
        // exactly the elements it read above, so no barrier is needed between the two.
        if (last == t) {
#pragma unroll
            for (int j = 0; j < VECS; ++j) {
                const int v = threadIdx.x + j * kLnThreads;
                if (v < vecs) store8(saved + v * 8, xn[j]);
            }
        } else {
            float ln_last[VECS][8];
            layer_norm_row(x + last * C, w, b, vecs, ln_last, scratch);
#pragma unroll
            for (int j = 0; j < VECS; ++j) {
                const int v = threadIdx.x + j * kLnThreads;
                if (v < vecs) store8(saved + v * 8, ln_last[j]);
            }
        }
    }

#pragma unroll
    for (int j = 0; j < VECS; ++j) {
        const int v = threadIdx.x + j * kLnThreads;
        if (v >= vecs) continue;
        // All mixes' loads first: the outputs are not restrict, so a load after a store would wait for it.
        uint4 mix[kMaxMix];
#pragma unroll
        for (int m = 0; m < kMaxMix; ++m) {  // unrolled: constant indices keep args out of local memory
            if (m < args.count) mix[m] = *reinterpret_cast<const uint4*>(args.mix[m] + v * 8);
        }
        float d[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) d[e] = pv[j][e] - xn[j][e];
#pragma unroll
        for (int m = 0; m < kMaxMix; ++m) {
            if (m >= args.count) break;
            float mf[8], o[8];
            unpack8(mix[m], mf);
#pragma unroll
            for (int e = 0; e < 8; ++e) o[e] = fmaf(d[e], mf[e], xn[j][e]);
            store8(args.out[m] + t * C + v * 8, o);
        }
    }
}

// ------------------------------------------------------------------------------------ time_mix
struct TimeMixArgs {
    // per token [T, C] fp16
    const __half *r, *k, *v, *dw, *da, *dv, *g;
    __half* v_first;  // written in layer 0, read in the others
    __half* out;
    // per channel [C]
    const float *w0, *r_k, *lnx_w, *lnx_b;
    const __half *a0, *v0, *k_k, *k_a;
    int first_layer;  // 1: layer 0 (no value residual; v_first := v)
};

// One token's inputs to the time mix at one channel, as floats.
struct TokenInputs {
    float r, k, v, dw, da, dv, g, v_first;
};

__device__ __forceinline__ TokenInputs load_token_inputs(const TimeMixArgs& p, int64_t o) {
    TokenInputs in;
    in.r = h2f(p.r[o]);
    in.k = h2f(p.k[o]);
    in.v = h2f(p.v[o]);
    in.dw = h2f(p.dw[o]);
    in.da = h2f(p.da[o]);
    in.g = h2f(p.g[o]);
    in.dv = p.first_layer ? 0.0f : h2f(p.dv[o]);
    in.v_first = p.first_layer ? 0.0f : h2f(p.v_first[o]);
    return in;
}

template <typename S>
__global__ void __launch_bounds__(N)
time_mix_kernel(int H, int64_t num_slots, int64_t num_tokens, S* __restrict__ state, const int64_t* __restrict__ slots,
                const int64_t* __restrict__ starts, const int64_t* __restrict__ lasts, TimeMixArgs p) {
    const int64_t row = blockIdx.x / H;
    const int h = blockIdx.x % H;
    const int i = threadIdx.x;
    const int64_t C = int64_t(H) * N;
    const int64_t col = int64_t(h) * N + i;

    const int64_t first = starts[row];
    const int64_t last = lasts[row];
    const int64_t slot = slots[row];
    if (last < first || first < 0 || last >= num_tokens) {  // block-uniform
        dependency_wait();
        return;
    }
    if (slot < 0 || slot >= num_slots) {  // bad slot: NaN output, state untouched
        dependency_wait();
        for (int64_t t = first; t <= last; ++t) p.out[t * C + col] = __float2half_rn(__int_as_float(0x7fc00000));
        return;
    }

    __shared__ __align__(16) float tile[N][wkv7::LD];
    __shared__ __align__(16) float kr[N], kw[N], kk_[N], ka[N], kb[N];  // key-axis vectors of the token
    __shared__ float scratch[6];

    // The state block (16 KB fp32) and the first token's inputs are loaded together, and each token
    // fetches the next one's inputs before the barrier that ends it: at large batches this kernel moves most
    // of a decode step's bytes, and a block that waited on one load after another left the memory idle.
    S* block = state + (slot * H + h) * N * N;
    wkv7::Staged<S> staged;
    wkv7::block_load(block, staged);  // only this kernel writes the state: safe before the wait

    const float w0 = p.w0[col], r_k = p.r_k[col], lnx_w = p.lnx_w[col], lnx_b = p.lnx_b[col];
    const float a0 = h2f(p.a0[col]), k_k = h2f(p.k_k[col]), k_a = h2f(p.k_a[col]);
    const float v0 = p.first_layer ? 0.0f : h2f(p.v0[col]);

    dependency_wait();
    TokenInputs in = load_token_inputs(p, first * C + col);
    wkv7::staged_to_tile(staged, tile);
    __syncthreads();
    float s[N];
    wkv7::tile_row_to_regs(tile[i], s);

    for (int64_t t = first; t <= last; ++t) {
        const int64_t o = t * C + col;
        const TokenInputs cur = in;
        const float r = cur.r, k = cur.k;
        float v = cur.v;
        const float w = __expf(-kExpMinusHalf * sigmoidf(w0 + cur.dw));
        const float a = sigmoidf(a0 + cur.da);
        const float kkr = k * k_k;
        const float kn = k * (1.0f + (a - 1.0f) * k_a);
        if (p.first_layer) {
            p.v_first[o] = __float2half_rn(v);
        } else {
            v = v + (cur.v_first - v) * sigmoidf(v0 + cur.dv);
        }
        const float norm = sqrtf(block_sum<2>(kkr * kkr, scratch));
        const float kk = kkr / fmaxf(norm, 1e-12f);
        kr[i] = r;
        kw[i] = w;
        kk_[i] = kn;
        ka[i] = -kk;
        kb[i] = kk * a;
        __syncthreads();

        const float y = wkv7::token_step(s, ka, kw, kk_, kb, kr, v);

        // group norm over the head, plus the bonus term sum_j r_j k'_j r_k_j
        const float mean = block_sum<2>(y, scratch + 2) * (1.0f / N);
        const float bonus = block_sum<2>(r * kn * r_k, scratch + 4);
        float var_part = (y - mean) * (y - mean);
        // reuse scratch[0..1]: every thread read it before the barrier inside the mean's block_sum
        const float var = block_sum<2>(var_part, scratch) * (1.0f / N);
        const float yn = (y - mean) * rsqrtf(var + kGroupNormEps) * lnx_w + lnx_b;
        const float res = round_half(yn + bonus * v) * cur.g;
        p.out[o] = __float2half_rn(res);
        if (t < last) in = load_token_inputs(p, o + C);  // in flight across the barrier
        __syncthreads();  // the key-axis buffers and scratch are rewritten by the next token
    }

    __syncthreads();
    wkv7::regs_to_tile_row(s, tile[i]);
    __syncthreads();
    wkv7::tile_to_block(tile, block);
}

// ------------------------------------------------------------------------------------ gemv
constexpr int kGemvWarps = 8;
constexpr int kMaxTasks = 8;
constexpr int kGemvMaxRows = 8;

enum WeightType : int { kWeightHalf = 0, kWeightInt8 = 1 };
enum Activation : int { kActNone = 0, kActTanh = 1, kActSigmoid = 2 };
enum Epilogue : int { kEpiNone = 0, kEpiReluSquare = 1 };

struct GemvTask {
    const void* w;           // [N, K] fp16 or int8, row-major (nn.Linear layout)
    const __half* scale;     // [N] per output channel (int8 weights), else null
    const __half* x;         // [M, K]
    __half* y;               // [M, N]
    const __half* residual;  // [M, N] added to the result, or null (may alias y)
    int n, k;
    int weight_type, activation, epilogue;
    int splits;              // warps per output channel (1, 2, 4 or 8), each reading one slice of the row
    int first_block;         // blocks [first_block, first_block + ceil(n * splits / kGemvWarps)) compute this task
};

struct GemvArgs {
    GemvTask task[kMaxTasks];
    int count;
};

__device__ __forceinline__ float activate(float x, int act) {
    if (act == kActTanh) return tanhf(x);
    if (act == kActSigmoid) return sigmoidf(x);
    return x;
}

// The activations of one 8-wide slice of x, converted and activated. The activation is a template
// switch: inlined into every weight vector's step, its code made the plain loop too large for the
// instruction cache, and only the small LoRA launches use it.
template <bool kAct>
__device__ __forceinline__ void load_x8(const __half* p, int act, float (&out)[8]) {
    load8(p, out);
    if (kAct && act != kActNone) {
#pragma unroll
        for (int e = 0; e < 8; ++e) out[e] = activate(out[e], act);
    }
}

// Each lane keeps kGemvLoads 16-byte weight loads in flight: the GEMV is a stream of the weights, and at
// batch 1 a matrix takes only microseconds, so the bytes in flight per multiprocessor set its speed.
constexpr int kGemvLoads = 8;

// This lane's next batch of a weight row's 16-byte vectors: [first, first + 32, ...) below end.
// Weights are read once per step: stream them past the caches.
__device__ __forceinline__ void load_weight_batch(const uint4* row, int first, int end, uint4 (&w)[kGemvLoads]) {
#pragma unroll
    for (int j = 0; j < kGemvLoads; ++j) {
        if (first + 32 * j < end) w[j] = __ldcs(row + first + 32 * j);
    }
}

// acc[m] += the batch's weights . x[m]; fp16 weights: 8 per vector.
template <int M, bool kAct>
__device__ __forceinline__ void fma_half_batch(const GemvTask& task, int first, int end, const uint4 (&w)[kGemvLoads],
                                               float (&acc)[M]) {
#pragma unroll
    for (int j = 0; j < kGemvLoads; ++j) {
        const int v = first + 32 * j;
        if (v >= end) break;
        const int k = v * 8;
        __half h[8];
        memcpy(h, &w[j], sizeof(h));
        float wf[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) wf[e] = __half2float(h[e]);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float xf[8];
            load_x8<kAct>(task.x + int64_t(m) * task.k + k, task.activation, xf);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[m] = fmaf(wf[e], xf[e], acc[m]);
        }
    }
}

// int8 weights: 16 per vector (the per-channel scale is applied in the epilogue).
template <int M, bool kAct>
__device__ __forceinline__ void fma_int8_batch(const GemvTask& task, int first, int end, const uint4 (&w)[kGemvLoads],
                                               float (&acc)[M]) {
#pragma unroll
    for (int j = 0; j < kGemvLoads; ++j) {
        const int v = first + 32 * j;
        if (v >= end) break;
        const int k = v * 16;
        float wf[16];
        int8x4_to_float(w[j].x, wf);
        int8x4_to_float(w[j].y, wf + 4);
        int8x4_to_float(w[j].z, wf + 8);
        int8x4_to_float(w[j].w, wf + 12);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float xa[8], xb[8];
            load_x8<kAct>(task.x + int64_t(m) * task.k + k, task.activation, xa);
            load_x8<kAct>(task.x + int64_t(m) * task.k + k + 8, task.activation, xb);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[m] = fmaf(wf[e], xa[e], acc[m]);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[m] = fmaf(wf[8 + e], xb[e], acc[m]);
        }
    }
}

// Registers capped for occupancy: three blocks per multiprocessor for one or two rows without activations
// (the big matrices at decode), else two.
template <int M, bool kAct>
__global__ void __launch_bounds__(kGemvWarps * 32, M <= 2 && !kAct ? 3 : 2) gemv_kernel(GemvArgs args) {
    int t = 0;
#pragma unroll 1
    while (t + 1 < args.count && int(blockIdx.x) >= args.task[t + 1].first_block) ++t;
    const GemvTask& task = args.task[t];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // This warp's (output channel, slice): a block holds whole channels, as kGemvWarps % splits == 0.
    const int unit = (int(blockIdx.x) - task.first_block) * kGemvWarps + warp;
    const int n = unit / task.splits, split = unit % task.splits;
    const bool active = n < task.n;  // warp-uniform; an idle warp still joins the block's barrier below
    const int count = task.weight_type == kWeightInt8 ? task.k / 16 : task.k / 8;  // 16-byte vectors per row
    const int slice = count / task.splits;
    const int begin = split * slice, end = begin + slice;
    const uint4* row = reinterpret_cast<const uint4*>(task.w) + int64_t(n) * count;
    uint4 w[kGemvLoads];
    if (active) load_weight_batch(row, begin + lane, end, w);  // weights: no kernel writes them, load before the wait
    dependency_wait();

    float acc[M];
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = 0.0f;
    if (active) {
#pragma unroll 1
        for (int first = begin + lane;;) {
            if (task.weight_type == kWeightInt8) {
                fma_int8_batch<M, kAct>(task, first, end, w, acc);
            } else {
                fma_half_batch<M, kAct>(task, first, end, w, acc);
            }
            first += 32 * kGemvLoads;
            if (first >= end) break;
            load_weight_batch(row, first, end, w);
        }
    }
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = warp_sum(acc[m]);
    if (task.splits > 1) {  // block-uniform: the slices' sums, added in slice order (deterministic)
        __shared__ float partial[kGemvWarps][M];
        if (lane == 0) {
#pragma unroll
            for (int m = 0; m < M; ++m) partial[warp][m] = acc[m];
        }
        __syncthreads();
        if (split != 0) return;
#pragma unroll
        for (int m = 0; m < M; ++m) {
            acc[m] = partial[warp][m];
            for (int j = 1; j < task.splits; ++j) acc[m] += partial[warp + j][m];
        }
    }
    if (!active || lane != 0) return;
    const float scale = task.scale ? __half2float(task.scale[n]) : 1.0f;
#pragma unroll
    for (int m = 0; m < M; ++m) {
        const int64_t o = int64_t(m) * task.n + n;
        float val = round_half(acc[m] * scale);  // the product in fp16, as a separate matmul would give
        if (task.epilogue == kEpiReluSquare) {
            val = fmaxf(val, 0.0f);
            val = val * val;
        }
        if (task.residual) val += __half2float(task.residual[o]);
        task.y[o] = __float2half_rn(val);
    }
}

// Which instance of a kernel a launch takes (the launchers and the CPU emulator's harness both ask):
// the activating GEMV when any task has an activation; ln_shift_mix's 8-vectors per thread for width C.
inline bool gemv_activates(const GemvArgs& args) {
    for (int i = 0; i < args.count; ++i)
        if (args.task[i].activation != kActNone) return true;
    return false;
}
inline int ln_vecs(int64_t C) {
    const int64_t per_thread = (C / 8 + kLnThreads - 1) / kLnThreads;
    return per_thread <= 1 ? 1 : per_thread <= 2 ? 2 : kMaxVec;
}

// Programmatic dependent launch is used on compute capability >= 9.0 unless RWKV_PDL=0.
inline bool use_pdl(int device) {
    static int cached[64] = {0};  // 0 unknown, 1 off, 2 on
    if (device < 0 || device >= 64) return false;
    if (cached[device] == 0) {
        int major = 0;
        const char* env = std::getenv("RWKV_PDL");
        const bool disabled = env && env[0] == '0';
        const bool ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess;
        cached[device] = (!disabled && ok && major >= 9) ? 2 : 1;
    }
    return cached[device] == 2;
}

template <typename... KernelArgs, typename... Args>
cudaError_t launch(void (*kernel)(KernelArgs...), unsigned grid, unsigned block, cudaStream_t stream, Args&&... args) {
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return err;
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(grid);
    config.blockDim = dim3(block);
    config.stream = stream;
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attribute;
    config.numAttrs = use_pdl(device) ? 1 : 0;
    return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

template <int M>
cudaError_t launch_gemv(const GemvArgs& args, int blocks, cudaStream_t stream) {
    return gemv_activates(args) ? launch(gemv_kernel<M, true>, static_cast<unsigned>(blocks), kGemvWarps * 32, stream, args)
               : launch(gemv_kernel<M, false>, static_cast<unsigned>(blocks), kGemvWarps * 32, stream, args);
}

template <typename F>
int on_device(int device, F&& launch) {
    int previous = -1;
    cudaError_t err = cudaGetDevice(&previous);
    if (err != cudaSuccess) return err;
    if (previous != device && (err = cudaSetDevice(device)) != cudaSuccess) return err;
    err = launch();
    if (previous != device) (void)cudaSetDevice(previous);
    return static_cast<int>(err);
}

// ------------------------------------------------------------------------------ kernel arguments
// The launchers' pointer arrays as the kernels' argument structs; the CPU emulator's harness
// (test/kernel_emu/emu_fused.cpp) packs its launches with these same functions.
inline MixArgs make_mix_args(const void* const* mix, void* const* out, int count) {
    MixArgs args{};
    for (int m = 0; m < count; ++m) {
        args.mix[m] = static_cast<const __half*>(mix[m]);
        args.out[m] = static_cast<__half*>(out[m]);
    }
    args.count = count;
    return args;
}

// tensors: r, k, v, dw, da, dv, g, v_first, out; params: w0, r_k, lnx_w, lnx_b, a0, v0, k_k, k_a.
inline TimeMixArgs make_time_mix_args(const void* const* tensors, const void* const* params, int first_layer) {
    TimeMixArgs p{};
    p.r = static_cast<const __half*>(tensors[0]);
    p.k = static_cast<const __half*>(tensors[1]);
    p.v = static_cast<const __half*>(tensors[2]);
    p.dw = static_cast<const __half*>(tensors[3]);
    p.da = static_cast<const __half*>(tensors[4]);
    p.dv = static_cast<const __half*>(tensors[5]);
    p.g = static_cast<const __half*>(tensors[6]);
    p.v_first = static_cast<__half*>(const_cast<void*>(tensors[7]));
    p.out = static_cast<__half*>(const_cast<void*>(tensors[8]));
    p.w0 = static_cast<const float*>(params[0]);
    p.r_k = static_cast<const float*>(params[1]);
    p.lnx_w = static_cast<const float*>(params[2]);
    p.lnx_b = static_cast<const float*>(params[3]);
    p.a0 = static_cast<const __half*>(params[4]);
    p.v0 = static_cast<const __half*>(params[5]);
    p.k_k = static_cast<const __half*>(params[6]);
    p.k_a = static_cast<const __half*>(params[7]);
    p.first_layer = first_layer;
    return p;
}

// Whether gemv_kernel takes a task: k a multiple of one 16-byte load (8 fp16 or 16 int8 weights).
inline bool gemv_takes(int64_t n, int64_t k, int weight_type) {
    const int multiple = weight_type == kWeightInt8 ? 16 : 8;
    return n > 0 && k > 0 && n <= INT_MAX / 2 && k <= INT_MAX / 2 && k % multiple == 0;
}

// Row splitting. A launch of few, long rows runs few blocks, and its last partial wave of blocks leaves
// the memory idle for as long as a whole one (7.2B FFN value, 4,096 rows of 32 KB: 1.3 waves, 3.2 TB/s
// against 3.7 for the 16,384 rows of the FFN key; bench/results/profile_nopdl_h200.json). So the rows of
// the task with the longest slices are halved until the launch has kGemvSplitRows (row, slice) units,
// while each slice keeps at least one full batch of loads per lane (kGemvMinSlice vectors).
// RWKV_GEMV_SPLIT=0 turns it off (for A/B timing).
constexpr int kGemvSplitRows = 16384;
constexpr int kGemvMinSlice = 32 * kGemvLoads;

inline bool gemv_split_enabled() {
    static const bool enabled = [] {
        const char* env = std::getenv("RWKV_GEMV_SPLIT");
        return !(env && env[0] == '0');
    }();
    return enabled;
}

inline void plan_gemv_splits(GemvArgs& args) {
    int64_t units = 0;
    for (int i = 0; i < args.count; ++i) {
        args.task[i].splits = 1;
        units += args.task[i].n;
    }
    while (gemv_split_enabled() && units < kGemvSplitRows) {
        int best = -1, best_slice = 0;
        for (int i = 0; i < args.count; ++i) {
            const GemvTask& t = args.task[i];
            const int count = t.weight_type == kWeightInt8 ? t.k / 16 : t.k / 8;
            const int slice = count / t.splits;
            if (t.splits < kGemvWarps && slice % 2 == 0 && slice / 2 >= kGemvMinSlice && slice > best_slice) {
                best = i;
                best_slice = slice;
            }
        }
        if (best < 0) break;
        units += args.task[best].n * int64_t(args.task[best].splits);
        args.task[best].splits *= 2;
    }
}

// The `count` tasks of one grouped launch, kGemvWarps (output channel, slice) units per block; returns
// the grid size. The caller has checked that gemv_kernel takes every task.
inline int pack_gemv(GemvArgs& args, int count, const void* const* w, const void* const* scale,
                     const void* const* x, void* const* y, const void* const* residual, const int64_t* n,
                     const int64_t* k, const int* weight_type, const int* activation, const int* epilogue) {
    int blocks = 0;
    for (int i = 0; i < count; ++i) {
        GemvTask& t = args.task[i];
        t.w = w[i];
        t.scale = static_cast<const __half*>(scale[i]);
        t.x = static_cast<const __half*>(x[i]);
        t.y = static_cast<__half*>(y[i]);
        t.residual = static_cast<const __half*>(residual[i]);
        t.n = static_cast<int>(n[i]);
        t.k = static_cast<int>(k[i]);
        t.weight_type = weight_type[i];
        t.activation = activation[i];
        t.epilogue = epilogue[i];
    }
    args.count = count;
    plan_gemv_splits(args);
    for (int i = 0; i < count; ++i) {
        GemvTask& t = args.task[i];
        t.first_block = blocks;
        blocks += static_cast<int>((int64_t(t.n) * t.splits + kGemvWarps - 1) / kGemvWarps);
    }
    return blocks;
}

}  // namespace fused

// --------------------------------------------------------------------------------- C interface
// x [T, C] fp16; ln_w/ln_b [C]; shift [S, C] (one layer's token-shift pool, fp16); prev [T] int32;
// slots/lasts [B] int64; mix[m] [C], out[m] [T, C] for m < count (<= 6). C % 8 == 0, C <= 8192.
extern "C" int fused_ln_shift_mix_launch(int device, int64_t stream, int64_t T, int64_t C, int64_t num_slots,
                                         const void* x, const void* ln_w, const void* ln_b, void* shift,
                                         const int32_t* prev, const int64_t* slots, const int64_t* lasts,
                                         const void* const* mix, void* const* out, int count) {
    using namespace fused;
    if (T == 0) return cudaSuccess;
    if (T < 0 || T > INT_MAX || C <= 0 || C % 8 || C > kLnThreads * kMaxVec * 8 || count < 1 || count > kMaxMix)
        return cudaErrorInvalidValue;
    const MixArgs args = make_mix_args(mix, out, count);
    const int vecs = ln_vecs(C);
    auto kernel = vecs == 1 ? ln_shift_mix_kernel<1> : vecs == 2 ? ln_shift_mix_kernel<2> : ln_shift_mix_kernel<kMaxVec>;
    return on_device(device, [&] {
        return launch(kernel, static_cast<unsigned>(T), kLnThreads, reinterpret_cast<cudaStream_t>(stream),
                      static_cast<int>(C), num_slots, static_cast<const __half*>(x), static_cast<const __half*>(ln_w),
                      static_cast<const __half*>(ln_b), static_cast<__half*>(shift), prev, slots, lasts, args);
    });
}

// tensors: r, k, v, dw, da, dv, g, v_first, out ([T, C] fp16; dv unused in layer 0);
// params: w0, r_k, lnx_w, lnx_b (fp32 [C]), a0, v0, k_k, k_a (fp16 [C]; v0 unused in layer 0).
extern "C" int fused_time_mix_launch(int device, int64_t stream, int state_dtype, int64_t B, int64_t H,
                                     int64_t num_slots, int64_t num_tokens, void* state, const int64_t* slots,
                                     const int64_t* starts, const int64_t* lasts, const void* const* tensors,
                                     const void* const* params, int first_layer) {
    using namespace fused;
    if (B == 0) return cudaSuccess;
    if (B < 0 || H <= 0 || B * H > INT_MAX) return cudaErrorInvalidConfiguration;
    const TimeMixArgs p = make_time_mix_args(tensors, params, first_layer);
    const int h = static_cast<int>(H);
    const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
    return on_device(device, [&] {
        const unsigned grid = static_cast<unsigned>(B * H);
        if (state_dtype == wkv7::kFloat32)
            return launch(time_mix_kernel<float>, grid, N, s, h, num_slots, num_tokens, static_cast<float*>(state),
                          slots, starts, lasts, p);
        if (state_dtype == wkv7::kFloat16)
            return launch(time_mix_kernel<__half>, grid, N, s, h, num_slots, num_tokens, static_cast<__half*>(state),
                          slots, starts, lasts, p);
        return cudaErrorInvalidValue;
    });
}

extern "C" int fused_gemv_max_rows() { return fused::kGemvMaxRows; }
extern "C" int fused_gemv_max_tasks() { return fused::kMaxTasks; }

// One launch computing `count` tasks y_i = act(x_i) W_i^T (see GemvTask) for M rows each.
// Weight k must be a multiple of 8 (fp16) or 16 (int8); every pointer 16-byte aligned.
extern "C" int fused_gemv_launch(int device, int64_t stream, int64_t M, int count, const void* const* w,
                                 const void* const* scale, const void* const* x, void* const* y,
                                 const void* const* residual, const int64_t* n, const int64_t* k,
                                 const int* weight_type, const int* activation, const int* epilogue) {
    using namespace fused;
    if (count < 1 || count > kMaxTasks || M < 1 || M > kGemvMaxRows) return cudaErrorInvalidValue;
    for (int i = 0; i < count; ++i)
        if (!gemv_takes(n[i], k[i], weight_type[i])) return cudaErrorInvalidValue;
    GemvArgs args{};
    const int blocks = pack_gemv(args, count, w, scale, x, y, residual, n, k, weight_type, activation, epilogue);
    const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
    return on_device(device, [&] {
        switch (M) {
            case 1: return launch_gemv<1>(args, blocks, s);
            case 2: return launch_gemv<2>(args, blocks, s);
            case 3: return launch_gemv<3>(args, blocks, s);
            case 4: return launch_gemv<4>(args, blocks, s);
            case 5: return launch_gemv<5>(args, blocks, s);
            case 6: return launch_gemv<6>(args, blocks, s);
            case 7: return launch_gemv<7>(args, blocks, s);
            default: return launch_gemv<8>(args, blocks, s);
        }
    });
}

extern "C" const char* fused_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

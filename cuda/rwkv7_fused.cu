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
//    A prefill takes time_mix_split_kernel + time_mix_finish_kernel (a prompt alone: a head's state rows split
//    over four blocks), time_mix_prefill_kernel (a few rows) or time_mix_chunked_kernel (many) instead: the
//    same math, the state-free work of 8 tokens side by side, then the recurrence alone (see their comments).
//
// 3. gemv: y = x W^T for a few rows of x (decode), several matrices per launch ("tasks"), one warp
//    per output channel reading the weight row once with 16-byte loads (a long row split among up to 8
//    warps of one block, summed in shared memory); fp16 or int8 (+ per-channel fp16 scale) weights, or
//    GemLite's packed 4-bit weights read in place; int8 and 4-bit tasks run on the tensor cores, a block per
//    band of output channels (gemv_int8_band, gemv_uint4_block), and a launch of few bands on 16 warps a
//    block (gemv_wide_band_kernel); relu^2, tanh or sigmoid on the output, residual add. A launch may run in two
//    stages, tasks reading other tasks' outputs waiting on a device counter (task_dependency_wait). On Hopper a
//    launch of fp16 rows 2,048 or 4,096 wide streams them through shared memory instead (gemv_stream_kernel).
//
// 4. sparse_gemv: y = x Wt (* scale) + residual for the FFN value matrix stored K-major (fp16, or int8 with its
//    per-channel scale), reading only the weight rows whose input relu(k)^2 is nonzero in some row of x (see
//    sparse_gemv_kernel).
//
// 5. relu_square: x = relu(x)^2 in place (the FFN key's activation beside cuBLAS products).
//
// 6. uint4_dequantize: columns of a 4-bit GemLite matrix rebuilt in fp16 for a cuBLAS product (large batches).
//
// Every launcher takes the stream to launch on (graph-capturable) and returns a cudaError_t as int.

#include "device_common.cuh"
#include "int8x4.cuh"
#include "wkv7_state.cuh"

#include <climits>
#include <cstdint>
#include <cstdlib>
#include <type_traits>
#include <utility>

namespace fused {

using wkv7::N;

constexpr int kLnThreads = 256;
constexpr int kMaxVec = 4;          // 16-byte vectors (8 halves) per thread: C <= 256 * 4 * 8 = 8192
constexpr int kMaxMix = 6;
constexpr int kLnSpan = 4;           // tokens per block of ln_shift_mix_span_kernel
constexpr float kLnEps = 1e-5f;
constexpr float kExpMinusHalf = 0.606531f;
constexpr float kGroupNormEps = 64e-5f;  // head_size * 1e-5

__device__ __forceinline__ float h2f(__half x) { return __half2float(x); }

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

__device__ __forceinline__ void load8(const __half* p, float (&out)[8]) {
    unpack8(*reinterpret_cast<const uint4*>(p), out);
}

__device__ __forceinline__ void store8(__half* p, const float (&in)[8]) { *reinterpret_cast<uint4*>(p) = pack8(in); }

// ------------------------------------------------------------------------------------ ln_shift_mix
struct MixArgs {
    const __half* mix[kMaxMix];
    __half* out[kMaxMix];
    int count;
};

// A C-wide fp16 row as this thread's up to VECS 8-vectors (vector threadIdx.x + j * kLnThreads in out[j]; a
// thread past the row's end leaves out[j] alone), and back.
template <int VECS>
__device__ __forceinline__ void load_row(const __half* __restrict__ x, int vecs, float (&out)[VECS][8]) {
#pragma unroll
    for (int j = 0; j < VECS; ++j) {
        const int v = threadIdx.x + j * kLnThreads;
        if (v < vecs) load8(x + v * 8, out[j]);
    }
}

template <int VECS>
__device__ __forceinline__ void store_row(__half* __restrict__ dst, int vecs, const float (&in)[VECS][8]) {
#pragma unroll
    for (int j = 0; j < VECS; ++j) {
        const int v = threadIdx.x + j * kLnThreads;
        if (v < vecs) store8(dst + v * 8, in[j]);
    }
}

// A slot's saved shift state, or zeros for a row without a valid slot (saved null).
template <int VECS>
__device__ __forceinline__ void load_row_or_zero(const __half* saved, int vecs, float (&out)[VECS][8]) {
    if (saved) {
        load_row(saved, vecs, out);
        return;
    }
#pragma unroll
    for (int j = 0; j < VECS; ++j)
#pragma unroll
        for (int e = 0; e < 8; ++e) out[j][e] = 0.0f;
}

// This thread's vectors of the norm's weight and bias (no kernel of the step writes them: loaded before the wait).
template <int VECS>
__device__ __forceinline__ void load_norm_params(const __half* __restrict__ ln_w, const __half* __restrict__ ln_b,
                                                 int vecs, uint4 (&w)[VECS], uint4 (&b)[VECS]) {
#pragma unroll
    for (int j = 0; j < VECS; ++j) {
        const int v = threadIdx.x + j * kLnThreads;
        if (v < vecs) {
            w[j] = *reinterpret_cast<const uint4*>(ln_w + v * 8);
            b[j] = *reinterpret_cast<const uint4*>(ln_b + v * 8);
        }
    }
}

// Layer norm, in place, of one row loaded by load_row, rounded to fp16 (the stored token-shift state is fp16, so
// every consumer sees the same values). w and b: this thread's vectors of the norm's weight and bias.
template <int VECS>
__device__ __forceinline__ void normalize_row(float (&row)[VECS][8], const uint4 (&w)[VECS], const uint4 (&b)[VECS],
                                              int vecs, float* scratch) {
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < VECS; ++j) {
        if (threadIdx.x + j * kLnThreads < vecs) {
#pragma unroll
            for (int e = 0; e < 8; ++e) sum += row[j][e];
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
                const float d = row[j][e] - mean;
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
            for (int e = 0; e < 8; ++e) row[j][e] = round_half((row[j][e] - mean) * rstd * wv[e] + bv[e]);
        }
    }
    __syncthreads();  // scratch is free again
}

template <int VECS>
__device__ __forceinline__ void layer_norm_row(const __half* __restrict__ x, const uint4 (&w)[VECS],
                                               const uint4 (&b)[VECS], int vecs, float (&out)[VECS][8],
                                               float* scratch) {
    load_row(x, vecs, out);
    normalize_row(out, w, b, vecs, scratch);
}

// Asks this multiprocessor's L1 for the line of p ahead of a load (no effect on any value).
__device__ __forceinline__ void prefetch_l1(const void* p) {
#if defined(__CUDA_ARCH__)
    asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
#endif
}

// This thread's vectors of the mixing vectors (weights: no kernel writes them), into L1 before the wait, so that
// write_mixes' loads after the norm are not another round trip to memory.
template <int VECS>
__device__ __forceinline__ void prefetch_mixes(const MixArgs& args, int vecs) {
#pragma unroll
    for (int m = 0; m < kMaxMix; ++m) {
        if (m >= args.count) break;
#pragma unroll
        for (int j = 0; j < VECS; ++j) {
            const int v = threadIdx.x + j * kLnThreads;
            if (v < vecs) prefetch_l1(args.mix[m] + v * 8);
        }
    }
}

// Token t's outputs: out[m][t] = xn + (pv - xn) * mix[m], xn its normalised input, pv the one before it.
template <int VECS>
__device__ __forceinline__ void write_mixes(const MixArgs& args, int64_t t, int C, int vecs,
                                            const float (&xn)[VECS][8], const float (&pv)[VECS][8]) {
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
    load_norm_params(ln_w, ln_b, vecs, w, b);
    const int p = prev[t];
    float pv[VECS][8];
    int64_t last = -1;
    __half* saved = nullptr;  // the slot's shift state when t starts a row with a valid slot
    if (p < 0) {
        const int64_t row = -int64_t(p) - 1;
        const int64_t slot = slots[row];
        last = lasts[row];
        if (slot >= 0 && slot < num_slots) saved = shift + slot * C;  // a bad slot is left alone (its row reads zeros)
        load_row_or_zero(saved, vecs, pv);
    }
    prefetch_mixes<VECS>(args, vecs);
    dependency_wait();

    float xn[VECS][8];
    layer_norm_row(x + t * C, w, b, vecs, xn, scratch);
    if (p >= 0) {
        layer_norm_row(x + int64_t(p) * C, w, b, vecs, pv, scratch);
    } else if (saved) {
        // The new shift state: the normalised input of the row's last token. Each thread writes
        // exactly the elements it read above, so no barrier is needed between the two.
        if (last == t) {
            store_row(saved, vecs, xn);
        } else {
            float ln_last[VECS][8];
            layer_norm_row(x + last * C, w, b, vecs, ln_last, scratch);
            store_row(saved, vecs, ln_last);
        }
    }
    write_mixes(args, t, C, vecs, xn, pv);
}

// Prompts: a block per kLnSpan consecutive tokens, with ln_shift_mix_kernel's results. Each token is normalised
// once (the per-token kernel normalises the token before it a second time) and the norm's parameters are loaded
// once per span. A row's tokens are packed in order, so prev[t] is t - 1 within a row (PackedBatch.prev_index);
// any other index is normalised on its own. A row start's slot state is read here and its new state, the row's
// last normalised input, written by the same threads, here or when the span reaches that token.
template <int VECS>
__global__ void __launch_bounds__(kLnThreads, VECS <= 2 ? 2 : 1)
ln_shift_mix_span_kernel(int64_t T, int C, int64_t num_slots, const __half* __restrict__ x,
                         const __half* __restrict__ ln_w, const __half* __restrict__ ln_b, __half* __restrict__ shift,
                         const int32_t* __restrict__ prev, const int64_t* __restrict__ slots,
                         const int64_t* __restrict__ lasts, MixArgs args) {
    __shared__ float scratch[2 * kLnThreads / 32];
    const int64_t t0 = int64_t(blockIdx.x) * kLnSpan;
    const int64_t t1 = T - t0 < kLnSpan ? T : t0 + kLnSpan;
    const int vecs = C / 8;
    dependency_wait();

    float before[VECS][8];       // the normalised input before token t (at a row start, the slot's state)
    __half* pending = nullptr;   // a slot whose new state is token pending_last's normalised input
    int64_t pending_last = -1;
#pragma unroll 1
    for (int64_t t = t0; t < t1; ++t) {
        uint4 w[VECS], b[VECS];  // (reloaded per token from L1: held across the span they cost a spill)
        load_norm_params(ln_w, ln_b, vecs, w, b);
        float xn[VECS][8];
        layer_norm_row(x + t * C, w, b, vecs, xn, scratch);
        const int p = prev[t];
        int64_t beyond = -1;  // a row start whose last token lies past the span: that token, normalised below
        if (p < 0) {
            const int64_t row = -int64_t(p) - 1;
            const int64_t slot = slots[row], last = lasts[row];
            __half* saved = slot >= 0 && slot < num_slots ? shift + slot * C : nullptr;  // a bad slot reads zeros
            load_row_or_zero(saved, vecs, before);
            if (saved) {
                pending = saved;
                pending_last = last;
                if (last >= t1) beyond = last;
            }
        } else if (t == t0 || p != t - 1) {
            layer_norm_row(x + int64_t(p) * C, w, b, vecs, before, scratch);
        }  // else: before holds token t - 1's normalised input from the last iteration
        if (t == pending_last) store_row(pending, vecs, xn);
        write_mixes(args, t, C, vecs, xn, before);
#pragma unroll
        for (int j = 0; j < VECS; ++j)
#pragma unroll
            for (int e = 0; e < 8; ++e) before[j][e] = xn[j][e];
        if (beyond >= 0) {  // (in xn's registers, free now)
            layer_norm_row(x + beyond * C, w, b, vecs, xn, scratch);
            store_row(pending, vecs, xn);
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

// The per-token inputs in the order of the kernels that copy them as 16-byte vectors (r, k, v, dw, da, g, dv,
// v_first; layer 0 reads the first six): chunk_input(p, j) is input j, chunk_inputs(p) how many the layer reads.
// Those kernels' loads and the launcher's alignment check (inputs_aligned) go through these.
constexpr int kChunkInputs = 8;
__host__ __device__ __forceinline__ const __half* chunk_input(const TimeMixArgs& p, int j) {
    return j == 0 ? p.r : j == 1 ? p.k : j == 2 ? p.v : j == 3 ? p.dw : j == 4 ? p.da : j == 5 ? p.g : j == 6 ? p.dv
                                                                                                       : p.v_first;
}
__host__ __device__ __forceinline__ int chunk_inputs(const TimeMixArgs& p) { return p.first_layer ? 6 : kChunkInputs; }

// One token's inputs to the time mix at one channel, as floats.
struct TokenInputs {
    float r, k, v, dw, da, dv, g, v_first;
};

// The inputs from input(j), the value of input j in chunk_input's order (layer 0 reads no dv and no v_first).
template <typename Input>
__device__ __forceinline__ TokenInputs token_inputs(const TimeMixArgs& p, Input input) {
    TokenInputs in;
    in.r = input(0);
    in.k = input(1);
    in.v = input(2);
    in.dw = input(3);
    in.da = input(4);
    in.g = input(5);
    in.dv = p.first_layer ? 0.0f : input(6);
    in.v_first = p.first_layer ? 0.0f : input(7);
    return in;
}

__device__ __forceinline__ TokenInputs load_token_inputs(const TimeMixArgs& p, int64_t o) {
    return token_inputs(p, [&](int j) { return h2f(chunk_input(p, j)[o]); });
}

// Row `row` of a time-mix launch: its first and last token and its state slot.
struct TimeMixRow {
    int64_t first, last, slot;
};

__device__ __forceinline__ TimeMixRow time_mix_row(int64_t row, const int64_t* slots, const int64_t* starts,
                                                   const int64_t* lasts) {
    return {starts[row], lasts[row], slots[row]};
}

// The time mix's per-channel parameters at channel col, as floats (v0: 0 in layer 0, which has none).
struct ChannelParams {
    float w0, r_k, lnx_w, lnx_b, a0, k_k, k_a, v0;
};

__device__ __forceinline__ ChannelParams load_channel_params(const TimeMixArgs& p, int64_t col) {
    return {p.w0[col],        p.r_k[col],       p.lnx_w[col],      p.lnx_b[col],
            h2f(p.a0[col]),   h2f(p.k_k[col]),  h2f(p.k_a[col]),   p.first_layer ? 0.0f : h2f(p.v0[col])};
}

// Whether a row's tokens lie in the launch (a nonempty range below num_tokens), and its slot in the pool.
__device__ __forceinline__ bool row_tokens_valid(int64_t first, int64_t last, int64_t num_tokens) {
    return !(last < first || first < 0 || last >= num_tokens);
}
__device__ __forceinline__ bool slot_valid(int64_t slot, int64_t num_slots) { return !(slot < 0 || slot >= num_slots); }

// Whether a row's tokens and slot are usable; stores NaN outputs for a row on a bad slot (its tokens first + offset,
// + stride, ... at channel col), leaving the state alone. Only after dependency_wait: the outputs may still be read
// by the predecessor.
__device__ __forceinline__ bool row_usable(const TimeMixArgs& p, int64_t first, int64_t last, int64_t slot,
                                           int64_t num_slots, int64_t num_tokens, int64_t C, int64_t col, int offset,
                                           int stride) {
    if (!row_tokens_valid(first, last, num_tokens)) return false;  // empty row or bad token range
    if (!slot_valid(slot, num_slots)) {
        for (int64_t t = first + offset; t <= last; t += stride)
            p.out[t * C + col] = __float2half_rn(__int_as_float(0x7fc00000));
        return false;
    }
    return true;
}

// Whether a time-mix block's row has work (values the same for the whole block, so the early return is
// block-uniform). If not, the block waits for its predecessor like any other, then row_usable's stores.
__device__ __forceinline__ bool row_has_work(const TimeMixArgs& p, int64_t first, int64_t last, int64_t slot,
                                             int64_t num_slots, int64_t num_tokens, int64_t C, int64_t col,
                                             int offset, int stride) {
    if (!row_tokens_valid(first, last, num_tokens)) {
        dependency_wait();
        return false;
    }
    if (!slot_valid(slot, num_slots)) {
        dependency_wait();
        return row_usable(p, first, last, slot, num_slots, num_tokens, C, col, offset, stride);  // (false)
    }
    return true;
}

// The decode kernels' shared memory besides the state: a token's key-axis vectors and the reductions' scratch.
struct TimeMixShared {
    __align__(16) float r[N], w[N], k[N], a[N], b[N];
    float scratch[6];
};

// Every token of one row through one head, a thread per state row (s = S[i][:], updated in place) and channel
// col. `in` holds the first token's inputs; each token fetches the next one's before the barrier that ends it.
__device__ __forceinline__ void time_mix_tokens(const TimeMixArgs& p, const ChannelParams& cp, int64_t first,
                                                int64_t last, int64_t C, int64_t col, TokenInputs in, float (&s)[N],
                                                TimeMixShared& sh) {
    const int i = threadIdx.x;
    for (int64_t t = first; t <= last; ++t) {
        const int64_t o = t * C + col;
        const TokenInputs cur = in;
        const float r = cur.r, k = cur.k;
        float v = cur.v;
        const float w = __expf(-kExpMinusHalf * sigmoidf(cp.w0 + cur.dw));
        const float a = sigmoidf(cp.a0 + cur.da);
        const float kkr = k * cp.k_k;
        const float kn = k * (1.0f + (a - 1.0f) * cp.k_a);
        if (p.first_layer) {
            p.v_first[o] = __float2half_rn(v);
        } else {
            v = v + (cur.v_first - v) * sigmoidf(cp.v0 + cur.dv);
        }
        const float norm = sqrtf(block_sum<2>(kkr * kkr, sh.scratch));
        const float kk = kkr / fmaxf(norm, 1e-12f);
        sh.r[i] = r;
        sh.w[i] = w;
        sh.k[i] = kn;
        sh.a[i] = -kk;
        sh.b[i] = kk * a;
        __syncthreads();

        const float y = wkv7::token_step(s, sh.a, sh.w, sh.k, sh.b, sh.r, v);

        // group norm over the head, plus the bonus term sum_j r_j k'_j r_k_j
        const float mean = block_sum<2>(y, sh.scratch + 2) * (1.0f / N);
        const float bonus = block_sum<2>(r * kn * cp.r_k, sh.scratch + 4);
        float var_part = (y - mean) * (y - mean);
        // reuse scratch[0..1]: every thread read it before the barrier inside the mean's block_sum
        const float var = block_sum<2>(var_part, sh.scratch) * (1.0f / N);
        const float yn = (y - mean) * rsqrtf(var + kGroupNormEps) * cp.lnx_w + cp.lnx_b;
        const float res = round_half(yn + bonus * v) * cur.g;
        p.out[o] = __float2half_rn(res);
        if (t < last) in = load_token_inputs(p, o + C);  // in flight across the barrier
        __syncthreads();  // the key-axis buffers and scratch are rewritten by the next token
    }
}

template <typename S>
__global__ void __launch_bounds__(N)
time_mix_kernel(int H, int64_t num_slots, int64_t num_tokens, S* __restrict__ state, const int64_t* __restrict__ slots,
                const int64_t* __restrict__ starts, const int64_t* __restrict__ lasts, TimeMixArgs p) {
    const int h = blockIdx.x % H;
    const int i = threadIdx.x;
    const int64_t C = int64_t(H) * N;
    const int64_t col = int64_t(h) * N + i;

    const auto [first, last, slot] = time_mix_row(blockIdx.x / H, slots, starts, lasts);
    if (!row_has_work(p, first, last, slot, num_slots, num_tokens, C, col, 0, 1)) return;

    __shared__ __align__(16) float tile[N][wkv7::LD];
    __shared__ TimeMixShared sh;

    // The state block (16 KB fp32) and the first token's inputs are loaded together, and each token
    // fetches the next one's inputs before the barrier that ends it: at large batches this kernel moves most
    // of a decode step's bytes, and a block that waited on one load after another left the memory idle.
    S* block = state + (slot * H + h) * N * N;
    wkv7::Staged<S> staged;
    wkv7::block_load(block, staged);  // only this kernel writes the state: safe before the wait

    const ChannelParams cp = load_channel_params(p, col);

    dependency_wait();
    const TokenInputs in = load_token_inputs(p, first * C + col);
    wkv7::staged_to_tile(staged, tile);
    __syncthreads();
    float s[N];
    wkv7::tile_row_to_regs(tile[i], s);

    time_mix_tokens(p, cp, first, last, C, col, in, s, sh);

    __syncthreads();
    wkv7::regs_to_tile_row(s, tile[i]);
    __syncthreads();
    wkv7::tile_to_block(tile, block);
}

// ------------------------------------------------------------------------------------ time_mix, many rows
// At large decode batches time_mix_kernel is bound by its blocks' latency, not by the memory: each block loads
// its state, waits for it, computes and stores, and the eight blocks of 128 registers x 64 threads a multiprocessor
// holds leave the memory idle while they compute (7.2B, batch 256, fp16 state: 3.41 ms of a 10.85 ms step, 2.5 of
// the 4.3 TB/s; bench/results/profile_b256_fp16_state_h200.json). This kernel runs as many blocks as fit at once
// (a multiple of H: a block keeps one head), each walking the (row, head) items with a stride, the next item's
// state block copied into shared memory (cp.async) while the current one is computed. Same math, order and
// rounding as time_mix_kernel (bit for bit; the launcher picks by the grid's size).
__device__ __forceinline__ void copy_async16(void* dst_shared, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(dst_shared));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
#else
    *reinterpret_cast<uint4*>(dst_shared) = *reinterpret_cast<const uint4*>(src);
#endif
}

__device__ __forceinline__ void copy_async8(void* dst_shared, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(dst_shared));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(dst), "l"(src) : "memory");
#else
    *reinterpret_cast<uint2*>(dst_shared) = *reinterpret_cast<const uint2*>(src);
#endif
}

__device__ __forceinline__ void copy_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

template <int PENDING>  // wait until at most PENDING of this thread's newest commit groups are in flight
__device__ __forceinline__ void copy_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
#endif
}

#define FUSED_TIME_MIX_PIPELINED 1  // (asked by the CPU emulator's harness: the HIP port has no such kernel)
template <typename S>
__global__ void __launch_bounds__(N, 8)
time_mix_pipelined_kernel(int H, int64_t num_slots, int64_t num_tokens, int64_t items, S* __restrict__ state,
                          const int64_t* __restrict__ slots, const int64_t* __restrict__ starts,
                          const int64_t* __restrict__ lasts, TimeMixArgs p) {
    // a head's state block in shared memory: row i at i * kRowBytes, padded by 16 bytes so that the 16-byte row
    // reads of every eight consecutive threads fall in different banks
    constexpr int kRowBytes = N * int(sizeof(S)) + 16;
    constexpr int kRowVecs = N * int(sizeof(S)) / 16;  // a state row's 16-byte vectors
    constexpr int kBlockVecs = N * kRowVecs;
    __shared__ __align__(16) unsigned char buf[2][N * kRowBytes];
    __shared__ __align__(16) __half inputs[2][kChunkInputs][N];  // the item's first token's inputs at head h
    __shared__ TimeMixShared sh;
    const int h = blockIdx.x % H;  // gridDim.x % H == 0: every item of the block is on head h
    const int i = threadIdx.x;
    const int64_t C = int64_t(H) * N;
    const int64_t col = int64_t(h) * N + i;
    const int64_t stride = gridDim.x;
    // 16-byte vector f of the state block in buffer b (vector f of the block in global memory)
    auto buffered = [&](int b, int f) { return &buf[b][(f / kRowVecs) * kRowBytes + (f % kRowVecs) * 16]; };
    // where a row's index k lives: its first token (0), last token (1), slot (2)
    auto row_index = [&](int k) { return k == 0 ? starts : k == 1 ? lasts : slots; };

    // Rows of items n .. n + 3 (first, last, slot), a ring by n % 4: item n + 3's is copied while item n is computed,
    // so that no fetch waits for a row's indices (an L2 round trip a block would pay per item).
    __shared__ __align__(8) int64_t rows[4][3];
    auto fetch_row = [&](int64_t item, int64_t (&dst)[3]) {  // threads 0-2, asynchronously
        if (i < 3 && item < items) copy_async8(&dst[i], row_index(i) + item / H);
    };
    // Copies of `item` (its row in `row`) into buffers b when the row has work: its state block (`state_block`) and
    // its first token's inputs (`tokens`: a 16-byte vector per thread; only after dependency_wait).
    auto fetch = [&](int64_t item, const int64_t (&row)[3], int b, bool state_block, bool tokens) {
        const int64_t first = row[0], last = row[1], slot = row[2];
        if (item >= items || !row_tokens_valid(first, last, num_tokens) || !slot_valid(slot, num_slots)) return;
        if (state_block) {
            const unsigned char* src = reinterpret_cast<const unsigned char*>(state + (slot * H + h) * N * N);
#pragma unroll
            for (int c = 0; c < kBlockVecs / N; ++c) {
                const int f = i + N * c;
                copy_async16(buffered(b, f), src + int64_t(f) * 16);
            }
        }
        const int j = i / 8, e = (i % 8) * 8;  // input j, channels e .. e + 7 of the head
        if (tokens && j < chunk_inputs(p)) copy_async16(&inputs[b][j][e], chunk_input(p, j) + first * C + h * N + e);
    };

    // (in shared memory: held in registers across the loop they cost a spill at 128 registers a thread)
    __shared__ ChannelParams channel[N];
    channel[i] = load_channel_params(p, col);
    const ChannelParams& cp = channel[i];
    if (i < 9) {  // the first three items' rows, read directly (no kernel of a step writes them: before the wait)
        const int64_t item = blockIdx.x + (i / 3) * stride;
        if (item < items) rows[i / 3][i % 3] = row_index(i % 3)[item / H];
    }
    __syncthreads();
    fetch(blockIdx.x, rows[0], 0, true, false);  // only this kernel writes the state: safe before the wait
    copy_async_commit();
    dependency_wait();
    fetch(blockIdx.x, rows[0], 0, false, true);
    copy_async_commit();
    // Each iteration commits one group (item n + 1's copies, item n + 3's row), and copy_async_wait<1> leaves
    // exactly that one in flight: item n's copies and item n + 2's row (the group before) have landed.
    int b = 0;
    int n = 0;
    for (int64_t item = blockIdx.x; item < items; item += stride, b ^= 1, ++n) {
        __syncthreads();  // every thread is done with item n - 1: its buffers (b ^ 1) and its row (slot (n + 3) % 4)
        fetch(item + stride, rows[(n + 1) % 4], b ^ 1, true, true);
        fetch_row(item + 3 * stride, rows[(n + 3) % 4]);
        copy_async_commit();
        copy_async_wait<1>();
        __syncthreads();  // the block's copies of this item are in buffers b
        const int64_t first = rows[n % 4][0], last = rows[n % 4][1], slot = rows[n % 4][2];
        if (!row_usable(p, first, last, slot, num_slots, num_tokens, C, col, 0, 1)) continue;
        const TokenInputs in = token_inputs(p, [&](int j) { return h2f(inputs[b][j][i]); });  // from the copies
        unsigned char* row = &buf[b][i * kRowBytes];
        float s[N];
        wkv7::row_to_regs<S>(row, s);

        time_mix_tokens(p, cp, first, last, C, col, in, s, sh);

        wkv7::regs_to_row<S>(s, row);  // (each thread its own row: no barrier before)
        __syncthreads();
        unsigned char* dst = reinterpret_cast<unsigned char*>(state + (slot * H + h) * N * N);
#pragma unroll
        for (int c = 0; c < kBlockVecs / N; ++c) {
            const int f = i + N * c;
            *reinterpret_cast<uint4*>(dst + int64_t(f) * 16) = *reinterpret_cast<const uint4*>(buffered(b, f));
        }
    }
    copy_async_wait<0>();
}

// ------------------------------------------------------------------------------------ time_mix, prefill
// time_mix_kernel walks a row's tokens one after another, each thread doing all of its channel's work, with
// six barriers and a 64-long dot product per token: a prompt alone is bound by that latency (7.2B, 1 x 128
// tokens: 1.66 us per token and layer; the first bench/results/profile_prefill_h200.json, in git history).
// For rows of several tokens this kernel separates what depends on the state from what does not. Per chunk
// of kPrefillChunk tokens:
//   A. in parallel over the chunk's tokens (64 threads per token): decay, gates, kk normalisation, k', v',
//      the bonus sum; the key-axis vectors and v' go to shared memory;
//   B. the recurrence, token after token without a barrier: four threads per state row i, each holding 16
//      of its 64 columns (j = 16c + 4q + e for quarter q, so the float4 reads are conflict-free), the dot
//      products summed over the quad by shuffles;
//   C. in parallel over the tokens again: group norm, bonus, gate, store.
// Five barriers per chunk. Same math and rounding points as time_mix_kernel (only summation orders differ).
constexpr int kPrefillThreads = 4 * N;
constexpr int kPrefillChunk = 8;
// Its blocks are four times as large, with a short chain of work per token: that wins while few blocks share
// a multiprocessor, the 64-thread kernel's small blocks once many do (7.2B on an H200, 64 blocks per prompt:
// 1 x 1024 tokens 47.2 ms against 72.0, 16 x 1024 486 ms against 436; bench/results/decode_h200_prefill.json
// and the git history of that file). Between the two measured points, the estimate is that the 64-thread
// kernel's latency is hidden from about four of its blocks per multiprocessor on.
constexpr unsigned kPrefillMaxBlocks = 512;
constexpr int kPrefillPerPass = kPrefillThreads / N;            // tokens side by side in phases A and C
constexpr int kPrefillPasses = kPrefillChunk / kPrefillPerPass;  // tokens per thread in phases A and C

struct PrefillChunk {  // shared: the chunk's key-axis vectors (r, w, k', -kk, kk*a), v' and y, per token
    float r[kPrefillChunk][N], w[kPrefillChunk][N], k[kPrefillChunk][N], a[kPrefillChunk][N], b[kPrefillChunk][N];
    float v[kPrefillChunk][N], y[kPrefillChunk][N];
    float norm[kPrefillChunk][2], bonus[kPrefillChunk][2], mean[kPrefillChunk][2], var[kPrefillChunk][2];  // per warp
};

// Sum over LANES adjacent lanes (a power of two, groups aligned to it), in every lane of the group: quads of a
// state row, a split-kernel row's threads, a head's 8 lanes in time_mix_finish_kernel.
template <int LANES>
__device__ __forceinline__ float lanes_sum(float v) {
#pragma unroll
    for (int o = 1; o < LANES; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

template <typename S>
__global__ void __launch_bounds__(kPrefillThreads)
time_mix_prefill_kernel(int H, int64_t num_slots, int64_t num_tokens, S* __restrict__ state,
                        const int64_t* __restrict__ slots, const int64_t* __restrict__ starts,
                        const int64_t* __restrict__ lasts, TimeMixArgs p) {
    const int h = blockIdx.x % H;
    const int ci = threadIdx.x % N;         // phases A and C: channel h*64+ci of tokens u0, u0+4, ...
    const int u0 = threadIdx.x / N;
    const int half_head = (threadIdx.x / 32) % 2;  // which of the token's two warps
    const int si = threadIdx.x / 4, q = threadIdx.x % 4;  // phase B: state row si, quarter q
    const int64_t C = int64_t(H) * N;
    const int64_t col = int64_t(h) * N + ci;

    const auto [first, last, slot] = time_mix_row(blockIdx.x / H, slots, starts, lasts);
    if (!row_has_work(p, first, last, slot, num_slots, num_tokens, C, col, u0, kPrefillPerPass)) return;

    // The staging tile is needed before the first chunk and after the last: the chunk buffers share it.
    __shared__ __align__(16) float tile[N][wkv7::LD];
    static_assert(sizeof(PrefillChunk) <= sizeof(tile), "chunk buffers must fit in the staging tile");
    PrefillChunk& buf = *reinterpret_cast<PrefillChunk*>(&tile[0][0]);

    S* block = state + (slot * H + h) * N * N;
    const bool stager = threadIdx.x < N;  // the staging helpers work with 64 threads
    wkv7::Staged<S> staged;
    if (stager) wkv7::block_load(block, staged);  // only this kernel writes the state: safe before the wait

    const auto [w0, r_k, lnx_w, lnx_b, a0, k_k, k_a, v0] = load_channel_params(p, col);

    dependency_wait();
    TokenInputs in[kPrefillPasses];
    // this thread's inputs of the chunk starting at token t0 (a row ending at token end; a parameter, since a
    // structured binding cannot be captured)
    auto fetch = [&](int64_t t0, int64_t end) {
#pragma unroll
        for (int m = 0; m < kPrefillPasses; ++m) {
            const int64_t t = t0 + u0 + m * kPrefillPerPass;
            if (t <= end) in[m] = load_token_inputs(p, t * C + col);
        }
    };
    fetch(first, last);
    if (stager) wkv7::staged_to_tile(staged, tile);
    __syncthreads();
    float s[16];  // s[4c + e] = S[si][16c + 4q + e]
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        const float4 f = *reinterpret_cast<const float4*>(&tile[si][16 * c + 4 * q]);
        s[4 * c + 0] = f.x;
        s[4 * c + 1] = f.y;
        s[4 * c + 2] = f.z;
        s[4 * c + 3] = f.w;
    }
    __syncthreads();  // the tile's memory now holds the chunk buffers

    for (int64_t t0 = first; t0 <= last; t0 += kPrefillChunk) {
        const int count = static_cast<int>(last - t0 + 1 < kPrefillChunk ? last - t0 + 1 : kPrefillChunk);
        // A: per token and channel (tokens past the row's end compute on zeros and store nothing)
        float kkr[kPrefillPasses], kn[kPrefillPasses], vn[kPrefillPasses], bonus[kPrefillPasses], g[kPrefillPasses];
        float r[kPrefillPasses], w[kPrefillPasses], a[kPrefillPasses];
#pragma unroll
        for (int m = 0; m < kPrefillPasses; ++m) {
            const int u = u0 + m * kPrefillPerPass;
            const TokenInputs cur = u < count ? in[m] : TokenInputs{};
            r[m] = cur.r;
            g[m] = cur.g;
            w[m] = __expf(-kExpMinusHalf * sigmoidf(w0 + cur.dw));
            a[m] = sigmoidf(a0 + cur.da);
            kkr[m] = cur.k * k_k;
            kn[m] = cur.k * (1.0f + (a[m] - 1.0f) * k_a);
            vn[m] = cur.v;
            if (p.first_layer) {
                if (u < count) p.v_first[(t0 + u) * C + col] = __float2half_rn(cur.v);
            } else {
                vn[m] = cur.v + (cur.v_first - cur.v) * sigmoidf(v0 + cur.dv);
            }
            const float norm_part = warp_sum(kkr[m] * kkr[m]), bonus_part = warp_sum(r[m] * kn[m] * r_k);
            if (threadIdx.x % 32 == 0) {
                buf.norm[u][half_head] = norm_part;
                buf.bonus[u][half_head] = bonus_part;
            }
        }
        __syncthreads();
#pragma unroll
        for (int m = 0; m < kPrefillPasses; ++m) {
            const int u = u0 + m * kPrefillPerPass;
            const float kk = kkr[m] / fmaxf(sqrtf(buf.norm[u][0] + buf.norm[u][1]), 1e-12f);
            bonus[m] = buf.bonus[u][0] + buf.bonus[u][1];
            buf.r[u][ci] = r[m];
            buf.w[u][ci] = w[m];
            buf.k[u][ci] = kn[m];
            buf.a[u][ci] = -kk;
            buf.b[u][ci] = kk * a[m];
            buf.v[u][ci] = vn[m];
        }
        if (t0 + kPrefillChunk <= last) fetch(t0 + kPrefillChunk, last);  // in flight across phase B
        __syncthreads();

        // B: the recurrence on this thread's quarter row (see token_step in wkv7_state.cuh)
        for (int u = 0; u < count; ++u) {
            const float4 *a4 = reinterpret_cast<const float4*>(buf.a[u]), *w4 = reinterpret_cast<const float4*>(buf.w[u]),
                         *k4 = reinterpret_cast<const float4*>(buf.k[u]), *b4 = reinterpret_cast<const float4*>(buf.b[u]),
                         *r4 = reinterpret_cast<const float4*>(buf.r[u]);
            float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int c = 0; c < 4; ++c) wkv7::dot4(&s[4 * c], a4[4 * c + q], acc);
            const float sa = lanes_sum<4>(wkv7::hsum4(acc));
            const float v = buf.v[u][si];
            float4 out = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int c = 0; c < 4; ++c)
                wkv7::update4(&s[4 * c], w4[4 * c + q], b4[4 * c + q], k4[4 * c + q], r4[4 * c + q], sa, v, out);
            const float y = lanes_sum<4>(wkv7::hsum4(out));
            if (q == 0) buf.y[u][si] = y;
        }
        __syncthreads();

        // C: group norm over the head, bonus, gate (two passes over y, as time_mix_kernel)
        float y[kPrefillPasses], mean[kPrefillPasses];
#pragma unroll
        for (int m = 0; m < kPrefillPasses; ++m) {
            const int u = u0 + m * kPrefillPerPass;
            y[m] = buf.y[u][ci];  // (stale past the row's end: reduced, never stored)
            const float part = warp_sum(y[m]);
            if (threadIdx.x % 32 == 0) buf.mean[u][half_head] = part;
        }
        __syncthreads();
#pragma unroll
        for (int m = 0; m < kPrefillPasses; ++m) {
            const int u = u0 + m * kPrefillPerPass;
            mean[m] = (buf.mean[u][0] + buf.mean[u][1]) * (1.0f / N);
            const float part = warp_sum((y[m] - mean[m]) * (y[m] - mean[m]));
            if (threadIdx.x % 32 == 0) buf.var[u][half_head] = part;
        }
        __syncthreads();
#pragma unroll
        for (int m = 0; m < kPrefillPasses; ++m) {
            const int u = u0 + m * kPrefillPerPass;
            if (u >= count) continue;
            const float var = (buf.var[u][0] + buf.var[u][1]) * (1.0f / N);
            const float yn = (y[m] - mean[m]) * rsqrtf(var + kGroupNormEps) * lnx_w + lnx_b;
            p.out[(t0 + u) * C + col] = __float2half_rn(round_half(yn + bonus[m] * vn[m]) * g[m]);
        }
    }

    __syncthreads();  // the chunk buffers are read for the last time above; the tile takes their memory back
#pragma unroll
    for (int c = 0; c < 4; ++c)
        *reinterpret_cast<float4*>(&tile[si][16 * c + 4 * q]) = make_float4(s[4 * c], s[4 * c + 1], s[4 * c + 2], s[4 * c + 3]);
    __syncthreads();
    if (stager) wkv7::tile_to_block(tile, block);
}

// ------------------------------------------------------------------------------------ tensor cores
// d += A b on the tensor cores (one warp): A 16 x 16 fp16, b 16 x 8 fp16, d 16 x 8 fp32. Fragments of lane
// 4g + t (PTX ISA, mma.m16n8k16, f16x2 registers with the lower k in the lower half):
//   a[0] A[g][2t, 2t+1]   a[1] A[g+8][2t, 2t+1]   a[2] A[g][2t+8, 2t+9]   a[3] A[g+8][2t+8, 2t+9]
//   b0 b[2t, 2t+1][g]     b1 b[2t+8, 2t+9][g]     d[0], d[1] d[g][2t, 2t+1]   d[2], d[3] d[g+8][2t, 2t+1]
__device__ __forceinline__ void mma_16x8x16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__)
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#elif defined(EMU_WARP)
    emu::mma_16x8x16(d, a, b0, b1);  // the CPU emulation's (test/kernel_emu/emu_device.h)
#endif
}

// ------------------------------------------------------------------------------------ time_mix, chunked
// A prefill of many rows (a grid of kPrefillMaxBlocks blocks or more). time_mix_kernel (a state row per thread)
// is bound there by shared-memory bandwidth, not by its barriers: every thread reads the token's five key-axis
// vectors (1,280 bytes) from shared memory for its one row, and with eight blocks per multiprocessor that is
// 655 KB per token step at 128 bytes per cycle, ~2.8 us; 16 x 1,024 tokens of a 7.2B layer took 3.0 ms, 2.9 us
// per token step (bench/results/profile_prefill_h200.json). A first chunked version with a row per thread was
// no faster (bench/results/experiment_prefill_per_token_h200.json). Here each thread holds 4 rows x 16 columns
// of the state (the same 64 registers), so each value read from shared memory serves 4 rows: a quarter of the
// bytes. Per chunk of kChunkTokens tokens (64 threads per (row, head), eight blocks per multiprocessor):
//   load: the 64 threads read the chunk's inputs with 16-byte loads into shared memory (the other blocks on the
//         multiprocessor hide the round trip; holding loads across the recurrence spilled registers);
//   A: per token and channel (thread i = channel i): decay, gates, k', v', and the sums over the head for kk's
//      norm and the bonus, the chunk's tokens side by side (two barriers);
//   B: the recurrence, token after token without a barrier: thread 4g + q holds rows 4g .. 4g + 3 at columns
//      16c + 4q + e (conflict-free float4 reads), the dot products summed over the quad by shuffles (a barrier
//      after the chunk);
//   C: group norm, bonus and gate per token and channel, the chunk's sums side by side (two barriers).
// Same math and rounding points as time_mix_kernel; the dot products over the state rows are summed in another
// order (as in time_mix_prefill_kernel), everything else in the same.
constexpr int kChunkTokens = 8;
constexpr int kChunkRows = 4;    // state rows per thread in phase B

struct ChunkBuffers {  // shared, per token of the chunk: key-axis vectors, v', g and y by channel, per-warp sums
    float r[kChunkTokens][N], w[kChunkTokens][N], k[kChunkTokens][N], a[kChunkTokens][N], b[kChunkTokens][N];
    float v[kChunkTokens][N], g[kChunkTokens][N], y[kChunkTokens][N];
    float norm[kChunkTokens][2], bonus[kChunkTokens][2], mean[kChunkTokens][2], var[kChunkTokens][2];
};


// One thread's share of inputs [J0, J1) of a chunk: 16 bytes (8 channels) of token threadIdx.x / 8 of each;
// zeros past the row's end.
template <int J0, int J1>
struct ChunkLoads {
    uint4 v[J1 - J0];
};

template <int J0, int J1>
__device__ __forceinline__ void load_chunk(const TimeMixArgs& p, int64_t t0, int64_t last, int64_t C, int h,
                                           ChunkLoads<J0, J1>& c) {
    const int64_t t = t0 + threadIdx.x / 8;
    const int64_t o = t * C + int64_t(h) * N + (threadIdx.x % 8) * 8;
    const int inputs = chunk_inputs(p);
#pragma unroll
    for (int j = J0; j < J1; ++j)
        c.v[j - J0] = t <= last && j < inputs ? *reinterpret_cast<const uint4*>(chunk_input(p, j) + o)
                                              : make_uint4(0, 0, 0, 0);
}

template <int J0, int J1>
__device__ __forceinline__ void store_chunk(const ChunkLoads<J0, J1>& c, __half (*in)[kChunkTokens][N]) {
#pragma unroll
    for (int j = J0; j < J1; ++j)
        *reinterpret_cast<uint4*>(&in[j][threadIdx.x / 8][(threadIdx.x % 8) * 8]) = c.v[j - J0];
}

// The state-free values of one token at one channel (time_mix_kernel's formulas): decay w, gate a, the
// unnormalised kk (k * k_k), k' and v' (layer 0: v).
struct ChannelToken {
    float w, a, kkr, kn, vn;
};

__device__ __forceinline__ ChannelToken channel_token(const ChannelParams& cp, float k, float v, float dw, float da,
                                                      float dv, float v_first, int first_layer) {
    ChannelToken o;
    o.w = __expf(-kExpMinusHalf * sigmoidf(cp.w0 + dw));
    o.a = sigmoidf(cp.a0 + da);
    o.kkr = k * cp.k_k;
    o.kn = k * (1.0f + (o.a - 1.0f) * cp.k_a);
    o.vn = first_layer ? v : v + (v_first - v) * sigmoidf(cp.v0 + dv);
    return o;
}

// The tokens of the chunk from token t0 of a row ending at token `last` (at most kChunkTokens)
__device__ __forceinline__ int chunk_count(int64_t t0, int64_t last) {
    return static_cast<int>(last - t0 + 1 < kChunkTokens ? last - t0 + 1 : kChunkTokens);
}

// A of a chunk (time_mix_chunked_kernel): per token at channel col = h * 64 + threadIdx.x of a 64-thread block,
// from the chunk's inputs in shared memory: decay, gates, k', v' and g into buf, and the head's sums for kk's
// norm and the bonus, the chunk's tokens side by side; then -kk and kk * a. Two barriers. Tokens past the row's
// end compute on zeros and store nothing; in layer 0 v_first := v.
__device__ __forceinline__ void chunk_prepare(const TimeMixArgs& p, const __half (*inputs)[kChunkTokens][N],
                                              ChunkBuffers& buf, const ChannelParams& cp, int64_t t0, int count,
                                              int64_t C, int64_t col) {
    const int i = threadIdx.x, warp = threadIdx.x >> 5;
    // (k * k_k and a wait for the norm in buf.a and buf.b at this thread's own channel)
#pragma unroll 2
    for (int u = 0; u < kChunkTokens; ++u) {
        const float r = h2f(inputs[0][u][i]), v = h2f(inputs[2][u][i]);
        const ChannelToken ch = channel_token(cp, h2f(inputs[1][u][i]), v, h2f(inputs[3][u][i]), h2f(inputs[4][u][i]),
                                              h2f(inputs[6][u][i]), h2f(inputs[7][u][i]), p.first_layer);
        if (p.first_layer && u < count) p.v_first[(t0 + u) * C + col] = __float2half_rn(v);
        buf.r[u][i] = r;
        buf.w[u][i] = ch.w;
        buf.k[u][i] = ch.kn;
        buf.v[u][i] = ch.vn;
        buf.g[u][i] = h2f(inputs[5][u][i]);
        buf.a[u][i] = ch.kkr;
        buf.b[u][i] = ch.a;
        const float norm_part = warp_sum(ch.kkr * ch.kkr), bonus_part = warp_sum(r * ch.kn * cp.r_k);
        if ((threadIdx.x & 31) == 0) {
            buf.norm[u][warp] = norm_part;
            buf.bonus[u][warp] = bonus_part;
        }
    }
    __syncthreads();
#pragma unroll
    for (int u = 0; u < kChunkTokens; ++u) {
        const float norm = sqrtf(buf.norm[u][0] + buf.norm[u][1]);
        const float kk = buf.a[u][i] / fmaxf(norm, 1e-12f);
        buf.b[u][i] = kk * buf.b[u][i];
        buf.a[u][i] = -kk;
    }
    __syncthreads();
}

// The inputs of the chunk from token t0 into the inputs' buffer, in two halves: fewer registers.
__device__ __forceinline__ void load_chunk_inputs(const TimeMixArgs& p, int64_t t0, int64_t last, int64_t C, int h,
                                                __half (*inputs)[kChunkTokens][N]) {
    ChunkLoads<0, kChunkInputs / 2> front;
    load_chunk(p, t0, last, C, h, front);
    store_chunk(front, inputs);
    ChunkLoads<kChunkInputs / 2, kChunkInputs> back;
    load_chunk(p, t0, last, C, h, back);
    store_chunk(back, inputs);
}

// C of a chunk (the chunked kernels): group norm over the head (two passes over y, which thread i reads at its
// channel i of buf.y), bonus, gate, and the `count` tokens' outputs stored. Two barriers.
__device__ __forceinline__ void chunk_finish(const TimeMixArgs& p, ChunkBuffers& buf, const ChannelParams& params,
                                             int64_t t0, int count, int64_t C, int64_t col) {
    const int i = threadIdx.x, warp = threadIdx.x >> 5;
    float y[kChunkTokens], mean[kChunkTokens], bonus[kChunkTokens];
#pragma unroll
    for (int u = 0; u < kChunkTokens; ++u) {
        y[u] = buf.y[u][i];
        const float part = warp_sum(y[u]);
        if ((threadIdx.x & 31) == 0) buf.mean[u][warp] = part;
    }
    __syncthreads();
#pragma unroll
    for (int u = 0; u < kChunkTokens; ++u) {
        mean[u] = (buf.mean[u][0] + buf.mean[u][1]) * (1.0f / N);
        bonus[u] = buf.bonus[u][0] + buf.bonus[u][1];  // read before the barrier: the next chunk rewrites it
        const float part = warp_sum((y[u] - mean[u]) * (y[u] - mean[u]));
        if ((threadIdx.x & 31) == 0) buf.var[u][warp] = part;
    }
    __syncthreads();
#pragma unroll
    for (int u = 0; u < kChunkTokens; ++u) {
        if (u >= count) break;
        const float var = (buf.var[u][0] + buf.var[u][1]) * (1.0f / N);
        const float yn = (y[u] - mean[u]) * rsqrtf(var + kGroupNormEps) * params.lnx_w + params.lnx_b;
        p.out[(t0 + u) * C + col] = __float2half_rn(round_half(yn + bonus[u] * buf.v[u][i]) * buf.g[u][i]);
    }
}

template <typename S>
__global__ void __launch_bounds__(N, 8)
time_mix_chunked_kernel(int H, int64_t num_slots, int64_t num_tokens, S* __restrict__ state,
                        const int64_t* __restrict__ slots, const int64_t* __restrict__ starts,
                        const int64_t* __restrict__ lasts, TimeMixArgs p) {
    static_assert(kChunkTokens * 8 == N, "load_chunk: 8 threads per token");
    static_assert(kChunkRows == 4 && N / kChunkRows * 4 == N, "phase B: a quad of threads per 4 rows (float4 of v, y)");
    const int h = blockIdx.x % H;
    const int i = threadIdx.x;
    const int g = i / 4, q = i % 4;  // phase B: state rows 4g .. 4g + 3, columns 16c + 4q + e (c, e < 4)
    const int64_t C = int64_t(H) * N;
    const int64_t col = int64_t(h) * N + i;

    const auto [first, last, slot] = time_mix_row(blockIdx.x / H, slots, starts, lasts);
    if (!row_has_work(p, first, last, slot, num_slots, num_tokens, C, col, 0, 1)) return;

    // The staging tile is needed before the first chunk and after the last: the chunk buffers share it.
    __shared__ __align__(16) float tile[N][wkv7::LD];
    __shared__ __align__(16) __half inputs[kChunkInputs][kChunkTokens][N];
    static_assert(sizeof(ChunkBuffers) <= sizeof(tile), "chunk buffers must fit in the staging tile");
    ChunkBuffers& buf = *reinterpret_cast<ChunkBuffers*>(&tile[0][0]);

    S* block = state + (slot * H + h) * N * N;
    wkv7::Staged<S> staged;
    wkv7::block_load(block, staged);  // only this kernel writes the state: safe before the wait

    const ChannelParams params = load_channel_params(p, col);

    dependency_wait();
    {
        ChunkLoads<0, kChunkInputs> all;
        load_chunk(p, first, last, C, h, all);
        wkv7::staged_to_tile(staged, tile);
        store_chunk(all, inputs);
    }
    __syncthreads();
    float s[kChunkRows][16];  // s[r][4c + e] = S[4g + r][16c + 4q + e]
#pragma unroll
    for (int r = 0; r < kChunkRows; ++r) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const float4 f = *reinterpret_cast<const float4*>(&tile[kChunkRows * g + r][16 * c + 4 * q]);
            s[r][4 * c + 0] = f.x;
            s[r][4 * c + 1] = f.y;
            s[r][4 * c + 2] = f.z;
            s[r][4 * c + 3] = f.w;
        }
    }
    __syncthreads();  // the tile's memory now holds the chunk buffers

    for (int64_t t0 = first; t0 <= last; t0 += kChunkTokens) {
        const int count = chunk_count(t0, last);
        chunk_prepare(p, inputs, buf, params, t0, count, C, col);
        const bool more = t0 + kChunkTokens <= last;

        // B: the recurrence (see the comment above the kernel); v', g and y are kept in shared memory to leave
        // the registers to the state
#pragma unroll
        for (int u = 0; u < kChunkTokens; ++u) {
            if (u >= count) {  // block-uniform
                if (q == 0) *reinterpret_cast<float4*>(&buf.y[u][kChunkRows * g]) = make_float4(0.f, 0.f, 0.f, 0.f);
                continue;
            }
            float sa[kChunkRows] = {}, y[kChunkRows] = {};
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const float4 a4 = *reinterpret_cast<const float4*>(&buf.a[u][16 * c + 4 * q]);
#pragma unroll
                for (int r = 0; r < kChunkRows; ++r) {
                    sa[r] = fmaf(s[r][4 * c + 0], a4.x, sa[r]);
                    sa[r] = fmaf(s[r][4 * c + 1], a4.y, sa[r]);
                    sa[r] = fmaf(s[r][4 * c + 2], a4.z, sa[r]);
                    sa[r] = fmaf(s[r][4 * c + 3], a4.w, sa[r]);
                }
            }
#pragma unroll
            for (int r = 0; r < kChunkRows; ++r) sa[r] = lanes_sum<4>(sa[r]);
            const float4 v4 = *reinterpret_cast<const float4*>(&buf.v[u][kChunkRows * g]);
            const float v[kChunkRows] = {v4.x, v4.y, v4.z, v4.w};
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int j = 16 * c + 4 * q;
                const float4 w4 = *reinterpret_cast<const float4*>(&buf.w[u][j]);
                const float4 b4 = *reinterpret_cast<const float4*>(&buf.b[u][j]);
                const float4 k4 = *reinterpret_cast<const float4*>(&buf.k[u][j]);
                const float4 r4 = *reinterpret_cast<const float4*>(&buf.r[u][j]);
#pragma unroll
                for (int r = 0; r < kChunkRows; ++r) {
                    float4 out = make_float4(0.f, 0.f, 0.f, 0.f);
                    wkv7::update4(&s[r][4 * c], w4, b4, k4, r4, sa[r], v[r], out);
                    y[r] += wkv7::hsum4(out);
                }
            }
#pragma unroll
            for (int r = 0; r < kChunkRows; ++r) y[r] = lanes_sum<4>(y[r]);
            if (q == 0) *reinterpret_cast<float4*>(&buf.y[u][kChunkRows * g]) = make_float4(y[0], y[1], y[2], y[3]);
        }
        if (more) load_chunk_inputs(p, t0 + kChunkTokens, last, C, h, inputs);  // free since A's first barrier
        __syncthreads();  // y of channel i was written by thread i / 4 * 4
        chunk_finish(p, buf, params, t0, count, C, col);
    }

    __syncthreads();  // the chunk buffers are read for the last time above; the tile takes their memory back
#pragma unroll
    for (int r = 0; r < kChunkRows; ++r) {
#pragma unroll
        for (int c = 0; c < 4; ++c)
            *reinterpret_cast<float4*>(&tile[kChunkRows * g + r][16 * c + 4 * q]) =
                make_float4(s[r][4 * c], s[r][4 * c + 1], s[r][4 * c + 2], s[r][4 * c + 3]);
    }
    __syncthreads();
    wkv7::tile_to_block(tile, block);
}

// ------------------------------------------------------------------------------------ time_mix, chunked, tensor cores
// time_mix_chunked_kernel's phase B walks the chunk's 8 tokens one after another, ~80 % of its instructions by a
// count of the source. Here B runs in matrix form, most of it on the tensor cores (mma.m16n8k16: fp16 operands,
// fp32 sums), with the same phases A and C. Per state row i (s: its 64 key columns; the rows share every matrix
// below), token u of the chunk updates s <- s diag(w_u) + (s . a_u) b_u + v_u[i] k'_u and reads y_u[i] = s . r_u
// (a = -kk, b = kk * a).
// With G_u the product of the chunk's decays up to token u (per column; G_-1 = 1; at most 8 factors above 0.545,
// so 1 / G_u < 128) and x_u = (s before token u) . a_u, from the chunk's starting state S0:
//   x_u = S0 (a_u G_{u-1}) + sum_{t<u} Aab[u][t] x_t + Aak[u][t] v_t    Aab[u][t] = (a_u G_{u-1}) . (b_t / G_t)
//   y_u = S0 (r_u G_u) + sum_{t<=u} Arb[u][t] x_t + Ark[u][t] v_t      Aak, Arb, Ark: likewise with k', r
//   S_end = S0 diag(G_7) + sum_t x_t (b_t G_7 / G_t)^T + v_t (k'_t G_7 / G_t)^T
// A block's two warps hold the state in mma accumulator fragments (fp32), 32 rows each. Per chunk:
//   a. thread j (a key column): the decay products and the scaled vectors, in fp32 and (bounded by |a|, |r|,
//      |b|, |k'|) in fp16 for the tensor cores;
//   b. the four 8 x 8 matrices, fp32 on the CUDA cores (one entry of each per thread);
//   c. S0 (a G) and S0 (r G) on the tensor cores, S0 rounded to fp16 from the accumulators;
//   d. thread i (a state row): the triangular solve for x_u, then y_u, in fp32;
//   e. the state update on the tensor cores, [x | v'] (fp16) times [b G / G | k' G / G] (fp16) added to the
//      accumulators scaled by G_7.
// Tokens past the row's end have zero inputs and decay 1, so they change nothing. The state stays fp32 between
// chunks; the fp16 operands put the outputs and the update within ~1e-3 relative of the fp32 recurrence, not
// the last-bit agreement of the other kernels (test_fused_emulated.py gives it tolerances of its own).
// The launcher takes it for time_mix_chunked_kernel's grids (RWKV_TIME_MIX_TC=0: that kernel, for A/B).
#define FUSED_TIME_MIX_TC 1  // (asked by the CPU emulator's harness: the HIP port has no such kernel)
struct TcOperands {  // phase B's fp16 operands and small matrices, in the inputs' buffer (free during B)
    __half ag[kChunkTokens][N + 8], rg[kChunkTokens][N + 8];  // B of c (k = column): a_u G_{u-1}, r_u G_u
    __half bk[N][2 * kChunkTokens];  // B of e, by column j: b_t G_7 / G_t (k = t), k'_t G_7 / G_t (k = 8 + t)
    __half xv[N][2 * kChunkTokens];  // A of e, by row i: x_t (k = t), v'_t (k = 8 + t)
    float mat[4][kChunkTokens][kChunkTokens];  // Aab, Aak, Arb, Ark
    float decay[N];                            // G_7 by column
};

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
    return uint32_t(__half_as_ushort(__float2half_rn(lo))) | (uint32_t(__half_as_ushort(__float2half_rn(hi))) << 16);
}
__device__ __forceinline__ uint32_t half_pair(const __half* p) { return *reinterpret_cast<const uint32_t*>(p); }

// Two adjacent state values S[row][j], S[row][j + 1] <-> fp32 (8 or 4 bytes, aligned)
__device__ __forceinline__ void load_state2(const float* p, float& a, float& b) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    a = __uint_as_float(u.x);
    b = __uint_as_float(u.y);
}
__device__ __forceinline__ void load_state2(const __half* p, float& a, float& b) {
    const uint32_t u = half_pair(p);
    a = h2f(__ushort_as_half(static_cast<unsigned short>(u & 0xffffu)));
    b = h2f(__ushort_as_half(static_cast<unsigned short>(u >> 16)));
}
__device__ __forceinline__ void store_state2(float* p, float a, float b) {
    uint2 u;
    u.x = __float_as_uint(a);
    u.y = __float_as_uint(b);
    *reinterpret_cast<uint2*>(p) = u;
}
__device__ __forceinline__ void store_state2(__half* p, float a, float b) {
    *reinterpret_cast<uint32_t*>(p) = pack_half2(a, b);
}

// The fragment layout of the state: lane 4g + t of warp w holds acc[m][n][e] = S[state_row(m, e)][8n + 2t + e % 2]
// (m < 2, n < 8: the accumulators of mma.m16n8k16, 16 rows x 8 columns each).
__device__ __forceinline__ int state_row(int m, int e) {
    return 32 * (threadIdx.x >> 5) + 16 * m + ((threadIdx.x & 31) >> 2) + 8 * (e / 2);
}
__device__ __forceinline__ int state_column(int n, int e) { return 8 * n + 2 * (threadIdx.x & 3) + e % 2; }

// Calls f(m, n, e, row, column) for each pair of this lane's fragments, acc[m][n][e] and acc[m][n][e + 1] =
// S[row][column], S[row][column + 1].
template <typename F>
__device__ __forceinline__ void for_state_pairs(F&& f) {
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; e += 2) f(m, n, e, state_row(m, e), state_column(n, e));
}

// The block's state into the fragments. An fp32 state directly (8-byte pairs); an fp16 one through shared memory
// (`stage`, free until phase A), with 16-byte loads: 32 4-byte loads per lane beside the 64 fragment registers
// spilled.
template <typename S>
__device__ __forceinline__ void load_state_fragments(const S* block, float (&acc)[2][8][4], void* stage) {
    if constexpr (std::is_same_v<S, float>) {
        for_state_pairs([&](int m, int n, int e, int row, int column) {
            load_state2(block + row * N + column, acc[m][n][e], acc[m][n][e + 1]);
        });
    } else {
        __half(*tile)[N + 8] = static_cast<__half(*)[N + 8]>(stage);  // padded: conflict-free pairs below
#pragma unroll
        for (int k = 0; k < N * N / 8 / N; ++k) {  // 16-byte vectors, N per round
            const int v = threadIdx.x + N * k;
            *reinterpret_cast<uint4*>(&tile[v / 8][(v % 8) * 8]) = *reinterpret_cast<const uint4*>(block + v * 8);
        }
        __syncthreads();
        for_state_pairs([&](int m, int n, int e, int row, int column) {
            load_state2(&tile[row][column], acc[m][n][e], acc[m][n][e + 1]);
        });
        __syncthreads();  // the stage's memory is the chunk buffers'
    }
}

template <typename S>
__device__ __forceinline__ void store_state_fragments(S* block, const float (&acc)[2][8][4]) {
    for_state_pairs([&](int m, int n, int e, int row, int column) {
        store_state2(block + row * N + column, acc[m][n][e], acc[m][n][e + 1]);
    });
}

// a: thread j (column j) turns buf's r, -kk, kk * a and k' of the chunk's tokens into r G_u, a G_{u-1}, b / G_u and
// k' / G_u in place (fp32, for b), writes the fp16 operands of c and e and G_7; buf.w is read for the last time.
__device__ __forceinline__ void tc_scale(ChunkBuffers& buf, TcOperands& op, int count) {
    const int j = threadIdx.x;
    float decay = 1.0f;
#pragma unroll
    for (int u = 0; u < kChunkTokens; ++u) {
        const float before = decay;
        decay *= u < count ? buf.w[u][j] : 1.0f;
        const float inv = 1.0f / decay;
        const float ag = buf.a[u][j] * before, rg = buf.r[u][j] * decay;
        buf.a[u][j] = ag;
        buf.r[u][j] = rg;
        buf.b[u][j] *= inv;
        buf.k[u][j] *= inv;
        op.ag[u][j] = __float2half_rn(ag);
        op.rg[u][j] = __float2half_rn(rg);
    }
    op.decay[j] = decay;
    uint32_t packed[kChunkTokens];  // the row bk[j]: 8 pairs (b and k' / G read back: fewer registers held)
#pragma unroll
    for (int u = 0; u < kChunkTokens; u += 2) {
        packed[u / 2] = pack_half2(buf.b[u][j] * decay, buf.b[u + 1][j] * decay);
        packed[kChunkTokens / 2 + u / 2] = pack_half2(buf.k[u][j] * decay, buf.k[u + 1][j] * decay);
    }
    uint4* row = reinterpret_cast<uint4*>(&op.bk[j][0]);
    row[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    row[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
}

// b: thread (u, t) = (4 warp + lane / 8, lane % 8) computes entry [u][t] of the four matrices (zero above the
// diagonal, and on it for Aab and Aak). Each lane starts its 64-long dot products at its own column block, so
// the 8 lanes of a quarter-warp read 8 different banks' float4s.
__device__ __forceinline__ void tc_matrices(const ChunkBuffers& buf, TcOperands& op) {
    const int lane = threadIdx.x & 31, u = 4 * (threadIdx.x >> 5) + lane / 8, t = lane % 8;
    float ab = 0.0f, ak = 0.0f, rb = 0.0f, rk = 0.0f;
#pragma unroll 4
    for (int c = 0; c < N / 4; ++c) {
        const int j = 4 * ((c + t) % (N / 4));
        const float4 a4 = *reinterpret_cast<const float4*>(&buf.a[u][j]);
        const float4 r4 = *reinterpret_cast<const float4*>(&buf.r[u][j]);
        const float4 b4 = *reinterpret_cast<const float4*>(&buf.b[t][j]);
        const float4 k4 = *reinterpret_cast<const float4*>(&buf.k[t][j]);
        ab += a4.x * b4.x + a4.y * b4.y + a4.z * b4.z + a4.w * b4.w;
        ak += a4.x * k4.x + a4.y * k4.y + a4.z * k4.z + a4.w * k4.w;
        rb += r4.x * b4.x + r4.y * b4.y + r4.z * b4.z + r4.w * b4.w;
        rk += r4.x * k4.x + r4.y * k4.y + r4.z * k4.z + r4.w * k4.w;
    }
    op.mat[0][u][t] = t < u ? ab : 0.0f;
    op.mat[1][u][t] = t < u ? ak : 0.0f;
    op.mat[2][u][t] = t <= u ? rb : 0.0f;
    op.mat[3][u][t] = t <= u ? rk : 0.0f;
}

// c: S0 (a G) into buf.w and S0 (r G) into buf.y, [token][row], for this warp's 32 rows.
__device__ __forceinline__ void tc_history(const float (&acc)[2][8][4], const TcOperands& op, ChunkBuffers& buf) {
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
    for (int m = 0; m < 2; ++m) {
        float x[4] = {0.0f, 0.0f, 0.0f, 0.0f}, y[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int ks = 0; ks < N / 16; ++ks) {  // k: columns 16 ks .. 16 ks + 15, two accumulator tiles
            const uint32_t a[4] = {pack_half2(acc[m][2 * ks][0], acc[m][2 * ks][1]),
                                   pack_half2(acc[m][2 * ks][2], acc[m][2 * ks][3]),
                                   pack_half2(acc[m][2 * ks + 1][0], acc[m][2 * ks + 1][1]),
                                   pack_half2(acc[m][2 * ks + 1][2], acc[m][2 * ks + 1][3])};
            mma_16x8x16(x, a, half_pair(&op.ag[g][16 * ks + 2 * t]), half_pair(&op.ag[g][16 * ks + 8 + 2 * t]));
            mma_16x8x16(y, a, half_pair(&op.rg[g][16 * ks + 2 * t]), half_pair(&op.rg[g][16 * ks + 8 + 2 * t]));
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            buf.w[2 * t + e % 2][state_row(m, e)] = x[e];
            buf.y[2 * t + e % 2][state_row(m, e)] = y[e];
        }
    }
}

// d: thread i (state row i): x_u by forward substitution, y_u (into buf.y), and the row xv[i] for e.
__device__ __forceinline__ void tc_solve(ChunkBuffers& buf, TcOperands& op) {
    const int i = threadIdx.x;
    float x[kChunkTokens], v[kChunkTokens];
#pragma unroll
    for (int u = 0; u < kChunkTokens; ++u) {
        v[u] = buf.v[u][i];
        float sum = buf.w[u][i];
#pragma unroll
        for (int t = 0; t < u; ++t) sum += op.mat[0][u][t] * x[t] + op.mat[1][u][t] * v[t];
        x[u] = sum;
    }
#pragma unroll
    for (int u = 0; u < kChunkTokens; ++u) {
        float sum = buf.y[u][i];
#pragma unroll
        for (int t = 0; t <= u; ++t) sum += op.mat[2][u][t] * x[t] + op.mat[3][u][t] * v[t];
        buf.y[u][i] = sum;
    }
    uint4* row = reinterpret_cast<uint4*>(&op.xv[i][0]);
    row[0] = make_uint4(pack_half2(x[0], x[1]), pack_half2(x[2], x[3]), pack_half2(x[4], x[5]), pack_half2(x[6], x[7]));
    row[1] = make_uint4(pack_half2(v[0], v[1]), pack_half2(v[2], v[3]), pack_half2(v[4], v[5]), pack_half2(v[6], v[7]));
}

// e: acc <- acc diag(G_7) + [x | v'] [b G_7 / G | k' G_7 / G], this warp's 32 rows.
__device__ __forceinline__ void tc_update(float (&acc)[2][8][4], const TcOperands& op) {
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
    for (int m = 0; m < 2; ++m) {
        const int row = state_row(m, 0);
        const uint32_t a[4] = {half_pair(&op.xv[row][2 * t]), half_pair(&op.xv[row + 8][2 * t]),
                               half_pair(&op.xv[row][8 + 2 * t]), half_pair(&op.xv[row + 8][8 + 2 * t])};
#pragma unroll
        for (int n = 0; n < 8; ++n) {
            const float d0 = op.decay[8 * n + 2 * t], d1 = op.decay[8 * n + 2 * t + 1];
            acc[m][n][0] *= d0;
            acc[m][n][1] *= d1;
            acc[m][n][2] *= d0;
            acc[m][n][3] *= d1;
            mma_16x8x16(acc[m][n], a, half_pair(&op.bk[8 * n + g][2 * t]), half_pair(&op.bk[8 * n + g][8 + 2 * t]));
        }
    }
}

template <typename S>
__global__ void __launch_bounds__(N, 8)
time_mix_chunked_tc_kernel(int H, int64_t num_slots, int64_t num_tokens, S* __restrict__ state,
                           const int64_t* __restrict__ slots, const int64_t* __restrict__ starts,
                           const int64_t* __restrict__ lasts, TimeMixArgs p) {
    static_assert(kChunkTokens == 8 && N == 64, "two warps of 32 state rows; 8-token chunks: one n8 / k8 of mma");
    const int h = blockIdx.x % H;
    const int64_t C = int64_t(H) * N;
    const int64_t col = int64_t(h) * N + threadIdx.x;

    const auto [first, last, slot] = time_mix_row(blockIdx.x / H, slots, starts, lasts);
    if (!row_has_work(p, first, last, slot, num_slots, num_tokens, C, col, 0, 1)) return;

    __shared__ __align__(16) ChunkBuffers buf;
    __shared__ __align__(16) __half inputs[kChunkInputs][kChunkTokens][N];
    static_assert(sizeof(TcOperands) <= sizeof(inputs), "phase B's operands must fit in the inputs' buffer");
    TcOperands& op = *reinterpret_cast<TcOperands*>(&inputs[0][0][0]);

    S* block = state + (slot * H + h) * N * N;
    float acc[2][8][4];
    static_assert(sizeof(__half) * N * (N + 8) <= sizeof(ChunkBuffers), "an fp16 state's stage in the buffers");
    load_state_fragments(block, acc, &buf);  // only this kernel writes the state: safe before the wait

    dependency_wait();
    load_chunk_inputs(p, first, last, C, h, inputs);  // (in halves: the state's fragments hold 64 registers)
    __syncthreads();

    for (int64_t t0 = first; t0 <= last; t0 += kChunkTokens) {
        const int count = chunk_count(t0, last);
        // (the channel's parameters are read where they are used, not held across B: registers)
        chunk_prepare(p, inputs, buf, load_channel_params(p, col), t0, count, C, col);  // frees the inputs' buffer
        tc_scale(buf, op, count);
        __syncthreads();
        tc_matrices(buf, op);
        tc_history(acc, op, buf);
        __syncthreads();
        tc_solve(buf, op);
        __syncthreads();  // xv rows of the other threads
        tc_update(acc, op);
        if (t0 + kChunkTokens <= last) {
            __syncthreads();  // the operands in the inputs' buffer are read
            load_chunk_inputs(p, t0 + kChunkTokens, last, C, h, inputs);
        }
        chunk_finish(p, buf, load_channel_params(p, col), t0, count, C, col);  // y of channel i: thread i's
    }
    store_state_fragments(block, acc);
}

// ------------------------------------------------------------------------------------ time_mix, split
// A prompt alone, or a few: one (row, head) block per head leaves most of the multiprocessors idle and each
// block walks 1,024 tokens of a 1k prompt one after another (the 256-thread kernel: 0.78 us per token and layer,
// 25 ms of a 7.2B prompt's 46; bench/results/profile_prefill_h200.json). The state's rows are independent of
// each other until the group norm, so this kernel splits a head's 64 rows over PARTS blocks (2 or 4, split_parts),
// and splits each block's work per chunk of 8 tokens between its warps:
//   B (the first 64 / PARTS * 4 threads): the recurrence on the block's 64 / PARTS rows, a quad of threads per row
//      (16 columns each, as in time_mix_prefill_kernel), the next token's S . a summed in the same pass as this
//      token's S . r, y before the group norm into `y_raw` [T, C] (fp32);
//   A (the last kSplitAWarps warps): meanwhile the next chunk's key-axis vectors and v' (two tokens per warp; lane
//      l at channels l and l + 32, so the head's sums are one warp's), into the other of two buffers, with the
//      inputs of the chunk after that loaded into registers on the way.
// (Measured and not kept, bench/results/experiment_time_mix_layout_h200.json: 8 threads per row, 8 A warps.)
// One barrier per chunk: a chunk takes the longer of A and B instead of their sum (7.2B, 1 x 1,024 tokens: A took
// 0.16 and B 0.26 us per token and layer when the block's 64 threads did one after the other;
// bench/results/experiment_time_mix_phases_h200.json). time_mix_finish_kernel then does the group norm, bonus
// and gate over all of the tokens at once. Same math and rounding points as time_mix_kernel (dot products over
// the state rows summed in another order, as in the other prefill kernels).
constexpr int kRowThreads = 4;                    // B's threads per state row
constexpr int kRowVecs = N / kRowThreads / 4;     // float4s of a state row per thread
constexpr int kSplitAWarps = 4;                   // A's warps
constexpr int kMaxSplitParts = 4;
// A (row, head)'s state rows go to `parts` blocks (split_parts: 2 or 4), each with B threads for N / parts rows.
__host__ __device__ constexpr int split_b_threads(int parts) { return N / parts * kRowThreads; }
__host__ __device__ constexpr int split_threads(int parts) { return split_b_threads(parts) + 32 * kSplitAWarps; }
constexpr int kSplitWarpTokens = kChunkTokens / kSplitAWarps;  // tokens of a chunk per A warp
// (row, head) grids of up to this many blocks take the split kernel: a 7.2B prompt alone or two (64 each), 1.5B's
// of up to four (32 each). At 256 time_mix_prefill_kernel is faster (experiment_prefill_split_ws_rows_h200.json
// against experiment_prefill_split_ws_off_rows_h200.json, 1,024-token rows: 7.2B x2 61.4 ms against 65.9, x4 125.0
// against 118.8; 1.5B x4 31.2 against 36.3, x8 61.7 against 60.6)
constexpr unsigned kSplitMaxBlocks = 128;
constexpr int kFinishTokens = 8;                  // tokens per block of time_mix_finish_kernel

struct SplitBuffers {  // shared, per token of a chunk: the key-axis vectors (r, w, k', -kk, kk*a) and v', by channel
    float r[kChunkTokens][N], w[kChunkTokens][N], k[kChunkTokens][N], a[kChunkTokens][N], b[kChunkTokens][N];
    float v[kChunkTokens][N];
};

// An A lane's inputs (chunk_input's order; g is not read) of its warp's tokens at its two channels.
struct SplitInputs {
    __half x[kSplitWarpTokens][2][kChunkInputs];
};


// Four consecutive state values S[row][j .. j+3] <-> fp32 (16 or 8 bytes, aligned)
__device__ __forceinline__ float4 load_state4(const float* src) { return *reinterpret_cast<const float4*>(src); }
__device__ __forceinline__ float4 load_state4(const __half* src) {
    const uint2 u = *reinterpret_cast<const uint2*>(src);
    __half h[4];
    memcpy(h, &u, sizeof(u));
    return make_float4(h2f(h[0]), h2f(h[1]), h2f(h[2]), h2f(h[3]));
}
__device__ __forceinline__ void store_state4(float* dst, const float* v) {
    *reinterpret_cast<float4*>(dst) = make_float4(v[0], v[1], v[2], v[3]);
}
__device__ __forceinline__ void store_state4(__half* dst, const float* v) {
    const __half h[4] = {__float2half_rn(v[0]), __float2half_rn(v[1]), __float2half_rn(v[2]), __float2half_rn(v[3])};
    uint2 u;
    memcpy(&u, h, sizeof(u));
    *reinterpret_cast<uint2*>(dst) = u;
}

// Thread q of a state row holds columns split_column(q, c) + e of it (c < kRowVecs, e < 4): conflict-free float4s.
__device__ __forceinline__ int split_column(int q, int c) { return 4 * q + 4 * kRowThreads * c; }

// A's loads: the chunk from token t0 (row ending at token `last`), A warp `warp_a`'s tokens, channels col0 and
// col0 + 32; zeros past the row's end.
__device__ __forceinline__ void split_load(const TimeMixArgs& p, int64_t t0, int64_t last, int64_t C, int64_t col0,
                                           int warp_a, SplitInputs& in) {
    const int inputs = chunk_inputs(p);
    const __half zero = __float2half_rn(0.0f);
#pragma unroll
    for (int u = 0; u < kSplitWarpTokens; ++u) {
        const int64_t t = t0 + warp_a * kSplitWarpTokens + u;
#pragma unroll
        for (int e = 0; e < 2; ++e)
#pragma unroll
            for (int j = 0; j < kChunkInputs; ++j)
                in.x[u][e][j] = t <= last && j != 5 && j < inputs ? chunk_input(p, j)[t * C + col0 + 32 * e] : zero;
    }
}

// A: the key-axis vectors and v' of A warp `warp_a`'s tokens of the chunk from token t0 (`count` tokens in the
// row) into buf; in layer 0 v_first := v where store_v_first. No barrier: the head's sums are the warp's.
__device__ __forceinline__ void split_prepare(const TimeMixArgs& p, const SplitInputs& in, SplitBuffers& buf,
                                              const ChannelParams (&cp)[2], int warp_a, int64_t t0, int count,
                                              int64_t C, int64_t col0, bool store_v_first) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int u = 0; u < kSplitWarpTokens; ++u) {
        const int tu = warp_a * kSplitWarpTokens + u;  // the token within the chunk
        ChannelToken ch[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const __half(&x)[kChunkInputs] = in.x[u][e];
            ch[e] = channel_token(cp[e], h2f(x[1]), h2f(x[2]), h2f(x[3]), h2f(x[4]), h2f(x[6]), h2f(x[7]),
                                  p.first_layer);
            if (p.first_layer && store_v_first && tu < count) p.v_first[(t0 + tu) * C + col0 + 32 * e] = x[2];
        }
        // time_mix_kernel's order: the sum over channels 0-31 plus the sum over 32-63
        const float norm = sqrtf(warp_sum(ch[0].kkr * ch[0].kkr) + warp_sum(ch[1].kkr * ch[1].kkr));
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int c = lane + 32 * e;
            const float kk = ch[e].kkr / fmaxf(norm, 1e-12f);
            buf.r[tu][c] = h2f(in.x[u][e][0]);
            buf.w[tu][c] = ch[e].w;
            buf.k[tu][c] = ch[e].kn;
            buf.v[tu][c] = ch[e].vn;
            buf.a[tu][c] = -kk;
            buf.b[tu][c] = kk * ch[e].a;
        }
    }
}

// B for one chunk: the recurrence on this thread's part s of state row `row`, writing y of token u to y_out[u * C]
// (thread q == 0). FULL: the chunk has all its tokens, so no token is guarded by a branch and the compiler may
// issue one token's shared-memory loads during the previous token's shuffles (7.2B prompt: 0.19 against 0.26 us
// per token and layer).
template <bool FULL>
__device__ __forceinline__ void split_recurrence(float (&s)[4 * kRowVecs], const SplitBuffers& buf, int q, int row,
                                                 int count, float* y_out, int64_t C) {
    float sa;
    {
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int c = 0; c < kRowVecs; ++c)
            wkv7::dot4(&s[4 * c], *reinterpret_cast<const float4*>(&buf.a[0][split_column(q, c)]), acc);
        sa = lanes_sum<kRowThreads>(wkv7::hsum4(acc));
    }
#pragma unroll
    for (int u = 0; u < kChunkTokens; ++u) {
        if (!FULL && u >= count) continue;  // (block-uniform; a break kept clang from unrolling)
        const bool more = FULL ? u + 1 < kChunkTokens : u + 1 < count;
        const int next = u + 1 < kChunkTokens ? u + 1 : u;  // (read only when more)
        const float v = buf.v[u][row];
        float4 out = make_float4(0.f, 0.f, 0.f, 0.f), acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int c = 0; c < kRowVecs; ++c) {
            const int j = split_column(q, c);
            wkv7::update4(&s[4 * c], *reinterpret_cast<const float4*>(&buf.w[u][j]),
                          *reinterpret_cast<const float4*>(&buf.b[u][j]),
                          *reinterpret_cast<const float4*>(&buf.k[u][j]),
                          *reinterpret_cast<const float4*>(&buf.r[u][j]), sa, v, out);
            if (more) wkv7::dot4(&s[4 * c], *reinterpret_cast<const float4*>(&buf.a[next][j]), acc);
        }
        const float y = lanes_sum<kRowThreads>(wkv7::hsum4(out));
        sa = lanes_sum<kRowThreads>(wkv7::hsum4(acc));
        if (q == 0) y_out[u * C] = y;
    }
}

template <typename S, int PARTS>
__global__ void __launch_bounds__(split_threads(PARTS))
time_mix_split_kernel(int H, int64_t num_slots, int64_t num_tokens, S* __restrict__ state,
                      const int64_t* __restrict__ slots, const int64_t* __restrict__ starts,
                      const int64_t* __restrict__ lasts, TimeMixArgs p, float* __restrict__ y_raw) {
    constexpr int kBThreads = split_b_threads(PARTS);
    static_assert(kRowVecs * 4 * kRowThreads == N && kBThreads % 32 == 0, "B: whole float4s, whole warps");
    static_assert(kSplitWarpTokens * kSplitAWarps == kChunkTokens, "A: the warps share a chunk's tokens");
    const int part = blockIdx.x % PARTS;
    const int64_t head_block = blockIdx.x / PARTS;  // row * H + head
    const int h = static_cast<int>(head_block % H);
    const bool recurrence = threadIdx.x < kBThreads;  // B's warps (warp-uniform)
    const int i = threadIdx.x % N;
    const int row = part * (N / PARTS) + threadIdx.x / kRowThreads, q = threadIdx.x % kRowThreads;  // B: row, columns
    const int warp_a = static_cast<int>(threadIdx.x / 32) - kBThreads / 32;  // A's warps: 0 .. kSplitAWarps-1
    const int64_t C = int64_t(H) * N;
    const int64_t col0 = int64_t(h) * N + (threadIdx.x & 31);                  // A: channels col0, col0 + 32

    const auto [first, last, slot] = time_mix_row(head_block / H, slots, starts, lasts);
    if (!row_has_work(p, first, last, slot, num_slots, num_tokens, C, int64_t(h) * N + i, 0, 1)) return;

    __shared__ __align__(16) SplitBuffers buf[2];
    S* state_row = state + ((slot * H + h) * N + row) * N;
    float s[4 * kRowVecs];  // B: s[4c + e] = S[row][split_column(q, c) + e]
    ChannelParams cp[2];    // A: at channels col0, col0 + 32
    SplitInputs in;         // A: the next chunk's inputs
    if (recurrence) {
#pragma unroll
        for (int c = 0; c < kRowVecs; ++c) {  // only this block touches these rows: safe before the wait
            const float4 f = load_state4(state_row + split_column(q, c));
            s[4 * c + 0] = f.x;
            s[4 * c + 1] = f.y;
            s[4 * c + 2] = f.z;
            s[4 * c + 3] = f.w;
        }
    } else {
        cp[0] = load_channel_params(p, col0);
        cp[1] = load_channel_params(p, col0 + 32);
    }

    dependency_wait();
    if (!recurrence) {  // the first chunk's A, then the second chunk's loads
        split_load(p, first, last, C, col0, warp_a, in);
        split_prepare(p, in, buf[0], cp, warp_a, first, chunk_count(first, last), C, col0, part == 0);
        if (first + kChunkTokens <= last) split_load(p, first + kChunkTokens, last, C, col0, warp_a, in);
    }
    __syncthreads();
    int cur = 0;
    for (int64_t t0 = first; t0 <= last; t0 += kChunkTokens, cur ^= 1) {
        if (recurrence) {
            const int count = chunk_count(t0, last);
            float* y_out = y_raw + t0 * C + int64_t(h) * N + row;
            if (count == kChunkTokens)  // (block-uniform)
                split_recurrence<true>(s, buf[cur], q, row, count, y_out, C);
            else
                split_recurrence<false>(s, buf[cur], q, row, count, y_out, C);
        } else if (t0 + kChunkTokens <= last) {
            const int64_t t1 = t0 + kChunkTokens;
            split_prepare(p, in, buf[cur ^ 1], cp, warp_a, t1, chunk_count(t1, last), C, col0, part == 0);
            if (t1 + kChunkTokens <= last) split_load(p, t1 + kChunkTokens, last, C, col0, warp_a, in);
        }
        __syncthreads();  // buf[cur ^ 1] is ready for B, buf[cur] free for A
    }

    if (recurrence) {
#pragma unroll
        for (int c = 0; c < kRowVecs; ++c) store_state4(state_row + split_column(q, c), &s[4 * c]);
    }
}

// The rest of the time mix after time_mix_split_kernel, for kFinishTokens tokens of one (row, head) per block
// (block b: (row, head) b % (rows * H), tokens from the row's first + kFinishTokens * (b / (rows * H))): group
// norm of y_raw over the head, the bonus sum_j r_j k'_j r_k_j (k' and v' computed again from the inputs, as in
// chunk_prepare), gate. Thread i takes token i / kFinishLanes of the block's and the 8 channels from
// 8 * (i % kFinishLanes) of the head, with 16-byte loads; a head's sums are over kFinishLanes adjacent lanes, so
// the block needs no barrier (7.2B layer of a 1k prompt: 25.8 us; 41.5 with a channel per thread and two
// barriers per 8 tokens; experiment_time_mix_parts_h200.json, experiment_time_mix_phases_ws_h200.json). Rows the
// split kernel left alone (row_has_work) are skipped.
constexpr int kFinishLanes = N / 8;

__global__ void __launch_bounds__(N)
time_mix_finish_kernel(int H, int64_t rows, int64_t num_slots, int64_t num_tokens, const int64_t* __restrict__ slots,
                       const int64_t* __restrict__ starts, const int64_t* __restrict__ lasts, TimeMixArgs p,
                       const float* __restrict__ y_raw) {
    static_assert(kFinishTokens * kFinishLanes == N, "a block: kFinishTokens tokens of kFinishLanes lanes");
    const int64_t head_block = blockIdx.x % (rows * H);
    const int h = static_cast<int>(head_block % H);
    const int64_t C = int64_t(H) * N;
    const int64_t col = int64_t(h) * N + 8 * (threadIdx.x % kFinishLanes);
    const auto [first, last, slot] = time_mix_row(head_block / H, slots, starts, lasts);
    const int64_t t0 = first + kFinishTokens * int64_t(blockIdx.x / (rows * H)), t = t0 + threadIdx.x / kFinishLanes;
    ChannelParams cp[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) cp[e] = load_channel_params(p, col + e);
    dependency_wait();
    if (!row_tokens_valid(first, last, num_tokens) || !slot_valid(slot, num_slots) || t0 > last) return;
    const bool live = t <= last;  // tokens past the row's end compute on zeros and store nothing

    const int64_t o = t * C + col;
    float x[kChunkInputs][8], y[8];  // x: chunk_input's order (dv and v_first only past layer 0)
#pragma unroll
    for (int j = 0; j < kChunkInputs; ++j) {
        if (live && j < chunk_inputs(p)) {
            load8(chunk_input(p, j) + o, x[j]);
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) x[j][e] = 0.0f;
        }
    }
#pragma unroll
    for (int e = 0; e < 8; e += 4) {
        const float4 f = live ? *reinterpret_cast<const float4*>(y_raw + o + e) : make_float4(0.f, 0.f, 0.f, 0.f);
        y[e] = f.x, y[e + 1] = f.y, y[e + 2] = f.z, y[e + 3] = f.w;
    }
    float vn[8], bonus = 0.0f, mean = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const ChannelToken ch = channel_token(cp[e], x[1][e], x[2][e], x[3][e], x[4][e], x[6][e], x[7][e],
                                              p.first_layer);
        vn[e] = ch.vn;
        bonus += x[0][e] * ch.kn * cp[e].r_k;
        mean += y[e];
    }
    bonus = lanes_sum<kFinishLanes>(bonus);
    mean = lanes_sum<kFinishLanes>(mean) * (1.0f / N);
    float var = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) var += (y[e] - mean) * (y[e] - mean);
    const float rstd = rsqrtf(lanes_sum<kFinishLanes>(var) * (1.0f / N) + kGroupNormEps);
    float out[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const float yn = (y[e] - mean) * rstd * cp[e].lnx_w + cp[e].lnx_b;
        out[e] = round_half(yn + bonus * vn[e]) * x[5][e];
    }
    if (live) store8(p.out + o, out);
}

// ------------------------------------------------------------------------------------ relu_square
// x = relu(x)^2 in place, fp16: the FFN key's activation where cuBLAS computes the product (prefill and large
// batches), one pass over the [T, ffn] matrix where torch's relu_ and square_ take one each (16 x 1,024 tokens
// of a 7.2B model: 2 x 0.27 ms per layer). The same rounding: relu is exact, the square is rounded once.
constexpr int kReluSquareThreads = 256;
constexpr int64_t kReluSquareMaxBlocks = 4096;

__device__ __forceinline__ float relu_square(float x) {
    x = x < 0.0f ? 0.0f : x;  // NaN stays NaN, as torch.relu keeps it (fmaxf would give 0)
    return x * x;
}

__global__ void __launch_bounds__(kReluSquareThreads) relu_square_kernel(__half* x, int64_t n) {
    dependency_wait();
    const int64_t stride = int64_t(gridDim.x) * kReluSquareThreads;
    const int64_t first = int64_t(blockIdx.x) * kReluSquareThreads + threadIdx.x;
    for (int64_t v = first; v < n / 8; v += stride) {
        float f[8];
        load8(x + v * 8, f);
#pragma unroll
        for (int e = 0; e < 8; ++e) f[e] = relu_square(f[e]);
        store8(x + v * 8, f);
    }
    for (int64_t j = n / 8 * 8 + first; j < n; j += stride) x[j] = __float2half_rn(relu_square(h2f(x[j])));
}

inline unsigned relu_square_blocks(int64_t n) {
    const int64_t blocks = (n / 8 + kReluSquareThreads - 1) / kReluSquareThreads;
    return static_cast<unsigned>(blocks < 1 ? 1 : blocks > kReluSquareMaxBlocks ? kReluSquareMaxBlocks : blocks);
}

// ------------------------------------------------------------------------------------ gemv
constexpr int kGemvWarps = 8;
constexpr int kMaxTasks = 12;
constexpr int kGemvMaxRows = 8;

// kWeightInt8Band is the launcher's own: int8 weights read by gemv_int8_band (tensor cores) instead of the
// per-thread int8 code (which the HIP port and RWKV_GEMV_INT8_TC=0 keep).
enum WeightType : int { kWeightHalf = 0, kWeightInt8 = 1, kWeightUint4 = 2, kWeightInt8Band = 3 };
enum Epilogue : int { kEpiNone = 0, kEpiReluSquare = 1, kEpiTanh = 2, kEpiSigmoid = 3 };

struct GemvTask {
    const void* w;           // [N, K] fp16 or int8, row-major (nn.Linear layout); 4-bit: [K/8, N] int32 words
    const __half* scale;     // [N] per output channel (int8 weights); 4-bit: [K/group, N]; else null
    const __half* zero;      // 4-bit: [K/group, N], added after the scale; else null
    const __half* x;         // [M, K]
    __half* y;               // [M, N]
    const __half* residual;  // [M, N] added to the result, or null (may alias y)
    int n, k;
    int group;               // 4-bit: input columns per scale/zero group
    int weight_type, epilogue;
    int splits;              // warps per output channel (1, 2, 4 or 8), each reading one slice of the row;
                             // 4-bit: 1 or 2, a block takes kUint4Band / splits columns
    int rows_per_warp;       // output channels per warp (a power of two; short rows), 32 / rows_per_warp lanes
                             // each; 1 with splits > 1 and for 4-bit tasks
    int first_block;         // blocks [first_block, first_block + gemv_units(task) / kGemvWarps) compute this task
    int promote;             // int8 bands: sums moved out of the tensor cores per vector (see mma_int8_band)
    // Stages of one launch (see task_dependency_wait): a producer task's blocks count themselves done in sync[0];
    // a consumer task's blocks wait until `wait_for` have, then count themselves done in sync[1], and the last of
    // the launch's `consumers` resets both to zero for the next launch.
    unsigned* sync;          // [2], or null for a launch without stages
    int producer;            // 1: a producer task
    int wait_for;            // > 0: a consumer task (the launch's producer blocks)
    int consumers;           // the launch's consumer blocks
    int block_rows;          // gemv_stream_kernel: output channels per block (plan_stream_gemv)
};

struct GemvArgs {
    GemvTask task[kMaxTasks];
    int count;
};

#define FUSED_GEMV_STAGES 1  // (asked by the CPU emulator's harness: the HIP port has no staged launches)
// A launch of two stages: tasks whose inputs are other tasks' outputs of the same launch (the LoRA second halves
// after their first halves), so that they cost no launch of their own. Their blocks come after every producer's in
// the grid, and blocks start in the order of their indices, so the producers run (or have run) while consumers wait:
// a consumer block loads its first weights, then waits for its predecessor kernel (PDL) and for the producers'
// blocks to be done (thread 0 polls the counter, the block's barrier orders the others' loads after it, as a
// cooperative grid barrier does).
__device__ __forceinline__ void task_dependency_wait(const GemvTask& task) {
    dependency_wait();
    if (task.wait_for > 0) {  // block-uniform
        if (threadIdx.x == 0) {
            while (*reinterpret_cast<volatile unsigned*>(task.sync) < unsigned(task.wait_for)) __nanosleep(32);
            __threadfence();
        }
        __syncthreads();
    }
}

// The end of a staged task's block, after its stores (every thread of the block calls it): producers count
// themselves done; consumers too, and the last consumer resets the counters.
__device__ __forceinline__ void finish_task_stage(const GemvTask& task) {
    if (!task.producer && task.wait_for == 0) return;  // block-uniform
    __syncthreads();
    if (threadIdx.x != 0) return;
    __threadfence();
    if (task.producer) {
        atomicAdd(&task.sync[0], 1u);
    } else if (atomicAdd(&task.sync[1], 1u) == unsigned(task.consumers - 1)) {
        task.sync[0] = 0u;  // every producer counted and every consumer past its wait: nothing reads them again
        task.sync[1] = 0u;
    }
}

// Each lane keeps kGemvLoads 16-byte weight loads in flight: the GEMV is a stream of the weights, and at
// batch 1 a matrix takes only microseconds, so the bytes in flight per multiprocessor set its speed.
constexpr int kGemvLoads = 8;

// This lane's next batch of a weight row's 16-byte vectors: [first, first + stride, ...) below end.
// Weights are read once per step: stream them past the caches.
__device__ __forceinline__ void load_weight_batch(const uint4* row, int first, int end, int stride,
                                                  uint4 (&w)[kGemvLoads]) {
#pragma unroll
    for (int j = 0; j < kGemvLoads; ++j) {
        if (first + stride * j < end) w[j] = __ldcs(row + first + stride * j);
    }
}

// acc[m] += the batch's weights . x[m]; fp16 weights: 8 per vector.
template <int M>
__device__ __forceinline__ void fma_half_batch(const GemvTask& task, int first, int end, int stride,
                                               const uint4 (&w)[kGemvLoads], float (&acc)[M]) {
#pragma unroll
    for (int j = 0; j < kGemvLoads; ++j) {
        const int v = first + stride * j;
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
            load8(task.x + int64_t(m) * task.k + k, xf);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[m] = fmaf(wf[e], xf[e], acc[m]);
        }
    }
}

// int8 weights: 16 per vector (the per-channel scale is applied in the epilogue).
template <int M>
__device__ __forceinline__ void fma_int8_batch(const GemvTask& task, int first, int end, int stride,
                                               const uint4 (&w)[kGemvLoads], float (&acc)[M]) {
#pragma unroll
    for (int j = 0; j < kGemvLoads; ++j) {
        const int v = first + stride * j;
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
            load8(task.x + int64_t(m) * task.k + k, xa);
            load8(task.x + int64_t(m) * task.k + k + 8, xb);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[m] = fmaf(wf[e], xa[e], acc[m]);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[m] = fmaf(wf[8 + e], xb[e], acc[m]);
        }
    }
}

// y[m][n] = fp16(epilogue(fp16(product)) + residual[m][n]): the product rounded to fp16 first, as a
// separate matmul would give it. A tanh or sigmoid epilogue gives the LoRA first halves' activations as the
// readable forward rounds them (computed once per value, not by every row of the second half that reads it).
// `add`: whether the task has a residual, `residual` its value here (loaded where the caller chose).
__device__ __forceinline__ __half rounded_output(float product, int epilogue, bool add, float residual) {
    float val = round_half(product);
    if (epilogue == kEpiReluSquare) {
        val = relu_square(val);
    } else if (epilogue == kEpiTanh) {
        val = tanhf(val);
    } else if (epilogue == kEpiSigmoid) {
        val = sigmoidf(val);
    }
    if (add) val += residual;
    return __float2half_rn(val);
}
__device__ __forceinline__ void store_rounded(__half* y, const __half* residual, int64_t o, float product,
                                              int epilogue) {
    y[o] = rounded_output(product, epilogue, residual != nullptr, residual ? __half2float(residual[o]) : 0.0f);
}
__device__ __forceinline__ void store_output(const GemvTask& task, int m, int n, float product) {
    store_rounded(task.y, task.residual, int64_t(m) * task.n + n, product, task.epilogue);
}

// What a thread's output of a band takes besides the sums, (row m, channel first_col + j) with m = threadIdx.x /
// band, j = threadIdx.x % band: the channel's scale (int8 weights; read before the PDL wait, no kernel writes it)
// and the residual (read right after the wait). Loaded at the block's start, while its weights are in flight, they
// are no round trip to memory at its end, after the barrier, where every block of the launch would wait for them.
// Kept in shared memory (the thread that stores its output reads them back): held in registers across the
// block's loop they spilled in the 16-warp blocks.
struct BandOutput {
    float scale, residual;
};
template <int M, int kWidth>
__device__ __forceinline__ void load_band_output(const GemvTask& task, int band, int first_col, bool scaled,
                                                 BandOutput (&out)[M][kWidth]) {
    const int m = threadIdx.x / band, j = threadIdx.x % band;
    const bool stores = m < M && first_col + j < task.n;
    const float scale = scaled && stores ? __half2float(task.scale[first_col + j]) : 1.0f;
    task_dependency_wait(task);
    if (stores) {
        out[m][j].scale = scale;
        out[m][j].residual = task.residual ? __half2float(task.residual[int64_t(m) * task.n + first_col + j]) : 0.0f;
    }
}

// A band's outputs after the barrier, one per thread (as in BandOutput), the WARPS warps' sums added in warp order
// (deterministic), times the channel's scale (1 but for int8); rounded_output.
template <int M, int kWidth, int WARPS>
__device__ __forceinline__ void store_band_sums(const GemvTask& task, const float (&band_sum)[WARPS][M][kWidth],
                                                int band, int first_col, const BandOutput (&out)[M][kWidth]) {
    const int m = threadIdx.x / band, j = threadIdx.x % band;
    if (m >= M || first_col + j >= task.n) return;
    float sum = band_sum[0][m][j];
#pragma unroll
    for (int w = 1; w < WARPS; ++w) sum += band_sum[w][m][j];
    task.y[int64_t(m) * task.n + first_col + j] =
        rounded_output(sum * out[m][j].scale, task.epilogue, task.residual != nullptr, out[m][j].residual);
}

// ---- 4-bit weights: GemLite's A16W4_HQQ_INT layers, read where GemLite's own kernels read them.
// gemlite 0.6 GemLiteLinearTriton.pack (32-bit packing, fma mode, group < in_features) stores
//   w            [K/8, N] int32, contiguous: word (c, n) holds W[n][8c + j] in bits 4j..4j+3 (j = 0..7)
//   scale, zero  [K/group, N] fp16, contiguous; zero = fp16(-zero_point * scale)
// and its kernels rebuild W[n][k] = fp16(q * scale + zero) with one fp16 fma (W_group_mode 4), then
// sum x * W in fp32. Here the weight is rebuilt the same way (__hfma2 rounds once: the same fp16
// value), and the tensor cores sum the products in fp32: the result differs from GemLite's only in the
// order of the fp32 sums.
//
// Why tensor cores: rebuilding a pair of weights takes a shift, a mask, an f16x2 subtract and an f16x2
// fma; a per-thread version with a converted fp32 fma per weight and row of x on top moved 1.67 TB/s
// through a 7.2B layer at batch 1, 1.32 at 2 and 0.66 at 8 (H200; fp16 rows: 3.45). One mma.m16n8k16
// takes 16 channels x 16 k of rebuilt weights (A) and 16 k of up to 8 rows of x (B), 2048 products in one
// instruction whatever the batch size: 0.94 TB/s at 8 (a first version, 32 bytes per lane in flight).
//
// Layout of the work: consecutive output channels are consecutive words, so a block takes a band of 32
// channels (splits == 1: 16-byte loads of 4 channels) or 16 (splits == 2: 8-byte loads of 2) the whole
// depth of K. Lane 4g + t of a warp loads the words of channels 4g.. (2g..) at its rows; the block's 32
// (warp, t) pairs each take a slice of whole groups of rows, so a batch of rows shares one scale/zero
// pair per channel. A word's nibbles (i, i + 4) make the f16x2 pair i; k may be renumbered freely inside
// an mma as long as A and B agree, so lane (g, t) puts pairs 0, 2 of its row at A's k 2t, 2t + 1 and
// pairs 1, 3 at 2t + 8, 2t + 9 (two mmas per pair of channels), and gives B the same k of x row g. The
// warps' sums are added in warp order through shared memory: deterministic.
constexpr int kUint4Band = 32;      // output channels per block at splits == 1
constexpr int kUint4MaxSplits = 2;  // 16 channels at the most
constexpr int kUint4SplitMinK = 2048;  // only long rows are worth the narrower loads of a halved band
// ... and only in launches of fewer blocks of full bands than this. With more (7.2B's r/k/v with the LoRAs, 488
// blocks, 712 with their staged second halves, and FFN key, 512) full bands, whose one-row loop issues a sixth fewer
// instructions a word, beat halving on the H200 (12.7 against 14.6 us, 13.3 against 16.2); with fewer (7.2B's output
// and FFN value, 128; 1.5B's layer launches, 328 at most) halving won (5.5 against 5.9 us, 15.1 against 18.5; 1.5B
// W4 batch 1 1,129 against 976 tok/s with every launch on full bands). The head (2,048 at either size) keeps full
// bands. W4 7.2B batch 1 +7.5 % on an H100, 1.5B within 0.5 % (bench/results/experiment_ab_tree_k*_h200.json,
// experiment_w4_halve*_h100.json; thirty-eighth session).
constexpr int kUint4HalveBelowBlocks = 448;
// Bytes of words in flight per lane: 4 rows of 16-byte loads, or 8 of 8-byte ones in a halved band (16
// registers either way: see gemv_kernel). With 4 rows of 8 bytes in a halved band (most of a 7.2B layer's
// matrices), a layer at batch 1 took 86 us on an H200, the per-thread version with 64 bytes 76 us.
constexpr int kUint4LaneBytes = 64;

template <int kWords>
struct Uint4Lane;  // a lane's words of one row of words, and its scales (or zeros) of one group
template <>
struct Uint4Lane<4> {
    using Words = uint4;
    using Meta = uint2;
};
template <>
struct Uint4Lane<2> {
    using Words = uint2;
    using Meta = uint32_t;
};
__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}
__device__ __forceinline__ uint32_t word_of(const uint2& v, int i) { return i == 0 ? v.x : v.y; }
__device__ __forceinline__ uint32_t word_of(uint32_t v, int) { return v; }

__device__ __forceinline__ __half2 as_half2(uint32_t bits) {
    __half2 h;
    memcpy(&h, &bits, sizeof(h));
    return h;
}
__device__ __forceinline__ uint32_t half2_bits(__half2 h) {
    uint32_t bits;
    memcpy(&bits, &h, sizeof(bits));
    return bits;
}

// (a & kMask) | 0x64006400 (nibbles under the exponent of 1024) as one LOP3: written plainly, the compiler splits it
// in two, one immediate per instruction.
template <uint32_t kMask>
__device__ __forceinline__ uint32_t under_1024(uint32_t a) {
#if defined(__CUDA_ARCH__)
    uint32_t d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "n"(kMask), "n"(0x64006400u));
    return d;
#else
    return (a & kMask) | 0x64006400u;
#endif
}

// The 4 f16x2 pairs of one word of one channel: pair i = (W[8c + i], W[8c + i + 4]) = fp16(q * scale + zero).
// Nibbles i and i + 4 go under the exponent of 1024 in the two halves (exactly 1024 + q), 1024 comes off
// exactly, and one __hfma2 applies the group's scale and zero (both halves: the channel's).
__device__ __forceinline__ void dequant_uint4x8(uint32_t word, __half2 scale, __half2 zero, uint32_t (&pair)[4]) {
    const __half2 bias = as_half2(0x64006400u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const __half2 q = __hsub2(as_half2(((word >> (4 * i)) & 0x000F000Fu) | 0x64006400u), bias);
        pair[i] = half2_bits(__hfma2(q, scale, zero));
    }
}

// The same pairs with one shift per word instead of three: the odd nibbles are masked where they lie (bits 4-7 of
// each half: exactly 1024 + 16q), and one __hfma2 by 1/16 and -64 makes q of them exactly; then the same fma.
__device__ __forceinline__ void dequant_uint4x8_one_shift(uint32_t word, __half2 scale, __half2 zero,
                                                          uint32_t (&pair)[4]) {
    const __half2 bias = as_half2(0x64006400u), sixteenth = as_half2(0x2C002C00u), minus64 = as_half2(0xD400D400u);
    const uint32_t high = word >> 8;
    const __half2 q0 = __hsub2(as_half2(under_1024<0x000F000Fu>(word)), bias);
    const __half2 q1 = __hfma2(as_half2(under_1024<0x00F000F0u>(word)), sixteenth, minus64);
    const __half2 q2 = __hsub2(as_half2(under_1024<0x000F000Fu>(high)), bias);
    const __half2 q3 = __hfma2(as_half2(under_1024<0x00F000F0u>(high)), sixteenth, minus64);
    pair[0] = half2_bits(__hfma2(q0, scale, zero));
    pair[1] = half2_bits(__hfma2(q1, scale, zero));
    pair[2] = half2_bits(__hfma2(q2, scale, zero));
    pair[3] = half2_bits(__hfma2(q3, scale, zero));
}

// x[m][8c .. 8c + 7] as the B pairs of one row of words: pair i = (x[8c + i], x[8c + i + 4]) (the tensor cores'
// operands).
__device__ __forceinline__ void load_x_pairs(const __half* p, uint32_t (&pair)[4]) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    pair[0] = __byte_perm(u.x, u.z, 0x5410);
    pair[1] = __byte_perm(u.x, u.z, 0x7632);
    pair[2] = __byte_perm(u.y, u.w, 0x5410);
    pair[3] = __byte_perm(u.y, u.w, 0x7632);
}

// Up to kLoads rows of words from row c on (all in one group), with the group's scales and zeros;
// rows at or past end, and a lane past the band's channels, read zero words and scales (weights 0: finite
// beside a zero x). Read once per step: streamed past the caches.
template <int kWords>
struct Uint4Batch {
    static constexpr int kLoads = kUint4LaneBytes / (4 * kWords);
    typename Uint4Lane<kWords>::Words w[kLoads];
    typename Uint4Lane<kWords>::Meta scale, zero;
};

template <int kWords>
__device__ __forceinline__ void load_uint4_words(const GemvTask& task, int col, int c, int j, int count, int end,
                                                 Uint4Batch<kWords>& b) {
    using Words = typename Uint4Lane<kWords>::Words;
    const bool mine = col < task.n;  // n % 4 == 0: a lane's channels are all in or all out
    const Words* w = reinterpret_cast<const Words*>(static_cast<const uint32_t*>(task.w) + int64_t(c + j) * task.n + col);
    b.w[j] = mine && j < count && c + j < end ? __ldcs(w) : Words{};
}

// The scales and zeros of group `group` (the caller's count of row c's group: no division per batch).
template <int kWords>
__device__ __forceinline__ void load_uint4_meta(const GemvTask& task, int col, int c, int group, int end,
                                                Uint4Batch<kWords>& b) {
    using Meta = typename Uint4Lane<kWords>::Meta;
    const bool mine = col < task.n;
    const int64_t meta = int64_t(group) * task.n + col;
    b.scale = mine && c < end ? __ldcs(reinterpret_cast<const Meta*>(task.scale + meta)) : Meta{};
    b.zero = mine && c < end ? __ldcs(reinterpret_cast<const Meta*>(task.zero + meta)) : Meta{};
}

template <int kWords>
__device__ __forceinline__ void load_uint4_batch(const GemvTask& task, int col, int c, int group, int count, int end,
                                                 Uint4Batch<kWords>& b) {
#pragma unroll
    for (int j = 0; j < b.kLoads; ++j) load_uint4_words(task, col, c, j, count, end, b);
    load_uint4_meta(task, col, c, group, end, b);
}

// Channel i's scale and zero of the batch b in both halves of a pair.
template <int kWords>
__device__ __forceinline__ void spread_uint4_meta(const Uint4Batch<kWords>& b, __half2 (&scale)[kWords],
                                                  __half2 (&zero)[kWords]) {
#pragma unroll
    for (int i = 0; i < kWords; ++i) {
        const unsigned dup = i % 2 ? 0x3232u : 0x1010u;
        scale[i] = as_half2(__byte_perm(word_of(b.scale, i / 2), 0u, dup));
        zero[i] = as_half2(__byte_perm(word_of(b.zero, i / 2), 0u, dup));
    }
}

// d[i / 2] += the products of one row of the lane's words (channel pair i / 2, see above) with x's pairs of that row.
// At one row the nibbles are taken with one shift a word (dequant_uint4x8_one_shift; the same weights).
template <int M, int kWords>
__device__ __forceinline__ void mma_uint4_words(const typename Uint4Lane<kWords>::Words& w,
                                                const __half2 (&scale)[kWords], const __half2 (&zero)[kWords],
                                                const uint32_t (&x)[4], float (&d)[kWords / 2][4]) {
#pragma unroll
    for (int h = 0; h < kWords / 2; ++h) {
        uint32_t lo[4], hi[4];  // channels 2h (A's row g) and 2h + 1 (row g + 8)
        if constexpr (M == 1) {
            dequant_uint4x8_one_shift(word_of(w, 2 * h), scale[2 * h], zero[2 * h], lo);
            dequant_uint4x8_one_shift(word_of(w, 2 * h + 1), scale[2 * h + 1], zero[2 * h + 1], hi);
        } else {
            dequant_uint4x8(word_of(w, 2 * h), scale[2 * h], zero[2 * h], lo);
            dequant_uint4x8(word_of(w, 2 * h + 1), scale[2 * h + 1], zero[2 * h + 1], hi);
        }
        const uint32_t a0[4] = {lo[0], hi[0], lo[1], hi[1]}, a1[4] = {lo[2], hi[2], lo[3], hi[3]};
        mma_16x8x16(d[h], a0, x[0], x[1]);
        mma_16x8x16(d[h], a1, x[2], x[3]);
    }
}

// d[i / 2] += the batch's products for the lane's channel pair i / 2 (see above), `count` rows from c on. next >= 0:
// b is refilled with the batch from row `next` on (load_uint4_batch; its group next_group) as its values are used.
template <int M, int kWords>
__device__ __forceinline__ void mma_uint4_batch(const GemvTask& task, int c, int count, int end, int g, int col,
                                                int next, int next_group, Uint4Batch<kWords>& b,
                                                float (&d)[kWords / 2][4]) {
    __half2 scale[kWords], zero[kWords];
    spread_uint4_meta(b, scale, zero);
    if (next >= 0) load_uint4_meta(task, col, next, next_group, end, b);  // first: the next batch starts with them
#pragma unroll
    for (int j = 0; j < b.kLoads; ++j) {
        if (j >= count) break;  // block-uniform: every lane reaches every mma
        uint32_t x[4] = {0u, 0u, 0u, 0u};  // x row g (whatever the lane's channels), zeros past M or the rows
        if (g < M && c + j < end) load_x_pairs(task.x + int64_t(g) * task.k + (c + j) * 8, x);
        mma_uint4_words<M, kWords>(b.w[j], scale, zero, x, d);
        if (next >= 0) load_uint4_words(task, col, next, j, count, end, b);
    }
}

// At one row of x with whole batches (a batch's rows divide its group: GemLite's groups of 64 and more), the band's
// loop takes no bound per row: rows 0.. of channel 0 with a zero scale and zero stand for a lane's rows past its
// slice and for channels past n, so their weights rebuild to exactly 0 and add nothing (their x, row 0's, is
// finite). The same operations in the same order as mma_uint4_batch, so the same sums, without its bound checks,
// predicated loads and counts per row: a batch of 16 words, 337 SASS instructions instead of 403 (16-byte words)
// and 394 instead of 499 (8-byte words), 0 spills at 64 registers. Offsets, not pointers, and x loaded by the lanes
// of B's column 0 only: 64-bit pointers, or x loaded by every lane, spilled.
struct Uint4Rows {  // where a lane's batch lies (32-bit offsets: fewer registers)
    int words;  // its words of the batch's first row, in words of its kWords channels (row j: + j * n / kWords)
    int row;    // that row (x's 8 values: 16-byte vector `row` of x)
    int meta;   // the batch's scales and zeros: task.scale / task.zero + meta
    bool live;  // false: rows past the lane's slice or channels past n (see above)
};

template <int kWords>
__device__ __forceinline__ Uint4Rows uint4_rows(const GemvTask& task, int col, int c, int group, int end) {
    const bool live = col < task.n && c < end;
    const int row = live ? c : 0, channel = live ? col : 0;  // (K / 8 * n < 2^31: gemv_takes)
    return {(row * task.n + channel) / kWords, row, group * task.n + channel, live};
}

template <int kWords>
__device__ __forceinline__ void load_uint4_meta(const GemvTask& task, const Uint4Rows& r, Uint4Batch<kWords>& b) {
    using Meta = typename Uint4Lane<kWords>::Meta;
    b.scale = r.live ? __ldcs(reinterpret_cast<const Meta*>(task.scale + r.meta)) : Meta{};
    b.zero = r.live ? __ldcs(reinterpret_cast<const Meta*>(task.zero + r.meta)) : Meta{};
}

template <int kWords>
__device__ __forceinline__ const typename Uint4Lane<kWords>::Words* uint4_words(const GemvTask& task) {
    return static_cast<const typename Uint4Lane<kWords>::Words*>(task.w);
}

template <int kWords>
__device__ __forceinline__ void load_uint4_rows(const GemvTask& task, const Uint4Rows& r, Uint4Batch<kWords>& b) {
    const int stride = task.n / kWords;
#pragma unroll
    for (int j = 0; j < b.kLoads; ++j) b.w[j] = __ldcs(uint4_words<kWords>(task) + (r.words + j * stride));
    load_uint4_meta(task, r, b);
}

// d += the batch b (rows r) at one row of x; `more`: b is refilled with the rows `next` as its values are used
// (the compiler issues those loads at the batch's end: a rolling refill gained 0.6 %, twenty-first session).
template <int kWords>
__device__ __forceinline__ void mma_uint4_rows(const GemvTask& task, int g, const Uint4Rows& r, bool more,
                                               const Uint4Rows& next, Uint4Batch<kWords>& b,
                                               float (&d)[kWords / 2][4]) {
    __half2 scale[kWords], zero[kWords];
    spread_uint4_meta(b, scale, zero);
    if (more) load_uint4_meta(task, next, b);
    const int stride = task.n / kWords;
#pragma unroll
    for (int j = 0; j < b.kLoads; ++j) {
        uint32_t x[4] = {0u, 0u, 0u, 0u};  // B's column g: only column 0 is stored
        if (g == 0) load_x_pairs(task.x + (r.row + j) * 8, x);
        mma_uint4_words<1, kWords>(b.w[j], scale, zero, x, d);
        if (more) b.w[j] = __ldcs(uint4_words<kWords>(task) + (next.words + j * stride));
    }
}

// One block of WARPS warps of a 4-bit task with kWords channels per lane (see above). Every thread reaches the
// barrier.
template <int M, int kWords, int WARPS>
__device__ __forceinline__ void gemv_uint4_band(const GemvTask& task, float (&band_sum)[WARPS][M][kUint4Band],
                                                BandOutput (&out)[M][kUint4Band]) {
    constexpr int kBand = 8 * kWords;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int first_col = (int(blockIdx.x) - task.first_block) * kBand;
    const int col = first_col + kWords * g;
    const int rows = task.k / 8, group_rows = task.group / 8;
    // 4 * WARPS slices of whole groups; a batch of rows divides a group (the largest power of two that does)
    const int slice = (rows + 4 * WARPS * group_rows - 1) / (4 * WARPS * group_rows) * group_rows;
    const int begin = min((4 * warp + t) * slice, rows), end = min(begin + slice, rows);
    const int count = min(Uint4Batch<kWords>::kLoads, group_rows & -group_rows);
    const bool busy = 4 * warp * slice < rows;  // warp-uniform: a warp past the last row has nothing to add
    // the group of the batch's rows, counted as the batches go at one row (a batch lies in one group)
    const int batches_per_group = group_rows / count;
    int group = begin / group_rows, batches_left = batches_per_group;
    Uint4Batch<kWords> b;
    const bool whole = M == 1 && count == Uint4Batch<kWords>::kLoads;  // task-uniform: see uint4_rows
    Uint4Rows at = uint4_rows<kWords>(task, col, begin, group, end);
    if (busy && whole) {  // weights: load before the wait
        load_uint4_rows(task, at, b);
    } else if (busy) {
        load_uint4_batch(task, col, begin, group, count, end, b);
    }
    load_band_output<M>(task, kBand, first_col, false, out);

    float d[kWords / 2][4];
#pragma unroll
    for (int h = 0; h < kWords / 2; ++h) {
#pragma unroll
        for (int e = 0; e < 4; ++e) d[h][e] = 0.0f;
    }
    if (busy) {
        // Rolling loads: each word of the next batch is asked for as soon as the word it replaces is rebuilt, so a
        // lane's loads stay in flight while it computes. H200, 7.2B W4 batch 1 / 2: 390.1 / 682.7 tok/s against
        // 387.9 / 675.0 loading the next batch after the whole current one; the int8 bands lost 5-8 % that way
        // (bench/results/experiment_gemv_rolling{1,0}_*_h200.json) and keep whole batches. Not in 16-warp blocks
        // at 8 rows, whose 64 registers then spill.
        constexpr bool rolling = M < 8 || WARPS == kGemvWarps;
        if constexpr (M == 1) {
            if (whole) {
#pragma unroll 1
                for (int c = begin, last = begin + slice; c < last;) {
                    const int next = c + count;
                    const bool new_group = batches_left == 1;
                    const int next_group = new_group ? group + 1 : group;
                    const Uint4Rows next_rows = uint4_rows<kWords>(task, col, next, next_group, end);
                    mma_uint4_rows<kWords>(task, g, at, next < last, next_rows, b, d);
                    at = next_rows;
                    c = next;
                    group = next_group;
                    batches_left = new_group ? batches_per_group : batches_left - 1;
                }
            }
        }
#pragma unroll 1
        for (int c = whole ? begin + slice : begin, last = begin + slice; c < last;) {  // (whole: done above)
            const int next = c + count;
            const bool new_group = batches_left == 1;
            // counted at one row; a division at more rows, whose 16-warp kernels spill with the counters held
            const int next_group = M == 1 ? (new_group ? group + 1 : group) : next / group_rows;
            mma_uint4_batch<M, kWords>(task, c, count, end, g, col, rolling && next < last ? next : -1, next_group, b,
                                       d);
            if (!rolling && next < last) load_uint4_batch(task, col, next, next_group, count, end, b);
            c = next;
            group = next_group;
            batches_left = new_group ? batches_per_group : batches_left - 1;
        }
    }
    // Lane (g, t) holds rows m = 2t, 2t + 1 of x for channels col + i (d[i / 2][i % 2 * 2 + m % 2]).
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const int m = 2 * t + e;
        if (m >= M) break;
#pragma unroll
        for (int i = 0; i < kWords; ++i) band_sum[warp][m][kWords * g + i] = d[i / 2][i % 2 * 2 + e];
    }
    __syncthreads();
    store_band_sums<M>(task, band_sum, kBand, first_col, out);
}

template <int M, int WARPS>
__device__ __forceinline__ void gemv_uint4_block(const GemvTask& task) {
    __shared__ float band_sum[WARPS][M][kUint4Band];
    __shared__ BandOutput out[M][kUint4Band];
    if (task.splits == 1) {
        gemv_uint4_band<M, 4, WARPS>(task, band_sum, out);
    } else {
        gemv_uint4_band<M, 2, WARPS>(task, band_sum, out);
    }
}

// ---- int8 weights on the tensor cores (kWeightInt8Band). The per-thread int8 code above spends ~4
// instructions per weight (byte to float, subtract, fp32 fma, x converted per row) and moved 2.3-2.8 TB/s
// through a 7.2B layer at batch 1, against 3.2-3.8 for fp16 rows (bench/results/profile_nopdl_w8_h200.json):
// bound by instructions, not by memory. Here a pair of weights takes one PRMT and one f16x2 subtract (int8
// is exact in fp16), and one mma.m16n8k16 takes 256 weights times up to 8 rows of x: the products are exact
// (int8 x fp16) and summed in fp32, as the per-thread code sums them, in another order.
//
// Layout of the work: a block takes a band of kInt8Band = 16 output channels (an mma's rows), its 8 warps
// slices of K (whole quads of 16-byte vectors). Lane (g, t) loads vectors t, t + 4, ... of the slice for
// channels g and g + 8 (64 contiguous bytes per channel and load), kInt8Loads of each in flight. A vector's
// 16 k-values of one channel make the lane's k of 4 mmas: mma s takes the vector's bytes 4s .. 4s + 3, its
// A pairs (2t, 2t + 1) and (2t + 8, 2t + 9) = bytes (4s, 4s + 1) and (4s + 2, 4s + 3), and B the same k of
// x row g (8 contiguous bytes of x: no shuffling). The warps' sums are added in warp order: deterministic.
constexpr int kInt8Band = 16;
constexpr int kInt8Loads = 3;  // vectors per channel and lane in flight: 2 x 3 x 16 bytes (4: a spill at one row)

// Vectors first, first + 4, ... below end of the lane's two channels (none past the task's channels: zero
// weights, as past end). Read once per step: streamed past the caches.
__device__ __forceinline__ void load_int8_band(const uint4* lo, const uint4* hi, bool lo_ok, bool hi_ok, int first,
                                               int end, uint4 (&w)[2][kInt8Loads]) {
#pragma unroll
    for (int j = 0; j < kInt8Loads; ++j) {
        const int v = first + 4 * j;
        w[0][j] = lo_ok && v < end ? __ldcs(lo + v) : uint4{};
        w[1][j] = hi_ok && v < end ? __ldcs(hi + v) : uint4{};
    }
}

// Two int8 of a word (as b + 128: the word XOR 0x80808080) as an exact f16x2: PRMT puts each byte under the
// exponent of 1024 (0x64XX = 1024 + XX), and 1152 comes off. selector 0x4140: bytes 0, 1; 0x4342: bytes 2, 3.
__device__ __forceinline__ uint32_t int8_pair(uint32_t biased, unsigned selector) {
    const __half2 v = as_half2(__byte_perm(biased, 0x64646464u, selector));
    return half2_bits(__hsub2(v, as_half2(0x64806480u)));
}

// d += one vector's products (see above): its 4 mmas, x row g's 16 values in xv.
__device__ __forceinline__ void mma_int8_vector(const uint4& lo_w, const uint4& hi_w, const uint4 (&xv)[2],
                                                float (&d)[4]) {
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        const uint32_t lo = word_of(lo_w, s) ^ 0x80808080u, hi = word_of(hi_w, s) ^ 0x80808080u;
        const uint32_t a[4] = {int8_pair(lo, 0x4140u), int8_pair(hi, 0x4140u), int8_pair(lo, 0x4342u),
                               int8_pair(hi, 0x4342u)};
        mma_16x8x16(d, a, word_of(xv[s / 2], 2 * (s % 2)), word_of(xv[s / 2], 2 * (s % 2) + 1));
    }
}

// d += the batch's products: vectors c + t, c + t + 4, ... below end, x row g (zero past M). promote: each
// vector's mmas sum from zero and the lane adds that to d in fp32, so the tensor cores never add a product
// to a long running sum (whose alignment drops the product's low bits); else d accumulates in the mmas.
template <int M>
__device__ __forceinline__ void mma_int8_band(const GemvTask& task, int c, int end, int g, int t,
                                              const uint4 (&w)[2][kInt8Loads], float (&d)[4]) {
#pragma unroll
    for (int j = 0; j < kInt8Loads; ++j) {
        if (c + 4 * j >= end) break;  // warp-uniform: every lane reaches every mma
        const int v = c + 4 * j + t;
        uint4 xv[2] = {uint4{}, uint4{}};
        if (g < M && v < end) {
            const uint4* p = reinterpret_cast<const uint4*>(task.x + int64_t(g) * task.k) + 2 * v;
            xv[0] = p[0];
            xv[1] = p[1];
        }
        if (task.promote) {  // task-uniform
            float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            mma_int8_vector(w[0][j], w[1][j], xv, part);
#pragma unroll
            for (int e = 0; e < 4; ++e) d[e] += part[e];
        } else {
            mma_int8_vector(w[0][j], w[1][j], xv, d);
        }
    }
}

// One block of WARPS warps of an int8 band task. Every thread reaches the barrier.
template <int M, int WARPS>
__device__ __forceinline__ void gemv_int8_band(const GemvTask& task) {
    __shared__ float band_sum[WARPS][M][kInt8Band];
    __shared__ BandOutput out[M][kInt8Band];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int first_col = (int(blockIdx.x) - task.first_block) * kInt8Band;
    const int count = task.k / 16;  // 16-byte vectors per channel
    const int slice = (count + 4 * WARPS - 1) / (4 * WARPS) * 4;
    const int begin = min(warp * slice, count), end = min(begin + slice, count);
    const bool lo_ok = first_col + g < task.n, hi_ok = first_col + g + 8 < task.n;
    const uint4* lo = reinterpret_cast<const uint4*>(task.w) + int64_t(first_col + g) * count;
    const uint4* hi = lo + int64_t(8) * count;
    uint4 w[2][kInt8Loads];
    load_int8_band(lo, hi, lo_ok, hi_ok, begin + t, end, w);  // weights: load before the wait
    load_band_output<M>(task, kInt8Band, first_col, true, out);

    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 1
    for (int c = begin; c < end;) {
        mma_int8_band<M>(task, c, end, g, t, w, d);
        c += 4 * kInt8Loads;
        if (c < end) load_int8_band(lo, hi, lo_ok, hi_ok, c + t, end, w);
    }
    // Lane (g, t) holds rows m = 2t, 2t + 1 of x for channels g (d[0], d[1]) and g + 8 (d[2], d[3]).
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const int m = 2 * t + e;
        if (m >= M) break;
        band_sum[warp][m][g] = d[e];
        band_sum[warp][m][g + 8] = d[2 + e];
    }
    __syncthreads();
    store_band_sums<M>(task, band_sum, kInt8Band, first_col, out);
}

// The task this block computes (block-uniform).
__device__ __forceinline__ const GemvTask& task_of_block(const GemvArgs& args) {
    int t = 0;
#pragma unroll 1
    while (t + 1 < args.count && int(blockIdx.x) >= args.task[t + 1].first_block) ++t;
    return args.task[t];
}

// One block of gemv_kernel's grid: its part of `task` (4-bit and int8 bands, or warps of fp16/int8 rows).
template <int M>
__device__ __forceinline__ void gemv_block(const GemvTask& task) {
    if (task.weight_type == kWeightUint4) {  // block-uniform
        gemv_uint4_block<M, kGemvWarps>(task);
        return;
    }
    if (task.weight_type == kWeightInt8Band) {
        gemv_int8_band<M, kGemvWarps>(task);
        return;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // This warp's (output channels, slice): a block holds whole channels, as kGemvWarps % splits == 0. A
    // warp of short rows takes rows_per_warp channels, `lanes` lanes each (splits is then 1).
    const int lanes = 32 / task.rows_per_warp, sub = lane % lanes;
    const int unit = (int(blockIdx.x) - task.first_block) * kGemvWarps + warp;
    const int n = unit / task.splits * task.rows_per_warp + lane / lanes, split = unit % task.splits;
    const bool active = n < task.n;  // the same for a channel's lanes; idle lanes still join the shuffles
    const int count = task.weight_type == kWeightInt8 ? task.k / 16 : task.k / 8;  // 16-byte vectors per row
    const int slice = count / task.splits;
    const int begin = split * slice, end = begin + slice;
    const uint4* row = reinterpret_cast<const uint4*>(task.w) + int64_t(n) * count;
    // Whole warps stride by a literal 32 (immediate address offsets); a channel of fewer lanes takes one
    // batch of loads at a run-time stride (gemv_rows_per_warp makes one batch enough).
    uint4 w[kGemvLoads];
    if (active) {  // weights: no kernel writes them, load before the wait
        if (lanes == 32) {
            load_weight_batch(row, begin + lane, end, 32, w);
        } else {
            load_weight_batch(row, sub, count, lanes, w);
        }
    }
    // The storing lane's scale (a weight: before the wait) and, at one row, its residual (after it): as BandOutput,
    // no round trip to memory at the block's end (at two rows the 80 registers of 24 warps a multiprocessor spill).
    const bool stores = active && sub == 0 && split == 0;
    const float scale = stores && task.scale ? __half2float(task.scale[n]) : 1.0f;
    task_dependency_wait(task);
    const float residual = M == 1 && stores && task.residual ? __half2float(task.residual[n]) : 0.0f;

    float acc[M];
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = 0.0f;
    if (active && lanes == 32) {
#pragma unroll 1
        for (int first = begin + lane;;) {
            if (task.weight_type == kWeightInt8) {
                fma_int8_batch<M>(task, first, end, 32, w, acc);
            } else {
                fma_half_batch<M>(task, first, end, 32, w, acc);
            }
            first += 32 * kGemvLoads;
            if (first >= end) break;
            load_weight_batch(row, first, end, 32, w);
        }
    } else if (active) {
        if (task.weight_type == kWeightInt8) {
            fma_int8_batch<M>(task, sub, count, lanes, w, acc);
        } else {
            fma_half_batch<M>(task, sub, count, lanes, w, acc);
        }
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {  // over the channel's lanes (the whole warp: warp_sum's order)
        for (int o = lanes / 2; o > 0; o >>= 1) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], o);
    }
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
    if (!active || sub != 0) return;
    if constexpr (M == 1) {
        task.y[n] = rounded_output(acc[0] * scale, task.epilogue, task.residual != nullptr, residual);
    } else {
#pragma unroll
        for (int m = 0; m < M; ++m) store_output(task, m, n, acc[m] * scale);
    }
}

// Registers capped for occupancy: 32 warps per multiprocessor for one row (four blocks), 24 for two, else 16. (The
// fp16/int8 code takes 64 registers at one row by itself; the cap keeps the 4-bit code from raising that.)
template <int M>
__global__ void __launch_bounds__(kGemvWarps * 32, (M == 1 ? 32 : M <= 2 ? 24 : 16) / kGemvWarps)
    gemv_kernel(GemvArgs args) {
    const GemvTask& task = task_of_block(args);
    gemv_block<M>(task);
    finish_task_stage(task);
}

// Launches of few bands (gemv_wide_bands): a band's K over kWideBandWarps warps instead of kGemvWarps. A 7.2B output
// projection or FFN value is 256 bands, two blocks per multiprocessor, each warp streaming a long slice of K alone;
// with twice the warps per band each slice is half as long. 7.2B at one row, per launch (int8; 4-bit):
// output 7.78 -> 6.20 us (6.91 -> 5.98), FFN value 26.23 -> 22.18 (22.49 -> 18.44), but the r/k/v launch (768
// bands) 18.28 -> 22.36 and the FFN key (1,024) 20.44 -> 21.73, whose blocks fill the multiprocessors already
// (bench/results/experiment_gemv_int8_warps8_h200.json against experiment_gemv_int8_warps16_h200.json, one call,
// every launch on 16 warps there). Bands alone fit 64 registers at every row count: two blocks per multiprocessor.
constexpr int kWideBandWarps = 16;
constexpr int kWideBandMaxBlocks = 256;
#define FUSED_WIDE_BANDS 1  // (asked by the CPU emulation's harness: the HIP port has no wide bands)

template <int M>
__global__ void __launch_bounds__(kWideBandWarps * 32, 32 / kWideBandWarps)
    gemv_wide_band_kernel(GemvArgs args) {
    const GemvTask& task = task_of_block(args);
    if (task.weight_type == kWeightUint4) {  // block-uniform; the launcher sends bands only
        gemv_uint4_block<M, kWideBandWarps>(task);
    } else {
        gemv_int8_band<M, kWideBandWarps>(task);
    }
}

// ------------------------------------------------------------------------------------ gemv, streamed
// fp16 rows of one width (K = 2,048 or 4,096), every task fp16, on Hopper. gemv_kernel's warps each load a
// batch of a row into registers, wait a round trip, then sum; at 1.5B's sizes a launch is two or three such waves
// per multiprocessor and each costs a round trip: the r/k/v launch took 12.6 us for 26 MB and the output
// projection 5.9 us for 8.4 MB, 48 % and 33 % of the bandwidth (bench/results/profile_nopdl_sparse_h200.json).
// Here a block streams a run of whole output channels through a ring of kStreamStages stages in shared memory,
// filled by bulk asynchronous copies (cp.async.bulk, completion counted on an mbarrier) that one thread issues:
// the first stages before the PDL wait (weights: no kernel writes them), each later one as soon as every warp
// is done with the stage it replaces. Two blocks a multiprocessor keep 80 KB in flight, and a block (40 KB of
// ring) fits beside the next launch's, which fills its own ring while this one runs.
// Thread i takes the 16-byte vectors i, i + 256, ... of every channel, its x there held in registers (read again
// through L1 for each channel when more than kStreamHeldX rows times vectors); a stage's channel sums are added
// over the warp by shuffles, then over the warps in warp order by the thread that stores the output
// (rounded_output): deterministic, and a row's sum does not depend on the other rows. Whether a launch streams
// depends on its tasks' shapes only (plan_stream_gemv), never on the rows of x, so a row's output is the same
// alone or in a batch. H200, decode tok/s against gemv_kernel in the same call: 1.5B batch 1 868.1 / 825.5,
// batch 2 1,475 / 1,454; 7.2B batch 1 274.3 / 269.0, batch 2 488.4 / 430.8
// (bench/results/experiment_gemv_stream{1,0}_2_h200.json). Above 2 rows fp16 models take cuBLAS: 4 and 8 rows
// streamed lost to it (experiment_gemv_stream_rows8_h200.json). int8 tasks keep their bands: streamed (stages of
// 1 KB from each of 8 channels, mma products) they ran at 1.5 TB/s against the bands' 2.8-3.4
// (bench/variants/gemv_stream_int8.patch; docs/BENCHMARKS.md, twenty-ninth session).
constexpr int kStreamWarps = 8;
constexpr int kStreamThreads = kStreamWarps * 32;
constexpr int kStreamStageBytes = 8192;
constexpr int kStreamStages = 5;
constexpr int kStreamMaxResiduals = 256;  // a block's residual values (channels x rows), read at its start
constexpr int kStreamHeldX = 4;           // rows of x times vectors per thread and channel held in registers
#define FUSED_GEMV_STREAM 1  // (asked by the CPU emulator's harness: the HIP port has no streamed launches)

// Each stage's mbarrier, expecting one arrival (the thread that asks for its bytes), then one fence making the
// initializations visible to the bulk copies.
__device__ __forceinline__ void stream_barriers_init(uint64_t (&bars)[kStreamStages]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    for (int s = 0; s < kStreamStages; ++s)
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(&bars[s])) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

// dst <- bytes of src (global), counted on bar, whose phase completes when they have all landed. The CPU
// emulation copies at once (its blocks' threads take turns only at barriers).
__device__ __forceinline__ void stream_copy(void* dst, const void* src, int bytes, uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)), "r"(bytes)
                 : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(shared_address(dst)), "l"(src), "r"(bytes), "r"(shared_address(bar))
                 : "memory");
#elif defined(EMU_WARP)
    memcpy(dst, src, static_cast<size_t>(bytes));
#endif
}

// Returns once bar's phase of parity `parity` has completed.
__device__ __forceinline__ void stream_wait(uint64_t* bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    uint32_t done = 0;
    do {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
            : "=r"(done)
            : "r"(shared_address(bar)), "r"(parity)
            : "memory");
    } while (!done);
#endif
}

// VPL: 16-byte vectors per thread and channel (K = 2,048 * VPL); a stage holds 2 / VPL channels.
template <int M, int VPL>
__global__ void __launch_bounds__(kStreamThreads, 2) gemv_stream_kernel(GemvArgs args) {
    constexpr int kRowVecs = kStreamThreads * VPL, kStageRows = kStreamStageBytes / (16 * kRowVecs);
    constexpr bool kHeld = M * VPL <= kStreamHeldX;
    static_assert(kStageRows >= 1, "a stage holds whole channels");
    __shared__ __align__(128) uint4 ring[kStreamStages][kStreamStageBytes / 16];
    __shared__ __align__(8) uint64_t full[kStreamStages];
    __shared__ float partial[2][kStreamWarps][kStageRows][M];  // two stages' warp sums: one barrier a stage
    __shared__ float residual[kStreamMaxResiduals];
    const GemvTask& task = task_of_block(args);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int first = (int(blockIdx.x) - task.first_block) * task.block_rows;
    const int rows = min(task.block_rows, task.n - first);
    const int stages = (rows + kStageRows - 1) / kStageRows;
    const __half* w = static_cast<const __half*>(task.w) + int64_t(first) * task.k;
    auto fill = [&](int s) {  // thread 0: stage s into its slot
        const int slot = s % kStreamStages, channels = min(kStageRows, rows - s * kStageRows);
        stream_copy(ring[slot], w + int64_t(s) * kStageRows * task.k, channels * task.k * 2, &full[slot]);
    };
    if (threadIdx.x == 0) {
        stream_barriers_init(full);
        for (int s = 0; s < min(stages, kStreamStages); ++s) fill(s);  // weights: before the wait
    }
    dependency_wait();
    auto x_at = [&](int m, int i) { return task.x + int64_t(m) * task.k + (i * kStreamThreads + threadIdx.x) * 8; };
    float held[kHeld ? M : 1][VPL][8];
    if constexpr (kHeld) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
#pragma unroll
            for (int i = 0; i < VPL; ++i) load8(x_at(m, i), held[m][i]);
        }
    }
    if (task.residual != nullptr) {  // before any store: y may be the residual
        for (int i = threadIdx.x; i < rows * M; i += kStreamThreads)
            residual[i] = __half2float(task.residual[int64_t(i % M) * task.n + first + i / M]);
    }
    __syncthreads();  // the barriers' initialization and the residuals
#pragma unroll 1
    for (int s = 0; s < stages; ++s) {
        const int slot = s % kStreamStages, channels = min(kStageRows, rows - s * kStageRows);
        stream_wait(&full[slot], uint32_t(s / kStreamStages) & 1u);
        float acc[kStageRows][M];
#pragma unroll
        for (int j = 0; j < kStageRows; ++j) {
#pragma unroll
            for (int m = 0; m < M; ++m) acc[j][m] = 0.0f;
            if (j >= channels) continue;  // block-uniform
#pragma unroll
            for (int i = 0; i < VPL; ++i) {
                float wf[8];
                unpack8(ring[slot][j * kRowVecs + i * kStreamThreads + threadIdx.x], wf);
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    float xf[8];
                    if constexpr (kHeld) {
#pragma unroll
                        for (int e = 0; e < 8; ++e) xf[e] = held[m][i][e];
                    } else {
                        load8(x_at(m, i), xf);
                    }
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[j][m] = fmaf(wf[e], xf[e], acc[j][m]);
                }
            }
        }
#pragma unroll
        for (int j = 0; j < kStageRows; ++j) {
#pragma unroll
            for (int m = 0; m < M; ++m) {
                const float sum = warp_sum(acc[j][m]);
                if (lane == 0) partial[s & 1][warp][j][m] = sum;
            }
        }
        __syncthreads();  // every warp is done with the slot and has its sums in `partial`
        if (threadIdx.x == 0 && s + kStreamStages < stages) fill(s + kStreamStages);
        if (threadIdx.x < channels * M) {
            const int j = threadIdx.x / M, m = threadIdx.x % M, c = s * kStageRows + j;
            float sum = partial[s & 1][0][j][m];
#pragma unroll
            for (int v = 1; v < kStreamWarps; ++v) sum += partial[s & 1][v][j][m];
            const float added = task.residual ? residual[c * M + m] : 0.0f;
            task.y[int64_t(m) * task.n + first + c] =
                rounded_output(sum, task.epilogue, task.residual != nullptr, added);
        }
    }
}

// ------------------------------------------------------------------------------------ sparse-input gemv
// y = x Wt (+ residual) for the FFN value product at decode, whose input relu(k)^2 is zero wherever the key
// projection was negative (about half the channels of a random model, 86-90 % of a trained one: see
// ../shared/spec/performance-limits.md): with the weights stored K-major (Wt [K, N], row k = the weights
// of input channel k), a zero input column is a whole weight row not read. Skipping a term x = 0 leaves
// the fp32 sum exactly as it was (fmaf(0, w, acc) == acc for finite w), and a row's terms are added in
// the same order whatever else is in the batch: a row's result does not depend on the other rows.
//
// Work split: a warp takes kSparseStrip output channels (16 bytes = 8 channels per lane) and 32 *
// ballots consecutive input rows; its lanes test one input row each for a nonzero x in any of the M rows
// (a ballot), and the warp then loads only the flagged weight rows, kGemvLoads at a time, taking x[m][k]
// from the lane that tested row k (a shuffle). The block's 8 warps take consecutive row ranges of one
// strip and add their sums in warp order; each block writes that sum to `partial`, and the block that
// arrives last at its strip (a counter per strip, left at zero again) adds the blocks' sums in slice order
// and stores the outputs: deterministic. Nothing can be loaded before the PDL wait (x says which rows).
// int8 weights (a W8A16 FFN value stored K-major too): 8-byte loads of a lane's 8 channels, each channel's scale
// applied to its sum at the end, as the grouped GEMV's int8 tasks do; one row only. H200, W8A16 decode against the
// int8 bands (bench/results/experiment_sparse_int8_*_h200.json): 7.2B 400.7 against 384.2 tok/s at one row, but
// 658 against 718 at 2 and 1,646 against 2,189 at 8 (an earlier version took up to 8), and 1.5B 998 against 1,091
// at one row.
constexpr int kSparseWarps = 8;      // warps per block (one thread per output channel of a strip)
constexpr int kSparseStrip = 256;    // output channels per warp and block
constexpr int kSparseMaxRows = 4;    // rows of x (the union of their nonzeros is read); fp16 weights
constexpr int kSparseMaxRowsInt8 = 1;
static_assert(kSparseMaxRowsInt8 <= kSparseMaxRows, "the block's shared sums are sized for kSparseMaxRows");
constexpr int kSparseMaxBallots = 2;
constexpr int kSparseMinBlocks = 256;  // grid size from which a warp takes 64 rows instead of 32
#define FUSED_SPARSE_INT8 1  // (asked by the CPU emulator's harness: the HIP port has fp16 weights only)

struct SparseGemvArgs {
    const __half* x;         // [M, K]
    const void* w;           // [K, N]: K-major, fp16, or int8 when scale is set
    const __half* scale;     // [N]: the int8 weights' per-channel scale, else null
    __half* y;               // [M, N]
    const __half* residual;  // [M, N] or null (may alias y)
    float* partial;          // [slices, M, N]: the blocks' sums
    unsigned* arrivals;      // [strips]: zero before a launch, zero again after it
    int n, k, ballots, slices, strips;
};

// A lane's 8 weights of one K-major row: 16 bytes of fp16 or 8 of int8, and the rows it loads at a time: as many
// bytes in flight for int8 as for fp16.
template <bool kInt8>
struct SparseLane {
    static constexpr int kLoads = kGemvLoads;
    using Vec = uint4;
    __device__ static void unpack(const Vec& v, float (&out)[8]) { unpack8(v, out); }
};
template <>
struct SparseLane<true> {
    static constexpr int kLoads = 2 * kGemvLoads;
    using Vec = uint2;
    __device__ static void unpack(const Vec& v, float (&out)[8]) {
        int8x4_to_float(v.x, out);
        int8x4_to_float(v.y, out + 4);
    }
};

// One block: strip blockIdx.x % strips, input rows of slice blockIdx.x / strips.
template <int M, bool kInt8 = false>
__global__ void __launch_bounds__(kSparseWarps * 32, M == 1 ? 4 : 2) sparse_gemv_kernel(SparseGemvArgs args) {
    using Lane = SparseLane<kInt8>;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int strip = int(blockIdx.x) % args.strips, slice = int(blockIdx.x) / args.strips;
    const int col = strip * kSparseStrip + 8 * lane;  // this lane's 8 output channels
    const bool mine = col < args.n;                   // n % 8 == 0: all 8 in or all out
    const int rows = 32 * args.ballots;
    const int k0 = (slice * kSparseWarps + warp) * rows;
    dependency_wait();

    // x at rows k0 + 32b + lane, and which rows have a nonzero x in any row of the batch
    float xs[kSparseMaxBallots][M];
    uint64_t todo = 0;
#pragma unroll
    for (int b = 0; b < kSparseMaxBallots; ++b) {
        const int k = k0 + 32 * b + lane;
        bool nonzero = false;
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const __half h = b < args.ballots && k < args.k ? args.x[int64_t(m) * args.k + k] : __float2half_rn(0.0f);
            xs[b][m] = __half2float(h);
            nonzero |= (__half_as_ushort(h) & 0x7fffu) != 0;  // -0 counts as zero, NaN as nonzero
        }
        todo |= uint64_t(__ballot_sync(0xffffffffu, nonzero)) << (32 * b);
    }

    float acc[M][8];
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[m][e] = 0.0f;
    }
    const auto* w = reinterpret_cast<const typename Lane::Vec*>(
        static_cast<const char*>(args.w) + int64_t(col) * sizeof(typename Lane::Vec) / 8);
    const int stride = args.n / 8;  // a lane's vectors per weight row
#pragma unroll 1
    while (todo) {  // warp-uniform
        constexpr int kLoads = Lane::kLoads;
        int row[kLoads];
        typename Lane::Vec v[kLoads];
#pragma unroll
        for (int j = 0; j < kLoads; ++j) {  // the next flagged rows, in order, all loads issued first
            row[j] = todo ? __ffsll(static_cast<long long>(todo)) - 1 : -1;
            todo &= todo - 1;
            if (row[j] >= 0 && mine) v[j] = __ldcs(w + int64_t(k0 + row[j]) * stride);
        }
#pragma unroll
        for (int j = 0; j < kLoads; ++j) {
            if (row[j] < 0) break;
            float wf[8];
            Lane::unpack(v[j], wf);
#pragma unroll
            for (int m = 0; m < M; ++m) {
                const float xk = __shfl_sync(0xffffffffu, row[j] < 32 ? xs[0][m] : xs[1][m], row[j] & 31);
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[m][e] = fmaf(xk, wf[e], acc[m][e]);
            }
        }
    }

    // The block's sum over its warps, in warp order, to partial[slice]
    __shared__ float warp_acc[kSparseWarps][M][kSparseStrip];
    __shared__ bool last;
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int e = 0; e < 8; ++e) warp_acc[warp][m][8 * lane + e] = acc[m][e];
    }
    __syncthreads();
    const int c = strip * kSparseStrip + threadIdx.x;  // one output channel per thread from here on
    const bool out = c < args.n;
    if (out) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float sum = warp_acc[0][m][threadIdx.x];
#pragma unroll
            for (int v = 1; v < kSparseWarps; ++v) sum += warp_acc[v][m][threadIdx.x];
            args.partial[(int64_t(slice) * M + m) * args.n + c] = sum;
        }
    }
    __threadfence();  // the sums are visible to the other blocks before this block's arrival is
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&args.arrivals[strip], 1u) == unsigned(args.slices - 1);
    __syncthreads();
    if (!last) return;
    if (threadIdx.x == 0) args.arrivals[strip] = 0u;  // ready for the next launch
    if (!out) return;
    __threadfence();
    const float scale = kInt8 ? __half2float(args.scale[c]) : 1.0f;
#pragma unroll
    for (int m = 0; m < M; ++m) {
        float sum = 0.0f;  // in slice order; kGemvLoads loads in flight at a time (this is the launch's tail)
        for (int s = 0; s < args.slices; s += kGemvLoads) {
            float part[kGemvLoads];
#pragma unroll
            for (int j = 0; j < kGemvLoads; ++j)
                part[j] = s + j < args.slices ? __ldcg(&args.partial[(int64_t(s + j) * M + m) * args.n + c]) : 0.0f;
#pragma unroll
            for (int j = 0; j < kGemvLoads; ++j) sum += part[j];
        }
        store_rounded(args.y, args.residual, int64_t(m) * args.n + c, sum * scale, kEpiNone);
    }
}

// Which instance of ln_shift_mix a launch takes (the launcher and the CPU emulator's harness both ask): its
// 8-vectors per thread for width C.
inline int ln_vecs(int64_t C) {
    const int64_t per_thread = (C / 8 + kLnThreads - 1) / kLnThreads;
    return per_thread <= 1 ? 1 : per_thread <= 2 ? 2 : kMaxVec;
}

// Environment knobs (A/B switches for measurements, each read once): decimal digits only, or the default when
// unset or anything else (as infer.ops.cuda_ext.env_int reads them); a switch is off at 0, on at other numbers.
inline int64_t env_int(const char* name, int64_t fallback) {
    const char* env = std::getenv(name);
    if (env == nullptr || *env < '0' || *env > '9') return fallback;
    char* end = nullptr;
    const long long value = std::strtoll(env, &end, 10);
    return *end == '\0' ? static_cast<int64_t>(value) : fallback;
}
inline bool env_flag(const char* name, bool fallback) { return env_int(name, fallback ? 1 : 0) != 0; }

// Whether a launch of T tokens over B rows of C channels takes ln_shift_mix_span_kernel: rows of kLnSpan
// tokens or more on average (prompts), C wider than one 8-vector per thread. A decode step (a token per row)
// keeps the per-token kernel, which loads a row start's slot state before the wait. At one vector per thread
// (C <= 2,048) the span kernel's registers halve the blocks per multiprocessor and it lost on the H200: 1.5B
// prompts 0.5-1.6 % slower, while 7.2B's 16 x 4,096 gained 1.1 % and its ln_shift_mix time 18.3 -> 15.3 ms at
// 16 x 1,024 (bench/results/decode_h200_prefill_ln_span.json against experiment_ln_per_token_h200.json).
// RWKV_LN_SPAN=0: every launch per token (A/B).
inline bool ln_span_for(int64_t T, int64_t B, int64_t C) {
    static const bool enabled = env_flag("RWKV_LN_SPAN", true);
    return enabled && T >= kLnSpan * B && ln_vecs(C) >= 2;
}

// The device's compute capability major (0 when it cannot be read).
inline int compute_major(int device) {
    static int cached[64] = {0};  // 0 unknown, else major + 1
    if (device < 0 || device >= 64) return 0;
    if (cached[device] == 0) {
        int major = 0;
        if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) major = 0;
        cached[device] = major + 1;
    }
    return cached[device] - 1;
}

// Programmatic dependent launch is used on compute capability >= 9.0 unless RWKV_PDL=0.
inline bool use_pdl(int device) {
    static const bool enabled = env_flag("RWKV_PDL", true);
    return enabled && compute_major(device) >= 9;
}

// fp16 launches of a streamed width take gemv_stream_kernel (bulk copies: compute capability >= 9.0) unless
// RWKV_GEMV_STREAM=0 (A/B).
inline bool use_stream_gemv(int device) {
    static const bool enabled = env_flag("RWKV_GEMV_STREAM", true);
    return enabled && compute_major(device) >= 9;
}

// The device's multiprocessor count (0 when it cannot be read).
inline int multiprocessors(int device) {
    static int cached[64] = {0};  // 0 unknown, else count + 1
    if (device < 0 || device >= 64) return 0;
    if (cached[device] == 0) {
        int count = 0;
        if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) count = 0;
        cached[device] = count + 1;
    }
    return cached[device] - 1;
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

// The kernel a packed GEMV launch runs on (fused_gemv_launch chooses).
enum class GemvKernel { kGrouped, kWideBands, kStreamed };

template <int M>
cudaError_t launch_gemv(const GemvArgs& args, int blocks, GemvKernel kernel, cudaStream_t stream) {
    const unsigned grid = static_cast<unsigned>(blocks);
    if (kernel == GemvKernel::kWideBands)
        return launch(gemv_wide_band_kernel<M>, grid, kWideBandWarps * 32, stream, args);
    if (kernel == GemvKernel::kStreamed) {
        if (args.task[0].k == 2048)  // stream_vectors 1, else 2 (plan_stream_gemv)
            return launch(gemv_stream_kernel<M, 1>, grid, kStreamThreads, stream, args);
        return launch(gemv_stream_kernel<M, 2>, grid, kStreamThreads, stream, args);
    }
    return launch(gemv_kernel<M>, grid, kGemvWarps * 32, stream, args);
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

// The split kernel's launch: its scratch (y before the group norm, fp32 [T, C]) and time_mix_finish_kernel's
// grid (every row's (row, head) blocks for up to max_len tokens).
inline int64_t split_scratch_floats(int64_t num_tokens, int64_t H) { return num_tokens * H * N; }
inline int64_t finish_blocks(int64_t B, int64_t H, int64_t max_len) {
    return B * H * ((max_len + kFinishTokens - 1) / kFinishTokens);
}

// Which time-mix kernel a launch takes: a step of single tokens time_mix_kernel; rows of several tokens
// time_mix_split_kernel (+ time_mix_finish_kernel) on a grid of at most kSplitMaxBlocks (row, head) blocks,
// time_mix_prefill_kernel on one of fewer than kPrefillMaxBlocks, else time_mix_chunked_kernel. The split and
// chunked kernels' 16-byte loads need 16-byte aligned inputs (else the prefill and decode kernels).
// The chunked kernel runs in its tensor-core form (time_mix_chunked_tc_kernel): 7.2B 16 x 1,024 and 16 x 4,096
// 40,595 and 40,652 tok/s against 38,570 and 38,758, 1.5B +5.6-6.3 %, the time mix 60.2 against 88.2 ms per
// 7.2B 16 x 1,024 forward (H200; bench/results/decode_h200_prefill_tc.json, experiment_time_mix_chunked_ab_h200.json,
// profile_prefill_tc_h200.json). RWKV_SPLIT_MAX_BLOCKS and RWKV_PREFILL_MAX_BLOCKS override the two bounds,
// RWKV_TIME_MIX_CHUNKED=0 takes time_mix_kernel instead of the chunked one, RWKV_TIME_MIX_TC=0 the chunked kernel
// on the CUDA cores (all read once; for A/B timing).
enum TimeMixKernel : int {
    kTimeMixDecode = 0, kTimeMixPrefill = 1, kTimeMixChunked = 2, kTimeMixSplit = 3, kTimeMixChunkedTc = 4
};

// Blocks per (row, head) of the split kernel on a (row, head) grid of `grid` blocks: 2 when that puts one block on
// each multiprocessor where 4 would put two (a 7.2B prompt alone, 64 heads on 132: 241.3 us per layer against
// 256.4, as the A warps' work per multiprocessor halves), else 4 (1.5B's prompt alone, 32 heads: 184.0 against
// 238.0 us with 2; bench/results/experiment_time_mix_parts_h200.json and _parts_1.5b_h200.json).
inline int split_parts(unsigned grid, int multiprocessors) {
    return grid * 2 <= unsigned(multiprocessors) && grid * 4 > unsigned(multiprocessors) ? 2 : 4;
}

// Whether every input the layer reads starts on 16 bytes (the kernels that copy them as vectors need it; C is a
// multiple of 64).
inline bool inputs_aligned(const TimeMixArgs& p) {
    for (int j = 0; j < chunk_inputs(p); ++j)
        if (reinterpret_cast<uintptr_t>(chunk_input(p, j)) % 16 != 0) return false;
    return true;
}

inline int time_mix_kernel_for(const TimeMixArgs& p, unsigned grid, int prefill) {
    static const int64_t split_max_blocks = env_int("RWKV_SPLIT_MAX_BLOCKS", kSplitMaxBlocks);
    static const int64_t prefill_max_blocks = env_int("RWKV_PREFILL_MAX_BLOCKS", kPrefillMaxBlocks);
    static const bool chunked = env_flag("RWKV_TIME_MIX_CHUNKED", true);
    static const bool tensor_cores = env_flag("RWKV_TIME_MIX_TC", true);
    if (!prefill) return kTimeMixDecode;
    const bool aligned = inputs_aligned(p);
    if (grid <= split_max_blocks && aligned && reinterpret_cast<uintptr_t>(p.out) % 16 == 0) return kTimeMixSplit;
    if (grid < prefill_max_blocks) return kTimeMixPrefill;
    if (!chunked || !aligned) return kTimeMixDecode;
    return tensor_cores ? kTimeMixChunkedTc : kTimeMixChunked;
}

// Blocks for time_mix_pipelined_kernel at a decode launch of `grid` (row, head) items: as many as fit on the device
// at once, a multiple of H; 0 for time_mix_kernel instead. By itself (requested == 0) the launcher takes it at two
// items per block or more for fp16 states (RWKV_TIME_MIX_PIPELINED=1, the default), for fp32 states too (=2) or never
// (=0): with fp32 states (16 KB a block, five or six blocks a multiprocessor) it loses 2-4 % at 256 and 512 rows
// (H200, 7.2B 19,948 and 22,080 tok/s against 20,309 and 22,614, 1.5B at 512 71,671 against 74,256;
// bench/results/experiment_time_mix_fp32_pipelined_h200.json against experiment_time_mix_fp32_per_row_h200.json).
// `requested` > 0 asks for that many (rounded down to a multiple of H; tests walk many items per block with it), < 0
// for none. Never with inputs off 16 bytes.
template <typename Kernel>
int64_t pipelined_blocks(Kernel kernel, int device, unsigned grid, int H, bool fp16_state, const TimeMixArgs& p,
                         int64_t requested) {
    static const int64_t mode = env_int("RWKV_TIME_MIX_PIPELINED", 1);
    static int per_multiprocessor[64] = {0};  // 0 unknown, else blocks + 1
    const bool automatic = mode >= 2 || (mode == 1 && fp16_state);
    if (requested < 0 || (requested == 0 && !automatic) || device < 0 || device >= 64 || !inputs_aligned(p))
        return 0;
    int64_t blocks = requested;
    if (blocks == 0) {
        if (per_multiprocessor[device] == 0) {
            int count = 0;
            if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&count, kernel, N, 0) != cudaSuccess) count = 0;
            per_multiprocessor[device] = count + 1;
        }
        blocks = int64_t(per_multiprocessor[device] - 1) * multiprocessors(device);
        if (int64_t(grid) < 2 * blocks) return 0;
    }
    if (blocks > int64_t(grid)) blocks = grid;
    return blocks / H * H;
}

// Whether gemv_kernel takes a task: k a multiple of one 16-byte load (8 fp16 or 16 int8 weights); 4-bit:
// whole 16-byte vectors of 4 channels (n % 4 == 0), whole groups of whole words, and word offsets in 32 bits
// (uint4_rows).
inline bool gemv_takes(int64_t n, int64_t k, int weight_type, int64_t group) {
    if (n <= 0 || k <= 0 || n > INT_MAX / 2 || k > INT_MAX / 2) return false;
    if (weight_type == kWeightUint4)
        return n % 4 == 0 && group > 0 && group % 8 == 0 && k % group == 0 && k / 8 * n < INT_MAX;
    return (weight_type == kWeightHalf && k % 8 == 0) ||
           ((weight_type == kWeightInt8 || weight_type == kWeightInt8Band) && k % 16 == 0);
}

// 16-byte vectors along K per unit of work: an fp16 row holds 8 weights per vector, an int8 row 16; a
// 4-bit band's K/8 rows of words hold 8 k-values of 4 channels per vector.
inline int gemv_vectors(const GemvTask& t) { return t.weight_type == kWeightHalf ? t.k / 8 : t.k / 16; }

// Warps of work (kGemvWarps per block) of a task split `splits` ways: one per (row, slice) for fp16 and
// int8, whole blocks of kUint4Band / splits channels for 4-bit weights.
inline int64_t gemv_units(const GemvTask& t, int splits) {
    if (t.weight_type == kWeightUint4) return (int64_t(t.n) * splits + kUint4Band - 1) / kUint4Band * kGemvWarps;
    if (t.weight_type == kWeightInt8Band) return (int64_t(t.n) + kInt8Band - 1) / kInt8Band * kGemvWarps;
    return (int64_t(t.n) + t.rows_per_warp - 1) / t.rows_per_warp * splits;
}

// gemv_kernel blocks of a planned task
inline int gemv_task_blocks(const GemvTask& t) {
    return static_cast<int>((gemv_units(t, t.splits) + kGemvWarps - 1) / kGemvWarps);
}

// Short rows. A warp on a row of fewer than 32 * kGemvLoads vectors leaves lanes without loads, and a launch
// of such rows (the LoRA second halves: 4,096 rows of 96-480 weights at 7.2B) runs many small warps, each
// waiting out one round trip to memory: 8.7-10 us per layer for 6.8 MB (bench/results/profile_nopdl_h200.json).
// Such a row gets the fewest lanes (a power of two) that keep each lane within one batch of kGemvLoads
// loads, and a warp takes 32 / lanes rows.
inline int gemv_rows_per_warp(const GemvTask& t) {
    if (t.weight_type == kWeightUint4 || t.weight_type == kWeightInt8Band) return 1;
    int lanes = 1;
    while (lanes < 32 && lanes * kGemvLoads < gemv_vectors(t)) lanes *= 2;
    return 32 / lanes;
}

// Row splitting. A launch of few, long rows runs few blocks, and its last partial wave of blocks leaves
// the memory idle for as long as a whole one (7.2B FFN value, 4,096 rows of 32 KB: 1.3 waves, 3.2 TB/s
// against 3.7 for the 16,384 rows of the FFN key; bench/results/profile_nopdl_h200.json). So the rows of
// the task with the longest slices are halved until the launch has kGemvSplitRows (row, slice) units,
// while each slice keeps at least one full batch of loads per lane (kGemvMinSlice vectors). A 4-bit task
// with long rows halves its band instead (once).
// 32,768 units: a 7.2B layer at batch 1 then splits r, k and v (and the FFN key) in two, one batch of loads
// per lane: 260.7 -> 267.8 tok/s against 16,384 (bench/results/decode_h200_lora_first_split32k.json).
constexpr int kGemvSplitRows = 32768;
constexpr int kGemvMinSlice = 32 * kGemvLoads;

// The (row, slice) units a launch is split to: kGemvSplitRows, RWKV_GEMV_SPLIT_ROWS instead if set, 0 (no
// splitting) with RWKV_GEMV_SPLIT=0 (read once; for A/B timing).
inline int64_t gemv_split_rows() {
    static const int64_t value =
        env_flag("RWKV_GEMV_SPLIT", true) ? env_int("RWKV_GEMV_SPLIT_ROWS", kGemvSplitRows) : 0;
    return value;
}

// 4-bit tasks halve their band at rows of at least this many columns: kUint4SplitMinK, RWKV_UINT4_SPLIT_MIN_K
// instead if set (read once; for A/B timing of full bands, whose one-row loop issues a sixth fewer instructions per
// word than a halved band's).
inline int64_t uint4_split_min_k() {
    static const int64_t value = env_int("RWKV_UINT4_SPLIT_MIN_K", kUint4SplitMinK);
    return value;
}

// 4-bit tasks keep full bands in launches of at least this many blocks of full bands: kUint4HalveBelowBlocks,
// RWKV_UINT4_HALVE_BELOW_BLOCKS instead if set (read once; for A/B timing). Shapes only: the same plan at any rows.
inline int64_t uint4_halve_below_blocks() {
    static const int64_t value = env_int("RWKV_UINT4_HALVE_BELOW_BLOCKS", kUint4HalveBelowBlocks);
    return value;
}

inline void plan_gemv_splits(GemvArgs& args) {
    int64_t units = 0;
    for (int i = 0; i < args.count; ++i) {
        args.task[i].splits = 1;
        args.task[i].rows_per_warp = gemv_rows_per_warp(args.task[i]);
        units += gemv_units(args.task[i], 1);
    }
    const bool uint4_halves = units < uint4_halve_below_blocks() * kGemvWarps;
    while (units < gemv_split_rows()) {
        int best = -1, best_slice = 0;
        for (int i = 0; i < args.count; ++i) {
            const GemvTask& t = args.task[i];
            const int slice = gemv_vectors(t) / t.splits;
            const bool splittable = t.weight_type == kWeightUint4
                                        ? uint4_halves && t.splits < kUint4MaxSplits && t.k >= uint4_split_min_k()
                                        : t.weight_type != kWeightInt8Band && t.splits < kGemvWarps &&
                                              t.rows_per_warp == 1 && slice % 2 == 0 && slice / 2 >= kGemvMinSlice;
            if (splittable && slice > best_slice) {
                best = i;
                best_slice = slice;
            }
        }
        if (best < 0) break;
        GemvTask& t = args.task[best];
        units += gemv_units(t, 2 * t.splits) - gemv_units(t, t.splits);
        t.splits *= 2;
    }
}

// The `count` tasks of one grouped launch, kGemvWarps units per block; returns the grid size. The caller
// has checked that gemv_kernel takes every task.
inline int pack_gemv(GemvArgs& args, int count, const void* const* w, const void* const* scale,
                     const void* const* zero, const void* const* x, void* const* y, const void* const* residual,
                     const int64_t* n, const int64_t* k, const int64_t* group, const int* weight_type,
                     const int* epilogue) {
    int blocks = 0;
    for (int i = 0; i < count; ++i) {
        GemvTask& t = args.task[i];
        t.w = w[i];
        t.scale = static_cast<const __half*>(scale[i]);
        t.zero = static_cast<const __half*>(zero[i]);
        t.x = static_cast<const __half*>(x[i]);
        t.y = static_cast<__half*>(y[i]);
        t.residual = static_cast<const __half*>(residual[i]);
        t.n = static_cast<int>(n[i]);
        t.k = static_cast<int>(k[i]);
        t.group = static_cast<int>(group[i]);
        t.weight_type = weight_type[i];
        t.epilogue = epilogue[i];
        t.promote = 1;
    }
    args.count = count;
    plan_gemv_splits(args);
    for (int i = 0; i < count; ++i) {
        GemvTask& t = args.task[i];
        t.first_block = blocks;
        blocks += gemv_task_blocks(t);
    }
    return blocks;
}

// Marks the stages of a packed launch (stage[i]: 0 none, 1 producer, 2 consumer; see task_dependency_wait), sync
// its counters ([2], zero). False unless every producer task precedes every consumer task, a launch with either has
// both, and sync is given.
inline bool stage_gemv(GemvArgs& args, const int* stage, unsigned* sync) {
    int producers = 0, consumers = 0, last_producer = -1, first_consumer = args.count;
    for (int i = 0; i < args.count; ++i) {
        if (stage[i] == 1) {
            producers += gemv_task_blocks(args.task[i]);
            last_producer = i;
        } else if (stage[i] == 2) {
            consumers += gemv_task_blocks(args.task[i]);
            first_consumer = first_consumer < i ? first_consumer : i;
        } else if (stage[i] != 0) {
            return false;
        }
    }
    if (producers == 0 && consumers == 0) return true;
    if (sync == nullptr || producers == 0 || consumers == 0 || last_producer > first_consumer) return false;
    for (int i = 0; i < args.count; ++i) {
        GemvTask& t = args.task[i];
        t.sync = sync;
        t.producer = stage[i] == 1;
        t.wait_for = stage[i] == 2 ? producers : 0;
        t.consumers = consumers;
    }
    return true;
}

inline bool gemv_staged(const GemvArgs& args) { return args.count > 0 && args.task[0].sync != nullptr; }

// Whether every task of a packed launch is a band (4-bit or int8 on the tensor cores): what gemv_wide_band_kernel
// computes.
inline bool gemv_all_bands(const GemvArgs& args) {
    for (int i = 0; i < args.count; ++i) {
        const int type = args.task[i].weight_type;
        if (type != kWeightUint4 && type != kWeightInt8Band) return false;
    }
    return true;
}

// Whether a packed launch of `blocks` blocks takes gemv_wide_band_kernel: all bands, at most kWideBandMaxBlocks of
// them. It reads the tasks' shapes only, never the rows of x: the two kernels add a band's warps' sums in
// different orders, and a row's output is the same alone or in a batch.
inline bool gemv_wide_bands(const GemvArgs& args, int blocks) {
    return blocks <= kWideBandMaxBlocks && gemv_all_bands(args) && !gemv_staged(args);
}

// 16-byte vectors per thread and channel of gemv_stream_kernel for rows of k weights (0: not a streamed width).
inline int stream_vectors(int64_t k) { return k == 2048 ? 1 : k == 4096 ? 2 : 0; }

// Plans a packed launch on gemv_stream_kernel: each task's channels in blocks of block_rows (first_block
// renumbered), two blocks a multiprocessor in all (fewer channels a block where residuals would not fit its
// buffer at kGemvMaxRows rows). Returns the grid, or 0 when the launch does not stream: a task not fp16, widths
// not all one streamed width, stages. It reads the tasks' shapes only, never the rows of x.
inline int plan_stream_gemv(GemvArgs& args, int multiprocessors) {
    if (args.count < 1 || multiprocessors <= 0 || gemv_staged(args)) return 0;
    const int k = args.task[0].k;
    int64_t rows = 0;
    bool residuals = false;
    for (int i = 0; i < args.count; ++i) {
        const GemvTask& t = args.task[i];
        if (t.weight_type != kWeightHalf || t.k != k) return 0;
        rows += t.n;
        residuals = residuals || t.residual != nullptr;
    }
    const int vectors = stream_vectors(k), grid = 2 * multiprocessors;
    if (vectors == 0 || grid <= args.count) return 0;
    const int64_t stage_rows = kStreamStageBytes / (16 * kStreamThreads * vectors);
    int64_t per_block = (rows + grid - args.count - 1) / (grid - args.count);  // the tasks' blocks fit the grid
    per_block = (per_block + stage_rows - 1) / stage_rows * stage_rows;
    if (residuals) per_block = std::min<int64_t>(per_block, kStreamMaxResiduals / kGemvMaxRows);
    int blocks = 0;
    for (int i = 0; i < args.count; ++i) {
        GemvTask& t = args.task[i];
        t.block_rows = static_cast<int>(per_block);
        t.first_block = blocks;
        blocks += static_cast<int>((t.n + per_block - 1) / per_block);
    }
    return blocks;
}

// The grid of a sparse-input GEMV of a K-major [k, n] weight: strips of kSparseStrip channels times slices
// of input rows, a warp taking 64 rows (two ballots) if that still makes min_blocks blocks, else 32.
// RWKV_SPARSE_MIN_BLOCKS overrides kSparseMinBlocks (for A/B timing; read once, by the workspace sizing and
// the launches alike).
inline int64_t sparse_min_blocks() {
    static const int64_t value = env_int("RWKV_SPARSE_MIN_BLOCKS", kSparseMinBlocks);
    return value;
}

inline SparseGemvArgs plan_sparse_gemv(int64_t n, int64_t k, int64_t min_blocks = sparse_min_blocks()) {
    SparseGemvArgs args{};
    args.n = static_cast<int>(n);
    args.k = static_cast<int>(k);
    args.strips = static_cast<int>((n + kSparseStrip - 1) / kSparseStrip);
    for (args.ballots = kSparseMaxBallots;; --args.ballots) {
        const int64_t rows = int64_t(kSparseWarps) * 32 * args.ballots;
        args.slices = static_cast<int>((k + rows - 1) / rows);
        if (args.ballots == 1 || int64_t(args.strips) * args.slices >= min_blocks) break;
    }
    return args;
}

// The rows a launch takes: fp16 or int8 weights.
inline int sparse_max_rows(bool int8) { return int8 ? kSparseMaxRowsInt8 : kSparseMaxRows; }

inline bool sparse_gemv_takes(int64_t M, int64_t n, int64_t k, bool int8 = false) {
    return M >= 1 && M <= sparse_max_rows(int8) && n > 0 && n % 8 == 0 && k > 0 && k <= INT_MAX / 2 &&
           n * kSparseMaxRows <= INT_MAX;
}

// run(kernel) for the sparse_gemv_kernel instance of M rows of x (sparse_gemv_takes) and the weights' type: the
// launcher's and the CPU emulator's harness's one choice.
template <typename Run>
auto with_sparse_gemv_kernel(int64_t M, bool int8, Run run) {
    if (int8) return run(sparse_gemv_kernel<1, true>);  // kSparseMaxRowsInt8
    switch (M) {
        case 1: return run(sparse_gemv_kernel<1>);
        case 2: return run(sparse_gemv_kernel<2>);
        case 3: return run(sparse_gemv_kernel<3>);
        default: return run(sparse_gemv_kernel<4>);
    }
}

// The launch's arguments: the plan for a [k, n] weight (min_blocks: see plan_sparse_gemv) and the pointers
// (scale: int8 weights').
inline SparseGemvArgs make_sparse_gemv_args(int64_t n, int64_t k, int64_t min_blocks, const void* x, const void* w,
                                            const void* scale, void* y, const void* residual, void* partial,
                                            void* arrivals) {
    SparseGemvArgs args = plan_sparse_gemv(n, k, min_blocks);
    args.x = static_cast<const __half*>(x);
    args.w = w;
    args.scale = static_cast<const __half*>(scale);
    args.y = static_cast<__half*>(y);
    args.residual = static_cast<const __half*>(residual);
    args.partial = static_cast<float*>(partial);
    args.arrivals = static_cast<unsigned*>(arrivals);
    return args;
}

// ------------------------------------------------------------------------------------ uint4_dequantize
// A 4-bit GemLite matrix (the fused GEMV's layout: words [K/8, N], W[n][8c + j] in bits 4j..4j+3 of word (c, n);
// fp16 scale and zero [K/group, N]) rebuilt as fp16 columns n0 .. n0 + width - 1 of W^T, [K, width] row-major,
// bit for bit as the GEMV rebuilds them (dequant_uint4x8). For batches the GEMV does not take: a chunk of
// columns small enough to stay in L2 until the cuBLAS product that reads it next (uint4_matmul in
// infer/ops/fused.py), so HBM streams the 4-bit words, not an fp16 copy. Thread i: word (i / width, n0 +
// i % width), consecutive threads on consecutive columns (each of its 8 stores coalesced with its warp's).
constexpr int kDequantThreads = 256;

__global__ void __launch_bounds__(kDequantThreads)
uint4_dequantize_kernel(const uint32_t* __restrict__ words, const __half* __restrict__ scale,
                        const __half* __restrict__ zero, int64_t N, int64_t K, int64_t group, int64_t n0,
                        int64_t width, __half* __restrict__ out) {
    const int64_t i = int64_t(blockIdx.x) * kDequantThreads + threadIdx.x;
    dependency_wait();
    if (i >= K / 8 * width) return;
    const int64_t c = i / width, j = i % width, n = n0 + j, g = 8 * c / group;
    uint32_t pair[4];
    const __half s = scale[g * N + n], z = zero[g * N + n];
    dequant_uint4x8(words[c * N + n], __halves2half2(s, s), __halves2half2(z, z), pair);
    __half* dst = out + 8 * c * width + j;
#pragma unroll
    for (int e = 0; e < 4; ++e) {  // pair e: (W[8c + e], W[8c + e + 4]) in its low and high 16 bits
        dst[e * width] = __ushort_as_half(static_cast<unsigned short>(pair[e] & 0xFFFFu));
        dst[(e + 4) * width] = __ushort_as_half(static_cast<unsigned short>(pair[e] >> 16));
    }
}

inline unsigned dequantize_blocks(int64_t K, int64_t width) {
    return static_cast<unsigned>((K / 8 * width + kDequantThreads - 1) / kDequantThreads);
}

}  // namespace fused

// --------------------------------------------------------------------------------- C interface
// x [T, C] fp16; ln_w/ln_b [C]; shift [S, C] (one layer's token-shift pool, fp16); prev [T] int32;
// slots/lasts [B] int64; mix[m] [C], out[m] [T, C] for m < count (<= 6). C % 8 == 0, C <= 8192.
extern "C" int fused_ln_shift_mix_launch(int device, int64_t stream, int64_t T, int64_t B, int64_t C,
                                         int64_t num_slots, const void* x, const void* ln_w, const void* ln_b,
                                         void* shift, const int32_t* prev, const int64_t* slots, const int64_t* lasts,
                                         const void* const* mix, void* const* out, int count) {
    using namespace fused;
    if (T == 0) return cudaSuccess;
    if (T < 0 || T > INT_MAX || B < 1 || C <= 0 || C % 8 || C > kLnThreads * kMaxVec * 8 || count < 1 ||
        count > kMaxMix)
        return cudaErrorInvalidValue;
    const MixArgs args = make_mix_args(mix, out, count);
    const int vecs = ln_vecs(C);
    const auto stream_ = reinterpret_cast<cudaStream_t>(stream);
    const auto x_ = static_cast<const __half*>(x);
    const auto w_ = static_cast<const __half*>(ln_w);
    const auto b_ = static_cast<const __half*>(ln_b);
    const auto shift_ = static_cast<__half*>(shift);
    return on_device(device, [&] {
        if (ln_span_for(T, B, C)) {
            auto kernel = vecs == 1   ? ln_shift_mix_span_kernel<1>
                          : vecs == 2 ? ln_shift_mix_span_kernel<2>
                                      : ln_shift_mix_span_kernel<kMaxVec>;
            return launch(kernel, static_cast<unsigned>((T + kLnSpan - 1) / kLnSpan), kLnThreads, stream_, T,
                          static_cast<int>(C), num_slots, x_, w_, b_, shift_, prev, slots, lasts, args);
        }
        auto kernel = vecs == 1   ? ln_shift_mix_kernel<1>
                      : vecs == 2 ? ln_shift_mix_kernel<2>
                                  : ln_shift_mix_kernel<kMaxVec>;
        return launch(kernel, static_cast<unsigned>(T), kLnThreads, stream_, static_cast<int>(C), num_slots, x_, w_,
                      b_, shift_, prev, slots, lasts, args);
    });
}

// tensors: r, k, v, dw, da, dv, g, v_first, out ([T, C] fp16; dv unused in layer 0);
// params: w0, r_k, lnx_w, lnx_b (fp32 [C]), a0, v0, k_k, k_a (fp16 [C]; v0 unused in layer 0).
// max_len: the longest row's tokens (a prefill when > 1, see time_mix_kernel_for).
// scratch: fp32, fused_time_mix_scratch_floats(...) of them (none when that is 0).
// pipeline_blocks: 0 lets a decode launch take time_mix_pipelined_kernel by its size, < 0 never, > 0 always, on that
// many blocks (see pipelined_blocks).
extern "C" int64_t fused_time_mix_scratch_floats(int64_t B, int64_t H, int64_t num_tokens, const void* const* tensors,
                                                 int first_layer, int64_t max_len) {
    using namespace fused;
    const void* params[8] = {};
    const TimeMixArgs p = make_time_mix_args(tensors, params, first_layer);
    if (B <= 0 || H <= 0 || B * H > INT_MAX) return 0;
    const bool split = time_mix_kernel_for(p, static_cast<unsigned>(B * H), max_len > 1) == kTimeMixSplit;
    return split ? split_scratch_floats(num_tokens, H) : 0;
}

extern "C" int fused_time_mix_launch(int device, int64_t stream, int state_dtype, int64_t B, int64_t H,
                                     int64_t num_slots, int64_t num_tokens, void* state, const int64_t* slots,
                                     const int64_t* starts, const int64_t* lasts, const void* const* tensors,
                                     const void* const* params, int first_layer, int64_t max_len, float* scratch,
                                     int64_t scratch_floats, int64_t pipeline_blocks) {
    using namespace fused;
    if (B == 0) return cudaSuccess;
    if (B < 0 || H <= 0 || B * H > INT_MAX) return cudaErrorInvalidConfiguration;
    if (state_dtype != wkv7::kFloat32 && state_dtype != wkv7::kFloat16) return cudaErrorInvalidValue;
    const TimeMixArgs p = make_time_mix_args(tensors, params, first_layer);
    const int h = static_cast<int>(H);
    const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
    const unsigned grid = static_cast<unsigned>(B * H);
    const int kernel = time_mix_kernel_for(p, grid, max_len > 1);
    const int64_t finish_grid = finish_blocks(B, H, max_len);
    if (kernel == kTimeMixSplit && (B * H > INT_MAX / kMaxSplitParts || finish_grid > INT_MAX))
        return cudaErrorInvalidConfiguration;
    if (kernel == kTimeMixSplit && (scratch == nullptr || scratch_floats < split_scratch_floats(num_tokens, H)))
        return cudaErrorInvalidValue;
    auto run = [&](auto* pool, auto decode_kernel, auto pipelined_kernel, auto prefill_kernel, auto chunked_kernel,
                   auto chunked_tc_kernel, auto split2_kernel, auto split4_kernel) {
        return on_device(device, [&] {
            const bool fp16_state = state_dtype == wkv7::kFloat16;
            const int64_t pipelined =
                kernel == kTimeMixDecode
                    ? pipelined_blocks(pipelined_kernel, device, grid, h, fp16_state, p, pipeline_blocks)
                    : 0;
            if (pipelined > 0)
                return launch(pipelined_kernel, static_cast<unsigned>(pipelined), N, s, h, num_slots, num_tokens,
                              int64_t(grid), pool, slots, starts, lasts, p);
            if (kernel == kTimeMixSplit) {
                const int parts = split_parts(grid, multiprocessors(device));
                const cudaError_t err =
                    parts == 2 ? launch(split2_kernel, grid * 2, split_threads(2), s, h, num_slots, num_tokens, pool,
                                        slots, starts, lasts, p, scratch)
                               : launch(split4_kernel, grid * 4, split_threads(4), s, h, num_slots, num_tokens, pool,
                                        slots, starts, lasts, p, scratch);
                if (err != cudaSuccess) return err;
                return launch(time_mix_finish_kernel, static_cast<unsigned>(finish_grid), N, s, h, B, num_slots,
                              num_tokens, slots, starts, lasts, p, static_cast<const float*>(scratch));
            }
            if (kernel == kTimeMixPrefill)
                return launch(prefill_kernel, grid, kPrefillThreads, s, h, num_slots, num_tokens, pool, slots, starts,
                              lasts, p);
            return launch(kernel == kTimeMixChunked     ? chunked_kernel
                          : kernel == kTimeMixChunkedTc ? chunked_tc_kernel
                                                        : decode_kernel,
                          grid, N, s, h, num_slots, num_tokens, pool, slots, starts, lasts, p);
        });
    };
    if (state_dtype == wkv7::kFloat32)
        return run(static_cast<float*>(state), time_mix_kernel<float>, time_mix_pipelined_kernel<float>,
                   time_mix_prefill_kernel<float>,
                   time_mix_chunked_kernel<float>, time_mix_chunked_tc_kernel<float>, time_mix_split_kernel<float, 2>,
                   time_mix_split_kernel<float, 4>);
    return run(static_cast<__half*>(state), time_mix_kernel<__half>, time_mix_pipelined_kernel<__half>,
               time_mix_prefill_kernel<__half>,
               time_mix_chunked_kernel<__half>, time_mix_chunked_tc_kernel<__half>, time_mix_split_kernel<__half, 2>,
               time_mix_split_kernel<__half, 4>);
}

extern "C" int fused_gemv_max_rows() { return fused::kGemvMaxRows; }
extern "C" int fused_gemv_max_tasks() { return fused::kMaxTasks; }

// One launch computing `count` tasks y_i = epilogue(x_i W_i^T) (see GemvTask) for M rows each, in stages
// (stage_gemv; sync: two uint32 counters, zero before the first launch and left so by each).
// Weight k must be a multiple of 8 (fp16) or 16 (int8); 4-bit (weight type 2): n % 4 == 0, group % 8 == 0,
// k % group == 0; every pointer 16-byte aligned. zero and group are read for 4-bit tasks only.
extern "C" int fused_gemv_launch(int device, int64_t stream, int64_t M, int count, const void* const* w,
                                 const void* const* scale, const void* const* zero, const void* const* x,
                                 void* const* y, const void* const* residual, const int64_t* n, const int64_t* k,
                                 const int64_t* group, const int* weight_type, const int* epilogue,
                                 const int* stage, void* sync) {
    using namespace fused;
    if (count < 1 || count > kMaxTasks || M < 1 || M > kGemvMaxRows) return cudaErrorInvalidValue;
    for (int i = 0; i < count; ++i)
        if (!gemv_takes(n[i], k[i], weight_type[i], group[i])) return cudaErrorInvalidValue;
    // int8 tasks on the tensor cores (gemv_int8_band), every one whatever its shape or the rows of x (the two ways
    // add in different orders: one rule for every batch keeps a row's output the same alone or in a batch; a
    // per-thread rule for narrow matrices at one row gave 1.5B 1,149 tok/s at batch 1 against 1,044 on bands, but
    // 3,613 against 6,395 at batch 8: bench/results/experiment_w8_shape_rule_h200.json), their sums promoted per
    // vector; RWKV_GEMV_INT8_TC=0: the per-thread code, 2: bands summed in the tensor cores' accumulators
    // throughout (both for A/B runs)
    static const int64_t int8_mode = env_int("RWKV_GEMV_INT8_TC", 1);
    int types[kMaxTasks];
    for (int i = 0; i < count; ++i)
        types[i] = weight_type[i] == kWeightInt8 && int8_mode != 0
                       ? kWeightInt8Band
                       : weight_type[i];
    GemvArgs args{};
    const int blocks = pack_gemv(args, count, w, scale, zero, x, y, residual, n, k, group, types, epilogue);
    if (!stage_gemv(args, stage, static_cast<unsigned*>(sync))) return cudaErrorInvalidValue;
    if (int8_mode == 2)
        for (int i = 0; i < count; ++i) args.task[i].promote = 0;
    // RWKV_GEMV_WIDE_BANDS=0: every launch on gemv_kernel (A/B)
    static const bool wide_bands = env_flag("RWKV_GEMV_WIDE_BANDS", true);
    GemvKernel kernel = wide_bands && gemv_wide_bands(args, blocks) ? GemvKernel::kWideBands : GemvKernel::kGrouped;
    GemvArgs streamed = args;  // the same tasks planned for gemv_stream_kernel, where it takes the launch
    const int stream_blocks = use_stream_gemv(device) ? plan_stream_gemv(streamed, multiprocessors(device)) : 0;
    if (stream_blocks > 0) kernel = GemvKernel::kStreamed;
    const GemvArgs& launched = stream_blocks > 0 ? streamed : args;
    const int grid = stream_blocks > 0 ? stream_blocks : blocks;
    const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
    return on_device(device, [&] {
        switch (M) {
            case 1: return launch_gemv<1>(launched, grid, kernel, s);
            case 2: return launch_gemv<2>(launched, grid, kernel, s);
            case 3: return launch_gemv<3>(launched, grid, kernel, s);
            case 4: return launch_gemv<4>(launched, grid, kernel, s);
            case 5: return launch_gemv<5>(launched, grid, kernel, s);
            case 6: return launch_gemv<6>(launched, grid, kernel, s);
            case 7: return launch_gemv<7>(launched, grid, kernel, s);
            default: return launch_gemv<8>(launched, grid, kernel, s);
        }
    });
}

extern "C" const char* fused_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

// Workspace of a sparse-input GEMV of a K-major [k, n] weight for up to fused_sparse_gemv_max_rows(int8) rows
// (int8 weights: 0 where the source has no such kernel): `partial_floats` fp32 values and `arrivals` uint32
// counters, which must be zero before the first launch (every launch leaves them at zero). Returns
// cudaErrorInvalidValue for shapes it cannot take.
extern "C" int fused_sparse_gemv_max_rows(int int8) { return fused::sparse_max_rows(int8 != 0); }
extern "C" int fused_sparse_gemv_workspace(int64_t n, int64_t k, int int8, int64_t* partial_floats,
                                           int64_t* arrivals) {
    using namespace fused;
    if (!sparse_gemv_takes(1, n, k)) return cudaErrorInvalidValue;
    const SparseGemvArgs args = plan_sparse_gemv(n, k);
    *partial_floats = int64_t(args.slices) * sparse_max_rows(int8 != 0) * n;
    *arrivals = args.strips;
    return cudaSuccess;
}

// y = x w (* scale) (+ residual) for x [M, k] fp16 (M <= fused_sparse_gemv_max_rows(int8)), w [k, n] K-major:
// fp16, or int8 with its per-channel fp16 scale [n] (scale null for fp16); y and residual [M, n] (residual may
// alias y or be null); partial and arrivals: a workspace of the sizes above (n % 8 == 0, 16-byte aligned
// pointers).
extern "C" int fused_sparse_gemv_launch(int device, int64_t stream, int64_t M, const void* x, const void* w,
                                        const void* scale, void* y, const void* residual, void* partial,
                                        void* arrivals, int64_t n, int64_t k) {
    using namespace fused;
    const bool int8 = scale != nullptr;
    if (!sparse_gemv_takes(M, n, k, int8)) return cudaErrorInvalidValue;
    const SparseGemvArgs args =
        make_sparse_gemv_args(n, k, sparse_min_blocks(), x, w, scale, y, residual, partial, arrivals);
    const unsigned grid = static_cast<unsigned>(args.strips * args.slices);
    const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
    return on_device(device, [&] {
        return with_sparse_gemv_kernel(M, int8, [&](auto kernel) {
            return launch(kernel, grid, kSparseWarps * 32, s, args);
        });
    });
}

// out [K, width] = fp16 columns n0 .. n0 + width - 1 of W^T for a 4-bit GemLite matrix W [N, K] (words [K/8, N]
// int32, scale and zero [K/group, N] fp16; group % 8 == 0, K % group == 0, 0 <= n0, n0 + width <= N).
extern "C" int fused_uint4_dequantize_launch(int device, int64_t stream, const void* words, const void* scale,
                                             const void* zero, int64_t N, int64_t K, int64_t group, int64_t n0,
                                             int64_t width, void* out) {
    using namespace fused;
    if (width == 0 || K == 0) return cudaSuccess;
    if (N <= 0 || K < 0 || width < 0 || n0 < 0 || n0 + width > N || group <= 0 || group % 8 || K % group ||
        K / 8 * width > int64_t(INT_MAX) * kDequantThreads)
        return cudaErrorInvalidValue;
    return on_device(device, [&] {
        return launch(uint4_dequantize_kernel, dequantize_blocks(K, width), kDequantThreads,
                      reinterpret_cast<cudaStream_t>(stream), static_cast<const uint32_t*>(words),
                      static_cast<const __half*>(scale), static_cast<const __half*>(zero), N, K, group, n0, width,
                      static_cast<__half*>(out));
    });
}

// x = relu(x)^2 in place for n fp16 values (x 16-byte aligned).
extern "C" int fused_relu_square_launch(int device, int64_t stream, int64_t n, void* x) {
    using namespace fused;
    if (n == 0) return cudaSuccess;
    if (n < 0) return cudaErrorInvalidValue;
    return on_device(device, [&] {
        return launch(relu_square_kernel, relu_square_blocks(n), kReluSquareThreads,
                      reinterpret_cast<cudaStream_t>(stream), static_cast<__half*>(x), n);
    });
}

// HIP port of cuda/rwkv7_fused.cu: the fused kernels of the RWKV-7 forward (layer norm + token shift +
// mixes, time mix, grouped GEMV, sparse-input GEMV, relu^2).
//
// Same layout, math, work split and launcher interface as the CUDA file (read its header comment); what
// differs is the runtime API (hip*), the launches and the warp primitives:
// - no programmatic dependent launch on ROCm: dependency_wait() is a no-op and every kernel is a plain
//   <<<>>> launch on the caller's stream (RWKV_PDL is not read);
// - the reductions are written for teams of 32 threads and shuffle with width 32, so a team is a whole
//   wavefront on RDNA (wave32) and half of one on CDNA (wave64). block_sum keeps one scratch slot per
//   32-thread team (threadIdx.x >> 5) on both; the GEMV keeps one team per output row, and a team past
//   the last row still joins the shuffles instead of returning (a wave64 holds two teams);
// - the weights of the GEMV are streamed with nontemporal loads (CUDA: __ldcs);
// - the GEMV's 4-bit tasks multiply with an fp32 fma per thread instead of the CUDA file's tensor-core
//   mma, over a work split of their own (the same rebuilt weights and fp16 x: see above kUint4Band);
// - the state staging helpers of cuda/wkv7_state.cuh are copied in below (as hip/wkv7_slots.hip does),
//   since that header includes the CUDA runtime.
//
// Build: torch.utils.cpp_extension on a ROCm build of torch compiles this file with hipcc together with
// cuda/rwkv7_fused_op.cpp (which only sees the C launchers below). Compile-checked, not run on ROCm.

#include <hip/hip_runtime.h>
#include <hip/hip_fp16.h>

#include <climits>
#include <cstdint>
#include <cstdlib>

#include "../cuda/int8x4.cuh"

// ------------------------------------------------------------------------ state staging (wkv7_state.cuh)
namespace wkv7 {

constexpr int N = 64;  // head size; also the block size of the time mix

// dtype codes shared with the binding (cuda/rwkv7_fused_op.cpp)
enum DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// A head's 64x64 state block moves between global memory and one register row per thread through a
// padded fp32 tile in shared memory (16-byte vectors, consecutive threads on consecutive vectors).
constexpr int LD = N + 4;

// 8 halves <-> 16 bytes, by bit operations (a memcpy through a __half array can leave it in private
// memory). torch builds extensions with __HIP_NO_HALF_CONVERSIONS__ & co: convert explicitly.
__device__ __forceinline__ void unpack8(uint4 u, float (&out)[8]) {  // by value: a reference into global memory made memcpy load bytes
    const uint32_t words[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[2 * i] = __half2float(__ushort_as_half(static_cast<unsigned short>(words[i] & 0xFFFFu)));
        out[2 * i + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(words[i] >> 16)));
    }
}

__device__ __forceinline__ uint4 pack8(const float (&in)[8]) {
    uint32_t words[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
        words[i] = uint32_t(__half_as_ushort(__float2half_rn(in[2 * i]))) |
                   (uint32_t(__half_as_ushort(__float2half_rn(in[2 * i + 1]))) << 16);
    uint4 u;
    u.x = words[0];
    u.y = words[1];
    u.z = words[2];
    u.w = words[3];
    return u;
}

// 16 bytes of state storage <-> fp32
template <typename S>
struct Vec16;

template <>
struct Vec16<float> {
    static constexpr int E = 4;  // elements per vector
    static __device__ __forceinline__ void to_f32(uint4 u, float (&out)[E]) {
        __builtin_memcpy(out, &u, sizeof(u));
    }
    static __device__ __forceinline__ uint4 from_f32(const float (&in)[E]) {
        uint4 u;
        __builtin_memcpy(&u, in, sizeof(u));
        return u;
    }
};

template <>
struct Vec16<__half> {
    static constexpr int E = 8;
    static __device__ __forceinline__ void to_f32(uint4 u, float (&out)[E]) { unpack8(u, out); }
    static __device__ __forceinline__ uint4 from_f32(const float (&in)[E]) { return pack8(in); }
};

// Global state block -> tile (fp32) in two halves, so that a kernel can do other work while the loads are
// in flight: block_load issues this thread's share of the block's 16-byte vectors, staged_to_tile stores
// them into the tile. Every thread of the block calls both.
template <typename S>
struct Staged {
    static constexpr int E = Vec16<S>::E;
    static constexpr int PER_ROW = N / E;  // vectors per state row; the block holds N * PER_ROW vectors
    uint4 vec[PER_ROW];                    // vector threadIdx.x + N * c of the block
};

template <typename S>
__device__ __forceinline__ void block_load(const S* __restrict__ src, Staged<S>& staged) {
    const uint4* q = reinterpret_cast<const uint4*>(src);
#pragma unroll
    for (int c = 0; c < Staged<S>::PER_ROW; ++c) staged.vec[c] = q[threadIdx.x + N * c];
}

template <typename S>
__device__ __forceinline__ void staged_to_tile(const Staged<S>& staged, float (*tile)[LD]) {
    constexpr int E = Staged<S>::E, PER_ROW = Staged<S>::PER_ROW;
#pragma unroll
    for (int c = 0; c < PER_ROW; ++c) {
        const int f = threadIdx.x + N * c;  // vector index within the block
        float vals[E];
        Vec16<S>::to_f32(staged.vec[c], vals);
        float* dst = &tile[f / PER_ROW][(f % PER_ROW) * E];
#pragma unroll
        for (int e = 0; e < E; e += 4)
            *reinterpret_cast<float4*>(dst + e) = make_float4(vals[e], vals[e + 1], vals[e + 2], vals[e + 3]);
    }
}

// Tile (fp32) -> global state block, rounding to the storage type. Every thread must call it.
template <typename S>
__device__ __forceinline__ void tile_to_block(const float (*tile)[LD], S* __restrict__ dst) {
    constexpr int E = Vec16<S>::E;
    constexpr int PER_ROW = N / E;
    uint4* q = reinterpret_cast<uint4*>(dst);
#pragma unroll
    for (int c = 0; c < PER_ROW; ++c) {
        const int f = threadIdx.x + N * c;
        const float* src = &tile[f / PER_ROW][(f % PER_ROW) * E];
        float vals[E];
#pragma unroll
        for (int e = 0; e < E; e += 4) {
            const float4 v4 = *reinterpret_cast<const float4*>(src + e);
            vals[e] = v4.x;
            vals[e + 1] = v4.y;
            vals[e + 2] = v4.z;
            vals[e + 3] = v4.w;
        }
        q[f] = Vec16<S>::from_f32(vals);
    }
}

// One thread's row of the tile <-> registers.
__device__ __forceinline__ void tile_row_to_regs(const float* __restrict__ row, float (&s)[N]) {
#pragma unroll
    for (int c = 0; c < N / 4; ++c) {
        const float4 f = reinterpret_cast<const float4*>(row)[c];
        s[4 * c + 0] = f.x;
        s[4 * c + 1] = f.y;
        s[4 * c + 2] = f.z;
        s[4 * c + 3] = f.w;
    }
}

__device__ __forceinline__ void regs_to_tile_row(const float (&s)[N], float* __restrict__ row) {
#pragma unroll
    for (int c = 0; c < N / 4; ++c)
        reinterpret_cast<float4*>(row)[c] = make_float4(s[4 * c + 0], s[4 * c + 1], s[4 * c + 2], s[4 * c + 3]);
}

// The recurrence on four consecutive state values of one row (see cuda/wkv7_state.cuh: dot4, update4, hsum4).
__device__ __forceinline__ void dot4(const float* s, float4 av, float4& acc) {
    acc.x = fmaf(s[0], av.x, acc.x);
    acc.y = fmaf(s[1], av.y, acc.y);
    acc.z = fmaf(s[2], av.z, acc.z);
    acc.w = fmaf(s[3], av.w, acc.w);
}

__device__ __forceinline__ void update4(float* s, float4 wv, float4 bv, float4 kv, float4 rv, float sa, float v,
                                        float4& out) {
    s[0] = fmaf(s[0], wv.x, fmaf(sa, bv.x, v * kv.x));
    s[1] = fmaf(s[1], wv.y, fmaf(sa, bv.y, v * kv.y));
    s[2] = fmaf(s[2], wv.z, fmaf(sa, bv.z, v * kv.z));
    s[3] = fmaf(s[3], wv.w, fmaf(sa, bv.w, v * kv.w));
    out.x = fmaf(s[0], rv.x, out.x);
    out.y = fmaf(s[1], rv.y, out.y);
    out.z = fmaf(s[2], rv.z, out.z);
    out.w = fmaf(s[3], rv.w, out.w);
}

__device__ __forceinline__ float hsum4(float4 v) { return (v.x + v.y) + (v.z + v.w); }

// One token of the recurrence for the state row s of one thread (see cuda/wkv7_state.cuh: token_step).
__device__ __forceinline__ float token_step(float (&s)[N], const float* a, const float* w, const float* k,
                                            const float* b, const float* r, float v) {
    const float4 *a4 = reinterpret_cast<const float4*>(a), *w4 = reinterpret_cast<const float4*>(w),
                 *k4 = reinterpret_cast<const float4*>(k), *b4 = reinterpret_cast<const float4*>(b),
                 *r4 = reinterpret_cast<const float4*>(r);
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int c = 0; c < N / 4; ++c) dot4(&s[4 * c], a4[c], acc);
    const float sa = hsum4(acc);
    float4 out = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int c = 0; c < N / 4; ++c) update4(&s[4 * c], w4[c], b4[c], k4[c], r4[c], sa, v, out);
    return hsum4(out);
}

}  // namespace wkv7

namespace fused {

using wkv7::N;

constexpr int kTeam = 32;           // threads per reduction team (a "warp" of the CUDA file)
constexpr int kLnThreads = 256;
constexpr int kMaxVec = 4;          // 16-byte vectors (8 halves) per thread: C <= 256 * 4 * 8 = 8192
constexpr int kMaxMix = 6;
constexpr int kLnSpan = 4;           // tokens per block of ln_shift_mix_span_kernel
constexpr float kLnEps = 1e-5f;
constexpr float kExpMinusHalf = 0.606531f;
constexpr float kGroupNormEps = 64e-5f;  // head_size * 1e-5

// torch builds extensions with __HIP_NO_HALF_CONVERSIONS__ & co: convert explicitly.
__device__ __forceinline__ float sigmoidf(float x) { return 1.0f / (1.0f + __expf(-x)); }
__device__ __forceinline__ float h2f(__half x) { return __half2float(x); }
__device__ __forceinline__ float round_half(float x) { return __half2float(__float2half_rn(x)); }

// No programmatic dependent launch on ROCm: kernels on a stream run one after the other.
__device__ __forceinline__ void dependency_wait() {}

__device__ __forceinline__ void load8(const __half* p, float (&out)[8]) {
    wkv7::unpack8(*reinterpret_cast<const uint4*>(p), out);
}

__device__ __forceinline__ void store8(__half* p, const float (&in)[8]) {
    *reinterpret_cast<uint4*>(p) = wkv7::pack8(in);
}

// 16 bytes read once (weights): a nontemporal load, the counterpart of CUDA's __ldcs.
typedef unsigned int u32x4 __attribute__((ext_vector_type(4)));
__device__ __forceinline__ uint4 load_stream(const void* p) {
    const u32x4 v = __builtin_nontemporal_load(reinterpret_cast<const u32x4*>(p));
    uint4 u;
    u.x = v.x;
    u.y = v.y;
    u.z = v.z;
    u.w = v.w;
    return u;
}

// Sum over the 32-thread team (width 32: half a wavefront on wave64, all of it on wave32).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = kTeam / 2; o > 0; o >>= 1) v += __shfl_xor(v, o, kTeam);
    return v;
}

// Sum over the block of TEAMS teams of 32; `scratch` holds one float per team and must not be reused by
// another reduction until every thread has passed a later barrier.
template <int TEAMS>
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    v = warp_sum(v);
    if ((threadIdx.x & (kTeam - 1)) == 0) scratch[threadIdx.x / kTeam] = v;
    __syncthreads();
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < TEAMS; ++w) total += scratch[w];
    return total;
}

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
    const float mean = block_sum<kLnThreads / kTeam>(sum, scratch) * inv_c;
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
    const float rstd = rsqrtf(block_sum<kLnThreads / kTeam>(sq, scratch + kLnThreads / kTeam) * inv_c + kLnEps);
#pragma unroll
    for (int j = 0; j < VECS; ++j) {
        if (threadIdx.x + j * kLnThreads < vecs) {
            float wv[8], bv[8];
            wkv7::unpack8(w[j], wv);
            wkv7::unpack8(b[j], bv);
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
        for (int m = 0; m < kMaxMix; ++m) {  // unrolled: constant indices keep args out of private memory
            if (m < args.count) mix[m] = *reinterpret_cast<const uint4*>(args.mix[m] + v * 8);
        }
        float d[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) d[e] = pv[j][e] - xn[j][e];
#pragma unroll
        for (int m = 0; m < kMaxMix; ++m) {
            if (m < args.count) {  // (a guard, not a break: LLVM does not fully unroll the break)
                float mf[8], o[8];
                wkv7::unpack8(mix[m], mf);
#pragma unroll
                for (int e = 0; e < 8; ++e) o[e] = fmaf(d[e], mf[e], xn[j][e]);
                store8(args.out[m] + t * C + v * 8, o);
            }
        }
    }
}

// prev[t] >= 0: index of the previous token of t's row; prev[t] < 0: t starts row -prev[t]-1.
// VECS: 8-vectors per thread, the fewest that cover C (registers grow with it).
template <int VECS>
__global__ void __launch_bounds__(kLnThreads)
ln_shift_mix_kernel(int C, int64_t num_slots, const __half* __restrict__ x, const __half* __restrict__ ln_w,
                    const __half* __restrict__ ln_b, __half* __restrict__ shift, const int32_t* __restrict__ prev,
                    const int64_t* __restrict__ slots, const int64_t* __restrict__ lasts, MixArgs args) {
    __shared__ float scratch[2 * kLnThreads / kTeam];
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
__global__ void __launch_bounds__(kLnThreads)
ln_shift_mix_span_kernel(int64_t T, int C, int64_t num_slots, const __half* __restrict__ x,
                         const __half* __restrict__ ln_w, const __half* __restrict__ ln_b, __half* __restrict__ shift,
                         const int32_t* __restrict__ prev, const int64_t* __restrict__ slots,
                         const int64_t* __restrict__ lasts, MixArgs args) {
    __shared__ float scratch[2 * kLnThreads / kTeam];
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

// Whether a time-mix block's row has work (values the same for the whole block, so the early return is
// block-uniform). If not, the block waits for its predecessor like any other and, for a row on a bad slot,
// stores NaN outputs (its tokens first + offset, + stride, ... at channel col), leaving the state alone.
__device__ __forceinline__ bool row_has_work(const TimeMixArgs& p, int64_t first, int64_t last, int64_t slot,
                                             int64_t num_slots, int64_t num_tokens, int64_t C, int64_t col,
                                             int offset, int stride) {
    if (!row_tokens_valid(first, last, num_tokens)) {  // empty row or bad token range
        dependency_wait();
        return false;
    }
    if (!slot_valid(slot, num_slots)) {
        dependency_wait();
        for (int64_t t = first + offset; t <= last; t += stride)
            p.out[t * C + col] = __float2half_rn(__int_as_float(0x7fc00000));
        return false;
    }
    return true;
}

// One block of 64 threads: one wavefront on CDNA, two on RDNA; block_sum<2> works on 32-thread teams
// either way.
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
    __shared__ __align__(16) float kr[N], kw[N], kk_[N], ka[N], kb[N];  // key-axis vectors of the token
    __shared__ float scratch[6];

    // The state block and the first token's inputs are loaded together, and each token fetches the next
    // one's inputs before the barrier that ends it (see the CUDA source).
    S* block = state + (slot * H + h) * N * N;
    wkv7::Staged<S> staged;
    wkv7::block_load(block, staged);

    const auto [w0, r_k, lnx_w, lnx_b, a0, k_k, k_a, v0] = load_channel_params(p, col);

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
        const float norm = sqrtf(block_sum<N / kTeam>(kkr * kkr, scratch));
        const float kk = kkr / fmaxf(norm, 1e-12f);
        kr[i] = r;
        kw[i] = w;
        kk_[i] = kn;
        ka[i] = -kk;
        kb[i] = kk * a;
        __syncthreads();

        const float y = wkv7::token_step(s, ka, kw, kk_, kb, kr, v);

        // group norm over the head, plus the bonus term sum_j r_j k'_j r_k_j
        const float mean = block_sum<N / kTeam>(y, scratch + 2) * (1.0f / N);
        const float bonus = block_sum<N / kTeam>(r * kn * r_k, scratch + 4);
        float var_part = (y - mean) * (y - mean);
        // reuse scratch[0..1]: every thread read it before the barrier inside the mean's block_sum
        const float var = block_sum<N / kTeam>(var_part, scratch) * (1.0f / N);
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
// Port note: the quad shuffles and the per-token sums use 32-thread teams, as block_sum does.
constexpr int kPrefillThreads = 4 * N;
constexpr int kPrefillChunk = 8;
constexpr unsigned kPrefillMaxBlocks = 512;  // larger grids take time_mix_chunked_kernel (see the CUDA source)
constexpr int kPrefillPerPass = kPrefillThreads / N;            // tokens side by side in phases A and C
constexpr int kPrefillPasses = kPrefillChunk / kPrefillPerPass;  // tokens per thread in phases A and C

struct PrefillChunk {  // shared: the chunk's key-axis vectors (r, w, k', -kk, kk*a), v' and y, per token
    float r[kPrefillChunk][N], w[kPrefillChunk][N], k[kPrefillChunk][N], a[kPrefillChunk][N], b[kPrefillChunk][N];
    float v[kPrefillChunk][N], y[kPrefillChunk][N];
    float norm[kPrefillChunk][2], bonus[kPrefillChunk][2], mean[kPrefillChunk][2], var[kPrefillChunk][2];  // per 32-thread team
};

// Sum over LANES adjacent lanes (a power of two, groups aligned to it), in every lane of the group: quads of a
// state row, a split-kernel row's threads, a head's 8 lanes in time_mix_finish_kernel.
template <int LANES>
__device__ __forceinline__ float lanes_sum(float v) {
#pragma unroll
    for (int o = 1; o < LANES; o <<= 1) v += __shfl_xor(v, o, kTeam);
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
    const int half_head = (threadIdx.x / kTeam) % 2;  // which of the token's two 32-thread teams
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
            if (threadIdx.x % kTeam == 0) {
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

        // B: the recurrence on this thread's quarter row (see token_step in cuda/wkv7_state.cuh)
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
            if (threadIdx.x % kTeam == 0) buf.mean[u][half_head] = part;
        }
        __syncthreads();
#pragma unroll
        for (int m = 0; m < kPrefillPasses; ++m) {
            const int u = u0 + m * kPrefillPerPass;
            mean[m] = (buf.mean[u][0] + buf.mean[u][1]) * (1.0f / N);
            const float part = warp_sum((y[m] - mean[m]) * (y[m] - mean[m]));
            if (threadIdx.x % kTeam == 0) buf.var[u][half_head] = part;
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
// Port note: the sums over the head are per 32-thread team, then the two teams, as block_sum<2> adds them;
// the quad shuffles are within a team.
constexpr int kChunkTokens = 8;
constexpr int kChunkInputs = 8;  // r, k, v, dw, da, g, dv, v_first (layer 0: the first six)
constexpr int kChunkRows = 4;    // state rows per thread in phase B

struct ChunkBuffers {  // shared, per token of the chunk: key-axis vectors, v', g and y by channel, per-team sums
    float r[kChunkTokens][N], w[kChunkTokens][N], k[kChunkTokens][N], a[kChunkTokens][N], b[kChunkTokens][N];
    float v[kChunkTokens][N], g[kChunkTokens][N], y[kChunkTokens][N];
    float norm[kChunkTokens][2], bonus[kChunkTokens][2], mean[kChunkTokens][2], var[kChunkTokens][2];
};

// Input j of the chunk (the order above), and how many the layer reads: the kernel's loads and the launcher's
// alignment check (time_mix_kernel_for) go through these.
__host__ __device__ __forceinline__ const __half* chunk_input(const TimeMixArgs& p, int j) {
    return j == 0 ? p.r : j == 1 ? p.k : j == 2 ? p.v : j == 3 ? p.dw : j == 4 ? p.da : j == 5 ? p.g : j == 6 ? p.dv
                                                                                                       : p.v_first;
}
__host__ __device__ __forceinline__ int chunk_inputs(const TimeMixArgs& p) { return p.first_layer ? 6 : kChunkInputs; }

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
    const int i = threadIdx.x, team = threadIdx.x / kTeam;
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
        if ((threadIdx.x & (kTeam - 1)) == 0) {
            buf.norm[u][team] = norm_part;
            buf.bonus[u][team] = bonus_part;
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

template <typename S>
__global__ void __launch_bounds__(N, 8)
time_mix_chunked_kernel(int H, int64_t num_slots, int64_t num_tokens, S* __restrict__ state,
                        const int64_t* __restrict__ slots, const int64_t* __restrict__ starts,
                        const int64_t* __restrict__ lasts, TimeMixArgs p) {
    static_assert(kChunkTokens * 8 == N, "load_chunk: 8 threads per token");
    static_assert(kChunkRows == 4 && N / kChunkRows * 4 == N, "phase B: a quad of threads per 4 rows (float4 of v, y)");
    const int h = blockIdx.x % H;
    const int i = threadIdx.x, team = threadIdx.x / kTeam;
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
        if (more) {  // the inputs' buffer is free since the first barrier; in two halves: fewer registers
            ChunkLoads<0, kChunkInputs / 2> front;
            load_chunk(p, t0 + kChunkTokens, last, C, h, front);
            store_chunk(front, inputs);
            ChunkLoads<kChunkInputs / 2, kChunkInputs> back;
            load_chunk(p, t0 + kChunkTokens, last, C, h, back);
            store_chunk(back, inputs);
        }

        __syncthreads();  // y of channel i was written by thread i / 4 * 4

        // C: group norm over the head (two passes over y), bonus, gate
        float y[kChunkTokens], mean[kChunkTokens], bonus[kChunkTokens];
#pragma unroll
        for (int u = 0; u < kChunkTokens; ++u) {
            y[u] = buf.y[u][i];
            const float part = warp_sum(y[u]);
            if ((threadIdx.x & (kTeam - 1)) == 0) buf.mean[u][team] = part;
        }
        __syncthreads();
#pragma unroll
        for (int u = 0; u < kChunkTokens; ++u) {
            mean[u] = (buf.mean[u][0] + buf.mean[u][1]) * (1.0f / N);
            bonus[u] = buf.bonus[u][0] + buf.bonus[u][1];  // read before the barrier: the next chunk rewrites it
            const float part = warp_sum((y[u] - mean[u]) * (y[u] - mean[u]));
            if ((threadIdx.x & (kTeam - 1)) == 0) buf.var[u][team] = part;
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

// ------------------------------------------------------------------------------------ time_mix, split
// Port note: "warps" are 32-thread teams (a wave64 holds two); the row sums shuffle within a team.
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
__host__ __device__ constexpr int split_threads(int parts) { return split_b_threads(parts) + kTeam * kSplitAWarps; }
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
    auto half_at = [](uint32_t word, int hi) {
        return __half2float(__ushort_as_half(static_cast<unsigned short>(hi ? word >> 16 : word & 0xFFFFu)));
    };
    return make_float4(half_at(u.x, 0), half_at(u.x, 1), half_at(u.y, 0), half_at(u.y, 1));
}
__device__ __forceinline__ void store_state4(float* dst, const float* v) {
    *reinterpret_cast<float4*>(dst) = make_float4(v[0], v[1], v[2], v[3]);
}
__device__ __forceinline__ void store_state4(__half* dst, const float* v) {
    auto bits = [](float x) { return uint32_t(__half_as_ushort(__float2half_rn(x))); };
    uint2 u;
    u.x = bits(v[0]) | (bits(v[1]) << 16);
    u.y = bits(v[2]) | (bits(v[3]) << 16);
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
    const int lane = threadIdx.x & (kTeam - 1);
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
    static_assert(kRowVecs * 4 * kRowThreads == N && kBThreads % 64 == 0, "B: whole float4s, whole waves");
    static_assert(kSplitWarpTokens * kSplitAWarps == kChunkTokens, "A: the warps share a chunk's tokens");
    const int part = blockIdx.x % PARTS;
    const int64_t head_block = blockIdx.x / PARTS;  // row * H + head
    const int h = static_cast<int>(head_block % H);
    const bool recurrence = threadIdx.x < kBThreads;  // B's warps (wave-uniform)
    const int i = threadIdx.x % N;
    const int row = part * (N / PARTS) + threadIdx.x / kRowThreads, q = threadIdx.x % kRowThreads;  // B: row, columns
    const int warp_a = static_cast<int>(threadIdx.x / kTeam) - kBThreads / kTeam;  // A's teams: 0 .. kSplitAWarps-1
    const int64_t C = int64_t(H) * N;
    const int64_t col0 = int64_t(h) * N + (threadIdx.x & (kTeam - 1));                  // A: channels col0, col0 + 32

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
// the block needs no barrier. Rows the split kernel left alone (row_has_work) are skipped.
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
constexpr int kGemvWarps = 8;  // 32-thread teams per block, one output row each
constexpr int kMaxTasks = 8;
constexpr int kGemvMaxRows = 8;

enum WeightType : int { kWeightHalf = 0, kWeightInt8 = 1, kWeightUint4 = 2 };
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
    int splits;              // teams per output channel (1, 2, 4 or 8), each reading one slice of the row;
                             // 4-bit: 1 or 2, a block takes kUint4Band / splits columns
    int rows_per_warp;       // output channels per team (a power of two; short rows), kTeam / rows_per_warp
                             // lanes each; 1 with splits > 1 and for 4-bit tasks
    int first_block;         // blocks [first_block, first_block + gemv_units(task) / kGemvWarps) compute this task
};

struct GemvArgs {
    GemvTask task[kMaxTasks];
    int count;
};

// Each lane keeps kGemvLoads 16-byte weight loads in flight (the GEMV streams the weights; see the CUDA
// source): a batch of loads, then its arithmetic.
constexpr int kGemvLoads = 8;

// This lane's next batch of a weight row's 16-byte vectors: [first, first + kTeam, ...) below end.
__device__ __forceinline__ void load_weight_batch(const uint4* row, int first, int end, int stride,
                                                  uint4 (&w)[kGemvLoads]) {
#pragma unroll
    for (int j = 0; j < kGemvLoads; ++j) {
        if (first + stride * j < end) w[j] = load_stream(row + first + stride * j);
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
        float wf[8];
        wkv7::unpack8(w[j], wf);
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
// separate matmul would give it.
__device__ __forceinline__ void store_rounded(__half* y, const __half* residual, int64_t o, float product,
                                              int epilogue) {
    float val = round_half(product);
    if (epilogue == kEpiReluSquare) {
        val = relu_square(val);
    } else if (epilogue == kEpiTanh) {
        val = tanhf(val);
    } else if (epilogue == kEpiSigmoid) {
        val = sigmoidf(val);
    }
    if (residual) val += __half2float(residual[o]);
    y[o] = __float2half_rn(val);
}
__device__ __forceinline__ void store_output(const GemvTask& task, int m, int n, float product) {
    store_rounded(task.y, task.residual, int64_t(m) * task.n + n, product, task.epilogue);
}

// ---- 4-bit weights: GemLite's A16W4_HQQ_INT layout read in place (read the CUDA source's comment above
// kUint4Band), W[n][k] = fp16(q * scale + zero) with one fp16 fma as GemLite rebuilds it, fp32 sums. The CUDA source sums on the tensor cores
// (mma.m16n8k16, whose fragments have no counterpart here); this port does each product with an fp32 fma:
// a block per band of kUint4Band / splits channels, `lanes` threads across it loading 4 channels x 8 k
// each, the block's other threads slices of the K/8 rows of words, the slices' sums added in a fixed order
// (a butterfly inside each team, then the teams in order through shared memory).
constexpr int kUint4Band = 32;      // output channels per block at splits == 1 (8 lanes)
constexpr int kUint4MaxSplits = 2;  // 16 channels (4 lanes: 64-byte runs) at the most
constexpr int kUint4SplitMinK = 2048;  // only long rows are worth the narrower band
constexpr int kUint4Loads = 4;      // 16-byte loads per thread per batch (128 weights)

__device__ __forceinline__ __half2 as_half2(uint32_t bits) {
    __half2 h;
    __builtin_memcpy(&h, &bits, sizeof(h));
    return h;
}

// The 8 weights of one word (k = 8c .. 8c + 7) of one channel as floats: nibbles i and i + 4 under the
// exponent of 1024 in a half2 (exactly 1024 + q), 1024 off exactly, one __hfma2 for scale and zero.
__device__ __forceinline__ void dequant_uint4x8(uint32_t word, __half2 scale, __half2 zero, float (&w)[8]) {
    const __half2 bias = as_half2(0x64006400u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const __half2 q = __hsub2(as_half2(((word >> (4 * i)) & 0x000F000Fu) | 0x64006400u), bias);
        const __half2 v = __hfma2(q, scale, zero);
        w[i] = __low2float(v);
        w[i + 4] = __high2float(v);
    }
}

// Up to kUint4Loads consecutive rows of words of one group (4 channels each) and that group's scales and
// zeros of the 4 channels.
struct Uint4Batch {
    uint4 w[kUint4Loads];
    uint2 scale, zero;
    int count;  // rows loaded
};

// Rows [c, c + count) below end, count <= kUint4Loads, all in c's group; the weights stream past the caches.
__device__ __forceinline__ void load_uint4_batch(const GemvTask& task, int col, int c, int end, Uint4Batch& b) {
    const int group_rows = task.group / 8;
    const int g = c / group_rows;
    b.count = min(min(end, (g + 1) * group_rows) - c, kUint4Loads);
    const uint32_t* w = static_cast<const uint32_t*>(task.w) + int64_t(c) * task.n + col;
#pragma unroll
    for (int j = 0; j < kUint4Loads; ++j) {
        if (j < b.count) b.w[j] = load_stream(w + int64_t(j) * task.n);
    }
    const int64_t meta = int64_t(g) * task.n + col;
    b.scale = *reinterpret_cast<const uint2*>(task.scale + meta);
    b.zero = *reinterpret_cast<const uint2*>(task.zero + meta);
}

// acc[m][i] += x[m][k] * W[col + i][k] over the batch's rows; the rows of x in passes of at most 4.
template <int M>
__device__ __forceinline__ void fma_uint4_batch(const GemvTask& task, int c, const Uint4Batch& b, float (&acc)[M][4]) {
    constexpr int kPasses = (M + 3) / 4, kRows = (M + kPasses - 1) / kPasses;
    const uint32_t scales[2] = {b.scale.x, b.scale.y}, zeros[2] = {b.zero.x, b.zero.y};
    __half2 scale[4], zero[4];  // channel i's scale and zero in both halves
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned dup = i % 2 ? 0x3232u : 0x1010u;
        scale[i] = as_half2(__byte_perm(scales[i / 2], 0u, dup));
        zero[i] = as_half2(__byte_perm(zeros[i / 2], 0u, dup));
    }
#pragma unroll
    for (int j = 0; j < kUint4Loads; ++j) {
        if (j >= b.count) continue;  // (not break: clang then leaves the loop rolled)
        const int k = (c + j) * 8;
        const uint32_t words[4] = {b.w[j].x, b.w[j].y, b.w[j].z, b.w[j].w};
#pragma unroll
        for (int p = 0; p < kPasses; ++p) {
            float xf[kRows][8];
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
                const int m = p * kRows + r;
                if (m >= M) break;
                load8(task.x + int64_t(m) * task.k + k, xf[r]);
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                float wf[8];
                dequant_uint4x8(words[i], scale[i], zero[i], wf);
#pragma unroll
                for (int r = 0; r < kRows; ++r) {
                    const int m = p * kRows + r;
                    if (m >= M) break;
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[m][i] = fmaf(wf[e], xf[r][e], acc[m][i]);
                }
            }
        }
    }
}

// One block of a 4-bit task. Every thread reaches the shuffles and the barrier.
template <int M>
__device__ __forceinline__ void gemv_uint4_block(const GemvTask& task) {
    const int lanes_log2 = task.splits == 1 ? 3 : 2;  // threads across the band: 8 or 4
    const int lanes = 1 << lanes_log2, band = 4 * lanes;
    const int quad = threadIdx.x & (lanes - 1), slice = threadIdx.x >> lanes_log2;
    const int first_col = (int(blockIdx.x) - task.first_block) * band;
    const int col = first_col + 4 * quad;
    const bool active = col < task.n;  // n % 4 == 0: all 4 channels of a vector, or none
    const int rows = task.k / 8, slices = kGemvWarps * kTeam / lanes;
    const int chunk = (rows + slices - 1) / slices;
    const int begin = min(slice * chunk, rows), end = min(begin + chunk, rows);
    dependency_wait();

    float acc[M][4];
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[m][i] = 0.0f;
    }
    if (active) {
        Uint4Batch b;
#pragma unroll 1
        for (int c = begin; c < end; c += b.count) {
            load_uint4_batch(task, col, c, end, b);
            fma_uint4_batch<M>(task, c, b, acc);
        }
    }
    // The slices of a team hold the same channels in lanes `lanes` apart: a butterfly over those lanes.
#pragma unroll 1
    for (int o = lanes; o < kTeam; o <<= 1) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[m][i] += __shfl_xor(acc[m][i], o, kTeam);
        }
    }
    __shared__ float band_sum[kGemvWarps][M][kUint4Band];
    const int lane = threadIdx.x & (kTeam - 1), team = int(threadIdx.x / kTeam);
    if (lane < lanes) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
#pragma unroll
            for (int i = 0; i < 4; ++i) band_sum[team][m][4 * quad + i] = acc[m][i];
        }
    }
    __syncthreads();
    // One output per thread: (row m, channel first_col + j), the teams' sums added in team order.
    const int m = threadIdx.x >> (lanes_log2 + 2), j = threadIdx.x & (band - 1);
    if (m >= M || first_col + j >= task.n) return;
    float sum = band_sum[0][m][j];
#pragma unroll
    for (int w = 1; w < kGemvWarps; ++w) sum += band_sum[w][m][j];
    store_output(task, m, first_col + j, sum);
}

// (No minimum-occupancy argument: HIP's second __launch_bounds__ parameter means something else.)
template <int M>
__global__ void __launch_bounds__(kGemvWarps * kTeam) gemv_kernel(GemvArgs args) {
    int t = 0;
#pragma unroll 1
    while (t + 1 < args.count && int(blockIdx.x) >= args.task[t + 1].first_block) ++t;
    const GemvTask& task = args.task[t];
    if (task.weight_type == kWeightUint4) {  // block-uniform
        gemv_uint4_block<M>(task);
        return;
    }
    const int lane = threadIdx.x & (kTeam - 1), team = int(threadIdx.x / kTeam);
    // This team's (output channels, slice): a block holds whole channels, as kGemvWarps % splits == 0. A team
    // of short rows takes rows_per_warp channels, `lanes` lanes each (splits is then 1).
    const int lanes = kTeam / task.rows_per_warp, sub = lane % lanes;
    const int unit = (int(blockIdx.x) - task.first_block) * kGemvWarps + team;
    const int n = unit / task.splits * task.rows_per_warp + lane / lanes, split = unit % task.splits;
    dependency_wait();
    // Lanes past the last row still join the shuffles (a wave64 holds two teams) and the block's barrier,
    // and only skip the loads and the stores.
    const bool active = n < task.n;  // the same for a channel's lanes

    float acc[M];
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = 0.0f;
    if (active) {
        const int count = task.weight_type == kWeightInt8 ? task.k / 16 : task.k / 8;  // 16-byte vectors per row
        const int slice = count / task.splits;
        const int begin = split * slice, end = begin + slice;
        const uint4* row = reinterpret_cast<const uint4*>(task.w) + int64_t(n) * count;
        uint4 w[kGemvLoads];
#pragma unroll 1
        for (int first = begin + sub; first < end; first += lanes * kGemvLoads) {
            load_weight_batch(row, first, end, lanes, w);
            if (task.weight_type == kWeightInt8) {
                fma_int8_batch<M>(task, first, end, lanes, w, acc);
            } else {
                fma_half_batch<M>(task, first, end, lanes, w, acc);
            }
        }
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {  // over the channel's lanes (the whole team: warp_sum's order)
        for (int o = lanes / 2; o > 0; o >>= 1) acc[m] += __shfl_xor(acc[m], o, kTeam);
    }
    if (task.splits > 1) {  // block-uniform: the slices' sums, added in slice order (deterministic)
        __shared__ float partial[kGemvWarps][M];
        if (lane == 0) {
#pragma unroll
            for (int m = 0; m < M; ++m) partial[team][m] = acc[m];
        }
        __syncthreads();
        if (split != 0) return;
#pragma unroll
        for (int m = 0; m < M; ++m) {
            acc[m] = partial[team][m];
            for (int j = 1; j < task.splits; ++j) acc[m] += partial[team + j][m];
        }
    }
    if (!active || sub != 0) return;
    const float scale = task.scale ? __half2float(task.scale[n]) : 1.0f;
#pragma unroll
    for (int m = 0; m < M; ++m) store_output(task, m, n, acc[m] * scale);
}

// ------------------------------------------------------------------------------------ sparse-input gemv
// y = x Wt (+ residual) with Wt K-major, skipping the weight rows of input columns that are zero in every row
// of x (the FFN value product at decode; read the CUDA source's comment). Same work split, with a 32-thread
// team for a warp: the team's ballot is an OR over shuffles, and the last block of a strip reads the other
// blocks' sums through volatile loads (past the non-coherent per-CU caches; CUDA: __ldcg).
constexpr int kSparseStrip = 256;
constexpr int kSparseMaxRows = 4;
constexpr int kSparseMaxBallots = 2;
constexpr int kSparseMinBlocks = 256;

struct SparseGemvArgs {
    const __half* x;         // [M, K]
    const __half* w;         // [K, N]: K-major
    __half* y;               // [M, N]
    const __half* residual;  // [M, N] or null (may alias y)
    float* partial;          // [slices, M, N]: the blocks' sums
    unsigned* arrivals;      // [strips]: zero before a launch, zero again after it
    int n, k, ballots, slices, strips;
};

// Bit l: lane l's predicate, over the 32-thread team.
__device__ __forceinline__ unsigned team_ballot(bool predicate) {
    unsigned bits = predicate ? 1u << (threadIdx.x & (kTeam - 1)) : 0u;
#pragma unroll
    for (int o = kTeam / 2; o > 0; o >>= 1) bits |= __shfl_xor(bits, o, kTeam);
    return bits;
}

template <int M>
__global__ void __launch_bounds__(kGemvWarps * kTeam) sparse_gemv_kernel(SparseGemvArgs args) {
    const int lane = threadIdx.x & (kTeam - 1), team = int(threadIdx.x / kTeam);
    const int strip = int(blockIdx.x) % args.strips, slice = int(blockIdx.x) / args.strips;
    const int col = strip * kSparseStrip + 8 * lane;
    const bool mine = col < args.n;
    const int rows = kTeam * args.ballots;
    const int k0 = (slice * kGemvWarps + team) * rows;
    dependency_wait();

    float xs[kSparseMaxBallots][M];
    uint64_t todo = 0;
#pragma unroll
    for (int b = 0; b < kSparseMaxBallots; ++b) {
        const int k = k0 + kTeam * b + lane;
        bool nonzero = false;
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const __half h = b < args.ballots && k < args.k ? args.x[int64_t(m) * args.k + k] : __float2half_rn(0.0f);
            xs[b][m] = __half2float(h);
            nonzero |= (__half_as_ushort(h) & 0x7fffu) != 0;  // -0 counts as zero, NaN as nonzero
        }
        todo |= uint64_t(team_ballot(nonzero)) << (kTeam * b);
    }

    float acc[M][8];
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[m][e] = 0.0f;
    }
    const __half* w = args.w + col;
    // Both teams of a wave64 take the same number of batches and shuffles (a team with fewer rows shuffles
    // along without adding), as the shuffles are wavefront-wide.
    int batches = (__popcll(todo) + kGemvLoads - 1) / kGemvLoads;
    batches = max(batches, __shfl_xor(batches, kTeam, warpSize));  // wave32: its own value
#pragma unroll 1
    for (int batch = 0; batch < batches; ++batch) {
        int row[kGemvLoads];
        uint4 v[kGemvLoads];
#pragma unroll
        for (int j = 0; j < kGemvLoads; ++j) {
            row[j] = todo ? __ffsll(static_cast<long long>(todo)) - 1 : -1;
            todo &= todo - 1;
            if (row[j] >= 0 && mine) v[j] = load_stream(w + int64_t(k0 + row[j]) * args.n);
        }
#pragma unroll
        for (int j = 0; j < kGemvLoads; ++j) {
            float wf[8];
            wkv7::unpack8(v[j], wf);
#pragma unroll
            for (int m = 0; m < M; ++m) {
                const float xk = __shfl(row[j] < kTeam ? xs[0][m] : xs[1][m], row[j] & (kTeam - 1), kTeam);
                if (row[j] < 0) continue;
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[m][e] = fmaf(xk, wf[e], acc[m][e]);
            }
        }
    }

    __shared__ float warp_acc[kGemvWarps][M][kSparseStrip];
    __shared__ bool last;
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int e = 0; e < 8; ++e) warp_acc[team][m][8 * lane + e] = acc[m][e];
    }
    __syncthreads();
    const int c = strip * kSparseStrip + threadIdx.x;
    const bool out = c < args.n;
    if (out) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float sum = warp_acc[0][m][threadIdx.x];
#pragma unroll
            for (int v = 1; v < kGemvWarps; ++v) sum += warp_acc[v][m][threadIdx.x];
            args.partial[(int64_t(slice) * M + m) * args.n + c] = sum;
        }
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&args.arrivals[strip], 1u) == unsigned(args.slices - 1);
    __syncthreads();
    if (!last) return;
    if (threadIdx.x == 0) args.arrivals[strip] = 0u;
    if (!out) return;
    __threadfence();
    const volatile float* partial = args.partial;
#pragma unroll
    for (int m = 0; m < M; ++m) {
        float sum = 0.0f;  // in slice order; kGemvLoads loads in flight at a time (this is the launch's tail)
        for (int s = 0; s < args.slices; s += kGemvLoads) {
            float part[kGemvLoads];
#pragma unroll
            for (int j = 0; j < kGemvLoads; ++j)
                part[j] = s + j < args.slices ? partial[(int64_t(s + j) * M + m) * args.n + c] : 0.0f;
#pragma unroll
            for (int j = 0; j < kGemvLoads; ++j) sum += part[j];
        }
        store_rounded(args.y, args.residual, int64_t(m) * args.n + c, sum, kEpiNone);
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

// Whether a launch of T tokens over B rows of C channels takes ln_shift_mix_span_kernel (see the CUDA source).
inline bool ln_span_for(int64_t T, int64_t B, int64_t C) {
    static const bool enabled = env_flag("RWKV_LN_SPAN", true);
    return enabled && T >= kLnSpan * B && ln_vecs(C) >= 2;
}

// The split kernel's launch: its scratch (y before the group norm, fp32 [T, C]) and time_mix_finish_kernel's
// grid (every row's (row, head) blocks for up to max_len tokens).
inline int64_t split_scratch_floats(int64_t num_tokens, int64_t H) { return num_tokens * H * N; }
inline int64_t finish_blocks(int64_t B, int64_t H, int64_t max_len) {
    return B * H * ((max_len + kFinishTokens - 1) / kFinishTokens);
}

// Which time-mix kernel a launch takes (see the CUDA source).
enum TimeMixKernel : int { kTimeMixDecode = 0, kTimeMixPrefill = 1, kTimeMixChunked = 2, kTimeMixSplit = 3 };

// Blocks per (row, head) of the split kernel on a (row, head) grid of `grid` blocks: 2 when that puts one block on
// each multiprocessor where 4 would put two, else 4 (measured on the H200, see the CUDA file).
inline int split_parts(unsigned grid, int multiprocessors) {
    return grid * 2 <= unsigned(multiprocessors) && grid * 4 > unsigned(multiprocessors) ? 2 : 4;
}

inline int time_mix_kernel_for(const TimeMixArgs& p, unsigned grid, int prefill) {
    static const int64_t split_max_blocks = env_int("RWKV_SPLIT_MAX_BLOCKS", kSplitMaxBlocks);
    static const int64_t prefill_max_blocks = env_int("RWKV_PREFILL_MAX_BLOCKS", kPrefillMaxBlocks);
    static const bool chunked = env_flag("RWKV_TIME_MIX_CHUNKED", true);
    if (!prefill) return kTimeMixDecode;
    bool aligned = true;
    for (int j = 0; j < chunk_inputs(p); ++j)
        aligned = aligned && reinterpret_cast<uintptr_t>(chunk_input(p, j)) % 16 == 0;
    if (grid <= split_max_blocks && aligned && reinterpret_cast<uintptr_t>(p.out) % 16 == 0) return kTimeMixSplit;
    if (grid < prefill_max_blocks) return kTimeMixPrefill;
    return chunked && aligned ? kTimeMixChunked : kTimeMixDecode;
}

// ------------------------------------------------------------------------------------ launches
// The device's multiprocessor (compute unit) count (0 when it cannot be read).
inline int multiprocessors(int device) {
    static int cached[64] = {0};  // 0 unknown, else count + 1
    if (device < 0 || device >= 64) return 0;
    if (cached[device] == 0) {
        int count = 0;
        if (hipDeviceGetAttribute(&count, hipDeviceAttributeMultiprocessorCount, device) != hipSuccess) count = 0;
        cached[device] = count + 1;
    }
    return cached[device] - 1;
}

// Plain launches (no PDL), each kernel named directly; the error of the launch is returned.
hipError_t launch_ln_shift_mix(int64_t T, int64_t B, hipStream_t stream, int C, int64_t num_slots, const __half* x,
                               const __half* ln_w, const __half* ln_b, __half* shift, const int32_t* prev,
                               const int64_t* slots, const int64_t* lasts, const MixArgs& args) {
    const int vecs = ln_vecs(C);
    if (ln_span_for(T, B, C)) {
        auto kernel = vecs == 1   ? ln_shift_mix_span_kernel<1>
                      : vecs == 2 ? ln_shift_mix_span_kernel<2>
                                  : ln_shift_mix_span_kernel<kMaxVec>;
        kernel<<<dim3(static_cast<unsigned>((T + kLnSpan - 1) / kLnSpan)), dim3(kLnThreads), 0, stream>>>(
            T, C, num_slots, x, ln_w, ln_b, shift, prev, slots, lasts, args);
        return hipGetLastError();
    }
    auto kernel = vecs == 1 ? ln_shift_mix_kernel<1> : vecs == 2 ? ln_shift_mix_kernel<2> : ln_shift_mix_kernel<kMaxVec>;
    kernel<<<dim3(static_cast<unsigned>(T)), dim3(kLnThreads), 0, stream>>>(C, num_slots, x, ln_w, ln_b, shift, prev,
                                                                            slots, lasts, args);
    return hipGetLastError();
}

template <typename S>
hipError_t launch_time_mix(unsigned grid, hipStream_t stream, int H, int64_t num_slots, int64_t num_tokens, S* state,
                           const int64_t* slots, const int64_t* starts, const int64_t* lasts, const TimeMixArgs& p,
                           int kernel, int64_t rows, int64_t finish_grid, float* scratch, int parts) {
    if (kernel == kTimeMixSplit) {
        if (parts == 2)
            time_mix_split_kernel<S, 2><<<dim3(grid * 2), dim3(split_threads(2)), 0, stream>>>(
                H, num_slots, num_tokens, state, slots, starts, lasts, p, scratch);
        else
            time_mix_split_kernel<S, 4><<<dim3(grid * 4), dim3(split_threads(4)), 0, stream>>>(
                H, num_slots, num_tokens, state, slots, starts, lasts, p, scratch);
        const hipError_t err = hipGetLastError();
        if (err != hipSuccess) return err;
        time_mix_finish_kernel<<<dim3(static_cast<unsigned>(finish_grid)), dim3(N), 0, stream>>>(
            H, rows, num_slots, num_tokens, slots, starts, lasts, p, scratch);
    } else if (kernel == kTimeMixPrefill) {
        time_mix_prefill_kernel<S><<<dim3(grid), dim3(kPrefillThreads), 0, stream>>>(H, num_slots, num_tokens, state,
                                                                                       slots, starts, lasts, p);
    } else if (kernel == kTimeMixChunked) {
        time_mix_chunked_kernel<S><<<dim3(grid), dim3(N), 0, stream>>>(H, num_slots, num_tokens, state, slots, starts,
                                                                       lasts, p);
    } else {
        time_mix_kernel<S><<<dim3(grid), dim3(N), 0, stream>>>(H, num_slots, num_tokens, state, slots, starts, lasts, p);
    }
    return hipGetLastError();
}

template <int M>
hipError_t launch_gemv(const GemvArgs& args, int blocks, hipStream_t stream) {
    const dim3 grid(static_cast<unsigned>(blocks)), block(kGemvWarps * kTeam);
    gemv_kernel<M><<<grid, block, 0, stream>>>(args);
    return hipGetLastError();
}

template <int M>
hipError_t launch_sparse_gemv(const SparseGemvArgs& args, hipStream_t stream) {
    sparse_gemv_kernel<M><<<dim3(static_cast<unsigned>(args.strips * args.slices)), dim3(kGemvWarps * kTeam), 0,
                            stream>>>(args);
    return hipGetLastError();
}

template <typename F>
int on_device(int device, F&& launch) {
    int previous = -1;
    hipError_t err = hipGetDevice(&previous);
    if (err != hipSuccess) return err;
    if (previous != device && (err = hipSetDevice(device)) != hipSuccess) return err;
    err = launch();
    if (previous != device) (void)hipSetDevice(previous);
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

// Whether gemv_kernel takes a task: k a multiple of one 16-byte load (8 fp16 or 16 int8 weights); 4-bit:
// whole 16-byte vectors of 4 channels (n % 4 == 0) and whole groups of whole words.
inline bool gemv_takes(int64_t n, int64_t k, int weight_type, int64_t group) {
    if (n <= 0 || k <= 0 || n > INT_MAX / 2 || k > INT_MAX / 2) return false;
    if (weight_type == kWeightUint4) return n % 4 == 0 && group > 0 && group % 8 == 0 && k % group == 0;
    return (weight_type == kWeightHalf && k % 8 == 0) || (weight_type == kWeightInt8 && k % 16 == 0);
}

// 16-byte vectors along K per unit of work (fp16 rows: 8 weights each, int8: 16, 4-bit words: 8 k-values
// of 4 channels), and the teams of work (kGemvWarps per block) of a task split `splits` ways.
inline int gemv_vectors(const GemvTask& t) { return t.weight_type == kWeightInt8 ? t.k / 16 : t.k / 8; }
inline int64_t gemv_units(const GemvTask& t, int splits) {
    if (t.weight_type == kWeightUint4) return (int64_t(t.n) * splits + kUint4Band - 1) / kUint4Band * kGemvWarps;
    return (int64_t(t.n) + t.rows_per_warp - 1) / t.rows_per_warp * splits;
}

// Short rows, as in the CUDA source: the fewest lanes (a power of two) that keep each lane within one batch
// of loads, and a team takes kTeam / lanes rows.
inline int gemv_rows_per_warp(const GemvTask& t) {
    if (t.weight_type == kWeightUint4) return 1;
    int lanes = 1;
    while (lanes < kTeam && lanes * kGemvLoads < gemv_vectors(t)) lanes *= 2;
    return kTeam / lanes;
}

// Row splitting, as in the CUDA source: the rows of the task with the longest slices are halved until the
// launch has kGemvSplitRows (row, slice) units, each slice keeping a full batch of loads per lane; a 4-bit
// task with long rows halves its band instead (once).
// 32,768 units: a 7.2B layer at batch 1 then splits r, k and v (and the FFN key) in two, one batch of loads
// per lane: 260.7 -> 267.8 tok/s against 16,384 (bench/results/decode_h200_lora_first_split32k.json).
constexpr int kGemvSplitRows = 32768;
constexpr int kGemvMinSlice = kTeam * kGemvLoads;

// The (row, slice) units a launch is split to: kGemvSplitRows, RWKV_GEMV_SPLIT_ROWS instead if set, 0 (no
// splitting) with RWKV_GEMV_SPLIT=0 (read once; for A/B timing).
inline int64_t gemv_split_rows() {
    static const int64_t value =
        env_flag("RWKV_GEMV_SPLIT", true) ? env_int("RWKV_GEMV_SPLIT_ROWS", kGemvSplitRows) : 0;
    return value;
}

inline void plan_gemv_splits(GemvArgs& args) {
    int64_t units = 0;
    for (int i = 0; i < args.count; ++i) {
        args.task[i].splits = 1;
        args.task[i].rows_per_warp = gemv_rows_per_warp(args.task[i]);
        units += gemv_units(args.task[i], 1);
    }
    while (units < gemv_split_rows()) {
        int best = -1, best_slice = 0;
        for (int i = 0; i < args.count; ++i) {
            const GemvTask& t = args.task[i];
            const int slice = gemv_vectors(t) / t.splits;
            const bool splittable = t.weight_type == kWeightUint4
                                        ? t.splits < kUint4MaxSplits && t.k >= kUint4SplitMinK
                                        : t.splits < kGemvWarps && t.rows_per_warp == 1 && slice % 2 == 0 &&
                                              slice / 2 >= kGemvMinSlice;
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
    }
    args.count = count;
    plan_gemv_splits(args);
    for (int i = 0; i < count; ++i) {
        GemvTask& t = args.task[i];
        t.first_block = blocks;
        blocks += static_cast<int>((gemv_units(t, t.splits) + kGemvWarps - 1) / kGemvWarps);
    }
    return blocks;
}

// The grid of a sparse-input GEMV (as the CUDA file plans it).
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
        const int64_t rows = int64_t(kGemvWarps) * kTeam * args.ballots;
        args.slices = static_cast<int>((k + rows - 1) / rows);
        if (args.ballots == 1 || int64_t(args.strips) * args.slices >= min_blocks) break;
    }
    return args;
}

inline bool sparse_gemv_takes(int64_t M, int64_t n, int64_t k) {
    return M >= 1 && M <= kSparseMaxRows && n > 0 && n % 8 == 0 && k > 0 && k <= INT_MAX / 2 &&
           n * kSparseMaxRows <= INT_MAX;
}

// The launch's arguments: the plan for a [k, n] weight (min_blocks: see plan_sparse_gemv) and the pointers.
inline SparseGemvArgs make_sparse_gemv_args(int64_t n, int64_t k, int64_t min_blocks, const void* x, const void* w,
                                            void* y, const void* residual, void* partial, void* arrivals) {
    SparseGemvArgs args = plan_sparse_gemv(n, k, min_blocks);
    args.x = static_cast<const __half*>(x);
    args.w = static_cast<const __half*>(w);
    args.y = static_cast<__half*>(y);
    args.residual = static_cast<const __half*>(residual);
    args.partial = static_cast<float*>(partial);
    args.arrivals = static_cast<unsigned*>(arrivals);
    return args;
}

// ------------------------------------------------------------------------------------ uint4_dequantize
// Columns n0 .. n0 + width - 1 of a 4-bit GemLite matrix's W^T as fp16 [K, width], bit for bit as the GEMV
// rebuilds them, for a cuBLAS/hipBLAS product at batches the GEMV does not take (see the CUDA file).
constexpr int kDequantThreads = 256;

__global__ void __launch_bounds__(kDequantThreads)
uint4_dequantize_kernel(const uint32_t* __restrict__ words, const __half* __restrict__ scale,
                        const __half* __restrict__ zero, int64_t N, int64_t K, int64_t group, int64_t n0,
                        int64_t width, __half* __restrict__ out) {
    const int64_t i = int64_t(blockIdx.x) * kDequantThreads + threadIdx.x;
    if (i >= K / 8 * width) return;
    const int64_t c = i / width, j = i % width, n = n0 + j, g = 8 * c / group;
    const __half s = scale[g * N + n], z = zero[g * N + n];
    float w[8];  // exact fp16 values
    dequant_uint4x8(words[c * N + n], __halves2half2(s, s), __halves2half2(z, z), w);
#pragma unroll
    for (int e = 0; e < 8; ++e) out[(8 * c + e) * width + j] = __float2half_rn(w[e]);
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
    if (T == 0) return hipSuccess;
    if (T < 0 || T > INT_MAX || B < 1 || C <= 0 || C % 8 || C > kLnThreads * kMaxVec * 8 || count < 1 ||
        count > kMaxMix)
        return hipErrorInvalidValue;
    const MixArgs args = make_mix_args(mix, out, count);
    return on_device(device, [&] {
        return launch_ln_shift_mix(T, B, reinterpret_cast<hipStream_t>(stream),
                                   static_cast<int>(C), num_slots, static_cast<const __half*>(x),
                                   static_cast<const __half*>(ln_w), static_cast<const __half*>(ln_b),
                                   static_cast<__half*>(shift), prev, slots, lasts, args);
    });
}

// tensors: r, k, v, dw, da, dv, g, v_first, out ([T, C] fp16; dv unused in layer 0);
// params: w0, r_k, lnx_w, lnx_b (fp32 [C]), a0, v0, k_k, k_a (fp16 [C]; v0 unused in layer 0).
// max_len: the longest row's tokens (a prefill when > 1, see time_mix_kernel_for).
// scratch: fp32, fused_time_mix_scratch_floats(...) of them (none when that is 0).
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
    // Not ported: the CUDA build's time_mix_pipelined_kernel (cp.async prefetch of the next row's state), so every
    // decode launch here takes time_mix_kernel, whatever pipeline_blocks asks (the results are the same).
    (void)pipeline_blocks;
    if (B == 0) return hipSuccess;
    if (B < 0 || H <= 0 || B * H > INT_MAX) return hipErrorInvalidConfiguration;
    const TimeMixArgs p = make_time_mix_args(tensors, params, first_layer);
    const int h = static_cast<int>(H);
    const hipStream_t s = reinterpret_cast<hipStream_t>(stream);
    const unsigned grid = static_cast<unsigned>(B * H);
    const int kernel = time_mix_kernel_for(p, grid, max_len > 1);
    const int64_t finish_grid = finish_blocks(B, H, max_len);
    if (kernel == kTimeMixSplit && (B * H > INT_MAX / kMaxSplitParts || finish_grid > INT_MAX))
        return hipErrorInvalidConfiguration;
    if (kernel == kTimeMixSplit && (scratch == nullptr || scratch_floats < split_scratch_floats(num_tokens, H)))
        return hipErrorInvalidValue;
    return on_device(device, [&] {
        const int parts = split_parts(grid, multiprocessors(device));
        if (state_dtype == wkv7::kFloat32)
            return launch_time_mix<float>(grid, s, h, num_slots, num_tokens, static_cast<float*>(state), slots,
                                          starts, lasts, p, kernel, B, finish_grid, scratch, parts);
        if (state_dtype == wkv7::kFloat16)
            return launch_time_mix<__half>(grid, s, h, num_slots, num_tokens, static_cast<__half*>(state), slots,
                                           starts, lasts, p, kernel, B, finish_grid, scratch, parts);
        return hipErrorInvalidValue;
    });
}

extern "C" int fused_gemv_max_rows() { return fused::kGemvMaxRows; }
extern "C" int fused_gemv_max_tasks() { return fused::kMaxTasks; }

// One launch computing `count` tasks y_i = epilogue(x_i W_i^T) (see GemvTask) for M rows each.
// Weight k must be a multiple of 8 (fp16) or 16 (int8); 4-bit (weight type 2): n % 4 == 0, group % 8 == 0,
// k % group == 0; every pointer 16-byte aligned. zero and group are read for 4-bit tasks only. stage and sync: the
// CUDA source's staged launches, which this port does not have (every stage must be 0).
extern "C" int fused_gemv_launch(int device, int64_t stream, int64_t M, int count, const void* const* w,
                                 const void* const* scale, const void* const* zero, const void* const* x,
                                 void* const* y, const void* const* residual, const int64_t* n, const int64_t* k,
                                 const int64_t* group, const int* weight_type, const int* epilogue,
                                 const int* stage, void* /*sync*/) {
    using namespace fused;
    if (count < 1 || count > kMaxTasks || M < 1 || M > kGemvMaxRows) return hipErrorInvalidValue;
    for (int i = 0; i < count; ++i)
        if (stage[i] != 0) return hipErrorInvalidValue;
    for (int i = 0; i < count; ++i)
        if (!gemv_takes(n[i], k[i], weight_type[i], group[i])) return hipErrorInvalidValue;
    GemvArgs args{};
    const int blocks = pack_gemv(args, count, w, scale, zero, x, y, residual, n, k, group, weight_type, epilogue);
    const hipStream_t s = reinterpret_cast<hipStream_t>(stream);
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

extern "C" const char* fused_error_string(int code) { return hipGetErrorString(static_cast<hipError_t>(code)); }

// The sparse-input GEMV's workspace and launch (see the CUDA file): fp16 weights only here (int8: 0 rows).
extern "C" int fused_sparse_gemv_max_rows(int int8) { return int8 ? 0 : fused::kSparseMaxRows; }
extern "C" int fused_sparse_gemv_workspace(int64_t n, int64_t k, int int8, int64_t* partial_floats,
                                           int64_t* arrivals) {
    using namespace fused;
    if (int8 || !sparse_gemv_takes(1, n, k)) return hipErrorInvalidValue;
    const SparseGemvArgs args = plan_sparse_gemv(n, k);
    *partial_floats = int64_t(args.slices) * kSparseMaxRows * n;
    *arrivals = args.strips;
    return hipSuccess;
}

extern "C" int fused_sparse_gemv_launch(int device, int64_t stream, int64_t M, const void* x, const void* w,
                                        const void* scale, void* y, const void* residual, void* partial,
                                        void* arrivals, int64_t n, int64_t k) {
    using namespace fused;
    if (scale != nullptr || !sparse_gemv_takes(M, n, k)) return hipErrorInvalidValue;
    const SparseGemvArgs args =
        make_sparse_gemv_args(n, k, sparse_min_blocks(), x, w, y, residual, partial, arrivals);
    const hipStream_t s = reinterpret_cast<hipStream_t>(stream);
    return on_device(device, [&] {
        switch (M) {
            case 1: return launch_sparse_gemv<1>(args, s);
            case 2: return launch_sparse_gemv<2>(args, s);
            case 3: return launch_sparse_gemv<3>(args, s);
            default: return launch_sparse_gemv<4>(args, s);
        }
    });
}

// out [K, width] = fp16 columns n0 .. n0 + width - 1 of W^T for a 4-bit GemLite matrix W [N, K] (see the CUDA file).
extern "C" int fused_uint4_dequantize_launch(int device, int64_t stream, const void* words, const void* scale,
                                             const void* zero, int64_t N, int64_t K, int64_t group, int64_t n0,
                                             int64_t width, void* out) {
    using namespace fused;
    if (width == 0 || K == 0) return hipSuccess;
    if (N <= 0 || K < 0 || width < 0 || n0 < 0 || n0 + width > N || group <= 0 || group % 8 || K % group ||
        K / 8 * width > int64_t(INT_MAX) * kDequantThreads)
        return hipErrorInvalidValue;
    return on_device(device, [&] {
        uint4_dequantize_kernel<<<dim3(dequantize_blocks(K, width)), dim3(kDequantThreads), 0,
                                  reinterpret_cast<hipStream_t>(stream)>>>(
            static_cast<const uint32_t*>(words), static_cast<const __half*>(scale), static_cast<const __half*>(zero),
            N, K, group, n0, width, static_cast<__half*>(out));
        return hipGetLastError();
    });
}

// x = relu(x)^2 in place for n fp16 values (x 16-byte aligned).
extern "C" int fused_relu_square_launch(int device, int64_t stream, int64_t n, void* x) {
    using namespace fused;
    if (n == 0) return hipSuccess;
    if (n < 0) return hipErrorInvalidValue;
    return on_device(device, [&] {
        relu_square_kernel<<<dim3(relu_square_blocks(n)), dim3(kReluSquareThreads), 0,
                             reinterpret_cast<hipStream_t>(stream)>>>(static_cast<__half*>(x), n);
        return hipGetLastError();
    });
}

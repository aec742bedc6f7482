// State staging helpers shared by the WKV-7 kernels (cuda/wkv7_slots.cu, cuda/rwkv7_fused.cu).
//
// A head's 64x64 state block (state[slot][h], S[value][key]) moves between global memory and one
// register row per thread (thread i holds S[i][:]) through a padded fp32 tile in shared memory.
#pragma once

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#include <cstdint>
#include <cstring>

namespace wkv7 {

constexpr int N = 64;  // head size; also the block size

// dtype codes shared with the binding (cuda/wkv7_slots_op.cpp)
enum DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// torch builds extensions with __CUDA_NO_HALF_CONVERSIONS__ & co: convert explicitly.
__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

// The state moves between global memory and registers through a padded fp32 staging tile in
// shared memory. A head's 64x64 state block is contiguous in the pool (16 KB fp32, 8 KB fp16),
// so the block reads and writes it in 16-byte vectors with consecutive threads on consecutive
// vectors (fully coalesced); each thread then takes its row out of the tile. The row stride
// LD = 68 floats keeps both the vector accesses and the row reads free of bank conflicts.
constexpr int LD = N + 4;

// 16 bytes of state storage <-> fp32
template <typename S>
struct Vec16;

template <>
struct Vec16<float> {
    static constexpr int E = 4;  // elements per vector
    static __device__ __forceinline__ void to_f32(uint4 u, float (&out)[E]) {
        memcpy(out, &u, sizeof(u));
    }
    static __device__ __forceinline__ uint4 from_f32(const float (&in)[E]) {
        uint4 u;
        memcpy(&u, in, sizeof(u));
        return u;
    }
};

template <>
struct Vec16<__half> {
    static constexpr int E = 8;
    static __device__ __forceinline__ void to_f32(uint4 u, float (&out)[E]) {
        __half h[E];
        memcpy(h, &u, sizeof(u));
#pragma unroll
        for (int e = 0; e < E; ++e) out[e] = __half2float(h[e]);
    }
    static __device__ __forceinline__ uint4 from_f32(const float (&in)[E]) {
        __half2 h[E / 2];  // one conversion instruction per pair, each rounded to nearest as __float2half_rn
#pragma unroll
        for (int e = 0; e < E; e += 2) h[e / 2] = __floats2half2_rn(in[e], in[e + 1]);
        uint4 u;
        memcpy(&u, h, sizeof(u));
        return u;
    }
};

// Global state block -> tile (fp32), in two halves so that a kernel can issue the loads, do other work
// while they are in flight, and only then wait for them: block_load issues this thread's share of the
// block's 16-byte vectors, staged_to_tile stores them into the tile. Every thread of the block calls both.
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

template <typename S>
__device__ __forceinline__ void block_to_tile(const S* __restrict__ src, float (*tile)[LD]) {
    Staged<S> staged;
    block_load(src, staged);
    staged_to_tile(staged, tile);
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

// A state row of storage type S held in shared memory as 16-byte vectors (N * sizeof(S) bytes) <-> fp32 registers.
template <typename S>
__device__ __forceinline__ void row_to_regs(const unsigned char* row, float (&s)[N]) {
    constexpr int E = Vec16<S>::E;
#pragma unroll
    for (int c = 0; c < N / E; ++c) {
        float vals[E];
        Vec16<S>::to_f32(reinterpret_cast<const uint4*>(row)[c], vals);
#pragma unroll
        for (int e = 0; e < E; ++e) s[c * E + e] = vals[e];
    }
}

template <typename S>
__device__ __forceinline__ void regs_to_row(const float (&s)[N], unsigned char* row) {
    constexpr int E = Vec16<S>::E;
#pragma unroll
    for (int c = 0; c < N / E; ++c) {
        float vals[E];
#pragma unroll
        for (int e = 0; e < E; ++e) vals[e] = s[c * E + e];
        reinterpret_cast<uint4*>(row)[c] = Vec16<S>::from_f32(vals);
    }
}

// The recurrence on four consecutive state values s[0..3] = S[i][j..j+3] of one row, in two halves:
//   dot4:    acc += S_old[i][j..j+3] * a[j..j+3]                       (partial sums of sa = S_old[i] . a)
//   update4: S[i][j] = S[i][j]*w[j] + sa*b[j] + v*k[j];  out += S_new[i][j..j+3] * r[j..j+3]
// Kept per component (four partial sums) for instruction-level parallelism; hsum4 adds them up.
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

// One token of the recurrence for the state row s = S[i][:] of one thread, with the token's key-axis
// vectors (16-byte aligned, fp32, shared by the block) and this row's value v:
//   sa = S_old[i] . a;   S[i][j] = S[i][j]*w[j] + sa*b[j] + v*k[j];   returns y[i] = S_new[i] . r
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

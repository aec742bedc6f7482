// HIP port of cuda/wkv7_slots.cu: the WKV-7 recurrence over a pool of state slots, updated in place.
//
// Same layout, math, work split and launcher interface as the CUDA file (read its header comment);
// only the runtime API (hip*), the half/bfloat16 types and the stream type differ. One block of 64
// threads is one wavefront on CDNA GPUs (two on RDNA); the barriers are the same either way.
// bfloat16 inputs are read as raw 16-bit patterns and widened by a shift, which is exact and needs
// no particular ROCm version of <hip/hip_bf16.h>.
//
// Build: torch.utils.cpp_extension on a ROCm build of torch compiles this file with hipcc together
// with cuda/wkv7_slots_op.cpp (which only sees the C launcher below). Compile-checked, not run.

#include <hip/hip_runtime.h>
#include <hip/hip_fp16.h>

#include <climits>
#include <cstdint>

namespace wkv7 {

constexpr int N = 64;  // head size; also the block size

// dtype codes shared with the binding (cuda/wkv7_slots_op.cpp)
enum DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// bfloat16 as its raw bits (the upper half of an fp32).
struct bf16_bits {
    uint16_t x;
};

// torch builds extensions with __HIP_NO_HALF_CONVERSIONS__ & co: convert explicitly.
__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(bf16_bits x) { return __uint_as_float(static_cast<unsigned>(x.x) << 16); }

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
    static __device__ __forceinline__ void to_f32(uint4 u, float (&out)[E]) {
        __half h[E];
        __builtin_memcpy(h, &u, sizeof(u));
#pragma unroll
        for (int e = 0; e < E; ++e) out[e] = __half2float(h[e]);
    }
    static __device__ __forceinline__ uint4 from_f32(const float (&in)[E]) {
        __half h[E];
#pragma unroll
        for (int e = 0; e < E; ++e) h[e] = __float2half(in[e]);
        uint4 u;
        __builtin_memcpy(&u, h, sizeof(u));
        return u;
    }
};

// Global state block -> tile (fp32). Every thread of the block must call it.
template <typename S>
__device__ __forceinline__ void block_to_tile(const S* __restrict__ src, float (*tile)[LD]) {
    constexpr int E = Vec16<S>::E;
    constexpr int PER_ROW = N / E;  // vectors per state row; the block holds N * PER_ROW vectors
    const uint4* q = reinterpret_cast<const uint4*>(src);
#pragma unroll
    for (int c = 0; c < PER_ROW; ++c) {
        const int f = threadIdx.x + N * c;  // vector index within the block
        float vals[E];
        Vec16<S>::to_f32(q[f], vals);
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

// Shared staging of one token's key-axis vectors (fp32).
struct __align__(16) TokenBuf {
    float r[N];
    float w[N];
    float k[N];
    float a[N];
    float b[N];
};

template <typename T, typename S>
__global__ void __launch_bounds__(N)
wkv7_slots_kernel(int H, int64_t num_slots, int64_t num_tokens, S* __restrict__ state,
                  const int64_t* __restrict__ slots, const int64_t* __restrict__ starts,
                  const int64_t* __restrict__ lasts, const T* __restrict__ r, const float* __restrict__ w,
                  const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ a,
                  const T* __restrict__ b, float* __restrict__ y) {
    const int64_t row = blockIdx.x / H;
    const int h = blockIdx.x % H;
    const int i = threadIdx.x;
    const int64_t C = int64_t(H) * N;
    const int64_t col = int64_t(h) * N + i;  // this thread's column in the [T, C] tensors

    // The same values for every thread of the block, so these early exits are block-uniform
    // (no thread is left waiting at a barrier).
    const int64_t first = starts[row];
    const int64_t last = lasts[row];
    if (last < first) return;                                   // empty row
    if (first < 0 || last >= num_tokens) return;                // bad token range: touch nothing
    const int64_t slot = slots[row];
    if (slot < 0 || slot >= num_slots) {                        // bad slot: make it visible in y
        for (int64_t t = first; t <= last; ++t) y[t * C + col] = __int_as_float(0x7fc00000);  // NaN
        return;
    }

    __shared__ __align__(16) float tile[N][LD];  // state staging, used before and after the token loop
    __shared__ TokenBuf buf[2];

    // inputs of the next token, fetched one token ahead (the first ones while the state loads)
    float nr = to_f32(r[first * C + col]);
    float nw = w[first * C + col];
    float nk = to_f32(k[first * C + col]);
    float nv = to_f32(v[first * C + col]);
    float na = to_f32(a[first * C + col]);
    float nb = to_f32(b[first * C + col]);

    S* block = state + (slot * H + h) * N * N;  // state[slot][h], a contiguous 64x64 block
    float s[N];                                  // s[j] = S[i][j], this thread's row
    block_to_tile(block, tile);
    __syncthreads();
    tile_row_to_regs(tile[i], s);

    int p = 0;  // buffer parity
    for (int64_t t = first; t <= last; ++t) {
        TokenBuf& cur = buf[p];
        cur.r[i] = nr;
        cur.w[i] = nw;
        cur.k[i] = nk;
        cur.a[i] = na;
        cur.b[i] = nb;
        const float vi = nv;
        __syncthreads();  // buf[p] is complete; buf[p^1] is no longer read by anyone

        if (t < last) {
            const int64_t o = (t + 1) * C + col;
            nr = to_f32(r[o]);
            nw = w[o];
            nk = to_f32(k[o]);
            nv = to_f32(v[o]);
            na = to_f32(a[o]);
            nb = to_f32(b[o]);
        }

        const float4* a4 = reinterpret_cast<const float4*>(cur.a);
        const float4* b4 = reinterpret_cast<const float4*>(cur.b);
        const float4* w4 = reinterpret_cast<const float4*>(cur.w);
        const float4* k4 = reinterpret_cast<const float4*>(cur.k);
        const float4* r4 = reinterpret_cast<const float4*>(cur.r);

        // sa = S_old[i] . a   (four partial sums for instruction-level parallelism)
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int c = 0; c < N / 4; ++c) {
            const float4 av = a4[c];
            acc.x = fmaf(s[4 * c + 0], av.x, acc.x);
            acc.y = fmaf(s[4 * c + 1], av.y, acc.y);
            acc.z = fmaf(s[4 * c + 2], av.z, acc.z);
            acc.w = fmaf(s[4 * c + 3], av.w, acc.w);
        }
        const float sa = (acc.x + acc.y) + (acc.z + acc.w);

        // S[i][j] = S[i][j]*w[j] + sa*b[j] + v[i]*k[j];  y[i] = S_new[i] . r
        float4 out = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int c = 0; c < N / 4; ++c) {
            const float4 wv = w4[c], bv = b4[c], kv = k4[c], rv = r4[c];
            s[4 * c + 0] = fmaf(s[4 * c + 0], wv.x, fmaf(sa, bv.x, vi * kv.x));
            s[4 * c + 1] = fmaf(s[4 * c + 1], wv.y, fmaf(sa, bv.y, vi * kv.y));
            s[4 * c + 2] = fmaf(s[4 * c + 2], wv.z, fmaf(sa, bv.z, vi * kv.z));
            s[4 * c + 3] = fmaf(s[4 * c + 3], wv.w, fmaf(sa, bv.w, vi * kv.w));
            out.x = fmaf(s[4 * c + 0], rv.x, out.x);
            out.y = fmaf(s[4 * c + 1], rv.y, out.y);
            out.z = fmaf(s[4 * c + 2], rv.z, out.z);
            out.w = fmaf(s[4 * c + 3], rv.w, out.w);
        }
        y[t * C + col] = (out.x + out.y) + (out.z + out.w);
        p ^= 1;
    }

    __syncthreads();  // (every thread is long done reading its row out of the tile)
    regs_to_tile_row(s, tile[i]);
    __syncthreads();
    tile_to_block(tile, block);
}

template <typename T, typename S>
hipError_t launch_typed(int64_t B, int H, int64_t num_slots, int64_t T_, void* state, const int64_t* slots,
                        const int64_t* starts, const int64_t* lasts, const void* r, const float* w, const void* k,
                        const void* v, const void* a, const void* b, float* y, hipStream_t stream) {
    const dim3 grid(static_cast<unsigned>(B * H));
    const dim3 block(N);
    wkv7_slots_kernel<T, S><<<grid, block, 0, stream>>>(
        H, num_slots, T_, static_cast<S*>(state), slots, starts, lasts, static_cast<const T*>(r), w,
        static_cast<const T*>(k), static_cast<const T*>(v), static_cast<const T*>(a), static_cast<const T*>(b), y);
    return hipGetLastError();
}

template <typename T>
hipError_t launch_act(int state_dtype, int64_t B, int H, int64_t num_slots, int64_t T_, void* state,
                      const int64_t* slots, const int64_t* starts, const int64_t* lasts, const void* r,
                      const float* w, const void* k, const void* v, const void* a, const void* b, float* y,
                      hipStream_t stream) {
    switch (state_dtype) {
        case kFloat32:
            return launch_typed<T, float>(B, H, num_slots, T_, state, slots, starts, lasts, r, w, k, v, a, b, y, stream);
        case kFloat16:
            return launch_typed<T, __half>(B, H, num_slots, T_, state, slots, starts, lasts, r, w, k, v, a, b, y, stream);
        default:
            return hipErrorInvalidValue;
    }
}

}  // namespace wkv7

// Launch the recurrence for B rows on `stream` (a hipStream_t passed as an integer) on HIP device
// `device`. act_dtype: 0 fp32, 1 fp16, 2 bf16 (r, k, v, a, b); state_dtype: 0 fp32, 1 fp16.
// H heads of 64; the state pool has num_slots slots; the packed tensors have num_tokens rows.
// Returns the hipError_t of the launch (0 = success). Nothing is launched when B == 0.
extern "C" int wkv7_slots_launch(int device, int64_t stream, int act_dtype, int state_dtype, int64_t B, int64_t H,
                                 int64_t num_slots, int64_t num_tokens, void* state, const int64_t* slots,
                                 const int64_t* starts, const int64_t* lasts, const void* r, const float* w,
                                 const void* k, const void* v, const void* a, const void* b, float* y) {
    using namespace wkv7;
    if (B == 0) return hipSuccess;
    if (B < 0 || H <= 0 || H > INT_MAX || B * H > INT_MAX) return hipErrorInvalidConfiguration;

    int previous = -1;
    hipError_t err = hipGetDevice(&previous);
    if (err != hipSuccess) return err;
    if (previous != device && (err = hipSetDevice(device)) != hipSuccess) return err;

    const hipStream_t s = reinterpret_cast<hipStream_t>(stream);
    const int h = static_cast<int>(H);
    switch (act_dtype) {
        case kFloat32:
            err = launch_act<float>(state_dtype, B, h, num_slots, num_tokens, state, slots, starts, lasts, r, w, k, v,
                                    a, b, y, s);
            break;
        case kFloat16:
            err = launch_act<__half>(state_dtype, B, h, num_slots, num_tokens, state, slots, starts, lasts, r, w, k,
                                     v, a, b, y, s);
            break;
        case kBFloat16:
            err = launch_act<bf16_bits>(state_dtype, B, h, num_slots, num_tokens, state, slots, starts, lasts, r,
                                        w, k, v, a, b, y, s);
            break;
        default:
            err = hipErrorInvalidValue;
    }

    if (previous != device) (void)hipSetDevice(previous);
    return err;
}

extern "C" const char* wkv7_slots_error_string(int code) {
    return hipGetErrorString(static_cast<hipError_t>(code));
}

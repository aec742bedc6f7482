// WKV-7 recurrence over a pool of state slots, updated in place (RWKV-7 "x070").
//
// Plain CUDA C++ (no torch headers): the torch binding is cuda/wkv7_slots_op.cpp, the HIP port
// hip/wkv7_slots.hip. Math: ../shared/spec/rwkv7-math.md §2-§3; reference: infer/ops/wkv.py.
//
// Layout
//   state  [S, H, 64, 64]  one layer's pool, fp32 or fp16, contiguous; state[slot][h][i][j] with
//                          i = VALUE index (row), j = KEY index (column)
//   slots  [B] int64       state slot of each row; distinct within a call (two rows on one slot
//                          would race), as PackedBatch guarantees. An out-of-range slot is skipped
//                          and its row's y set to NaN
//   starts [B] int64       packed index of each row's first token
//   lasts  [B] int64       packed index of each row's last token (row b owns starts[b]..lasts[b];
//                          lasts < starts means an empty row, which is left alone)
//   r,k,v,a,b [T, C]       activations (fp16 / bf16 / fp32), C = H*64, head h = columns h*64..h*64+63
//   w      [T, C] fp32     multiplicative decay in (0, 1)
//   y      [T, C] fp32     output
//
// Work split: one thread block per (row, head), 64 threads. Thread i keeps row i of the head's
// 64x64 state in 64 fp32 registers for the whole row, so the state is read from its slot once and
// written back once per call, whatever the row's length (coalesced, through shared memory: see
// block_to_tile). Per token t (kernel convention a = -kk,
// b = kk*a_gate), with everything in fp32:
//
//   sa      = sum_j S[i][j] * a[j]                      (uses the OLD state)
//   S[i][j] = S[i][j] * w[j] + sa * b[j] + v[i] * k[j]
//   y[i]    = sum_j S[i][j] * r[j]                      (uses the NEW state)
//
// Every thread needs all 64 values of r, w, k, a, b of the token (the key axis) and only v[i], so
// thread i loads element i of each into shared memory, converted to fp32. The shared buffers are
// double-buffered by token parity, so one __syncthreads per token suffices: a thread writes the
// buffer of token t+1 only after the barrier of token t, which every thread passes after it has
// finished reading that buffer for token t-1. The next token's inputs are fetched into registers
// while the current token is computed, to hide global-memory latency.
//
// The launcher takes raw pointers, a device index and the stream (so that the caller's current
// stream is used and the launch can be captured in a CUDA graph) and returns the cudaError_t as int.

#include "wkv7_state.cuh"

#include <climits>
#include <cstdint>

namespace wkv7 {

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

        y[t * C + col] = token_step(s, cur.a, cur.w, cur.k, cur.b, cur.r, vi);
        p ^= 1;
    }

    __syncthreads();  // (every thread is long done reading its row out of the tile)
    regs_to_tile_row(s, tile[i]);
    __syncthreads();
    tile_to_block(tile, block);
}

template <typename T, typename S>
cudaError_t launch_typed(int64_t B, int H, int64_t num_slots, int64_t T_, void* state, const int64_t* slots,
                         const int64_t* starts, const int64_t* lasts, const void* r, const float* w, const void* k,
                         const void* v, const void* a, const void* b, float* y, cudaStream_t stream) {
    const dim3 grid(static_cast<unsigned>(B * H));
    const dim3 block(N);
    wkv7_slots_kernel<T, S><<<grid, block, 0, stream>>>(
        H, num_slots, T_, static_cast<S*>(state), slots, starts, lasts, static_cast<const T*>(r), w,
        static_cast<const T*>(k), static_cast<const T*>(v), static_cast<const T*>(a), static_cast<const T*>(b), y);
    return cudaGetLastError();
}

template <typename T>
cudaError_t launch_act(int state_dtype, int64_t B, int H, int64_t num_slots, int64_t T_, void* state,
                       const int64_t* slots, const int64_t* starts, const int64_t* lasts, const void* r,
                       const float* w, const void* k, const void* v, const void* a, const void* b, float* y,
                       cudaStream_t stream) {
    switch (state_dtype) {
        case kFloat32:
            return launch_typed<T, float>(B, H, num_slots, T_, state, slots, starts, lasts, r, w, k, v, a, b, y, stream);
        case kFloat16:
            return launch_typed<T, __half>(B, H, num_slots, T_, state, slots, starts, lasts, r, w, k, v, a, b, y, stream);
        default:
            return cudaErrorInvalidValue;
    }
}

}  // namespace wkv7

// Launch the recurrence for B rows on `stream` (a cudaStream_t passed as an integer) on CUDA device
// `device`. act_dtype: 0 fp32, 1 fp16, 2 bf16 (r, k, v, a, b); state_dtype: 0 fp32, 1 fp16.
// H heads of 64; the state pool has num_slots slots; the packed tensors have num_tokens rows.
// Returns the cudaError_t of the launch (0 = success). Nothing is launched when B == 0.
extern "C" int wkv7_slots_launch(int device, int64_t stream, int act_dtype, int state_dtype, int64_t B, int64_t H,
                                 int64_t num_slots, int64_t num_tokens, void* state, const int64_t* slots,
                                 const int64_t* starts, const int64_t* lasts, const void* r, const float* w,
                                 const void* k, const void* v, const void* a, const void* b, float* y) {
    using namespace wkv7;
    if (B == 0) return cudaSuccess;
    if (B < 0 || H <= 0 || H > INT_MAX || B * H > INT_MAX) return cudaErrorInvalidConfiguration;

    int previous = -1;
    cudaError_t err = cudaGetDevice(&previous);
    if (err != cudaSuccess) return err;
    if (previous != device && (err = cudaSetDevice(device)) != cudaSuccess) return err;

    const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
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
            err = launch_act<__nv_bfloat16>(state_dtype, B, h, num_slots, num_tokens, state, slots, starts, lasts, r,
                                            w, k, v, a, b, y, s);
            break;
        default:
            err = cudaErrorInvalidValue;
    }

    if (previous != device) (void)cudaSetDevice(previous);
    return err;
}

extern "C" const char* wkv7_slots_error_string(int code) {
    return cudaGetErrorString(static_cast<cudaError_t>(code));
}

// Stand-in for CUDA's <mma.h> (nvcuda::wmma) when a kernel source is compiled for the CPU emulation
// (emu_device.h): the fragment API as the kernels use it, for the shapes the project's kernels name.
//
// A fragment is opaque to the kernel (its per-lane layout is unspecified), so here every lane's fragment
// holds the whole tile: load_matrix_sync reads all of it, mma_sync computes all of it, store_matrix_sync
// writes all of it. Each lane does so at its own time between the warp's barriers, as the fibers are
// scheduled: the calls imply no ordering of memory between lanes (the kernel's __syncwarp() calls do).
// Like on a GPU, these are warp-collective calls that every lane of the warp must make, in the same
// order and with the same arguments: the emulation records each lane's sequence of calls (what, the
// pointer, ldm, layout, and the contents of the fragments passed in) and flags a lane whose call differs
// from its warp's, and a lane that makes fewer or more calls than the others (emu::wmma_error(), which
// the harness turns into a failure). Also flagged: a pointer not 256-bit aligned and an ldm that is not
// a multiple of 16 bytes, which CUDA documents as required.
//
// mma_sync: D = A B + C with fp16 inputs and an fp32 accumulator: every product of two fp16
// values is exact in fp32 and is added with one fmaf, k in ascending order per output. Tensor cores
// add the products of a step in an unspecified order and precision (close to fp32): the tests bound
// the accumulation error as for an fp32 loop.
#pragma once
#include <cstdio>

#include "emu_device.h"

namespace emu {

inline const char* wmma_failure = nullptr;  // the first misuse seen (null if none)
inline const char* wmma_error() { return wmma_failure; }
inline void wmma_reset() { wmma_failure = nullptr; }

namespace wmma_log {
inline unsigned long long block = ~0ull;  // emu::block_serial of the block the log is for
inline std::vector<std::vector<uint64_t>> warp_calls;  // per warp: the signature of each call
inline std::vector<size_t> lane_calls;                 // per thread: how many calls it made

inline void fail(const char* why) {
    if (!wmma_failure) wmma_failure = why;
}
// Every lane of each warp made as many calls as its warp's record holds (a block that ended).
inline void check_counts() {
    for (size_t t = 0; t < lane_calls.size(); ++t)
        if (lane_calls[t] != warp_calls[t / EMU_WARP].size()) fail("a lane skipped a warp-collective wmma call");
}
inline void record(uint64_t signature) {
    if (block != block_serial) {
        if (block != ~0ull) check_counts();
        block = block_serial;
        warp_calls.assign((blockDim.x + EMU_WARP - 1) / EMU_WARP, {});
        lane_calls.assign(blockDim.x, 0);
    }
    std::vector<uint64_t>& calls = warp_calls[threadIdx.x / EMU_WARP];
    size_t& n = lane_calls[threadIdx.x];
    if (n == calls.size())
        calls.push_back(signature);
    else if (calls[n] != signature)
        fail("the lanes of a warp made different wmma calls (another call, pointer, ldm or fragment)");
    ++n;
}
// The harness calls this after the grid: the last block's counts.
inline void finish() {
    if (block != ~0ull) check_counts();
    block = ~0ull;
}
inline uint64_t mix(uint64_t h, const void* data, size_t size) {  // FNV-1a
    const unsigned char* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < size; ++i) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}
template <typename... Ts>
uint64_t signature(const Ts&... parts) {
    uint64_t h = 1469598103934665603ull;
    ((h = mix(h, &parts, sizeof(parts))), ...);
    return h;
}
}  // namespace wmma_log

}  // namespace emu

namespace nvcuda {
namespace wmma {

struct row_major {};
struct col_major {};
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K>
struct tile_shape;
template <int M, int N, int K>
struct tile_shape<matrix_a, M, N, K> {
    static constexpr int rows = M, cols = K;
};
template <int M, int N, int K>
struct tile_shape<matrix_b, M, N, K> {
    static constexpr int rows = K, cols = N;
};
template <int M, int N, int K>
struct tile_shape<accumulator, M, N, K> {
    static constexpr int rows = M, cols = N;
};

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
    static_assert((M == 16 && N == 16 && K == 16) || (M == 32 && N == 8 && K == 16) || (M == 8 && N == 32 && K == 16),
                  "a WMMA shape CUDA has for fp16");
    static constexpr int rows = tile_shape<Use, M, N, K>::rows, cols = tile_shape<Use, M, N, K>::cols;
    static constexpr int num_elements = rows * cols;  // the whole tile (see above)
    T x[rows * cols];
};

namespace detail {
inline float to_float(float v) { return v; }
inline float to_float(__half v) { return __half2float(v); }

template <typename T>
void check_pointer(const T* p, unsigned ldm) {
    if (reinterpret_cast<uintptr_t>(p) % 32) emu::wmma_log::fail("wmma: a pointer not 256-bit aligned");
    if ((ldm * sizeof(T)) % 16) emu::wmma_log::fail("wmma: ldm not a multiple of 16 bytes");
}
// element (r, c) of a tile at p: row-major p[r * ldm + c], column-major p[c * ldm + r]
inline size_t at(int r, int c, unsigned ldm, bool row_major_order) {
    return row_major_order ? size_t(r) * ldm + c : size_t(c) * ldm + r;
}
template <typename F, typename T>
void load_tile(F& f, const T* p, unsigned ldm, bool row) {
    for (int r = 0; r < F::rows; ++r)
        for (int c = 0; c < F::cols; ++c) f.x[r * F::cols + c] = p[at(r, c, ldm, row)];
}
}  // namespace detail

template <typename Use, int M, int N, int K, typename T, typename Layout>
void load_matrix_sync(fragment<Use, M, N, K, T, Layout>& f, const T* p, unsigned ldm) {
    static_assert(!std::is_same_v<Use, accumulator>, "an accumulator load takes a layout_t");
    emu::wmma_log::record(emu::wmma_log::signature(1, p, ldm, std::is_same_v<Layout, row_major>));
    detail::check_pointer(p, ldm);
    detail::load_tile(f, p, ldm, std::is_same_v<Layout, row_major>);
}

template <int M, int N, int K, typename T>
void load_matrix_sync(fragment<accumulator, M, N, K, T>& f, const T* p, unsigned ldm, layout_t layout) {
    emu::wmma_log::record(emu::wmma_log::signature(2, p, ldm, layout));
    detail::check_pointer(p, ldm);
    detail::load_tile(f, p, ldm, layout == mem_row_major);
}

template <int M, int N, int K, typename T>
void store_matrix_sync(T* p, const fragment<accumulator, M, N, K, T>& f, unsigned ldm, layout_t layout) {
    emu::wmma_log::record(emu::wmma_log::signature(3, p, ldm, layout, f.x));
    detail::check_pointer(p, ldm);
    for (int r = 0; r < f.rows; ++r)
        for (int c = 0; c < f.cols; ++c) p[detail::at(r, c, ldm, layout == mem_row_major)] = f.x[r * f.cols + c];
}

template <typename Use, int M, int N, int K, typename T, typename Layout>
void fill_fragment(fragment<Use, M, N, K, T, Layout>& f, T v) {
    emu::wmma_log::record(emu::wmma_log::signature(4, v));
    for (auto& e : f.x) e = v;
}

template <int M, int N, int K, typename TA, typename LA, typename LB>
void mma_sync(fragment<accumulator, M, N, K, float>& d, const fragment<matrix_a, M, N, K, TA, LA>& a,
              const fragment<matrix_b, M, N, K, TA, LB>& b, const fragment<accumulator, M, N, K, float>& c) {
    emu::wmma_log::record(emu::wmma_log::signature(5, a.x, b.x, c.x));
    fragment<accumulator, M, N, K, float> out;
    for (int i = 0; i < M; ++i)
        for (int j = 0; j < N; ++j) {
            float acc = c.x[i * N + j];
            for (int k = 0; k < K; ++k)
                acc = fmaf(detail::to_float(a.x[i * K + k]), detail::to_float(b.x[k * N + j]), acc);
            out.x[i * N + j] = acc;
        }
    d = out;
}

}  // namespace wmma
}  // namespace nvcuda

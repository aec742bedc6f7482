// The Hopper mixed-input GEMMs' tile choice, int8 (W8A16) and 4-bit (GemLite A16W4) weights (the tiles are
// cuda/w8a16_gemm_sm90_<tile>.cu and cuda/w4a16_gemm_sm90_<tile>.cu, the kernel template
// cuda/w8a16_gemm_sm90.cuh). Compiled only for an sm_90a build with the CUTLASS headers
// (-DW8A16_WITH_CUTLASS_SM90, infer/ops/linear_w8a16.py); cuda/w8a16_gemm.cu calls it.
//
// Why several tiles: the int8 weights are converted to fp16 in registers once per batch tile that reads
// them, so a taller batch tile (TILE_N) converts less, but fewer, larger tiles leave SMs idle on small
// matrices. Measured on the H200 (bench/results/w8_gemm_variants_h200.json, 7.2B shapes at 128/256/512
// rows): the fastest tile was, every time, the one with the tallest batch tile that still gives at
// least ~90 % of the SMs a tile (preferring 128 channels over 64 at equal batch tile). At 256 and 512
// rows that matches cuBLAS fp16 on the FFN and head matrices (50.6 us vs 50.6 us for 16384x4096 at 256).
#include <cuda_runtime.h>

#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "w8a16_gemm_sm90.cuh"

namespace {

using w8a16_sm90::Half, w8a16_sm90::Int8Rows, w8a16_sm90::Uint4Groups, w8a16_sm90::Problem;
using Run = int (*)(const Problem&, cudaStream_t, int);

struct Tile {
    int m, n;  // output channels x batch rows
    Run int8, uint4, int8_split, uint4_split;
};

template <int TILE_M, int TILE_N>
constexpr Tile tile() {
    return {TILE_M, TILE_N, w8a16_sm90::gemm<Int8Rows, TILE_M, TILE_N, Half>,
            w8a16_sm90::gemm<Uint4Groups, TILE_M, TILE_N, Half>, w8a16_sm90::gemm<Int8Rows, TILE_M, TILE_N, float>,
            w8a16_sm90::gemm<Uint4Groups, TILE_M, TILE_N, float>};
}

// In order of preference: tallest batch tile first, then more channels per tile.
constexpr Tile kTiles[] = {tile<64, 256>(), tile<128, 128>(), tile<64, 128>(), tile<64, 64>()};
constexpr int kTileCount = sizeof(kTiles) / sizeof(kTiles[0]);

int ceil_div(int a, int b) { return (a + b - 1) / b; }

// `splits` CTAs share each output tile (split K).
int pick_tile(int rows, int channels, int splits, int sms) {
    for (int i = 0; i < kTileCount; ++i) {
        const Tile& t = kTiles[i];
        if (t.n > rows) continue;  // a batch tile taller than the batch computes padding
        if (10 * ceil_div(channels, t.m) * ceil_div(rows, t.n) * splits >= 9 * sms) return i;
    }
    return kTileCount - 1;
}

// y[i] = fp16(partials[0][i] + ... + partials[splits - 1][i]) for i < 4 count4, four outputs a thread.
__global__ void sum_splits_kernel(const float4* __restrict__ partials, int splits, int64_t count4,
                                  __half2* __restrict__ y) {
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= count4) return;
    float4 sum = partials[i];
    for (int s = 1; s < splits; ++s) {
        const float4 part = partials[s * count4 + i];
        sum.x += part.x, sum.y += part.y, sum.z += part.z, sum.w += part.w;
    }
    y[2 * i] = __floats2half2_rn(sum.x, sum.y);
    y[2 * i + 1] = __floats2half2_rn(sum.z, sum.w);
}

// Run `p` (M, N, K as given) with `tile` (-1: chosen from the shape and the device's SM count), taking the
// tile's kernel for the weight format `format`. 0, a cudaError_t, or status_base + a cutlass::Status.
int run(int64_t M, int64_t N, int64_t K, Problem p, Run Tile::*format, cudaStream_t stream, int status_base,
        int tile) {
    if (M <= 0 || N <= 0 || K <= 0 || M > INT_MAX || N > INT_MAX || K > INT_MAX || tile >= kTileCount)
        return cudaErrorInvalidValue;
    p.m = static_cast<int>(M), p.n = static_cast<int>(N), p.k = static_cast<int>(K);
    if (tile < 0) {
        int device = 0, sms = 0;
        cudaError_t err = cudaGetDevice(&device);
        if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
        if (err != cudaSuccess) return err;
        tile = pick_tile(p.m, p.n, p.splits, sms);
    }
    return (kTiles[tile].*format)(p, stream, status_base);
}

// `p` with K split in p.splits slices (> 1), each a whole number of `step` elements (the 4-bit group; 64 for
// int8) and of the K step, `format` one of the split kernels: partial_rows rows of x at a time, each chunk's slice
// products written to `partials` (packed [splits, chunk rows, N]) and summed into y (N a multiple of 4).
int run_split(int64_t M, int64_t N, int64_t K, Problem p, int64_t step, Run Tile::*format, cudaStream_t stream,
              int status_base, int tile, void* partials, int64_t partial_rows) {
    if (partials == nullptr || partial_rows <= 0 || N % 4 || K % (p.splits * step) || (K / p.splits) % 64)
        return cudaErrorInvalidValue;
    __half* y = static_cast<__half*>(p.y);
    for (int64_t first = 0; first < M; first += partial_rows) {
        const int64_t rows = std::min(partial_rows, M - first);
        Problem chunk = p;
        chunk.x = static_cast<const __half*>(p.x) + first * K;
        chunk.y = partials;
        int err = run(rows, N, K, chunk, format, stream, status_base, tile);
        if (err != 0) return err;
        const int64_t count4 = rows * N / 4;
        constexpr int kThreads = 256;
        sum_splits_kernel<<<static_cast<unsigned>((count4 + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
            static_cast<const float4*>(partials), p.splits, count4, reinterpret_cast<__half2*>(y + first * N));
        if ((err = cudaGetLastError()) != cudaSuccess) return err;
    }
    return cudaSuccess;
}

}  // namespace

int w8a16_gemm_sm90_tile_count() { return kTileCount; }

int w8a16_gemm_sm90_tile_shape(int tile, int which) {
    return tile < 0 || tile >= kTileCount ? -1 : which == 0 ? kTiles[tile].m : kTiles[tile].n;
}

// y[M, N] = x[M, K] @ (w[N, K] * scale[N, None])^T with tile `tile` (-1: chosen per problem). splits > 1: K cut
// into that many slices of whole K steps (64), their fp32 products written to partials [splits, partial_rows, N]
// and summed into y, partial_rows rows of x at a time (N a multiple of 4).
int w8a16_gemm_sm90(int64_t M, int64_t N, int64_t K, const void* x, const void* w, const void* scale, void* y,
                    cudaStream_t stream, int status_base, int tile, int splits, void* partials, int64_t partial_rows) {
    if (splits < 1) return cudaErrorInvalidValue;
    const Problem p{0, 0, 0, x, w, scale, nullptr, 0, y, splits};
    if (splits == 1) return run(M, N, K, p, &Tile::int8, stream, status_base, tile);
    return run_split(M, N, K, p, 64, &Tile::int8_split, stream, status_base, tile, partials, partial_rows);
}

// y[M, N] = x[M, K] @ W^T for 4-bit W (words [N, K / 8], scale and zero [K / group, N]; group a multiple of the
// K step, 64), with tile `tile` (-1: chosen per problem). splits > 1: K cut into that many slices of whole groups,
// as w8a16_gemm_sm90 does.
int w4a16_gemm_sm90(int64_t M, int64_t N, int64_t K, const void* x, const void* words, const void* scale,
                    const void* zero, int64_t group, void* y, cudaStream_t stream, int status_base, int tile,
                    int splits, void* partials, int64_t partial_rows) {
    if (group <= 0 || group > K || K % group || splits < 1) return cudaErrorInvalidValue;
    const Problem p{0, 0, 0, x, words, scale, zero, static_cast<int>(group), y, splits};
    if (splits == 1) return run(M, N, K, p, &Tile::uint4, stream, status_base, tile);
    return run_split(M, N, K, p, group, &Tile::uint4_split, stream, status_base, tile, partials, partial_rows);
}

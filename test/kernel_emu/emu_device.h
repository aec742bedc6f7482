// CPU emulation of the CUDA/HIP device features that the project's kernels use (cuda/sampler.cu,
// cuda/rwkv7_fused.cu, cuda/rwkv7_step.cu, cuda/wkv7_slots.cu + cuda/wkv7_state.cuh and their HIP ports), for
// test_sampler_emulated.py, test_fused_emulated.py and test_step_emulated.py. The stand-in runtime headers of this
// folder (cuda_runtime.h, cuda_fp16.h, cuda_bf16.h, hip/hip_runtime.h, hip/hip_fp16.h) include it, so the
// kernel sources compile unchanged with g++ (see emu_build.py for the two textual adaptations).
//
// Not a general GPU emulator:
// - A thread block is `threads` fibers (ucontext) on one OS thread, resumed in a fresh random order
//   on every sweep: a fiber runs until it waits at a barrier. __syncthreads is a barrier of all of the
//   block's threads; a warp shuffle is an exchange through a per-warp buffer between two barriers of
//   the warp's EMU_WARP fibers (every lane of the warp must call it together, as on a GPU where the
//   lanes run in lockstep). A thread that returns early never arrives, so a block whose threads end up
//   at different barriers is reported as deadlocked instead of hanging.
// - Shared memory (`__shared__` becomes `static`) is one object: the blocks of a grid run one after
//   another, in a shuffled order (a kernel may not depend on the order of its blocks). A cooperative kernel
//   runs on a resident grid instead (run_resident_grid: every block's fibers swept together, so its grid
//   barriers wait for the other blocks), with per-block dynamic shared memory (emu::block_shared).
// - Arithmetic: IEEE fp32 with round-to-nearest; fmaf is a real fused multiply-add and nothing else is
//   contracted (x86-64 g++ without -mfma). The fast-math intrinsics (__expf, rsqrtf) are the exact
//   libm functions here, while the GPU build (--use_fast_math) approximates them to a few ulp: the
//   tests' tolerances are stated against that.
// - __half and __nv_bfloat16 are 16-bit storage types with explicit conversions only (torch builds its
//   extensions with __CUDA_NO_HALF_CONVERSIONS__ & co.), converting with IEEE round-to-nearest-even; the
//   f16x2 arithmetic the kernels use (__hsub2, __hfma2) rounds each exact result once.
// - The one tensor-core instruction the kernels use (mma.m16n8k16, fp16 operands, fp32 sums) is
//   emu::mma_16x8x16: the PTX ISA's fragment layout over a warp, its sums in k order in fp32.
#pragma once

#include <math.h>
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <cstdio>
#include <functional>
#include <numeric>
#include <random>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))

#ifndef EMU_WARP
#define EMU_WARP 32
#endif

#define EMU_EXPORT extern "C" __attribute__((visibility("default")))

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(8) uint2 {
    unsigned x, y;
};
static_assert(sizeof(float4) == 16 && sizeof(uint4) == 16 && sizeof(uint2) == 8, "vector types");
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }

inline dim3 threadIdx;  // set by the scheduler before it resumes a fiber
inline dim3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;

// ------------------------------------------------------------------------------------ 16-bit floats
namespace emu {

inline uint32_t f32_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline float f32_from_bits(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// IEEE binary16, round to nearest even (overflow to infinity, subnormals, NaN stays NaN).
inline uint16_t f32_to_f16(float f) {
    const uint32_t x = f32_bits(f);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));  // NaN
    if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 (and inf): infinity
    if (ax < 0x38800000u) {  // below 2^-14: subnormal (or zero); the scaling by 2^24 is exact
        const float scaled = f32_from_bits(ax) * 16777216.0f;
        return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(scaled)));  // ties to even
    }
    const uint32_t r = ax - 0x38000000u;  // rebias the exponent (127 -> 15)
    return static_cast<uint16_t>(sign | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13));
}

// A double rounded to binary16 once (round to nearest even; overflow to infinity, subnormals); `below` is
// what the double left off (the exact value is d + below, |below| < half an ulp of d): it only decides a
// d that lies exactly halfway between two fp16 numbers.
inline uint16_t f64_to_f16(double d, double below = 0.0) {
    if (std::isnan(d)) return 0x7e00u;
    const uint16_t sign = std::signbit(d) ? 0x8000u : 0u;
    const double a = std::fabs(d);
    int e = 0;
    std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1)
    const double ulp = std::ldexp(1.0, std::max(e - 1, -14) - 10);
    const double scaled = a / ulp;  // exact: a power-of-two scaling
    double units = std::nearbyint(scaled);  // ties to even
    if (scaled - std::floor(scaled) == 0.5 && below != 0.0) {  // a tie that is none: round by what was left off
        const bool larger = (below > 0.0) != static_cast<bool>(sign);
        units = larger ? std::ceil(scaled) : std::floor(scaled);
    }
    const double r = units * ulp;
    if (r >= 65520.0) return static_cast<uint16_t>(sign | 0x7c00u);
    return static_cast<uint16_t>(sign | f32_to_f16(static_cast<float>(r)));  // r is an fp16 number: exact
}

inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const int e = (h >> 10) & 0x1f;
    const uint32_t m = h & 0x3ffu;
    if (e == 0) {
        const float v = static_cast<float>(m) * (1.0f / 16777216.0f);  // exact
        return f32_from_bits(f32_bits(v) | sign);
    }
    if (e == 31) return f32_from_bits(sign | 0x7f800000u | (m << 13));
    return f32_from_bits(sign | (static_cast<uint32_t>(e + 112) << 23) | (m << 13));
}

// bfloat16: the upper half of an fp32 (round to nearest even on the way down).
inline uint16_t f32_to_bf16(float f) {
    const uint32_t x = f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
    return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
inline float bf16_to_f32(uint16_t b) { return f32_from_bits(static_cast<uint32_t>(b) << 16); }

}  // namespace emu

// ------------------------------------------------------------------------------------ scheduling
namespace emu {

void yield();  // back to the scheduler (below)
inline unsigned long long progress = 0;  // barrier arrivals and returns; the scheduler detects deadlocks

struct Barrier {
    int expected = 0, arrived = 0;
    unsigned generation = 0;
    void wait() {
        const unsigned g = generation;
        ++progress;
        if (++arrived == expected) {
            arrived = 0;
            ++generation;
            return;
        }
        while (generation == g) yield();
    }
};

struct Warp {
    Barrier bar;
    uint64_t buf[EMU_WARP];
    alignas(16) unsigned char gathered[EMU_WARP][32];  // all_gather's
};
inline Barrier* active_barrier = nullptr;  // __syncthreads's: the running fiber's block's (set by run_blocks)
inline Warp* warps = nullptr;
inline unsigned char* block_shared = nullptr;  // run_resident_grid: the running fiber's block's dynamic shared memory

inline int lane() { return static_cast<int>(threadIdx.x) % EMU_WARP; }

// Every lane of the warp publishes v; each gets lane src's value (its own when !valid).
template <typename T>
T exchange(T v, int src, bool valid) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffle of a wide type");
    Warp& w = warps[threadIdx.x / EMU_WARP];
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    w.buf[lane()] = bits;
    w.bar.wait();
    T out = v;
    if (valid) std::memcpy(&out, &w.buf[src], sizeof(T));
    w.bar.wait();
    return out;
}

// Every lane of the warp publishes v (up to 32 bytes); each gets all the lanes' values, in lane order.
template <typename T>
void all_gather(const T& v, T (&out)[EMU_WARP]) {
    static_assert(sizeof(T) <= 32 && std::is_trivially_copyable_v<T>, "gather of a wide type");
    Warp& w = warps[threadIdx.x / EMU_WARP];
    std::memcpy(w.gathered[lane()], &v, sizeof(T));
    w.bar.wait();
    for (int l = 0; l < EMU_WARP; ++l) std::memcpy(&out[l], w.gathered[l], sizeof(T));
    w.bar.wait();
}

// The shuffles with a segment width (a power of two <= EMU_WARP), as HIP defines them; CUDA's agree.
template <typename T>
T shfl_xor(T v, int mask, int width = EMU_WARP) {
    const int self = lane();
    const int src = self ^ mask;
    return exchange(v, src, src < ((self + width) & ~(width - 1)));
}
template <typename T>
T shfl_up(T v, unsigned delta, int width = EMU_WARP) {
    const int self = lane();
    const int src = self - static_cast<int>(delta);
    return exchange(v, src, src >= (self & ~(width - 1)));
}
template <typename T>
T shfl_down(T v, unsigned delta, int width = EMU_WARP) {
    const int self = lane();
    return exchange(v, self + static_cast<int>(delta), (self & (width - 1)) + static_cast<int>(delta) < width);
}

template <typename T>
T shfl(T v, int src, int width = EMU_WARP) {
    const int base = lane() & ~(width - 1);
    return exchange(v, base + (src & (width - 1)), true);
}
// Bit l: lane l's predicate (the lanes of the warp, every lane calling it together).
inline uint64_t ballot(bool predicate) {
    bool all[EMU_WARP];
    all_gather(predicate, all);
    uint64_t mask = 0;
    for (int l = 0; l < EMU_WARP; ++l) mask |= uint64_t(all[l]) << l;
    return mask;
}

namespace sched {
constexpr size_t kStack = 256 * 1024;
inline ucontext_t scheduler;
inline std::vector<ucontext_t> fibers;
inline std::vector<char> stacks;
inline std::vector<char> finished;
inline int current = 0;
inline const std::function<void()>* body = nullptr;

inline void fiber_main() {
    (*body)();
    finished[current] = 1;  // returns to `scheduler` through uc_link
    ++progress;
}
}  // namespace sched

inline void yield() { swapcontext(&sched::fibers[sched::current], &sched::scheduler); }

// Runs blocks [first, first + count) of a grid (gridDim must be set) of `threads` threads each, their fibers swept
// together in a fresh random order (seeded by `seed`) until every fiber has returned, so that a result cannot lean
// on one interleaving between barriers, and a block may wait (yield in a loop) for another block's progress, as a
// grid barrier does. Each block has its own __syncthreads barrier, warps and `shared_bytes` of dynamic shared memory
// (emu::block_shared, to be read by the kernel when it starts). `skew`: each block's fibers are resumed only every
// 1st, 2nd, 4th or 8th sweep (drawn per block), so some blocks run far ahead of others, as blocks of a GPU may: a
// wait that a kernel leaves out then shows. Returns 0, or 1 + a block of a deadlock: fibers waiting at barriers
// that can no longer complete (they took different paths, or some returned while others wait; the waiting fibers
// are then abandoned).
inline int run_blocks(unsigned first, unsigned count, int threads, size_t shared_bytes,
                      const std::function<void()>& kernel, unsigned seed, bool skew = false) {
    using namespace sched;
    const int total = static_cast<int>(count) * threads;
    fibers.assign(total, ucontext_t{});
    if (stacks.size() < static_cast<size_t>(total) * kStack) stacks.resize(static_cast<size_t>(total) * kStack);
    finished.assign(total, 0);
    const int per_block = (threads + EMU_WARP - 1) / EMU_WARP;
    std::vector<Warp> all_warps(static_cast<size_t>(count) * per_block);
    std::vector<Barrier> barriers(count);
    std::vector<std::vector<float4>> shared(count, std::vector<float4>((shared_bytes + 15) / 16));
    for (unsigned b = 0; b < count; ++b) {
        barriers[b].expected = threads;
        for (int w = 0; w < per_block; ++w)
            all_warps[b * per_block + w].bar.expected = std::min(EMU_WARP, threads - w * EMU_WARP);
    }
    blockDim = dim3(static_cast<unsigned>(threads));
    body = &kernel;
    for (int f = 0; f < total; ++f) {
        getcontext(&fibers[f]);
        fibers[f].uc_stack.ss_sp = &stacks[static_cast<size_t>(f) * kStack];
        fibers[f].uc_stack.ss_size = kStack;
        fibers[f].uc_link = &scheduler;
        makecontext(&fibers[f], fiber_main, 0);
    }
    std::vector<int> order(total);
    std::iota(order.begin(), order.end(), 0);
    std::mt19937 rng(seed);
    constexpr int kWindow = 8;  // sweeps in which every block is resumed at least once
    std::vector<int> every(count, 1);
    if (skew) {
        for (auto& e : every) e = 1 << (rng() % 4);
    }
    int result = 0;
    unsigned long long before = progress;
    for (int left = total, sweep = 0; left > 0; ++sweep) {
        int waiting = 0;
        left = 0;
        std::shuffle(order.begin(), order.end(), rng);
        for (const int f : order) {
            if (finished[f]) continue;
            const unsigned b = static_cast<unsigned>(f / threads);
            if (sweep % every[b]) {
                ++left;
                continue;
            }
            current = f;
            blockIdx = dim3(first + b);
            threadIdx = dim3(static_cast<unsigned>(f % threads));
            active_barrier = &barriers[b];
            warps = &all_warps[b * per_block];
            block_shared = reinterpret_cast<unsigned char*>(shared[b].data());
            swapcontext(&scheduler, &fibers[f]);
            if (!finished[f]) ++left, waiting = static_cast<int>(first + b);
        }
        if (sweep % kWindow == kWindow - 1) {
            if (left > 0 && progress == before) {  // a whole window of waiting only
                result = 1 + waiting;
                break;
            }
            before = progress;
        }
    }
    active_barrier = nullptr;
    warps = nullptr;
    block_shared = nullptr;
    return result;
}

// One block (blockIdx must be set) of `threads` threads; false when it deadlocked.
inline bool run_block(const std::function<void()>& kernel, int threads) {
    return run_blocks(blockIdx.x, 1, threads, 0, kernel, blockIdx.x * 7919u + 1u) == 0;
}

// Runs a 1-D grid block by block in a shuffled order (seeded by `seed`). Returns 0, or 1 + the index
// of the first block that deadlocked. `ordered` > 0: blocks [0, ordered) run before the others (each part
// shuffled), as a GPU starts blocks in index order: a block that waits for lower-indexed blocks (a staged
// GEMV launch's consumers) then finds them done.
inline int run_grid(unsigned grid, int threads, const std::function<void()>& kernel, unsigned seed = 1,
                    unsigned ordered = 0) {
    std::vector<unsigned> order(grid);
    std::iota(order.begin(), order.end(), 0u);
    std::mt19937 rng(seed);
    ordered = ordered < grid ? ordered : grid;
    std::shuffle(order.begin(), order.begin() + ordered, rng);
    std::shuffle(order.begin() + ordered, order.end(), rng);
    gridDim = dim3(grid);
    for (const unsigned b : order) {
        blockIdx = dim3(b);
        if (!run_block(kernel, threads)) return 1 + static_cast<int>(b);
    }
    return 0;
}

// Runs a 1-D grid with every block resident at once, as a cooperative launch guarantees (see run_blocks; the
// blocks run at skewed speeds). Static
// __shared__ variables would be one object for all blocks: a kernel run here takes its shared memory from
// emu::block_shared. Returns 0, or 1 + a block of a deadlock.
inline int run_resident_grid(unsigned grid, int threads, size_t shared_bytes, const std::function<void()>& kernel,
                             unsigned seed = 1) {
    gridDim = dim3(grid);
    return run_blocks(0, grid, threads, shared_bytes, kernel, seed, true);
}

// What emu_build.py turns a `kernel<<<grid, block, smem, stream>>>(args...)` launch into (the launchers
// are not run: the harnesses launch the kernels with run_grid): nothing is launched, and the runtime
// stand-ins' cudaGetLastError()/hipGetLastError() report "not supported".
template <typename Stream, typename... KernelArgs, typename... Args>
void no_launch(dim3, dim3, size_t, Stream, void (*)(KernelArgs...), Args&&...) {}

}  // namespace emu

// ------------------------------------------------------------------------------------ device functions
inline void __syncthreads() { emu::active_barrier->wait(); }

template <typename T>
T __ldg(const T* p) { return *p; }
template <typename T>
T __ldcs(const T* p) { return *p; }
template <typename T>
T __ldcg(const T* p) { return *p; }
inline void __threadfence() {}  // the blocks of a grid run one after another
// Only a staged GEMV launch's consumer polls (task_dependency_wait), and only while a producer block has not run:
// here, where the producers run first, that wait could never end.
inline void __nanosleep(unsigned) {
    std::fprintf(stderr, "emulation: a block waits for blocks that have not run\n");
    std::abort();
}
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline unsigned __float_as_uint(float x) { return emu::f32_bits(x); }
inline float __uint_as_float(unsigned u) { return emu::f32_from_bits(u); }
inline int __float_as_int(float x) { return static_cast<int>(emu::f32_bits(x)); }
inline float __int_as_float(int i) { return emu::f32_from_bits(static_cast<uint32_t>(i)); }
// Byte i of the result is byte (s >> 4i) & 7 of the 8-byte value y:x (PRMT's default mode).
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const uint64_t v = (static_cast<uint64_t>(y) << 32) | x;
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= static_cast<unsigned>((v >> (8 * ((s >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
    return r;
}
inline double __ull2double_rn(unsigned long long x) { return static_cast<double>(x); }
inline double __dmul_rn(double a, double b) {
    volatile double r = a * b;  // never contracted
    return r;
}
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline unsigned atomicAdd(unsigned* a, unsigned v) {
    const unsigned old = *a;
    *a = old + v;
    return old;
}
inline unsigned long long atomicAdd(unsigned long long* a, unsigned long long v) {
    const unsigned long long old = *a;
    *a = old + v;
    return old;
}

// fp32 math: the intrinsics as their exactly rounded (or libm) counterparts.
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
// expf, fmaf, fmaxf, fminf, sqrtf, tanhf: <math.h>'s (correctly rounded fmaf and sqrtf).

template <typename A, typename B>
inline std::common_type_t<A, B> min(A a, B b) {
    using C = std::common_type_t<A, B>;
    return static_cast<C>(a) < static_cast<C>(b) ? static_cast<C>(a) : static_cast<C>(b);
}
template <typename A, typename B>
inline std::common_type_t<A, B> max(A a, B b) {
    using C = std::common_type_t<A, B>;
    return static_cast<C>(a) < static_cast<C>(b) ? static_cast<C>(b) : static_cast<C>(a);
}
using std::fmin;
using std::nextafter;

// ------------------------------------------------------------------------------------ half / bfloat16
// Storage types without implicit conversions (as the kernels are built by torch).
struct __half {
    uint16_t __x;
};
struct __nv_bfloat16 {
    uint16_t __x;
};
static_assert(sizeof(__half) == 2 && sizeof(__nv_bfloat16) == 2, "16-bit types");

inline float __half2float(__half h) { return emu::f16_to_f32(h.__x); }
inline __half __float2half_rn(float f) { return __half{emu::f32_to_f16(f)}; }
inline __half __float2half(float f) { return __float2half_rn(f); }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline __half __ushort_as_half(unsigned short u) { return __half{u}; }
// Two halves; the arithmetic rounds each lane's exact result once, as the GPU's f16x2 instructions do.
struct alignas(4) __half2 {
    __half x, y;
};
static_assert(sizeof(__half2) == 4, "half2");
inline __half2 __halves2half2(__half lo, __half hi) { return __half2{lo, hi}; }
inline __half2 __floats2half2_rn(float lo, float hi) { return __half2{__float2half_rn(lo), __float2half_rn(hi)}; }
inline float __low2float(__half2 h) { return __half2float(h.x); }
inline float __high2float(__half2 h) { return __half2float(h.y); }
namespace emu {
inline __half fma_half(__half a, __half b, __half c) {
    const double p = double(__half2float(a)) * double(__half2float(b));  // exact: 22 significant bits
    const double q = __half2float(c);
    const double s = p + q;
    const double t = s - p;
    const double below = std::isfinite(s) ? (p - (s - t)) + (q - t) : 0.0;  // two-sum: s + below = p + q exactly
    return __ushort_as_half(f64_to_f16(s, below));
}
}  // namespace emu
inline __half2 __hfma2(__half2 a, __half2 b, __half2 c) {
    return __half2{emu::fma_half(a.x, b.x, c.x), emu::fma_half(a.y, b.y, c.y)};
}
inline __half2 __hsub2(__half2 a, __half2 b) {  // a - b is exact in a double
    return __half2{__ushort_as_half(emu::f64_to_f16(double(__half2float(a.x)) - double(__half2float(b.x)))),
                   __ushort_as_half(emu::f64_to_f16(double(__half2float(a.y)) - double(__half2float(b.y))))};
}
inline float __bfloat162float(__nv_bfloat16 b) { return emu::bf16_to_f32(b.__x); }
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16{emu::f32_to_bf16(f)}; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __float2bfloat16(f); }

// ------------------------------------------------------------------------------------ tensor cores
namespace emu {
// mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 of one 32-lane warp, with the PTX ISA's fragments (lane
// 4g + t; f16x2 registers, the lower k in the lower half):
//   a[0] A[g][2t, 2t+1]   a[1] A[g+8][2t, 2t+1]   a[2] A[g][2t+8, 2t+9]   a[3] A[g+8][2t+8, 2t+9]
//   b0 B[2t, 2t+1][g]     b1 B[2t+8, 2t+9][g]     d[0], d[1] D[g][2t, 2t+1]   d[2], d[3] D[g+8][2t, 2t+1]
// Each element of D is C plus its 16 products (exact: fp16 times fp16) added in k order in fp32; the
// tensor cores' own order and rounding differ in the last fp32 bits.
inline void mma_16x8x16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    struct Fragments {
        uint32_t a[4], b[2];
    };
    if (EMU_WARP != 32) std::abort();  // a CUDA warp
    Fragments all[EMU_WARP];
    all_gather(Fragments{{a[0], a[1], a[2], a[3]}, {b0, b1}}, all);
    const auto half_at = [](uint32_t reg, int k) {
        return __half2float(__ushort_as_half(static_cast<unsigned short>(reg >> (16 * (k % 2)))));
    };
    const auto A = [&](int row, int k) {
        return half_at(all[(row % 8) * 4 + (k % 8) / 2].a[(row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)], k);
    };
    const auto B = [&](int k, int col) { return half_at(all[col * 4 + (k % 8) / 2].b[k >= 8 ? 1 : 0], k); };
    const int g = lane() / 4, t = lane() % 4;
    for (int e = 0; e < 4; ++e) {
        const int row = g + (e >= 2 ? 8 : 0), col = 2 * t + e % 2;
        float sum = d[e];
        for (int k = 0; k < 16; ++k) sum = fmaf(A(row, k), B(k, col), sum);
        d[e] = sum;
    }
}
}  // namespace emu

// CPU emulation of the few CUDA/HIP device features cuda/sampler.cu and hip/sampler.hip use, for
// test/test_sampler_emulated.py (included by the stand-in cuda_runtime.h and hip/hip_runtime.h here).
//
// Not a general GPU emulator. A thread block is kThreads fibers (ucontext) on one OS thread, run
// round-robin: a fiber runs until it waits at a barrier. __syncthreads is a barrier of all of them;
// a warp shuffle is an exchange through a per-warp buffer between two barriers of the warp's fibers
// (every lane of a warp must call it together, as the kernel does); shared memory is a static object
// (one block runs at a time). Arithmetic intrinsics map to their IEEE round-to-nearest C++
// counterparts. The launcher part of the kernel file (from `extern "C" int sampler_launch` on) is not
// compiled; emu_sampler.cpp launches the kernel template itself.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)

#ifndef EMU_WARP
#define EMU_WARP 32
#endif

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
struct float4 {
    float x, y, z, w;
};
static_assert(sizeof(float4) == 16, "float4");

inline dim3 threadIdx;  // set by the scheduler before it resumes a fiber
inline dim3 blockIdx;

namespace emu {
void yield();  // back to the scheduler (emu_sampler.cpp)
inline unsigned long long progress = 0;  // barrier arrivals; the scheduler detects deadlocks with it

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
};
inline Barrier block_barrier;
inline Warp* warps = nullptr;

inline int lane() { return static_cast<int>(threadIdx.x) % EMU_WARP; }

template <typename T>
T exchange(T v, int src, bool valid) {
    static_assert(sizeof(T) <= 8, "shuffle of a wide type");
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

template <typename T>
T shfl_xor(T v, int o) { return exchange(v, lane() ^ o, true); }
template <typename T>
T shfl_up(T v, unsigned o) { return exchange(v, lane() - static_cast<int>(o), lane() >= static_cast<int>(o)); }
template <typename T>
T shfl_down(T v, unsigned o) {
    return exchange(v, lane() + static_cast<int>(o), lane() + static_cast<int>(o) < EMU_WARP);
}
}  // namespace emu

inline void __syncthreads() { emu::block_barrier.wait(); }

template <typename T>
T __ldg(const T* p) { return *p; }
inline unsigned __float_as_uint(float x) {
    unsigned u;
    std::memcpy(&u, &x, 4);
    return u;
}
inline float __uint_as_float(unsigned u) {
    float x;
    std::memcpy(&x, &u, 4);
    return x;
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

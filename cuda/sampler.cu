// Token sampler: the per-row top-k / top-p keep threshold and the inverse-CDF draw, without sorting.
//
// Plain CUDA C++ (no torch headers): the torch binding is cuda/sampler_op.cpp, the HIP port
// hip/sampler.hip, the loader infer/ops/sampler_cuda.py. The semantics are those of the torch path
// of infer/sampler.py (Sampler._thresholds and the draw after it), which this kernel replaces:
//
//   p      [B, V] fp32  softmax(adjusted / T) of each row (computed by torch; rows sum to ~1)
//   k      top_k of the row (0 = off; >= V means V)        tp  top_p of the row (>= 1 = off)
//   tau    keep p >= tau, with tau one of the row's values:
//            sorted descending: vals; cs[j] = vals[0] + ... + vals[j], counted only for j < k;
//            mass = cs[k-1] (1 without top-k); need = tp * mass; j* = first j with cs[j] >= need
//            (V when none); tau = vals[min(j*, V-1)]; tau = 0 when there is no top-k and tp >= 1
//   drawn  first index i (vocabulary order) with C[i] > target, where C[i] is the sum of the kept
//          p[0..i], total = C[V-1], target = min(u * total, nextafter(total, 0)); V-1 when none
//
// Sums. The torch path sums in fp64 (a cumsum, whose rounding depends on its summation order); the
// kernel sums exactly in 62-bit fixed point and rounds once: q(p) = floor(p * 2^62), but at least 1
// when p > 0 (so u = 0 draws the first kept token of positive probability, as exact arithmetic
// does), and a sum S of q's stands for R(S), the double nearest to S * 2^-62. q is exact for every
// p >= 2^-39, and a row's sum fits 64 bits while the row sums to less than 4. Where the torch fp64
// sums are exact -- whenever the probabilities taking part (those >= tau and, with top-k, the top k)
// are multiples of 2^-52, e.g. all >= 2^-29 -- both paths compare the same doubles, so tau and the
// token are identical. Otherwise (the kept set reaches probabilities below ~2^-29) the torch result
// carries its own rounding and the kernel gives the exactly rounded one; the two can then differ in
// tau (by tokens of negligible mass) and, very rarely, in the token. Integer sums also make every
// result independent of thread timing, atomics order and the other rows of the batch.
//
// Selection without sorting. Probabilities are non-negative floats, which order like their bit
// patterns ("keys", as uint32). Both the k-th largest key and tau are the largest key t with a
// monotone property of the keys >= t:
//   top-k:  count(key >= t) >= k                                  (t = kth)
//   top-p:  R(sum of q(key) over key >= t) >= need, restricted to t > kth; tau = kth when even the
//           keys > kth do not reach need (the prefix then ends inside kth's tie group, which the
//           torch path, keeping p >= vals[j*], keeps whole: ties never depend on order).
// Found by range refinement over key values: a histogram of the current range [lo, hi] in 2048
// bins of 2^s consecutive keys (count and exact q-sum per bin, shared-memory integer atomics), a
// suffix scan over the bins picks the bin holding the answer, and the range shrinks to that bin
// (at most 3 rounds for 31-bit keys). The first range is [smallest positive key, largest key] of
// the row, so concentrated rows still spread over the bins. Once the range holds at most kCap
// keys they are gathered into shared memory (together with every larger key when those fit too,
// so the top-p search after top-k reuses them) and the remaining rounds read only that buffer.
//
// The draw: per-warp segment sums of the kept q (coalesced), the crossing segment, then the block
// splits that segment into contiguous per-thread pieces, scans them, and the one thread whose
// piece holds the crossing walks it.
//
// One thread block of kThreads per row; every launch goes on the caller's stream, allocates
// nothing and never synchronizes with the host, so it can be captured in a CUDA graph.

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>

namespace rwkv_sampler {

typedef unsigned long long u64;

constexpr int kThreads = 512;
constexpr int kMaxWarps = kThreads / 32;  // warps of a block (fewer where warps are wider)
constexpr int kBinBits = 11;
constexpr int kBins = 1 << kBinBits;
constexpr int kBinsPerThread = kBins / kThreads;
constexpr uint32_t kCap = 2048;          // keys gathered into shared memory
constexpr uint32_t kOneKey = 0x3F800000u;  // bits of 1.0f: keys are clamped to [0, 1]
static_assert(kBins % kThreads == 0, "bins per thread");

struct Range {
    uint32_t lo, hi;    // the answer lies in [lo, hi]
    uint32_t n;         // keys of the row in [lo, hi]
    uint32_t above_n;   // keys of the row above hi (up to the row's largest)
    u64 above_q;        // their q-sum
};

struct Cands {          // shared-memory copy of every key in [lo, hi] when valid
    bool valid;
    uint32_t lo, hi, n;
};

struct Shared {
    u64 bin_q[kBins];
    uint32_t bin_n[kBins];
    uint32_t cand[kCap];
    u64 red_q[kMaxWarps];
    uint32_t red_a[kMaxWarps], red_b[kMaxWarps], red_n[kMaxWarps];
    Range range;
    uint32_t ncand;
    long long drawn;
};

// ------------------------------------------------------------------------------------------ keys
__device__ __forceinline__ uint32_t key_of(float x) {
    const uint32_t b = __float_as_uint(x);
    if (b & 0x80000000u) return 0u;  // negative: not produced by softmax; counted as 0
    return b < kOneKey ? b : kOneKey;  // > 1, inf, NaN: not produced by softmax; counted as 1
}

// q(key) = floor(value * 2^62), exact for values >= 2^-39; at least 1 for a positive value, so that
// every kept token of positive probability still starts a step of the CDF (u = 0 draws the first
// one, as exact arithmetic does).
__device__ __forceinline__ u64 q62(uint32_t key) {
    const int e = static_cast<int>(key >> 23);
    if (e == 0) return key != 0;  // zero, or subnormal (< 2^-126)
    const u64 m = (key & 0x7FFFFFu) | 0x800000u;  // value = m * 2^(e - 150)
    const int sh = e - 88;
    if (sh >= 0) return m << sh;  // sh <= 39: <= 2^62
    const u64 q = sh > -24 ? (m >> -sh) : 0;
    return q ? q : 1;
}

// R(q): q * 2^-62 rounded to the nearest double (the scaling by a power of two is exact)
__device__ __forceinline__ double to_prob(u64 q) { return __ull2double_rn(q) * 0x1p-62; }

__device__ __forceinline__ int bit_length(uint32_t x) { return x ? 32 - __clz(static_cast<int>(x)) : 0; }

// f(key) for every element of the row; coalesced, float4 when kVec
template <bool kVec, typename F>
__device__ __forceinline__ void for_each_key(const float* __restrict__ row, int64_t V, F&& f) {
    if (kVec) {
        const float4* r4 = reinterpret_cast<const float4*>(row);
        const int n4 = static_cast<int>(V >> 2);
#pragma unroll 4
        for (int i = threadIdx.x; i < n4; i += kThreads) {
            const float4 v = __ldg(r4 + i);
            f(key_of(v.x));
            f(key_of(v.y));
            f(key_of(v.z));
            f(key_of(v.w));
        }
    } else {
        const int n = static_cast<int>(V);
#pragma unroll 1
        for (int i = threadIdx.x; i < n; i += kThreads) f(key_of(__ldg(row + i)));
    }
}

// ------------------------------------------------------------------------------------------ warps (HIP: differs)
constexpr int kWarp = 32;
constexpr unsigned kFull = 0xffffffffu;
__device__ __forceinline__ int warp_size() { return kWarp; }
template <typename T>
__device__ __forceinline__ T shfl_xor(T v, int o) { return __shfl_xor_sync(kFull, v, o); }
template <typename T>
__device__ __forceinline__ T shfl_up(T v, int o) { return __shfl_up_sync(kFull, v, o); }
template <typename T>
__device__ __forceinline__ T shfl_down(T v, int o) { return __shfl_down_sync(kFull, v, o); }

// ------------------------------------------------------------------------------------------ block helpers
__device__ __forceinline__ int lane_id() { return threadIdx.x % warp_size(); }
__device__ __forceinline__ int warp_id() { return threadIdx.x / warp_size(); }
__device__ __forceinline__ int num_warps() { return kThreads / warp_size(); }

template <typename T>
__device__ __forceinline__ T warp_add(T v) {
    for (int o = warp_size() / 2; o > 0; o >>= 1) v += shfl_xor(v, o);
    return v;
}

// Exclusive prefix sum over the block's threads (in thread order); *total = the block's sum.
__device__ __forceinline__ u64 block_exclusive_sum(Shared& sh, u64 v, u64* total) {
    const int lane = lane_id(), w = warp_id();
    u64 incl = v;
    for (int o = 1; o < warp_size(); o <<= 1) {
        const u64 y = shfl_up(incl, o);
        if (lane >= o) incl += y;
    }
    if (lane == warp_size() - 1) sh.red_q[w] = incl;
    __syncthreads();
    u64 before = 0, all = 0;
    for (int i = 0; i < num_warps(); ++i) {
        const u64 t = sh.red_q[i];
        before += i < w ? t : 0;
        all += t;
    }
    __syncthreads();
    *total = all;
    return before + incl - v;
}

// Sums over the threads after this one (reverse exclusive scan) of a (count, q) pair.
__device__ __forceinline__ void block_suffix_after(Shared& sh, uint32_t n, u64 q, uint32_t* n_after, u64* q_after) {
    const int lane = lane_id(), w = warp_id();
    uint32_t in = n;
    u64 iq = q;
    for (int o = 1; o < warp_size(); o <<= 1) {
        const uint32_t yn = shfl_down(in, o);
        const u64 yq = shfl_down(iq, o);
        if (lane + o < warp_size()) {
            in += yn;
            iq += yq;
        }
    }
    if (lane == 0) {
        sh.red_n[w] = in;
        sh.red_q[w] = iq;
    }
    __syncthreads();
    uint32_t an = 0;
    u64 aq = 0;
    for (int i = w + 1; i < num_warps(); ++i) {
        an += sh.red_n[i];
        aq += sh.red_q[i];
    }
    __syncthreads();
    *n_after = an + in - n;
    *q_after = aq + iq - q;
}

// ------------------------------------------------------------------------------------------ passes
struct RowStats {
    uint32_t min_pos;  // smallest positive key (UINT_MAX when none)
    uint32_t max_key;  // largest key
    uint32_t n_pos;    // positive keys
    u64 total;         // q-sum of the row
};

template <bool kVec>
__device__ RowStats row_stats(Shared& sh, const float* __restrict__ row, int64_t V) {
    uint32_t mn = UINT_MAX, mx = 0, n = 0;
    u64 tot = 0;
    for_each_key<kVec>(row, V, [&](uint32_t k) {
        if (k != 0) {
            mn = min(mn, k);
            mx = max(mx, k);
            ++n;
            tot += q62(k);
        }
    });
    for (int o = warp_size() / 2; o > 0; o >>= 1) {
        mn = min(mn, shfl_xor(mn, o));
        mx = max(mx, shfl_xor(mx, o));
    }
    n = warp_add(n);
    tot = warp_add(tot);
    const int w = warp_id();
    if (lane_id() == 0) {
        sh.red_a[w] = mn;
        sh.red_b[w] = mx;
        sh.red_n[w] = n;
        sh.red_q[w] = tot;
    }
    __syncthreads();
    RowStats st{UINT_MAX, 0, 0, 0};
    for (int i = 0; i < num_warps(); ++i) {
        st.min_pos = min(st.min_pos, sh.red_a[i]);
        st.max_key = max(st.max_key, sh.red_b[i]);
        st.n_pos += sh.red_n[i];
        st.total += sh.red_q[i];
    }
    __syncthreads();
    return st;
}

// Copy every key in [lo, hi] into sh.cand (the caller knows there are at most kCap).
template <bool kVec>
__device__ Cands gather(Shared& sh, const float* __restrict__ row, int64_t V, uint32_t lo, uint32_t hi) {
    if (threadIdx.x == 0) sh.ncand = 0;
    __syncthreads();
    for_each_key<kVec>(row, V, [&](uint32_t k) {
        if (k >= lo && k <= hi) {
            const uint32_t i = atomicAdd(&sh.ncand, 1u);
            if (i < kCap) sh.cand[i] = k;
        }
    });
    __syncthreads();
    return Cands{true, lo, hi, min(sh.ncand, kCap)};
}

// Histogram of the keys in [lo, hi] (from the row or the gathered keys): bin (key - lo) >> s.
template <bool kVec>
__device__ void histogram(Shared& sh, const float* __restrict__ row, int64_t V, bool from_cand, uint32_t ncand,
                          uint32_t lo, uint32_t hi, int s) {
    for (int i = threadIdx.x; i < kBins; i += kThreads) {
        sh.bin_n[i] = 0;
        sh.bin_q[i] = 0;
    }
    __syncthreads();
    auto add = [&](uint32_t k) {
        if (k >= lo && k <= hi) {
            const uint32_t b = (k - lo) >> s;
            atomicAdd(&sh.bin_n[b], 1u);
            atomicAdd(&sh.bin_q[b], q62(k));
        }
    };
    if (from_cand) {
        for (uint32_t i = threadIdx.x; i < ncand; i += kThreads) add(sh.cand[i]);
    } else {
        for_each_key<kVec>(row, V, add);
    }
    __syncthreads();
}

// The bin holding the answer: the largest bin b whose lower bound t satisfies the property
// (kCount: count(key >= t) >= k; else R(q-sum(key >= t)) >= need). The property holds at lo and
// fails above hi (invariants of Range), and is monotone, so exactly one thread sees it switch.
template <bool kCount>
__device__ Range choose_bin(Shared& sh, const Range& r, int s, u64 k, double need) {
    const int t = threadIdx.x;
    const int b0 = t * kBinsPerThread;
    uint32_t lc = 0;
    u64 lm = 0;
#pragma unroll
    for (int j = 0; j < kBinsPerThread; ++j) {
        lc += sh.bin_n[b0 + j];
        lm += sh.bin_q[b0 + j];
    }
    if (t == 0) sh.range = Range{r.lo, r.lo, 1, r.above_n, r.above_q};  // never used unless the invariants broke
    uint32_t an;
    u64 aq;
    block_suffix_after(sh, lc, lm, &an, &aq);
    auto holds = [&](uint32_t sn, u64 sq) {
        return kCount ? static_cast<u64>(r.above_n) + sn >= k : to_prob(r.above_q + sq) >= need;
    };
    bool next = holds(an, aq);
#pragma unroll
    for (int j = kBinsPerThread - 1; j >= 0; --j) {  // the bins are read again: fewer live registers
        const uint32_t c = sh.bin_n[b0 + j];
        const uint32_t sn = an + c;
        const u64 sq = aq + sh.bin_q[b0 + j];
        const bool here = holds(sn, sq);
        if (here && !next) {
            const u64 base = static_cast<u64>(r.lo) + (static_cast<u64>(b0 + j) << s);
            const u64 top = base + ((1ull << s) - 1);
            sh.range = Range{static_cast<uint32_t>(base), static_cast<uint32_t>(top < r.hi ? top : r.hi), c,
                             r.above_n + an, r.above_q + aq};
        }
        next = here;
        an = sn;
        aq = sq;
    }
    __syncthreads();
    return sh.range;  // rewritten only after later barriers
}

template <bool kCount, bool kVec>
__device__ Range select_key(Shared& sh, const float* __restrict__ row, int64_t V, Range r, uint32_t max_key,
                            Cands& cd, u64 k, double need) {
    for (int round = 0; round < 8 && r.lo < r.hi; ++round) {
        bool covered = cd.valid && cd.lo <= r.lo && r.hi <= cd.hi;
        if (!covered && r.n <= kCap) {
            // take every larger key along when they fit too: a later top-p search above kth reuses them
            const uint32_t ghi = r.n + r.above_n <= kCap ? max_key : r.hi;
            cd = gather<kVec>(sh, row, V, r.lo, ghi);
            covered = true;
        }
        const int s = max(0, bit_length(r.hi - r.lo) - kBinBits);
        histogram<kVec>(sh, row, V, covered, cd.n, r.lo, r.hi, s);
        r = choose_bin<kCount>(sh, r, s, k, need);
    }
    return r;
}

// ------------------------------------------------------------------------------------------ draw
__device__ __forceinline__ u64 kept_q(float x, uint32_t tau_key) {
    const uint32_t k = key_of(x);
    return k >= tau_key ? q62(k) : 0;
}

template <bool kVec>
__device__ long long draw(Shared& sh, const float* __restrict__ row, int64_t V, uint32_t tau_key, double u) {
    const int lane = lane_id(), w = warp_id(), nw = num_warps();
    const int64_t n_items = kVec ? V >> 2 : V;  // float4s or floats
    const int64_t seg = (n_items + nw - 1) / nw;
    const float4* r4 = reinterpret_cast<const float4*>(row);
    auto item_q = [&](int64_t i) -> u64 {
        if (kVec) {
            const float4 v = __ldg(r4 + i);
            return kept_q(v.x, tau_key) + kept_q(v.y, tau_key) + kept_q(v.z, tau_key) + kept_q(v.w, tau_key);
        }
        return kept_q(__ldg(row + i), tau_key);
    };

    // 1. the warp segments' sums, and the segment where the kept CDF first exceeds the target
    {
        const int64_t a = min(n_items, w * seg), b = min(n_items, a + seg);
        u64 local = 0;
#pragma unroll 4
        for (int64_t i = a + lane; i < b; i += warp_size()) local += item_q(i);
        local = warp_add(local);
        if (lane == 0) sh.red_q[w] = local;
    }
    __syncthreads();
    u64 total = 0;
    for (int i = 0; i < nw; ++i) total += sh.red_q[i];
    const double total_p = to_prob(total);
    const double target = fmin(__dmul_rn(u, total_p), nextafter(total_p, 0.0));
    int cw = nw;
    u64 before = 0;
    {
        u64 acc = 0;
        for (int i = 0; i < nw; ++i) {
            const u64 next = acc + sh.red_q[i];
            if (cw == nw && to_prob(next) > target) {
                cw = i;
                before = acc;
            }
            acc = next;
        }
    }
    __syncthreads();
    if (cw == nw) return V - 1;  // nothing kept has positive mass (not a probability row)

    // 2. that segment in contiguous per-thread pieces; the piece holding the crossing is walked
    const int64_t a = min(n_items, cw * seg), b = min(n_items, a + seg);
    const int64_t per = (b - a + kThreads - 1) / kThreads;
    const int64_t pa = min(b, a + threadIdx.x * per), pb = min(b, pa + per);
    u64 mine = 0;
    for (int64_t i = pa; i < pb; ++i) mine += item_q(i);
    u64 unused;
    const u64 start = before + block_exclusive_sum(sh, mine, &unused);
    if (threadIdx.x == 0) sh.drawn = V - 1;
    __syncthreads();
    if (mine != 0 && to_prob(start) <= target && target < to_prob(start + mine)) {
        u64 run = start;
        auto crosses = [&](float x, int64_t index) {
            const uint32_t k = key_of(x);
            if (k < tau_key) return false;
            run += q62(k);
            if (!(to_prob(run) > target)) return false;
            sh.drawn = index;
            return true;
        };
        for (int64_t i = pa; i < pb; ++i) {
            if (kVec) {
                const float4 v = __ldg(r4 + i);
                if (crosses(v.x, 4 * i) || crosses(v.y, 4 * i + 1) || crosses(v.z, 4 * i + 2) ||
                    crosses(v.w, 4 * i + 3))
                    break;
            } else if (crosses(__ldg(row + i), i)) {
                break;
            }
        }
    }
    __syncthreads();
    return sh.drawn;
}

// ------------------------------------------------------------------------------------------ kernel
template <bool kVec>
__global__ void __launch_bounds__(kThreads, 2)
sampler_kernel(int64_t V, int64_t p_stride, const float* __restrict__ p, const int64_t* __restrict__ top_k,
               int64_t k_stride, const float* __restrict__ top_p, int64_t tp_stride, const float* __restrict__ u,
               int64_t u_stride, const int64_t* __restrict__ greedy, int64_t g_stride, float* __restrict__ tau_out,
               int64_t* __restrict__ drawn_out) {
    __shared__ Shared sh;
    const int64_t rowi = blockIdx.x;
    if (greedy[rowi * g_stride] != 0) {  // the caller takes the argmax
        if (threadIdx.x == 0) {
            tau_out[rowi] = 0.0f;
            drawn_out[rowi] = 0;
        }
        return;
    }
    const float* row = p + rowi * p_stride;
    const int64_t k_raw = top_k[rowi * k_stride];
    const float tp = top_p[rowi * tp_stride];
    const bool has_k = k_raw > 0;
    const u64 k = has_k ? static_cast<u64>(k_raw < V ? k_raw : V) : 0;

    uint32_t tau_key = 0;
    if (has_k || tp < 1.0f) {
        const RowStats st = row_stats<kVec>(sh, row, V);
        const uint32_t row_min = st.n_pos < static_cast<u64>(V) ? 0u : st.min_pos;  // vals[V-1]
        Cands cd{false, 0, 0, 0};
        if (!has_k) {
            const double need = static_cast<double>(tp);
            if (!(need > 0.0)) {
                tau_key = st.max_key;
            } else if (to_prob(st.total) < need) {
                tau_key = row_min;
            } else {
                const Range r0{st.min_pos, st.max_key, st.n_pos, 0, 0};
                tau_key = select_key<false, kVec>(sh, row, V, r0, st.max_key, cd, 0, need).lo;
            }
        } else {
            uint32_t kth, n_gt;
            u64 q_gt;
            if (k > st.n_pos) {  // kth is a zero
                kth = 0;
                n_gt = st.n_pos;
                q_gt = st.total;
            } else {
                const Range r0{st.min_pos, st.max_key, st.n_pos, 0, 0};
                const Range r = select_key<true, kVec>(sh, row, V, r0, st.max_key, cd, k, 0.0);
                kth = r.lo;
                n_gt = r.above_n;
                q_gt = r.above_q;
            }
            const double mass = to_prob(q_gt + (k - n_gt) * q62(kth));
            const double need = __dmul_rn(static_cast<double>(tp), mass);
            if (mass < need) {  // top_p > 1: no prefix reaches it
                tau_key = row_min;
            } else if (!(need > 0.0)) {
                tau_key = st.max_key;
            } else if (to_prob(q_gt) < need) {
                tau_key = kth;
            } else {
                const uint32_t lo = max(kth + 1, st.min_pos);
                const Range r0{lo, st.max_key, n_gt, 0, 0};
                tau_key = select_key<false, kVec>(sh, row, V, r0, st.max_key, cd, 0, need).lo;
            }
        }
    }
    const long long d = draw<kVec>(sh, row, V, tau_key, static_cast<double>(u[rowi * u_stride]));
    if (threadIdx.x == 0) {
        tau_out[rowi] = __uint_as_float(tau_key);
        drawn_out[rowi] = d;
    }
}

// ------------------------------------------------------------------------------------------ preparation
// What infer/sampler.py's torch path does to a row of logits before its softmax, in two passes over the row
// instead of ~10 (each op of the torch path reads and writes the whole [B, V] batch once):
//   x = logits - penalty[slot] (fp32; no penalty: the logits in fp32), then x[id] += bias for each of the
//   slot's bias entries in order; NaN -> -inf, +inf -> FLT_MAX, -inf stays; x[vv:] = -inf
//   tok = argmax x (the first of equal values), dead = (x[tok] == -inf), fallback = argmax over [0, vv) of the
//   logits alone with NaN -> -inf, +inf -> FLT_MAX (a dead row's token)
//   s = min(x / T, FLT_MAX) (NaN stays NaN, as torch's clamp), or 0 everywhere in a dead row
//   u = the row's uniform for this step from its keys k1, k2 and the slot's step counter (infer/sampler.py's
//       _uniform: three lowbias32 mixes; its split multiplications are exact 32-bit wrapping products)
// The same fp32 operations in the same order as torch, so s, u and the tokens are bit for bit the torch path's.
constexpr float kFloatMax = 3.40282347e38f;

__device__ __forceinline__ float load_logit(const float* row, int64_t i) { return row[i]; }
__device__ __forceinline__ float load_logit(const __half* row, int64_t i) { return __half2float(row[i]); }

__device__ __forceinline__ float finite_or_inf(float v) {  // torch.nan_to_num(nan=-inf, posinf=FLT_MAX, neginf=-inf)
    if (v != v) return -INFINITY;
    return v == INFINITY ? kFloatMax : v;
}

// the argmax order: the larger value, the smaller index among equal ones (torch.argmax's choice)
__device__ __forceinline__ bool before(float v, int i, float bv, int bi) { return v > bv || (v == bv && i < bi); }

__device__ __forceinline__ uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    return x ^ (x >> 16);
}

// _uniform of infer/sampler.py: 24 random bits of the hash of (k1, k2, step) as a float in [0, 1)
__device__ __forceinline__ float step_uniform(int64_t k1, int64_t k2, int64_t step) {
    const uint32_t lo = static_cast<uint32_t>(step), hi = static_cast<uint32_t>(static_cast<uint64_t>(step) >> 32);
    uint32_t h = mix32(lo ^ static_cast<uint32_t>(k1));
    h = mix32(h ^ hi ^ static_cast<uint32_t>(k2));
    h = mix32(h ^ 0x9E3779B9u);
    return static_cast<float>(h >> 8) * (1.0f / 16777216.0f);
}

struct ArgMax {
    float v;
    int i;
};

__device__ __forceinline__ ArgMax block_argmax(float* red_v, int* red_i, ArgMax m) {
    for (int o = warp_size() / 2; o > 0; o >>= 1) {
        const float ov = shfl_xor(m.v, o);
        const int oi = shfl_xor(m.i, o);
        if (before(ov, oi, m.v, m.i)) m = ArgMax{ov, oi};
    }
    if (lane_id() == 0) {
        red_v[warp_id()] = m.v;
        red_i[warp_id()] = m.i;
    }
    __syncthreads();
    ArgMax best{red_v[0], red_i[0]};
    for (int w = 1; w < num_warps(); ++w) {
        if (before(red_v[w], red_i[w], best.v, best.i)) best = ArgMax{red_v[w], red_i[w]};
    }
    __syncthreads();
    return best;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
prepare_kernel(int64_t V, int64_t vv, const T* __restrict__ logits, int64_t l_stride, const float* __restrict__ penalty,
               int64_t pen_stride, const int64_t* __restrict__ slots, const int64_t* __restrict__ bias_ids,
               const float* __restrict__ bias_vals, int64_t n_bias, int64_t bias_stride, const float* __restrict__ temp,
               int64_t t_stride, const int64_t* __restrict__ k1, const int64_t* __restrict__ k2, int64_t k_stride,
               const int64_t* __restrict__ steps, float* __restrict__ s, int64_t s_stride, int64_t* __restrict__ tok,
               bool* __restrict__ dead, int64_t* __restrict__ fallback, float* __restrict__ u) {
    __shared__ float red_v[kMaxWarps];
    __shared__ int red_i[kMaxWarps];
    const int64_t rowi = blockIdx.x, slot = slots[rowi];
    const T* lg = logits + rowi * l_stride;
    const float* pen = penalty != nullptr ? penalty + slot * pen_stride : nullptr;
    float* x = s + rowi * s_stride;
    const int n = static_cast<int>(V), n_valid = static_cast<int>(vv < V ? vv : V);

    // 1. x before the bias, and the fallback
    ArgMax raw{-INFINITY, INT_MAX};
#pragma unroll 4
    for (int i = threadIdx.x; i < n; i += kThreads) {
        const float v = load_logit(lg, i);
        if (i < n_valid) {
            const float r = finite_or_inf(v);
            if (before(r, i, raw.v, raw.i)) raw = ArgMax{r, i};
        }
        x[i] = pen != nullptr ? v - pen[i] : v;
    }
    raw = block_argmax(red_v, red_i, raw);  // its barrier also orders x's writes before the bias
    if (threadIdx.x == 0) {  // in order, one thread: ids may repeat (padding entries add 0 to token 0)
        for (int64_t j = 0; j < n_bias; ++j) {
            const int64_t id = bias_ids[slot * bias_stride + j];
            if (id >= 0 && id < V) x[id] = x[id] + bias_vals[slot * bias_stride + j];  // the sampler checks ids
        }
    }
    __syncthreads();

    // 2. cleaned x, its argmax, s
    const float t = temp[rowi * t_stride];
    ArgMax best{-INFINITY, INT_MAX};
#pragma unroll 4
    for (int i = threadIdx.x; i < n; i += kThreads) {
        const float v = i < n_valid ? finite_or_inf(x[i]) : -INFINITY;
        if (before(v, i, best.v, best.i)) best = ArgMax{v, i};
        const float q = v / t;
        x[i] = q > kFloatMax ? kFloatMax : q;
    }
    best = block_argmax(red_v, red_i, best);
    const bool is_dead = best.v == -INFINITY;
    if (is_dead) {
        for (int i = threadIdx.x; i < n; i += kThreads) x[i] = 0.0f;
    }
    if (threadIdx.x == 0) {
        tok[rowi] = best.i;
        dead[rowi] = is_dead;
        fallback[rowi] = raw.i;
        u[rowi] = step_uniform(k1[rowi * k_stride], k2[rowi * k_stride], steps[slot]);
    }
}

// The launchers' common frame: argument checks, the device switched to `device` and back, the launch's error.
template <typename Launch>
int launch_on(int device, int64_t B, int64_t V, Launch&& launch) {
    if (B == 0) return cudaSuccess;
    if (B < 0 || B > INT_MAX || V <= 0 || V > INT_MAX) return cudaErrorInvalidConfiguration;
    int previous = -1;
    cudaError_t err = cudaGetDevice(&previous);
    if (err != cudaSuccess) return err;
    if (previous != device && (err = cudaSetDevice(device)) != cudaSuccess) return err;
    launch();
    err = cudaGetLastError();
    if (previous != device) (void)cudaSetDevice(previous);
    return err;
}

}  // namespace rwkv_sampler

// Launch on `stream` (a cudaStream_t passed as an integer) of CUDA device `device`: one block per
// row of p [B, V] (row stride p_stride floats, unit column stride); top_k/greedy int64 and
// top_p/u fp32 are 1-D with the given element strides; tau [B] fp32 and drawn [B] int64 are written
// (0 and 0 for greedy rows). Returns the cudaError_t of the launch (0 = success); nothing is
// launched when B == 0.
extern "C" int sampler_launch(int device, int64_t stream, int64_t B, int64_t V, int64_t p_stride, const float* p,
                              const int64_t* top_k, int64_t k_stride, const float* top_p, int64_t tp_stride,
                              const float* u, int64_t u_stride, const int64_t* greedy, int64_t g_stride, float* tau,
                              int64_t* drawn) {
    using namespace rwkv_sampler;
    return launch_on(device, B, V, [&] {
        const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
        const bool vec = V % 4 == 0 && p_stride % 4 == 0 && reinterpret_cast<uintptr_t>(p) % 16 == 0;
        const dim3 grid(static_cast<unsigned>(B)), block(kThreads);
        if (vec) {
            sampler_kernel<true><<<grid, block, 0, s>>>(V, p_stride, p, top_k, k_stride, top_p, tp_stride, u,
                                                        u_stride, greedy, g_stride, tau, drawn);
        } else {
            sampler_kernel<false><<<grid, block, 0, s>>>(V, p_stride, p, top_k, k_stride, top_p, tp_stride, u,
                                                         u_stride, greedy, g_stride, tau, drawn);
        }
    });
}

// Launch of prepare_kernel (see above) on `stream` of CUDA device `device`: one block per row of logits [B, V] (fp16
// when half, else fp32; row stride l_stride, unit column stride). penalty [slots, V] fp32 (row stride pen_stride) or
// null; slots [B] int64 picks each row's penalty and bias rows; bias_ids/bias_vals [slots, n_bias] (row stride
// bias_stride; n_bias 0: none); temp [B] fp32 (element stride t_stride); k1, k2 [B] int64 (element stride k_stride)
// and steps [slots] int64 (each slot's step counter). Writes s [B, V] fp32 (row stride s_stride), tok and fallback
// [B] int64, dead [B] bool and u [B] fp32. Returns the launch's error code.
extern "C" int sampler_prepare_launch(int device, int64_t stream, int64_t B, int64_t V, int64_t vv, int half,
                                      const void* logits, int64_t l_stride, const float* penalty, int64_t pen_stride,
                                      const int64_t* slots, const int64_t* bias_ids, const float* bias_vals,
                                      int64_t n_bias, int64_t bias_stride, const float* temp, int64_t t_stride,
                                      const int64_t* k1, const int64_t* k2, int64_t k_stride, const int64_t* steps,
                                      float* s, int64_t s_stride, int64_t* tok, bool* dead, int64_t* fallback,
                                      float* u) {
    using namespace rwkv_sampler;
    return launch_on(device, B, V, [&] {
        const cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
        const dim3 grid(static_cast<unsigned>(B)), block(kThreads);
        if (half) {
            prepare_kernel<__half><<<grid, block, 0, st>>>(V, vv, static_cast<const __half*>(logits), l_stride,
                                                           penalty, pen_stride, slots, bias_ids, bias_vals, n_bias,
                                                           bias_stride, temp, t_stride, k1, k2, k_stride, steps, s,
                                                           s_stride, tok, dead, fallback, u);
        } else {
            prepare_kernel<float><<<grid, block, 0, st>>>(V, vv, static_cast<const float*>(logits), l_stride, penalty,
                                                          pen_stride, slots, bias_ids, bias_vals, n_bias, bias_stride,
                                                          temp, t_stride, k1, k2, k_stride, steps, s, s_stride, tok,
                                                          dead, fallback, u);
        }
    });
}

extern "C" const char* sampler_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

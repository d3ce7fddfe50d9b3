// Top-K log-probabilities of draft logits (DDTREE_CONTRACT.md section 2), one CTA per row.
//
//   logits [rows, V] (float32 | bfloat16 | float16)
//     -> topk_lp float32 [rows, K], topk_id int64 [rows, K]
//
// lp = x - lse rounded once to float32, lse = max + log(sum exp(x - max)) accumulated in
// float64; each row descending in lp, equal lp values ordered by the smaller id.
//
// Per row (NOTES-tree.md has the reasoning and the measurements):
//   prefilter a lower bound of the K-th largest x from the row's first `chunk` elements
//             (their own K-th largest, to 24 bits): two histogram passes over the chunk;
//   pass A    the one full read: per-thread (reference max, float64 sum) for lse; elements at
//             or above the bound are appended to the shared-memory candidates;
//   sort      a bitonic sort of the candidates keyed (lp desc, id asc); the first K are the
//             answer unless an element below the bound ties the K-th lp.
// General path (candidates overflow, or that tie): a histogram pass finds the 12-bit bin
// holding the K-th largest x; the threshold is that bin's lowest x, lowered to the smallest
// x whose lp equals that x's lp (two different logits can round to one lp, and the smaller
// id then goes first); another read gathers every element at or above it. If those do not
// fit, the histogram is refined on the next 12, then 8 bits (one more read each); if they
// still do not fit (massive exact ties), the elements above the K-th lp are gathered and the
// tied ones taken in id order by a block-wide scan.
#include "tree_topk.cuh"

#include <cooperative_groups.h>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

namespace {

using namespace topk;

constexpr int kThreads = kRowThreads;
constexpr int kBins = 4096;                 // the widest histogram level (12 bits)
constexpr int kCap = 8192;                  // candidates held in shared memory
constexpr int kUnroll = 4;                  // 16-byte loads in flight per thread
// Calls f(x, id) for every element of the row, each once, split over the block's threads;
// kVector: 16-byte loads (needs V % (16 / sizeof(T)) == 0 and a 16-byte aligned base).
template <typename T, bool kVector, bool kReverse, typename F>
__device__ __forceinline__ void for_each(const T* __restrict__ row, int V, F&& f) {
    if constexpr (kVector) {
        constexpr int N = 16 / sizeof(T);
        const int nvec = V / N;
        const uint4* vrow = reinterpret_cast<const uint4*>(row);
        for (int base = threadIdx.x; base < nvec; base += kThreads * kUnroll) {
            uint4 raw[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                int v = base + u * kThreads;
                if (v < nvec) raw[u] = __ldg(vrow + (kReverse ? nvec - 1 - v : v));
            }
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                int v = base + u * kThreads;
                if (v < nvec) {
                    int first = (kReverse ? nvec - 1 - v : v) * N;
                    const T* e = reinterpret_cast<const T*>(&raw[u]);
#pragma unroll
                    for (int j = 0; j < N; ++j) f(to_float(e[j]), first + j);
                }
            }
        }
    } else {
        for (int i = threadIdx.x; i < V; i += kThreads) {
            int id = kReverse ? V - 1 - i : i;
            f(to_float(row[id]), id);
        }
    }
}

struct Shared {
    uint32_t hist[kBins];
    uint64_t cand[kCap];
};

struct Scalars {
    float max;
    double lse;
    int bin;            // the boundary bin of the current level
    int above;          // elements strictly above the boundary bin's range, all levels so far
    uint32_t threshold; // the candidate threshold key
    int count;          // candidates gathered (may exceed kCap: overflow)
};

using BlockScan = cub::BlockScan<int, kThreads>;

// Smallest key k in [lo, hi] with pred(k) true, pred monotone (false ... false true ... true);
// hi when none before it holds.
template <typename P>
__device__ uint32_t first_true(uint32_t lo, uint32_t hi, P pred) {
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (pred(mid)) hi = mid; else lo = mid + 1;
    }
    return lo;
}

// Finds the bin holding the `need`-th largest element of hist[0 .. nbins) counted from the
// top; writes it and the count strictly above it (this level only) to s->bin, s->above.
__device__ void select_bin(const uint32_t* hist, int nbins, int need, Scalars* s,
                           typename BlockScan::TempStorage& scan) {
    const int per = (nbins + kThreads - 1) / kThreads;
    const int group = kThreads - 1 - threadIdx.x;          // thread 0 holds the highest bins
    const int hi = min(nbins, (group + 1) * per), lo = min(nbins, group * per);
    int total = 0;
    for (int b = lo; b < hi; ++b) total += hist[b];
    int above;
    BlockScan(scan).ExclusiveSum(total, above);
    if (above < need && above + total >= need) {
        for (int b = hi - 1; b >= lo; --b) {
            if (above + static_cast<int>(hist[b]) >= need) {
                s->bin = b;
                s->above += above;
                break;
            }
            above += hist[b];
        }
    }
    __syncthreads();
}

// Rows longer than this get a prefilter threshold from their first `chunk` elements.
__device__ inline int prefilter_chunk(int V, int K) {
    if (V <= kCap) return 0;                                     // everything fits: no filter
    long long want = 2LL * K * V / kCap;                         // ~kCap / 2 candidates expected
    int chunk = static_cast<int>(((max(want, 8192LL) + 1023) / 1024) * 1024);
    return chunk >= V ? 0 : chunk;
}

template <typename T, bool kVector>
__global__ void __launch_bounds__(kThreads) topk_logprobs_kernel(
    const T* __restrict__ logits, int V, int K, float* __restrict__ topk_lp, int64_t* __restrict__ topk_id,
    const int* __restrict__ rows_needed) {
    if (rows_needed && rows_needed[blockIdx.x] == 0) return;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    Shared& sh = *reinterpret_cast<Shared*>(smem_raw);
    __shared__ Scalars s;
    __shared__ union {
        typename BlockScan::TempStorage scan;
        typename BlockReduceF::TempStorage reduce_f;
        typename BlockReduceD::TempStorage reduce_d;
    } tmp;

    const T* row = logits + static_cast<size_t>(blockIdx.x) * V;
    for (int b = threadIdx.x; b < kBins; b += kThreads) sh.hist[b] = 0;
    if (threadIdx.x == 0) { s.above = 0; s.count = 0; }
    __syncthreads();

    // Prefilter: the first `chunk` elements' K-th largest key, to 24 bits (rounded down), is a
    // lower bound of the row's K-th largest: the chunk alone has K elements at or above it.
    uint32_t floor_key = kMinKey;
    if (const int chunk = prefilter_chunk(V, K)) {
        uint32_t prefix = 0;
        for (int level = 0; level < 2; ++level) {
            for_each<T, kVector, false>(row, chunk, [&](float x, int) {
                const uint32_t k = order_key(x);
                if (level == 0) atomicAdd(&sh.hist[k >> 20], 1u);
                else if ((k >> 20) == prefix) atomicAdd(&sh.hist[(k >> 8) & 0xFFF], 1u);
            });
            __syncthreads();
            select_bin(sh.hist, kBins, K - s.above, &s, tmp.scan);
            prefix = (prefix << 12) | static_cast<uint32_t>(s.bin);
            for (int b = threadIdx.x; b < kBins; b += kThreads) sh.hist[b] = 0;
            __syncthreads();
        }
        floor_key = max(prefix << 8, kMinKey);
        if (threadIdx.x == 0) s.above = 0;
        __syncthreads();
    }

    // Pass A, the one full read: per-thread (reference m, float64 sum of e^(x - m)) for lse, m
    // raised only when x exceeds it by more than kRescale (terms stay below e^kRescale, and
    // warps rarely diverge into the float64 rescale); every element at or above floor_key is
    // appended to the candidates while they fit (one shared atomic per warp).
    const float floor_value = key_value(floor_key);
    float m = -INFINITY;
    double sum = 0.0;
    float mk = m + kRescale;
    for_each<T, kVector, false>(row, V, [&](float x, int id) {
        accumulate(x, m, mk, sum);
        if (x >= floor_value) {
            namespace cg = cooperative_groups;
            const cg::coalesced_group group = cg::coalesced_threads();
            int base = 0;
            if (group.thread_rank() == 0) base = atomicAdd(&s.count, static_cast<int>(group.size()));
            const int slot = group.shfl(base, 0) + static_cast<int>(group.thread_rank());
            if (slot < kCap) sh.cand[slot] = (static_cast<uint64_t>(order_key(x)) << 32) | static_cast<uint32_t>(id);
        }
    });
    const double lse = row_lse(m, sum, tmp.reduce_f, tmp.reduce_d, s.max, s.lse);

    // Fast path: every element >= floor_key was kept (x >= floor_value: -0.0 passes with +0.0,
    // an extra candidate that the sort orders correctly). The answer is among them unless an element
    // below floor_key ties the K-th log-prob (then the general path below decides).
    bool sorted = false;
    if (s.count <= kCap) {
        const int count = s.count;
        for (int i = threadIdx.x; i < count; i += kThreads) {
            const uint64_t c = sh.cand[i];
            sh.cand[i] = candidate(log_prob(key_value(static_cast<uint32_t>(c >> 32)), lse), static_cast<int>(c & 0xFFFFFFFFu));
        }
        __syncthreads();
        sort_candidates(sh.cand, count);
        const float lp_k = key_value(~static_cast<uint32_t>(sh.cand[K - 1] >> 32));
        sorted = floor_key == kMinKey || log_prob(key_value(floor_key - 1), lse) < lp_k;
        __syncthreads();
    }

    if (!sorted) {
        // General path. Radix levels over the keys >= floor_key (the K-th largest is among them):
        // 12, 12, then 8 bits, one read each.
        constexpr int kShift[3] = {20, 8, 0};
        constexpr int kBits[3] = {12, 12, 8};
        uint32_t prefix = 0;
        bool gathered = false;
        for (int level = 0; level < 3 && !gathered; ++level) {
            const int shift_prev = level > 0 ? kShift[level - 1] : 32;
            __syncthreads();                                      // every thread has read hist[s.bin]
            for (int b = threadIdx.x; b < (1 << kBits[level]); b += kThreads) sh.hist[b] = 0;
            __syncthreads();
            const uint32_t mask = (1u << kBits[level]) - 1;
            for_each<T, kVector, true>(row, V, [&](float x, int) {
                const uint32_t k = order_key(x);
                if (k >= floor_key && (level == 0 || (k >> shift_prev) == prefix))
                    atomicAdd(&sh.hist[(k >> kShift[level]) & mask], 1u);
            });
            __syncthreads();
            select_bin(sh.hist, 1 << kBits[level], K - s.above, &s, tmp.scan);
            prefix = (prefix << kBits[level]) | static_cast<uint32_t>(s.bin);
            const uint32_t lo_key = prefix << kShift[level];
            if (s.above + static_cast<int>(sh.hist[s.bin]) > kCap) continue;   // cannot fit: refine

            if (threadIdx.x == 0) {
                const float lp_lo = log_prob(key_value(lo_key), lse);
                s.threshold = first_true(kMinKey, lo_key, [&](uint32_t k) { return log_prob(key_value(k), lse) >= lp_lo; });
                s.count = 0;
            }
            __syncthreads();
            const uint32_t threshold = s.threshold;
            for_each<T, kVector, true>(row, V, [&](float x, int id) {
                if (order_key(x) >= threshold) {
                    int slot = atomicAdd(&s.count, 1);
                    if (slot < kCap) sh.cand[slot] = candidate(log_prob(x, lse), id);
                }
            });
            __syncthreads();
            gathered = s.count <= kCap;
            __syncthreads();
        }

        if (!gathered) {
            // Massive ties: prefix is the exact key of the K-th largest x. Take every element with
            // lp above lp_K (fewer than K), then the ones tied at lp_K in increasing id order.
            if (threadIdx.x == 0) {
                const float lp_k = log_prob(key_value(prefix), lse);
                s.threshold = first_true(prefix, kMaxKey, [&](uint32_t k) { return log_prob(key_value(k), lse) > lp_k; });
                s.count = 0;
            }
            __syncthreads();
            const uint32_t strict = s.threshold;
            const float lp_k = log_prob(key_value(prefix), lse);
            for_each<T, kVector, true>(row, V, [&](float x, int id) {
                if (order_key(x) >= strict) sh.cand[atomicAdd(&s.count, 1)] = candidate(log_prob(x, lse), id);
            });
            __syncthreads();
            const int strict_count = s.count;
            int taken = 0;
            for (int base = 0; base < V && strict_count + taken < K; base += kThreads) {
                const int id = base + threadIdx.x;
                const bool tie = id < V && log_prob(to_float(row[id]), lse) == lp_k;
                int rank, ties;
                BlockScan(tmp.scan).ExclusiveSum(tie ? 1 : 0, rank, ties);
                if (tie && strict_count + taken + rank < K) sh.cand[strict_count + taken + rank] = candidate(lp_k, id);
                taken += ties;
                __syncthreads();
            }
            if (threadIdx.x == 0) s.count = K;
            __syncthreads();
        }
        sort_candidates(sh.cand, s.count);
    }

    float* out_lp = topk_lp + static_cast<size_t>(blockIdx.x) * K;
    int64_t* out_id = topk_id + static_cast<size_t>(blockIdx.x) * K;
    for (int r = threadIdx.x; r < K; r += kThreads) {
        uint64_t c = sh.cand[r];
        out_lp[r] = key_value(~static_cast<uint32_t>(c >> 32));
        out_id[r] = static_cast<int64_t>(c & 0xFFFFFFFFu);
    }
}

}  // namespace

namespace topk {

template <typename T>
int launch_topk_v3(const T* x, int rows, int V, int K, float* topk_lp, int64_t* topk_id, const int* rows_needed,
                   cudaStream_t stream) {
    const bool vector = V % (16 / static_cast<int>(sizeof(T))) == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
    auto kernel = vector ? topk_logprobs_kernel<T, true> : topk_logprobs_kernel<T, false>;
    const int smem = static_cast<int>(sizeof(Shared));
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return static_cast<int>(err);
    kernel<<<rows, kThreads, smem, stream>>>(x, V, K, topk_lp, topk_id, rows_needed);
    return kdtree_launch_status();
}

template int launch_topk_v3<float>(const float*, int, int, int, float*, int64_t*, const int*, cudaStream_t);
template int launch_topk_v3<__nv_bfloat16>(const __nv_bfloat16*, int, int, int, float*, int64_t*, const int*,
                                           cudaStream_t);
template int launch_topk_v3<__half>(const __half*, int, int, int, float*, int64_t*, const int*, cudaStream_t);

}  // namespace topk

namespace {

template <typename T>
int launch_version(const void* logits, int rows, int V, int K, int version, void* workspace, float* topk_lp,
                   int64_t* topk_id, cudaStream_t stream) {
    const T* x = static_cast<const T*>(logits);
    if (version == 4 && topk_v4_takes(rows, V, K, sizeof(T), logits))
        return launch_topk_v4(x, rows, V, K, topk_lp, topk_id, workspace, stream);
    return launch_topk_v3(x, rows, V, K, topk_lp, topk_id, nullptr, stream);
}

}  // namespace

// version: 3 (tree_topk.cu) or 4 (tree_topk_v4.cu, where it takes the rows: else v3). Bytes of
// device workspace the launch needs (0: none); the same arguments must reach the launch.
KDTREE_API size_t kdtree_topk_workspace_bytes(int dtype, int rows, int V, int K, int version,
                                              const void* logits) {
    const int elem = dtype == 0 ? 4 : 2;
    if (version != 4 || rows <= 0 || K <= 0 || K > V || !topk_v4_takes(rows, V, K, elem, logits)) return 0;
    return topk_v4_workspace_bytes(rows, V, K);
}

// dtype: 0 float32, 1 bfloat16, 2 float16. K = min(k, V), 0 < V, K <= 4096 (0 rows or K = 0: no-op).
KDTREE_API int kdtree_topk_logprobs(const void* logits, int dtype, int rows, int V, int K, int version,
                                    void* workspace, float* topk_lp, int64_t* topk_id, cudaStream_t stream) {
    if (rows < 0 || V <= 0 || K < 0 || K > V) return KDTREE_BAD_SHAPE;
    if (K > kCap) return KDTREE_BAD_LIMIT;
    if (version != 3 && version != 4) return KDTREE_BAD_SHAPE;
    if (rows == 0 || K == 0) return KDTREE_OK;
    if (!logits || !topk_lp || !topk_id) return KDTREE_BAD_POINTER;
    if (kdtree_topk_workspace_bytes(dtype, rows, V, K, version, logits) > 0 && !workspace) return KDTREE_BAD_POINTER;
    switch (dtype) {
        case 0: return launch_version<float>(logits, rows, V, K, version, workspace, topk_lp, topk_id, stream);
        case 1: return launch_version<__nv_bfloat16>(logits, rows, V, K, version, workspace, topk_lp, topk_id, stream);
        case 2: return launch_version<__half>(logits, rows, V, K, version, workspace, topk_lp, topk_id, stream);
        default: return KDTREE_BAD_SHAPE;
    }
}

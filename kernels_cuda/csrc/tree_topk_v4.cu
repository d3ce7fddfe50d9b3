// Top-K log-probabilities, v4 (NOTES-tree.md has the design, its prediction and measurements).
//
// Same function as v3 (tree_topk.cu), bit for bit: every thread of a row's 512 performs v3's
// pass-A arithmetic (tree_topk.cuh: accumulate, row_lse) on the same vectors in the same order,
// so lse is v3's, and the K best (lp desc, id asc) given lse are unique. What changes:
//   bound    from pass A's own first loads: each thread's kTop largest logits among its first
//            kBatch vectors, the K-th largest of those over the CTA (a radix select): the CTA
//            alone holds K elements at or above it, so it never cuts the answer (v3: two
//            histogram passes with per-element shared atomics over a prefix of the row);
//   loop     kBatch 16-byte loads in flight per thread all along (a register is refilled as soon
//            as its vector is used), the float64 rescale and the candidate append out of the
//            per-element path (one branch per vector, one warp vote a batch);
//   select   the K-th best candidate by a radix select, then a sort of those K only (v3: a
//            bitonic sort of every candidate);
//   split    when rows are fewer than the multiprocessors, a row's 512 threads are spread over
//            S CTAs of 512 / S (K <= 512 / S); each writes its threads' (m, sum) and its
//            candidates out, and a merge kernel reduces them exactly as one CTA would.
// A row whose candidates overflow, or whose K-th lp could be tied by an element below a bound,
// is flagged and finished by v3 (the same result, at v3's cost).
#include "tree_topk.cuh"

namespace {

using namespace topk;

constexpr int kBatch = 8;            // 16-byte vectors in flight per thread; the first batch gives the bound
constexpr int kTop = 4;              // each thread's largest elements of its first batch that the bound ranks
constexpr int kCap = 8192;           // a row's candidates in shared memory
constexpr int kSplitCap = 4096;      // candidates one CTA of a split row writes out
constexpr int kMaxK = 512;
constexpr int kMaxSplits = 8;
constexpr unsigned kFull = 0xFFFFFFFFu;

template <typename T>
constexpr int kPerVector = 16 / static_cast<int>(sizeof(T));

// The workspace (kdtree_topk_workspace_bytes): fallback flags, and for split rows the threads'
// pass-A results and the CTAs' candidates, counts and bounds.
struct Workspace {
    int* fallback;      // [rows] 1: v3 finishes the row
    float* m;           // [rows, 512]
    double* sum;        // [rows, 512]
    uint64_t* cand;     // [rows, splits, kSplitCap] order_key(x) << 32 | id
    int* count;         // [rows, splits]
    uint32_t* bound;    // [rows, splits]
};

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

Workspace carve(void* base, int rows, int splits) {
    unsigned char* p = static_cast<unsigned char*>(base);
    Workspace w{};
    w.fallback = reinterpret_cast<int*>(p);
    p += align256(rows * sizeof(int));
    if (splits > 1) {
        const size_t threads = static_cast<size_t>(rows) * kRowThreads, ctas = static_cast<size_t>(rows) * splits;
        w.m = reinterpret_cast<float*>(p);
        p += align256(threads * sizeof(float));
        w.sum = reinterpret_cast<double*>(p);
        p += align256(threads * sizeof(double));
        w.cand = reinterpret_cast<uint64_t*>(p);
        p += align256(ctas * kSplitCap * sizeof(uint64_t));
        w.count = reinterpret_cast<int*>(p);
        p += align256(ctas * sizeof(int));
        w.bound = reinterpret_cast<uint32_t*>(p);
    }
    return w;
}

int sm_count() {
    int device = 0, sms = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
        return 0;
    return sms;
}

// CTAs per row: the most (a power of two <= kMaxSplits) with K <= 512 / S and rows * S <= SMs.
int splits_for(int rows, int K) {
    const int sms = sm_count();
    int s = 1;
    while (s < kMaxSplits && K <= kRowThreads / (2 * s) && static_cast<long long>(rows) * 2 * s <= sms) s *= 2;
    return s;
}

template <typename T>
__device__ __forceinline__ void unpack(uint4 raw, float (&x)[kPerVector<T>]) {
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int j = 0; j < kPerVector<T>; ++j) x[j] = to_float(e[j]);
}

struct Acc {
    float m, mk;
    double sum;
};

// A vector whose largest element exceeds mk (rare after the first): v3's step element by element.
template <typename T>
__device__ __noinline__ Acc accumulate_vector(uint4 raw, Acc a) {
    float x[kPerVector<T>];
    unpack<T>(raw, x);
#pragma unroll
    for (int j = 0; j < kPerVector<T>; ++j) accumulate(x[j], a.m, a.mk, a.sum);
    return a;
}

struct SelectSmem {
    uint32_t hist[256];
    int digit, need, count;
};

// The need-th smallest (1-based) of keys[0 .. count) (distinct, or ties counted with
// multiplicity), looking at the top 8 * passes bits (the rest of the result is 0): a radix
// select, one 8-bit digit a pass, same-digit lanes of a warp adding once. Block-collective.
template <int kThreads>
__device__ uint64_t kth_smallest(const uint64_t* keys, int count, int need, int passes, SelectSmem& sm) {
    uint64_t prefix = 0;
    for (int pass = 0; pass < passes; ++pass) {
        const int shift = 56 - 8 * pass;
        for (int b = threadIdx.x; b < 256; b += kThreads) sm.hist[b] = 0;
        __syncthreads();
        for (int base = 0; base < count; base += kThreads) {      // warp-uniform trip count
            const int i = base + threadIdx.x;
            const uint64_t k = i < count ? keys[i] : 0;
            const bool in = i < count && (pass == 0 || (k >> (shift + 8)) == (prefix >> (shift + 8)));
            const unsigned digit = in ? static_cast<unsigned>(k >> shift) & 0xFFu : 256u;
            const unsigned peers = __match_any_sync(kFull, digit);
            if (in && (threadIdx.x & 31) == static_cast<unsigned>(__ffs(peers) - 1)) atomicAdd(&sm.hist[digit], __popc(peers));
        }
        __syncthreads();
        if (threadIdx.x < 32) {                                   // warp 0: the digit holding the need-th
            const int lane = threadIdx.x;
            unsigned c[8], total = 0;
#pragma unroll
            for (int q = 0; q < 8; ++q) total += c[q] = sm.hist[8 * lane + q];
            unsigned inclusive = total;
#pragma unroll
            for (int d = 1; d < 32; d <<= 1) {
                const unsigned other = __shfl_up_sync(kFull, inclusive, d);
                if (lane >= d) inclusive += other;
            }
            unsigned run = inclusive - total;
            if (run < static_cast<unsigned>(need) && static_cast<unsigned>(need) <= inclusive) {
                int found = -1;
                unsigned before = run;
#pragma unroll
                for (int q = 0; q < 8; ++q) {
                    if (found < 0 && run + c[q] >= static_cast<unsigned>(need)) {
                        found = q;
                        before = run;
                    }
                    run += c[q];
                }
                sm.digit = 8 * lane + found;
                sm.need = need - static_cast<int>(before);
            }
        }
        __syncthreads();
        prefix |= static_cast<uint64_t>(sm.digit) << shift;
        need = sm.need;
    }
    return prefix;
}


// ---------------------------------------------------------------------------------------------
// Pass A for one thread of a row's 512 (vt): its vectors vt, vt + 512, ... in order.

struct PassOut {
    float m;
    double sum;
    uint32_t bound;     // the CTA's bound key (kMinKey: every element is a candidate)
};

// Appends this thread's elements >= floor_value of the vectors flagged in vmask (reloaded: they
// were just read) to cand[*counter ...] (up to cap; the counter counts past it). Warp-collective.
template <typename T>
__device__ void append(const uint4* vrow, int vt, int first, unsigned vmask, float floor_value, uint64_t* cand,
                       int* counter, int cap) {
    if (!__any_sync(kFull, vmask)) return;
    constexpr int N = kPerVector<T>;
    int count = 0;
    for (unsigned bits = vmask; bits; bits &= bits - 1) {
        float x[N];
        unpack<T>(__ldg(vrow + vt + kRowThreads * (first + __ffs(bits) - 1)), x);
#pragma unroll
        for (int j = 0; j < N; ++j) count += x[j] >= floor_value;
    }
    const int lane = threadIdx.x & 31;
    int inclusive = count;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int other = __shfl_up_sync(kFull, inclusive, d);
        if (lane >= d) inclusive += other;
    }
    int base = 0;
    if (lane == 31) base = atomicAdd(counter, inclusive);
    int slot = __shfl_sync(kFull, base, 31) + inclusive - count;
    for (unsigned bits = vmask; bits; bits &= bits - 1) {
        const int v = vt + kRowThreads * (first + __ffs(bits) - 1);
        float x[N];
        unpack<T>(__ldg(vrow + v), x);
#pragma unroll
        for (int j = 0; j < N; ++j) {
            if (x[j] >= floor_value) {
                if (slot < cap) cand[slot] = (static_cast<uint64_t>(order_key(x[j])) << 32) | static_cast<uint32_t>(v * N + j);
                ++slot;
            }
        }
    }
}

// Block-collective over the CTA's kThreads threads (every one calls it). K <= kThreads.
template <typename T, int kThreads>
__device__ PassOut pass_a(const T* __restrict__ row, int V, int K, int vt, uint64_t* cand, int* counter, int cap,
                          uint64_t* bound_keys, SelectSmem& sm) {
    constexpr int N = kPerVector<T>;
    const int nvec = V / N;
    const uint4* vrow = reinterpret_cast<const uint4*>(row);
    const int batches = ((nvec + kRowThreads - 1) / kRowThreads + kBatch - 1) / kBatch;   // the same for all
    Acc a{-INFINITY, -INFINITY + kRescale, 0.0};
    uint4 raw[kBatch];

    // The bound: this thread's kTop largest elements of its first batch; the K-th largest of
    // those over the CTA (distinct elements, so the CTA holds K at or above it).
    float top[kTop];
#pragma unroll
    for (int q = 0; q < kTop; ++q) top[q] = -INFINITY;
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
        const int v = vt + kRowThreads * u;
        if (v < nvec) {
            raw[u] = __ldg(vrow + v);
            float x[N];
            unpack<T>(raw[u], x);
#pragma unroll
            for (int j = 0; j < N; ++j) {
                float carry = x[j] == x[j] ? x[j] : -INFINITY;      // a NaN is no element of the order
#pragma unroll
                for (int q = 0; q < kTop; ++q) {
                    const float hi = fmaxf(top[q], carry);
                    carry = fminf(top[q], carry);
                    top[q] = hi;
                }
            }
        }
    }
#pragma unroll
    for (int q = 0; q < kTop; ++q) bound_keys[kTop * threadIdx.x + q] = static_cast<uint64_t>(~order_key(top[q])) << 32;
    __syncthreads();
    const uint32_t bound = ~static_cast<uint32_t>(kth_smallest<kThreads>(bound_keys, kTop * kThreads, K, 4, sm) >> 32);
    const float floor_value = key_value(bound);

    // Each vector's register is refilled with the next batch's as soon as it is used (the
    // appends reread flagged vectors from the cache), so kBatch loads stay in flight throughout.
    for (int b = 0; b < batches; ++b) {
        const int first = b * kBatch;
        unsigned vmask = 0;
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
            if (vt + kRowThreads * (first + u) < nvec) {
                float x[N];
                unpack<T>(raw[u], x);
                float vmax = x[0];
#pragma unroll
                for (int j = 1; j < N; ++j) vmax = fmaxf(vmax, x[j]);
                if (vmax > a.mk) {
                    a = accumulate_vector<T>(raw[u], a);
                } else {
#pragma unroll
                    for (int j = 0; j < N; ++j) a.sum += exp_diff(x[j], a.m);
                }
                vmask |= static_cast<unsigned>(vmax >= floor_value) << u;
            }
            const int next = vt + kRowThreads * (first + kBatch + u);
            if (next < nvec) raw[u] = __ldg(vrow + next);
        }
        append<T>(vrow, vt, first, vmask, floor_value, cand, counter, cap);
    }
    return PassOut{a.m, a.sum, bound};
}

// ---------------------------------------------------------------------------------------------
// Selection (512 threads): from cand[0 .. count) (order_key(x) << 32 | id), all elements
// >= the bound (the most restrictive of the row's CTAs), the K best in contract order.

struct RowSmem {
    uint64_t cand[kCap];
    uint64_t chosen[kMaxK];
    uint64_t bound_keys[kTop * kRowThreads];
    SelectSmem select;
    BlockReduceF::TempStorage reduce_f;
    BlockReduceD::TempStorage reduce_d;
    float max;
    double lse;
    int count, chosen_count;
};

// Writes the row's K outputs, or flags it for v3 (overflow, too few, or a tie across the bound).
__device__ void finish_row(RowSmem& sh, int count, uint32_t bound, double lse, int K, float* out_lp,
                           int64_t* out_id, int* fallback) {
    if (count > kCap || count < K) {                            // uniform: count is the same everywhere
        if (threadIdx.x == 0) *fallback = 1;
        return;
    }
    for (int i = threadIdx.x; i < count; i += kRowThreads) {
        const uint64_t c = sh.cand[i];
        sh.cand[i] = candidate(log_prob(key_value(static_cast<uint32_t>(c >> 32)), lse), static_cast<int>(c & 0xFFFFFFFFu));
    }
    if (threadIdx.x == 0) sh.chosen_count = 0;
    __syncthreads();
    const uint64_t kth = kth_smallest<kRowThreads>(sh.cand, count, K, 8, sh.select);     // keys are distinct
    for (int i = threadIdx.x; i < count; i += kRowThreads)
        if (sh.cand[i] <= kth) sh.chosen[atomicAdd(&sh.chosen_count, 1)] = sh.cand[i];
    __syncthreads();
    sort_candidates(sh.chosen, K);
    const float lp_k = key_value(~static_cast<uint32_t>(sh.chosen[K - 1] >> 32));
    const bool exact = bound == kMinKey || log_prob(key_value(bound - 1), lse) < lp_k;
    if (threadIdx.x == 0) *fallback = exact ? 0 : 1;
    if (!exact) return;
    for (int r = threadIdx.x; r < K; r += kRowThreads) {
        const uint64_t c = sh.chosen[r];
        out_lp[r] = key_value(~static_cast<uint32_t>(c >> 32));
        out_id[r] = static_cast<int64_t>(c & 0xFFFFFFFFu);
    }
}

// One CTA of 512 threads per row.
template <typename T>
__global__ void __launch_bounds__(kRowThreads) topk_v4_row(const T* __restrict__ logits, int V, int K,
                                                           float* __restrict__ topk_lp, int64_t* __restrict__ topk_id,
                                                           Workspace ws) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    RowSmem& sh = *reinterpret_cast<RowSmem*>(smem_raw);
    const int row = blockIdx.x;
    if (threadIdx.x == 0) sh.count = 0;
    __syncthreads();
    const PassOut p = pass_a<T, kRowThreads>(logits + static_cast<size_t>(row) * V, V, K, threadIdx.x, sh.cand,
                                             &sh.count, kCap, sh.bound_keys, sh.select);
    const double lse = row_lse(p.m, p.sum, sh.reduce_f, sh.reduce_d, sh.max, sh.lse);  // its barriers publish count
    finish_row(sh, sh.count, p.bound, lse, K, topk_lp + static_cast<size_t>(row) * K,
               topk_id + static_cast<size_t>(row) * K, ws.fallback + row);
}

// Split rows: CTA (s, row) runs the row's threads s * kThreads .. + kThreads.
template <typename T, int kThreads>
__global__ void __launch_bounds__(kThreads) topk_v4_split(const T* __restrict__ logits, int V, int K, Workspace ws) {
    __shared__ uint64_t bound_keys[kTop * kThreads];
    __shared__ SelectSmem select;
    __shared__ int count;
    const int s = blockIdx.x, splits = gridDim.x, row = blockIdx.y;
    const int vt = s * kThreads + threadIdx.x;
    const size_t cta = static_cast<size_t>(row) * splits + s;
    if (threadIdx.x == 0) count = 0;
    __syncthreads();
    const PassOut p = pass_a<T, kThreads>(logits + static_cast<size_t>(row) * V, V, K, vt, ws.cand + cta * kSplitCap,
                                          &count, kSplitCap, bound_keys, select);
    ws.m[static_cast<size_t>(row) * kRowThreads + vt] = p.m;
    ws.sum[static_cast<size_t>(row) * kRowThreads + vt] = p.sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        ws.count[cta] = count;
        ws.bound[cta] = p.bound;
    }
}

// The merge of a split row: v3's lse from the 512 threads' (m, sum), the CTAs' candidates.
__global__ void __launch_bounds__(kRowThreads) topk_v4_merge(int K, int splits, float* __restrict__ topk_lp,
                                                             int64_t* __restrict__ topk_id, Workspace ws) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    RowSmem& sh = *reinterpret_cast<RowSmem*>(smem_raw);
    const int row = blockIdx.x;
    const size_t t = static_cast<size_t>(row) * kRowThreads + threadIdx.x;
    const double lse = row_lse(ws.m[t], ws.sum[t], sh.reduce_f, sh.reduce_d, sh.max, sh.lse);
    int total = 0;
    uint32_t bound = kMinKey;
    bool overflow = false;
    for (int s = 0; s < splits; ++s) {                          // every thread, the same few loads
        const int c = ws.count[static_cast<size_t>(row) * splits + s];
        overflow |= c > kSplitCap;
        bound = max(bound, ws.bound[static_cast<size_t>(row) * splits + s]);
        const int at = total;
        total += c;
        if (!overflow && total <= kCap)
            for (int i = threadIdx.x; i < c; i += kRowThreads)
                sh.cand[at + i] = ws.cand[(static_cast<size_t>(row) * splits + s) * kSplitCap + i];
    }
    __syncthreads();
    finish_row(sh, overflow ? kCap + 1 : total, bound, lse, K, topk_lp + static_cast<size_t>(row) * K,
               topk_id + static_cast<size_t>(row) * K, ws.fallback + row);
}

template <typename T, int kThreads>
int launch_split(const T* x, int rows, int V, int K, int splits, const Workspace& ws, cudaStream_t stream) {
    topk_v4_split<T, kThreads><<<dim3(splits, rows), kThreads, 0, stream>>>(x, V, K, ws);
    return kdtree_launch_status();
}

}  // namespace

namespace topk {

bool topk_v4_takes(int rows, int V, int K, int elem_size, const void* logits) {
    return rows > 0 && V > kCap && V % (16 / elem_size) == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0 &&
           K >= 1 && K <= kMaxK;
}

size_t topk_v4_workspace_bytes(int rows, int V, int K) {
    const int splits = splits_for(rows, K);
    size_t bytes = align256(rows * sizeof(int));
    if (splits > 1) {
        const size_t threads = static_cast<size_t>(rows) * kRowThreads, ctas = static_cast<size_t>(rows) * splits;
        bytes += align256(threads * sizeof(float)) + align256(threads * sizeof(double)) +
                 align256(ctas * kSplitCap * sizeof(uint64_t)) + align256(ctas * sizeof(int)) +
                 align256(ctas * sizeof(uint32_t));
    }
    return bytes;
}

template <typename T>
int launch_topk_v4(const T* x, int rows, int V, int K, float* topk_lp, int64_t* topk_id, void* workspace,
                   cudaStream_t stream) {
    const int splits = splits_for(rows, K);
    const Workspace ws = carve(workspace, rows, splits);
    const int smem = static_cast<int>(sizeof(RowSmem));
    if (splits == 1) {
        cudaError_t err = cudaFuncSetAttribute(topk_v4_row<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        if (err != cudaSuccess) return static_cast<int>(err);
        topk_v4_row<T><<<rows, kRowThreads, smem, stream>>>(x, V, K, topk_lp, topk_id, ws);
    } else {
        const int status = splits == 2 ? launch_split<T, 256>(x, rows, V, K, splits, ws, stream)
                         : splits == 4 ? launch_split<T, 128>(x, rows, V, K, splits, ws, stream)
                                       : launch_split<T, 64>(x, rows, V, K, splits, ws, stream);
        if (status != 0) return status;
        cudaError_t err = cudaFuncSetAttribute(topk_v4_merge, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        if (err != cudaSuccess) return static_cast<int>(err);
        topk_v4_merge<<<rows, kRowThreads, smem, stream>>>(K, splits, topk_lp, topk_id, ws);
    }
    const int status = kdtree_launch_status();
    if (status != 0) return status;
    return launch_topk_v3(x, rows, V, K, topk_lp, topk_id, ws.fallback, stream);
}

template int launch_topk_v4<float>(const float*, int, int, int, float*, int64_t*, void*, cudaStream_t);
template int launch_topk_v4<__nv_bfloat16>(const __nv_bfloat16*, int, int, int, float*, int64_t*, void*, cudaStream_t);
template int launch_topk_v4<__half>(const __half*, int, int, int, float*, int64_t*, void*, cudaStream_t);

}  // namespace topk

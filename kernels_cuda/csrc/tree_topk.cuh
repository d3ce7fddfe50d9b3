// Shared by the top-K kernels (tree_topk.cu: v3, tree_topk_v4.cu: v4): the float order keys,
// the contract's log-prob, and the pass-A arithmetic whose every step both versions perform in
// the same order, so that their lse, hence their outputs, are bit-identical.
#pragma once

#include "common.cuh"

#include <cub/block/block_reduce.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace topk {

constexpr uint32_t kMinKey = 0x007FFFFFu;   // order_key(-inf)
constexpr uint32_t kMaxKey = 0xFF800000u;   // order_key(+inf)
constexpr float kRescale = 16.0f;           // pass A's reference max may lag the max by this

__device__ __forceinline__ uint32_t order_key(float x) {
    uint32_t u = __float_as_uint(x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float key_value(uint32_t k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

// The contract's lp: the float64 difference, rounded once to float32.
__device__ __forceinline__ float log_prob(float x, double lse) {
    return static_cast<float>(static_cast<double>(x) - lse);
}

// e^(x - m) to about 1e-7 relative: float exp of the rounded difference d, corrected to first
// order by the difference's exact rounding error (TwoSum), so the argument is exact; one
// float -> double conversion per element (the sum is float64).
__device__ __forceinline__ double exp_diff(float x, float m) {
    const float d = x - m;
    const float xv = d + m, mv = d - xv;
    const float err = (x - xv) - (m + mv);                  // x - m = d + err exactly
    const float e = expf(d);
    return e > 0.0f ? static_cast<double>(fmaf(e, err, e)) : 0.0;
}

// Candidate sort key: ascending order = lp descending, then id ascending.
__device__ __forceinline__ uint64_t candidate(float lp, int id) {
    return (static_cast<uint64_t>(~order_key(lp)) << 32) | static_cast<uint32_t>(id);
}

// Pass A's step for one element, in the thread's order: the reference max m is raised only
// when x exceeds it by more than kRescale (mk = m + kRescale, kept beside it), then
// sum += e^(x - m).
__device__ __forceinline__ void accumulate(float x, float& m, float& mk, double& sum) {
    if (x > mk) {
        sum = (m == -INFINITY) ? 0.0 : sum * exp(static_cast<double>(m) - static_cast<double>(x));
        m = x;
        mk = m + kRescale;
    }
    sum += exp_diff(x, m);
}

constexpr int kRowThreads = 512;           // pass A's threads per row: each owns the vectors = itself mod 512

struct MaxOp {
    __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

using BlockReduceF = cub::BlockReduce<float, kRowThreads>;
using BlockReduceD = cub::BlockReduce<double, kRowThreads>;

// The row's lse from the 512 threads' pass-A results (m, sum): the block max M, each sum
// rescaled by e^(m - M), their block sum S; lse = M + log(S), returned to every thread.
// max_slot and lse_slot are shared scalars; both temp storages may alias (a barrier separates them).
__device__ __forceinline__ double row_lse(float m, double sum, typename BlockReduceF::TempStorage& reduce_f,
                                          typename BlockReduceD::TempStorage& reduce_d, float& max_slot,
                                          double& lse_slot) {
    const float block_max = BlockReduceF(reduce_f).Reduce(m, MaxOp());
    if (threadIdx.x == 0) max_slot = block_max;
    __syncthreads();
    sum = (m == -INFINITY) ? 0.0 : sum * exp(static_cast<double>(m) - static_cast<double>(max_slot));
    const double block_sum = BlockReduceD(reduce_d).Sum(sum);
    if (threadIdx.x == 0) lse_slot = static_cast<double>(max_slot) + log(block_sum);
    __syncthreads();
    return lse_slot;
}

// Bitonic sort of cand[0 .. count) ascending (padded to a power of two with the largest key), by a
// block of kRowThreads threads.
__device__ inline void sort_candidates(uint64_t* cand, int count) {
    int size = 1;
    while (size < count) size <<= 1;
    for (int i = count + threadIdx.x; i < size; i += kRowThreads) cand[i] = ~0ull;
    __syncthreads();
    for (int k = 2; k <= size; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < size; i += kRowThreads) {
                int partner = i ^ j;
                if (partner > i) {
                    uint64_t a = cand[i], b = cand[partner];
                    if ((a > b) == ((i & k) == 0)) { cand[i] = b; cand[partner] = a; }
                }
            }
            __syncthreads();
        }
    }
}

// Host side: v3 over every row (rows_needed null) or over the rows r with rows_needed[r] != 0;
// v4's rows (tree_topk_v4.cu), its fallback to v3 included. T: float, __nv_bfloat16, __half.
template <typename T>
int launch_topk_v3(const T* logits, int rows, int V, int K, float* topk_lp, int64_t* topk_id,
                   const int* rows_needed, cudaStream_t stream);

// Whether v4 takes these rows (else v3 does); workspace bytes it needs; the launch.
bool topk_v4_takes(int rows, int V, int K, int elem_size, const void* logits);
size_t topk_v4_workspace_bytes(int rows, int V, int K);
template <typename T>
int launch_topk_v4(const T* logits, int rows, int V, int K, float* topk_lp, int64_t* topk_id, void* workspace,
                   cudaStream_t stream);

}  // namespace topk

// Sampling choices (DDTREE_CONTRACT.md section 5), one CTA per row.
//
//   logits [rows, V] (float32 | bfloat16 | float16 | float64), uniforms float64 [rows], T > 0
//     -> choices int64 [rows]
//
// x = logit / T in float64 (IEEE division); lse = max + log(sum exp(x - max)); p = exp(x - lse).
// The choice is the smallest id with p > 0 whose cdf exceeds u, else (u beyond the total) the
// largest id with p > 0: a token of probability 0 is never chosen. -1 marks a row the contract
// has no answer for: a NaN logit, no finite maximum (+inf, or every logit -inf), or u outside
// [0, 1).
//
// The cdf, evaluated in float64 over ids in increasing order (NOTES-tree.md has the reasoning):
//   tiles     ids [256 j, 256 j + 256), each lane of a warp owning 8 consecutive ids;
//   pass      the one full read: per tile its largest x, M_j, and S_j = sum exp(x - M_j);
//   row       M = max M_j, lse = M + log(sum S_j exp(M_j - M)); tile mass q_j = S_j exp(M_j - lse)
//             and prefix P_j = the exclusive scan of q in tile order;
//   tile      the chosen id lies in the first tile with q_j > 0 and P_j + q_j > u (if none, the
//             last tile with q_j > 0); a tile with q_j = 0 holds no id with p > 0;
//   id        in that tile, warp 0 computes each p exactly, cdf = P_j + (the exclusive scan of
//             the lanes' sums + the lane's running sum); the first id with p > 0 and cdf > u,
//             else the tile's last id with p > 0.
// Boundaries that are exact in float64 (dyadic probabilities) are exact here, as in numpy;
// elsewhere the cdf differs from a sequential numpy cumsum by rounding only (~1e-13 relative).
#include "common.cuh"

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kPer = 8;                  // consecutive ids a lane owns in a tile
constexpr int kTile = 32 * kPer;         // ids per tile
constexpr int kMaxTiles = 4096;          // V <= 1,048,576 (24 bytes of shared memory a tile)
constexpr unsigned kFull = 0xFFFFFFFFu;

__device__ __forceinline__ double to_double(float x) { return x; }
__device__ __forceinline__ double to_double(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ double to_double(__half x) { return __half2float(x); }
__device__ __forceinline__ double to_double(double x) { return x; }

// The kPer logits of `lane` in `tile` (ids tile * kTile + lane * kPer + k), -inf past V.
// kVector: V % kPer == 0 and a 16-byte aligned base, so a lane's ids are all in or all out.
template <typename T, bool kVector>
__device__ __forceinline__ void load_tile(const T* __restrict__ row, int V, int tile, int lane, double (&v)[kPer]) {
    const int first = tile * kTile + lane * kPer;
    if constexpr (kVector) {
        constexpr int kLoads = kPer * static_cast<int>(sizeof(T)) / 16;
        if (first < V) {
            uint4 raw[kLoads];
            const uint4* src = reinterpret_cast<const uint4*>(row + first);
#pragma unroll
            for (int i = 0; i < kLoads; ++i) raw[i] = __ldg(src + i);
            const T* e = reinterpret_cast<const T*>(raw);
#pragma unroll
            for (int k = 0; k < kPer; ++k) v[k] = to_double(e[k]);
        } else {
#pragma unroll
            for (int k = 0; k < kPer; ++k) v[k] = -INFINITY;
        }
    } else {
#pragma unroll
        for (int k = 0; k < kPer; ++k) v[k] = first + k < V ? to_double(row[first + k]) : -INFINITY;
    }
}

__device__ __forceinline__ double warp_max(double x) {
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) x = fmax(x, __shfl_xor_sync(kFull, x, d));
    return x;
}

__device__ __forceinline__ double warp_sum(double x) {
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) x += __shfl_xor_sync(kFull, x, d);
    return x;
}

struct MaxOp {
    __device__ __forceinline__ double operator()(double a, double b) const { return fmax(a, b); }
};

using BlockReduce = cub::BlockReduce<double, kThreads>;
using BlockScan = cub::BlockScan<double, kThreads>;

template <typename T, bool kVector, bool kScaled>
__global__ void __launch_bounds__(kThreads) sample_choices_kernel(
    const T* __restrict__ logits, int V, double temperature, const double* __restrict__ uniforms,
    int64_t* __restrict__ choices) {
    extern __shared__ double tiles_smem[];
    const int tiles = (V + kTile - 1) / kTile;
    double* tile_max = tiles_smem;              // M_j
    double* mass = tiles_smem + tiles;          // S_j, then q_j
    double* prefix = tiles_smem + 2 * tiles;    // P_j
    __shared__ double row_max, row_lse;
    __shared__ union {
        typename BlockReduce::TempStorage reduce;
        typename BlockScan::TempStorage scan;
    } tmp;

    const T* row = logits + static_cast<size_t>(blockIdx.x) * V;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    auto x_of = [temperature](double logit) { return kScaled ? logit / temperature : logit; };

    // The one full read: per tile M_j (x is monotone in the logit, so M_j = x of the largest
    // logit) and S_j = sum exp(x - M_j), each lane's 8 terms in id order, then the warp's sum.
    bool nan = false;
    for (int tile = warp; tile < tiles; tile += kWarps) {
        double v[kPer];
        load_tile<T, kVector>(row, V, tile, lane, v);
        double m = -INFINITY;
#pragma unroll
        for (int k = 0; k < kPer; ++k) {
            nan |= v[k] != v[k];
            m = fmax(m, v[k]);
        }
        const double M = x_of(warp_max(m));
        double sum = 0.0;
        if (M != -INFINITY) {
#pragma unroll
            for (int k = 0; k < kPer; ++k) sum += exp(x_of(v[k]) - M);
        }
        sum = warp_sum(sum);
        if (lane == 0) {
            tile_max[tile] = M;
            mass[tile] = sum;
        }
    }
    const bool any_nan = __syncthreads_or(nan);

    double m = -INFINITY;
    for (int t = threadIdx.x; t < tiles; t += kThreads) m = fmax(m, tile_max[t]);
    m = BlockReduce(tmp.reduce).Reduce(m, MaxOp());
    if (threadIdx.x == 0) row_max = m;
    __syncthreads();
    const double M = row_max, u = uniforms[blockIdx.x];
    if (any_nan || !isfinite(M) || !(u >= 0.0 && u < 1.0)) {        // uniform across the block
        if (threadIdx.x == 0) choices[blockIdx.x] = -1;
        return;
    }

    double part = 0.0;
    for (int t = threadIdx.x; t < tiles; t += kThreads) part += mass[t] * exp(tile_max[t] - M);
    const double total = BlockReduce(tmp.reduce).Sum(part);
    if (threadIdx.x == 0) row_lse = M + log(total);
    __syncthreads();
    const double lse = row_lse;
    // Tile masses and their exclusive prefix; each thread reads back only the tiles it wrote.
    double carry = 0.0;
    for (int base = 0; base < tiles; base += kThreads) {
        const int t = base + threadIdx.x;
        const double q = t < tiles ? mass[t] * exp(tile_max[t] - lse) : 0.0;
        double excl, aggregate;
        BlockScan(tmp.scan).ExclusiveSum(q, excl, aggregate);
        if (t < tiles) {
            mass[t] = q;
            prefix[t] = carry + excl;
        }
        carry += aggregate;
        __syncthreads();
    }
    if (warp != 0) return;

    // The tile: the first of mass > 0 whose prefix + mass exceeds u, else the last of mass > 0
    // (one exists: the row maximum's tile has mass >= exp(-log V) > 0).
    int tile = -1, last = -1;
    for (int base = 0; base < tiles && tile < 0; base += 32) {
        const int t = base + lane;
        const bool positive = t < tiles && mass[t] > 0.0;
        const unsigned crosses = __ballot_sync(kFull, positive && prefix[t] + mass[t] > u);
        const unsigned any = __ballot_sync(kFull, positive);
        if (crosses) tile = base + __ffs(crosses) - 1;
        else if (any) last = base + 31 - __clz(any);
    }
    const bool beyond = tile < 0;
    if (beyond) tile = last;

    // The id inside it, from the exact p of each of its ids.
    double v[kPer], c[kPer], p[kPer];
    load_tile<T, kVector>(row, V, tile, lane, v);
    double running = 0.0;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
        p[k] = exp(x_of(v[k]) - lse);
        running += p[k];
        c[k] = running;
    }
    double inclusive = running;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const double other = __shfl_up_sync(kFull, inclusive, d);
        if (lane >= d) inclusive += other;
    }
    double exclusive = __shfl_up_sync(kFull, inclusive, 1);
    if (lane == 0) exclusive = 0.0;
    const double base_cdf = prefix[tile];
    int hit = -1, positive = -1;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
        if (p[k] > 0.0) {
            positive = k;
            if (hit < 0 && !beyond && base_cdf + (exclusive + c[k]) > u) hit = k;
        }
    }
    const unsigned hits = __ballot_sync(kFull, hit >= 0);
    const unsigned positives = __ballot_sync(kFull, positive >= 0);
    const int src = hits ? __ffs(hits) - 1 : 31 - __clz(positives);
    const int k = __shfl_sync(kFull, hits ? hit : positive, src);
    if (lane == 0) choices[blockIdx.x] = static_cast<int64_t>(tile) * kTile + src * kPer + k;
}

template <typename T>
int launch_sample(const void* logits, int rows, int V, double temperature, const double* uniforms, int64_t* choices,
                  cudaStream_t stream) {
    const T* x = static_cast<const T*>(logits);
    const bool vector = V % kPer == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
    const bool scaled = temperature != 1.0;
    auto kernel = vector ? (scaled ? sample_choices_kernel<T, true, true> : sample_choices_kernel<T, true, false>)
                         : (scaled ? sample_choices_kernel<T, false, true> : sample_choices_kernel<T, false, false>);
    const int smem = 3 * ((V + kTile - 1) / kTile) * static_cast<int>(sizeof(double));
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return static_cast<int>(err);
    kernel<<<rows, kThreads, smem, stream>>>(x, V, temperature, uniforms, choices);
    return kdtree_launch_status();
}

}  // namespace

// dtype: 0 float32, 1 bfloat16, 2 float16, 3 float64. 0 < V <= 1,048,576; temperature finite and
// > 0 (else KDTREE_BAD_SHAPE); rows == 0: no-op.
KDTREE_API int kdtree_sample_choices(const void* logits, int dtype, int rows, int V, double temperature,
                                     const double* uniforms, int64_t* choices, cudaStream_t stream) {
    if (rows < 0 || V <= 0 || !(temperature > 0.0) || !isfinite(temperature)) return KDTREE_BAD_SHAPE;
    if ((V + kTile - 1) / kTile > kMaxTiles) return KDTREE_BAD_LIMIT;
    if (rows == 0) return KDTREE_OK;
    if (!logits || !uniforms || !choices) return KDTREE_BAD_POINTER;
    switch (dtype) {
        case 0: return launch_sample<float>(logits, rows, V, temperature, uniforms, choices, stream);
        case 1: return launch_sample<__nv_bfloat16>(logits, rows, V, temperature, uniforms, choices, stream);
        case 2: return launch_sample<__half>(logits, rows, V, temperature, uniforms, choices, stream);
        case 3: return launch_sample<double>(logits, rows, V, temperature, uniforms, choices, stream);
        default: return KDTREE_BAD_SHAPE;
    }
}

// Shared by the tree-verify MLA sources (mla_verify.cu has the math): the launch parameters,
// the device helpers every path uses (key rows, visibility, output stores), and the launchers
// of the two tensor-core kernels, which live in their own files.
//
//   mla_verify.cu  the CUDA-core kernel, the split combine, the dispatch and the C API
//   mla_mma.cu     K2 dims on mma.sync + cp.async (compute capability 8.0 and later)
//   mla_wgmma.cu   K2 dims on wgmma + TMA (Hopper, sm_90a code only): one warpgroup scores
//                  every tile; mla_wgmma_pairs.cu: the warpgroups score alternate tiles
#pragma once

#include "common.cuh"

#include <cuda_bf16.h>
#include <math_constants.h>

namespace kdtree_mla {

using bf16 = __nv_bfloat16;

enum MlaDtype : int { kFloat32 = 0, kBFloat16 = 1 };

struct MlaParams {
    const void* q_lat;          // [T, H, R]
    const void* q_pe;           // [T, H, dr]
    const void* c_kv;           // [S, R] rows (a pool [P, page_size, R] is S = P * page_size rows)
    const void* k_pe;           // [S, dr]
    const int32_t* context;     // [B]
    const int32_t* tree;        // [B]
    const int32_t* q_offsets;   // [B + 1]
    const int32_t* kv_offsets;  // [B] (contiguous layout; null when paged)
    const int32_t* block_table; // [B, table_stride] (paged layout; null when contiguous)
    int table_stride, page_size;
    const uint32_t* visibility; // [T, vis_words]
    void* o_lat;                // [T, H, R]
    float* lse;                 // [T, H]
    float* part_o;              // [num_splits, T * H, R]  (num_splits > 1 only)
    float* part_lse;            // [num_splits, T * H]
    int vis_words;
    int heads, kv_lora, rope_dim;
    int total_rows;             // T * H
    int num_splits, split_keys; // split y covers request keys [y * split_keys, (y + 1) * split_keys)
    float scale_log2;           // scale * log2(e): scores live in the log2 domain
};

// K2 dims, the only ones the tensor-core kernels take.
constexpr int kK2Lora = 512, kK2Rope = 64;
constexpr int kTileRows = 64;  // query rows per block of either tensor-core kernel

// The tensor-core launchers: the attention kernel only (the dispatcher adds the combine).
// grid = (row tiles of the longest tree, splits, requests). 0, a cudaError_t, or a KdtreeStatus.
bool wgmma_built();                        // this library carries the sm_90a kernel
bool wgmma_layout(const MlaParams& p);     // its TMA boxes can read this key layout
// pairs: the seesaw kernel (mla_wgmma_pairs.cu), else the one-scorer kernel (mla_wgmma.cu).
int launch_wgmma(const MlaParams& p, dim3 grid, long long cache_rows, bool out_bf16, bool pairs, cudaStream_t stream);
// mma.sync: the tile plan for 160 KB of shared memory a block and more (sm_80, sm_90) where the
// device has it, else (or with `small_tiles`) the one for 100 KB (sm_86, sm_89, sm_120).
int launch_mma(const MlaParams& p, dim3 grid, bool small_tiles, bool out_bf16, cudaStream_t stream);

constexpr float kLn2 = 0.693147180559945309f;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(bf16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_float<bf16>(float x) { return __float2bfloat16_rn(x); }

// The cache row of request b's key slot s (the layouts at the top of mla_verify.cu).
__device__ __forceinline__ int cache_row(const MlaParams& p, int b, int s) {
    if (!p.block_table) return p.kv_offsets[b] + s;
    return p.block_table[(size_t)b * p.table_stride + s / p.page_size] * p.page_size + s % p.page_size;
}

// Is key s (request-local) visible to the query token `token` (global row of visibility)?
// The caller guarantees s < context + tree.
__device__ __forceinline__ bool key_visible(const MlaParams& p, int token, int s, int context) {
    if (s < context) return true;
    const int j = s - context;
    return (p.visibility[(size_t)token * p.vis_words + (j >> 5)] >> (j & 31)) & 1u;
}

// Final softmax statistics of one row: the natural lse (-inf when l == 0).
__device__ __forceinline__ float row_lse(float m_log2, float l) {
    return l > 0.f ? (m_log2 + log2f(l)) * kLn2 : -CUDART_INF_F;
}

// Where row `row` (global) of split `split` puts columns col, col + 1.
template <typename TOut>
__device__ __forceinline__ void store_pair(const MlaParams& p, int split, int row, int col, float v0, float v1) {
    if (p.num_splits == 1) {
        TOut* dst = static_cast<TOut*>(p.o_lat) + (size_t)row * p.kv_lora + col;
        dst[0] = from_float<TOut>(v0);
        dst[1] = from_float<TOut>(v1);
    } else {
        float2* dst = reinterpret_cast<float2*>(p.part_o + ((size_t)split * p.total_rows + row) * p.kv_lora + col);
        *dst = make_float2(v0, v1);
    }
}

template <typename TOut>
__device__ __forceinline__ void store_one(const MlaParams& p, int split, int row, int col, float v) {
    if (p.num_splits == 1) {
        static_cast<TOut*>(p.o_lat)[(size_t)row * p.kv_lora + col] = from_float<TOut>(v);
    } else {
        p.part_o[((size_t)split * p.total_rows + row) * p.kv_lora + col] = v;
    }
}

__device__ __forceinline__ void store_lse(const MlaParams& p, int split, int row, float lse) {
    if (p.num_splits == 1) p.lse[row] = lse;
    else p.part_lse[(size_t)split * p.total_rows + row] = lse;
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
}
// 2^x on the special-function unit (ex2.approx.ftz: relative error below 2^-22, results under
// 2^-126 flushed to 0, as no softmax weight needs them); exp2f adds range fix-ups around the same
// instruction.
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ void named_bar_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace kdtree_mla

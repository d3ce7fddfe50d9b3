// Tree-verify MLA attention in the absorbed form, with a bit-packed ancestor-only mask.
//
// A ragged batch of B requests. Request b has tree[b] query tokens (rows
// q_offsets[b] .. q_offsets[b] + tree[b] of q_lat / q_pe) and kv_len = context[b] + tree[b]
// keys, slots 0 .. kv_len of its cached context, then its tree tokens. Slot s lives in one
// row of c_kv / k_pe viewed as [rows, R] / [rows, dr] (`cache_row`), in one of two layouts:
// - contiguous: row kv_offsets[b] + s;
// - paged (block_table given; pools [P, page_size, R] as vLLM / FlashMLA keep them): row
//   block_table[b, s / page_size] * page_size + s % page_size. Table entries past a
//   request's last page may be -1 and are never read.
// For query token t of request b, head h, key slot s of request b:
//
//   score(t, h, s) = (q_lat[t, h] . c_kv[s] + q_pe[t, h] . k_pe[s]) * scale
//   visible(t, s)  = s < context[b] || bit (s - context[b]) of visibility row t
//   o_lat[t, h]    = sum_s softmax_s(score) c_kv[s]  over the visible keys
//   lse[t, h]      = log sum_s exp(score)            (natural log; -inf and o_lat = 0 when
//                                                      the row sees no key)
//
// Visibility row t holds vis_words uint32 words; bit b of word w is tree token 32w + b,
// little-endian, as in DDTREE_CONTRACT.md.
//
// Work is cut into (query-row tile, key split, request) blocks. A query row is one
// (token, head) pair; rows are flattened token-major, so a tile of 64 rows at K2 dims is one
// token's 64 heads, all sharing the keys. With more than one split each block writes a
// normalised partial (o, lse) to a float32 workspace and `mla_combine` merges the splits
// (flash-decoding); with one split blocks write the outputs directly.
//
// Two block kernels, the same math:
// - `mla_generic`: any dims, float32 or bf16 inputs; one warp per row, float32 CUDA cores.
// - `mla_k2_wgmma`: bf16 inputs at kv_lora 512, rope 64, on Hopper (sm_90a); 64 rows x 64
//   keys a step on the tensor cores (wgmma, float32 accumulation), operands loaded by TMA
//   with the 128-byte swizzle; c_kv in shared memory serves as both K and V. A 64-key tile
//   (tiles start at request slots that are multiples of the box height) is one TMA box per
//   64-dim chunk in the contiguous layout or with pages of a multiple of 64 slots, and
//   64 / page_size boxes of page_size rows per chunk with pages of 8, 16 or 32 slots. Other
//   page sizes take the CUDA-core path.

#include "common.cuh"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <math_constants.h>

namespace {

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

constexpr float kLn2 = 0.693147180559945309f;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(bf16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_float<bf16>(float x) { return __float2bfloat16_rn(x); }

// The cache row of request b's key slot s (the layouts at the top of this file).
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

// Final softmax statistics of one row: natural lse and 1 / l (both safe when l == 0).
__device__ __forceinline__ float row_lse(float m_log2, float l) {
    return l > 0.f ? (m_log2 + log2f(l)) * kLn2 : -CUDART_INF_F;
}

// Where row `row` (global) of split `split` puts column `col`'s value and its lse.
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

// ------------------------------------------------------------------ generic path

constexpr int kGenericWarps = 4;

// One warp per query row; lanes split the dims, a butterfly sum gives every lane the same
// score, the online softmax runs per key. Shared memory per warp: q [R + dr] and o [R] floats.
template <typename TIn, typename TOut>
__global__ void __launch_bounds__(kGenericWarps * 32) mla_generic(MlaParams p) {
    extern __shared__ float smem[];
    const int b = blockIdx.z, split = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int tree = p.tree[b], context = p.context[b];
    const int local_row = blockIdx.x * kGenericWarps + warp;
    const int kv_len = context + tree;
    const int key_begin = split * p.split_keys;
    if (local_row >= tree * p.heads || key_begin >= kv_len) return;
    const int key_end = min(kv_len, key_begin + p.split_keys);
    const int R = p.kv_lora, dr = p.rope_dim;
    const int row = p.q_offsets[b] * p.heads + local_row;
    const int token = row / p.heads;

    float* q = smem + warp * (2 * R + dr);  // [R + dr]
    float* o = q + R + dr;                  // [R]
    const TIn* q_lat = static_cast<const TIn*>(p.q_lat) + (size_t)row * R;
    const TIn* q_pe = static_cast<const TIn*>(p.q_pe) + (size_t)row * dr;
    for (int d = lane; d < R; d += 32) { q[d] = to_float(q_lat[d]); o[d] = 0.f; }
    for (int d = lane; d < dr; d += 32) q[R + d] = to_float(q_pe[d]);
    __syncwarp();

    float m = -CUDART_INF_F, l = 0.f;
    for (int s = key_begin; s < key_end; ++s) {
        if (!key_visible(p, token, s, context)) continue;
        const size_t key_row = cache_row(p, b, s);
        const TIn* c = static_cast<const TIn*>(p.c_kv) + key_row * R;
        const TIn* k = static_cast<const TIn*>(p.k_pe) + key_row * dr;
        float dot = 0.f;
        for (int d = lane; d < R; d += 32) dot += q[d] * to_float(c[d]);
        for (int d = lane; d < dr; d += 32) dot += q[R + d] * to_float(k[d]);
        for (int mask = 16; mask > 0; mask >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, mask);
        const float x = dot * p.scale_log2;
        const float m_new = fmaxf(m, x);
        const float alpha = exp2f(m - m_new);
        const float w = exp2f(x - m_new);
        l = l * alpha + w;
        for (int d = lane; d < R; d += 32) o[d] = o[d] * alpha + w * to_float(c[d]);
        m = m_new;
    }
    const float inv_l = l > 0.f ? 1.f / l : 0.f;
    for (int d = lane; d < R; d += 32) store_one<TOut>(p, split, row, d, o[d] * inv_l);
    if (lane == 0) store_lse(p, split, row, row_lse(m, l));
}

// ------------------------------------------------------------------ K2 tensor-core path (Hopper)

namespace k2 {
constexpr int kR = 512, kDr = 64, kD = kR + kDr;  // latent, rope, score dims
constexpr int kBM = 64;                   // query rows per block (one wgmma M)
constexpr int kChunkDims = 64;            // dims per 128-byte swizzled row
constexpr int kChunks = kD / kChunkDims;  // 9: 8 of c_kv / q_lat, 1 of k_pe / q_pe
constexpr int kChunkBytes = 64 * 128;     // one [64 rows][64 dims] bf16 chunk
constexpr int kTileBytes = kChunks * kChunkBytes;  // a Q tile or a key tile: 72 KB
constexpr int kStages = 2;                // key tiles in flight
constexpr int kMinBox = 8;                // key rows per TMA box at least: one 1024-byte swizzle period
constexpr int kThreads = 256;             // two warpgroups
// Shared memory, from a 1024-byte aligned base (the 128-byte swizzle repeats every 1024 bytes).
constexpr int kOffQ = 0;
constexpr int kOffK = kOffQ + kTileBytes;                 // [kStages] key tiles
constexpr int kOffP = kOffK + kStages * kTileBytes;       // P [64 rows][64 keys], one chunk
constexpr int kOffAlpha = kOffP + kChunkBytes;            // [64] float: this tile's O rescale
constexpr int kOffInvL = kOffAlpha + kBM * 4;             // [64] float: final 1 / l
constexpr int kOffBars = kOffInvL + kBM * 4;              // mbarriers (see the kernel)
constexpr int kBars = 1 + 2 * kStages + 3;
constexpr size_t kSmemBytes = kOffBars + kBars * 8 + 1024;
}  // namespace k2

// The four operands as TMA tensor maps: rows of 64-dim chunks, 128-byte swizzle; boxes of 64
// rows, or of page_size rows for the keys of pages smaller than 64 slots (key_box).
struct K2Maps {
    CUtensorMap q_lat;  // [T * H rows, 512]
    CUtensorMap q_pe;   // [T * H rows, 64]
    CUtensorMap c_kv;   // [S rows, 512]
    CUtensorMap k_pe;   // [S rows, 64]
};

// Key rows per TMA box: 64, or a page when pages are smaller (8, 16 or 32 slots on the
// tensor-core path), so that no box crosses a page.
__host__ __device__ __forceinline__ int key_box(const MlaParams& p) {
    return p.block_table && p.page_size < 64 ? p.page_size : 64;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // Hopper-only instructions: sm_90a code

namespace k2 {
constexpr int kBN = 64;  // keys per tile
constexpr int kMaxBoxes = kBN / kMinBox;  // TMA boxes per chunk of a key tile at most
constexpr int kBarWg0 = 1;  // named barrier of warpgroup 0 alone (0 is __syncthreads)
}  // namespace k2

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
    asm volatile(
        "{\n.reg .pred done;\nWAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n}\n" ::"r"(smem_u32(bar)), "r"(parity) : "memory");
}
// One box of `map` ([rows][64 dims]) at (dim x, row y) into a swizzled chunk; completes on bar.
__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, uint64_t* bar, int x, int y) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
        ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(smem_u32(bar)) : "memory");
}
// One box per chunk: rows y .. y + box - 1 of the latent map (8 chunks) and of the rope map (1),
// at `dst` within each chunk.
__device__ __forceinline__ void tma_load_rows(unsigned char* dst, const CUtensorMap* lat, const CUtensorMap* pe,
                                              uint64_t* bar, int y) {
#pragma unroll
    for (int c = 0; c < k2::kChunks - 1; ++c) tma_load(dst + c * k2::kChunkBytes, lat, bar, c * k2::kChunkDims, y);
    tma_load(dst + (k2::kChunks - 1) * k2::kChunkBytes, pe, bar, 0, y);
}
// The cache rows of the boxes of request b's key tile at slots key0 .. key0 + 63: box j
// (box rows; key0 is a multiple of box when paged) starts at slot key0 + j box. Contiguous
// rows are base + slot (base = kv_offsets[b], read once: no load a tile, one box of 64);
// paged ones come from the block table. A box whose first slot lies past `last` (the
// split's last key) loads the box holding `last`: a row the table maps, whose contents are
// zeroed or masked before use.
template <bool kPaged>
__device__ __forceinline__ void key_tile_rows(int (&y)[k2::kMaxBoxes], const MlaParams& p, int b, int base,
                                              int key0, int last, int box) {
    if constexpr (!kPaged) {
        y[0] = base + key0;
        return;
    }
#pragma unroll
    for (int j = 0; j < k2::kMaxBoxes; ++j) {
        if (j * box < 64) {
            const int s = key0 + j * box;
            y[j] = cache_row(p, b, s <= last ? s : key0 + (last - key0) / box * box);
        }
    }
}
// A key tile's 64 rows as 64 / box boxes per chunk at rows y[j]; box j lands at row j box
// of each chunk (a multiple of 8 rows: 1024-byte aligned, the swizzle's period). The boxes
// add up to one tile, the byte count the barrier expects.
__device__ __forceinline__ void tma_load_keys(unsigned char* dst, const CUtensorMap* lat, const CUtensorMap* pe,
                                              uint64_t* bar, const int (&y)[k2::kMaxBoxes], int box) {
    mbar_expect_tx(bar, k2::kTileBytes);
#pragma unroll
    for (int j = 0; j < k2::kMaxBoxes; ++j)
        if (j * box < 64) tma_load_rows(dst + j * box * 128, lat, pe, bar, y[j]);
}
__device__ __forceinline__ void named_bar_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Generic-proxy writes to shared memory become visible to the tensor cores and the copy engine.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Shared-memory matrix descriptor with the 128-byte swizzle. K-major operands (Q, K, P):
// rows of 128 bytes, 8-row groups sbo = 1024 bytes apart (lbo unused). MN-major V: 64 output
// columns per 128-byte row, lbo = the stride between 64-column chunks, sbo = between 8-key groups.
__device__ __forceinline__ uint64_t smem_desc(const void* p, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((smem_u32(p) & 0x3FFFF) >> 4) | (uint64_t)((lbo >> 4) & 0x3FFF) << 16 |
           (uint64_t)((sbo >> 4) & 0x3FFF) << 32 | 1ull << 62;
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Keep the compiler from moving accesses of wgmma accumulators across the asynchronous window.
template <int N> __device__ __forceinline__ void fence_operands(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
}
// Eight float32 accumulators d[i] .. d[i + 7] as read-write asm operands.
#define KDTREE_F8(i)                                                                                       \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
        "+f"(d[i + 7])
// s[64 x 64] (+)= Q[64 x 16] K[64 x 16]^T, both K-major in shared memory.
__device__ __forceinline__ void wgmma_scores(float (&d)[32], uint64_t q, uint64_t k, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : KDTREE_F8(0), KDTREE_F8(8), KDTREE_F8(16), KDTREE_F8(24)
        : "l"(q), "l"(k), "r"(accumulate));
}
// o[64 x 256] += P[64 x 16] V[16 x 256]: P K-major and V MN-major in shared memory.
__device__ __forceinline__ void wgmma_pv(float (&d)[128], uint64_t p, uint64_t v) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, 0, 1;\n}\n"
        : KDTREE_F8(0), KDTREE_F8(8), KDTREE_F8(16), KDTREE_F8(24), KDTREE_F8(32), KDTREE_F8(40), KDTREE_F8(48), KDTREE_F8(56),
          KDTREE_F8(64), KDTREE_F8(72), KDTREE_F8(80), KDTREE_F8(88), KDTREE_F8(96), KDTREE_F8(104), KDTREE_F8(112), KDTREE_F8(120)
        : "l"(p), "l"(v), "r"(1));
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// Block = 64 query rows x one key split of one request, two warpgroups, both operands of
// every wgmma in shared memory. Per 64-key tile, warpgroup 0 computes the scores S = Q K^T,
// the online softmax, and writes P (bf16) and the rows' rescale factors to shared memory;
// then each warpgroup accumulates its 256 of the 512 output columns, O += P V, so warpgroup 1
// works on tile t while warpgroup 0 scores tile t + 1. c_kv in shared memory is both K
// (K-major) and V (MN-major). One thread of warpgroup 1 issues the TMA loads: the Q tile, then
// key tiles into a ring of kStages, each refilled once all 8 warps have released it. Every
// hand-off between the warpgroups is an mbarrier.
template <typename TOut, bool kPaged>
__global__ void __launch_bounds__(k2::kThreads, 1)
    mla_k2_wgmma(const __grid_constant__ MlaParams p, const __grid_constant__ K2Maps maps) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // wgmma exists only in sm_90a code
    using namespace k2;
    extern __shared__ unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
    unsigned char* sQ = smem + kOffQ;
    unsigned char* sK = smem + kOffK;
    unsigned char* sP = smem + kOffP;
    float* sAlpha = reinterpret_cast<float*>(smem + kOffAlpha);
    float* sInvL = reinterpret_cast<float*>(smem + kOffInvL);
    uint64_t* bars = reinterpret_cast<uint64_t*>(smem + kOffBars);
    uint64_t* q_full = bars;              // the Q tile landed
    uint64_t* full = bars + 1;            // [kStages] a key tile landed
    uint64_t* empty = full + kStages;     // [kStages] all 8 warps are done with a key tile
    uint64_t* p_ready = empty + kStages;  // warpgroup 0 wrote P and alpha of a tile
    uint64_t* p_free = p_ready + 1;       // warpgroup 1 is done with them
    uint64_t* l_ready = p_free + 1;       // warpgroup 0 wrote the final 1 / l

    const int b = blockIdx.z, split = blockIdx.y;
    const int tree = p.tree[b], context = p.context[b];
    const int rows = tree * p.heads;
    const int row0 = blockIdx.x * kBM;
    const int kv_len = context + tree;
    const int key_begin = split * p.split_keys;
    if (row0 >= rows || key_begin >= kv_len) return;
    const int key_end = min(kv_len, key_begin + p.split_keys);
    const int n_tiles = (key_end - key_begin + kBN - 1) / kBN;
    const int grow0 = p.q_offsets[b] * p.heads + row0;     // global row of tile row 0
    const int box = kPaged ? key_box(p) : 64;                // key rows per TMA box (compile-time when contiguous)
    const int base = kPaged ? 0 : p.kv_offsets[b];          // contiguous: the request's first cache row

    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const bool producer = tid == 128;
    const int r_lo = 16 * warp + g;  // this thread's tile rows: r_lo and r_lo + 8 (accumulator layout)

    if (tid == 0) {
        mbar_init(q_full, 1);
        for (int s = 0; s < kStages; ++s) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], 8);
        }
        mbar_init(p_ready, 128);  // hand-offs between the warpgroups: every thread arrives after
        mbar_init(p_free, 128);   // its own shared-memory accesses (faster, measured, than one
        mbar_init(l_ready, 128);  // elected lane per warp exchanging the values by shuffles)
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (producer) {
        mbar_expect_tx(q_full, kTileBytes);
        tma_load_rows(sQ, &maps.q_lat, &maps.q_pe, q_full, grow0);
        for (int s = 0; s < kStages && s < n_tiles; ++s) {
            int y[kMaxBoxes];
            key_tile_rows<kPaged>(y, p, b, base, key_begin + s * kBN, key_end - 1, box);
            tma_load_keys(sK + s * kTileBytes, &maps.c_kv, &maps.k_pe, &full[s], y, box);
        }
    }
    __syncwarp();

    bool row_ok[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) row_ok[h] = row0 + r_lo + 8 * h < rows;
    float o[128];  // [64 rows x 256 columns] of this warpgroup's output half
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    float inv_l[2];  // 1 / the final row sums
    // O *= alpha per row, skipped when no row's running max moved (x * 1 == x: exact).
    auto rescale_o = [&](const float (&alpha)[2]) {
        if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
            for (int i = 0; i < 128; ++i) o[i] *= alpha[(i >> 1) & 1];
        }
    };
    // O += P V of tile `tile`: this warpgroup's 256 columns, P and V from shared memory.
    const uint64_t p_desc = smem_desc(sP, 16, 1024);
    const uint64_t v_desc = smem_desc(sK, kChunkBytes, 1024) + ((wg * 4 * kChunkBytes) >> 4);
    auto accumulate_pv = [&](int tile) {
        fence_operands(o);
        wgmma_fence();
        const uint32_t stage_off = ((tile % kStages) * kTileBytes) >> 4;  // descriptor units of 16 bytes
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
            wgmma_pv(o, p_desc + ((kk * 32) >> 4), v_desc + stage_off + ((kk * 16 * 128) >> 4));
        wgmma_commit();
        wgmma_wait_all();
        fence_operands(o);
    };

    if (wg == 0) {
        int vis_token[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) vis_token[h] = (grow0 + (row_ok[h] ? r_lo + 8 * h : 0)) / p.heads;
        float m_row[2] = {-CUDART_INF_F, -CUDART_INF_F};
        float l_row[2] = {0.f, 0.f};  // this thread's part of the row sums (reduced at the end)
        const uint64_t q_desc = smem_desc(sQ, 16, 1024);
        const uint64_t k_desc = smem_desc(sK, 16, 1024);

        mbar_wait(q_full, 0);
        for (int tile = 0; tile < n_tiles; ++tile) {
            // Wait for the key tile; zero its V rows past the split (the cache may hold NaN there).
            const int stage = tile % kStages;
            unsigned char* sKt = sK + stage * kTileBytes;
            mbar_wait(&full[stage], (tile / kStages) & 1);
            const int key0 = key_begin + tile * kBN;
            const int valid = key_end - key0;
            if (valid < kBN) {
                for (int i = tid; i < (kBN - valid) * 8 * (kChunks - 1); i += 128) {
                    const int unit = i & 7, chunk = (i >> 3) % (kChunks - 1), r = valid + (i >> 3) / (kChunks - 1);
                    *reinterpret_cast<uint4*>(sKt + chunk * kChunkBytes + r * 128 + unit * 16) = make_uint4(0, 0, 0, 0);
                }
                fence_proxy_async();
                named_bar_sync(kBarWg0, 128);
            }
            // Scores: s[4j + 2h + e] = row r_lo + 8h, key 8j + 2 t4 + e; 64 x 64 over 576 dims, 36 k-steps.
            float s[32];
#pragma unroll
            for (int i = 0; i < 32; ++i) s[i] = 0.f;
            fence_operands(s);
            fence_operands(o);
            wgmma_fence();
            const uint32_t stage_off = (stage * kTileBytes) >> 4;
#pragma unroll
            for (int ks = 0; ks < kD / 16; ++ks) {
                const uint32_t off = ((ks / 4) * kChunkBytes + (ks % 4) * 32) >> 4;
                wgmma_scores(s, q_desc + off, k_desc + stage_off + off, ks > 0);
            }
            wgmma_commit();
            wgmma_wait_all();
            fence_operands(s);
            fence_operands(o);

            // Scale into the log2 domain; mask keys past the split and hidden tree keys.
            const bool masked_tile = key0 + kBN > context || valid < kBN;
#pragma unroll
            for (int i = 0; i < 32; ++i) {
                float x = s[i] * p.scale_log2;
                if (masked_tile) {
                    const int key = key0 + 8 * (i >> 2) + 2 * t4 + (i & 1);
                    const int h = (i >> 1) & 1;
                    const bool visible = key < key_end && (!row_ok[h] || key_visible(p, vis_token[h], key, context));
                    x = visible ? x : -CUDART_INF_F;
                }
                s[i] = x;
            }
            float alpha[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float mx = -CUDART_INF_F;
#pragma unroll
                for (int j = 0; j < 8; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float m_new = fmaxf(m_row[h], mx);
                const float m_use = m_new == -CUDART_INF_F ? 0.f : m_new;
                alpha[h] = exp2f(m_row[h] - m_use);
                m_row[h] = m_new;
                float sum = 0.f;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    s[4 * j + 2 * h] = exp2f(s[4 * j + 2 * h] - m_use);
                    s[4 * j + 2 * h + 1] = exp2f(s[4 * j + 2 * h + 1] - m_use);
                    sum += s[4 * j + 2 * h] + s[4 * j + 2 * h + 1];
                }
                l_row[h] = l_row[h] * alpha[h] + sum;
            }
            // P as bf16 into shared memory (K-major, swizzled), once warpgroup 1 is done with the last.
            if (tile > 0) mbar_wait(p_free, (tile - 1) & 1);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    *reinterpret_cast<uint32_t*>(sP + (r_lo + 8 * h) * 128 + ((j ^ g) << 4) + 4 * t4) =
                        pack_bf16(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]);
            }
            if (t4 == 0) {
                sAlpha[r_lo] = alpha[0];
                sAlpha[r_lo + 8] = alpha[1];
            }
            fence_proxy_async();
            mbar_arrive(p_ready);

            rescale_o(alpha);
            named_bar_sync(kBarWg0, 128);  // P V reads the other warps' rows of P too
            accumulate_pv(tile);
            if (lane == 0) mbar_arrive(&empty[stage]);
        }

#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float l = l_row[h];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            inv_l[h] = l > 0.f ? 1.f / l : 0.f;
            if (t4 == 0) {
                sInvL[r_lo + 8 * h] = inv_l[h];
                if (row_ok[h]) store_lse(p, split, grow0 + r_lo + 8 * h, row_lse(m_row[h], l));
            }
        }
        mbar_arrive(l_ready);
    } else {
        for (int tile = 0; tile < n_tiles; ++tile) {
            const int stage = tile % kStages;
            const bool refill = producer && tile + kStages < n_tiles;
            int y[kMaxBoxes];  // the refill's rows, looked up before the P V: block-table reads overlap it
            if (refill) key_tile_rows<kPaged>(y, p, b, base, key_begin + (tile + kStages) * kBN, key_end - 1, box);
            mbar_wait(p_ready, tile & 1);
            const float alpha[2] = {sAlpha[r_lo], sAlpha[r_lo + 8]};
            rescale_o(alpha);
            accumulate_pv(tile);
            if (tile + 1 < n_tiles) mbar_arrive(p_free);
            __syncwarp();
            if (lane == 0) mbar_arrive(&empty[stage]);
            if (refill) {
                mbar_wait(&empty[stage], (tile / kStages) & 1);
                tma_load_keys(sK + stage * kTileBytes, &maps.c_kv, &maps.k_pe, &full[stage], y, box);
            }
            __syncwarp();
        }
        mbar_wait(l_ready, 0);
        inv_l[0] = sInvL[r_lo];
        inv_l[1] = sInvL[r_lo + 8];
    }

    // o[4j + 2h + e]: row r_lo + 8h, column 256 wg + 8j + 2 t4 + e.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if (!row_ok[h]) continue;
        const int row = grow0 + r_lo + 8 * h;
#pragma unroll
        for (int j = 0; j < 32; ++j)
            store_pair<TOut>(p, split, row, 256 * wg + 8 * j + 2 * t4, o[4 * j + 2 * h] * inv_l[h],
                             o[4 * j + 2 * h + 1] * inv_l[h]);
    }
#else
    __trap();  // never launched: the host launches this kernel only where sm_90a code runs
#endif
}

// ------------------------------------------------------------------ split combine

constexpr int kMaxSplits = 128;
constexpr int kCombineThreads = 128;

// Block = one query row: the first warp turns the splits' lse into weights exp(lse_i - max)
// (non-empty splits only) and writes lse = max + log(sum_i w_i); then each thread merges its
// columns, o = sum_i w_i o_i / sum_i w_i, reading the splits' partial rows coalesced.
template <typename TOut>
__global__ void __launch_bounds__(kCombineThreads) mla_combine(MlaParams p) {
    __shared__ float weights[kMaxSplits];
    __shared__ float inv_total;
    const int b = blockIdx.y, local_row = blockIdx.x;
    const int tree = p.tree[b];
    if (local_row >= tree * p.heads) return;
    const int kv_len = p.context[b] + tree;
    const int n_splits = min(p.num_splits, (kv_len + p.split_keys - 1) / p.split_keys);
    const int row = p.q_offsets[b] * p.heads + local_row;
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        float mx = -CUDART_INF_F;
        for (int i = lane; i < n_splits; i += 32) mx = fmaxf(mx, p.part_lse[(size_t)i * p.total_rows + row]);
        for (int mask = 16; mask > 0; mask >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, mask));
        float total = 0.f;
        for (int i = lane; i < n_splits; i += 32) {
            const float w = mx == -CUDART_INF_F ? 0.f : __expf(p.part_lse[(size_t)i * p.total_rows + row] - mx);
            weights[i] = w;
            total += w;
        }
        for (int mask = 16; mask > 0; mask >>= 1) total += __shfl_xor_sync(0xffffffffu, total, mask);
        if (lane == 0) {
            inv_total = total > 0.f ? 1.f / total : 0.f;
            p.lse[row] = total > 0.f ? mx + logf(total) : -CUDART_INF_F;
        }
    }
    __syncthreads();
    const float* part = p.part_o + (size_t)row * p.kv_lora;
    const size_t split_stride = (size_t)p.total_rows * p.kv_lora;
    TOut* out = static_cast<TOut*>(p.o_lat) + (size_t)row * p.kv_lora;
    for (int c = threadIdx.x; c < p.kv_lora; c += kCombineThreads) {
        float acc = 0.f;
#pragma unroll 8
        for (int i = 0; i < n_splits; ++i) acc += weights[i] * part[i * split_stride + c];
        out[c] = from_float<TOut>(acc * inv_total);
    }
}

// cuTensorMapEncodeTiled from the driver (no link-time dependency on libcuda).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
    static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult found;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
                cudaSuccess ||
            found != cudaDriverEntryPointSuccess)
            fn = nullptr;
        return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
    }();
    return encode;
}

// A bf16 [rows, dims] row-major tensor as boxes of box_rows rows x 64 dims with the 128-byte swizzle.
bool encode_rows(CUtensorMap* map, const void* base, int dims, long long rows, int box_rows) {
    const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
    if (!encode) return false;
    const cuuint64_t size[2] = {(cuuint64_t)dims, (cuuint64_t)rows};
    const cuuint64_t stride[1] = {(cuuint64_t)dims * sizeof(bf16)};
    const cuuint32_t box[2] = {k2::kChunkDims, (cuuint32_t)box_rows}, step[2] = {1, 1};
    return encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), size, stride, box, step,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Whether the current device runs this library's sm_90a code: the library carries it
// (KDTREE_SM90A, set by build.py) and the device has compute capability 9.0 (H100, H200).
bool runs_sm90a() {
#ifdef KDTREE_SM90A
    int device = 0, major = 0, minor = 0;
    return cudaGetDevice(&device) == cudaSuccess &&
           cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
           cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess &&
           major == 9 && minor == 0;
#else
    return false;
#endif
}

// Whether the tensor-core path reads this layout: contiguous, or pages of a multiple of 64
// slots, or of 8, 16 or 32 slots (whole boxes of at least one swizzle period per page).
bool tensor_core_layout(const MlaParams& p) {
    return !p.block_table || p.page_size % 64 == 0 || (64 % p.page_size == 0 && p.page_size >= k2::kMinBox);
}

template <typename TOut>
int launch(const MlaParams& p, int batch, int max_tree, long long cache_rows, int in_dtype, bool generic,
           cudaStream_t stream) {
    const long long max_rows = (long long)max_tree * p.heads;
    const bool k2_fast = !generic && in_dtype == kBFloat16 && p.kv_lora == k2::kR && p.rope_dim == k2::kDr &&
                         tensor_core_layout(p) && runs_sm90a();
    if (k2_fast) {
        static_assert(k2::kSmemBytes <= 227 * 1024, "K2 tiles do not fit in shared memory");
        if (p.block_table && p.split_keys % key_box(p) != 0) return KDTREE_BAD_SHAPE;  // a box would cross a page
        K2Maps maps;
        if (!encode_rows(&maps.q_lat, p.q_lat, k2::kR, p.total_rows, 64) ||
            !encode_rows(&maps.q_pe, p.q_pe, k2::kDr, p.total_rows, 64) ||
            !encode_rows(&maps.c_kv, p.c_kv, k2::kR, cache_rows, key_box(p)) ||
            !encode_rows(&maps.k_pe, p.k_pe, k2::kDr, cache_rows, key_box(p)))
            return KDTREE_BAD_TENSOR_MAP;
        // Two instances: the contiguous one has no block-table code at all (measured: the table's
        // per-tile lookups in the shared instance cost 20-27% of the contiguous kernel's time).
        const auto kernel = p.block_table ? mla_k2_wgmma<TOut, true> : mla_k2_wgmma<TOut, false>;
        const cudaError_t err =
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)k2::kSmemBytes);
        if (err != cudaSuccess) return (int)err;
        const dim3 grid((unsigned)((max_rows + k2::kBM - 1) / k2::kBM), p.num_splits, batch);
        kernel<<<grid, k2::kThreads, k2::kSmemBytes, stream>>>(p, maps);
    } else {
        const size_t smem = (size_t)kGenericWarps * (2 * p.kv_lora + p.rope_dim) * sizeof(float);
        if (smem > 48 * 1024) return KDTREE_BAD_LIMIT;
        const dim3 grid((unsigned)((max_rows + kGenericWarps - 1) / kGenericWarps), p.num_splits, batch);
        if (in_dtype == kBFloat16) mla_generic<bf16, TOut><<<grid, kGenericWarps * 32, smem, stream>>>(p);
        else mla_generic<float, TOut><<<grid, kGenericWarps * 32, smem, stream>>>(p);
    }
    int status = kdtree_launch_status();
    if (status != 0 || p.num_splits == 1) return status;
    mla_combine<TOut><<<dim3((unsigned)max_rows, batch), kCombineThreads, 0, stream>>>(p);
    return kdtree_launch_status();
}

}  // namespace

// 1 when bf16 inputs at K2 dims take the tensor-core path on the current device (this library
// carries sm_90a code and the device has compute capability 9.0), else 0.
KDTREE_API int kdtree_mla_tensor_cores() { return runs_sm90a() ? 1 : 0; }

// Tree-verify MLA attention (see the top of this file). in_dtype / out_dtype: 0 float32,
// 1 bfloat16 (q_lat, q_pe, c_kv, k_pe share in_dtype). cache_rows: the rows of c_kv and k_pe
// (P * page_size for pools). Keys: kv_offsets (contiguous; block_table null) or block_table
// [batch, table_stride] with page_size >= 1 (paged; kv_offsets unused); a paged tensor-core
// launch needs split_keys to be a multiple of min(page_size, 64).
// num_splits * split_keys must cover every request's keys; split_keys is a multiple of 32;
// with num_splits > 1, part_o [num_splits, T * H, kv_lora] and part_lse [num_splits, T * H]
// float32 are scratch. generic != 0 forces the CUDA-core path (for comparisons); otherwise
// bf16 at K2 dims takes the tensor-core path, whose TMA needs 16-byte aligned pointers.
// Grid: one block per 64 (tensor-core) or 4 (generic) rows of the longest tree, per split,
// per request.
KDTREE_API int kdtree_mla_verify(const void* q_lat, const void* q_pe, const void* c_kv, const void* k_pe,
                                 const int32_t* context, const int32_t* tree_sizes, const int32_t* q_offsets,
                                 const int32_t* kv_offsets, const int32_t* block_table, int table_stride,
                                 int page_size, const uint32_t* visibility, int vis_words, void* o_lat,
                                 float* lse, float* part_o, float* part_lse, int batch, int total_tokens,
                                 long long cache_rows, int heads, int kv_lora, int rope_dim, int max_tree,
                                 int num_splits, int split_keys, float scale, int in_dtype, int out_dtype, int generic,
                                 cudaStream_t stream) {
    if (!q_lat || !q_pe || !c_kv || !k_pe || !context || !tree_sizes || !q_offsets || !(kv_offsets || block_table) ||
        !visibility || !o_lat || !lse)
        return KDTREE_BAD_POINTER;
    if (block_table && (table_stride <= 0 || page_size <= 0)) return KDTREE_BAD_SHAPE;
    if (num_splits > 1 && (!part_o || !part_lse)) return KDTREE_BAD_POINTER;
    if (batch <= 0 || total_tokens <= 0 || cache_rows <= 0 || heads <= 0 || kv_lora <= 0 || rope_dim <= 0 ||
        max_tree <= 0 || num_splits <= 0 || split_keys <= 0 || split_keys % 32 != 0 || vis_words <= 0 ||
        vis_words * 32 < max_tree)
        return KDTREE_BAD_SHAPE;
    if ((in_dtype != kFloat32 && in_dtype != kBFloat16) || (out_dtype != kFloat32 && out_dtype != kBFloat16))
        return KDTREE_BAD_SHAPE;
    if (batch > 65535 || num_splits > kMaxSplits || (long long)total_tokens * heads > (1LL << 31) - 1 ||
        (long long)max_tree * heads > (1LL << 31) - 1 || cache_rows > (1LL << 31) - 1)
        return KDTREE_BAD_LIMIT;
    MlaParams p;
    p.q_lat = q_lat; p.q_pe = q_pe; p.c_kv = c_kv; p.k_pe = k_pe;
    p.context = context; p.tree = tree_sizes; p.q_offsets = q_offsets; p.kv_offsets = kv_offsets;
    p.block_table = block_table; p.table_stride = block_table ? table_stride : 0; p.page_size = block_table ? page_size : 0;
    p.visibility = visibility; p.vis_words = vis_words;
    p.o_lat = o_lat; p.lse = lse; p.part_o = part_o; p.part_lse = part_lse;
    p.heads = heads; p.kv_lora = kv_lora; p.rope_dim = rope_dim;
    p.total_rows = total_tokens * heads;
    p.num_splits = num_splits; p.split_keys = split_keys;
    p.scale_log2 = scale * 1.44269504088896341f;
    return out_dtype == kBFloat16
               ? launch<bf16>(p, batch, max_tree, cache_rows, in_dtype, generic != 0, stream)
               : launch<float>(p, batch, max_tree, cache_rows, in_dtype, generic != 0, stream);
}

// Shared by the two Hopper tree-verify MLA kernels at K2 dims (sm_90a code only; the math is at
// the top of mla_verify.cu): their tile geometry, the TMA tensor maps of the four operands, and
// the device helpers for mbarriers, TMA loads, shared-memory descriptors and wgmma.
//
//   mla_wgmma.cu        one warpgroup scores every key tile (splits of a few tiles: decode)
//   mla_wgmma_pairs.cu  the two warpgroups score alternate tiles (longer splits)
//
// A 64-key tile (tiles start at request slots that are multiples of the box height) is one TMA
// box per 64-dim chunk in the contiguous layout or with pages of a multiple of 64 slots, and
// 64 / page_size boxes of page_size rows per chunk with pages of 8, 16 or 32 slots; other page
// sizes take the mma.sync kernel (mla_mma.cu).
#pragma once

#include "mla_common.cuh"

#include <cuda.h>
#include <cudaTypedefs.h>

#include <type_traits>

namespace kdtree_mla {

// The four operands as TMA tensor maps: rows of 64-dim chunks, 128-byte swizzle; boxes of 64
// rows, or of page_size rows for the keys of pages smaller than 64 slots (key_box).
struct K2Maps {
    CUtensorMap q_lat;  // [T * H rows, 512]
    CUtensorMap q_pe;   // [T * H rows, 64]
    CUtensorMap c_kv;   // [S rows, 512]
    CUtensorMap k_pe;   // [S rows, 64]
};

// The seesaw kernel (mla_wgmma_pairs.cu): launched by launch_wgmma with the maps encoded.
int launch_wgmma_pairs(const MlaParams& p, const K2Maps& maps, dim3 grid, bool out_bf16, cudaStream_t stream);

namespace {
namespace k2 {
constexpr int kR = 512, kDr = 64, kD = kR + kDr;  // latent, rope, score dims
constexpr int kBM = 64;                   // query rows per block (one wgmma M)
constexpr int kBN = 64;                   // keys per tile
constexpr int kChunkDims = 64;            // dims per 128-byte swizzled row
constexpr int kChunks = kD / kChunkDims;  // 9: 8 of c_kv / q_lat, 1 of k_pe / q_pe
constexpr int kRopeChunk = kChunks - 1;   // k_pe's chunk of a key tile
constexpr int kChunkBytes = 64 * 128;     // one [64 rows][64 dims] bf16 chunk
constexpr int kTileBytes = kChunks * kChunkBytes;  // a Q tile or a key tile: 72 KB
constexpr int kMinBox = 8;                // key rows per TMA box at least: one 1024-byte swizzle period
constexpr int kMaxBoxes = kBN / kMinBox;  // TMA boxes per chunk of a key tile at most
constexpr int kThreads = 256;             // two warpgroups
template <int N> using C = std::integral_constant<int, N>;  // a chunk index as a type
}  // namespace k2

// Key rows per TMA box: 64, or a page when pages are smaller (8, 16 or 32 slots on the
// tensor-core path), so that no box crosses a page.
__host__ __device__ __forceinline__ int key_box(const MlaParams& p) {
    return p.block_table && p.page_size < 64 ? p.page_size : 64;
}

// One instance of a K2 kernel (TOut, kPaged) on the grid, with smem_bytes of dynamic shared
// memory (beyond 48 KB: the attribute is set first). 0, or a cudaError_t.
template <typename Kernel>
int launch_k2(Kernel kernel, size_t smem_bytes, dim3 grid, const MlaParams& p, const K2Maps& maps,
              cudaStream_t stream) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_bytes);
    if (err != cudaSuccess) return (int)err;
    kernel<<<grid, k2::kThreads, smem_bytes, stream>>>(p, maps);
    return kdtree_launch_status();
}

// A block's work (grid: row tiles, splits, requests): rows row0 .. row0 + 63 of request b's tree
// (row = token * heads + head; global row grow0 + r) against key split `split`, request slots
// [key_begin, key_end) of its context + tree in n_tiles tiles of 64 keys; the keys' TMA box
// height, and the request's first cache row `base` when the keys are contiguous.
struct K2Block {
    int b, split, context, rows, row0, key_begin, key_end, n_tiles, grow0, box, base;

    // This block's work; false (the block returns at once) when it has no rows or no keys.
    template <bool kPaged>
    __device__ __forceinline__ bool take(const MlaParams& p) {
        b = blockIdx.z;
        split = blockIdx.y;
        const int tree = p.tree[b];
        context = p.context[b];
        rows = tree * p.heads;
        row0 = blockIdx.x * k2::kBM;
        const int kv_len = context + tree;
        key_begin = split * p.split_keys;
        if (row0 >= rows || key_begin >= kv_len) return false;
        key_end = min(kv_len, key_begin + p.split_keys);
        n_tiles = (key_end - key_begin + k2::kBN - 1) / k2::kBN;
        grow0 = p.q_offsets[b] * p.heads + row0;
        box = kPaged ? key_box(p) : 64;  // compile-time when contiguous
        base = kPaged ? 0 : p.kv_offsets[b];
        return true;
    }
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // Hopper-only instructions: sm_90a code

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
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
// The first slot of box `j` of a key tile at slots key0 .. key0 + 63 (box rows; key0 is a
// multiple of box when paged): key0 + j box, or, for a box whose first slot lies past `last`
// (the split's last key), the box holding `last`: a row the table maps, whose contents are
// zeroed or masked before use.
__device__ __forceinline__ int key_box_slot(int key0, int last, int box, int j) {
    const int s = key0 + j * box;
    return s <= last ? s : key0 + (last - key0) / box * box;
}
// cache_row of a paged request's slot s, its table entry read where this is called: a plain
// load that the compiler sinks to its first use stalls the loading warp there.
__device__ __forceinline__ int cache_row_now(const MlaParams& p, int b, int s) {
    int page;
    asm volatile("ld.global.nc.b32 %0, [%1];\n"
                 : "=r"(page) : "l"(p.block_table + (size_t)b * p.table_stride + s / p.page_size));
    return page * p.page_size + s % p.page_size;
}
// Box j (rows j box .. j box + box - 1, a multiple of 8: 1024-byte aligned, the swizzle's
// period) of chunks [first, last) of a key tile, from cache row `row`, each chunk completing on
// its own barrier, which expects the whole chunk: the 64 / box boxes of a tile add up to it.
__device__ __forceinline__ void tma_load_key_box(unsigned char* tile, const CUtensorMap* lat, const CUtensorMap* pe,
                                                 uint64_t* bars, int first, int last, int row, int j, int box) {
    for (int c = first; c < last; ++c) {
        const bool rope = c == k2::kRopeChunk;
        tma_load(tile + c * k2::kChunkBytes + j * box * 128, rope ? pe : lat, &bars[c], rope ? 0 : c * k2::kChunkDims,
                 row);
    }
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
// Wait until at most N committed groups of this warpgroup's wgmma are pending.
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keep the compiler from moving accesses of wgmma operands across the asynchronous window.
template <int N> __device__ __forceinline__ void fence_operands(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int N> __device__ __forceinline__ void fence_operands(uint32_t (&a)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(a[i])::"memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}

// A packed pair of bf16 times a, rounded back to bf16.
__device__ __forceinline__ uint32_t scale_bf16x2(uint32_t x, float a) {
    const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x));
    return pack_bf16(f.x * a, f.y * a);
}

// The online softmax of a thread's row h (0, 1) of a score tile s, the m64n64 accumulator: s[4j + 2h + e]
// is row r_lo + 8h, the quad's four threads holding the row's 64 scores; maxima and sums in the log2
// domain. The row's unscaled max over the tile, across the quad.
__device__ __forceinline__ float row_max(const float (&s)[32], int h) {
    float mx = -CUDART_INF_F;
#pragma unroll
    for (int j = 0; j < 8; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    return fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
}
// The row's new running max from the old one and the tile's unscaled max mx (a positive scale keeps
// the max), the value to subtract (0 while the row has no visible key), and alpha = exp2(m_old - m_new).
struct RowMax {
    float m_new, m_use, alpha;
};
__device__ __forceinline__ RowMax new_max(float m_old, float mx, float scale_log2) {
    const float m_new = fmaxf(m_old, mx * scale_log2);
    const float m_use = m_new == -CUDART_INF_F ? 0.f : m_new;
    return {m_new, m_use, exp2_approx(m_old - m_use)};
}
// Row h of s := exp2(s scale_log2 - m) (m finite); -> this thread's part of the row's sum.
__device__ __forceinline__ float exponentiate(float (&s)[32], int h, float scale_log2, float m) {
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        s[4 * j + 2 * h] = exp2_approx(fmaf(s[4 * j + 2 * h], scale_log2, -m));
        s[4 * j + 2 * h + 1] = exp2_approx(fmaf(s[4 * j + 2 * h + 1], scale_log2, -m));
        sum += s[4 * j + 2 * h] + s[4 * j + 2 * h + 1];
    }
    return sum;
}

// O *= alpha per row (o: a warpgroup's [64 x 256] accumulator, this thread's rows r_lo and
// r_lo + 8 by alpha[0] and alpha[1]), skipped when no row's factor differs from 1 (x * 1 == x:
// exact).
__device__ __forceinline__ void rescale_o(float (&o)[128], const float (&alpha)[2]) {
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
        for (int i = 0; i < 128; ++i) o[i] *= alpha[(i >> 1) & 1];
    }
}
// O / l of this thread's rows to the output (or split `split`'s partials): o[4j + 2h + e] is row
// r_lo + 8h of the block (global row grow0 + r_lo + 8h), column 256 wg + 8j + 2 t4 + e.
template <typename TOut>
__device__ __forceinline__ void store_o(const MlaParams& p, int split, int grow0, int r_lo, int wg, int t4,
                                        const bool (&row_ok)[2], const float (&o)[128], const float (&inv_l)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if (!row_ok[h]) continue;
        const int row = grow0 + r_lo + 8 * h;
#pragma unroll
        for (int j = 0; j < 32; ++j)
            store_pair<TOut>(p, split, row, 256 * wg + 8 * j + 2 * t4, o[4 * j + 2 * h] * inv_l[h],
                             o[4 * j + 2 * h + 1] * inv_l[h]);
    }
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
// o[64 x 256] += P[64 x 16] V[16 x 256]: P from registers (a0..a3: the k16 slice of the scores'
// accumulator layout, packed to bf16), V MN-major in shared memory.
__device__ __forceinline__ void wgmma_pv_rs(float (&d)[128], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                            uint64_t v) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
        : KDTREE_F8(0), KDTREE_F8(8), KDTREE_F8(16), KDTREE_F8(24), KDTREE_F8(32), KDTREE_F8(40), KDTREE_F8(48), KDTREE_F8(56),
          KDTREE_F8(64), KDTREE_F8(72), KDTREE_F8(80), KDTREE_F8(88), KDTREE_F8(96), KDTREE_F8(104), KDTREE_F8(112), KDTREE_F8(120)
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(v), "r"(1));
}

// Issue s (+)= Q K^T over chunks kFirst .. kLast - 1 of a key tile (k: its descriptor), one
// commit group a chunk, each as soon as its chunk lands on its barrier (bars null: no wait, for
// a product whose result goes unused); `zero` starts the sum. The chunks are compile-time and
// each descriptor is added where its wgmma issues: a loop at run time, or descriptors hoisted
// into registers (72 of them), make ptxas serialize or spill.
template <int kFirst, int kLast>
__device__ __forceinline__ void score_chunks(float (&s)[32], uint64_t q, uint64_t k, uint64_t* bars, uint32_t parity,
                                             bool zero) {
#pragma unroll
    for (int c = kFirst; c < kLast; ++c) {
        if (bars) mbar_wait(&bars[c], parity);
        fence_operands(s);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            const uint64_t off = (c * k2::kChunkBytes + kk * 32) >> 4;
            uint64_t q_at, k_at;
            asm volatile("add.s64 %0, %2, %4;\nadd.s64 %1, %3, %4;\n" : "=l"(q_at), "=l"(k_at) : "l"(q), "l"(k), "l"(off));
            wgmma_scores(s, q_at, k_at, !(zero && c == kFirst && kk == 0));
        }
        wgmma_commit();
    }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace
}  // namespace kdtree_mla

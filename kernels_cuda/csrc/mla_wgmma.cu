// Tree-verify MLA attention at K2 dims on Hopper, one warpgroup scoring every key tile (the
// helpers and tile geometry are in mla_wgmma.cuh), and the host side of both Hopper kernels:
// tensor maps, and which kernel a launch takes (launch_wgmma).

#include "mla_wgmma.cuh"

namespace kdtree_mla {
namespace {
namespace single {
using namespace k2;
constexpr int kStages = 2;  // key tiles in flight
// Shared memory, from a 1024-byte aligned base (the 128-byte swizzle repeats every 1024 bytes).
constexpr int kOffQ = 0;
constexpr int kOffK = kOffQ + kTileBytes;                 // [kStages] key tiles
constexpr int kOffP = kOffK + kStages * kTileBytes;       // P [64 rows][64 keys], one chunk
constexpr int kOffAlpha = kOffP + kChunkBytes;            // [64] float: this tile's O rescale
constexpr int kOffInvL = kOffAlpha + kBM * 4;             // [64] float: final 1 / l
constexpr int kOffBars = kOffInvL + kBM * 4;              // mbarriers (see the kernel)
constexpr int kBars = 1 + 2 * kStages + 3;
constexpr size_t kSmemBytes = kOffBars + kBars * 8 + 1024;
[[maybe_unused]] constexpr int kBarWg0 = 1;  // named barrier of warpgroup 0 alone (0 is __syncthreads)
}  // namespace single

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The cache rows of the boxes of request b's key tile at slots key0 .. key0 + 63
// (key_box_slot): contiguous, base + key0 (base = kv_offsets[b], one box of 64); paged, from
// the block table.
template <bool kPaged>
__device__ __forceinline__ void key_tile_rows(int (&y)[k2::kMaxBoxes], const MlaParams& p, int b, int base, int key0,
                                              int last, int box) {
    if constexpr (!kPaged) {
        y[0] = base + key0;
        return;
    }
#pragma unroll
    for (int j = 0; j < k2::kMaxBoxes; ++j)
        if (j * box < k2::kBN) y[j] = cache_row(p, b, key_box_slot(key0, last, box, j));
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
    using namespace single;
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

    K2Block blk{};
    if (!blk.take<kPaged>(p)) return;
    const int b = blk.b, split = blk.split, context = blk.context, rows = blk.rows, row0 = blk.row0;
    const int key_begin = blk.key_begin, key_end = blk.key_end, n_tiles = blk.n_tiles, grow0 = blk.grow0;
    const int box = blk.box, base = blk.base;

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
        wgmma_wait<0>();
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
            wgmma_wait<0>();
            fence_operands(s);
            fence_operands(o);

            // Mask keys past the split and hidden tree keys, one branch a tile (a test per score
            // costs the unmasked tiles their rate); the softmax scales the scores (the scale is
            // positive: a row's max is its unscaled max times the scale).
            if (key0 + kBN > context || valid < kBN) {
#pragma unroll
                for (int i = 0; i < 32; ++i) {
                    const int key = key0 + 8 * (i >> 2) + 2 * t4 + (i & 1);
                    const int h = (i >> 1) & 1;
                    const bool visible = key < key_end && (!row_ok[h] || key_visible(p, vis_token[h], key, context));
                    s[i] = visible ? s[i] : -CUDART_INF_F;
                }
            }
            float alpha[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const RowMax m = new_max(m_row[h], row_max(s, h), p.scale_log2);
                alpha[h] = m.alpha;
                m_row[h] = m.m_new;
                const float sum = exponentiate(s, h, p.scale_log2, m.m_use);
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

            rescale_o(o, alpha);
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
            rescale_o(o, alpha);
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

    store_o<TOut>(p, split, grow0, r_lo, wg, t4, row_ok, o, inv_l);
#else
    __trap();  // never launched: the host launches this kernel only where sm_90a code runs
#endif
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

}  // namespace

// Whether this library carries sm_90a code (the wgmma kernels).
bool wgmma_built() {
#ifdef KDTREE_SM90A
    return true;
#else
    return false;
#endif
}

// Contiguous, or pages of a multiple of 64 slots, or of 8, 16 or 32 slots (whole boxes of at
// least one swizzle period per page).
bool wgmma_layout(const MlaParams& p) {
    return !p.block_table || p.page_size % 64 == 0 || (64 % p.page_size == 0 && p.page_size >= k2::kMinBox);
}

int launch_wgmma(const MlaParams& p, dim3 grid, long long cache_rows, bool out_bf16, bool pairs, cudaStream_t stream) {
    static_assert(single::kSmemBytes <= 227 * 1024, "K2 tiles do not fit in shared memory");
    if (p.block_table && p.split_keys % key_box(p) != 0) return KDTREE_BAD_SHAPE;  // a box would cross a page
    K2Maps maps;
    if (!encode_rows(&maps.q_lat, p.q_lat, k2::kR, p.total_rows, 64) ||
        !encode_rows(&maps.q_pe, p.q_pe, k2::kDr, p.total_rows, 64) ||
        !encode_rows(&maps.c_kv, p.c_kv, k2::kR, cache_rows, key_box(p)) ||
        !encode_rows(&maps.k_pe, p.k_pe, k2::kDr, cache_rows, key_box(p)))
        return KDTREE_BAD_TENSOR_MAP;
    if (pairs) return launch_wgmma_pairs(p, maps, grid, out_bf16, stream);
    // Two instances per output type: the contiguous one has no block-table code at all
    // (measured: the table's per-tile lookups in a shared instance cost the contiguous kernel 20-27%).
    const auto kernel = out_bf16 ? (p.block_table ? mla_k2_wgmma<bf16, true> : mla_k2_wgmma<bf16, false>)
                                 : (p.block_table ? mla_k2_wgmma<float, true> : mla_k2_wgmma<float, false>);
    return launch_k2(kernel, single::kSmemBytes, grid, p, maps, stream);
}

}  // namespace kdtree_mla

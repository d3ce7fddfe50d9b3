// Tree-verify MLA attention at K2 dims on mma.sync (compute capability 8.0 and later: A100,
// L40S, RTX 30xx / 40xx / 50xx, B200 through the PTX, and Hopper built without sm_90a): the
// FlashAttention-2 design in the kernel's absorbed layout (576-wide keys, 512-wide values, the
// same c_kv rows as both). The math is at the top of mla_verify.cu.
//
// Block = 64 query rows x one key split of one request; 8 warps in two groups of 4. Group g
// takes rows 32g .. 32g + 31 and synchronises only within itself (named barriers of 128
// threads): the groups share nothing but the ring of key tiles. Per tile of kKeys keys, in
// each group:
// - scores: warp d keeps its rows' Q over dims 128d .. 128d + 127 of the latent and
//   16d .. 16d + 15 of the rope in registers (72, loaded once) and computes partial scores
//   over those 144 dims (m16n8k16, K fragments by ldmatrix); the four partials meet in shared
//   memory;
// - softmax: warp d owns rows 8d .. 8d + 7 (one per thread quad), adds their four partials in
//   a fixed order (the same bits on every run), masks (two visibility words a row and tile),
//   updates the running max and sum, and writes P (bf16) and the O rescale factor;
// - P V: warp d accumulates output columns 128d .. 128d + 127 of the group's 32 rows (128
//   float32 registers), P and V (the tile read transposed, ldmatrix.trans) from shared memory.
// Keys stream in by cp.async into a ring of `stages` tiles, rows padded to 1168 bytes (ldmatrix
// without bank conflicts). Each group copies half of every tile and arrives on the tile's
// mbarrier when its copies land; at the end of tile t a group refills the stage of tile t - 1
// with tile t + stages - 1 once both groups are done with tile t - 1, so either group may run
// up to a tile ahead of the other. With 4 stages, group 1 starts once group 0 has its first
// scores, so that one group's barriers and softmax fall under the other's tensor work. Keys
// past the split's end are zero-filled by cp.async (the cache may hold NaN there) and masked.
//
// Two tile plans (`Tiles`): 32-key tiles for 160 KB of shared memory a block and more (sm_80,
// sm_90: 3 or 4 stages, 155 or 192 KB), 16-key tiles for 100 KB (sm_86, sm_89, sm_120: 3
// stages, 82 KB).

#include "mla_common.cuh"

namespace kdtree_mla {
namespace {

namespace mma_k2 {
constexpr int kR = kK2Lora, kDr = kK2Rope, kD = kR + kDr;
constexpr int kLd = kD + 8;            // bf16 per key row in shared memory: 1168 bytes, 16 apart mod 128
constexpr int kRowChunks = kD / 8;     // 16-byte chunks of a key row: 64 of c_kv, then 8 of k_pe
constexpr int kThreads = 256;          // two groups of 4 warps
constexpr int kGroupRows = kTileRows / 2;
constexpr int kDimSteps = 9;           // k-steps of 16 score dims per warp: 8 of the latent, 1 of the rope
constexpr int kCols = kR / 4;          // output columns per warp
constexpr int kBarStagger = 3;         // named barriers: 0 __syncthreads, 1 + g group g, this one
}  // namespace mma_k2

template <int kKeys_>
struct Tiles {
    static constexpr int kKeys = kKeys_;
    static constexpr int kPartLd = kKeys + 8;  // floats per row of a partial-score slice (float2 stores conflict-free)
    static constexpr int kPLd = kKeys + 8;     // bf16 per row of P (rows 16-byte aligned, ldmatrix conflict-free)
    static constexpr int kStageBytes = kKeys * mma_k2::kLd * 2;
    // After the ring of stages: per group, 4 partial-score slices [32 rows][kPartLd] float,
    // P [32 rows][kPLd] bf16, the rows' rescale factors and final 1 / l; then the mbarriers.
    static constexpr int kPartBytes = 2 * 4 * mma_k2::kGroupRows * kPartLd * 4;
    static constexpr int kPBytes = 2 * mma_k2::kGroupRows * kPLd * 2;
    static constexpr int kRowBytes = 2 * mma_k2::kGroupRows * 4;
    static constexpr size_t smem_bytes(int stages) {
        return (size_t)stages * kStageBytes + kPartBytes + kPBytes + 2 * kRowBytes + 2 * stages * 8;
    }
};
using BigTiles = Tiles<32>;
using SmallTiles = Tiles<16>;

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}
// One arrival on `bar` once every cp.async this thread issued so far has landed.
__device__ __forceinline__ void cp_async_arrive(uint64_t* bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
    asm volatile("mbarrier.init.shared.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
    asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared.b64 state, [%0];\n}\n" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
#if __CUDA_ARCH__ >= 900  // try_wait suspends the thread instead of spinning
    asm volatile(
        "{\n.reg .pred done;\nWAIT:\n"
        "mbarrier.try_wait.parity.shared.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n}\n" ::"r"(smem_u32(bar)), "r"(parity) : "memory");
#else
    asm volatile(
        "{\n.reg .pred done;\nWAIT:\n"
        "mbarrier.test_wait.parity.shared.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n}\n" ::"r"(smem_u32(bar)), "r"(parity) : "memory");
#endif
}
__device__ __forceinline__ void named_bar_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
// d[16 x 8] += a[16 x 16] b[16 x 8], bf16 operands, float32 accumulators (a pure function:
// the compiler may schedule it freely).
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The block above (the top of this file). Fragment layouts of m16n8k16: A regs (row g, k 2t4),
// (g + 8, 2t4), (g, 2t4 + 8), (g + 8, 2t4 + 8); B regs (k 2t4, n g), (k 2t4 + 8, n g);
// accumulators (g, 2t4 + e), (g + 8, 2t4 + e), with g = lane / 4, t4 = lane % 4.
template <typename TOut, bool kPaged, typename T>
__global__ void __launch_bounds__(mma_k2::kThreads, 1) mla_k2_mma(const __grid_constant__ MlaParams p, int stages) {
    using namespace mma_k2;
    constexpr int kKeys = T::kKeys;
    extern __shared__ __align__(16) unsigned char smem[];

    const int b = blockIdx.z, split = blockIdx.y;
    const int tree = p.tree[b], context = p.context[b];
    const int rows = tree * p.heads;
    const int row0 = blockIdx.x * kTileRows;
    const int kv_len = context + tree;
    const int key_begin = split * p.split_keys;
    if (row0 >= rows || key_begin >= kv_len) return;
    const int key_end = min(kv_len, key_begin + p.split_keys);
    const int n_tiles = (key_end - key_begin + kKeys - 1) / kKeys;
    const int qrow0 = p.q_offsets[b] * p.heads;  // global row of the request's row 0

    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int group_bar = 1 + wg;
    const int grow = row0 + kGroupRows * wg;  // request row of this group's row 0

    const uint32_t ring = smem_u32(smem);
    unsigned char* after_ring = smem + stages * T::kStageBytes;
    float* part = reinterpret_cast<float*>(after_ring) + wg * 4 * kGroupRows * T::kPartLd;  // [4][32][kPartLd]
    bf16* sP = reinterpret_cast<bf16*>(after_ring + T::kPartBytes) + wg * kGroupRows * T::kPLd;
    float* sAlpha = reinterpret_cast<float*>(after_ring + T::kPartBytes + T::kPBytes) + wg * kGroupRows;
    float* sInvL = reinterpret_cast<float*>(after_ring + T::kPartBytes + T::kPBytes + T::kRowBytes) + wg * kGroupRows;
    uint64_t* full = reinterpret_cast<uint64_t*>(after_ring + T::kPartBytes + T::kPBytes + 2 * T::kRowBytes);
    uint64_t* empty = full + stages;  // [stages]: all 8 warps are done with the tile

    if (tid == 0) {
        for (int s = 0; s < stages; ++s) {
            mbar_init(&full[s], kThreads);  // every thread's copies of the tile (cp_async_arrive)
            mbar_init(&empty[s], 8);
        }
    }
    __syncthreads();

    // Group wg copies rows wg * kKeys / 2 .. of each tile, kRowThreads threads a row.
    constexpr int kLoadRows = kKeys / 2, kRowThreads = 128 / kLoadRows;
    const int load_row = wg * kLoadRows + (tid & 127) / kRowThreads, load_chunk = tid % kRowThreads;
    const int base = kPaged ? 0 : p.kv_offsets[b];  // contiguous: the request's first cache row
    auto load_tile = [&](int tile) {
        const int slot = key_begin + tile * kKeys + load_row;
        const bool valid = slot < key_end;
        const int row = valid ? (kPaged ? cache_row(p, b, slot) : base + slot) : 0;
        const bf16* c = static_cast<const bf16*>(p.c_kv) + (size_t)row * kR;
        const bf16* k = static_cast<const bf16*>(p.k_pe) + (size_t)row * kDr;
        const uint32_t dst = ring + (tile % stages) * T::kStageBytes + load_row * kLd * 2;
#pragma unroll
        for (int i = 0; i < (kRowChunks + kRowThreads - 1) / kRowThreads; ++i) {
            const int chunk = load_chunk + i * kRowThreads;
            if (kRowChunks % kRowThreads == 0 || chunk < kRowChunks)
                cp_async16(dst + chunk * 16, chunk < kR / 8 ? c + chunk * 8 : k + (chunk - kR / 8) * 8, valid);
        }
        cp_async_arrive(&full[tile % stages]);
    };
    for (int t = 0; t < stages - 1 && t < n_tiles; ++t) load_tile(t);

    // Q: rows 16 rt + g + 8 h of the group, this warp's 144 dims, as A fragments (zero past the tree).
    uint32_t qf[2][kDimSteps][4];
#pragma unroll
    for (int rt = 0; rt < 2; ++rt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int local = grow + 16 * rt + g + 8 * h;
            const bool ok = local < rows;
            const size_t row = (size_t)qrow0 + (ok ? local : 0);
            const bf16* lat = static_cast<const bf16*>(p.q_lat) + row * kR + kCols * warp + 2 * t4;
            const bf16* pe = static_cast<const bf16*>(p.q_pe) + row * kDr + 16 * warp + 2 * t4;
#pragma unroll
            for (int ks = 0; ks < kDimSteps; ++ks) {
                const bf16* src = ks < kDimSteps - 1 ? lat + 16 * ks : pe;
                qf[rt][ks][h] = ok ? __ldg(reinterpret_cast<const unsigned int*>(src)) : 0u;
                qf[rt][ks][2 + h] = ok ? __ldg(reinterpret_cast<const unsigned int*>(src + 8)) : 0u;
            }
        }
    }

    // The row whose softmax this thread's quad owns (group row 8 warp + g).
    const int srow = 8 * warp + g;
    const bool srow_ok = grow + srow < rows;
    const int stoken = (qrow0 + (srow_ok ? grow + srow : 0)) / p.heads;
    float m_row = -CUDART_INF_F, l_row = 0.f;  // l_row: this thread's part of the row sum
    float o[2][kCols / 8][4];                  // rows 16 rt + g (+ 8), columns kCols warp + 8 n + 2 t4 (+ 1)
#pragma unroll
    for (int rt = 0; rt < 2; ++rt)
#pragma unroll
        for (int n = 0; n < kCols / 8; ++n) o[rt][n][0] = o[rt][n][1] = o[rt][n][2] = o[rt][n][3] = 0.f;

    // ldmatrix lane offsets (bytes): K rows as B (keys x dims), P as A, the tile transposed as V's B.
    const uint32_t k_lane = (((lane & 7) + ((lane >> 4) << 3)) * kLd + ((lane >> 3) & 1) * 8) * 2;
    const uint32_t v_lane = (((lane & 7) + ((lane >> 3) & 1) * 8) * kLd + kCols * warp + (lane >> 4) * 8) * 2;
    const uint32_t p_lane = smem_u32(sP) + ((lane & 15) * T::kPLd + (lane >> 4) * 8) * 2;

    const bool stagger = stages >= 4;
    if (stagger && wg == 1) named_bar_sync(kBarStagger, kThreads);
    for (int tile = 0; tile < n_tiles; ++tile) {
        const int stage = tile % stages;
        const uint32_t sK = ring + stage * T::kStageBytes;
        mbar_wait(&full[stage], (tile / stages) & 1);

        // Partial scores over this warp's dims, 16 keys at a time, into slice `warp` of part.
#pragma unroll
        for (int hf = 0; hf < kKeys / 16; ++hf) {
            float acc[2][2][4] = {};
#pragma unroll
            for (int ks = 0; ks < kDimSteps; ++ks) {
                const int dim = ks < kDimSteps - 1 ? kCols * warp + 16 * ks : kR + 16 * warp;
                uint32_t kb[4];
                ldmatrix_x4(kb, sK + k_lane + (16 * hf * kLd + dim) * 2);
#pragma unroll
                for (int rt = 0; rt < 2; ++rt) {
                    mma_bf16(acc[rt][0], qf[rt][ks], kb[0], kb[1]);
                    mma_bf16(acc[rt][1], qf[rt][ks], kb[2], kb[3]);
                }
            }
#pragma unroll
            for (int rt = 0; rt < 2; ++rt)
#pragma unroll
                for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                    for (int h = 0; h < 2; ++h)
                        *reinterpret_cast<float2*>(part + (warp * kGroupRows + 16 * rt + g + 8 * h) * T::kPartLd +
                                                   16 * hf + 8 * nt + 2 * t4) =
                            make_float2(acc[rt][nt][2 * h], acc[rt][nt][2 * h + 1]);
        }
        if (stagger && wg == 0 && tile == 0) named_bar_arrive(kBarStagger, kThreads);
        named_bar_sync(group_bar, 128);

        // Softmax of row srow: x[nt][e] = key 8 nt + 2 t4 + e of the tile, the four slices added in order.
        const int key0 = key_begin + tile * kKeys;
        const bool masked_tile = key0 + kKeys > context || key0 + kKeys > key_end;
        float x[kKeys / 8][2];
#pragma unroll
        for (int nt = 0; nt < kKeys / 8; ++nt) {
            const float* src = part + srow * T::kPartLd + 8 * nt + 2 * t4;
            float2 sum = *reinterpret_cast<const float2*>(src);
#pragma unroll
            for (int d = 1; d < 4; ++d) {
                const float2 v = *reinterpret_cast<const float2*>(src + d * kGroupRows * T::kPartLd);
                sum.x += v.x;
                sum.y += v.y;
            }
            x[nt][0] = sum.x * p.scale_log2;
            x[nt][1] = sum.y * p.scale_log2;
        }
        if (masked_tile) {
            // The row's visibility bits of tree tokens base .. base + 63, two words read once: the
            // tile's tree keys (kKeys <= 32 of them) lie among these. Rows past the tree see all.
            const int base = max(key0 - context, 0) & ~31;
            uint64_t bits = ~0ull;
            if (srow_ok) {
                const uint32_t* word = p.visibility + (size_t)stoken * p.vis_words + (base >> 5);
                bits = word[0] | ((base >> 5) + 1 < p.vis_words ? (uint64_t)word[1] << 32 : 0ull);
            }
#pragma unroll
            for (int nt = 0; nt < kKeys / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int key = key0 + 8 * nt + 2 * t4 + e;
                    const int j = key - context;  // tree token, or < 0: a context key
                    const bool visible = key < key_end && (j < 0 || ((bits >> ((j - base) & 63)) & 1));
                    x[nt][e] = visible ? x[nt][e] : -CUDART_INF_F;
                }
        }
        float mx = -CUDART_INF_F;
#pragma unroll
        for (int nt = 0; nt < kKeys / 8; ++nt) mx = fmaxf(mx, fmaxf(x[nt][0], x[nt][1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m_row, mx);
        const float m_use = m_new == -CUDART_INF_F ? 0.f : m_new;
        const float alpha = exp2_approx(m_row - m_use);
        m_row = m_new;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < kKeys / 8; ++nt) {
            x[nt][0] = exp2_approx(x[nt][0] - m_use);
            x[nt][1] = exp2_approx(x[nt][1] - m_use);
            sum += x[nt][0] + x[nt][1];
            *reinterpret_cast<uint32_t*>(sP + srow * T::kPLd + 8 * nt + 2 * t4) = pack_bf16(x[nt][0], x[nt][1]);
        }
        l_row = l_row * alpha + sum;
        if (t4 == 0) sAlpha[srow] = alpha;
        named_bar_sync(group_bar, 128);

        // O *= alpha per row (skipped when no row's max moved: x * 1 == x), then O += P V.
        float a[2][2];
#pragma unroll
        for (int rt = 0; rt < 2; ++rt) {
            a[rt][0] = sAlpha[16 * rt + g];
            a[rt][1] = sAlpha[16 * rt + g + 8];
        }
        if (__any_sync(0xffffffffu, a[0][0] != 1.f || a[0][1] != 1.f || a[1][0] != 1.f || a[1][1] != 1.f)) {
#pragma unroll
            for (int rt = 0; rt < 2; ++rt)
#pragma unroll
                for (int n = 0; n < kCols / 8; ++n) {
                    o[rt][n][0] *= a[rt][0];
                    o[rt][n][1] *= a[rt][0];
                    o[rt][n][2] *= a[rt][1];
                    o[rt][n][3] *= a[rt][1];
                }
        }
#pragma unroll
        for (int kk = 0; kk < kKeys / 16; ++kk) {
            uint32_t pa[2][4];
#pragma unroll
            for (int rt = 0; rt < 2; ++rt) ldmatrix_x4(pa[rt], p_lane + (16 * rt * T::kPLd + 16 * kk) * 2);
#pragma unroll
            for (int c = 0; c < kCols / 16; ++c) {
                uint32_t vb[4];
                ldmatrix_x4_trans(vb, sK + v_lane + (16 * kk * kLd + 16 * c) * 2);
#pragma unroll
                for (int rt = 0; rt < 2; ++rt) {
                    mma_bf16(o[rt][2 * c], pa[rt], vb[0], vb[1]);
                    mma_bf16(o[rt][2 * c + 1], pa[rt], vb[2], vb[3]);
                }
            }
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[stage]);

        // Refill the stage of tile - 1 with tile + stages - 1, once both groups are done with tile - 1.
        const int next = tile + stages - 1;
        if (next < n_tiles) {
            if (tile > 0) mbar_wait(&empty[(tile - 1) % stages], ((tile - 1) / stages) & 1);
            load_tile(next);
        }
    }

    // Row sums to 1 / l through shared memory (the owners), then the outputs.
    float l = l_row;
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (t4 == 0) {
        sInvL[srow] = l > 0.f ? 1.f / l : 0.f;
        if (srow_ok) store_lse(p, split, qrow0 + grow + srow, row_lse(m_row, l));
    }
    named_bar_sync(group_bar, 128);
#pragma unroll
    for (int rt = 0; rt < 2; ++rt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = 16 * rt + g + 8 * h;
            if (grow + r >= rows) continue;
            const float inv_l = sInvL[r];
#pragma unroll
            for (int n = 0; n < kCols / 8; ++n)
                store_pair<TOut>(p, split, qrow0 + grow + r, kCols * warp + 8 * n + 2 * t4, o[rt][n][2 * h] * inv_l,
                                 o[rt][n][2 * h + 1] * inv_l);
        }
    }
}

template <typename TOut, typename T>
int launch_tiles(const MlaParams& p, dim3 grid, int stages, cudaStream_t stream) {
    const auto kernel = p.block_table ? mla_k2_mma<TOut, true, T> : mla_k2_mma<TOut, false, T>;
    const size_t smem = T::smem_bytes(stages);
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (err != cudaSuccess) return (int)err;
    kernel<<<grid, mma_k2::kThreads, smem, stream>>>(p, stages);
    return kdtree_launch_status();
}

// The device's shared memory a block may take (opt-in), or 0.
size_t block_smem_limit() {
    int device = 0, limit = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess)
        return 0;
    return (size_t)limit;
}

}  // namespace

// Big tiles with 4 stages where they fit (H100, H200), else 3 (A100); small tiles with 3.
int launch_mma(const MlaParams& p, dim3 grid, bool small_tiles, bool out_bf16, cudaStream_t stream) {
    const size_t limit = block_smem_limit();
    small_tiles = small_tiles || limit < BigTiles::smem_bytes(3);
    if (limit < SmallTiles::smem_bytes(3)) return KDTREE_BAD_LIMIT;
    if (small_tiles)
        return out_bf16 ? launch_tiles<bf16, SmallTiles>(p, grid, 3, stream)
                        : launch_tiles<float, SmallTiles>(p, grid, 3, stream);
    const int stages = limit >= BigTiles::smem_bytes(4) ? 4 : 3;
    return out_bf16 ? launch_tiles<bf16, BigTiles>(p, grid, stages, stream)
                    : launch_tiles<float, BigTiles>(p, grid, stages, stream);
}

}  // namespace kdtree_mla

// Tree-verify MLA attention at K2 dims on Hopper, the two warpgroups in a seesaw (the helpers and
// tile geometry are in mla_wgmma.cuh; mla_wgmma.cu launches it for splits of many tiles).

#include "mla_wgmma.cuh"

namespace kdtree_mla {
namespace {
namespace pairs {
using namespace k2;
// Shared memory, from a 1024-byte aligned base (the 128-byte swizzle repeats every 1024 bytes).
constexpr int kOffQ = 0;
constexpr int kOffK = kOffQ + kTileBytes;        // [2] key tiles: tile t in slot t % 2
constexpr int kOffM = kOffK + 2 * kTileBytes;    // [64] float: the rows' running max (log2 domain)
constexpr int kOffScale = kOffM + kBM * 4;       // [2][64] float: each warpgroup's rescale of a pair
constexpr int kOffL = kOffScale + 2 * kBM * 4;   // [2][64] float: each warpgroup's row sums
constexpr int kOffBars = kOffL + 2 * kBM * 4;    // mbarriers: Q, one per chunk of each slot, the hand-offs
constexpr int kBars = 1 + 2 * kChunks + 5;
constexpr size_t kSmemBytes = kOffBars + kBars * 8 + 1024;
[[maybe_unused]] constexpr int kBarOwn = 1;  // named barrier (0 is __syncthreads) + warpgroup: its 128 threads alone
}  // namespace pairs

// Block = 64 query rows x one key split of one request, two warpgroups in a seesaw (FlashMLA's
// schedule for its dense decode kernel, read in its public source): the split's 64-key tiles go
// in pairs, tile 2i to slot 0 and warpgroup 0, tile 2i + 1 to slot 1 and warpgroup 1. Each
// warpgroup scores its own tile, S = Q K^T over 576 dims, so one's softmax runs under the other's
// tensor work, and owns half of O (256 of the 512 columns) over both tiles of the pair:
//
//   wg 0: softmax of S0 against the running max -> m0; O_L = O_L a0 + P0 V0_L (P0 in registers)
//   wg 1: softmax of S1 against m0 -> m1;          O_R = O_R a0 a1 + P1 V1_R (P1 in registers)
//   wg 0: P0 *= a1 into shared memory;             O_L = O_L a1 + P1 V1_L
//   wg 1:                                          O_R += P0 V0_R
//
// with a0 = exp2(m - m0), a1 = exp2(m0 - m1); then each scores the next tile of its slot. Warpgroup 1
// takes its tile's softmax at the tile's own max before it waits for m0, which then only rescales
// P1 (by exp2(max S1 - m1), skipped when 1): warpgroup 0's softmax is all it waits for. A
// tile's P lives in its own k_pe chunk once its scores are done (V is c_kv alone), so shared
// memory holds Q and two key tiles. Every key chunk has its own TMA barrier and is refilled as
// soon as its readers are done: thread 0 issues slot 0's chunks 0-3 (V_L) and slot 1's 0-3 and
// 8 (V_L, P1), thread 128 slot 1's 4-7 (V_R) and slot 0's 4-8 (V_R, P0). The running max lives
// in shared memory; each warpgroup keeps its part of the row sums.
template <typename TOut, bool kPaged>
__global__ void __launch_bounds__(k2::kThreads, 1)
    mla_k2_wgmma_pairs(const __grid_constant__ MlaParams p, const __grid_constant__ K2Maps maps) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // wgmma exists only in sm_90a code
    using namespace pairs;
    extern __shared__ unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
    unsigned char* sQ = smem + kOffQ;
    unsigned char* sK = smem + kOffK;
    float* sM = reinterpret_cast<float*>(smem + kOffM);
    float* sScale = reinterpret_cast<float*>(smem + kOffScale);  // [wg][row]
    float* sL = reinterpret_cast<float*>(smem + kOffL);          // [wg][row]
    uint64_t* bars = reinterpret_cast<uint64_t*>(smem + kOffBars);
    uint64_t* q_full = bars;                  // the Q tile landed
    uint64_t* full = bars + 1;                // [slot][chunk]: a key chunk landed
    uint64_t* scale0_ready = full + 2 * kChunks;  // warpgroup 0 wrote the first tile's max and rescale
    uint64_t* scale1_ready = scale0_ready + 1;    // warpgroup 1 wrote the second tile's
    uint64_t* p0_ready = scale0_ready + 2;        // warpgroup 0 wrote the first tile's P at the pair's max
    uint64_t* p1_ready = scale0_ready + 3;        // warpgroup 1 wrote the second's P and issued its P0 V
    uint64_t* sums_ready = scale0_ready + 4;      // both wrote their row sums

    K2Block blk{};
    if (!blk.take<kPaged>(p)) return;
    const int b = blk.b, split = blk.split, context = blk.context, rows = blk.rows, row0 = blk.row0;
    const int key_begin = blk.key_begin, key_end = blk.key_end, n_tiles = blk.n_tiles, grow0 = blk.grow0;
    const int box = blk.box, base = blk.base;

    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int r_lo = 16 * warp + g;  // this thread's tile rows: r_lo and r_lo + 8 (accumulator layout)

    if (tid == 0) {
        mbar_init(q_full, 1);
        for (int i = 0; i < 2 * kChunks; ++i) mbar_init(&full[i], 1);
        for (int i = 0; i < 4; ++i) mbar_init(&scale0_ready[i], 128);  // every thread of the writing warpgroup
        mbar_init(sums_ready, kThreads);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    if (tid < kBM) sM[tid] = -CUDART_INF_F;
    __syncthreads();
    // The key tiles are loaded by warp 0 of a warpgroup: its lane j holds the cache row of box j
    // of a tile, read from the block table at the start of the pair that loads it (box_row), and
    // issues that box.
    auto box_row = [&](int t) {
        const int key0 = key_begin + t * kBN;
        if constexpr (!kPaged) return base + key0;
        return t < n_tiles && lane * box < kBN ? cache_row_now(p, b, key_box_slot(key0, key_end - 1, box, lane)) : 0;
    };
    auto load = [&](int t, int first, int last, int row) {  // chunks [first, last) of tile t into its slot
        uint64_t* bars = full + (t & 1) * kChunks;
        if (lane == 0)
            for (int c = first; c < last; ++c) mbar_expect_tx(&bars[c], kChunkBytes);
        __syncwarp();
        if (lane * box < kBN)
            tma_load_key_box(sK + (t & 1) * kTileBytes, &maps.c_kv, &maps.k_pe, bars, first, last, row, lane, box);
    };
    if (tid < 32) {
        if (tid == 0) {
            mbar_expect_tx(q_full, kTileBytes);
            tma_load_rows(sQ, &maps.q_lat, &maps.q_pe, q_full, grow0);
        }
        load(0, 0, kChunks, box_row(0));
        if (n_tiles > 1) load(1, 0, kChunks, box_row(1));
    }

    bool row_ok[2];
    int vis_token[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        row_ok[h] = row0 + r_lo + 8 * h < rows;
        vis_token[h] = (grow0 + (row_ok[h] ? r_lo + 8 * h : 0)) / p.heads;
    }
    float o[128];  // [64 rows x 256 columns] of this warpgroup's output half
    float s[32];       // s[4j + 2h + e] = row r_lo + 8h, key 8j + 2 t4 + e of this warpgroup's tile
    uint32_t pb[16];   // pb[2j + h]: s[4j + 2h], s[4j + 2h + 1] as bf16, the A fragments of P V
    float l_part[2] = {0.f, 0.f};  // this thread's part of its warpgroup's row sums

    const uint64_t q_desc = smem_desc(sQ, 16, 1024);
    const uint64_t k_desc = smem_desc(sK, 16, 1024);
    const uint64_t v_desc = smem_desc(sK, kChunkBytes, 1024) + ((wg * 4 * kChunkBytes) >> 4);  // this half of V
    auto slot_off = [](int t) { return (uint32_t)(((t & 1) * kTileBytes) >> 4); };  // descriptor units
    // Issue s (+)= Q K^T over chunks kFirst .. kLast - 1 of tile t (slot t % 2, its (t / 2)-th load).
    auto score = [&](auto first, auto last, int t, bool zero) {
        score_chunks<decltype(first)::value, decltype(last)::value>(
            s, q_desc, k_desc + slot_off(t), full + (t & 1) * kChunks, (t >> 1) & 1, zero);
    };
    // Mask keys past the split and hidden tree keys of tile t (the scores stay unscaled: the
    // softmax scales them); zero the tile's V rows past the split (the cache may hold NaN there)
    // for both warpgroups.
    auto mask = [&](int t) {
        const int key0 = key_begin + t * kBN;
        const int valid = key_end - key0;
        const bool masked_tile = key0 + kBN > context || valid < kBN;
        // The tile's tree keys (key - context >= 0) lie in visibility words w0 .. w0 + 2 of a row
        // (64 keys from any bit offset), read once a tile; rows past the tree see every key.
        const int w0 = (key0 - context) >> 5;  // floor: negative while the tile starts in the context
        uint32_t words[2][3];
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int k = 0; k < 3; ++k) {
                const int w = w0 + k;
                words[h][k] = !row_ok[h] ? ~0u
                              : masked_tile && w >= 0 && w < p.vis_words
                                  ? p.visibility[(size_t)vis_token[h] * p.vis_words + w]
                                  : 0u;
            }
        if (masked_tile) {  // one branch a tile: a test per score costs the unmasked tiles their rate
#pragma unroll
            for (int i = 0; i < 32; ++i) {
                const int key = key0 + 8 * (i >> 2) + 2 * t4 + (i & 1);
                const int h = (i >> 1) & 1;
                const int j = key - context;
                const int k = (j >> 5) - w0;
                const uint32_t word = k == 0 ? words[h][0] : k == 1 ? words[h][1] : words[h][2];
                const bool visible = key < key_end && (j < 0 || (word >> (j & 31)) & 1u);
                s[i] = visible ? s[i] : -CUDART_INF_F;
            }
        }
        if (valid < kBN) {
            unsigned char* tile = sK + (t & 1) * kTileBytes;
            for (int i = tid & 127; i < (kBN - valid) * 8 * (kChunks - 1); i += 128) {
                const int unit = i & 7, chunk = (i >> 3) % (kChunks - 1), r = valid + (i >> 3) / (kChunks - 1);
                *reinterpret_cast<uint4*>(tile + chunk * kChunkBytes + r * 128 + unit * 16) = make_uint4(0, 0, 0, 0);
            }
            fence_proxy_async();
            named_bar_sync(kBarOwn + wg, 128);
        }
    };
    // The softmax helpers (mla_wgmma.cuh) over both of this thread's rows.
    auto row_maxes = [&](float (&mx)[2]) {
#pragma unroll
        for (int h = 0; h < 2; ++h) mx[h] = row_max(s, h);
    };
    auto new_maxes = [&](const float (&mx)[2], const float (&m_old)[2], float (&m_new)[2], float (&m_use)[2],
                         float (&alpha)[2]) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const RowMax m = new_max(m_old[h], mx[h], p.scale_log2);
            m_new[h] = m.m_new;
            m_use[h] = m.m_use;
            alpha[h] = m.alpha;
        }
    };
    auto exponentiate_rows = [&](const float (&m)[2], float (&sum)[2]) {
#pragma unroll
        for (int h = 0; h < 2; ++h) sum[h] = exponentiate(s, h, p.scale_log2, m[h]);
    };
    auto pack_p = [&]() {
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h) pb[2 * j + h] = pack_bf16(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]);
    };
    // Issue O += P V of tile t's half of V: P from pb, or from the tile's k_pe chunk.
    auto pv_registers = [&](int t) {
        fence_operands(o);
        fence_operands(pb);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
            wgmma_pv_rs(o, pb[4 * kk], pb[4 * kk + 1], pb[4 * kk + 2], pb[4 * kk + 3],
                        v_desc + slot_off(t) + ((kk * 16 * 128) >> 4));
        wgmma_commit();
    };
    auto pv_shared = [&](int t) {
        fence_operands(o);
        wgmma_fence();
        const uint64_t p_desc = smem_desc(sK + (t & 1) * kTileBytes + kRopeChunk * kChunkBytes, 16, 1024);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
            wgmma_pv(o, p_desc + ((kk * 32) >> 4), v_desc + slot_off(t) + ((kk * 16 * 128) >> 4));
        wgmma_commit();
    };
    // P (pb) into tile t's k_pe chunk: K-major, swizzled, the A operand of the other half's P V.
    auto store_p = [&](int t) {
        unsigned char* sP = sK + (t & 1) * kTileBytes + kRopeChunk * kChunkBytes;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
            for (int h = 0; h < 2; ++h)
                *reinterpret_cast<uint32_t*>(sP + (r_lo + 8 * h) * 128 + ((j ^ g) << 4) + 4 * t4) = pb[2 * j + h];
        }
        fence_proxy_async();
    };

    // Zero O; wait for Q; each warpgroup scores the first tile of its slot (warpgroup 1 of a
    // one-tile split scores whatever its slot holds and never reads the result: a product
    // skipped here would make ptxas serialize the loop's).
    auto begin = [&]() {
#pragma unroll
        for (int i = 0; i < 128; ++i) o[i] = 0.f;
        mbar_wait(q_full, 0);
        score_chunks<0, kChunks>(s, q_desc, k_desc + slot_off(wg), wg < n_tiles ? full + wg * kChunks : nullptr, 0,
                                 true);
        wgmma_wait<0>();
        fence_operands(s);
    };

    // Row sums: each warpgroup's part at the final max, added across the quad and the
    // warpgroups; then O / l and the lse.
    auto finish = [&]() {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float l = l_part[h];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            if (t4 == 0) sL[wg * kBM + r_lo + 8 * h] = l;
        }
        mbar_arrive(sums_ready);
        mbar_wait(sums_ready, 0);
        float inv_l[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = r_lo + 8 * h;
            const float l = sL[r] + sL[kBM + r];
            inv_l[h] = l > 0.f ? 1.f / l : 0.f;
            if (wg == 0 && t4 == 0 && row_ok[h]) store_lse(p, split, grow0 + r, row_lse(sM[r], l));
        }

        store_o<TOut>(p, split, grow0, r_lo, wg, t4, row_ok, o, inv_l);
    };

    // Each warpgroup runs the whole block in its own branch (one loop with both roles inside it,
    // or a prologue or epilogue shared by both, makes ptxas serialize the wgmma); the named
    // barriers keep them in step.
    if (wg == 0) {
        begin();
        for (int t0 = 0; t0 < n_tiles; t0 += 2) {
            const int t1 = t0 + 1;
            const bool has1 = t1 < n_tiles;
            const bool next0 = t0 + 2 < n_tiles, next1 = t1 + 2 < n_tiles;
            const uint32_t parity = (t0 >> 1) & 1;  // of the hand-offs: one phase a pair
            int row0 = 0, row1 = 0;                 // warp 0: the next tiles' box rows
            if (warp == 0) {
                row0 = box_row(t0 + 2);
                row1 = box_row(t1 + 2);
            }
            mask(t0);
            float mx[2], m_old[2], m0[2], m_use[2], a0[2], sum[2], a1[2] = {1.f, 1.f};
            row_maxes(mx);
#pragma unroll
            for (int h = 0; h < 2; ++h) m_old[h] = sM[r_lo + 8 * h];
            new_maxes(mx, m_old, m0, m_use, a0);
            exponentiate_rows(m_use, sum);
            pack_p();
            __syncwarp();
            if (t4 == 0) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    sM[r_lo + 8 * h] = m0[h];
                    sScale[r_lo + 8 * h] = a0[h];
                }
            }
            mbar_arrive(scale0_ready);
#pragma unroll
            for (int h = 0; h < 2; ++h) l_part[h] = l_part[h] * a0[h] + sum[h];
            rescale_o(o, a0);
            pv_registers(t0);
            wgmma_wait<0>();
            fence_operands(o);
            mbar_wait(scale1_ready, parity);
            if (warp == 0 && next0) load(t0 + 2, 0, 4, row0);
            if (has1) {  // P0 to the pair's max: from its bf16 values (s is free for the next scores)
#pragma unroll
                for (int h = 0; h < 2; ++h) a1[h] = sScale[kBM + r_lo + 8 * h];
                if (__any_sync(0xffffffffu, a1[0] != 1.f || a1[1] != 1.f)) {
#pragma unroll
                    for (int i = 0; i < 16; ++i) pb[i] = scale_bf16x2(pb[i], a1[i & 1]);
                }
            }
            store_p(t0);
            mbar_arrive(p0_ready);
            mbar_wait(p1_ready, parity);
            if (has1) {  // (no second tile: the split's last pair, nothing left to do)
#pragma unroll
                for (int h = 0; h < 2; ++h) l_part[h] *= a1[h];
                rescale_o(o, a1);
                pv_shared(t1);
                if (next0) {
                    score(C<0>(), C<4>(), t0 + 2, true);
                    wgmma_wait<4>();  // the P1 V above, not the four chunks' scores
                    if (warp == 0 && next1) {
                        load(t1 + 2, 0, 4, row1);
                        load(t1 + 2, kRopeChunk, kChunks, row1);
                    }
                    score(C<4>(), C<kChunks>(), t0 + 2, false);
                }
                wgmma_wait<0>();
                fence_operands(o);
                fence_operands(s);
            }
        }
        finish();
    } else {
        begin();
        for (int t0 = 0; t0 < n_tiles; t0 += 2) {
            const int t1 = t0 + 1;
            const bool has1 = t1 < n_tiles;
            const bool next0 = t0 + 2 < n_tiles, next1 = t1 + 2 < n_tiles;
            const uint32_t parity = (t0 >> 1) & 1;
            int row0 = 0, row1 = 0;
            if (warp == 0) {
                row0 = box_row(t0 + 2);
                row1 = box_row(t1 + 2);
            }
            // The tile's softmax at its own max needs nothing of warpgroup 0's: done before the
            // wait for its max, which then only rescales it (by c <= 1, skipped when 1).
            float mx[2], m_old[2], m1[2], m_use[2], a[2], sum[2] = {0.f, 0.f};
            if (has1) {
                mask(t1);
                row_maxes(mx);
#pragma unroll
                for (int h = 0; h < 2; ++h) m_use[h] = mx[h] == -CUDART_INF_F ? 0.f : mx[h] * p.scale_log2;
                exponentiate_rows(m_use, sum);
            }
            mbar_wait(scale0_ready, parity);
#pragma unroll
            for (int h = 0; h < 2; ++h) m_old[h] = sM[r_lo + 8 * h];
            if (has1) {
                new_maxes(mx, m_old, m1, m_use, a);
                float c[2];
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    c[h] = mx[h] == -CUDART_INF_F ? 1.f : exp2_approx(mx[h] * p.scale_log2 - m_use[h]);
                if (__any_sync(0xffffffffu, c[0] != 1.f || c[1] != 1.f)) {
#pragma unroll
                    for (int i = 0; i < 32; ++i) s[i] *= c[(i >> 1) & 1];
#pragma unroll
                    for (int h = 0; h < 2; ++h) sum[h] *= c[h];
                }
                pack_p();
            } else {
                a[0] = a[1] = 1.f;
            }
            __syncwarp();
            if (t4 == 0) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    if (has1) sM[r_lo + 8 * h] = m1[h];
                    sScale[kBM + r_lo + 8 * h] = a[h];
                }
            }
            mbar_arrive(scale1_ready);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                a[h] *= sScale[r_lo + 8 * h];  // O_R and its sums from the last pair's max to m0, then to m1
                l_part[h] = l_part[h] * a[h] + sum[h];
            }
            rescale_o(o, a);
            if (has1) {
                store_p(t1);
                pv_registers(t1);
                mbar_wait(p0_ready, parity);
                pv_shared(t0);
                mbar_arrive(p1_ready);
                wgmma_wait<1>();
                if (warp == 0 && next1) load(t1 + 2, 4, 8, row1);
                wgmma_wait<0>();
            } else {
                mbar_wait(p0_ready, parity);
                pv_shared(t0);
                mbar_arrive(p1_ready);
                wgmma_wait<0>();
            }
            fence_operands(o);
            if (warp == 0 && next0) load(t0 + 2, 4, kChunks, row0);
            if (next1) {
                score(C<4>(), C<8>(), t1 + 2, true);
                score(C<0>(), C<4>(), t1 + 2, false);
                score(C<kRopeChunk>(), C<kChunks>(), t1 + 2, false);
                wgmma_wait<0>();
                fence_operands(s);
            }
        }
        finish();
    }

#else
    __trap();  // never launched: the host launches this kernel only where sm_90a code runs
#endif
}

}  // namespace

int launch_wgmma_pairs(const MlaParams& p, const K2Maps& maps, dim3 grid, bool out_bf16, cudaStream_t stream) {
    static_assert(pairs::kSmemBytes <= 227 * 1024, "K2 tiles do not fit in shared memory");
    const auto kernel = out_bf16 ? (p.block_table ? mla_k2_wgmma_pairs<bf16, true> : mla_k2_wgmma_pairs<bf16, false>)
                                 : (p.block_table ? mla_k2_wgmma_pairs<float, true> : mla_k2_wgmma_pairs<float, false>);
    return launch_k2(kernel, pairs::kSmemBytes, grid, p, maps, stream);
}

}  // namespace kdtree_mla

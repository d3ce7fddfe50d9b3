// Tree-verify MLA attention in the absorbed form, with a bit-packed ancestor-only mask.
//
// A ragged batch of B requests. Request b has tree[b] query tokens (rows
// q_offsets[b] .. q_offsets[b] + tree[b] of q_lat / q_pe) and kv_len = context[b] + tree[b]
// keys (rows kv_offsets[b] .. kv_offsets[b] + kv_len of c_kv / k_pe: its cached context,
// then its tree tokens). For query token t of request b, head h, key s of request b:
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
// - `mla_k2_bf16`: bf16 inputs at kv_lora 512, rope 64; 64 rows x 32 keys a step on the
//   tensor cores (mma.sync m16n8k16, float32 accumulation), keys streamed through a
//   cp.async pipeline; c_kv in shared memory serves as both K and V.

#include "common.cuh"

#include <cuda_bf16.h>
#include <math_constants.h>

namespace {

using bf16 = __nv_bfloat16;

enum MlaDtype : int { kFloat32 = 0, kBFloat16 = 1 };

struct MlaParams {
    const void* q_lat;          // [T, H, R]
    const void* q_pe;           // [T, H, dr]
    const void* c_kv;           // [S, R]
    const void* k_pe;           // [S, dr]
    const int32_t* context;     // [B]
    const int32_t* tree;        // [B]
    const int32_t* q_offsets;   // [B + 1]
    const int32_t* kv_offsets;  // [B]
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

    const TIn* c_kv = static_cast<const TIn*>(p.c_kv) + (size_t)p.kv_offsets[b] * R;
    const TIn* k_pe = static_cast<const TIn*>(p.k_pe) + (size_t)p.kv_offsets[b] * dr;
    float m = -CUDART_INF_F, l = 0.f;
    for (int s = key_begin; s < key_end; ++s) {
        if (!key_visible(p, token, s, context)) continue;
        const TIn* c = c_kv + (size_t)s * R;
        const TIn* k = k_pe + (size_t)s * dr;
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

// ------------------------------------------------------------------ K2 tensor-core path

namespace k2 {
constexpr int kR = 512, kDr = 64, kD = kR + kDr;  // latent, rope, score dims
constexpr int kLd = kD + 8;       // shared row stride in bf16: 1168 bytes, ldmatrix conflict-free
constexpr int kBM = 64;           // query rows per block
constexpr int kBN = 32;           // keys per pipeline step
constexpr int kThreads = 256;     // 8 warps: 4 row groups x 2 halves
constexpr int kChunks = kD / 8;   // 16-byte chunks per row
constexpr int kHalfD = kD / 2;    // score dims per warp half: 288 = 18 k-steps of 16
constexpr int kHalfR = kR / 2;    // output columns per warp half: 256 = 32 n-tiles of 8
constexpr int kStages = 3;
constexpr size_t kSmemBytes = (size_t)(kBM + kStages * kBN) * kLd * sizeof(bf16);
}  // namespace k2

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const bf16* p) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const bf16* p) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
// d[16x8] += a[16x16] * b[16x8], bf16 operands, float32 accumulators.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ void pair_barrier(int id) {
    asm volatile("bar.sync %0, 64;\n" ::"r"(id) : "memory");
}

// Block = 64 query rows x one key split of one request. Warp w: row group mi = w % 4 (16 rows),
// half nj = w / 4. Scores: each warp of a pair takes half of the 576 score dims for all 32 keys
// (its Q fragments stay in registers), the pair sums the two partial score tiles through
// shared memory, so both hold the same full tile; softmax statistics are then identical in
// both, P stays in registers, and each warp accumulates its 256 of the 512 output columns.
template <typename TOut>
__global__ void __launch_bounds__(k2::kThreads, 1) mla_k2_bf16(MlaParams p) {
    using namespace k2;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16* sQ = reinterpret_cast<bf16*>(smem_raw);   // [kBM][kLd]; then the score exchange
    bf16* sK = sQ + kBM * kLd;                      // [kStages][kBN][kLd]
    float* sX = reinterpret_cast<float*>(smem_raw); // [8 warps][16][32 lanes] partial scores

    const int b = blockIdx.z, split = blockIdx.y;
    const int tree = p.tree[b], context = p.context[b];
    const int rows = tree * p.heads;
    const int row0 = blockIdx.x * kBM;
    const int kv_len = context + tree;
    const int key_begin = split * p.split_keys;
    if (row0 >= rows || key_begin >= kv_len) return;
    const int key_end = min(kv_len, key_begin + p.split_keys);
    const int n_tiles = (key_end - key_begin + kBN - 1) / kBN;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int mi = warp & 3, nj = warp >> 2;
    const int g = lane >> 2, t4 = lane & 3;
    const int grow0 = p.q_offsets[b] * p.heads + row0;  // global row of tile row 0
    const bf16* q_lat = static_cast<const bf16*>(p.q_lat) + (size_t)grow0 * kR;
    const bf16* q_pe = static_cast<const bf16*>(p.q_pe) + (size_t)grow0 * kDr;
    const bf16* c_kv = static_cast<const bf16*>(p.c_kv) + (size_t)p.kv_offsets[b] * kR;
    const bf16* k_pe = static_cast<const bf16*>(p.k_pe) + (size_t)p.kv_offsets[b] * kDr;

    // Q tile -> shared (rows past the request are zero-filled and never stored).
    for (int i = tid; i < kBM * kChunks; i += kThreads) {
        const int r = i / kChunks, c = i % kChunks;
        const bool valid = row0 + r < rows;
        const bf16* src = c < kR / 8 ? q_lat + (size_t)r * kR + c * 8 : q_pe + (size_t)r * kDr + (c - kR / 8) * 8;
        cp_async16(sQ + r * kLd + c * 8, valid ? src : q_lat, valid);
    }
    cp_async_commit();

    auto load_keys = [&](int tile, int stage) {
        const int k0 = key_begin + tile * kBN;
        bf16* dst = sK + stage * kBN * kLd;
        for (int i = tid; i < kBN * kChunks; i += kThreads) {
            const int r = i / kChunks, c = i % kChunks;
            const int key = k0 + r;
            const bool valid = key < key_end;
            const bf16* src = c < kR / 8 ? c_kv + (size_t)key * kR + c * 8 : k_pe + (size_t)key * kDr + (c - kR / 8) * 8;
            cp_async16(dst + r * kLd + c * 8, valid ? src : c_kv, valid);
        }
    };
    for (int s = 0; s < kStages - 1; ++s) {
        if (s < n_tiles) load_keys(s, s);
        cp_async_commit();
    }
    cp_async_wait<kStages - 1>();  // the Q group is complete
    __syncthreads();

    uint32_t qa[kHalfD / 16][4];    // this warp's 16 rows x 288 dims, as mma A fragments
#pragma unroll
    for (int ks = 0; ks < kHalfD / 16; ++ks)
        ldmatrix_x4(qa[ks], sQ + (16 * mi + (lane & 15)) * kLd + kHalfD * nj + 16 * ks + (lane >> 4) * 8);

    // Rows g and g + 8 of this warp's group: their visibility row, and whether they exist.
    int vis_token[2];
    bool row_ok[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int local = row0 + 16 * mi + g + 8 * h;
        row_ok[h] = local < rows;
        vis_token[h] = (grow0 - row0 + (row_ok[h] ? local : 0)) / p.heads;
    }

    float o[kHalfR / 8][4];
#pragma unroll
    for (int n = 0; n < kHalfR / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m_row[2] = {-CUDART_INF_F, -CUDART_INF_F};
    float l_row[2] = {0.f, 0.f};  // this thread's part of the row sums (reduced at the end)

    for (int tile = 0; tile < n_tiles; ++tile) {
        cp_async_wait<kStages - 2>();
        __syncthreads();  // tile `tile` landed for everyone; everyone is done with tile - 1
        if (tile + kStages - 1 < n_tiles) load_keys(tile + kStages - 1, (tile + kStages - 1) % kStages);
        cp_async_commit();
        const bf16* sKt = sK + (tile % kStages) * kBN * kLd;

        // Partial scores over this warp's 288 dims: 16 rows x 32 keys (4 n-tiles of 8 keys).
        float s[4][4];
#pragma unroll
        for (int n = 0; n < 4; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < kHalfD / 16; ++ks) {
#pragma unroll
            for (int kp = 0; kp < 2; ++kp) {
                uint32_t kb[4];
                ldmatrix_x4(kb, sKt + (16 * kp + (lane & 7) + ((lane >> 4) << 3)) * kLd + kHalfD * nj + 16 * ks +
                                    ((lane >> 3) & 1) * 8);
                mma_bf16(s[2 * kp], qa[ks], kb[0], kb[1]);
                mma_bf16(s[2 * kp + 1], qa[ks], kb[2], kb[3]);
            }
        }
        // Sum the pair's partial tiles (a + b == b + a, so both warps hold the same bits).
        float* mine = sX + warp * 16 * 32 + lane;
        const float* other = sX + (warp ^ 4) * 16 * 32 + lane;
#pragma unroll
        for (int i = 0; i < 16; ++i) mine[i * 32] = s[i / 4][i % 4];
        pair_barrier(1 + mi);
#pragma unroll
        for (int i = 0; i < 16; ++i) s[i / 4][i % 4] += other[i * 32];

        // Scale into the log2 domain; mask keys past the split and hidden tree keys.
        const int key0 = key_begin + tile * kBN;
        const bool masked_tile = key0 + kBN > context || key0 + kBN > key_end;
#pragma unroll
        for (int n = 0; n < 4; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float x = s[n][e] * p.scale_log2;
                if (masked_tile) {
                    const int key = key0 + 8 * n + 2 * t4 + (e & 1);
                    const int h = e >> 1;
                    const bool visible = key < key_end && (!row_ok[h] || key_visible(p, vis_token[h], key, context));
                    x = visible ? x : -CUDART_INF_F;
                }
                s[n][e] = x;
            }
        }
        // Online softmax: rows g (elements 0, 1) and g + 8 (elements 2, 3) of each n-tile.
        float alpha[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float mx = -CUDART_INF_F;
#pragma unroll
            for (int n = 0; n < 4; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * h], s[n][2 * h + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = fmaxf(m_row[h], mx);
            const float m_use = m_new == -CUDART_INF_F ? 0.f : m_new;
            alpha[h] = exp2f(m_row[h] - m_use);
            m_row[h] = m_new;
            float sum = 0.f;
#pragma unroll
            for (int n = 0; n < 4; ++n) {
                s[n][2 * h] = exp2f(s[n][2 * h] - m_use);
                s[n][2 * h + 1] = exp2f(s[n][2 * h + 1] - m_use);
                sum += s[n][2 * h] + s[n][2 * h + 1];
            }
            l_row[h] = l_row[h] * alpha[h] + sum;
        }
        // Rescale O only when some row's running max moved (x * 1 == x: skipping is exact).
        if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
            for (int n = 0; n < kHalfR / 8; ++n) {
                o[n][0] *= alpha[0];
                o[n][1] *= alpha[0];
                o[n][2] *= alpha[1];
                o[n][3] *= alpha[1];
            }
        }
        // P (16 rows x 32 keys) as two A fragments of 16 keys, straight from the accumulators.
        uint32_t pa[2][4];
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
            pa[kk][0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
            pa[kk][1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
            pa[kk][2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            pa[kk][3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
        }
        // O[16 rows x 256 cols] += P V, V = the c_kv part of the key tile.
#pragma unroll
        for (int c = 0; c < kHalfR / 16; ++c) {
#pragma unroll
            for (int kk = 0; kk < 2; ++kk) {
                uint32_t vb[4];
                ldmatrix_x4_trans(vb, sKt + (16 * kk + (lane & 7) + ((lane >> 3) & 1) * 8) * kLd + kHalfR * nj +
                                          16 * c + (lane >> 4) * 8);
                mma_bf16(o[2 * c], pa[kk], vb[0], vb[1]);
                mma_bf16(o[2 * c + 1], pa[kk], vb[2], vb[3]);
            }
        }
    }
    cp_async_wait<0>();

#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float l = l_row[h];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        if (!row_ok[h]) continue;
        const int row = grow0 + 16 * mi + g + 8 * h;
        const float inv_l = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
        for (int n = 0; n < kHalfR / 8; ++n)
            store_pair<TOut>(p, split, row, kHalfR * nj + 8 * n + 2 * t4, o[n][2 * h] * inv_l, o[n][2 * h + 1] * inv_l);
        if (nj == 0 && t4 == 0) store_lse(p, split, row, row_lse(m_row[h], l));
    }
}

// ------------------------------------------------------------------ split combine

constexpr int kMaxSplits = 128;

// One warp per row: weights exp(lse_i - max) over the request's non-empty splits, then
// o = sum_i w_i o_i / sum_i w_i and lse = max + log(sum_i w_i).
template <typename TOut>
__global__ void __launch_bounds__(kGenericWarps * 32) mla_combine(MlaParams p) {
    __shared__ float weights[kGenericWarps][kMaxSplits];
    const int b = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int tree = p.tree[b];
    const int local_row = blockIdx.x * kGenericWarps + warp;
    if (local_row >= tree * p.heads) return;
    const int kv_len = p.context[b] + tree;
    const int n_splits = min(p.num_splits, (kv_len + p.split_keys - 1) / p.split_keys);
    const int row = p.q_offsets[b] * p.heads + local_row;

    float mx = -CUDART_INF_F;
    for (int i = 0; i < n_splits; ++i) mx = fmaxf(mx, p.part_lse[(size_t)i * p.total_rows + row]);
    float* w = weights[warp];
    for (int i = lane; i < n_splits; i += 32)
        w[i] = mx == -CUDART_INF_F ? 0.f : __expf(p.part_lse[(size_t)i * p.total_rows + row] - mx);
    __syncwarp();
    float total = 0.f;
    for (int i = 0; i < n_splits; ++i) total += w[i];
    const float inv_total = total > 0.f ? 1.f / total : 0.f;
    TOut* out = static_cast<TOut*>(p.o_lat) + (size_t)row * p.kv_lora;
    for (int c = lane; c < p.kv_lora; c += 32) {
        float acc = 0.f;
        for (int i = 0; i < n_splits; ++i) acc += w[i] * p.part_o[((size_t)i * p.total_rows + row) * p.kv_lora + c];
        out[c] = from_float<TOut>(acc * inv_total);
    }
    if (lane == 0) p.lse[row] = total > 0.f ? mx + logf(total) : -CUDART_INF_F;
}

template <typename TOut>
int launch(const MlaParams& p, int batch, int max_tree, int in_dtype, bool generic, cudaStream_t stream) {
    const long long max_rows = (long long)max_tree * p.heads;
    const bool k2_fast = !generic && in_dtype == kBFloat16 && p.kv_lora == k2::kR && p.rope_dim == k2::kDr;
    if (k2_fast) {
        static_assert(k2::kSmemBytes <= 227 * 1024, "K2 tile does not fit in shared memory");
        const cudaError_t err = cudaFuncSetAttribute(mla_k2_bf16<TOut>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                     (int)k2::kSmemBytes);
        if (err != cudaSuccess) return (int)err;
        const dim3 grid((unsigned)((max_rows + k2::kBM - 1) / k2::kBM), p.num_splits, batch);
        mla_k2_bf16<TOut><<<grid, k2::kThreads, k2::kSmemBytes, stream>>>(p);
    } else {
        const size_t smem = (size_t)kGenericWarps * (2 * p.kv_lora + p.rope_dim) * sizeof(float);
        if (smem > 48 * 1024) return KDTREE_BAD_LIMIT;
        const dim3 grid((unsigned)((max_rows + kGenericWarps - 1) / kGenericWarps), p.num_splits, batch);
        if (in_dtype == kBFloat16) mla_generic<bf16, TOut><<<grid, kGenericWarps * 32, smem, stream>>>(p);
        else mla_generic<float, TOut><<<grid, kGenericWarps * 32, smem, stream>>>(p);
    }
    int status = kdtree_launch_status();
    if (status != 0 || p.num_splits == 1) return status;
    const dim3 grid((unsigned)((max_rows + kGenericWarps - 1) / kGenericWarps), batch);
    mla_combine<TOut><<<grid, kGenericWarps * 32, 0, stream>>>(p);
    return kdtree_launch_status();
}

}  // namespace

// Tree-verify MLA attention (see the top of this file). in_dtype / out_dtype: 0 float32,
// 1 bfloat16 (q_lat, q_pe, c_kv, k_pe share in_dtype). num_splits * split_keys must cover
// every request's keys; split_keys is a multiple of 32; with num_splits > 1, part_o
// [num_splits, T * H, kv_lora] and part_lse [num_splits, T * H] float32 are scratch.
// generic != 0 forces the CUDA-core path (for comparisons). Grid: one block per 64 (fast) or
// 4 (generic) rows of the longest tree, per split, per request.
KDTREE_API int kdtree_mla_verify(const void* q_lat, const void* q_pe, const void* c_kv, const void* k_pe,
                                 const int32_t* context, const int32_t* tree_sizes, const int32_t* q_offsets,
                                 const int32_t* kv_offsets, const uint32_t* visibility, int vis_words, void* o_lat,
                                 float* lse, float* part_o, float* part_lse, int batch, int total_tokens, int heads,
                                 int kv_lora, int rope_dim, int max_tree, int num_splits, int split_keys, float scale,
                                 int in_dtype, int out_dtype, int generic, cudaStream_t stream) {
    if (!q_lat || !q_pe || !c_kv || !k_pe || !context || !tree_sizes || !q_offsets || !kv_offsets || !visibility ||
        !o_lat || !lse)
        return KDTREE_BAD_POINTER;
    if (num_splits > 1 && (!part_o || !part_lse)) return KDTREE_BAD_POINTER;
    if (batch <= 0 || total_tokens <= 0 || heads <= 0 || kv_lora <= 0 || rope_dim <= 0 || max_tree <= 0 ||
        num_splits <= 0 || split_keys <= 0 || split_keys % 32 != 0 || vis_words <= 0 || vis_words * 32 < max_tree)
        return KDTREE_BAD_SHAPE;
    if ((in_dtype != kFloat32 && in_dtype != kBFloat16) || (out_dtype != kFloat32 && out_dtype != kBFloat16))
        return KDTREE_BAD_SHAPE;
    if (batch > 65535 || num_splits > kMaxSplits || (long long)total_tokens * heads > (1LL << 31) - 1 ||
        (long long)max_tree * heads > (1LL << 31) - 1)
        return KDTREE_BAD_LIMIT;
    MlaParams p;
    p.q_lat = q_lat; p.q_pe = q_pe; p.c_kv = c_kv; p.k_pe = k_pe;
    p.context = context; p.tree = tree_sizes; p.q_offsets = q_offsets; p.kv_offsets = kv_offsets;
    p.visibility = visibility; p.vis_words = vis_words;
    p.o_lat = o_lat; p.lse = lse; p.part_o = part_o; p.part_lse = part_lse;
    p.heads = heads; p.kv_lora = kv_lora; p.rope_dim = rope_dim;
    p.total_rows = total_tokens * heads;
    p.num_splits = num_splits; p.split_keys = split_keys;
    p.scale_log2 = scale * 1.44269504088896341f;
    return out_dtype == kBFloat16 ? launch<bf16>(p, batch, max_tree, in_dtype, generic != 0, stream)
                                  : launch<float>(p, batch, max_tree, in_dtype, generic != 0, stream);
}

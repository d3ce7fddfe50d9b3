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
//
// Four block kernels, the same math:
// - `mla_generic` (here): any dims, float32 or bf16 inputs; one warp per row, float32 CUDA cores.
// - `mla_k2_mma` (mla_mma.cu): bf16 inputs at kv_lora 512, rope 64, on any GPU of compute
//   capability 8.0 and later; mma.sync m16n8k16 with float32 accumulation, keys by cp.async,
//   any page size.
// - `mla_k2_wgmma` (mla_wgmma.cu): the same inputs on Hopper when this library carries sm_90a
//   code; wgmma and TMA, contiguous keys or pages of 8, 16, 32 or a multiple of 64 slots; one
//   warpgroup scores every key tile.
// - `mla_k2_wgmma_pairs` (mla_wgmma_pairs.cu): the same on the same inputs, the two warpgroups
//   scoring alternate tiles (FlashMLA's seesaw); run only when asked for by name (`resolve`).
// `kdtree_mla_verify`'s `kernel` picks one (0: the fastest that takes the inputs here) at run
// time, by the device's compute capability and shared memory.

#include "mla_common.cuh"

#include <type_traits>

namespace kdtree_mla {
namespace {

// ------------------------------------------------------------------ generic path

constexpr int kGenericWarps = 4;
// Columns a lane holds: kv_lora up to 32 x kGenericLat (kGenericSmallLat: the small presets'
// instance), rope_dim up to 32 x kGenericRope.
constexpr int kGenericLat = 16, kGenericSmallLat = 2, kGenericRope = 2;

// A row's key list: the cached slots 0 .. context, then the row's visible tree tokens in order.
// Its length: context + the visible tree tokens of visibility row `token`.
__device__ int list_length(const MlaParams& p, int token, int context, int tree) {
    int visible = 0;
    for (int w = 0; w * 32 < tree; ++w) {
        const uint32_t word = p.visibility[(size_t)token * p.vis_words + w];
        visible += __popc(tree - w * 32 >= 32 ? word : word & ((1u << (tree - w * 32)) - 1u));
    }
    return context + visible;
}

// The keys a split of a row's list holds: split_keys, or with split_keys 0 (the invariant plan)
// the list cut into at most num_splits splits of whole 32-key blocks, sized from its length alone.
__device__ __forceinline__ int row_split_keys(const MlaParams& p, int length) {
    if (p.split_keys > 0) return p.split_keys;
    const int blocks = (length + 31) / 32;
    return 32 * max(1, (blocks + p.num_splits - 1) / p.num_splits);
}

// The slots of list positions [begin, end) of one row's key list, in order (`next`: the next
// slot, -1 past them).
struct KeyCursor {
    int position, end, context, tree, j;   // j: the next tree token to look at

    __device__ KeyCursor(const MlaParams& p, int token, int begin, int end_, int context_, int tree_)
        : position(begin), end(end_), context(context_), tree(tree_), j(0) {
        for (int rank = context; rank < begin && j < tree; ++j)      // skip the list's earlier tree keys
            rank += key_visible(p, token, context + j, context);
    }

    __device__ int next(const MlaParams& p, int token) {
        if (position >= end) return -1;
        if (position < context) return position++;
        for (; j < tree; ++j)
            if (key_visible(p, token, context + j, context)) { ++position; return context + j++; }
        return -1;
    }
};

// One warp per query row; lane i holds columns i, i + 32, ... of q, o and the key in flight
// (kLat of the latent, kRope of the rope part, zero past R and dr) in registers, and loads the
// next key while it folds this one. The score: each lane's products in column order (latent,
// then rope), then a butterfly sum, so every lane has the same; the online softmax runs per key.
// Splits cut the row's key list (not the slots): split y folds list positions
// [y * keys, (y + 1) * keys), keys = row_split_keys. With split_keys 0 a row's partials are a
// function of its list alone, whatever its tree's other tokens, the batch and the cache.
template <typename TIn, typename TOut, int kLat, int kRope>
__global__ void __launch_bounds__(kGenericWarps * 32) mla_generic(MlaParams p) {
    constexpr int kCols = kLat + kRope;
    const int b = blockIdx.z, split = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int tree = p.tree[b], context = p.context[b];
    const int local_row = blockIdx.x * kGenericWarps + warp;
    if (local_row >= tree * p.heads) return;
    const int row = p.q_offsets[b] * p.heads + local_row;
    const int token = row / p.heads;
    const int length = p.split_keys > 0 ? context + tree : list_length(p, token, context, tree);
    const int split_keys = row_split_keys(p, length);
    const int key_begin = split * split_keys;
    if (key_begin >= length) return;        // the combine reads no partial of it
    const int R = p.kv_lora, dr = p.rope_dim;

    // column i of a lane's kCols: latent lane + 32 i (i < kLat), else rope lane + 32 (i - kLat)
    auto load = [&](const TIn* lat, const TIn* rope, float (&v)[kCols]) {
#pragma unroll
        for (int i = 0; i < kCols; ++i) {
            const int d = lane + 32 * (i < kLat ? i : i - kLat);
            v[i] = i < kLat ? (d < R ? to_float(lat[d]) : 0.f) : (d < dr ? to_float(rope[d]) : 0.f);
        }
    };
    auto load_key = [&](int s, float (&v)[kCols]) {
        const size_t key_row = cache_row(p, b, s);
        load(static_cast<const TIn*>(p.c_kv) + key_row * R, static_cast<const TIn*>(p.k_pe) + key_row * dr, v);
    };
    float q[kCols], o[kLat], key[kCols], ahead[kCols];
    load(static_cast<const TIn*>(p.q_lat) + (size_t)row * R, static_cast<const TIn*>(p.q_pe) + (size_t)row * dr, q);
#pragma unroll
    for (int i = 0; i < kLat; ++i) o[i] = 0.f;

    float m = -CUDART_INF_F, l = 0.f;
    KeyCursor keys(p, token, key_begin, key_begin + split_keys, context, tree);
    int s = keys.next(p, token);
    if (s >= 0) load_key(s, key);
    while (s >= 0) {
        const int s_ahead = keys.next(p, token);
        if (s_ahead >= 0) load_key(s_ahead, ahead);          // in flight while this key folds
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < kCols; ++i) dot = fmaf(q[i], key[i], dot);
        for (int mask = 16; mask > 0; mask >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, mask);
        const float x = dot * p.scale_log2;
        const float m_new = fmaxf(m, x);
        const float alpha = exp2f(m - m_new);
        const float w = exp2f(x - m_new);
        l = l * alpha + w;
#pragma unroll
        for (int i = 0; i < kLat; ++i) o[i] = fmaf(o[i], alpha, w * key[i]);
        m = m_new;
#pragma unroll
        for (int i = 0; i < kCols; ++i) key[i] = ahead[i];
        s = s_ahead;
    }
    const float inv_l = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
    for (int i = 0; i < kLat; ++i)
        if (lane + 32 * i < R) store_one<TOut>(p, split, row, lane + 32 * i, o[i] * inv_l);
    if (lane == 0) store_lse(p, split, row, row_lse(m, l));
}

// ------------------------------------------------------------------ split combine

constexpr int kMaxSplits = 65535;  // the grid's y
constexpr int kCombineThreads = 128;

// The weight of a split with log-sum-exp lse when the largest is top: 0 for a split that saw no key.
__device__ __forceinline__ float split_weight(float lse, float top) {
    return top == -CUDART_INF_F ? 0.f : __expf(lse - top);
}

// Block = one query row: the first warp finds the largest lse and the sum of the weights
// w_i = exp(lse_i - max) (a split that saw no key weighs 0) and writes lse = max + log(sum_i w_i);
// then each thread merges its columns, o = sum_i w_i o_i / sum_i w_i in split order, reading the
// splits' partial rows coalesced.
template <typename TOut>
__global__ void __launch_bounds__(kCombineThreads) mla_combine(MlaParams p) {
    __shared__ float top_lse, inv_total;
    const int b = blockIdx.y, local_row = blockIdx.x;
    const int tree = p.tree[b], context = p.context[b];
    if (local_row >= tree * p.heads) return;
    const int row = p.q_offsets[b] * p.heads + local_row;
    const int length = p.split_keys > 0 ? context + tree : list_length(p, row / p.heads, context, tree);
    const int split_keys = row_split_keys(p, length);
    const int n_splits = min(p.num_splits, (length + split_keys - 1) / split_keys);
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        float mx = -CUDART_INF_F;
        for (int i = lane; i < n_splits; i += 32) mx = fmaxf(mx, p.part_lse[(size_t)i * p.total_rows + row]);
        for (int mask = 16; mask > 0; mask >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, mask));
        float total = 0.f;
        for (int i = lane; i < n_splits; i += 32) total += split_weight(p.part_lse[(size_t)i * p.total_rows + row], mx);
        for (int mask = 16; mask > 0; mask >>= 1) total += __shfl_xor_sync(0xffffffffu, total, mask);
        if (lane == 0) {
            top_lse = mx;
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
        for (int i = 0; i < n_splits; ++i)
            acc += split_weight(p.part_lse[(size_t)i * p.total_rows + row], top_lse) * part[i * split_stride + c];
        out[c] = from_float<TOut>(acc * inv_total);
    }
}

// Which tensor-core kernel the current device runs: 2 wgmma (compute capability 9.0 and this
// library carries sm_90a code), 1 mma.sync (compute capability 8.0 and later), 0 none.
int tensor_core_kind() {
    int device = 0, major = 0, minor = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess)
        return 0;
    if (major == 9 && minor == 0 && wgmma_built()) return 2;
    return major >= 8 ? 1 : 0;
}

enum MlaKernel : int { kAuto = 0, kCudaCores = 1, kMma = 2, kMmaSmall = 3, kWgmma = 4, kWgmmaPairs = 5 };

// kAuto takes the one-scorer wgmma kernel on Hopper, never the seesaw (kWgmmaPairs, run when
// asked for by name): with v4.1's softmax in both, the one-scorer kernel was the faster in 92
// of 96 cases, by 1.002-1.33x, and the seesaw at most 1.6% faster in the other 4 (H100,
// 2026-12-07, both forced in one run; docs/results/mla-peers-h100-v42.md).

// The kernel that runs `kernel` (kAuto resolved) for these inputs, or -1 when the one asked for cannot.
int resolve(const MlaParams& p, int in_dtype, int kernel) {
    const bool k2 = in_dtype == kBFloat16 && p.kv_lora == kK2Lora && p.rope_dim == kK2Rope;
    bool aligned = true;  // cp.async and TMA read 16-byte chunks
    for (const void* t : {p.q_lat, p.q_pe, p.c_kv, p.k_pe}) aligned = aligned && reinterpret_cast<uintptr_t>(t) % 16 == 0;
    const int kind = k2 && aligned ? tensor_core_kind() : 0;
    switch (kernel) {
        case kAuto:
            if (kind == 2 && wgmma_layout(p)) return kWgmma;
            return kind >= 1 ? kMma : kCudaCores;
        case kCudaCores: return kCudaCores;
        case kMma:
        case kMmaSmall: return kind >= 1 ? kernel : -1;
        case kWgmma:
        case kWgmmaPairs: return kind == 2 && wgmma_layout(p) ? kernel : -1;
        default: return -1;
    }
}

template <typename TOut>
int launch(const MlaParams& p, int batch, int max_tree, long long cache_rows, int in_dtype, int kernel,
           cudaStream_t stream) {
    const long long max_rows = (long long)max_tree * p.heads;
    const int chosen = p.split_keys == 0 ? (kernel == kAuto || kernel == kCudaCores ? kCudaCores : -1)
                                         : resolve(p, in_dtype, kernel);
    if (chosen < 0) return KDTREE_BAD_KERNEL;
    int status;
    if (chosen == kCudaCores) {
        if (p.kv_lora > 32 * kGenericLat || p.rope_dim > 32 * kGenericRope) return KDTREE_BAD_LIMIT;
        const dim3 grid((unsigned)((max_rows + kGenericWarps - 1) / kGenericWarps), p.num_splits, batch);
        const bool small = p.kv_lora <= 32 * kGenericSmallLat;
        constexpr int threads = kGenericWarps * 32;
        if (in_dtype == kBFloat16 && small)
            mla_generic<bf16, TOut, kGenericSmallLat, kGenericRope><<<grid, threads, 0, stream>>>(p);
        else if (in_dtype == kBFloat16)
            mla_generic<bf16, TOut, kGenericLat, kGenericRope><<<grid, threads, 0, stream>>>(p);
        else if (small)
            mla_generic<float, TOut, kGenericSmallLat, kGenericRope><<<grid, threads, 0, stream>>>(p);
        else
            mla_generic<float, TOut, kGenericLat, kGenericRope><<<grid, threads, 0, stream>>>(p);
        status = kdtree_launch_status();
    } else {
        const dim3 grid((unsigned)((max_rows + kTileRows - 1) / kTileRows), p.num_splits, batch);
        constexpr bool out_bf16 = std::is_same<TOut, bf16>::value;
        status = chosen >= kWgmma ? launch_wgmma(p, grid, cache_rows, out_bf16, chosen == kWgmmaPairs, stream)
                                  : launch_mma(p, grid, chosen == kMmaSmall, out_bf16, stream);
    }
    if (status != 0 || p.num_splits == 1) return status;
    mla_combine<TOut><<<dim3((unsigned)max_rows, batch), kCombineThreads, 0, stream>>>(p);
    return kdtree_launch_status();
}

}  // namespace
}  // namespace kdtree_mla

// The tensor-core kernel bf16 inputs at K2 dims take on the current device: 2 wgmma (Hopper,
// this library carries sm_90a code), 1 mma.sync (compute capability 8.0 and later), 0 none.
KDTREE_API int kdtree_mla_tensor_cores() { return kdtree_mla::tensor_core_kind(); }

// Tree-verify MLA attention (see the top of this file). in_dtype / out_dtype: 0 float32,
// 1 bfloat16 (q_lat, q_pe, c_kv, k_pe share in_dtype). cache_rows: the rows of c_kv and k_pe
// (P * page_size for pools). Keys: kv_offsets (contiguous; block_table null) or block_table
// [batch, table_stride] with page_size >= 1 (paged; kv_offsets unused); a paged wgmma launch
// needs split_keys to be a multiple of min(page_size, 64).
// num_splits * split_keys must cover every request's keys; split_keys is a multiple of 32, or 0
// (the CUDA cores only, kernel 0 or 1): each row's key list is cut into at most num_splits splits
// of whole 32-key blocks sized from its length alone (the invariant plan); with num_splits > 1,
// part_o [num_splits, T * H, kv_lora] and part_lse [num_splits, T * H] float32 are scratch. The
// CUDA cores take kv_lora <= 512 and rope_dim <= 64 (KDTREE_BAD_LIMIT). kernel: 0 the fastest for these inputs on this device (bf16 at K2 dims
// with 16-byte aligned pointers: wgmma where it runs and reads the layout, else mma.sync on
// compute capability 8.0 and later; anything else the CUDA cores), 1 the CUDA cores, 2 mma.sync
// with the tiles this device's shared memory holds, 3 mma.sync with the tiles of 100 KB GPUs,
// 4 wgmma (one scorer), 5 wgmma in pairs (the seesaw); KDTREE_BAD_KERNEL when the one asked for
// cannot run these inputs here.
// Grid: one block per 64 (tensor cores) or 4 (CUDA cores) rows of the longest tree, per split,
// per request.
KDTREE_API int kdtree_mla_verify(const void* q_lat, const void* q_pe, const void* c_kv, const void* k_pe,
                                 const int32_t* context, const int32_t* tree_sizes, const int32_t* q_offsets,
                                 const int32_t* kv_offsets, const int32_t* block_table, int table_stride,
                                 int page_size, const uint32_t* visibility, int vis_words, void* o_lat,
                                 float* lse, float* part_o, float* part_lse, int batch, int total_tokens,
                                 long long cache_rows, int heads, int kv_lora, int rope_dim, int max_tree,
                                 int num_splits, int split_keys, float scale, int in_dtype, int out_dtype, int kernel,
                                 cudaStream_t stream) {
    using namespace kdtree_mla;
    if (!q_lat || !q_pe || !c_kv || !k_pe || !context || !tree_sizes || !q_offsets || !(kv_offsets || block_table) ||
        !visibility || !o_lat || !lse)
        return KDTREE_BAD_POINTER;
    if (block_table && (table_stride <= 0 || page_size <= 0)) return KDTREE_BAD_SHAPE;
    if (num_splits > 1 && (!part_o || !part_lse)) return KDTREE_BAD_POINTER;
    if (batch <= 0 || total_tokens <= 0 || cache_rows <= 0 || heads <= 0 || kv_lora <= 0 || rope_dim <= 0 ||
        max_tree <= 0 || num_splits <= 0 || split_keys < 0 || split_keys % 32 != 0 || vis_words <= 0 ||
        vis_words * 32 < max_tree)
        return KDTREE_BAD_SHAPE;
    if ((in_dtype != kFloat32 && in_dtype != kBFloat16) || (out_dtype != kFloat32 && out_dtype != kBFloat16))
        return KDTREE_BAD_SHAPE;
    if (!(scale > 0.f && scale <= 3.4e38f)) return KDTREE_BAD_VALUE;  // the kernels take a row's max before scaling
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
               ? launch<bf16>(p, batch, max_tree, cache_rows, in_dtype, kernel, stream)
               : launch<float>(p, batch, max_tree, cache_rows, in_dtype, kernel, stream);
}

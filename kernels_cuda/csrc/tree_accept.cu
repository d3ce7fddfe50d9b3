// Greedy accept (DDTREE_CONTRACT.md section 6) and in-place KV compaction (section 7).
//
// accept:  parents, tokens, choices int64 [batch, width], n [batch]
//            -> accepted int64 [batch, cols] (padding -1), accept_len [batch], next_root [batch]
//          One warp per request: from the root, step to the child j (parents[j] == cur,
//          tokens[j] == choices[cur]; the smallest such j) while one exists and the path
//          fits in cols; next_root = choices[cur].
// compact: c_kv and k_pe (any element type, rows given in bytes) in one of two layouts,
//          contiguous [layers, batch, slots, row] (request b's slot s is row s of [l, b]) or
//          paged [layers, pages, page_size, row] with block_table int32 [batch, table_stride]
//          (slot s is row s % page_size of page block_table[b, s / page_size]; `slot_row`),
//          for every layer and request in one launch:
//          slot start + k <- slot start + accepted[k] for k < accept_len, in increasing k.
//          Each thread owns a column of 16-, 4- or 2-byte units and walks k in order, so the
//          in-place copy is exactly the sequential one (right for non-prefix paths such as
//          [0, 2, 5]). Entries that break the contract (accepted[k] < k, a source slot past
//          the request's slots or table, a table entry outside [0, pages), accept_len outside
//          [0, cols]) are skipped, never written out of bounds.
#include "common.cuh"

namespace {

constexpr int kWarps = 4;

__global__ void __launch_bounds__(kWarps * 32) accept_greedy_kernel(
    const int64_t* __restrict__ parents, const int64_t* __restrict__ tokens, const int64_t* __restrict__ n,
    const int64_t* __restrict__ choices, int batch, int width, int cols, int64_t* accepted, int64_t* accept_len,
    int64_t* next_root) {
    const int b = blockIdx.x * kWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (b >= batch) return;
    const size_t row = static_cast<size_t>(b) * width;
    const int nb = static_cast<int>(min64(n[b], width - 1));
    int cur = 0, len = 1;
    while (len < cols) {
        const int64_t want = choices[row + cur];
        int found = -1;
        for (int base = cur + 1; base <= nb && found < 0; base += 32) {
            const int j = base + lane;
            const bool match = j <= nb && parents[row + j] == cur && tokens[row + j] == want;
            const unsigned ballot = __ballot_sync(0xFFFFFFFFu, match);
            if (ballot) found = base + __ffs(ballot) - 1;
        }
        if (found < 0) break;
        if (lane == 0) accepted[static_cast<size_t>(b) * cols + len] = found;
        cur = found;
        ++len;
    }
    for (int k = lane; k < cols; k += 32)
        if (k == 0 || k >= len) accepted[static_cast<size_t>(b) * cols + k] = k == 0 ? 0 : -1;
    if (lane == 0) {
        accept_len[b] = len;
        next_root[b] = choices[row + cur];
    }
}

struct CompactArgs {
    unsigned char* cache[2];    // c_kv, k_pe
    int row_bytes[2];
    int batch, cols;
    int slots;                  // contiguous: slots per request; paged: page_size
    const int32_t* block_table; // [batch, table_stride], or null: the contiguous layout
    int table_stride, pages;
    const int64_t* starts;
    const int64_t* accepted;
    const int64_t* accept_len;
};

// The row (of a cache viewed as [rows, row_bytes]) of request b's slot s in `layer`, or -1
// where the slot has none (past the request's slots or its table, or a table entry outside
// [0, pages)).
__device__ __forceinline__ int64_t slot_row(const CompactArgs& a, int layer, int b, int64_t s) {
    if (!a.block_table) return s < a.slots ? (static_cast<int64_t>(layer) * a.batch + b) * a.slots + s : -1;
    if (s >= static_cast<int64_t>(a.table_stride) * a.slots) return -1;
    const int page = a.block_table[static_cast<size_t>(b) * a.table_stride + s / a.slots];
    return page >= 0 && page < a.pages ? (static_cast<int64_t>(layer) * a.pages + page) * a.slots + s % a.slots : -1;
}

template <typename U>
__device__ void compact_rows(U* cache, int units, const CompactArgs& a, int layer, int b, int64_t start,
                             const int64_t* path, int len) {
    for (int c = threadIdx.x; c < units; c += blockDim.x) {
        for (int k = 1; k < len; ++k) {
            const int64_t src = path[k];
            if (src <= k) continue;
            const int64_t to = slot_row(a, layer, b, start + k), from = slot_row(a, layer, b, start + src);
            if (to >= 0 && from >= 0) cache[to * units + c] = cache[from * units + c];
        }
    }
}

// grid (batch, layers, 2): blockIdx.z picks the cache (0 c_kv, 1 k_pe).
__global__ void compact_kv_kernel(CompactArgs a) {
    const int b = blockIdx.x, layer = blockIdx.y, which = blockIdx.z;
    const int64_t start = a.starts[b];
    const int len = static_cast<int>(min64(a.accept_len[b], a.cols));
    if (start < 0 || len <= 1) return;
    const int bytes = which ? a.row_bytes[1] : a.row_bytes[0];  // selects, not a run-time index (no local memory)
    unsigned char* cache = which ? a.cache[1] : a.cache[0];
    const int64_t* path = a.accepted + static_cast<size_t>(b) * a.cols;
    if (bytes % 16 == 0 && reinterpret_cast<uintptr_t>(cache) % 16 == 0)
        compact_rows(reinterpret_cast<uint4*>(cache), bytes / 16, a, layer, b, start, path, len);
    else if (bytes % 4 == 0 && reinterpret_cast<uintptr_t>(cache) % 4 == 0)
        compact_rows(reinterpret_cast<uint32_t*>(cache), bytes / 4, a, layer, b, start, path, len);
    else
        compact_rows(reinterpret_cast<uint16_t*>(cache), bytes / 2, a, layer, b, start, path, len);
}

}  // namespace

// cols = accepted's columns (>= 1); a path longer than cols stops at cols nodes.
KDTREE_API int kdtree_accept_greedy(const int64_t* parents, const int64_t* tokens, const int64_t* n,
                                    const int64_t* choices, int batch, int width, int cols, int64_t* accepted,
                                    int64_t* accept_len, int64_t* next_root, cudaStream_t stream) {
    if (batch < 0 || width < 1 || cols < 1) return KDTREE_BAD_SHAPE;
    if (batch == 0) return KDTREE_OK;
    if (!parents || !tokens || !n || !choices || !accepted || !accept_len || !next_root) return KDTREE_BAD_POINTER;
    accept_greedy_kernel<<<(batch + kWarps - 1) / kWarps, kWarps * 32, 0, stream>>>(
        parents, tokens, n, choices, batch, width, cols, accepted, accept_len, next_root);
    return kdtree_launch_status();
}

// Row sizes in bytes (even); layers * batch * 2 CTAs. Contiguous (block_table null): caches
// [layers, batch, slots, row]. Paged: caches [layers, pages, slots = page_size, row] and
// block_table [batch, table_stride].
KDTREE_API int kdtree_compact_kv(void* c_kv, void* k_pe, int layers, int batch, int slots, int c_kv_row_bytes,
                                 int k_pe_row_bytes, const int64_t* starts, const int64_t* accepted, int cols,
                                 const int64_t* accept_len, const int32_t* block_table, int table_stride, int pages,
                                 cudaStream_t stream) {
    if (layers < 0 || batch < 0 || slots < 0 || cols < 1 || c_kv_row_bytes < 0 || k_pe_row_bytes < 0 ||
        c_kv_row_bytes % 2 || k_pe_row_bytes % 2 || (block_table && (table_stride < 1 || pages < 0)))
        return KDTREE_BAD_SHAPE;
    if (layers == 0 || batch == 0 || slots == 0 || (block_table && pages == 0)) return KDTREE_OK;
    if (!c_kv || !k_pe || !starts || !accepted || !accept_len) return KDTREE_BAD_POINTER;
    if (layers > 65535) return KDTREE_BAD_LIMIT;
    CompactArgs a{{static_cast<unsigned char*>(c_kv), static_cast<unsigned char*>(k_pe)},
                  {c_kv_row_bytes, k_pe_row_bytes}, batch, cols, slots, block_table,
                  block_table ? table_stride : 0, block_table ? pages : 0, starts, accepted, accept_len};
    compact_kv_kernel<<<dim3(batch, layers, 2), 128, 0, stream>>>(a);
    return kdtree_launch_status();
}

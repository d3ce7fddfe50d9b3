// Greedy accept (DDTREE_CONTRACT.md section 6) and in-place KV compaction (section 7).
//
// accept:  parents, tokens, choices int64 [batch, width], n [batch]
//            -> accepted int64 [batch, cols] (padding -1), accept_len [batch], next_root [batch]
//          One warp per request: from the root, step to the child j (parents[j] == cur,
//          tokens[j] == choices[cur]; the smallest such j) while one exists and the path
//          fits in cols; next_root = choices[cur].
// compact: c_kv [layers, batch, max_len, row_a] and k_pe [layers, batch, max_len, row_b] (any
//          element type, rows given in bytes), for every layer and request in one launch:
//          slot start + k <- slot start + accepted[k] for k < accept_len, in increasing k.
//          Each thread owns a column of 16-, 4- or 2-byte units and walks k in order, so the
//          in-place copy is exactly the sequential one (right for non-prefix paths such as
//          [0, 2, 5]). Entries that break the contract (accepted[k] < k, a source slot past
//          max_len, accept_len outside [0, cols]) are skipped, never written out of bounds.
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
    int batch, max_len, cols;
    const int64_t* starts;
    const int64_t* accepted;
    const int64_t* accept_len;
};

template <typename U>
__device__ void compact_rows(U* base, int units, int64_t start, const int64_t* path, int len, int max_len) {
    for (int c = threadIdx.x; c < units; c += blockDim.x) {
        for (int k = 1; k < len; ++k) {
            const int64_t src = path[k];
            if (src == k || src < k || start + src >= max_len) continue;
            base[(start + k) * units + c] = base[(start + src) * units + c];
        }
    }
}

// grid (batch, layers, 2): blockIdx.z picks the cache (0 c_kv, 1 k_pe).
__global__ void compact_kv_kernel(CompactArgs a) {
    const int b = blockIdx.x, layer = blockIdx.y, which = blockIdx.z;
    const int64_t start = a.starts[b];
    const int len = static_cast<int>(min64(a.accept_len[b], a.cols));
    if (start < 0 || len <= 1) return;
    const int bytes = a.row_bytes[which];
    unsigned char* base =
        a.cache[which] + (static_cast<size_t>(layer) * a.batch + b) * static_cast<size_t>(a.max_len) * bytes;
    const int64_t* path = a.accepted + static_cast<size_t>(b) * a.cols;
    if (bytes % 16 == 0 && reinterpret_cast<uintptr_t>(a.cache[which]) % 16 == 0)
        compact_rows(reinterpret_cast<uint4*>(base), bytes / 16, start, path, len, a.max_len);
    else if (bytes % 4 == 0 && reinterpret_cast<uintptr_t>(a.cache[which]) % 4 == 0)
        compact_rows(reinterpret_cast<uint32_t*>(base), bytes / 4, start, path, len, a.max_len);
    else
        compact_rows(reinterpret_cast<uint16_t*>(base), bytes / 2, start, path, len, a.max_len);
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

// Row sizes in bytes (even); layers * batch * 2 CTAs.
KDTREE_API int kdtree_compact_kv(void* c_kv, void* k_pe, int layers, int batch, int max_len, int c_kv_row_bytes,
                                 int k_pe_row_bytes, const int64_t* starts, const int64_t* accepted, int cols,
                                 const int64_t* accept_len, cudaStream_t stream) {
    if (layers < 0 || batch < 0 || max_len < 0 || cols < 1 || c_kv_row_bytes < 0 || k_pe_row_bytes < 0 ||
        c_kv_row_bytes % 2 || k_pe_row_bytes % 2)
        return KDTREE_BAD_SHAPE;
    if (layers == 0 || batch == 0 || max_len == 0) return KDTREE_OK;
    if (!c_kv || !k_pe || !starts || !accepted || !accept_len) return KDTREE_BAD_POINTER;
    if (layers > 65535) return KDTREE_BAD_LIMIT;
    CompactArgs a{{static_cast<unsigned char*>(c_kv), static_cast<unsigned char*>(k_pe)},
                  {c_kv_row_bytes, k_pe_row_bytes}, batch, max_len, cols, starts, accepted, accept_len};
    compact_kv_kernel<<<dim3(batch, layers, 2), 128, 0, stream>>>(a);
    return kdtree_launch_status();
}

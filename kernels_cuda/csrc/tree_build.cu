// Best-first DDTree build (DDTREE_CONTRACT.md section 3) and compile (section 4), one CTA per request.
//
// build:   topk_lp float32 [batch, L, K], topk_id int64 [batch, L, K], budgets [batch], roots [batch]
//            -> n [batch], parents, tokens, depths int64 [batch, width], scores float64 [batch, width]
// compile: parents, depths [batch, width], n [batch], starts [batch]
//            -> positions, first_child, next_sibling int64 [batch, width],
//               visibility_bits int32 [batch, width, W], W = ceil(width / 32)
//
// Column 0 is the root; columns 1 .. n[b] the nodes in pop order; padding columns hold -1
// (scores -inf, positions -1, first_child/next_sibling -1) and their visibility row sees
// itself only. Every output element is written.
//
// The heap runs in one thread on shared memory: a node's rank path is never stored; on an
// exact score tie the two candidates' paths are rebuilt by walking parents (depth <= 32).
// A popped node's sibling replaces the heap top (one sift-down for pop + push).
#include "common.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int kMaxDepth = 32;
constexpr int kMaxWidth = 4096;     // 12-bit parent and rank fields

__device__ __forceinline__ uint32_t pack(int parent, int depth, int rank) {
    return static_cast<uint32_t>(parent) | (static_cast<uint32_t>(rank) << 12) | (static_cast<uint32_t>(depth) << 24);
}
__device__ __forceinline__ int parent_of(uint32_t p) { return p & 0xFFF; }
__device__ __forceinline__ int rank_of(uint32_t p) { return (p >> 12) & 0xFFF; }
__device__ __forceinline__ int depth_of(uint32_t p) { return p >> 24; }

struct BuildSmem {
    float* lp;          // [L, Kb] this request's top-k log-probs
    int* parent;        // [width]
    uint32_t* node;     // [width] pack(parent, depth, rank) per node
    double* score;      // [width]
    double* heap_score; // [width + 1], 1-based
    uint32_t* heap_key; // [width + 1]
};

// Rank path of candidate p (ranks from depth 1 to its depth) into ranks[]; returns its length.
__device__ int rank_path(uint32_t p, const uint32_t* node, int* ranks) {
    int d = depth_of(p);
    ranks[d - 1] = rank_of(p);
    for (int v = parent_of(p); v != 0; v = parent_of(node[v])) ranks[depth_of(node[v]) - 1] = rank_of(node[v]);
    return d;
}

// Rank path of candidate pa < that of pb (lexicographic; out of line: only exact score ties get here).
__device__ __noinline__ bool path_less(uint32_t pa, uint32_t pb, const uint32_t* node) {
    if (parent_of(pa) == parent_of(pb)) return rank_of(pa) < rank_of(pb);
    int ra[kMaxDepth], rb[kMaxDepth];
    int la = rank_path(pa, node, ra), lb = rank_path(pb, node, rb);
    for (int i = 0; i < min(la, lb); ++i)
        if (ra[i] != rb[i]) return ra[i] < rb[i];
    return la < lb;
}

// Contract order: the higher score first; on equal scores the lexicographically smaller rank path.
__device__ __forceinline__ bool better(double sa, uint32_t pa, double sb, uint32_t pb, const uint32_t* node) {
    return sa != sb ? sa > sb : path_less(pa, pb, node);
}

__device__ void sift_down(BuildSmem& s, int size, double sc, uint32_t key) {
    int i = 1;
    for (int c = 2; c <= size; c = 2 * i) {
        if (c + 1 <= size && better(s.heap_score[c + 1], s.heap_key[c + 1], s.heap_score[c], s.heap_key[c], s.node)) ++c;
        if (!better(s.heap_score[c], s.heap_key[c], sc, key, s.node)) break;
        s.heap_score[i] = s.heap_score[c];
        s.heap_key[i] = s.heap_key[c];
        i = c;
    }
    s.heap_score[i] = sc;
    s.heap_key[i] = key;
}

__device__ void sift_up(BuildSmem& s, int i, double sc, uint32_t key) {
    for (int p = i / 2; i > 1 && better(sc, key, s.heap_score[p], s.heap_key[p], s.node); p = i / 2) {
        s.heap_score[i] = s.heap_score[p];
        s.heap_key[i] = s.heap_key[p];
        i = p;
    }
    s.heap_score[i] = sc;
    s.heap_key[i] = key;
}

// The serial best-first loop (thread 0). Returns n, the non-root nodes built.
__device__ int best_first(BuildSmem& s, int L, int Kb, int budget) {
    s.node[0] = pack(0, 0, 0);
    s.score[0] = 0.0;
    int size = 0, n = 0;
    if (L > 0 && Kb > 0 && budget > 0) {
        size = 1;
        s.heap_score[1] = static_cast<double>(s.lp[0]);
        s.heap_key[1] = pack(0, 1, 0);
    }
    while (size > 0 && n < budget) {
        const double sc = s.heap_score[1];
        const uint32_t key = s.heap_key[1];
        const int parent = parent_of(key), d = depth_of(key), r = rank_of(key);
        ++n;
        s.node[n] = key;
        s.score[n] = sc;
        if (r + 1 < Kb) {
            sift_down(s, size, s.score[parent] + static_cast<double>(s.lp[(d - 1) * Kb + r + 1]), pack(parent, d, r + 1));
        } else {
            --size;
            if (size > 0) sift_down(s, size, s.heap_score[size + 1], s.heap_key[size + 1]);
        }
        if (d < L) {
            ++size;
            sift_up(s, size, sc + static_cast<double>(s.lp[d * Kb]), pack(n, d + 1, 0));
        }
    }
    return n;
}

// Compile outputs for one request from parent[0 .. width) in shared memory (-1 beyond n).
__device__ void compile_request(const int* parent, const int64_t* depths, int n, int width, int64_t start,
                                int64_t* positions, int32_t* bits, int64_t* first_child, int64_t* next_sibling) {
    const int words = (width + 31) / 32;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        const bool real = i <= n;
        positions[i] = real ? start + depths[i] : -1;
        int32_t* row = bits + static_cast<size_t>(i) * words;
        int a = i;                                        // ancestors come in decreasing index order
        for (int w = words - 1; w >= 0; --w) {
            uint32_t word = 0;
            while (a >= 0 && (a >> 5) == w) {
                word |= 1u << (a & 31);
                a = real ? parent[a] : -1;
            }
            row[w] = static_cast<int32_t>(word);
        }
        int64_t child = -1, sibling = -1;
        if (real) {
            const int p = parent[i];
            for (int k = i + 1; k <= n && (child < 0 || (sibling < 0 && p >= 0)); ++k) {
                if (child < 0 && parent[k] == i) child = k;
                if (sibling < 0 && p >= 0 && parent[k] == p) sibling = k;
            }
        }
        first_child[i] = child;
        next_sibling[i] = sibling;
    }
}

struct BuildArgs {
    const float* topk_lp;
    const int64_t* topk_id;
    const int64_t* budgets;
    const int64_t* roots;
    int L, K, width;
    int64_t* n;
    int64_t* parents;
    int64_t* tokens;
    int64_t* depths;
    double* scores;
    const int64_t* starts;      // null: no compile outputs
    int64_t* positions;
    int32_t* bits;
    int64_t* first_child;
    int64_t* next_sibling;
};

__host__ __device__ inline int staged_k(int K, int width) { return min(K, width - 1); }

__host__ __device__ inline size_t build_smem_bytes(int L, int K, int width) {
    return sizeof(double) * (2 * width + 1) + sizeof(uint32_t) * (2 * width + 1) + sizeof(int) * width +
           sizeof(float) * L * staged_k(K, width);
}

__global__ void __launch_bounds__(kThreads) build_trees_kernel(BuildArgs a) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int b = blockIdx.x, width = a.width, L = a.L;
    BuildSmem s;
    s.score = reinterpret_cast<double*>(smem_raw);
    s.heap_score = s.score + width;
    s.heap_key = reinterpret_cast<uint32_t*>(s.heap_score + width + 1);
    s.node = s.heap_key + width + 1;
    s.parent = reinterpret_cast<int*>(s.node + width);
    s.lp = reinterpret_cast<float*>(s.parent + width);
    __shared__ int n_shared;

    const int budget = static_cast<int>(min64(max64(a.budgets[b], 0), width - 1));
    const int Kb = min(a.K, budget);                      // ranks >= budget are never popped
    const float* lp = a.topk_lp + static_cast<size_t>(b) * L * a.K;
    for (int i = threadIdx.x; i < L * Kb; i += blockDim.x) s.lp[i] = lp[(i / Kb) * a.K + i % Kb];
    __syncthreads();
    if (threadIdx.x == 0) n_shared = best_first(s, L, Kb, budget);
    __syncthreads();
    const int n = n_shared;

    const size_t row = static_cast<size_t>(b) * width;
    const int64_t* ids = a.topk_id + static_cast<size_t>(b) * L * a.K;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        const uint32_t key = s.node[i];
        const bool real = i <= n;
        const int d = depth_of(key);
        const int p = i == 0 ? -1 : parent_of(key);
        s.parent[i] = real ? p : -1;
        a.parents[row + i] = real ? p : -1;
        a.depths[row + i] = real ? d : -1;
        a.scores[row + i] = real ? s.score[i] : -INFINITY;
        a.tokens[row + i] = i == 0 ? a.roots[b] : real ? ids[(d - 1) * a.K + rank_of(key)] : -1;
    }
    if (threadIdx.x == 0) a.n[b] = n;
    if (a.starts == nullptr) return;
    __syncthreads();
    compile_request(s.parent, a.depths + row, n, width, a.starts[b], a.positions + row,
                    a.bits + row * ((width + 31) / 32), a.first_child + row, a.next_sibling + row);
}

__global__ void __launch_bounds__(kThreads) compile_trees_kernel(
    const int64_t* __restrict__ parents, const int64_t* __restrict__ depths, const int64_t* __restrict__ n,
    const int64_t* __restrict__ starts, int width, int64_t* positions, int32_t* bits, int64_t* first_child,
    int64_t* next_sibling) {
    extern __shared__ int parent_s[];
    const int b = blockIdx.x;
    const size_t row = static_cast<size_t>(b) * width;
    const int nb = static_cast<int>(min64(n[b], width - 1));
    for (int i = threadIdx.x; i < width; i += blockDim.x) parent_s[i] = i <= nb ? static_cast<int>(parents[row + i]) : -1;
    __syncthreads();
    compile_request(parent_s, depths + row, nb, width, starts[b], positions + row,
                    bits + row * ((width + 31) / 32), first_child + row, next_sibling + row);
}

// The device's opt-in shared memory per block, read once per device.
int max_smem_optin() {
    static int cached[64] = {};
    int device = 0;
    cudaGetDevice(&device);
    if (device >= 64) device = 63;
    if (cached[device] == 0) cudaDeviceGetAttribute(&cached[device], cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    return cached[device];
}

}  // namespace

// Builds `batch` trees; width = columns of the outputs (>= 1; a budget above width - 1 is
// capped there). starts == null skips the compile outputs (positions, bits, first_child,
// next_sibling may then be null). L <= 32, K < 4096, width <= 4096.
KDTREE_API int kdtree_build_trees(const float* topk_lp, const int64_t* topk_id, int batch, int L, int K,
                                  const int64_t* budgets, const int64_t* roots, int width, int64_t* n,
                                  int64_t* parents, int64_t* tokens, int64_t* depths, double* scores,
                                  const int64_t* starts, int64_t* positions, int32_t* bits,
                                  int64_t* first_child, int64_t* next_sibling, cudaStream_t stream) {
    if (batch < 0 || L < 0 || K < 0 || width < 1) return KDTREE_BAD_SHAPE;
    if (L > kMaxDepth || K >= kMaxWidth || width > kMaxWidth) return KDTREE_BAD_LIMIT;
    if (batch == 0) return KDTREE_OK;
    if (!budgets || !roots || !n || !parents || !tokens || !depths || !scores || (L * K > 0 && (!topk_lp || !topk_id)))
        return KDTREE_BAD_POINTER;
    if (starts && (!positions || !bits || !first_child || !next_sibling)) return KDTREE_BAD_POINTER;
    const size_t smem = build_smem_bytes(L, K, width);
    if (smem > static_cast<size_t>(max_smem_optin())) return KDTREE_BAD_LIMIT;
    cudaError_t err = cudaFuncSetAttribute(build_trees_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem));
    if (err != cudaSuccess) return static_cast<int>(err);
    BuildArgs a{topk_lp, topk_id, budgets, roots, L, K, width, n, parents, tokens, depths, scores,
                starts, positions, bits, first_child, next_sibling};
    build_trees_kernel<<<batch, kThreads, smem, stream>>>(a);
    return kdtree_launch_status();
}

// Compiles `batch` trees of `width` columns (n[b] <= width - 1).
KDTREE_API int kdtree_compile_trees(const int64_t* parents, const int64_t* depths, const int64_t* n,
                                    const int64_t* starts, int batch, int width, int64_t* positions, int32_t* bits,
                                    int64_t* first_child, int64_t* next_sibling, cudaStream_t stream) {
    if (batch < 0 || width < 1) return KDTREE_BAD_SHAPE;
    if (width > kMaxWidth) return KDTREE_BAD_LIMIT;
    if (batch == 0) return KDTREE_OK;
    if (!parents || !depths || !n || !starts || !positions || !bits || !first_child || !next_sibling)
        return KDTREE_BAD_POINTER;
    compile_trees_kernel<<<batch, kThreads, sizeof(int) * width, stream>>>(parents, depths, n, starts, width,
                                                                         positions, bits, first_child, next_sibling);
    return kdtree_launch_status();
}

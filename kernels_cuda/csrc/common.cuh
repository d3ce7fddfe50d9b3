// Shared by every kernels_cuda source: the launch status convention.
//
// Each exported launcher is `extern "C" int kdtree_...(..., cudaStream_t stream)`
// and returns 0 on success, a positive cudaError_t from the launch, or one of the
// negative kdtree statuses below for arguments the kernel cannot take.
// `kdtree_status_string(code)` (tree_status.cu) names any of them.
#pragma once

#include <cuda_runtime.h>
#include <cstdint>

#define KDTREE_API extern "C" __attribute__((visibility("default")))

enum KdtreeStatus : int {
    KDTREE_OK = 0,
    KDTREE_BAD_SHAPE = -1,      // a size is negative, zero where it must not be, or too large
    KDTREE_BAD_LIMIT = -2,      // a size exceeds a compile-time limit of the kernel
    KDTREE_BAD_POINTER = -3,    // a required pointer is null
    KDTREE_BAD_TENSOR_MAP = -4, // the driver rejected a TMA tensor map (unaligned pointer or stride)
    KDTREE_BAD_KERNEL = -5,     // the kernel asked for cannot run these inputs on this device
    KDTREE_BAD_VALUE = -6,      // a scalar argument is out of its range (e.g. a scale that is not finite and positive)
};

// The status of the last launch on this thread (0 when it was accepted).
inline int kdtree_launch_status() { return static_cast<int>(cudaGetLastError()); }

__host__ __device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

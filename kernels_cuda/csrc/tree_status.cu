// kdtree_status_string: the message for any launcher's return value.
#include "common.cuh"

KDTREE_API const char* kdtree_status_string(int code) {
    switch (code) {
        case KDTREE_OK: return "ok";
        case KDTREE_BAD_SHAPE: return "bad shape argument";
        case KDTREE_BAD_LIMIT: return "size exceeds a kernel limit";
        case KDTREE_BAD_POINTER: return "null pointer argument";
        case KDTREE_BAD_TENSOR_MAP: return "TMA tensor map rejected by the driver (unaligned pointer or stride)";
        case KDTREE_BAD_KERNEL: return "the kernel asked for cannot run these inputs on this device";
        case KDTREE_BAD_VALUE: return "a scalar argument is out of its range";
        default: return code > 0 ? cudaGetErrorString(static_cast<cudaError_t>(code)) : "unknown kdtree status";
    }
}

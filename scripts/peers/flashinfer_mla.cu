// FlashInfer's paged MLA attention (BatchMLAPagedAttention) behind a C ABI of our own, for
// tests/kernels/peers (ctypes) to time beside kdtree's MLA verify kernel without FlashInfer's
// Python package, its JIT or tvm-ffi. scripts/build_flashinfer_mla.sh compiles it against the
// pinned FlashInfer headers: twice, once per kernel family, into one library.
//
// - Built with FIMLA_SM90 (sm_90a only): fimla_run_fa3, FlashInfer's Hopper kernel
//   (include/flashinfer/attention/mla_hopper.cuh; the "fa3" backend its wrapper picks on SM90).
// - Built without: fimla_plan (scheduler.cuh's MLAPlan: the split schedule, computed on the host
//   into the pinned workspace, then copied here to the device workspace, once per shape), fimla_run_fa2
//   (include/flashinfer/attention/mla.cuh, FlashInfer's "fa2" backend) and fimla_last_error.
//
// Fixed here as in the JIT module FlashInfer generates for Kimi K2: bf16 queries, keys and output,
// int32 indices, latent 512, rope 64. Pointers and strides (in elements) are those of
// BatchMLAPagedAttentionRun (csrc/batch_mla_run.cu of FlashInfer): q_nope / q_pe [n, heads, d],
// ckv / kpe [pages, page_size, d], o [n, heads, 512], except that q_nope and q_pe share their
// strides, as do ckv and kpe (in our layout both are parts of one 576-wide row); kv_indices: the
// pages of request b from kv_indptr[b] (in pages). causal: query i of a request with qo_len queries and kv_len keys sees
// keys 0 .. kv_len - qo_len + i (right-aligned); otherwise every key. Each entry point returns 0,
// or a non-zero code with the reason in fimla_last_error().
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include <flashinfer/attention/mla_params.cuh>
#include <flashinfer/attention/scheduler.cuh>
#ifdef FIMLA_SM90
#include <flashinfer/attention/mla_hopper.cuh>
#else
#include <flashinfer/attention/mla.cuh>
#endif

using namespace flashinfer;
using Params = MLAParams<nv_bfloat16, nv_bfloat16, nv_bfloat16, int32_t>;
constexpr uint32_t CKV = 512, KPE = 64;
constexpr int PLAN_FIELDS = 18;  // MLAPlanInfo::ToVector()

void fimla_set_error(const std::string& message);  // defined in the build without FIMLA_SM90

namespace {

// The kernel's parameters from the plan's offsets into the two workspaces (as BatchMLAPagedAttentionRun).
Params make_params(const int64_t* plan_vec, void* float_ws, void* int_ws, const void* q_nope, const void* q_pe,
                   uint32_t q_stride_n, uint32_t q_stride_h, const void* ckv, const void* kpe,
                   uint32_t kv_stride_page, uint32_t kv_stride_n, const int32_t* kv_indices, void* o,
                   uint32_t o_stride_n, uint32_t o_stride_h, float* lse, uint32_t num_heads,
                   uint32_t page_size, float sm_scale) {
  MLAPlanInfo plan;
  plan.FromVector(std::vector<int64_t>(plan_vec, plan_vec + PLAN_FIELDS));
  auto at = [&](int64_t offset) { return GetPtrFromBaseOffset<int32_t>(int_ws, offset); };
  Params p;
  p.q_nope = static_cast<nv_bfloat16*>(const_cast<void*>(q_nope));
  p.q_pe = static_cast<nv_bfloat16*>(const_cast<void*>(q_pe));
  p.ckv = static_cast<nv_bfloat16*>(const_cast<void*>(ckv));
  p.kpe = static_cast<nv_bfloat16*>(const_cast<void*>(kpe));
  p.q_indptr = at(plan.q_indptr_offset);
  p.kv_indptr = at(plan.kv_indptr_offset);
  p.partial_indptr = at(plan.partial_indptr_offset);
  p.kv_indices = const_cast<int32_t*>(kv_indices);
  p.q_len = at(plan.q_len_offset);
  p.kv_len = at(plan.kv_len_offset);
  p.q_start = at(plan.q_start_offset);
  p.kv_start = at(plan.kv_start_offset);
  p.kv_end = at(plan.kv_end_offset);
  p.work_indptr = at(plan.work_indptr_offset);
  p.merge_packed_offset_start = at(plan.merge_packed_offset_start_offset);
  p.merge_packed_offset_end = at(plan.merge_packed_offset_end_offset);
  p.merge_partial_packed_offset_start = at(plan.merge_partial_packed_offset_start_offset);
  p.merge_partial_packed_offset_end = at(plan.merge_partial_packed_offset_end_offset);
  p.merge_partial_stride = at(plan.merge_partial_stride_offset);
  p.final_o = static_cast<nv_bfloat16*>(o);
  p.final_lse = lse;
  p.partial_o = GetPtrFromBaseOffset<nv_bfloat16>(float_ws, plan.partial_o_offset);
  p.partial_lse = GetPtrFromBaseOffset<float>(float_ws, plan.partial_lse_offset);
  p.num_heads = uint_fastdiv(num_heads);
  p.block_size = uint_fastdiv(page_size);
  p.q_nope_stride_n = p.q_pe_stride_n = q_stride_n;
  p.q_nope_stride_h = p.q_pe_stride_h = q_stride_h;
  p.ckv_stride_page = p.kpe_stride_page = kv_stride_page;
  p.ckv_stride_n = p.kpe_stride_n = kv_stride_n;
  p.o_stride_n = o_stride_n;
  p.o_stride_h = o_stride_h;
  p.sm_scale = sm_scale;
  p.return_lse_base_on_e = false;
  return p;
}

template <typename Launch>
int guarded(const char* what, Launch launch) {
  try {
    cudaError_t status = launch();
    if (status != cudaSuccess) {
      fimla_set_error(std::string(what) + ": " + cudaGetErrorString(status));
      return static_cast<int>(status);
    }
    return 0;
  } catch (const std::exception& exc) {
    fimla_set_error(std::string(what) + ": " + exc.what());
    return -1;
  }
}

}  // namespace

#define FIMLA_RUN_ARGS                                                                            \
  const int64_t *plan, void *float_ws, void *int_ws, const void *q_nope, const void *q_pe,       \
      uint32_t q_stride_n, uint32_t q_stride_h, const void *ckv, const void *kpe,                 \
      uint32_t kv_stride_page, uint32_t kv_stride_n, const int32_t *kv_indices, void *o,          \
      uint32_t o_stride_n, uint32_t o_stride_h, float *lse, int causal, uint32_t num_heads,       \
      uint32_t page_size, float sm_scale, cudaStream_t stream
#define FIMLA_PARAMS                                                                                \
  make_params(plan, float_ws, int_ws, q_nope, q_pe, q_stride_n, q_stride_h, ckv, kpe, kv_stride_page, \
              kv_stride_n, kv_indices, o, o_stride_n, o_stride_h, lse, num_heads, page_size, sm_scale)

// extern "C" int NAME(FIMLA_RUN_ARGS): mla::KERNEL<mask, CKV, KPE> over the plan's grid, the mask
// causal or none.
#define FIMLA_DEFINE_RUN(NAME, KERNEL)                                                             \
  extern "C" int NAME(FIMLA_RUN_ARGS) {                                                            \
    return guarded(#KERNEL, [&] {                                                                  \
      Params p = FIMLA_PARAMS;                                                                     \
      const uint32_t x = plan[0], y = plan[1];                                                     \
      return causal ? mla::KERNEL<MaskMode::kCausal, CKV, KPE>(p, x, y, stream)                    \
                    : mla::KERNEL<MaskMode::kNone, CKV, KPE>(p, x, y, stream);                     \
    });                                                                                            \
  }

#ifdef FIMLA_SM90

FIMLA_DEFINE_RUN(fimla_run_fa3, BatchMLAPageAttentionHopper)

#else

namespace {
thread_local std::string last_error;
}
void fimla_set_error(const std::string& message) { last_error = message; }
extern "C" const char* fimla_last_error() { return last_error.c_str(); }

// plan: int64[18] out. int_ws_host: page-locked, as large as int_ws (int_ws_bytes). MLAPlan (0.7.4)
// only writes the schedule there and says how many bytes it staged: FlashInfer's Python side
// (jit/attention/modules.py, _BatchMLAModuleProxy) copies them to int_ws. We copy them on stream and
// wait for the copy, so int_ws_host may be reused or freed on return (plans are made once per shape).
// qo_indptr, kv_indptr (in pages), kv_len: host arrays of batch + 1, batch + 1, batch entries.
extern "C" int fimla_plan(int64_t* plan, void* float_ws, size_t float_ws_bytes, void* int_ws,
                          void* int_ws_host, size_t int_ws_bytes, const int32_t* qo_indptr,
                          const int32_t* kv_indptr, const int32_t* kv_len, uint32_t batch,
                          uint32_t num_heads, int causal, cudaStream_t stream) {
  return guarded("MLAPlan", [&] {
    MLAPlanInfo info;
    size_t staged_bytes = 0;  // how much of int_ws_host the schedule fills
    cudaError_t status =
        MLAPlan<int32_t>(float_ws, float_ws_bytes, int_ws, int_ws_host, int_ws_bytes, info, staged_bytes,
                         const_cast<int32_t*>(qo_indptr), const_cast<int32_t*>(kv_indptr),
                         const_cast<int32_t*>(kv_len), batch, num_heads, CKV, causal, stream);
    if (status == cudaSuccess)
      status = cudaMemcpyAsync(int_ws, int_ws_host, staged_bytes, cudaMemcpyHostToDevice, stream);
    if (status == cudaSuccess) status = cudaStreamSynchronize(stream);
    if (status == cudaSuccess) {
      std::vector<int64_t> vec = info.ToVector();
      std::copy(vec.begin(), vec.end(), plan);
    }
    return status;
  });
}

FIMLA_DEFINE_RUN(fimla_run_fa2, BatchMLAPagedAttention)

#endif

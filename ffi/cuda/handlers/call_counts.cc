#include "cuda/handlers/call_counts.h"

#include <atomic>

namespace jmo::cuda {
namespace {

constexpr int kOps = static_cast<int>(HandlerOp::kCount);

// Indexed by HandlerOp.
constexpr const char* kTargets[kOps] = {"jmo_dispatch",       "jmo_dispatch_gemm", "jmo_expert_combine",
                                        "jmo_exchange_counts", "jmo_gather_rs",     "jmo_grouped_matmul",
                                        "jmo_grouped_outer",   "jmo_grouped_matmul_swiglu",
                                        "jmo_grouped_matmul_swiglu_grad", "jmo_grouped_matmul_fp8",
                                        "jmo_grouped_outer_fp8", "jmo_quantize_columns_fp8",
                                        "jmo_quantize_weight_fp8", "jmo_swiglu_backward_fp8",
                                        "jmo_swiglu_forward_fp8", "jmo_grouped_matmul_swiglu_fp8"};

std::atomic<uint64_t> g_calls[kOps];
std::atomic<uint64_t> g_captured[kOps];

}  // namespace

void NoteHandlerCall(HandlerOp op, cudaStream_t stream) {
  const int i = static_cast<int>(op);
  g_calls[i].fetch_add(1, std::memory_order_relaxed);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    // Counted as not captured; cleared so that the launcher's own query (and launch-error check) reports it.
    cudaGetLastError();
    return;
  }
  if (status == cudaStreamCaptureStatusActive) g_captured[i].fetch_add(1, std::memory_order_relaxed);
}

std::vector<HandlerCalls> HandlerCallCounts() {
  std::vector<HandlerCalls> out;
  for (int i = 0; i < kOps; ++i)
    out.push_back({kTargets[i], g_calls[i].load(std::memory_order_relaxed),
                   g_captured[i].load(std::memory_order_relaxed)});
  return out;
}

}  // namespace jmo::cuda

// How often each XLA:CUDA handler of this library ran on the host, and how many of those runs traced it into a CUDA
// graph. XLA's command buffers record a custom call by running its handler once on a capturing stream and then
// replay the graph with no host code of ours, so a step whose calls were captured shows host runs far below its call
// count, some of them captured; the GPU tests and the decode benchmark read the counts (cuda_handler_calls) to show
// that a program's custom calls ran inside CUDA graphs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

namespace jmo::cuda {

enum class HandlerOp : int {
  kDispatch,
  kDispatchGemm,
  kExpertCombine,
  kExchangeCounts,
  kGatherRs,
  kGroupedMatmul,
  kGroupedOuter,
  kGroupedMatmulSwiGlu,
  kGroupedMatmulSwiGluGrad,
  kGroupedMatmulFp8,
  kGroupedOuterFp8,
  kQuantizeColumnsFp8,
  kQuantizeWeightFp8,
  kSwiGluBackwardFp8,
  kSwiGluForwardFp8,
  kGroupedMatmulSwiGluFp8,
  kCount
};

// Counts one host run of `op`'s handler on `stream`, and whether the stream was capturing.
void NoteHandlerCall(HandlerOp op, cudaStream_t stream);

struct HandlerCalls {
  const char* target;  // the custom call target ("jmo_dispatch", ...)
  uint64_t calls;      // host runs since the process started
  uint64_t captured;   // of which on a capturing stream (traced into a CUDA graph)
};
std::vector<HandlerCalls> HandlerCallCounts();

}  // namespace jmo::cuda

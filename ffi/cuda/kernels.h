// Host entry points of the two primitives on CUDA (DESIGN §3, §5). Plain C++: used by the XLA FFI handlers
// (handlers_cuda.cc) and by the loopback test harness (loopback.cc), so both run exactly the same code.
//
// All pointers are device pointers (operands of the custom call); every call only enqueues work on `stream`,
// except after a failure (RecoverIfAborted synchronizes). A failure inside the kernels (a timed-out wait, an invalid
// routing input found on the device) is reported by the *next* call of the same rank, with rank, peer, stage and
// counts: the kernels run asynchronously, so the call that fails cannot know yet.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/workspace_cuda.h"

namespace jmo::cuda {

enum class DType { kF32, kBF16 };

struct CallOptions {
  int64_t timeout_ms = 10000;
  int32_t delay_rank = -1;  // testing aid: this rank spins delay_us on its device at the start of every call
  int64_t delay_us = 0;
};

struct CallSite {
  Workspace* ws;
  int group, rank;
  cudaStream_t stream;
  CallOptions opts;
};

// dispatch: rows src[slot_src_row[p]] -> peer slot_dest_rank[p]'s recv row slot_dest_row[p] (-1: dropped); waits for
// this rank's *expected rows, then writes out [cap, D] (rows past *expected are zero).
Status Dispatch(const CallSite& c, DType dt, const void* src, int64_t S, int64_t D, const int32_t* slot_src_row,
                const int32_t* slot_dest_rank, const int32_t* slot_dest_row, int64_t P, const int32_t* recv_expected,
                const int32_t* group_op, const int32_t* rank_op, void* out, int64_t cap);

// expert_combine: producer = grouped GEMM lhs[segment] @ w[expert] over the (expert, source) segments in
// OrderSegments order; consumer = pushes each finished band to its source's ret rows; then
// y[t] = sum_j gates[t, j] * ret[slot_ret_row[t*k + j]] (fixed order j = 0..k-1), slot_out[p] = ret[...] if given.
Status ExpertCombine(const CallSite& c, DType dt, const void* lhs, int64_t cap, int64_t K, const void* w, int64_t E_l,
                     int64_t N, const float* gates, int64_t T, int64_t k, const int32_t* seg_rows,
                     const int32_t* seg_ret_off, const int32_t* slot_ret_row, const int32_t* ret_expected,
                     const int32_t* group_op, const int32_t* rank_op, void* y, void* slot_out);

// Loads every kernel on device `dev` and sets the expert kernel's shared memory (once per device). Workspace::Create
// calls it: with CUDA's lazy module loading, a kernel loaded at its first launch can wait for kernels already running,
// and ours spin on each other across ranks sharing a device.
Status PrepareKernels(int dev);

// Which producer path ExpertCombine takes for these operands: "mma.sync bf16" (tensor cores, sm80+) or
// "simt fp32" (float32 operands, or shapes the tensor-core path does not take: K or N not a multiple of 8).
const char* ProducerPath(DType dt, int64_t K, int64_t N, const void* lhs, const void* w);

}  // namespace jmo::cuda

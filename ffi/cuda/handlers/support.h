// What every XLA:CUDA handler of this library needs between the FFI and the kernels' host API: the Status -> FFI
// error mapping and selecting the device that owns XLA's stream. (The dtype comes mapped with the shape checks of
// common/: DTypeOf in call_signature.h.)
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/api.h"
#include "cuda/workspace/workspace.h"
#include "xla/ffi/api/ffi.h"

namespace jmo::cuda {

inline xla::ffi::Error ToFfi(const Status& s) {
  namespace ffi = xla::ffi;
  if (s.ok()) return ffi::Error::Success();
  ffi::ErrorCode code = ffi::ErrorCode::kInternal;
  switch (s.code) {
    case kInvalidArgument: code = ffi::ErrorCode::kInvalidArgument; break;
    case kDeadlineExceeded: code = ffi::ErrorCode::kDeadlineExceeded; break;
    case kFailedPrecondition: code = ffi::ErrorCode::kFailedPrecondition; break;
    default: break;
  }
  return ffi::Error(code, s.msg);
}

// Launch on the device that owns XLA's stream (XLA makes its context current; be explicit anyway).
inline Status UseDevice(int32_t ordinal) {
  int cur = -1;
  // A failed query is cleared (cudaSetDevice below reports what matters), not left for a later launch check to blame.
  if (cudaGetDevice(&cur) != cudaSuccess) (void)cudaGetLastError();
  else if (cur == ordinal) return Status{};
  return CudaStatus(cudaSetDevice(ordinal), "cudaSetDevice");
}

}  // namespace jmo::cuda

// What every XLA:CUDA handler of this library needs between the FFI and the kernels' host API: the Status -> FFI
// error mapping, the dtype mapping, and selecting the device that owns XLA's stream.
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

inline DType ToDType(xla::ffi::DataType t) { return t == xla::ffi::DataType::F32 ? DType::kF32 : DType::kBF16; }

// Launch on the device that owns XLA's stream (XLA makes its context current; be explicit anyway).
inline Status UseDevice(int32_t ordinal) {
  int cur = -1;
  if (cudaGetDevice(&cur) == cudaSuccess && cur == ordinal) return Status{};
  return CudaStatus(cudaSetDevice(ordinal), "cudaSetDevice");
}

}  // namespace jmo::cuda

// nanobind bindings of the CUDA side, called from ffi/module.cc when the extension is built with nvcc.
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>

namespace jmo::cuda {

// Adds cuda_registrations(), create_cuda_workspace(...), the CUDA workspace queries and the GEMM engine selection
// (select_gemm_engine, gemm_engine_device_refusal, gemm_engine_operand_refusal).
void RegisterModule(nanobind::module_& m);

// Whether `handle` names a CUDA workspace (their handles live in a range of their own), and releasing one.
bool IsCudaWorkspaceHandle(int64_t handle);
bool ReleaseCudaWorkspace(int64_t handle);

}  // namespace jmo::cuda

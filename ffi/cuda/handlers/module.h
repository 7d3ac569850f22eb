// nanobind bindings of the CUDA side, called from ffi/module.cc when the extension is built with nvcc.
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>

namespace jmo::cuda {

// Adds cuda_registrations(), create_cuda_workspace(...), cuda_producer_path(...) and the CUDA workspace queries.
void RegisterModule(nanobind::module_& m);

// Whether `handle` names a CUDA workspace (their handles live in a range of their own), and releasing one.
bool IsCudaWorkspaceHandle(int64_t handle);
bool ReleaseCudaWorkspace(int64_t handle);

}  // namespace jmo::cuda

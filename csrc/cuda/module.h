// nanobind bindings of the CUDA side, called from csrc/module.cc when the extension is built with nvcc.
#pragma once

#include <nanobind/nanobind.h>

namespace jmo::cuda {

// Adds cuda_registrations(), create_cuda_workspace(...), cuda_producer_path(...) and makes release_workspace()
// release CUDA workspaces too.
void RegisterModule(nanobind::module_& m);

}  // namespace jmo::cuda

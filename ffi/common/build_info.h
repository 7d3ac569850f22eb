// What this build of the extension was compiled with, as name -> text pairs for jax_moe_overlap.build_info(). The
// build system passes the facts as JMO_BUILD_* definitions (CMakeLists.txt, ffi/cuda/CMakeLists.txt); a fact the
// build did not give reads "".
#pragma once

#include <map>
#include <string>

#include "xla/ffi/api/c_api.h"

#ifndef JMO_BUILD_CXX_COMPILER
#define JMO_BUILD_CXX_COMPILER ""
#endif
#ifndef JMO_BUILD_TYPE
#define JMO_BUILD_TYPE ""
#endif
#ifndef JMO_BUILD_JAX_VERSION
#define JMO_BUILD_JAX_VERSION ""
#endif
#ifndef JMO_BUILD_CUDA_VERSION
#define JMO_BUILD_CUDA_VERSION ""
#endif
#ifndef JMO_BUILD_CUDA_ARCHS
#define JMO_BUILD_CUDA_ARCHS ""
#endif
#ifndef JMO_BUILD_CUDA_COMPILER
#define JMO_BUILD_CUDA_COMPILER ""
#endif

namespace jmo {

inline std::map<std::string, std::string> BuildInfo() {
#ifdef JMO_WITH_CUDA
  const char* cuda = "1";
#else
  const char* cuda = "0";
#endif
  return {
      {"cuda", cuda},
      {"cuda_version", JMO_BUILD_CUDA_VERSION},
      {"cuda_archs", JMO_BUILD_CUDA_ARCHS},
      {"cuda_compiler", JMO_BUILD_CUDA_COMPILER},
      {"cxx_compiler", JMO_BUILD_CXX_COMPILER},
      {"build_type", JMO_BUILD_TYPE},
      {"jax_version", JMO_BUILD_JAX_VERSION},
      {"xla_ffi_api", std::to_string(XLA_FFI_API_MAJOR) + "." + std::to_string(XLA_FFI_API_MINOR)},
  };
}

}  // namespace jmo

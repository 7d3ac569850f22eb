// The dtypes of the library's rows and GEMM operands, and what every size and check needs to know of one, as one
// table: the CPU handlers, the CUDA ops and the GEMM engine selection (cuda/gemm/engine.h) all read it. Plain C++
// (no XLA, no CUDA), so that every part of ffi/ and the tools can include it.
//
// A new dtype is a row of kDTypeTraits (and an entry of DType), its XLA element type in DTypeOf
// (common/call_signature.h), its conversions (common/bf16.h's kind on the host, cuda/device/convert.cuh on the
// device), and the kernels that take it.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace jmo {

enum class DType : uint8_t { kF32, kBF16 };

// Which GEMM engines take a dtype as operands: bit e for the CUDA library's engine e (GemmEngine of
// cuda/gemm/engine.h, whose engine 0 is the SIMT engine). A dtype that every engine takes says so with kEveryEngine,
// so that an engine added for a new architecture takes it without an edit here.
using EngineMask = uint32_t;
inline constexpr EngineMask kSimtEngineOnly = 1u;
inline constexpr EngineMask kEveryEngine = ~0u;

struct DTypeTraits {
  const char* name;        // as NumPy and JAX name it
  int elem_bytes;          // bytes per element
  int channels_per_scale;  // a row carries one float32 scale per this many channels besides its elements; 0: none
  EngineMask engines;      // the GEMM engines that take it as operands
};

// Indexed by DType. float32 runs on the SIMT engine only: the tensor-core engines take 16-bit operands.
inline constexpr DTypeTraits kDTypeTraits[] = {
    {"float32", 4, 0, kSimtEngineOnly},
    {"bfloat16", 2, 0, kEveryEngine},
};
inline constexpr int kDTypeCount = static_cast<int>(sizeof(kDTypeTraits) / sizeof(kDTypeTraits[0]));
static_assert(kDTypeCount == static_cast<int>(DType::kBF16) + 1, "one row of kDTypeTraits per DType");

constexpr const DTypeTraits& Traits(DType d) { return kDTypeTraits[static_cast<int>(d)]; }

// Bytes of one row of `channels` elements as the workspace holds and ships it: its elements and its scales.
constexpr int64_t RowBytes(DType d, int64_t channels) {
  const DTypeTraits& t = Traits(d);
  const int64_t scales = t.channels_per_scale > 0 ? (channels + t.channels_per_scale - 1) / t.channels_per_scale : 0;
  return channels * t.elem_bytes + scales * static_cast<int64_t>(sizeof(float));
}

// The dtype of this name (DTypeTraits::name); false if none has it.
inline bool DTypeNamed(std::string_view name, DType* d) {
  for (int i = 0; i < kDTypeCount; ++i)
    if (name == kDTypeTraits[i].name) {
      *d = static_cast<DType>(i);
      return true;
    }
  return false;
}

// "float32 or bfloat16": every dtype's name, for the errors that refuse another one.
inline std::string DTypeNames() {
  std::string s;
  for (int i = 0; i < kDTypeCount; ++i)
    s += std::string(i == 0 ? "" : i + 1 == kDTypeCount ? " or " : ", ") + kDTypeTraits[i].name;
  return s;
}

}  // namespace jmo

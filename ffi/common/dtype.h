// The dtypes of the library's rows and GEMM operands, and what every size and check needs to know of one, as one
// table: the CPU handlers, the CUDA ops and the GEMM engine selection (cuda/gemm/engine.h) all read it. Plain C++
// (no XLA, no CUDA), so that every part of ffi/ and the tools can include it.
//
// A new dtype is a row of kDTypeTraits (and an entry of DType), its XLA element type in DTypeOf
// (common/call_signature.h), its conversions (common/bf16.h's kind on the host, cuda/device/convert.cuh on the
// device), and the kernels that take it. A row format that the calls only move (no GEMM engine takes it: kNoEngine,
// MovedOnly) needs no conversions: the dispatch moves its rows as bytes (RowBytes), and every call that computes
// refuses it in its shape check (call_signature.h's ComputeDTypeOf).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace jmo {

enum class DType : uint8_t { kF32, kBF16, kE4M3Rows };

// Which GEMM engines take a dtype as operands: bit e for the CUDA library's engine e (GemmEngine of
// cuda/gemm/engine.h, whose engine 0 is the SIMT engine). A dtype that every engine takes says so with kEveryEngine,
// so that an engine added for a new architecture takes it without an edit here.
using EngineMask = uint32_t;
inline constexpr EngineMask kSimtEngineOnly = 1u;
inline constexpr EngineMask kEveryEngine = ~0u;
inline constexpr EngineMask kNoEngine = 0u;

struct DTypeTraits {
  const char* name;        // as NumPy and JAX name it
  int elem_bytes;          // bytes per element
  int channels_per_scale;  // a row carries one float32 scale per this many channels besides its elements; 0: none
  EngineMask engines;      // the GEMM engines that take it as operands
};

// Indexed by DType. float32 runs on the SIMT engine only: the tensor-core engines take 16-bit operands.
// kE4M3Rows: packed e4m3 rows, the wire format of quantization="fp8" (jax_moe_overlap/fp8.py's pack_rows): a row of D
// channels is its D e4m3 values' bytes, then its D / 128 float32 scales' bytes, in an XLA uint8 buffer [rows,
// D + D / 32]. The dispatch moves them unchanged and dispatch_gemm's FP8 form reads them where they land (beside e4m3
// w: its own operand rule, call_signature.h); no GemmEngine takes them (the other FP8 GEMMs take the unpacked values
// and scales as separate operands).
inline constexpr DTypeTraits kDTypeTraits[] = {
    {"float32", 4, 0, kSimtEngineOnly},
    {"bfloat16", 2, 0, kEveryEngine},
    {"uint8", 1, 128, kNoEngine},
};
inline constexpr int kDTypeCount = static_cast<int>(sizeof(kDTypeTraits) / sizeof(kDTypeTraits[0]));
static_assert(kDTypeCount == static_cast<int>(DType::kE4M3Rows) + 1, "one row of kDTypeTraits per DType");

constexpr const DTypeTraits& Traits(DType d) { return kDTypeTraits[static_cast<int>(d)]; }

// A row format the calls only move, unchanged: no GEMM engine takes it, no kernel converts it.
constexpr bool MovedOnly(DType d) { return Traits(d).engines == kNoEngine; }

// Whether a dtype's XLA buffer holds a row's bytes (its values and scales packed: one uint8 element per byte) rather
// than one element per channel.
constexpr bool Packed(DType d) { return Traits(d).channels_per_scale > 0; }

// Bytes of one row of `channels` elements as the workspace holds and ships it: its elements and its scales.
constexpr int64_t RowBytes(DType d, int64_t channels) {
  const DTypeTraits& t = Traits(d);
  const int64_t scales = t.channels_per_scale > 0 ? (channels + t.channels_per_scale - 1) / t.channels_per_scale : 0;
  return channels * t.elem_bytes + scales * static_cast<int64_t>(sizeof(float));
}

// The channels of a row whose XLA buffer row has `width` elements: width itself, or for a packed dtype (whose
// elements are the row's bytes) the channels whose RowBytes are `width`, in whole tiles of channels_per_scale; -1 if
// no number of whole tiles has that many bytes.
constexpr int64_t RowChannels(DType d, int64_t width) {
  const DTypeTraits& t = Traits(d);
  if (!Packed(d)) return width;
  const int64_t tile_bytes = t.channels_per_scale * t.elem_bytes + static_cast<int64_t>(sizeof(float));
  return width > 0 && width % tile_bytes == 0 ? width / tile_bytes * t.channels_per_scale : -1;
}

// The dtype of this name (DTypeTraits::name) that a GEMM takes (with `moved_too`, or a row format the calls only
// move); false if none has it.
inline bool DTypeNamed(std::string_view name, DType* d, bool moved_too = false) {
  for (int i = 0; i < kDTypeCount; ++i)
    if (name == kDTypeTraits[i].name && (moved_too || !MovedOnly(static_cast<DType>(i)))) {
      *d = static_cast<DType>(i);
      return true;
    }
  return false;
}

// "float32 or bfloat16": the names of the dtypes that GEMMs take (with `moved_too`, also the row formats the dispatch
// moves, each with what it holds), for the errors that refuse another one.
inline std::string DTypeNames(bool moved_too = false) {
  std::string s;
  int n = 0, count = 0;
  for (int i = 0; i < kDTypeCount; ++i) count += moved_too || !MovedOnly(static_cast<DType>(i));
  for (int i = 0; i < kDTypeCount; ++i) {
    const DType d = static_cast<DType>(i);
    if (!moved_too && MovedOnly(d)) continue;
    s += std::string(n == 0 ? "" : n + 1 == count ? " or " : ", ") + kDTypeTraits[i].name;
    if (Packed(d))
      s += " (packed e4m3 rows: D e4m3 values, then D / " + std::to_string(kDTypeTraits[i].channels_per_scale) +
           " float32 scales)";
    ++n;
  }
  return s;
}

}  // namespace jmo

// The attributes of the workspace calls, decoded once into one struct per call, which both platforms' handlers
// receive: every call's CallAttrs (the workspace handle and the CallOptions of common/call_options.h), and for
// dispatch_gemm and expert_combine their own besides. On the wire they are the custom call's scalar attributes, read
// here by name, each exactly once (jax_moe_overlap's call_site.RankInfo.attrs builds every call's from the CallConfig,
// the call wrappers add their own): a missing, mistyped or unknown attribute is a decoding error that names it.
//
// XLA_FFI_REGISTER_STRUCT_ATTR_DECODING would build a flat struct from its members in their order; these structs nest
// CallOptions (whose tuning nests again) and share its attributes between the calls, so they are read by name here.
#pragma once

#include <algorithm>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/call_options.h"
#include "xla/ffi/api/ffi.h"

namespace jmo {

// dispatch and exchange_counts take these alone.
struct CallAttrs {
  int64_t workspace;  // the workspace's handle
  CallOptions options;
};

struct DispatchGemmAttrs {
  CallAttrs call;
  bool transpose_rhs;  // w is [E_local, N, D], read transposed
  bool swiglu;         // GEMM1's SwiGLU epilogue (not with transpose_rhs: CheckDispatchGemm)
};

struct ExpertCombineAttrs {
  CallAttrs call;
  bool transpose_rhs;  // w is [E_local, N, K], read transposed
};

// Reads a call's attributes by name into fields; Error() says what did not fit.
class AttrReader {
 public:
  explicit AttrReader(const XLA_FFI_Attrs* attrs) : attrs_(attrs) {}

  template <typename T>
  void operator()(std::string_view name, T* field) {
    auto value = attrs_.get<T>(name);
    if (value.has_error()) {
      missing_ += (missing_.empty() ? "" : ", ") + std::string(name);
      return;
    }
    *field = *value;
    read_.push_back(name);
  }

  // Empty if every attribute read was there with its type and every attribute of the call was read; else which were
  // missing or mistyped, or which the call has that nothing reads.
  std::string Error() const {
    std::string unknown;
    for (std::string_view name : attrs_)
      if (std::find(read_.begin(), read_.end(), name) == read_.end())
        unknown += (unknown.empty() ? "" : ", ") + std::string(name);
    if (missing_.empty() && unknown.empty()) return {};
    return "jax_moe_overlap: the call's attributes " +
           (missing_.empty() ? "hold " + unknown + ", which it does not take" : "lack (or mistype) " + missing_);
  }

 private:
  xla::ffi::Dictionary attrs_;
  std::vector<std::string_view> read_;
  std::string missing_;
};

// Each struct's attributes, by name: CallOptions' fields under the names CallConfig's attributes have.
inline void ReadAttrs(AttrReader& r, CallAttrs* a) {
  CallOptions& o = a->options;
  r("workspace", &a->workspace);
  r("timeout_ms", &o.timeout_ms);
  r("first_call_timeout_ms", &o.first_call_timeout_ms);
  r("delay_rank", &o.delay_rank);
  r("delay_us", &o.delay_us);
  r("consumer_ctas", &o.consumer_ctas);
  r("serialize", &o.serialize);
  r("push_bulk_copy", &o.tuning.bulk_copy);
  r("push_slots", &o.tuning.push_slots);
  r("push_read_lag", &o.tuning.push_read_lag);
  r("push_issuers", &o.tuning.push_issuers);
  r("pushers", &o.pushers);
  r("x_recv_from_tiles", &o.x_recv_from_tiles);
}

inline void ReadAttrs(AttrReader& r, DispatchGemmAttrs* a) {
  ReadAttrs(r, &a->call);
  r("transpose_rhs", &a->transpose_rhs);
  r("swiglu", &a->swiglu);
}

inline void ReadAttrs(AttrReader& r, ExpertCombineAttrs* a) {
  ReadAttrs(r, &a->call);
  r("transpose_rhs", &a->transpose_rhs);
}

// A call's whole attribute set (XLA hands it over as a dictionary) as T.
template <typename T>
std::optional<T> DecodeAttrs(XLA_FFI_AttrType type, void* attrs, xla::ffi::DiagnosticEngine& diagnostic) {
  if (type != XLA_FFI_AttrType_DICTIONARY) return diagnostic.Emit("jax_moe_overlap: expected the call's attributes");
  AttrReader r(static_cast<const XLA_FFI_Attrs*>(attrs));
  T a{};
  ReadAttrs(r, &a);
  if (std::string e = r.Error(); !e.empty()) return diagnostic.Emit(e);
  return a;
}

}  // namespace jmo

// `.Attrs<T>()` in a binding (call_signature.h) decodes the call's attributes as T with these.
namespace xla::ffi {
template <>
struct AttrDecoding<jmo::CallAttrs> {
  using Type = jmo::CallAttrs;
  static std::optional<Type> Decode(XLA_FFI_AttrType t, void* a, DiagnosticEngine& d) {
    return jmo::DecodeAttrs<Type>(t, a, d);
  }
};
template <>
struct AttrDecoding<jmo::DispatchGemmAttrs> {
  using Type = jmo::DispatchGemmAttrs;
  static std::optional<Type> Decode(XLA_FFI_AttrType t, void* a, DiagnosticEngine& d) {
    return jmo::DecodeAttrs<Type>(t, a, d);
  }
};
template <>
struct AttrDecoding<jmo::ExpertCombineAttrs> {
  using Type = jmo::ExpertCombineAttrs;
  static std::optional<Type> Decode(XLA_FFI_AttrType t, void* a, DiagnosticEngine& d) {
    return jmo::DecodeAttrs<Type>(t, a, d);
  }
};
}  // namespace xla::ffi

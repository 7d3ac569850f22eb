// The engines' rules and the selection (engine.h). Each engine's two rules restate the checks of its own launch code
// (gemm/sm90/wgmma_grouped.cuh, wgmma_outer.cuh and the SwiGLU launch in ops/grouped_gemm.cu refuse what the wgmma
// rule refuses; gemm/sm80/mma_tile.cuh's tile needs what the mma.sync rule asks), so a call never selects an engine
// that then refuses it.
#include "cuda/gemm/engine.h"

#include <cstdint>

namespace jmo::cuda {
namespace {

constexpr int64_t kInt32Max = 0x7fffffff;

bool Aligned16(const GemmOperands& o) {
  return ((reinterpret_cast<uintptr_t>(o.lhs) | reinterpret_cast<uintptr_t>(o.rhs)) & 15) == 0;
}

const char* AnyDevice(ComputeCapability) { return nullptr; }

const char* Sm80OrNewer(ComputeCapability cc) {
  return cc.major >= 8 ? nullptr : "mma.sync bf16 needs compute capability 8.0 or newer";
}

const char* Hopper(ComputeCapability cc) {
  return cc.major == 9 ? nullptr : "the wgmma engine runs on Hopper GPUs only (compute capability 9.x)";
}

const char* SimtOperands(const GemmOperands& o) {
  return o.epilogue == GemmEpilogue::kNone ? nullptr : "the SIMT engine has no SwiGLU epilogues";
}

// The tile of gemm/sm80/mma_tile.cuh loads lhs and w rows as stored (lhs [*, K]; w [K, N], or [N, K] transposed;
// rhs [*, N] of the outer form) with 16-byte cp.async: both row lengths multiples of 8 elements, 16-byte aligned
// bases. Its stores check their alignment pair by pair, so N need not be a multiple of 8 when w is transposed.
const char* MmaSyncOperands(const GemmOperands& o) {
  if (o.epilogue != GemmEpilogue::kNone) return "the mma.sync engine has no SwiGLU epilogues";
  const int64_t w_row = o.form == GemmForm::kRows && o.transpose_rhs ? o.K : o.N;
  if (o.K % 8 != 0 || w_row % 8 != 0)
    return "the mma.sync engine needs lhs and w rows (as stored) of a multiple of 8 elements";
  if (!Aligned16(o)) return "the mma.sync engine needs 16-byte aligned operands";
  return nullptr;
}

// The wgmma loops read tiles of 64 k (or 64 rows of K in the outer form) and stores of 64-column groups through TMA
// maps, which need every extent >= 1, 16-byte aligned bases and 32-bit tile coordinates. The SwiGLU epilogue pairs
// the gate's and the up projection's 128-column halves and stores h in 16-column groups: 2F a multiple of 64, the
// same as F a multiple of 32. The SwiGLU-gradient epilogue has N = F (dh's columns) and writes bf16 only.
const char* WgmmaOperands(const GemmOperands& o) {
  if (o.M < 1 || o.K < 1 || o.N < 1) return "the wgmma engine needs every extent >= 1";
  if (o.K % 64 != 0 || o.N % 64 != 0)
    return "the wgmma engine needs K and N multiples of 64 (with the SwiGLU epilogue N = 2F: F a multiple of 32; "
           "with the SwiGLU-gradient epilogue N = F)";
  if (o.M > kInt32Max - 128 || o.K > kInt32Max || o.N > kInt32Max)
    return "the wgmma engine needs extents that fit its 32-bit tile coordinates";
  if (!Aligned16(o)) return "the wgmma engine needs 16-byte aligned operands";
  return nullptr;
}

struct EngineRules {
  const char* name;
  const char* (*device)(ComputeCapability);
  const char* (*operands)(const GemmOperands&);
};

// Indexed by GemmEngine.
constexpr EngineRules kRules[kGemmEngineCount] = {
    {"simt fp32", AnyDevice, SimtOperands},
    {"mma.sync bf16", Sm80OrNewer, MmaSyncOperands},
    {"wgmma bf16", Hopper, WgmmaOperands},
};

// The order SelectGemmEngine tries them in: the fastest first.
constexpr GemmEngine kPreference[kGemmEngineCount] = {GemmEngine::kWgmma, GemmEngine::kMmaSync, GemmEngine::kSimt};

const EngineRules& Rules(GemmEngine e) { return kRules[static_cast<int>(e)]; }

}  // namespace

const char* Fp8GroupedGemmDeviceRefusal(ComputeCapability cc) {
  return cc.major == 9 ? nullptr
                       : "the FP8 grouped GEMM needs Hopper FP8 tensor cores (compute capability 9.x, sm_90a code: "
                         "e4m3 wgmma)";
}

const char* Fp8DispatchGemmOperandRefusal(int64_t D, int64_t N) {
  if (D < 512 || D % 512 != 0)
    return "the FP8 dispatch_gemm kernel reads the packed rows by TMA at their stride of D + D/32 bytes, which TMA "
           "takes as a multiple of 16 bytes: d_model must be a multiple of 512";
  if (N < 128 || N % 128 != 0) return "the FP8 grouped GEMM takes N (w's columns) in whole 128-column blocks";
  return nullptr;
}

const char* GemmEngineName(GemmEngine e) { return Rules(e).name; }

std::optional<GemmEngine> GemmEngineNamed(std::string_view name) {
  for (int i = 0; i < kGemmEngineCount; ++i)
    if (name == kRules[i].name) return static_cast<GemmEngine>(i);
  return std::nullopt;
}

const char* GemmEngineDeviceRefusal(GemmEngine e, ComputeCapability cc) { return Rules(e).device(cc); }

const char* GemmEngineOperandRefusal(GemmEngine e, const GemmOperands& o) {
  if (((Traits(o.dtype).engines >> static_cast<int>(e)) & 1u) == 0)
    return "the engine does not take operands of this dtype";
  if (o.form == GemmForm::kOuter && (o.transpose_rhs || o.epilogue != GemmEpilogue::kNone))
    return "the outer form has neither a transposed rhs nor an epilogue";
  if (o.epilogue == GemmEpilogue::kSwiGlu && o.transpose_rhs)
    return "the SwiGLU epilogue reads w as stored [K, 2F], not transposed";
  if (o.epilogue == GemmEpilogue::kSwiGluGrad && o.dtype != DType::kBF16)
    return "the SwiGLU-gradient epilogue writes bfloat16 only";
  return Rules(e).operands(o);
}

const char* GemmEngineRefusal(GemmEngine e, ComputeCapability cc, const GemmOperands& o) {
  const char* why = GemmEngineDeviceRefusal(e, cc);
  return why != nullptr ? why : GemmEngineOperandRefusal(e, o);
}

std::optional<GemmEngine> SelectGemmEngine(ComputeCapability cc, const GemmOperands& o,
                                           std::optional<GemmEngine> refused) {
  for (GemmEngine e : kPreference)
    if (e != refused && GemmEngineRefusal(e, cc, o) == nullptr) return e;
  return std::nullopt;
}

}  // namespace jmo::cuda

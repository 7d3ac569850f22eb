// Which GEMM engine runs a GEMM: the one place that says which engine runs on which GPU and takes which operands.
// Every op that runs a GEMM (expert_combine's producer, dispatch_gemm, the bare grouped GEMMs), the nanobind module
// (so that Python asks instead of restating the rules) and the tools select here. Plain C++, no CUDA headers.
//
// Each engine states two rules, as flashinfer states a backend's compute capabilities apart from its problem
// checks: the devices it runs on, and the operands it takes; each rule answers nullptr (yes) or why not, a constant
// string, so that a selection builds no text and a caller that requires an engine can say why it does not apply.
// SelectGemmEngine tries the engines in preference order (wgmma, mma.sync, SIMT) and takes the first whose two rules
// both say yes, as tokamax's ragged_dot takes the first implementation that does not refuse the operands.
//
// A new architecture: its engine under gemm/sm<NN>/, its entry in GemmEngine and its two rules and preference in
// engine.cc. The dtypes it takes come from common/dtype.h (a dtype that every engine takes needs no edit there).
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include "common/dtype.h"

namespace jmo::cuda {

// The engines (the values are template arguments of the producer kernels, and bits of DTypeTraits::engines).
enum class GemmEngine : uint8_t {
  kSimt = 0,     // gemm/simt_tile.cuh: float32 FMA, any dtype, shape, alignment and device
  kMmaSync = 1,  // gemm/sm80/mma_tile.cuh: mma.sync m16n8k16 bf16, sm_80 and later
  kWgmma = 2,    // gemm/sm90/: wgmma + TMA, warp-specialized, Hopper
};
inline constexpr int kGemmEngineCount = 3;
static_assert((kSimtEngineOnly >> static_cast<int>(GemmEngine::kSimt)) & 1u, "bit 0 of an EngineMask is SIMT's");

// "wgmma bf16", "mma.sync bf16", "simt fp32": the names results and benchmarks report.
const char* GemmEngineName(GemmEngine e);
std::optional<GemmEngine> GemmEngineNamed(std::string_view name);

struct ComputeCapability {
  int major = 0, minor = 0;
};

// What a GEMM computes per group g of consecutive rows of lhs:
//   kRows:  out[rows of g] [*, N] = lhs[rows of g] [*, K] @ w[g] [K, N] (transpose_rhs: w[g] stored [N, K] and read
//           as its transpose); the reduction is over K.
//   kOuter: out[g] [K, N] = lhs[rows of g]^T @ rhs[rows of g], lhs [M, K], rhs [M, N]; the reduction is over the
//           group's rows (the weight gradient).
enum class GemmForm : uint8_t { kRows, kOuter };

// kSwiGlu (kRows only): N = 2F columns, the gate's F then the up projection's F, and the epilogue stores
// h = silu(gate) * up [*, F] (and optionally the float32 preactivation) instead of the N columns.
// kSwiGluGrad (kRows only): the GEMM is dh = d_out @ W2^T, N = F columns, and the epilogue stores the SwiGLU's input
// gradient da [*, 2F] (d_gate, then d_up, in lhs's dtype) from dh and the float32 preactivation a [*, 2F], instead
// of dh itself (the backward pass's GEMM; w in either layout).
enum class GemmEpilogue : uint8_t { kNone, kSwiGlu, kSwiGluGrad };

struct GemmOperands {
  DType dtype;  // of lhs and w (rhs)
  GemmForm form;
  int64_t M, K, N;  // M: rows of lhs (any count >= 1 where the caller does not know it yet)
  bool transpose_rhs = false;
  GemmEpilogue epilogue = GemmEpilogue::kNone;
  const void* lhs = nullptr;  // the operands' addresses, for the alignment the tensor-core engines need (nullptr:
  const void* rhs = nullptr;  // checked as aligned, as XLA's buffers are)
};

// nullptr if engine e runs on a device of this compute capability, else why not.
const char* GemmEngineDeviceRefusal(GemmEngine e, ComputeCapability cc);

// nullptr if engine e takes these operands, else why not.
const char* GemmEngineOperandRefusal(GemmEngine e, const GemmOperands& o);

// nullptr if engine e runs on the device and takes the operands, else why not: what a caller that requires e reports.
const char* GemmEngineRefusal(GemmEngine e, ComputeCapability cc, const GemmOperands& o);

// nullptr if the FP8 block-scaled grouped GEMM (gemm/sm90/wgmma_grouped_fp8.cuh: e4m3 wgmma, Hopper's FP8 tensor
// cores) runs on a device of this compute capability, else why not. It is no GemmEngine (it takes e4m3 operands
// with their scales, which no other engine does, so there is nothing to select among).
const char* Fp8GroupedGemmDeviceRefusal(ComputeCapability cc);

// nullptr if dispatch_gemm's FP8 kernel (ops/dispatch_gemm.cu over Fp8PackedRowsOperands) takes packed e4m3 rows of
// D channels and w of N columns (besides the FP8 grouped GEMM's device rule and the call's shape rules), else why not.
const char* Fp8DispatchGemmOperandRefusal(int64_t D, int64_t N);

// The first engine that runs on the device and takes the operands, other than `refused` (an engine whose launch
// refused the call after all, for what its rule cannot see: a kernel's build, an output's alignment). None only where
// the epilogue is one that the other engines of this device do not have (SIMT takes every other GEMM).
std::optional<GemmEngine> SelectGemmEngine(ComputeCapability cc, const GemmOperands& o,
                                           std::optional<GemmEngine> refused = std::nullopt);

}  // namespace jmo::cuda

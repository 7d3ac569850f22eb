// The combine's gather + weighted sum: CombineKernel (combine.cu) runs it after its wait for the call's ret rows; the
// combine probe in tools/ times the same loop with other shapes and loads.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/device/convert.cuh"

namespace jmo::cuda {

// V consecutive elements of a row, loaded and stored as one access (V = 16 / sizeof(T): a 16-byte vector) or
// element by element (V = 1).
template <typename T, int V>
struct Pack {
  static_assert(V == 1 || V * sizeof(T) == 16, "one element or one 16-byte vector");
  alignas(V * sizeof(T)) T e[V];
  __device__ __forceinline__ void LoadCg(const T* p) {
    if constexpr (V == 1) e[0] = __ldcg(p); else *reinterpret_cast<uint4*>(e) = __ldcg(reinterpret_cast<const uint4*>(p));
  }
  __device__ __forceinline__ void Store(T* p) const {
    if constexpr (V == 1) *p = e[0]; else *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(e);
  }
};

// y[t] = sum_j gates[t k + j] * ret[slot_ret_row[t k + j]] in the fixed order j = 0..k-1 (deterministic), fp32
// accumulation, for the T_ tokens (N columns, V per vector); slot_out[p] = ret row of slot p, zero for a dropped slot
// (row < 0) or a row outside [0, ret_rows) (slot_out may be null). load(Pack&, const T*) reads one vector of a ret
// row (CombineKernel: Pack::LoadCg, since other SMs and GPUs write ret rows during the call); bad_row(p, row) is
// called once per slot p whose row is >= ret_rows. Every thread of the grid calls it (blockDim.x a multiple of 32).
//
// One warp per token (grid-stride over tokens): lane j holds the row and gate of choice j (k > 32: 32 choices at a
// time) and shuffles them to the warp, so each row index is read once, not once per column; the warp walks the row
// in chunks of 32 kU vectors, lane l taking vectors l, l + 32, ..., and keeps kU x kJ 16-byte loads in flight before
// it accumulates. An item-per-thread loop would pay a 64-bit item -> (token, column) division per load and re-read the
// row index per vector.
template <typename T, int V, int kU, int kJ, class Load, class BadRow>
__device__ __forceinline__ void GatherWeightedSum(const T* ret, int64_t ret_rows, const float* gates,
                                                  const int32_t* slot_ret_row, int64_t T_, int64_t k, int64_t N, T* y,
                                                  T* slot_out, Load load, BadRow bad_row) {
  Pack<T, V> zero;
  for (int i = 0; i < V; ++i) zero.e[i] = FromFloat<T>(0.f);
  const int lane = threadIdx.x & 31, vecs = (int)(N / V);  // vecs < 2^31: column math in 32 bits
  const int64_t warps = (int64_t)gridDim.x * (blockDim.x / 32);
  for (int64_t t = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; t < T_; t += warps) {
    // Choice `lane` of token t (choices 0..31: read once per token; beyond 32, per chunk below).
    int32_t row0 = -1;
    float gate0 = 0.f;
    if (lane < k) row0 = slot_ret_row[t * k + lane], gate0 = gates[t * k + lane];
    if (row0 >= ret_rows) bad_row(t * k + lane, row0);
    // Chunks of 32 kU vectors; this lane's are c, c + 32, ..., c + 32 (kU - 1). The loop is warp-uniform (c0, not c):
    // the shuffles below need every lane, also in a last partial chunk and when a row has fewer than 32 vectors.
    for (int c0 = 0; c0 < vecs; c0 += 32 * kU) {
      const int c = c0 + lane;
      float acc[kU][V];
#pragma unroll
      for (int u = 0; u < kU; ++u)
#pragma unroll
        for (int i = 0; i < V; ++i) acc[u][i] = 0.f;
      for (int64_t j32 = 0; j32 < k; j32 += 32) {
        int32_t row_l = row0;
        float gate_l = gate0;
        if (j32 > 0) {
          row_l = -1;
          if (j32 + lane < k) row_l = slot_ret_row[t * k + j32 + lane], gate_l = gates[t * k + j32 + lane];
          if (c0 == 0 && row_l >= ret_rows) bad_row(t * k + j32 + lane, row_l);
        }
        const int nj = k - j32 < 32 ? (int)(k - j32) : 32;
        for (int j0 = 0; j0 < nj; j0 += kJ) {
          Pack<T, V> v[kJ][kU];
          uint32_t ok = 0;  // bit jj: choice j32 + j0 + jj has a row in [0, ret_rows)
#pragma unroll
          for (int jj = 0; jj < kJ; ++jj) {
            const int32_t r = __shfl_sync(~0u, row_l, (j0 + jj) & 31);
            if (j0 + jj >= nj || r < 0 || r >= ret_rows) continue;
            ok |= 1u << jj;
            const T* src = ret + (int64_t)r * N + c * V;
#pragma unroll
            for (int u = 0; u < kU; ++u)
              if (c + 32 * u < vecs) load(v[jj][u], src + 32 * u * V);
          }
#pragma unroll
          for (int jj = 0; jj < kJ; ++jj) {
            const float g = __shfl_sync(~0u, gate_l, (j0 + jj) & 31);
            if (j0 + jj >= nj) break;
            if (ok >> jj & 1) {
#pragma unroll
              for (int u = 0; u < kU; ++u)
#pragma unroll
                for (int i = 0; i < V; ++i) acc[u][i] += g * ToFloat(v[jj][u].e[i]);
            }
            if (slot_out) {
              T* dst = slot_out + (t * k + j32 + j0 + jj) * N + c * V;
#pragma unroll
              for (int u = 0; u < kU; ++u) {
                if (c + 32 * u >= vecs) continue;
                if (ok >> jj & 1) v[jj][u].Store(dst + 32 * u * V);
                else zero.Store(dst + 32 * u * V);
              }
            }
          }
        }
      }
      T* dst = y + t * N + c * V;
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        if (c + 32 * u >= vecs) continue;
        Pack<T, V> out;
#pragma unroll
        for (int i = 0; i < V; ++i) out.e[i] = FromFloat<T>(acc[u][i]);
        out.Store(dst + 32 * u * V);
      }
    }
  }
}

}  // namespace jmo::cuda

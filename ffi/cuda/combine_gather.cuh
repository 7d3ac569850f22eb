// The combine's gather + weighted sum, shared by CombineKernel (kernels.cu: after its wait for the call's ret rows)
// and the combine probe (combine_probe.cu: the same loop with other items / choices in flight and other loads).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/gemm_tile.cuh"  // ToFloat, FromFloat

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
// accumulation, for the T_ tokens (N columns, V per item); slot_out[p] = ret row of slot p, zero for a dropped slot
// (row -1) or a row outside [0, ret_rows) (slot_out may be null). load(Pack&, const T*) reads one item of a ret row
// (CombineKernel: Pack::LoadCg, since other SMs and GPUs write ret rows during the call); bad_row(p, row) is called
// once per slot p whose row lies outside [0, ret_rows). Grid-stride over items: every thread of the grid calls it.
template <typename T, int V, int kItems, int kJ, class Load, class BadRow>
__device__ __forceinline__ void GatherWeightedSum(const T* ret, int64_t ret_rows, const float* gates,
                                                  const int32_t* slot_ret_row, int64_t T_, int64_t k, int64_t N, T* y,
                                                  T* slot_out, Load load, BadRow bad_row) {
  Pack<T, V> zero;
  for (int i = 0; i < V; ++i) zero.e[i] = FromFloat<T>(0.f);
  // Work items (token t, V columns from n) are numbered t * (N / V) + n / V, so neighbouring threads read neighbouring
  // columns. A thread takes kItems items a pass and reads their rows kJ choices at a time, issuing all kItems x kJ
  // loads together: the combine is a gather at HBM speed only with enough bytes in flight (ncu, H200, seed shape:
  // 121 us with 256 threads x 4 items x 1 choice, against XLA's 55 us gather + weighted sum). 512 x 3 x 2 is the most
  // that fits 128 registers without spills (bf16, V = 8).
  const int64_t vecs = N / V, items = T_ * vecs, stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t base = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; base < items; base += stride * kItems) {
    float acc[kItems][V];
    int64_t t[kItems], n[kItems];
#pragma unroll
    for (int u = 0; u < kItems; ++u) {
      const int64_t item = min(base + u * stride, items - 1);  // past the end: a repeat of the last item, not stored
      t[u] = item / vecs;
      n[u] = item % vecs * V;
#pragma unroll
      for (int i = 0; i < V; ++i) acc[u][i] = 0.f;
    }
    for (int64_t j0 = 0; j0 < k; j0 += kJ) {
      Pack<T, V> v[kJ][kItems];
      int32_t row[kJ][kItems];
#pragma unroll
      for (int jj = 0; jj < kJ; ++jj)
#pragma unroll
        for (int u = 0; u < kItems; ++u) row[jj][u] = j0 + jj < k ? slot_ret_row[t[u] * k + j0 + jj] : -1;
#pragma unroll
      for (int jj = 0; jj < kJ; ++jj)
#pragma unroll
        for (int u = 0; u < kItems; ++u)
          if (row[jj][u] >= 0 && row[jj][u] < ret_rows) load(v[jj][u], ret + (int64_t)row[jj][u] * N + n[u]);
#pragma unroll
      for (int jj = 0; jj < kJ; ++jj) {
        if (j0 + jj >= k) break;
#pragma unroll
        for (int u = 0; u < kItems; ++u) {
          const int64_t p = t[u] * k + j0 + jj;
          const bool mine = base + u * stride < items;
          const int32_t r = row[jj][u];
          if (r < 0 || r >= ret_rows) {
            if (mine && r >= 0 && n[u] == 0) bad_row(p, r);
            if (mine && slot_out) zero.Store(slot_out + p * N + n[u]);
            continue;
          }
          const float g = gates[p];
#pragma unroll
          for (int i = 0; i < V; ++i) acc[u][i] += g * ToFloat(v[jj][u].e[i]);
          if (mine && slot_out) v[jj][u].Store(slot_out + p * N + n[u]);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kItems; ++u) {
      if (base + u * stride >= items) continue;
      Pack<T, V> out;
#pragma unroll
      for (int i = 0; i < V; ++i) out.e[i] = FromFloat<T>(acc[u][i]);
      out.Store(y + t[u] * N + n[u]);
    }
  }
}

}  // namespace jmo::cuda

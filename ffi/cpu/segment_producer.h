// expert_combine's producer on CPU, which gather_rs shares: the grouped GEMM over the (local expert, source)
// segments in the producer's order (protocol.h's OrderSegments), each finished band of output rows stored into the
// rank's stage rows in the call's dtype and published with its tile-ready flag (= the epoch).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/bf16.h"
#include "cpu/fp8_gemm_rows.h"
#include "cpu/workspace_cpu.h"
#include "jax_moe_overlap/protocol.h"

namespace jmo::cpu {

template <typename T>
struct Elem;
template <>
struct Elem<float> {
  static float Load(const void* p, int64_t i) { return static_cast<const float*>(p)[i]; }
  static void Store(void* p, int64_t i, float v) { static_cast<float*>(p)[i] = v; }
};
template <>
struct Elem<uint16_t> {
  static float Load(const void* p, int64_t i) { return Bf16ToFloat(static_cast<const uint16_t*>(p)[i]); }
  static void Store(void* p, int64_t i, float v) { static_cast<uint16_t*>(p)[i] = FloatToBf16(v); }
};

// w[e] is [K, N], or with transpose_rhs [N, K] read as its transpose: element (k, n) at k * w_k + n * w_n. The sums
// run in the same order either way, so the transposed call equals the plain one on the transposed weights bit for bit.
template <typename T>
void ProduceSegments(const std::vector<Segment>& order, const void* lhs, const void* w, int64_t K, int64_t N,
                     bool transpose_rhs, const RankView& self, uint64_t epoch) {
  const int64_t w_k = transpose_rhs ? 1 : N, w_n = transpose_rhs ? K : 1;
  std::vector<float> acc(N);
  for (const Segment& seg : order) {
    const int64_t bands = (seg.rows + kBandRows - 1) / kBandRows;
    const int64_t w_off = static_cast<int64_t>(seg.expert) * K * N;
    for (int64_t b = 0; b < bands; ++b) {
      const int64_t r0 = seg.recv_off + b * kBandRows;
      const int64_t r1 = seg.recv_off + std::min<int64_t>(seg.rows, (b + 1) * kBandRows);
      for (int64_t i = r0; i < r1; ++i) {
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t k = 0; k < K; ++k) {
          const float a = Elem<T>::Load(lhs, i * K + k);
          if (a == 0.f) continue;
          const int64_t wrow = w_off + k * w_k;
          for (int64_t n = 0; n < N; ++n) acc[n] += a * Elem<T>::Load(w, wrow + n * w_n);
        }
        for (int64_t n = 0; n < N; ++n) Elem<T>::Store(self.stage(), i * N + n, acc[n]);
      }
      // The band is stored: publish it (release) so the consumer may ship it.
      AtomicStore(&self.tile_ready()[seg.band_base + b], epoch);
    }
  }
}

// The FP8 producer (expert_combine on e4m3 operands): each band's rows by the FP8 row GEMM every CPU handler of it
// calls (MatmulFp8Rows: jmo_grouped_matmul_fp8's rows, bit for bit), with the segment's expert's weight block: lhs
// [cap, K] e4m3, sa [K/128, ld], w [E_local, N, K] e4m3, sb [E_local, N/128, K/128]; the rows stored in the
// outputs' dtype (bfloat16 with out_bf16, else float32).
inline void ProduceSegmentsFp8(const std::vector<Segment>& order, const uint8_t* lhs, const float* sa, int64_t ld,
                               const uint8_t* w, const float* sb, int64_t K, int64_t N, bool out_bf16,
                               const RankView& self, uint64_t epoch) {
  const int64_t w_blocks = (N / kFp8Tile) * (K / kFp8Tile);
  for (const Segment& seg : order) {
    const int64_t bands = (seg.rows + kBandRows - 1) / kBandRows;
    const uint8_t* w_e = w + static_cast<int64_t>(seg.expert) * N * K;
    const float* sb_e = sb + static_cast<int64_t>(seg.expert) * w_blocks;
    for (int64_t b = 0; b < bands; ++b) {
      const int64_t r0 = seg.recv_off + b * kBandRows;
      const int64_t r1 = seg.recv_off + std::min<int64_t>(seg.rows, (b + 1) * kBandRows);
      MatmulFp8Rows(Fp8Lhs::MnMajor(lhs, K, sa, ld), w_e, sb_e, {r0, r1}, K, N, self.stage(), out_bf16);
      AtomicStore(&self.tile_ready()[seg.band_base + b], epoch);
    }
  }
}

}  // namespace jmo::cpu

// The column quantizer's persistent schedule (ops/quantize_columns.cuh's kernels, items and quantization), which the
// library no longer launches: one CTA per item measured faster for every input form (docs/performance.md, the column
// quantizer's table). quantize_columns_probe.cu times it beside the library's launch.
#pragma once

#include "cuda/ops/quantize_columns.cuh"

namespace jmo::cuda::qcols {

// 16 bytes global -> shared, asynchronously (sm_80+); complete at WaitCopies.
__device__ __forceinline__ void CopyAsync16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"((uint32_t)__cvta_generic_to_shared(dst)),
               "l"(src)
               : "memory");
}
__device__ __forceinline__ void CopyAsync8(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"((uint32_t)__cvta_generic_to_shared(dst)), "l"(src)
               : "memory");
}
__device__ __forceinline__ void CopyAsync4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"((uint32_t)__cvta_generic_to_shared(dst)), "l"(src)
               : "memory");
}
__device__ __forceinline__ void CommitCopies() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void WaitCopies() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// The shared stage of a persistent CTA: each thread's kRowsPerWarp Raws, row-major over the threads (a warp's
// accesses to one row are contiguous: conflict-free).
template <typename Raw>
struct Stage {
  Raw raw[kRowsPerWarp][kThreads];
};

// A lane's kLaneCh channels of one row of each input form, copied into its slot of the stage.
__device__ __forceinline__ void CopyRowAsync(const RowsF32& in, float4* dst, int64_t row, int64_t c) {
  CopyAsync16(dst, in.x + row * in.C + c);
}
template <int kN>
__device__ __forceinline__ void CopyRowAsync(const RowsBf16N<kN>& in, typename RowsBf16N<kN>::Raw* dst, int64_t row,
                                             int64_t c) {
  if constexpr (kN == 8)
    CopyAsync16(dst, in.x + row * in.C + c);
  else
    CopyAsync8(dst, in.x + row * in.C + c);
}
__device__ __forceinline__ void CopyRowAsync(const RowsE4m3& in, E4m3Row8* dst, int64_t row, int64_t c) {
  CopyAsync8(&dst->q, in.x + row * in.C + c);
  CopyAsync4(&dst->s, in.scales + row * (in.C / 128) + c / 128);
}

// Persistent: CTA b takes items b, b + gridDim.x, ...; the next item's rows are copied (cp.async) into the thread's
// own slots of a shared stage while the current item is quantized from registers, so no CTA-wide barrier guards the
// stage. Dynamic shared memory: PersistentSmem<In>().
template <class In>
constexpr int PersistentSmem() {
  return static_cast<int>(sizeof(Shared<In>) + sizeof(Stage<typename In::Raw>));
}
template <class In>
__global__ void __launch_bounds__(kThreads, 2)
    QuantizeColumnsPersistent(In in, int64_t M, int64_t C, const int32_t* __restrict__ sizes, int G, int64_t Mp,
                              int64_t items, uint8_t* __restrict__ q_t, float* __restrict__ s) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ uint32_t sink;  // see below
  Shared<In>& sm = *reinterpret_cast<Shared<In>*>(smem);
  static_assert(sizeof(Shared<In>) % 16 == 0, "the stage's slots must be 16-byte aligned");
  auto& stage = reinterpret_cast<Stage<typename In::Raw>*>(smem + sizeof(Shared<In>))->raw;
  constexpr int kCh = Shared<In>::kCh;
  const int64_t blocks = C / kCh;
  const int lane = threadIdx.x & 31, row0 = (threadIdx.x >> 5) * kRowsPerWarp;
  BuildTables(sizes, G, M, sm.row_off, sm.tile_off);
  __syncthreads();
  // Issue the copies of an item's rows (this thread's) into the stage; its tile's placement is returned.
  auto issue = [&](int64_t item) {
    const int64_t t = item / blocks, c0 = (item % blocks) * kCh;
    const ColumnTileRows tile = PlaceColumnTile(t, sm.row_off, sm.tile_off, G);
#pragma unroll
    for (int k = 0; k < kRowsPerWarp; ++k)
      if (row0 + k < tile.rows) CopyRowAsync(in, &stage[k][threadIdx.x], tile.first + row0 + k, c0 + In::kLaneCh * lane);
    CommitCopies();
    return tile;
  };
  int64_t item = blockIdx.x;
  if (item >= items) return;
  ColumnTileRows tile = issue(item);
  for (; item < items; item += gridDim.x) {
    const int64_t t = item / blocks, c0 = (item % blocks) * kCh;
    const int rows = tile.rows;
    typename In::Raw raw[kRowsPerWarp];
    WaitCopies();  // this thread's copies: the only slots it reads
    uint32_t read = 0;  // every word read from the stage: the next copies into these slots wait for it
#pragma unroll
    for (int k = 0; k < kRowsPerWarp; ++k)
      if (row0 + k < rows) {
        raw[k] = stage[k][threadIdx.x];
#pragma unroll
        for (int w = 0; w < (int)(sizeof(raw[k]) / 4); ++w) read ^= reinterpret_cast<const uint32_t*>(&raw[k])[w];
      }
    // The shared loads above and the cp.async writes below touch the same slots, and PTX does not order a thread's
    // ld.shared before its later cp.async: a store of every loaded word's XOR (to a word nothing reads) needs the
    // loads' registers, so they have landed before it issues, and the copies issue after it (asm volatile, memory
    // clobbers: kept in order).
    asm volatile("st.shared.u32 [%0], %1;" ::"r"((uint32_t)__cvta_generic_to_shared(&sink)), "r"(read) : "memory");
    if (item + gridDim.x < items) tile = issue(item + gridDim.x);
    if (rows == 0)
      EmptyItem<kCh>(t, c0, C, Mp, q_t, s);
    else
      QuantizeItem<In>(raw, rows, t, c0, C, Mp, sm, q_t, s);
  }
}

}  // namespace jmo::cuda::qcols

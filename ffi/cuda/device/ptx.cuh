// The device layer's PTX: what the protocol, the transport and the GEMM engines share. System- and GPU-scope loads,
// stores and reductions with explicit ordering, the global timer, shared-memory addresses, mbarriers, TMA tensor and
// bulk copies, proxy fences, register reallocation and named barriers. Nothing here knows a kernel of the library.
//
// Compiles for any target: the sm_90a instructions are emitted only under WGMMA_SM90A (the sm_90a device pass);
// other device passes (sm_80, compute_80 PTX) get __trap() bodies, and the host side refuses to launch there.
#pragma once

#include <cuda.h>  // CUtensorMap
#include <cuda_runtime.h>

#include <cstdint>

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WGMMA_SM90A 1
#else
#define WGMMA_SM90A 0
#endif

namespace jmo::ptx {

// ---- Ordered global accesses and the clock (any target) --------------------------------------------------------


__device__ __forceinline__ uint64_t GlobalTimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ uint64_t LoadAcquireSys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t LoadVolatile(const uint64_t* p) {
  return *reinterpret_cast<const volatile uint64_t*>(p);
}
__device__ __forceinline__ void StoreReleaseSys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void StoreReleaseGpu(uint64_t* p, uint64_t v) {
  asm volatile("st.release.gpu.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void AddReleaseSys(uint64_t* p, uint64_t v) {
  asm volatile("red.release.sys.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void AddReleaseGpu(uint64_t* p, uint64_t v) {
  asm volatile("red.release.gpu.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void AddRelaxedSys(uint64_t* p, uint64_t v) {
  asm volatile("red.relaxed.sys.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// ---- Shared memory, mbarriers, TMA tensor loads, register reallocation (sm_90a; __trap() elsewhere) --------------

__device__ __forceinline__ uint32_t SmemAddr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void MbarInit(uint32_t bar, uint32_t count) {
#if WGMMA_SM90A
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
#else
  __trap();
#endif
}
// Generic-proxy smem writes -> visible to the async proxy (wgmma operand reads, later TMA writes).
__device__ __forceinline__ void FenceProxyAsyncShared() {
#if WGMMA_SM90A
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#else
  __trap();
#endif
}
// Make initialized barriers visible to the async proxy (TMA complete_tx) and to the other threads.
__device__ __forceinline__ void MbarInitFence() {
#if WGMMA_SM90A
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  FenceProxyAsyncShared();
#else
  __trap();
#endif
}
// Producer: arm the barrier's transaction count for this phase (one arrival of the count-1 barrier).
__device__ __forceinline__ void MbarArriveExpectTx(uint32_t bar, uint32_t bytes) {
#if WGMMA_SM90A
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
#else
  __trap();
#endif
}
// One lane of the (fully active, converged) warp: true on exactly one lane. A predicate made fresh at each use, so
// that a loop whose warp arrives once per step keeps no lane index live across it (a register that ptxas would spill
// where the loop's accumulators fill the register file).
__device__ __forceinline__ bool ElectOne() {
#if WGMMA_SM90A
  uint32_t elected = 0;
  asm volatile(
      "{\n\t.reg .pred p;\n\telect.sync _|p, 0xffffffff;\n\tselp.u32 %0, 1, 0, p;\n\t}"
      : "=r"(elected));
  return elected != 0;
#else
  __trap();
  return false;
#endif
}
__device__ __forceinline__ void MbarArrive(uint32_t bar) {
#if WGMMA_SM90A
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
#else
  __trap();
#endif
}
// Spin until the phase with parity `parity` of the barrier has completed. A fresh barrier is in phase 0, so
// waiting on parity 1 returns at once (the "previous" phase counts as complete): that is how the producer's
// first pass over the empty barriers goes through.
__device__ __forceinline__ void MbarWait(uint32_t bar, uint32_t parity) {
#if WGMMA_SM90A
  uint32_t done;
  do {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
#else
  __trap();
#endif
}

__device__ __forceinline__ void TmaLoad2D(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1) {
#if WGMMA_SM90A
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void TmaLoad3D(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1,
                                          int c2) {
#if WGMMA_SM90A
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
      "[%2];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void PrefetchTensorMap(const CUtensorMap* map) {
#if WGMMA_SM90A
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
#else
  __trap();
#endif
}

template <int kRegs>
__device__ __forceinline__ void SetMaxNRegInc() {
#if WGMMA_SM90A
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs) : "memory");
#else
  __trap();
#endif
}
template <int kRegs>
__device__ __forceinline__ void SetMaxNRegDec() {
#if WGMMA_SM90A
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs) : "memory");
#else
  __trap();
#endif
}
// bar.sync id, n: plain PTX (sm_70+), no guard needed.
__device__ __forceinline__ void NamedBarSync(int id, int n) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory");
}

// bar.arrive id, n: counts the calling threads on the barrier without waiting (the rest of the n threads bar.sync).
__device__ __forceinline__ void NamedBarArrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory");
}

// Shared-memory loads by 32-bit address (for data behind a generic pointer the compiler cannot place in shared
// memory, which it would read with slower generic loads). Volatile: they stay after the barrier wait before them.
__device__ __forceinline__ float LdSharedF32(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ float2 LdSharedF32x2(uint32_t addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ uint4 LdSharedV4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr)
               : "memory");
  return v;
}

// ---- cp.async and ldmatrix (sm_80+) ----------------------------------------------------------------------------

__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(SmemAddr(smem)), "l"(gmem), "r"(src_bytes)
               : "memory");
}
// 4 bytes global -> shared (L1-allocating: small, reused values such as per-block scales).
__device__ __forceinline__ void CpAsync4(uint32_t smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem), "l"(gmem) : "memory");
}
// Counts this thread's cp.async copies issued so far on an mbarrier: one more pending arrival on its current phase
// now, and that arrival once the copies have landed (their writes are then visible to whoever waits on the phase).
__device__ __forceinline__ void CpAsyncMbarArrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void LdMatrixX4(uint32_t* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddr(p)));
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddr(p)));
}

// ---- TMA bulk copies (sm_90a; __trap() elsewhere) --------------------------------------------------------------

namespace bulk {
// global -> shared, completing `bytes` transactions on the barrier.
__device__ __forceinline__ void Load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
#if WGMMA_SM90A
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
#else
  __trap();
#endif
}
// shared -> global, one bulk group per call (Commit).
__device__ __forceinline__ void Store(void* dst, uint32_t src, uint32_t bytes) {
#if WGMMA_SM90A
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(src), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
#else
  __trap();
#endif
}
// Until at most N of this thread's store groups are pending; the others have completed (writes performed).
template <int N>
__device__ __forceinline__ void WaitStores() {
#if WGMMA_SM90A
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
#else
  __trap();
#endif
}
// Until at most N of this thread's store groups may still read their shared-memory source (the slot is reusable).
template <int N>
__device__ __forceinline__ void WaitStoresRead() {
#if WGMMA_SM90A
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
#else
  __trap();
#endif
}
}  // namespace bulk

// Orders this thread's generic-proxy view of global memory with its async-proxy (TMA) accesses: after acquiring a
// producer's flag, before loading what the producer stored; after the stores complete, before the release.
__device__ __forceinline__ void FenceProxyAsyncGlobal() {
#if WGMMA_SM90A
  asm volatile("fence.proxy.async.global;" ::: "memory");
#else
  __trap();
#endif
}

}  // namespace jmo::ptx

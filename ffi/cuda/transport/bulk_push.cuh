// Band pushes by TMA bulk copies (cp.async.bulk, sm_90): the chunk stream with which expert_combine's consumer moves
// finished bands to the peers' ret rows.
//
// Why: a CTA that copies with ordinary loads and stores keeps at most (threads x loads per thread) bytes in flight, so
// load latency bounds its rate. The copy engine of the SM (TMA) moves a whole chunk per instruction, so one thread
// keeps a ring of chunks in flight (global -> shared -> global: 64 KiB of loads and up to 128 KiB of stores), and the
// consumer needs fewer SMs for the same bytes/s: SMs that the producer keeps.
//
// StreamBands pushes a CTA's bands in order through a ring of shared-memory slots: a band's chunks are loaded only
// once the band is ready (polled, so one slow band never stops the stores of chunks already loaded), each chunk is
// stored as soon as its load lands, and a band is reported done only when all of its stores have completed (so the
// caller can release-add the arrival counter). One StreamBands runs on one thread; a CTA may run several, each on its
// own ring and bands, because one issuing thread pays a fixed cost per chunk whatever the ring's depth.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/device/ptx.cuh"

namespace jmo::cuda {

constexpr int kPushChunkBytes = 8192;  // bytes of one bulk copy (a multiple of 16)
constexpr int kPushMaxSlots = 24;      // ring slots (192 KB of shared memory at most; the launch's smem decides)
constexpr int kPushReadLag = 4;        // default: stores whose shared-memory reads may be pending (the rest load)
// The ring's slots and read lag are per-call tuning (ConsumerTuning in api.h). Neither raises the rate of one issuing
// thread; more issuing threads do, so the consumer runs several StreamBands per CTA, each on its own slice of shared
// memory (ConsumerTuning::push_issuers).
constexpr int kPushWriteLag = 16;      // stores whose global writes may be pending (128 KiB: covers the store latency)
constexpr int kPushMaxPending = 32;    // bands with stores issued but not yet reported (at most kPushWriteLag + 1)

// Shared memory StreamBands needs for `slots` slots (barriers first, then the 128-aligned ring).
// (kChunk: the bytes of one copy; the consumer uses kPushChunkBytes, the push probe in tools/ tries others.)
template <int kChunk = kPushChunkBytes>
__host__ __device__ constexpr int PushRingBytes(int slots) { return 128 + slots * kChunk + 128; }

// WaitStoresRead with a run-time lag among the supported ones (1, 2, 4, 8, 12, 16; others round down); returns the
// lag it used. The lag must stay below the ring's slots, or the ring drains completely before each reuse.
__device__ __forceinline__ int WaitStoresReadLag(int lag) {
  if (lag >= 16) { ptx::bulk::WaitStoresRead<16>(); return 16; }
  if (lag >= 12) { ptx::bulk::WaitStoresRead<12>(); return 12; }
  if (lag >= 8) { ptx::bulk::WaitStoresRead<8>(); return 8; }
  if (lag >= 4) { ptx::bulk::WaitStoresRead<4>(); return 4; }
  if (lag >= 2) { ptx::bulk::WaitStoresRead<2>(); return 2; }
  ptx::bulk::WaitStoresRead<1>();
  return 1;
}

// One band as StreamBands sees it.
struct PushBand {
  const char* src;
  char* dst;
  int64_t bytes;  // a multiple of 16, src and dst 16-byte aligned
};

// Pushes bands 0..count-1 (band_of(i) -> PushBand) through `slots` ring slots of kChunk bytes in `smem`
// (PushRingBytes<kChunk>(slots)).
// ready(i, block): whether band i may be read (and its destination written); with block = false it only polls, with
// block = true it waits (bounded) and returns false when it gave up. done(i): called once band i's stores have all
// completed, in band order. Returns false when ready() gave up; every copy it issued has completed either way (the
// ring is shared memory that dies with the CTA). Called by one thread.
template <int kChunk = kPushChunkBytes, class ReadyFn, class BandFn, class DoneFn>
__device__ bool StreamBands(int count, ReadyFn ready, BandFn band_of, DoneFn done_fn, char* smem, int slots,
                            int read_lag = kPushReadLag) {
  using namespace ptx;
  using namespace ptx::bulk;
  uint64_t* bars = reinterpret_cast<uint64_t*>((reinterpret_cast<uintptr_t>(smem) + 127) & ~(uintptr_t)127);
  char* ring = reinterpret_cast<char*>(bars) + 128;
  for (int s = 0; s < slots; ++s) MbarInit(SmemAddr(&bars[s]), 1);
  MbarInitFence();

  // Chunks are numbered over all bands of the call: q = 0, 1, ... Slot of chunk q: q % slots, its use number q / slots.
  // Two lags decouple the ring from the store latency: a slot is reused once its store has *read* it (kPushReadLag),
  // while up to kPushWriteLag stores may still be writing; a band is reported once its stores have *completed*.
  int64_t loaded = 0, stored = 0, read = 0, completed = 0;  // loads / stores issued, stores read, stores complete
  int lb = 0, sb = 0;                             // band of the next load / the next store
  int64_t loff = 0, soff = 0;                     // byte offset within it
  PushBand lband{}, sband{};
  int64_t last_chunk[kPushMaxPending] = {};  // [band % kPushMaxPending]: the chunk number of the band's last store
  int signalled = 0;                    // bands reported done
  uint32_t chunk_bytes[kPushMaxSlots];
  bool ok = true;

  auto signal = [&]() {
    bool fenced = false;
    while (signalled < sb && last_chunk[signalled % kPushMaxPending] < completed) {
      if (!fenced) {
        FenceProxyAsyncGlobal();
        fenced = true;
      }
      done_fn(signalled++);
    }
  };

  while (true) {
    bool progress = false;
    // 1. Loads into free slots (the slot of chunk `loaded` is free once the store of chunk loaded - slots has read it).
    //    A band's first chunk waits for the band to be ready, polled: stores of loaded chunks must not wait on it.
    while (lb < count && loaded - read < slots) {
      if (loff == 0) {
        if (!ready(lb, false)) break;
        FenceProxyAsyncGlobal();
        lband = band_of(lb);
      }
      const int slot = (int)(loaded % slots);
      const int64_t left = lband.bytes - loff;
      const uint32_t n = (uint32_t)(left < kChunk ? left : kChunk);
      chunk_bytes[slot] = n;
      const uint32_t bar = SmemAddr(&bars[slot]);
      MbarArriveExpectTx(bar, n);
      Load(SmemAddr(ring + (int64_t)slot * kChunk), lband.src + loff, n, bar);
      ++loaded;
      loff += n;
      if (loff == lband.bytes) {
        ++lb;
        loff = 0;
      }
      progress = true;
    }
    // 2. The store of the oldest loaded chunk (its load is in flight or landed: a short wait).
    if (stored < loaded) {
      const int slot = (int)(stored % slots);
      if (soff == 0) sband = band_of(sb);
      MbarWait(SmemAddr(&bars[slot]), (uint32_t)((stored / slots) & 1));
      Store(sband.dst + soff, SmemAddr(ring + (int64_t)slot * kChunk), chunk_bytes[slot]);
      soff += chunk_bytes[slot];
      if (soff == sband.bytes) {
        last_chunk[sb % kPushMaxPending] = stored;
        ++sb;
        soff = 0;
      }
      ++stored;
      progress = true;
    }
    // 3. Slots: all but the newest kPushReadLag stores have read theirs. Completion: all but the newest
    //    kPushWriteLag stores have written; report the bands they finished.
    if (stored - read > read_lag) read = stored - WaitStoresReadLag(read_lag);
    if (stored - completed > kPushWriteLag) {
      WaitStores<kPushWriteLag>();
      completed = stored - kPushWriteLag;
      if (read < completed) read = completed;
      signal();
    }
    if (progress) continue;
    if (completed < stored) {  // nothing to issue: finish the stores in flight and report their bands
      WaitStores<0>();
      completed = read = stored;
      signal();
      continue;
    }
    if (lb >= count) break;
    if (!ready(lb, true)) {  // nothing in flight: wait (bounded) for the next band
      ok = false;
      break;
    }
  }
  // On failure, drain what is in flight (loads land in slots this CTA owns; stores read them).
  for (int64_t q = stored; q < loaded; ++q) MbarWait(SmemAddr(&bars[q % slots]), (uint32_t)((q / slots) & 1));
  WaitStores<0>();
  return ok;
}

}  // namespace jmo::cuda

// Probe of jmo_quantize_columns_fp8's CUDA kernels (ops/quantize_columns.cuh) on one Hopper GPU: the baseline (the
// kernel of cb5e3ee, quantize_columns_v0.cuh), the library's launcher (QuantizeColumnsFp8, ops/quantize_columns.cu)
// and each kernel schedule and input form of the kernel header,
// on x [M = 163840, C] (C = 1024, 2048; float32, bfloat16, and row-quantized e4m3 + power-of-two scales) grouped in 16
// skewed groups summing to 131072 rows (some not multiples of 128, one empty). Every variant's outputs (q_t and s,
// poisoned before each checked run) are compared bitwise with the baseline's; the baseline is checked against a naive
// kernel of the rules (common/fp8_columns.h: one thread per (tile, channel), rows in order). Row-quantized inputs
// are checked against the baseline run on their dequantized float32 rows. The float32 data holds NaNs (with
// payloads), infinities, signed zeros, float32 subnormals and values placed a few ulps around e4m3 rounding
// midpoints of their tile's scale.
//   quantize_columns_probe [--reps N]   prints: variant, dtype, C, us (median of N = 20 after warm-up), GB/s (bytes
//                                        read + written), equal (yes/no; mismatching bytes of q_t and words of s)
// Exit codes: 0 all equal, 1 a mismatch, 2 CUDA error or bad usage, 3 watchdog timeout.
#include "probe_common.cuh"

#include "cuda/ops/quantize_columns.cu"  // the library's launcher (its helpers below: this probe does not link jmo_cuda)
#include "cuda/ops/quantize_columns.cuh"
#include "quantize_columns_persistent.cuh"  // the persistent schedule the library dropped
#include "quantize_columns_v0.cuh"  // the baseline: the kernel of cb5e3ee

namespace jmo::cuda {
// The library functions the launcher calls, for this standalone build.
Status CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status{};
  return Status::Error(kInternal, std::string(what) + ": " + cudaGetErrorString(err));
}
Status CheckSizes(const char* op, int64_t M, int64_t G) {
  if (G < 1 || G > kMaxGroups || M >= (int64_t(1) << 31)) return Status::Error(kInvalidArgument, op);
  return Status{};
}
Status SetKernelSmem(const void* kernel, int bytes, const char* name) {
  return CudaStatus(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), name);
}
Status Fp8DeviceCheck(const char* op, DeviceInfo* dev) {
  int d = 0;
  cudaGetDevice(&d);
  cudaDeviceGetAttribute(&dev->sms, cudaDevAttrMultiProcessorCount, d);
  cudaDeviceGetAttribute(&dev->cc.major, cudaDevAttrComputeCapabilityMajor, d);
  cudaDeviceGetAttribute(&dev->cc.minor, cudaDevAttrComputeCapabilityMinor, d);
  return dev->cc.major == 9 ? Status{} : Status::Error(kFailedPrecondition, op);
}
}  // namespace jmo::cuda

namespace {

using namespace jmo;
using namespace jmo::cuda::qcols;

constexpr int64_t kM = 163840;
constexpr int kG = 16;

// 16 skewed group sizes summing to 131072: one empty, most not multiples of 128.
std::vector<int32_t> GroupSizes() {
  std::vector<int32_t> n = {20000, 1, 127, 0, 15000, 300, 9999, 12800, 129, 7000, 2500, 18000, 640, 5555, 1000, 0};
  int64_t sum = 0;
  for (int32_t v : n) sum += v;
  n[kG - 1] = static_cast<int32_t>(131072 - sum);
  return n;
}

__device__ float Normalish(uint32_t h) {  // a sum of uniforms: roughly normal in [-2, 2]
  return ((h & 0xFF) + ((h >> 8) & 0xFF) + ((h >> 16) & 0xFF) + (h >> 24) - 510.f) / 255.f;
}

// float32 (or bfloat16) rows with magnitudes by channel (2^-12 .. 2^12) and the special values of the header.
template <typename T>
__global__ void FillRows(T* x, int64_t M, int64_t C) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < M * C; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / C, c = i % C;
    const uint32_t h = Hash(i * 0x9E3779B97F4A7C15ULL + 12345);
    float v = ldexpf(Normalish(h), static_cast<int>((c * 7) % 25) - 12);
    const uint32_t k = Hash(i + 777) % 200003;
    if (k == 0) v = 0.f;
    else if (k == 1) v = -0.f;
    else if (k == 2) v = (h & 1) ? 1e-40f : -1e-40f;  // float32 subnormals
    else if (c == 17 && r == 4000) v = INFINITY;
    else if (c == 18 && r == 70000) v = -INFINITY;
    else if (c == 33 && (r == 10 || r == 100)) v = __uint_as_float(r == 10 ? 0x7FC00123u : 0xFFC00456u);  // NaNs
    else if (c == 34 && r == 50000) v = __uint_as_float(0xFF800001u);  // a signalling-pattern NaN
    x[i] = static_cast<T>(v);
  }
}

// The rules, naively: thread per (tile, channel), rows in order (the CPU handler's loops).
template <typename T>
__global__ void RulesKernel(const T* x, int64_t C, const int32_t* row_off, const int32_t* tile_off, int G, int64_t tiles,
                            int64_t Mp, uint8_t* q_t, float* s) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= tiles * C) return;
  const int64_t t = i / C, c = i % C;
  const ColumnTileRows tile = PlaceColumnTile(t, row_off, tile_off, G);
  float m = 0.f;
  for (int k = 0; k < tile.rows; ++k) m = AmaxStep(m, static_cast<float>(x[(tile.first + k) * C + c]));
  const float sc = ColumnTileScale(m);
  s[t * C + c] = sc;
  for (int k = 0; k < kColumnTile; ++k)
    q_t[c * Mp + t * kColumnTile + k] =
        k < tile.rows ? QuantizeE4m3(static_cast<float>(x[(tile.first + k) * C + c]), sc) : 0;
}

// Values of float32 rows moved a few ulps around the e4m3 rounding midpoints of their tile's scale (every 5th
// channel; the amax row kept, so the scale stays).
__global__ void NearMidpoints(float* x, int64_t C, const int32_t* row_off, const int32_t* tile_off, int G,
                              int64_t tiles) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= tiles * C || (i % C) % 5 != 1) return;
  const int64_t t = i / C, c = i % C;
  const ColumnTileRows tile = PlaceColumnTile(t, row_off, tile_off, G);
  float m = 0.f;
  int arg = -1;
  for (int k = 0; k < tile.rows; ++k) {
    const float a = fabsf(x[(tile.first + k) * C + c]);
    if (a > m) m = a, arg = k;
  }
  if (!(m > 0.f) || !isfinite(m)) return;
  const float sc = ColumnTileScale(m);
  for (int k = 0; k < tile.rows; ++k) {
    if (k == arg) continue;
    float& v = x[(tile.first + k) * C + c];
    const float q = fabsf(v / sc);
    if (q < 0x1p-9f || q > 430.f) continue;
    // The midpoint above q: e4m3 values step by 2^(e - 3) in [2^e, 2^(e + 1)) (2^-9 below 2^-6).
    const int e = max(-6, ilogbf(q));
    const float step = ldexpf(1.f, e - 3), mid = (floorf(q / step) + 0.5f) * step;
    const uint32_t h = Hash(i * 131 + k);
    const int d = static_cast<int>(h % 9) - 4;  // -4 .. 4 ulps
    const float w = __uint_as_float(__float_as_uint(mid * sc) + d);
    if (w < m) v = copysignf(w, v);
  }
}

// Row-quantized rows: random e4m3 bytes (no NaN) and power-of-two scales 2^-10 .. 2^9 per (row, 128 channels).
__global__ void FillRowQuantized(uint8_t* q, float* sc, int64_t M, int64_t C) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < M * C; i += (int64_t)gridDim.x * blockDim.x) {
    uint8_t b = static_cast<uint8_t>(Hash(i * 0x9E3779B97F4A7C15ULL + 999));
    if ((b & 0x7F) == 0x7F) b ^= 1;
    q[i] = b;
    if (i % 128 == 0) sc[i / 128] = ldexpf(1.f, static_cast<int>(Hash(i + 5) % 20) - 10);
  }
}
__constant__ float kE4m3Value[256];
__global__ void Dequantize(const uint8_t* q, const float* sc, float* x, int64_t M, int64_t C) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < M * C; i += (int64_t)gridDim.x * blockDim.x)
    x[i] = kE4m3Value[q[i]] * sc[i / 128];
}

__global__ void CountDiff(const uint32_t* a, const uint32_t* b, int64_t n, unsigned long long* out) {
  unsigned long long d = 0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    d += __popc(__vcmpne4(a[i], b[i])) / 8;  // differing bytes
  if (d) atomicAdd(out, d);
}

__global__ void Tables(const int32_t* sizes, int G, int64_t M, int32_t* row_off, int32_t* tile_off) {
  __shared__ int32_t r[kG + 1], t[kG + 1];
  BuildTables(sizes, G, M, r, t);
  __syncthreads();
  for (int g = threadIdx.x; g <= G; g += blockDim.x) row_off[g] = r[g], tile_off[g] = t[g];
}

struct Buffers {
  int64_t C, tiles, Mp;
  uint8_t* q_t;
  float* s;
  uint8_t* ref_q;
  float* ref_s;
  unsigned long long* diff;
};

// Mismatching bytes of q_t plus mismatching bytes of s against the reference outputs.
unsigned long long Diff(const Buffers& b, cudaStream_t st) {
  CK(cudaMemsetAsync(b.diff, 0, sizeof(unsigned long long), st));
  CountDiff<<<1024, 256, 0, st>>>(reinterpret_cast<const uint32_t*>(b.q_t), reinterpret_cast<const uint32_t*>(b.ref_q),
                                  b.C * b.Mp / 4, b.diff);
  CountDiff<<<1024, 256, 0, st>>>(reinterpret_cast<const uint32_t*>(b.s), reinterpret_cast<const uint32_t*>(b.ref_s),
                                  b.tiles * b.C, b.diff);
  unsigned long long d = 0;
  CK(cudaMemcpyAsync(&d, b.diff, sizeof d, cudaMemcpyDeviceToHost, st));
  WaitOrDie(st, "compare");
  return d;
}

void Poison(const Buffers& b, cudaStream_t st) {
  CK(cudaMemsetAsync(b.q_t, 0xA5, b.C * b.Mp, st));
  CK(cudaMemsetAsync(b.s, 0xFF, b.tiles * b.C * sizeof(float), st));
}

int g_reps = 20, g_failures = 0;

// Check (poisoned outputs vs the reference) then time one variant; prints its row.
template <class Launch>
void Row(const char* name, const char* dtype, const Buffers& b, double bytes, cudaStream_t st, Launch launch) {
  Poison(b, st);
  launch();
  CK(cudaGetLastError());
  WaitOrDie(st, name);
  const unsigned long long d = Diff(b, st);
  for (int i = 0; i < 3; ++i) launch();
  WaitOrDie(st, std::string(name) + " warm-up");
  const float ms = MedianLaunchMs(st, g_reps, launch, [](int) {});
  printf("%-26s %-6s %5lld %9.1f %9.0f   %s", name, dtype, (long long)b.C, ms * 1e3, bytes / (ms * 1e-3) / 1e9,
         d ? "NO" : "yes");
  if (d) printf(" (%llu bytes differ)", d);
  printf("\n");
  fflush(stdout);
  g_failures += d != 0;
}

template <class In>
void SetSmem(const void* kernel, int bytes) {
  CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

template <class In>
void LaunchLean(In in, const Buffers& b, const int32_t* sizes, cudaStream_t st) {
  constexpr int kCh = Shared<In>::kCh;
  QuantizeColumnsLean<In><<<(unsigned)(b.tiles * (b.C / kCh)), kThreads, LeanSmem<In>(), st>>>(
      in, kM, b.C, sizes, kG, b.Mp, b.q_t, b.s);
}

template <class In>
void LaunchPersistent(In in, const Buffers& b, const int32_t* sizes, cudaStream_t st, int grid) {
  constexpr int kCh = Shared<In>::kCh;
  QuantizeColumnsPersistent<In><<<grid, kThreads, PersistentSmem<In>(), st>>>(in, kM, b.C, sizes, kG, b.Mp,
                                                                             b.tiles * (b.C / kCh), b.q_t, b.s);
}

template <class In>
int PersistentGrid(int sms) {
  SetSmem<In>(reinterpret_cast<const void*>(QuantizeColumnsPersistent<In>), PersistentSmem<In>());
  SetSmem<In>(reinterpret_cast<const void*>(QuantizeColumnsLean<In>), LeanSmem<In>());
  int per_sm = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, QuantizeColumnsPersistent<In>, kThreads,
                                                   PersistentSmem<In>()));
  return std::max(1, per_sm) * sms;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--reps" && i + 1 < argc) g_reps = std::max(1, atoi(argv[++i]));
    else {
      fprintf(stderr, "usage: %s [--reps N]\n", argv[0]);
      return 2;
    }
  }
  g_watchdog_s = 60.0;
  const int sms = ProbeDevice(0);
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  {
    E4m3Table tab;
    CK(cudaMemcpyToSymbol(kE4m3Value, tab.value, sizeof tab.value));
  }
  const std::vector<int32_t> sizes = GroupSizes();
  int64_t rows = 0;
  for (int32_t n : sizes) rows += n;
  const int64_t tiles = (kM + kColumnTile - 1) / kColumnTile + kG, Mp = kColumnTile * tiles;
  int32_t *d_sizes, *d_row_off, *d_tile_off;
  CK(cudaMalloc(&d_sizes, kG * sizeof(int32_t)));
  CK(cudaMalloc(&d_row_off, (kG + 1) * sizeof(int32_t)));
  CK(cudaMalloc(&d_tile_off, (kG + 1) * sizeof(int32_t)));
  CK(cudaMemcpy(d_sizes, sizes.data(), kG * sizeof(int32_t), cudaMemcpyHostToDevice));
  Tables<<<1, 32>>>(d_sizes, kG, kM, d_row_off, d_tile_off);
  CK(cudaDeviceSynchronize());
  const int64_t Cmax = 2048;
  float* x32;
  __nv_bfloat16* x16;
  uint8_t *xq, *q_t, *ref_q;
  float *xs, *s, *ref_s;
  unsigned long long* diff;
  CK(cudaMalloc(&x32, kM * Cmax * sizeof(float)));
  CK(cudaMalloc(&x16, kM * Cmax * sizeof(__nv_bfloat16)));
  CK(cudaMalloc(&xq, kM * Cmax));
  CK(cudaMalloc(&xs, kM * Cmax / 128 * sizeof(float)));
  CK(cudaMalloc(&q_t, Cmax * Mp));
  CK(cudaMalloc(&ref_q, Cmax * Mp));
  CK(cudaMalloc(&s, tiles * Cmax * sizeof(float)));
  CK(cudaMalloc(&ref_s, tiles * Cmax * sizeof(float)));
  CK(cudaMalloc(&diff, sizeof(unsigned long long)));
  const int grid_f32 = PersistentGrid<RowsF32>(sms), grid_bf16 = PersistentGrid<RowsBf16x4>(sms),
            grid_e4m3 = PersistentGrid<RowsE4m3>(sms);
  SetSmem<RowsBf16>(reinterpret_cast<const void*>(QuantizeColumnsLean<RowsBf16>), LeanSmem<RowsBf16>());
  printf("M %lld, %d groups, %lld rows in groups, %lld tiles; persistent grids: f32 %d, bf16 %d, e4m3 %d CTAs\n",
         (long long)kM, kG, (long long)rows, (long long)tiles, grid_f32, grid_bf16, grid_e4m3);
  printf("%-26s %-6s %5s %9s %9s   %s\n", "variant", "dtype", "C", "us", "GB/s", "equal");
  for (int64_t C : {int64_t(1024), int64_t(2048)}) {
    const Buffers b{C, tiles, Mp, q_t, s, ref_q, ref_s, diff};
    const double written = static_cast<double>(C * Mp + tiles * C * 4);
    const unsigned rules_grid = (unsigned)((tiles * C + 255) / 256);
    for (int dt = 0; dt < 3; ++dt) {
      // The reference outputs: the baseline on these rows (float32 rows for row-quantized inputs), checked against
      // the rules.
      const char* dtype = dt == 0 ? "f32" : dt == 1 ? "bf16" : "e4m3";
      if (dt == 0) {
        FillRows<float><<<2048, 256, 0, st>>>(x32, kM, C);
        NearMidpoints<<<rules_grid, 256, 0, st>>>(x32, C, d_row_off, d_tile_off, kG, tiles);
      } else if (dt == 1) {
        FillRows<__nv_bfloat16><<<2048, 256, 0, st>>>(x16, kM, C);
      } else {
        FillRowQuantized<<<2048, 256, 0, st>>>(xq, xs, kM, C);
        Dequantize<<<2048, 256, 0, st>>>(xq, xs, x32, kM, C);
      }
      const DType base_dt = dt == 1 ? DType::kBF16 : DType::kF32;
      const void* base_x = dt == 1 ? static_cast<const void*>(x16) : static_cast<const void*>(x32);
      CK(cudaMemsetAsync(ref_q, 0xA5, C * Mp, st));
      CK(cudaMemsetAsync(ref_s, 0xFF, tiles * C * sizeof(float), st));
      CK(jmo::cuda::qcols_v0::Launch(st, base_dt, base_x, kM, C, kG, d_sizes, tiles, ref_q, ref_s));
      Poison(b, st);  // the rules' outputs go to q_t, s
      if (dt == 1)
        RulesKernel<__nv_bfloat16><<<rules_grid, 256, 0, st>>>(x16, C, d_row_off, d_tile_off, kG, tiles, Mp, q_t, s);
      else
        RulesKernel<float><<<rules_grid, 256, 0, st>>>(x32, C, d_row_off, d_tile_off, kG, tiles, Mp, q_t, s);
      CK(cudaGetLastError());
      WaitOrDie(st, "reference");
      const unsigned long long d = Diff(b, st);
      printf("%-26s %-6s %5lld %9s %9s   %s\n", "(baseline vs rules)", dtype, (long long)C, "", "",
             d ? "NO" : "yes");
      g_failures += d != 0;
      const double elem = dt == 0 ? 4 : dt == 1 ? 2 : 1;
      const double bytes = rows * C * elem + (dt == 2 ? rows * (C / 128) * 4.0 : 0.0) + written;
      if (dt < 2)
        Row("v0 (cb5e3ee, baseline)", dtype, b, bytes, st,
            [&] { CK(jmo::cuda::qcols_v0::Launch(st, base_dt, base_x, kM, C, kG, d_sizes, tiles, q_t, s)); });
      if (dt == 0) {
        Row("library", dtype, b, bytes, st, [&] {
          jmo::cuda::QuantizeColumnsFp8(st, DType::kF32, x32, kM, C, kG, d_sizes, tiles, q_t, s);
        });
        const RowsF32 in{x32, C};
        Row("lean f32x4", dtype, b, bytes, st, [&] { LaunchLean(in, b, d_sizes, st); });
        Row("persistent f32x4", dtype, b, bytes, st, [&] { LaunchPersistent(in, b, d_sizes, st, grid_f32); });
      } else if (dt == 1) {
        Row("library", dtype, b, bytes, st, [&] {
          jmo::cuda::QuantizeColumnsFp8(st, DType::kBF16, x16, kM, C, kG, d_sizes, tiles, q_t, s);
        });
        Row("lean bf16x8 (16 B loads)", dtype, b, bytes, st, [&] { LaunchLean(RowsBf16{x16, C}, b, d_sizes, st); });
        Row("lean bf16x4", dtype, b, bytes, st, [&] { LaunchLean(RowsBf16x4{x16, C}, b, d_sizes, st); });
        Row("persistent bf16x4", dtype, b, bytes, st,
            [&] { LaunchPersistent(RowsBf16x4{x16, C}, b, d_sizes, st, grid_bf16); });
      } else {
        const RowsE4m3 in{xq, xs, C};
        Row("lean e4m3x8 (row-quant.)", dtype, b, bytes, st, [&] { LaunchLean(in, b, d_sizes, st); });
        Row("persistent e4m3x8", dtype, b, bytes, st, [&] { LaunchPersistent(in, b, d_sizes, st, grid_e4m3); });
      }
    }
  }
  printf("%s\n", g_failures ? "MISMATCH: see the rows marked NO" : "all variants equal the baseline bitwise");
  return g_failures ? 1 : 0;
}

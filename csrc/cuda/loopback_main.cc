// jmo_loopback: runs the loopback harness (loopback.h) on one GPU.
//
//   jmo_loopback --suite full        R = 2, 4, 8 x balanced / moderate / extreme routing, float32, capacity drops,
//                                    a held-back rank, a forced timeout with recovery, 1000 consecutive iterations,
//                                    w transposed (--transpose-rhs) on every producer engine
//   jmo_loopback --suite resource    the device-side manager and the serialized mode (also part of full)
//   jmo_loopback --suite dispatch-gemm   the dispatch and GEMM1 in one launch (dispatch_gemm), R = 1, 2, 4, 8
//   jmo_loopback --suite dispatch-gemm-time   dispatch + GEMM1 as two calls vs dispatch_gemm, timed (R = 2)
//   jmo_loopback --suite small       a few one-rank calls at small sizes (for compute-sanitizer)
//   jmo_loopback --suite small-mma   the same without the wgmma-producer cases (for racecheck: see Suite)
//   jmo_loopback --ranks 4 --routing 1 --iters 100 ...   one case (see LoopbackConfig for the options)
//   --transpose-rhs            expert_combine's w as [E_l, N, K], read transposed in place (the backward pass's dx)
// Prints one PASS/FAIL line per case; exits non-zero if any case fails.
//
// Timing (the resource-manager and consumer benchmarks drive these; benchmarks/*.py):
//   --time                     after the checked call(s), time expert_combine alone on data set 0: --warmup W calls,
//                              then --reps N; prints one TIMED line and one `RESULT {json}` line per variant
//   --consumers C              C per call (0: the manager: the --model evaluated on the device, else SMs / 8)
//   --serialize                the consumer starts only after the producer has finished every tile
//   --sweep-consumers 1,2,4    one variant per C, then the manager, then the manager serialized
//   --model a,b,...            the 9 ModelParams (resource_model.h order) of the workspace
//   --per-call-stats           synchronize after each timed call and read its device spans (producer / consumer)
//   --decision-cost N          time the device-side choice (N evaluations in one CTA) on rank 0's plan
//   --check-tokens N           check the expert outputs of about N tokens per rank (big timing shapes)
//   --copy-ceiling B1,B2,...   only: median cudaMemcpyAsync device-to-device time of each size (bytes)
//   --device-info              only: the device's name and SM count, the producer tile (for calibrate.py)
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "cuda/kernels.h"
#include "cuda/loopback.h"

using jmo::cuda::LoopbackConfig;

namespace {

std::vector<double> ParseList(const char* arg) {
  std::vector<double> v;
  std::stringstream ss(arg);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) v.push_back(std::atof(item.c_str()));
  return v;
}

// Plausible H200-like constants that make the device-side choice vary over the suite's small shapes: they exercise
// the manager's code path (every CTA must agree on C), they are not a calibration.
jmo::ModelParams SuiteModel() { return jmo::ModelParams{132, 1, 64, 128, 0.05, 0.0005, 2.0, 300.0, 0.5}; }

// R ranks with two experts each, `routing` 0 / 1 / 2 (balanced / moderate / extreme), `iters` iterations.
LoopbackConfig RankCase(const LoopbackConfig& base, int R, int routing, int iters) {
  LoopbackConfig c = base;
  c.ranks = R;
  c.experts = 2 * R;
  c.routing = routing;
  c.iters = iters;
  return c;
}

std::vector<LoopbackConfig> Suite(const std::string& name, const LoopbackConfig& base) {
  std::vector<LoopbackConfig> v;
  if (name == "small" || name == "small-mma") {
    // One rank (it pushes to and receives from itself through the same peer-pointer paths). Several ranks cannot run
    // under compute-sanitizer: its tools serialize kernels, and ranks sharing a GPU spin-wait on each other's kernels,
    // so every wait would time out (seen on the H200 with R=2).
    const int shapes[4][3] = {{64, 72, 40}, {128, 200, 136}, {64, 40, 24}, {192, 128, 192}};  // the last: wgmma
    for (const auto& shp : shapes)
      for (bool f32 : {false, true}) {
        LoopbackConfig c = base;
        c.ranks = 1;
        c.tokens = 48;
        c.experts = 4;
        c.d_model = shp[0];
        c.k_dim = shp[1];
        c.n_dim = shp[2];
        c.iters = 2;
        c.datasets = 1;
        c.routing = 1;
        c.f32 = f32;
        v.push_back(c);
      }
    // w transposed (the backward pass's layout): mma.sync, SIMT and (Hopper) wgmma loads of B along K.
    const int transposed[3][4] = {{128, 200, 136, 0}, {128, 200, 136, 1}, {192, 128, 192, 0}};  // D, K, N, f32
    for (const auto& shp : transposed) {
      LoopbackConfig c = v.front();
      c.d_model = shp[0];
      c.k_dim = shp[1];
      c.n_dim = shp[2];
      c.f32 = shp[3] != 0;
      c.transpose_rhs = true;
      v.push_back(c);
    }
    if (name == "small-mma") {
      // Without the cases the wgmma producer runs on this GPU (ProducerPath, asked with null operands: the
      // harness's buffers are cudaMalloc'd, so aligned), for racecheck: it instruments every shared-memory access,
      // and on the H200 the first wgmma case (its TMA / mbarrier pipeline over ~200 KB of shared memory) had not
      // finished after 180 s (session 7, call 2), while the other cases take 0.4-2 s. memcheck and synccheck run
      // the whole "small" suite.
      std::vector<LoopbackConfig> keep;
      for (const auto& c : v)
        if (std::string(jmo::cuda::ProducerPath(c.f32 ? jmo::cuda::DType::kF32 : jmo::cuda::DType::kBF16, c.k_dim,
                                                c.n_dim, c.transpose_rhs, nullptr, nullptr)) != "wgmma bf16")
          keep.push_back(c);
      return keep;
    }
    return v;
  }
  std::vector<LoopbackConfig> resource;
  for (int R : {1, 2, 4}) {  // the resource manager on the device (every CTA computes the same C), then serialized
    for (bool ser : {false, true}) {
      LoopbackConfig c = base;
      c.ranks = R;
      c.experts = 4 * R;
      c.tokens = 256;
      c.k_dim = 256;
      c.n_dim = 264;
      c.routing = 1;
      c.consumers = ser ? 3 : 0;
      c.serialize = ser;
      c.has_model = true;
      c.model = SuiteModel();
      c.iters = 12;
      resource.push_back(c);
    }
  }
  {  // manager + serialized together, float32 operands (the SIMT path keeps the fixed C), 8 ranks
    LoopbackConfig c = base;
    c.ranks = 8;
    c.experts = 16;
    c.routing = 2;
    c.consumers = 0;
    c.serialize = true;
    c.has_model = true;
    c.model = SuiteModel();
    c.iters = 10;
    resource.push_back(c);
    c.f32 = true;
    c.ranks = 2;
    c.experts = 4;
    resource.push_back(c);
  }
  if (name == "resource") return resource;
  // dispatch_gemm: the dispatch and GEMM1 in one launch (bf16, D and K multiples of 64: the wgmma engine).
  std::vector<LoopbackConfig> dispatch_gemm;
  for (int R : {1, 2, 4, 8})
    for (int routing : {0, 1, 2}) {
      LoopbackConfig c = RankCase(base, R, routing, 12);
      c.d_model = 192;
      c.k_dim = 128;
      c.dispatch_gemm_pushers = R == 1 ? 1 : 2;
      dispatch_gemm.push_back(c);
    }
  {  // a forced timeout and recovery with the per-source waits
    LoopbackConfig c = dispatch_gemm[3];
    c.timeout_at = 5;
    dispatch_gemm.push_back(c);
  }
  if (name == "dispatch-gemm") return dispatch_gemm;
  if (name == "dispatch-gemm-time") {
    // Timing at a seed-like shape (R = 2 ranks sharing the GPU): dispatch + GEMM1 as two calls against dispatch_gemm
    // with 4, 8, 16 pushing CTAs (of each rank's 66), after a checked call on every 64th token.
    std::vector<LoopbackConfig> t;
    for (int pushers : {4, 8, 16}) {
      LoopbackConfig c = base;
      c.ranks = 2;
      c.experts = 8;
      c.tokens = 4096;
      c.d_model = 2048;
      c.k_dim = 4096;  // GEMM1's N = 2F (F = 2048), and expert_combine's K
      c.n_dim = 2048;
      c.routing = 0;
      c.datasets = 1;
      c.iters = 2;
      c.check_tokens = 64;
      c.time = true;
      c.reps = 20;
      c.dispatch_gemm_pushers = pushers;
      t.push_back(c);
    }
    return t;
  }
  if (name != "full") {
    std::fprintf(stderr, "unknown suite %s\n", name.c_str());
    std::exit(2);
  }
  for (int R : {2, 4, 8})
    for (int routing : {0, 1, 2}) v.push_back(RankCase(base, R, routing, 30));
  {  // 1000 consecutive iterations (2000 calls per rank) without a reset
    LoopbackConfig c = base;
    c.ranks = 8;
    c.experts = 16;
    c.routing = 1;
    c.iters = 1000;
    v.push_back(c);
  }
  {  // larger GEMM: many K tiles, several N tiles, multi-band segments
    LoopbackConfig c = base;
    c.ranks = 2;
    c.experts = 4;
    c.tokens = 256;
    c.d_model = 512;
    c.k_dim = 1024;
    c.n_dim = 520;
    c.iters = 6;
    c.datasets = 2;
    v.push_back(c);
  }
  for (int R : {1, 2, 4, 8}) {  // K and N multiples of 64: the wgmma producer on Hopper (128-row tiles = 2 bands,
    LoopbackConfig c = base;    // segments ending mid-tile, N = 320 = one full and one partial 256-column tile)
    c.ranks = R;
    c.experts = 2 * R;
    c.tokens = 192;
    c.d_model = 320;
    c.k_dim = 384;
    c.n_dim = 320;
    c.routing = R == 4 ? 2 : 1;
    c.iters = R == 8 ? 200 : 20;
    v.push_back(c);
  }
  for (int R : {2, 4}) {  // float32 operands (SIMT producer)
    LoopbackConfig c = base;
    c.ranks = R;
    c.experts = 2 * R;
    c.routing = 1;
    c.f32 = true;
    c.iters = 10;
    v.push_back(c);
  }
  {  // w transposed, read in place ([E_l, N, K]: the backward pass's dx = da @ W1^T) on each engine: wgmma on Hopper
     // (K, N multiples of 64; mma.sync elsewhere), mma.sync with N = 140 (not a multiple of 8: only w's rows, of K
     // elements, must be 16-byte chunks), SIMT (float32)
    const int transposed[3][5] = {{2, 320, 384, 320, 0}, {4, 128, 200, 140, 0}, {2, 128, 200, 136, 1}};  // R, D, K, N, f32
    for (const auto& shp : transposed) {
      LoopbackConfig c = base;
      c.ranks = shp[0];
      c.experts = 2 * shp[0];
      c.tokens = 192;
      c.d_model = shp[1];
      c.k_dim = shp[2];
      c.n_dim = shp[3];
      c.f32 = shp[4] != 0;
      c.transpose_rhs = true;
      c.routing = 1;
      c.iters = 12;
      v.push_back(c);
    }
  }
  {  // capacity overflow: slots dropped by the plan's rule
    LoopbackConfig c = base;
    c.ranks = 4;
    c.experts = 8;
    c.routing = 1;
    c.capacity_factor = 1.0;
    c.iters = 10;
    v.push_back(c);
  }
  {  // one rank held back 3 ms at the start of every call
    LoopbackConfig c = base;
    c.ranks = 4;
    c.experts = 8;
    c.delay_rank = 1;
    c.delay_us = 3000;
    c.iters = 20;
    v.push_back(c);
  }
  for (int R : {2, 8}) {  // a forced timeout: reported by the next call, then recovery
    LoopbackConfig c = base;
    c.ranks = R;
    c.experts = 2 * R;
    c.timeout_at = 5;
    c.iters = 15;
    v.push_back(c);
  }
  v.insert(v.end(), resource.begin(), resource.end());
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  // R rank streams must not share hardware queues (a waiting kernel would block another rank's kernel behind it).
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  // Load every kernel up front (Workspace::Create also does): lazy loading can wait for running kernels.
  setenv("CUDA_MODULE_LOADING", "EAGER", 0);
  LoopbackConfig base;
  std::string suite;
  std::vector<double> copy_sizes;
  bool device_info = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--suite") suite = next();
    else if (a == "--ranks") base.ranks = std::atoi(next());
    else if (a == "--tokens") base.tokens = std::atoi(next());
    else if (a == "--top-k") base.top_k = std::atoi(next());
    else if (a == "--experts") base.experts = std::atoi(next());
    else if (a == "--d-model") base.d_model = std::atoi(next());
    else if (a == "--k-dim") base.k_dim = std::atoi(next());
    else if (a == "--n-dim") base.n_dim = std::atoi(next());
    else if (a == "--iters") base.iters = std::atoi(next());
    else if (a == "--routing") base.routing = std::atoi(next());
    else if (a == "--capacity-factor") base.capacity_factor = std::atof(next());
    else if (a == "--f32") base.f32 = true;
    else if (a == "--transpose-rhs") base.transpose_rhs = true;
    else if (a == "--delay-rank") base.delay_rank = std::atoi(next());
    else if (a == "--delay-us") base.delay_us = std::atoll(next());
    else if (a == "--timeout-at") base.timeout_at = std::atoi(next());
    else if (a == "--timeout-ms") base.timeout_ms = std::atoll(next());
    else if (a == "--datasets") base.datasets = std::atoi(next());
    else if (a == "--seed") base.seed = std::strtoull(next(), nullptr, 10);
    else if (a == "--consumers") base.consumers = std::atoi(next());
    else if (a == "--sm-budget") base.sm_budget = std::atoi(next());
    else if (a == "--device") base.device = std::atoi(next());
    else if (a == "--zipf") base.zipf = std::atof(next());
    else if (a == "--device-info") device_info = true;
    else if (a == "--serialize") base.serialize = true;
    else if (a == "--time") base.time = true;
    else if (a == "--warmup") base.warmup = std::atoi(next());
    else if (a == "--reps") base.reps = std::atoi(next());
    else if (a == "--per-call-stats") base.per_call_stats = true;
    else if (a == "--decision-cost") base.decision_iters = std::atoi(next());
    else if (a == "--check-tokens") base.check_tokens = std::atoi(next());
    else if (a == "--dispatch-gemm") base.dispatch_gemm_pushers = std::atoi(next());
    else if (a == "--copy-ceiling") copy_sizes = ParseList(next());
    else if (a == "--sweep-consumers") {
      for (double c : ParseList(next())) base.sweep.push_back((int)c);
    } else if (a == "--model") {
      std::vector<double> m = ParseList(next());
      if (m.size() != 9) {
        std::fprintf(stderr, "--model takes 9 comma-separated numbers (ModelParams order), got %zu\n", m.size());
        return 2;
      }
      base.has_model = true;
      base.model = jmo::ModelParams{(int32_t)m[0], (int32_t)m[1], (int32_t)m[2], (int32_t)m[3], m[4], m[5], m[6], m[7],
                                    m[8]};
    }
    else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  if (device_info) {
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, base.device) != cudaSuccess) {
      std::fprintf(stderr, "cudaGetDeviceProperties failed\n");
      return 1;
    }
    // The producer engine (and its tile) that bf16 calls of --k-dim x --n-dim (--transpose-rhs) take on this device.
    alignas(16) static char dummy[16];
    cudaSetDevice(base.device);
    const std::string path =
        jmo::cuda::ProducerPath(jmo::cuda::DType::kBF16, base.k_dim, base.n_dim, base.transpose_rhs, dummy, dummy);
    int tile_m = 0, tile_n = 0;
    jmo::cuda::ProducerTile(path, &tile_m, &tile_n);
    std::printf("RESULT {\"kind\": \"device\", \"name\": \"%s\", \"sms\": %d, \"tile_m\": %d, \"tile_n\": %d, "
                "\"producer\": \"%s\", \"cc\": \"%d.%d\"}\n", prop.name, prop.multiProcessorCount, tile_m, tile_n,
                path.c_str(), prop.major, prop.minor);
    return 0;
  }
  if (!copy_sizes.empty()) {
    for (double b : copy_sizes) {
      const double us = jmo::cuda::CopyCeilingUs(base.device, (int64_t)b, base.reps);
      std::printf("COPY bytes=%.0f median_us=%.3f GB/s=%.1f\n", b, us, b / us * 1e-3);
      std::printf("RESULT {\"kind\": \"copy\", \"bytes\": %.0f, \"median_us\": %.4f, \"gbps\": %.3f}\n", b, us,
                  b / us * 1e-3);
    }
    return 0;
  }
  if (base.consumers < 0) {
    std::fprintf(stderr, "--consumers must be >= 0 (0: the manager)\n");
    return 2;
  }
  std::vector<LoopbackConfig> cases = suite.empty() ? std::vector<LoopbackConfig>{base} : Suite(suite, base);
  int failed = 0;
  for (const LoopbackConfig& c : cases) {
    jmo::cuda::LoopbackResult r = jmo::cuda::RunLoopback(c);
    std::printf("%s\n%s", r.summary.c_str(), r.log.c_str());
    for (const jmo::cuda::TimedVariant& v : r.timed) {
      std::ostringstream chosen, js;
      for (size_t i = 0; i < v.chosen.size(); ++i) chosen << (i ? "," : "") << v.chosen[i];
      std::printf("TIMED C=%s%s median_us=%.2f p10_us=%.2f p90_us=%.2f mean_us=%.2f producer_span_us=%.2f "
                  "consumer_span_us=%.2f chosen=%s pushed_MB=%.2f identical=%d\n",
                  v.consumers > 0 ? std::to_string(v.consumers).c_str() : "manager", v.serialize ? " serialized" : "",
                  v.median_us, v.p10_us, v.p90_us, v.mean_us, v.prod_span_us, v.cons_span_us, chosen.str().c_str(),
                  v.pushed_bytes / 1e6, (int)v.identical);
      js << "{\"kind\": \"timed\", \"consumers\": " << v.consumers << ", \"serialize\": " << (v.serialize ? 1 : 0)
         << ", \"median_us\": " << v.median_us << ", \"p10_us\": " << v.p10_us << ", \"p90_us\": " << v.p90_us
         << ", \"mean_us\": " << v.mean_us << ", \"producer_span_us\": " << v.prod_span_us
         << ", \"consumer_span_us\": " << v.cons_span_us << ", \"chosen\": [" << chosen.str()
         << "], \"pushed_bytes\": " << v.pushed_bytes << ", \"identical\": " << (v.identical ? "true" : "false")
         << ", \"budget\": " << r.budget << "}";
      std::printf("RESULT %s\n", js.str().c_str());
      if (!v.timeline.empty()) std::printf("TIMELINE %s\n", v.timeline.c_str());
    }
    if (c.time) {
      for (size_t q = 0; q < r.seg_rows.size(); ++q) {
        std::ostringstream js;
        js << "{\"kind\": \"plan\", \"rank\": " << q << ", \"ranks\": " << c.ranks << ", \"budget\": " << r.budget
           << ", \"seg_rows\": [";
        for (size_t i = 0; i < r.seg_rows[q].size(); ++i) js << (i ? ", " : "") << r.seg_rows[q][i];
        js << "]}";
        std::printf("RESULT %s\n", js.str().c_str());
      }
    }
    if (c.decision_iters > 0 && r.decision_choice > 0)
      std::printf("DECISION table_build_ns=%.1f decision_ns=%.1f choice=%d\nRESULT {\"kind\": \"decision\", "
                  "\"table_ns\": %.2f, \"decision_ns\": %.3f, \"choice\": %d}\n",
                  r.table_ns, r.decision_ns, r.decision_choice, r.table_ns, r.decision_ns, r.decision_choice);
    std::fflush(stdout);
    if (!r.pass) ++failed;
  }
  std::printf("loopback: %d of %zu cases passed\n", (int)cases.size() - failed, cases.size());
  return failed ? 1 : 0;
}

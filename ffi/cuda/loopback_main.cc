// jmo_loopback: runs the loopback harness (loopback.h) on one GPU.
//
//   jmo_loopback --suite full        R = 2, 4, 8 x balanced / moderate / extreme routing, float32, capacity drops,
//                                    a held-back rank, a forced timeout with recovery, 1000 consecutive iterations
//   jmo_loopback --suite small       a few one-rank calls at small sizes (for compute-sanitizer)
//   jmo_loopback --ranks 4 --routing 1 --iters 100 ...   one case (see LoopbackConfig for the options)
// Prints one PASS/FAIL line per case; exits non-zero if any case fails.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/loopback.h"

using jmo::cuda::LoopbackConfig;

namespace {

std::vector<LoopbackConfig> Suite(const std::string& name, const LoopbackConfig& base) {
  std::vector<LoopbackConfig> v;
  if (name == "small") {
    // One rank (it pushes to and receives from itself through the same peer-pointer paths). Several ranks cannot run
    // under compute-sanitizer: its tools serialize kernels, and ranks sharing a GPU spin-wait on each other's kernels,
    // so every wait would time out (seen on the H200 with R=2).
    const int shapes[3][3] = {{64, 72, 40}, {128, 200, 136}, {64, 40, 24}};
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
    return v;
  }
  if (name != "full") {
    std::fprintf(stderr, "unknown suite %s\n", name.c_str());
    std::exit(2);
  }
  for (int R : {2, 4, 8})
    for (int routing : {0, 1, 2}) {
      LoopbackConfig c = base;
      c.ranks = R;
      c.experts = 2 * R;
      c.routing = routing;
      c.iters = 30;
      v.push_back(c);
    }
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
  for (int R : {2, 4}) {  // float32 operands (SIMT producer)
    LoopbackConfig c = base;
    c.ranks = R;
    c.experts = 2 * R;
    c.routing = 1;
    c.f32 = true;
    c.iters = 10;
    v.push_back(c);
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
    else if (a == "--delay-rank") base.delay_rank = std::atoi(next());
    else if (a == "--delay-us") base.delay_us = std::atoll(next());
    else if (a == "--timeout-at") base.timeout_at = std::atoi(next());
    else if (a == "--timeout-ms") base.timeout_ms = std::atoll(next());
    else if (a == "--datasets") base.datasets = std::atoi(next());
    else if (a == "--seed") base.seed = std::strtoull(next(), nullptr, 10);
    else if (a == "--consumers") base.consumers = std::atoi(next());
    else if (a == "--sm-budget") base.sm_budget = std::atoi(next());
    else if (a == "--device") base.device = std::atoi(next());
    else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  std::vector<LoopbackConfig> cases = suite.empty() ? std::vector<LoopbackConfig>{base} : Suite(suite, base);
  int failed = 0;
  for (const LoopbackConfig& c : cases) {
    jmo::cuda::LoopbackResult r = jmo::cuda::RunLoopback(c);
    std::printf("%s\n%s", r.summary.c_str(), r.log.c_str());
    std::fflush(stdout);
    if (!r.pass) ++failed;
  }
  std::printf("loopback: %d of %zu cases passed\n", (int)cases.size() - failed, cases.size());
  return failed ? 1 : 0;
}

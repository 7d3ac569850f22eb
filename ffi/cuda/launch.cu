// Host side shared by every launcher: device attributes, the one-CTA-per-SM preparation of kernels whose CTAs wait
// on each other, launch errors, and loading every kernel of the library when a workspace is created.
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "cuda/launch.h"

namespace jmo::cuda {

Status GetDeviceInfo(int dev, DeviceInfo* info) {
  static std::mutex mu;
  static DeviceInfo cache[64];
  std::lock_guard<std::mutex> lock(mu);
  if (dev < 0 || dev >= 64) return Status::Error(kInvalidArgument, "device ordinal out of range");
  if (cache[dev].sms == 0) {
    Status s = CudaStatus(cudaDeviceGetAttribute(&cache[dev].sms, cudaDevAttrMultiProcessorCount, dev), "attr");
    if (s.ok())
      s = CudaStatus(
          cudaDeviceGetAttribute(&cache[dev].smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev), "attr");
    if (s.ok())
      s = CudaStatus(cudaDeviceGetAttribute(&cache[dev].cc.major, cudaDevAttrComputeCapabilityMajor, dev), "attr");
    if (s.ok())
      s = CudaStatus(cudaDeviceGetAttribute(&cache[dev].cc.minor, cudaDevAttrComputeCapabilityMinor, dev), "attr");
    if (!s.ok()) {
      cache[dev].sms = 0;
      return s;
    }
  }
  *info = cache[dev];
  return Status{};
}

Status CurrentDeviceInfo(DeviceInfo* info) {
  int dev = 0;
  Status s = CudaStatus(cudaGetDevice(&dev), "cudaGetDevice");
  return s.ok() ? GetDeviceInfo(dev, info) : s;
}

Status SetKernelSmem(const void* kernel, int bytes, const char* name) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, int> set;  // (kernel, device) -> bytes set
  int dev = 0;
  Status s = CudaStatus(cudaGetDevice(&dev), "cudaGetDevice");
  if (!s.ok()) return s;
  std::lock_guard<std::mutex> lock(mu);
  int& done = set[{kernel, dev}];
  if (done == bytes) return Status{};
  const std::string what = std::string("cudaFuncSetAttribute(") + name + ")";
  s = CudaStatus(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), what.c_str());
  if (s.ok()) done = bytes;
  return s;
}

Status PrepareOneCtaPerSm(const void* kernel, int threads, int need, const KernelSetup& setup, const char* name,
                          int dev, int* smem_bytes) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, int> prepared;  // (kernel, device) -> bytes set
  DeviceInfo info;
  Status s = GetDeviceInfo(dev, &info);
  if (!s.ok()) return s;
  const int bytes = std::max(need, info.smem_per_sm / 2 + 1);
  *smem_bytes = bytes;
  std::lock_guard<std::mutex> lock(mu);
  int& done = prepared[{kernel, dev}];
  if (done != bytes) {
    const std::string what = std::string(setup.name) + "(" + name + ")";
    s = CudaStatus(setup.set_smem != nullptr
                       ? setup.set_smem(kernel, bytes)
                       : cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
                   what.c_str());
    if (!s.ok()) return s;
    int blocks = 0;
    s = CudaStatus(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, bytes),
                   "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    if (!s.ok()) return s;
    if (blocks != 1)
      return Status::Error(kInternal, std::string("jax_moe_overlap: expected exactly one ") + name +
                                          " CTA per SM, occupancy says " + std::to_string(blocks));
    done = bytes;
  }
  return Status{};
}

Status LaunchError(const char* what) {
  return CudaStatus(cudaGetLastError(), what);
}

namespace {
__global__ void EmptyKernel() {}
}  // namespace

Status LaunchEmpty(cudaStream_t stream) {
  EmptyKernel<<<1, 1, 0, stream>>>();
  return LaunchError("launch of EmptyKernel");
}

Status PrepareKernels(int dev) {
  Status s = PrepareExpertKernels(dev);
  if (s.ok()) s = PrepareProtocolKernels(dev);
  if (s.ok()) s = PrepareDispatchKernels(dev);
  if (s.ok()) s = PrepareCombineKernels(dev);
  if (s.ok()) s = PrepareGatherSumKernels(dev);
  if (s.ok()) s = PrepareCountsKernels(dev);
  return s;
}

}  // namespace jmo::cuda

#include "platform/cuda/cuda_platform.h"

#include <cuda_runtime_api.h>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "platform/cuda/cuda_util.h"

namespace kvrelay::platform::cuda {
namespace {

class CudaMemoryResource final : public kv::MemoryResource {
 public:
  CudaMemoryResource(kv::MemoryKind kind, int device) : kind_(kind), device_(device) {}
  kv::MemoryKind kind() const override { return kind_; }

  absl::StatusOr<void*> Allocate(size_t bytes) override {
    if (bytes == 0) return absl::InvalidArgumentError("Allocate: bytes must be positive");
    void* p = nullptr;
    if (kind_ == kv::MemoryKind::kDevice) {
      DeviceGuard guard(device_);
      KV_RETURN_IF_CUDA_ERROR(cudaMalloc(&p, bytes));
    } else {
      KV_RETURN_IF_CUDA_ERROR(cudaHostAlloc(&p, bytes, cudaHostAllocPortable));
    }
    return p;
  }

  void Deallocate(void* ptr, size_t) override {
    if (ptr == nullptr) return;
    if (kind_ == kv::MemoryKind::kDevice) {
      DeviceGuard guard(device_);
      cudaFree(ptr);
    } else {
      cudaFreeHost(ptr);
    }
  }

 private:
  const kv::MemoryKind kind_;
  const int device_;
};

class CudaPlatform final : public DevicePlatform {
 public:
  explicit CudaPlatform(std::vector<DeviceInfo> devices) : devices_(std::move(devices)) {}
  std::string name() const override { return "cuda"; }
  std::vector<DeviceInfo> devices() const override { return devices_; }

  absl::StatusOr<std::unique_ptr<kv::MemoryResource>> MakeMemoryResource(kv::MemoryKind kind,
                                                                         int device) override {
    if (device < 0 || device >= static_cast<int>(devices_.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("device ", device, " out of range [0, ", devices_.size(), ")"));
    }
    if (kind == kv::MemoryKind::kHost) return kv::MakeHostMemoryResource();
    return std::make_unique<CudaMemoryResource>(kind, device);
  }

  absl::Status Copy(void* dst, const void* src, size_t bytes) override {
    // cudaMemcpyDefault: unified addressing tells the direction from the pointers.
    KV_RETURN_IF_CUDA_ERROR(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault));
    return absl::OkStatus();
  }

 private:
  const std::vector<DeviceInfo> devices_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DevicePlatform>> MakeCudaPlatform() {
  int count = 0;
  // Any error means "no GPU": no driver, insufficient driver, no device.
  if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error so later probes start clean
    return absl::FailedPreconditionError(absl::StrCat("no CUDA device: ", cudaGetErrorString(e)));
  }
  if (count == 0) return absl::FailedPreconditionError("no CUDA device: device count is 0");
  std::vector<DeviceInfo> devices;
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    devices.push_back(
        {i, prop.name, static_cast<int64_t>(prop.totalGlobalMem), prop.major * 10 + prop.minor});
  }
  if (devices.empty()) return absl::FailedPreconditionError("no CUDA device answered");
  return std::unique_ptr<DevicePlatform>(new CudaPlatform(std::move(devices)));
}

}  // namespace kvrelay::platform::cuda

#include "platform/device_platform.h"

#include <cstring>

#ifdef KVRELAY_HAVE_CUDA
#include "platform/cuda/cuda_platform.h"
#endif

namespace kvrelay::platform {
namespace {

class CpuPlatform final : public DevicePlatform {
 public:
  std::string name() const override { return "cpu"; }
  std::vector<DeviceInfo> devices() const override { return {}; }
  absl::StatusOr<std::unique_ptr<kv::MemoryResource>> MakeMemoryResource(kv::MemoryKind kind,
                                                                         int) override {
    if (kind != kv::MemoryKind::kHost) {
      return absl::UnimplementedError("the CPU platform has host memory only");
    }
    return kv::MakeHostMemoryResource();
  }
  absl::Status Copy(void* dst, const void* src, size_t bytes) override {
    std::memmove(dst, src, bytes);
    return absl::OkStatus();
  }
};

}  // namespace

std::unique_ptr<DevicePlatform> MakeCpuPlatform() { return std::make_unique<CpuPlatform>(); }

absl::StatusOr<std::unique_ptr<DevicePlatform>> MakeDevicePlatform() {
#ifdef KVRELAY_HAVE_CUDA
  return cuda::MakeCudaPlatform();
#else
  return absl::UnimplementedError("built without CUDA");
#endif
}

std::unique_ptr<DevicePlatform> MakeBestPlatform() {
  absl::StatusOr<std::unique_ptr<DevicePlatform>> device = MakeDevicePlatform();
  if (device.ok()) return *std::move(device);
  return MakeCpuPlatform();
}

}  // namespace kvrelay::platform

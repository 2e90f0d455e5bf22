#pragma once

// DevicePlatform: where KV memory lives and how bytes move between host and device. The CPU
// platform is always there; the CUDA platform exists in CUDA builds on machines with a device.
// KVRELAY_HAVE_CUDA is read in exactly one file, device_platform.cc (the factory).
//
// Thread-safe: every method may be called from any thread.

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kv/pool/memory_resource.h"

namespace kvrelay::platform {

struct DeviceInfo {
  int index = 0;
  std::string name;
  int64_t total_memory_bytes = 0;
  int compute_capability = 0;  // e.g. 90 for sm_90
};

class DevicePlatform {
 public:
  virtual ~DevicePlatform() = default;
  virtual std::string name() const = 0;  // "cpu" or "cuda"
  virtual std::vector<DeviceInfo> devices() const = 0;
  // Host memory on every platform; pinned host and device memory on CUDA.
  // Unimplemented for a kind the platform does not have.
  virtual absl::StatusOr<std::unique_ptr<kv::MemoryResource>> MakeMemoryResource(
      kv::MemoryKind kind, int device = 0) = 0;
  // Synchronous copy between any two addresses this platform's resources handed out.
  virtual absl::Status Copy(void* dst, const void* src, size_t bytes) = 0;
};

std::unique_ptr<DevicePlatform> MakeCpuPlatform();

// The accelerator platform. Unimplemented("built without CUDA") in builds without nvcc;
// FailedPrecondition naming the reason when the build has CUDA but the machine has no usable
// device (any CUDA error counts as "no GPU", e.g. "insufficient driver").
absl::StatusOr<std::unique_ptr<DevicePlatform>> MakeDevicePlatform();

// MakeDevicePlatform() when it succeeds, the CPU platform otherwise.
std::unique_ptr<DevicePlatform> MakeBestPlatform();

}  // namespace kvrelay::platform

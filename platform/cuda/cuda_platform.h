#pragma once

// The CUDA DevicePlatform: device and pinned-host memory resources, synchronous copies.

#include <memory>

#include "absl/status/statusor.h"
#include "platform/device_platform.h"

namespace kvrelay::platform::cuda {

// FailedPrecondition naming CUDA's reason when no device is usable.
absl::StatusOr<std::unique_ptr<DevicePlatform>> MakeCudaPlatform();

}  // namespace kvrelay::platform::cuda

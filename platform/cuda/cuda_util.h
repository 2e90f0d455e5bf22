#pragma once

// RAII owners for CUDA runtime handles and the CUDA error -> absl::Status converter. CUDA builds
// only (this folder is added when nvcc is found).

#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace kvrelay::platform::cuda {

// cudaErrorMemoryAllocation -> ResourceExhausted; no device / driver -> FailedPrecondition;
// everything else Internal. The message names the call and CUDA's own text.
absl::Status FromCuda(cudaError_t error, const char* what);

#define KV_RETURN_IF_CUDA_ERROR(expr)                                    \
  do {                                                                   \
    cudaError_t kv_cuda_error_ = (expr);                                 \
    if (kv_cuda_error_ != cudaSuccess)                                   \
      return ::kvrelay::platform::cuda::FromCuda(kv_cuda_error_, #expr); \
  } while (false)

// Sets the current device for the scope and restores the previous one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

// Move-only owners. Each destructor runs on the device the handle was created on.
class CudaStream {
 public:
  static absl::StatusOr<CudaStream> Create(int device);
  CudaStream(CudaStream&& o) noexcept
      : device_(o.device_), stream_(std::exchange(o.stream_, nullptr)) {}
  CudaStream& operator=(CudaStream&& o) noexcept;
  ~CudaStream();
  cudaStream_t get() const { return stream_; }
  absl::Status Synchronize() const;

 private:
  CudaStream(int device, cudaStream_t s) : device_(device), stream_(s) {}
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
};

class CudaEvent {
 public:
  static absl::StatusOr<CudaEvent> Create(int device);
  CudaEvent(CudaEvent&& o) noexcept
      : device_(o.device_), event_(std::exchange(o.event_, nullptr)) {}
  CudaEvent& operator=(CudaEvent&& o) noexcept;
  ~CudaEvent();
  cudaEvent_t get() const { return event_; }
  absl::Status Record(cudaStream_t stream) const;
  // Milliseconds between `start` and this event. REQUIRES: both recorded and completed.
  absl::StatusOr<float> ElapsedSince(const CudaEvent& start) const;

 private:
  CudaEvent(int device, cudaEvent_t e) : device_(device), event_(e) {}
  int device_ = 0;
  cudaEvent_t event_ = nullptr;
};

class DeviceBuffer {
 public:
  static absl::StatusOr<DeviceBuffer> Allocate(int device, size_t bytes);
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : device_(o.device_), data_(std::exchange(o.data_, nullptr)), bytes_(o.bytes_) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  ~DeviceBuffer();
  void* data() const { return data_; }
  size_t size() const { return bytes_; }

 private:
  DeviceBuffer(int device, void* p, size_t bytes) : device_(device), data_(p), bytes_(bytes) {}
  int device_ = 0;
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

class PinnedBuffer {
 public:
  static absl::StatusOr<PinnedBuffer> Allocate(size_t bytes);
  PinnedBuffer(PinnedBuffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), bytes_(o.bytes_) {}
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept;
  ~PinnedBuffer();
  void* data() const { return data_; }
  size_t size() const { return bytes_; }

 private:
  PinnedBuffer(void* p, size_t bytes) : data_(p), bytes_(bytes) {}
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace kvrelay::platform::cuda

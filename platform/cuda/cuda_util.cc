#include "platform/cuda/cuda_util.h"

namespace kvrelay::platform::cuda {

absl::Status FromCuda(cudaError_t error, const char* what) {
  const std::string message =
      absl::StrCat(what, ": ", cudaGetErrorName(error), " (", cudaGetErrorString(error), ")");
  switch (error) {
    case cudaSuccess:
      return absl::OkStatus();
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(message);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
    case cudaErrorDevicesUnavailable:
      return absl::FailedPreconditionError(message);
    default:
      return absl::InternalError(message);
  }
}

DeviceGuard::DeviceGuard(int device) {
  if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
  if (previous_ != device) cudaSetDevice(device);
}

DeviceGuard::~DeviceGuard() {
  if (previous_ >= 0) cudaSetDevice(previous_);
}

absl::StatusOr<CudaStream> CudaStream::Create(int device) {
  DeviceGuard guard(device);
  cudaStream_t s = nullptr;
  KV_RETURN_IF_CUDA_ERROR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return CudaStream(device, s);
}

CudaStream& CudaStream::operator=(CudaStream&& o) noexcept {
  if (this != &o) {
    this->~CudaStream();
    device_ = o.device_;
    stream_ = std::exchange(o.stream_, nullptr);
  }
  return *this;
}

CudaStream::~CudaStream() {
  if (stream_ != nullptr) {
    DeviceGuard guard(device_);
    cudaStreamDestroy(stream_);
  }
}

absl::Status CudaStream::Synchronize() const {
  KV_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

absl::StatusOr<CudaEvent> CudaEvent::Create(int device) {
  DeviceGuard guard(device);
  cudaEvent_t e = nullptr;
  KV_RETURN_IF_CUDA_ERROR(cudaEventCreate(&e));
  return CudaEvent(device, e);
}

CudaEvent& CudaEvent::operator=(CudaEvent&& o) noexcept {
  if (this != &o) {
    this->~CudaEvent();
    device_ = o.device_;
    event_ = std::exchange(o.event_, nullptr);
  }
  return *this;
}

CudaEvent::~CudaEvent() {
  if (event_ != nullptr) {
    DeviceGuard guard(device_);
    cudaEventDestroy(event_);
  }
}

absl::Status CudaEvent::Record(cudaStream_t stream) const {
  KV_RETURN_IF_CUDA_ERROR(cudaEventRecord(event_, stream));
  return absl::OkStatus();
}

absl::StatusOr<float> CudaEvent::ElapsedSince(const CudaEvent& start) const {
  KV_RETURN_IF_CUDA_ERROR(cudaEventSynchronize(event_));
  float ms = 0;
  KV_RETURN_IF_CUDA_ERROR(cudaEventElapsedTime(&ms, start.event_, event_));
  return ms;
}

absl::StatusOr<DeviceBuffer> DeviceBuffer::Allocate(int device, size_t bytes) {
  DeviceGuard guard(device);
  void* p = nullptr;
  KV_RETURN_IF_CUDA_ERROR(cudaMalloc(&p, bytes));
  return DeviceBuffer(device, p, bytes);
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    this->~DeviceBuffer();
    device_ = o.device_;
    data_ = std::exchange(o.data_, nullptr);
    bytes_ = o.bytes_;
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() {
  if (data_ != nullptr) {
    DeviceGuard guard(device_);
    cudaFree(data_);
  }
}

absl::StatusOr<PinnedBuffer> PinnedBuffer::Allocate(size_t bytes) {
  void* p = nullptr;
  KV_RETURN_IF_CUDA_ERROR(cudaHostAlloc(&p, bytes, cudaHostAllocPortable));
  return PinnedBuffer(p, bytes);
}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    this->~PinnedBuffer();
    data_ = std::exchange(o.data_, nullptr);
    bytes_ = o.bytes_;
  }
  return *this;
}

PinnedBuffer::~PinnedBuffer() {
  if (data_ != nullptr) cudaFreeHost(data_);
}

}  // namespace kvrelay::platform::cuda

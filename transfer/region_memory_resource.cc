#include "transfer/region_memory_resource.h"

#include "absl/strings/str_cat.h"
#include "common/logging.h"

namespace kvrelay::transfer {

absl::StatusOr<void*> RegionMemoryResource::Allocate(size_t bytes) {
  absl::MutexLock lock(&mu_);
  if (region_ != nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("this resource already holds a region of ", region_->size_bytes(), " bytes"));
  }
  absl::StatusOr<MemoryRegionPtr> region = private_memory_
                                               ? transport_->AllocatePrivateMemory(bytes)
                                               : transport_->AllocateMemory(bytes);
  if (absl::IsUnimplemented(region.status())) return region.status();  // no private regions
  if (!region.ok()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("transport cannot allocate ", bytes, " bytes: ", region.status().message()));
  }
  region_ = std::move(*region);
  if (region_->kind() != MemoryKind::kDevice) {
    // Every page faulted in now (the memory is zero-filled, so zeros are written back): RSS is
    // the pool's whole size from the start, as RDMA registration (which pins pages) makes it,
    // instead of creeping up as load first reaches deeper slots (a soak's leak check read
    // that as growth), and no request pays the first-touch faults.
    constexpr size_t kPage = 4096;
    volatile uint8_t* bytes = region_->data();
    for (size_t at = 0; at < region_->size_bytes(); at += kPage) bytes[at] = 0;
  }
  return static_cast<void*>(region_->data());
}

void RegionMemoryResource::Deallocate(void* ptr, size_t) {
  absl::MutexLock lock(&mu_);
  if (region_ == nullptr || ptr != region_->data()) {
    KV_LOG(ERROR) << "RegionMemoryResource::Deallocate of memory it did not allocate";
    return;
  }
  region_.reset();
}

const MemoryRegion* RegionMemoryResource::region() const {
  absl::MutexLock lock(&mu_);
  return region_.get();
}

}  // namespace kvrelay::transfer

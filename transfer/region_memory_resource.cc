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

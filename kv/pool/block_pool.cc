#include "kv/pool/block_pool.h"

#include "absl/strings/str_cat.h"

namespace kvrelay::kv {
namespace {

constexpr int64_t kMaxSlots = int64_t{1} << 31;

}  // namespace

absl::StatusOr<std::unique_ptr<BlockPool>> BlockPool::Create(
    BlockPoolOptions options, std::unique_ptr<MemoryResource> resource) {
  if (resource == nullptr) return absl::InvalidArgumentError("BlockPool: resource is null");
  MemoryResource* raw = resource.get();
  auto pool = Create(options, raw);
  if (!pool.ok()) return pool.status();
  (*pool)->owned_resource_ = std::move(resource);
  return pool;
}

absl::StatusOr<std::unique_ptr<BlockPool>> BlockPool::Create(BlockPoolOptions options,
                                                             MemoryResource* resource) {
  if (resource == nullptr) return absl::InvalidArgumentError("BlockPool: resource is null");
  if (options.slot_bytes == 0) {
    return absl::InvalidArgumentError("BlockPool: slot_bytes must be positive, got 0");
  }
  if (options.num_slots <= 0 || options.num_slots >= kMaxSlots) {
    return absl::InvalidArgumentError(
        absl::StrCat("BlockPool: num_slots must be in [1, 2^31), got ", options.num_slots));
  }
  const size_t align = options.slot_alignment;
  if (align == 0 || (align & (align - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("BlockPool: slot_alignment must be a power of two, got ", align));
  }
  const size_t stride = (options.slot_bytes + align - 1) / align * align;
  if (stride > SIZE_MAX / static_cast<size_t>(options.num_slots)) {
    return absl::InvalidArgumentError("BlockPool: slot_bytes x num_slots overflows");
  }
  const size_t size_bytes = stride * static_cast<size_t>(options.num_slots);
  absl::StatusOr<void*> memory = resource->Allocate(size_bytes);
  if (!memory.ok()) return memory.status();
  return std::unique_ptr<BlockPool>(new BlockPool(
      options, resource, nullptr, static_cast<uint8_t*>(*memory), size_bytes, stride));
}

BlockPool::BlockPool(BlockPoolOptions options, MemoryResource* resource,
                     std::unique_ptr<MemoryResource> owned, uint8_t* base, size_t size_bytes,
                     size_t stride)
    : owned_resource_(std::move(owned)),
      resource_(resource),
      base_(base),
      size_bytes_(size_bytes),
      slot_bytes_(options.slot_bytes),
      stride_(stride),
      num_slots_(options.num_slots),
      refcounts_(new std::atomic<int32_t>[static_cast<size_t>(options.num_slots)]) {
  free_list_.reserve(static_cast<size_t>(num_slots_));
  // Push in reverse so slot 0 is handed out first (deterministic, cache-friendly).
  for (int64_t i = num_slots_ - 1; i >= 0; --i) {
    refcounts_[i].store(0, std::memory_order_relaxed);
    free_list_.push_back(static_cast<SlotId>(i));
  }
}

BlockPool::~BlockPool() { resource_->Deallocate(base_, size_bytes_); }

absl::Status BlockPool::CheckSlot(SlotId slot) const {
  if (slot < 0 || slot >= num_slots_) {
    return absl::InvalidArgumentError(
        absl::StrCat("slot ", slot, " out of range [0, ", num_slots_, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<SlotId> BlockPool::Allocate() {
  absl::MutexLock lock(&mu_);
  if (free_list_.empty()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("block pool full: all ", num_slots_, " slots in use"));
  }
  SlotId slot = free_list_.back();
  free_list_.pop_back();
  // Pairs with the acquire in Release(): the new owner sees the slot as fully released.
  refcounts_[slot].store(1, std::memory_order_release);
  return slot;
}

absl::StatusOr<std::vector<SlotId>> BlockPool::AllocateMany(int64_t n) {
  if (n < 0) return absl::InvalidArgumentError(absl::StrCat("AllocateMany: n = ", n));
  absl::MutexLock lock(&mu_);
  if (static_cast<int64_t>(free_list_.size()) < n) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "block pool: asked for ", n, " slots, ", free_list_.size(), " of ", num_slots_, " free"));
  }
  std::vector<SlotId> slots(free_list_.end() - n, free_list_.end());
  free_list_.resize(free_list_.size() - static_cast<size_t>(n));
  for (SlotId s : slots) refcounts_[s].store(1, std::memory_order_release);
  return slots;
}

absl::Status BlockPool::AddRef(SlotId slot) {
  if (absl::Status s = CheckSlot(slot); !s.ok()) return s;
  int32_t count = refcounts_[slot].load(std::memory_order_relaxed);
  do {
    if (count <= 0) {
      return absl::FailedPreconditionError(absl::StrCat("AddRef of free slot ", slot));
    }
  } while (!refcounts_[slot].compare_exchange_weak(count, count + 1, std::memory_order_relaxed));
  return absl::OkStatus();
}

absl::Status BlockPool::Release(SlotId slot) {
  if (absl::Status s = CheckSlot(slot); !s.ok()) return s;
  int32_t count = refcounts_[slot].load(std::memory_order_relaxed);
  do {
    if (count <= 0) {
      return absl::FailedPreconditionError(absl::StrCat("Release of free slot ", slot));
    }
    // acq_rel: the last releaser sees every earlier owner's writes before the slot is reused.
  } while (!refcounts_[slot].compare_exchange_weak(count, count - 1, std::memory_order_acq_rel));
  if (count == 1) {
    absl::MutexLock lock(&mu_);
    free_list_.push_back(slot);
  }
  return absl::OkStatus();
}

int32_t BlockPool::RefCount(SlotId slot) const {
  if (slot < 0 || slot >= num_slots_) return 0;
  return refcounts_[slot].load(std::memory_order_acquire);
}

SlotId BlockPool::SlotOf(const void* address) const {
  const uint8_t* p = static_cast<const uint8_t*>(address);
  if (p < base_ || p >= base_ + size_bytes_) return -1;
  return static_cast<SlotId>(static_cast<size_t>(p - base_) / stride_);
}

int64_t BlockPool::free_slots() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(free_list_.size());
}

}  // namespace kvrelay::kv

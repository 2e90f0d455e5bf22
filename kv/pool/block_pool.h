#pragma once

// BlockPool: fixed-size slots carved out of one allocation from a MemoryResource.
//
// O(1) allocate/free (a free-list stack under one mutex), atomic reference counts per slot so
// AddRef/Release on a live slot never take the lock, ResourceExhausted when full. A slot is
// never handed out twice: it returns to the free list only when its count drops to zero, and
// Release of a free slot is reported (FailedPrecondition), not applied.
//
// Thread-safe. The pool owns its memory; SlotAddress() pointers stay valid until the pool is
// destroyed. The MemoryResource must outlive the pool when passed by pointer.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kv/pool/memory_resource.h"

namespace kvrelay::kv {

using SlotId = int32_t;

struct BlockPoolOptions {
  size_t slot_bytes = 0;        // > 0; rounded up to slot_alignment
  int64_t num_slots = 0;        // > 0, < 2^31
  size_t slot_alignment = 256;  // power of two; 256 keeps GPU and DMA engines happy
};

class BlockPool {
 public:
  // Owns `resource`.
  static absl::StatusOr<std::unique_ptr<BlockPool>> Create(
      BlockPoolOptions options, std::unique_ptr<MemoryResource> resource);
  // Borrows `resource`, which must outlive the pool.
  static absl::StatusOr<std::unique_ptr<BlockPool>> Create(BlockPoolOptions options,
                                                           MemoryResource* resource);
  ~BlockPool();
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  // A free slot with reference count 1. ResourceExhausted when none is free.
  absl::StatusOr<SlotId> Allocate() ABSL_LOCKS_EXCLUDED(mu_);
  // n slots, all or nothing.
  absl::StatusOr<std::vector<SlotId>> AllocateMany(int64_t n) ABSL_LOCKS_EXCLUDED(mu_);
  // InvalidArgument for an id out of range, FailedPrecondition for a free slot.
  absl::Status AddRef(SlotId slot);
  // Drops one reference; the slot is free again at zero.
  absl::Status Release(SlotId slot) ABSL_LOCKS_EXCLUDED(mu_);
  int32_t RefCount(SlotId slot) const;

  // REQUIRES: 0 <= slot < num_slots().
  void* SlotAddress(SlotId slot) const { return base_ + static_cast<size_t>(slot) * stride_; }
  // Slot id of an address inside the pool, or -1.
  SlotId SlotOf(const void* address) const;

  void* base() const { return base_; }
  size_t size_bytes() const { return size_bytes_; }
  size_t slot_bytes() const { return slot_bytes_; }  // as requested
  size_t slot_stride() const { return stride_; }     // distance between slots
  int64_t num_slots() const { return num_slots_; }
  int64_t free_slots() const ABSL_LOCKS_EXCLUDED(mu_);
  MemoryKind memory_kind() const { return resource_->kind(); }

 private:
  BlockPool(BlockPoolOptions options, MemoryResource* resource,
            std::unique_ptr<MemoryResource> owned, uint8_t* base, size_t size_bytes, size_t stride);
  absl::Status CheckSlot(SlotId slot) const;

  // Constant after construction.
  std::unique_ptr<MemoryResource> owned_resource_;
  MemoryResource* resource_;
  uint8_t* base_;
  size_t size_bytes_;
  size_t slot_bytes_;
  size_t stride_;
  int64_t num_slots_;

  // refcounts_[i] is 0 exactly when slot i is on free_list_. Increments from 0 happen only
  // under mu_ (in Allocate); a release that reaches 0 pushes under mu_.
  std::unique_ptr<std::atomic<int32_t>[]> refcounts_;
  mutable absl::Mutex mu_;
  std::vector<SlotId> free_list_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvrelay::kv

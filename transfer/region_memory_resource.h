#pragma once

// RegionMemoryResource: a kv::MemoryResource whose memory comes from
// Transport::AllocateMemory, so a worker's kv::BlockPool lives in transport-registered memory
// (for UCX: shared-memory segments that local peers put into with plain memcpy) and its one
// region can be published to peers:
//
//   RegionMemoryResource resource(transport.get());
//   KV_ASSIGN_OR_RETURN(auto pool, kv::BlockPool::Create(options, &resource));
//   publish(transport->address(), resource.region()->id());
//
// Holds at most one allocation at a time (a BlockPool makes exactly one). Thread-safe. The
// transport must outlive this resource, and the resource must outlive the pool.

#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "kv/pool/memory_resource.h"
#include "transfer/transport.h"

namespace kvrelay::transfer {

class RegionMemoryResource final : public kv::MemoryResource {
 public:
  // `private_memory`: Transport::AllocatePrivateMemory (announced to no peer).
  explicit RegionMemoryResource(Transport* transport, bool private_memory = false)
      : transport_(transport), private_memory_(private_memory) {}

  kv::MemoryKind kind() const override { return kv::MemoryKind::kHost; }
  // ResourceExhausted when the transport cannot allocate, FailedPrecondition when this
  // resource already holds an allocation.
  absl::StatusOr<void*> Allocate(size_t bytes) override;
  void Deallocate(void* ptr, size_t bytes) override;
  // The registered region behind the current allocation, or null.
  const MemoryRegion* region() const;

 private:
  Transport* const transport_;
  const bool private_memory_;
  mutable absl::Mutex mu_;
  MemoryRegionPtr region_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvrelay::transfer

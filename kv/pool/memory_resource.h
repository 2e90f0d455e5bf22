#pragma once

// Where block-pool memory comes from. Host memory lives here; pinned host and device memory
// resources are implemented in platform/cuda (CUDA builds only) behind the same interface.

#include <cstddef>
#include <memory>
#include <string_view>

#include "absl/status/statusor.h"

namespace kvrelay::kv {

enum class MemoryKind { kHost, kPinnedHost, kDevice };
std::string_view MemoryKindName(MemoryKind kind);

// A contiguous allocation. Thread-safe: implementations may be called from any thread.
class MemoryResource {
 public:
  virtual ~MemoryResource() = default;
  virtual MemoryKind kind() const = 0;
  // Page-aligned memory of at least `bytes`. ResourceExhausted when it cannot be had.
  virtual absl::StatusOr<void*> Allocate(size_t bytes) = 0;
  // REQUIRES: ptr came from Allocate(bytes) on this resource.
  virtual void Deallocate(void* ptr, size_t bytes) = 0;
  // Whether the last Allocate got huge pages (host only; diagnostics).
  virtual bool UsedHugePages() const { return false; }
};

// Anonymous mmap. With try_huge_pages: MAP_HUGETLB first (explicit 2 MiB pages, when the
// system has them reserved), else madvise(MADV_HUGEPAGE) for transparent huge pages.
std::unique_ptr<MemoryResource> MakeHostMemoryResource(bool try_huge_pages = true);

}  // namespace kvrelay::kv

#include "kv/pool/memory_resource.h"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/errno_status.h"

namespace kvrelay::kv {
namespace {

constexpr size_t kHugePageBytes = size_t{2} << 20;

size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

class HostMemoryResource final : public MemoryResource {
 public:
  explicit HostMemoryResource(bool try_huge_pages) : try_huge_pages_(try_huge_pages) {}

  MemoryKind kind() const override { return MemoryKind::kHost; }

  absl::StatusOr<void*> Allocate(size_t bytes) override {
    if (bytes == 0) return absl::InvalidArgumentError("Allocate: bytes must be positive");
    if (try_huge_pages_ && bytes >= kHugePageBytes) {
      void* p = ::mmap(nullptr, RoundUp(bytes, kHugePageBytes), PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0);
      if (p != MAP_FAILED) {
        used_huge_pages_.store(true, std::memory_order_relaxed);
        Remember(p, RoundUp(bytes, kHugePageBytes));
        return p;
      }
    }
    void* p = ::mmap(nullptr, RoundUp(bytes, PageBytes()), PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      return ErrnoToStatus(errno, absl::StrCat("mmap of ", bytes, " bytes"));
    }
    // Transparent huge pages cut TLB misses on large pools; advisory only.
    if (try_huge_pages_ && bytes >= kHugePageBytes) ::madvise(p, bytes, MADV_HUGEPAGE);
    used_huge_pages_.store(false, std::memory_order_relaxed);
    Remember(p, RoundUp(bytes, PageBytes()));
    return p;
  }

  void Deallocate(void* ptr, size_t /*bytes*/) override ABSL_LOCKS_EXCLUDED(mu_) {
    if (ptr == nullptr) return;
    size_t mapped_bytes = 0;
    {
      absl::MutexLock lock(&mu_);
      auto it = mappings_.find(ptr);
      if (it == mappings_.end()) return;  // not ours; nothing safe to do
      mapped_bytes = it->second;
      mappings_.erase(it);
    }
    ::munmap(ptr, mapped_bytes);
  }

  bool UsedHugePages() const override { return used_huge_pages_.load(std::memory_order_relaxed); }

 private:
  static size_t PageBytes() { return static_cast<size_t>(::sysconf(_SC_PAGESIZE)); }
  // munmap needs the length that was mapped (huge-page rounded for MAP_HUGETLB).
  void Remember(void* p, size_t mapped_bytes) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    mappings_[p] = mapped_bytes;
  }

  const bool try_huge_pages_;
  absl::Mutex mu_;
  absl::flat_hash_map<void*, size_t> mappings_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> used_huge_pages_{false};
};

}  // namespace

std::string_view MemoryKindName(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kHost:
      return "host";
    case MemoryKind::kPinnedHost:
      return "pinned_host";
    case MemoryKind::kDevice:
      return "device";
  }
  return "unknown";
}

std::unique_ptr<MemoryResource> MakeHostMemoryResource(bool try_huge_pages) {
  return std::make_unique<HostMemoryResource>(try_huge_pages);
}

}  // namespace kvrelay::kv

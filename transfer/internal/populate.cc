#include "transfer/internal/populate.h"

#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

#include "absl/strings/str_cat.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace kvrelay::transfer::internal {
namespace {

size_t PageSize() {
  static const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  return page;
}

// The bracketed word of a /sys/kernel/mm/transparent_hugepage setting ("always [madvise]").
std::string ThpSetting(const char* path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return "unknown";
  size_t open = line.find('['), close = line.find(']');
  if (open == std::string::npos || close == std::string::npos || close < open) return line;
  return line.substr(open + 1, close - open - 1);
}

}  // namespace

absl::Status PopulateForWrite(void* data, size_t bytes) {
  if (data == nullptr || bytes == 0) return absl::OkStatus();
  const size_t page = PageSize();
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data) & ~(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes + page - 1) & ~(page - 1);
  const int e =
      ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_WRITE) == 0 ? 0 : errno;
  if (e == ENOMEM) {
    return absl::UnavailableError(
        absl::StrCat("populating ", bytes, " bytes at ", absl::Hex(begin), ": range not mapped"));
  }
  if (e == EFAULT || e == EHWPOISON) {
    return absl::ResourceExhaustedError(
        absl::StrCat("populating ", bytes, " bytes: ", std::strerror(e)));
  }
  // Then one read per page. Without MADV_POPULATE_WRITE (EINVAL: kernel < 5.14) this is the
  // populating itself: a read fault on a shared mapping maps the page writable (shared memory
  // keeps no dirty accounting). With it, it is still needed under shadow paging (measured on
  // this project's PVM guests: the first access to each populated page costs ~7 us of CPU in
  // the hypervisor, no guest fault counted, as much as the fault itself).
  // Each page is touched at a byte of the span (the first page at `data` itself): the bytes
  // before it on that page are not the caller's (ASan reported this as an overflow).
  const uintptr_t first = reinterpret_cast<uintptr_t>(data);
  for (uintptr_t p = begin; p < end; p += page) {
    (void)*reinterpret_cast<volatile const uint8_t*>(std::max(p, first));
  }
  return absl::OkStatus();
}

std::string AdviseHugePages(void* data, size_t bytes, bool shared_memory) {
  const size_t page = PageSize();
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + page - 1) & ~(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(page - 1);
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
  return ThpSetting(shared_memory ? "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
                                  : "/sys/kernel/mm/transparent_hugepage/enabled");
}

PageFaults ProcessPageFaults() {
  rusage ru = {};
  ::getrusage(RUSAGE_SELF, &ru);
  return PageFaults{ru.ru_minflt, ru.ru_majflt};
}

PageFaults ThreadPageFaults() {
  rusage ru = {};
  ::getrusage(RUSAGE_THREAD, &ru);
  return PageFaults{ru.ru_minflt, ru.ru_majflt};
}

}  // namespace kvrelay::transfer::internal

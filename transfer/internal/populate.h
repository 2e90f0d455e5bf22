#pragma once

// Populating memory ahead of use, so that no transfer pays page faults on its hot path.
//
// A fault costs microseconds per 4 KiB page (more on a virtual machine); a 256 KiB block that
// lands on pages nobody has touched yet takes 64 of them. Shared-memory regions are touched on
// both sides: the owner's pages when the segment is created, and the writer's own mapping of
// the same segment (UCX maps a peer's segment when it unpacks the remote key), whose page-table
// entries are separate and start empty even when the owner populated every page.

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace kvrelay::transfer::internal {

// Maps every page of [data, data + bytes) writable without changing its contents
// (madvise(MADV_POPULATE_WRITE), Linux 5.14+), then reads one byte per page (which alone maps
// shared-memory pages writable on older kernels, and fills shadow page tables on virtual
// machines that use them). Safe while other processes write the memory. `data` need not be
// page-aligned. Unavailable for an unmapped range, ResourceExhausted when memory runs out.
absl::Status PopulateForWrite(void* data, size_t bytes);

// Asks for transparent huge pages on the range (madvise(MADV_HUGEPAGE)); best effort. Returns
// what the kernel allows for this kind of memory ("always", "madvise", "never", ...), for
// reports.
std::string AdviseHugePages(void* data, size_t bytes, bool shared_memory);

// Minor and major page faults of the calling process (getrusage(RUSAGE_SELF)) or thread.
struct PageFaults {
  int64_t minor = 0;
  int64_t major = 0;
};
PageFaults ProcessPageFaults();
PageFaults ThreadPageFaults();

}  // namespace kvrelay::transfer::internal

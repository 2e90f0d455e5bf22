#pragma once

namespace kvrelay {

// Hands the heap's free pages back to the kernel (glibc's malloc_trim). After a large transient
// allocation (a snapshot of a whole index, built and written at once) the allocator otherwise
// keeps that high-water mark resident for the rest of the process's life, which reads as a
// leak in RSS. Costs a walk of the heap's free chunks (milliseconds); call it after such work,
// not per request. A no-op where the C library has no such call.
void ReleaseFreeHeapMemory();

}  // namespace kvrelay

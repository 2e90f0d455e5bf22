#pragma once

// KV_CHECK is fatal: only for "impossible after init" and out-of-memory, never for anything a
// peer or user sends. KV_DCHECK is compiled out in NDEBUG builds.

#include <cstdio>
#include <cstdlib>

namespace kvrelay::internal {
[[noreturn]] inline void CheckFailed(const char* file, int line, const char* expr) {
  std::fprintf(stderr, "%s:%d: KV_CHECK failed: %s\n", file, line, expr);
  std::fflush(stderr);
  std::abort();
}
}  // namespace kvrelay::internal

#define KV_CHECK(cond)                                                        \
  do {                                                                        \
    if (!(cond)) ::kvrelay::internal::CheckFailed(__FILE__, __LINE__, #cond); \
  } while (false)

#ifdef NDEBUG
#define KV_DCHECK(cond) \
  do {                  \
    (void)sizeof(cond); \
  } while (false)
#else
#define KV_DCHECK(cond) KV_CHECK(cond)
#endif

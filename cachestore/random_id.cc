#include "cachestore/random_id.h"

#include <sys/random.h>

#include <cerrno>

#include "common/check.h"

namespace kvrelay::cachestore {

uint64_t RandomId() {
  uint64_t v = 0;
  while (v == 0) {
    const ssize_t n = getrandom(&v, sizeof(v), 0);
    // getrandom only fails on EINTR before init or with bad arguments: retry on EINTR.
    if (n < 0 && errno == EINTR) continue;
    KV_CHECK(n == static_cast<ssize_t>(sizeof(v)));
  }
  return v;
}

}  // namespace kvrelay::cachestore

#pragma once

// QuotaTable: how much of one thing (requests in flight, tokens of decode KV reserved) each key
// (a tenant, a client identity) holds at once, against one limit. Take() hands out a Lease that
// gives its units back when it is returned or destroyed; past the limit Take() refuses with
// RESOURCE_EXHAUSTED naming the key, the quota and its flag, attributed to the client
// (ErrorInfo{ROLE_CLIENT, FAILURE_OVERLOADED}), so no worker is ever blamed for it.
//
// Thread-safe. Leases must not outlive their table.

#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics.h"

namespace kvrelay::gateway {

class QuotaTable {
 public:
  // `kind` names the key in messages ("tenant", "client"), `unit` what is counted ("requests
  // in flight"), `flag` the flag that sets `limit` (0: no limit). `refusals` may be null.
  QuotaTable(std::string kind, std::string unit, std::string flag, int64_t limit,
             Counter* refusals);

  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept { *this = std::move(other); }
    Lease& operator=(Lease&& other) noexcept;
    ~Lease() { Return(); }
    // Gives the unit back now (idempotent).
    void Return();

   private:
    friend class QuotaTable;
    Lease(QuotaTable* table, std::string key, int64_t units)
        : table_(table), key_(std::move(key)), units_(units) {}
    QuotaTable* table_ = nullptr;
    std::string key_;
    int64_t units_ = 0;
  };

  // `units` (>= 1) for `key`, refused when they would take it past the limit. An empty key (no
  // identity, e.g. --insecure callers) and a table without a limit always succeed and count
  // nothing.
  absl::StatusOr<Lease> Take(const std::string& key, int64_t units = 1);
  int64_t Held(const std::string& key) const;
  int64_t limit() const { return limit_; }

 private:
  void Give(const std::string& key, int64_t units);

  const std::string kind_, unit_, flag_;
  const int64_t limit_;
  Counter* const refusals_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, int64_t> held_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvrelay::gateway

#pragma once

// QuotaTable: how much of one thing (requests in flight, decode reservations) each key (a
// tenant, a client identity) holds at once, against one limit. Take() hands out a Lease that
// gives its unit back when it is returned or destroyed; past the limit Take() refuses with
// RESOURCE_EXHAUSTED naming the key, the quota and its flag, attributed to the client
// (ErrorInfo{ROLE_CLIENT, FAILURE_OVERLOADED}), so no worker is ever blamed for it.
//
// Thread-safe. Leases must not outlive their table.

#include <cstdint>
#include <mutex>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "common/metrics.h"

namespace kvrelay::gateway {

class QuotaTable {
 public:
  // `kind` names the key in messages ("tenant", "client"), `holding` what is counted
  // ("requests in flight"), `flag` the flag that sets `limit` (0: no limit). `refusals` may be
  // null.
  QuotaTable(std::string kind, std::string holding, std::string flag, int32_t limit,
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
    Lease(QuotaTable* table, std::string key) : table_(table), key_(std::move(key)) {}
    QuotaTable* table_ = nullptr;
    std::string key_;
  };

  // One unit for `key`. An empty key (no identity, e.g. --insecure callers) and a table
  // without a limit always succeed and count nothing.
  absl::StatusOr<Lease> Take(const std::string& key);
  int32_t Held(const std::string& key) const;
  int32_t limit() const { return limit_; }

 private:
  void Give(const std::string& key);

  const std::string kind_, holding_, flag_;
  const int32_t limit_;
  Counter* const refusals_;
  mutable std::mutex mu_;
  absl::flat_hash_map<std::string, int32_t> held_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvrelay::gateway

#pragma once

// StoreLink: a worker's connection to the cache store, over CacheStoreClient. Registers the
// node (id + incarnation) and its cache segment, heartbeats from a background thread
// (re-registering if the store forgot the node, e.g. after a restart), matches prefixes under
// leases and commits new blocks.
//
// Thread-safe. The segment (if any) and the clock must outlive the link.

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "cachestore/client/cache_store_client.h"
#include "common/clock.h"
#include "common/server/credentials.h"
#include "kv/block_hash.h"
#include "model/kv_cache.h"
#include "worker/kv_memory.h"

namespace kvrelay::worker {

struct StoreLinkOptions {
  std::string cachestore_address;  // host:port
  std::string node_id;
  uint64_t incarnation = 0;
  std::string transport_kind = "ucx";
  std::string transport_address;  // where peers reach this node's data plane
  absl::Duration ttl = absl::Seconds(10);
  absl::Duration rpc_timeout = absl::Seconds(5);
  server::SecurityOptions security;
};

struct PrefixMatch {
  int32_t matched = 0;               // leading blocks committed somewhere
  std::vector<int64_t> local_slots;  // per matched block: our segment's slot, or -1
  uint64_t lease_id = 0;
};

class StoreLink {
 public:
  // Registers (retrying until `deadline`, so workers may start before the store).
  static absl::StatusOr<std::unique_ptr<StoreLink>> Connect(StoreLinkOptions options,
                                                            const CacheSegment* segment,
                                                            Clock* clock, absl::Time deadline);
  ~StoreLink();

  absl::StatusOr<PrefixMatch> MatchPrefix(const std::vector<kv::BlockHash>& chain,
                                          absl::Duration lease_ttl);
  void ReleaseLease(uint64_t lease_id);
  // Commits chain[first, last) (their KV is blocks first..last-1 of `seq`): allocates slots
  // preferring this node, copies the blocks placed here into the segment, commits them.
  // Blocks placed on other nodes are not committed. Returns how many were committed.
  absl::StatusOr<int32_t> CommitBlocks(const std::vector<kv::BlockHash>& chain, int64_t first,
                                       int64_t last, const model::Sequence& seq);

  const std::string& node_id() const { return options_.node_id; }
  uint64_t incarnation() const { return options_.incarnation; }

 private:
  StoreLink(StoreLinkOptions options, const CacheSegment* segment, Clock* clock,
            std::unique_ptr<cachestore::CacheStoreClient> client);
  absl::Status Register();
  void HeartbeatLoop();

  const StoreLinkOptions options_;
  const CacheSegment* segment_;
  Clock* const clock_;
  std::unique_ptr<cachestore::CacheStoreClient> client_;
  absl::Notification stop_;
  std::thread heartbeat_;
};

}  // namespace kvrelay::worker

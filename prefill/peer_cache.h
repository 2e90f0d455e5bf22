#pragma once

// PeerCache: one worker's data-plane connections, by address. A live peer is reused (UCX
// connects are costly); one that went away is dropped and connected again. Pushes to decode
// workers (PushSession) and pulls from cache holders share it.
//
// Thread-safe. The transport must outlive the cache.

#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "transfer/transport.h"

namespace kvrelay::prefill {

class PeerCache {
 public:
  explicit PeerCache(transfer::Transport* transport) : transport_(transport) {}
  PeerCache(const PeerCache&) = delete;
  PeerCache& operator=(const PeerCache&) = delete;

  // The live peer at `address`, connected now (presenting `key` in the hello, by `deadline`)
  // when there is none. Failures are Transport::Connect's: UNAVAILABLE (nobody answers),
  // DEADLINE_EXCEEDED, INVALID_ARGUMENT (malformed address), PERMISSION_DENIED (`key` refused).
  absl::StatusOr<transfer::PeerId> Get(const std::string& address, const std::string& key,
                                       absl::Time deadline);

 private:
  transfer::Transport* const transport_;
  absl::Mutex mu_;  // not held while connecting
  absl::flat_hash_map<std::string, transfer::PeerId> peers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvrelay::prefill

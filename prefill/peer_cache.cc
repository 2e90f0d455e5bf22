#include "prefill/peer_cache.h"

#include "common/status_macros.h"

namespace kvrelay::prefill {

absl::StatusOr<transfer::PeerId> PeerCache::Get(const std::string& address, const std::string& key,
                                                absl::Time deadline) {
  {
    absl::MutexLock lock(&mu_);
    auto it = peers_.find(address);
    if (it != peers_.end()) {
      // A peer that went away is dropped and reconnected.
      if (transport_->RemoteRegions(it->second).ok()) return it->second;
      peers_.erase(it);
    }
  }
  KV_ASSIGN_OR_RETURN(transfer::PeerId peer,
                      transport_->Connect(address, deadline, {.peer_key = key}));
  absl::MutexLock lock(&mu_);
  peers_[address] = peer;
  return peer;
}

}  // namespace kvrelay::prefill

#include "prefill/peer_cache.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace kvrelay::prefill {

absl::StatusOr<transfer::PeerId> PeerCache::Get(const std::string& address, const std::string& key,
                                                absl::Time deadline) {
  std::shared_ptr<Connecting> pending;
  bool leader = false;
  {
    absl::MutexLock lock(&mu_);
    auto it = peers_.find(address);
    if (it != peers_.end()) {
      // A peer that went away is dropped and reconnected.
      if (transport_->RemoteRegions(it->second).ok()) return it->second;
      peers_.erase(it);
    }
    auto [at, inserted] = connecting_.try_emplace(address);
    if (inserted) at->second = std::make_shared<Connecting>();
    pending = at->second;
    leader = inserted;
  }
  if (!leader) {
    if (!pending->done.WaitForNotificationWithDeadline(deadline)) {
      return absl::DeadlineExceededError(
          absl::StrCat("the connect to ", address, " under way did not finish in time"));
    }
    return pending->result;
  }
  absl::StatusOr<transfer::PeerId> peer = transport_->Connect(address, deadline, {.peer_key = key});
  {
    absl::MutexLock lock(&mu_);
    if (peer.ok()) peers_[address] = *peer;
    connecting_.erase(address);
  }
  pending->result = peer;
  pending->done.Notify();
  return peer;
}

}  // namespace kvrelay::prefill

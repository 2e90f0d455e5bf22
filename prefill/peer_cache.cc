#include "prefill/peer_cache.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace kvrelay::prefill {
namespace {
// How long a caller waits for a connect already under way to the same address.
constexpr absl::Duration kJoinFor = absl::Milliseconds(500);
}  // namespace

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
    // A connect finishes in milliseconds; one that takes longer was likely dialed while the
    // peer was unreachable (its SYNs back off for seconds after the link is back), so after
    // a short wait a caller dials on its own rather than sharing that one's fate.
    if (pending->done.WaitForNotificationWithDeadline(std::min(deadline, absl::Now() + kJoinFor))) {
      return pending->result;
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("the connect to ", address, " under way did not finish in time"));
    }
  }
  absl::StatusOr<transfer::PeerId> peer = transport_->Connect(address, deadline, {.peer_key = key});
  {
    absl::MutexLock lock(&mu_);
    if (peer.ok()) peers_[address] = *peer;
    if (leader) connecting_.erase(address);
  }
  if (leader) {
    pending->result = peer;
    pending->done.Notify();
  }
  return peer;
}

}  // namespace kvrelay::prefill

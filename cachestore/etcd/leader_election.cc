#include "cachestore/etcd/leader_election.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/logging.h"

namespace kvrelay::etcd {

LeaderElection::LeaderElection(EtcdClient* etcd, ElectionOptions options, OnChange on_change)
    : etcd_(etcd), options_(std::move(options)), on_change_(std::move(on_change)) {}

absl::StatusOr<std::unique_ptr<LeaderElection>> LeaderElection::Start(EtcdClient* etcd,
                                                                      ElectionOptions options,
                                                                      OnChange on_change) {
  if (options.key.empty() || options.value.empty()) {
    return absl::InvalidArgumentError("election: key and value must not be empty");
  }
  if (options.ttl < absl::Seconds(1) || options.safety_margin < absl::ZeroDuration() ||
      options.safety_margin >= options.ttl / 2) {
    return absl::InvalidArgumentError(
        "election: ttl must be >= 1s and safety_margin in [0, ttl / 2)");
  }
  auto election = std::unique_ptr<LeaderElection>(
      new LeaderElection(etcd, std::move(options), std::move(on_change)));
  LeaderElection* e = election.get();
  election->thread_ = std::thread([e] { e->Run(); });
  return election;
}

LeaderElection::~LeaderElection() { Resign(); }

void LeaderElection::Resign() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
  if (thread_.joinable()) thread_.join();
}

LeaderElection::State LeaderElection::state() const {
  absl::MutexLock lock(&mu_);
  State s = state_;
  if (s.leader && absl::Now() >= valid_until_) {
    s.leader = false;
    s.term = 0;
  }
  return s;
}

bool LeaderElection::IsLeader() const { return state().leader; }

int64_t LeaderElection::term() const { return state().term; }

bool LeaderElection::WaitUntilLeader(absl::Time deadline) const {
  while (absl::Now() < deadline) {
    if (IsLeader()) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return IsLeader();
}

void LeaderElection::SetState(State next) {
  bool changed;
  {
    absl::MutexLock lock(&mu_);
    changed = next.leader != state_.leader || next.term != state_.term ||
              next.leader_term != state_.leader_term;
    state_ = next;
  }
  if (changed && on_change_) on_change_(next);
}

bool LeaderElection::Renew() {
  const absl::Time sent = absl::Now();
  absl::StatusOr<absl::Duration> granted = etcd_->KeepAlive(lease_);
  if (granted.ok()) {
    absl::MutexLock lock(&mu_);
    // etcd counts the TTL from when it received the keepalive, which is after `sent`.
    valid_until_ = sent + *granted - options_.safety_margin;
    return true;
  }
  if (absl::IsNotFound(granted.status())) return false;  // expired at etcd
  absl::MutexLock lock(&mu_);
  return absl::Now() < valid_until_;  // etcd unreachable: valid until it could have expired
}

void LeaderElection::Run() {
  const absl::Duration renew_every = options_.ttl / 3;
  // The code of the failure last logged (-1: none): one line per kind of failure, not one per
  // retry.
  int logged_code = -1;
  while (!stop_.HasBeenNotified()) {
    // A fresh lease for each campaign: an expired one can never be renewed.
    const absl::Time granted_at = absl::Now();
    absl::StatusOr<int64_t> lease = etcd_->GrantLease(options_.ttl);
    if (!lease.ok()) {
      if (logged_code != static_cast<int>(lease.status().code())) {
        logged_code = static_cast<int>(lease.status().code());
        KV_LOG(WARNING) << "election: cannot get a lease from etcd (" << lease.status()
                        << "); retrying every " << renew_every << ", logged again only when "
                        << "the failure changes"
                        << (etcd_->tls() ? ""
                                         : "; this store talks to etcd in plain text, which an "
                                           "etcd started with --client-cert-auth refuses: give "
                                           "--etcd-ca, --etcd-cert and --etcd-key");
      }
      SetState(State{});
      stop_.WaitForNotificationWithTimeout(renew_every);
      continue;
    }
    logged_code = -1;
    lease_ = *lease;
    {
      absl::MutexLock lock(&mu_);
      valid_until_ = granted_at + options_.ttl - options_.safety_margin;
    }
    // Campaign: create the key, or follow whoever holds it until it goes.
    while (!stop_.HasBeenNotified()) {
      absl::StatusOr<EtcdClient::CreateResult> created =
          etcd_->CreateIfAbsent(options_.key, options_.value, lease_);
      if (!created.ok()) {
        KV_LOG(WARNING) << "election: " << created.status();
        if (!Renew()) break;
        stop_.WaitForNotificationWithTimeout(renew_every);
        continue;
      }
      if (created->created) {
        State leading{true, created->kv.create_revision, options_.value,
                      created->kv.create_revision};
        KV_LOG(INFO) << "election: leading " << options_.key << " with term " << leading.term;
        SetState(leading);
        // Lead until the lease is gone or we stop.
        while (!stop_.WaitForNotificationWithTimeout(renew_every)) {
          if (!Renew()) {
            KV_LOG(WARNING) << "election: lost the lease of term " << leading.term
                            << "; stepping down";
            break;
          }
        }
        SetState(State{});
        if (stop_.HasBeenNotified()) {
          (void)etcd_->DeleteIfCreatedAt(options_.key, leading.term);  // resign
        }
        break;  // a new lease, a new campaign
      }
      State following{false, 0, created->kv.value, created->kv.create_revision};
      SetState(following);
      // Wait for the holder to go, renewing our lease meanwhile.
      bool lease_ok = true;
      while (!stop_.HasBeenNotified()) {
        absl::StatusOr<bool> changed =
            etcd_->WaitForChange(options_.key, created->kv.mod_revision, absl::Now() + renew_every);
        if (!(lease_ok = Renew())) break;
        if (changed.ok() && *changed) break;
        if (!changed.ok()) stop_.WaitForNotificationWithTimeout(absl::Milliseconds(100));
      }
      if (!lease_ok) break;
    }
    (void)etcd_->RevokeLease(lease_);
  }
  SetState(State{});
}

}  // namespace kvrelay::etcd

#pragma once

// LeaderElection: one of several cache store instances leads, through etcd. Each instance holds
// a lease (kept alive by a background thread) and tries to create the leader key bound to it;
// whoever created it leads, with the key's create revision as its TERM, a fencing token that
// grows with every new leader. The others watch the key and try again when it goes (the leader
// resigned, or its lease expired because it died, hung or lost etcd).
//
// Failing closed: IsLeader() is true only until the lease could have expired as etcd sees it —
// the send time of the last successful keepalive plus the TTL etcd granted, less a margin — so a
// leader that was paused (SIGSTOP), partitioned from etcd or slow stops acting as leader on its
// own clock, before or when etcd hands the key to someone else. Writes that must not outlive
// the term go through EtcdClient::PutIfGuardCreatedAt(key, term, ...).
//
// Thread-safe. The destructor resigns (deletes the key if this instance holds it) and revokes
// the lease, so a standby takes over at once on a clean shutdown.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "cachestore/etcd/etcd_client.h"

namespace kvrelay::etcd {

struct ElectionOptions {
  std::string key = "/kvrelay/cachestore/leader";
  std::string value;  // what followers learn of the leader (its address); non-empty
  absl::Duration ttl = absl::Seconds(2);
  // Leadership ends this long before the lease could have expired at etcd (clock drift, the
  // time the keepalive reply took).
  absl::Duration safety_margin = absl::Milliseconds(300);
};

class LeaderElection {
 public:
  struct State {
    bool leader = false;
    int64_t term = 0;          // this instance's term while leader, else 0
    std::string leader_value;  // the current leader's value ("" when unknown)
    int64_t leader_term = 0;   // and its term
  };
  // Called from the election thread when this instance becomes leader or stops being leader.
  using OnChange = std::function<void(const State&)>;

  // `etcd` must outlive the election.
  static absl::StatusOr<std::unique_ptr<LeaderElection>> Start(EtcdClient* etcd,
                                                               ElectionOptions options,
                                                               OnChange on_change = nullptr);
  ~LeaderElection();

  State state() const;
  // True while this instance leads and its lease is surely still valid at etcd.
  bool IsLeader() const;
  int64_t term() const;  // 0 unless IsLeader()
  // Waits until this instance leads (true) or `deadline` passes (false).
  bool WaitUntilLeader(absl::Time deadline) const;
  // Stops campaigning: deletes the key if this instance holds it and revokes the lease, so a
  // standby takes over at once (a clean shutdown). Idempotent; the destructor calls it.
  void Resign();

 private:
  LeaderElection(EtcdClient* etcd, ElectionOptions options, OnChange on_change);
  void Run();
  // Keeps the lease alive; false when it is gone (expired at etcd, or could have).
  bool Renew();
  void SetState(State next);

  EtcdClient* const etcd_;
  const ElectionOptions options_;
  const OnChange on_change_;
  absl::Notification stop_;
  mutable absl::Mutex mu_;
  State state_ ABSL_GUARDED_BY(mu_);
  absl::Time valid_until_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  int64_t lease_ = 0;  // election thread only
  std::thread thread_;
};

}  // namespace kvrelay::etcd

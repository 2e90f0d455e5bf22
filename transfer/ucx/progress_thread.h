#pragma once

// ProgressThread: the one thread that makes every UCX call on a worker, and that also serves
// the transport's control sockets. When nothing is in flight it sleeps in poll() on
// {worker event fd (after ucp_worker_arm), wake eventfd, watched fds} with a timeout from the
// next timer, so an idle connected pair uses no CPU. While work is in flight (`busy()`), it
// keeps progressing without sleeping.
//
// Other threads only Post() closures; code that must run on the loop asserts
// KV_DCHECK(IsOnProgressThread()). Stop() (or the destructor) joins the thread; the worker
// must outlive it.

#include <ucp/api/ucp.h>

#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/event_fd.h"

namespace kvrelay::transfer::ucx {

class ProgressThread {
 public:
  struct Hooks {
    // True while operations are in flight: keep progressing instead of sleeping.
    absl::AnyInvocable<bool()> busy;
    // Runs every loop iteration (after progress); returns when it next wants to run.
    absl::AnyInvocable<absl::Time()> tick;
  };

  // `spin`: after the last event, keep progressing this long before sleeping (0: sleep at
  // once). Bounded, so an idle worker still costs no CPU.
  static absl::StatusOr<std::unique_ptr<ProgressThread>> Start(
      ucp_worker_h worker, Hooks hooks, absl::Duration spin = absl::Microseconds(200));
  ~ProgressThread();
  ProgressThread(const ProgressThread&) = delete;
  ProgressThread& operator=(const ProgressThread&) = delete;

  // Any thread. Closures run in order on the loop; ones posted after Stop() never run.
  void Post(absl::AnyInvocable<void()> fn);
  // Any thread: posts `fn` and waits for it (runs inline on the loop thread).
  void RunSync(absl::AnyInvocable<void()> fn);
  bool IsOnProgressThread() const { return std::this_thread::get_id() == thread_.get_id(); }
  // Joins; idempotent. Must not be called from the loop.
  void Stop();

  // Loop only: watch `fd` for `events` (POLLIN/POLLOUT); `cb(revents)` runs on the loop.
  void WatchFd(int fd, short events, absl::AnyInvocable<void(short)> cb);
  void SetFdEvents(int fd, short events);
  void UnwatchFd(int fd);

 private:
  ProgressThread(ucp_worker_h worker, int worker_efd, EventFd wake, Hooks hooks);
  void Loop();
  bool RunPosted();
  // True if any fd was ready.
  bool PollOnce(int timeout_ms);

  ucp_worker_h worker_;
  const int worker_efd_;
  EventFd wake_;
  Hooks hooks_;
  std::thread thread_;

  absl::Mutex mu_;
  std::vector<absl::AnyInvocable<void()>> posted_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;

  // Loop only.
  struct Watch {
    short events;
    std::shared_ptr<absl::AnyInvocable<void(short)>> cb;
  };
  absl::flat_hash_map<int, Watch> watches_;
  absl::Duration spin_after_activity_;
  absl::Time last_activity_ = absl::InfinitePast();
  absl::Time last_poll_ = absl::InfinitePast();
};

}  // namespace kvrelay::transfer::ucx

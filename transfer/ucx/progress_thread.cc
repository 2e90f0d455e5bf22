#include "transfer/ucx/progress_thread.h"

#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <utility>

#include "absl/synchronization/notification.h"
#include "common/check.h"
#include "common/errno_status.h"
#include "common/logging.h"
#include "transfer/ucx/ucx_handles.h"

namespace kvrelay::transfer::ucx {

absl::StatusOr<std::unique_ptr<ProgressThread>> ProgressThread::Start(ucp_worker_h worker,
                                                                      Hooks hooks,
                                                                      absl::Duration spin) {
  int efd = -1;
  ucs_status_t st = ucp_worker_get_efd(worker, &efd);
  if (st != UCS_OK) return FromUcs(st, "ucp_worker_get_efd");
  absl::StatusOr<EventFd> wake = EventFd::Create();
  if (!wake.ok()) return wake.status();
  std::unique_ptr<ProgressThread> t(
      new ProgressThread(worker, efd, std::move(*wake), std::move(hooks)));
  t->spin_after_activity_ = spin;
  t->thread_ = std::thread([p = t.get()] { p->Loop(); });
  return t;
}

ProgressThread::ProgressThread(ucp_worker_h worker, int worker_efd, EventFd wake, Hooks hooks)
    : worker_(worker), worker_efd_(worker_efd), wake_(std::move(wake)), hooks_(std::move(hooks)) {}

ProgressThread::~ProgressThread() { Stop(); }

void ProgressThread::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  wake_.Notify();
  if (thread_.joinable()) {
    KV_CHECK(!IsOnProgressThread());
    thread_.join();
  }
}

void ProgressThread::Post(absl::AnyInvocable<void()> fn) {
  bool first = false;
  {
    absl::MutexLock lock(&mu_);
    if (stop_) return;
    first = posted_.empty();
    posted_.push_back(std::move(fn));
  }
  // One wake-up per batch: whoever queued onto an empty list notified, and the loop takes the
  // whole list (RunPosted) after it drains the eventfd, so later closures are seen too.
  if (first) wake_.Notify();
}

void ProgressThread::RunSync(absl::AnyInvocable<void()> fn) {
  if (IsOnProgressThread()) {
    fn();
    return;
  }
  auto done = std::make_shared<absl::Notification>();
  bool posted = false;
  {
    absl::MutexLock lock(&mu_);
    if (!stop_) {
      posted = true;
      posted_.push_back([fn = std::move(fn), done]() mutable {
        fn();
        done->Notify();
      });
    }
  }
  if (!posted) return;
  wake_.Notify();
  done->WaitForNotification();
}

void ProgressThread::WatchFd(int fd, short events, absl::AnyInvocable<void(short)> cb) {
  KV_DCHECK(IsOnProgressThread());
  watches_[fd] = Watch{events, std::make_shared<absl::AnyInvocable<void(short)>>(std::move(cb))};
}

void ProgressThread::SetFdEvents(int fd, short events) {
  KV_DCHECK(IsOnProgressThread());
  auto it = watches_.find(fd);
  if (it != watches_.end()) it->second.events = events;
}

void ProgressThread::UnwatchFd(int fd) {
  KV_DCHECK(IsOnProgressThread());
  watches_.erase(fd);
}

bool ProgressThread::RunPosted() {
  std::vector<absl::AnyInvocable<void()>> batch;
  {
    absl::MutexLock lock(&mu_);
    if (stop_) return false;
    batch.swap(posted_);
  }
  for (auto& fn : batch) fn();
  return true;
}

bool ProgressThread::PollOnce(int timeout_ms) {
  std::vector<pollfd> fds;
  fds.reserve(watches_.size() + 2);
  fds.push_back({wake_.fd(), POLLIN, 0});
  fds.push_back({worker_efd_, POLLIN, 0});
  for (const auto& [fd, w] : watches_) fds.push_back({fd, w.events, 0});
  int n = ::poll(fds.data(), fds.size(), timeout_ms);
  if (n <= 0) {
    if (n < 0 && errno != EINTR) {
      KV_LOG(ERROR) << ErrnoToStatus(errno, "progress thread: poll");
    }
    return false;
  }
  if (fds[0].revents != 0) wake_.Drain();
  for (size_t i = 2; i < fds.size(); ++i) {
    if (fds[i].revents == 0) continue;
    auto it = watches_.find(fds[i].fd);
    if (it == watches_.end()) continue;  // unwatched by an earlier callback
    std::shared_ptr<absl::AnyInvocable<void(short)>> cb = it->second.cb;  // may unwatch itself
    (*cb)(fds[i].revents);
  }
  return true;
}

// Logs a loop phase that held the thread long enough to starve heartbeats.
class SlowPhaseLog {
 public:
  explicit SlowPhaseLog(const char* what) : what_(what), start_(absl::Now()) {}
  ~SlowPhaseLog() {
    absl::Duration took = absl::Now() - start_;
    if (took > absl::Milliseconds(500)) {
      KV_LOG(WARNING) << "transfer progress thread: " << what_ << " took "
                      << absl::FormatDuration(took);
    }
  }

 private:
  const char* what_;
  absl::Time start_;
};

void ProgressThread::Loop() {
  while (true) {
    {
      SlowPhaseLog slow("posted work");
      if (!RunPosted()) return;
    }
    // Bounded, so posted work, sockets and timers get their turn under sustained traffic.
    int progressed = 0;
    {
      SlowPhaseLog slow("ucp_worker_progress");
      while (progressed < 64 && ucp_worker_progress(worker_) != 0) ++progressed;
    }
    absl::Time next;
    {
      SlowPhaseLog slow("tick");
      next = hooks_.tick();
    }
    const absl::Time now = absl::Now();
    // Only UCX's own events count as activity: the next one of a burst is usually microseconds
    // away. Socket events do not: a thread that spins after every control frame (a receiver of
    // shared-memory puts has no UCX work at all, only DONE frames) burns a core that, on a
    // 2-core machine, the sender's copy needs (64 KiB blocks into a 32 MiB region: 0.47x memcpy
    // spinning, 0.7x sleeping). A sleeping thread is woken by the socket within microseconds.
    if (progressed > 0) last_activity_ = now;
    // While operations are in flight, or shortly after the last event, keep going without the
    // cost of a wake-up.
    if (hooks_.busy() || now - last_activity_ < spin_after_activity_) {
      // Sockets without sleeping, at most every 50 us: a poll() per spin would cost more than
      // the progress calls themselves (system calls are dear in VMs).
      if (now - last_poll_ >= absl::Microseconds(50)) {
        SlowPhaseLog slow("socket events");
        last_poll_ = now;
        PollOnce(0);
      }
      continue;
    }
    ucs_status_t st = ucp_worker_arm(worker_);
    if (st == UCS_ERR_BUSY) continue;  // events arrived meanwhile: progress again
    if (st != UCS_OK) {
      KV_LOG(ERROR) << "ucp_worker_arm: " << ucs_status_string(st);
    }
    const absl::Duration wait = next - absl::Now();
    int timeout_ms = 0;
    if (wait > absl::ZeroDuration()) {
      timeout_ms = static_cast<int>(
          std::min<int64_t>(absl::ToInt64Milliseconds(wait + absl::Microseconds(999)), 1000));
    }
    SlowPhaseLog slow("poll and socket events");
    PollOnce(timeout_ms);
  }
}

}  // namespace kvrelay::transfer::ucx

#include "transfer/ucx/progress_thread.h"

#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <utility>

#include "absl/synchronization/notification.h"
#include "common/check.h"
#include "common/logging.h"
#include "transfer/ucx/ucx_handles.h"

namespace kvrelay::transfer::ucx {

absl::StatusOr<std::unique_ptr<ProgressThread>> ProgressThread::Start(ucp_worker_h worker,
                                                                      Hooks hooks) {
  int efd = -1;
  ucs_status_t st = ucp_worker_get_efd(worker, &efd);
  if (st != UCS_OK) return FromUcs(st, "ucp_worker_get_efd");
  absl::StatusOr<EventFd> wake = EventFd::Create();
  if (!wake.ok()) return wake.status();
  std::unique_ptr<ProgressThread> t(
      new ProgressThread(worker, efd, std::move(*wake), std::move(hooks)));
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
  {
    absl::MutexLock lock(&mu_);
    if (stop_) return;
    posted_.push_back(std::move(fn));
  }
  wake_.Notify();
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

void ProgressThread::PollOnce(int timeout_ms) {
  std::vector<pollfd> fds;
  fds.reserve(watches_.size() + 2);
  fds.push_back({wake_.fd(), POLLIN, 0});
  fds.push_back({worker_efd_, POLLIN, 0});
  for (const auto& [fd, w] : watches_) fds.push_back({fd, w.events, 0});
  int n = ::poll(fds.data(), fds.size(), timeout_ms);
  if (n <= 0) {
    if (n < 0 && errno != EINTR) {
      KV_LOG(ERROR) << "poll failed, errno " << errno;
    }
    return;
  }
  if (fds[0].revents != 0) wake_.Drain();
  for (size_t i = 2; i < fds.size(); ++i) {
    if (fds[i].revents == 0) continue;
    auto it = watches_.find(fds[i].fd);
    if (it == watches_.end()) continue;  // unwatched by an earlier callback
    std::shared_ptr<absl::AnyInvocable<void(short)>> cb = it->second.cb;  // may unwatch itself
    (*cb)(fds[i].revents);
  }
}

void ProgressThread::Loop() {
  while (true) {
    if (!RunPosted()) return;
    while (ucp_worker_progress(worker_) != 0) {
    }
    const absl::Time next = hooks_.tick();
    if (hooks_.busy()) {
      PollOnce(0);  // sockets and posted work, without sleeping
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
    PollOnce(timeout_ms);
  }
}

}  // namespace kvrelay::transfer::ucx

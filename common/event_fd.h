#pragma once

// A Linux eventfd used to wake a thread sleeping in poll(). Thread-safe: Notify() may be called
// from any thread, Drain() from the thread that polls.

#include "absl/status/statusor.h"
#include "common/scoped_fd.h"

namespace kvrelay {

class EventFd {
 public:
  static absl::StatusOr<EventFd> Create();

  EventFd(EventFd&&) = default;
  EventFd& operator=(EventFd&&) = default;

  int fd() const { return fd_.get(); }
  void Notify() const;
  // Resets the counter so the next poll() sleeps again.
  void Drain() const;

 private:
  explicit EventFd(ScopedFd fd) : fd_(std::move(fd)) {}
  ScopedFd fd_;
};

}  // namespace kvrelay

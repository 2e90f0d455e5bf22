#include "common/event_fd.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/errno_status.h"

namespace kvrelay {

absl::StatusOr<EventFd> EventFd::Create() {
  int fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (fd < 0) return ErrnoToStatus(errno, "eventfd");
  return EventFd(ScopedFd(fd));
}

void EventFd::Notify() const {
  const uint64_t one = 1;
  // EAGAIN means the counter is saturated: the poller is already awake.
  [[maybe_unused]] ssize_t n = ::write(fd_.get(), &one, sizeof(one));
}

void EventFd::Drain() const {
  uint64_t value;
  [[maybe_unused]] ssize_t n = ::read(fd_.get(), &value, sizeof(value));
}

}  // namespace kvrelay

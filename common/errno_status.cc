#include "common/errno_status.h"

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvrelay {

absl::Status ErrnoToStatus(int err, absl::string_view operation_and_subject) {
  if (err == EPIPE || err == ETIMEDOUT || err == EADDRNOTAVAIL) {
    return absl::UnavailableError(absl::StrCat(operation_and_subject, ": ", std::strerror(err)));
  }
  return absl::ErrnoToStatus(err, operation_and_subject);
}

}  // namespace kvrelay

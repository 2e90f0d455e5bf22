#pragma once

// The one errno -> absl::Status converter of the code base. Abseil's mapping (ENOENT NotFound,
// EACCES PermissionDenied, ENOSPC/ENOMEM ResourceExhausted, EINVAL InvalidArgument, ...), except
// that every errno meaning "the peer is gone or cannot be reached" is Unavailable, the code the
// failure rules give a lost peer: EPIPE (absl: FailedPrecondition), ETIMEDOUT (absl:
// DeadlineExceeded, which callers read as their own deadline) and EADDRNOTAVAIL (absl:
// AlreadyExists).
//
// The message is "<operation> <subject>: <strerror>", e.g. "open /data/wal.log: Permission
// denied": name the operation and the file, address or peer it was about.

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvrelay {

absl::Status ErrnoToStatus(int err, absl::string_view operation_and_subject);

}  // namespace kvrelay

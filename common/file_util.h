#pragma once

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvrelay {

// Reads a whole file. NotFound when it does not exist; the message names the path.
absl::StatusOr<std::string> ReadFileToString(const std::string& path);

// Writes `contents` to `path` atomically: a temp file in the same directory, fsync, rename,
// fsync of the directory. Readers see the old file or the new one, never a torn one.
absl::Status WriteFileAtomically(const std::string& path, std::string_view contents);

// mkdir -p.
absl::Status MakeDirectories(const std::string& path);

}  // namespace kvrelay

#pragma once

// `--config FILE.yaml` for every server: the file is a flat YAML map whose keys are flag names
// (without "--") and whose values are scalars (lists are joined with commas). Flags given on
// the command line override the file.

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kvrelay {

// Returns `args` with --config FILE (or --config=FILE) replaced by the file's flags, placed
// before the remaining arguments. InvalidArgument naming the file and key for a malformed file.
absl::StatusOr<std::vector<std::string>> ExpandConfigFile(const std::vector<std::string>& args);

}  // namespace kvrelay

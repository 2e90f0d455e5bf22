#pragma once

// The client-side commands that live in cli/ itself (generate, layout, status). Each returns the
// process exit code: 0 on success, 1 on a runtime failure, 2 on bad usage (with a one-line message
// on stderr). Every other command is declared in the command.h of its own folder
// (`<module>/server/`,
// `<module>/tools/`, `cli/up/`, `cli/bench_serve/`).

#include <string>
#include <vector>

namespace kvrelay::cli {

int RunGenerateCommand(const std::vector<std::string>& args);
int RunLayoutCommand(const std::vector<std::string>& args);
int RunStatusCommand(const std::vector<std::string>& args);

}  // namespace kvrelay::cli

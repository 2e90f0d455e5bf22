#pragma once

// Runs real kvrelay binaries as child processes for integration tests. The child's stdout and
// stderr go to files in a private temp dir so a test can wait for a line ("listening on ...")
// and print the logs on failure.
//
// Not thread-safe; one test thread owns each ChildProcess. The destructor SIGKILLs and reaps a
// child that is still running, so no test leaves processes behind.

#include <sys/types.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tests/testing/test_env.h"

namespace kvrelay::testing {

struct CommandResult {
  int exit_code = -1;  // -signal when killed by a signal
  std::string stdout_text;
  std::string stderr_text;
};

// Runs a command to completion (bounded by `timeout`, then SIGKILL) and captures its output.
absl::StatusOr<CommandResult> RunCommand(const std::vector<std::string>& argv,
                                         absl::Duration timeout = absl::Seconds(120),
                                         const std::map<std::string, std::string>& env = {});

// Runs build/bin/kvrelay with `args` (RunCommand); a failure to run it at all is a test
// failure, and the result is then empty (exit_code -1).
CommandResult RunKvrelay(std::vector<std::string> args,
                         absl::Duration timeout = absl::Seconds(120));

// Whether process `pid` is stopped (state T in /proc/<pid>/stat), waiting up to `timeout`:
// SIGSTOP is delivered asynchronously, and a call must not be answered just before it takes
// effect.
bool WaitStopped(pid_t pid, absl::Duration timeout = absl::Seconds(5));

class ChildProcess {
 public:
  static absl::StatusOr<std::unique_ptr<ChildProcess>> Start(
      const std::vector<std::string>& argv, const std::map<std::string, std::string>& env = {});
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }
  // Waits until stdout or stderr contains `needle`; returns the line that holds it.
  // DeadlineExceeded on timeout, FailedPrecondition if the child exited first.
  absl::StatusOr<std::string> WaitForOutput(const std::string& needle, absl::Duration timeout);
  void Signal(int signo);
  // Waits for exit; returns the exit code (or -signal), DeadlineExceeded on timeout.
  absl::StatusOr<int> Wait(absl::Duration timeout);
  bool Running();
  std::string Stdout() const;
  std::string Stderr() const;

 private:
  ChildProcess() = default;
  pid_t pid_ = -1;
  std::optional<int> exit_code_;
  std::unique_ptr<TempDir> dir_;
};

}  // namespace kvrelay::testing

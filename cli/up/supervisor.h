#pragma once

// Supervisor: runs a set of child processes (the services `kvrelay up` starts), forwards their
// stdout/stderr line by line with a "[name] " prefix, watches for the line each server prints
// once it serves (`<name> listening on HOST:PORT metrics HOST:MPORT`), notices children that
// die, and stops them in order (SIGTERM, a grace period, then SIGKILL).
//
// SIGINT and SIGTERM sent to this process are caught through a signalfd (blocked for the whole
// process by the constructor, which must therefore run before any other thread starts) and
// turn into stop_requested(). Each child runs in its own process group (a terminal's Ctrl-C
// reaches only the supervisor), with the default signal mask and PR_SET_PDEATHSIG(SIGTERM), so
// it does not outlive a supervisor that is killed.
//
// Not thread-safe: one thread drives it (Poll and everything else).

#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/scoped_fd.h"

namespace kvrelay::cli::up {

struct Endpoint {
  std::string address;          // HOST:PORT of the gRPC server
  std::string metrics_address;  // HOST:MPORT of /metrics
};

// Parses "<name> listening on HOST:PORT metrics HOST:MPORT" anywhere in `line`.
std::optional<Endpoint> ParseListeningLine(const std::string& line);

class Supervisor {
 public:
  struct Child {
    std::string name;
    pid_t pid = -1;
    std::optional<Endpoint> endpoint;  // once the listening line was seen
    std::optional<int> exit_code;      // once reaped: exit status, or -signal
    bool stopping = false;             // we sent it SIGTERM
    ScopedFd out, err;
    std::string out_partial, err_partial;
  };

  static absl::StatusOr<std::unique_ptr<Supervisor>> Create();
  ~Supervisor();  // SIGKILLs and reaps children still running

  // Starts `argv` (argv[0] is the executable path) as child `name`. Returns its index.
  absl::StatusOr<int> Start(const std::string& name, const std::vector<std::string>& argv);

  // Forwards output and reaps children for up to `timeout` (returns early on a signal or a
  // child exit). Returns the indices of children that exited during this call.
  std::vector<int> Poll(absl::Duration timeout);

  // Waits until child `index` printed its listening line. FailedPrecondition if it exits first,
  // Cancelled on SIGINT/SIGTERM, DeadlineExceeded after `timeout`.
  absl::StatusOr<Endpoint> WaitListening(int index, absl::Duration timeout);

  // SIGTERM to every running child in `indices`, then waits up to `grace` for them (forwarding
  // output), then SIGKILLs the rest. Returns true if all exited with status 0 within grace.
  bool Stop(const std::vector<int>& indices, absl::Duration grace);

  bool stop_requested() const { return stop_signal_ != 0; }
  int stop_signal() const { return stop_signal_; }
  const Child& child(int index) const { return *children_[index]; }
  int num_children() const { return static_cast<int>(children_.size()); }

 private:
  Supervisor() = default;
  void DrainFd(Child& c, bool is_err, bool eof);
  void ReapChildren(std::vector<int>* exited);

  ScopedFd signal_fd_;
  int stop_signal_ = 0;
  std::vector<std::unique_ptr<Child>> children_;
};

// "exit status 3", "killed by signal 9 (Killed)".
std::string DescribeExit(int exit_code);

}  // namespace kvrelay::cli::up

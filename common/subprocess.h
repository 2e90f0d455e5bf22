#pragma once

// The one fork/exec in kvrelay: `kvrelay up`'s supervisor, the test harness and the benchmarks'
// peer processes all start children through Spawn(), so every child gets the same hygiene —
// its own process group when asked, the default signal mask and dispositions, stdin from
// /dev/null, and optionally PR_SET_PDEATHSIG so it never outlives its parent.

#include <sys/types.h>

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kvrelay {

struct SpawnOptions {
  std::vector<std::string> argv;           // argv[0] is the executable's path
  std::map<std::string, std::string> env;  // added to (overriding) the parent's environment
  int stdout_fd = -1;                      // dup2'ed onto the child's stdout; -1 = inherit
  int stderr_fd = -1;                      // ... stderr; -1 = inherit
  bool own_process_group = true;           // kill(-pid) reaches the child's whole tree
  int parent_death_signal = 0;             // e.g. SIGTERM: sent to the child if we die
};

// Starts the child and returns its pid. The child's fds other than 0-2 close on exec only if
// they were opened O_CLOEXEC (as all of kvrelay's are).
absl::StatusOr<pid_t> Spawn(const SpawnOptions& options);

// waitpid status -> exit code, or -signal when killed by a signal.
int DecodeWaitStatus(int wait_status);

}  // namespace kvrelay

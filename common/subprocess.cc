#include "common/subprocess.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/errno_status.h"

namespace kvrelay {

absl::StatusOr<pid_t> Spawn(const SpawnOptions& options) {
  if (options.argv.empty()) return absl::InvalidArgumentError("Spawn: empty argv");
  // Everything the child needs is prepared here: between fork and exec only async-signal-safe
  // calls are allowed (the parent has threads).
  std::vector<char*> args;
  for (const std::string& a : options.argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  std::vector<std::string> env_storage;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry(*e);
    const std::string name = entry.substr(0, entry.find('='));
    if (!options.env.contains(name)) env_storage.push_back(entry);
  }
  for (const auto& [name, value] : options.env)
    env_storage.push_back(absl::StrCat(name, "=", value));
  std::vector<char*> envp;
  for (std::string& e : env_storage) envp.push_back(e.data());
  envp.push_back(nullptr);

  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) return ErrnoToStatus(errno, "fork");
  if (pid == 0) {
    if (options.own_process_group) ::setpgid(0, 0);
    if (options.stdout_fd >= 0) ::dup2(options.stdout_fd, STDOUT_FILENO);
    if (options.stderr_fd >= 0) ::dup2(options.stderr_fd, STDERR_FILENO);
    const int null_fd = ::open("/dev/null", O_RDONLY);
    if (null_fd >= 0) ::dup2(null_fd, STDIN_FILENO);
    struct sigaction dfl;
    std::memset(&dfl, 0, sizeof(dfl));
    dfl.sa_handler = SIG_DFL;
    ::sigaction(SIGPIPE, &dfl, nullptr);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    if (options.parent_death_signal != 0) {
      ::prctl(PR_SET_PDEATHSIG, options.parent_death_signal);
      if (::getppid() != parent) ::_exit(1);  // the parent died before prctl
    }
    ::execve(args[0], args.data(), envp.data());
    const char msg[] = "exec failed\n";
    [[maybe_unused]] ssize_t n = ::write(STDERR_FILENO, msg, sizeof(msg) - 1);
    ::_exit(127);
  }
  return pid;
}

int DecodeWaitStatus(int wait_status) {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return -WTERMSIG(wait_status);
  return -1;
}

}  // namespace kvrelay

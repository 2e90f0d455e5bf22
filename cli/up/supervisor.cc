#include "cli/up/supervisor.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/errno_status.h"
#include "common/subprocess.h"

namespace kvrelay::cli::up {
namespace {

sigset_t StopSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGCHLD);
  return set;
}

void WriteLine(FILE* out, const std::string& prefix, absl::string_view line) {
  std::string text = absl::StrCat(prefix, line, "\n");
  std::fwrite(text.data(), 1, text.size(), out);
  std::fflush(out);
}

}  // namespace

std::optional<Endpoint> ParseListeningLine(const std::string& line) {
  // "<name> listening on HOST:PORT metrics HOST:MPORT"
  std::vector<std::string> words =
      absl::StrSplit(line, absl::ByAnyChar(" \t\r"), absl::SkipEmpty());
  for (size_t i = 0; i + 2 < words.size(); ++i) {
    if (words[i] != "listening" || words[i + 1] != "on") continue;
    Endpoint e;
    e.address = words[i + 2];
    if (e.address.find(':') == std::string::npos) return std::nullopt;
    if (i + 4 < words.size() && words[i + 3] == "metrics") e.metrics_address = words[i + 4];
    return e;
  }
  return std::nullopt;
}

std::string DescribeExit(int exit_code) {
  if (exit_code >= 0) return absl::StrCat("exit status ", exit_code);
  return absl::StrCat("killed by signal ", -exit_code, " (", strsignal(-exit_code), ")");
}

absl::StatusOr<std::unique_ptr<Supervisor>> Supervisor::Create() {
  auto s = std::unique_ptr<Supervisor>(new Supervisor());
  sigset_t set = StopSignals();
  // Blocked here, inherited by every thread created later (gRPC's included), so the signals
  // are only ever delivered through the signalfd.
  if (int rc = pthread_sigmask(SIG_BLOCK, &set, nullptr); rc != 0) {
    return ErrnoToStatus(rc, "pthread_sigmask");
  }
  int fd = ::signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
  if (fd < 0) return ErrnoToStatus(errno, "signalfd");
  s->signal_fd_.Reset(fd);
  // A closed stdout (`kvrelay up | head`) must not kill the supervisor and orphan the children.
  ::signal(SIGPIPE, SIG_IGN);
  return s;
}

Supervisor::~Supervisor() {
  for (auto& c : children_) {
    if (c->pid > 0 && !c->exit_code.has_value()) {
      ::kill(c->pid, SIGKILL);
      int status;
      ::waitpid(c->pid, &status, 0);
    }
  }
}

absl::StatusOr<int> Supervisor::Start(const std::string& name,
                                      const std::vector<std::string>& argv) {
  if (argv.empty()) return absl::InvalidArgumentError("Start: empty argv");
  int out[2], err[2];
  if (::pipe2(out, O_CLOEXEC) != 0) return ErrnoToStatus(errno, "pipe");
  if (::pipe2(err, O_CLOEXEC) != 0) {
    const int saved = errno;
    ::close(out[0]);
    ::close(out[1]);
    return ErrnoToStatus(saved, "pipe");
  }
  // Its own process group, so a Ctrl-C in the terminal reaches only the supervisor, which then
  // stops the services in order (a service that already drains on SIGINT would take the
  // supervisor's SIGTERM as "now"); PR_SET_PDEATHSIG covers a killed supervisor.
  absl::StatusOr<pid_t> spawned = Spawn({.argv = argv,
                                         .stdout_fd = out[1],
                                         .stderr_fd = err[1],
                                         .own_process_group = true,
                                         .parent_death_signal = SIGTERM});
  if (!spawned.ok()) {
    for (int fd : {out[0], out[1], err[0], err[1]}) ::close(fd);
    return spawned.status();
  }
  const pid_t pid = *spawned;
  ::close(out[1]);
  ::close(err[1]);
  auto c = std::make_unique<Child>();
  c->name = name;
  c->pid = pid;
  c->out.Reset(out[0]);
  c->err.Reset(err[0]);
  for (int fd : {out[0], err[0]}) ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  children_.push_back(std::move(c));
  return static_cast<int>(children_.size()) - 1;
}

void Supervisor::DrainFd(Child& c, bool is_err, bool eof) {
  ScopedFd& fd = is_err ? c.err : c.out;
  std::string& partial = is_err ? c.err_partial : c.out_partial;
  char buf[65536];
  while (fd.valid()) {
    ssize_t n = ::read(fd.get(), buf, sizeof(buf));
    if (n > 0) {
      partial.append(buf, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n == 0 || (n < 0 && errno != EAGAIN)) eof = true;
    break;
  }
  const std::string prefix = absl::StrCat("[", c.name, "] ");
  size_t start = 0;
  for (size_t nl; (nl = partial.find('\n', start)) != std::string::npos; start = nl + 1) {
    std::string line = partial.substr(start, nl - start);
    if (!c.endpoint.has_value()) c.endpoint = ParseListeningLine(line);
    WriteLine(is_err ? stderr : stdout, prefix, line);
  }
  partial.erase(0, start);
  if (eof) {
    if (!partial.empty()) WriteLine(is_err ? stderr : stdout, prefix, partial);
    partial.clear();
    fd.Reset();
  }
}

void Supervisor::ReapChildren(std::vector<int>* exited) {
  for (size_t i = 0; i < children_.size(); ++i) {
    Child& c = *children_[i];
    if (c.pid <= 0 || c.exit_code.has_value()) continue;
    int status;
    if (::waitpid(c.pid, &status, WNOHANG) == c.pid) {
      // Its output may still sit in the pipes: forward it before anyone reports the exit.
      if (c.out.valid()) DrainFd(c, false, false);
      if (c.err.valid()) DrainFd(c, true, false);
      c.exit_code = DecodeWaitStatus(status);
      exited->push_back(static_cast<int>(i));
    }
  }
}

std::vector<int> Supervisor::Poll(absl::Duration timeout) {
  std::vector<int> exited;
  std::vector<pollfd> fds;
  std::vector<std::pair<Child*, bool>> owners;  // (child, is_err) per fds[i], i >= 1
  fds.push_back({signal_fd_.get(), POLLIN, 0});
  owners.push_back({nullptr, false});
  for (auto& c : children_) {
    if (c->out.valid()) {
      fds.push_back({c->out.get(), POLLIN, 0});
      owners.push_back({c.get(), false});
    }
    if (c->err.valid()) {
      fds.push_back({c->err.get(), POLLIN, 0});
      owners.push_back({c.get(), true});
    }
  }
  const int ms =
      static_cast<int>(std::clamp<int64_t>(absl::ToInt64Milliseconds(timeout), 0, 60000));
  int n = ::poll(fds.data(), fds.size(), ms);
  if (n > 0) {
    for (size_t i = 1; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      const bool hangup = (fds[i].revents & (POLLHUP | POLLERR)) != 0;
      DrainFd(*owners[i].first, owners[i].second, hangup && !(fds[i].revents & POLLIN));
    }
    if (fds[0].revents & POLLIN) {
      signalfd_siginfo info;
      while (::read(signal_fd_.get(), &info, sizeof(info)) == sizeof(info)) {
        if (info.ssi_signo == SIGINT || info.ssi_signo == SIGTERM) {
          stop_signal_ = static_cast<int>(info.ssi_signo);
        }
      }
    }
  }
  ReapChildren(&exited);
  return exited;
}

absl::StatusOr<Endpoint> Supervisor::WaitListening(int index, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  Child& c = *children_[index];
  while (true) {
    if (c.endpoint.has_value()) return *c.endpoint;
    if (c.exit_code.has_value()) {
      return absl::FailedPreconditionError(absl::StrCat(c.name, " (pid ", c.pid, ") ended with ",
                                                        DescribeExit(*c.exit_code),
                                                        " before it was listening"));
    }
    if (stop_requested()) {
      return absl::CancelledError(absl::StrCat("stopped by signal ", stop_signal_));
    }
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(absl::StrCat(
          c.name, " printed no 'listening on' line within ", absl::FormatDuration(timeout)));
    }
    Poll(std::min(left, absl::Milliseconds(200)));
  }
}

bool Supervisor::Stop(const std::vector<int>& indices, absl::Duration grace) {
  const int signal_before = stop_signal_;
  for (int i : indices) {
    Child& c = *children_[i];
    if (c.pid > 0 && !c.exit_code.has_value()) {
      ::kill(c.pid, SIGTERM);
      c.stopping = true;
    }
  }
  const absl::Time deadline = absl::Now() + grace;
  auto running = [&] {
    return std::any_of(indices.begin(), indices.end(), [&](int i) {
      return children_[i]->pid > 0 && !children_[i]->exit_code.has_value();
    });
  };
  bool clean = true;
  while (running()) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) break;
    stop_signal_ = 0;
    Poll(std::min(left, absl::Milliseconds(100)));
    // A second Ctrl-C while stopping means "now": skip the rest of the grace period.
    const bool again = stop_signal_ != 0 && signal_before != 0;
    if (stop_signal_ == 0) stop_signal_ = signal_before;
    if (again) break;
  }
  for (int i : indices) {
    Child& c = *children_[i];
    if (c.pid > 0 && !c.exit_code.has_value()) {
      std::fprintf(stderr, "kvrelay up: %s (pid %d) did not stop within %s; sending SIGKILL\n",
                   c.name.c_str(), static_cast<int>(c.pid), absl::FormatDuration(grace).c_str());
      ::kill(c.pid, SIGKILL);
      int status;
      ::waitpid(c.pid, &status, 0);
      c.exit_code = DecodeWaitStatus(status);
      clean = false;
    }
    if (c.out.valid()) DrainFd(c, false, true);
    if (c.err.valid()) DrainFd(c, true, true);
    if (c.exit_code.has_value() && *c.exit_code != 0) {
      std::fprintf(stderr, "kvrelay up: %s (pid %d) ended with %s\n", c.name.c_str(),
                   static_cast<int>(c.pid), DescribeExit(*c.exit_code).c_str());
      clean = false;
    }
  }
  return clean;
}

}  // namespace kvrelay::cli::up

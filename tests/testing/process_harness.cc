#include "tests/testing/process_harness.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/errno_status.h"
#include "common/scoped_fd.h"
#include "common/status_macros.h"
#include "common/subprocess.h"
#include "gtest/gtest.h"
#include "tests/testing/test_env.h"

namespace kvrelay::testing {
namespace {

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

absl::StatusOr<std::unique_ptr<ChildProcess>> ChildProcess::Start(
    const std::vector<std::string>& argv, const std::map<std::string, std::string>& env) {
  if (argv.empty()) return absl::InvalidArgumentError("empty argv");
  auto child = std::unique_ptr<ChildProcess>(new ChildProcess());
  child->dir_ = std::make_unique<TempDir>();
  const std::string out_path = child->dir_->File("stdout");
  const std::string err_path = child->dir_->File("stderr");
  ScopedFd out(::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  ScopedFd err(::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!out.valid() || !err.valid()) return ErrnoToStatus(errno, "open child log");
  // Own process group so a test can kill the whole tree.
  KV_ASSIGN_OR_RETURN(const pid_t pid, Spawn({.argv = argv,
                                              .env = env,
                                              .stdout_fd = out.get(),
                                              .stderr_fd = err.get(),
                                              .own_process_group = true}));
  child->pid_ = pid;
  return child;
}

ChildProcess::~ChildProcess() {
  if (pid_ > 0 && !exit_code_.has_value()) {
    ::kill(-pid_, SIGKILL);
    ::kill(pid_, SIGKILL);
    int status;
    ::waitpid(pid_, &status, 0);
  }
}

bool ChildProcess::Running() {
  if (exit_code_.has_value()) return false;
  int status;
  pid_t r = ::waitpid(pid_, &status, WNOHANG);
  if (r == pid_) {
    exit_code_ = DecodeWaitStatus(status);
    return false;
  }
  return true;
}

absl::StatusOr<std::string> ChildProcess::WaitForOutput(const std::string& needle,
                                                        absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    for (const std::string& text : {Stdout(), Stderr()}) {
      size_t pos = text.find(needle);
      if (pos != std::string::npos) {
        size_t begin = text.rfind('\n', pos);
        begin = begin == std::string::npos ? 0 : begin + 1;
        size_t end = text.find('\n', pos);
        return text.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
      }
    }
    if (!Running()) {
      return absl::FailedPreconditionError(absl::StrCat("process exited with ", *exit_code_,
                                                        " before printing '", needle,
                                                        "'; stderr:\n", Stderr()));
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "no '", needle, "' within ", absl::FormatDuration(timeout), "; stderr:\n", Stderr()));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

void ChildProcess::Signal(int signo) {
  if (pid_ > 0 && !exit_code_.has_value()) ::kill(pid_, signo);
}

absl::StatusOr<int> ChildProcess::Wait(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (Running()) {
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("process ", pid_, " still running after ", absl::FormatDuration(timeout)));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  return *exit_code_;
}

std::string ChildProcess::Stdout() const { return ReadAll(dir_->File("stdout")); }
std::string ChildProcess::Stderr() const { return ReadAll(dir_->File("stderr")); }

absl::StatusOr<CommandResult> RunCommand(const std::vector<std::string>& argv,
                                         absl::Duration timeout,
                                         const std::map<std::string, std::string>& env) {
  auto child = ChildProcess::Start(argv, env);
  if (!child.ok()) return child.status();
  absl::StatusOr<int> code = (*child)->Wait(timeout);
  if (!code.ok()) {
    (*child)->Signal(SIGKILL);
    return absl::DeadlineExceededError(
        absl::StrCat(absl::StrJoin(argv, " "), ": ", code.status().message()));
  }
  CommandResult result;
  result.exit_code = *code;
  result.stdout_text = (*child)->Stdout();
  result.stderr_text = (*child)->Stderr();
  return result;
}

CommandResult RunKvrelay(std::vector<std::string> args, absl::Duration timeout) {
  args.insert(args.begin(), BinaryPath("kvrelay"));
  absl::StatusOr<CommandResult> result = RunCommand(args, timeout);
  EXPECT_TRUE(result.ok()) << result.status();
  return result.ok() ? *std::move(result) : CommandResult{};
}

bool WaitStopped(pid_t pid, absl::Duration timeout) {
  for (absl::Time deadline = absl::Now() + timeout; absl::Now() < deadline;) {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
    const size_t paren = text.rfind(')');
    if (paren != std::string::npos && paren + 2 < text.size() && text[paren + 2] == 'T') {
      return true;
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
  return false;
}

}  // namespace kvrelay::testing

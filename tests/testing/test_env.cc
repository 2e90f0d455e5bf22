#include "tests/testing/test_env.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>

#include "common/check.h"
#include "common/scoped_fd.h"

namespace kvrelay::testing {

TempDir::TempDir() {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string pattern = std::string(base != nullptr ? base : "/tmp") + "/kvrelay_test_XXXXXX";
  KV_CHECK(::mkdtemp(pattern.data()) != nullptr);
  path_ = pattern;
}

TempDir::~TempDir() {
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

ScopedEnv::ScopedEnv(std::string name, std::optional<std::string> value) : name_(std::move(name)) {
  if (const char* old = std::getenv(name_.c_str()); old != nullptr) old_value_ = old;
  if (value.has_value()) {
    ::setenv(name_.c_str(), value->c_str(), 1);
  } else {
    ::unsetenv(name_.c_str());
  }
}

ScopedEnv::~ScopedEnv() {
  if (old_value_.has_value()) {
    ::setenv(name_.c_str(), old_value_->c_str(), 1);
  } else {
    ::unsetenv(name_.c_str());
  }
}

int PickUnusedPort() {
  ScopedFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  KV_CHECK(fd.valid());
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  KV_CHECK(::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  socklen_t len = sizeof(addr);
  KV_CHECK(::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  return ntohs(addr.sin_port);
}

std::string BinDir() {
  if (const char* dir = std::getenv("KVRELAY_BIN_DIR"); dir != nullptr) return dir;
  // Tests live in build/bin/tests; the binaries one level up.
  std::error_code ec;
  auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  return self.parent_path().parent_path().string();
}

std::string BinaryPath(const std::string& name) { return BinDir() + "/" + name; }

std::string SourceDir() {
  if (const char* dir = std::getenv("KVRELAY_SOURCE_DIR"); dir != nullptr) return dir;
  return ".";
}

std::string HttpGet(int port, const std::string& path) {
  ScopedFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string response;
  if (!fd.valid() || ::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return response;
  }
  const std::string request = "GET " + path + " HTTP/1.0\r\n\r\n";
  if (::send(fd.get(), request.data(), request.size(), 0) != static_cast<ssize_t>(request.size())) {
    return response;
  }
  char buf[4096];
  ssize_t n;
  while ((n = ::recv(fd.get(), buf, sizeof(buf), 0)) > 0)
    response.append(buf, static_cast<size_t>(n));
  return response;
}

}  // namespace kvrelay::testing

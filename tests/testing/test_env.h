#pragma once

// Hermetic test helpers: temp dirs, free ports, scoped environment variables, binary paths.

#include <optional>
#include <string>

namespace kvrelay::testing {

// A fresh directory under $TEST_TMPDIR or /tmp, removed (recursively) on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Sets (or unsets, with nullopt) an environment variable for the lifetime of the object.
class ScopedEnv {
 public:
  ScopedEnv(std::string name, std::optional<std::string> value);
  ~ScopedEnv();
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  std::optional<std::string> old_value_;
};

// A TCP port on 127.0.0.1 that was free when asked (bound with port 0, then released).
int PickUnusedPort();

// GET `path` from 127.0.0.1:`port` over HTTP/1.0: the whole response (status line, headers,
// body), or "" when nothing answers.
std::string HttpGet(int port, const std::string& path);

// build/bin, from $KVRELAY_BIN_DIR (set by ctest) or next to the test binary's directory.
std::string BinDir();
// Path of build/bin/<name>.
std::string BinaryPath(const std::string& name);
// Source tree root, from $KVRELAY_SOURCE_DIR.
std::string SourceDir();

}  // namespace kvrelay::testing

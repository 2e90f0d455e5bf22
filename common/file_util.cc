#include "common/file_util.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/errno_status.h"
#include "common/scoped_fd.h"

namespace kvrelay {
namespace {

absl::Status ErrnoStatus(absl::string_view what, const std::string& path, int err) {
  return ErrnoToStatus(err, absl::StrCat(what, " ", path));
}

absl::Status WriteAll(int fd, std::string_view data, const std::string& path) {
  while (!data.empty()) {
    ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus("write", path, errno);
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::string> ReadFileToString(const std::string& path) {
  ScopedFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return ErrnoStatus("open", path, errno);
  std::string contents;
  char buffer[1 << 16];
  while (true) {
    ssize_t n = ::read(fd.get(), buffer, sizeof(buffer));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus("read", path, errno);
    }
    if (n == 0) break;
    contents.append(buffer, static_cast<size_t>(n));
  }
  return contents;
}

absl::Status WriteFileAtomically(const std::string& path, std::string_view contents) {
  const std::string temp = absl::StrCat(path, ".tmp.", ::getpid());
  {
    ScopedFd fd(::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (!fd.valid()) return ErrnoStatus("open", temp, errno);
    if (absl::Status s = WriteAll(fd.get(), contents, temp); !s.ok()) {
      ::unlink(temp.c_str());
      return s;
    }
    if (::fsync(fd.get()) != 0) {
      int err = errno;
      ::unlink(temp.c_str());
      return ErrnoStatus("fsync", temp, err);
    }
  }
  if (::rename(temp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(temp.c_str());
    return ErrnoStatus("rename", path, err);
  }
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash + 1);
  ScopedFd dir_fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir_fd.valid()) ::fsync(dir_fd.get());
  return absl::OkStatus();
}

absl::Status MakeDirectories(const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError("empty directory path");
  for (size_t pos = 1; pos <= path.size(); ++pos) {
    if (pos != path.size() && path[pos] != '/') continue;
    const std::string prefix = path.substr(0, pos);
    if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      return ErrnoStatus("mkdir", prefix, errno);
    }
  }
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return ErrnoStatus("stat", path, errno);
  if (!S_ISDIR(st.st_mode))
    return absl::FailedPreconditionError(absl::StrCat(path, " is not a directory"));
  return absl::OkStatus();
}

}  // namespace kvrelay

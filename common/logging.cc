#include "common/logging.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvrelay {
namespace {

LogSeverity SeverityFromEnv() {
  const char* env = std::getenv("KVRELAY_LOG_LEVEL");
  if (env == nullptr) return LogSeverity::kInfo;
  if (std::strcmp(env, "debug") == 0) return LogSeverity::kDebug;
  if (std::strcmp(env, "warning") == 0) return LogSeverity::kWarning;
  if (std::strcmp(env, "error") == 0) return LogSeverity::kError;
  return LogSeverity::kInfo;
}

// Relaxed: the level is a filter, no other data is published through it.
std::atomic<int>& MinSeverityStorage() {
  static std::atomic<int> severity{static_cast<int>(SeverityFromEnv())};
  return severity;
}

char SeverityLetter(LogSeverity severity) {
  switch (severity) {
    case LogSeverity::kDebug:
      return 'D';
    case LogSeverity::kInfo:
      return 'I';
    case LogSeverity::kWarning:
      return 'W';
    case LogSeverity::kError:
      return 'E';
  }
  return '?';
}

}  // namespace

LogSeverity MinLogSeverity() {
  return static_cast<LogSeverity>(MinSeverityStorage().load(std::memory_order_relaxed));
}

void SetMinLogSeverity(LogSeverity severity) {
  MinSeverityStorage().store(static_cast<int>(severity), std::memory_order_relaxed);
}

namespace internal {

LogMessage::LogMessage(LogSeverity severity, const char* file, int line) : severity_(severity) {
  const char* base = std::strrchr(file, '/');
  stream_ << SeverityLetter(severity) << ' '
          << absl::FormatTime("%H:%M:%E3S", absl::Now(), absl::LocalTimeZone()) << ' '
          << (base != nullptr ? base + 1 : file) << ':' << line << "] ";
}

LogMessage::~LogMessage() {
  stream_ << '\n';
  const std::string text = stream_.str();
  std::fwrite(text.data(), 1, text.size(), stderr);
  if (severity_ >= LogSeverity::kWarning) std::fflush(stderr);
}

}  // namespace internal
}  // namespace kvrelay

#pragma once

// Minimal leveled logging to stderr (Abseil 20220623 has no absl/log). Thread-safe: each
// message is formatted first and written with one fwrite.
//
//   KV_LOG(WARNING) << "cut WAL tail at offset " << offset;

#include <sstream>
#include <string_view>

namespace kvrelay {

enum class LogSeverity { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// Messages below this level are dropped. Default kInfo; KVRELAY_LOG_LEVEL=debug|info|warning|error.
LogSeverity MinLogSeverity();
void SetMinLogSeverity(LogSeverity severity);

namespace internal {
class LogMessage {
 public:
  LogMessage(LogSeverity severity, const char* file, int line);
  ~LogMessage();
  LogMessage(const LogMessage&) = delete;
  LogMessage& operator=(const LogMessage&) = delete;
  std::ostream& stream() { return stream_; }

 private:
  LogSeverity severity_;
  std::ostringstream stream_;
};
// Turns `stream << ...` into void so both arms of KV_LOG's ?: have one type.
struct LogVoidify {
  void operator&(std::ostream&) {}
};
}  // namespace internal
}  // namespace kvrelay

#define KV_LOG_SEVERITY_DEBUG ::kvrelay::LogSeverity::kDebug
#define KV_LOG_SEVERITY_INFO ::kvrelay::LogSeverity::kInfo
#define KV_LOG_SEVERITY_WARNING ::kvrelay::LogSeverity::kWarning
#define KV_LOG_SEVERITY_ERROR ::kvrelay::LogSeverity::kError

// An expression, not an if/else, so `if (x) KV_LOG(INFO) << y;` has no dangling else.
#define KV_LOG(level)                                     \
  (KV_LOG_SEVERITY_##level < ::kvrelay::MinLogSeverity()) \
      ? (void)0                                           \
      : ::kvrelay::internal::LogVoidify() &               \
            ::kvrelay::internal::LogMessage(KV_LOG_SEVERITY_##level, __FILE__, __LINE__).stream()

#pragma once

// A minimal HTTP/1.0 responder for Prometheus scrapes: GET /metrics answers the text from
// `render`; anything else is 404. One thread, one connection at a time (scrapes are rare and
// small); each connection is bounded by a 2 s read timeout.

#include <functional>
#include <optional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "common/event_fd.h"
#include "common/scoped_fd.h"

namespace kvrelay::cachestore::server {

class MetricsHttpServer {
 public:
  // Binds host:port (port 0 = any free port) and starts serving.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& host, int port, std::function<std::string()> render);
  ~MetricsHttpServer();  // stops and joins
  int port() const { return port_; }

 private:
  MetricsHttpServer() = default;
  void Loop();
  void Serve(int fd);

  ScopedFd listen_fd_;
  std::optional<EventFd> stop_;  // notified by the destructor
  int port_ = 0;
  std::function<std::string()> render_;
  std::thread thread_;
};

}  // namespace kvrelay::cachestore::server

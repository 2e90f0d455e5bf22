#pragma once

// A minimal HTTP/1.0 responder for /metrics and /healthz on its own port: one thread, one
// connection at a time (scrapes are rare and small), bounded request size, 5 s I/O timeouts.
// Not a general web server.
//
// Thread-safe: Start/Stop from any thread; the handler runs on the server thread.

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "common/event_fd.h"
#include "common/scoped_fd.h"

namespace kvrelay {

struct HttpResponse {
  int status = 200;
  std::string content_type = "text/plain; version=0.0.4";
  std::string body;
};

// Called with the request path ("/metrics"); returns the response.
using HttpHandler = std::function<HttpResponse(const std::string& path)>;

class HttpServer {
 public:
  // Listens on host:port (port 0 = any free port).
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(const std::string& host, int port,
                                                           HttpHandler handler);
  ~HttpServer();  // stops and joins
  int port() const { return port_; }

 private:
  HttpServer(ScopedFd listener, int port, EventFd stop, HttpHandler handler);
  void Loop();
  void Serve(int fd);

  ScopedFd listener_;
  int port_;
  EventFd stop_;
  HttpHandler handler_;
  std::thread thread_;
};

class MetricsRegistry;
// GET /metrics -> registry text; /healthz -> "ok"; anything else 404.
HttpHandler MetricsHandler(const MetricsRegistry* registry);

}  // namespace kvrelay

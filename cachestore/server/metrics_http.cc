#include "cachestore/server/metrics_http.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace kvrelay::cachestore::server {

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& host, int port, std::function<std::string()> render) {
  auto server = std::unique_ptr<MetricsHttpServer>(new MetricsHttpServer());
  server->render_ = std::move(render);
  KV_ASSIGN_OR_RETURN(EventFd stop, EventFd::Create());
  server->stop_.emplace(std::move(stop));
  server->listen_fd_.Reset(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!server->listen_fd_.valid()) {
    return absl::UnavailableError(absl::StrCat("metrics socket: ", std::strerror(errno)));
  }
  int one = 1;
  ::setsockopt(server->listen_fd_.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("host: not an IPv4 address: ", host));
  }
  if (::bind(server->listen_fd_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(server->listen_fd_.get(), 16) != 0) {
    return absl::UnavailableError(
        absl::StrCat("metrics-port: cannot listen on ", host, ":", port, ": ", std::strerror(errno)));
  }
  socklen_t len = sizeof(addr);
  ::getsockname(server->listen_fd_.get(), reinterpret_cast<sockaddr*>(&addr), &len);
  server->port_ = ntohs(addr.sin_port);
  server->thread_ = std::thread([s = server.get()] { s->Loop(); });
  return server;
}

MetricsHttpServer::~MetricsHttpServer() {
  if (stop_.has_value()) stop_->Notify();
  if (thread_.joinable()) thread_.join();
}

void MetricsHttpServer::Loop() {
  while (true) {
    pollfd fds[2] = {{listen_fd_.get(), POLLIN, 0}, {stop_->fd(), POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    if (fds[0].revents & POLLIN) {
      ScopedFd conn(::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC));
      if (conn.valid()) Serve(conn.get());
    }
  }
}

void MetricsHttpServer::Serve(int fd) {
  timeval tv{2, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  std::string req;
  char buf[2048];
  while (req.find("\r\n\r\n") == std::string::npos && req.find("\n\n") == std::string::npos &&
         req.size() < 8192) {
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    req.append(buf, static_cast<size_t>(n));
  }
  std::string status = "404 Not Found";
  std::string body = "not found\n";
  if (req.rfind("GET /metrics", 0) == 0) {
    status = "200 OK";
    body = render_();
  }
  const std::string resp = absl::StrCat(
      "HTTP/1.0 ", status, "\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: ",
      body.size(), "\r\nConnection: close\r\n\r\n", body);
  size_t off = 0;
  while (off < resp.size()) {
    const ssize_t n = ::send(fd, resp.data() + off, resp.size() - off, MSG_NOSIGNAL);
    if (n <= 0) break;
    off += static_cast<size_t>(n);
  }
}

}  // namespace kvrelay::cachestore::server

#include "common/http_server.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/errno_status.h"
#include "common/metrics.h"

namespace kvrelay {
namespace {

constexpr size_t kMaxRequestBytes = 8192;

const char* Reason(int status) {
  switch (status) {
    case 200:
      return "OK";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    default:
      return "Error";
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const std::string& host, int port,
                                                              HttpHandler handler) {
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics port must be in [0, 65535], got ", port));
  }
  // Hostnames, IPv4 and IPv6 literals alike.
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* resolved = nullptr;
  const std::string service = absl::StrCat(port);
  if (int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &resolved); rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics host '", host, "' does not resolve: ", ::gai_strerror(rc)));
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> addresses(resolved, &::freeaddrinfo);
  ScopedFd fd(::socket(resolved->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return ErrnoToStatus(errno, "socket");
  int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd.get(), resolved->ai_addr, resolved->ai_addrlen) != 0) {
    return ErrnoToStatus(errno, absl::StrCat("metrics-port: bind ", host, ":", port));
  }
  if (::listen(fd.get(), 16) != 0) return ErrnoToStatus(errno, "listen");
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &len);
  const int bound_port = bound.ss_family == AF_INET6
                             ? ntohs(reinterpret_cast<const sockaddr_in6*>(&bound)->sin6_port)
                             : ntohs(reinterpret_cast<const sockaddr_in*>(&bound)->sin_port);
  absl::StatusOr<EventFd> stop = EventFd::Create();
  if (!stop.ok()) return stop.status();
  return std::unique_ptr<HttpServer>(
      new HttpServer(std::move(fd), bound_port, *std::move(stop), std::move(handler)));
}

HttpServer::HttpServer(ScopedFd listener, int port, EventFd stop, HttpHandler handler)
    : listener_(std::move(listener)),
      port_(port),
      stop_(std::move(stop)),
      handler_(std::move(handler)),
      thread_([this] { Loop(); }) {}

HttpServer::~HttpServer() {
  stop_.Notify();
  thread_.join();
}

void HttpServer::Loop() {
  while (true) {
    pollfd fds[2] = {{listener_.get(), POLLIN, 0}, {stop_.fd(), POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    if (fds[0].revents & POLLIN) {
      ScopedFd conn(::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
      if (conn.valid()) Serve(conn.get());
    }
  }
}

void HttpServer::Serve(int fd) {
  timeval timeout{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  std::string request;
  char buffer[2048];
  while (request.find("\r\n\r\n") == std::string::npos && request.size() < kMaxRequestBytes) {
    ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
    if (n <= 0) break;
    request.append(buffer, static_cast<size_t>(n));
  }
  HttpResponse response;
  const size_t first_space = request.find(' ');
  const size_t second_space =
      first_space == std::string::npos ? std::string::npos : request.find(' ', first_space + 1);
  if (second_space == std::string::npos) {
    response = {405, "text/plain", "bad request\n"};
  } else if (request.compare(0, first_space, "GET") != 0) {
    response = {405, "text/plain", "only GET\n"};
  } else {
    response = handler_(request.substr(first_space + 1, second_space - first_space - 1));
  }
  std::string out = absl::StrCat("HTTP/1.0 ", response.status, " ", Reason(response.status),
                                 "\r\nContent-Type: ", response.content_type,
                                 "\r\nContent-Length: ", response.body.size(),
                                 "\r\nConnection: close\r\n\r\n", response.body);
  size_t sent = 0;
  while (sent < out.size()) {
    ssize_t n = ::send(fd, out.data() + sent, out.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;
    sent += static_cast<size_t>(n);
  }
}

HttpHandler MetricsHandler(const MetricsRegistry* registry) {
  return [registry](const std::string& path) -> HttpResponse {
    if (path == "/metrics") {
      return {200, "text/plain; version=0.0.4", registry != nullptr ? registry->RenderText() : ""};
    }
    if (path == "/healthz") return {200, "text/plain", "ok\n"};
    return {404, "text/plain", "not found\n"};
  };
}

}  // namespace kvrelay

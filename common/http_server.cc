#include "common/http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/metrics.h"

namespace kvrelay {
namespace {

constexpr size_t kMaxRequestBytes = 8192;

const char* Reason(int status) {
  switch (status) {
    case 200: return "OK";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    default: return "Error";
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const std::string& host, int port,
                                                              HttpHandler handler) {
  ScopedFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("metrics host must be an IPv4 address, got '",
                                                   host, "'"));
  }
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return absl::UnavailableError(
        absl::StrCat("bind ", host, ":", port, ": ", std::strerror(errno)));
  }
  if (::listen(fd.get(), 16) != 0) {
    return absl::InternalError(absl::StrCat("listen: ", std::strerror(errno)));
  }
  socklen_t len = sizeof(addr);
  ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len);
  absl::StatusOr<EventFd> stop = EventFd::Create();
  if (!stop.ok()) return stop.status();
  return std::unique_ptr<HttpServer>(
      new HttpServer(std::move(fd), ntohs(addr.sin_port), *std::move(stop), std::move(handler)));
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
    if (path == "/metrics") return {200, "text/plain; version=0.0.4", registry->RenderText()};
    if (path == "/healthz") return {200, "text/plain", "ok\n"};
    return {404, "text/plain", "not found\n"};
  };
}

}  // namespace kvrelay

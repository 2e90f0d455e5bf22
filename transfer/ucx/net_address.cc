#include "transfer/ucx/net_address.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/errno_status.h"

namespace kvrelay::transfer::ucx {
namespace {

std::string NumericHost(const sockaddr* sa, socklen_t len) {
  char host[NI_MAXHOST];
  if (::getnameinfo(sa, len, host, sizeof(host), nullptr, 0, NI_NUMERICHOST) != 0) return "";
  return host;
}

}  // namespace

absl::StatusOr<HostPort> ParseHostPort(std::string_view address_view, bool allow_port_zero) {
  const std::string address(address_view);
  auto bad = [&] {
    return absl::InvalidArgumentError(absl::StrCat(
        "transport address must look like host:port or [ipv6]:port, got '", address, "'"));
  };
  HostPort out;
  std::string port_part;
  if (!address.empty() && address.front() == '[') {
    const size_t close = address.find(']');
    if (close == std::string::npos || close + 1 >= address.size() || address[close + 1] != ':') {
      return bad();
    }
    out.host = address.substr(1, close - 1);
    port_part = address.substr(close + 2);
  } else {
    const size_t colon = address.rfind(':');
    if (colon == std::string::npos) return bad();
    out.host = address.substr(0, colon);
    if (out.host.find(':') != std::string::npos) return bad();  // unbracketed IPv6
    port_part = address.substr(colon + 1);
  }
  if (out.host.empty() || !absl::SimpleAtoi(port_part, &out.port) || out.port < 0 ||
      out.port > 65535 || (out.port == 0 && !allow_port_zero)) {
    return bad();
  }
  return out;
}

std::string FormatHostPort(std::string_view host_view, int port) {
  const std::string host(host_view);
  if (host.find(':') != std::string::npos) return absl::StrCat("[", host, "]:", port);
  return absl::StrCat(host, ":", port);
}

bool IsWildcardHost(std::string_view host) {
  return host.empty() || host == "0.0.0.0" || host == "::" || host == "*";
}

absl::StatusOr<std::vector<ResolvedAddress>> Resolve(std::string_view host_view, int port) {
  const std::string host(host_view);
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &res);
  if (rc != 0 || res == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve host '", host, "': ", ::gai_strerror(rc)));
  }
  std::vector<ResolvedAddress> out;
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    if (ai->ai_family != AF_INET && ai->ai_family != AF_INET6) continue;
    ResolvedAddress r;
    std::memcpy(&r.addr, ai->ai_addr, ai->ai_addrlen);
    r.len = ai->ai_addrlen;
    r.family = ai->ai_family;
    out.push_back(r);
  }
  ::freeaddrinfo(res);
  std::stable_sort(out.begin(), out.end(), [](const ResolvedAddress& a, const ResolvedAddress& b) {
    return a.family == AF_INET && b.family != AF_INET;
  });
  if (out.empty()) {
    return absl::UnavailableError(absl::StrCat("host '", host, "' has no IP address"));
  }
  return out;
}

absl::StatusOr<ScopedFd> ListenTcp(std::string_view host_view, int port, int* bound_port) {
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("listen port must be 0-65535, got ", port));
  }
  std::string host(host_view);
  if (host.empty() || host == "*") host = "0.0.0.0";
  absl::StatusOr<std::vector<ResolvedAddress>> addrs = Resolve(host, port);
  if (!addrs.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot listen on '", host, "': ", addrs.status().message()));
  }
  absl::Status last;
  for (const ResolvedAddress& a : *addrs) {
    ScopedFd fd(::socket(a.family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!fd.valid()) return ErrnoToStatus(errno, "socket");
    int one = 1;
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&a.addr), a.len) != 0) {
      last = ErrnoToStatus(errno, absl::StrCat("bind ", FormatHostPort(host, port)));
      continue;
    }
    if (::listen(fd.get(), 128) != 0) return ErrnoToStatus(errno, "listen");
    sockaddr_storage bound = {};
    socklen_t len = sizeof(bound);
    ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &len);
    *bound_port =
        ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                          : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    return fd;
  }
  return last;
}

absl::StatusOr<ScopedFd> ConnectTcp(std::string_view address_view, absl::Time deadline) {
  const std::string address(address_view);
  absl::StatusOr<HostPort> hp = ParseHostPort(address);
  if (!hp.ok()) return hp.status();
  absl::StatusOr<std::vector<ResolvedAddress>> addrs = Resolve(hp->host, hp->port);
  if (!addrs.ok()) return addrs.status();
  absl::Status last = absl::UnavailableError(absl::StrCat("cannot connect to ", address));
  for (const ResolvedAddress& a : *addrs) {
    ScopedFd fd(::socket(a.family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!fd.valid()) return ErrnoToStatus(errno, "socket");
    if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&a.addr), a.len) == 0) return fd;
    if (errno != EINPROGRESS) {
      last = ErrnoToStatus(errno, absl::StrCat("connect to ", address));
      continue;
    }
    bool ready = false;
    while (true) {
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) {
        return absl::DeadlineExceededError(absl::StrCat("connect to ", address, " timed out"));
      }
      pollfd p = {fd.get(), POLLOUT, 0};
      const int n = ::poll(
          &p, 1, static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, 1000)));
      if (n > 0) {
        ready = true;
        break;
      }
      if (n < 0 && errno != EINTR) return ErrnoToStatus(errno, "poll");
    }
    int err = 0;
    socklen_t len = sizeof(err);
    ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (ready && err == 0) return fd;
    last = ErrnoToStatus(err, absl::StrCat("connect to ", address));
  }
  return last;
}

absl::StatusOr<std::string> PrimaryHostAddress(int family) {
  // A connected UDP socket sends nothing; the kernel just picks the route's source address.
  {
    ScopedFd fd(::socket(family, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    if (fd.valid()) {
      sockaddr_storage dst = {};
      socklen_t len = 0;
      if (family == AF_INET6) {
        auto* d = reinterpret_cast<sockaddr_in6*>(&dst);
        d->sin6_family = AF_INET6;
        d->sin6_port = htons(9);
        ::inet_pton(AF_INET6, "2001:db8::1", &d->sin6_addr);  // documentation prefix
        len = sizeof(*d);
      } else {
        auto* d = reinterpret_cast<sockaddr_in*>(&dst);
        d->sin_family = AF_INET;
        d->sin_port = htons(9);
        ::inet_pton(AF_INET, "192.0.2.1", &d->sin_addr);  // TEST-NET-1
        len = sizeof(*d);
      }
      if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&dst), len) == 0) {
        sockaddr_storage src = {};
        socklen_t slen = sizeof(src);
        if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&src), &slen) == 0) {
          std::string host = NumericHost(reinterpret_cast<sockaddr*>(&src), slen);
          if (!host.empty() && !IsWildcardHost(host)) return host;
        }
      }
    }
  }
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return ErrnoToStatus(errno, "getifaddrs");
  std::string found;
  for (ifaddrs* i = list; i != nullptr && found.empty(); i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != family) continue;
    if ((i->ifa_flags & IFF_UP) == 0 || (i->ifa_flags & IFF_LOOPBACK) != 0) continue;
    found =
        NumericHost(i->ifa_addr, family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in));
  }
  ::freeifaddrs(list);
  if (found.empty()) return absl::NotFoundError("this host has no non-loopback address");
  return found;
}

}  // namespace kvrelay::transfer::ucx

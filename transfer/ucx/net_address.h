#pragma once

// Addresses of the control connection: "host:port" with a hostname, an IPv4 literal or a
// bracketed IPv6 literal ("[::1]:40123"); name resolution (getaddrinfo); the listening socket;
// and the address to advertise when bound to a wildcard.

#include <sys/socket.h>

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/scoped_fd.h"

namespace kvrelay::transfer::ucx {

struct HostPort {
  std::string host;  // without brackets
  int port = 0;
};

// "host:port", "[v6]:port". InvalidArgument naming the input when malformed; port 1-65535
// unless `allow_port_zero`.
absl::StatusOr<HostPort> ParseHostPort(std::string_view address, bool allow_port_zero = false);
// Brackets IPv6 literals.
std::string FormatHostPort(std::string_view host, int port);
// True for "0.0.0.0", "::", "" and "*".
bool IsWildcardHost(std::string_view host);

// getaddrinfo for TCP; IPv4 results first. Unavailable naming the host when it does not
// resolve.
struct ResolvedAddress {
  sockaddr_storage addr = {};
  socklen_t len = 0;
  int family = 0;
};
absl::StatusOr<std::vector<ResolvedAddress>> Resolve(std::string_view host, int port);

// A non-blocking listening socket on host:port (port 0: any); the bound port in *bound_port.
absl::StatusOr<ScopedFd> ListenTcp(std::string_view host, int port, int* bound_port);

// A connected non-blocking TCP socket to `address`, trying each resolved address in turn
// until `deadline`. Unavailable when nobody answers, DeadlineExceeded when out of time.
absl::StatusOr<ScopedFd> ConnectTcp(std::string_view address, absl::Time deadline);

// This host's primary address: the source address the kernel picks for the default route
// (asked with a connected UDP socket, which sends nothing), else the first non-loopback
// address of an interface that is up. NotFound if the host has none.
absl::StatusOr<std::string> PrimaryHostAddress(int family = AF_INET);

}  // namespace kvrelay::transfer::ucx

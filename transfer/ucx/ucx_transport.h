#pragma once

// UcxTransport: the Transport interface over UCX (ucp) RMA.
//
// Per transport: one ucp context + worker owned by one ProgressThread, a ControlChannel (TCP
// listener + one control connection per peer: hello, regions, DONE/ACK, heartbeats, liveness)
// and per peer one UCX data endpoint created from the peer's worker address (so tcp and shared
// memory both work; a sockaddr listener would work over tcp only on UCX 1.13). Puts/gets are split
// into chunks, issued with many in flight under a byte and op cap, and a put batch ends with one
// ucp_ep_flush_nbx, after which a DONE frame carrying the per-block checksums goes over the control
// connection; the receiver verifies, tells its handler, and ACKs each block. Dead peers are noticed
// by TCP EOF (process death), the UCX endpoint error callback (error mode PEER), or missing
// heartbeats (for shared memory, whose endpoints run with error mode NONE on this UCX version).
//
// Honours UCX_TLS and UCX_NET_DEVICES (read once, at Create). Thread-safe (see Transport).

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "transfer/transport.h"

namespace kvrelay::transfer {

struct UcxTransportOptions {
  // Where the control listener binds: an IPv4/IPv6 literal or a hostname (resolved with
  // getaddrinfo); "0.0.0.0" or "::" for every interface.
  std::string listen_host = "127.0.0.1";
  // The data-plane (control listener) port; 0: any free port. Fixed ports suit firewalls and
  // Kubernetes Services. See address().
  int listen_port = 0;
  // Host part of address(), what peers are told to connect to: a hostname or IP literal.
  // Default: listen_host, except that a wildcard listen_host is never advertised: then this
  // host's primary address (the default route's source address, logged at INFO).
  std::string advertise_host;
  // Port part of address() when it differs from the bound one (NAT, port mapping); 0: the
  // bound port.
  int advertise_port = 0;
  // UCX's own tcp transport listens on ports of its own (the data connections over tcp);
  // "LOW-HIGH" confines them (UCX_TCP_PORT_RANGE), empty: UCX_TCP_PORT_RANGE or any port.
  std::string ucx_tcp_port_range;
  // Endpoint error handling. kAuto: NONE on UCX 1.13 (its PEER mode aborts the process in
  // wireup when a tcp peer goes away at the wrong moment; see ucx_transport.cc) and for shared
  // memory, relying on the control channel's heartbeat; PEER on later UCX over a network.
  enum class ErrorMode { kAuto, kPeer, kNone };
  ErrorMode error_mode = ErrorMode::kAuto;
  uint64_t chunk_bytes = 1 << 20;          // larger blocks are split (tcp collapses on 16 MiB)
  uint64_t max_inflight_bytes = 16 << 20;  // per transport
  int32_t max_inflight_ops = 256;          // per transport
  // The progress thread keeps polling this long after the last event before it sleeps on the
  // worker's event fd (cuts wake-up latency inside bursts; idle CPU stays ~0).
  absl::Duration spin_after_activity = absl::Microseconds(200);
  absl::Duration heartbeat_interval = absl::Milliseconds(200);
  absl::Duration peer_timeout = absl::Seconds(2);  // no frame for this long => peer is down
  // Closing an endpoint we chose to close (Disconnect, shutdown) flushes it for at most this
  // long, then force-closes it. Endpoints of lost peers are force-closed at once.
  absl::Duration endpoint_flush_timeout = absl::Seconds(1);
};

absl::StatusOr<TransportPtr> MakeUcxTransport(UcxTransportOptions options = {});

}  // namespace kvrelay::transfer

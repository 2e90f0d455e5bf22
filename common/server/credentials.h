#pragma once

// The one place where gRPC server and channel credentials are made. Every server goes through
// ServerCredentialsFor() and every client channel through MakeChannel(), so transport security
// is decided here and nowhere else.
//
// Today: plain text only when SecurityOptions::insecure is set (the default for now); with
// cert/key/CA files, mutual TLS with gRPC's own SSL credentials (servers require and verify
// client certificates).
//
// Long-lived channels get HTTP/2 keepalive pings so that a peer that vanished behind a network
// cut is noticed within keepalive_time + keepalive_timeout instead of at the next RPC's deadline.

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"

namespace kvrelay::server {

struct SecurityOptions {
  bool insecure = true;   // plain text; servers log it loudly
  std::string cert_file;  // PEM certificate chain of this component
  std::string key_file;   // PEM private key
  std::string ca_file;    // PEM CA bundle that peers' certificates must chain to
};

struct ChannelOptions {
  absl::Duration keepalive_time = absl::Seconds(10);
  absl::Duration keepalive_timeout = absl::Seconds(5);
  int max_message_bytes = 16 << 20;
  // Its own TCP connection instead of gRPC's process-wide subchannel pool (load generators).
  bool own_connection = false;
};

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFor(
    const SecurityOptions& security);
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFor(
    const SecurityOptions& security);

// A channel to `address` (HOST:PORT) with keepalive. Fails only when the credentials cannot be
// loaded; connecting is lazy, as with grpc::CreateChannel.
absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const std::string& address,
                                                           const SecurityOptions& security,
                                                           const ChannelOptions& options = {});

}  // namespace kvrelay::server

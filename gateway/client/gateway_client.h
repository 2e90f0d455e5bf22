#pragma once

// A blocking client of kvrelay.v1.Gateway/Generate: sends one request, collects the streamed
// tokens and the final summary. Used by `kvrelay generate --gateway`, `kvrelay bench-serve`, the
// end-to-end tests and bench/e2e_bench.
//
// Its channel comes from common/server/credentials (MakeChannel), as every channel does:
// plain text with SecurityOptions::insecure, mutual TLS with cert/key/CA files.
//
// Thread safety: a GatewayClient may be used from many threads at once (one gRPC channel).

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/server/credentials.h"
#include "gateway/client/generation.h"
#include "kvrelay/v1/gateway.grpc.pb.h"

namespace kvrelay::gateway::client {

struct GatewayRequest {
  GenerationRequest generation;
  std::string model;  // model id; "" lets the gateway use the one model it serves
  std::string tenant = "default";
};

class GatewayClient {
 public:
  // Called on the calling thread with each streamed message's tokens, as they arrive.
  using TokenCallback = std::function<void(const std::vector<int32_t>& new_tokens)>;

  // `address` is host:port; connects lazily. `bearer_token` (a JWT naming the tenant, see
  // gateway/tenant_auth.h) goes with every call as "authorization: Bearer ..." when non-empty.
  // TLS files that cannot be read make every call fail with that reason (the CLI checks them
  // before it gets here).
  explicit GatewayClient(const std::string& address,
                         const ::kvrelay::server::SecurityOptions& security = {},
                         std::string bearer_token = "");

  // The gateway's error as an absl::Status with the same code (INVALID_ARGUMENT for bad input,
  // UNAVAILABLE when no worker could serve, DEADLINE_EXCEEDED past `timeout`). A stream that
  // ends OK without a summary is DataLoss.
  absl::StatusOr<GenerationResult> Generate(const GatewayRequest& request, absl::Duration timeout,
                                            const TokenCallback& on_tokens = nullptr) const;

  // The same, for a raw proto (tests send malformed requests this way).
  absl::StatusOr<GenerationResult> GenerateRaw(const v1::GenerateRequest& request,
                                               absl::Duration timeout,
                                               const TokenCallback& on_tokens = nullptr) const;

  // Gateway/Status (`kvrelay status`): the cluster as the gateway sees it, within `timeout`.
  // Needs an admin or gateway certificate under mutual TLS.
  absl::StatusOr<v1::GatewayStatusResponse> Status(absl::Duration timeout) const;

  const std::string& address() const { return address_; }  // as given to the constructor

 private:
  const std::string address_;
  const std::string bearer_token_;
  std::unique_ptr<v1::Gateway::Stub> stub_;  // null when the channel could not be made
  absl::Status channel_status_;              // why stub_ is null
};

}  // namespace kvrelay::gateway::client

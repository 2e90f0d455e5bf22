#pragma once

// A blocking client of kvrelay.v1.Gateway/Generate: sends one request, collects the streamed
// tokens and the final summary. Used by `kvrelay generate --gateway`, the end-to-end tests and
// bench/e2e_bench.
//
// Thread safety: a GatewayClient may be used from many threads at once (one gRPC channel).

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cli/colocated.h"
#include "common/server/credentials.h"
#include "kvrelay/v1/gateway.grpc.pb.h"

namespace kvrelay::cli {

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
  explicit GatewayClient(const std::string& address, const server::SecurityOptions& security = {},
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

 private:
  std::unique_ptr<v1::Gateway::Stub> stub_;
  const std::string bearer_token_;
};

}  // namespace kvrelay::cli

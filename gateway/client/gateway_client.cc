#include "gateway/client/gateway_client.h"

#include "absl/strings/str_cat.h"
#include "grpcpp/client_context.h"
#include "proto/grpc_status.h"

namespace kvrelay::gateway::client {
namespace {

absl::StatusOr<std::unique_ptr<v1::Gateway::Stub>> MakeStub(
    const std::string& address, const ::kvrelay::server::SecurityOptions& security) {
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
      ::kvrelay::server::MakeChannel(address, security);
  if (!channel.ok()) return channel.status();
  return v1::Gateway::NewStub(*std::move(channel));
}

}  // namespace

GatewayClient::GatewayClient(const std::string& address,
                             const ::kvrelay::server::SecurityOptions& security,
                             std::string bearer_token)
    : address_(address), bearer_token_(std::move(bearer_token)) {
  absl::StatusOr<std::unique_ptr<v1::Gateway::Stub>> stub = MakeStub(address, security);
  if (stub.ok()) {
    stub_ = *std::move(stub);
  } else {
    channel_status_ = stub.status();
  }
}

absl::StatusOr<GenerationResult> GatewayClient::Generate(const GatewayRequest& request,
                                                         absl::Duration timeout,
                                                         const TokenCallback& on_tokens) const {
  v1::GenerateRequest proto;
  for (int32_t t : request.generation.tokens) proto.add_tokens(t);
  proto.set_model(request.model);
  proto.set_tenant(request.tenant);
  proto.set_max_tokens(request.generation.max_tokens);
  proto.mutable_sampling()->set_temperature(request.generation.temperature);
  proto.mutable_sampling()->set_seed(request.generation.seed);
  if (request.generation.eos_token >= 0) {
    proto.set_eos_token(request.generation.eos_token);
    proto.set_has_eos_token(true);
  } else {
    proto.set_eos_token(-1);
  }
  return GenerateRaw(proto, timeout, on_tokens);
}

absl::StatusOr<GenerationResult> GatewayClient::GenerateRaw(const v1::GenerateRequest& request,
                                                            absl::Duration timeout,
                                                            const TokenCallback& on_tokens) const {
  // Unreadable TLS files: every call fails with the reason (clearer than a crash).
  if (stub_ == nullptr) return channel_status_;
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  if (!bearer_token_.empty()) context.AddMetadata("authorization", "Bearer " + bearer_token_);
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader =
      stub_->Generate(&context, request);
  GenerationResult result;
  bool have_summary = false;
  v1::GenerateResponse response;
  while (reader->Read(&response)) {
    for (int32_t t : response.tokens()) result.tokens.push_back(t);
    if (on_tokens && response.tokens_size() > 0) {
      on_tokens(std::vector<int32_t>(response.tokens().begin(), response.tokens().end()));
    }
    if (response.has_summary()) {
      have_summary = true;
      const v1::GenerateSummary& s = response.summary();
      result.ttft_ms = s.ttft_ms();
      result.total_ms = s.total_ms();
      result.prefix_hit_tokens = s.prefix_hit_tokens();
      result.computed_prompt_tokens = s.computed_prompt_tokens();
      result.transferred_bytes = s.transferred_bytes();
      result.fetched_bytes = s.fetched_bytes();
      result.prompt_tokens = s.prompt_tokens();
      result.generated_tokens = s.generated_tokens();
      result.prefill_worker = s.prefill_worker();
      result.decode_worker = s.decode_worker();
      result.attempts = s.attempts();
      result.prefix_source = s.prefix_source();
      result.decode_held_blocks = s.decode_held_blocks();
    }
  }
  grpc::Status status = reader->Finish();
  if (!status.ok()) return proto::FromGrpcStatus(status);
  if (!have_summary) {
    return absl::DataLossError(absl::StrCat("gateway stream ended after ", result.tokens.size(),
                                            " tokens without a summary"));
  }
  return result;
}

absl::StatusOr<v1::GatewayStatusResponse> GatewayClient::Status(absl::Duration timeout) const {
  if (stub_ == nullptr) return channel_status_;
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  if (!bearer_token_.empty()) context.AddMetadata("authorization", "Bearer " + bearer_token_);
  v1::GatewayStatusResponse response;
  grpc::Status status = stub_->Status(&context, v1::GatewayStatusRequest(), &response);
  if (!status.ok()) return proto::FromGrpcStatus(status);
  return response;
}

}  // namespace kvrelay::gateway::client

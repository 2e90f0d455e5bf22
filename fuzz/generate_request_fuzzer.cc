// The gateway's Generate check (gateway/request_validation): protobuf bytes are parsed as a
// GenerateRequest and validated against a real model config (the llama3-8b preset).

#include <cstddef>
#include <cstdint>

#include "gateway/request_validation.h"
#include "kv/presets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const kvrelay::kv::ModelConfig* config = [] {
    absl::StatusOr<kvrelay::kv::ModelConfig> c = kvrelay::kv::LoadPreset("llama3-8b");
    if (!c.ok()) __builtin_trap();
    return new kvrelay::kv::ModelConfig(*std::move(c));
  }();
  kvrelay::v1::GenerateRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  absl::Status s = kvrelay::gateway::ValidateGenerateRequest(request, "llama3-8b", *config);
  if (s.ok() && (request.tokens_size() == 0 || request.tenant().empty())) __builtin_trap();
  if (!s.ok() && !absl::IsInvalidArgument(s) && !absl::IsResourceExhausted(s)) __builtin_trap();
  return 0;
}

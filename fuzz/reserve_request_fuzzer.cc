// The decode worker's Reserve check (decode/request_validation): protobuf bytes are parsed as
// a ReserveRequest and validated against a real layout (the llama3-8b preset). The first
// input byte, if 1, stamps the right layout fingerprint so the checks past it are reached.

#include <cstddef>
#include <cstdint>
#include <string>

#include "decode/request_validation.h"
#include "kv/presets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const kvrelay::kv::ModelConfig* config = [] {
    absl::StatusOr<kvrelay::kv::ModelConfig> c = kvrelay::kv::LoadPreset("llama3-8b");
    if (!c.ok()) __builtin_trap();
    return new kvrelay::kv::ModelConfig(*std::move(c));
  }();
  if (size == 0) return 0;
  kvrelay::v1::ReserveRequest request;
  if (!request.ParseFromArray(data + 1, static_cast<int>(size - 1))) return 0;
  if (data[0] == 1) {
    const kvrelay::kv::LayoutFingerprint& fp = config->layout.fingerprint();
    request.set_layout_fingerprint(fp.bytes.data(), fp.bytes.size());
  }
  absl::Status s = kvrelay::decode::ValidateReserveRequest(request, "llama3-8b", config->layout);
  if (s.ok() &&
      (request.prompt_tokens() < 1 || request.max_tokens() < 1 || request.request_id().empty())) {
    __builtin_trap();
  }
  if (!s.ok() && !absl::IsInvalidArgument(s) && !absl::IsFailedPrecondition(s)) __builtin_trap();
  return 0;
}

#include "gateway/request_validation.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kv/prompt_validation.h"
#include "proto/limits.h"

namespace kvrelay::gateway {

absl::Status ValidateGenerateRequest(const kvrelay::v1::GenerateRequest& request,
                                     const std::string& model_name, const kv::ModelConfig& config) {
  if (!request.model().empty() && request.model() != model_name) {
    return absl::InvalidArgumentError(absl::StrCat("model: unknown model '",
                                                   request.model().substr(0, 256),
                                                   "' (this gateway serves '", model_name, "')"));
  }
  if (request.tenant().empty() || request.tenant().size() > limits::kMaxTenantBytes) {
    return absl::InvalidArgumentError(absl::StrCat("tenant must be 1-", limits::kMaxTenantBytes,
                                                   " bytes, got ", request.tenant().size()));
  }
  KV_RETURN_IF_ERROR(kv::ValidatePrompt(request.tokens(), request.max_tokens(), config));
  const float t = request.sampling().temperature();
  if (!(t >= 0 && t <= limits::kMaxTemperature)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling.temperature must be in [0, ", limits::kMaxTemperature, "]"));
  }
  const float top_p = request.sampling().top_p();
  if (!(top_p >= 0 && top_p <= 1)) {
    return absl::InvalidArgumentError("sampling.top_p must be in (0, 1] (0 = unset)");
  }
  return absl::OkStatus();
}

}  // namespace kvrelay::gateway

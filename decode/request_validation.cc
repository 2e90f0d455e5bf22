#include "decode/request_validation.h"

#include <cctype>

#include "absl/strings/str_cat.h"
#include "proto/limits.h"

namespace kvrelay::decode {

absl::Status ValidateRequestId(const std::string& id) {
  if (id.empty() || id.size() > limits::kMaxRequestIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "request_id must be 1-", limits::kMaxRequestIdBytes, " bytes, got ", id.size()));
  }
  for (char c : id) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != ':' &&
        c != '-') {
      return absl::InvalidArgumentError("request_id may hold only [A-Za-z0-9._:-]");
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateReserveRequest(const kvrelay::v1::ReserveRequest& request,
                                    const std::string& model_name, const kv::ModelLayout& layout) {
  if (absl::Status s = ValidateRequestId(request.request_id()); !s.ok()) return s;
  if (!model_name.empty() && request.model() != model_name) {
    return absl::InvalidArgumentError(absl::StrCat("model: this worker serves '", model_name,
                                                   "', not '", request.model().substr(0, 256),
                                                   "'"));
  }
  const kv::LayoutFingerprint& fp = layout.fingerprint();
  if (request.layout_fingerprint() !=
      std::string_view(reinterpret_cast<const char*>(fp.bytes.data()), fp.bytes.size())) {
    return absl::FailedPreconditionError(
        absl::StrCat("layout_fingerprint: this worker serves ",
                     kv::LayoutMismatch(layout, "request's", request.layout_description())));
  }
  if (request.prompt_tokens() < 1 || request.prompt_tokens() > limits::kMaxPromptTokens) {
    return absl::InvalidArgumentError(absl::StrCat("prompt_tokens must be in [1, ",
                                                   limits::kMaxPromptTokens, "], got ",
                                                   request.prompt_tokens()));
  }
  if (request.max_tokens() < 1 || request.max_tokens() > limits::kMaxGenerateTokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_tokens must be in [1, ", limits::kMaxGenerateTokens, "], got ", request.max_tokens()));
  }
  return absl::OkStatus();
}

}  // namespace kvrelay::decode

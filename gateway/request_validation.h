#pragma once

// What the gateway checks in a Generate request before routing it: a pure function of the
// request and the served model, shared by Gateway and the fuzzer (fuzz/). InvalidArgument
// names the field and the value.

#include <string>

#include "absl/status/status.h"
#include "kv/hf_config.h"
#include "kvrelay/v1/gateway.pb.h"

namespace kvrelay::gateway {

// Model (empty = the served one), tenant length, prompt (kv::ValidatePrompt against `config`),
// max_tokens, sampling ranges.
absl::Status ValidateGenerateRequest(const kvrelay::v1::GenerateRequest& request,
                                     const std::string& model_name, const kv::ModelConfig& config);

}  // namespace kvrelay::gateway

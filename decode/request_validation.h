#pragma once

// What a decode worker checks in a request before it touches any state: pure functions of the
// request and the worker's model, so that DecodeWorker and the fuzzer (fuzz/) run the same
// code. InvalidArgument names the field and the value; FailedPrecondition means the request
// was routed for another layout (the caller's routing, not its input, is wrong).

#include <string>

#include "absl/status/status.h"
#include "kv/model_layout.h"
#include "kvrelay/v1/decode.pb.h"

namespace kvrelay::decode {

// 1-64 bytes of [A-Za-z0-9._:-].
absl::Status ValidateRequestId(const std::string& id);

// Reserve: request id, model (when `model_name` is not empty), layout fingerprint, prompt and
// max_tokens ranges.
absl::Status ValidateReserveRequest(const kvrelay::v1::ReserveRequest& request,
                                    const std::string& model_name, const kv::ModelLayout& layout);

}  // namespace kvrelay::decode

#pragma once

// OpenAiHttpServer: the OpenAI-compatible HTTP front door of the gateway, beside its gRPC one
// and over the same Gateway (same routing, failover, admission and tenant rules).
//
//   GET  /v1/models
//   POST /v1/completions        prompt as text or token ids
//   POST /v1/chat/completions   messages -> the model's chat template (its Tokenizer)
//
// Both POSTs stream as server-sent events (`stream: true`, ending with `data: [DONE]`) or answer
// once. Supported fields: model, max_tokens (max_completion_tokens), temperature, top_p, seed,
// stop (string or up to 4 strings), stream, stream_options.include_usage. `usage` reports
// prompt_tokens_details.cached_tokens (the prefix reused from the KV cache). Each choice also
// carries `token_ids` (as vLLM's return_token_ids), so clients can compare ids exactly.
// Errors are OpenAI-shaped: {"error": {"message", "type", "param", "code"}} with the matching
// HTTP status (400 bad field, 401/403 credentials, 404 unknown model or path, 429 no capacity,
// 503 no worker, 504 deadline). A 429 carries Retry-After (seconds: the predicted wait when the
// refusal has one, else 1); its type is "overloaded_error" (code "overloaded") when a tier is full
// and "rate_limit_error" when a per-tenant or per-client quota refused.
//
// The tenant comes from the credential (TenantResolver over the Authorization header), never
// from the body.
//
// Built on cpp-httplib (Debian's libcpp-httplib-dev): a thread pool, one request per thread.
// Text goes through the served model's tokenizer (tokenizer/: its tokenizer.json, or the byte
// tokenizer of the demo models; see LoadServedTokenizer).
//
// Thread-safe; the gateway and the tokenizer must outlive the server.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/server/credentials.h"
#include "gateway/gateway.h"
#include "tokenizer/tokenizer.h"

namespace httplib {
class Server;
}

namespace kvrelay::gateway {

// The tokenizer of the model in `model_dir`: its tokenizer.json (or tokenizer.json.gz) when the
// directory has one, else the byte tokenizer of the demo models (one token per UTF-8 byte, with
// the plain chat template "<|role|>\ncontent\n" ... "<|assistant|>\n").
absl::StatusOr<std::unique_ptr<tokenizer::Tokenizer>> LoadServedTokenizer(
    const std::string& model_dir);

// Authorization header value ("" when absent) -> the authenticated tenant, or
// Unauthenticated / PermissionDenied.
using TenantResolver = std::function<absl::StatusOr<std::string>(const std::string& authorization)>;

struct OpenAiHttpOptions {
  std::string host = "127.0.0.1";
  int port = 0;  // 0: any free port
  std::string model_name;
  // TLS (HTTPS) when cert and key files are given.
  ::kvrelay::server::SecurityOptions security;
  TenantResolver resolve_tenant;  // required
  int32_t default_max_tokens = 16;
  absl::Duration request_timeout = absl::Seconds(120);
  size_t max_body_bytes = 4 << 20;
};

class OpenAiHttpServer {
 public:
  static absl::StatusOr<std::unique_ptr<OpenAiHttpServer>> Start(
      OpenAiHttpOptions options, Gateway* gateway, const tokenizer::Tokenizer* tokenizer);
  ~OpenAiHttpServer();  // stops accepting, joins
  int port() const { return port_; }

 private:
  OpenAiHttpServer(OpenAiHttpOptions options, Gateway* gateway,
                   const tokenizer::Tokenizer* tokenizer);
  void Routes();

  const OpenAiHttpOptions options_;
  Gateway* const gateway_;
  const tokenizer::Tokenizer* const tokenizer_;
  std::unique_ptr<httplib::Server> http_;
  int port_ = 0;
  std::thread thread_;
};

}  // namespace kvrelay::gateway

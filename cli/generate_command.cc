// `kvrelay generate`: one request, either through a running gateway (--gateway ADDR) or in this
// process with prefill and decode co-located (--colocated --model DIR), the reference that
// disaggregated serving must match.

#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "cli/colocated.h"
#include "cli/command.h"
#include "common/file_util.h"
#include "common/flags.h"
#include "common/server/server_flags.h"
#include "gateway/client/gateway_client.h"
#include "kv/hf_config.h"
#include "tokenizer/byte_tokenizer.h"
#include "tokenizer/tokenizer.h"

namespace kvrelay::cli {
using ::kvrelay::gateway::client::GatewayClient;
using ::kvrelay::gateway::client::GatewayRequest;

namespace {

int UsageError(const std::string& message) { return ::kvrelay::UsageError("generate", message); }

// "1,2,3" (spaces allowed) -> ids; InvalidArgument naming the bad entry.
absl::StatusOr<std::vector<int32_t>> ParseTokenList(const std::string& text) {
  std::vector<int32_t> tokens;
  if (absl::StripAsciiWhitespace(text).empty()) return tokens;
  int index = 0;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    int32_t id;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(part), &id)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--tokens: entry ", index, " ('", part, "') is not an integer"));
    }
    tokens.push_back(id);
    ++index;
  }
  return tokens;
}

// The text of generated ids: --tokenizer's decoding, or the byte tokenizer's display form.
std::string DisplayText(const std::vector<int32_t>& ids, const tokenizer::Tokenizer& tokenizer,
                        bool byte_tokens) {
  if (byte_tokens) return tokenizer::DecodeBytesForDisplay(ids);
  absl::StatusOr<std::string> text = tokenizer.Decode(ids);
  return text.ok() ? *text : absl::StrCat("<", text.status().message(), ">");
}

nlohmann::json ResultJson(const GenerationResult& r, const std::string& mode,
                          const std::optional<std::string>& text) {
  nlohmann::json j = {{"mode", mode},
                      {"tokens", r.tokens},
                      {"ttft_ms", r.ttft_ms},
                      {"total_ms", r.total_ms},
                      {"prefix_hit_tokens", r.prefix_hit_tokens},
                      {"computed_prompt_tokens", r.computed_prompt_tokens},
                      {"transferred_bytes", r.transferred_bytes},
                      {"fetched_bytes", r.fetched_bytes},
                      {"prompt_tokens", r.prompt_tokens},
                      {"generated_tokens", r.generated_tokens},
                      {"prefill_worker", r.prefill_worker},
                      {"decode_worker", r.decode_worker},
                      {"attempts", r.attempts},
                      {"prefix_source", r.prefix_source},
                      {"decode_held_blocks", r.decode_held_blocks}};
  if (text) j["text"] = *text;
  return j;
}

void PrintHuman(const GenerationResult& r, const std::optional<std::string>& text) {
  if (text) std::printf("text:   %s\n", text->c_str());
  std::printf("tokens: %s\n", absl::StrJoin(r.tokens, ",").c_str());
  std::printf(
      "ttft %.2f ms, total %.2f ms; prompt %d tokens (%d from cache, %d computed); "
      "%d generated; KV moved %lld B, fetched %lld B (prefix: %s, %d blocks held by decode); "
      "prefill %s, decode %s, attempts %d\n",
      r.ttft_ms, r.total_ms, r.prompt_tokens, r.prefix_hit_tokens, r.computed_prompt_tokens,
      r.generated_tokens, static_cast<long long>(r.transferred_bytes),
      static_cast<long long>(r.fetched_bytes),
      r.prefix_source.empty() ? "-" : r.prefix_source.c_str(), r.decode_held_blocks,
      r.prefill_worker.c_str(), r.decode_worker.c_str(), r.attempts);
}

}  // namespace

int RunGenerateCommand(const std::vector<std::string>& args) {
  std::string gateway_address, model_dir, model_id, tokens_text, prompt, tenant, token_file;
  server::SecurityOptions security;
  bool colocated = false, json = false;
  int32_t max_tokens = 16, threads = 1, eos = -1;
  int64_t seed = 0;
  double temperature = 0.0;
  absl::Duration timeout = absl::Seconds(120);
  FlagSet flags("generate",
                "Generates tokens for one prompt through a gateway, or co-located in this "
                "process (the reference).");
  flags.AddString("gateway", &gateway_address, "gateway address HOST:PORT");
  flags.AddBool("colocated", &colocated, "prefill and decode in this process (needs --model)");
  flags.AddString("model", &model_dir, "model directory for --colocated");
  flags.AddString("model-name", &model_id,
                  "model name sent to the gateway (default: the model the gateway serves)");
  flags.AddString("tokens", &tokens_text, "prompt token ids, comma-separated: 1,2,3");
  flags.AddString("prompt", &prompt, "prompt text, tokenized by --tokenizer");
  std::string tokenizer_spec = "byte";
  flags.AddString("tokenizer", &tokenizer_spec,
                  "byte (one token per byte, the demo models) or a model's tokenizer.json "
                  "directory/file (tokenizer/README.md)");
  flags.AddInt32("max-tokens", &max_tokens, "tokens to generate, 1-4096");
  flags.AddString("tenant", &tenant,
                  "tenant (prefix reuse never crosses tenants); with TLS it must be the one the "
                  "client certificate or --token-file names (default: that one; with "
                  "--insecure: 'default')");
  flags.AddString("token-file", &token_file,
                  "file holding a bearer token (JWT) that names the tenant (`kvrelay token`)");
  server::AddSecurityFlags(flags, security);
  flags.AddDouble("temperature", &temperature, "sampling temperature; 0 = greedy");
  flags.AddInt64("seed", &seed, "sampling seed (>= 0)");
  flags.AddInt32("eos", &eos, "stop after this token id; -1 = none");
  flags.AddInt32("threads", &threads, "compute threads for --colocated");
  std::string device_text = "cpu";
  flags.AddString("device", &device_text,
                  "cpu|cuda[:N]|auto: where --colocated computes (cpu, the reference, by "
                  "default; a CUDA cluster's tokens equal a CUDA co-located run's)");
  std::string kv_dtype_text = "auto";
  flags.AddString("kv-cache-dtype", &kv_dtype_text,
                  "KV cache dtype of --colocated (auto: the model's; bf16, fp16, fp32 or "
                  "fp8_e4m3), as the workers' flag of the same name");
  flags.AddDuration("timeout", &timeout, "deadline of the whole request");
  flags.AddBool("json", &json, "print one JSON object");
  if (std::optional<int> exit_code = ParseCommandLine(flags, args)) return *exit_code;
  absl::StatusOr<std::optional<kv::DType>> kv_dtype =
      kv::ParseKvDTypeFlag("--kv-cache-dtype", kv_dtype_text);
  if (!kv_dtype.ok()) return UsageError(std::string(kv_dtype.status().message()));
  if (!colocated && kv_dtype->has_value()) {
    return UsageError("--kv-cache-dtype is for --colocated; a gateway's workers have their own");
  }
  if (colocated == !gateway_address.empty()) {
    return UsageError("give exactly one of --gateway ADDR or --colocated");
  }
  if (colocated && model_dir.empty()) return UsageError("--colocated needs --model DIR");
  absl::StatusOr<model::DeviceChoice> device = model::ParseDeviceFlag(device_text);
  if (!device.ok()) return UsageError(absl::StrCat("--device: ", device.status().message()));
  if (!colocated && flags.WasSet("device")) {
    return UsageError("--device is for --colocated; a gateway's workers have their own");
  }
  if (!colocated) {
    if (absl::Status s = server::SettleSecurity(flags, security); !s.ok()) {
      return UsageError(std::string(s.message()));
    }
    if (security.insecure && tenant.empty()) tenant = "default";
  }
  std::string bearer_token;
  if (!token_file.empty()) {
    absl::StatusOr<std::string> token = ReadFileToString(token_file);
    if (!token.ok()) return UsageError(absl::StrCat("--token-file: ", token.status().message()));
    bearer_token = std::string(absl::StripAsciiWhitespace(*token));
  }
  if (!colocated && !model_dir.empty()) {
    return UsageError("--model is for --colocated; with --gateway use --model-name");
  }
  if (flags.WasSet("tokens") == flags.WasSet("prompt")) {
    return UsageError("give exactly one of --tokens 1,2,3 or --prompt TEXT");
  }
  GenerationRequest request;
  const bool with_text = flags.WasSet("prompt");
  const bool byte_tokens = tokenizer_spec == "byte";
  absl::StatusOr<std::unique_ptr<tokenizer::Tokenizer>> text_tokenizer =
      tokenizer::LoadTokenizer(tokenizer_spec);
  if (!text_tokenizer.ok()) {
    return UsageError(absl::StrCat("--tokenizer: ", text_tokenizer.status().message()));
  }
  if (with_text) {
    absl::StatusOr<std::vector<int32_t>> ids = (*text_tokenizer)->Encode(prompt);
    if (!ids.ok()) return UsageError(absl::StrCat("--prompt: ", ids.status().message()));
    request.tokens = *std::move(ids);
  } else {
    absl::StatusOr<std::vector<int32_t>> parsed = ParseTokenList(tokens_text);
    if (!parsed.ok()) return UsageError(std::string(parsed.status().message()));
    request.tokens = *std::move(parsed);
  }
  if (request.tokens.empty()) return UsageError("the prompt is empty");
  if (max_tokens < 1)
    return UsageError(absl::StrCat("--max-tokens must be >= 1, got ", max_tokens));
  if (temperature < 0 || temperature > 100) {
    return UsageError(absl::StrCat("--temperature must be in [0, 100], got ", temperature));
  }
  if (seed < 0) return UsageError(absl::StrCat("--seed must be >= 0, got ", seed));
  if (timeout <= absl::ZeroDuration()) return UsageError("--timeout must be positive");
  request.max_tokens = max_tokens;
  request.temperature = static_cast<float>(temperature);
  request.seed = static_cast<uint64_t>(seed);
  request.eos_token = eos;

  absl::StatusOr<GenerationResult> result;
  std::string mode;
  if (colocated) {
    mode = "colocated";
    absl::StatusOr<std::unique_ptr<ColocatedGenerator>> generator =
        ColocatedGenerator::Load(model_dir, threads, *device, *kv_dtype);
    if (!generator.ok()) {
      return UsageError(absl::StrCat("--model ", model_dir, ": ", generator.status().message()));
    }
    result = (*generator)->Generate(request);
  } else {
    mode = "gateway";
    GatewayRequest gateway_request;
    gateway_request.generation = request;
    gateway_request.tenant = tenant;
    gateway_request.model = model_id;
    result =
        GatewayClient(gateway_address, security, bearer_token).Generate(gateway_request, timeout);
  }
  if (!result.ok()) {
    std::fprintf(stderr, "kvrelay generate: %s\n", result.status().ToString().c_str());
    return result.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  std::optional<std::string> text;
  if (with_text) text = DisplayText(result->tokens, **text_tokenizer, byte_tokens);
  if (json) {
    std::cout << ResultJson(*result, mode, text).dump() << std::endl;
  } else {
    PrintHuman(*result, text);
  }
  return 0;
}

}  // namespace kvrelay::cli

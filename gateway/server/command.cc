// `kvrelay gateway`: runs the gateway until SIGTERM.

#include "gateway/server/command.h"

#include <cstdio>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/file_util.h"
#include "common/flags.h"
#include "common/logging.h"
#include "common/server/server_flags.h"
#include "common/server/service_host.h"
#include "common/status_macros.h"
#include "gateway/gateway.h"
#include "gateway/http/openai_server.h"
#include "gateway/server/gateway_service.h"
#include "gateway/tenant_auth.h"
#include "kv/hf_config.h"

namespace kvrelay::gateway::server {
namespace {

// Bounds of the quota flags: beyond them a "limit" limits nothing a gateway could serve.
constexpr int64_t kMaxInFlightQuota = 100000;
constexpr int64_t kMaxReservedTokensQuota = int64_t{1} << 32;

// What `kvrelay gateway`'s flags fill, before and after their checks.
struct GatewayFlags {
  GatewayOptions options;
  kvrelay::server::ServiceHostOptions host;
  std::string cachestore, prefill, decode, secret_file, token_keys_file, http_host;
  std::string kv_cache_dtype = "auto";
  int32_t http_port = -1;
  std::vector<std::string> prefill_addresses, decode_addresses;  // --prefill, --decode split
};

void AddRoutingFlags(FlagSet& flags, GatewayFlags& f) {
  GatewayOptions& options = f.options;
  flags.AddString("cachestore", &f.cachestore,
                  "cache store HOST:PORT (prefix-aware routing); several, comma-separated: an HA "
                  "store set");
  flags.AddString("prefill", &f.prefill,
                  "fixed prefill workers, HOST:PORT[,HOST:PORT...] (with --cachestore, workers "
                  "that register are discovered too)");
  flags.AddString("decode", &f.decode, "fixed decode workers, HOST:PORT[,HOST:PORT...]");
  flags.AddDuration("discovery-interval", &options.discovery_interval,
                    "how often the cache store's registry is read for workers that joined or "
                    "left (0: only the fixed lists)");
  flags.AddString("model", &options.model_dir, "model directory the workers serve");
  flags.AddString("model-name", &options.model_name,
                  "model name requests use (default: the directory's base name)");
  flags.AddInt32("block-tokens", &options.block_tokens,
                 "tokens per KV block; the cache store and the workers must use the same value "
                 "(a store with another one is refused)");
  flags.AddString("kv-cache-dtype", &f.kv_cache_dtype,
                  "KV cache dtype the workers use (auto: the model's torch_dtype; bf16, fp16, "
                  "fp32 or fp8_e4m3): part of the layout requests are hashed and routed for; "
                  "workers serving another layout are never paired");
  flags.AddInt32("max-attempts", &options.max_attempts, "failed worker pairs tried per request");
  flags.AddBool("prefix-routing", &options.prefix_routing,
                "route to the prefill node holding the prompt's prefix when its queue is worth it "
                "(false: by load alone; workers pull or recompute what others hold)");
  flags.AddDuration("reserve-timeout", &options.reserve_timeout,
                    "per-attempt upper bound on a decode worker's Reserve");
  flags.AddDuration("reserve-timeout-floor", &options.reserve_timeout_floor,
                    "lower bound of the adaptive Reserve timeout (SRTT + 4 RTTVAR of measured "
                    "Reserve round trips, within [floor, --reserve-timeout])");
  options.link_canary_interval = absl::Seconds(1);
  flags.AddDuration("link-canary-interval", &options.link_canary_interval,
                    "how often a decode worker whose pushes were at least twice as slow per MiB "
                    "as the fleet's best gets a synthetic request that measures its link again, "
                    "instead of a client's (0: off)");
  flags.AddDuration("prefill-timeout", &options.prefill_timeout,
                    "per-attempt bound on a prefill (compute + push)");
  flags.AddDuration("chunk-timeout", &options.chunk_timeout,
                    "per-attempt bound on the wait for the first and every next token");
  flags.AddDuration("breaker-open", &options.breaker.open_for,
                    "how long a failed worker is skipped before a probe (doubles per failed "
                    "probe)");
  flags.AddDuration("busy-for", &options.breaker.busy_for,
                    "how long a worker that refused for capacity is passed over (at most; less "
                    "when it predicts room sooner); overload never opens its breaker");
  flags.AddInt32("max-inflight", &options.max_inflight,
                 "requests this gateway has in flight at once; more are refused at once with "
                 "RESOURCE_EXHAUSTED / HTTP 429 (0: no limit)");
}

void AddTenantFlags(FlagSet& flags, GatewayFlags& f) {
  GatewayOptions& options = f.options;
  flags.AddString("tenant-secret-file", &f.secret_file,
                  "file with the secret mixed into tenant salts (required; no default)");
  flags.AddString("tenant-token-keys", &f.token_keys_file,
                  "file with HS256 keys (one per line) that sign tenants' bearer tokens "
                  "(JWT: sub = tenant, exp); without it tenants come only from client "
                  "certificates");
  flags.AddInt32("max-inflight-per-tenant", &options.max_inflight_per_tenant,
                 "requests one tenant may have in flight (0: no limit)");
  flags.AddInt32("max-inflight-per-client", &options.max_inflight_per_client,
                 "requests one client may have in flight: its certificate's SPIFFE id, or over "
                 "HTTP its bearer token's subject (0: no limit; not applied with --insecure)");
  flags.AddInt64("max-reserved-tokens-per-tenant", &options.max_reserved_tokens_per_tenant,
                 "decode KV one tenant may hold reserved at once, in tokens (prompt + "
                 "max_tokens per reservation, held until the decode worker streams; 0: no "
                 "limit)");
  flags.AddInt64("max-reserved-tokens-per-client", &options.max_reserved_tokens_per_client,
                 "decode KV one client may hold reserved at once, in tokens (0: no limit)");
  flags.AddInt32("http-port", &f.http_port,
                 "OpenAI-compatible HTTP port (/v1/completions, /v1/chat/completions, "
                 "/v1/models); -1: off, 0: any free port");
  flags.AddString("http-host", &f.http_host, "address the HTTP port listens on (default: --host)");
}

// --cachestore, --prefill and --decode: split and checked. InvalidArgument with the usage line.
absl::Status CheckAddresses(GatewayFlags& f) {
  for (absl::string_view a : absl::StrSplit(f.prefill, ',', absl::SkipEmpty())) {
    f.prefill_addresses.emplace_back(a);
  }
  for (absl::string_view a : absl::StrSplit(f.decode, ',', absl::SkipEmpty())) {
    f.decode_addresses.emplace_back(a);
  }
  if (f.cachestore.empty() && (f.prefill_addresses.empty() || f.decode_addresses.empty())) {
    return absl::InvalidArgumentError(
        "give --cachestore (workers are discovered from its registry) or at least one --prefill "
        "and one --decode worker");
  }
  for (const auto& list : {f.prefill_addresses, f.decode_addresses}) {
    for (const std::string& a : list) {
      if (absl::Status s = kvrelay::server::CheckHostPort(a, "--prefill/--decode entry"); !s.ok()) {
        return s;
      }
    }
  }
  if (!f.cachestore.empty()) {
    for (absl::string_view address : absl::StrSplit(f.cachestore, ',')) {
      if (absl::Status s = kvrelay::server::CheckHostPort(std::string(address), "--cachestore");
          !s.ok()) {
        return s;
      }
    }
  }
  return absl::OkStatus();
}

// --model, --block-tokens, the tenant secret and the quota bounds. InvalidArgument with the
// usage line.
absl::Status CheckModelAndTenants(GatewayFlags& f) {
  GatewayOptions& options = f.options;
  if (options.model_dir.empty()) return absl::InvalidArgumentError("--model is required");
  if (options.model_name.empty()) {
    options.model_name = kvrelay::server::ModelNameFromDir(options.model_dir);
  }
  if (absl::Status s = kv::CheckBlockTokensFlag(options.block_tokens); !s.ok()) return s;
  KV_ASSIGN_OR_RETURN(options.kv_cache_dtype,
                      kv::ParseKvDTypeFlag("--kv-cache-dtype", f.kv_cache_dtype));
  // No default: a known secret makes every tenant's block hashes computable offline.
  if (f.secret_file.empty()) {
    return absl::InvalidArgumentError(
        "--tenant-secret-file is required (e.g. `head -c 32 /dev/urandom | base64`)");
  }
  absl::StatusOr<std::string> secret = ReadFileToString(f.secret_file);
  if (!secret.ok() || absl::StripAsciiWhitespace(*secret).size() < 16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tenant-secret-file: ",
        secret.ok() ? "want at least 16 bytes of secret" : std::string(secret.status().message())));
  }
  options.tenant_secret = std::string(absl::StripAsciiWhitespace(*secret));
  for (const auto& [flag, value, bound] : std::vector<std::tuple<const char*, int64_t, int64_t>>{
           {"--max-inflight-per-tenant", options.max_inflight_per_tenant, kMaxInFlightQuota},
           {"--max-inflight-per-client", options.max_inflight_per_client, kMaxInFlightQuota},
           {"--max-reserved-tokens-per-tenant", options.max_reserved_tokens_per_tenant,
            kMaxReservedTokensQuota},
           {"--max-reserved-tokens-per-client", options.max_reserved_tokens_per_client,
            kMaxReservedTokensQuota}}) {
    if (value < 0 || value > bound) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, " must be in [0, ", bound, "], got ", value));
    }
  }
  return absl::OkStatus();
}

// The fixed endpoints and the factories discovery uses. The endpoint's error (exit 1).
absl::StatusOr<Gateway::Workers> MakeWorkers(const GatewayFlags& f) {
  const kvrelay::server::SecurityOptions security = f.host.security;
  Gateway::Workers workers;
  for (const std::string& a : f.prefill_addresses) {
    KV_ASSIGN_OR_RETURN(std::unique_ptr<PrefillEndpoint> e, MakeGrpcPrefillEndpoint(a, security));
    workers.prefill.push_back(std::move(e));
  }
  for (const std::string& a : f.decode_addresses) {
    KV_ASSIGN_OR_RETURN(std::unique_ptr<DecodeEndpoint> e, MakeGrpcDecodeEndpoint(a, security));
    workers.decode.push_back(std::move(e));
  }
  workers.make_prefill = [security](const std::string& address) {
    return MakeGrpcPrefillEndpoint(address, security);
  };
  workers.make_decode = [security](const std::string& address) {
    return MakeGrpcDecodeEndpoint(address, security);
  };
  return workers;
}

// The store client (null without --cachestore), refusing a store whose --block-tokens differs
// (FailedPrecondition naming both; a store not up yet is discovery's to retry).
absl::StatusOr<std::unique_ptr<cachestore::CacheStoreClient>> ConnectStore(const GatewayFlags& f) {
  if (f.cachestore.empty()) return nullptr;
  // One address, or several (an HA store set): the client follows the leader among them.
  cachestore::CacheStoreClient::Options store_options{.timeout = f.options.route_timeout};
  store_options.security = f.host.security;
  store_options.block_tokens = f.options.block_tokens;
  KV_ASSIGN_OR_RETURN(std::unique_ptr<cachestore::CacheStoreClient> store,
                      cachestore::CacheStoreClient::Connect(f.cachestore, store_options));
  cachestore::CallOptions call;
  call.deadline = absl::Now() + f.options.route_timeout;
  if (absl::Status s = store->ListNodes(call).status(); absl::IsFailedPrecondition(s)) return s;
  return store;
}

// HTTP callers name their tenant with a verified bearer token; only the plain-text dev mode
// (--insecure) has a shared "anonymous" tenant for callers without one.
TenantResolver MakeHttpTenantResolver(bool insecure, const TenantTokenVerifier* verifier) {
  return [insecure, verifier](const std::string& authorization) -> absl::StatusOr<std::string> {
    if (insecure) {
      // Plain-text dev mode, as before: a token that verifies names its tenant, anything else
      // (no header, a placeholder API key) is the shared "anonymous" tenant.
      absl::StatusOr<std::string> tenant = ResolveTenant(
          kvrelay::server::Peer{}, /*enforcing=*/true, authorization, "", verifier, absl::Now());
      return tenant.ok() ? *tenant : std::string("anonymous");
    }
    if (authorization.empty()) {
      return kvrelay::server::Unauthorized(
          absl::UnauthenticatedError("an Authorization: Bearer token is required"));
    }
    return ResolveTenant(kvrelay::server::Peer{}, /*enforcing=*/true, authorization, "", verifier,
                         absl::Now());
  };
}

// The OpenAI-compatible HTTP server over `gateway` (null with --http-port -1); prints its
// listening line. The server's error (exit 1).
absl::StatusOr<std::unique_ptr<OpenAiHttpServer>> StartHttp(const GatewayFlags& f, Gateway* gateway,
                                                            const tokenizer::Tokenizer* tokenizer,
                                                            const TenantTokenVerifier* verifier) {
  if (f.http_port < 0) return nullptr;
  OpenAiHttpOptions http_options;
  http_options.host = f.http_host.empty() ? f.host.host : f.http_host;
  http_options.port = f.http_port;
  http_options.model_name = f.options.model_name;
  http_options.security = f.host.security;
  http_options.resolve_tenant = MakeHttpTenantResolver(f.host.security.insecure, verifier);
  KV_ASSIGN_OR_RETURN(std::unique_ptr<OpenAiHttpServer> http,
                      OpenAiHttpServer::Start(std::move(http_options), gateway, tokenizer));
  std::printf("gateway http listening on %s:%d\n",
              (f.http_host.empty() ? f.host.host : f.http_host).c_str(), http->port());
  std::fflush(stdout);
  return http;
}

// Flags parsed and checked: an exit code to return at once, or nullopt to go on.
std::optional<int> ParseGatewayFlags(const std::vector<std::string>& raw_args, GatewayFlags& f) {
  f.host.name = "gateway";
  f.host.port = 50051;
  f.host.health_services = {"kvrelay.v1.Gateway"};
  FlagSet flags("gateway", "Runs the gateway: Generate with KV-aware routing.");
  kvrelay::server::AddServerFlags(flags, f.host);
  AddRoutingFlags(flags, f);
  AddTenantFlags(flags, f);
  if (std::optional<int> exit_code =
          kvrelay::server::ParseServerCommandLine(flags, raw_args, "gateway", f.host)) {
    return exit_code;
  }
  for (absl::Status s : {CheckAddresses(f), CheckModelAndTenants(f)}) {
    if (!s.ok()) return kvrelay::server::UsageError("gateway", s.message());
  }
  return std::nullopt;
}

// Serves `gateway` over gRPC (and HTTP with --http-port) until SIGTERM; the exit code.
int Serve(const GatewayFlags& f, Gateway* gateway, const TenantTokenVerifier* verifier,
          MetricsRegistry* metrics) {
  // Text of the OpenAI HTTP API goes through the served model's tokenizer.
  absl::StatusOr<std::unique_ptr<tokenizer::Tokenizer>> text_tokenizer;
  if (f.http_port >= 0) {
    text_tokenizer = LoadServedTokenizer(f.options.model_dir);
    if (!text_tokenizer.ok()) {
      return kvrelay::server::UsageError(
          "gateway",
          absl::StrCat("--model ", f.options.model_dir, ": ", text_tokenizer.status().ToString()));
    }
  }
  const kvrelay::server::Authorizer authorizer(f.host.security);
  GatewayService service(gateway, authorizer, verifier);
  absl::StatusOr<std::unique_ptr<kvrelay::server::ServiceHost>> server =
      kvrelay::server::ServiceHost::Start(f.host, {&service}, metrics);
  if (!server.ok()) {
    std::fprintf(stderr, "kvrelay gateway: %s\n", server.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<std::unique_ptr<OpenAiHttpServer>> http =
      StartHttp(f, gateway, text_tokenizer.ok() ? text_tokenizer->get() : nullptr, verifier);
  if (!http.ok()) {
    std::fprintf(stderr, "kvrelay gateway: %s\n", http.status().ToString().c_str());
    return 1;
  }
  (*server)->WaitForShutdown({.on_drain = [&http] { http->reset(); }});
  return 0;
}

}  // namespace

int RunGatewayCommand(const std::vector<std::string>& raw_args) {
  kvrelay::server::ServiceHost::BlockShutdownSignals();
  GatewayFlags f;
  if (std::optional<int> exit_code = ParseGatewayFlags(raw_args, f)) return *exit_code;
  std::unique_ptr<TenantTokenVerifier> verifier;
  if (!f.token_keys_file.empty()) {
    absl::StatusOr<TenantTokenVerifier> loaded =
        TenantTokenVerifier::FromKeyFile(f.token_keys_file);
    if (!loaded.ok()) {
      return kvrelay::server::UsageError(
          "gateway", absl::StrCat("--tenant-token-keys: ", loaded.status().message()));
    }
    verifier = std::make_unique<TenantTokenVerifier>(*std::move(loaded));
  }
  absl::StatusOr<Gateway::Workers> workers = MakeWorkers(f);
  if (!workers.ok()) return kvrelay::server::UsageError("gateway", workers.status().ToString(), 1);
  absl::StatusOr<std::unique_ptr<cachestore::CacheStoreClient>> store = ConnectStore(f);
  if (!store.ok()) {
    return kvrelay::server::UsageError("gateway", store.status().ToString(),
                                       absl::IsFailedPrecondition(store.status()) ? 2 : 1);
  }
  MetricsRegistry metrics;
  absl::StatusOr<std::unique_ptr<Gateway>> gateway =
      Gateway::Create(f.options, *std::move(workers), *std::move(store), &metrics);
  if (!gateway.ok()) {
    std::fprintf(stderr, "kvrelay gateway: %s\n", gateway.status().ToString().c_str());
    return gateway.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  return Serve(f, gateway->get(), verifier.get(), &metrics);
}

int RunTokenCommand(const std::vector<std::string>& raw_args) {
  std::string tenant, keys_file;
  absl::Duration ttl = absl::Hours(1);
  FlagSet flags("token", "Prints a bearer token (JWT HS256) that names a tenant.");
  flags.AddString("tenant", &tenant, "the tenant the token names (1-128 of [A-Za-z0-9._:-])");
  flags.AddString("tenant-token-keys", &keys_file,
                  "the gateway's --tenant-token-keys file (its first key signs)");
  flags.AddDuration("ttl", &ttl, "how long the token is valid");
  if (std::optional<int> exit_code = kvrelay::server::ParseCommandLine(flags, raw_args, "token")) {
    return *exit_code;
  }
  if (tenant.empty()) return kvrelay::server::UsageError("token", "--tenant is required");
  if (ttl <= absl::ZeroDuration()) return kvrelay::server::UsageError("token", "--ttl must be > 0");
  absl::StatusOr<TenantTokenVerifier> keys = TenantTokenVerifier::FromKeyFile(keys_file);
  if (!keys.ok()) {
    return kvrelay::server::UsageError(
        "token", absl::StrCat("--tenant-token-keys: ", keys.status().message()));
  }
  const std::string token = keys->SignWithFirstKey(tenant, absl::Now() + ttl);
  // Refuse to print what the gateway would refuse (bad tenant names).
  if (absl::Status s = keys->Verify(token, absl::Now()).status(); !s.ok()) {
    return kvrelay::server::UsageError("token", std::string(s.message()));
  }
  std::printf("%s\n", token.c_str());
  return 0;
}

}  // namespace kvrelay::gateway::server

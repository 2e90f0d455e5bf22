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
#include "gateway/gateway.h"
#include "gateway/http/openai_server.h"
#include "gateway/server/gateway_service.h"
#include "gateway/tenant_auth.h"

namespace kvrelay::gateway::server {
namespace {
// Bounds of the quota flags: beyond them a "limit" limits nothing a gateway could serve.
constexpr int64_t kMaxInFlightQuota = 100000;
constexpr int64_t kMaxReservedTokensQuota = int64_t{1} << 32;
}  // namespace

int RunGatewayCommand(const std::vector<std::string>& raw_args) {
  kvrelay::server::ServiceHost::BlockShutdownSignals();
  GatewayOptions options;
  kvrelay::server::ServiceHostOptions host;
  host.name = "gateway";
  host.port = 50051;
  host.health_services = {"kvrelay.v1.Gateway"};
  std::string cachestore, prefill, decode, secret_file, token_keys_file;
  FlagSet flags("gateway", "Runs the gateway: Generate with KV-aware routing.");
  kvrelay::server::AddServerFlags(flags, host);
  flags.AddString("cachestore", &cachestore,
                  "cache store HOST:PORT (prefix-aware routing); several, comma-separated: an HA "
                  "store set");
  flags.AddString("prefill", &prefill,
                  "fixed prefill workers, HOST:PORT[,HOST:PORT...] (with --cachestore, workers "
                  "that register are discovered too)");
  flags.AddString("decode", &decode, "fixed decode workers, HOST:PORT[,HOST:PORT...]");
  flags.AddDuration("discovery-interval", &options.discovery_interval,
                    "how often the cache store's registry is read for workers that joined or "
                    "left (0: only the fixed lists)");
  flags.AddString("model", &options.model_dir, "model directory the workers serve");
  flags.AddString("model-name", &options.model_name,
                  "model name requests use (default: the directory's base name)");
  flags.AddString("tenant-secret-file", &secret_file,
                  "file with the secret mixed into tenant salts (required; no default)");
  flags.AddString("tenant-token-keys", &token_keys_file,
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
  flags.AddInt32("max-attempts", &options.max_attempts, "failed worker pairs tried per request");
  flags.AddBool("prefix-routing", &options.prefix_routing,
                "route to the prefill node holding the prompt's prefix when its queue is worth it "
                "(false: by load alone; workers pull or recompute what others hold)");
  flags.AddDuration("reserve-timeout", &options.reserve_timeout,
                    "per-attempt bound on a decode worker's Reserve");
  flags.AddDuration("prefill-timeout", &options.prefill_timeout,
                    "per-attempt bound on a prefill (compute + push)");
  flags.AddDuration("chunk-timeout", &options.chunk_timeout,
                    "per-attempt bound on the wait for the first and every next token");
  int32_t http_port = -1;
  std::string http_host;
  flags.AddInt32("http-port", &http_port,
                 "OpenAI-compatible HTTP port (/v1/completions, /v1/chat/completions, "
                 "/v1/models); -1: off, 0: any free port");
  flags.AddString("http-host", &http_host, "address the HTTP port listens on (default: --host)");
  flags.AddDuration("breaker-open", &options.breaker.open_for,
                    "how long a failed worker is skipped before a probe (doubles per failed "
                    "probe)");
  if (std::optional<int> exit_code =
          kvrelay::server::ParseServerCommandLine(flags, raw_args, "gateway", host)) {
    return *exit_code;
  }
  std::vector<std::string> prefill_addresses, decode_addresses;
  for (absl::string_view a : absl::StrSplit(prefill, ',', absl::SkipEmpty())) {
    prefill_addresses.emplace_back(a);
  }
  for (absl::string_view a : absl::StrSplit(decode, ',', absl::SkipEmpty())) {
    decode_addresses.emplace_back(a);
  }
  if (cachestore.empty() && (prefill_addresses.empty() || decode_addresses.empty())) {
    return kvrelay::server::UsageError(
        "gateway",
        "give --cachestore (workers are discovered from its registry) or at least one --prefill "
        "and one --decode worker");
  }
  for (const auto& list : {prefill_addresses, decode_addresses}) {
    for (const std::string& a : list) {
      if (absl::Status s = kvrelay::server::CheckHostPort(a, "--prefill/--decode entry"); !s.ok()) {
        return kvrelay::server::UsageError("gateway", std::string(s.message()));
      }
    }
  }
  if (!cachestore.empty()) {
    for (absl::string_view address : absl::StrSplit(cachestore, ',')) {
      if (absl::Status s = kvrelay::server::CheckHostPort(std::string(address), "--cachestore");
          !s.ok()) {
        return kvrelay::server::UsageError("gateway", std::string(s.message()));
      }
    }
  }
  if (options.model_dir.empty())
    return kvrelay::server::UsageError("gateway", "--model is required");
  if (options.model_name.empty())
    options.model_name = kvrelay::server::ModelNameFromDir(options.model_dir);
  // No default: a known secret makes every tenant's block hashes computable offline.
  if (secret_file.empty()) {
    return kvrelay::server::UsageError(
        "gateway", "--tenant-secret-file is required (e.g. `head -c 32 /dev/urandom | base64`)");
  }
  {
    absl::StatusOr<std::string> secret = ReadFileToString(secret_file);
    if (!secret.ok() || absl::StripAsciiWhitespace(*secret).size() < 16) {
      return kvrelay::server::UsageError(
          "gateway", absl::StrCat("--tenant-secret-file: ",
                                  secret.ok() ? "want at least 16 bytes of secret"
                                              : std::string(secret.status().message())));
    }
    options.tenant_secret = std::string(absl::StripAsciiWhitespace(*secret));
  }
  for (const auto& [flag, value, bound] : std::vector<std::tuple<const char*, int64_t, int64_t>>{
           {"--max-inflight-per-tenant", options.max_inflight_per_tenant, kMaxInFlightQuota},
           {"--max-inflight-per-client", options.max_inflight_per_client, kMaxInFlightQuota},
           {"--max-reserved-tokens-per-tenant", options.max_reserved_tokens_per_tenant,
            kMaxReservedTokensQuota},
           {"--max-reserved-tokens-per-client", options.max_reserved_tokens_per_client,
            kMaxReservedTokensQuota}}) {
    if (value < 0 || value > bound) {
      return kvrelay::server::UsageError(
          "gateway", absl::StrCat(flag, " must be in [0, ", bound, "], got ", value));
    }
  }
  std::unique_ptr<TenantTokenVerifier> verifier;
  if (!token_keys_file.empty()) {
    absl::StatusOr<TenantTokenVerifier> loaded = TenantTokenVerifier::FromKeyFile(token_keys_file);
    if (!loaded.ok()) {
      return kvrelay::server::UsageError(
          "gateway", absl::StrCat("--tenant-token-keys: ", loaded.status().message()));
    }
    verifier = std::make_unique<TenantTokenVerifier>(*std::move(loaded));
  }

  Gateway::Workers workers;
  for (const std::string& a : prefill_addresses) {
    absl::StatusOr<std::unique_ptr<PrefillEndpoint>> e = MakeGrpcPrefillEndpoint(a, host.security);
    if (!e.ok()) return kvrelay::server::UsageError("gateway", e.status().ToString(), 1);
    workers.prefill.push_back(*std::move(e));
  }
  for (const std::string& a : decode_addresses) {
    absl::StatusOr<std::unique_ptr<DecodeEndpoint>> e = MakeGrpcDecodeEndpoint(a, host.security);
    if (!e.ok()) return kvrelay::server::UsageError("gateway", e.status().ToString(), 1);
    workers.decode.push_back(*std::move(e));
  }
  const kvrelay::server::SecurityOptions security = host.security;
  workers.make_prefill = [security](const std::string& address) {
    return MakeGrpcPrefillEndpoint(address, security);
  };
  workers.make_decode = [security](const std::string& address) {
    return MakeGrpcDecodeEndpoint(address, security);
  };
  std::unique_ptr<cachestore::CacheStoreClient> store;
  if (!cachestore.empty()) {
    // One address, or several (an HA store set): the client follows the leader among them.
    cachestore::CacheStoreClient::Options store_options{.timeout = options.route_timeout};
    store_options.security = host.security;
    absl::StatusOr<std::unique_ptr<cachestore::CacheStoreClient>> connected =
        cachestore::CacheStoreClient::Connect(cachestore, store_options);
    if (!connected.ok()) {
      return kvrelay::server::UsageError("gateway", connected.status().ToString(), 1);
    }
    store = *std::move(connected);
  }
  MetricsRegistry metrics;
  absl::StatusOr<std::unique_ptr<Gateway>> gateway =
      Gateway::Create(options, std::move(workers), std::move(store), &metrics);
  if (!gateway.ok()) {
    std::fprintf(stderr, "kvrelay gateway: %s\n", gateway.status().ToString().c_str());
    return gateway.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  // Text of the OpenAI HTTP API goes through the served model's tokenizer.
  absl::StatusOr<std::unique_ptr<tokenizer::Tokenizer>> text_tokenizer;
  if (http_port >= 0) {
    text_tokenizer = LoadServedTokenizer(options.model_dir);
    if (!text_tokenizer.ok()) {
      return kvrelay::server::UsageError(
          "gateway",
          absl::StrCat("--model ", options.model_dir, ": ", text_tokenizer.status().ToString()));
    }
  }
  const kvrelay::server::Authorizer authorizer(host.security);
  GatewayService service(gateway->get(), authorizer, verifier.get());
  absl::StatusOr<std::unique_ptr<kvrelay::server::ServiceHost>> server =
      kvrelay::server::ServiceHost::Start(host, {&service}, &metrics);
  if (!server.ok()) {
    std::fprintf(stderr, "kvrelay gateway: %s\n", server.status().ToString().c_str());
    return 1;
  }
  std::unique_ptr<OpenAiHttpServer> http;
  if (http_port >= 0) {
    OpenAiHttpOptions http_options;
    http_options.host = http_host.empty() ? host.host : http_host;
    http_options.port = http_port;
    http_options.model_name = options.model_name;
    http_options.security = host.security;
    // HTTP callers name their tenant with a verified bearer token; only the plain-text dev
    // mode (--insecure) has a shared "anonymous" tenant for callers without one.
    const bool insecure = host.security.insecure;
    http_options.resolve_tenant =
        [insecure, verifier = verifier.get()](
            const std::string& authorization) -> absl::StatusOr<std::string> {
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
    absl::StatusOr<std::unique_ptr<OpenAiHttpServer>> started =
        OpenAiHttpServer::Start(std::move(http_options), gateway->get(), text_tokenizer->get());
    if (!started.ok()) {
      std::fprintf(stderr, "kvrelay gateway: %s\n", started.status().ToString().c_str());
      return 1;
    }
    http = *std::move(started);
    std::printf("gateway http listening on %s:%d\n",
                (http_host.empty() ? host.host : http_host).c_str(), http->port());
    std::fflush(stdout);
  }
  (*server)->WaitForShutdown({.on_drain = [&http] { http.reset(); }});
  return 0;
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

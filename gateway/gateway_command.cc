// `kvrelay gateway`: runs the gateway until SIGTERM.

#include <cstdio>
#include <iostream>

#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/config_file.h"
#include "common/file_util.h"
#include "common/flags.h"
#include "common/logging.h"
#include "gateway/gateway_service.h"
#include "worker/service_host.h"

namespace kvrelay::cli {

int RunGatewayCommand(const std::vector<std::string>& raw_args) {
  worker::ServiceHost::BlockShutdownSignals();
  gateway::GatewayOptions options;
  worker::ServiceHostOptions host;
  host.name = "gateway";
  int32_t port = 50051, metrics_port = 0;
  std::string prefill, decode, secret_file;
  FlagSet flags("gateway", "Runs the gateway: Generate with KV-aware routing.");
  flags.AddString("host", &host.host, "address to listen on");
  flags.AddInt32("port", &port, "gRPC port (0: any free port)");
  flags.AddInt32("metrics-port", &metrics_port, "Prometheus /metrics port (0: any free port)");
  flags.AddString("cachestore", &options.cachestore_address, "cache store HOST:PORT");
  flags.AddString("prefill", &prefill, "prefill workers, HOST:PORT[,HOST:PORT...]");
  flags.AddString("decode", &decode, "decode workers, HOST:PORT[,HOST:PORT...]");
  flags.AddString("model", &options.model_dir, "model directory the workers serve");
  flags.AddString("model-name", &options.model_name,
                  "model name requests use (default: the directory's base name)");
  flags.AddString("tenant-secret-file", &secret_file,
                  "file with the secret mixed into tenant salts (default: a fixed dev secret)");
  flags.AddInt32("max-attempts", &options.max_attempts, "worker pairs tried per request");
  absl::StatusOr<std::vector<std::string>> args = ExpandConfigFile(raw_args);
  absl::Status parsed = args.ok() ? flags.Parse(*args) : args.status();
  if (!parsed.ok()) {
    std::fprintf(stderr, "kvrelay gateway: %s\n", std::string(parsed.message()).c_str());
    return 2;
  }
  if (flags.help_requested()) {
    std::cout << flags.Usage();
    return 0;
  }
  for (absl::string_view a : absl::StrSplit(prefill, ',', absl::SkipEmpty())) {
    options.prefill_addresses.emplace_back(a);
  }
  for (absl::string_view a : absl::StrSplit(decode, ',', absl::SkipEmpty())) {
    options.decode_addresses.emplace_back(a);
  }
  for (const auto& list : {options.prefill_addresses, options.decode_addresses}) {
    for (const std::string& a : list) {
      if (absl::Status s = worker::CheckHostPort(a, "--prefill/--decode entry"); !s.ok()) {
        std::fprintf(stderr, "kvrelay gateway: %s\n", std::string(s.message()).c_str());
        return 2;
      }
    }
  }
  if (options.model_dir.empty()) {
    std::fprintf(stderr, "kvrelay gateway: --model is required\n");
    return 2;
  }
  if (options.model_name.empty()) options.model_name = worker::ModelNameFromDir(options.model_dir);
  if (secret_file.empty()) {
    options.tenant_secret = "kvrelay-development-secret";
    KV_LOG(WARNING) << "no --tenant-secret-file: using the development secret";
  } else {
    absl::StatusOr<std::string> secret = ReadFileToString(secret_file);
    if (!secret.ok() || absl::StripAsciiWhitespace(*secret).empty()) {
      std::fprintf(stderr, "kvrelay gateway: --tenant-secret-file: %s\n",
                   secret.ok() ? "empty" : std::string(secret.status().message()).c_str());
      return 2;
    }
    options.tenant_secret = std::string(absl::StripAsciiWhitespace(*secret));
  }
  host.port = port;
  host.metrics_port = metrics_port;
  MetricsRegistry metrics;
  absl::StatusOr<std::unique_ptr<gateway::GatewayService>> service =
      gateway::GatewayService::Create(options, &metrics);
  if (!service.ok()) {
    std::fprintf(stderr, "kvrelay gateway: %s\n", service.status().ToString().c_str());
    return service.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  return worker::ServeUntilSignal(host, service->get(), &metrics);
}

}  // namespace kvrelay::cli

// `kvrelay prefill`: runs a prefill worker until SIGTERM.

#include <cstdio>
#include <iostream>

#include "common/config_file.h"
#include "common/flags.h"
#include "prefill/prefill_worker.h"
#include "worker/service_host.h"

namespace kvrelay::cli {

int RunPrefillCommand(const std::vector<std::string>& raw_args) {
  worker::ServiceHost::BlockShutdownSignals();
  prefill::PrefillWorkerOptions options;
  worker::ServiceHostOptions host;
  host.name = "prefill";
  int32_t port = 0, metrics_port = 0;
  FlagSet flags("prefill", "Runs a prefill worker: computes or reuses KV, pushes it to decode.");
  flags.AddString("host", &host.host, "address to listen on");
  flags.AddInt32("port", &port, "gRPC port (0: any free port)");
  flags.AddInt32("metrics-port", &metrics_port, "Prometheus /metrics port (0: any free port)");
  flags.AddString("cachestore", &options.core.cachestore_address, "cache store HOST:PORT (required)");
  flags.AddString("model", &options.core.model_dir, "model directory (config.json + safetensors)");
  flags.AddString("model-name", &options.model_name,
                  "model name requests must use (default: the directory's base name)");
  flags.AddString("node-id", &options.core.node_id, "node id in the cache store");
  flags.AddString("transport-host", &options.core.transport_host, "data-plane listen address");
  flags.AddInt32("threads", &options.core.threads, "compute threads");
  flags.AddInt64("pool-blocks", &options.core.pool_blocks, "KV slots per layer group for requests");
  flags.AddInt64("cache-blocks", &options.core.cache_slots, "whole-block slots offered to the store");
  absl::StatusOr<std::vector<std::string>> args = ExpandConfigFile(raw_args);
  absl::Status parsed = args.ok() ? flags.Parse(*args) : args.status();
  if (!parsed.ok()) {
    std::fprintf(stderr, "kvrelay prefill: %s\n", std::string(parsed.message()).c_str());
    return 2;
  }
  if (flags.help_requested()) {
    std::cout << flags.Usage();
    return 0;
  }
  if (options.core.model_dir.empty() || options.core.cachestore_address.empty()) {
    std::fprintf(stderr, "kvrelay prefill: --model and --cachestore are required\n");
    return 2;
  }
  if (options.model_name.empty()) options.model_name = worker::ModelNameFromDir(options.core.model_dir);
  if (options.core.threads < 1 || options.core.pool_blocks < 1 || options.core.cache_slots < 1) {
    std::fprintf(stderr,
                 "kvrelay prefill: --threads, --pool-blocks and --cache-blocks must be positive\n");
    return 2;
  }
  host.port = port;
  host.metrics_port = metrics_port;
  MetricsRegistry metrics;
  absl::StatusOr<std::unique_ptr<prefill::PrefillWorker>> worker =
      prefill::PrefillWorker::Create(options, &metrics);
  if (!worker.ok()) {
    std::fprintf(stderr, "kvrelay prefill: %s\n", worker.status().ToString().c_str());
    return 1;
  }
  std::fprintf(stderr, "prefill: model %s, data plane %s\n", options.model_name.c_str(),
               (*worker)->transport_address().c_str());
  return worker::ServeUntilSignal(host, worker->get(), &metrics);
}

}  // namespace kvrelay::cli

// `kvrelay decode`: runs a decode worker until SIGTERM.

#include <cstdio>
#include <iostream>

#include "common/config_file.h"
#include "common/flags.h"
#include "decode/decode_worker.h"
#include "worker/service_host.h"

namespace kvrelay::cli {

int RunDecodeCommand(const std::vector<std::string>& raw_args) {
  worker::ServiceHost::BlockShutdownSignals();
  decode::DecodeWorkerOptions options;
  worker::ServiceHostOptions host;
  host.name = "decode";
  int32_t port = 0, metrics_port = 0;
  FlagSet flags("decode", "Runs a decode worker: receives KV blocks, decodes, streams tokens.");
  flags.AddString("host", &host.host, "address to listen on");
  flags.AddInt32("port", &port, "gRPC port (0: any free port)");
  flags.AddInt32("metrics-port", &metrics_port, "Prometheus /metrics port (0: any free port)");
  flags.AddString("cachestore", &options.core.cachestore_address,
                  "cache store HOST:PORT (empty: no multi-turn block commits)");
  flags.AddString("model", &options.core.model_dir, "model directory (config.json + safetensors)");
  flags.AddString("model-name", &options.model_name,
                  "model name requests must use (default: the directory's base name)");
  flags.AddString("node-id", &options.core.node_id, "node id in the cache store");
  flags.AddString("transport-host", &options.core.transport_host, "data-plane listen address");
  flags.AddInt32("threads", &options.core.threads, "compute threads");
  flags.AddInt64("pool-blocks", &options.core.pool_blocks, "KV slots per layer group");
  flags.AddInt64("cache-slots", &options.core.cache_slots, "whole-block slots offered to the store");
  flags.AddInt32("max-batch", &options.max_batch, "sequences per decode step");
  absl::StatusOr<std::vector<std::string>> args = ExpandConfigFile(raw_args);
  absl::Status parsed = args.ok() ? flags.Parse(*args) : args.status();
  if (!parsed.ok()) {
    std::fprintf(stderr, "kvrelay decode: %s\n", std::string(parsed.message()).c_str());
    return 2;
  }
  if (flags.help_requested()) {
    std::cout << flags.Usage();
    return 0;
  }
  if (options.core.model_dir.empty()) {
    std::fprintf(stderr, "kvrelay decode: --model is required\n");
    return 2;
  }
  if (options.model_name.empty()) options.model_name = worker::ModelNameFromDir(options.core.model_dir);
  if (options.core.threads < 1 || options.core.pool_blocks < 1 || options.max_batch < 1 ||
      options.core.cache_slots < 1) {
    std::fprintf(stderr,
                 "kvrelay decode: --threads, --pool-blocks, --cache-slots and --max-batch must "
                 "be positive\n");
    return 2;
  }
  host.port = port;
  host.metrics_port = metrics_port;
  MetricsRegistry metrics;
  absl::StatusOr<std::unique_ptr<decode::DecodeWorker>> worker =
      decode::DecodeWorker::Create(options, &metrics);
  if (!worker.ok()) {
    std::fprintf(stderr, "kvrelay decode: %s\n", worker.status().ToString().c_str());
    return 1;
  }
  std::fprintf(stderr, "decode: model %s, data plane %s\n", options.model_name.c_str(),
               (*worker)->transport_address().c_str());
  return worker::ServeUntilSignal(host, worker->get(), &metrics, [&] { (*worker)->Drain(); });
}

}  // namespace kvrelay::cli

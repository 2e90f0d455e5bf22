#include "worker/worker_core.h"

#include <cstdio>
#include <iostream>

#include "common/config_file.h"
#include "common/status_macros.h"
#include "transfer/ucx/ucx_transport.h"

namespace kvrelay::worker {

absl::StatusOr<std::unique_ptr<WorkerCore>> WorkerCore::Create(const WorkerCoreOptions& options,
                                                               transfer::InboundHandler inbound) {
  auto core = std::make_unique<WorkerCore>();
  model::RunnerOptions runner_options;
  runner_options.threads = options.threads;
  KV_ASSIGN_OR_RETURN(core->runner, model::ModelRunner::Load(options.model_dir, runner_options));
  transfer::UcxTransportOptions ucx;
  ucx.listen_host = options.transport_host;
  KV_ASSIGN_OR_RETURN(core->transport, transfer::MakeUcxTransport(ucx));
  core->transport_address = core->transport->address();
  if (inbound) core->transport->SetInboundHandler(std::move(inbound));
  KV_ASSIGN_OR_RETURN(core->kv, RegisteredKvCache::Create(core->runner->layout(),
                                                          options.pool_blocks,
                                                          core->transport.get()));
  if (!options.cachestore_address.empty()) {
    KV_ASSIGN_OR_RETURN(core->segment,
                        CacheSegment::Create(core->runner->layout(), options.cache_slots,
                                             core->transport.get()));
    StoreLinkOptions link;
    link.cachestore_address = options.cachestore_address;
    link.node_id = options.node_id;
    link.transport_address = core->transport_address;
    KV_ASSIGN_OR_RETURN(core->store, StoreLink::Connect(link, core->segment.get(),
                                                        absl::Now() + absl::Seconds(30)));
  }
  return core;
}

void WorkerFlags::AddFlags(FlagSet& flags) {
  flags.AddString("host", &host_.host, "address to listen on");
  flags.AddInt32("port", &host_.port, "gRPC port (0: any free port)");
  flags.AddInt32("metrics-port", &host_.metrics_port, "Prometheus /metrics port (0: any free port)");
  flags.AddString("cachestore", &core_.cachestore_address, "cache store HOST:PORT");
  flags.AddString("model", &core_.model_dir, "model directory (config.json + safetensors)");
  flags.AddString("model-name", &model_name_,
                  "model name requests must use (default: the directory's base name)");
  flags.AddString("node-id", &core_.node_id, "node id in the cache store");
  flags.AddString("transport-host", &core_.transport_host, "data-plane listen address");
  flags.AddInt32("threads", &core_.threads, "compute threads");
  flags.AddInt64("pool-blocks", &core_.pool_blocks, "request KV slots per layer group");
  flags.AddInt64("cache-slots", &core_.cache_slots, "whole-block slots offered to the store");
}

std::optional<int> WorkerFlags::Parse(FlagSet& flags, const std::vector<std::string>& raw_args,
                                      bool cachestore_required) {
  const char* name = host_.name.c_str();
  absl::StatusOr<std::vector<std::string>> args = ExpandConfigFile(raw_args);
  absl::Status parsed = args.ok() ? flags.Parse(*args) : args.status();
  if (!parsed.ok()) {
    std::fprintf(stderr, "kvrelay %s: %s\n", name, std::string(parsed.message()).c_str());
    return 2;
  }
  if (flags.help_requested()) {
    std::cout << flags.Usage();
    return 0;
  }
  if (core_.model_dir.empty()) {
    std::fprintf(stderr, "kvrelay %s: --model is required\n", name);
    return 2;
  }
  if (cachestore_required && core_.cachestore_address.empty()) {
    std::fprintf(stderr, "kvrelay %s: --cachestore is required\n", name);
    return 2;
  }
  if (core_.threads < 1 || core_.pool_blocks < 1 || core_.cache_slots < 1) {
    std::fprintf(stderr, "kvrelay %s: --threads, --pool-blocks and --cache-slots must be positive\n",
                 name);
    return 2;
  }
  if (model_name_.empty()) model_name_ = ModelNameFromDir(core_.model_dir);
  return std::nullopt;
}

}  // namespace kvrelay::worker

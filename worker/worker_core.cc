#include "worker/worker_core.h"

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

}  // namespace kvrelay::worker

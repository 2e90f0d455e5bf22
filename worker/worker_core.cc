#include "worker/worker_core.h"

#include <unistd.h>

#include <cstdio>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kv/secret.h"
#include "proto/grpc_status.h"
#include "proto/limits.h"

namespace kvrelay::worker {
namespace {

uint64_t RandomU64() {
  std::random_device device;
  return (static_cast<uint64_t>(device()) << 32) ^ device();
}

}  // namespace

std::string DefaultNodeId(const std::string& role) {
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0 || host[0] == '\0') {
    std::snprintf(host, sizeof(host), "host");
  }
  return absl::StrFormat("%s-%s-%08x", role, host, static_cast<uint32_t>(RandomU64()));
}

namespace {

// The model of `options`, on the device it names: the parsed config handed down, or
// config.json read once here.
absl::Status LoadModel(const WorkerCoreOptions& options, WorkerCore& core) {
  model::RunnerOptions runner_options;
  runner_options.threads = options.threads;
  runner_options.block_tokens = options.block_tokens;
  kv::ModelConfig config;
  if (options.model_config.has_value()) {
    config = *options.model_config;
  } else {
    KV_ASSIGN_OR_RETURN(config, kv::LoadHfConfig(options.model_dir + "/config.json",
                                                 {.kv_dtype = options.kv_cache_dtype,
                                                  .block_tokens = options.block_tokens}));
  }
  KV_ASSIGN_OR_RETURN(
      model::ServingModel loaded,
      model::LoadServingModel(options.model_dir, config, runner_options, options.device));
  core.runner = std::move(loaded.attention);
  core.mamba = std::move(loaded.mamba);
  core.device = std::move(loaded.device);
  core.device_reason = std::move(loaded.reason);
  return absl::OkStatus();
}

// options.memory_key_scope resolved against the transport's capabilities.
absl::StatusOr<MemoryKeyScope> ResolveMemoryKeyScope(MemoryKeyScope scope,
                                                     const transfer::Capabilities& caps) {
  if (scope == MemoryKeyScope::kAuto) {
    scope = caps.hardware_enforced_keys ? MemoryKeyScope::kReservation : MemoryKeyScope::kPool;
  }
  if (scope == MemoryKeyScope::kReservation && !caps.private_regions) {
    return absl::FailedPreconditionError(
        absl::StrCat("--memory-key-scope reservation needs a transport with private regions "
                     "(ucx); this one is '",
                     caps.name, "'"));
  }
  return scope;
}

}  // namespace

absl::StatusOr<std::unique_ptr<WorkerCore>> WorkerCore::Create(const WorkerCoreOptions& options,
                                                               transfer::InboundHandler inbound,
                                                               WorkerCoreDeps deps) {
  if (deps.transport == nullptr) {
    return absl::InvalidArgumentError(
        "worker core: no transport (the commands make a UCX one in worker/server)");
  }
  auto core = std::make_unique<WorkerCore>();
  core->clock = deps.clock != nullptr ? deps.clock : Clock::Real();
  core->metrics = deps.metrics;
  core->metric_labels = deps.metric_labels;
  core->node_id = options.node_id.empty() ? DefaultNodeId(options.role) : options.node_id;
  core->incarnation = RandomU64() | 1;  // never 0: 0 means "unknown" on the wire
  KV_RETURN_IF_ERROR(LoadModel(options, *core));
  const kv::ModelLayout& layout = core->model_config().layout;
  core->transport = std::move(deps.transport);
  core->transport_kind = deps.transport_kind;
  core->transport_address = core->transport->address();
  WorkerCoreOptions effective = options;
  effective.model_config.reset();  // the runner holds it; no second copy
  // Every worker's data plane takes only peers that present its key: decode hands it out with
  // reservations, both roles with their cache segment's access (to readers the store sends).
  if (effective.transport_accept_key.empty()) {
    KV_ASSIGN_OR_RETURN(effective.transport_accept_key, kv::RandomSecret(32));
  }
  core->transport->SetAcceptKey(effective.transport_accept_key);
  if (inbound) core->transport->SetInboundHandler(std::move(inbound));
  KV_ASSIGN_OR_RETURN(
      core->memory_key_scope,
      ResolveMemoryKeyScope(options.memory_key_scope, core->transport->capabilities()));
  KV_ASSIGN_OR_RETURN(
      core->kv, RegisteredKvCache::Create(layout, options.pool_blocks, core->transport.get(),
                                          core->memory_key_scope == MemoryKeyScope::kReservation));
  if (core->runner != nullptr) KV_RETURN_IF_ERROR(core->runner->PrepareCache(core->kv->cache()));
  if (!options.cachestore_address.empty()) {
    KV_ASSIGN_OR_RETURN(core->segment,
                        CacheSegment::Create(layout, options.cache_slots, core->transport.get()));
    if (!options.ssd_dir.empty()) {
      DiskCacheOptions disk;
      disk.directory = options.ssd_dir;
      disk.capacity_bytes = static_cast<uint64_t>(options.ssd_bytes);
      disk.block_bytes = core->segment->block_bytes();
      disk.layout = layout.fingerprint();
      core->disk_stages = PlanDiskStages(*core->segment, core->kv->cache(), kDiskStages);
      disk.stages = core->disk_stages.stages;
      disk.node_id = core->node_id;
      disk.metrics = core->metrics;
      disk.metric_labels = core->metric_labels;
      KV_ASSIGN_OR_RETURN(core->disk, DiskCache::Open(std::move(disk)));
    }
  }
  core->options = std::move(effective);
  return core;
}

std::string WorkerCore::DeviceLine() const {
  return absl::StrCat("device ", device.Label(), " (", device_reason, ")");
}

absl::StatusOr<MemoryKeyScope> ParseMemoryKeyScope(absl::string_view name) {
  if (name == "auto") return MemoryKeyScope::kAuto;
  if (name == "reservation") return MemoryKeyScope::kReservation;
  if (name == "pool") return MemoryKeyScope::kPool;
  return absl::InvalidArgumentError(
      absl::StrCat("memory key scope must be auto, reservation or pool, got '", name, "'"));
}

const char* MemoryKeyScopeName(MemoryKeyScope scope) {
  switch (scope) {
    case MemoryKeyScope::kAuto:
      return "auto";
    case MemoryKeyScope::kReservation:
      return "reservation";
    case MemoryKeyScope::kPool:
      return "pool";
  }
  return "?";
}

bool WorkerCore::DrainAndLeave(const std::function<bool()>& idle, absl::Time deadline) {
  // Polled, not signalled: idleness spans the reservation table, the batch scheduler and the
  // prefill queue, and a drain happens once per process.
  bool went_idle = idle();
  while (!went_idle && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
    went_idle = idle();
  }
  if (!went_idle) {
    KV_LOG(WARNING) << node_id << ": drain timed out with requests still in flight";
  }
  if (store != nullptr) store->Leave();
  return went_idle;
}

absl::Status WorkerCore::ConnectStore(const std::string& grpc_address,
                                      std::function<kvrelay::v1::NodeLoad()> load) {
  if (options.cachestore_address.empty()) return absl::OkStatus();
  StoreLinkOptions link;
  link.cachestore_address = options.cachestore_address;
  link.node_id = node_id;
  link.incarnation = incarnation;
  link.role =
      options.role == "prefill" ? kvrelay::v1::NODE_ROLE_PREFILL : kvrelay::v1::NODE_ROLE_DECODE;
  link.grpc_address = grpc_address;
  link.transport_address = transport_address;
  link.transport_kind = transport_kind;
  link.security = options.security;
  link.request_timeout = options.store_request_timeout;
  link.store_backoff = options.store_backoff;
  link.store_backoff_max = options.store_backoff_max;
  link.metrics = metrics;
  link.disk = disk.get();
  link.metric_labels = metric_labels;
  link.block_tokens = model_config().layout.block_tokens();
  link.load = std::move(load);
  if (segment != nullptr) {
    link.segment_access_key =
        segment->AccessKey(options.transport_accept_key, transport->incarnation());
  }
  KV_ASSIGN_OR_RETURN(
      store, StoreLink::Connect(link, segment.get(), clock, absl::Now() + absl::Seconds(30)));
  return absl::OkStatus();
}

absl::StatusOr<kvrelay::v1::PromoteResponse> WorkerCore::Promote(
    const kvrelay::v1::PromoteRequest& request, kvrelay::v1::Role role, absl::Time deadline) {
  auto refuse = [&](absl::Status status, kvrelay::v1::FailureReason reason) {
    kvrelay::v1::ErrorInfo info;
    info.set_role(role);
    info.set_node_id(node_id);
    info.set_incarnation(incarnation);
    info.set_reason(reason);
    return proto::WithErrorInfo(std::move(status), info);
  };
  if (request.request_id().empty() || request.request_id().size() > 64) {
    return refuse(absl::InvalidArgumentError(absl::StrCat("request_id: want 1-64 bytes, got ",
                                                          request.request_id().size())),
                  kvrelay::v1::FAILURE_INVALID_REQUEST);
  }
  const std::string& packed = request.chain_packed();
  const int64_t blocks = static_cast<int64_t>(packed.size() / 16);
  if (packed.size() % 16 != 0 || blocks > limits::kMaxChainBlocks) {
    return refuse(absl::InvalidArgumentError(absl::StrCat(
                      "chain_packed: want a multiple of 16 bytes, at most ",
                      limits::kMaxChainBlocks, " hashes; got ", packed.size(), " bytes")),
                  kvrelay::v1::FAILURE_INVALID_REQUEST);
  }
  if (request.first() < 0 || request.first() >= blocks) {
    return refuse(absl::InvalidArgumentError(
                      absl::StrCat("first: want [0, ", blocks, "), got ", request.first())),
                  kvrelay::v1::FAILURE_INVALID_REQUEST);
  }
  const kv::ModelLayout& layout = model_config().layout;
  if (request.layout_fingerprint() != layout.fingerprint().ToBytes()) {
    return refuse(absl::FailedPreconditionError(absl::StrCat(
                      "promote: the chain was hashed for another layout than this node's (",
                      layout.Describe(), ")")),
                  kvrelay::v1::FAILURE_IDENTITY);
  }
  kvrelay::v1::PromoteResponse response;
  if (disk == nullptr || segment == nullptr || store == nullptr) return response;
  std::vector<kv::BlockHash> chain;
  chain.reserve(static_cast<size_t>(blocks));
  for (int64_t i = 0; i < blocks; ++i) {
    chain.push_back(kv::BlockHash::FromBytes(
        absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(packed.data()) + i * 16, 16)));
  }
  // Reads of at most ~64 MiB: each read's buffers live only until its blocks are committed.
  const int64_t per_read =
      std::max<int64_t>(1, (int64_t{64} << 20) / static_cast<int64_t>(segment->block_bytes()));
  int64_t i = request.first();
  while (i < blocks && clock->Now() < deadline) {
    const int64_t run = std::min(disk->HeldRun(chain, i), per_read);
    if (run == 0) {  // not on disk (in DRAM, or nowhere here): the next one may be
      ++i;
      continue;
    }
    absl::StatusOr<std::vector<std::vector<uint8_t>>> read = disk->Read(
        absl::MakeConstSpan(chain).subspan(static_cast<size_t>(i), static_cast<size_t>(run)),
        deadline);
    if (!read.ok() || read->empty()) {
      if (!read.ok()) {
        KV_LOG(WARNING) << request.request_id() << ": promote: disk read: " << read.status();
        break;
      }
      ++i;  // the block failed verification (unlisted now): the rest may still verify
      continue;
    }
    const std::vector<std::vector<uint8_t>>& units = *read;
    const int64_t from = i;
    absl::StatusOr<int32_t> committed = store->CommitBlocksFrom(
        chain, from, from + static_cast<int64_t>(units.size()),
        [&](int64_t block, int64_t slot) {
          return segment->StoreBlockBytes(units[static_cast<size_t>(block - from)], slot);
        },
        deadline);
    if (!committed.ok()) {
      KV_LOG(WARNING) << request.request_id() << ": promote: commit: " << committed.status();
      break;
    }
    response.set_promoted(response.promoted() + *committed);
    i += static_cast<int64_t>(units.size());
  }
  return response;
}

}  // namespace kvrelay::worker

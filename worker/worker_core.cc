#include "worker/worker_core.h"

#include <unistd.h>

#include <cstdio>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/server/auth.h"
#include "common/server/server_flags.h"
#include "common/status_macros.h"
#include "kv/secret.h"
#include "transfer/ucx/ucx_transport.h"

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

absl::StatusOr<std::unique_ptr<WorkerCore>> WorkerCore::Create(const WorkerCoreOptions& options,
                                                               transfer::InboundHandler inbound,
                                                               WorkerCoreDeps deps) {
  auto core = std::make_unique<WorkerCore>();
  core->clock = deps.clock != nullptr ? deps.clock : Clock::Real();
  core->node_id = options.node_id.empty() ? DefaultNodeId(options.role) : options.node_id;
  core->incarnation = RandomU64() | 1;  // never 0: 0 means "unknown" on the wire
  model::RunnerOptions runner_options;
  runner_options.threads = options.threads;
  KV_ASSIGN_OR_RETURN(kv::ModelConfig config, kv::LoadHfConfig(options.model_dir + "/config.json"));
  KV_ASSIGN_OR_RETURN(
      model::ServingModel loaded,
      model::LoadServingModel(options.model_dir, config, runner_options, options.device));
  core->runner = std::move(loaded.attention);
  core->mamba = std::move(loaded.mamba);
  core->device = std::move(loaded.device);
  core->device_reason = std::move(loaded.reason);
  const kv::ModelLayout& layout = core->model_config().layout;
  if (deps.transport != nullptr) {
    core->transport = std::move(deps.transport);
    core->transport_kind = deps.transport_kind;
  } else {
    core->transport_kind = "ucx";
    transfer::UcxTransportOptions ucx;
    ucx.listen_host = options.transport_host;
    ucx.listen_port = options.transport_port;
    ucx.advertise_host = options.advertise_host;
    KV_ASSIGN_OR_RETURN(core->transport, transfer::MakeUcxTransport(ucx));
  }
  core->transport_address = core->transport->address();
  WorkerCoreOptions effective = options;
  // Every worker's data plane takes only peers that present its key: decode hands it out with
  // reservations, both roles with their cache segment's access (to readers the store sends).
  if (effective.transport_accept_key.empty()) {
    KV_ASSIGN_OR_RETURN(effective.transport_accept_key, kv::RandomSecret(32));
  }
  core->transport->SetAcceptKey(effective.transport_accept_key);
  if (inbound) core->transport->SetInboundHandler(std::move(inbound));
  const transfer::Capabilities caps = core->transport->capabilities();
  core->memory_key_scope = options.memory_key_scope;
  if (core->memory_key_scope == MemoryKeyScope::kAuto) {
    core->memory_key_scope =
        caps.hardware_enforced_keys ? MemoryKeyScope::kReservation : MemoryKeyScope::kPool;
  }
  if (core->memory_key_scope == MemoryKeyScope::kReservation && !caps.private_regions) {
    return absl::FailedPreconditionError(
        absl::StrCat("--memory-key-scope reservation needs a transport with private regions "
                     "(ucx); this one is '",
                     caps.name, "'"));
  }
  KV_ASSIGN_OR_RETURN(
      core->kv, RegisteredKvCache::Create(layout, options.pool_blocks, core->transport.get(),
                                          core->memory_key_scope == MemoryKeyScope::kReservation));
  if (core->runner != nullptr) KV_RETURN_IF_ERROR(core->runner->PrepareCache(core->kv->cache()));
  if (!options.cachestore_address.empty()) {
    KV_ASSIGN_OR_RETURN(core->segment,
                        CacheSegment::Create(layout, options.cache_slots, core->transport.get()));
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
  link.load = std::move(load);
  if (segment != nullptr) {
    link.segment_access_key =
        segment->AccessKey(options.transport_accept_key, transport->incarnation());
  }
  KV_ASSIGN_OR_RETURN(
      store, StoreLink::Connect(link, segment.get(), clock, absl::Now() + absl::Seconds(30)));
  return absl::OkStatus();
}

void WorkerFlags::AddFlags(FlagSet& flags) {
  server::AddServerFlags(flags, host_);
  flags.AddString("cachestore", &core_.cachestore_address,
                  "cache store HOST:PORT (several, comma-separated: an HA store set)");
  flags.AddString("model", &core_.model_dir, "model directory (config.json + safetensors)");
  flags.AddString("model-name", &model_name_,
                  "model name requests must use (default: the directory's base name)");
  flags.AddString("node-id", &core_.node_id,
                  "node id in the cache store (default: <role>-<hostname>-<random>, unique per "
                  "process)");
  flags.AddString("transport-host", &core_.transport_host, "data-plane listen address");
  flags.AddInt32("transport-port", &core_.transport_port,
                 "fixed data-plane port (0: any free port)");
  flags.AddString("advertise-address", &core_.advertise_host,
                  "host (name or address) other nodes use to reach this one, for gRPC and the "
                  "data plane (default: the bind address; a wildcard such as 0.0.0.0 is never "
                  "advertised)");
  flags.AddInt32("threads", &core_.threads, "compute threads");
  flags.AddString("device", &device_,
                  "where the model computes: auto (CUDA device 0 when one is usable and runs the "
                  "model, else the CPU), cpu, cuda or cuda:N (that device or an error); KV "
                  "never crosses between backends whose bits differ");
  flags.AddInt64("pool-blocks", &core_.pool_blocks, "request KV slots per layer group");
  flags.AddInt64("cache-slots", &core_.cache_slots, "whole-block slots offered to the store");
  flags.AddDuration("store-request-timeout", &core_.store_request_timeout,
                    "deadline of a store call on a request's path (prefix match, commit): a store "
                    "slower than this costs reuse, not latency");
  flags.AddDuration("store-backoff", &core_.store_backoff,
                    "how long request-path store calls are skipped after one failed");
}

std::optional<int> WorkerFlags::Parse(FlagSet& flags, const std::vector<std::string>& raw_args,
                                      bool cachestore_required) {
  const std::string& name = host_.name;
  core_.role = name;
  if (std::optional<int> exit_code = server::ParseServerCommandLine(flags, raw_args, name, host_)) {
    return exit_code;
  }
  core_.security = host_.security;
  if (!host_.security.insecure) {
    // The certificate names this node: its role must be ours, and it is the node id (the cache
    // store accepts node-scoped calls only from the node's own certificate).
    absl::StatusOr<server::Peer> own = server::IdentityOfCertificateFile(host_.security.cert_file);
    if (!own.ok())
      return server::UsageError(name, absl::StrCat("--tls-cert: ", own.status().message()));
    if (server::RoleName(own->role) != name) {
      return server::UsageError(name, absl::StrCat("--tls-cert is a ", server::RoleName(own->role),
                                                   " certificate, not a ", name, " one"));
    }
    if (core_.node_id.empty()) core_.node_id = own->id;
    if (core_.node_id != own->id) {
      return server::UsageError(
          name, absl::StrCat("--node-id '", core_.node_id,
                             "' differs from the certificate's node id '", own->id, "'"));
    }
  }
  if (core_.model_dir.empty()) return server::UsageError(name, "--model is required");
  if (cachestore_required && core_.cachestore_address.empty()) {
    return server::UsageError(name, "--cachestore is required");
  }
  if (!core_.cachestore_address.empty()) {
    for (absl::string_view address : absl::StrSplit(core_.cachestore_address, ',')) {
      if (absl::Status s = server::CheckHostPort(std::string(address), "--cachestore"); !s.ok()) {
        return server::UsageError(name, std::string(s.message()));
      }
    }
  }
  if (core_.transport_port < 0 || core_.transport_port > 65535) {
    return server::UsageError(name, "--transport-port must be in [0, 65535]");
  }
  absl::StatusOr<model::DeviceChoice> device = model::ParseDeviceFlag(device_);
  if (!device.ok()) return server::UsageError(name, std::string(device.status().message()));
  core_.device = *device;
  // An explicit device this machine cannot honour is bad usage, refused before any weight is
  // read (auto and cpu always go on).
  if (core_.device.kind == model::DeviceChoice::Kind::kCuda) {
    absl::StatusOr<kv::ModelConfig> config = kv::LoadHfConfig(core_.model_dir + "/config.json");
    if (config.ok()) {
      if (absl::Status s = model::CheckDeviceChoice(core_.device, *config); !s.ok()) {
        return server::UsageError(name, std::string(s.message()));
      }
    }  // else the worker's load reports the model directory's problem
  }
  if (core_.threads < 1 || core_.pool_blocks < 1 || core_.cache_slots < 1) {
    return server::UsageError(name, "--threads, --pool-blocks and --cache-slots must be positive");
  }
  if (core_.store_request_timeout <= absl::ZeroDuration() ||
      core_.store_backoff < absl::ZeroDuration()) {
    return server::UsageError(
        name, "--store-request-timeout must be positive and --store-backoff not negative");
  }
  if (model_name_.empty()) model_name_ = server::ModelNameFromDir(core_.model_dir);
  return std::nullopt;
}

int ServeWorker(const server::ServiceHostOptions& host, grpc::Service* service,
                const MetricsRegistry* metrics, const std::string& advertise_host,
                const std::function<absl::Status(const std::string& grpc_address)>& connect_store,
                std::function<void()> on_drain) {
  server::ServiceHostOptions options = host;
  options.serving_at_start = false;
  absl::StatusOr<std::unique_ptr<server::ServiceHost>> server =
      server::ServiceHost::Start(options, {service}, metrics);
  absl::Status status = server.status();
  // Registered only now that the gateway can reach the advertised gRPC address. Health says
  // SERVING only once registered: a gateway that starts after this worker is healthy (kvrelay
  // up, readiness probes) then finds it in the store at once (ASan's slower start-up showed a
  // gateway that started in between and had no prefill worker for its first requests).
  if (status.ok()) {
    status = connect_store(
        absl::StrCat(server::AdvertisedHost(host.host, advertise_host), ":", (*server)->port()));
    if (status.ok()) (*server)->SetServing(true);
  }
  if (!status.ok()) {
    std::fprintf(stderr, "kvrelay %s: %s\n", host.name.c_str(), status.ToString().c_str());
    return 1;
  }
  (*server)->WaitForShutdown({.on_drain = std::move(on_drain)});
  return 0;
}

}  // namespace kvrelay::worker

#pragma once

// WorkerCore: what a prefill and a decode worker both own — the model, the data-plane
// transport, the request KV cache in transport memory, and (with a cache store) a cache
// segment plus the store link that registers and heartbeats it.
//
// The transport and the clock are injected (WorkerCoreDeps), so the serving core runs over the
// in-process or fault-injecting transport and a SimulatedClock in one-process tests, and over
// UCX with the real clock in `kvrelay prefill|decode` (worker/server makes that transport: this
// library links neither UCX nor gRPC's server side).
//
// Members are declared in creation order, so destruction stops the heartbeat first and the
// transport after every region allocated from it.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/server/credentials.h"
#include "kv/hf_config.h"
#include "kvrelay/v1/common.pb.h"
#include "model/attention_model.h"
#include "model/mamba_runner.h"
#include "model/select/model_select.h"
#include "transfer/transport.h"
#include "worker/disk_cache.h"
#include "worker/kv_memory.h"
#include "worker/store_link.h"

namespace kvrelay::worker {

// Whose memory keys a decode worker hands out (--memory-key-scope).
//  kPool:        the KV pool is registered once and published to every peer that presents
//                the data-plane key (one rkey per connection).
//  kReservation: the pool is private; each reservation registers its own slots (ucp_mem_map of
//                their existing memory per contiguous run) and its keys go out only in that
//                Reserve response; unmapped when the reservation ends. Where keys are enforced
//                in hardware (RDMA) the NIC refuses any write outside live reservations.
//  kAuto:        kReservation when the transport has a hardware-enforced key domain
//                (Capabilities::hardware_enforced_keys), else kPool.
enum class MemoryKeyScope { kAuto, kReservation, kPool };
// "auto", "reservation", "pool"; InvalidArgument naming the value otherwise.
absl::StatusOr<MemoryKeyScope> ParseMemoryKeyScope(absl::string_view name);
const char* MemoryKeyScopeName(MemoryKeyScope scope);

// Stages a disk tier block is cut into (PlanDiskStages): a prefix read back from disk is used
// up to a layer while up to 7/8 of it is still being read.
inline constexpr int kDiskStages = 8;

struct WorkerCoreOptions {
  std::string role;  // "prefill" or "decode": default node ids and error attribution
  std::string model_dir;
  // config.json of model_dir, parsed once by the caller (worker/server's flags) and handed down
  // to the model loader; empty: WorkerCore::Create reads it with `block_tokens`.
  std::optional<kv::ModelConfig> model_config;
  // Tokens per KV block and KV dtype (empty: the model's) when WorkerCore::Create reads
  // config.json itself.
  int32_t block_tokens = kv::kDefaultBlockTokens;
  std::optional<kv::DType> kv_cache_dtype;
  std::string node_id;             // empty: "<role>-<hostname>-<random>", unique per process
  std::string cachestore_address;  // empty: no cache segment, no store link
  std::string transport_host = "127.0.0.1";
  int32_t transport_port = 0;  // fixed data-plane port; 0: any
  // The host others use to reach this node (gRPC and data plane); empty: derived from the bind
  // addresses (never a wildcard such as 0.0.0.0).
  std::string advertise_host;
  int32_t threads = 1;
  // Where attention models compute (model/select/model_select.h). The commands' --device
  // defaults to auto; in-process users (tests comparing with the CPU reference) get the CPU
  // unless they ask. Mamba models run on the CPU whatever auto finds; cuda with one is refused.
  model::DeviceChoice device{.kind = model::DeviceChoice::Kind::kCpu};
  int64_t pool_blocks = 1024;  // request KV slots per layer group
  int64_t cache_slots = 256;   // whole-block slots offered to the store
  // The disk tier behind the cache segment (worker/disk_cache.h): a directory on local NVMe
  // (empty: none; needs a store) and the tier file's size in bytes (--ssd-dir, --ssd-bytes).
  std::string ssd_dir;
  int64_t ssd_bytes = 0;
  server::SecurityOptions security;  // for the channel to the store
  // Store calls on a request's critical path and how long they fail fast after one failed,
  // doubling per failed probe up to the max (StoreLinkOptions, whose defaults these are).
  absl::Duration store_request_timeout = StoreLinkOptions().request_timeout;
  absl::Duration store_backoff = StoreLinkOptions().store_backoff;
  absl::Duration store_backoff_max = StoreLinkOptions().store_backoff_max;
  // Non-empty: the data-plane key peers must present to connect (Transport::SetAcceptKey),
  // installed before the inbound handler. The decode worker sets its own random one.
  std::string transport_accept_key;
  // Decode only; what WorkerCore::memory_key_scope resolves (kAuto by capabilities).
  MemoryKeyScope memory_key_scope = MemoryKeyScope::kPool;
};

struct WorkerCoreDeps {
  // The data plane (required): in-process in tests, UCX from worker/server in the commands.
  transfer::TransportPtr transport;
  std::string transport_kind = "inproc";  // what peers are told
  Clock* clock = Clock::Real();           // not owned; must outlive the core
  // Where the store link's gate is exported (optional; not owned; must outlive the core), with
  // these labels (the worker's model_name).
  MetricsRegistry* metrics = nullptr;
  MetricLabels metric_labels;
};

struct WorkerCore {
  // `inbound` (may be empty) is installed before the transport can accept peers.
  // InvalidArgument without deps.transport; the model loader's and the transport's errors.
  static absl::StatusOr<std::unique_ptr<WorkerCore>> Create(const WorkerCoreOptions& options,
                                                            transfer::InboundHandler inbound,
                                                            WorkerCoreDeps deps = {});
  // Registers with the cache store (when configured) once the gRPC server listens on
  // `grpc_address`, reporting `load` with each heartbeat. ALREADY_EXISTS when another live
  // process holds this node id. REQUIRES: called once.
  absl::Status ConnectStore(const std::string& grpc_address,
                            std::function<kvrelay::v1::NodeLoad()> load);
  // The drain's tail (SIGTERM; the worker already refuses new work): waits until `idle()`
  // holds (every admitted request finished) or `deadline`, then leaves the store (the node id is
  // free for the next process at once). Returns whether the worker went idle in time. Blocks
  // the caller, checking `idle` every 10 ms.
  bool DrainAndLeave(const std::function<bool()>& idle, absl::Time deadline);

  // A gateway's PromoteRequest (proto/kvrelay/v1/common.proto): reads the blocks of the
  // request's chain, from `first` on, that the disk tier lists (runs of them; blocks not listed
  // are skipped) back into the cache segment and commits them there, so a prefill worker
  // elsewhere can pull them and this node's own next Reserve or Prefill finds them in DRAM.
  // Bounded by `deadline` (the disk reads and the store calls). Without a disk tier or store:
  // nothing promoted. InvalidArgument (FAILURE_INVALID_REQUEST) for a malformed request,
  // FailedPrecondition (FAILURE_IDENTITY) for another layout; both attributed to `role` and
  // this node. A disk read or commit that fails ends the promotion with what it had: the
  // blocks are recomputed elsewhere, not an error.
  absl::StatusOr<kvrelay::v1::PromoteResponse> Promote(const kvrelay::v1::PromoteRequest& request,
                                                       kvrelay::v1::Role role, absl::Time deadline);

  // The model's config and layout, whichever runner computes it.
  const kv::ModelConfig& model_config() const {
    return runner != nullptr ? runner->config() : mamba->config();
  }
  // "device <cpu|cuda:N> (<why>)", e.g. "device cpu (auto: no usable CUDA device (...))": what
  // the worker's listening line says.
  std::string DeviceLine() const;

  Clock* clock = nullptr;
  MetricsRegistry* metrics = nullptr;  // from WorkerCoreDeps; may be null
  MetricLabels metric_labels;
  std::string node_id;
  uint64_t incarnation = 0;  // random per process start
  // Exactly one of the two: attention models run on `runner` (CPU or CUDA, by
  // options.device) over the KV cache; Mamba (model_type "mamba") on `mamba`, whose recurrent
  // state travels in `kv`'s one SSM group (one slot = one sequence's whole state) and is
  // checkpointed per block in `segment`.
  std::unique_ptr<model::AttentionModel> runner;
  std::unique_ptr<model::MambaRunner> mamba;
  // What the model computes on ("cpu" for Mamba) and one line on why it was picked, for the
  // listening line and /metrics (kvrelay:cache_config_info's device labels).
  model::ComputeDevice device;
  std::string device_reason;
  transfer::TransportPtr transport;
  std::string transport_kind;  // "ucx" or "inproc"
  std::string transport_address;
  std::unique_ptr<RegisteredKvCache> kv;
  // options.memory_key_scope resolved: kReservation (kv's pools are private regions) or kPool.
  MemoryKeyScope memory_key_scope = MemoryKeyScope::kPool;
  std::unique_ptr<CacheSegment> segment;  // null without a store
  // The disk tier behind `segment` (options.ssd_dir); null without one. Declared before `store`,
  // which demotes into it, so it outlives the link.
  std::unique_ptr<DiskCache> disk;
  // How `disk` cuts a block into layer stages (its stage_of_layer tells a prefill which stage
  // a layer waits for).
  DiskStagePlan disk_stages;
  std::unique_ptr<StoreLink> store;  // null without a store or before ConnectStore
  WorkerCoreOptions options;
};

// "<role>-<hostname>-<8 hex digits>": unique per process, so two replicas of one deployment
// never share an id by accident.
std::string DefaultNodeId(const std::string& role);

}  // namespace kvrelay::worker

#include "worker/server/worker_flags.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/server/auth.h"
#include "common/server/server_flags.h"
#include "common/status_macros.h"
#include "kv/hf_config.h"
#include "model/select/model_select.h"

namespace kvrelay::worker::server {

void WorkerFlags::AddFlags(FlagSet& flags) {
  kvrelay::server::AddServerFlags(flags, host_);
  flags.AddString("cachestore", &core_.cachestore_address,
                  "cache store HOST:PORT (several, comma-separated: an HA store set)");
  AddModelFlags(flags);
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
  flags.AddInt64("pool-blocks", &core_.pool_blocks, "request KV slots per layer group");
  flags.AddInt64("cache-slots", &core_.cache_slots, "whole-block slots offered to the store");
  flags.AddString("ssd-dir", &core_.ssd_dir,
                  "directory on local NVMe for the disk tier behind the cache slots: blocks that "
                  "leave DRAM are kept there (io_uring, O_DIRECT, each verified on read) and read "
                  "back when a request needs them (empty: no disk tier; needs --cachestore)");
  flags.AddInt64("ssd-bytes", &core_.ssd_bytes,
                 "size in bytes of the disk tier's file under --ssd-dir (reserved at start)");
  AddStoreFlags(flags);
}

void WorkerFlags::AddModelFlags(FlagSet& flags) {
  flags.AddString("model", &core_.model_dir, "model directory (config.json + safetensors)");
  flags.AddString("model-name", &model_name_,
                  "model name requests must use (default: the directory's base name)");
  flags.AddInt32("block-tokens", &core_.block_tokens,
                 "tokens per KV block; the cache store and the gateway must use the same value "
                 "(registration with another one is refused)");
  flags.AddString("kv-cache-dtype", &kv_cache_dtype_,
                  "dtype of the KV cache: auto (the model's torch_dtype), bf16, fp16, fp32 or "
                  "fp8_e4m3 (half of bf16's bytes per token; E4M3 with per-block scales, "
                  "kv/fp8.h); every worker a request crosses must use the same one (blocks of "
                  "another dtype are refused, never converted)");
  flags.AddString("device", &device_,
                  "where the model computes: auto (CUDA device 0 when one is usable and runs the "
                  "model, else the CPU), cpu, cuda or cuda:N (that device or an error); KV "
                  "never crosses between backends whose bits differ");
}

void WorkerFlags::AddStoreFlags(FlagSet& flags) {
  flags.AddDuration("store-request-timeout", &core_.store_request_timeout,
                    "per-call limit of a store call on a request's path (prefix match, commit), "
                    "shortened to what is left of the request's deadline: a store slower than "
                    "this costs reuse, not latency");
  flags.AddDuration("store-backoff", &core_.store_backoff,
                    "after a request-path store call found the store not answering, how long "
                    "the next ones fail fast (reuse off, no wait) before one probes it; doubles "
                    "per failed probe up to --store-backoff-max");
  flags.AddDuration("store-backoff-max", &core_.store_backoff_max,
                    "the longest --store-backoff grows to while the store stays away");
}

std::optional<int> WorkerFlags::Parse(FlagSet& flags, const std::vector<std::string>& raw_args,
                                      bool cachestore_required) {
  const std::string& name = host_.name;
  core_.role = name;
  if (std::optional<int> exit_code =
          kvrelay::server::ParseServerCommandLine(flags, raw_args, name, host_)) {
    return exit_code;
  }
  core_.security = host_.security;
  for (absl::Status s : {CheckIdentity(), CheckAddresses(cachestore_required)}) {
    if (!s.ok()) return UsageError(name, s.message());
  }
  // After the checks above, in their order: a missing --model is reported before a bad device.
  if (absl::Status s = SettleModel(); !s.ok()) return UsageError(name, s.message());
  if (absl::Status s = CheckSizes(); !s.ok()) return UsageError(name, s.message());
  if (model_name_.empty()) model_name_ = kvrelay::server::ModelNameFromDir(core_.model_dir);
  return std::nullopt;
}

absl::Status WorkerFlags::CheckIdentity() {
  if (host_.security.insecure) return absl::OkStatus();
  // The cache store accepts node-scoped calls only from the node's own certificate.
  const std::string& name = host_.name;
  absl::StatusOr<kvrelay::server::Peer> own =
      kvrelay::server::IdentityOfCertificateFile(host_.security.cert_file);
  if (!own.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--tls-cert: ", own.status().message()));
  }
  if (kvrelay::server::RoleName(own->role) != name) {
    return absl::InvalidArgumentError(absl::StrCat("--tls-cert is a ",
                                                   kvrelay::server::RoleName(own->role),
                                                   " certificate, not a ", name, " one"));
  }
  if (core_.node_id.empty()) core_.node_id = own->id;
  if (core_.node_id != own->id) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--node-id '", core_.node_id, "' differs from the certificate's node id '", own->id, "'"));
  }
  return absl::OkStatus();
}

absl::Status WorkerFlags::CheckAddresses(bool cachestore_required) {
  if (core_.model_dir.empty()) return absl::InvalidArgumentError("--model is required");
  if (cachestore_required && core_.cachestore_address.empty()) {
    return absl::InvalidArgumentError("--cachestore is required");
  }
  if (!core_.cachestore_address.empty()) {
    for (absl::string_view address : absl::StrSplit(core_.cachestore_address, ',')) {
      if (absl::Status s = kvrelay::server::CheckHostPort(std::string(address), "--cachestore");
          !s.ok()) {
        return absl::InvalidArgumentError(s.message());
      }
    }
  }
  if (core_.transport_port < 0 || core_.transport_port > 65535) {
    return absl::InvalidArgumentError("--transport-port must be in [0, 65535]");
  }
  return absl::OkStatus();
}

absl::Status WorkerFlags::SettleModel() {
  absl::StatusOr<model::DeviceChoice> device = model::ParseDeviceFlag(device_);
  if (!device.ok()) return absl::InvalidArgumentError(device.status().message());
  core_.device = *device;
  if (absl::Status s = kv::CheckBlockTokensFlag(core_.block_tokens); !s.ok()) return s;
  KV_ASSIGN_OR_RETURN(core_.kv_cache_dtype,
                      kv::ParseKvDTypeFlag("--kv-cache-dtype", kv_cache_dtype_));
  // The one parse of config.json in this process; a config that does not parse is left to the
  // worker's load, which reports the model directory's problem.
  absl::StatusOr<kv::ModelConfig> config =
      kv::LoadHfConfig(core_.model_dir + "/config.json",
                       {.kv_dtype = core_.kv_cache_dtype, .block_tokens = core_.block_tokens});
  if (!config.ok()) return absl::OkStatus();
  // An explicit device this machine cannot honour is bad usage, refused before any weight is
  // read (auto and cpu always go on).
  if (absl::Status s = model::CheckDeviceChoice(core_.device, *config); !s.ok()) {
    return absl::InvalidArgumentError(s.message());
  }
  core_.model_config = *std::move(config);
  return absl::OkStatus();
}

absl::Status WorkerFlags::CheckSizes() {
  if (core_.threads < 1 || core_.pool_blocks < 1 || core_.cache_slots < 1) {
    return absl::InvalidArgumentError(
        "--threads, --pool-blocks and --cache-slots must be positive");
  }
  if (!core_.ssd_dir.empty() && (core_.ssd_bytes <= 0 || core_.cachestore_address.empty())) {
    return absl::InvalidArgumentError(
        "--ssd-dir needs a positive --ssd-bytes and a --cachestore (the disk tier keeps blocks "
        "that leave the cache slots)");
  }
  if (core_.ssd_dir.empty() && core_.ssd_bytes != 0) {
    return absl::InvalidArgumentError("--ssd-bytes needs --ssd-dir");
  }
  if (core_.store_request_timeout <= absl::ZeroDuration() ||
      core_.store_backoff < absl::ZeroDuration() || core_.store_backoff_max < core_.store_backoff) {
    return absl::InvalidArgumentError(
        "--store-request-timeout must be positive, --store-backoff not negative and "
        "--store-backoff-max not below --store-backoff");
  }
  return absl::OkStatus();
}

}  // namespace kvrelay::worker::server

#pragma once

// Command-line handling shared by `kvrelay prefill` and `kvrelay decode`: registers the server
// flags (common/server), the WorkerCoreOptions flags, --block-tokens and --model-name on a
// FlagSet, then parses (with --config) and checks them. config.json is read here once, with
// --block-tokens, and handed down in WorkerCoreOptions::model_config: the device check and the
// model loader use that one parse.
//
// One thread. The three outputs given to the constructor must outlive the WorkerFlags.
//
//   WorkerFlags worker_flags(host, options.core, options.model_name);
//   worker_flags.AddFlags(flags);
//   flags.AddInt32("max-batch", ...);  // command-specific flags
//   if (std::optional<int> exit_code = worker_flags.Parse(flags, args, false)) return *exit_code;

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/flags.h"
#include "common/server/service_host.h"
#include "worker/worker_core.h"

namespace kvrelay::worker::server {

class WorkerFlags {
 public:
  WorkerFlags(kvrelay::server::ServiceHostOptions& host, WorkerCoreOptions& core,
              std::string& model_name)
      : host_(host), core_(core), model_name_(model_name) {}
  void AddFlags(FlagSet& flags);
  // Returns an exit code to return at once (0 after --help, 2 with a one-line message for bad
  // usage), or nullopt when the command should go on; fills the model name's default from the
  // directory. A config.json that does not parse is left to the worker's load to report (exit 1).
  std::optional<int> Parse(FlagSet& flags, const std::vector<std::string>& raw_args,
                           bool cachestore_required);

 private:
  void AddModelFlags(FlagSet& flags);
  void AddStoreFlags(FlagSet& flags);
  // Each: InvalidArgument with the usage message, else OK.
  // The certificate names this node: its role must be ours, and it is the node id.
  absl::Status CheckIdentity();
  absl::Status CheckAddresses(bool cachestore_required);
  // --block-tokens, --kv-cache-dtype, --device and config.json (parsed into core_.model_config).
  absl::Status SettleModel();
  absl::Status CheckSizes();

  kvrelay::server::ServiceHostOptions& host_;
  WorkerCoreOptions& core_;
  std::string& model_name_;
  std::string device_ = "auto";          // --device, parsed into core_.device
  std::string kv_cache_dtype_ = "auto";  // --kv-cache-dtype, parsed into core_.kv_cache_dtype
};

}  // namespace kvrelay::worker::server

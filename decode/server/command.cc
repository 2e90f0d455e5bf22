// `kvrelay decode`: runs a decode worker until SIGTERM.

#include "decode/server/command.h"

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/flags.h"
#include "common/server/server_flags.h"
#include "common/server/service_host.h"
#include "decode/decode_worker.h"
#include "decode/server/decode_service.h"
#include "worker/server/default_transport.h"
#include "worker/server/serve_worker.h"
#include "worker/server/worker_flags.h"

namespace kvrelay::decode::server {

int RunDecodeCommand(const std::vector<std::string>& raw_args) {
  kvrelay::server::ServiceHost::BlockShutdownSignals();
  DecodeWorkerOptions options;
  kvrelay::server::ServiceHostOptions host;
  host.name = "decode";
  host.health_services = {"kvrelay.v1.Decode"};
  FlagSet flags("decode", "Runs a decode worker: receives KV blocks, decodes, streams tokens.");
  worker::server::WorkerFlags worker_flags(host, options.core, options.model_name);
  worker_flags.AddFlags(flags);
  flags.AddInt32("max-batch", &options.max_batch, "sequences per decode step");
  flags.AddInt32("max-queued", &options.max_queued,
                 "admitted requests waiting for a batch slot before new ones are refused");
  flags.AddDuration("max-queue-wait", &options.max_queue_wait,
                    "refuse (RESOURCE_EXHAUSTED) a Reserve whose predicted wait for a batch place "
                    "is longer than this, below its deadline (0: the deadline alone)");
  flags.AddDuration("reservation-ttl", &options.reservation_ttl,
                    "a reservation not used by Generate within this long is dropped");
  std::string memory_key_scope = "auto";
  flags.AddString("memory-key-scope", &memory_key_scope,
                  "auto|reservation|pool: memory keys per reservation (each reservation's slots "
                  "registered on their own, keys only in its Reserve response) or one per pool; "
                  "auto: reservation where the NIC enforces keys (RDMA), else pool");
  if (std::optional<int> exit_code =
          worker_flags.Parse(flags, raw_args, /*cachestore_required=*/false)) {
    return *exit_code;
  }
  absl::StatusOr<worker::MemoryKeyScope> scope = worker::ParseMemoryKeyScope(memory_key_scope);
  if (!scope.ok()) {
    return kvrelay::server::UsageError("decode", absl::StrCat("--", scope.status().message()));
  }
  options.core.memory_key_scope = *scope;
  if (options.reservation_ttl < absl::Milliseconds(100) ||
      options.reservation_ttl > absl::Hours(1)) {
    return kvrelay::server::UsageError(
        "decode", absl::StrCat("--reservation-ttl must be in [100ms, 1h], got ",
                               absl::FormatDuration(options.reservation_ttl)));
  }
  if (options.max_batch < 1) {
    return kvrelay::server::UsageError(
        "decode", absl::StrCat("--max-batch must be positive, got ", options.max_batch));
  }
  if (options.max_queued < 0) {
    return kvrelay::server::UsageError(
        "decode", absl::StrCat("--max-queued must be >= 0, got ", options.max_queued));
  }
  MetricsRegistry metrics;
  absl::StatusOr<worker::WorkerCoreDeps> deps = worker::server::DefaultWorkerDeps(options.core);
  absl::StatusOr<std::unique_ptr<DecodeWorker>> worker =
      deps.ok() ? DecodeWorker::Create(options, &metrics, *std::move(deps)) : deps.status();
  if (!worker.ok()) {
    std::fprintf(stderr, "kvrelay decode: %s\n", worker.status().ToString().c_str());
    return 1;
  }
  std::fprintf(stderr, "decode: model %s, node %s, data plane %s, memory keys per %s\n",
               options.model_name.c_str(), (*worker)->node_id().c_str(),
               (*worker)->transport_address().c_str(),
               worker::MemoryKeyScopeName((*worker)->memory_key_scope()));
  host.listening_note = (*worker)->device_line();
  DecodeService service(worker->get(), kvrelay::server::Authorizer(host.security));
  return worker::server::ServeWorker(
      host, &service, &metrics, options.core.advertise_host,
      [&](const std::string& grpc_address) { return (*worker)->ConnectStore(grpc_address); },
      [&](absl::Time deadline) { (*worker)->Drain(deadline); });
}

}  // namespace kvrelay::decode::server

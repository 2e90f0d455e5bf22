// `kvrelay prefill`: runs a prefill worker until SIGTERM.

#include "prefill/server/command.h"

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/flags.h"
#include "common/server/server_flags.h"
#include "common/server/service_host.h"
#include "prefill/prefill_worker.h"
#include "prefill/server/prefill_service.h"
#include "worker/server/default_transport.h"
#include "worker/server/serve_worker.h"
#include "worker/server/worker_flags.h"

namespace kvrelay::prefill::server {

int RunPrefillCommand(const std::vector<std::string>& raw_args) {
  kvrelay::server::ServiceHost::BlockShutdownSignals();
  PrefillWorkerOptions options;
  kvrelay::server::ServiceHostOptions host;
  host.name = "prefill";
  host.health_services = {"kvrelay.v1.Prefill"};
  FlagSet flags("prefill", "Runs a prefill worker: computes or reuses KV, pushes it to decode.");
  worker::server::WorkerFlags worker_flags(host, options.core, options.model_name);
  worker_flags.AddFlags(flags);
  flags.AddBool("pull-remote-prefix", &options.pull_remote_prefix,
                "pull cached prefix blocks held on other nodes when the cost model says it beats "
                "recomputing them (false: always recompute them)");
  flags.AddDuration("fetch-timeout", &options.fetch_timeout,
                    "how long a pull from another node may take before the rest is recomputed");
  flags.AddDuration(
      "max-queue-wait", &options.max_queue_wait,
      "refuse (RESOURCE_EXHAUSTED) a request whose predicted wait for compute (prompt "
      "tokens queued / measured rate) is longer than this, below its deadline (0: "
      "the deadline alone)");
  if (std::optional<int> exit_code =
          worker_flags.Parse(flags, raw_args, /*cachestore_required=*/true)) {
    return *exit_code;
  }
  MetricsRegistry metrics;
  absl::StatusOr<worker::WorkerCoreDeps> deps = worker::server::DefaultWorkerDeps(options.core);
  absl::StatusOr<std::unique_ptr<PrefillWorker>> worker =
      deps.ok() ? PrefillWorker::Create(options, &metrics, *std::move(deps)) : deps.status();
  if (!worker.ok()) {
    std::fprintf(stderr, "kvrelay prefill: %s\n", worker.status().ToString().c_str());
    return 1;
  }
  std::fprintf(stderr, "prefill: model %s, node %s, data plane %s\n", options.model_name.c_str(),
               (*worker)->node_id().c_str(), (*worker)->transport_address().c_str());
  host.listening_note = (*worker)->device_line();
  PrefillService service(worker->get(), kvrelay::server::Authorizer(host.security));
  return worker::server::ServeWorker(
      host, &service, &metrics, options.core.advertise_host,
      [&](const std::string& grpc_address) { return (*worker)->ConnectStore(grpc_address); },
      [&](absl::Time deadline) { (*worker)->Drain(deadline); });
}

}  // namespace kvrelay::prefill::server

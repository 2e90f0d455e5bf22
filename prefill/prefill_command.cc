// `kvrelay prefill`: runs a prefill worker until SIGTERM.

#include <cstdio>

#include "common/flags.h"
#include "prefill/prefill_worker.h"
#include "worker/service_host.h"
#include "worker/worker_core.h"

namespace kvrelay::cli {

int RunPrefillCommand(const std::vector<std::string>& raw_args) {
  worker::ServiceHost::BlockShutdownSignals();
  prefill::PrefillWorkerOptions options;
  worker::ServiceHostOptions host;
  host.name = "prefill";
  FlagSet flags("prefill", "Runs a prefill worker: computes or reuses KV, pushes it to decode.");
  worker::WorkerFlags worker_flags(host, options.core, options.model_name);
  worker_flags.AddFlags(flags);
  if (std::optional<int> exit_code = worker_flags.Parse(flags, raw_args, /*cachestore_required=*/true)) {
    return *exit_code;
  }
  MetricsRegistry metrics;
  absl::StatusOr<std::unique_ptr<prefill::PrefillWorker>> worker =
      prefill::PrefillWorker::Create(options, &metrics);
  if (!worker.ok()) {
    std::fprintf(stderr, "kvrelay prefill: %s\n", worker.status().ToString().c_str());
    return 1;
  }
  std::fprintf(stderr, "prefill: model %s, data plane %s\n", options.model_name.c_str(),
               (*worker)->transport_address().c_str());
  return worker::ServeUntilSignal(host, worker->get(), &metrics);
}

}  // namespace kvrelay::cli

// `kvrelay decode`: runs a decode worker until SIGTERM.

#include <cstdio>

#include "common/flags.h"
#include "decode/decode_worker.h"
#include "worker/service_host.h"
#include "worker/worker_core.h"

namespace kvrelay::cli {

int RunDecodeCommand(const std::vector<std::string>& raw_args) {
  worker::ServiceHost::BlockShutdownSignals();
  decode::DecodeWorkerOptions options;
  worker::ServiceHostOptions host;
  host.name = "decode";
  FlagSet flags("decode", "Runs a decode worker: receives KV blocks, decodes, streams tokens.");
  worker::WorkerFlags worker_flags(host, options.core, options.model_name);
  worker_flags.AddFlags(flags);
  flags.AddInt32("max-batch", &options.max_batch, "sequences per decode step");
  if (std::optional<int> exit_code = worker_flags.Parse(flags, raw_args, /*cachestore_required=*/false)) {
    return *exit_code;
  }
  if (options.max_batch < 1) {
    std::fprintf(stderr, "kvrelay decode: --max-batch must be positive, got %d\n",
                 options.max_batch);
    return 2;
  }
  MetricsRegistry metrics;
  absl::StatusOr<std::unique_ptr<decode::DecodeWorker>> worker =
      decode::DecodeWorker::Create(options, &metrics);
  if (!worker.ok()) {
    std::fprintf(stderr, "kvrelay decode: %s\n", worker.status().ToString().c_str());
    return 1;
  }
  std::fprintf(stderr, "decode: model %s, data plane %s\n", options.model_name.c_str(),
               (*worker)->transport_address().c_str());
  return worker::ServeUntilSignal(host, worker->get(), &metrics, [&] { (*worker)->Drain(); });
}

}  // namespace kvrelay::cli

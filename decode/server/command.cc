// `kvrelay decode`: runs a decode worker until SIGTERM.

#include "decode/server/command.h"

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/flags.h"
#include "common/server/server_flags.h"
#include "common/server/service_host.h"
#include "decode/decode_worker.h"
#include "decode/server/decode_service.h"
#include "worker/worker_core.h"

namespace kvrelay::decode::server {

int RunDecodeCommand(const std::vector<std::string>& raw_args) {
  kvrelay::server::ServiceHost::BlockShutdownSignals();
  DecodeWorkerOptions options;
  kvrelay::server::ServiceHostOptions host;
  host.name = "decode";
  host.health_services = {"kvrelay.v1.Decode"};
  FlagSet flags("decode", "Runs a decode worker: receives KV blocks, decodes, streams tokens.");
  worker::WorkerFlags worker_flags(host, options.core, options.model_name);
  worker_flags.AddFlags(flags);
  flags.AddInt32("max-batch", &options.max_batch, "sequences per decode step");
  flags.AddInt32("max-queued", &options.max_queued,
                 "admitted requests waiting for a batch slot before new ones are refused");
  if (std::optional<int> exit_code =
          worker_flags.Parse(flags, raw_args, /*cachestore_required=*/false)) {
    return *exit_code;
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
  absl::StatusOr<std::unique_ptr<DecodeWorker>> worker = DecodeWorker::Create(options, &metrics);
  if (!worker.ok()) {
    std::fprintf(stderr, "kvrelay decode: %s\n", worker.status().ToString().c_str());
    return 1;
  }
  std::fprintf(stderr, "decode: model %s, node %s, data plane %s\n", options.model_name.c_str(),
               (*worker)->node_id().c_str(), (*worker)->transport_address().c_str());
  DecodeService service(worker->get(), kvrelay::server::Authorizer(host.security));
  absl::StatusOr<std::unique_ptr<kvrelay::server::ServiceHost>> server =
      kvrelay::server::ServiceHost::Start(host, {&service}, &metrics);
  if (!server.ok()) {
    std::fprintf(stderr, "kvrelay decode: %s\n", server.status().ToString().c_str());
    return 1;
  }
  // Registered only now that the gateway can reach the advertised gRPC address.
  const std::string advertised =
      absl::StrCat(kvrelay::server::AdvertisedHost(host.host, options.core.advertise_host), ":",
                   (*server)->port());
  if (absl::Status s = (*worker)->ConnectStore(advertised); !s.ok()) {
    std::fprintf(stderr, "kvrelay decode: %s\n", s.ToString().c_str());
    return 1;
  }
  (*server)->WaitForShutdown({.on_drain = [&] { (*worker)->Drain(); }});
  return 0;
}

}  // namespace kvrelay::decode::server

#include "worker/server/default_transport.h"

#include "common/status_macros.h"
#include "transfer/ucx/ucx_transport.h"

namespace kvrelay::worker::server {

absl::StatusOr<WorkerCoreDeps> DefaultWorkerDeps(const WorkerCoreOptions& options) {
  transfer::UcxTransportOptions ucx;
  ucx.listen_host = options.transport_host;
  ucx.listen_port = options.transport_port;
  ucx.advertise_host = options.advertise_host;
  WorkerCoreDeps deps;
  KV_ASSIGN_OR_RETURN(deps.transport, transfer::MakeUcxTransport(ucx));
  deps.transport_kind = "ucx";
  return deps;
}

}  // namespace kvrelay::worker::server

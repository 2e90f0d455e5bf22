#pragma once

// The data plane `kvrelay prefill|decode` run over: a UCX transport listening on the worker's
// --transport-host/--transport-port and advertising --advertise-address. In-process users
// (tests) inject their own transport into WorkerCoreDeps instead.
//
// Thread-safe (no state).

#include "absl/status/statusor.h"
#include "worker/worker_core.h"

namespace kvrelay::worker::server {

// WorkerCoreDeps with a UCX transport for `options` (transport_kind "ucx", the real clock).
// The UCX transport's errors (no such address, port taken).
absl::StatusOr<WorkerCoreDeps> DefaultWorkerDeps(const WorkerCoreOptions& options);

}  // namespace kvrelay::worker::server

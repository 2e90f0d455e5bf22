#pragma once

// RAII owners for UCX handles and the one converter from ucs_status_t to absl::Status.
// Declare owners in creation order so that the context is destroyed last.
//
// Thread safety: these are plain owners. A worker and everything created on it (endpoints,
// unpacked remote keys, requests) are used only by the worker's ProgressThread.

#include <ucp/api/ucp.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvrelay::transfer::ucx {

// NO_MEMORY -> ResourceExhausted, TIMED_OUT -> DeadlineExceeded, CONNECTION_RESET /
// UNREACHABLE / ENDPOINT_TIMEOUT / NOT_CONNECTED / REJECTED -> Unavailable, CANCELED ->
// Cancelled, INVALID_PARAM -> InvalidArgument, UNSUPPORTED -> Unimplemented, else Internal.
absl::Status FromUcs(ucs_status_t status, std::string_view what);

using UcpConfigPtr = std::unique_ptr<ucp_config_t, decltype(&ucp_config_release)>;
using UcpContextPtr = std::unique_ptr<ucp_context, decltype(&ucp_cleanup)>;
using UcpWorkerPtr = std::unique_ptr<ucp_worker, decltype(&ucp_worker_destroy)>;
using UcpRkeyPtr = std::unique_ptr<ucp_rkey, decltype(&ucp_rkey_destroy)>;

// Reads UCX_* from the environment (UCX_TLS, UCX_NET_DEVICES, ...) and creates a context with
// RMA + wakeup features, then a worker with multi-thread mode SINGLE (one progress thread).
absl::StatusOr<UcpContextPtr> CreateContext(size_t request_size);
absl::StatusOr<UcpWorkerPtr> CreateWorker(ucp_context_h context);
// The worker's address blob, for the peer's ucp_ep_create.
absl::StatusOr<std::string> WorkerAddress(ucp_worker_h worker);

// A registered memory region (ucp_mem_map of existing memory) and its packed remote key.
// Move-only; unmapped on destruction. The context must outlive it.
class UcpMemRegion {
 public:
  static absl::StatusOr<UcpMemRegion> Map(ucp_context_h context, void* data, size_t bytes);
  // Memory allocated by UCX (UCP_MEM_MAP_ALLOCATE: shared-memory segments first, per
  // UCX_MEM_ALLOC_METHOD), so that shared-memory peers can map it; sets *data.
  static absl::StatusOr<UcpMemRegion> Allocate(ucp_context_h context, size_t bytes, void** data);
  UcpMemRegion() = default;
  UcpMemRegion(UcpMemRegion&& other) noexcept;
  UcpMemRegion& operator=(UcpMemRegion&& other) noexcept;
  ~UcpMemRegion();

  // ucp_rkey_pack + ucp_rkey_buffer_release.
  absl::StatusOr<std::string> PackRemoteKey() const;
  ucp_mem_h memh() const { return memh_; }

 private:
  void Reset();
  ucp_context_h context_ = nullptr;  // not owned
  ucp_mem_h memh_ = nullptr;
};

// Unpacks a peer's remote key for use on `ep`.
absl::StatusOr<UcpRkeyPtr> UnpackRemoteKey(ucp_ep_h ep, const std::string& packed);

}  // namespace kvrelay::transfer::ucx

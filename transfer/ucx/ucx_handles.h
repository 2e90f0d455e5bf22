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
#include "absl/time/clock.h"
#include "absl/time/time.h"

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
// A non-empty `tcp_port_range` ("LOW-HIGH") overrides UCX_TCP_PORT_RANGE.
absl::StatusOr<UcpContextPtr> CreateContext(size_t request_size,
                                            const std::string& tcp_port_range = "");
absl::StatusOr<UcpWorkerPtr> CreateWorker(ucp_context_h context);
// Whether UCX can move CUDA device memory in this context, as UCX itself answers it
// (ucp_context_query, UCP_ATTR_FIELD_MEMORY_TYPES includes UCS_MEMORY_TYPE_CUDA): true only for
// a UCX built --with-cuda (cuda_copy, plus gdr_copy / an RDMA NIC for GPUDirect). Debian's UCX
// 1.13 answers false. Never assumed from the build or the hardware.
absl::StatusOr<bool> SupportsCudaMemory(ucp_context_h context);
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

// A UCX endpoint and its closing. Move-only. Closing never blocks the caller: Close() starts
// it and returns an EndpointCloser that the worker's thread polls until UCX holds nothing of
// the endpoint any more. The worker must outlive both.
class EndpointCloser;
class UcpEndpoint {
 public:
  // ucp_ep_create from the peer's worker address. With `err_handler`, error mode PEER (the
  // handler hears about a failed peer); without, NONE.
  static absl::StatusOr<UcpEndpoint> Create(ucp_worker_h worker, const std::string& peer_address,
                                            const ucp_err_handler_t* err_handler);
  UcpEndpoint() = default;
  UcpEndpoint(UcpEndpoint&& other) noexcept;
  UcpEndpoint& operator=(UcpEndpoint&& other) noexcept;
  // An endpoint still open is force-closed here, progressing the worker until UCX is done
  // (bounded: 2 s). Owners normally Close() first.
  ~UcpEndpoint();

  ucp_ep_h get() const { return ep_; }
  explicit operator bool() const { return ep_ != nullptr; }
  bool peer_error_mode() const { return peer_mode_; }

  // Starts closing. `graceful`: flush outstanding operations first (ucp_ep_flush_nbx) until
  // `flush_deadline`, then close with FORCE (nothing left to lose after a flush); else FORCE at
  // once (the peer is gone: flushing towards it can hang with error mode NONE). Leaves this
  // object empty.
  std::unique_ptr<EndpointCloser> Close(bool graceful, absl::Time flush_deadline);

 private:
  ucp_worker_h worker_ = nullptr;  // not owned
  ucp_ep_h ep_ = nullptr;
  bool peer_mode_ = false;
};

class EndpointCloser {
 public:
  ~EndpointCloser();
  // Advances the close; true once done (or given up at `give_up`: UCX keeps the request).
  bool Poll(absl::Time now);

 private:
  friend class UcpEndpoint;
  EndpointCloser(ucp_worker_h worker, ucp_ep_h ep, ucs_status_ptr_t flush,
                 absl::Time flush_deadline);
  void StartForceClose();
  ucp_worker_h worker_;
  ucp_ep_h ep_;                       // until the close is issued
  ucs_status_ptr_t flush_ = nullptr;  // a flush in progress
  ucs_status_ptr_t close_ = nullptr;  // a close in progress
  absl::Time flush_deadline_;
  absl::Time give_up_ = absl::InfiniteFuture();
  bool done_ = false;
};

// Unpacks a peer's remote key for use on `ep`.
absl::StatusOr<UcpRkeyPtr> UnpackRemoteKey(ucp_ep_h ep, const std::string& packed);

}  // namespace kvrelay::transfer::ucx

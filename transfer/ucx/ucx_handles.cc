#include "transfer/ucx/ucx_handles.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"

namespace kvrelay::transfer::ucx {

absl::Status FromUcs(ucs_status_t status, std::string_view what_view) {
  if (status == UCS_OK) return absl::OkStatus();
  const std::string what(what_view);
  std::string msg = absl::StrCat(what, ": ", ucs_status_string(status));
  switch (status) {
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE:
      return absl::ResourceExhaustedError(msg);
    case UCS_ERR_TIMED_OUT:
      return absl::DeadlineExceededError(msg);
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_REJECTED:
    case UCS_ERR_IO_ERROR:
      return absl::UnavailableError(msg);
    case UCS_ERR_CANCELED:
      return absl::CancelledError(msg);
    case UCS_ERR_INVALID_PARAM:
    case UCS_ERR_INVALID_ADDR:
      return absl::InvalidArgumentError(msg);
    case UCS_ERR_UNSUPPORTED:
      return absl::UnimplementedError(msg);
    default:
      return absl::InternalError(msg);
  }
}

absl::StatusOr<UcpContextPtr> CreateContext(size_t request_size,
                                            const std::string& tcp_port_range) {
  ucp_config_t* config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
  if (st != UCS_OK) return FromUcs(st, "ucp_config_read");
  UcpConfigPtr config_owner(config, &ucp_config_release);
  if (!tcp_port_range.empty()) {
    st = ucp_config_modify(config, "TCP_PORT_RANGE", tcp_port_range.c_str());
    if (st != UCS_OK) {
      return absl::InvalidArgumentError(
          absl::StrCat("ucx_tcp_port_range must look like LOW-HIGH, got '", tcp_port_range, "'"));
    }
  }
  ucp_params_t params = {};
  params.field_mask =
      UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_REQUEST_SIZE | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
  params.request_size = request_size;
  params.mt_workers_shared = 0;
  ucp_context_h context = nullptr;
  st = ucp_init(&params, config, &context);
  if (st != UCS_OK) return FromUcs(st, "ucp_init");
  return UcpContextPtr(context, &ucp_cleanup);
}

absl::StatusOr<bool> SupportsCudaMemory(ucp_context_h context) {
  ucp_context_attr_t attr = {};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  const ucs_status_t st = ucp_context_query(context, &attr);
  if (st != UCS_OK) return FromUcs(st, "ucp_context_query(UCP_ATTR_FIELD_MEMORY_TYPES)");
  return (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
}

absl::StatusOr<UcpWorkerPtr> CreateWorker(ucp_context_h context) {
  ucp_worker_params_t params = {};
  params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  params.thread_mode = UCS_THREAD_MODE_SINGLE;
  ucp_worker_h worker = nullptr;
  ucs_status_t st = ucp_worker_create(context, &params, &worker);
  if (st != UCS_OK) return FromUcs(st, "ucp_worker_create");
  return UcpWorkerPtr(worker, &ucp_worker_destroy);
}

absl::StatusOr<std::string> WorkerAddress(ucp_worker_h worker) {
  ucp_address_t* address = nullptr;
  size_t length = 0;
  ucs_status_t st = ucp_worker_get_address(worker, &address, &length);
  if (st != UCS_OK) return FromUcs(st, "ucp_worker_get_address");
  std::string out(reinterpret_cast<const char*>(address), length);
  ucp_worker_release_address(worker, address);
  return out;
}

absl::StatusOr<UcpMemRegion> UcpMemRegion::Map(ucp_context_h context, void* data, size_t bytes) {
  ucp_mem_map_params_t params = {};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  params.address = data;
  params.length = bytes;
  ucp_mem_h memh = nullptr;
  ucs_status_t st = ucp_mem_map(context, &params, &memh);
  if (st != UCS_OK) return FromUcs(st, absl::StrCat("ucp_mem_map of ", bytes, " bytes"));
  UcpMemRegion region;
  region.context_ = context;
  region.memh_ = memh;
  return region;
}

absl::StatusOr<UcpMemRegion> UcpMemRegion::Allocate(ucp_context_h context, size_t bytes,
                                                    void** data) {
  ucp_mem_map_params_t params = {};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_FLAGS;
  params.address = nullptr;
  params.length = bytes;
  params.flags = UCP_MEM_MAP_ALLOCATE;
  ucp_mem_h memh = nullptr;
  ucs_status_t st = ucp_mem_map(context, &params, &memh);
  if (st != UCS_OK) return FromUcs(st, absl::StrCat("ucp_mem_map(ALLOCATE) of ", bytes, " bytes"));
  UcpMemRegion region;
  region.context_ = context;
  region.memh_ = memh;
  ucp_mem_attr_t attr = {};
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
  st = ucp_mem_query(memh, &attr);
  if (st != UCS_OK) return FromUcs(st, "ucp_mem_query");
  if (attr.length < bytes) {
    return absl::InternalError(
        absl::StrCat("UCX allocated ", attr.length, " of ", bytes, " bytes"));
  }
  *data = attr.address;
  return region;
}

UcpMemRegion::UcpMemRegion(UcpMemRegion&& other) noexcept
    : context_(std::exchange(other.context_, nullptr)),
      memh_(std::exchange(other.memh_, nullptr)) {}

UcpMemRegion& UcpMemRegion::operator=(UcpMemRegion&& other) noexcept {
  if (this != &other) {
    Reset();
    context_ = std::exchange(other.context_, nullptr);
    memh_ = std::exchange(other.memh_, nullptr);
  }
  return *this;
}

UcpMemRegion::~UcpMemRegion() { Reset(); }

void UcpMemRegion::Reset() {
  if (memh_ != nullptr) {
    ucs_status_t st = ucp_mem_unmap(context_, memh_);
    if (st != UCS_OK) {
      KV_LOG(WARNING) << "ucp_mem_unmap: " << ucs_status_string(st);
    }
  }
  memh_ = nullptr;
  context_ = nullptr;
}

absl::StatusOr<std::string> UcpMemRegion::PackRemoteKey() const {
  void* buffer = nullptr;
  size_t size = 0;
  ucs_status_t st = ucp_rkey_pack(context_, memh_, &buffer, &size);
  if (st != UCS_OK) return FromUcs(st, "ucp_rkey_pack");
  std::string out(static_cast<const char*>(buffer), size);
  ucp_rkey_buffer_release(buffer);
  return out;
}

absl::StatusOr<UcpEndpoint> UcpEndpoint::Create(ucp_worker_h worker,
                                                const std::string& peer_address,
                                                const ucp_err_handler_t* err_handler) {
  ucp_ep_params_t params = {};
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  params.address = reinterpret_cast<const ucp_address_t*>(peer_address.data());
  params.err_mode =
      err_handler != nullptr ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  if (err_handler != nullptr) {
    params.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.err_handler = *err_handler;
  }
  ucp_ep_h ep = nullptr;
  ucs_status_t st = ucp_ep_create(worker, &params, &ep);
  if (st != UCS_OK) return FromUcs(st, "ucp_ep_create from the peer's worker address");
  UcpEndpoint out;
  out.worker_ = worker;
  out.ep_ = ep;
  out.peer_mode_ = err_handler != nullptr;
  return out;
}

UcpEndpoint::UcpEndpoint(UcpEndpoint&& other) noexcept
    : worker_(std::exchange(other.worker_, nullptr)),
      ep_(std::exchange(other.ep_, nullptr)),
      peer_mode_(other.peer_mode_) {}

UcpEndpoint& UcpEndpoint::operator=(UcpEndpoint&& other) noexcept {
  if (this != &other) {
    if (ep_ != nullptr) {
      std::unique_ptr<EndpointCloser> closer = Close(false, absl::Now());
      const absl::Time stop = absl::Now() + absl::Seconds(2);
      while (!closer->Poll(absl::Now()) && absl::Now() < stop) ucp_worker_progress(worker_);
    }
    worker_ = std::exchange(other.worker_, nullptr);
    ep_ = std::exchange(other.ep_, nullptr);
    peer_mode_ = other.peer_mode_;
  }
  return *this;
}

UcpEndpoint::~UcpEndpoint() {
  if (ep_ == nullptr) return;
  ucp_worker_h worker = worker_;
  std::unique_ptr<EndpointCloser> closer = Close(false, absl::Now());
  const absl::Time stop = absl::Now() + absl::Seconds(2);
  while (!closer->Poll(absl::Now()) && absl::Now() < stop) ucp_worker_progress(worker);
}

std::unique_ptr<EndpointCloser> UcpEndpoint::Close(bool graceful, absl::Time flush_deadline) {
  ucs_status_ptr_t flush = nullptr;
  if (graceful && ep_ != nullptr) {
    ucp_request_param_t param = {};
    flush = ucp_ep_flush_nbx(ep_, &param);
    if (UCS_PTR_IS_ERR(flush)) flush = nullptr;  // nothing to wait for: force-close
  }
  std::unique_ptr<EndpointCloser> closer(
      new EndpointCloser(worker_, std::exchange(ep_, nullptr), flush, flush_deadline));
  worker_ = nullptr;
  return closer;
}

EndpointCloser::EndpointCloser(ucp_worker_h worker, ucp_ep_h ep, ucs_status_ptr_t flush,
                               absl::Time flush_deadline)
    : worker_(worker), ep_(ep), flush_(flush), flush_deadline_(flush_deadline) {
  if (ep_ == nullptr) {
    done_ = true;
  } else if (flush_ == nullptr) {
    StartForceClose();
  }
}

EndpointCloser::~EndpointCloser() {
  // Requests UCX still holds are released by UCX when they complete.
  if (flush_ != nullptr) ucp_request_free(flush_);
  if (close_ != nullptr) ucp_request_free(close_);
}

void EndpointCloser::StartForceClose() {
  ucp_request_param_t param = {};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t req = ucp_ep_close_nbx(ep_, &param);
  ep_ = nullptr;
  if (req == nullptr || UCS_PTR_IS_ERR(req)) {
    done_ = true;
    return;
  }
  close_ = req;
  // With error mode NONE (shared memory) a close towards a dead process can take seconds.
  give_up_ = absl::Now() + absl::Seconds(5);
}

bool EndpointCloser::Poll(absl::Time now) {
  if (done_) return true;
  if (flush_ != nullptr) {
    if (ucp_request_check_status(flush_) == UCS_INPROGRESS && now < flush_deadline_) return false;
    // Flushed, failed, or out of time: the force close completes a flush still running.
    ucp_request_free(flush_);
    flush_ = nullptr;
    StartForceClose();
    if (done_) return true;
  }
  if (ucp_request_check_status(close_) == UCS_INPROGRESS && now < give_up_) return false;
  ucp_request_free(close_);
  close_ = nullptr;
  done_ = true;
  return true;
}

absl::StatusOr<UcpRkeyPtr> UnpackRemoteKey(ucp_ep_h ep, const std::string& packed) {
  ucp_rkey_h rkey = nullptr;
  ucs_status_t st = ucp_ep_rkey_unpack(ep, packed.data(), &rkey);
  if (st != UCS_OK) return FromUcs(st, "ucp_ep_rkey_unpack");
  return UcpRkeyPtr(rkey, &ucp_rkey_destroy);
}

}  // namespace kvrelay::transfer::ucx

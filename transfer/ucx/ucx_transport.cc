#include "transfer/ucx/ucx_transport.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/check.h"
#include "common/logging.h"
#include "common/scoped_fd.h"
#include "common/status_macros.h"
#include "transfer/internal/handle_state.h"
#include "transfer/ucx/progress_thread.h"
#include "transfer/ucx/ucx_handles.h"
#include "transfer/ucx/wire.h"

namespace kvrelay::transfer {
namespace {

using internal::HandleState;
using ucx::FromUcs;
using ucx::ProgressThread;
using ucx::UcpContextPtr;
using ucx::UcpMemRegion;
using ucx::UcpRkeyPtr;
using ucx::UcpWorkerPtr;
namespace wire = ::kvrelay::transfer::ucx::wire;
using wire::FrameType;

std::atomic<uint64_t> g_next_region_id{1};

// Whether UCX_TLS (unset = all) allows a network transport, which supports error mode PEER.
bool UcxTlsHasNetwork() {
  const char* tls = std::getenv("UCX_TLS");
  if (tls == nullptr) return true;
  const std::string v(tls);
  for (const char* net : {"tcp", "rc", "dc", "ud", "all", "ib", "^"}) {
    if (v.find(net) != std::string::npos) return true;
  }
  return false;
}

absl::Status Errno(std::string_view what) {
  int e = errno;
  std::string msg = absl::StrCat(std::string(what), ": ", std::strerror(e));
  if (e == ECONNREFUSED || e == ECONNRESET || e == EHOSTUNREACH || e == ENETUNREACH || e == EPIPE) {
    return absl::UnavailableError(msg);
  }
  return absl::InternalError(msg);
}

class UcxTransport;

// One UCX operation in flight: a put/get chunk or a batch flush. Lives in the request memory
// UCX allocates (ucp_params_t::request_size).
struct OpRequest {
  uint64_t bytes;
};

struct Chunk {
  uint8_t* local;
  RegionId remote_region;
  uint64_t remote_offset;
  uint64_t length;
};

struct Transfer {
  UcxTransport* owner = nullptr;
  uint64_t id = 0;
  PeerId peer = 0;
  Direction direction = Direction::kPut;
  uint64_t tag = 0;
  LayerRange layers;
  std::vector<BlockTransfer> blocks;
  std::vector<Chunk> chunks;
  size_t next_chunk = 0;
  int64_t inflight = 0;  // chunk requests not yet completed
  bool flush_inflight = false;
  bool flushed = false;
  absl::Time deadline = absl::InfiniteFuture();
  std::shared_ptr<HandleState> handle;
  absl::Status failure;  // first failure; once set nothing more is issued
};

struct QueueItem {
  std::unique_ptr<Transfer> transfer;  // null for a control message
  uint64_t tag = 0;
  std::string message;
};

struct RemoteRegion {
  uint64_t base = 0;
  uint64_t size = 0;
  std::string packed_rkey;
  UcpRkeyPtr rkey{nullptr, &ucp_rkey_destroy};  // unpacked on first use
};

struct ConnectWaiter {
  absl::Notification done;
  absl::StatusOr<PeerId> result = absl::UnknownError("not connected");
  PeerId peer = 0;
  void Finish(absl::StatusOr<PeerId> r) {
    if (done.HasBeenNotified()) return;
    result = std::move(r);
    done.Notify();
  }
};

struct Conn;
struct EpErrorArg {
  UcxTransport* owner;
  PeerId peer;
};

struct Conn {
  PeerId id = 0;
  ScopedFd fd;
  bool outgoing = false;
  enum class State { kHandshake, kReady, kDead } state = State::kHandshake;
  std::string rbuf;
  size_t roff = 0;
  std::string wbuf;
  size_t woff = 0;
  ucp_ep_h ep = nullptr;
  bool ep_peer_mode = false;
  std::unique_ptr<EpErrorArg> err_arg;
  absl::flat_hash_map<RegionId, RemoteRegion> regions;
  std::deque<QueueItem> queue;
  absl::flat_hash_map<uint64_t, std::unique_ptr<Transfer>> awaiting_ack;
  absl::Time last_recv;
  absl::Time last_send;
  std::shared_ptr<ConnectWaiter> waiter;
};

class UcxRegion;

class UcxTransport final : public Transport {
 public:
  static absl::StatusOr<std::unique_ptr<UcxTransport>> Create(UcxTransportOptions options);
  ~UcxTransport() override;

  Capabilities capabilities() const override { return caps_; }
  std::string address() const override { return address_; }
  absl::StatusOr<MemoryRegionPtr> RegisterMemory(MemorySpan span, MemoryKind kind) override;
  absl::StatusOr<MemoryRegionPtr> AllocateMemory(size_t bytes) override;
  absl::StatusOr<PeerId> Connect(std::string_view address, absl::Time deadline) override;
  absl::Status Disconnect(PeerId peer) override;
  absl::StatusOr<std::vector<RemoteRegionInfo>> RemoteRegions(PeerId peer) const override;
  std::vector<PeerId> Peers() const override;
  absl::StatusOr<TransferPlan> Prepare(const TransferBatch& batch) override;
  absl::StatusOr<TransferHandlePtr> Post(const TransferPlan& plan, LayerRange layers,
                                         PostOptions options) override;
  absl::Status SendControl(PeerId peer, uint64_t tag, std::string_view message) override;
  void SetInboundHandler(InboundHandler handler) override {
    absl::MutexLock lock(&handler_mu_);
    handler_ = std::move(handler);
  }

  void Deregister(RegionId id);

  // UCX callbacks (progress thread).
  static void OnOpDone(void* request, ucs_status_t status, void* user_data);
  static void OnFlushDone(void* request, ucs_status_t status, void* user_data);
  static void OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status);

 private:
  struct LocalRegion {
    MemorySpan span;
    UcpMemRegion mem;
    std::string packed_rkey;
  };
  struct PeerInfo {
    bool alive = true;
    absl::flat_hash_map<RegionId, uint64_t> region_sizes;
  };

  explicit UcxTransport(UcxTransportOptions options) : options_(std::move(options)) {}
  absl::Status Init();

  // --- progress thread only ---
  absl::Time Tick();
  bool Busy() const { return active_transfers_ > 0; }
  void OnListenerReadable();
  Conn* AdoptConn(int fd, bool outgoing, std::shared_ptr<ConnectWaiter> waiter);
  void OnConnEvent(PeerId id, short revents);
  void SendFrame(Conn& c, std::string frame);
  void FlushWrites(Conn& c);
  absl::Status HandleFrame(Conn& c, FrameType type, std::string_view payload);
  absl::Status HandleHello(Conn& c, wire::Reader& r);
  absl::Status HandleDone(Conn& c, wire::Reader& r);
  absl::Status HandleAck(Conn& c, wire::Reader& r);
  std::string HelloFrame() const;
  std::string RegionFrame(RegionId id, const LocalRegion& region) const;
  absl::Status CreateEndpoint(Conn& c, const std::string& worker_address);
  // `notify`: tell the handler (kPeerDown); `orderly`: the peer said BYE (not logged).
  void PeerDown(Conn& c, absl::Status status, bool notify, bool orderly = false);
  void CloseEndpoint(Conn& c);
  void FinishPeerDown(Conn& c);
  // Finishes endpoint closes that completed (or gave up); with `wait`, progresses until all
  // are done (bounded).
  void PollClosing(bool wait);
  struct Closing {
    ucs_status_ptr_t req;
    PeerId conn;
    absl::Time give_up;
  };
  void Enqueue(std::unique_ptr<Transfer> t);
  void FailTransfer(PeerId peer, uint64_t id, absl::Status status);
  void Pump(Conn& c);
  bool IssueChunk(Conn& c, Transfer& t);
  void Retire(Conn& c, Transfer& t);
  void Deliver(InboundEvent event);
  Conn* FindConn(PeerId id) {
    auto it = conns_.find(id);
    return it == conns_.end() || it->second->state == Conn::State::kDead ? nullptr
                                                                         : it->second.get();
  }

  const UcxTransportOptions options_;
  Capabilities caps_;
  std::string address_;
  // Declared in creation order: the context outlives the worker, the worker the thread.
  UcpContextPtr context_{nullptr, &ucp_cleanup};
  UcpWorkerPtr worker_{nullptr, &ucp_worker_destroy};
  std::string worker_address_;
  ScopedFd listener_;
  std::unique_ptr<ProgressThread> progress_;

  // Progress thread only.
  absl::flat_hash_map<PeerId, std::unique_ptr<Conn>> conns_;
  std::vector<PeerId> dead_conns_;
  std::vector<Closing> closing_;
  absl::flat_hash_map<RegionId, LocalRegion> local_regions_;
  int64_t inflight_ops_ = 0;
  uint64_t inflight_bytes_ = 0;
  int64_t active_transfers_ = 0;  // transfers in conn queues
  absl::Time next_heartbeat_check_ = absl::InfinitePast();
  absl::Time next_deadline_check_ = absl::InfinitePast();

  std::atomic<PeerId> next_peer_{1};
  std::atomic<uint64_t> next_transfer_id_{1};

  // Snapshot for callers' validation; written by the progress thread.
  mutable absl::Mutex mu_;
  absl::flat_hash_map<PeerId, PeerInfo> peers_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<RegionId, void*> region_ptrs_ ABSL_GUARDED_BY(mu_);

  absl::Mutex handler_mu_;
  InboundHandler handler_ ABSL_GUARDED_BY(handler_mu_);
};

class UcxRegion final : public MemoryRegion {
 public:
  UcxRegion(UcxTransport* owner, RegionId id, MemorySpan span, MemoryKind kind)
      : MemoryRegion(owner, id, span, kind), transport_(owner) {}
  ~UcxRegion() override { transport_->Deregister(id()); }

 private:
  UcxTransport* transport_;
};

// --- Creation and teardown ---------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<UcxTransport>> UcxTransport::Create(UcxTransportOptions options) {
  if (options.chunk_bytes == 0 || options.max_inflight_bytes == 0 ||
      options.max_inflight_ops <= 0) {
    return absl::InvalidArgumentError(
        "chunk_bytes, max_inflight_bytes and max_inflight_ops must be positive");
  }
  if (options.heartbeat_interval <= absl::ZeroDuration() ||
      options.peer_timeout <= options.heartbeat_interval) {
    return absl::InvalidArgumentError("peer_timeout must exceed a positive heartbeat_interval");
  }
  std::unique_ptr<UcxTransport> t(new UcxTransport(std::move(options)));
  KV_RETURN_IF_ERROR(t->Init());
  return t;
}

absl::Status UcxTransport::Init() {
  KV_ASSIGN_OR_RETURN(context_, ucx::CreateContext(sizeof(OpRequest)));
  KV_ASSIGN_OR_RETURN(worker_, ucx::CreateWorker(context_.get()));
  KV_ASSIGN_OR_RETURN(worker_address_, ucx::WorkerAddress(worker_.get()));

  ucp_context_attr_t attr = {};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  bool cuda = false;
  if (ucp_context_query(context_.get(), &attr) == UCS_OK) {
    cuda = (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
  }
  const char* tls = std::getenv("UCX_TLS");
  caps_ = Capabilities{.name = "ucx",
                       .device_memory = cuda,
                       .notifications = true,
                       .pull = true,
                       .max_blocks_per_batch = 1 << 20,
                       .detail = absl::StrCat("UCX ", ucp_get_version_string(),
                                              ", UCX_TLS=", tls != nullptr ? tls : "all",
                                              cuda ? "" : ", no CUDA memory support")};

  // Control listener.
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return Errno("socket");
  listener_.Reset(fd);
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(options_.listen_port));
  if (::inet_pton(AF_INET, options_.listen_host.c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("listen_host must be an IPv4 address, got '", options_.listen_host, "'"));
  }
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return Errno(absl::StrCat("bind ", options_.listen_host, ":", options_.listen_port));
  }
  if (::listen(fd, 128) != 0) return Errno("listen");
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  std::string host = options_.advertise_host;
  if (host.empty()) host = options_.listen_host == "0.0.0.0" ? "127.0.0.1" : options_.listen_host;
  address_ = absl::StrCat(host, ":", ntohs(addr.sin_port));

  ProgressThread::Hooks hooks;
  hooks.busy = [this] { return Busy(); };
  hooks.tick = [this] { return Tick(); };
  KV_ASSIGN_OR_RETURN(progress_, ProgressThread::Start(worker_.get(), std::move(hooks),
                                                       options_.spin_after_activity));
  progress_->RunSync([this] {
    progress_->WatchFd(listener_.get(), POLLIN, [this](short) { OnListenerReadable(); });
  });
  return absl::OkStatus();
}

UcxTransport::~UcxTransport() {
  if (progress_ != nullptr) {
    progress_->RunSync([this] {
      std::vector<PeerId> ids;
      for (auto& [id, c] : conns_) ids.push_back(id);
      for (PeerId id : ids) {
        Conn* c = FindConn(id);
        if (c == nullptr) continue;
        if (c->state == Conn::State::kReady)
          SendFrame(*c, std::move(wire::Writer(FrameType::kBye)).Finish());
        PeerDown(*c, absl::CancelledError("transport shut down"), /*notify=*/false);
      }
      PollClosing(/*wait=*/true);
      conns_.clear();
      local_regions_.clear();
      progress_->UnwatchFd(listener_.get());
    });
    progress_->Stop();
    progress_.reset();
  }
  {
    absl::MutexLock lock(&handler_mu_);
    handler_ = nullptr;
  }
}

// --- Caller-thread API -----------------------------------------------------------------------

absl::StatusOr<MemoryRegionPtr> UcxTransport::RegisterMemory(MemorySpan span, MemoryKind kind) {
  if (span.data == nullptr || span.size_bytes == 0) {
    return absl::InvalidArgumentError("cannot register a null or empty memory span");
  }
  if (kind == MemoryKind::kDevice && !caps_.device_memory) {
    return absl::UnimplementedError(
        "this UCX build has no CUDA memory support; stage device memory through pinned host "
        "buffers");
  }
  const RegionId id = g_next_region_id.fetch_add(1);
  absl::Status status;
  progress_->RunSync([&] {
    absl::StatusOr<UcpMemRegion> mem =
        UcpMemRegion::Map(context_.get(), span.data, span.size_bytes);
    if (!mem.ok()) {
      status = mem.status();
      return;
    }
    absl::StatusOr<std::string> rkey = mem->PackRemoteKey();
    if (!rkey.ok()) {
      status = rkey.status();
      return;
    }
    LocalRegion& region = local_regions_[id];
    region = LocalRegion{span, std::move(*mem), std::move(*rkey)};
    for (auto& [pid, c] : conns_) {
      if (c->state == Conn::State::kReady) SendFrame(*c, RegionFrame(id, region));
    }
  });
  KV_RETURN_IF_ERROR(status);
  {
    absl::MutexLock lock(&mu_);
    region_ptrs_[id] = span.data;
  }
  return std::make_unique<UcxRegion>(this, id, span, kind);
}

absl::StatusOr<MemoryRegionPtr> UcxTransport::AllocateMemory(size_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("cannot allocate zero bytes");
  const RegionId id = g_next_region_id.fetch_add(1);
  absl::Status status;
  void* data = nullptr;
  progress_->RunSync([&] {
    absl::StatusOr<UcpMemRegion> mem = UcpMemRegion::Allocate(context_.get(), bytes, &data);
    if (!mem.ok()) {
      status = mem.status();
      return;
    }
    absl::StatusOr<std::string> rkey = mem->PackRemoteKey();
    if (!rkey.ok()) {
      status = rkey.status();
      return;
    }
    local_regions_[id] = LocalRegion{MemorySpan{data, bytes}, std::move(*mem), std::move(*rkey)};
  });
  KV_RETURN_IF_ERROR(status);
  // Touch every page now (zero-fill), not during the first transfer into it; then publish.
  std::memset(data, 0, bytes);
  progress_->RunSync([&] {
    auto it = local_regions_.find(id);
    if (it == local_regions_.end()) return;
    for (auto& [pid, c] : conns_) {
      if (c->state == Conn::State::kReady) SendFrame(*c, RegionFrame(id, it->second));
    }
  });
  {
    absl::MutexLock lock(&mu_);
    region_ptrs_[id] = data;
  }
  return std::make_unique<UcxRegion>(this, id, MemorySpan{data, bytes}, MemoryKind::kHost);
}

void UcxTransport::Deregister(RegionId id) {
  {
    absl::MutexLock lock(&mu_);
    region_ptrs_.erase(id);
  }
  progress_->RunSync([this, id] {
    if (local_regions_.erase(id) == 0) return;
    for (auto& [pid, c] : conns_) {
      if (c->state != Conn::State::kReady) continue;
      wire::Writer w(FrameType::kRegionRemove);
      w.U64(id);
      SendFrame(*c, std::move(w).Finish());
    }
  });
}

absl::StatusOr<PeerId> UcxTransport::Connect(std::string_view address_view, absl::Time deadline) {
  const std::string address(address_view);
  size_t colon = address.rfind(':');
  int port = 0;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port <= 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("transport address must look like host:port, got '", address, "'"));
  }
  const std::string host = address.substr(0, colon);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    addrinfo hints = {};
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    if (::getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0 || res == nullptr) {
      return absl::UnavailableError(absl::StrCat("cannot resolve host '", host, "'"));
    }
    addr.sin_addr = reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr;
    ::freeaddrinfo(res);
  }
  ScopedFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return Errno("socket");
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    if (errno != EINPROGRESS) return Errno(absl::StrCat("connect to ", address));
    while (true) {
      absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) {
        return absl::DeadlineExceededError(absl::StrCat("connect to ", address, " timed out"));
      }
      pollfd p = {fd.get(), POLLOUT, 0};
      int n = ::poll(
          &p, 1, static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, 1000)));
      if (n > 0) break;
      if (n < 0 && errno != EINTR) return Errno("poll");
    }
    int err = 0;
    socklen_t len = sizeof(err);
    ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) {
      errno = err;
      return Errno(absl::StrCat("connect to ", address));
    }
  }
  auto waiter = std::make_shared<ConnectWaiter>();
  int raw = fd.Release();
  progress_->Post([this, raw, waiter] { AdoptConn(raw, /*outgoing=*/true, waiter); });
  if (!waiter->done.WaitForNotificationWithDeadline(deadline)) {
    progress_->Post([this, waiter] {
      waiter->Finish(absl::DeadlineExceededError("handshake timed out"));
      if (Conn* c = FindConn(waiter->peer)) {
        PeerDown(*c, absl::DeadlineExceededError("handshake timed out"), false);
      }
    });
    return absl::DeadlineExceededError(
        absl::StrCat("handshake with ", address, " not done before the deadline"));
  }
  return waiter->result;
}

absl::Status UcxTransport::Disconnect(PeerId peer) {
  absl::Status status = absl::NotFoundError(absl::StrCat("unknown peer ", peer));
  progress_->RunSync([&] {
    Conn* c = FindConn(peer);
    if (c == nullptr) return;
    status = absl::OkStatus();
    if (c->state == Conn::State::kReady)
      SendFrame(*c, std::move(wire::Writer(FrameType::kBye)).Finish());
    PeerDown(*c, absl::CancelledError(absl::StrCat("peer ", peer, " disconnected locally")),
             /*notify=*/false);
  });
  return status;
}

absl::StatusOr<std::vector<RemoteRegionInfo>> UcxTransport::RemoteRegions(PeerId peer) const {
  absl::MutexLock lock(&mu_);
  auto it = peers_.find(peer);
  if (it == peers_.end()) return absl::NotFoundError(absl::StrCat("unknown peer ", peer));
  std::vector<RemoteRegionInfo> out;
  for (const auto& [id, size] : it->second.region_sizes) out.push_back({id, size});
  std::sort(out.begin(), out.end(),
            [](const RemoteRegionInfo& a, const RemoteRegionInfo& b) { return a.id < b.id; });
  return out;
}

std::vector<PeerId> UcxTransport::Peers() const {
  absl::MutexLock lock(&mu_);
  std::vector<PeerId> out;
  for (const auto& [id, info] : peers_) {
    if (info.alive) out.push_back(id);
  }
  return out;
}

absl::StatusOr<TransferPlan> UcxTransport::Prepare(const TransferBatch& batch) {
  absl::MutexLock lock(&mu_);
  auto it = peers_.find(batch.peer);
  if (it == peers_.end()) return absl::NotFoundError(absl::StrCat("unknown peer ", batch.peer));
  if (!it->second.alive) {
    return absl::UnavailableError(absl::StrCat("peer ", batch.peer, " is gone"));
  }
  const PeerInfo& info = it->second;
  auto is_local = [this](const MemoryRegion* r) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    auto rit = region_ptrs_.find(r->id());
    return rit != region_ptrs_.end() && rit->second == r->span().data;
  };
  auto remote_size = [&info, &batch](RegionId id) -> absl::StatusOr<uint64_t> {
    auto rit = info.region_sizes.find(id);
    if (rit == info.region_sizes.end()) {
      return absl::NotFoundError(absl::StrCat("peer ", batch.peer, " has no region ", id));
    }
    return rit->second;
  };
  return internal::BuildPlan(this, batch, is_local, remote_size);
}

absl::StatusOr<TransferHandlePtr> UcxTransport::Post(const TransferPlan& plan, LayerRange layers,
                                                     PostOptions options) {
  KV_RETURN_IF_ERROR(internal::CheckPost(this, plan, layers));
  {
    absl::MutexLock lock(&mu_);
    auto it = peers_.find(plan.peer);
    if (it == peers_.end() || !it->second.alive) {
      return absl::UnavailableError(absl::StrCat("peer ", plan.peer, " is gone"));
    }
  }
  auto t = std::make_unique<Transfer>();
  t->owner = this;
  t->id = next_transfer_id_.fetch_add(1);
  t->peer = plan.peer;
  t->direction = plan.direction;
  t->tag = plan.tag;
  t->layers = layers;
  t->deadline = options.deadline;
  t->blocks = internal::BlocksForPost(plan, layers);
  int64_t bytes = 0;
  for (const BlockTransfer& b : t->blocks) bytes += b.length;
  auto [lo, hi] = plan.SegmentRange(layers);
  for (size_t i = lo; i < hi; ++i) {
    const Segment& s = plan.segments[i];
    for (uint64_t off = 0; off < s.length; off += options_.chunk_bytes) {
      t->chunks.push_back(Chunk{s.local->data() + s.local_offset + off, s.remote_region,
                                s.remote_offset + off,
                                std::min<uint64_t>(options_.chunk_bytes, s.length - off)});
    }
  }
  t->handle = std::make_shared<HandleState>(bytes, t->blocks.size());
  auto handle = std::make_unique<TransferHandle>(t->handle);
  if (absl::Now() >= options.deadline) {
    t->handle->Complete(absl::DeadlineExceededError("transfer posted after its deadline"));
    return handle;
  }
  const uint64_t id = t->id;
  const PeerId peer = t->peer;
  t->handle->SetCancelFn([this, id, peer] {
    progress_->Post(
        [this, id, peer] { FailTransfer(peer, id, absl::CancelledError("transfer cancelled")); });
  });
  progress_->Post([this, t = std::move(t)]() mutable { Enqueue(std::move(t)); });
  return handle;
}

absl::Status UcxTransport::SendControl(PeerId peer, uint64_t tag, std::string_view message) {
  if (message.size() > kMaxControlBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("control message of ", message.size(), " bytes exceeds ", kMaxControlBytes));
  }
  {
    absl::MutexLock lock(&mu_);
    auto it = peers_.find(peer);
    if (it == peers_.end()) return absl::NotFoundError(absl::StrCat("unknown peer ", peer));
    if (!it->second.alive) return absl::UnavailableError(absl::StrCat("peer ", peer, " is gone"));
  }
  progress_->Post([this, peer, tag, msg = std::string(message)]() mutable {
    Conn* c = FindConn(peer);
    if (c == nullptr) return;
    c->queue.push_back(QueueItem{nullptr, tag, std::move(msg)});
    Pump(*c);
  });
  return absl::OkStatus();
}

// --- Progress thread: connections ------------------------------------------------------------

void UcxTransport::OnListenerReadable() {
  while (true) {
    int fd = ::accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;  // EAGAIN, or a transient error; poll tells us again
    AdoptConn(fd, /*outgoing=*/false, nullptr);
  }
}

Conn* UcxTransport::AdoptConn(int fd, bool outgoing, std::shared_ptr<ConnectWaiter> waiter) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  auto conn = std::make_unique<Conn>();
  Conn& c = *conn;
  c.id = next_peer_.fetch_add(1);
  c.fd.Reset(fd);
  c.outgoing = outgoing;
  c.last_recv = c.last_send = absl::Now();
  c.waiter = std::move(waiter);
  if (c.waiter) c.waiter->peer = c.id;
  conns_[c.id] = std::move(conn);
  const PeerId id = c.id;
  progress_->WatchFd(fd, POLLIN, [this, id](short revents) { OnConnEvent(id, revents); });
  if (outgoing) SendFrame(c, HelloFrame());
  return &c;
}

std::string UcxTransport::HelloFrame() const {
  wire::Writer w(FrameType::kHello);
  w.U32(wire::kMagic);
  w.U32(wire::kVersion);
  w.Str(worker_address_);
  w.U32(static_cast<uint32_t>(local_regions_.size()));
  for (const auto& [id, r] : local_regions_) {
    w.U64(id);
    w.U64(reinterpret_cast<uint64_t>(r.span.data));
    w.U64(r.span.size_bytes);
    w.Str(r.packed_rkey);
  }
  return std::move(w).Finish();
}

std::string UcxTransport::RegionFrame(RegionId id, const LocalRegion& r) const {
  wire::Writer w(FrameType::kRegionAdd);
  w.U64(id);
  w.U64(reinterpret_cast<uint64_t>(r.span.data));
  w.U64(r.span.size_bytes);
  w.Str(r.packed_rkey);
  return std::move(w).Finish();
}

void UcxTransport::SendFrame(Conn& c, std::string frame) {
  if (c.state == Conn::State::kDead) return;
  if (c.woff == c.wbuf.size()) {
    c.wbuf.clear();
    c.woff = 0;
  }
  c.wbuf.append(frame);
  c.last_send = absl::Now();
  FlushWrites(c);
}

void UcxTransport::FlushWrites(Conn& c) {
  while (c.woff < c.wbuf.size()) {
    ssize_t n = ::send(c.fd.get(), c.wbuf.data() + c.woff, c.wbuf.size() - c.woff,
                       MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      c.woff += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      progress_->SetFdEvents(c.fd.get(), POLLIN | POLLOUT);
      return;
    }
    if (n < 0 && errno == EINTR) continue;
    // The reader side notices the broken connection and takes the peer down.
    return;
  }
  c.wbuf.clear();
  c.woff = 0;
  progress_->SetFdEvents(c.fd.get(), POLLIN);
}

void UcxTransport::OnConnEvent(PeerId id, short revents) {
  Conn* c = FindConn(id);
  if (c == nullptr) return;
  if (revents & POLLOUT) FlushWrites(*c);
  if (!(revents & (POLLIN | POLLHUP | POLLERR))) return;
  char buf[64 << 10];
  bool eof = false;
  absl::Status read_error;
  while (true) {
    ssize_t n = ::recv(c->fd.get(), buf, sizeof(buf), MSG_DONTWAIT);
    if (n > 0) {
      c->rbuf.append(buf, static_cast<size_t>(n));
      continue;
    }
    if (n == 0) {
      eof = true;
    } else if (errno == EINTR) {
      continue;
    } else if (errno != EAGAIN && errno != EWOULDBLOCK) {
      read_error = Errno("control connection");
    }
    break;
  }
  if (c->rbuf.size() > c->roff) c->last_recv = absl::Now();
  while (c->rbuf.size() - c->roff >= 4) {
    uint32_t len;
    std::memcpy(&len, c->rbuf.data() + c->roff, 4);
    if (len == 0 || len > wire::kMaxFrameBytes) {
      PeerDown(*c, absl::UnavailableError(absl::StrCat("peer sent a bad frame length ", len)),
               true);
      return;
    }
    if (c->rbuf.size() - c->roff - 4 < len) break;
    auto type = static_cast<FrameType>(c->rbuf[c->roff + 4]);
    std::string_view payload(c->rbuf.data() + c->roff + 5, len - 1);
    c->roff += 4 + len;
    absl::Status st = HandleFrame(*c, type, payload);
    c = FindConn(id);
    if (c == nullptr) return;  // the frame took the peer down
    if (!st.ok()) {
      PeerDown(*c, absl::UnavailableError(absl::StrCat("protocol error: ", st.message())), true);
      return;
    }
  }
  if (c->roff == c->rbuf.size()) {
    c->rbuf.clear();
    c->roff = 0;
  } else if (c->roff > (1 << 20)) {
    c->rbuf.erase(0, c->roff);
    c->roff = 0;
  }
  if (eof || !read_error.ok()) {
    PeerDown(
        *c,
        eof ? absl::UnavailableError(absl::StrCat("peer ", id, " closed the control connection"))
            : absl::UnavailableError(read_error.message()),
        true);
  }
}

absl::Status UcxTransport::HandleFrame(Conn& c, FrameType type, std::string_view payload) {
  wire::Reader r(payload);
  if (type == FrameType::kHello) return HandleHello(c, r);
  if (c.state != Conn::State::kReady) return absl::InvalidArgumentError("frame before hello");
  switch (type) {
    case FrameType::kRegionAdd: {
      uint64_t id, base, size;
      RemoteRegion region;
      if (!r.U64(&id) || !r.U64(&base) || !r.U64(&size) || !r.Str(&region.packed_rkey)) {
        return absl::InvalidArgumentError("truncated region frame");
      }
      region.base = base;
      region.size = size;
      c.regions[id] = std::move(region);
      absl::MutexLock lock(&mu_);
      peers_[c.id].region_sizes[id] = size;
      return absl::OkStatus();
    }
    case FrameType::kRegionRemove: {
      uint64_t id;
      if (!r.U64(&id)) return absl::InvalidArgumentError("truncated region-remove frame");
      c.regions.erase(id);
      absl::MutexLock lock(&mu_);
      peers_[c.id].region_sizes.erase(id);
      return absl::OkStatus();
    }
    case FrameType::kDone:
      return HandleDone(c, r);
    case FrameType::kAck:
      return HandleAck(c, r);
    case FrameType::kControl: {
      uint64_t tag;
      std::string msg;
      if (!r.U64(&tag) || !r.Str(&msg)) return absl::InvalidArgumentError("truncated control");
      Deliver(InboundEvent{.kind = InboundEvent::Kind::kControl,
                           .peer = c.id,
                           .tag = tag,
                           .message = std::move(msg)});
      return absl::OkStatus();
    }
    case FrameType::kHeartbeat:
      return absl::OkStatus();
    case FrameType::kBye:
      PeerDown(c, absl::UnavailableError(absl::StrCat("peer ", c.id, " disconnected")), true,
               /*orderly=*/true);
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unknown frame type ", static_cast<int>(type)));
  }
}

absl::Status UcxTransport::HandleHello(Conn& c, wire::Reader& r) {
  if (c.state != Conn::State::kHandshake) return absl::InvalidArgumentError("second hello");
  uint32_t magic, version, n;
  std::string worker_address;
  if (!r.U32(&magic) || !r.U32(&version) || magic != wire::kMagic) {
    return absl::InvalidArgumentError("not a kvrelay transfer peer");
  }
  if (version != wire::kVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("peer speaks protocol version ", version, ", we speak ", wire::kVersion));
  }
  if (!r.Str(&worker_address) || !r.U32(&n) || n > (1u << 20)) {
    return absl::InvalidArgumentError("truncated hello");
  }
  PeerInfo info;
  for (uint32_t i = 0; i < n; ++i) {
    uint64_t id;
    RemoteRegion region;
    if (!r.U64(&id) || !r.U64(&region.base) || !r.U64(&region.size) ||
        !r.Str(&region.packed_rkey)) {
      return absl::InvalidArgumentError("truncated hello region");
    }
    info.region_sizes[id] = region.size;
    c.regions[id] = std::move(region);
  }
  KV_RETURN_IF_ERROR(CreateEndpoint(c, worker_address));
  if (!c.outgoing) SendFrame(c, HelloFrame());
  c.state = Conn::State::kReady;
  {
    absl::MutexLock lock(&mu_);
    peers_[c.id] = std::move(info);
  }
  if (c.waiter) c.waiter->Finish(c.id);
  return absl::OkStatus();
}

absl::Status UcxTransport::CreateEndpoint(Conn& c, const std::string& worker_address) {
  auto create = [&](bool peer_mode) -> ucs_status_t {
    ucp_ep_params_t params = {};
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    params.address = reinterpret_cast<const ucp_address_t*>(worker_address.data());
    params.err_mode = peer_mode ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    if (peer_mode) {
      c.err_arg = std::make_unique<EpErrorArg>(EpErrorArg{this, c.id});
      params.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
      params.err_handler.cb = &UcxTransport::OnEpError;
      params.err_handler.arg = c.err_arg.get();
    }
    return ucp_ep_create(worker_.get(), &params, &c.ep);
  };
  using Mode = UcxTransportOptions::ErrorMode;
  ucs_status_t st;
  if (options_.error_mode == Mode::kNone) {
    st = create(false);
  } else if (options_.error_mode == Mode::kAuto && !UcxTlsHasNetwork()) {
    // Shared-memory-only transports have no peer-failure support on UCX 1.13; asking for PEER
    // only makes UCX log an error before we fall back.
    st = create(false);
  } else {
    st = create(true);
    c.ep_peer_mode = st == UCS_OK;
    if (st != UCS_OK && options_.error_mode == Mode::kAuto) {
      KV_LOG(DEBUG) << "UCX endpoint with error mode PEER unsupported (" << ucs_status_string(st)
                    << "); using NONE + heartbeat";
      st = create(false);
    }
  }
  if (st != UCS_OK) {
    c.ep = nullptr;
    return FromUcs(st, "ucp_ep_create from the peer's worker address");
  }
  return absl::OkStatus();
}

void UcxTransport::OnEpError(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* a = static_cast<EpErrorArg*>(arg);
  UcxTransport* self = a->owner;
  PeerId peer = a->peer;
  // Not from inside UCX's callback: closing the endpoint progresses the worker.
  self->progress_->Post([self, peer, status] {
    if (Conn* c = self->FindConn(peer)) {
      self->PeerDown(*c, FromUcs(status, "UCX data endpoint failed"), true);
    }
  });
}

void UcxTransport::CloseEndpoint(Conn& c) {
  if (c.ep == nullptr) {
    FinishPeerDown(c);
    return;
  }
  ucp_request_param_t param = {};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t req = ucp_ep_close_nbx(c.ep, &param);
  c.ep = nullptr;
  if (req == nullptr || UCS_PTR_IS_ERR(req)) {
    FinishPeerDown(c);
    return;
  }
  // Not waited for here: with error mode NONE (shared memory) a close towards a dead process
  // can take seconds, and this thread must keep serving the other peers meanwhile.
  closing_.push_back(Closing{req, c.id, absl::Now() + absl::Seconds(5)});
}

void UcxTransport::PollClosing(bool wait) {
  const absl::Time give_up_all = absl::Now() + absl::Seconds(5);
  while (!closing_.empty()) {
    const absl::Time now = absl::Now();
    std::vector<Closing> still;
    for (Closing& cl : closing_) {
      if (ucp_request_check_status(cl.req) == UCS_INPROGRESS && now < cl.give_up) {
        still.push_back(cl);
        continue;
      }
      ucp_request_free(cl.req);  // released by UCX when it completes, if it has not
      auto it = conns_.find(cl.conn);
      if (it != conns_.end()) FinishPeerDown(*it->second);
    }
    closing_.swap(still);
    if (!wait || closing_.empty() || now > give_up_all) return;
    ucp_worker_progress(worker_.get());
  }
}

void UcxTransport::PeerDown(Conn& c, absl::Status status, bool notify, bool orderly) {
  if (c.state == Conn::State::kDead) return;
  const bool was_ready = c.state == Conn::State::kReady;
  c.state = Conn::State::kDead;
  if (notify && !orderly) {
    KV_LOG(WARNING) << "transfer peer " << c.id << " down: " << status;
  }
  progress_->UnwatchFd(c.fd.get());
  c.fd.Reset();
  for (QueueItem& item : c.queue) {
    if (item.transfer && item.transfer->failure.ok()) item.transfer->failure = status;
  }
  for (auto& [id, t] : c.awaiting_ack) t->handle->Complete(status);
  c.awaiting_ack.clear();
  {
    absl::MutexLock lock(&mu_);
    auto it = peers_.find(c.id);
    if (it != peers_.end()) {
      it->second.alive = false;
      it->second.region_sizes.clear();
    }
  }
  if (c.waiter) c.waiter->Finish(status);
  if (notify && was_ready) {
    Deliver(InboundEvent{.kind = InboundEvent::Kind::kPeerDown, .peer = c.id, .status = status});
  }
  // Force-closing completes every request still in flight on the endpoint (with an error);
  // the transfers using them end in FinishPeerDown, once UCX no longer references them.
  CloseEndpoint(c);
}

void UcxTransport::FinishPeerDown(Conn& c) {
  for (QueueItem& item : c.queue) {
    if (!item.transfer) continue;
    --active_transfers_;
    item.transfer->handle->Complete(item.transfer->failure);
    if (item.transfer->inflight > 0 || item.transfer->flush_inflight) {
      // UCX still references it (the close gave up): keep it alive forever rather than risk
      // a use-after-free. Logged because it should not happen.
      KV_LOG(ERROR) << "transfer " << item.transfer->id << " still has UCX requests in flight";
      item.transfer.release();
    }
  }
  c.queue.clear();
  c.regions.clear();  // destroys unpacked rkeys
  dead_conns_.push_back(c.id);
}

void UcxTransport::Deliver(InboundEvent event) {
  absl::ReaderMutexLock lock(&handler_mu_);
  if (handler_) handler_(std::move(event));
}

// --- Progress thread: transfers --------------------------------------------------------------

void UcxTransport::Enqueue(std::unique_ptr<Transfer> t) {
  Conn* c = FindConn(t->peer);
  if (c == nullptr || c->state != Conn::State::kReady) {
    t->handle->Complete(absl::UnavailableError(absl::StrCat("peer ", t->peer, " is gone")));
    return;
  }
  ++active_transfers_;
  c->queue.push_back(QueueItem{std::move(t)});
  Pump(*c);
}

void UcxTransport::FailTransfer(PeerId peer, uint64_t id, absl::Status status) {
  Conn* c = FindConn(peer);
  if (c == nullptr) return;
  auto it = c->awaiting_ack.find(id);
  if (it != c->awaiting_ack.end()) {
    it->second->handle->Complete(status);
    c->awaiting_ack.erase(it);
    return;
  }
  for (QueueItem& item : c->queue) {
    if (item.transfer && item.transfer->id == id && item.transfer->failure.ok()) {
      item.transfer->failure = status;
    }
  }
  Pump(*c);
}

void UcxTransport::OnOpDone(void* request, ucs_status_t status, void* user_data) {
  auto* t = static_cast<Transfer*>(user_data);
  auto* op = static_cast<OpRequest*>(request);
  --t->inflight;
  --t->owner->inflight_ops_;
  t->owner->inflight_bytes_ -= op->bytes;
  if (status != UCS_OK && t->failure.ok()) {
    t->failure = FromUcs(status, absl::StrCat("UCX ", DirectionName(t->direction)));
  }
  ucp_request_free(request);
}

void UcxTransport::OnFlushDone(void* request, ucs_status_t status, void* user_data) {
  auto* t = static_cast<Transfer*>(user_data);
  t->flush_inflight = false;
  if (status == UCS_OK) {
    t->flushed = true;
  } else if (t->failure.ok()) {
    t->failure = FromUcs(status, "UCX flush");
  }
  ucp_request_free(request);
}

bool UcxTransport::IssueChunk(Conn& c, Transfer& t) {
  const Chunk& chunk = t.chunks[t.next_chunk];
  auto rit = c.regions.find(chunk.remote_region);
  if (rit == c.regions.end() || chunk.remote_offset + chunk.length > rit->second.size) {
    t.failure =
        absl::NotFoundError(absl::StrCat("peer ", c.id, " withdrew region ", chunk.remote_region));
    return false;
  }
  RemoteRegion& region = rit->second;
  if (region.rkey == nullptr) {
    absl::StatusOr<UcpRkeyPtr> rkey = ucx::UnpackRemoteKey(c.ep, region.packed_rkey);
    if (!rkey.ok()) {
      t.failure = rkey.status();
      return false;
    }
    region.rkey = std::move(*rkey);
  }
  ucp_request_param_t param = {};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = &UcxTransport::OnOpDone;
  param.user_data = &t;
  const uint64_t remote_addr = region.base + chunk.remote_offset;
  ucs_status_ptr_t req =
      t.direction == Direction::kPut
          ? ucp_put_nbx(c.ep, chunk.local, chunk.length, remote_addr, region.rkey.get(), &param)
          : ucp_get_nbx(c.ep, chunk.local, chunk.length, remote_addr, region.rkey.get(), &param);
  ++t.next_chunk;
  if (req == nullptr) return true;  // completed in place
  if (UCS_PTR_IS_ERR(req)) {
    t.failure =
        FromUcs(UCS_PTR_STATUS(req), absl::StrCat("ucp_", DirectionName(t.direction), "_nbx"));
    return false;
  }
  static_cast<OpRequest*>(req)->bytes = chunk.length;
  ++t.inflight;
  ++inflight_ops_;
  inflight_bytes_ += chunk.length;
  return true;
}

void UcxTransport::Pump(Conn& c) {
  if (c.state != Conn::State::kReady) return;
  // Issue: transfers in order, sharing the transport-wide window. Operations that complete in
  // place (shared memory: a memcpy, page faults included) do not fill the window, so each call
  // also stops after `max_inflight_bytes`: the loop then serves sockets and heartbeats before
  // the next call continues.
  uint64_t budget = options_.max_inflight_bytes;
  for (QueueItem& item : c.queue) {
    if (!item.transfer) continue;
    Transfer& t = *item.transfer;
    if (!t.failure.ok()) continue;
    bool window_full = false;
    while (t.next_chunk < t.chunks.size()) {
      const uint64_t len = t.chunks[t.next_chunk].length;
      if (inflight_ops_ >= options_.max_inflight_ops ||
          (inflight_ops_ > 0 && inflight_bytes_ + len > options_.max_inflight_bytes) ||
          (budget < len && budget != options_.max_inflight_bytes)) {
        window_full = true;
        break;
      }
      budget -= std::min(budget, len);
      if (!IssueChunk(c, t)) break;
    }
    if (t.direction == Direction::kPut && t.failure.ok() && t.next_chunk == t.chunks.size() &&
        !t.flush_inflight && !t.flushed) {
      ucp_request_param_t param = {};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      param.cb.send = &UcxTransport::OnFlushDone;
      param.user_data = &t;
      ucs_status_ptr_t req = ucp_ep_flush_nbx(c.ep, &param);
      if (req == nullptr) {
        t.flushed = true;
      } else if (UCS_PTR_IS_ERR(req)) {
        t.failure = FromUcs(UCS_PTR_STATUS(req), "ucp_ep_flush_nbx");
      } else {
        static_cast<OpRequest*>(req)->bytes = 0;
        t.flush_inflight = true;
      }
    }
    if (window_full) break;
  }
  // Retire from the front, in order, so DONE and control frames leave in Post order.
  while (!c.queue.empty() && c.state == Conn::State::kReady) {
    QueueItem& item = c.queue.front();
    if (!item.transfer) {
      wire::Writer w(FrameType::kControl);
      w.U64(item.tag);
      w.Str(item.message);
      SendFrame(c, std::move(w).Finish());
      c.queue.pop_front();
      continue;
    }
    Transfer& t = *item.transfer;
    if (t.inflight > 0 || t.flush_inflight) break;
    if (t.failure.ok()) {
      if (t.next_chunk < t.chunks.size()) break;
      if (t.direction == Direction::kPut && !t.flushed) break;
    }
    std::unique_ptr<Transfer> owned = std::move(item.transfer);
    c.queue.pop_front();
    --active_transfers_;
    Retire(c, *owned);
    if (owned->failure.ok() && owned->direction == Direction::kPut) {
      c.awaiting_ack[owned->id] = std::move(owned);
    }
  }
}

void UcxTransport::Retire(Conn& c, Transfer& t) {
  if (!t.failure.ok()) {
    t.handle->Complete(t.failure);
    return;
  }
  if (t.direction == Direction::kGet) {
    std::vector<absl::Status> statuses;
    statuses.reserve(t.blocks.size());
    for (const BlockTransfer& b : t.blocks) {
      statuses.push_back(internal::VerifyBlock(b.local->data() + b.local_offset, b.length,
                                               b.checksum, b.local->id(), b.local_offset));
    }
    t.handle->CompleteBlocks(std::move(statuses));
    return;
  }
  // Put: the data is in the peer's memory (flush done); tell it which blocks and checksums.
  wire::Writer w(FrameType::kDone);
  w.U64(t.id);
  w.U64(t.tag);
  w.I32(t.layers.begin);
  w.I32(t.layers.end);
  w.U32(static_cast<uint32_t>(t.blocks.size()));
  for (const BlockTransfer& b : t.blocks) {
    w.U64(b.remote_region);
    w.U64(b.remote_offset);
    w.U64(b.length);
    w.U8(b.checksum.has_value() ? 1 : 0);
    w.U64(b.checksum.value_or(0));
  }
  SendFrame(c, std::move(w).Finish());
}

absl::Status UcxTransport::HandleDone(Conn& c, wire::Reader& r) {
  uint64_t id, tag;
  int32_t lb, le;
  uint32_t n;
  if (!r.U64(&id) || !r.U64(&tag) || !r.I32(&lb) || !r.I32(&le) || !r.U32(&n) ||
      r.remaining() < static_cast<size_t>(n) * 33) {
    return absl::InvalidArgumentError("truncated done frame");
  }
  InboundEvent event{
      .kind = InboundEvent::Kind::kBlocks, .peer = c.id, .tag = tag, .layers = LayerRange{lb, le}};
  event.blocks.reserve(n);
  std::vector<absl::Status> statuses;
  statuses.reserve(n);
  for (uint32_t i = 0; i < n; ++i) {
    ReceivedBlock b;
    uint8_t has = 0;
    uint64_t ck = 0;
    r.U64(&b.region);
    r.U64(&b.offset);
    r.U64(&b.length);
    r.U8(&has);
    r.U64(&ck);
    if (has) b.checksum = ck;
    auto it = local_regions_.find(b.region);
    if (it == local_regions_.end()) {
      b.status = absl::InvalidArgumentError(absl::StrCat("no local region ", b.region));
    } else if (b.offset > it->second.span.size_bytes ||
               b.length > it->second.span.size_bytes - b.offset) {
      b.status = absl::InvalidArgumentError(
          absl::StrCat("block [", b.offset, ", +", b.length, ") is outside region ", b.region));
    } else {
      b.status = internal::VerifyBlock(static_cast<const uint8_t*>(it->second.span.data) + b.offset,
                                       b.length, b.checksum, b.region, b.offset);
    }
    statuses.push_back(b.status);
    event.blocks.push_back(std::move(b));
  }
  event.status = internal::SummarizeBlocks(statuses);
  wire::Writer w(FrameType::kAck);
  w.U64(id);
  w.U32(n);
  std::string first_error;
  for (const absl::Status& s : statuses) {
    w.U8(static_cast<uint8_t>(s.code()));
    if (!s.ok() && first_error.empty()) first_error = std::string(s.message());
  }
  w.Str(first_error);
  // The handler sees the blocks before the sender's handle completes.
  Deliver(std::move(event));
  if (Conn* still = FindConn(c.id)) SendFrame(*still, std::move(w).Finish());
  return absl::OkStatus();
}

absl::Status UcxTransport::HandleAck(Conn& c, wire::Reader& r) {
  uint64_t id;
  uint32_t n;
  if (!r.U64(&id) || !r.U32(&n) || r.remaining() < n) {
    return absl::InvalidArgumentError("truncated ack frame");
  }
  std::vector<absl::Status> statuses;
  statuses.reserve(n);
  std::vector<uint8_t> codes(n);
  for (uint32_t i = 0; i < n; ++i) r.U8(&codes[i]);
  std::string first_error;
  r.Str(&first_error);
  bool first = true;
  for (uint8_t code : codes) {
    if (code == 0) {
      statuses.push_back(absl::OkStatus());
      continue;
    }
    auto sc = static_cast<absl::StatusCode>(code);
    statuses.push_back(absl::Status(
        sc, absl::StrCat("receiver: ", first ? first_error : "block failed verification")));
    first = false;
  }
  static bool printed = false;
  if (!printed && std::getenv("KVRELAY_UCX_EP_INFO") != nullptr && c.ep != nullptr) {
    printed = true;
    ucp_ep_print_info(c.ep, stderr);
  }
  auto it = c.awaiting_ack.find(id);
  if (it == c.awaiting_ack.end()) return absl::OkStatus();  // cancelled meanwhile
  if (statuses.size() != it->second->blocks.size()) {
    return absl::InvalidArgumentError("ack block count does not match the transfer");
  }
  it->second->handle->CompleteBlocks(std::move(statuses));
  c.awaiting_ack.erase(it);
  return absl::OkStatus();
}

absl::Time UcxTransport::Tick() {
  if (!closing_.empty()) PollClosing(/*wait=*/false);
  for (PeerId id : dead_conns_) conns_.erase(id);
  dead_conns_.clear();
  for (auto& [id, c] : conns_) {
    if (!c->queue.empty()) Pump(*c);
  }
  const absl::Time now = absl::Now();
  bool any_pending = false;
  if (now >= next_deadline_check_) {
    next_deadline_check_ = now + absl::Milliseconds(1);
    for (auto& [id, c] : conns_) {
      if (c->state != Conn::State::kReady) continue;
      std::vector<uint64_t> expired;
      for (QueueItem& item : c->queue) {
        if (item.transfer && item.transfer->failure.ok() && now >= item.transfer->deadline) {
          item.transfer->failure = absl::DeadlineExceededError(
              absl::StrCat(DirectionName(item.transfer->direction), " of ",
                           item.transfer->blocks.size(), " blocks missed its deadline"));
        }
      }
      for (auto& [tid, t] : c->awaiting_ack) {
        if (now >= t->deadline) expired.push_back(tid);
      }
      for (uint64_t tid : expired) {
        c->awaiting_ack[tid]->handle->Complete(
            absl::DeadlineExceededError("no acknowledgement from the receiver by the deadline"));
        c->awaiting_ack.erase(tid);
      }
      if (!c->awaiting_ack.empty() || !c->queue.empty()) any_pending = true;
      if (!c->queue.empty()) Pump(*c);
    }
  }
  if (now >= next_heartbeat_check_) {
    next_heartbeat_check_ = now + options_.heartbeat_interval / 4;
    std::vector<std::pair<PeerId, absl::Status>> down;
    for (auto& [id, c] : conns_) {
      if (c->state == Conn::State::kDead) continue;
      if (now - c->last_recv > options_.peer_timeout && c->state == Conn::State::kReady) {
        // Frames may be waiting unread in the socket while this thread was busy.
        OnConnEvent(id, POLLIN);
      }
      if (c->state == Conn::State::kDead) continue;
      if (now - c->last_recv > options_.peer_timeout) {
        down.emplace_back(
            id, absl::UnavailableError(absl::StrCat("peer ", id, " sent nothing for ",
                                                    absl::FormatDuration(now - c->last_recv))));
        continue;
      }
      if (c->state == Conn::State::kReady && now - c->last_send >= options_.heartbeat_interval) {
        SendFrame(*c, std::move(wire::Writer(FrameType::kHeartbeat)).Finish());
      }
    }
    for (auto& [id, st] : down) {
      if (Conn* c = FindConn(id)) PeerDown(*c, st, true);
    }
  }
  absl::Time next = next_heartbeat_check_;
  if (any_pending || !closing_.empty()) next = std::min(next, now + absl::Milliseconds(1));
  return next;
}

}  // namespace

absl::StatusOr<TransportPtr> MakeUcxTransport(UcxTransportOptions options) {
  KV_ASSIGN_OR_RETURN(std::unique_ptr<UcxTransport> t, UcxTransport::Create(std::move(options)));
  return TransportPtr(std::move(t));
}

}  // namespace kvrelay::transfer

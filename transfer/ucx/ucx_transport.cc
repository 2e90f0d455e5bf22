#include "transfer/ucx/ucx_transport.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/check.h"
#include "common/logging.h"
#include "common/scoped_fd.h"
#include "common/status_macros.h"
#include "transfer/internal/handle_state.h"
#include "transfer/internal/populate.h"
#include "transfer/ucx/control_channel.h"
#include "transfer/ucx/frames.h"
#include "transfer/ucx/key_enforcement.h"
#include "transfer/ucx/net_address.h"
#include "transfer/ucx/progress_thread.h"
#include "transfer/ucx/ucx_handles.h"
#include "transfer/ucx/wire.h"

namespace kvrelay::transfer {
namespace {

namespace frames = ::kvrelay::transfer::ucx::frames;
using internal::HandleState;
using ucx::ConnectWaiter;
using ucx::ControlChannel;
using ucx::EndpointCloser;
using ucx::FromUcs;
using ucx::PeerDownKind;
using ucx::PeerHello;
using ucx::ProgressThread;
using ucx::UcpContextPtr;
using ucx::UcpEndpoint;
using ucx::UcpMemRegion;
using ucx::UcpRkeyPtr;
using ucx::UcpWorkerPtr;
namespace wire = ::kvrelay::transfer::ucx::wire;
using wire::FrameType;

// Whether error mode PEER is worth asking for by default (ErrorMode::kAuto): only where a network
// transport may carry the endpoint (shared memory has no peer-failure support on UCX 1.13), and
// not on UCX 1.13 at all: there, over tcp, a peer that goes away while or soon after the two
// sides' endpoints are matched aborts the surviving process inside UCX's wireup (assertions at
// ucp_ep.inl:215 "remote_id == remote_ep_id" and ucp_request.c:684 "got REP message"; seen in
// 4 of 6 runs of transfer_ucx_test). The control channel's heartbeat and its kernel socket
// report a dead peer anyway, and every transfer has a deadline, so NONE loses no detection.
bool PeerErrorModeByDefault() {
#if UCP_API_VERSION < UCP_VERSION(1, 14)
  return false;
#else
  const char* tls = std::getenv("UCX_TLS");
  if (tls == nullptr) return true;
  const std::string v(tls);
  for (const char* net : {"tcp", "rc", "dc", "ud", "all", "ib", "^"}) {
    if (v.find(net) != std::string::npos) return true;
  }
  return false;
#endif
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
  std::string credential;  // put: sent with the DONE
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
  UcpRkeyPtr rkey{nullptr, &ucp_rkey_destroy};  // unpacked when announced
  // Where UCX mapped the peer's segment into this process (shared memory: puts are memcpy
  // into it), or null. Populated piecewise by the progress thread, so that transfers do not
  // pay this mapping's first-touch faults; `populated` bytes from the start are done.
  uint8_t* mapped = nullptr;
  uint64_t populated = 0;
};

struct EpErrorArg {
  UcxTransport* owner;
  PeerId peer;
};

// The RMA side of one connected peer (the control connection is ControlChannel's): its UCX
// endpoint, the regions it published (keys unpacked on that endpoint) and the transfers to it.
// Progress thread only. Declared so that the endpoint is closed before the keys are destroyed.
struct Peer {
  PeerId id = 0;
  std::unique_ptr<EpErrorArg> err_arg;  // outlives the endpoint (UCX holds a pointer)
  absl::flat_hash_map<RegionId, RemoteRegion> regions;
  UcpEndpoint ep;
  std::deque<QueueItem> queue;
  absl::flat_hash_map<uint64_t, std::unique_ptr<Transfer>> awaiting_ack;
};

class UcxRegion;

class UcxTransport final : public Transport, private ControlChannel::Delegate {
 public:
  static absl::StatusOr<std::unique_ptr<UcxTransport>> Create(UcxTransportOptions options);
  ~UcxTransport() override;

  Capabilities capabilities() const override { return caps_; }
  std::string address() const override { return address_; }
  uint64_t incarnation() const override { return incarnation_; }
  absl::StatusOr<MemoryRegionPtr> RegisterMemory(MemorySpan span, MemoryKind kind) override;
  absl::StatusOr<MemoryRegionPtr> AllocateMemory(size_t bytes) override;
  absl::StatusOr<MemoryRegionPtr> AllocatePrivateMemory(size_t bytes) override {
    return Allocate(bytes, /*publish=*/false);
  }
  absl::StatusOr<MemoryRegionPtr> RegisterPrivateMemory(MemorySpan span, MemoryKind kind) override {
    return Register(span, kind, /*publish=*/false);
  }
  absl::StatusOr<std::string> ExportRegion(const MemoryRegion& region) const override;
  absl::StatusOr<RegionId> ImportRegion(PeerId peer, std::string_view exported) override;
  absl::Status ForgetRegion(PeerId peer, RegionId region) override;
  using Transport::Connect;
  absl::StatusOr<PeerId> Connect(std::string_view address, absl::Time deadline,
                                 const ConnectOptions& options) override;
  absl::Status Disconnect(PeerId peer) override;
  absl::StatusOr<std::vector<RemoteRegionInfo>> RemoteRegions(PeerId peer) const override;
  absl::StatusOr<PeerStatus> GetPeerStatus(PeerId peer) const override;
  std::vector<PeerId> Peers() const override;
  absl::StatusOr<TransferPlan> Prepare(const TransferBatch& batch) override;
  absl::StatusOr<TransferHandlePtr> Post(const TransferPlan& plan, LayerRange layers,
                                         PostOptions options) override;
  absl::Status SendControl(PeerId peer, uint64_t tag, std::string_view message) override;
  void SetAcceptKey(std::string key) override {
    progress_->RunSync([this, &key] { channel_->SetAcceptKey(std::move(key)); });
  }
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
    // False for private regions: never in a hello or a region frame (ExportRegion only).
    bool published = true;
  };
  // What callers' threads may read about a peer (under mu_).
  struct PeerInfo {
    bool alive = true;
    bool outgoing = false;
    absl::Status down_reason;
    std::string address;
    uint64_t incarnation = 0;
    uint64_t unpopulated_bytes = 0;
    absl::flat_hash_map<RegionId, uint64_t> region_sizes;
  };
  // A peer whose endpoint is closing; its transfers end once UCX has let go of them.
  struct Closing {
    std::unique_ptr<EndpointCloser> closer;
    std::unique_ptr<Peer> peer;
  };
  // A peer that went down while GETs of ours were unanswered. Over an emulated GET (UCX over
  // tcp) the peer's reply names our request by its address (error mode NONE on UCX 1.13), and
  // a peer that was only paused or cut off still sends it when it runs again: had the endpoint
  // been force-closed and the transfer ended, that reply would be copied into a request UCX
  // had freed, towards memory its owner had reused (a KV slot: wrong tokens; an unmapped
  // region: SIGSEGV, seen in a soak). So the endpoint stays open and those transfers stay in
  // flight, their handles not terminal and their destinations held, until every reply has
  // landed, UCX failed the requests itself, or the peer is known gone (a new incarnation at
  // its address, or this transport's shutdown); then the endpoint closes.
  struct Parked {
    std::unique_ptr<Peer> peer;
    std::string address;
    uint64_t incarnation = 0;
    absl::Status why;
    std::vector<std::unique_ptr<Transfer>> gets;    // handle ends when inflight reaches 0
    std::vector<std::unique_ptr<Transfer>> others;  // handle ended; UCX may still call back
  };

  explicit UcxTransport(UcxTransportOptions options) : options_(std::move(options)) {}
  absl::Status Init();
  absl::StatusOr<MemoryRegionPtr> Register(MemorySpan span, MemoryKind kind, bool publish);
  absl::StatusOr<MemoryRegionPtr> Allocate(size_t bytes, bool publish);
  // Both ways in (Register's mapping, Allocate's allocation): packs the mapping's remote key
  // and files it under `id`; the mapping's own failure, or the packing's, otherwise. Does not
  // publish. Progress thread only.
  absl::StatusOr<LocalRegion*> AddLocalRegion(RegionId id, MemorySpan span,
                                              absl::StatusOr<UcpMemRegion> mem, bool publish);
  // Makes `id` visible to callers' validation (region_ptrs_) and hands out its handle.
  MemoryRegionPtr MakeRegion(RegionId id, MemorySpan span, MemoryKind kind);
  bool OnLoop() const { return progress_->IsOnProgressThread(); }

  // --- ControlChannel::Delegate (progress thread) ---
  void WriteHelloBody(wire::Writer& w) override;
  absl::Status OnHello(PeerId id, bool outgoing, const std::string& address, const PeerHello& hello,
                       wire::Reader& body) override;
  absl::Status OnFrame(PeerId id, FrameType type, wire::Reader& r) override;
  void OnPeerDown(PeerId id, const absl::Status& why, PeerDownKind kind) override;

  // --- progress thread only ---
  absl::Time Tick();
  bool Busy() const { return active_transfers_ > 0 || populate_pending_; }
  Peer* FindPeer(PeerId id) {
    auto it = peers_.find(id);
    return it == peers_.end() ? nullptr : it->second.get();
  }
  absl::Status CreateEndpoint(Peer& p, const std::string& worker_address);
  absl::Status HandleDone(Peer& p, std::string_view payload);
  absl::Status HandleAck(Peer& p, std::string_view payload);
  std::string RegionFrame(RegionId id, const LocalRegion& region) const;
  // Unpacks the region's rkey on the peer's endpoint and, where UCX maps the peer's memory
  // into this process, schedules populating that mapping.
  absl::Status MapRemoteRegion(Peer& p, RemoteRegion& region);
  // Populates pending remote mappings for about `budget`; sets populate_pending_.
  void PopulateSome(absl::Duration budget);
  // Finishes endpoint closes that completed (or gave up); with `wait`, progresses until all
  // are done (bounded).
  void PollClosing(bool wait);
  void SweepOrphaned();
  void FinishPeerDown(Peer& p);
  // Moves a downed peer with unanswered GETs to parked_ (false when it has none).
  bool Park(std::unique_ptr<Peer>& owned, const absl::Status& why);
  // Ends parked GETs whose replies all landed; closes their endpoints once nothing is left.
  void SettleParked();
  // The peer behind `address` is a new process: its predecessor can no longer answer, so its
  // parked endpoint is closed and the GETs end (Unavailable).
  void ReleaseParkedReplacedBy(const std::string& address, uint64_t incarnation);
  // Force-closes a parked peer's endpoint; its GETs end once the close is done.
  void CloseParked(Parked parked);
  void Enqueue(std::unique_ptr<Transfer> t);
  void FailTransfer(PeerId peer, uint64_t id, absl::Status status);
  void Pump(Peer& p);
  bool IssueChunk(Peer& p, Transfer& t);
  void Retire(Peer& p, Transfer& t);
  void Deliver(InboundEvent event);

  const UcxTransportOptions options_;
  const uint64_t incarnation_ = internal::NewIncarnation();
  Capabilities caps_;
  std::string address_;
  // Declared in creation order: the context outlives the worker, the worker the thread.
  UcpContextPtr context_{nullptr, &ucp_cleanup};
  UcpWorkerPtr worker_{nullptr, &ucp_worker_destroy};
  std::string worker_address_;
  std::unique_ptr<ProgressThread> progress_;
  // Set (release) once progress_ holds the started thread: the loop may run its hooks before
  // Start() has returned, and they must not read progress_ (OnLoop) until then (UBSan found a
  // null member call there, and it was a data race on progress_).
  std::atomic<bool> loop_ready_{false};
  std::unique_ptr<ControlChannel> channel_;  // created and destroyed on the progress thread

  // Progress thread only.
  absl::flat_hash_map<PeerId, std::unique_ptr<Peer>> peers_;
  std::vector<Closing> closing_;
  // Transfers of peers that went down while UCX still held requests of theirs (a force close
  // can complete before the cancelled requests' callbacks run): kept until the callbacks ran,
  // then freed (SweepOrphaned).
  std::vector<std::unique_ptr<Transfer>> orphaned_;
  std::vector<Parked> parked_;
  absl::flat_hash_map<RegionId, LocalRegion> local_regions_;
  int64_t inflight_ops_ = 0;
  uint64_t inflight_bytes_ = 0;
  int64_t active_transfers_ = 0;  // transfers in peer queues
  bool populate_pending_ = false;
  // Last Post enqueued, DONE handled or ACK received: populating yields to transfers in either
  // direction (a receiver has no transfers of its own in flight).
  absl::Time last_transfer_event_ = absl::InfinitePast();
  absl::Time next_deadline_check_ = absl::InfinitePast();

  std::atomic<uint64_t> next_transfer_id_{1};

  // Snapshot for callers' validation; written by the progress thread.
  mutable absl::Mutex mu_;
  absl::flat_hash_map<PeerId, PeerInfo> peer_info_ ABSL_GUARDED_BY(mu_);
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
  if (options.listen_port < 0 || options.listen_port > 65535 || options.advertise_port < 0 ||
      options.advertise_port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("ports must be 0-65535, got listen_port ",
                                                   options.listen_port, ", advertise_port ",
                                                   options.advertise_port));
  }
  std::unique_ptr<UcxTransport> t(new UcxTransport(std::move(options)));
  KV_RETURN_IF_ERROR(t->Init());
  return t;
}

absl::Status UcxTransport::Init() {
  // Control listener first: a bad bind address is the likeliest configuration error.
  int bound_port = 0;
  KV_ASSIGN_OR_RETURN(ScopedFd listener,
                      ucx::ListenTcp(options_.listen_host, options_.listen_port, &bound_port));
  std::string host = options_.advertise_host;
  if (host.empty()) {
    host = options_.listen_host;
    if (ucx::IsWildcardHost(host)) {
      // Never advertise a wildcard: peers would connect to themselves.
      const int family = host == "::" ? AF_INET6 : AF_INET;
      absl::StatusOr<std::string> primary = ucx::PrimaryHostAddress(family);
      if (!primary.ok()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "listening on ", options_.listen_host,
            " and no advertise_host given, but this host has no address to advertise: ",
            primary.status().message()));
      }
      host = *primary;
      KV_LOG(INFO) << "transfer listener on "
                   << ucx::FormatHostPort(options_.listen_host, bound_port) << " advertises "
                   << host << " (this host's primary address; set advertise_host to choose)";
    }
  } else if (ucx::IsWildcardHost(host)) {
    return absl::InvalidArgumentError(
        absl::StrCat("advertise_host must name this host, got '", host, "'"));
  }
  address_ = ucx::FormatHostPort(
      host, options_.advertise_port != 0 ? options_.advertise_port : bound_port);

  KV_ASSIGN_OR_RETURN(context_, ucx::CreateContext(sizeof(OpRequest), options_.ucx_tcp_port_range));
  KV_ASSIGN_OR_RETURN(worker_, ucx::CreateWorker(context_.get()));
  KV_ASSIGN_OR_RETURN(worker_address_, ucx::WorkerAddress(worker_.get()));

  // Device blocks go on the wire directly only when UCX says it moves CUDA memory; otherwise
  // workers stage them through the (pinned) host pools. Logged once per process.
  absl::StatusOr<bool> cuda_query = ucx::SupportsCudaMemory(context_.get());
  const bool cuda = cuda_query.ok() && *cuda_query;
  static std::once_flag cuda_logged;
  std::call_once(cuda_logged, [&] {
    if (!cuda_query.ok()) {
      KV_LOG(WARNING) << "UCX memory types unknown (" << cuda_query.status()
                      << "): device memory is staged through host pools";
    } else {
      KV_LOG(INFO) << "UCX " << ucp_get_version_string()
                   << (cuda ? ": CUDA memory supported (device blocks can be registered directly)"
                            : ": no CUDA memory support (device blocks are staged through host "
                              "pools)");
    }
  });
  const char* tls = std::getenv("UCX_TLS");
  const bool enforced =
      ucx::HardwareEnforcedKeys(ucx::QueryUctComponents(), tls != nullptr ? tls : "");
  caps_ = Capabilities{
      .name = "ucx",
      .device_memory = cuda,
      .notifications = true,
      .pull = true,
      .max_blocks_per_batch = 1 << 20,
      .detail = absl::StrCat("UCX ", ucp_get_version_string(), ", UCX_TLS=",
                             tls != nullptr ? tls : "all", cuda ? "" : ", no CUDA memory support",
                             enforced ? ", RDMA (keys enforced by the NIC)" : ", no RDMA device"),
      .private_regions = true,
      .hardware_enforced_keys = enforced};

  ProgressThread::Hooks hooks;
  hooks.busy = [this] { return loop_ready_.load(std::memory_order_acquire) && Busy(); };
  hooks.tick = [this] {
    if (!loop_ready_.load(std::memory_order_acquire)) return absl::Now() + absl::Milliseconds(1);
    return Tick();
  };
  KV_ASSIGN_OR_RETURN(progress_, ProgressThread::Start(worker_.get(), std::move(hooks),
                                                       options_.spin_after_activity));
  loop_ready_.store(true, std::memory_order_release);
  progress_->RunSync([this, &listener] {
    channel_ = std::make_unique<ControlChannel>(
        progress_.get(), static_cast<ControlChannel::Delegate*>(this),
        ControlChannel::Options{.incarnation = incarnation_,
                                .advertised_address = address_,
                                .heartbeat_interval = options_.heartbeat_interval,
                                .peer_timeout = options_.peer_timeout});
    channel_->Start(std::move(listener));
  });
  return absl::OkStatus();
}

UcxTransport::~UcxTransport() {
  if (progress_ != nullptr) {
    progress_->RunSync([this] {
      // BYE to everyone, endpoints flushed (bounded) and closed.
      if (channel_ != nullptr) channel_->Shutdown(absl::CancelledError("transport shut down"));
      // Parked endpoints close too; their GETs end only once the worker is gone (below), when
      // no reply can land any more.
      for (Parked& pk : parked_) {
        std::unique_ptr<EndpointCloser> closer = pk.peer->ep.Close(false, absl::Now());
        closing_.push_back(Closing{std::move(closer), std::move(pk.peer)});
      }
      PollClosing(/*wait=*/true);
      channel_.reset();
      peers_.clear();
      local_regions_.clear();
      const absl::Time give_up = absl::Now() + absl::Seconds(2);
      while (!orphaned_.empty() && absl::Now() < give_up) {
        ucp_worker_progress(worker_.get());
        SweepOrphaned();
      }
    });
    progress_->Stop();
    progress_.reset();
  }
  if (!orphaned_.empty() || !parked_.empty()) {
    // UCX never called back: once the worker is gone it cannot, so the transfers are safe to
    // free after it.
    if (!orphaned_.empty()) {
      KV_LOG(WARNING) << orphaned_.size() << " transfers still had UCX requests at shutdown";
    }
    worker_.reset();
    orphaned_.clear();
    for (Parked& pk : parked_) {
      for (std::unique_ptr<Transfer>& t : pk.gets) {
        t->handle->Complete(absl::CancelledError(
            absl::StrCat("transport shut down while peer ", t->peer, " might still answer")));
      }
    }
    parked_.clear();
  }
  {
    absl::MutexLock lock(&handler_mu_);
    handler_ = nullptr;
  }
}

// --- Caller-thread API -----------------------------------------------------------------------

absl::StatusOr<MemoryRegionPtr> UcxTransport::RegisterMemory(MemorySpan span, MemoryKind kind) {
  return Register(span, kind, /*publish=*/true);
}

absl::StatusOr<MemoryRegionPtr> UcxTransport::AllocateMemory(size_t bytes) {
  return Allocate(bytes, /*publish=*/true);
}

absl::StatusOr<MemoryRegionPtr> UcxTransport::Register(MemorySpan span, MemoryKind kind,
                                                       bool publish) {
  if (span.data == nullptr || span.size_bytes == 0) {
    return absl::InvalidArgumentError("cannot register a null or empty memory span");
  }
  if (kind == MemoryKind::kDevice && !caps_.device_memory) {
    return absl::UnimplementedError(
        "this UCX build has no CUDA memory support; stage device memory through pinned host "
        "buffers");
  }
  // Every page mapped and touched now, so transfers from or into it take no faults.
  if (kind != MemoryKind::kDevice) {
    KV_RETURN_IF_ERROR(internal::PopulateForWrite(span.data, span.size_bytes));
  }
  const RegionId id = internal::NextRegionId();
  absl::Status status;
  progress_->RunSync([&] {
    absl::StatusOr<LocalRegion*> region = AddLocalRegion(
        id, span, UcpMemRegion::Map(context_.get(), span.data, span.size_bytes), publish);
    status = region.status();
    if (region.ok() && publish) channel_->Broadcast(RegionFrame(id, **region));
  });
  KV_RETURN_IF_ERROR(status);
  return MakeRegion(id, span, kind);
}

absl::StatusOr<MemoryRegionPtr> UcxTransport::Allocate(size_t bytes, bool publish) {
  if (bytes == 0) return absl::InvalidArgumentError("cannot allocate zero bytes");
  const RegionId id = internal::NextRegionId();
  absl::Status status;
  void* data = nullptr;
  progress_->RunSync([&] {
    absl::StatusOr<UcpMemRegion> mem = UcpMemRegion::Allocate(context_.get(), bytes, &data);
    status = AddLocalRegion(id, MemorySpan{data, bytes}, std::move(mem), publish).status();
  });
  KV_RETURN_IF_ERROR(status);
  // Every page mapped and touched now (zero-fill), not during the first transfer into it; then
  // publish. Huge pages where the kernel allows them for this memory.
  internal::AdviseHugePages(data, bytes, /*shared_memory=*/true);
  absl::Status populated = internal::PopulateForWrite(data, bytes);
  if (populated.ok()) std::memset(data, 0, bytes);
  progress_->RunSync([&] {
    auto it = local_regions_.find(id);
    if (it == local_regions_.end()) return;
    if (!populated.ok()) {
      local_regions_.erase(it);
      return;
    }
    if (publish) channel_->Broadcast(RegionFrame(id, it->second));
  });
  KV_RETURN_IF_ERROR(populated);
  return MakeRegion(id, MemorySpan{data, bytes}, MemoryKind::kHost);
}

absl::StatusOr<UcxTransport::LocalRegion*> UcxTransport::AddLocalRegion(
    RegionId id, MemorySpan span, absl::StatusOr<UcpMemRegion> mem, bool publish) {
  KV_DCHECK(OnLoop());
  KV_RETURN_IF_ERROR(mem.status());
  KV_ASSIGN_OR_RETURN(std::string rkey, mem->PackRemoteKey());
  return &local_regions_
              .insert_or_assign(id, LocalRegion{span, *std::move(mem), std::move(rkey), publish})
              .first->second;
}

MemoryRegionPtr UcxTransport::MakeRegion(RegionId id, MemorySpan span, MemoryKind kind) {
  {
    absl::MutexLock lock(&mu_);
    region_ptrs_[id] = span.data;
  }
  return std::make_unique<UcxRegion>(this, id, span, kind);
}

void UcxTransport::Deregister(RegionId id) {
  {
    absl::MutexLock lock(&mu_);
    region_ptrs_.erase(id);
  }
  progress_->RunSync([this, id] {
    auto it = local_regions_.find(id);
    if (it == local_regions_.end()) return;
    const bool published = it->second.published;
    local_regions_.erase(it);  // ucp_mem_unmap: on RDMA the NIC refuses its key from now on
    if (!published) return;    // nobody was told; importers' DONEs now name no local region
    wire::Writer w(FrameType::kRegionRemove);
    w.U64(id);
    channel_->Broadcast(std::move(w).Finish());
  });
}

// An exported key is a kRegionAdd frame (id, base, size, packed rkey) preceded by the
// exporter's incarnation, so it is never used on another process behind the same address.
absl::StatusOr<std::string> UcxTransport::ExportRegion(const MemoryRegion& region) const {
  if (region.owner() != this) {
    return absl::InvalidArgumentError(
        absl::StrCat("region ", region.id(), " is not this transport's"));
  }
  absl::StatusOr<std::string> out;
  progress_->RunSync([&] {
    auto it = local_regions_.find(region.id());
    if (it == local_regions_.end()) {
      out = absl::NotFoundError(absl::StrCat("region ", region.id(), " is not registered"));
      return;
    }
    if (it->second.published) {
      out = absl::InvalidArgumentError(absl::StrCat(
          "region ", region.id(), " is published to every peer; export private regions only"));
      return;
    }
    wire::Writer w(FrameType::kRegionAdd);
    w.U64(incarnation_);
    w.U64(region.id());
    w.U64(reinterpret_cast<uint64_t>(it->second.span.data));
    w.U64(it->second.span.size_bytes);
    w.Str(it->second.packed_rkey);
    out = std::move(w).Finish();
  });
  if (out.ok() && out->size() > kMaxExportedRegionBytes) {
    return absl::InternalError(absl::StrCat("exported key of ", out->size(), " bytes"));
  }
  return out;
}

absl::StatusOr<RegionId> UcxTransport::ImportRegion(PeerId peer, std::string_view exported) {
  if (exported.size() > kMaxExportedRegionBytes || exported.size() < 5) {
    return absl::InvalidArgumentError(absl::StrCat("exported region key: want 5 to ",
                                                   kMaxExportedRegionBytes, " bytes, got ",
                                                   exported.size()));
  }
  uint32_t length = 0;
  std::memcpy(&length, exported.data(), 4);
  if (length != exported.size() - 4 ||
      static_cast<FrameType>(exported[4]) != FrameType::kRegionAdd) {
    return absl::InvalidArgumentError("exported region key: malformed header");
  }
  wire::Reader r(exported.substr(5));
  uint64_t incarnation = 0;
  if (!r.U64(&incarnation)) return absl::InvalidArgumentError("exported region key: truncated");
  absl::StatusOr<frames::Region> announced = frames::DecodeRegion(r);
  if (!announced.ok() || !r.done()) {
    return absl::InvalidArgumentError("exported region key: truncated or trailing bytes");
  }
  {
    absl::MutexLock lock(&mu_);
    auto it = peer_info_.find(peer);
    if (it == peer_info_.end()) return absl::NotFoundError(absl::StrCat("unknown peer ", peer));
    if (!it->second.alive) return absl::UnavailableError(absl::StrCat("peer ", peer, " is gone"));
    if (it->second.incarnation != incarnation) {
      return absl::FailedPreconditionError(
          absl::StrCat("exported region key of transport incarnation ", incarnation, ", peer ",
                       peer, " is incarnation ", it->second.incarnation));
    }
  }
  const RegionId id = announced->id;
  absl::Status status;
  progress_->RunSync([&] {
    Peer* p = FindPeer(peer);
    if (p == nullptr) {
      status = absl::UnavailableError(absl::StrCat("peer ", peer, " is gone"));
      return;
    }
    RemoteRegion region;
    region.base = announced->base;
    region.size = announced->size;
    region.packed_rkey = std::move(announced->packed_rkey);
    status = MapRemoteRegion(*p, region);
    if (!status.ok()) return;
    p->regions[id] = std::move(region);
    absl::MutexLock lock(&mu_);
    peer_info_[peer].region_sizes[id] = announced->size;
  });
  KV_RETURN_IF_ERROR(status);
  return id;
}

absl::Status UcxTransport::ForgetRegion(PeerId peer, RegionId region) {
  absl::Status status;
  progress_->RunSync([&] {
    Peer* p = FindPeer(peer);
    if (p == nullptr || p->regions.erase(region) == 0) {
      status = absl::NotFoundError(absl::StrCat("peer ", peer, " has no imported region ", region));
      return;
    }
    absl::MutexLock lock(&mu_);
    auto it = peer_info_.find(peer);
    if (it != peer_info_.end()) it->second.region_sizes.erase(region);
  });
  return status;
}

absl::StatusOr<PeerId> UcxTransport::Connect(std::string_view address_view, absl::Time deadline,
                                             const ConnectOptions& options) {
  const std::string address(address_view);
  if (options.peer_key.size() > kMaxPeerKeyBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("peer_key of ", options.peer_key.size(), " bytes exceeds ", kMaxPeerKeyBytes));
  }
  KV_RETURN_IF_ERROR(ucx::ParseHostPort(address).status());
  {
    // A live connection we opened to this address is reused; a dead one never is.
    absl::MutexLock lock(&mu_);
    for (const auto& [id, info] : peer_info_) {
      if (info.alive && info.outgoing && info.address == address) return id;
    }
  }
  KV_ASSIGN_OR_RETURN(ScopedFd fd, ucx::ConnectTcp(address, deadline));
  auto waiter = std::make_shared<ConnectWaiter>();
  progress_->Post([this, fd = std::move(fd), address, waiter, key = options.peer_key]() mutable {
    channel_->Adopt(std::move(fd), /*outgoing=*/true, address, waiter, std::move(key));
  });
  if (!waiter->done.WaitForNotificationWithDeadline(deadline)) {
    progress_->Post([this, waiter] {
      const absl::Status late = absl::DeadlineExceededError("handshake timed out");
      waiter->Finish(late);
      if (waiter->peer != 0) channel_->Close(waiter->peer, late, PeerDownKind::kLocal, true);
    });
    return absl::DeadlineExceededError(
        absl::StrCat("handshake with ", address, " not done before the deadline"));
  }
  return waiter->result;
}

absl::Status UcxTransport::Disconnect(PeerId peer) {
  absl::Status status = absl::NotFoundError(absl::StrCat("unknown peer ", peer));
  progress_->RunSync([&] {
    if (FindPeer(peer) == nullptr || !channel_->IsReady(peer)) return;
    status = absl::OkStatus();
    channel_->Close(peer,
                    absl::CancelledError(absl::StrCat("peer ", peer, " disconnected locally")),
                    PeerDownKind::kLocal, /*say_bye=*/true);
  });
  return status;
}

absl::StatusOr<PeerStatus> UcxTransport::GetPeerStatus(PeerId peer) const {
  absl::MutexLock lock(&mu_);
  auto it = peer_info_.find(peer);
  if (it == peer_info_.end()) return absl::NotFoundError(absl::StrCat("unknown peer ", peer));
  const PeerInfo& info = it->second;
  return PeerStatus{.id = peer,
                    .address = info.address,
                    .incarnation = info.incarnation,
                    .alive = info.alive,
                    .down_reason = info.down_reason,
                    .unpopulated_bytes = info.unpopulated_bytes};
}

absl::StatusOr<std::vector<RemoteRegionInfo>> UcxTransport::RemoteRegions(PeerId peer) const {
  absl::MutexLock lock(&mu_);
  auto it = peer_info_.find(peer);
  if (it == peer_info_.end()) return absl::NotFoundError(absl::StrCat("unknown peer ", peer));
  if (!it->second.alive) {
    return absl::UnavailableError(
        absl::StrCat("peer ", peer, " is gone: ", it->second.down_reason.message()));
  }
  std::vector<RemoteRegionInfo> out;
  for (const auto& [id, size] : it->second.region_sizes) out.push_back({id, size});
  std::sort(out.begin(), out.end(),
            [](const RemoteRegionInfo& a, const RemoteRegionInfo& b) { return a.id < b.id; });
  return out;
}

std::vector<PeerId> UcxTransport::Peers() const {
  absl::MutexLock lock(&mu_);
  std::vector<PeerId> out;
  for (const auto& [id, info] : peer_info_) {
    if (info.alive) out.push_back(id);
  }
  return out;
}

absl::StatusOr<TransferPlan> UcxTransport::Prepare(const TransferBatch& batch) {
  absl::MutexLock lock(&mu_);
  auto it = peer_info_.find(batch.peer);
  if (it == peer_info_.end()) return absl::NotFoundError(absl::StrCat("unknown peer ", batch.peer));
  if (!it->second.alive) {
    return absl::UnavailableError(absl::StrCat("peer ", batch.peer, " is gone"));
  }
  const PeerInfo& info = it->second;
  // Called back by BuildPlan below while `lock` is held; the analysis cannot follow a lock
  // into a callback.
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
    auto it = peer_info_.find(plan.peer);
    if (it == peer_info_.end() || !it->second.alive) {
      return absl::UnavailableError(absl::StrCat("peer ", plan.peer, " is gone"));
    }
  }
  auto t = std::make_unique<Transfer>();
  t->owner = this;
  t->id = next_transfer_id_.fetch_add(1);
  t->peer = plan.peer;
  t->direction = plan.direction;
  t->tag = plan.tag;
  t->credential = plan.credential;
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
    auto it = peer_info_.find(peer);
    if (it == peer_info_.end()) return absl::NotFoundError(absl::StrCat("unknown peer ", peer));
    if (!it->second.alive) return absl::UnavailableError(absl::StrCat("peer ", peer, " is gone"));
  }
  progress_->Post([this, peer, tag, msg = std::string(message)]() mutable {
    Peer* p = FindPeer(peer);
    if (p == nullptr) return;
    p->queue.push_back(QueueItem{nullptr, tag, std::move(msg)});
    Pump(*p);
  });
  return absl::OkStatus();
}

// --- Progress thread: the control channel's callbacks --------------------------------------

void UcxTransport::WriteHelloBody(wire::Writer& w) {
  KV_DCHECK(OnLoop());
  w.Str(worker_address_);
  uint32_t published = 0;
  for (const auto& [id, r] : local_regions_) published += r.published ? 1 : 0;
  w.U32(published);
  for (const auto& [id, r] : local_regions_) {
    if (!r.published) continue;
    w.U64(id);
    w.U64(reinterpret_cast<uint64_t>(r.span.data));
    w.U64(r.span.size_bytes);
    w.Str(r.packed_rkey);
  }
}

std::string UcxTransport::RegionFrame(RegionId id, const LocalRegion& r) const {
  wire::Writer w(FrameType::kRegionAdd);
  w.U64(id);
  w.U64(reinterpret_cast<uint64_t>(r.span.data));
  w.U64(r.span.size_bytes);
  w.Str(r.packed_rkey);
  return std::move(w).Finish();
}

absl::Status UcxTransport::OnHello(PeerId id, bool outgoing, const std::string& address,
                                   const PeerHello& hello, wire::Reader& r) {
  KV_DCHECK(OnLoop());
  KV_ASSIGN_OR_RETURN(frames::HelloBody body, frames::DecodeHelloBody(r));
  if (!parked_.empty()) ReleaseParkedReplacedBy(address, hello.incarnation);
  // Registered first, so that OnPeerDown cleans up whatever a failure below leaves.
  auto owned = std::make_unique<Peer>();
  Peer& p = *owned;
  p.id = id;
  peers_[id] = std::move(owned);
  PeerInfo info;
  info.outgoing = outgoing;
  info.address = address;
  info.incarnation = hello.incarnation;
  for (frames::Region& announced : body.regions) {
    RemoteRegion region;
    region.base = announced.base;
    region.size = announced.size;
    region.packed_rkey = std::move(announced.packed_rkey);
    info.region_sizes[announced.id] = region.size;
    p.regions[announced.id] = std::move(region);
  }
  KV_RETURN_IF_ERROR(CreateEndpoint(p, body.worker_address));
  for (auto& [rid, region] : p.regions) {
    KV_RETURN_IF_ERROR(MapRemoteRegion(p, region));
    if (region.mapped != nullptr) info.unpopulated_bytes += region.size;
  }
  absl::MutexLock lock(&mu_);
  peer_info_[id] = std::move(info);
  return absl::OkStatus();
}

absl::Status UcxTransport::OnFrame(PeerId id, FrameType type, wire::Reader& r) {
  KV_DCHECK(OnLoop());
  Peer* p = FindPeer(id);
  if (p == nullptr) return absl::InternalError(absl::StrCat("no state for peer ", id));
  switch (type) {
    case FrameType::kRegionAdd: {
      absl::StatusOr<frames::Region> announced = frames::DecodeRegion(r);
      if (!announced.ok()) return absl::InvalidArgumentError("truncated region frame");
      const uint64_t rid = announced->id;
      const uint64_t size = announced->size;
      RemoteRegion region;
      region.base = announced->base;
      region.size = size;
      region.packed_rkey = std::move(announced->packed_rkey);
      KV_RETURN_IF_ERROR(MapRemoteRegion(*p, region));
      p->regions[rid] = std::move(region);
      absl::MutexLock lock(&mu_);
      peer_info_[id].region_sizes[rid] = size;
      return absl::OkStatus();
    }
    case FrameType::kRegionRemove: {
      uint64_t rid;
      if (!r.U64(&rid)) return absl::InvalidArgumentError("truncated region-remove frame");
      p->regions.erase(rid);
      absl::MutexLock lock(&mu_);
      peer_info_[id].region_sizes.erase(rid);
      return absl::OkStatus();
    }
    case FrameType::kDone: {
      std::string_view rest;
      r.Rest(&rest);
      return HandleDone(*p, rest);
    }
    case FrameType::kAck: {
      std::string_view rest;
      r.Rest(&rest);
      return HandleAck(*p, rest);
    }
    case FrameType::kControl: {
      std::string_view rest;
      r.Rest(&rest);
      KV_ASSIGN_OR_RETURN(frames::Control control, frames::DecodeControl(rest));
      Deliver(InboundEvent{.kind = InboundEvent::Kind::kControl,
                           .peer = id,
                           .tag = control.tag,
                           .message = std::move(control.message)});
      return absl::OkStatus();
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unknown frame type ", static_cast<int>(type)));
  }
}

absl::Status UcxTransport::CreateEndpoint(Peer& p, const std::string& worker_address) {
  using Mode = UcxTransportOptions::ErrorMode;
  p.err_arg = std::make_unique<EpErrorArg>(EpErrorArg{this, p.id});
  ucp_err_handler_t handler = {};
  handler.cb = &UcxTransport::OnEpError;
  handler.arg = p.err_arg.get();
  absl::StatusOr<UcpEndpoint> ep;
  if (options_.error_mode == Mode::kNone ||
      (options_.error_mode == Mode::kAuto && !PeerErrorModeByDefault())) {
    // See PeerErrorModeByDefault: the heartbeat covers peer failures.
    ep = UcpEndpoint::Create(worker_.get(), worker_address, nullptr);
  } else {
    ep = UcpEndpoint::Create(worker_.get(), worker_address, &handler);
    if (!ep.ok() && options_.error_mode == Mode::kAuto) {
      KV_LOG(DEBUG) << "UCX endpoint with error mode PEER unsupported (" << ep.status()
                    << "); using NONE + heartbeat";
      ep = UcpEndpoint::Create(worker_.get(), worker_address, nullptr);
    }
  }
  if (!ep.ok()) return ep.status();
  p.ep = std::move(*ep);
  return absl::OkStatus();
}

void UcxTransport::OnEpError(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* a = static_cast<EpErrorArg*>(arg);
  UcxTransport* self = a->owner;
  PeerId peer = a->peer;
  // Not from inside UCX's callback: closing the endpoint progresses the worker.
  self->progress_->Post([self, peer, status] {
    if (self->channel_ != nullptr) {
      self->channel_->Close(peer, FromUcs(status, "UCX data endpoint failed"), PeerDownKind::kLost,
                            /*say_bye=*/false);
    }
  });
}

void UcxTransport::OnPeerDown(PeerId id, const absl::Status& status, PeerDownKind kind) {
  KV_DCHECK(OnLoop());
  if (kind == PeerDownKind::kLost) {
    KV_LOG(WARNING) << "transfer peer " << id << " down: " << status;
  }
  {
    absl::MutexLock lock(&mu_);
    auto it = peer_info_.find(id);
    if (it != peer_info_.end()) {
      it->second.alive = false;
      it->second.down_reason = status;
      it->second.unpopulated_bytes = 0;
      it->second.region_sizes.clear();
    }
  }
  auto it = peers_.find(id);
  if (it == peers_.end()) return;
  std::unique_ptr<Peer> owned = std::move(it->second);
  peers_.erase(it);
  Peer& p = *owned;
  for (QueueItem& item : p.queue) {
    if (item.transfer && item.transfer->failure.ok()) item.transfer->failure = status;
  }
  for (auto& [tid, t] : p.awaiting_ack) t->handle->Complete(status);
  p.awaiting_ack.clear();
  if (kind != PeerDownKind::kLocal) {
    Deliver(InboundEvent{.kind = InboundEvent::Kind::kPeerDown, .peer = id, .status = status});
  }
  if (Park(owned, status)) return;
  // Closing completes every request still in flight on the endpoint (with an error); the
  // transfers using them end in FinishPeerDown, once UCX no longer references them. We flush
  // first only when we chose to close; towards a lost peer a flush can hang.
  const bool graceful = kind == PeerDownKind::kLocal;
  std::unique_ptr<EndpointCloser> closer =
      p.ep.Close(graceful, absl::Now() + options_.endpoint_flush_timeout);
  if (closer->Poll(absl::Now())) {
    FinishPeerDown(p);
    return;
  }
  closing_.push_back(Closing{std::move(closer), std::move(owned)});
}

void UcxTransport::PollClosing(bool wait) {
  KV_DCHECK(OnLoop());
  const absl::Time give_up_all = absl::Now() + absl::Seconds(10);
  while (!closing_.empty()) {
    const absl::Time now = absl::Now();
    std::vector<Closing> still;
    for (Closing& cl : closing_) {
      if (!cl.closer->Poll(now)) {
        still.push_back(std::move(cl));
        continue;
      }
      FinishPeerDown(*cl.peer);
    }
    closing_.swap(still);
    SweepOrphaned();
    if (!wait || closing_.empty() || now > give_up_all) return;
    ucp_worker_progress(worker_.get());
  }
}

void UcxTransport::FinishPeerDown(Peer& p) {
  KV_DCHECK(OnLoop());
  for (QueueItem& item : p.queue) {
    if (!item.transfer) continue;
    --active_transfers_;
    item.transfer->handle->Complete(item.transfer->failure);
    if (item.transfer->inflight > 0 || item.transfer->flush_inflight) {
      // UCX still references it: its requests complete (cancelled) on a later progress call.
      orphaned_.push_back(std::move(item.transfer));
    }
  }
  p.queue.clear();
  p.regions.clear();  // destroys unpacked rkeys
}

bool UcxTransport::Park(std::unique_ptr<Peer>& owned, const absl::Status& why) {
  KV_DCHECK(OnLoop());
  Peer& p = *owned;
  const bool unanswered = std::any_of(p.queue.begin(), p.queue.end(), [](const QueueItem& item) {
    return item.transfer != nullptr && item.transfer->direction == Direction::kGet &&
           item.transfer->inflight > 0;
  });
  if (!unanswered) return false;
  Parked parked;
  {
    absl::MutexLock lock(&mu_);
    auto it = peer_info_.find(p.id);
    if (it != peer_info_.end()) {
      parked.address = it->second.address;
      parked.incarnation = it->second.incarnation;
    }
  }
  parked.why = why;
  for (QueueItem& item : p.queue) {
    if (!item.transfer) continue;
    --active_transfers_;
    std::unique_ptr<Transfer> t = std::move(item.transfer);
    if (t->direction == Direction::kGet && t->inflight > 0) {
      parked.gets.push_back(std::move(t));
      continue;
    }
    t->handle->Complete(t->failure);
    if (t->inflight > 0 || t->flush_inflight) parked.others.push_back(std::move(t));
  }
  p.queue.clear();
  KV_LOG(WARNING) << "transfer peer " << p.id << " (" << parked.address << ") went down with "
                  << parked.gets.size()
                  << " pulls unanswered: its endpoint stays open and their destinations stay "
                     "held until the replies land or a new process takes its address";
  parked.peer = std::move(owned);
  parked_.push_back(std::move(parked));
  return true;
}

void UcxTransport::SettleParked() {
  KV_DCHECK(OnLoop());
  std::vector<Parked> still;
  std::vector<Parked> settled;
  for (Parked& pk : parked_) {
    std::erase_if(pk.gets, [](const std::unique_ptr<Transfer>& t) {
      if (t->inflight > 0) return false;
      t->handle->Complete(t->failure);
      return true;
    });
    std::erase_if(pk.others, [](const std::unique_ptr<Transfer>& t) {
      return t->inflight == 0 && !t->flush_inflight;
    });
    (pk.gets.empty() ? settled : still).push_back(std::move(pk));
  }
  parked_.swap(still);
  for (Parked& pk : settled) {
    KV_LOG(INFO) << "transfer peer " << pk.peer->id << " (" << pk.address
                 << ") answered its parked pulls; closing its endpoint";
    CloseParked(std::move(pk));
  }
}

void UcxTransport::ReleaseParkedReplacedBy(const std::string& address, uint64_t incarnation) {
  KV_DCHECK(OnLoop());
  std::vector<Parked> still;
  std::vector<Parked> replaced;
  for (Parked& pk : parked_) {
    const bool gone = pk.address == address && pk.incarnation != incarnation;
    (gone ? replaced : still).push_back(std::move(pk));
  }
  parked_.swap(still);
  for (Parked& pk : replaced) {
    KV_LOG(INFO) << "a new process at " << address << " replaced transfer peer " << pk.peer->id
                 << ": its " << pk.gets.size() << " parked pulls end unanswered";
    CloseParked(std::move(pk));
  }
}

void UcxTransport::CloseParked(Parked parked) {
  KV_DCHECK(OnLoop());
  Peer& p = *parked.peer;
  // The GETs end (with the peer's down status) once the close is done: FinishPeerDown.
  for (std::unique_ptr<Transfer>& t : parked.gets) {
    ++active_transfers_;
    p.queue.push_back(QueueItem{std::move(t)});
  }
  for (std::unique_ptr<Transfer>& t : parked.others) orphaned_.push_back(std::move(t));
  std::unique_ptr<EndpointCloser> closer = p.ep.Close(/*graceful=*/false, absl::Now());
  if (closer->Poll(absl::Now())) {
    FinishPeerDown(p);
    return;
  }
  closing_.push_back(Closing{std::move(closer), std::move(parked.peer)});
}

void UcxTransport::SweepOrphaned() {
  std::erase_if(orphaned_, [](const std::unique_ptr<Transfer>& t) {
    return t->inflight == 0 && !t->flush_inflight;
  });
}

void UcxTransport::Deliver(InboundEvent event) {
  absl::ReaderMutexLock lock(&handler_mu_);
  if (handler_) handler_(std::move(event));
}

// --- Progress thread: transfers --------------------------------------------------------------

void UcxTransport::Enqueue(std::unique_ptr<Transfer> t) {
  Peer* p = FindPeer(t->peer);
  if (p == nullptr) {
    t->handle->Complete(absl::UnavailableError(absl::StrCat("peer ", t->peer, " is gone")));
    return;
  }
  ++active_transfers_;
  last_transfer_event_ = absl::Now();
  p->queue.push_back(QueueItem{std::move(t)});
  Pump(*p);
}

void UcxTransport::FailTransfer(PeerId peer, uint64_t id, absl::Status status) {
  KV_DCHECK(OnLoop());
  Peer* p = FindPeer(peer);
  if (p == nullptr) return;
  auto it = p->awaiting_ack.find(id);
  if (it != p->awaiting_ack.end()) {
    it->second->handle->Complete(status);
    p->awaiting_ack.erase(it);
    return;
  }
  for (QueueItem& item : p->queue) {
    if (item.transfer && item.transfer->id == id && item.transfer->failure.ok()) {
      item.transfer->failure = status;
    }
  }
  Pump(*p);
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

bool UcxTransport::IssueChunk(Peer& p, Transfer& t) {
  const Chunk& chunk = t.chunks[t.next_chunk];
  auto rit = p.regions.find(chunk.remote_region);
  if (rit == p.regions.end() || chunk.remote_offset + chunk.length > rit->second.size) {
    t.failure =
        absl::NotFoundError(absl::StrCat("peer ", p.id, " withdrew region ", chunk.remote_region));
    return false;
  }
  RemoteRegion& region = rit->second;
  if (region.rkey == nullptr) {
    t.failure = absl::InternalError(absl::StrCat("region ", chunk.remote_region, " has no rkey"));
    return false;
  }
  ucp_request_param_t param = {};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = &UcxTransport::OnOpDone;
  param.user_data = &t;
  const uint64_t remote_addr = region.base + chunk.remote_offset;
  ucs_status_ptr_t req = t.direction == Direction::kPut
                             ? ucp_put_nbx(p.ep.get(), chunk.local, chunk.length, remote_addr,
                                           region.rkey.get(), &param)
                             : ucp_get_nbx(p.ep.get(), chunk.local, chunk.length, remote_addr,
                                           region.rkey.get(), &param);
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

absl::Status UcxTransport::MapRemoteRegion(Peer& p, RemoteRegion& region) {
  KV_ASSIGN_OR_RETURN(region.rkey, ucx::UnpackRemoteKey(p.ep.get(), region.packed_rkey));
  void* local = nullptr;
  // UCS_OK only where UCX mapped the peer's segment here (shared memory); over tcp or RDMA the
  // bytes are moved by the NIC or the peer, so there is nothing of ours to populate.
  if (ucp_rkey_ptr(region.rkey.get(), region.base, &local) == UCS_OK && local != nullptr) {
    region.mapped = static_cast<uint8_t*>(local);
    region.populated = 0;
    populate_pending_ = true;
  }
  return absl::OkStatus();
}

void UcxTransport::PopulateSome(absl::Duration budget) {
  // A turn takes at least one piece: 1 MiB is ~1 ms here (8 MiB pieces held the thread for
  // 6-50 ms, a stall of every DONE and ACK behind them).
  constexpr uint64_t kPiece = 1 << 20;
  const absl::Time stop = absl::Now() + budget;
  bool pending = false;
  KV_DCHECK(OnLoop());
  for (auto& [pid, peer] : peers_) {
    uint64_t unpopulated = 0;
    // Not captured as a structured binding: clang before 16 cannot.
    absl::Cleanup publish = [&, peer_id = pid] {
      absl::MutexLock lock(&mu_);
      auto it = peer_info_.find(peer_id);
      if (it != peer_info_.end()) it->second.unpopulated_bytes = unpopulated;
    };
    for (auto& [rid, region] : peer->regions) {
      while (region.mapped != nullptr && region.populated < region.size) {
        if (absl::Now() >= stop) {
          pending = true;
          break;
        }
        const uint64_t n = std::min<uint64_t>(kPiece, region.size - region.populated);
        absl::Status st = internal::PopulateForWrite(region.mapped + region.populated, n);
        if (!st.ok()) {
          // Not fatal: transfers then take the faults themselves.
          KV_LOG(WARNING) << "populating peer " << pid << "'s region " << rid << ": " << st;
          region.populated = region.size;
          break;
        }
        region.populated += n;
      }
      if (region.mapped != nullptr) unpopulated += region.size - region.populated;
    }
  }
  populate_pending_ = pending;
}

void UcxTransport::Pump(Peer& p) {
  KV_DCHECK(OnLoop());
  // Issue: transfers in order, sharing the transport-wide window. Operations that complete in
  // place (shared memory: a memcpy, page faults included) do not fill the window, so each call
  // also stops after `max_inflight_bytes`: the loop then serves sockets and heartbeats before
  // the next call continues.
  uint64_t budget = options_.max_inflight_bytes;
  for (QueueItem& item : p.queue) {
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
      if (!IssueChunk(p, t)) break;
    }
    if (t.direction == Direction::kPut && t.failure.ok() && t.next_chunk == t.chunks.size() &&
        !t.flush_inflight && !t.flushed) {
      ucp_request_param_t param = {};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      param.cb.send = &UcxTransport::OnFlushDone;
      param.user_data = &t;
      ucs_status_ptr_t req = ucp_ep_flush_nbx(p.ep.get(), &param);
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
  while (!p.queue.empty()) {
    QueueItem& item = p.queue.front();
    if (!item.transfer) {
      wire::Writer w(FrameType::kControl);
      w.U64(item.tag);
      w.Str(item.message);
      channel_->Send(p.id, std::move(w).Finish());
      p.queue.pop_front();
      continue;
    }
    Transfer& t = *item.transfer;
    if (t.inflight > 0 || t.flush_inflight) break;
    if (t.failure.ok()) {
      if (t.next_chunk < t.chunks.size()) break;
      if (t.direction == Direction::kPut && !t.flushed) break;
    }
    std::unique_ptr<Transfer> owned = std::move(item.transfer);
    p.queue.pop_front();
    --active_transfers_;
    Retire(p, *owned);
    if (owned->failure.ok() && owned->direction == Direction::kPut) {
      p.awaiting_ack[owned->id] = std::move(owned);
    }
  }
}

void UcxTransport::Retire(Peer& p, Transfer& t) {
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
  w.Str(t.credential);
  channel_->Send(p.id, std::move(w).Finish());
}

absl::Status UcxTransport::HandleDone(Peer& p, std::string_view payload) {
  KV_ASSIGN_OR_RETURN(frames::Done done, frames::DecodeDone(payload));
  last_transfer_event_ = absl::Now();
  const uint64_t id = done.transfer_id;
  const uint32_t n = static_cast<uint32_t>(done.blocks.size());
  InboundEvent event{.kind = InboundEvent::Kind::kBlocks,
                     .peer = p.id,
                     .tag = done.tag,
                     .layers = LayerRange{done.layer_begin, done.layer_end},
                     .credential = std::move(done.credential)};
  event.blocks.reserve(n);
  std::vector<absl::Status> statuses;
  statuses.reserve(n);
  for (const frames::DoneBlock& sent : done.blocks) {
    ReceivedBlock b;
    b.region = sent.region;
    b.offset = sent.offset;
    b.length = sent.length;
    b.checksum = sent.checksum;
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
  channel_->Send(p.id, std::move(w).Finish());
  return absl::OkStatus();
}

absl::Status UcxTransport::HandleAck(Peer& p, std::string_view payload) {
  KV_ASSIGN_OR_RETURN(frames::Ack ack, frames::DecodeAck(payload));
  last_transfer_event_ = absl::Now();
  const uint64_t id = ack.transfer_id;
  const std::string& first_error = ack.first_error;
  std::vector<absl::Status> statuses;
  statuses.reserve(ack.codes.size());
  bool first = true;
  for (uint8_t code : ack.codes) {
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
  if (!printed && std::getenv("KVRELAY_UCX_EP_INFO") != nullptr && p.ep) {
    printed = true;
    ucp_ep_print_info(p.ep.get(), stderr);
  }
  auto it = p.awaiting_ack.find(id);
  if (it == p.awaiting_ack.end()) return absl::OkStatus();  // cancelled meanwhile
  if (statuses.size() != it->second->blocks.size()) {
    return absl::InvalidArgumentError("ack block count does not match the transfer");
  }
  it->second->handle->CompleteBlocks(std::move(statuses));
  p.awaiting_ack.erase(it);
  return absl::OkStatus();
}

absl::Time UcxTransport::Tick() {
  KV_DCHECK(OnLoop());
  if (!closing_.empty()) PollClosing(/*wait=*/false);
  if (!orphaned_.empty()) SweepOrphaned();
  if (!parked_.empty()) SettleParked();
  // A few milliseconds per turn while transfers run in either direction (they come first),
  // more when idle.
  if (populate_pending_) {
    const bool transfers_running =
        active_transfers_ > 0 || absl::Now() - last_transfer_event_ < absl::Milliseconds(100);
    PopulateSome(transfers_running ? absl::Milliseconds(2) : absl::Milliseconds(20));
  }
  for (auto& [id, p] : peers_) {
    if (!p->queue.empty()) Pump(*p);
  }
  const absl::Time now = absl::Now();
  bool any_pending = false;
  if (now >= next_deadline_check_) {
    next_deadline_check_ = now + absl::Milliseconds(1);
    for (auto& [id, p] : peers_) {
      std::vector<uint64_t> expired;
      for (QueueItem& item : p->queue) {
        if (item.transfer && item.transfer->failure.ok() && now >= item.transfer->deadline) {
          item.transfer->failure = absl::DeadlineExceededError(
              absl::StrCat(DirectionName(item.transfer->direction), " of ",
                           item.transfer->blocks.size(), " blocks missed its deadline"));
        }
      }
      for (auto& [tid, t] : p->awaiting_ack) {
        if (now >= t->deadline) expired.push_back(tid);
      }
      for (uint64_t tid : expired) {
        p->awaiting_ack[tid]->handle->Complete(
            absl::DeadlineExceededError("no acknowledgement from the receiver by the deadline"));
        p->awaiting_ack.erase(tid);
      }
      if (!p->awaiting_ack.empty() || !p->queue.empty()) any_pending = true;
      if (!p->queue.empty()) Pump(*p);
    }
  }
  // Heartbeats and liveness (may take peers down, which edits peers_: not inside the loops).
  absl::Time next = now + absl::Milliseconds(50);
  if (channel_ != nullptr) {
    next = channel_->Tick(now);
    // Everything this loop turn queued (DONEs, ACKs, CONTROL, heartbeats) in one send per peer,
    // before the loop may sleep; frames queued by socket callbacks go out on the next turn,
    // which follows at once.
    channel_->FlushPending();
  }
  if (any_pending || !closing_.empty() || !orphaned_.empty() || populate_pending_) {
    next = std::min(next, now + absl::Milliseconds(1));
  }
  return next;
}

}  // namespace

absl::StatusOr<TransportPtr> MakeUcxTransport(UcxTransportOptions options) {
  KV_ASSIGN_OR_RETURN(std::unique_ptr<UcxTransport> t, UcxTransport::Create(std::move(options)));
  return TransportPtr(std::move(t));
}

}  // namespace kvrelay::transfer

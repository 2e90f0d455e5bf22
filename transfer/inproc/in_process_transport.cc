#include "transfer/inproc/in_process_transport.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <thread>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "transfer/internal/handle_state.h"

namespace kvrelay::transfer {
namespace {

using internal::HandleState;

std::atomic<uint64_t> g_next_name{1};

// Everything a peer may touch; shared so a peer can outlive us safely. Lock order: handler_mu
// before mu.
struct Core {
  std::string name;
  const uint64_t incarnation = internal::NewIncarnation();
  uint64_t copy_chunk_bytes = 0;
  // Readers: copies into/out of our regions and handler lookups. Writer: register,
  // deregister, shutdown.
  absl::Mutex mu;
  bool alive ABSL_GUARDED_BY(mu) = true;
  std::string accept_key ABSL_GUARDED_BY(mu);  // Transport::SetAcceptKey
  absl::flat_hash_map<RegionId, MemorySpan> regions ABSL_GUARDED_BY(mu);
  struct PeerLink {
    std::shared_ptr<Core> remote;
    PeerId id_at_remote = 0;
    bool outgoing = false;  // we connected (Connect reuses it)
  };
  absl::flat_hash_map<PeerId, PeerLink> peers ABSL_GUARDED_BY(mu);
  // Peers that went away, for GetPeerStatus.
  absl::flat_hash_map<PeerId, PeerStatus> gone ABSL_GUARDED_BY(mu);

  // Drops the link to `peer` (if any), remembering why.
  void ForgetPeer(PeerId peer, absl::Status why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto it = peers.find(peer);
    if (it == peers.end()) return;
    gone[peer] = PeerStatus{.id = peer,
                            .address = absl::StrCat("inproc:", it->second.remote->name),
                            .incarnation = it->second.remote->incarnation,
                            .alive = false,
                            .down_reason = std::move(why)};
    peers.erase(it);
  }
  PeerId next_peer ABSL_GUARDED_BY(mu) = 1;
  // Held shared while the handler runs, exclusively when it is replaced or at shutdown.
  absl::Mutex handler_mu;
  InboundHandler handler ABSL_GUARDED_BY(handler_mu);

  void Deliver(InboundEvent event) {
    absl::ReaderMutexLock lock(&handler_mu);
    if (handler) handler(std::move(event));
  }
};

class Registry {
 public:
  static Registry& Get() {
    static Registry* r = new Registry;
    return *r;
  }
  bool Add(const std::string& name, std::shared_ptr<Core> core) {
    absl::MutexLock lock(&mu_);
    return cores_.emplace(name, std::move(core)).second;
  }
  void Remove(const std::string& name) {
    absl::MutexLock lock(&mu_);
    cores_.erase(name);
  }
  std::shared_ptr<Core> Find(const std::string& name) {
    absl::MutexLock lock(&mu_);
    auto it = cores_.find(name);
    return it == cores_.end() ? nullptr : it->second;
  }

 private:
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Core>> cores_ ABSL_GUARDED_BY(mu_);
};

class InProcessRegion final : public MemoryRegion {
 public:
  InProcessRegion(const void* owner, RegionId id, MemorySpan span, MemoryKind kind,
                  std::shared_ptr<Core> core, bool owns_memory = false)
      : MemoryRegion(owner, id, span, kind), core_(std::move(core)), owns_(owns_memory) {}
  ~InProcessRegion() override {
    {
      absl::MutexLock lock(&core_->mu);
      core_->regions.erase(id());
    }
    if (owns_) std::free(span().data);
  }

 private:
  std::shared_ptr<Core> core_;
  bool owns_;
};

struct Job {
  enum class Kind { kTransfer, kControl } kind = Kind::kTransfer;
  PeerId peer = 0;
  Direction direction = Direction::kPut;
  uint64_t tag = 0;
  std::string credential;
  LayerRange layers;
  std::vector<BlockTransfer> blocks;
  absl::Time deadline = absl::InfiniteFuture();
  std::shared_ptr<HandleState> handle;
  std::string message;
};

class InProcessTransport final : public Transport {
 public:
  explicit InProcessTransport(std::shared_ptr<Core> core) : core_(std::move(core)) {
    worker_ = std::thread([this] { WorkerLoop(); });
  }

  ~InProcessTransport() override {
    Registry::Get().Remove(core_->name);
    {
      absl::MutexLock lock(&queue_mu_);
      stopping_ = true;
    }
    worker_.join();
    absl::flat_hash_map<PeerId, Core::PeerLink> peers;
    {
      absl::MutexLock handler_lock(&core_->handler_mu);  // no handler runs after this
      core_->handler = nullptr;
      absl::MutexLock lock(&core_->mu);
      core_->alive = false;
      peers = core_->peers;
      for (auto& [id, link] : peers) {
        core_->ForgetPeer(id, absl::CancelledError("transport shut down"));
      }
    }
    for (auto& [id, link] : peers) {
      {
        absl::MutexLock lock(&link.remote->mu);
        link.remote->ForgetPeer(
            link.id_at_remote,
            absl::UnavailableError(absl::StrCat("in-process peer ", core_->name, " shut down")));
      }
      link.remote->Deliver(InboundEvent{.kind = InboundEvent::Kind::kPeerDown,
                                        .peer = link.id_at_remote,
                                        .status = absl::UnavailableError(absl::StrCat(
                                            "in-process peer ", core_->name, " shut down"))});
    }
  }

  Capabilities capabilities() const override {
    return Capabilities{.name = "inproc",
                        .device_memory = false,
                        .notifications = true,
                        .pull = true,
                        .max_blocks_per_batch = 1 << 20,
                        .detail = "memcpy"};
  }

  std::string address() const override { return absl::StrCat("inproc:", core_->name); }
  uint64_t incarnation() const override { return core_->incarnation; }

  absl::StatusOr<MemoryRegionPtr> RegisterMemory(MemorySpan span, MemoryKind kind) override {
    if (span.data == nullptr || span.size_bytes == 0) {
      return absl::InvalidArgumentError("cannot register a null or empty memory span");
    }
    if (kind == MemoryKind::kDevice) {
      return absl::UnimplementedError(
          "in-process transport cannot copy device memory; stage it through pinned host memory");
    }
    RegionId id = internal::NextRegionId();
    {
      absl::MutexLock lock(&core_->mu);
      core_->regions[id] = span;
    }
    return std::make_unique<InProcessRegion>(this, id, span, kind, core_);
  }

  absl::StatusOr<MemoryRegionPtr> AllocateMemory(size_t bytes) override {
    if (bytes == 0) return absl::InvalidArgumentError("cannot allocate zero bytes");
    const size_t rounded = (bytes + 4095) / 4096 * 4096;
    void* data = std::aligned_alloc(4096, rounded);
    if (data == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes, " bytes"));
    }
    std::memset(data, 0, rounded);
    RegionId id = internal::NextRegionId();
    MemorySpan span{data, bytes};
    {
      absl::MutexLock lock(&core_->mu);
      core_->regions[id] = span;
    }
    return std::make_unique<InProcessRegion>(this, id, span, MemoryKind::kHost, core_,
                                             /*owns_memory=*/true);
  }

  using Transport::Connect;
  absl::StatusOr<PeerId> Connect(std::string_view address_view, absl::Time,
                                 const ConnectOptions& options) override {
    const std::string address(address_view);
    if (!absl::StartsWith(address, "inproc:")) {
      return absl::InvalidArgumentError(
          absl::StrCat("in-process address must look like inproc:<name>, got '", address, "'"));
    }
    std::shared_ptr<Core> remote = Registry::Get().Find(address.substr(7));
    if (remote == nullptr) {
      return absl::UnavailableError(absl::StrCat("no in-process transport at ", address));
    }
    if (remote == core_) {
      return absl::InvalidArgumentError("an in-process transport cannot connect to itself");
    }
    {
      absl::ReaderMutexLock lock(&remote->mu);
      if (!internal::PeerKeyAccepted(remote->accept_key, options.peer_key)) {
        return absl::PermissionDeniedError(
            absl::StrCat(address, " refused the connection: wrong data-plane key"));
      }
    }
    {
      absl::ReaderMutexLock lock(&core_->mu);
      for (const auto& [id, link] : core_->peers) {
        if (link.outgoing && link.remote == remote) return id;  // live and ours: reuse
      }
    }
    PeerId mine;
    PeerId theirs;
    {
      absl::MutexLock lock(&remote->mu);
      if (!remote->alive) return absl::UnavailableError(absl::StrCat(address, " shut down"));
      theirs = remote->next_peer++;
      remote->peers[theirs] = Core::PeerLink{core_, 0};
    }
    {
      absl::MutexLock lock(&core_->mu);
      mine = core_->next_peer++;
      core_->peers[mine] = Core::PeerLink{remote, theirs, /*outgoing=*/true};
    }
    {
      absl::MutexLock lock(&remote->mu);
      auto it = remote->peers.find(theirs);
      if (it != remote->peers.end()) it->second.id_at_remote = mine;
    }
    return mine;
  }

  absl::Status Disconnect(PeerId peer) override {
    Core::PeerLink link;
    {
      absl::MutexLock lock(&core_->mu);
      auto it = core_->peers.find(peer);
      if (it == core_->peers.end()) return absl::NotFoundError(absl::StrCat("unknown peer ", peer));
      link = it->second;
      core_->ForgetPeer(peer,
                        absl::CancelledError(absl::StrCat("peer ", peer, " disconnected locally")));
    }
    {
      absl::MutexLock lock(&link.remote->mu);
      link.remote->ForgetPeer(link.id_at_remote, absl::UnavailableError(absl::StrCat(
                                                     "peer ", core_->name, " disconnected")));
    }
    link.remote->Deliver(InboundEvent{
        .kind = InboundEvent::Kind::kPeerDown,
        .peer = link.id_at_remote,
        .status = absl::UnavailableError(absl::StrCat("peer ", core_->name, " disconnected"))});
    return absl::OkStatus();
  }

  absl::StatusOr<std::vector<RemoteRegionInfo>> RemoteRegions(PeerId peer) const override {
    KV_ASSIGN_OR_RETURN(std::shared_ptr<Core> remote, Remote(peer));
    std::vector<RemoteRegionInfo> out;
    absl::ReaderMutexLock lock(&remote->mu);
    for (const auto& [id, span] : remote->regions) out.push_back({id, span.size_bytes});
    return out;
  }

  absl::StatusOr<PeerStatus> GetPeerStatus(PeerId peer) const override {
    absl::ReaderMutexLock lock(&core_->mu);
    auto it = core_->peers.find(peer);
    if (it != core_->peers.end()) {
      return PeerStatus{.id = peer,
                        .address = absl::StrCat("inproc:", it->second.remote->name),
                        .incarnation = it->second.remote->incarnation,
                        .alive = true};
    }
    auto git = core_->gone.find(peer);
    if (git != core_->gone.end()) return git->second;
    return absl::NotFoundError(absl::StrCat("unknown peer ", peer));
  }

  std::vector<PeerId> Peers() const override {
    absl::ReaderMutexLock lock(&core_->mu);
    std::vector<PeerId> out;
    for (const auto& [id, link] : core_->peers) out.push_back(id);
    return out;
  }

  absl::StatusOr<TransferPlan> Prepare(const TransferBatch& batch) override {
    KV_ASSIGN_OR_RETURN(std::shared_ptr<Core> remote, Remote(batch.peer));
    auto is_local = [this](const MemoryRegion* r) {
      absl::ReaderMutexLock lock(&core_->mu);
      auto it = core_->regions.find(r->id());
      return it != core_->regions.end() && it->second.data == r->span().data;
    };
    auto remote_size = [&remote, &batch](RegionId id) -> absl::StatusOr<uint64_t> {
      absl::ReaderMutexLock lock(&remote->mu);
      auto it = remote->regions.find(id);
      if (it == remote->regions.end()) {
        return absl::NotFoundError(absl::StrCat("peer ", batch.peer, " has no region ", id));
      }
      return it->second.size_bytes;
    };
    return internal::BuildPlan(this, batch, is_local, remote_size);
  }

  absl::StatusOr<TransferHandlePtr> Post(const TransferPlan& plan, LayerRange layers,
                                         PostOptions options) override {
    KV_RETURN_IF_ERROR(internal::CheckPost(this, plan, layers));
    KV_RETURN_IF_ERROR(Link(plan.peer).status());
    Job job;
    job.peer = plan.peer;
    job.direction = plan.direction;
    job.tag = plan.tag;
    job.credential = plan.credential;
    job.layers = layers;
    job.blocks = internal::BlocksForPost(plan, layers);
    job.deadline = options.deadline;
    int64_t bytes = 0;
    for (const BlockTransfer& b : job.blocks) bytes += b.length;
    job.handle = std::make_shared<HandleState>(bytes, job.blocks.size());
    auto handle = std::make_unique<TransferHandle>(job.handle);
    Enqueue(std::move(job));
    return handle;
  }

  absl::Status SendControl(PeerId peer, uint64_t tag, std::string_view message) override {
    if (message.size() > kMaxControlBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("control message of ", message.size(), " bytes exceeds ", kMaxControlBytes));
    }
    KV_RETURN_IF_ERROR(Remote(peer).status());
    Job job;
    job.kind = Job::Kind::kControl;
    job.peer = peer;
    job.tag = tag;
    job.message = std::string(message);
    Enqueue(std::move(job));
    return absl::OkStatus();
  }

  void SetInboundHandler(InboundHandler handler) override {
    absl::MutexLock lock(&core_->handler_mu);
    core_->handler = std::move(handler);
  }

  void SetAcceptKey(std::string key) override {
    absl::MutexLock lock(&core_->mu);
    core_->accept_key = std::move(key);
  }

 private:
  absl::StatusOr<std::shared_ptr<Core>> Remote(PeerId peer) const {
    absl::ReaderMutexLock lock(&core_->mu);
    auto it = core_->peers.find(peer);
    if (it == core_->peers.end()) {
      auto git = core_->gone.find(peer);
      if (git != core_->gone.end()) {
        return absl::UnavailableError(
            absl::StrCat("peer ", peer, " is gone: ", git->second.down_reason.message()));
      }
      return absl::NotFoundError(absl::StrCat("unknown peer ", peer));
    }
    return it->second.remote;
  }

  absl::StatusOr<std::pair<std::shared_ptr<Core>, PeerId>> Link(PeerId peer) const {
    absl::ReaderMutexLock lock(&core_->mu);
    auto it = core_->peers.find(peer);
    if (it == core_->peers.end()) {
      return absl::UnavailableError(absl::StrCat("peer ", peer, " is gone"));
    }
    return std::make_pair(it->second.remote, it->second.id_at_remote);
  }

  void Enqueue(Job job) {
    absl::MutexLock lock(&queue_mu_);
    queue_.push_back(std::move(job));
  }

  void WorkerLoop() {
    while (true) {
      Job job;
      {
        absl::MutexLock lock(&queue_mu_);
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(queue_mu_) {
          return stopping_ || !queue_.empty();
        };
        queue_mu_.Await(absl::Condition(&ready));
        if (queue_.empty()) return;  // stopping
        if (stopping_) {
          // Fail what is left rather than run it during shutdown.
          for (Job& j : queue_) {
            if (j.handle) j.handle->Complete(absl::CancelledError("transport shut down"));
          }
          queue_.clear();
          return;
        }
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      if (job.kind == Job::Kind::kControl) {
        RunControl(job);
      } else {
        RunTransfer(job);
      }
    }
  }

  void RunControl(Job& job) {
    absl::StatusOr<std::pair<std::shared_ptr<Core>, PeerId>> link = Link(job.peer);
    if (!link.ok()) return;
    link->first->Deliver(InboundEvent{.kind = InboundEvent::Kind::kControl,
                                      .peer = link->second,
                                      .tag = job.tag,
                                      .message = std::move(job.message)});
  }

  void RunTransfer(Job& job) {
    absl::StatusOr<std::pair<std::shared_ptr<Core>, PeerId>> link = Link(job.peer);
    if (!link.ok()) {
      job.handle->Complete(link.status());
      return;
    }
    Core& remote = *link->first;
    const bool put = job.direction == Direction::kPut;
    std::vector<absl::Status> statuses(job.blocks.size());
    for (size_t i = 0; i < job.blocks.size(); ++i) {
      const BlockTransfer& b = job.blocks[i];
      for (uint64_t done = 0; done < b.length;) {
        if (job.handle->cancel_requested()) {
          job.handle->Complete(absl::CancelledError("transfer cancelled"));
          return;
        }
        if (absl::Now() >= job.deadline) {
          job.handle->Complete(absl::DeadlineExceededError(
              absl::StrCat(DirectionName(job.direction), " of ", job.blocks.size(),
                           " blocks missed its deadline")));
          return;
        }
        uint64_t n = std::min<uint64_t>(core_->copy_chunk_bytes, b.length - done);
        absl::ReaderMutexLock lock(&remote.mu);
        auto it = remote.regions.find(b.remote_region);
        if (!remote.alive) {
          job.handle->Complete(absl::UnavailableError("peer shut down during the transfer"));
          return;
        }
        if (it == remote.regions.end() || b.remote_offset + b.length > it->second.size_bytes) {
          job.handle->Complete(absl::NotFoundError(
              absl::StrCat("peer withdrew region ", b.remote_region, " during the transfer")));
          return;
        }
        uint8_t* remote_bytes = static_cast<uint8_t*>(it->second.data) + b.remote_offset + done;
        uint8_t* local_bytes = b.local->data() + b.local_offset + done;
        if (put) {
          std::memcpy(remote_bytes, local_bytes, n);
        } else {
          std::memcpy(local_bytes, remote_bytes, n);
        }
        done += n;
      }
    }
    if (!put) {
      for (size_t i = 0; i < job.blocks.size(); ++i) {
        const BlockTransfer& b = job.blocks[i];
        statuses[i] = internal::VerifyBlock(b.local->data() + b.local_offset, b.length, b.checksum,
                                            b.local->id(), b.local_offset);
      }
      job.handle->CompleteBlocks(std::move(statuses));
      return;
    }
    // The receiver verifies its own memory, as a remote receiver would.
    InboundEvent event{.kind = InboundEvent::Kind::kBlocks,
                       .peer = link->second,
                       .tag = job.tag,
                       .layers = job.layers,
                       .credential = job.credential};
    {
      absl::ReaderMutexLock lock(&remote.mu);
      for (size_t i = 0; i < job.blocks.size(); ++i) {
        const BlockTransfer& b = job.blocks[i];
        auto it = remote.regions.find(b.remote_region);
        if (!remote.alive || it == remote.regions.end()) {
          statuses[i] = absl::UnavailableError("receiver region gone before verification");
        } else {
          statuses[i] =
              internal::VerifyBlock(static_cast<const uint8_t*>(it->second.data) + b.remote_offset,
                                    b.length, b.checksum, b.remote_region, b.remote_offset);
        }
        event.blocks.push_back(
            ReceivedBlock{b.remote_region, b.remote_offset, b.length, b.checksum, statuses[i]});
      }
    }
    event.status = internal::SummarizeBlocks(statuses);
    remote.Deliver(std::move(event));
    job.handle->CompleteBlocks(std::move(statuses));
  }

  std::shared_ptr<Core> core_;
  absl::Mutex queue_mu_;
  std::deque<Job> queue_ ABSL_GUARDED_BY(queue_mu_);
  bool stopping_ ABSL_GUARDED_BY(queue_mu_) = false;
  std::thread worker_;
};

}  // namespace

absl::StatusOr<TransportPtr> MakeInProcessTransport(InProcessTransportOptions options) {
  if (options.copy_chunk_bytes == 0) {
    return absl::InvalidArgumentError("copy_chunk_bytes must be positive");
  }
  auto core = std::make_shared<Core>();
  core->name = options.name.empty() ? absl::StrCat("t", g_next_name.fetch_add(1)) : options.name;
  core->copy_chunk_bytes = options.copy_chunk_bytes;
  if (!Registry::Get().Add(core->name, core)) {
    return absl::AlreadyExistsError(
        absl::StrCat("an in-process transport named '", core->name, "' already exists"));
  }
  return std::make_unique<InProcessTransport>(std::move(core));
}

}  // namespace kvrelay::transfer

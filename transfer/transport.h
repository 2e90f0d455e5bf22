#pragma once

// The data plane's interface: register memory, connect to a peer by address, prepare and post
// batched block transfers (push = put into the peer's memory, pull = get from it), completion
// handles with deadlines and cancellation, and small control messages ordered after the data
// they describe.
//
// Typical use (prefill pushes into decode's block pool):
//
//   // decode (receiver)
//   KV_ASSIGN_OR_RETURN(auto region, transport->RegisterMemory({pool->base(),
//                                                               pool->size_bytes()}, kHost));
//   transport->SetInboundHandler(queue.Handler());         // before anyone connects
//   publish(transport->address(), region->id());           // e.g. via the cache store
//
//   // prefill (sender)
//   KV_ASSIGN_OR_RETURN(PeerId peer, transport->Connect(address, deadline));
//   TransferBatch batch{.peer = peer, .direction = Direction::kPut, .tag = request_id};
//   batch.blocks.push_back({.local = my_region, .local_offset = ..., .remote_region = id,
//                           .remote_offset = ..., .length = ..., .layer = l});
//   KV_ASSIGN_OR_RETURN(TransferPlan plan, transport->Prepare(batch));
//   for (int l = 0; l < layers; ++l) {                      // layer l+1 computes meanwhile
//     KV_ASSIGN_OR_RETURN(handles[l], transport->Post(plan, LayerRange::One(l)));
//   }
//   for (auto& h : handles) KV_RETURN_IF_ERROR(h->Wait(deadline));
//
// The receiver's handler gets one InboundEvent{kBlocks} per Post, after the data is in its
// memory, with each block's checksum verified (a mismatch => that block's status is DataLoss
// and the sender's handle fails with DataLoss). Corrupted data is never reported as received.
//
// Thread safety: every Transport method may be called from any thread. The inbound handler runs
// on an internal thread; it must not block for long and must not destroy handles or the
// transport. Lifetimes: regions and handles must be destroyed before their transport; a region
// must not be destroyed while a transfer that uses it is in flight.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kv/pool/memory_resource.h"

namespace kvrelay::transfer {

using MemoryKind = kv::MemoryKind;
// A connected peer, as seen by one transport. Never reused within a transport's lifetime.
using PeerId = uint64_t;
// A registered region, unique within the process that registered it (peers name remote
// regions by the id their owner published).
using RegionId = uint64_t;

struct MemorySpan {
  void* data = nullptr;
  size_t size_bytes = 0;
};

struct Capabilities {
  std::string name;            // "inproc", "ucx"
  bool device_memory = false;  // kDevice memory can be registered directly; else stage via
                               // pinned host buffers (Debian's UCX 1.13 has no CUDA module)
  bool notifications = true;   // the receiver learns about each completed Post
  bool pull = true;            // Direction::kGet supported
  int64_t max_blocks_per_batch = 0;
  std::string detail;  // e.g. the UCX transports in use
  // AllocatePrivateMemory / RegisterPrivateMemory / ExportRegion / ImportRegion work.
  bool private_regions = false;
  // A memory domain whose remote keys the hardware enforces (RDMA: the NIC refuses an access
  // outside a key's registered range or with a key that was unmapped) is available. Decided
  // from UCX's component list, not from any error: see transfer/README.md, "Who may write".
  bool hardware_enforced_keys = false;
};

// A registered memory region. Destroying it deregisters the memory (and withdraws it from
// connected peers). Not copyable; thread-compatible.
class MemoryRegion {
 public:
  MemoryRegion(const void* owner, RegionId id, MemorySpan span, MemoryKind kind)
      : owner_(owner), id_(id), span_(span), kind_(kind) {}
  virtual ~MemoryRegion() = default;
  MemoryRegion(const MemoryRegion&) = delete;
  MemoryRegion& operator=(const MemoryRegion&) = delete;

  RegionId id() const { return id_; }
  MemorySpan span() const { return span_; }
  uint8_t* data() const { return static_cast<uint8_t*>(span_.data); }
  size_t size_bytes() const { return span_.size_bytes; }
  MemoryKind kind() const { return kind_; }
  // The transport that registered this region (identity only; for validation).
  const void* owner() const { return owner_; }

 private:
  const void* owner_;
  RegionId id_;
  MemorySpan span_;
  MemoryKind kind_;
};
using MemoryRegionPtr = std::unique_ptr<MemoryRegion>;

// What the peer has registered and published: the id and size of each region.
struct RemoteRegionInfo {
  RegionId id = 0;
  uint64_t size_bytes = 0;
};

// What this transport knows about one peer (Transport::GetPeerStatus).
struct PeerStatus {
  PeerId id = 0;
  // The address given to Connect(), or for a peer that connected to us the address it
  // advertised in its hello.
  std::string address;
  // The peer transport instance's incarnation: random, 64-bit, new for every transport (so
  // for every process start). A process restarted behind the same address has a different
  // one, and is always a different PeerId: regions and keys of an old incarnation are never
  // used for a new one.
  uint64_t incarnation = 0;
  bool alive = false;
  // Why the peer is no longer alive (OK while alive): Unavailable (connection lost, missed
  // heartbeats, endpoint error), Cancelled (disconnected locally).
  absl::Status down_reason;
  // Bytes of the peer's memory that this process maps directly (shared memory) and has not
  // yet populated; transfers into them still pay first-touch page faults. 0 over a network.
  uint64_t unpopulated_bytes = 0;
};

enum class Direction { kPut, kGet };

// One block: local region + offset <-> remote region + offset, `length` bytes.
struct BlockTransfer {
  const MemoryRegion* local = nullptr;  // registered with this transport
  uint64_t local_offset = 0;
  RegionId remote_region = 0;  // a region the peer published
  uint64_t remote_offset = 0;
  uint64_t length = 0;  // > 0
  int32_t layer = 0;    // >= 0; Post() sends a range of layers
  // Put: the block's XXH3-64 (kv::BlockChecksum) sent to the receiver, which verifies it;
  // computed at Post() from the local bytes when absent and the batch asks for checksums.
  // Get: the expected checksum, verified after the bytes arrived.
  std::optional<uint64_t> checksum;
};

struct TransferBatch {
  PeerId peer = 0;
  Direction direction = Direction::kPut;
  uint64_t tag = 0;               // opaque to the transport; handed to the receiver (request id)
  bool compute_checksums = true;  // put only: fill in missing checksums at Post()
  // Put only: opaque to the transport, handed to the receiver with the blocks
  // (InboundEvent::credential), e.g. the decode reservation's token. At most 1 KiB.
  std::string credential;
  std::vector<BlockTransfer> blocks;
};

// Layers [begin, end).
struct LayerRange {
  int32_t begin = 0;
  int32_t end = std::numeric_limits<int32_t>::max();
  static LayerRange All() { return {}; }
  static LayerRange One(int32_t layer) { return {layer, layer + 1}; }
  bool Contains(int32_t layer) const { return layer >= begin && layer < end; }
};

// A contiguous run of bytes after coalescing: adjacent blocks of one layer whose local and
// remote bytes are both contiguous in the same regions. Never spans two regions.
struct Segment {
  const MemoryRegion* local = nullptr;
  uint64_t local_offset = 0;
  RegionId remote_region = 0;
  uint64_t remote_offset = 0;
  uint64_t length = 0;
  int32_t layer = 0;
};

// A validated, coalesced batch: blocks sorted by layer (stable), segments per layer. Cheap to
// post many times. Valid only with the transport that prepared it.
struct TransferPlan {
  const void* transport = nullptr;
  PeerId peer = 0;
  Direction direction = Direction::kPut;
  uint64_t tag = 0;
  bool compute_checksums = true;
  std::string credential;
  std::vector<BlockTransfer> blocks;
  std::vector<Segment> segments;
  // Blocks and segments are sorted by layer, so one layer is a contiguous index range.
  std::pair<size_t, size_t> BlockRange(LayerRange layers) const;
  std::pair<size_t, size_t> SegmentRange(LayerRange layers) const;
};

struct PostOptions {
  // The transfer fails with DeadlineExceeded if not complete by then (buffers are released
  // only once no operation uses them any more).
  absl::Time deadline = absl::InfiniteFuture();
};

namespace internal {
class HandleState;
}

// Completion of one Post. Thread-safe. The destructor cancels the transfer and waits until it
// is terminal, so the buffers it used are free when it returns. Terminal means nothing will
// write into them again: a pull (GET) that was out when its peer was declared lost stays
// running until the peer answers, the connection fails for good, a new process takes the
// peer's address, or the transport shuts down (over UCX's tcp transport a paused peer answers
// when it runs again, into the pull's destination). Code on a request path hands such a
// handle to a thread of its own (worker::FetchQuarantine) instead of destroying it.
class TransferHandle {
 public:
  explicit TransferHandle(std::shared_ptr<internal::HandleState> state);
  ~TransferHandle();
  TransferHandle(const TransferHandle&) = delete;
  TransferHandle& operator=(const TransferHandle&) = delete;

  // The final status once terminal; nullopt while running.
  std::optional<absl::Status> Poll() const;
  // Waits until terminal or `deadline`; DeadlineExceeded("... still running") when the wait
  // ran out (the transfer itself goes on). Otherwise the transfer's status: OK, Cancelled,
  // DeadlineExceeded, Unavailable (peer gone), DataLoss (a checksum failed), ...
  absl::Status Wait(absl::Time deadline) const;
  // Best effort: operations not yet issued are skipped; the handle becomes terminal (with
  // Cancelled, unless it completed first) once no operation is in flight.
  void Cancel();
  // Per block of the posted layer range, valid once terminal: OK, or why that block failed.
  std::vector<absl::Status> block_statuses() const;
  int64_t bytes() const;

 private:
  std::shared_ptr<internal::HandleState> state_;
};
using TransferHandlePtr = std::unique_ptr<TransferHandle>;

// What the receiver learns.
struct ReceivedBlock {
  RegionId region = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  std::optional<uint64_t> checksum;
  absl::Status status;  // OK (checksum verified or none sent), DataLoss, InvalidArgument
};

struct InboundEvent {
  enum class Kind {
    kBlocks,    // a Post's data is in our memory; blocks carry the verification result
    kControl,   // SendControl() message
    kPeerDown,  // the peer disconnected or stopped answering; status says why
  };
  Kind kind = Kind::kBlocks;
  PeerId peer = 0;
  uint64_t tag = 0;
  LayerRange layers;
  std::vector<ReceivedBlock> blocks;
  std::string message;
  absl::Status status;  // kBlocks: OK iff every block is OK
  // kBlocks: the sender's TransferBatch::credential, as sent (the receiver decides).
  std::string credential;
};
using InboundHandler = std::function<void(InboundEvent)>;

struct ConnectOptions {
  // Presented in the data-plane hello: a transport created with an accept key (e.g.
  // UcxTransportOptions::accept_key) refuses, before it tells the peer anything about its
  // memory, a connection whose hello carries another key. Ignored by peers without one.
  std::string peer_key;
};
inline constexpr size_t kMaxPeerKeyBytes = 256;
inline constexpr size_t kMaxCredentialBytes = 1024;
inline constexpr size_t kMaxExportedRegionBytes = 4096;

class Transport {
 public:
  virtual ~Transport() = default;

  virtual Capabilities capabilities() const = 0;
  // Where peers Connect() to ("127.0.0.1:40123", "inproc:decode-0").
  virtual std::string address() const = 0;
  // This transport instance's incarnation (random 64-bit, never 0), sent to every peer.
  virtual uint64_t incarnation() const = 0;

  // InvalidArgument for a null/empty span; Unimplemented for device memory without
  // capabilities().device_memory.
  virtual absl::StatusOr<MemoryRegionPtr> RegisterMemory(MemorySpan span, MemoryKind kind) = 0;

  // Memory allocated and registered by the transport, which picks what its peers can reach
  // fastest (UCX: shared-memory segments, so shared-memory peers put and get with plain
  // memcpy instead of emulating RMA through messages). Zero-filled, page-aligned, freed with
  // the region. A worker builds its block pool on it (see transfer::RegionMemoryResource).
  virtual absl::StatusOr<MemoryRegionPtr> AllocateMemory(size_t bytes) = 0;

  // Connects to the transport listening at `address`; both sides can then push and pull.
  // A live connection this transport opened to the same address is reused (same PeerId);
  // a dead one never is: a peer that went away (process restarted, network cut) gets a new
  // connection and a new PeerId. Unavailable when nobody answers, DeadlineExceeded when the
  // handshake is not done in time, InvalidArgument for a malformed address.
  // PermissionDenied when the peer requires a key and `options.peer_key` is not it.
  virtual absl::StatusOr<PeerId> Connect(std::string_view address, absl::Time deadline,
                                         const ConnectOptions& options) = 0;
  absl::StatusOr<PeerId> Connect(std::string_view address, absl::Time deadline) {
    return Connect(address, deadline, ConnectOptions{});
  }
  // NotFound for an unknown peer. Transfers in flight to it fail with Cancelled.
  virtual absl::Status Disconnect(PeerId peer) = 0;
  // Regions the peer has published: NotFound for an unknown peer, Unavailable (with why) once
  // the peer is dead, so "RemoteRegions(p).ok()" is a liveness check.
  virtual absl::StatusOr<std::vector<RemoteRegionInfo>> RemoteRegions(PeerId peer) const = 0;
  // NotFound for a peer this transport never had.
  virtual absl::StatusOr<PeerStatus> GetPeerStatus(PeerId peer) const = 0;
  // Peers connected to us or by us that are alive.
  virtual std::vector<PeerId> Peers() const = 0;

  // Validates (InvalidArgument: null/foreign/unregistered local region, zero length, offset or
  // length out of range, negative layer; NotFound: unknown peer or remote region) and coalesces.
  virtual absl::StatusOr<TransferPlan> Prepare(const TransferBatch& batch) = 0;
  // Starts the blocks of `layers` (InvalidArgument for a plan from another transport or an
  // empty range; Unavailable once the peer is gone).
  virtual absl::StatusOr<TransferHandlePtr> Post(const TransferPlan& plan, LayerRange layers,
                                                 PostOptions options = {}) = 0;

  // A small message (<= kMaxControlBytes) delivered to the peer's handler after every transfer
  // posted earlier to the same peer has been delivered.
  static constexpr size_t kMaxControlBytes = 1 << 20;
  virtual absl::Status SendControl(PeerId peer, uint64_t tag, std::string_view message) = 0;

  // Set before peers connect; replaces any previous handler.
  virtual void SetInboundHandler(InboundHandler handler) = 0;
  // --- Regions whose keys go out of band (memory keys per reservation) ---------------------
  // Like AllocateMemory / RegisterMemory, but never announced to any peer (not in the hello,
  // no region frame): a peer can reach it only after it imports the key ExportRegion() gives,
  // handed to it some other way (e.g. a Reserve response). Destroying the region unmaps it;
  // a peer's later access with the old key is refused by the NIC where the keys are enforced
  // in hardware, and by the receiver's DONE check everywhere ("no local region").
  // Unimplemented where capabilities().private_regions is false.
  virtual absl::StatusOr<MemoryRegionPtr> AllocatePrivateMemory(size_t bytes);
  // A sub-range of memory this transport allocated (e.g. a few slots of a private pool) may be
  // registered again on its own.
  virtual absl::StatusOr<MemoryRegionPtr> RegisterPrivateMemory(MemorySpan span, MemoryKind kind);
  // The opaque key of a private region of this transport: its id, address, size, the packed
  // remote key and this transport's incarnation (at most kMaxExportedRegionBytes).
  virtual absl::StatusOr<std::string> ExportRegion(const MemoryRegion& region) const;
  // Makes an exported region usable in batches to `peer` (its id as BlockTransfer::
  // remote_region). InvalidArgument for a malformed key; FailedPrecondition when the key is of
  // another process than the one `peer` is; NotFound/Unavailable for an unknown/dead peer.
  virtual absl::StatusOr<RegionId> ImportRegion(PeerId peer, std::string_view exported);
  // Drops an imported key (its unpacked rkey is destroyed). NotFound when not imported.
  virtual absl::Status ForgetRegion(PeerId peer, RegionId region);

  // Set before peers connect. Non-empty: a peer's Connect must present this key
  // (ConnectOptions::peer_key), or it is refused with PermissionDenied before it learns
  // anything about this transport's memory (UCX: worker address, regions, rkeys). Empty
  // (the default): every peer is accepted. See transfer/README.md for what this guarantees.
  virtual void SetAcceptKey(std::string key) = 0;
};
using TransportPtr = std::unique_ptr<Transport>;

// A thread-safe queue of inbound events, for code that prefers pulling to callbacks.
class InboundQueue {
 public:
  // The returned handler pushes into this queue, which must outlive the transport using it.
  InboundHandler Handler();
  void Push(InboundEvent event);
  // The next event; DeadlineExceeded when none arrives by `deadline`.
  absl::StatusOr<InboundEvent> Next(absl::Time deadline);
  // The next event of `kind`, skipping others.
  absl::StatusOr<InboundEvent> NextOfKind(InboundEvent::Kind kind, absl::Time deadline);
  size_t size() const;

 private:
  mutable absl::Mutex mu_;
  std::vector<InboundEvent> events_ ABSL_GUARDED_BY(mu_);
  size_t head_ ABSL_GUARDED_BY(mu_) = 0;
};

const char* DirectionName(Direction d);

}  // namespace kvrelay::transfer

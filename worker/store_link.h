#pragma once

// StoreLink: a worker's connection to the cache store, over CacheStoreClient. Registers the
// node as (node id, incarnation) with its role, gRPC and data-plane addresses and its cache
// segment; heartbeats with the worker's load from a background thread; after the store forgot
// the node (restart without its log, a long partition) registers again and re-announces the
// blocks its segment still holds, so prefix hits come back without recompute; with several
// store instances (HA) the client follows the leader, and a new leader's term makes the link
// re-announce its blocks too (idempotent), so blocks the old leader had not replicated return.
// Matches prefixes under leases bound to this node and commits new blocks into its own segment.
// Deregisters on Leave() or destruction, so the store drops the node at once instead of waiting
// out its TTL (and the node id is free for the next process at once).
//
// What each segment slot holds is tracked exactly: a slot is forgotten before new bytes are
// written into it and recorded only after its commit, so a re-announce never names bytes that
// are not there.
//
// Thread-safe. The segment (if any) and the clock must outlive the link.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "cachestore/client/cache_store_client.h"
#include "common/clock.h"
#include "common/dependency_gate.h"
#include "common/metrics.h"
#include "common/server/credentials.h"
#include "kv/block_hash.h"
#include "model/kv_cache.h"
#include "worker/disk_cache.h"
#include "worker/kv_memory.h"

namespace kvrelay::worker {

struct StoreLinkOptions {
  std::string cachestore_address;  // host:port, or several comma-separated (HA store set)
  std::string node_id;
  uint64_t incarnation = 0;
  kvrelay::v1::NodeRole role = kvrelay::v1::NODE_ROLE_UNSPECIFIED;
  std::string grpc_address;  // where the gateway reaches this worker (discovery)
  std::string transport_kind = "ucx";
  std::string transport_address;  // where peers reach this node's data plane
  absl::Duration ttl = absl::Seconds(10);
  absl::Duration rpc_timeout = absl::Seconds(5);
  // The per-call limit of a store call on a request's critical path (MatchPrefix, the commit
  // after a prefill or at the end of a stream): each gets min(what is left of the request's
  // deadline, this), so a store that does not answer costs reuse, not seconds of TTFT. After
  // such a call fails because the store was slow or away (not because the request had no time
  // left), the link's DependencyGate fails the next ones fast for `store_backoff`, doubling per
  // failed probe up to `store_backoff_max`; one call at a time then probes, bounded by
  // `probe_timeout` as well (zero: a fifth of request_timeout; a store that answers does so in
  // milliseconds, and a patient request_timeout on a slow machine keeps a patient probe), so
  // probing a hung store costs a request little.
  absl::Duration request_timeout = absl::Milliseconds(500);
  absl::Duration store_backoff = absl::Milliseconds(250);
  absl::Duration store_backoff_max = absl::Seconds(2);
  absl::Duration probe_timeout = absl::ZeroDuration();
  // The gate's time (not the link's clock, which may be a test's frozen SimulatedClock: the gate
  // bounds wall-clock RPC waits, as the calls' deadlines); null: the real clock. Not owned.
  Clock* gate_clock = nullptr;
  // The gate's state gauge and fast-fail counter (kvrelay:dependency_*{dependency="cachestore"})
  // are registered here when set; not owned.
  MetricsRegistry* metrics = nullptr;
  MetricLabels metric_labels;  // on those families too (model_name)
  server::SecurityOptions security;
  std::function<kvrelay::v1::NodeLoad()> load;  // reported with each heartbeat (optional)
  // Registered as the segment's memory key (CacheSegment::AccessKey): what readers the store
  // sends here need to get blocks over the data plane.
  std::string segment_access_key;
  // Tokens per KV block of the node's layout, checked by the store at registration (another
  // value than the store's is refused: FailedPrecondition naming both); 0: not checked.
  int32_t block_tokens = 0;
  // The node's disk tier (optional, not owned, must outlive the link): a committed block whose
  // segment slot the store hands to another block is demoted there (a copy that verified
  // against its slot entry) instead of dropped. The tier is registered as a second segment
  // ("disk", TIER_SSD) and what each of its slots holds is announced there (from the heartbeat
  // thread, within ~100 ms of the change; all of it again whenever the link registers).
  DiskCache* disk = nullptr;
};

struct PrefixMatch {
  int32_t matched = 0;               // leading blocks committed somewhere
  std::vector<int64_t> local_slots;  // per matched block: our segment's slot, or -1
  // Per matched block: its replicas on other nodes that may be read (the store handed out
  // their segment access), best first.
  std::vector<std::vector<RemoteReplica>> remote;
  uint64_t lease_id = 0;
};

class StoreLink {
 public:
  // Registers (retrying until `deadline`, so workers may start before the store). A refused
  // registration (ALREADY_EXISTS: another live process holds this node id) is returned at once.
  static absl::StatusOr<std::unique_ptr<StoreLink>> Connect(StoreLinkOptions options,
                                                            const CacheSegment* segment,
                                                            Clock* clock, absl::Time deadline);
  // A link that never registers and sends no heartbeat: for tests of the request-path calls
  // against a store that would not accept a registration (one that never answers).
  static absl::StatusOr<std::unique_ptr<StoreLink>> UnregisteredForTest(StoreLinkOptions options,
                                                                        const CacheSegment* segment,
                                                                        Clock* clock);
  ~StoreLink();

  // Stops heartbeating and deregisters (bounded by one second), once: the drain's last step,
  // so gateways stop routing here before the gRPC server stops. Request-path calls after it
  // may be refused by the store (this node is unknown there).
  void Leave();

  // Request-path calls: `deadline` is the request's; each store call of them gets
  // min(deadline, now + options.request_timeout). DeadlineExceeded without a call when the
  // deadline has passed; Unavailable at once while the gate is open (the store did not answer
  // just before); the store's error.
  absl::StatusOr<PrefixMatch> MatchPrefix(const std::vector<kv::BlockHash>& chain,
                                          absl::Duration lease_ttl, absl::Time deadline);
  // Best effort (a lease not released expires at the store); bounded as above.
  void ReleaseLease(uint64_t lease_id, absl::Time deadline = absl::InfiniteFuture());
  // Commits chain[first, last) (their KV is blocks first..last-1 of `seq`): allocates slots in
  // this node's segment, copies the blocks there, commits them with their tokens (from
  // seq.tokens(), for the store's KV events). Returns how many were committed.
  // With `keep_copies`, blocks already committed on other nodes get a copy here too (a decode
  // worker keeping what it received, so a later turn need not receive it again). The whole
  // commit's waits on the store share one per-call limit (it runs before a prefill answers).
  // Each store
  // call is bounded by `deadline` as MatchPrefix's is.
  absl::StatusOr<int32_t> CommitBlocks(const std::vector<kv::BlockHash>& chain, int64_t first,
                                       int64_t last, const model::Sequence& seq,
                                       absl::Time deadline, bool keep_copies = false);
  // Writes one block's bytes (segment_->block_bytes() of them) into segment slot `slot`.
  using BlockWriter = std::function<absl::Status(int64_t block_index, int64_t slot)>;
  // As CommitBlocks, with the bytes of block i written by `write(i, slot)`: for Mamba, the
  // state checkpoint after block i (kept under block i's chained hash). `tokens`: those `chain`
  // was hashed from (block i's are tokens[i * block_tokens, (i + 1) * block_tokens)), sent with
  // the commit; none are sent when it is shorter or options.block_tokens is 0.
  absl::StatusOr<int32_t> CommitBlocksFrom(const std::vector<kv::BlockHash>& chain, int64_t first,
                                           int64_t last, const BlockWriter& write,
                                           absl::Time deadline, bool keep_copies = false,
                                           absl::Span<const int32_t> tokens = {});
  // How many leading blocks of `chain` the segment holds; copies them into fresh KvCache
  // slots (appended to group_slots[g], one reference each for the caller). Under the link's
  // lock, so no slot is rewritten while it is copied; every copy is checked against its slot
  // entry (hash and checksum).
  int64_t LoadHeldPrefix(const std::vector<kv::BlockHash>& chain, model::KvCache& cache,
                         std::vector<std::vector<kv::SlotId>>& group_slots) const;

  const std::string& node_id() const { return options_.node_id; }
  uint64_t incarnation() const { return options_.incarnation; }
  // Blocks the segment holds committed, as the link knows them.
  int64_t held_blocks() const;

 private:
  StoreLink(StoreLinkOptions options, const CacheSegment* segment, Clock* clock,
            std::unique_ptr<cachestore::CacheStoreClient> client);
  absl::Status Register();
  // Re-announces every held block (after the store forgot this node).
  void Reannounce();
  void HeartbeatLoop();
  // Queues every block the disk tier lists (and, with `listen`, what changes from now on).
  void QueueDiskBlocks(bool listen);
  // Announces the queued disk slot changes (best effort: a failed call is logged and the slots
  // are announced again on the next registration).
  void AnnounceDiskChanges();
  // A request-path call: its bound, min(the request's deadline, now + options_.request_timeout,
  // and now + options_.probe_timeout for the gate's probe), and the gate's ticket.
  struct RequestCall {
    cachestore::CallOptions call;
    DependencyGate::BoundCall gated;
    // Records `status` with the gate (once).
    void Done(const absl::Status& status) { gated.Done(status); }
  };
  // Through the gate: DeadlineExceeded when `deadline` has passed, the gate's Unavailable
  // while it is open, else the call's bound and ticket. `limit`: an earlier end of the per-call
  // limit shared by several calls (a commit's allocate and commit).
  absl::StatusOr<RequestCall> OpenRequestCall(absl::Time deadline,
                                              absl::Time limit = absl::InfiniteFuture());
  // The answer of MatchPrefix in this node's terms: own slots and readable remote replicas.
  PrefixMatch ToPrefixMatch(const kvrelay::v1::MatchPrefixResponse& response) const;
  kvrelay::v1::AllocateRequest AllocationFor(const std::vector<kv::BlockHash>& chain, int64_t first,
                                             int64_t last, bool keep_copies) const;
  // Writes the allocated blocks placed wholly in this node's segment (their slots forgotten
  // first); appends to `written` what to record once committed. Returns the chain indices of
  // the blocks written.
  std::vector<int64_t> WriteAllocated(const kvrelay::v1::AllocateResponse& allocation,
                                      const std::vector<kv::BlockHash>& chain, int64_t first,
                                      const BlockWriter& write,
                                      std::vector<kvrelay::v1::AnnouncedBlock>& written);

  const StoreLinkOptions options_;
  const CacheSegment* segment_;
  Clock* const clock_;
  std::unique_ptr<cachestore::CacheStoreClient> client_;
  mutable absl::Mutex mu_;
  // slot -> the committed block it holds (hash, parent, size).
  absl::flat_hash_map<int64_t, kvrelay::v1::AnnouncedBlock> held_ ABSL_GUARDED_BY(mu_);
  // The same blocks by hash (hi, lo) -> slot.
  absl::flat_hash_map<std::pair<uint64_t, uint64_t>, int64_t> slot_of_ ABSL_GUARDED_BY(mu_);
  void ForgetSlotLocked(int64_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Before `slot` is rewritten: hands the committed block it holds (if any, and if its bytes
  // still verify against the slot entry) to the disk tier.
  void DemoteSlotLocked(int64_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Disk slot changes not yet announced, in order.
  absl::Mutex disk_mu_;
  std::vector<kvrelay::v1::AnnouncedBlock> disk_pending_ ABSL_GUARDED_BY(disk_mu_);
  DependencyGate gate_;  // the store on the request path
  absl::Notification stop_;
  std::atomic<bool> left_{false};  // Leave ran (exchange: the first caller deregisters)
  // The store process this link last registered with or heard from (0: not yet); relaxed: read
  // and written by the heartbeat thread, and by Register on the connecting thread before it.
  std::atomic<uint64_t> store_incarnation_{0};
  std::thread heartbeat_;
};

}  // namespace kvrelay::worker

#include "cachestore/cache_store.h"

#include <algorithm>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "cachestore/random_id.h"
#include "common/file_util.h"
#include "common/heap.h"
#include "common/logging.h"
#include "common/status_macros.h"

namespace kvrelay::cachestore {

namespace {

// A slot of `node`'s `segment` was reserved: its view loses it, in place. Allocate holds the
// store's lock, so nothing else changed the registry meanwhile; rebuilding every view after each
// block (NodeRegistry::Segments) cost a copy of every node's segments per block, 7% of a
// 256-node simulation and growing with the cluster.
void TakeSlot(std::vector<SegmentView>& views, uint16_t node, uint16_t segment) {
  for (SegmentView& v : views) {
    if (v.node == node && v.segment == segment) {
      --v.free_slots;
      return;
    }
  }
}
constexpr char kWalFile[] = "/wal.log";
constexpr char kSnapshotFile[] = "/snapshot";
// Sequence numbers reserved per logged high-water mark.
constexpr uint64_t kSequenceReservation = 1024;

NodeSpec WithoutSegments(const NodeSpec& spec) {
  NodeSpec out = spec;
  out.segments.clear();
  return out;
}
}  // namespace

absl::StatusOr<std::unique_ptr<CacheStore>> CacheStore::Create(CacheStoreOptions options) {
  KV_ASSIGN_OR_RETURN(EvictionPolicyPtr policy, MakeEvictionPolicy(options.policy, 0));
  if (!policy->prefix_aware()) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy: '", options.policy,
                     "' is the non-prefix-aware trace-replay baseline; the service needs adaptive, "
                     "lrfu, probation-lag, probation-lru or leaf-lru"));
  }
  policy->LearnInBackground();  // lookups queue chains for the adaptive policy's shadows
  if (!(options.low_watermark > 0 && options.low_watermark <= options.high_watermark &&
        options.high_watermark <= 1.0)) {
    return absl::InvalidArgumentError("watermarks: want 0 < low <= high <= 1");
  }
  auto store = std::unique_ptr<CacheStore>(new CacheStore(std::move(options), std::move(policy)));
  KV_RETURN_IF_ERROR(store->Recover());
  return store;
}

CacheStore::CacheStore(CacheStoreOptions options, EvictionPolicyPtr policy)
    : options_(std::move(options)),
      clock_(options_.clock != nullptr ? options_.clock : Clock::Real()),
      store_incarnation_(RandomId()),
      policy_(std::move(policy)),
      registry_(options_.limits.max_nodes) {
  BlockIndex::Options index_options;
  index_options.policy = policy_.get();
  index_ = std::make_unique<BlockIndex>(index_options);
}

CacheStore::~CacheStore() = default;

absl::Status CacheStore::Recover() {
  absl::MutexLock lock(&mu_);
  if (options_.data_dir.empty()) return absl::OkStatus();
  KV_RETURN_IF_ERROR(MakeDirectories(options_.data_dir));
  // Replay rebuilds state; it publishes no events (their numbers are already spent).
  replaying_ = true;
  // Runs at scope exit, before `lock` is released; the analysis cannot see that a cleanup's
  // callback runs under the caller's lock.
  absl::Cleanup done_replaying = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS { replaying_ = false; };
  uint64_t max_seq = 0;
  int64_t applied = 0;
  absl::StatusOr<std::vector<WalOp>> snapshot = ReadSnapshot(options_.data_dir + kSnapshotFile);
  if (snapshot.ok()) {
    for (const WalOp& op : *snapshot) {
      KV_RETURN_IF_ERROR(ApplyOp(op, &max_seq));
      ++applied;
    }
  } else if (!absl::IsNotFound(snapshot.status())) {
    return snapshot.status();
  }
  Wal::Recovered recovered;
  KV_ASSIGN_OR_RETURN(wal_,
                      Wal::Open(options_.data_dir + kWalFile, options_.wal_fsync, &recovered));
  for (const WalOp& op : recovered.ops) {
    KV_RETURN_IF_ERROR(ApplyOp(op, &max_seq));
    ++applied;
  }
  // Nodes recovered from disk get one TTL to heartbeat again before they (and their blocks) go.
  registry_.TouchAll(clock_->Now());
  UpdateCapacityHint();
  {
    absl::MutexLock events_lock(&events_mu_);
    // Replay re-ran removals that published events numbered from 1; none is a live event, and
    // left in place they would break EventsSince's sequence -> position arithmetic.
    events_.clear();
    next_sequence_ = max_seq + 1;
  }
  // The first event after the restart logs a fresh mark before it is handed out.
  sequence_reserved_ = max_seq;
  if (applied > 0) {
    KV_LOG(INFO) << "cachestore: recovered " << registry_.size() << " nodes and "
                 << index_->committed_count() << " blocks from " << options_.data_dir << " ("
                 << applied << " records)";
  }
  return absl::OkStatus();
}

absl::Status CacheStore::ApplyOp(const WalOp& op, uint64_t* max_seq) {
  *max_seq = std::max(*max_seq, op.sequence);
  switch (op.type) {
    case WalOp::Type::kRegisterNode: {
      NodeSpec spec = op.node;
      if (spec.incarnation == 0) spec.incarnation = RandomId();  // logged before incarnations
      KV_ASSIGN_OR_RETURN(auto r, registry_.Register(spec, clock_->Now(), /*force_replace=*/true));
      if (r.replaced) {
        RemoveNodeLocked(r.index, /*log=*/false, "replaced (log replay)");
        KV_ASSIGN_OR_RETURN(r, registry_.Register(spec, clock_->Now(), /*force_replace=*/true));
      }
      return absl::OkStatus();
    }
    case WalOp::Type::kRemoveNode: {
      std::optional<uint16_t> node = registry_.Find(op.node_id);
      if (node.has_value()) RemoveNodeLocked(*node, /*log=*/false, "removed (log replay)");
      return absl::OkStatus();
    }
    case WalOp::Type::kSequenceMark:
      return absl::OkStatus();
    case WalOp::Type::kCommitBlock: {
      if (index_->Contains(op.hash)) {
        // A replica announced after the first commit: add what the index lacks.
        for (const WalReplica& r : op.replicas) {
          std::optional<uint16_t> node = registry_.Find(r.node_id);
          if (!node.has_value()) continue;
          std::optional<uint16_t> seg = registry_.FindSegment(*node, r.segment_id);
          if (!seg.has_value()) continue;
          Replica rep{*node, *seg, r.slot};
          if (index_->StateOf(op.hash) != BlockState::kCommitted) break;
          std::vector<MatchedBlock> found;
          index_->MatchPrefix(absl::MakeConstSpan(&op.hash, 1), false, false, &found);
          bool listed = false;
          for (const MatchedBlock& b : found) {
            for (const Replica& x : b.replicas) listed |= (x == rep);
          }
          if (listed || !registry_.MarkUsed(rep)) continue;
          if (!index_->AddReplica(op.hash, rep).ok()) registry_.FreeSlot(rep);
        }
        if (index_->StateOf(op.hash) == BlockState::kCommitted) KeepTokens(op.hash, op.token_ids);
        return absl::OkStatus();
      }
      NewBlock block;
      block.hash = op.hash;
      block.parent = op.parent;
      block.size_bytes = op.size_bytes;
      for (const WalReplica& r : op.replicas) {
        std::optional<uint16_t> node = registry_.Find(r.node_id);
        if (!node.has_value()) continue;
        std::optional<uint16_t> seg = registry_.FindSegment(*node, r.segment_id);
        if (!seg.has_value()) continue;
        Replica rep{*node, *seg, r.slot};
        if (registry_.MarkUsed(rep)) block.replicas.push_back(rep);
      }
      if (block.replicas.empty()) return absl::OkStatus();
      if (!index_->Insert(block, BlockState::kCommitted).ok()) {
        for (const Replica& r : block.replicas) registry_.FreeSlot(r);
        return absl::OkStatus();
      }
      KeepTokens(op.hash, op.token_ids);  // replicated from a leader (never on disk)
      return absl::OkStatus();
    }
    case WalOp::Type::kRemoveBlock: {
      if (op.hash.IsZero()) return absl::OkStatus();  // sequence marker of a snapshot
      for (const RemovedBlock& b : index_->RemoveSubtree(op.hash)) {
        for (const Replica& r : b.replicas) registry_.FreeSlot(r);
        DropTokens(b.hash);
      }
      return absl::OkStatus();
    }
  }
  return absl::OkStatus();
}

void CacheStore::UpdateCapacityHint() {
  const int64_t slots = registry_.SlotTotals().second;
  policy_->SetCapacityHint(slots);
  index_->SetGhostCapacity(
      std::min<size_t>(options_.max_ghost_blocks, static_cast<size_t>(kGhostCaches * slots)));
}

std::vector<Location> CacheStore::Describe(const Replicas& replicas) const {
  std::vector<Location> out;
  out.reserve(replicas.size());
  for (const Replica& r : replicas) out.push_back(registry_.Describe(r));
  return out;
}

std::vector<WalReplica> CacheStore::WalReplicas(const Replicas& replicas) const {
  std::vector<WalReplica> out;
  for (const Replica& r : replicas) {
    Location loc = registry_.Describe(r);
    out.push_back(WalReplica{loc.node_id, loc.segment_id, r.slot});
  }
  return out;
}

uint64_t CacheStore::Publish(StoreEvent event) {
  if (replaying_) return 0;
  absl::MutexLock lock(&events_mu_);
  if (wal_ != nullptr && next_sequence_ > sequence_reserved_) {
    // Log the high-water mark before handing the number out, so no number is ever reused
    // after kill -9 (removal events of a dropped node, for one, are not logged one by one).
    WalOp mark;
    mark.type = WalOp::Type::kSequenceMark;
    mark.sequence = next_sequence_ + kSequenceReservation - 1;
    absl::Status s = wal_->Append({mark});
    if (s.ok()) {
      sequence_reserved_ = mark.sequence;
    } else {
      KV_LOG(ERROR) << "cachestore: logging the event sequence mark failed: " << s;
    }
  }
  event.sequence = next_sequence_++;
  const uint64_t seq = event.sequence;
  events_.push_back(std::move(event));
  while (events_.size() > options_.event_retention) events_.pop_front();
  events_cv_.SignalAll();
  return seq;
}

void CacheStore::KeepTokens(const BlockHash& hash, absl::Span<const int32_t> tokens) {
  if (!options_.keep_block_tokens || tokens.empty()) return;
  absl::MutexLock lock(&tokens_mu_);
  tokens_.try_emplace(hash, tokens.begin(), tokens.end());
}

void CacheStore::DropTokens(const BlockHash& hash) {
  if (!options_.keep_block_tokens) return;
  absl::MutexLock lock(&tokens_mu_);
  tokens_.erase(hash);
}

std::vector<int32_t> CacheStore::TokensOf(const BlockHash& hash) const {
  if (!options_.keep_block_tokens) return {};
  absl::MutexLock lock(&tokens_mu_);
  auto it = tokens_.find(hash);
  return it == tokens_.end() ? std::vector<int32_t>() : it->second;
}

size_t CacheStore::kept_token_blocks() const {
  absl::MutexLock lock(&tokens_mu_);
  return tokens_.size();
}

uint64_t CacheStore::last_sequence() const {
  absl::MutexLock lock(&events_mu_);
  return next_sequence_ - 1;
}

void CacheStore::AppendWal(const std::vector<WalOp>& ops) {
  if (ops.empty()) return;
  {
    absl::MutexLock lock(&repl_mu_);
    if (repl_enabled_) {
      for (const WalOp& op : ops) repl_ops_.push_back(op);
      repl_end_ += ops.size();
      while (repl_ops_.size() > repl_retention_) repl_ops_.pop_front();
      repl_cv_.SignalAll();
    }
  }
  if (wal_ == nullptr) return;
  absl::Status s = wal_->Append(ops);
  // The in-memory state stays authoritative; a failed append is logged once per failure.
  if (!s.ok()) {
    KV_LOG(ERROR) << "cachestore: WAL append failed: " << s;
  }
}

void CacheStore::OnRemoved(const std::vector<RemovedBlock>& removed, std::vector<WalOp>* wal) {
  for (const RemovedBlock& b : removed) {
    DropTokens(b.hash);
    std::vector<std::string> nodes;
    for (const Replica& r : b.replicas) {
      if (auto id = registry_.NodeId(r.node)) nodes.push_back(*id);
      registry_.FreeSlot(r);
    }
    if (b.state != BlockState::kCommitted) continue;  // never visible: no event, no log
    const uint64_t seq = Publish({0, StoreEvent::Kind::kRemoved, b.hash, b.parent, nodes});
    if (wal != nullptr) {
      WalOp op;
      op.type = WalOp::Type::kRemoveBlock;
      op.sequence = seq;
      op.hash = b.hash;
      wal->push_back(std::move(op));
    }
  }
}

void CacheStore::RemoveNodeLocked(uint16_t node, bool log, std::string_view why) {
  std::optional<NodeSpec> spec = registry_.Spec(node);
  std::optional<std::string> id;
  if (spec.has_value()) id = spec->node_id;
  if (id.has_value()) {
    // Its allocations end (their blocks are on it anyway with own-node placement) and its
    // leases are released: nothing of this incarnation outlives it.
    for (auto it = allocations_.begin(); it != allocations_.end();) {
      if (it->second.owner.node_id == *id) {
        const int64_t n = static_cast<int64_t>(it->second.hashes.size());
        const int64_t before = allocated_blocks_;
        AbortLocked(it->second);
        allocated_blocks_ = before - n;
        allocations_.erase(it++);
      } else {
        ++it;
      }
    }
    for (std::vector<BlockHash>& blocks : leases_.RemoveOwner(*id)) index_->ReleaseLeases(blocks);
  }
  std::vector<RemovedBlock> removed = index_->RemoveNode(node);
  OnRemoved(removed, nullptr);  // replay of kRemoveNode repeats the same sweep
  DropDiskReplicasLocked(node);
  registry_.Remove(node);
  ReapOrphansLocked();
  UpdateCapacityHint();
  if (spec.has_value()) {
    if (!replaying_) {
      KV_LOG(INFO) << "cachestore: node " << spec->node_id << " incarnation " << spec->incarnation
                   << " " << why << "; dropped it and " << removed.size() << " blocks";
    }
    PublishNodeEventLocked(StoreEvent::Kind::kNodeLeft, *spec);
  }
  if (log && id.has_value()) {
    WalOp op;
    op.type = WalOp::Type::kRemoveNode;
    op.node_id = *id;
    AppendWal({op});
  }
}

void CacheStore::PublishNodeEventLocked(StoreEvent::Kind kind, const NodeSpec& spec) {
  StoreEvent e;
  e.kind = kind;
  e.node = WithoutSegments(spec);
  e.node_ids = {spec.node_id};
  Publish(std::move(e));
}

absl::Status CacheStore::CheckBlockTokens(const std::string& node_id, int32_t block_tokens) const {
  if (block_tokens == 0 || block_tokens == options_.block_tokens) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "node ", node_id, " uses ", block_tokens, "-token KV blocks (--block-tokens ", block_tokens,
      ") but this cache store ", options_.block_tokens, "-token ones (--block-tokens ",
      options_.block_tokens, "): every process of a deployment must use the same --block-tokens"));
}

absl::StatusOr<RegisterResult> CacheStore::RegisterNode(NodeSpec spec) {
  if (spec.ttl <= absl::ZeroDuration()) spec.ttl = options_.default_node_ttl;
  uint64_t total_bytes = 0;
  for (const SegmentSpec& seg : spec.segments) {
    if (seg.capacity_slots < 1 || seg.capacity_slots > options_.limits.max_capacity_slots) {
      return absl::InvalidArgumentError(absl::StrCat("segments.capacity_slots: want 1-",
                                                     options_.limits.max_capacity_slots, ", got ",
                                                     seg.capacity_slots));
    }
    if (seg.slot_bytes < 1 || seg.slot_bytes > options_.limits.max_slot_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("segments.slot_bytes: want 1-",
                                                     options_.limits.max_slot_bytes, ", got ",
                                                     seg.slot_bytes));
    }
    total_bytes += static_cast<uint64_t>(seg.capacity_slots) * seg.slot_bytes;
  }
  if (total_bytes > options_.limits.max_node_capacity_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("segments: a node may advertise at most ",
                                                   options_.limits.max_node_capacity_bytes,
                                                   " bytes in all, got ", total_bytes));
  }
  const bool assigned = spec.incarnation == 0;
  if (assigned) spec.incarnation = RandomId();  // legacy client: every registration is new
  absl::MutexLock lock(&mu_);
  absl::StatusOr<NodeRegistry::RegisterResult> r =
      registry_.Register(spec, clock_->Now(), /*force_replace=*/false,
                         /*allow_successor=*/!assigned);
  if (!r.ok()) {
    counters_.refused_registrations.fetch_add(1, std::memory_order_relaxed);
    KV_LOG(WARNING) << "cachestore: refused registration of " << spec.node_id << ": "
                    << r.status().message();
    return r.status();
  }
  if (r->replaced) {
    RemoveNodeLocked(r->index, /*log=*/true,
                     absl::StrCat("is gone (suspect, or its address is now incarnation ",
                                  spec.incarnation, "'s) and is replaced by it"));
    r = registry_.Register(spec, clock_->Now());
    if (!r.ok()) return r.status();
  }
  if (r->added) {
    WalOp op;
    op.type = WalOp::Type::kRegisterNode;
    op.node = spec;
    AppendWal({op});
    UpdateCapacityHint();
    KV_LOG(INFO) << "cachestore: node " << spec.node_id << " (" << NodeRoleName(spec.role)
                 << ") registered, incarnation " << spec.incarnation;
    PublishNodeEventLocked(StoreEvent::Kind::kNodeJoined, spec);
  } else if (r->revived) {
    PublishNodeEventLocked(StoreEvent::Kind::kNodeLive, spec);
  }
  return RegisterResult{spec.ttl, spec.incarnation, r->revived};
}

absl::Status CacheStore::DeregisterNode(const Caller& node) {
  absl::MutexLock lock(&mu_);
  KV_ASSIGN_OR_RETURN(uint16_t index, registry_.Check(node.node_id, node.incarnation));
  RemoveNodeLocked(index, /*log=*/true, "deregistered");
  return absl::OkStatus();
}

absl::StatusOr<HeartbeatResult> CacheStore::Heartbeat(const std::string& node_id,
                                                      uint64_t incarnation, const NodeLoad* load) {
  NodeRegistry::HeartbeatResult r = registry_.Heartbeat(node_id, incarnation, clock_->Now(), load);
  switch (r.outcome) {
    case NodeRegistry::HeartbeatOutcome::kUnknown:
      return HeartbeatResult{false, NodeState::kLive};
    case NodeRegistry::HeartbeatOutcome::kWrongIncarnation:
      return IdentityError(absl::FailedPreconditionError(absl::StrCat(
                               "incarnation: node '", node_id, "' is registered with incarnation ",
                               r.registered_incarnation, ", not ", incarnation,
                               " (this process was replaced or forgotten): register again")),
                           node_id);
    case NodeRegistry::HeartbeatOutcome::kRevived: {
      absl::MutexLock lock(&mu_);
      if (std::optional<NodeSpec> spec = registry_.Spec(r.index)) {
        KV_LOG(INFO) << "cachestore: node " << node_id << " is back within the grace period";
        PublishNodeEventLocked(StoreEvent::Kind::kNodeLive, *spec);
      }
      return HeartbeatResult{true, NodeState::kSuspect};
    }
    case NodeRegistry::HeartbeatOutcome::kOk:
      break;
  }
  return HeartbeatResult{true, NodeState::kLive};
}

void CacheStore::AppendMatched(const MatchedBlock& block, SegmentRefs& seen,
                               MatchResult& result) const {
  MatchResult::Block out{block.hash, block.size_bytes, {}};
  for (const Replica& r : block.replicas) {
    const uint32_t key = (static_cast<uint32_t>(r.node) << 16) | r.segment;
    uint32_t ref = UINT32_MAX;
    for (const auto& [k, v] : seen) {
      if (k == key) ref = v;
    }
    if (ref == UINT32_MAX) {
      ref = static_cast<uint32_t>(result.segments.size());
      result.segments.push_back(registry_.Describe(Replica{r.node, r.segment, 0}));
      seen.push_back({key, ref});
    }
    out.replicas.push_back({ref, r.slot});
  }
  result.blocks.push_back(std::move(out));
}

absl::StatusOr<MatchResult> CacheStore::MatchPrefix(absl::Span<const BlockHash> chain,
                                                    absl::Duration lease_ttl,
                                                    const Caller& caller) {
  if (lease_ttl > options_.max_lease_ttl) {
    return absl::InvalidArgumentError(
        absl::StrCat("lease_ttl_ms: at most ", absl::ToInt64Milliseconds(options_.max_lease_ttl),
                     ", got ", absl::ToInt64Milliseconds(lease_ttl)));
  }
  const bool lease = lease_ttl > absl::ZeroDuration();
  if (lease && !caller.anonymous()) {
    KV_RETURN_IF_ERROR(registry_.Check(caller.node_id, caller.incarnation).status());
  }
  std::vector<MatchedBlock> found;
  found.reserve(chain.size());
  MatchResult result;
  policy_->OnRequest(chain);  // adaptive policies learn from the request stream
  // A node removed while we resolve indices could hand its index to a new incarnation: retry
  // then (rare), so a location never names a process other than the one holding the block.
  for (int attempt = 0;; ++attempt) {
    const uint64_t removals = registry_.removals();
    found.clear();
    result = MatchResult{};
    result.matched = index_->MatchPrefix(chain, /*touch=*/attempt == 0, lease, &found);
    if (registry_.suspect_count() > 0) {
      // Replicas on suspect nodes are skipped; the prefix ends at a block with none left.
      for (int i = 0; i < result.matched; ++i) {
        Replicas& reps = found[i].replicas;
        reps.erase(std::remove_if(reps.begin(), reps.end(),
                                  [&](const Replica& r) { return registry_.IsSuspect(r.node); }),
                   reps.end());
        if (reps.empty()) {
          std::vector<BlockHash> unpinned;
          for (int j = i; j < result.matched; ++j) unpinned.push_back(found[j].hash);
          if (lease) index_->ReleaseLeases(unpinned);
          result.matched = i;
          found.resize(i);
          break;
        }
      }
    }
    // Resolve each distinct (node, segment) once; chains usually live on one or two segments.
    result.blocks.reserve(found.size());
    SegmentRefs seen;
    for (const MatchedBlock& b : found) AppendMatched(b, seen, result);
    if (registry_.removals() == removals) break;
    if (lease) {
      std::vector<BlockHash> pinned;
      for (const MatchedBlock& b : found) pinned.push_back(b.hash);
      index_->ReleaseLeases(pinned);
    }
  }
  // Where the DRAM prefix ends, the nodes' disk tiers may go on. No lease there: a block read
  // from disk is verified by its reader, and one overwritten meanwhile is recomputed.
  if (static_cast<size_t>(result.matched) < chain.size()) {
    SegmentRefs seen;
    for (const MatchedBlock& b : DiskRun(chain, static_cast<size_t>(std::max(result.matched, 0)))) {
      AppendMatched(b, seen, result);
      ++result.matched;
    }
  }
  counters_.prefix_queries.fetch_add(1, std::memory_order_relaxed);
  counters_.prefix_query_blocks.fetch_add(static_cast<int64_t>(chain.size()),
                                          std::memory_order_relaxed);
  counters_.prefix_hit_blocks.fetch_add(result.matched, std::memory_order_relaxed);
  for (const MatchResult::Block& b : result.blocks) {
    Tier fastest = Tier::kUnspecified;
    for (const MatchResult::Replica& r : b.replicas) {
      const Tier t = result.segments[r.segment].tier;
      if (fastest == Tier::kUnspecified || (t != Tier::kUnspecified && t < fastest)) fastest = t;
    }
    counters_.prefix_hit_blocks_by_tier[static_cast<size_t>(fastest)].fetch_add(
        1, std::memory_order_relaxed);
  }
  if (lease && result.matched > 0) {
    std::vector<BlockHash> hashes;
    hashes.reserve(found.size());
    for (const MatchedBlock& b : found) hashes.push_back(b.hash);
    result.lease_id = leases_.Add(std::move(hashes), clock_->Now() + lease_ttl,
                                  LeaseTable::Owner{caller.node_id, caller.incarnation});
  }
  return result;
}

std::vector<NodePrefix> CacheStore::QueryPrefix(absl::Span<const BlockHash> chain) {
  std::vector<MatchedBlock> found;
  index_->MatchPrefix(chain, /*touch=*/false, /*lease=*/false, &found);
  // node -> leading blocks held (in DRAM or on its disk tier) while unbroken, and how many of
  // them only on disk.
  struct Run {
    int matched = 0;
    int disk = 0;
  };
  absl::flat_hash_map<uint16_t, Run> run;
  absl::MutexLock disk_lock(&disk_mu_);
  for (size_t i = 0; i < chain.size(); ++i) {
    bool advanced = false;
    auto hold = [&](uint16_t node, bool on_disk) {
      if (registry_.IsSuspect(node)) return;
      auto it = run.find(node);
      if (i == 0 && it == run.end()) {
        run[node] = {1, on_disk ? 1 : 0};
        advanced = true;
      } else if (it != run.end() && it->second.matched == static_cast<int>(i)) {
        it->second.matched = static_cast<int>(i) + 1;
        if (on_disk) ++it->second.disk;
        advanced = true;
      }
    };
    if (i < found.size()) {
      for (const Replica& r : found[i].replicas) hold(r.node, false);
    }
    if (auto it = disk_blocks_.find(chain[i]); it != disk_blocks_.end()) {
      for (const Replica& r : it->second.replicas) hold(r.node, true);
    }
    if (!advanced) break;
  }
  std::vector<NodePrefix> out;
  for (const auto& [node, n] : run) {
    if (auto id = registry_.NodeId(node)) out.push_back({*id, n.matched, n.disk});
  }
  std::sort(out.begin(), out.end(), [](const NodePrefix& a, const NodePrefix& b) {
    return a.matched != b.matched ? a.matched > b.matched : a.node_id < b.node_id;
  });
  return out;
}

absl::StatusOr<std::vector<const SegmentView*>> CacheStore::PlaceLocked(
    const AllocateArgs& args, size_t i, std::optional<uint16_t> only_node,
    std::optional<uint16_t> prefer_node, absl::Time deadline, std::vector<SegmentView>* views,
    std::vector<WalOp>* wal) {
  const AllocateArgs::Block& b = args.blocks[i];
  const int replicas = only_node.has_value() ? 1 : std::max(1, args.replicas);
  // Candidate segments on one node (own-node / preferred placement) or anywhere.
  auto on_node = [&](uint16_t node) {
    std::vector<SegmentView> out;
    for (const SegmentView& v : *views) {
      if (v.node == node) out.push_back(v);
    }
    return out;
  };
  // Evicts (leaf-first, by policy) one block with a replica in a fitting segment of `scope`
  // (all when nullopt); false when nothing there is evictable.
  auto evict_one = [&](std::optional<uint16_t> scope)
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::StatusOr<bool> {
    if (clock_->Now() > deadline && options_.clock == nullptr) {
      return absl::DeadlineExceededError("allocate: deadline passed while evicting");
    }
    std::vector<SegmentView> fits;
    for (const SegmentView& v : *views) {
      if (v.slot_bytes >= b.size_bytes && (!scope.has_value() || v.node == *scope)) {
        fits.push_back(v);
      }
    }
    if (fits.empty()) return false;
    auto evicted = index_->EvictOne([&](const RemovedBlock& candidate) {
      for (const Replica& r : candidate.replicas) {
        for (const SegmentView& v : fits) {
          if (v.node == r.node && v.segment == r.segment) return true;
        }
      }
      return false;
    });
    if (!evicted.has_value()) return false;
    counters_.evicted_blocks.fetch_add(1, std::memory_order_relaxed);
    OnRemoved({*evicted}, wal);
    *views = registry_.Segments(only_node);
    return true;
  };
  const std::optional<uint16_t> local = only_node.has_value() ? only_node : prefer_node;
  if (local.has_value()) {
    while (true) {
      std::vector<SegmentView> mine = on_node(*local);
      std::vector<const SegmentView*> chosen =
          ChoosePlacement(mine, b.size_bytes, "", args.preferred_tier, 1);
      if (!chosen.empty()) {
        // Map back into *views so the pointers stay valid for the caller.
        for (const SegmentView& v : *views) {
          if (v.node == chosen[0]->node && v.segment == chosen[0]->segment) {
            std::vector<const SegmentView*> out = {&v};
            if (replicas > 1) {
              std::vector<SegmentView> others;
              for (const SegmentView& o : *views) {
                if (o.node != v.node) others.push_back(o);
              }
              for (const SegmentView* o :
                   ChoosePlacement(others, b.size_bytes, "", args.preferred_tier, replicas - 1)) {
                for (const SegmentView& w : *views) {
                  if (w.node == o->node && w.segment == o->segment) out.push_back(&w);
                }
              }
            }
            return out;
          }
        }
      }
      KV_ASSIGN_OR_RETURN(bool evicted, evict_one(*local));
      if (!evicted) break;
    }
    if (only_node.has_value()) {
      const std::string node = registry_.NodeId(*only_node).value_or("?");
      return absl::ResourceExhaustedError(absl::StrCat(
          "blocks[", i, "]: node '", node, "' has no free slot of at least ", b.size_bytes,
          " bytes and nothing evictable there (all leased, uncommitted or too small)"));
    }
  }
  std::vector<const SegmentView*> chosen =
      ChoosePlacement(*views, b.size_bytes, args.preferred_node, args.preferred_tier, replicas);
  while (chosen.empty()) {
    KV_ASSIGN_OR_RETURN(bool evicted, evict_one(std::nullopt));
    if (!evicted) break;
    chosen =
        ChoosePlacement(*views, b.size_bytes, args.preferred_node, args.preferred_tier, replicas);
  }
  if (chosen.empty()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("blocks[", i, "]: no segment with a free slot of at least ", b.size_bytes,
                     " bytes, and nothing evictable (all leased, uncommitted or too small)"));
  }
  return chosen;
}

absl::StatusOr<AllocateResult> CacheStore::Allocate(const AllocateArgs& args, absl::Time deadline) {
  if (args.blocks.empty()) return absl::InvalidArgumentError("blocks: at least one block needed");
  const int replicas = args.replicas == 0 ? 1 : args.replicas;
  if (replicas < 1 || replicas > options_.limits.max_replicas) {
    return absl::InvalidArgumentError(
        absl::StrCat("replicas: want 1-", options_.limits.max_replicas, ", got ", args.replicas));
  }
  absl::MutexLock lock(&mu_);
  // A node allocating for itself places in its own segments only (issue 10.9: spilling onto
  // another node made the caller abort the blocks, and nothing was ever evicted).
  std::optional<uint16_t> only_node, prefer_node;
  if (!args.caller.anonymous()) {
    KV_ASSIGN_OR_RETURN(uint16_t caller,
                        registry_.Check(args.caller.node_id, args.caller.incarnation));
    const bool has_segments =
        registry_.Spec(caller).has_value() && !registry_.Spec(caller)->segments.empty();
    if (has_segments &&
        (args.preferred_node.empty() || args.preferred_node == args.caller.node_id)) {
      only_node = caller;
    }
  }
  if (!only_node.has_value() && !args.preferred_node.empty()) {
    prefer_node = registry_.Find(args.preferred_node);
    if (prefer_node.has_value() && registry_.IsSuspect(*prefer_node)) prefer_node.reset();
  }
  AllocateArgs effective = args;
  effective.replicas = replicas;
  AllocateResult result;
  PendingAllocation pending;
  pending.owner = args.caller;
  if (!args.caller.anonymous() && pending.owner.incarnation == 0 && only_node.has_value()) {
    pending.owner.incarnation = registry_.Spec(*only_node)->incarnation;
  }
  std::vector<WalOp> wal;
  auto fail = [&](absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    AbortLocked(pending);
    AppendWal(wal);
    return status;
  };
  std::vector<SegmentView> views = registry_.Segments(only_node);
  absl::flat_hash_map<BlockHash, int> in_request;
  for (size_t i = 0; i < args.blocks.size(); ++i) {
    const AllocateArgs::Block& b = args.blocks[i];
    if (b.hash.IsZero()) {
      return fail(
          absl::InvalidArgumentError(absl::StrCat("blocks[", i, "].hash: must not be zero")));
    }
    if (b.size_bytes == 0 || b.size_bytes > options_.limits.max_slot_bytes) {
      return fail(absl::InvalidArgumentError(absl::StrCat("blocks[", i, "].size_bytes: want 1-",
                                                          options_.limits.max_slot_bytes, ", got ",
                                                          b.size_bytes)));
    }
    if (in_request.contains(b.hash)) {
      return fail(absl::InvalidArgumentError(
          absl::StrCat("blocks[", i, "].hash: duplicate of blocks[", in_request[b.hash], "]")));
    }
    in_request[b.hash] = static_cast<int>(i);
    std::optional<BlockState> state = index_->StateOf(b.hash);
    if (state == BlockState::kCommitted) {
      std::vector<MatchedBlock> found;
      index_->MatchPrefix(absl::MakeConstSpan(&b.hash, 1), false, false, &found);
      const bool on_caller = !found.empty() && only_node.has_value() &&
                             std::any_of(found[0].replicas.begin(), found[0].replicas.end(),
                                         [&](const Replica& r) { return r.node == *only_node; });
      if (args.add_local_replicas && only_node.has_value() && !found.empty() && !on_caller) {
        AllocateArgs one = effective;
        one.replicas = 1;
        absl::StatusOr<std::vector<const SegmentView*>> chosen =
            PlaceLocked(one, i, only_node, prefer_node, deadline, &views, &wal);
        std::optional<Replica> rep;
        if (chosen.ok() && !chosen->empty()) {
          const uint16_t node = (*chosen)[0]->node, segment = (*chosen)[0]->segment;
          if (std::optional<uint32_t> slot = registry_.ReserveSlot(node, segment)) {
            rep = Replica{node, segment, *slot};
          }
        }
        if (!rep.has_value()) views = registry_.Segments(only_node);  // nothing reserved: fresh
        if (rep.has_value()) {
          TakeSlot(views, rep->node, rep->segment);
          pending.extra.push_back({b.hash, b.parent, *rep});
          result.blocks.push_back({b.hash, Describe(Replicas{*rep}), false});
          continue;
        }
        // No room for one more copy: the block stays where it is.
      }
      AllocateResult::Block out{b.hash, {}, true};
      if (!found.empty()) out.replicas = Describe(found[0].replicas);
      result.blocks.push_back(std::move(out));
      continue;
    }
    if (state == BlockState::kAllocated) {
      return fail(absl::AlreadyExistsError(absl::StrCat(
          "blocks[", i, "].hash: ", b.hash.ToHex(), " is being written by another allocation")));
    }
    if (!b.parent.IsZero() && !index_->Contains(b.parent)) {
      return fail(absl::FailedPreconditionError(
          absl::StrCat("blocks[", i, "].parent: ", b.parent.ToHex(),
                       " is neither stored nor allocated earlier in this request")));
    }
    absl::StatusOr<std::vector<const SegmentView*>> chosen =
        PlaceLocked(effective, i, only_node, prefer_node, deadline, &views, &wal);
    if (!chosen.ok()) return fail(chosen.status());
    NewBlock nb;
    nb.hash = b.hash;
    nb.parent = b.parent;
    nb.size_bytes = static_cast<uint32_t>(b.size_bytes);
    bool refused = false;
    for (const SegmentView* v : *chosen) {
      std::optional<uint32_t> slot = registry_.ReserveSlot(v->node, v->segment);
      if (slot.has_value()) {
        nb.replicas.push_back(Replica{v->node, v->segment, *slot});
      } else {
        refused = true;
      }
    }
    if (refused) {
      views = registry_.Segments(only_node);
    } else {
      for (const Replica& r : nb.replicas) TakeSlot(views, r.node, r.segment);
    }
    if (nb.replicas.empty()) {
      return fail(absl::ResourceExhaustedError(
          absl::StrCat("blocks[", i, "]: the chosen segments filled up; retry")));
    }
    absl::Status s = index_->Insert(nb, BlockState::kAllocated);
    if (!s.ok()) {
      for (const Replica& r : nb.replicas) registry_.FreeSlot(r);
      return fail(absl::Status(s.code(), absl::StrCat("blocks[", i, "]: ", s.message())));
    }
    pending.hashes.push_back(b.hash);
    pending.parents[b.hash] = b.parent;
    result.blocks.push_back({b.hash, Describe(nb.replicas), false});
  }
  AppendWal(wal);
  counters_.allocated_blocks.fetch_add(static_cast<int64_t>(pending.hashes.size()),
                                       std::memory_order_relaxed);
  result.commit_timeout = options_.commit_timeout;
  if (!pending.empty()) {
    uint64_t id = RandomId();
    while (allocations_.contains(id)) id = RandomId();
    result.allocation_id = id;
    pending.deadline = clock_->Now() + options_.commit_timeout;
    allocated_blocks_ += static_cast<int64_t>(pending.hashes.size());
    allocations_[result.allocation_id] = std::move(pending);
  }
  return result;
}

absl::Status CacheStore::CheckOwner(uint64_t allocation_id, const PendingAllocation& pending,
                                    const Caller& caller) const {
  const Caller& owner = pending.owner;
  if (owner.anonymous()) return absl::OkStatus();
  if (caller.node_id != owner.node_id) {
    return IdentityError(absl::PermissionDeniedError(absl::StrCat(
                             "allocation_id: allocation ", allocation_id, " belongs to node '",
                             owner.node_id, "', not to ",
                             caller.anonymous() ? std::string("an anonymous caller")
                                                : absl::StrCat("node '", caller.node_id, "'"))),
                         caller.node_id);
  }
  if (caller.incarnation != owner.incarnation) {
    return IdentityError(
        absl::FailedPreconditionError(absl::StrCat(
            "incarnation: allocation ", allocation_id, " belongs to node '", owner.node_id,
            "' incarnation ", owner.incarnation, ", not incarnation ", caller.incarnation)),
        caller.node_id);
  }
  return absl::OkStatus();
}

absl::StatusOr<int> CacheStore::Commit(uint64_t allocation_id, absl::Span<const BlockHash> hashes,
                                       const Caller& caller, absl::Span<const int32_t> token_ids) {
  const size_t block_tokens = static_cast<size_t>(options_.block_tokens);
  if (!token_ids.empty() && token_ids.size() != hashes.size() * block_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("token_ids: ", token_ids.size(), " tokens for ", hashes.size(), " hashes of ",
                     block_tokens, " tokens each (want ", hashes.size() * block_tokens, ")"));
  }
  // Block hash -> its tokens; empty when not kept (nothing is copied then).
  absl::flat_hash_map<BlockHash, absl::Span<const int32_t>> tokens_of;
  if (options_.keep_block_tokens && !token_ids.empty()) {
    for (size_t i = 0; i < hashes.size(); ++i) {
      tokens_of[hashes[i]] = token_ids.subspan(i * block_tokens, block_tokens);
    }
  }
  absl::MutexLock lock(&mu_);
  auto it = allocations_.find(allocation_id);
  if (it == allocations_.end()) {
    return absl::NotFoundError(absl::StrCat("allocation_id: ", allocation_id,
                                            " is unknown (committed, aborted or reclaimed)"));
  }
  KV_RETURN_IF_ERROR(CheckOwner(allocation_id, it->second, caller));
  PendingAllocation& pending = it->second;
  std::vector<bool> wanted(pending.hashes.size(), hashes.empty());
  for (size_t i = 0; i < hashes.size(); ++i) {
    auto pos = std::find(pending.hashes.begin(), pending.hashes.end(), hashes[i]);
    if (pos == pending.hashes.end()) {
      if (std::any_of(
              pending.extra.begin(), pending.extra.end(),
              [&](const PendingAllocation::ExtraReplica& x) { return x.hash == hashes[i]; })) {
        continue;  // one more replica of a committed block (see below)
      }
      return absl::InvalidArgumentError(absl::StrCat("hashes[", i, "]: ", hashes[i].ToHex(),
                                                     " is not an uncommitted block of allocation ",
                                                     allocation_id));
    }
    wanted[pos - pending.hashes.begin()] = true;
  }
  std::vector<WalOp> wal;
  std::vector<BlockHash> left;
  int committed = 0;
  absl::Status status;
  for (size_t i = 0; i < pending.hashes.size(); ++i) {
    const BlockHash& h = pending.hashes[i];
    if (!wanted[i] || !status.ok()) {
      left.push_back(h);
      continue;
    }
    absl::Status s = index_->Commit(h);
    if (!s.ok()) {
      if (absl::IsNotFound(s)) continue;  // lost with its node; nothing to commit
      status = s;
      left.push_back(h);
      continue;
    }
    std::vector<MatchedBlock> found;
    index_->MatchPrefix(absl::MakeConstSpan(&h, 1), false, false, &found);
    if (found.empty()) continue;
    WalOp op;
    op.type = WalOp::Type::kCommitBlock;
    op.hash = h;
    op.parent = pending.parents[h];
    op.size_bytes = found[0].size_bytes;
    op.replicas = WalReplicas(found[0].replicas);
    std::vector<std::string> nodes;
    for (const WalReplica& r : op.replicas) nodes.push_back(r.node_id);
    if (auto t = tokens_of.find(h); t != tokens_of.end()) {
      KeepTokens(h, t->second);
      op.token_ids.assign(t->second.begin(), t->second.end());
    }
    op.sequence = Publish(
        {0, StoreEvent::Kind::kStored, op.hash, op.parent, std::move(nodes), {}, op.token_ids});
    pending.parents.erase(h);
    wal.push_back(std::move(op));
    ++committed;
  }
  // One more replica of blocks committed elsewhere: listed unless the block went meanwhile.
  std::vector<PendingAllocation::ExtraReplica> extra_left;
  for (PendingAllocation::ExtraReplica& x : pending.extra) {
    const bool named =
        hashes.empty() || std::find(hashes.begin(), hashes.end(), x.hash) != hashes.end();
    if (!named || !status.ok()) {
      extra_left.push_back(x);
      continue;
    }
    if (index_->StateOf(x.hash) != BlockState::kCommitted ||
        !index_->AddReplica(x.hash, x.replica).ok()) {
      registry_.FreeSlot(x.replica);
      continue;
    }
    std::vector<MatchedBlock> found;
    index_->MatchPrefix(absl::MakeConstSpan(&x.hash, 1), false, false, &found);
    if (found.empty()) continue;
    WalOp op;
    op.type = WalOp::Type::kCommitBlock;  // replay adds the replicas the index lacks
    op.hash = x.hash;
    op.parent = x.parent;
    op.size_bytes = found[0].size_bytes;
    op.replicas = WalReplicas(found[0].replicas);
    std::vector<std::string> nodes;
    for (const WalReplica& r : op.replicas) nodes.push_back(r.node_id);
    if (auto t = tokens_of.find(x.hash); t != tokens_of.end()) KeepTokens(x.hash, t->second);
    op.token_ids = TokensOf(x.hash);  // the first committer's, when it sent them
    op.sequence = Publish(
        {0, StoreEvent::Kind::kStored, op.hash, op.parent, std::move(nodes), {}, op.token_ids});
    wal.push_back(std::move(op));
    ++committed;
  }
  pending.extra = std::move(extra_left);
  AppendWal(wal);
  counters_.committed_blocks.fetch_add(committed, std::memory_order_relaxed);
  allocated_blocks_ -= static_cast<int64_t>(pending.hashes.size() - left.size());
  pending.hashes = std::move(left);
  if (pending.empty()) allocations_.erase(it);
  MaybeSnapshotLocked();
  if (!status.ok()) return status;
  return committed;
}

void CacheStore::AbortLocked(PendingAllocation& pending) {
  // Children first: reverse of the parent-first allocation order.
  for (auto it = pending.hashes.rbegin(); it != pending.hashes.rend(); ++it) {
    absl::StatusOr<RemovedBlock> removed = index_->RemoveAllocated(*it);
    if (!removed.ok()) {
      // A child in another allocation still points at it: it goes when that one ends.
      if (index_->StateOf(*it) == BlockState::kAllocated) orphans_.push_back(*it);
      continue;  // else lost with its node already
    }
    for (const Replica& r : removed->replicas) registry_.FreeSlot(r);
    --allocated_blocks_;
  }
  pending.hashes.clear();
  for (const PendingAllocation::ExtraReplica& x : pending.extra) registry_.FreeSlot(x.replica);
  pending.extra.clear();
  ReapOrphansLocked();
}

void CacheStore::ReapOrphansLocked() {
  // Each pass removes the childless ones; a removal can free its parent for the next pass.
  bool progress = true;
  while (progress && !orphans_.empty()) {
    progress = false;
    for (size_t i = 0; i < orphans_.size();) {
      if (index_->StateOf(orphans_[i]) != BlockState::kAllocated) {
        orphans_[i] = orphans_.back();  // committed meanwhile can't happen; gone with a node can
        orphans_.pop_back();
        continue;
      }
      absl::StatusOr<RemovedBlock> removed = index_->RemoveAllocated(orphans_[i]);
      if (!removed.ok()) {
        ++i;
        continue;
      }
      for (const Replica& r : removed->replicas) registry_.FreeSlot(r);
      counters_.reclaimed_blocks.fetch_add(1, std::memory_order_relaxed);
      orphans_[i] = orphans_.back();
      orphans_.pop_back();
      progress = true;
    }
  }
}

absl::Status CacheStore::Abort(uint64_t allocation_id, const Caller& caller) {
  absl::MutexLock lock(&mu_);
  auto it = allocations_.find(allocation_id);
  if (it == allocations_.end()) {
    return absl::NotFoundError(absl::StrCat("allocation_id: ", allocation_id,
                                            " is unknown (committed, aborted or reclaimed)"));
  }
  KV_RETURN_IF_ERROR(CheckOwner(allocation_id, it->second, caller));
  // allocated_blocks_ was raised by the full count; AbortLocked lowers it per removed block.
  const int64_t n = static_cast<int64_t>(it->second.hashes.size());
  const int64_t before = allocated_blocks_;
  AbortLocked(it->second);
  allocated_blocks_ = before - n;
  counters_.aborted_blocks.fetch_add(n, std::memory_order_relaxed);
  allocations_.erase(it);
  return absl::OkStatus();
}

absl::Status CacheStore::ReleaseLease(uint64_t lease_id, const Caller& caller) {
  KV_ASSIGN_OR_RETURN(
      std::vector<BlockHash> blocks,
      leases_.Release(lease_id, LeaseTable::Owner{caller.node_id, caller.incarnation}));
  index_->ReleaseLeases(blocks);
  return absl::OkStatus();
}

absl::StatusOr<AnnounceResult> CacheStore::AnnounceBlocks(const Caller& node,
                                                          const std::string& segment_id,
                                                          absl::Span<const AnnouncedBlock> blocks) {
  if (node.anonymous()) return absl::InvalidArgumentError("node_id: must not be empty");
  if (static_cast<int>(blocks.size()) > options_.limits.max_announce) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "blocks: at most ", options_.limits.max_announce, " per call, got ", blocks.size()));
  }
  absl::MutexLock lock(&mu_);
  KV_ASSIGN_OR_RETURN(uint16_t index, registry_.Check(node.node_id, node.incarnation));
  std::optional<uint16_t> segment = registry_.FindSegment(index, segment_id);
  if (!segment.has_value()) {
    return absl::NotFoundError(absl::StrCat("segment_id: node '", node.node_id,
                                            "' registered no segment '", segment_id, "'"));
  }
  std::optional<NodeSpec> spec = registry_.Spec(index);
  const SegmentSpec& seg = spec->segments[*segment];
  if (seg.tier == Tier::kSsd) {
    AnnounceResult disk =
        AnnounceDiskLocked(index, *segment, seg.slot_bytes, seg.capacity_slots, blocks);
    counters_.announced_blocks.fetch_add(disk.accepted, std::memory_order_relaxed);
    return disk;
  }
  AnnounceResult result;
  std::vector<WalOp> wal;
  auto log_commit = [&](const BlockHash& hash,
                        const BlockHash& parent) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<MatchedBlock> found;
    index_->MatchPrefix(absl::MakeConstSpan(&hash, 1), false, false, &found);
    if (found.empty()) return;
    WalOp op;
    op.type = WalOp::Type::kCommitBlock;
    op.hash = hash;
    op.parent = parent;
    op.size_bytes = found[0].size_bytes;
    op.replicas = WalReplicas(found[0].replicas);
    std::vector<std::string> nodes;
    for (const WalReplica& r : op.replicas) nodes.push_back(r.node_id);
    // A replica re-announced to a block the store already has keeps that block's tokens; an
    // announcement carries none of its own.
    op.token_ids = TokensOf(hash);
    op.sequence =
        Publish({0, StoreEvent::Kind::kStored, hash, parent, std::move(nodes), {}, op.token_ids});
    wal.push_back(std::move(op));
  };
  for (size_t i = 0; i < blocks.size(); ++i) {
    const AnnouncedBlock& b = blocks[i];
    const int at = static_cast<int>(i);
    if (b.hash.IsZero() || b.size_bytes == 0 || b.size_bytes > seg.slot_bytes ||
        static_cast<int64_t>(b.slot) >= seg.capacity_slots) {
      result.rejected.push_back({at, AnnounceRejection::kBadInput});
      continue;
    }
    const Replica rep{index, *segment, b.slot};
    std::optional<BlockState> state = index_->StateOf(b.hash);
    if (state == BlockState::kAllocated) {
      result.rejected.push_back({at, AnnounceRejection::kInFlight});
      continue;
    }
    if (state == BlockState::kCommitted) {
      std::vector<MatchedBlock> found;
      index_->MatchPrefix(absl::MakeConstSpan(&b.hash, 1), false, false, &found);
      bool exact = false, same_node = false;
      for (const MatchedBlock& m : found) {
        for (const Replica& x : m.replicas) {
          exact |= (x == rep);
          same_node |= (x.node == index);
        }
      }
      if (exact) {
        ++result.already_present;
      } else if (same_node) {
        result.rejected.push_back({at, AnnounceRejection::kConflict});
      } else if (!registry_.MarkUsed(rep)) {
        result.rejected.push_back({at, AnnounceRejection::kSlotInUse});
      } else if (!index_->AddReplica(b.hash, rep).ok()) {
        registry_.FreeSlot(rep);
        result.rejected.push_back({at, AnnounceRejection::kConflict});
      } else {
        ++result.accepted;
        log_commit(b.hash, b.parent);
      }
      continue;
    }
    if (!b.parent.IsZero() && index_->StateOf(b.parent) != BlockState::kCommitted) {
      result.rejected.push_back({at, AnnounceRejection::kParentMissing});
      continue;
    }
    if (!registry_.MarkUsed(rep)) {
      result.rejected.push_back({at, AnnounceRejection::kSlotInUse});
      continue;
    }
    NewBlock nb;
    nb.hash = b.hash;
    nb.parent = b.parent;
    nb.size_bytes = static_cast<uint32_t>(b.size_bytes);
    nb.replicas.push_back(rep);
    if (!index_->Insert(nb, BlockState::kCommitted).ok()) {
      registry_.FreeSlot(rep);
      result.rejected.push_back({at, AnnounceRejection::kParentMissing});
      continue;
    }
    ++result.accepted;
    log_commit(b.hash, b.parent);
  }
  AppendWal(wal);
  counters_.announced_blocks.fetch_add(result.accepted, std::memory_order_relaxed);
  MaybeSnapshotLocked();
  return result;
}

namespace {
uint64_t DiskSlotKey(const Replica& r) {
  return (static_cast<uint64_t>(r.node) << 48) | (static_cast<uint64_t>(r.segment) << 32) | r.slot;
}
}  // namespace

AnnounceResult CacheStore::AnnounceDiskLocked(uint16_t node, uint16_t segment, uint64_t slot_bytes,
                                              int64_t capacity_slots,
                                              absl::Span<const AnnouncedBlock> blocks) {
  AnnounceResult result;
  const std::string node_id = registry_.NodeId(node).value_or("");
  std::vector<StoreEvent> events;
  auto event = [&](StoreEvent::Kind kind, const BlockHash& hash) {
    StoreEvent e;
    e.kind = kind;
    e.hash = hash;
    e.node_ids = {node_id};
    e.tier = Tier::kSsd;
    events.push_back(std::move(e));
  };
  {
    absl::MutexLock lock(&disk_mu_);
    for (size_t i = 0; i < blocks.size(); ++i) {
      const AnnouncedBlock& b = blocks[i];
      if (b.size_bytes > slot_bytes || static_cast<int64_t>(b.slot) >= capacity_slots) {
        result.rejected.push_back({static_cast<int>(i), AnnounceRejection::kBadInput});
        continue;
      }
      const Replica rep{node, segment, b.slot};
      const uint64_t key = DiskSlotKey(rep);
      if (auto old = disk_slots_.find(key); old != disk_slots_.end()) {
        if (old->second == b.hash) {
          ++result.already_present;
          continue;
        }
        // The node wrote another block into the slot: the one it held is gone from there.
        const BlockHash gone = old->second;
        disk_slots_.erase(old);
        registry_.FreeSlot(rep);
        if (auto it = disk_blocks_.find(gone); it != disk_blocks_.end()) {
          Replicas& reps = it->second.replicas;
          reps.erase(std::remove(reps.begin(), reps.end(), rep), reps.end());
          if (reps.empty()) disk_blocks_.erase(it);
        }
        event(StoreEvent::Kind::kRemoved, gone);
      }
      ++result.accepted;
      if (b.hash.IsZero()) continue;  // the slot holds nothing now
      DiskBlock& block = disk_blocks_[b.hash];
      block.size_bytes = static_cast<uint32_t>(b.size_bytes);
      block.replicas.push_back(rep);
      disk_slots_[key] = b.hash;
      registry_.MarkUsed(rep);
      event(StoreEvent::Kind::kStored, b.hash);
    }
  }
  for (StoreEvent& e : events) Publish(std::move(e));
  return result;
}

void CacheStore::DropDiskReplicasLocked(uint16_t node) {
  absl::MutexLock lock(&disk_mu_);
  for (auto it = disk_slots_.begin(); it != disk_slots_.end();) {
    if (static_cast<uint16_t>(it->first >> 48) != node) {
      ++it;
      continue;
    }
    if (auto b = disk_blocks_.find(it->second); b != disk_blocks_.end()) {
      Replicas& reps = b->second.replicas;
      reps.erase(std::remove_if(reps.begin(), reps.end(),
                                [node](const Replica& r) { return r.node == node; }),
                 reps.end());
      if (reps.empty()) disk_blocks_.erase(b);
    }
    disk_slots_.erase(it++);
  }
}

std::vector<MatchedBlock> CacheStore::DiskRun(absl::Span<const BlockHash> chain,
                                              size_t from) const {
  std::vector<MatchedBlock> out;
  absl::MutexLock lock(&disk_mu_);
  for (size_t i = from; i < chain.size() && !disk_blocks_.empty(); ++i) {
    auto it = disk_blocks_.find(chain[i]);
    if (it == disk_blocks_.end()) break;
    MatchedBlock m;
    m.hash = chain[i];
    m.size_bytes = it->second.size_bytes;
    for (const Replica& r : it->second.replicas) {
      if (!registry_.IsSuspect(r.node)) m.replicas.push_back(r);
    }
    if (m.replicas.empty()) break;
    out.push_back(std::move(m));
  }
  return out;
}

std::vector<NodeInfo> CacheStore::ListNodes() const { return registry_.List(clock_->Now()); }

std::optional<NodeRole> CacheStore::RoleOf(const std::string& node_id) const {
  std::optional<uint16_t> index = registry_.Find(node_id);
  if (!index.has_value()) return std::nullopt;
  std::optional<NodeSpec> spec = registry_.Spec(*index);
  if (!spec.has_value()) return std::nullopt;
  return spec->role;
}

StoreStats CacheStore::Stats() const {
  StoreStats s;
  s.nodes = registry_.live_count();
  s.suspect_nodes = registry_.size() - s.nodes;
  s.store_incarnation = store_incarnation_;
  s.committed_blocks = index_->committed_count();
  s.allocated_blocks = index_->size() - s.committed_blocks;
  s.active_leases = leases_.active();
  s.evictions = counters_.evicted_blocks.load(std::memory_order_relaxed);
  {
    absl::MutexLock lock(&disk_mu_);
    s.disk_blocks = static_cast<int64_t>(disk_blocks_.size());
  }
  s.last_sequence = last_sequence();
  s.index_bytes = static_cast<int64_t>(index_->MemoryUsageBytes());
  {
    absl::MutexLock lock(&events_mu_);
    s.retained_events = static_cast<int64_t>(events_.size());
  }
  s.kept_token_blocks = static_cast<int64_t>(kept_token_blocks());
  s.tiers = registry_.Usage();
  s.policy = std::string(policy_->name());
  return s;
}

void CacheStore::Tick() {
  const absl::Time now = clock_->Now();
  for (std::vector<BlockHash>& blocks : leases_.Expire(now)) {
    index_->ReleaseLeases(blocks);
    counters_.expired_leases.fetch_add(1, std::memory_order_relaxed);
  }
  absl::MutexLock lock(&mu_);
  NodeRegistry::Sweep sweep = registry_.Expire(now, options_.suspect_grace);
  for (uint16_t node : sweep.suspected) {
    std::optional<NodeSpec> spec = registry_.Spec(node);
    if (!spec.has_value()) continue;
    KV_LOG(WARNING) << "cachestore: node " << spec->node_id << " missed its heartbeat TTL ("
                    << spec->ttl << "); suspect: its blocks are skipped, and dropped after "
                    << options_.suspect_grace << " more";
    counters_.suspected_nodes.fetch_add(1, std::memory_order_relaxed);
    PublishNodeEventLocked(StoreEvent::Kind::kNodeSuspect, *spec);
  }
  for (uint16_t node : sweep.forget) {
    RemoveNodeLocked(node, /*log=*/true, "stayed silent past its TTL and the grace period");
    counters_.expired_nodes.fetch_add(1, std::memory_order_relaxed);
  }
  for (auto it = allocations_.begin(); it != allocations_.end();) {
    if (it->second.deadline <= now) {
      const int64_t n = static_cast<int64_t>(it->second.hashes.size());
      const int64_t before = allocated_blocks_;
      AbortLocked(it->second);
      allocated_blocks_ = before - n;
      counters_.reclaimed_blocks.fetch_add(n, std::memory_order_relaxed);
      // (AbortLocked reaps orphans the allocation released.)
      allocations_.erase(it++);
    } else {
      ++it;
    }
  }
  auto [used, capacity] = registry_.SlotTotals();
  if (capacity > 0 && static_cast<double>(used) > options_.high_watermark * capacity) {
    std::vector<WalOp> wal;
    while (static_cast<double>(used) > options_.low_watermark * capacity) {
      std::optional<RemovedBlock> evicted = index_->EvictOne();
      if (!evicted.has_value()) break;
      counters_.evicted_blocks.fetch_add(1, std::memory_order_relaxed);
      used -= static_cast<int64_t>(evicted->replicas.size());
      OnRemoved({*evicted}, &wal);
    }
    AppendWal(wal);
  }
  MaybeSnapshotLocked();
}

void CacheStore::MaybeSnapshotLocked() {
  if (wal_ == nullptr || wal_->records_since_reset() < options_.snapshot_every_ops) return;
  absl::Status s = SnapshotLocked();
  if (!s.ok()) {
    KV_LOG(ERROR) << "cachestore: snapshot failed: " << s;
  }
}

absl::Status CacheStore::WriteSnapshotNow() {
  absl::MutexLock lock(&mu_);
  if (wal_ == nullptr) return absl::FailedPreconditionError("no --data-dir: nothing to snapshot");
  return SnapshotLocked();
}

absl::Status CacheStore::SnapshotLocked() {
  absl::Status written;
  {
    std::vector<WalOp> ops = StateAsOpsLocked(WalTokens::kDrop);
    written = WriteSnapshot(options_.data_dir + kSnapshotFile, ops);
  }
  // The whole index as records, then as one framed string: tens of MiB for a few seconds,
  // which the allocator would otherwise keep resident (a 30-minute soak's store grew 43% at
  // its first snapshot and stayed there).
  ReleaseFreeHeapMemory();
  KV_RETURN_IF_ERROR(written);
  return wal_->Reset();
}

std::vector<WalOp> CacheStore::StateAsOpsLocked(WalTokens tokens) {
  std::vector<WalOp> ops;
  for (const NodeSpec& spec : registry_.AllSpecs()) {
    WalOp op;
    op.type = WalOp::Type::kRegisterNode;
    op.node = spec;
    ops.push_back(std::move(op));
  }
  // Blocks parent-first, so replay can insert each after its parent: sort by depth.
  std::vector<WalOp> blocks;
  index_->ForEachCommitted([&](const NewBlock& b) {
    WalOp op;
    op.type = WalOp::Type::kCommitBlock;
    op.hash = b.hash;
    op.parent = b.parent;
    op.size_bytes = b.size_bytes;
    op.replicas = WalReplicas(b.replicas);
    if (tokens == WalTokens::kInclude) op.token_ids = TokensOf(b.hash);
    blocks.push_back(std::move(op));
  });
  absl::flat_hash_map<BlockHash, size_t> pos;
  for (size_t i = 0; i < blocks.size(); ++i) pos[blocks[i].hash] = i;
  std::vector<int> depth(blocks.size(), -1);
  std::vector<size_t> path;
  for (size_t i = 0; i < blocks.size(); ++i) {
    size_t x = i;
    path.clear();
    int base = 0;
    while (depth[x] < 0) {
      path.push_back(x);
      auto p = pos.find(blocks[x].parent);
      if (blocks[x].parent.IsZero() || p == pos.end()) {
        base = 0;
        break;
      }
      x = p->second;
      if (depth[x] >= 0) base = depth[x] + 1;
    }
    for (auto it = path.rbegin(); it != path.rend(); ++it) depth[*it] = base++;
  }
  std::vector<size_t> order(blocks.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return depth[a] < depth[b]; });
  for (size_t i : order) ops.push_back(std::move(blocks[i]));
  WalOp marker;  // carries the sequence high-water mark across the log reset
  marker.type = WalOp::Type::kSequenceMark;
  marker.sequence = std::max({last_sequence(), sequence_reserved_, replicated_max_sequence_});
  ops.push_back(marker);
  return ops;
}

void CacheStore::EnableReplicationLog(size_t retention) {
  absl::MutexLock lock(&repl_mu_);
  repl_enabled_ = true;
  repl_retention_ = std::max<size_t>(retention, 1);
}

uint64_t CacheStore::replication_position() const {
  absl::MutexLock lock(&repl_mu_);
  return repl_end_;
}

absl::StatusOr<std::vector<WalOp>> CacheStore::ReplicationSince(uint64_t from, size_t max,
                                                                absl::Time deadline,
                                                                uint64_t* next) {
  absl::MutexLock lock(&repl_mu_);
  while (from == repl_end_ && absl::Now() < deadline) {
    repl_cv_.WaitWithDeadline(&repl_mu_, deadline);
  }
  const uint64_t oldest = repl_end_ - repl_ops_.size();
  if (from < oldest || from > repl_end_) {
    return absl::OutOfRangeError(absl::StrCat("replication position ", from,
                                              " is outside the retained log [", oldest, ", ",
                                              repl_end_, "]"));
  }
  std::vector<WalOp> out;
  for (uint64_t p = from; p < repl_end_ && out.size() < max; ++p) {
    out.push_back(repl_ops_[p - oldest]);
  }
  *next = from + out.size();
  return out;
}

std::vector<WalOp> CacheStore::ReplicationSnapshot(uint64_t* position) {
  absl::MutexLock lock(&mu_);
  // Ops are appended under mu_, so no op lands between the state and its position.
  *position = replication_position();
  return StateAsOpsLocked(WalTokens::kInclude);
}

void CacheStore::ResetForReplication() {
  absl::MutexLock lock(&mu_);
  replaying_ = true;
  for (const NodeSpec& spec : registry_.AllSpecs()) {
    std::optional<uint16_t> node = registry_.Find(spec.node_id);
    if (node.has_value()) RemoveNodeLocked(*node, /*log=*/true, "reset to follow the leader");
  }
  for (auto& [id, pending] : allocations_) AbortLocked(pending);
  allocations_.clear();
  allocated_blocks_ = 0;
  {
    absl::MutexLock tokens_lock(&tokens_mu_);
    tokens_.clear();  // every block went with its node; the snapshot brings them back
  }
  replaying_ = false;
}

absl::Status CacheStore::ApplyReplicated(absl::Span<const WalOp> ops) {
  absl::MutexLock lock(&mu_);
  replaying_ = true;
  // Runs at scope exit, before `lock` is released; the analysis cannot see that a cleanup's
  // callback runs under the caller's lock.
  absl::Cleanup done_replaying = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS { replaying_ = false; };
  uint64_t max_seq = replicated_max_sequence_;
  std::vector<WalOp> logged;
  for (const WalOp& op : ops) {
    KV_RETURN_IF_ERROR(ApplyOp(op, &max_seq));
    if (op.type != WalOp::Type::kSequenceMark) logged.push_back(op);
  }
  replicated_max_sequence_ = max_seq;
  UpdateCapacityHint();
  AppendWal(logged);
  MaybeSnapshotLocked();
  return absl::OkStatus();
}

void CacheStore::PromoteToLeader() {
  absl::MutexLock lock(&mu_);
  registry_.TouchAll(clock_->Now());
  absl::MutexLock events_lock(&events_mu_);
  // Numbers the old leader may have handed out after its last replicated op are skipped too.
  const uint64_t floor = replicated_max_sequence_ + kSequenceReservation + 1;
  if (next_sequence_ < floor) {
    events_.clear();  // EventsSince's arithmetic needs contiguous numbers
    next_sequence_ = floor;
  }
}

absl::StatusOr<std::vector<StoreEvent>> CacheStore::EventsSince(uint64_t from, size_t max,
                                                                absl::Time deadline) {
  absl::MutexLock lock(&events_mu_);
  if (from == 0) from = next_sequence_;
  const uint64_t oldest = events_.empty() ? next_sequence_ : events_.front().sequence;
  if (from < oldest) {
    return absl::OutOfRangeError(
        absl::StrCat("from_sequence: ", from, " is older than the oldest retained event ", oldest));
  }
  if (from > next_sequence_) {
    return absl::OutOfRangeError(
        absl::StrCat("from_sequence: ", from, " is ahead of the next sequence ", next_sequence_,
                     " (did the store restart without its data dir? compare store_incarnation)"));
  }
  while (next_sequence_ <= from) {
    if (events_cv_.WaitWithDeadline(&events_mu_, deadline)) break;
  }
  std::vector<StoreEvent> out;
  // Never index by arithmetic on sequence numbers (issue 13.5: events_ and the numbers diverged
  // after a log replay and this read past the deque): search, then walk within bounds.
  auto it = std::lower_bound(events_.begin(), events_.end(), from,
                             [](const StoreEvent& e, uint64_t seq) { return e.sequence < seq; });
  for (; it != events_.end() && out.size() < max; ++it) out.push_back(*it);
  return out;
}

}  // namespace kvrelay::cachestore

#include "cachestore/cache_store.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "common/logging.h"
#include "common/status_macros.h"

namespace kvrelay::cachestore {

namespace {
constexpr char kWalFile[] = "/wal.log";
constexpr char kSnapshotFile[] = "/snapshot";
}  // namespace

absl::StatusOr<std::unique_ptr<CacheStore>> CacheStore::Create(CacheStoreOptions options) {
  KV_ASSIGN_OR_RETURN(EvictionPolicyPtr policy, MakeEvictionPolicy(options.policy, 0));
  if (!policy->prefix_aware()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy: '", options.policy,
        "' is the non-prefix-aware trace-replay baseline; the service needs lrfu or leaf-lru"));
  }
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
      policy_(std::move(policy)) {
  BlockIndex::Options index_options;
  index_options.policy = policy_.get();
  index_ = std::make_unique<BlockIndex>(index_options);
}

CacheStore::~CacheStore() = default;

absl::Status CacheStore::Recover() {
  absl::MutexLock lock(&mu_);
  if (options_.data_dir.empty()) return absl::OkStatus();
  KV_RETURN_IF_ERROR(MakeDirectories(options_.data_dir));
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
  KV_ASSIGN_OR_RETURN(wal_, Wal::Open(options_.data_dir + kWalFile, options_.wal_fsync, &recovered));
  for (const WalOp& op : recovered.ops) {
    KV_RETURN_IF_ERROR(ApplyOp(op, &max_seq));
    ++applied;
  }
  // Nodes recovered from disk get one TTL to heartbeat again before they (and their blocks) go.
  registry_.TouchAll(clock_->Now());
  UpdateCapacityHint();
  {
    absl::MutexLock events_lock(&events_mu_);
    next_sequence_ = max_seq + 1;
  }
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
      KV_ASSIGN_OR_RETURN(auto r, registry_.Register(op.node, clock_->Now()));
      if (r.replaced) {
        RemoveNodeLocked(r.index, /*log=*/false);
        KV_ASSIGN_OR_RETURN(r, registry_.Register(op.node, clock_->Now()));
      }
      return absl::OkStatus();
    }
    case WalOp::Type::kRemoveNode: {
      std::optional<uint16_t> node = registry_.Find(op.node_id);
      if (node.has_value()) RemoveNodeLocked(*node, /*log=*/false);
      return absl::OkStatus();
    }
    case WalOp::Type::kCommitBlock: {
      if (index_->Contains(op.hash)) return absl::OkStatus();
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
      }
      return absl::OkStatus();
    }
    case WalOp::Type::kRemoveBlock: {
      if (op.hash.IsZero()) return absl::OkStatus();  // sequence marker of a snapshot
      for (const RemovedBlock& b : index_->RemoveSubtree(op.hash)) {
        for (const Replica& r : b.replicas) registry_.FreeSlot(r);
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
  absl::MutexLock lock(&events_mu_);
  event.sequence = next_sequence_++;
  const uint64_t seq = event.sequence;
  events_.push_back(std::move(event));
  while (events_.size() > options_.event_retention) events_.pop_front();
  events_cv_.SignalAll();
  return seq;
}

uint64_t CacheStore::last_sequence() const {
  absl::MutexLock lock(&events_mu_);
  return next_sequence_ - 1;
}

void CacheStore::AppendWal(const std::vector<WalOp>& ops) {
  if (wal_ == nullptr || ops.empty()) return;
  absl::Status s = wal_->Append(ops);
  // The in-memory state stays authoritative; a failed append is logged once per failure.
  if (!s.ok()) {
    KV_LOG(ERROR) << "cachestore: WAL append failed: " << s;
  }
}

void CacheStore::OnRemoved(const std::vector<RemovedBlock>& removed, std::vector<WalOp>* wal) {
  for (const RemovedBlock& b : removed) {
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

void CacheStore::RemoveNodeLocked(uint16_t node, bool log) {
  std::optional<std::string> id = registry_.NodeId(node);
  std::vector<RemovedBlock> removed = index_->RemoveNode(node);
  OnRemoved(removed, nullptr);  // replay of kRemoveNode repeats the same sweep
  registry_.Remove(node);
  UpdateCapacityHint();
  if (log && id.has_value()) {
    WalOp op;
    op.type = WalOp::Type::kRemoveNode;
    op.node_id = *id;
    AppendWal({op});
  }
}

absl::StatusOr<absl::Duration> CacheStore::RegisterNode(NodeSpec spec) {
  if (spec.ttl <= absl::ZeroDuration()) spec.ttl = options_.default_node_ttl;
  absl::MutexLock lock(&mu_);
  KV_ASSIGN_OR_RETURN(auto r, registry_.Register(spec, clock_->Now()));
  if (r.replaced) {
    KV_LOG(INFO) << "cachestore: node " << spec.node_id << " re-registered with a new spec; "
                 << "dropping its old blocks";
    RemoveNodeLocked(r.index, /*log=*/true);
    KV_ASSIGN_OR_RETURN(r, registry_.Register(spec, clock_->Now()));
  }
  WalOp op;
  op.type = WalOp::Type::kRegisterNode;
  op.node = spec;
  AppendWal({op});
  UpdateCapacityHint();
  return spec.ttl;
}

bool CacheStore::Heartbeat(const std::string& node_id) {
  return registry_.Heartbeat(node_id, clock_->Now());
}

absl::StatusOr<MatchResult> CacheStore::MatchPrefix(absl::Span<const BlockHash> chain,
                                                    absl::Duration lease_ttl) {
  if (lease_ttl > options_.max_lease_ttl) {
    return absl::InvalidArgumentError(absl::StrCat("lease_ttl_ms: at most ",
                                                   absl::ToInt64Milliseconds(options_.max_lease_ttl),
                                                   ", got ", absl::ToInt64Milliseconds(lease_ttl)));
  }
  const bool lease = lease_ttl > absl::ZeroDuration();
  std::vector<MatchedBlock> found;
  found.reserve(chain.size());
  MatchResult result;
  policy_->OnRequest(chain);  // adaptive policies learn from the request stream
  result.matched = index_->MatchPrefix(chain, /*touch=*/true, lease, &found);
  counters_.prefix_queries.fetch_add(1, std::memory_order_relaxed);
  counters_.prefix_query_blocks.fetch_add(static_cast<int64_t>(chain.size()),
                                          std::memory_order_relaxed);
  counters_.prefix_hit_blocks.fetch_add(result.matched, std::memory_order_relaxed);
  if (lease && result.matched > 0) {
    std::vector<BlockHash> hashes;
    hashes.reserve(found.size());
    for (const MatchedBlock& b : found) hashes.push_back(b.hash);
    result.lease_id = leases_.Add(std::move(hashes), clock_->Now() + lease_ttl);
  }
  // Resolve each distinct (node, segment) once; chains usually live on one or two segments.
  result.blocks.reserve(found.size());
  absl::InlinedVector<std::pair<uint32_t, uint32_t>, 4> seen;  // (node << 16 | segment, ref)
  for (MatchedBlock& b : found) {
    MatchResult::Block out{b.hash, b.size_bytes, {}};
    for (const Replica& r : b.replicas) {
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
  return result;
}

std::vector<NodePrefix> CacheStore::QueryPrefix(absl::Span<const BlockHash> chain) {
  std::vector<MatchedBlock> found;
  index_->MatchPrefix(chain, /*touch=*/false, /*lease=*/false, &found);
  absl::flat_hash_map<uint16_t, int> run;  // node -> leading blocks held, while unbroken
  for (size_t i = 0; i < found.size(); ++i) {
    for (const Replica& r : found[i].replicas) {
      auto it = run.find(r.node);
      if (i == 0) {
        run[r.node] = 1;
      } else if (it != run.end() && it->second == static_cast<int>(i)) {
        it->second = static_cast<int>(i) + 1;
      }
    }
  }
  std::vector<NodePrefix> out;
  for (const auto& [node, n] : run) {
    if (auto id = registry_.NodeId(node)) out.push_back({*id, n});
  }
  std::sort(out.begin(), out.end(), [](const NodePrefix& a, const NodePrefix& b) {
    return a.matched != b.matched ? a.matched > b.matched : a.node_id < b.node_id;
  });
  return out;
}

absl::StatusOr<AllocateResult> CacheStore::Allocate(const AllocateArgs& args,
                                                    absl::Time deadline) {
  if (args.blocks.empty()) return absl::InvalidArgumentError("blocks: at least one block needed");
  const int replicas = args.replicas == 0 ? 1 : args.replicas;
  if (replicas < 1 || replicas > 4) {
    return absl::InvalidArgumentError(absl::StrCat("replicas: want 1-4, got ", args.replicas));
  }
  absl::MutexLock lock(&mu_);
  AllocateResult result;
  PendingAllocation pending;
  std::vector<WalOp> wal;
  auto fail = [&](absl::Status status) {
    AbortLocked(pending);
    AppendWal(wal);
    return status;
  };
  absl::flat_hash_map<BlockHash, int> in_request;
  for (size_t i = 0; i < args.blocks.size(); ++i) {
    const AllocateArgs::Block& b = args.blocks[i];
    if (b.hash.IsZero()) {
      return fail(absl::InvalidArgumentError(absl::StrCat("blocks[", i, "].hash: must not be zero")));
    }
    if (b.size_bytes == 0 || b.size_bytes > 0xFFFFFFFFull) {
      return fail(absl::InvalidArgumentError(
          absl::StrCat("blocks[", i, "].size_bytes: want 1 to 2^32-1, got ", b.size_bytes)));
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
    // Placement; evict (leaf-first, by policy) only while nothing fits.
    std::vector<SegmentView> views = registry_.Segments();
    std::vector<const SegmentView*> chosen =
        ChoosePlacement(views, b.size_bytes, args.preferred_node, args.preferred_tier, replicas);
    while (chosen.empty()) {
      if (clock_->Now() > deadline && options_.clock == nullptr) {
        return fail(absl::DeadlineExceededError("allocate: deadline passed while evicting"));
      }
      const uint64_t size = b.size_bytes;
      std::vector<SegmentView> fits;
      for (const SegmentView& v : views) {
        if (v.slot_bytes >= size) fits.push_back(v);
      }
      if (fits.empty()) break;
      auto evicted = index_->EvictOne([&](const RemovedBlock& candidate) {
        for (const Replica& r : candidate.replicas) {
          for (const SegmentView& v : fits) {
            if (v.node == r.node && v.segment == r.segment) return true;
          }
        }
        return false;
      });
      if (!evicted.has_value()) break;
      counters_.evicted_blocks.fetch_add(1, std::memory_order_relaxed);
      OnRemoved({*evicted}, &wal);
      views = registry_.Segments();
      chosen =
          ChoosePlacement(views, b.size_bytes, args.preferred_node, args.preferred_tier, replicas);
    }
    if (chosen.empty()) {
      return fail(absl::ResourceExhaustedError(absl::StrCat(
          "blocks[", i, "]: no segment with a free slot of at least ", b.size_bytes,
          " bytes, and nothing evictable (all leased, uncommitted or too small)")));
    }
    NewBlock nb;
    nb.hash = b.hash;
    nb.parent = b.parent;
    nb.size_bytes = static_cast<uint32_t>(b.size_bytes);
    for (const SegmentView* v : chosen) {
      std::optional<uint32_t> slot = registry_.ReserveSlot(v->node, v->segment);
      if (slot.has_value()) nb.replicas.push_back(Replica{v->node, v->segment, *slot});
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
  if (!pending.hashes.empty()) {
    result.allocation_id = next_allocation_id_++;
    pending.deadline = clock_->Now() + options_.commit_timeout;
    allocated_blocks_ += static_cast<int64_t>(pending.hashes.size());
    allocations_[result.allocation_id] = std::move(pending);
  }
  return result;
}

absl::StatusOr<int> CacheStore::Commit(uint64_t allocation_id,
                                       absl::Span<const BlockHash> hashes) {
  absl::MutexLock lock(&mu_);
  auto it = allocations_.find(allocation_id);
  if (it == allocations_.end()) {
    return absl::NotFoundError(absl::StrCat("allocation_id: ", allocation_id,
                                            " is unknown (committed, aborted or reclaimed)"));
  }
  PendingAllocation& pending = it->second;
  std::vector<bool> wanted(pending.hashes.size(), hashes.empty());
  for (size_t i = 0; i < hashes.size(); ++i) {
    auto pos = std::find(pending.hashes.begin(), pending.hashes.end(), hashes[i]);
    if (pos == pending.hashes.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "hashes[", i, "]: ", hashes[i].ToHex(), " is not an uncommitted block of allocation ",
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
    op.sequence = Publish({0, StoreEvent::Kind::kStored, op.hash, op.parent, std::move(nodes)});
    pending.parents.erase(h);
    wal.push_back(std::move(op));
    ++committed;
  }
  AppendWal(wal);
  counters_.committed_blocks.fetch_add(committed, std::memory_order_relaxed);
  allocated_blocks_ -= static_cast<int64_t>(pending.hashes.size() - left.size());
  pending.hashes = std::move(left);
  if (pending.hashes.empty()) allocations_.erase(it);
  MaybeSnapshotLocked();
  if (!status.ok()) return status;
  return committed;
}

void CacheStore::AbortLocked(PendingAllocation& pending) {
  // Children first: reverse of the parent-first allocation order.
  for (auto it = pending.hashes.rbegin(); it != pending.hashes.rend(); ++it) {
    absl::StatusOr<RemovedBlock> removed = index_->RemoveAllocated(*it);
    if (!removed.ok()) continue;  // lost with its node already
    for (const Replica& r : removed->replicas) registry_.FreeSlot(r);
    --allocated_blocks_;
  }
  pending.hashes.clear();
}

absl::Status CacheStore::Abort(uint64_t allocation_id) {
  absl::MutexLock lock(&mu_);
  auto it = allocations_.find(allocation_id);
  if (it == allocations_.end()) {
    return absl::NotFoundError(absl::StrCat("allocation_id: ", allocation_id,
                                            " is unknown (committed, aborted or reclaimed)"));
  }
  // allocated_blocks_ was raised by the full count; AbortLocked lowers it per removed block.
  const int64_t n = static_cast<int64_t>(it->second.hashes.size());
  const int64_t before = allocated_blocks_;
  AbortLocked(it->second);
  allocated_blocks_ = before - n;
  counters_.aborted_blocks.fetch_add(n, std::memory_order_relaxed);
  allocations_.erase(it);
  return absl::OkStatus();
}

absl::Status CacheStore::ReleaseLease(uint64_t lease_id) {
  std::optional<std::vector<BlockHash>> blocks = leases_.Release(lease_id);
  if (!blocks.has_value()) {
    return absl::NotFoundError(
        absl::StrCat("lease_id: ", lease_id, " is unknown, released or expired"));
  }
  index_->ReleaseLeases(*blocks);
  return absl::OkStatus();
}

StoreStats CacheStore::Stats() const {
  StoreStats s;
  s.nodes = registry_.size();
  s.committed_blocks = index_->committed_count();
  s.allocated_blocks = index_->size() - s.committed_blocks;
  s.active_leases = leases_.active();
  s.evictions = counters_.evicted_blocks.load(std::memory_order_relaxed);
  s.last_sequence = last_sequence();
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
  for (uint16_t node : registry_.Expired(now)) {
    KV_LOG(WARNING) << "cachestore: node " << registry_.NodeId(node).value_or("?")
                    << " missed its heartbeat TTL; dropping it and its blocks";
    RemoveNodeLocked(node, /*log=*/true);
    counters_.expired_nodes.fetch_add(1, std::memory_order_relaxed);
  }
  for (auto it = allocations_.begin(); it != allocations_.end();) {
    if (it->second.deadline <= now) {
      const int64_t n = static_cast<int64_t>(it->second.hashes.size());
      const int64_t before = allocated_blocks_;
      AbortLocked(it->second);
      allocated_blocks_ = before - n;
      counters_.reclaimed_blocks.fetch_add(n, std::memory_order_relaxed);
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
  WalOp marker;  // carries the last sequence number across the log reset
  marker.type = WalOp::Type::kRemoveBlock;
  marker.sequence = last_sequence();
  ops.push_back(marker);
  KV_RETURN_IF_ERROR(WriteSnapshot(options_.data_dir + kSnapshotFile, ops));
  return wal_->Reset();
}

absl::StatusOr<std::vector<StoreEvent>> CacheStore::EventsSince(uint64_t from, size_t max,
                                                                absl::Time deadline) {
  absl::MutexLock lock(&events_mu_);
  if (from == 0) from = next_sequence_;
  const uint64_t oldest = events_.empty() ? next_sequence_ : events_.front().sequence;
  if (from < oldest) {
    return absl::OutOfRangeError(absl::StrCat("from_sequence: ", from,
                                              " is older than the oldest retained event ", oldest));
  }
  while (next_sequence_ <= from) {
    if (events_cv_.WaitWithDeadline(&events_mu_, deadline)) break;
  }
  std::vector<StoreEvent> out;
  if (events_.empty()) return out;
  const uint64_t first = events_.front().sequence;
  for (uint64_t seq = std::max(from, first); seq < next_sequence_ && out.size() < max; ++seq) {
    out.push_back(events_[seq - first]);
  }
  return out;
}

}  // namespace kvrelay::cachestore

#include "cachestore/block_index.h"

#include <algorithm>
#include <functional>

#include "absl/strings/str_cat.h"
#include "common/check.h"

namespace kvrelay::cachestore {

namespace {
constexpr uint16_t kMaxLeases = 0xFFFF;
}  // namespace

BlockIndex::BlockIndex(Options options)
    : options_(options), ghost_capacity_(options.ghost_capacity) {
  KV_CHECK(options_.policy != nullptr);
}

BlockIndex::~BlockIndex() = default;

uint32_t BlockIndex::AllocRecord(Shard& s) {
  uint32_t local;
  if (!s.free_list.empty()) {
    local = s.free_list.back();
    s.free_list.pop_back();
  } else {
    local = s.next_unused++;
    KV_CHECK(local < (1u << kLocalBits));  // 67M blocks per shard: "impossible" (OOM first)
    if ((local >> kChunkBits) >= s.chunks.size()) {
      s.chunks.push_back(std::make_unique<Record[]>(kChunkSize));
    }
  }
  Record& r = Rec(s, local);
  const uint16_t gen = r.gen;
  r = Record{};
  r.gen = gen;
  return local;
}

Replicas BlockIndex::ReplicasOf(const Shard& s, uint32_t local, const Record& r) {
  Replicas out;
  const int n = r.flags & kReplicaMask;
  if (n >= 1) out.push_back(r.replica0);
  if (n > 1) {
    auto it = s.extra_replicas.find(local);
    if (it != s.extra_replicas.end()) out.insert(out.end(), it->second.begin(), it->second.end());
  }
  return out;
}

RemovedBlock BlockIndex::FreeRecord(Shard& s, uint32_t local, BlockHash parent_hash) {
  Record& r = Rec(s, local);
  RemovedBlock out;
  out.hash = r.hash;
  out.parent = parent_hash;
  out.size_bytes = r.size_bytes;
  out.state = r.state;
  out.replicas = ReplicasOf(s, local, r);
  if ((r.flags & kReplicaMask) > 1) s.extra_replicas.erase(local);
  if (r.state == BlockState::kCommitted) --s.committed;
  s.map.erase(r.hash);
  r.state = BlockState::kFree;
  r.flags = 0;
  ++r.gen;
  s.free_list.push_back(local);
  return out;
}

bool BlockIndex::Evictable(const Record& r) const {
  if (r.state != BlockState::kCommitted || r.leases != 0) return false;
  return !policy().prefix_aware() || r.num_children == 0;
}

void BlockIndex::MaybeQueue(Shard& s, uint32_t local, Record& r) {
  if ((r.flags & kInHeap) != 0 || !Evictable(r)) return;
  r.flags |= kInHeap;
  const HeapEntry e{policy().Priority(r.stats),
                    MakeId(static_cast<int>(&s - shards_.data()), local), r.gen};
  absl::MutexLock lock(&heap_mu_);
  heap_.push_back(e);
  std::push_heap(heap_.begin(), heap_.end(), std::greater<HeapEntry>());
}

BlockHash BlockIndex::HashOf(RecordId id) const {
  if (id == kNoRecord) return BlockHash{};
  const Shard& s = shards_[ShardOfId(id)];
  absl::MutexLock lock(&s.mu);
  return RecC(s, LocalOf(id)).hash;
}

void BlockIndex::DetachFromParent(RecordId parent) {
  if (parent == kNoRecord) return;
  Shard& s = shards_[ShardOfId(parent)];
  absl::MutexLock lock(&s.mu);
  Record& p = Rec(s, LocalOf(parent));
  if (p.state == BlockState::kFree || p.num_children == 0) return;
  --p.num_children;
  MaybeQueue(s, LocalOf(parent), p);
}

void BlockIndex::RememberGhost(const BlockHash& hash, const AccessStats& stats) {
  const size_t capacity = ghost_capacity_.load(std::memory_order_relaxed);
  if (capacity == 0) return;
  absl::MutexLock lock(&ghost_mu_);
  const uint64_t serial = ++ghost_serial_;
  ghosts_[hash] = Ghost{stats, serial};
  ghost_fifo_.emplace_back(hash, serial);
  // Drop the oldest live ghosts beyond capacity, and stale FIFO entries as they surface (the
  // FIFO is kept within 2x capacity so stale entries cannot pile up).
  while (!ghost_fifo_.empty() && (ghosts_.size() > capacity || ghost_fifo_.size() > 2 * capacity)) {
    const auto [h, s] = ghost_fifo_.front();
    ghost_fifo_.pop_front();
    auto it = ghosts_.find(h);
    if (it != ghosts_.end() && it->second.serial == s) ghosts_.erase(it);
  }
}

std::optional<AccessStats> BlockIndex::TakeGhost(const BlockHash& hash) {
  absl::MutexLock lock(&ghost_mu_);
  if (ghosts_.empty()) return std::nullopt;
  auto it = ghosts_.find(hash);
  if (it == ghosts_.end()) return std::nullopt;
  AccessStats stats = it->second.stats;
  ghosts_.erase(it);  // its FIFO entry becomes stale
  return stats;
}

int BlockIndex::MatchPrefix(absl::Span<const BlockHash> chain, bool touch, bool lease,
                            std::vector<MatchedBlock>* out) {
  int matched = 0;
  // One atomic per call: block i of the chain gets tick base + i + 1 (parents before children).
  const uint64_t base = touch ? tick_.fetch_add(chain.size(), std::memory_order_relaxed) : 0;
  for (const BlockHash& h : chain) {
    Shard& s = shards_[ShardOf(h)];
    absl::MutexLock lock(&s.mu);
    auto it = s.map.find(h);
    if (it == s.map.end()) break;
    Record& r = Rec(s, it->second);
    if (r.state != BlockState::kCommitted) break;
    if (lease) {
      if (r.leases == kMaxLeases) break;
      ++r.leases;
    }
    if (touch) policy().OnAccess(r.stats, h, base + static_cast<uint64_t>(matched) + 1);
    if (out != nullptr) out->push_back({h, r.size_bytes, ReplicasOf(s, it->second, r)});
    ++matched;
  }
  return matched;
}

absl::Status BlockIndex::Insert(const NewBlock& block, BlockState state, bool lease) {
  if (block.replicas.size() > kReplicaMask) {
    return absl::InvalidArgumentError(absl::StrCat("replicas: at most ", kReplicaMask,
                                                   " per block, got ", block.replicas.size()));
  }
  // Plain (non-prefix-aware) policies may evict a parent before its children, so parent links
  // would dangle: they are not kept at all.
  RecordId parent = kNoRecord;
  if (!block.parent.IsZero() && policy().prefix_aware()) {
    Shard& ps = shards_[ShardOf(block.parent)];
    absl::MutexLock lock(&ps.mu);
    auto it = ps.map.find(block.parent);
    if (it == ps.map.end()) {
      return absl::FailedPreconditionError(
          absl::StrCat("parent: block ", block.parent.ToHex(), " is not in the index"));
    }
    // Counted before the child exists, so the parent cannot be evicted in between.
    Record& p = Rec(ps, it->second);
    ++p.num_children;
    parent = MakeId(ShardOf(block.parent), it->second);
  }
  std::optional<AccessStats> ghost = TakeGhost(block.hash);
  Shard& s = shards_[ShardOf(block.hash)];
  {
    absl::ReleasableMutexLock lock(&s.mu);
    if (s.map.contains(block.hash)) {
      lock.Release();
      DetachFromParent(parent);
      return absl::AlreadyExistsError(absl::StrCat("block ", block.hash.ToHex(), " exists"));
    }
    const uint32_t local = AllocRecord(s);
    Record& r = Rec(s, local);
    r.hash = block.hash;
    r.parent = parent;
    r.size_bytes = block.size_bytes;
    r.state = state;
    r.leases = lease ? 1 : 0;
    r.flags = static_cast<uint8_t>(block.replicas.size());
    if (!block.replicas.empty()) r.replica0 = block.replicas[0];
    if (block.replicas.size() > 1) {
      s.extra_replicas[local] = Replicas(block.replicas.begin() + 1, block.replicas.end());
    }
    policy().OnInsert(r.stats, block.hash, NextTick(), ghost ? &*ghost : nullptr);
    s.map.emplace(block.hash, local);
    if (state == BlockState::kCommitted) ++s.committed;
    MaybeQueue(s, local, r);
  }
  return absl::OkStatus();
}

absl::Status BlockIndex::Commit(const BlockHash& hash) {
  Shard& s = shards_[ShardOf(hash)];
  RecordId parent;
  {
    absl::MutexLock lock(&s.mu);
    auto it = s.map.find(hash);
    if (it == s.map.end()) {
      return absl::NotFoundError(absl::StrCat("block ", hash.ToHex(), " is not allocated"));
    }
    if (Rec(s, it->second).state == BlockState::kCommitted) return absl::OkStatus();
    parent = Rec(s, it->second).parent;
  }
  if (parent != kNoRecord) {
    const Shard& ps = shards_[ShardOfId(parent)];
    absl::MutexLock lock(&ps.mu);
    if (RecC(ps, LocalOf(parent)).state != BlockState::kCommitted) {
      return absl::FailedPreconditionError(absl::StrCat("parent of block ", hash.ToHex(),
                                                        " is not committed; commit parents first"));
    }
  }
  absl::MutexLock lock(&s.mu);
  auto it = s.map.find(hash);
  if (it == s.map.end()) {
    return absl::NotFoundError(absl::StrCat("block ", hash.ToHex(), " is not allocated"));
  }
  Record& r = Rec(s, it->second);
  if (r.state != BlockState::kCommitted) {
    r.state = BlockState::kCommitted;
    ++s.committed;
    MaybeQueue(s, it->second, r);
  }
  return absl::OkStatus();
}

absl::StatusOr<RemovedBlock> BlockIndex::RemoveAllocated(const BlockHash& hash) {
  Shard& s = shards_[ShardOf(hash)];
  RemovedBlock out;
  RecordId parent;
  {
    absl::MutexLock lock(&s.mu);
    auto it = s.map.find(hash);
    if (it == s.map.end()) {
      return absl::NotFoundError(absl::StrCat("block ", hash.ToHex(), " is not allocated"));
    }
    Record& r = Rec(s, it->second);
    if (r.state != BlockState::kAllocated) {
      return absl::FailedPreconditionError(
          absl::StrCat("block ", hash.ToHex(), " is committed; only allocations can be aborted"));
    }
    if (r.num_children != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("block ", hash.ToHex(), " has children; remove them first"));
    }
    parent = r.parent;
    out = FreeRecord(s, it->second, BlockHash{});
  }
  out.parent = HashOf(parent);
  DetachFromParent(parent);
  return out;
}

// Memoized: the path walked up to a record already decided takes its value, so every record is
// walked once and the sweep stays linear in the index's size.
absl::flat_hash_map<RecordId, bool> BlockIndex::InheritFromAncestors(
    absl::flat_hash_map<RecordId, bool> marked) {
  std::vector<RecordId> path;
  for (int si = 0; si < kNumShards; ++si) {
    for (const auto& [h, local] : shards_[si].map) {
      RecordId id = MakeId(si, local);
      path.clear();
      bool result = false;
      while (true) {
        auto m = marked.find(id);
        if (m != marked.end()) {
          result = m->second;
          break;
        }
        path.push_back(id);
        const RecordId p = Rec(shards_[ShardOfId(id)], LocalOf(id)).parent;
        if (p == kNoRecord) break;
        id = p;
      }
      for (RecordId x : path) marked[x] = result;
    }
  }
  return marked;
}

std::vector<RemovedBlock> BlockIndex::RemoveSubtree(const BlockHash& hash) {
  std::vector<RemovedBlock> removed;
  absl::MutexLock evict_lock(&evict_mu_);
  // A leaf, what nearly every removal is (WAL replay of evictions): one lookup. A sweep per
  // removal made a restart's replay quadratic in the log (55 s for 86k records in the soak).
  // Without parent links (plain policies) every block counts no children: a leaf as well.
  {
    Shard& s = shards_[ShardOf(hash)];
    RecordId parent = kNoRecord;
    std::optional<RemovedBlock> leaf;
    {
      absl::MutexLock lock(&s.mu);
      auto it = s.map.find(hash);
      if (it == s.map.end()) return removed;
      const Record& r = Rec(s, it->second);
      if (r.num_children == 0) {
        parent = r.parent;
        leaf = FreeRecord(s, it->second, BlockHash{});
      }
    }
    if (leaf.has_value()) {
      leaf->parent = HashOf(parent);
      DetachFromParent(parent);
      removed.push_back(*std::move(leaf));
      return removed;
    }
  }
  // An inner block: sweep the index for its descendants.
  for (Shard& s : shards_) s.mu.Lock();
  // Find the target and every descendant: a record is doomed if its ancestor chain reaches it.
  RecordId target = kNoRecord;
  {
    Shard& s = shards_[ShardOf(hash)];
    auto it = s.map.find(hash);
    if (it != s.map.end()) target = MakeId(ShardOf(hash), it->second);
  }
  if (target != kNoRecord) {
    // id -> descends from target (or is it).
    const absl::flat_hash_map<RecordId, bool> doomed = InheritFromAncestors({{target, true}});
    // Children before parents: order doomed ids by depth below target (deepest first).
    std::vector<std::pair<int, RecordId>> order;
    for (const auto& [id, d] : doomed) {
      if (!d) continue;
      int depth = 0;
      for (RecordId x = id; x != target; x = Rec(shards_[ShardOfId(x)], LocalOf(x)).parent) ++depth;
      order.push_back({depth, id});
    }
    std::sort(order.begin(), order.end(), std::greater<>());
    for (const auto& [depth, id] : order) {
      (void)depth;
      Shard& s = shards_[ShardOfId(id)];
      const RecordId parent = Rec(s, LocalOf(id)).parent;
      BlockHash parent_hash;
      if (parent != kNoRecord) {
        Record& p = Rec(shards_[ShardOfId(parent)], LocalOf(parent));
        parent_hash = p.hash;
        if (p.num_children > 0) --p.num_children;
        if (id == target) MaybeQueue(shards_[ShardOfId(parent)], LocalOf(parent), p);
      }
      removed.push_back(FreeRecord(s, LocalOf(id), parent_hash));
    }
  }
  for (int i = kNumShards - 1; i >= 0; --i) shards_[i].mu.Unlock();
  return removed;
}

absl::Status BlockIndex::AddReplica(const BlockHash& hash, const Replica& replica) {
  Shard& s = shards_[ShardOf(hash)];
  absl::MutexLock lock(&s.mu);
  auto it = s.map.find(hash);
  if (it == s.map.end())
    return absl::NotFoundError(absl::StrCat("block ", hash.ToHex(), " absent"));
  const uint32_t local = it->second;
  Record& r = Rec(s, local);
  const int n = r.flags & kReplicaMask;
  if (r.state != BlockState::kCommitted || n >= kReplicaMask || n == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("block ", hash.ToHex(), " is uncommitted or has no room for a replica"));
  }
  Replicas reps = ReplicasOf(s, local, r);
  for (const Replica& x : reps) {
    if (x == replica) return absl::AlreadyExistsError("replica already listed");
  }
  s.extra_replicas[local].push_back(replica);
  r.flags = static_cast<uint8_t>((r.flags & ~kReplicaMask) | (n + 1));
  return absl::OkStatus();
}

bool BlockIndex::Touch(const BlockHash& hash, bool lease) {
  Shard& s = shards_[ShardOf(hash)];
  absl::MutexLock lock(&s.mu);
  auto it = s.map.find(hash);
  if (it == s.map.end()) return false;
  Record& r = Rec(s, it->second);
  if (lease) {
    if (r.leases == kMaxLeases) return false;
    ++r.leases;
  }
  policy().OnAccess(r.stats, hash, NextTick());
  return true;
}

void BlockIndex::ReleaseLeases(absl::Span<const BlockHash> hashes) {
  for (const BlockHash& h : hashes) {
    Shard& s = shards_[ShardOf(h)];
    absl::MutexLock lock(&s.mu);
    auto it = s.map.find(h);
    if (it == s.map.end()) continue;
    Record& r = Rec(s, it->second);
    if (r.leases > 0) --r.leases;
    MaybeQueue(s, it->second, r);
  }
}

absl::StatusOr<RemovedBlock> BlockIndex::RemoveLeaf(const BlockHash& hash) {
  absl::MutexLock evict_lock(&evict_mu_);
  Shard& s = shards_[ShardOf(hash)];
  RecordId parent = kNoRecord;
  RemovedBlock out;
  {
    absl::MutexLock lock(&s.mu);
    auto it = s.map.find(hash);
    if (it == s.map.end()) {
      return absl::NotFoundError(absl::StrCat("block ", hash.ToHex(), " is not in the index"));
    }
    const Record& r = Rec(s, it->second);
    if (!Evictable(r)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "block ", hash.ToHex(), " is leased, uncommitted or has children: not a free leaf"));
    }
    // As EvictOne: only prefix-aware policies keep children counts to maintain.
    parent = policy().prefix_aware() ? r.parent : kNoRecord;
    out = FreeRecord(s, it->second, BlockHash{});
  }
  if (parent != kNoRecord) {
    out.parent = HashOf(parent);
    DetachFromParent(parent);
  }
  return out;
}

std::optional<RemovedBlock> BlockIndex::EvictOne(
    const std::function<bool(const RemovedBlock&)>& accept) {
  absl::MutexLock evict_lock(&evict_mu_);
  if (const uint64_t epoch = policy().epoch(); epoch != heap_epoch_) {
    heap_epoch_ = epoch;
    RerankHeap();
  }
  std::vector<HeapEntry> vetoed;
  std::optional<RemovedBlock> result;
  // Bounded: every iteration pops one heap entry; re-pushes happen only when a priority grew,
  // which needs an access, and vetoed entries are held aside until the end.
  while (true) {
    HeapEntry e;
    {
      absl::MutexLock lock(&heap_mu_);
      if (heap_.empty()) break;
      std::pop_heap(heap_.begin(), heap_.end(), std::greater<HeapEntry>());
      e = heap_.back();
      heap_.pop_back();
    }
    Shard& s = shards_[ShardOfId(e.id)];
    RecordId parent = kNoRecord;
    {
      absl::ReleasableMutexLock lock(&s.mu);
      const uint32_t local = LocalOf(e.id);
      if (local >= s.next_unused) continue;
      Record& r = Rec(s, local);
      if (r.gen != e.gen || (r.flags & kInHeap) == 0) continue;  // stale entry
      r.flags &= ~kInHeap;
      if (!Evictable(r)) continue;  // re-queued when it becomes evictable again
      const double now_priority = policy().Priority(r.stats);
      if (now_priority > e.priority) {  // accessed since queued: re-rank
        MaybeQueue(s, local, r);
        continue;
      }
      if (accept) {
        RemovedBlock probe;
        probe.hash = r.hash;
        probe.size_bytes = r.size_bytes;
        probe.replicas = ReplicasOf(s, local, r);
        if (!accept(probe)) {
          r.flags |= kInHeap;
          vetoed.push_back(e);
          continue;
        }
      }
      parent = policy().prefix_aware() ? r.parent : kNoRecord;
      const AccessStats stats = r.stats;
      result = FreeRecord(s, local, BlockHash{});
      lock.Release();
      RememberGhost(result->hash, stats);
    }
    if (parent != kNoRecord) {
      result->parent = HashOf(parent);
      DetachFromParent(parent);
    }
    break;
  }
  if (!vetoed.empty()) {
    absl::MutexLock lock(&heap_mu_);
    for (const HeapEntry& e : vetoed) {
      heap_.push_back(e);
      std::push_heap(heap_.begin(), heap_.end(), std::greater<HeapEntry>());
    }
  }
  return result;
}

void BlockIndex::RerankHeap() {
  // Lock order is shard -> heap_mu_, so take the entries out, re-rank each under its shard lock,
  // and merge them back with whatever was queued meanwhile.
  std::vector<HeapEntry> entries;
  {
    absl::MutexLock lock(&heap_mu_);
    entries.swap(heap_);
  }
  for (HeapEntry& e : entries) {
    Shard& s = shards_[ShardOfId(e.id)];
    absl::MutexLock lock(&s.mu);
    const uint32_t local = LocalOf(e.id);
    if (local >= s.next_unused) continue;
    const Record& r = Rec(s, local);
    if (r.gen == e.gen) e.priority = policy().Priority(r.stats);  // stale ones stay stale
  }
  absl::MutexLock lock(&heap_mu_);
  heap_.insert(heap_.end(), entries.begin(), entries.end());
  std::make_heap(heap_.begin(), heap_.end(), std::greater<HeapEntry>());
}

std::vector<RemovedBlock> BlockIndex::RemoveNode(uint16_t node) {
  std::vector<RemovedBlock> removed;
  absl::MutexLock evict_lock(&evict_mu_);
  for (Shard& s : shards_) s.mu.Lock();
  // Pass 1: drop the node's replicas; blocks with none left are dead.
  absl::flat_hash_map<RecordId, bool> dead;  // memo: id -> dead (itself or an ancestor)
  for (int si = 0; si < kNumShards; ++si) {
    Shard& s = shards_[si];
    for (const auto& [h, local] : s.map) {
      Record& r = Rec(s, local);
      const int n = r.flags & kReplicaMask;
      if (n == 0) continue;
      Replicas reps = ReplicasOf(s, local, r);
      Replicas kept;
      for (const Replica& rep : reps) {
        if (rep.node != node) kept.push_back(rep);
      }
      if (kept.size() == reps.size()) continue;
      if (kept.empty()) {
        dead[MakeId(si, local)] = true;
        continue;
      }
      r.replica0 = kept[0];
      r.flags = static_cast<uint8_t>((r.flags & ~kReplicaMask) | kept.size());
      if (kept.size() > 1) {
        s.extra_replicas[local] = Replicas(kept.begin() + 1, kept.end());
      } else {
        s.extra_replicas.erase(local);
      }
    }
  }
  if (!dead.empty()) {
    // Pass 2: descendants of dead blocks are dead too (no block outlives its parent).
    dead = InheritFromAncestors(std::move(dead));
    // Pass 3: free them; surviving parents lose a child and may become evictable leaves.
    std::vector<RecordId> doomed;
    for (const auto& [id, d] : dead) {
      if (d) doomed.push_back(id);
    }
    std::vector<BlockHash> parent_hashes(doomed.size());
    for (size_t i = 0; i < doomed.size(); ++i) {
      const RecordId p = Rec(shards_[ShardOfId(doomed[i])], LocalOf(doomed[i])).parent;
      if (p != kNoRecord) parent_hashes[i] = Rec(shards_[ShardOfId(p)], LocalOf(p)).hash;
    }
    for (size_t i = 0; i < doomed.size(); ++i) {
      const RecordId id = doomed[i];
      const RecordId p = Rec(shards_[ShardOfId(id)], LocalOf(id)).parent;
      if (p != kNoRecord && !dead[p]) {
        Shard& ps = shards_[ShardOfId(p)];
        Record& pr = Rec(ps, LocalOf(p));
        if (pr.num_children > 0) --pr.num_children;
        MaybeQueue(ps, LocalOf(p), pr);
      }
    }
    for (size_t i = 0; i < doomed.size(); ++i) {
      removed.push_back(
          FreeRecord(shards_[ShardOfId(doomed[i])], LocalOf(doomed[i]), parent_hashes[i]));
    }
  }
  for (int i = kNumShards - 1; i >= 0; --i) shards_[i].mu.Unlock();
  return removed;
}

void BlockIndex::ForEachCommitted(const std::function<void(const NewBlock&)>& fn) const {
  for (const Shard& s : shards_) {
    std::vector<std::pair<NewBlock, RecordId>> batch;
    {
      absl::MutexLock lock(&s.mu);
      for (const auto& [h, local] : s.map) {
        const Record& r = RecC(s, local);
        if (r.state != BlockState::kCommitted) continue;
        NewBlock b;
        b.hash = h;
        b.size_bytes = r.size_bytes;
        b.replicas = ReplicasOf(s, local, r);
        batch.push_back({std::move(b), r.parent});
      }
    }
    for (auto& [b, parent] : batch) {
      b.parent = HashOf(parent);
      fn(b);
    }
  }
}

void BlockIndex::ForEachReplica(const std::function<void(const Replica&)>& fn) const {
  for (const Shard& s : shards_) {
    absl::MutexLock lock(&s.mu);
    for (const auto& [h, local] : s.map) {
      for (const Replica& rep : ReplicasOf(s, local, RecC(s, local))) fn(rep);
    }
  }
}

bool BlockIndex::Contains(const BlockHash& hash) const {
  const Shard& s = shards_[ShardOf(hash)];
  absl::MutexLock lock(&s.mu);
  return s.map.contains(hash);
}

std::optional<BlockState> BlockIndex::StateOf(const BlockHash& hash) const {
  const Shard& s = shards_[ShardOf(hash)];
  absl::MutexLock lock(&s.mu);
  auto it = s.map.find(hash);
  if (it == s.map.end()) return std::nullopt;
  return RecC(s, it->second).state;
}

int BlockIndex::LeasesOf(const BlockHash& hash) const {
  const Shard& s = shards_[ShardOf(hash)];
  absl::MutexLock lock(&s.mu);
  auto it = s.map.find(hash);
  return it == s.map.end() ? 0 : RecC(s, it->second).leases;
}

int64_t BlockIndex::size() const {
  int64_t n = 0;
  for (const Shard& s : shards_) {
    absl::MutexLock lock(&s.mu);
    n += static_cast<int64_t>(s.map.size());
  }
  return n;
}

int64_t BlockIndex::committed_count() const {
  int64_t n = 0;
  for (const Shard& s : shards_) {
    absl::MutexLock lock(&s.mu);
    n += s.committed;
  }
  return n;
}

size_t BlockIndex::ghost_size() const {
  absl::MutexLock lock(&ghost_mu_);
  return ghosts_.size();
}

size_t BlockIndex::MemoryUsageBytes() const {
  size_t bytes = sizeof(*this);
  for (const Shard& s : shards_) {
    absl::MutexLock lock(&s.mu);
    // flat_hash_map: one slot plus one control byte per bucket (+ a group of sentinel bytes).
    bytes += s.map.capacity() * (sizeof(std::pair<BlockHash, uint32_t>) + 1) + 16;
    bytes += s.chunks.size() * kChunkSize * sizeof(Record);
    bytes += s.chunks.capacity() * sizeof(std::unique_ptr<Record[]>);
    bytes += s.free_list.capacity() * sizeof(uint32_t);
    bytes += s.extra_replicas.capacity() * (sizeof(std::pair<uint32_t, Replicas>) + 1);
  }
  {
    absl::MutexLock lock(&heap_mu_);
    bytes += heap_.capacity() * sizeof(HeapEntry);
  }
  absl::MutexLock lock(&ghost_mu_);
  bytes += ghosts_.capacity() * (sizeof(std::pair<BlockHash, Ghost>) + 1);
  bytes += ghost_fifo_.size() * sizeof(std::pair<BlockHash, uint64_t>);
  return bytes;
}

}  // namespace kvrelay::cachestore

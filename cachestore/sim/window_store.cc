#include "cachestore/sim/window_store.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/check.h"
#include "common/status_macros.h"

namespace kvrelay::cachestore::sim {

namespace {
BlockIndex::Options IndexOptions(const EvictionPolicy* policy, int64_t capacity_blocks) {
  BlockIndex::Options options;
  options.policy = policy;
  options.ghost_capacity =
      static_cast<size_t>(kGhostCaches * std::max<int64_t>(capacity_blocks, 1));
  return options;
}
}  // namespace

WindowAwareCache::WindowAwareCache(const EvictionPolicy* policy, int64_t capacity_bytes,
                                   BlockParts parts, bool window_aware)
    : policy_(policy),
      capacity_bytes_(capacity_bytes),
      parts_(parts),
      window_aware_(window_aware && parts.window_blocks > 0 && parts.window_bytes > 0),
      index_(IndexOptions(policy, capacity_bytes / (parts.full_bytes + parts.window_bytes))) {
  KV_CHECK(capacity_bytes > 0 && parts.full_bytes + parts.window_bytes > 0);
}

WindowAwareCache::Match WindowAwareCache::MatchPrefix(absl::Span<const BlockHash> chain) {
  Match m;
  m.full_blocks = index_.MatchPrefix(chain, /*touch=*/false, /*lease=*/false, nullptr);
  if (!window_aware_) {
    m.usable_blocks = m.full_blocks;
    return m;
  }
  // n is a resume point when the window parts of blocks [n - w, n) are all cached.
  const int w = parts_.window_blocks;
  int run = 0;  // consecutive blocks ending at j whose window part is cached
  for (int j = 0; j < m.full_blocks; ++j) {
    auto it = parts_state_.find(chain[j]);
    run = (it != parts_state_.end() && it->second.window_present) ? run + 1 : 0;
    if (run >= std::min(w, j + 1)) m.usable_blocks = j + 1;
  }
  m.window_from = std::max(0, m.usable_blocks - w);
  return m;
}

bool WindowAwareCache::ReclaimOneWindowPart() {
  while (!reclaim_.empty()) {
    const auto [tick, hash] = reclaim_.top();
    reclaim_.pop();
    auto it = parts_state_.find(hash);
    if (it == parts_state_.end() || !it->second.window_present || !it->second.interior ||
        it->second.tick != tick) {
      continue;  // stale: evicted, already reclaimed, re-marked or accessed since
    }
    it->second.window_present = false;
    used_bytes_ -= parts_.window_bytes;
    ++counters_.window_parts_reclaimed;
    return true;
  }
  return false;
}

bool WindowAwareCache::MakeRoom(int64_t bytes) {
  while (used_bytes_ + bytes > capacity_bytes_) {
    if (window_aware_ && ReclaimOneWindowPart()) continue;
    std::optional<RemovedBlock> evicted = index_.EvictOne();
    if (!evicted.has_value()) return false;
    auto it = parts_state_.find(evicted->hash);
    used_bytes_ -= parts_.full_bytes;
    if (it != parts_state_.end()) {
      if (it->second.window_present) used_bytes_ -= parts_.window_bytes;
      parts_state_.erase(it);
    }
    ++counters_.blocks_evicted;
  }
  return true;
}

void WindowAwareCache::Access(absl::Span<const BlockHash> chain, const Match& match) {
  const int n = static_cast<int>(chain.size());
  // This request branches off a cached path that already continues elsewhere: a shared prefix
  // (system prompt, forked conversation) that later requests will resume from again.
  bool branch = false;
  if (match.full_blocks > 0 && match.full_blocks < n) {
    auto it = parts_state_.find(chain[match.full_blocks - 1]);
    branch = it != parts_state_.end() && it->second.has_child;
  }
  std::vector<BlockHash> leased;
  BlockHash parent;
  for (int j = 0; j < n; ++j) {
    const BlockHash& h = chain[j];
    // Resume points: this request's end (a follow-up resumes at the last full block, so the
    // window before it is the last window_blocks + 1 blocks [TRT kSWAExtraBlock]) and the point
    // where it branched off a path that already went on elsewhere. Blocks outside the windows
    // before them are interior.
    const int w = parts_.window_blocks;
    const bool before_branch = branch && j >= match.full_blocks - w && j < match.full_blocks;
    const bool recomputed = j >= match.usable_blocks;
    PartState* st = nullptr;
    if (index_.Touch(h, /*lease=*/true)) {
      leased.push_back(h);
      st = &parts_state_[h];
      if (recomputed && !st->window_present) {
        // The worker computed this block again, window part included: keep it if it fits.
        if (!MakeRoom(parts_.window_bytes)) break;
        st = &parts_state_[h];  // MakeRoom may rehash the map
        st->window_present = true;
        used_bytes_ += parts_.window_bytes;
      }
    } else {
      if (!MakeRoom(parts_.full_bytes + parts_.window_bytes)) break;
      NewBlock block;
      block.hash = h;
      block.parent = parent;
      if (!index_.Insert(block, BlockState::kCommitted, /*lease=*/true).ok()) break;
      leased.push_back(h);
      if (j > 0) {
        auto p = parts_state_.find(chain[j - 1]);
        if (p != parts_state_.end()) p->second.has_child = true;
      }
      st = &parts_state_[h];
      st->window_present = true;
      used_bytes_ += parts_.full_bytes + parts_.window_bytes;
    }
    parent = h;
    st->tick = ++tick_;
    // A branch point is where requests proved to resume: its window stays (sticky until the
    // block goes). The end of this request is a likely resume point only until it is extended.
    if (before_branch) st->branch_window = true;
    st->interior = j < n - (w + 1) && !st->branch_window;
    const bool interior = st->interior;
    if (window_aware_ && interior && st->window_present) reclaim_.push({st->tick, h});
  }
  index_.ReleaseLeases(leased);
}

absl::StatusOr<ReplayResult> ReplayWindowed(const std::vector<TraceRequest>& trace,
                                            int64_t capacity_bytes, const BlockParts& parts,
                                            bool window_aware, std::string_view policy_name,
                                            std::vector<int32_t>* per_request_hits) {
  if (capacity_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("capacity: must be positive bytes, got ", capacity_bytes));
  }
  if (parts.full_bytes < 0 || parts.window_bytes < 0 ||
      parts.full_bytes + parts.window_bytes <= 0 || parts.window_blocks < 0) {
    return absl::InvalidArgumentError("block parts: want non-negative bytes, not both zero");
  }
  const int64_t block_bytes = parts.full_bytes + parts.window_bytes;
  KV_ASSIGN_OR_RETURN(
      EvictionPolicyPtr policy,
      MakeEvictionPolicy(policy_name, std::max<int64_t>(1, capacity_bytes / block_bytes)));
  WindowAwareCache cache(policy.get(), capacity_bytes, parts, window_aware);
  ReplayResult result;
  result.policy = std::string(policy->name());
  result.capacity_blocks = capacity_bytes / block_bytes;
  if (per_request_hits != nullptr) per_request_hits->clear();
  std::vector<BlockHash> chain;
  for (const TraceRequest& request : trace) {
    chain.clear();
    for (uint64_t id : request.hash_ids) chain.push_back(TraceBlockHash(id));
    policy->OnRequest(chain);
    const WindowAwareCache::Match m = cache.MatchPrefix(chain);
    ++result.requests;
    result.blocks += static_cast<int64_t>(chain.size());
    result.hit_blocks += m.usable_blocks;
    result.hit_window_blocks += m.usable_blocks - m.window_from;
    if (per_request_hits != nullptr) per_request_hits->push_back(m.usable_blocks);
    cache.Access(chain, m);
  }
  result.evictions = cache.counters().blocks_evicted;
  return result;
}

}  // namespace kvrelay::cachestore::sim

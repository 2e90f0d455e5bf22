#include "cachestore/sim/trace_replay.h"

#include <cmath>
#include <limits>
#include <queue>
#include <set>
#include <tuple>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "cachestore/adaptive_policy.h"
#include "cachestore/block_index.h"
#include "common/file_util.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace kvrelay::cachestore::sim {

namespace {
constexpr int64_t kTraceBlockTokensForCheck = 512;

// Counts one request of an offline replay whose cache is `cached` (keyed by trace id): its
// blocks, and its hits, the leading blocks already cached.
template <typename CachedById>
void CountRequest(const std::vector<uint64_t>& ids, const CachedById& cached,
                  ReplayResult& result) {
  ++result.requests;
  result.blocks += static_cast<int64_t>(ids.size());
  size_t hits = 0;
  while (hits < ids.size() && cached.contains(ids[hits])) ++hits;
  result.hit_blocks += static_cast<int64_t>(hits);
}

}  // namespace

// Trace ids are small integers; spread them over the hash space (shard bits are the top bits of
// lo) with a fixed bijective mix so the index sees hash-like keys.
BlockHash TraceBlockHash(uint64_t id) {
  uint64_t x = id + 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  x ^= x >> 31;
  return BlockHash{id, x};
}

absl::StatusOr<std::vector<TraceRequest>> ParseTrace(std::string_view text) {
  std::vector<TraceRequest> out;
  int line_no = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view line = text.substr(pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    nlohmann::json j = nlohmann::json::parse(line.begin(), line.end(), nullptr, false);
    if (j.is_discarded() || !j.is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat("trace line ", line_no, ": not a JSON object"));
    }
    auto it = j.find("hash_ids");
    if (it == j.end() || !it->is_array()) {
      return absl::InvalidArgumentError(
          absl::StrCat("trace line ", line_no, ": hash_ids: missing or not an array"));
    }
    TraceRequest r;
    for (const auto& [field, target] :
         {std::pair<const char*, int64_t*>{"input_length", &r.input_length},
          {"output_length", &r.output_length},
          {"timestamp", &r.timestamp_ms}}) {
      auto f = j.find(field);
      if (f == j.end()) continue;
      if (!f->is_number() ||
          (!f->is_number_integer() && f->get<double>() != std::floor(f->get<double>()))) {
        return absl::InvalidArgumentError(
            absl::StrCat("trace line ", line_no, ": ", field, ": want a non-negative integer"));
      }
      const double v = f->get<double>();
      if (v < 0 || v > 9e15) {
        return absl::InvalidArgumentError(absl::StrCat("trace line ", line_no, ": ", field,
                                                       ": want a non-negative integer, got ", v));
      }
      *target = static_cast<int64_t>(v);
    }
    r.hash_ids.reserve(it->size());
    for (const auto& v : *it) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("trace line ", line_no, ": hash_ids: want non-negative integers"));
      }
      r.hash_ids.push_back(v.get<uint64_t>());
    }
    if (r.input_length >= 0 &&
        (r.input_length + kTraceBlockTokensForCheck - 1) / kTraceBlockTokensForCheck !=
            static_cast<int64_t>(r.hash_ids.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("trace line ", line_no, ": input_length ", r.input_length, " needs ",
                       (r.input_length + kTraceBlockTokensForCheck - 1) / kTraceBlockTokensForCheck,
                       " blocks of 512 tokens but hash_ids has ", r.hash_ids.size()));
    }
    out.push_back(std::move(r));
  }
  return out;
}

absl::StatusOr<std::vector<TraceRequest>> LoadTrace(const std::string& path) {
  KV_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  return ParseTrace(text);
}

absl::StatusOr<ReplayResult> ReplayTrace(const std::vector<TraceRequest>& trace,
                                         int64_t capacity_blocks, std::string_view policy_name,
                                         const ReplayOptions& replay_options) {
  if (capacity_blocks <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("capacity-blocks: must be positive, got ", capacity_blocks));
  }
  if (policy_name == "belady") return ReplayBelady(trace, capacity_blocks);
  if (policy_name == "belady-leaf") return ReplayBeladyLeaf(trace, capacity_blocks);
  KV_ASSIGN_OR_RETURN(EvictionPolicyPtr policy, MakeEvictionPolicy(policy_name, capacity_blocks));
  if (const auto* adaptive = dynamic_cast<const AdaptivePolicy*>(policy.get());
      adaptive != nullptr && replay_options.learner_halvings > 0) {
    adaptive->SetBudgetSampling(replay_options.learner_halvings);
  }
  BlockIndex::Options options;
  options.policy = policy.get();
  options.ghost_capacity = static_cast<size_t>(kGhostCaches * capacity_blocks);
  BlockIndex index(options);

  ReplayResult result;
  result.policy = std::string(policy->name());
  result.capacity_blocks = capacity_blocks;
  int64_t cached = 0;
  std::vector<BlockHash> chain;
  for (const TraceRequest& request : trace) {
    chain.clear();
    for (uint64_t id : request.hash_ids) chain.push_back(TraceBlockHash(id));
    ++result.requests;
    result.blocks += static_cast<int64_t>(chain.size());
    policy->OnRequest(chain);
    result.hit_blocks +=
        ReplayRequestInto(index, chain, capacity_blocks, &cached, &result.evictions);
  }
  return result;
}

namespace {

bool Holds(BlockIndex& index, const BlockHash& hash) {
  return index.MatchPrefix({&hash, 1}, /*touch=*/false, /*lease=*/false, nullptr) == 1;
}

// The two tiers of ReplayTiered and the moves between them.
class TwoTiers {
 public:
  TwoTiers(const EvictionPolicy* dram_policy, EvictionPolicyPtr disk_policy, int64_t dram_blocks,
           int64_t disk_blocks)
      : dram_capacity_(dram_blocks),
        disk_capacity_(disk_blocks),
        disk_policy_(std::move(disk_policy)),
        dram_(Options(dram_policy, dram_blocks)),
        disk_(Options(disk_policy_.get(), disk_blocks)) {}

  void Replay(absl::Span<const BlockHash> chain, TieredReplayResult& r) {
    size_t hits = 0;
    for (; hits < chain.size(); ++hits) {
      if (Holds(dram_, chain[hits])) {
        ++r.dram_hit_blocks;
      } else if (Holds(disk_, chain[hits])) {
        ++r.disk_hit_blocks;
      } else {
        break;
      }
    }
    r.total.hit_blocks += static_cast<int64_t>(hits);
    // Every block is accessed in order, leased while the request runs (ReplayRequestInto's
    // rule), promoted from disk or inserted when DRAM lacks it.
    std::vector<BlockHash> leased;
    BlockHash parent;
    for (const BlockHash& h : chain) {
      if (dram_.Touch(h, /*lease=*/true)) {
        leased.push_back(h);
        parent = h;
        continue;
      }
      if (disk_.RemoveLeaf(h).ok()) {
        --disk_cached_;
        ++r.promotions;
      }
      while (dram_cached_ >= dram_capacity_) {
        std::optional<RemovedBlock> evicted = dram_.EvictOne();
        if (!evicted.has_value()) break;
        --dram_cached_;
        ++r.total.evictions;
        Demote(evicted->hash, r);
      }
      if (dram_cached_ >= dram_capacity_) break;  // longer than DRAM: the rest is not stored
      NewBlock block;
      block.hash = h;
      block.parent = parent;
      if (!dram_.Insert(block, BlockState::kCommitted, /*lease=*/true).ok()) break;
      ++dram_cached_;
      leased.push_back(h);
      parent = h;
    }
    dram_.ReleaseLeases(leased);
  }

 private:
  static BlockIndex::Options Options(const EvictionPolicy* policy, int64_t capacity) {
    BlockIndex::Options o;
    o.policy = policy;
    o.ghost_capacity = static_cast<size_t>(kGhostCaches * capacity);
    return o;
  }

  void Demote(const BlockHash& hash, TieredReplayResult& r) {
    while (disk_cached_ >= disk_capacity_) {
      if (!disk_.EvictOne().has_value()) return;
      --disk_cached_;
      ++r.disk_evictions;
    }
    NewBlock block;
    block.hash = hash;  // no parent: a disk block is found by its hash alone
    if (!disk_.Insert(block, BlockState::kCommitted).ok()) return;
    ++disk_cached_;
    ++r.demotions;
  }

  const int64_t dram_capacity_;
  const int64_t disk_capacity_;
  EvictionPolicyPtr disk_policy_;
  BlockIndex dram_;
  BlockIndex disk_;
  int64_t dram_cached_ = 0;
  int64_t disk_cached_ = 0;
};

}  // namespace

absl::StatusOr<TieredReplayResult> ReplayTiered(const std::vector<TraceRequest>& trace,
                                                int64_t dram_blocks, int64_t disk_blocks,
                                                std::string_view policy_name,
                                                const ReplayOptions& replay_options) {
  if (dram_blocks <= 0 || disk_blocks <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tiers: DRAM and disk capacities must be "
                     "positive, got ",
                     dram_blocks, " and ", disk_blocks));
  }
  if (IsOfflinePolicy(policy_name)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tiers: ", std::string(policy_name), " is offline; a tiered replay takes online policies"));
  }
  KV_ASSIGN_OR_RETURN(EvictionPolicyPtr policy, MakeEvictionPolicy(policy_name, dram_blocks));
  if (const auto* adaptive = dynamic_cast<const AdaptivePolicy*>(policy.get());
      adaptive != nullptr && replay_options.learner_halvings > 0) {
    adaptive->SetBudgetSampling(replay_options.learner_halvings);
  }
  TieredReplayResult result;
  result.total.policy = std::string(policy->name());
  result.total.capacity_blocks = dram_blocks;
  result.disk_blocks = disk_blocks;
  // LRU on disk: it sees demotions, not requests, which the learning policies misread (on the
  // Mooncake trace at 500 + 4,000 blocks: lru 0.266, adaptive 0.245, lrfu 0.240, probation 0.249).
  KV_ASSIGN_OR_RETURN(EvictionPolicyPtr disk_policy, MakeEvictionPolicy("lru", disk_blocks));
  TwoTiers tiers(policy.get(), std::move(disk_policy), dram_blocks, disk_blocks);
  std::vector<BlockHash> chain;
  for (const TraceRequest& request : trace) {
    chain.clear();
    for (uint64_t id : request.hash_ids) chain.push_back(TraceBlockHash(id));
    ++result.total.requests;
    result.total.blocks += static_cast<int64_t>(chain.size());
    policy->OnRequest(chain);
    tiers.Replay(chain, result);
  }
  return result;
}

ReplayResult ReplayBelady(const std::vector<TraceRequest>& trace, int64_t capacity_blocks) {
  constexpr int64_t kNever = std::numeric_limits<int64_t>::max();
  // next_use[i][j]: index of the next request that touches block j of request i.
  std::vector<std::vector<int64_t>> next_use(trace.size());
  {
    absl::flat_hash_map<uint64_t, int64_t> next;
    for (int64_t i = static_cast<int64_t>(trace.size()) - 1; i >= 0; --i) {
      const auto& ids = trace[i].hash_ids;
      next_use[i].resize(ids.size());
      for (size_t j = 0; j < ids.size(); ++j) {
        auto it = next.find(ids[j]);
        next_use[i][j] = it == next.end() ? kNever : it->second;
      }
      for (uint64_t id : ids) next[id] = i;
    }
  }
  ReplayResult result;
  result.policy = "belady";
  result.capacity_blocks = capacity_blocks;
  absl::flat_hash_map<uint64_t, int64_t> cached;  // id -> its next use
  // Max-heap of (next use, id); entries whose next use no longer matches are stale.
  std::priority_queue<std::pair<int64_t, uint64_t>> heap;
  for (size_t i = 0; i < trace.size(); ++i) {
    const auto& ids = trace[i].hash_ids;
    CountRequest(ids, cached, result);
    for (size_t j = 0; j < ids.size(); ++j) {
      const int64_t nu = next_use[i][j];
      auto it = cached.find(ids[j]);
      if (it != cached.end()) {
        it->second = nu;
        heap.push({nu, ids[j]});
        continue;
      }
      if (static_cast<int64_t>(cached.size()) >= capacity_blocks) {
        while (true) {
          auto top = heap.top();
          auto c = cached.find(top.second);
          if (c != cached.end() && c->second == top.first) break;
          heap.pop();
        }
        if (heap.top().first <= nu) continue;  // the newcomer is needed last: do not cache it
        cached.erase(heap.top().second);
        heap.pop();
        ++result.evictions;
      }
      cached[ids[j]] = nu;
      heap.push({nu, ids[j]});
    }
  }
  return result;
}

bool IsOfflinePolicy(std::string_view policy) {
  return policy == "belady" || policy == "belady-leaf";
}

ReplayResult ReplayBeladyLeaf(const std::vector<TraceRequest>& trace, int64_t capacity_blocks) {
  constexpr int64_t kNever = std::numeric_limits<int64_t>::max();
  // next_access[i][j]: position (in block accesses) of the next access to block j of request i.
  std::vector<std::vector<int64_t>> next_access(trace.size());
  {
    int64_t position = 0;
    for (const TraceRequest& r : trace) position += static_cast<int64_t>(r.hash_ids.size());
    absl::flat_hash_map<uint64_t, int64_t> next;
    for (int64_t i = static_cast<int64_t>(trace.size()) - 1; i >= 0; --i) {
      const auto& ids = trace[i].hash_ids;
      position -= static_cast<int64_t>(ids.size());
      next_access[i].resize(ids.size());
      for (int64_t j = static_cast<int64_t>(ids.size()) - 1; j >= 0; --j) {
        auto it = next.find(ids[j]);
        next_access[i][j] = it == next.end() ? kNever : it->second;
        next[ids[j]] = position + j;
      }
    }
  }
  struct Cached {
    uint64_t parent = 0;
    bool has_parent = false;
    int32_t children = 0;
    int32_t depth = 0;
    int64_t next_access = 0;
    bool leased = false;
  };
  // Evictable leaves ordered by (next access, depth, id): the last one goes first.
  using Key = std::tuple<int64_t, int32_t, uint64_t>;
  absl::flat_hash_map<uint64_t, Cached> cached;
  std::set<Key> evictable;
  auto key_of = [](uint64_t id, const Cached& c) { return Key{c.next_access, c.depth, id}; };

  ReplayResult result;
  result.policy = "belady-leaf";
  result.capacity_blocks = capacity_blocks;
  std::vector<uint64_t> leased;
  for (size_t i = 0; i < trace.size(); ++i) {
    const auto& ids = trace[i].hash_ids;
    CountRequest(ids, cached, result);
    leased.clear();
    for (size_t j = 0; j < ids.size(); ++j) {
      if (auto it = cached.find(ids[j]); it != cached.end()) {
        Cached& c = it->second;
        if (!c.leased && c.children == 0) evictable.erase(key_of(ids[j], c));
        if (!c.leased) leased.push_back(ids[j]);
        c.leased = true;
        c.next_access = next_access[i][j];
        continue;
      }
      while (static_cast<int64_t>(cached.size()) >= capacity_blocks && !evictable.empty()) {
        const uint64_t victim = std::get<2>(*evictable.rbegin());
        evictable.erase(std::prev(evictable.end()));
        const Cached gone = cached[victim];
        cached.erase(victim);
        ++result.evictions;
        if (!gone.has_parent) continue;
        Cached& parent = cached[gone.parent];
        if (--parent.children == 0 && !parent.leased) {
          evictable.insert(key_of(gone.parent, parent));
        }
      }
      // Every cached block is leased by this request: the rest of it cannot be stored.
      if (static_cast<int64_t>(cached.size()) >= capacity_blocks) break;
      Cached c;
      c.depth = static_cast<int32_t>(j);
      c.next_access = next_access[i][j];
      c.leased = true;
      if (j > 0) {
        c.parent = ids[j - 1];
        c.has_parent = true;
        ++cached[ids[j - 1]].children;  // the previous block is cached and leased
      }
      cached[ids[j]] = c;
      leased.push_back(ids[j]);
    }
    for (uint64_t id : leased) {
      Cached& c = cached[id];
      c.leased = false;
      if (c.children == 0) evictable.insert(key_of(id, c));
    }
  }
  return result;
}

absl::StatusOr<std::vector<ReplayResult>> ReplaySweep(const std::vector<TraceRequest>& trace,
                                                      const std::vector<int64_t>& capacities,
                                                      const std::vector<std::string>& policies,
                                                      const ReplayOptions& options) {
  std::vector<ReplayResult> out;
  for (int64_t capacity : capacities) {
    for (const std::string& policy : policies) {
      KV_ASSIGN_OR_RETURN(ReplayResult r, ReplayTrace(trace, capacity, policy, options));
      out.push_back(std::move(r));
    }
  }
  return out;
}

}  // namespace kvrelay::cachestore::sim

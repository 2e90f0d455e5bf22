#include "cachestore/trace_replay.h"

#include "absl/strings/str_cat.h"
#include "cachestore/block_index.h"
#include "common/file_util.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace kvrelay::cachestore {

namespace {
// Trace ids are small integers; spread them over the hash space (shard bits are the top bits of
// lo) with a fixed bijective mix so the index sees hash-like keys.
BlockHash TraceHash(uint64_t id) {
  uint64_t x = id + 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  x ^= x >> 31;
  return BlockHash{id, x};
}
}  // namespace

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
      return absl::InvalidArgumentError(absl::StrCat("trace line ", line_no, ": not a JSON object"));
    }
    auto it = j.find("hash_ids");
    if (it == j.end() || !it->is_array()) {
      return absl::InvalidArgumentError(
          absl::StrCat("trace line ", line_no, ": hash_ids: missing or not an array"));
    }
    TraceRequest r;
    r.hash_ids.reserve(it->size());
    for (const auto& v : *it) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("trace line ", line_no, ": hash_ids: want non-negative integers"));
      }
      r.hash_ids.push_back(v.get<uint64_t>());
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
                                         int64_t capacity_blocks, std::string_view policy_name) {
  if (capacity_blocks <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("capacity-blocks: must be positive, got ", capacity_blocks));
  }
  KV_ASSIGN_OR_RETURN(EvictionPolicyPtr policy, MakeEvictionPolicy(policy_name, capacity_blocks));
  BlockIndex::Options options;
  options.policy = policy.get();
  options.ghost_capacity = static_cast<size_t>(kGhostCaches * capacity_blocks);
  BlockIndex index(options);

  ReplayResult result;
  result.policy = std::string(policy->name());
  result.capacity_blocks = capacity_blocks;
  int64_t cached = 0;
  std::vector<BlockHash> chain;
  std::vector<BlockHash> leased;
  for (const TraceRequest& request : trace) {
    chain.clear();
    for (uint64_t id : request.hash_ids) chain.push_back(TraceHash(id));
    ++result.requests;
    result.blocks += static_cast<int64_t>(chain.size());
    result.hit_blocks += index.MatchPrefix(chain, /*touch=*/false, /*lease=*/false, nullptr);
    leased.clear();
    BlockHash parent;
    for (const BlockHash& h : chain) {
      if (index.Touch(h, /*lease=*/true)) {
        leased.push_back(h);
        parent = h;
        continue;
      }
      while (cached >= capacity_blocks) {
        if (!index.EvictOne().has_value()) break;
        --cached;
        ++result.evictions;
      }
      // A request longer than the whole cache: the rest of it cannot be stored.
      if (cached >= capacity_blocks) break;
      NewBlock block;
      block.hash = h;
      block.parent = parent;
      if (!index.Insert(block, BlockState::kCommitted, /*lease=*/true).ok()) break;
      ++cached;
      leased.push_back(h);
      parent = h;
    }
    index.ReleaseLeases(leased);
  }
  return result;
}

}  // namespace kvrelay::cachestore

#include "cachestore/node_registry.h"

#include <algorithm>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"

namespace kvrelay::cachestore {

std::string_view TierName(Tier tier) {
  switch (tier) {
    case Tier::kGpu:
      return "gpu";
    case Tier::kHost:
      return "host";
    case Tier::kSsd:
      return "ssd";
    default:
      return "unspecified";
  }
}

absl::Status IdentityError(absl::Status status, std::string_view node_id) {
  status.SetPayload(kIdentityPayload, absl::Cord(std::string(node_id)));
  return status;
}

std::string_view NodeRoleName(NodeRole role) {
  switch (role) {
    case NodeRole::kPrefill:
      return "prefill";
    case NodeRole::kDecode:
      return "decode";
    case NodeRole::kCache:
      return "cache";
    default:
      return "unspecified";
  }
}

void NodeRegistry::SetSuspect(uint16_t index, bool suspect) {
  Node& n = nodes_[index];
  const bool was = n.state == NodeState::kSuspect;
  if (was == suspect) return;
  n.state = suspect ? NodeState::kSuspect : NodeState::kLive;
  suspect_[index].store(suspect ? 1 : 0, std::memory_order_release);
  suspect_count_.fetch_add(suspect ? 1 : -1, std::memory_order_acq_rel);
}

absl::StatusOr<NodeRegistry::RegisterResult> NodeRegistry::Register(const NodeSpec& spec,
                                                                    absl::Time now,
                                                                    bool force_replace,
                                                                    bool allow_successor) {
  absl::MutexLock lock(&mu_);
  auto it = by_id_.find(spec.node_id);
  if (it != by_id_.end()) {
    Node& n = nodes_[it->second];
    if (n.spec.incarnation == spec.incarnation) {
      if (!(n.spec == spec)) {
        if (force_replace) return RegisterResult{it->second, true, false, false};
        return IdentityError(
            absl::FailedPreconditionError(
                absl::StrCat("node_id: node '", spec.node_id, "' incarnation ", spec.incarnation,
                             " is already registered with different addresses, segments or TTL; a "
                             "new spec needs "
                             "a new incarnation")),
            spec.node_id);
      }
      n.last_heartbeat = now;
      const bool revived = n.state == NodeState::kSuspect;
      SetSuspect(it->second, false);
      return RegisterResult{it->second, false, revived, false};
    }
    const bool successor = allow_successor && !spec.grpc_address.empty() &&
                           spec.grpc_address == n.spec.grpc_address && spec.role == n.spec.role;
    if (n.state == NodeState::kLive && !force_replace && !successor) {
      absl::Status refused = IdentityError(
          absl::AlreadyExistsError(absl::StrCat(
              "node_id: '", spec.node_id, "' is registered by a live process (incarnation ",
              n.spec.incarnation, ", data plane ", n.spec.transport_address,
              n.spec.grpc_address.empty() ? "" : ", gRPC ", n.spec.grpc_address,
              "); refusing incarnation ", spec.incarnation, ": give each process its own node id")),
          spec.node_id);
      refused.SetPayload(kHolderPayload,
                         absl::Cord(absl::StrCat(absl::ToInt64Milliseconds(std::max(
                                                     now - n.last_heartbeat, absl::ZeroDuration())),
                                                 "/", absl::ToInt64Milliseconds(n.spec.ttl))));
      return refused;
    }
    return RegisterResult{it->second, true, false, false};
  }
  if (static_cast<int>(by_id_.size()) >= std::min(max_nodes_, kMaxNodes)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "node_id: at most ", std::min(max_nodes_, kMaxNodes), " nodes may be registered at once"));
  }
  uint16_t index;
  if (!free_indices_.empty()) {
    index = free_indices_.front();
    free_indices_.pop_front();
  } else {
    index = static_cast<uint16_t>(nodes_.size());
    nodes_.emplace_back();
  }
  Node& n = nodes_[index];
  n = Node{};
  n.spec = spec;
  n.last_heartbeat = now;
  n.live = true;
  for (const SegmentSpec& s : spec.segments) n.segments.push_back(Segment{s});
  by_id_[spec.node_id] = index;
  return RegisterResult{index, false, false, true};
}

NodeRegistry::HeartbeatResult NodeRegistry::Heartbeat(const std::string& node_id,
                                                      uint64_t incarnation, absl::Time now,
                                                      const NodeLoad* load) {
  absl::MutexLock lock(&mu_);
  HeartbeatResult r;
  auto it = by_id_.find(node_id);
  if (it == by_id_.end()) return r;
  Node& n = nodes_[it->second];
  r.index = it->second;
  r.registered_incarnation = n.spec.incarnation;
  if (incarnation != 0 && incarnation != n.spec.incarnation) {
    r.outcome = HeartbeatOutcome::kWrongIncarnation;
    return r;
  }
  n.last_heartbeat = now;
  if (load != nullptr) n.load = *load;
  r.outcome = n.state == NodeState::kSuspect ? HeartbeatOutcome::kRevived : HeartbeatOutcome::kOk;
  SetSuspect(it->second, false);
  return r;
}

NodeRegistry::Sweep NodeRegistry::Expire(absl::Time now, absl::Duration grace) {
  absl::MutexLock lock(&mu_);
  Sweep out;
  for (size_t i = 0; i < nodes_.size(); ++i) {
    Node& n = nodes_[i];
    if (!n.live || now - n.last_heartbeat <= n.spec.ttl) continue;
    if (n.state == NodeState::kLive) {
      SetSuspect(static_cast<uint16_t>(i), true);
      n.suspect_since = now;
      out.suspected.push_back(static_cast<uint16_t>(i));
    }
    if (now - n.last_heartbeat > n.spec.ttl + grace) out.forget.push_back(static_cast<uint16_t>(i));
  }
  return out;
}

void NodeRegistry::TouchAll(absl::Time now) {
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < nodes_.size(); ++i) {
    nodes_[i].last_heartbeat = now;
    if (nodes_[i].live) SetSuspect(static_cast<uint16_t>(i), false);
  }
}

void NodeRegistry::Remove(uint16_t node) {
  absl::MutexLock lock(&mu_);
  if (node >= nodes_.size() || !nodes_[node].live) return;
  SetSuspect(node, false);
  by_id_.erase(nodes_[node].spec.node_id);
  nodes_[node] = Node{};
  free_indices_.push_back(node);
  removals_.fetch_add(1, std::memory_order_acq_rel);
}

absl::StatusOr<uint16_t> NodeRegistry::Check(const std::string& node_id,
                                             uint64_t incarnation) const {
  absl::MutexLock lock(&mu_);
  auto it = by_id_.find(node_id);
  if (it == by_id_.end()) {
    return IdentityError(absl::NotFoundError(absl::StrCat(
                             "node_id: node '", node_id,
                             "' is not registered (expired, replaced or never registered): "
                             "register again")),
                         node_id);
  }
  const uint64_t registered = nodes_[it->second].spec.incarnation;
  if (incarnation != 0 && incarnation != registered) {
    return IdentityError(
        absl::FailedPreconditionError(
            absl::StrCat("incarnation: node '", node_id, "' is registered with incarnation ",
                         registered, ", not ", incarnation, " (an earlier or different process)")),
        node_id);
  }
  return it->second;
}

std::optional<uint16_t> NodeRegistry::Find(const std::string& node_id) const {
  absl::MutexLock lock(&mu_);
  auto it = by_id_.find(node_id);
  if (it == by_id_.end()) return std::nullopt;
  return it->second;
}

std::optional<std::string> NodeRegistry::NodeId(uint16_t node) const {
  absl::MutexLock lock(&mu_);
  if (node >= nodes_.size() || !nodes_[node].live) return std::nullopt;
  return nodes_[node].spec.node_id;
}

std::optional<NodeSpec> NodeRegistry::Spec(uint16_t node) const {
  absl::MutexLock lock(&mu_);
  if (node >= nodes_.size() || !nodes_[node].live) return std::nullopt;
  return nodes_[node].spec;
}

std::vector<NodeSpec> NodeRegistry::AllSpecs() const {
  absl::MutexLock lock(&mu_);
  std::vector<NodeSpec> out;
  for (const Node& n : nodes_) {
    if (n.live) out.push_back(n.spec);
  }
  return out;
}

std::optional<uint16_t> NodeRegistry::FindSegment(uint16_t node,
                                                  const std::string& segment_id) const {
  absl::MutexLock lock(&mu_);
  if (node >= nodes_.size() || !nodes_[node].live) return std::nullopt;
  const auto& segs = nodes_[node].segments;
  for (size_t i = 0; i < segs.size(); ++i) {
    if (segs[i].spec.segment_id == segment_id) return static_cast<uint16_t>(i);
  }
  return std::nullopt;
}

int64_t NodeRegistry::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(by_id_.size());
}

int64_t NodeRegistry::live_count() const {
  absl::MutexLock lock(&mu_);
  int64_t n = 0;
  for (const Node& node : nodes_) n += (node.live && node.state == NodeState::kLive) ? 1 : 0;
  return n;
}

std::vector<NodeInfo> NodeRegistry::List(absl::Time now) const {
  absl::MutexLock lock(&mu_);
  std::vector<NodeInfo> out;
  for (const Node& n : nodes_) {
    if (!n.live) continue;
    NodeInfo info;
    info.spec = n.spec;
    info.state = n.state;
    info.load = n.load;
    info.since_heartbeat = std::max(absl::ZeroDuration(), now - n.last_heartbeat);
    for (const Segment& s : n.segments) {
      info.capacity_slots += s.spec.capacity_slots;
      info.used_slots += s.used;
      if (s.spec.tier == Tier::kSsd) {
        info.ssd_capacity_slots += s.spec.capacity_slots;
        info.ssd_used_slots += s.used;
      }
    }
    out.push_back(std::move(info));
  }
  std::sort(out.begin(), out.end(),
            [](const NodeInfo& a, const NodeInfo& b) { return a.spec.node_id < b.spec.node_id; });
  return out;
}

std::optional<uint32_t> NodeRegistry::ReserveSlot(uint16_t node, uint16_t segment) {
  absl::MutexLock lock(&mu_);
  if (node >= nodes_.size() || !nodes_[node].live) return std::nullopt;
  if (segment >= nodes_[node].segments.size()) return std::nullopt;
  Segment& s = nodes_[node].segments[segment];
  uint32_t slot;
  if (!s.free_list.empty()) {
    slot = s.free_list.back();
    s.free_list.pop_back();
  } else if (s.next_unused < s.spec.capacity_slots) {
    slot = s.next_unused++;
  } else {
    return std::nullopt;
  }
  ++s.used;
  return slot;
}

void NodeRegistry::FreeSlot(const Replica& r) {
  absl::MutexLock lock(&mu_);
  if (r.node >= nodes_.size() || !nodes_[r.node].live) return;
  if (r.segment >= nodes_[r.node].segments.size()) return;
  Segment& s = nodes_[r.node].segments[r.segment];
  if (r.slot >= s.next_unused || s.used == 0) return;
  s.free_list.push_back(r.slot);
  --s.used;
}

bool NodeRegistry::MarkUsed(const Replica& r) {
  absl::MutexLock lock(&mu_);
  if (r.node >= nodes_.size() || !nodes_[r.node].live) return false;
  if (r.segment >= nodes_[r.node].segments.size()) return false;
  Segment& s = nodes_[r.node].segments[r.segment];
  if (r.slot >= s.spec.capacity_slots) return false;
  if (r.slot >= s.next_unused) {
    for (uint32_t x = s.next_unused; x < r.slot; ++x) s.free_list.push_back(x);
    s.next_unused = r.slot + 1;
  } else {
    auto it = std::find(s.free_list.begin(), s.free_list.end(), r.slot);
    if (it == s.free_list.end()) return false;
    *it = s.free_list.back();
    s.free_list.pop_back();
  }
  ++s.used;
  return true;
}

std::vector<SegmentView> NodeRegistry::Segments(std::optional<uint16_t> include) const {
  absl::MutexLock lock(&mu_);
  std::vector<SegmentView> out;
  for (size_t i = 0; i < nodes_.size(); ++i) {
    const Node& n = nodes_[i];
    if (!n.live) continue;
    if (n.state == NodeState::kSuspect && include != static_cast<uint16_t>(i)) continue;
    for (size_t j = 0; j < n.segments.size(); ++j) {
      const Segment& s = n.segments[j];
      // A disk tier (SSD) is its node's own: the node announces what each of its slots holds
      // (CacheStore, "disk replicas"); the store places and evicts only in DRAM tiers.
      if (s.spec.tier == Tier::kSsd) continue;
      out.push_back(SegmentView{static_cast<uint16_t>(i), static_cast<uint16_t>(j), s.spec.tier,
                                s.spec.capacity_slots, s.spec.capacity_slots - s.used,
                                s.spec.slot_bytes, &n.spec.node_id});
    }
  }
  return out;
}

Location NodeRegistry::Describe(const Replica& r) const {
  absl::MutexLock lock(&mu_);
  Location loc;
  loc.slot = r.slot;
  if (r.node >= nodes_.size() || !nodes_[r.node].live) return loc;
  const Node& n = nodes_[r.node];
  loc.node_id = n.spec.node_id;
  loc.incarnation = n.spec.incarnation;
  loc.transport_kind = n.spec.transport_kind;
  loc.transport_address = n.spec.transport_address;
  if (r.segment < n.segments.size()) {
    const SegmentSpec& s = n.segments[r.segment].spec;
    loc.segment_id = s.segment_id;
    loc.memory_key = s.memory_key;
    loc.tier = s.tier;
    loc.slot_bytes = s.slot_bytes;
    loc.offset_bytes = static_cast<uint64_t>(r.slot) * s.slot_bytes;
  }
  return loc;
}

std::vector<TierUsage> NodeRegistry::Usage() const {
  absl::MutexLock lock(&mu_);
  std::vector<TierUsage> out;
  for (Tier t : {Tier::kGpu, Tier::kHost, Tier::kSsd}) {
    TierUsage u;
    u.tier = t;
    for (const Node& n : nodes_) {
      if (!n.live) continue;
      for (const Segment& s : n.segments) {
        if (s.spec.tier != t) continue;
        u.capacity_slots += s.spec.capacity_slots;
        u.used_slots += s.used;
        u.capacity_bytes += s.spec.capacity_slots * static_cast<int64_t>(s.spec.slot_bytes);
        u.used_bytes += s.used * static_cast<int64_t>(s.spec.slot_bytes);
      }
    }
    out.push_back(u);
  }
  return out;
}

std::pair<int64_t, int64_t> NodeRegistry::SlotTotals() const {
  absl::MutexLock lock(&mu_);
  int64_t used = 0, cap = 0;
  for (const Node& n : nodes_) {
    if (!n.live) continue;
    for (const Segment& s : n.segments) {
      if (s.spec.tier == Tier::kSsd) continue;  // watermarks and the policy size DRAM only
      used += s.used;
      cap += s.spec.capacity_slots;
    }
  }
  return {used, cap};
}

std::vector<const SegmentView*> ChoosePlacement(const std::vector<SegmentView>& segments,
                                                uint64_t size_bytes,
                                                const std::string& preferred_node,
                                                Tier preferred_tier, int replicas) {
  std::vector<const SegmentView*> eligible;
  for (const SegmentView& s : segments) {
    if (s.free_slots > 0 && s.slot_bytes >= size_bytes) eligible.push_back(&s);
  }
  auto rank = [&](const SegmentView* s) {
    const bool node_match = !preferred_node.empty() && *s->node_id == preferred_node;
    const int tier_rank = preferred_tier == Tier::kUnspecified
                              ? static_cast<int>(s->tier)
                              : (s->tier == preferred_tier ? 0 : 1 + static_cast<int>(s->tier));
    const double free_fraction = static_cast<double>(s->free_slots) /
                                 static_cast<double>(std::max<int64_t>(1, s->capacity_slots));
    return std::make_tuple(node_match ? 0 : 1, tier_rank, -free_fraction, s->node, s->segment);
  };
  std::sort(eligible.begin(), eligible.end(),
            [&](const SegmentView* a, const SegmentView* b) { return rank(a) < rank(b); });
  std::vector<const SegmentView*> out;
  for (const SegmentView* s : eligible) {
    if (static_cast<int>(out.size()) >= replicas) break;
    bool same_node = false;
    for (const SegmentView* o : out) same_node |= (o->node == s->node);
    if (!same_node) out.push_back(s);
  }
  return out;
}

}  // namespace kvrelay::cachestore

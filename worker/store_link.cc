#include "worker/store_link.h"

#include <algorithm>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kv/checksum.h"
#include "proto/grpc_status.h"

namespace kvrelay::worker {
namespace {

constexpr char kSegmentId[] = "kv";
constexpr char kDiskSegmentId[] = "disk";

DependencyGateOptions GateOptions(const StoreLinkOptions& options) {
  DependencyGateOptions gate;
  gate.name = absl::StrCat("the cache store at ", options.cachestore_address);
  gate.min_cooldown = options.store_backoff;
  gate.max_cooldown = std::max(options.store_backoff, options.store_backoff_max);
  gate.metrics = options.metrics;
  gate.metric_label = "cachestore";
  gate.extra_labels = options.metric_labels;
  return gate;
}

// Until when a registration refused because a live process holds this node id is worth
// retrying: the holder's last heartbeat plus its TTL (plus a second), after which the store
// forgets it; `now` when it heartbeated within half its TTL (it heartbeats every quarter, so it
// runs: a real duplicate, refused at once). A store that does not say: `fallback`.
absl::Time HolderGoneBy(const absl::Status& refused, absl::Time now, absl::Time fallback) {
  const std::optional<kvrelay::v1::ErrorInfo> info = proto::GetErrorInfo(refused);
  if (!info.has_value() || !info->has_holder_silent_ms()) return fallback;
  const absl::Duration silent = absl::Milliseconds(info->holder_silent_ms());
  const absl::Duration ttl = absl::Milliseconds(info->holder_ttl_ms());
  if (silent < ttl / 2) return now;
  return now + (ttl - silent) + absl::Seconds(1);
}

}  // namespace

StoreLink::StoreLink(StoreLinkOptions options, const CacheSegment* segment, Clock* clock,
                     std::unique_ptr<cachestore::CacheStoreClient> client)
    : options_(std::move(options)),
      segment_(segment),
      clock_(clock),
      client_(std::move(client)),
      gate_(options_.gate_clock != nullptr ? options_.gate_clock : Clock::Real(),
            GateOptions(options_)) {}

absl::StatusOr<std::unique_ptr<StoreLink>> StoreLink::Connect(StoreLinkOptions options,
                                                              const CacheSegment* segment,
                                                              Clock* clock, absl::Time deadline) {
  cachestore::CacheStoreClient::Options client_options;
  client_options.timeout = options.rpc_timeout;
  client_options.security = options.security;
  client_options.node = {options.node_id, options.incarnation};
  // A list of store instances (HA): the client follows the leader among them.
  KV_ASSIGN_OR_RETURN(
      std::unique_ptr<cachestore::CacheStoreClient> client,
      cachestore::CacheStoreClient::Connect(options.cachestore_address, client_options));
  auto link = std::unique_ptr<StoreLink>(
      new StoreLink(std::move(options), segment, clock, std::move(client)));
  absl::Status status;
  // Another live process holds this id: it may be this node's earlier process, gone without
  // deregistering from another address (a pod rescheduled with a new IP), which the store
  // forgets within one TTL. A real duplicate keeps heartbeating: refused at once.
  const absl::Time fallback_gone_by = absl::Now() + link->options_.ttl + absl::Seconds(1);
  bool waiting_logged = false;
  while (true) {
    status = link->Register();
    const absl::Time now = absl::Now();
    if (absl::IsAlreadyExists(status) &&
        now < std::min(deadline, HolderGoneBy(status, now, fallback_gone_by))) {
      if (!waiting_logged) {
        KV_LOG(WARNING) << link->options_.node_id << ": " << status.message()
                        << "; retrying until that registration's TTL has passed";
        waiting_logged = true;
      }
      absl::SleepFor(absl::Milliseconds(500));
      continue;
    }
    // Refused (another live process holds this id) or malformed: retrying will not help.
    if (status.ok() || absl::IsAlreadyExists(status) || absl::IsInvalidArgument(status) ||
        absl::IsFailedPrecondition(status) || absl::Now() > deadline) {
      break;
    }
    absl::SleepFor(absl::Milliseconds(200));
  }
  if (!status.ok()) {
    absl::Status named(
        status.code(),
        absl::StrCat("cannot register node ", link->options_.node_id, " with the cache store at ",
                     link->options_.cachestore_address, ": ", status.message()));
    // The store's ErrorInfo (who holds the id, how long silent) stays for the caller.
    status.ForEachPayload([&named](absl::string_view type_url, const absl::Cord& payload) {
      named.SetPayload(type_url, payload);
    });
    return named;
  }
  // What the disk tier holds (verified by its scan at open, for a restarted worker) is announced
  // from the first heartbeat poll on.
  link->QueueDiskBlocks(/*listen=*/true);
  link->heartbeat_ = std::thread([l = link.get()] { l->HeartbeatLoop(); });
  return link;
}

absl::StatusOr<std::unique_ptr<StoreLink>> StoreLink::UnregisteredForTest(
    StoreLinkOptions options, const CacheSegment* segment, Clock* clock) {
  cachestore::CacheStoreClient::Options client_options;
  client_options.security = options.security;
  client_options.node = {options.node_id, options.incarnation};
  KV_ASSIGN_OR_RETURN(
      std::unique_ptr<cachestore::CacheStoreClient> client,
      cachestore::CacheStoreClient::Connect(options.cachestore_address, client_options));
  return std::unique_ptr<StoreLink>(
      new StoreLink(std::move(options), segment, clock, std::move(client)));
}

StoreLink::~StoreLink() {
  // No call into this link from the disk tier once this returns.
  if (options_.disk != nullptr) options_.disk->Listen({});
  Leave();
}

void StoreLink::Leave() {
  if (left_.exchange(true, std::memory_order_acq_rel)) return;
  stop_.Notify();
  // The heartbeat runs only once registered: a refused link has nothing to deregister.
  if (!heartbeat_.joinable()) return;
  heartbeat_.join();
  // Leaving on purpose: the store drops this node and its blocks now, not after the TTL.
  cachestore::CallOptions call;
  call.deadline = absl::Now() + absl::Seconds(1);
  if (absl::Status s = client_->Deregister(call); !s.ok()) {
    KV_LOG(INFO) << options_.node_id << ": deregister: " << s;
  }
}

absl::Status StoreLink::Register() {
  cachestore::CacheStoreClient::Registration reg;
  reg.role = options_.role;
  reg.grpc_address = options_.grpc_address;
  reg.transport_kind = options_.transport_kind;
  reg.transport_address = options_.transport_address;
  reg.ttl = options_.ttl;
  reg.block_tokens = options_.block_tokens;
  if (segment_ != nullptr) {
    kvrelay::v1::Segment s;
    s.set_segment_id(kSegmentId);
    s.set_tier(kvrelay::v1::TIER_HOST);
    s.set_capacity_slots(segment_->num_slots());
    // The store computes offsets as slot x slot_bytes, so it gets the stride.
    s.set_slot_bytes(segment_->slot_stride());
    s.set_memory_key(options_.segment_access_key);
    reg.segments.push_back(std::move(s));
  }
  if (options_.disk != nullptr && options_.disk->num_slots() > 0) {
    kvrelay::v1::Segment s;
    s.set_segment_id(kDiskSegmentId);
    s.set_tier(kvrelay::v1::TIER_SSD);
    s.set_capacity_slots(options_.disk->num_slots());
    s.set_slot_bytes(options_.disk->slot_bytes());
    reg.segments.push_back(std::move(s));  // no memory key: read back by this node only
  }
  absl::StatusOr<kvrelay::v1::RegisterNodeResponse> r = client_->Register(reg);
  if (r.ok()) store_incarnation_.store(r->store_incarnation(), std::memory_order_relaxed);
  return r.status();
}

void StoreLink::QueueDiskBlocks(bool listen) {
  if (options_.disk == nullptr || options_.disk->num_slots() == 0) return;
  const uint64_t size = options_.disk->slot_bytes();
  auto announced = [size](int64_t slot, const kv::BlockHash& hash) {
    kvrelay::v1::AnnouncedBlock a;
    cachestore::CacheStoreClient::ToProto(hash, a.mutable_hash());
    a.set_slot(slot);
    a.set_size_bytes(size);
    return a;
  };
  if (listen) {
    // Every listed block first, then each change, in order, into the queue the heartbeat
    // thread announces from.
    options_.disk->Listen([this, announced](int64_t slot, const kv::BlockHash& hash) {
      absl::MutexLock lock(&disk_mu_);
      disk_pending_.push_back(announced(slot, hash));
    });
    return;
  }
  const std::vector<std::pair<int64_t, kv::BlockHash>> listed = options_.disk->Listed();
  absl::MutexLock lock(&disk_mu_);
  for (const auto& [slot, hash] : listed) disk_pending_.push_back(announced(slot, hash));
}

void StoreLink::AnnounceDiskChanges() {
  std::vector<kvrelay::v1::AnnouncedBlock> pending;
  {
    absl::MutexLock lock(&disk_mu_);
    pending.swap(disk_pending_);
  }
  constexpr size_t kPerCall = 1024;
  for (size_t begin = 0; begin < pending.size(); begin += kPerCall) {
    std::vector<kvrelay::v1::AnnouncedBlock> chunk(
        pending.begin() + static_cast<std::ptrdiff_t>(begin),
        pending.begin() + static_cast<std::ptrdiff_t>(std::min(pending.size(), begin + kPerCall)));
    absl::StatusOr<kvrelay::v1::AnnounceBlocksResponse> r =
        client_->Announce(kDiskSegmentId, chunk);
    if (!r.ok()) {
      KV_LOG(WARNING) << options_.node_id << ": announcing " << chunk.size()
                      << " disk tier slots failed: " << r.status();
      return;
    }
  }
}

void StoreLink::Reannounce() {
  std::vector<kvrelay::v1::AnnouncedBlock> blocks;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [slot, block] : held_) blocks.push_back(block);
  }
  if (blocks.empty()) return;
  // Parents before children: a parent's hash is some earlier block's; order by chain depth.
  absl::flat_hash_map<std::pair<uint64_t, uint64_t>, const kvrelay::v1::AnnouncedBlock*> by_hash;
  for (const auto& b : blocks) by_hash[{b.hash().hi(), b.hash().lo()}] = &b;
  auto depth = [&](const kvrelay::v1::AnnouncedBlock& b) {
    int d = 0;
    const kvrelay::v1::AnnouncedBlock* cur = &b;
    while (d < 100000) {
      auto it = by_hash.find({cur->parent().hi(), cur->parent().lo()});
      if (it == by_hash.end()) break;
      cur = it->second;
      ++d;
    }
    return d;
  };
  std::vector<std::pair<int, kvrelay::v1::AnnouncedBlock>> ordered;
  for (const auto& b : blocks) ordered.emplace_back(depth(b), b);
  std::stable_sort(ordered.begin(), ordered.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  blocks.clear();
  for (auto& [d, b] : ordered) blocks.push_back(std::move(b));
  absl::StatusOr<kvrelay::v1::AnnounceBlocksResponse> r = client_->Announce(kSegmentId, blocks);
  if (!r.ok()) {
    KV_LOG(WARNING) << options_.node_id << ": re-announcing " << blocks.size()
                    << " blocks failed: " << r.status();
    return;
  }
  KV_LOG(INFO) << options_.node_id << ": re-announced " << blocks.size() << " blocks ("
               << r->accepted() << " new, " << r->already_present() << " known, "
               << r->rejected_size() << " refused)";
}

void StoreLink::HeartbeatLoop() {
  const absl::Duration interval = options_.ttl / 4;
  // A new store leader (HA) is noticed within this; it knows this node from the old leader's
  // log, but blocks committed just before the failover may not have reached it.
  const absl::Duration term_poll = std::min(interval, absl::Milliseconds(100));
  bool replaced_logged = false;
  int64_t term = client_->term();
  absl::Time next_heartbeat = absl::Now() + interval;
  while (!stop_.WaitForNotificationWithTimeout(term_poll)) {
    AnnounceDiskChanges();
    if (const int64_t now_term = client_->term(); now_term != term) {
      if (term != 0) {
        KV_LOG(INFO) << options_.node_id << ": a new cache store leader (term " << now_term
                     << ", was " << term << "); re-announcing what the segment holds";
        Reannounce();
        QueueDiskBlocks(/*listen=*/false);
      }
      term = now_term;
    }
    if (absl::Now() < next_heartbeat) continue;
    next_heartbeat = absl::Now() + interval;
    kvrelay::v1::NodeLoad load;
    if (options_.load) load = options_.load();
    if (options_.disk != nullptr) {
      load.set_disk_read_bytes_per_second(
          static_cast<int64_t>(std::min(options_.disk->read_bytes_per_second(), 1e12)));
    }
    absl::StatusOr<kvrelay::v1::HeartbeatResponse> r = client_->Heartbeat(&load);
    if (r.ok() && r->known() && r->store_incarnation() != 0) {
      // A store that restarted from its log knows this node and its DRAM blocks, not what the
      // disk tier holds (memory only there): announce that again.
      const uint64_t before =
          store_incarnation_.exchange(r->store_incarnation(), std::memory_order_relaxed);
      if (before != 0 && before != r->store_incarnation()) {
        KV_LOG(INFO) << options_.node_id << ": the cache store restarted; re-announcing what the "
                     << "disk tier holds";
        QueueDiskBlocks(/*listen=*/false);
      }
    }
    if (r.ok() && !r->known()) {
      KV_LOG(WARNING) << options_.node_id << ": the cache store forgot this node; registering "
                      << "and re-announcing what the segment holds";
      if (absl::Status s = Register(); s.ok()) {
        Reannounce();
        QueueDiskBlocks(/*listen=*/false);
      } else {
        KV_LOG(WARNING) << options_.node_id << ": register failed: " << s;
      }
    } else if (!r.ok() && absl::IsFailedPrecondition(r.status()) && !replaced_logged) {
      // Another process registered this id after we were forgotten: we must not serve as it.
      KV_LOG(ERROR) << options_.node_id
                    << ": the store holds another incarnation of this id: " << r.status();
      replaced_logged = true;
    }
  }
}

int64_t StoreLink::held_blocks() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(held_.size());
}

absl::StatusOr<StoreLink::RequestCall> StoreLink::OpenRequestCall(absl::Time deadline,
                                                                  absl::Time limit) {
  if (absl::Now() >= deadline) {
    return absl::DeadlineExceededError(
        "the request's deadline passed before its cache store call could go out");
  }
  const absl::Time bound = std::min(limit, absl::Now() + options_.request_timeout);
  if (bound <= absl::Now()) {
    return absl::DeadlineExceededError(
        "this commit's time for the cache store was spent before its last call could go out");
  }
  const absl::Duration probe = options_.probe_timeout > absl::ZeroDuration()
                                   ? options_.probe_timeout
                                   : options_.request_timeout / 5;
  KV_ASSIGN_OR_RETURN(DependencyGate::BoundCall gated, gate_.AdmitCall(deadline, bound, probe));
  const cachestore::CallOptions call{.deadline = gated.deadline};
  return RequestCall{.call = call, .gated = std::move(gated)};
}

absl::StatusOr<PrefixMatch> StoreLink::MatchPrefix(const std::vector<kv::BlockHash>& chain,
                                                   absl::Duration lease_ttl, absl::Time deadline) {
  if (chain.empty()) return PrefixMatch{};
  KV_ASSIGN_OR_RETURN(RequestCall call, OpenRequestCall(deadline));
  absl::StatusOr<kvrelay::v1::MatchPrefixResponse> answered =
      client_->MatchPrefix(chain, lease_ttl, call.call);
  call.Done(answered.status());
  KV_RETURN_IF_ERROR(answered.status());
  return ToPrefixMatch(*answered);
}

PrefixMatch StoreLink::ToPrefixMatch(const kvrelay::v1::MatchPrefixResponse& response) const {
  PrefixMatch match;
  match.matched = response.matched();
  match.lease_id = response.lease_id();
  // Readable remote segments: a kvrelay worker's access key, the store handed it out.
  std::vector<std::optional<RemoteReplica>> readable(response.segments_size());
  for (int k = 0; k < response.segments_size(); ++k) {
    const kvrelay::v1::SegmentRef& ref = response.segments(k);
    kvrelay::v1::SegmentAccess access;
    if (ref.node_id() == options_.node_id || ref.segment_id() != kSegmentId ||
        ref.address().address().empty() || ref.memory_key().empty() ||
        !access.ParseFromString(ref.memory_key()) || access.region_id() == 0 ||
        access.slot_stride() == 0) {
      continue;
    }
    RemoteReplica r;
    r.node_id = ref.node_id();
    r.transport_address = ref.address().address();
    r.transport_incarnation = access.transport_incarnation();
    r.data_plane_key = access.data_plane_key();
    r.region_id = access.region_id();
    r.table_region_id = access.table_region_id();
    r.slot_stride = access.slot_stride();
    readable[k] = std::move(r);
  }
  int replica = 0;
  for (int i = 0; i < response.matched() && i < response.replica_counts_size(); ++i) {
    int64_t slot = -1;
    std::vector<RemoteReplica> remote;
    for (uint32_t k = 0; k < response.replica_counts(i) && replica < response.replica_slot_size();
         ++k, ++replica) {
      const uint32_t seg = response.replica_segment(replica);
      if (seg >= static_cast<uint32_t>(response.segments_size())) continue;
      const kvrelay::v1::SegmentRef& ref = response.segments(static_cast<int>(seg));
      // Only this process's own replicas: an earlier incarnation's slots hold other bytes.
      if (ref.node_id() == options_.node_id && ref.segment_id() == kSegmentId &&
          (ref.incarnation() == 0 || ref.incarnation() == options_.incarnation)) {
        if (slot < 0) slot = response.replica_slot(replica);
      } else if (readable[seg].has_value()) {
        remote.push_back(*readable[seg]);
        remote.back().slot = response.replica_slot(replica);
      }
    }
    match.local_slots.push_back(slot);
    match.remote.push_back(std::move(remote));
  }
  return match;
}

void StoreLink::ReleaseLease(uint64_t lease_id, absl::Time deadline) {
  if (lease_id == 0) return;
  // On a request's path too; a lease not released expires at the store on its own.
  absl::StatusOr<RequestCall> call = OpenRequestCall(deadline);
  if (!call.ok()) return;
  absl::Status s = client_->ReleaseLease(lease_id, call->call);
  call->Done(s);
  if (!s.ok()) KV_LOG(WARNING) << "ReleaseLease: " << s;
}

absl::StatusOr<int32_t> StoreLink::CommitBlocks(const std::vector<kv::BlockHash>& chain,
                                                int64_t first, int64_t last,
                                                const model::Sequence& seq, absl::Time deadline,
                                                bool keep_copies) {
  if (segment_ == nullptr) return 0;
  return CommitBlocksFrom(
      chain, first, last,
      [this, &seq](int64_t block_index, int64_t slot) {
        return segment_->StoreBlock(seq, block_index, slot);
      },
      deadline, keep_copies, seq.tokens());
}

kvrelay::v1::AllocateRequest StoreLink::AllocationFor(const std::vector<kv::BlockHash>& chain,
                                                      int64_t first, int64_t last,
                                                      bool keep_copies) const {
  kvrelay::v1::AllocateRequest request;
  for (int64_t i = first; i < last; ++i) {
    auto* block = request.add_blocks();
    cachestore::CacheStoreClient::ToProto(chain[i], block->mutable_hash());
    cachestore::CacheStoreClient::ToProto(i == 0 ? kv::BlockHash{} : chain[i - 1],
                                          block->mutable_parent());
    block->set_size_bytes(segment_->block_bytes());
  }
  request.set_preferred_tier(kvrelay::v1::TIER_HOST);
  request.set_replicas(1);
  request.set_add_local_replicas(keep_copies);
  return request;
}

std::vector<int64_t> StoreLink::WriteAllocated(const kvrelay::v1::AllocateResponse& allocation,
                                               const std::vector<kv::BlockHash>& chain,
                                               int64_t first, const BlockWriter& write,
                                               std::vector<kvrelay::v1::AnnouncedBlock>& written) {
  std::vector<int64_t> stored;
  for (int i = 0; i < allocation.blocks_size(); ++i) {
    const auto& block = allocation.blocks(i);
    if (block.already_committed()) continue;
    bool all_here = block.replicas_size() > 0;
    for (const auto& replica : block.replicas()) {
      if (replica.node_id() != options_.node_id || replica.segment_id() != kSegmentId) {
        all_here = false;
      }
    }
    if (!all_here) continue;
    bool ok = true;
    for (const auto& replica : block.replicas()) {
      // The slot's old content is gone from the moment we write (readers on other nodes
      // check its entry, cleared first).
      absl::MutexLock lock(&mu_);
      DemoteSlotLocked(replica.slot());
      ForgetSlotLocked(replica.slot());
      if (!write(first + i, replica.slot()).ok()) {
        ok = false;
        continue;
      }
      segment_->PublishEntry(replica.slot(), chain[first + i]);
      kvrelay::v1::AnnouncedBlock a;
      *a.mutable_hash() = block.hash();
      cachestore::CacheStoreClient::ToProto(first + i == 0 ? kv::BlockHash{} : chain[first + i - 1],
                                            a.mutable_parent());
      a.set_slot(replica.slot());
      a.set_size_bytes(segment_->block_bytes());
      written.push_back(std::move(a));
    }
    if (ok) stored.push_back(first + i);
  }
  return stored;
}

absl::StatusOr<int32_t> StoreLink::CommitBlocksFrom(const std::vector<kv::BlockHash>& chain,
                                                    int64_t first, int64_t last,
                                                    const BlockWriter& write, absl::Time deadline,
                                                    bool keep_copies,
                                                    absl::Span<const int32_t> tokens) {
  if (segment_ == nullptr || first >= last) return 0;
  // The whole commit (allocate, write, commit) gets one per-call limit, not one per call: it
  // runs before the prefill answers, so a slow store adds at most that much.
  const absl::Time limit = absl::Now() + options_.request_timeout;
  const kvrelay::v1::AllocateRequest request = AllocationFor(chain, first, last, keep_copies);
  KV_ASSIGN_OR_RETURN(RequestCall call, OpenRequestCall(deadline, limit));
  absl::StatusOr<kvrelay::v1::AllocateResponse> allocated = client_->Allocate(request, call.call);
  call.Done(allocated.status());
  KV_ASSIGN_OR_RETURN(kvrelay::v1::AllocateResponse allocation, std::move(allocated));
  std::vector<kvrelay::v1::AnnouncedBlock> written;
  const absl::Time write_start = absl::Now();
  const std::vector<int64_t> stored_blocks =
      WriteAllocated(allocation, chain, first, write, written);
  std::vector<kv::BlockHash> stored;
  // The committed blocks' tokens, for the store's KV events (routers key blocks by them).
  const size_t block_tokens = static_cast<size_t>(std::max(options_.block_tokens, 0));
  const bool send_tokens =
      block_tokens > 0 && tokens.size() >= static_cast<size_t>(last) * block_tokens;
  std::vector<int32_t> stored_tokens;
  for (int64_t b : stored_blocks) {
    stored.push_back(chain[b]);
    if (send_tokens) {
      absl::Span<const int32_t> t =
          tokens.subspan(static_cast<size_t>(b) * block_tokens, block_tokens);
      stored_tokens.insert(stored_tokens.end(), t.begin(), t.end());
    }
  }
  // The limit counts time waiting on the store, not copying here.
  const absl::Time finish_limit = limit + (absl::Now() - write_start);
  // Writing took time: the abort or commit gets what is left then, through the gate again (an
  // allocation neither committed nor aborted is aborted by the store after its own timeout).
  KV_ASSIGN_OR_RETURN(RequestCall finish, OpenRequestCall(deadline, finish_limit));
  if (stored.empty()) {
    finish.Done(client_->Abort(allocation.allocation_id(), finish.call));
    return 0;
  }
  // A commit that times out is not retried: the store aborts the allocation after its own
  // timeout and the slots go back to it; the bytes written there are never matched.
  absl::StatusOr<int> commit =
      client_->Commit(allocation.allocation_id(), stored, finish.call, stored_tokens);
  finish.Done(commit.status());
  KV_ASSIGN_OR_RETURN(int committed, std::move(commit));
  absl::MutexLock lock(&mu_);
  for (auto& a : written) {
    const int64_t slot = a.slot();
    slot_of_[{a.hash().hi(), a.hash().lo()}] = slot;
    held_[slot] = std::move(a);
  }
  return committed;
}

void StoreLink::ForgetSlotLocked(int64_t slot) {
  auto it = held_.find(slot);
  if (it != held_.end()) {
    auto by_hash = slot_of_.find({it->second.hash().hi(), it->second.hash().lo()});
    if (by_hash != slot_of_.end() && by_hash->second == slot) slot_of_.erase(by_hash);
    held_.erase(it);
  }
  if (segment_ != nullptr && slot >= 0 && slot < segment_->num_slots()) segment_->ClearEntry(slot);
}

void StoreLink::DemoteSlotLocked(int64_t slot) {
  if (options_.disk == nullptr || segment_ == nullptr) return;
  auto it = held_.find(slot);
  if (it == held_.end()) return;
  const kv::BlockHash hash{it->second.hash().hi(), it->second.hash().lo()};
  const CacheSegment::SlotEntry entry = segment_->Entry(slot);
  const uint8_t* bytes = segment_->GroupUnit(slot, 0);
  const size_t size = static_cast<size_t>(segment_->block_bytes());
  // Only bytes that are the block they claim to be go to disk (the tier writes its own checksum
  // of what it is given).
  if (entry.hash_hi != hash.hi || entry.hash_lo != hash.lo ||
      entry.checksum != kv::BlockChecksum(bytes, size)) {
    return;
  }
  options_.disk->Demote(hash, absl::MakeConstSpan(bytes, size));
}

int64_t StoreLink::LoadHeldPrefix(const std::vector<kv::BlockHash>& chain, model::KvCache& cache,
                                  std::vector<std::vector<kv::SlotId>>& group_slots) const {
  if (segment_ == nullptr) return 0;
  absl::MutexLock lock(&mu_);
  int64_t loaded = 0;
  for (const kv::BlockHash& hash : chain) {
    auto it = slot_of_.find({hash.hi, hash.lo});
    if (it == slot_of_.end()) break;
    const CacheSegment::SlotEntry entry = segment_->Entry(it->second);
    if (entry.hash_hi != hash.hi || entry.hash_lo != hash.lo ||
        entry.checksum != kv::BlockChecksum(segment_->GroupUnit(it->second, 0),
                                            static_cast<size_t>(segment_->block_bytes()))) {
      KV_LOG(WARNING) << options_.node_id << ": cache slot " << it->second
                      << " does not hold the block it should; not used";
      break;
    }
    std::vector<std::vector<kv::SlotId>> one;
    if (!segment_->LoadBlock(it->second, cache, one).ok()) {
      for (size_t g = 0; g < one.size(); ++g) {
        for (kv::SlotId s : one[g]) (void)cache.pool(static_cast<int>(g)).Release(s);
      }
      break;
    }
    group_slots.resize(one.size());
    for (size_t g = 0; g < one.size(); ++g) {
      group_slots[g].insert(group_slots[g].end(), one[g].begin(), one[g].end());
    }
    ++loaded;
  }
  return loaded;
}

}  // namespace kvrelay::worker

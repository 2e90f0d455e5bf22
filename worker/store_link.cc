#include "worker/store_link.h"

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"

namespace kvrelay::worker {
namespace {

constexpr char kSegmentId[] = "kv";

}  // namespace

StoreLink::StoreLink(StoreLinkOptions options, const CacheSegment* segment, Clock* clock,
                     std::unique_ptr<cachestore::CacheStoreClient> client)
    : options_(std::move(options)), segment_(segment), clock_(clock), client_(std::move(client)) {}

absl::StatusOr<std::unique_ptr<StoreLink>> StoreLink::Connect(StoreLinkOptions options,
                                                              const CacheSegment* segment,
                                                              Clock* clock, absl::Time deadline) {
  KV_ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel,
                      server::MakeChannel(options.cachestore_address, options.security));
  auto client = cachestore::CacheStoreClient::FromChannel(
      std::move(channel), cachestore::CacheStoreClient::Options{.timeout = options.rpc_timeout});
  auto link = std::unique_ptr<StoreLink>(
      new StoreLink(std::move(options), segment, clock, std::move(client)));
  absl::Status status;
  while (true) {
    status = link->Register();
    // A refused registration (another live process holds this node id) is final.
    if (status.ok() || absl::IsAlreadyExists(status) || absl::IsInvalidArgument(status) ||
        absl::Now() > deadline) {
      break;
    }
    absl::SleepFor(absl::Milliseconds(200));
  }
  if (!status.ok()) {
    return absl::Status(status.code(),
                        absl::StrCat("cannot register node ", link->options_.node_id,
                                     " with the cache store at ",
                                     link->options_.cachestore_address, ": ", status.message()));
  }
  link->heartbeat_ = std::thread([l = link.get()] { l->HeartbeatLoop(); });
  return link;
}

StoreLink::~StoreLink() {
  stop_.Notify();
  if (heartbeat_.joinable()) heartbeat_.join();
}

absl::Status StoreLink::Register() {
  kvrelay::v1::RegisterNodeRequest request;
  request.set_node_id(options_.node_id);
  request.mutable_address()->set_kind(options_.transport_kind);
  request.mutable_address()->set_address(options_.transport_address);
  request.set_ttl_ms(absl::ToInt64Milliseconds(options_.ttl));
  if (segment_ != nullptr) {
    kvrelay::v1::Segment* s = request.add_segments();
    s->set_segment_id(kSegmentId);
    s->set_tier(kvrelay::v1::TIER_HOST);
    s->set_capacity_slots(segment_->num_slots());
    // The store computes offsets as slot x slot_bytes, so it gets the stride.
    s->set_slot_bytes(segment_->slot_stride());
    s->set_memory_key(absl::StrCat(segment_->region().id()));
  }
  return client_->RegisterNode(request).status();
}

void StoreLink::HeartbeatLoop() {
  const absl::Duration interval = options_.ttl / 4;
  while (!stop_.WaitForNotificationWithTimeout(interval)) {
    absl::StatusOr<bool> known = client_->Heartbeat(options_.node_id);
    if (known.ok() && !*known) {
      KV_LOG(WARNING) << options_.node_id << ": the cache store forgot this node; registering";
      if (absl::Status s = Register(); !s.ok()) {
        KV_LOG(WARNING) << options_.node_id << ": register failed: " << s;
      }
    }
  }
}

absl::StatusOr<PrefixMatch> StoreLink::MatchPrefix(const std::vector<kv::BlockHash>& chain,
                                                   absl::Duration lease_ttl) {
  PrefixMatch match;
  if (chain.empty()) return match;
  KV_ASSIGN_OR_RETURN(kvrelay::v1::MatchPrefixResponse response,
                      client_->MatchPrefix(chain, lease_ttl));
  match.matched = response.matched();
  match.lease_id = response.lease_id();
  const auto locations = cachestore::CacheStoreClient::Locations(response);
  for (int i = 0; i < response.matched() && i < static_cast<int>(locations.size()); ++i) {
    int64_t slot = -1;
    for (const auto& replica : locations[i]) {
      if (replica.node_id() == options_.node_id && replica.segment_id() == kSegmentId) {
        slot = replica.slot();
        break;
      }
    }
    match.local_slots.push_back(slot);
  }
  return match;
}

void StoreLink::ReleaseLease(uint64_t lease_id) {
  if (lease_id == 0) return;
  if (absl::Status s = client_->ReleaseLease(lease_id); !s.ok()) {
    KV_LOG(WARNING) << "ReleaseLease: " << s;
  }
}

absl::StatusOr<int32_t> StoreLink::CommitBlocks(const std::vector<kv::BlockHash>& chain,
                                                int64_t first, int64_t last,
                                                const model::Sequence& seq) {
  if (segment_ == nullptr || first >= last) return 0;
  kvrelay::v1::AllocateRequest request;
  for (int64_t i = first; i < last; ++i) {
    auto* block = request.add_blocks();
    cachestore::CacheStoreClient::ToProto(chain[i], block->mutable_hash());
    cachestore::CacheStoreClient::ToProto(i == 0 ? kv::BlockHash{} : chain[i - 1],
                                          block->mutable_parent());
    block->set_size_bytes(segment_->block_bytes());
  }
  request.set_preferred_node(options_.node_id);
  request.set_preferred_tier(kvrelay::v1::TIER_HOST);
  request.set_replicas(1);
  KV_ASSIGN_OR_RETURN(kvrelay::v1::AllocateResponse allocation, client_->Allocate(request));
  std::vector<kv::BlockHash> stored;
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
      if (!segment_->StoreBlock(seq, first + i, replica.slot()).ok()) ok = false;
    }
    if (ok) stored.push_back(cachestore::CacheStoreClient::FromProto(block.hash()));
  }
  if (stored.empty()) {
    (void)client_->Abort(allocation.allocation_id());
    return 0;
  }
  KV_ASSIGN_OR_RETURN(int committed, client_->Commit(allocation.allocation_id(), stored));
  return committed;
}

}  // namespace kvrelay::worker

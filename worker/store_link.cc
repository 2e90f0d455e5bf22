#include "worker/store_link.h"

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "grpcpp/grpcpp.h"
#include "proto/grpc_status.h"

namespace kvrelay::worker {
namespace {

void ToProto(const kv::BlockHash& h, kvrelay::v1::BlockHash* out) {
  out->set_hi(h.hi);
  out->set_lo(h.lo);
}

constexpr char kSegmentId[] = "kv";

}  // namespace

StoreLink::StoreLink(StoreLinkOptions options, const CacheSegment* segment)
    : options_(std::move(options)), segment_(segment) {
  stub_ = kvrelay::v1::CacheStore::NewStub(
      grpc::CreateChannel(options_.cachestore_address, grpc::InsecureChannelCredentials()));
}

absl::StatusOr<std::unique_ptr<StoreLink>> StoreLink::Connect(StoreLinkOptions options,
                                                              const CacheSegment* segment,
                                                              absl::Time deadline) {
  auto link = std::unique_ptr<StoreLink>(new StoreLink(std::move(options), segment));
  absl::Status status;
  while (true) {
    status = link->Register();
    if (status.ok() || absl::Now() > deadline) break;
    absl::SleepFor(absl::Milliseconds(200));
  }
  if (!status.ok()) {
    return absl::UnavailableError(absl::StrCat("cannot register with the cache store at ",
                                               link->options_.cachestore_address, ": ",
                                               status.message()));
  }
  link->heartbeat_ = std::thread([l = link.get()] { l->HeartbeatLoop(); });
  return link;
}

StoreLink::~StoreLink() {
  stop_.Notify();
  if (heartbeat_.joinable()) heartbeat_.join();
}

std::unique_ptr<grpc::ClientContext> StoreLink::Context() const {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(std::chrono::system_clock::now() +
                        std::chrono::milliseconds(absl::ToInt64Milliseconds(options_.rpc_timeout)));
  return context;
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
  kvrelay::v1::RegisterNodeResponse response;
  auto context = Context();
  context->set_wait_for_ready(true);
  return proto::FromGrpcStatus(stub_->RegisterNode(context.get(), request, &response));
}

void StoreLink::HeartbeatLoop() {
  const absl::Duration interval = options_.ttl / 3;
  while (!stop_.WaitForNotificationWithTimeout(interval)) {
    kvrelay::v1::HeartbeatRequest request;
    request.set_node_id(options_.node_id);
    kvrelay::v1::HeartbeatResponse response;
    auto context = Context();
    grpc::Status status = stub_->Heartbeat(context.get(), request, &response);
    if (status.ok() && !response.known()) {
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
  kvrelay::v1::MatchPrefixRequest request;
  for (const kv::BlockHash& h : chain) ToProto(h, request.add_chain());
  request.set_lease_ttl_ms(absl::ToInt64Milliseconds(lease_ttl));
  kvrelay::v1::MatchPrefixResponse response;
  auto context = Context();
  if (absl::Status s = proto::FromGrpcStatus(stub_->MatchPrefix(context.get(), request, &response));
      !s.ok()) {
    return s;
  }
  match.matched = response.matched();
  match.lease_id = response.lease_id();
  for (int i = 0; i < response.matched() && i < response.blocks_size(); ++i) {
    int64_t slot = -1;
    for (const auto& replica : response.blocks(i).replicas()) {
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
  kvrelay::v1::ReleaseLeaseRequest request;
  request.set_lease_id(lease_id);
  kvrelay::v1::ReleaseLeaseResponse response;
  auto context = Context();
  grpc::Status status = stub_->ReleaseLease(context.get(), request, &response);
  if (!status.ok()) KV_LOG(WARNING) << "ReleaseLease: " << status.error_message();
}

absl::StatusOr<int32_t> StoreLink::CommitBlocks(const std::vector<kv::BlockHash>& chain,
                                                int64_t first, int64_t last,
                                                const model::Sequence& seq) {
  if (segment_ == nullptr || first >= last) return 0;
  kvrelay::v1::AllocateRequest request;
  for (int64_t i = first; i < last; ++i) {
    auto* block = request.add_blocks();
    ToProto(chain[i], block->mutable_hash());
    ToProto(i == 0 ? kv::BlockHash{} : chain[i - 1], block->mutable_parent());
    block->set_size_bytes(segment_->block_bytes());
  }
  request.set_preferred_node(options_.node_id);
  request.set_preferred_tier(kvrelay::v1::TIER_HOST);
  request.set_replicas(1);
  kvrelay::v1::AllocateResponse allocation;
  {
    auto context = Context();
    if (absl::Status s =
            proto::FromGrpcStatus(stub_->Allocate(context.get(), request, &allocation));
        !s.ok()) {
      return s;
    }
  }
  kvrelay::v1::CommitRequest commit;
  commit.set_allocation_id(allocation.allocation_id());
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
    bool stored = true;
    for (const auto& replica : block.replicas()) {
      if (!segment_->StoreBlock(seq, first + i, replica.slot()).ok()) stored = false;
    }
    if (stored) *commit.add_hashes() = block.hash();
  }
  if (commit.hashes_size() == 0) {
    kvrelay::v1::AbortRequest abort;
    abort.set_allocation_id(allocation.allocation_id());
    kvrelay::v1::AbortResponse ignored;
    auto context = Context();
    stub_->Abort(context.get(), abort, &ignored);
    return 0;
  }
  kvrelay::v1::CommitResponse committed;
  auto context = Context();
  if (absl::Status s = proto::FromGrpcStatus(stub_->Commit(context.get(), commit, &committed));
      !s.ok()) {
    return s;
  }
  return committed.committed();
}

}  // namespace kvrelay::worker

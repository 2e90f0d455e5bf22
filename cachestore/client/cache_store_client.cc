#include "cachestore/client/cache_store_client.h"

#include <chrono>

#include "grpcpp/grpcpp.h"
#include "common/server/credentials.h"
#include "proto/grpc_status.h"

namespace kvrelay::cachestore {

using ::kvrelay::proto::FromGrpcStatus;

absl::StatusOr<std::unique_ptr<CacheStoreClient>> CacheStoreClient::Connect(
    const std::string& target, Options options) {
  if (target.empty()) return absl::InvalidArgumentError("target: empty cache store address");
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = server::MakeChannel(
      target, options.security, server::ChannelOptions{.own_connection = options.own_connection});
  if (!channel.ok()) return channel.status();
  return std::unique_ptr<CacheStoreClient>(new CacheStoreClient(*std::move(channel), options));
}

std::unique_ptr<CacheStoreClient> CacheStoreClient::FromChannel(
    std::shared_ptr<grpc::Channel> channel, Options options) {
  return std::unique_ptr<CacheStoreClient>(new CacheStoreClient(std::move(channel), options));
}

CacheStoreClient::CacheStoreClient(std::shared_ptr<grpc::Channel> channel, Options options)
    : channel_(std::move(channel)),
      stub_(v1::CacheStore::NewStub(channel_)),
      options_(options) {}

void CacheStoreClient::SetDeadline(grpc::ClientContext* ctx) const {
  ctx->set_deadline(std::chrono::system_clock::now() +
                    absl::ToChronoMilliseconds(options_.timeout));
}

absl::Status CacheStoreClient::WaitForReady(absl::Duration timeout) {
  const auto deadline = std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout);
  if (channel_->WaitForConnected(deadline)) return absl::OkStatus();
  return absl::UnavailableError("cache store not reachable before the timeout");
}

absl::StatusOr<v1::RegisterNodeResponse> CacheStoreClient::RegisterNode(
    const v1::RegisterNodeRequest& req) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::RegisterNodeResponse resp;
  absl::Status s = FromGrpcStatus(stub_->RegisterNode(&ctx, req, &resp));
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<bool> CacheStoreClient::Heartbeat(const std::string& node_id) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::HeartbeatRequest req;
  req.set_node_id(node_id);
  v1::HeartbeatResponse resp;
  absl::Status s = FromGrpcStatus(stub_->Heartbeat(&ctx, req, &resp));
  if (!s.ok()) return s;
  return resp.known();
}

absl::StatusOr<v1::MatchPrefixResponse> CacheStoreClient::MatchPrefix(
    absl::Span<const kv::BlockHash> chain, absl::Duration lease_ttl) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::MatchPrefixRequest req;
  std::string* packed = req.mutable_chain_packed();
  packed->resize(chain.size() * 16);
  for (size_t i = 0; i < chain.size(); ++i) {
    for (int b = 0; b < 8; ++b) {
      (*packed)[16 * i + b] = static_cast<char>(chain[i].hi >> (56 - 8 * b));
      (*packed)[16 * i + 8 + b] = static_cast<char>(chain[i].lo >> (56 - 8 * b));
    }
  }
  req.set_lease_ttl_ms(absl::ToInt64Milliseconds(lease_ttl));
  req.set_columnar(true);
  v1::MatchPrefixResponse resp;
  absl::Status s = FromGrpcStatus(stub_->MatchPrefix(&ctx, req, &resp));
  if (!s.ok()) return s;
  return resp;
}

std::vector<std::vector<v1::BlockLocation>> CacheStoreClient::Locations(
    const v1::MatchPrefixResponse& resp) {
  std::vector<std::vector<v1::BlockLocation>> out(resp.replica_counts_size());
  int k = 0;
  for (int i = 0; i < resp.replica_counts_size(); ++i) {
    for (uint32_t j = 0; j < resp.replica_counts(i); ++j, ++k) {
      if (k >= resp.replica_segment_size() || k >= resp.replica_slot_size()) return out;
      const uint32_t ref = resp.replica_segment(k);
      if (ref >= static_cast<uint32_t>(resp.segments_size())) continue;
      const v1::SegmentRef& seg = resp.segments(static_cast<int>(ref));
      v1::BlockLocation loc;
      loc.set_node_id(seg.node_id());
      loc.set_segment_id(seg.segment_id());
      loc.set_tier(seg.tier());
      loc.set_slot(resp.replica_slot(k));
      loc.set_offset_bytes(static_cast<uint64_t>(resp.replica_slot(k)) * seg.slot_bytes());
      loc.set_length_bytes(seg.slot_bytes());
      out[i].push_back(std::move(loc));
    }
  }
  return out;
}

absl::StatusOr<v1::QueryPrefixResponse> CacheStoreClient::QueryPrefix(
    absl::Span<const kv::BlockHash> chain) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::QueryPrefixRequest req;
  for (const kv::BlockHash& h : chain) ToProto(h, req.add_chain());
  v1::QueryPrefixResponse resp;
  absl::Status s = FromGrpcStatus(stub_->QueryPrefix(&ctx, req, &resp));
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<v1::AllocateResponse> CacheStoreClient::Allocate(const v1::AllocateRequest& req) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::AllocateResponse resp;
  absl::Status s = FromGrpcStatus(stub_->Allocate(&ctx, req, &resp));
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<v1::AllocateResponse> CacheStoreClient::AllocateChain(
    absl::Span<const kv::BlockHash> chain, uint64_t size_bytes, kv::BlockHash first_parent,
    const std::string& preferred_node) {
  v1::AllocateRequest req;
  kv::BlockHash parent = first_parent;
  for (const kv::BlockHash& h : chain) {
    v1::BlockToAllocate* b = req.add_blocks();
    ToProto(h, b->mutable_hash());
    ToProto(parent, b->mutable_parent());
    b->set_size_bytes(size_bytes);
    parent = h;
  }
  req.set_preferred_node(preferred_node);
  return Allocate(req);
}

absl::StatusOr<int> CacheStoreClient::Commit(uint64_t allocation_id,
                                             absl::Span<const kv::BlockHash> hashes) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::CommitRequest req;
  req.set_allocation_id(allocation_id);
  for (const kv::BlockHash& h : hashes) ToProto(h, req.add_hashes());
  v1::CommitResponse resp;
  absl::Status s = FromGrpcStatus(stub_->Commit(&ctx, req, &resp));
  if (!s.ok()) return s;
  return resp.committed();
}

absl::Status CacheStoreClient::Abort(uint64_t allocation_id) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::AbortRequest req;
  req.set_allocation_id(allocation_id);
  v1::AbortResponse resp;
  return FromGrpcStatus(stub_->Abort(&ctx, req, &resp));
}

absl::Status CacheStoreClient::ReleaseLease(uint64_t lease_id) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::ReleaseLeaseRequest req;
  req.set_lease_id(lease_id);
  v1::ReleaseLeaseResponse resp;
  return FromGrpcStatus(stub_->ReleaseLease(&ctx, req, &resp));
}

absl::StatusOr<v1::StatsResponse> CacheStoreClient::Stats() {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::StatsResponse resp;
  absl::Status s = FromGrpcStatus(stub_->Stats(&ctx, v1::StatsRequest(), &resp));
  if (!s.ok()) return s;
  return resp;
}

absl::Status CacheStoreClient::WatchEvents(uint64_t from_sequence, absl::Duration timeout,
                                           const std::function<bool(const v1::Event&)>& on_event) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout));
  v1::WatchEventsRequest req;
  req.set_from_sequence(from_sequence);
  std::unique_ptr<grpc::ClientReader<v1::Event>> reader = stub_->WatchEvents(&ctx, req);
  v1::Event event;
  while (reader->Read(&event)) {
    if (!on_event(event)) {
      ctx.TryCancel();
      break;
    }
  }
  grpc::Status s = reader->Finish();
  if (s.error_code() == grpc::StatusCode::CANCELLED ||
      s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    return absl::OkStatus();
  }
  return FromGrpcStatus(s);
}

}  // namespace kvrelay::cachestore

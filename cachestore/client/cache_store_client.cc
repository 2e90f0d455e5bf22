#include "cachestore/client/cache_store_client.h"

#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>

#include "absl/strings/str_format.h"
#include "common/server/credentials.h"
#include "grpcpp/grpcpp.h"
#include "proto/grpc_status.h"

namespace kvrelay::cachestore {

using ::kvrelay::proto::FromGrpcStatus;

namespace {
constexpr int kAnnounceBatch = 4096;

uint64_t KernelRandom64() {
  uint64_t v = 0;
  while (v == 0) {
    const ssize_t n = getrandom(&v, sizeof(v), 0);
    if (n != static_cast<ssize_t>(sizeof(v))) v = 0;  // EINTR: retry
  }
  return v;
}
}  // namespace

absl::StatusOr<std::unique_ptr<CacheStoreClient>> CacheStoreClient::Connect(
    const std::string& target, Options options) {
  if (target.empty()) return absl::InvalidArgumentError("target: empty cache store address");
  server::ChannelOptions channel_options;
  channel_options.keepalive_time = options.keepalive;
  channel_options.own_connection = options.own_connection;
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
      server::MakeChannel(target, options.security, channel_options);
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
      options_(options),
      node_(options.node) {}

uint64_t CacheStoreClient::NewIncarnation() { return KernelRandom64(); }

std::string CacheStoreClient::DefaultNodeId(std::string_view role) {
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0 || host[0] == '\0') {
    std::snprintf(host, sizeof(host), "host");
  }
  // Node ids are [A-Za-z0-9._:-]; hostnames are too, but be strict.
  std::string clean;
  for (const char* p = host; *p != '\0' && clean.size() < 64; ++p) {
    const char c = *p;
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    clean.push_back(ok ? c : '-');
  }
  return absl::StrFormat("%s-%s-%08x", std::string(role.substr(0, 32)), clean,
                         static_cast<uint32_t>(KernelRandom64()));
}

NodeIdentity CacheStoreClient::node() const {
  absl::MutexLock lock(&mu_);
  return node_;
}

void CacheStoreClient::SetNode(NodeIdentity node) {
  absl::MutexLock lock(&mu_);
  node_ = std::move(node);
}

void CacheStoreClient::SetDeadline(grpc::ClientContext* ctx, const CallOptions& call) const {
  const absl::Time deadline = std::min(absl::Now() + options_.timeout, call.deadline);
  ctx->set_deadline(absl::ToChronoTime(deadline));
}

absl::Status CacheStoreClient::WaitForReady(absl::Duration timeout) {
  const auto deadline = std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout);
  if (channel_->WaitForConnected(deadline)) return absl::OkStatus();
  return absl::UnavailableError("cache store not reachable before the timeout");
}

absl::StatusOr<v1::RegisterNodeResponse> CacheStoreClient::Register(const Registration& reg,
                                                                    const CallOptions& call) {
  const NodeIdentity me = node();
  if (me.empty()) return absl::FailedPreconditionError("Register: Options::node is not set");
  v1::RegisterNodeRequest req;
  req.set_node_id(me.node_id);
  req.set_incarnation(me.incarnation);
  req.set_role(reg.role);
  req.set_grpc_address(reg.grpc_address);
  req.mutable_address()->set_kind(reg.transport_kind);
  req.mutable_address()->set_address(reg.transport_address);
  for (const v1::Segment& s : reg.segments) *req.add_segments() = s;
  req.set_ttl_ms(absl::ToInt64Milliseconds(reg.ttl));
  return RegisterNode(req, call);
}

absl::StatusOr<v1::RegisterNodeResponse> CacheStoreClient::RegisterNode(
    const v1::RegisterNodeRequest& req_in, const CallOptions& call) {
  v1::RegisterNodeRequest req = req_in;
  const NodeIdentity me = node();
  if (req.node_id().empty()) req.set_node_id(me.node_id);
  if (req.incarnation() == 0 && req.node_id() == me.node_id) req.set_incarnation(me.incarnation);
  grpc::ClientContext ctx;
  SetDeadline(&ctx, call);
  v1::RegisterNodeResponse resp;
  absl::Status s = FromGrpcStatus(stub_->RegisterNode(&ctx, req, &resp));
  if (!s.ok()) return s;
  return resp;
}

absl::Status CacheStoreClient::Deregister(const CallOptions& call) {
  const NodeIdentity me = node();
  grpc::ClientContext ctx;
  SetDeadline(&ctx, call);
  v1::DeregisterNodeRequest req;
  req.set_node_id(me.node_id);
  req.set_incarnation(me.incarnation);
  v1::DeregisterNodeResponse resp;
  return FromGrpcStatus(stub_->DeregisterNode(&ctx, req, &resp));
}

absl::StatusOr<v1::HeartbeatResponse> CacheStoreClient::Heartbeat(const v1::NodeLoad* load,
                                                                  const CallOptions& call) {
  const NodeIdentity me = node();
  grpc::ClientContext ctx;
  SetDeadline(&ctx, call);
  v1::HeartbeatRequest req;
  req.set_node_id(me.node_id);
  req.set_incarnation(me.incarnation);
  if (load != nullptr) *req.mutable_load() = *load;
  v1::HeartbeatResponse resp;
  absl::Status s = FromGrpcStatus(stub_->Heartbeat(&ctx, req, &resp));
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<bool> CacheStoreClient::Heartbeat(const std::string& node_id,
                                                 const CallOptions& call) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx, call);
  v1::HeartbeatRequest req;
  req.set_node_id(node_id);
  v1::HeartbeatResponse resp;
  absl::Status s = FromGrpcStatus(stub_->Heartbeat(&ctx, req, &resp));
  if (!s.ok()) return s;
  return resp.known();
}

absl::StatusOr<v1::AnnounceBlocksResponse> CacheStoreClient::Announce(
    const std::string& segment_id, absl::Span<const v1::AnnouncedBlock> blocks,
    const CallOptions& call) {
  const NodeIdentity me = node();
  v1::AnnounceBlocksResponse total;
  for (size_t start = 0; start < blocks.size(); start += kAnnounceBatch) {
    const size_t n = std::min<size_t>(kAnnounceBatch, blocks.size() - start);
    v1::AnnounceBlocksRequest req;
    req.set_node_id(me.node_id);
    req.set_incarnation(me.incarnation);
    req.set_segment_id(segment_id);
    for (size_t i = 0; i < n; ++i) *req.add_blocks() = blocks[start + i];
    grpc::ClientContext ctx;
    SetDeadline(&ctx, call);
    v1::AnnounceBlocksResponse resp;
    absl::Status s = FromGrpcStatus(stub_->AnnounceBlocks(&ctx, req, &resp));
    if (!s.ok()) return s;
    total.set_accepted(total.accepted() + resp.accepted());
    total.set_already_present(total.already_present() + resp.already_present());
    for (const v1::AnnounceRejection& r : resp.rejected()) {
      v1::AnnounceRejection* out = total.add_rejected();
      out->set_index(static_cast<uint32_t>(start) + r.index());
      out->set_reason(r.reason());
    }
  }
  return total;
}

absl::StatusOr<v1::MatchPrefixResponse> CacheStoreClient::MatchPrefix(
    absl::Span<const kv::BlockHash> chain, absl::Duration lease_ttl, const CallOptions& call) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx, call);
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
  const NodeIdentity me = node();
  if (!me.empty() && me.incarnation != 0) {
    req.set_node_id(me.node_id);
    req.set_incarnation(me.incarnation);
  }
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
      loc.set_incarnation(seg.incarnation());
      out[i].push_back(std::move(loc));
    }
  }
  return out;
}

absl::StatusOr<v1::QueryPrefixResponse> CacheStoreClient::QueryPrefix(
    absl::Span<const kv::BlockHash> chain, const CallOptions& call) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx, call);
  v1::QueryPrefixRequest req;
  for (const kv::BlockHash& h : chain) ToProto(h, req.add_chain());
  v1::QueryPrefixResponse resp;
  absl::Status s = FromGrpcStatus(stub_->QueryPrefix(&ctx, req, &resp));
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<v1::AllocateResponse> CacheStoreClient::Allocate(const v1::AllocateRequest& req_in,
                                                                const CallOptions& call) {
  v1::AllocateRequest req = req_in;
  const NodeIdentity me = node();
  if (req.node_id().empty() && !me.empty() && me.incarnation != 0) {
    req.set_node_id(me.node_id);
    req.set_incarnation(me.incarnation);
  }
  grpc::ClientContext ctx;
  SetDeadline(&ctx, call);
  v1::AllocateResponse resp;
  absl::Status s = FromGrpcStatus(stub_->Allocate(&ctx, req, &resp));
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<v1::AllocateResponse> CacheStoreClient::AllocateChain(
    absl::Span<const kv::BlockHash> chain, uint64_t size_bytes, kv::BlockHash first_parent,
    const std::string& preferred_node, const CallOptions& call) {
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
  return Allocate(req, call);
}

absl::StatusOr<int> CacheStoreClient::Commit(uint64_t allocation_id,
                                             absl::Span<const kv::BlockHash> hashes,
                                             const CallOptions& call) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx, call);
  v1::CommitRequest req;
  req.set_allocation_id(allocation_id);
  for (const kv::BlockHash& h : hashes) ToProto(h, req.add_hashes());
  const NodeIdentity me = node();
  if (!me.empty() && me.incarnation != 0) {
    req.set_node_id(me.node_id);
    req.set_incarnation(me.incarnation);
  }
  v1::CommitResponse resp;
  absl::Status s = FromGrpcStatus(stub_->Commit(&ctx, req, &resp));
  if (!s.ok()) return s;
  return resp.committed();
}

absl::Status CacheStoreClient::Abort(uint64_t allocation_id, const CallOptions& call) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx, call);
  v1::AbortRequest req;
  req.set_allocation_id(allocation_id);
  const NodeIdentity me = node();
  if (!me.empty() && me.incarnation != 0) {
    req.set_node_id(me.node_id);
    req.set_incarnation(me.incarnation);
  }
  v1::AbortResponse resp;
  return FromGrpcStatus(stub_->Abort(&ctx, req, &resp));
}

absl::Status CacheStoreClient::ReleaseLease(uint64_t lease_id, const CallOptions& call) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx, call);
  v1::ReleaseLeaseRequest req;
  req.set_lease_id(lease_id);
  const NodeIdentity me = node();
  if (!me.empty() && me.incarnation != 0) {
    req.set_node_id(me.node_id);
    req.set_incarnation(me.incarnation);
  }
  v1::ReleaseLeaseResponse resp;
  return FromGrpcStatus(stub_->ReleaseLease(&ctx, req, &resp));
}

absl::StatusOr<v1::ListNodesResponse> CacheStoreClient::ListNodes(const CallOptions& call) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx, call);
  v1::ListNodesResponse resp;
  absl::Status s = FromGrpcStatus(stub_->ListNodes(&ctx, v1::ListNodesRequest(), &resp));
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<v1::StatsResponse> CacheStoreClient::Stats(const CallOptions& call) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx, call);
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
  bool stopped = false;
  while (reader->Read(&event)) {
    if (!on_event(event)) {
      stopped = true;
      ctx.TryCancel();
      break;
    }
  }
  grpc::Status s = reader->Finish();
  // Our own cancel or the watch timeout end the stream normally; anything else is reported.
  if ((stopped && s.error_code() == grpc::StatusCode::CANCELLED) ||
      s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    return absl::OkStatus();
  }
  return FromGrpcStatus(s);
}

}  // namespace kvrelay::cachestore

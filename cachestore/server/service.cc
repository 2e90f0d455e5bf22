#include "cachestore/server/service.h"

#include <chrono>
#include <cstdio>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "proto/grpc_status.h"

namespace kvrelay::cachestore::server {

namespace {

using ::kvrelay::proto::ToGrpcStatus;

// Bad input is the caller's own failure (never counted against a node).
grpc::Status ClientError(absl::Status status) {
  v1::ErrorInfo info;
  info.set_role(v1::ROLE_CLIENT);
  info.set_reason(v1::FAILURE_INVALID_REQUEST);
  return ToGrpcStatus(proto::WithErrorInfo(std::move(status), info));
}
grpc::Status Invalid(const std::string& msg) {
  return ClientError(absl::InvalidArgumentError(msg));
}
grpc::Status Exhausted(const std::string& msg) {
  return ClientError(absl::ResourceExhaustedError(msg));
}

v1::Role ToRole(NodeRole role) {
  switch (role) {
    case NodeRole::kPrefill:
      return v1::ROLE_PREFILL;
    case NodeRole::kDecode:
      return v1::ROLE_DECODE;
    default:
      return v1::ROLE_UNSPECIFIED;
  }
}

kv::BlockHash FromProto(const v1::BlockHash& h) { return kv::BlockHash{h.hi(), h.lo()}; }
void ToProto(const kv::BlockHash& h, v1::BlockHash* out) {
  out->set_hi(h.hi);
  out->set_lo(h.lo);
}

// 1-max bytes of [A-Za-z0-9._:-].
grpc::Status CheckId(const std::string& id, const std::string& field, int max_bytes,
                     bool allow_empty = false) {
  if (id.empty()) {
    return allow_empty ? grpc::Status::OK : Invalid(absl::StrCat(field, ": must not be empty"));
  }
  if (static_cast<int>(id.size()) > max_bytes) {
    return Invalid(absl::StrCat(field, ": at most ", max_bytes, " bytes, got ", id.size()));
  }
  for (char c : id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == ':' || c == '-';
    if (!ok) return Invalid(absl::StrCat(field, ": only [A-Za-z0-9._:-] allowed"));
  }
  return grpc::Status::OK;
}

grpc::Status ParseChain(const google::protobuf::RepeatedPtrField<v1::BlockHash>& in,
                        const std::string& field, int max, std::vector<kv::BlockHash>* out) {
  if (in.empty()) return Invalid(absl::StrCat(field, ": at least one hash needed"));
  if (in.size() > max) {
    return Exhausted(absl::StrCat(field, ": at most ", max, " hashes, got ", in.size()));
  }
  out->reserve(in.size());
  for (int i = 0; i < in.size(); ++i) {
    kv::BlockHash h = FromProto(in[i]);
    if (h.IsZero()) return Invalid(absl::StrCat(field, "[", i, "]: must not be zero"));
    out->push_back(h);
  }
  return grpc::Status::OK;
}

uint64_t LoadBigEndian64(const char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

// chain (repeated BlockHash) or chain_packed (16-byte big-endian hashes), exactly one.
grpc::Status ParseEitherChain(const google::protobuf::RepeatedPtrField<v1::BlockHash>& chain,
                              const std::string& packed, int max, std::vector<kv::BlockHash>* out) {
  if (packed.empty()) return ParseChain(chain, "chain", max, out);
  if (!chain.empty()) return Invalid("chain, chain_packed: set one of them, not both");
  if (packed.size() % 16 != 0) {
    return Invalid(
        absl::StrCat("chain_packed: length must be a multiple of 16, got ", packed.size()));
  }
  const size_t n = packed.size() / 16;
  if (n > static_cast<size_t>(max)) {
    return Exhausted(absl::StrCat("chain_packed: at most ", max, " hashes, got ", n));
  }
  out->resize(n);
  for (size_t i = 0; i < n; ++i) {
    (*out)[i] = kv::BlockHash{LoadBigEndian64(packed.data() + 16 * i),
                              LoadBigEndian64(packed.data() + 16 * i + 8)};
    if ((*out)[i].IsZero()) return Invalid(absl::StrCat("chain_packed[", i, "]: must not be zero"));
  }
  return grpc::Status::OK;
}

grpc::Status CheckDeadline(grpc::ServerContextBase* ctx) {
  if (ctx->deadline() < std::chrono::system_clock::now()) {
    return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "deadline passed before handling");
  }
  return grpc::Status::OK;
}

absl::Time DeadlineOf(grpc::ServerContext* ctx, absl::Duration cap) {
  const absl::Time d = absl::FromChrono(ctx->deadline());
  return std::min(d, absl::Now() + cap);
}

void ToProto(const Location& loc, v1::BlockLocation* out) {
  out->set_node_id(loc.node_id);
  out->set_incarnation(loc.incarnation);
  out->set_segment_id(loc.segment_id);
  out->set_slot(loc.slot);
  out->set_tier(static_cast<v1::Tier>(loc.tier));
  out->set_offset_bytes(loc.offset_bytes);
  out->set_length_bytes(loc.slot_bytes);
}

class RpcTimer {
 public:
  RpcTimer(Histogram* h, Counter* errors) : h_(h), errors_(errors) {}
  ~RpcTimer() { h_->Observe(absl::ToDoubleSeconds(absl::Now() - start_)); }
  grpc::Status Done(grpc::Status s) {
    if (!s.ok()) errors_->Increment();
    return s;
  }

 private:
  Histogram* h_;
  Counter* errors_;
  absl::Time start_ = absl::Now();
};

// Finer than LatencyBucketsSeconds() at the low end: most store RPCs take tens of microseconds.
std::vector<double> RpcBucketsSeconds() {
  return {0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1.0, 10.0};
}

const TierUsage& UsageOf(const StoreStats& stats, Tier tier) {
  static const TierUsage kNone;
  for (const TierUsage& u : stats.tiers) {
    if (u.tier == tier) return u;
  }
  return kNone;
}

}  // namespace

CacheStoreService::CacheStoreService(CacheStore* store, Limits limits, MetricsRegistry* metrics,
                                     kvrelay::server::Authorizer authorizer,
                                     const Leadership* leadership)
    : store_(store), limits_(limits), authorizer_(std::move(authorizer)), leadership_(leadership) {
  RegisterMetrics(metrics);
}

grpc::Status CacheStoreService::CurrentTerm(int64_t* term) const {
  if (leadership_ == nullptr) return grpc::Status::OK;
  absl::StatusOr<int64_t> leading = leadership_->LeaderTerm();
  if (!leading.ok()) return ToGrpcStatus(leading.status());
  *term = *leading;
  return grpc::Status::OK;
}

grpc::Status CacheStoreService::Lead(grpc::ServerContextBase* ctx, int64_t* term) const {
  if (auto s = CurrentTerm(term); !s.ok()) return s;
  if (leadership_ != nullptr) ctx->AddTrailingMetadata(kTermMetadataKey, absl::StrCat(*term));
  return grpc::Status::OK;
}

grpc::Status CacheStoreService::Served(int64_t term) const {
  if (leadership_ == nullptr) return grpc::Status::OK;
  // Checked again after the work: a leader paused mid-call (SIGSTOP) whose lease ran out
  // meanwhile must not hand out what it decided under the old term.
  absl::StatusOr<int64_t> leading = leadership_->LeaderTerm();
  if (!leading.ok()) return ToGrpcStatus(leading.status());
  if (*leading != term) {
    return ToGrpcStatus(NotLeaderError(absl::StrCat("cache store: the term changed from ", term,
                                                    " to ", *leading, " while the call ran"),
                                       ""));
  }
  return grpc::Status::OK;
}

const char* CacheStoreService::RpcName(int rpc) {
  static const char* kNames[] = {"RegisterNode", "Heartbeat",        "MatchPrefix",
                                 "QueryPrefix",  "Allocate",         "Commit",
                                 "Abort",        "ReleaseLease",     "Stats",
                                 "WatchEvents",  "DeregisterNode",   "AnnounceBlocks",
                                 "ListNodes",    "MatchPrefixStream"};
  return kNames[rpc];
}

grpc::Status CacheStoreService::ParseCaller(const std::string& node_id, uint64_t incarnation,
                                            bool required, Caller* out) const {
  if (node_id.empty()) {
    if (required) return Invalid("node_id: must not be empty");
    if (incarnation != 0) return Invalid("incarnation: set without node_id");
    return grpc::Status::OK;
  }
  if (auto s = CheckId(node_id, "node_id", limits_.max_id_bytes); !s.ok()) return s;
  if (incarnation == 0) {
    return Invalid(
        absl::StrCat("incarnation: node '", node_id, "' must send its non-zero incarnation"));
  }
  out->node_id = node_id;
  out->incarnation = incarnation;
  return grpc::Status::OK;
}

grpc::Status CacheStoreService::Fail(absl::Status status, bool ids_expire) const {
  if (status.ok()) return grpc::Status::OK;
  v1::ErrorInfo info;
  if (absl::optional<absl::Cord> node = status.GetPayload(kIdentityPayload)) {
    // About who the caller (or the node it named) is: structured, with that node's role.
    status.ErasePayload(kIdentityPayload);
    info.set_node_id(std::string(*node));
    info.set_role(ToRole(store_->RoleOf(info.node_id()).value_or(NodeRole::kUnspecified)));
    info.set_reason(v1::FAILURE_IDENTITY);
    if (absl::optional<absl::Cord> holder = status.GetPayload(kHolderPayload)) {
      status.ErasePayload(kHolderPayload);
      std::pair<std::string, std::string> parts = absl::StrSplit(std::string(*holder), '/');
      uint32_t silent_ms = 0;
      uint32_t ttl_ms = 0;
      if (absl::SimpleAtoi(parts.first, &silent_ms) && absl::SimpleAtoi(parts.second, &ttl_ms)) {
        info.set_holder_silent_ms(silent_ms);
        info.set_holder_ttl_ms(ttl_ms);
      }
    }
    return ToGrpcStatus(proto::WithErrorInfo(std::move(status), info));
  }
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
      info.set_role(v1::ROLE_CLIENT);
      info.set_reason(v1::FAILURE_INVALID_REQUEST);
      break;
    case absl::StatusCode::kDeadlineExceeded:
      info.set_role(v1::ROLE_CLIENT);
      info.set_reason(v1::FAILURE_CALLER_DEADLINE);
      break;
    case absl::StatusCode::kResourceExhausted:
      info.set_role(v1::ROLE_STORE);
      info.set_reason(v1::FAILURE_OVERLOADED);
      break;
    case absl::StatusCode::kNotFound:
      info.set_role(v1::ROLE_STORE);
      info.set_reason(ids_expire ? v1::FAILURE_EXPIRED : v1::FAILURE_UNSPECIFIED);
      break;
    default:
      info.set_role(v1::ROLE_STORE);
      info.set_reason(v1::FAILURE_UNSPECIFIED);
  }
  return ToGrpcStatus(proto::WithErrorInfo(std::move(status), info));
}

grpc::Status CacheStoreService::Authorize(grpc::ServerContextBase* ctx, Rpc rpc,
                                          const std::string& node_id) const {
  if (!authorizer_.enforcing()) return grpc::Status::OK;
  static const auto* const kMethods = [] {
    auto* methods = new std::array<std::string, kNumRpcs>();
    for (int i = 0; i < kNumRpcs; ++i) {
      (*methods)[i] = absl::StrCat("/kvrelay.v1.CacheStore/", RpcName(i));
    }
    return methods;
  }();
  absl::StatusOr<kvrelay::server::Peer> peer =
      authorizer_.Authorize(*ctx, (*kMethods)[rpc], node_id);
  return peer.ok() ? grpc::Status::OK : ToGrpcStatus(peer.status());
}

namespace {

v1::NodeState ToProto(NodeState s) {
  return s == NodeState::kSuspect ? v1::NODE_STATE_SUSPECT : v1::NODE_STATE_LIVE;
}

void ToProto(const NodeSpec& spec, v1::NodeInfo* out) {
  out->set_node_id(spec.node_id);
  out->set_incarnation(spec.incarnation);
  out->set_role(static_cast<v1::NodeRole>(spec.role));
  out->set_grpc_address(spec.grpc_address);
  out->mutable_address()->set_kind(spec.transport_kind);
  out->mutable_address()->set_address(spec.transport_address);
  out->set_ttl_ms(absl::ToInt64Milliseconds(spec.ttl));
}

grpc::Status ParseLoad(const v1::NodeLoad& in, int64_t max, NodeLoad* out) {
  const std::pair<const char*, int64_t> fields[] = {
      {"load.active_requests", in.active_requests()},
      {"load.queued_requests", in.queued_requests()},
      {"load.free_kv_blocks", in.free_kv_blocks()},
      {"load.total_kv_blocks", in.total_kv_blocks()},
      {"load.disk_read_bytes_per_second", in.disk_read_bytes_per_second()}};
  for (const auto& [name, v] : fields) {
    if (v < 0 || v >= max) return Invalid(absl::StrCat(name, ": want 0 to ", max - 1, ", got ", v));
  }
  out->active_requests = in.active_requests();
  out->queued_requests = in.queued_requests();
  out->free_kv_blocks = in.free_kv_blocks();
  out->total_kv_blocks = in.total_kv_blocks();
  out->disk_read_bytes_per_second = in.disk_read_bytes_per_second();
  return grpc::Status::OK;
}

}  // namespace

grpc::Status CacheStoreService::RegisterNode(grpc::ServerContext* ctx,
                                             const v1::RegisterNodeRequest* req,
                                             v1::RegisterNodeResponse* resp) {
  RpcTimer t(latency_[kRegister], errors_[kRegister]);
  if (auto s = CheckDeadline(ctx); !s.ok()) return t.Done(s);
  if (auto s = Authorize(ctx, kRegister, req->node_id()); !s.ok()) return t.Done(s);
  int64_t term = 0;
  if (auto s = Lead(ctx, &term); !s.ok()) return t.Done(s);
  if (auto s = CheckId(req->node_id(), "node_id", limits_.max_id_bytes); !s.ok()) return t.Done(s);
  if (req->role() < v1::NODE_ROLE_UNSPECIFIED || req->role() > v1::NODE_ROLE_CACHE) {
    return t.Done(Invalid(absl::StrCat("role: unknown role ", static_cast<int>(req->role()))));
  }
  if (authorizer_.enforcing()) {
    // A worker registers only in the role its certificate names (Authorize checked the id).
    absl::StatusOr<kvrelay::server::Peer> peer = authorizer_.Identify(*ctx);
    if (!peer.ok()) return t.Done(ToGrpcStatus(peer.status()));
    const v1::NodeRole certified = peer->role == kvrelay::server::PeerRole::kPrefill
                                       ? v1::NODE_ROLE_PREFILL
                                       : v1::NODE_ROLE_DECODE;
    if (req->role() != certified) {
      return t.Done(
          ToGrpcStatus(kvrelay::server::Unauthorized(absl::PermissionDeniedError(absl::StrCat(
              "RegisterNode: role ", v1::NodeRole_Name(req->role()), " for node '", req->node_id(),
              "' but its certificate is for ", kvrelay::server::RoleName(peer->role))))));
    }
  }
  if (static_cast<int>(req->grpc_address().size()) > limits_.max_address_bytes) {
    return t.Done(Invalid(absl::StrCat("grpc_address: at most ", limits_.max_address_bytes,
                                       " bytes, got ", req->grpc_address().size())));
  }
  if (req->segments_size() > limits_.max_segments) {
    return t.Done(Exhausted(
        absl::StrCat("segments: at most ", limits_.max_segments, ", got ", req->segments_size())));
  }
  if (req->ttl_ms() != 0 &&
      (req->ttl_ms() < limits_.min_ttl_ms || req->ttl_ms() > limits_.max_ttl_ms)) {
    return t.Done(Invalid(absl::StrCat("ttl_ms: want 0 or ", limits_.min_ttl_ms, "-",
                                       limits_.max_ttl_ms, ", got ", req->ttl_ms())));
  }
  if (static_cast<int>(req->address().kind().size()) > 32) {
    return t.Done(Invalid("address.kind: at most 32 bytes"));
  }
  if (static_cast<int>(req->address().address().size()) > limits_.max_address_bytes) {
    return t.Done(
        Invalid(absl::StrCat("address.address: at most ", limits_.max_address_bytes, " bytes")));
  }
  if (auto s = store_->CheckBlockTokens(req->node_id(), req->block_tokens()); !s.ok()) {
    return t.Done(Fail(s));
  }
  NodeSpec spec;
  spec.node_id = req->node_id();
  spec.incarnation = req->incarnation();
  spec.role = static_cast<NodeRole>(req->role());
  spec.grpc_address = req->grpc_address();
  spec.transport_kind = req->address().kind();
  spec.transport_address = req->address().address();
  spec.ttl = absl::Milliseconds(req->ttl_ms());
  for (int i = 0; i < req->segments_size(); ++i) {
    const v1::Segment& s = req->segments(i);
    const std::string f = absl::StrCat("segments[", i, "]");
    if (auto st = CheckId(s.segment_id(), f + ".segment_id", limits_.max_id_bytes); !st.ok()) {
      return t.Done(st);
    }
    for (const SegmentSpec& prev : spec.segments) {
      if (prev.segment_id == s.segment_id()) {
        return t.Done(Invalid(f + ".segment_id: duplicate '" + s.segment_id() + "'"));
      }
    }
    if (s.tier() < v1::TIER_GPU || s.tier() > v1::TIER_SSD) {
      return t.Done(Invalid(
          absl::StrCat(f, ".tier: want GPU, HOST or SSD, got ", static_cast<int>(s.tier()))));
    }
    if (s.capacity_slots() < 1 || s.capacity_slots() > limits_.max_capacity_slots) {
      return t.Done(
          Invalid(absl::StrCat(f, ".capacity_slots: want 1 to ", limits_.max_capacity_slots,
                               ", got ", s.capacity_slots())));
    }
    if (s.slot_bytes() < 1 || s.slot_bytes() > limits_.max_slot_bytes) {
      return t.Done(Invalid(absl::StrCat(f, ".slot_bytes: want 1 to ", limits_.max_slot_bytes,
                                         ", got ", s.slot_bytes())));
    }
    if (static_cast<int>(s.memory_key().size()) > limits_.max_memory_key_bytes) {
      return t.Done(Exhausted(absl::StrCat(f, ".memory_key: at most ", limits_.max_memory_key_bytes,
                                           " bytes, got ", s.memory_key().size())));
    }
    spec.segments.push_back(SegmentSpec{s.segment_id(), static_cast<Tier>(s.tier()),
                                        s.capacity_slots(), s.slot_bytes(), s.memory_key()});
  }
  absl::StatusOr<RegisterResult> r = store_->RegisterNode(std::move(spec));
  if (!r.ok()) return t.Done(Fail(r.status()));
  resp->set_ttl_ms(absl::ToInt64Milliseconds(r->ttl));
  resp->set_incarnation(r->incarnation);
  resp->set_store_incarnation(store_->store_incarnation());
  resp->set_revived(r->revived);
  return t.Done(Served(term));
}

grpc::Status CacheStoreService::DeregisterNode(grpc::ServerContext* ctx,
                                               const v1::DeregisterNodeRequest* req,
                                               v1::DeregisterNodeResponse*) {
  RpcTimer t(latency_[kDeregister], errors_[kDeregister]);
  if (auto s = CheckDeadline(ctx); !s.ok()) return t.Done(s);
  if (auto s = Authorize(ctx, kDeregister, req->node_id()); !s.ok()) return t.Done(s);
  int64_t term = 0;
  if (auto s = Lead(ctx, &term); !s.ok()) return t.Done(s);
  Caller caller;
  if (auto s = ParseCaller(req->node_id(), req->incarnation(), true, &caller); !s.ok()) {
    return t.Done(s);
  }
  const grpc::Status done = Fail(store_->DeregisterNode(caller));
  return t.Done(done.ok() ? Served(term) : done);
}

grpc::Status CacheStoreService::AnnounceBlocks(grpc::ServerContext* ctx,
                                               const v1::AnnounceBlocksRequest* req,
                                               v1::AnnounceBlocksResponse* resp) {
  RpcTimer t(latency_[kAnnounce], errors_[kAnnounce]);
  if (auto s = CheckDeadline(ctx); !s.ok()) return t.Done(s);
  if (auto s = Authorize(ctx, kAnnounce, req->node_id()); !s.ok()) return t.Done(s);
  int64_t term = 0;
  if (auto s = Lead(ctx, &term); !s.ok()) return t.Done(s);
  Caller caller;
  if (auto s = ParseCaller(req->node_id(), req->incarnation(), true, &caller); !s.ok()) {
    return t.Done(s);
  }
  if (auto s = CheckId(req->segment_id(), "segment_id", limits_.max_id_bytes); !s.ok()) {
    return t.Done(s);
  }
  if (req->blocks().empty()) return t.Done(Invalid("blocks: at least one block needed"));
  if (req->blocks_size() > limits_.max_announce) {
    return t.Done(Exhausted(
        absl::StrCat("blocks: at most ", limits_.max_announce, ", got ", req->blocks_size())));
  }
  std::vector<AnnouncedBlock> blocks;
  blocks.reserve(req->blocks_size());
  for (int i = 0; i < req->blocks_size(); ++i) {
    const v1::AnnouncedBlock& b = req->blocks(i);
    if (b.slot() < 0 || b.slot() >= limits_.max_capacity_slots) {
      return t.Done(Invalid(absl::StrCat("blocks[", i, "].slot: want 0 to ",
                                         limits_.max_capacity_slots - 1, ", got ", b.slot())));
    }
    if (b.size_bytes() < 1 || b.size_bytes() > limits_.max_slot_bytes) {
      return t.Done(Invalid(absl::StrCat("blocks[", i, "].size_bytes: want 1 to ",
                                         limits_.max_slot_bytes, ", got ", b.size_bytes())));
    }
    blocks.push_back({FromProto(b.hash()), FromProto(b.parent()), static_cast<uint32_t>(b.slot()),
                      b.size_bytes()});
  }
  absl::StatusOr<AnnounceResult> r = store_->AnnounceBlocks(caller, req->segment_id(), blocks);
  if (!r.ok()) return t.Done(Fail(r.status()));
  resp->set_accepted(r->accepted);
  resp->set_already_present(r->already_present);
  for (const auto& [index, reason] : r->rejected) {
    v1::AnnounceRejection* rej = resp->add_rejected();
    rej->set_index(static_cast<uint32_t>(index));
    rej->set_reason(static_cast<v1::AnnounceRejection::Reason>(reason));
  }
  return t.Done(Served(term));
}

grpc::Status CacheStoreService::ListNodes(grpc::ServerContext* ctx, const v1::ListNodesRequest*,
                                          v1::ListNodesResponse* resp) {
  RpcTimer t(latency_[kListNodes], errors_[kListNodes]);
  if (auto s = CheckDeadline(ctx); !s.ok()) return t.Done(s);
  if (auto s = Authorize(ctx, kListNodes, ""); !s.ok()) return t.Done(s);
  int64_t term = 0;
  if (auto s = Lead(ctx, &term); !s.ok()) return t.Done(s);
  // The sequence first: whatever changes after it shows up in events after it.
  resp->set_last_sequence(store_->last_sequence());
  resp->set_store_incarnation(store_->store_incarnation());
  resp->set_block_tokens(store_->block_tokens());
  for (const NodeInfo& n : store_->ListNodes()) {
    v1::NodeInfo* out = resp->add_nodes();
    ToProto(n.spec, out);
    out->set_state(ToProto(n.state));
    out->mutable_load()->set_active_requests(n.load.active_requests);
    out->mutable_load()->set_queued_requests(n.load.queued_requests);
    out->mutable_load()->set_free_kv_blocks(n.load.free_kv_blocks);
    out->mutable_load()->set_total_kv_blocks(n.load.total_kv_blocks);
    out->mutable_load()->set_disk_read_bytes_per_second(n.load.disk_read_bytes_per_second);
    out->set_since_heartbeat_ms(absl::ToInt64Milliseconds(n.since_heartbeat));
    out->set_capacity_slots(n.capacity_slots);
    out->set_used_slots(n.used_slots);
    out->set_ssd_capacity_slots(n.ssd_capacity_slots);
    out->set_ssd_used_slots(n.ssd_used_slots);
  }
  return t.Done(Served(term));
}

grpc::Status CacheStoreService::Heartbeat(grpc::ServerContext* ctx, const v1::HeartbeatRequest* req,
                                          v1::HeartbeatResponse* resp) {
  RpcTimer t(latency_[kHeartbeat], errors_[kHeartbeat]);
  if (auto s = CheckDeadline(ctx); !s.ok()) return t.Done(s);
  if (auto s = Authorize(ctx, kHeartbeat, req->node_id()); !s.ok()) return t.Done(s);
  int64_t term = 0;
  if (auto s = Lead(ctx, &term); !s.ok()) return t.Done(s);
  if (auto s = CheckId(req->node_id(), "node_id", limits_.max_id_bytes); !s.ok()) return t.Done(s);
  NodeLoad load;
  if (req->has_load()) {
    if (auto s = ParseLoad(req->load(), limits_.max_load_value, &load); !s.ok()) return t.Done(s);
  }
  absl::StatusOr<HeartbeatResult> r =
      store_->Heartbeat(req->node_id(), req->incarnation(), req->has_load() ? &load : nullptr);
  if (!r.ok()) return t.Done(Fail(r.status()));
  resp->set_known(r->known);
  resp->set_store_incarnation(store_->store_incarnation());
  if (r->known) resp->set_previous_state(ToProto(r->state));
  return t.Done(Served(term));
}

grpc::ServerUnaryReactor* CacheStoreService::MatchPrefix(grpc::CallbackServerContext* ctx,
                                                         const v1::MatchPrefixRequest* req,
                                                         v1::MatchPrefixResponse* resp) {
  // Answered inline on the thread that read the request: the lookup takes shard locks only,
  // one at a time, and never waits, so nothing blocks gRPC's callback threads.
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(MatchPrefixImpl(ctx, req, resp));
  return reactor;
}

grpc::Status CacheStoreService::MatchPrefix(grpc::ServerContext* ctx,
                                            const v1::MatchPrefixRequest* req,
                                            v1::MatchPrefixResponse* resp) {
  return MatchPrefixImpl(ctx, req, resp);
}

grpc::Status CacheStoreService::MatchPrefixImpl(grpc::ServerContextBase* ctx,
                                                const v1::MatchPrefixRequest* req,
                                                v1::MatchPrefixResponse* resp) {
  RpcTimer t(latency_[kMatch], errors_[kMatch]);
  if (auto s = CheckDeadline(ctx); !s.ok()) return t.Done(s);
  std::optional<int64_t> term;
  bool not_leader = false;
  grpc::Status s = MatchPrefixCore(ctx, kMatch, *req, resp, &term, &not_leader);
  if (leadership_ != nullptr && term.has_value()) {
    ctx->AddTrailingMetadata(kTermMetadataKey, absl::StrCat(*term));
  }
  return t.Done(s);
}

grpc::Status CacheStoreService::MatchPrefixCore(grpc::ServerContextBase* ctx, Rpc rpc,
                                                const v1::MatchPrefixRequest& request,
                                                v1::MatchPrefixResponse* resp,
                                                std::optional<int64_t>* led_term,
                                                bool* not_leader) {
  const v1::MatchPrefixRequest* req = &request;
  if (auto s = Authorize(ctx, rpc, req->node_id()); !s.ok()) return s;
  int64_t term = 0;
  if (auto s = CurrentTerm(&term); !s.ok()) {
    *not_leader = true;
    return s;
  }
  *led_term = term;
  // Checked again once the answer is built: see Served().
  auto served = [this, term, not_leader] {
    grpc::Status s = Served(term);
    if (!s.ok()) *not_leader = true;
    return s;
  };
  std::vector<kv::BlockHash> chain;
  if (auto s = ParseEitherChain(req->chain(), req->chain_packed(), limits_.max_chain, &chain);
      !s.ok()) {
    return s;
  }
  if (req->lease_ttl_ms() < 0 || req->lease_ttl_ms() > limits_.max_ttl_ms) {
    return Invalid(
        absl::StrCat("lease_ttl_ms: want 0-", limits_.max_ttl_ms, ", got ", req->lease_ttl_ms()));
  }
  Caller caller;
  if (auto s = ParseCaller(req->node_id(), req->incarnation(), false, &caller); !s.ok()) {
    return s;
  }
  absl::StatusOr<MatchResult> r =
      store_->MatchPrefix(chain, absl::Milliseconds(req->lease_ttl_ms()), caller);
  if (!r.ok()) return Fail(r.status());
  resp->set_matched(r->matched);
  resp->set_lease_id(r->lease_id);
  if (!req->columnar()) {
    for (size_t i = 0; i < r->blocks.size(); ++i) {
      v1::MatchedBlock* mb = resp->add_blocks();
      ToProto(r->blocks[i].hash, mb->mutable_hash());
      for (size_t k = 0; k < r->blocks[i].replicas.size(); ++k) {
        ToProto(r->ReplicaLocation(i, k), mb->add_replicas());
      }
    }
    return served();
  }
  for (const Location& seg : r->segments) {
    v1::SegmentRef* ref = resp->add_segments();
    ref->set_node_id(seg.node_id);
    ref->set_segment_id(seg.segment_id);
    ref->set_tier(static_cast<v1::Tier>(seg.tier));
    ref->set_slot_bytes(seg.slot_bytes);
    ref->set_incarnation(seg.incarnation);
    // How to read the segment goes only to a registered worker holding a lease on the blocks
    // (the auth table lets a worker match only as itself).
    if (!caller.anonymous() && r->lease_id != 0) {
      ref->mutable_address()->set_kind(seg.transport_kind);
      ref->mutable_address()->set_address(seg.transport_address);
      ref->set_memory_key(seg.memory_key);
    }
  }
  resp->mutable_replica_counts()->Reserve(static_cast<int>(r->blocks.size()));
  resp->mutable_replica_segment()->Reserve(static_cast<int>(r->blocks.size()));
  resp->mutable_replica_slot()->Reserve(static_cast<int>(r->blocks.size()));
  for (const MatchResult::Block& b : r->blocks) {
    resp->add_replica_counts(static_cast<uint32_t>(b.replicas.size()));
    for (const MatchResult::Replica& rep : b.replicas) {
      resp->add_replica_segment(rep.segment);
      resp->add_replica_slot(rep.slot);
    }
  }
  return served();
}

grpc::Status CacheStoreService::QueryPrefix(grpc::ServerContext* ctx,
                                            const v1::QueryPrefixRequest* req,
                                            v1::QueryPrefixResponse* resp) {
  RpcTimer t(latency_[kQuery], errors_[kQuery]);
  if (auto s = CheckDeadline(ctx); !s.ok()) return t.Done(s);
  if (auto s = Authorize(ctx, kQuery, ""); !s.ok()) return t.Done(s);
  int64_t term = 0;
  if (auto s = Lead(ctx, &term); !s.ok()) return t.Done(s);
  std::vector<kv::BlockHash> chain;
  if (auto s = ParseChain(req->chain(), "chain", limits_.max_chain, &chain); !s.ok()) {
    return t.Done(s);
  }
  for (const NodePrefix& n : store_->QueryPrefix(chain)) {
    v1::NodePrefix* np = resp->add_nodes();
    np->set_node_id(n.node_id);
    np->set_matched(n.matched);
    np->set_disk_blocks(n.disk_blocks);
  }
  return t.Done(Served(term));
}

grpc::Status CacheStoreService::Allocate(grpc::ServerContext* ctx, const v1::AllocateRequest* req,
                                         v1::AllocateResponse* resp) {
  RpcTimer t(latency_[kAllocate], errors_[kAllocate]);
  if (auto s = CheckDeadline(ctx); !s.ok()) return t.Done(s);
  if (auto s = Authorize(ctx, kAllocate, req->node_id()); !s.ok()) return t.Done(s);
  int64_t term = 0;
  if (auto s = Lead(ctx, &term); !s.ok()) return t.Done(s);
  if (req->blocks().empty()) return t.Done(Invalid("blocks: at least one block needed"));
  if (req->blocks_size() > limits_.max_chain) {
    return t.Done(Exhausted(
        absl::StrCat("blocks: at most ", limits_.max_chain, ", got ", req->blocks_size())));
  }
  if (auto s = CheckId(req->preferred_node(), "preferred_node", limits_.max_id_bytes, true);
      !s.ok()) {
    return t.Done(s);
  }
  if (req->preferred_tier() < v1::TIER_UNSPECIFIED || req->preferred_tier() > v1::TIER_SSD) {
    return t.Done(Invalid(
        absl::StrCat("preferred_tier: unknown tier ", static_cast<int>(req->preferred_tier()))));
  }
  if (req->replicas() < 0 || req->replicas() > limits_.max_replicas) {
    return t.Done(Invalid(
        absl::StrCat("replicas: want 0-", limits_.max_replicas, ", got ", req->replicas())));
  }
  AllocateArgs args;
  if (auto s = ParseCaller(req->node_id(), req->incarnation(), false, &args.caller); !s.ok()) {
    return t.Done(s);
  }
  args.preferred_node = req->preferred_node();
  args.preferred_tier = static_cast<Tier>(req->preferred_tier());
  args.replicas = req->replicas();
  args.add_local_replicas = req->add_local_replicas();
  for (const v1::BlockToAllocate& b : req->blocks()) {
    args.blocks.push_back({FromProto(b.hash()), FromProto(b.parent()), b.size_bytes()});
  }
  absl::StatusOr<AllocateResult> r = store_->Allocate(args, DeadlineOf(ctx, absl::Seconds(30)));
  if (!r.ok()) return t.Done(Fail(r.status()));
  resp->set_allocation_id(r->allocation_id);
  resp->set_commit_timeout_ms(absl::ToInt64Milliseconds(r->commit_timeout));
  for (const AllocateResult::Block& b : r->blocks) {
    v1::Allocation* a = resp->add_blocks();
    ToProto(b.hash, a->mutable_hash());
    a->set_already_committed(b.already_committed);
    for (const Location& loc : b.replicas) ToProto(loc, a->add_replicas());
  }
  return t.Done(Served(term));
}

grpc::Status CacheStoreService::Commit(grpc::ServerContext* ctx, const v1::CommitRequest* req,
                                       v1::CommitResponse* resp) {
  RpcTimer t(latency_[kCommit], errors_[kCommit]);
  if (auto s = CheckDeadline(ctx); !s.ok()) return t.Done(s);
  if (auto s = Authorize(ctx, kCommit, req->node_id()); !s.ok()) return t.Done(s);
  int64_t term = 0;
  if (auto s = Lead(ctx, &term); !s.ok()) return t.Done(s);
  if (req->allocation_id() == 0) return t.Done(Invalid("allocation_id: must not be zero"));
  std::vector<kv::BlockHash> hashes;
  if (!req->hashes().empty()) {
    if (auto s = ParseChain(req->hashes(), "hashes", limits_.max_chain, &hashes); !s.ok()) {
      return t.Done(s);
    }
  }
  Caller caller;
  if (auto s = ParseCaller(req->node_id(), req->incarnation(), false, &caller); !s.ok()) {
    return t.Done(s);
  }
  absl::StatusOr<int> n =
      store_->Commit(req->allocation_id(), hashes, caller, absl::MakeConstSpan(req->token_ids()));
  if (!n.ok()) return t.Done(Fail(n.status(), /*ids_expire=*/true));
  resp->set_committed(*n);
  return t.Done(Served(term));
}

grpc::Status CacheStoreService::Abort(grpc::ServerContext* ctx, const v1::AbortRequest* req,
                                      v1::AbortResponse*) {
  RpcTimer t(latency_[kAbort], errors_[kAbort]);
  if (auto s = CheckDeadline(ctx); !s.ok()) return t.Done(s);
  if (auto s = Authorize(ctx, kAbort, req->node_id()); !s.ok()) return t.Done(s);
  int64_t term = 0;
  if (auto s = Lead(ctx, &term); !s.ok()) return t.Done(s);
  if (req->allocation_id() == 0) return t.Done(Invalid("allocation_id: must not be zero"));
  Caller caller;
  if (auto s = ParseCaller(req->node_id(), req->incarnation(), false, &caller); !s.ok()) {
    return t.Done(s);
  }
  const grpc::Status done = Fail(store_->Abort(req->allocation_id(), caller), /*ids_expire=*/true);
  return t.Done(done.ok() ? Served(term) : done);
}

grpc::Status CacheStoreService::ReleaseLease(grpc::ServerContext* ctx,
                                             const v1::ReleaseLeaseRequest* req,
                                             v1::ReleaseLeaseResponse*) {
  RpcTimer t(latency_[kRelease], errors_[kRelease]);
  if (auto s = CheckDeadline(ctx); !s.ok()) return t.Done(s);
  if (auto s = Authorize(ctx, kRelease, req->node_id()); !s.ok()) return t.Done(s);
  int64_t term = 0;
  if (auto s = Lead(ctx, &term); !s.ok()) return t.Done(s);
  if (req->lease_id() == 0) return t.Done(Invalid("lease_id: must not be zero"));
  Caller caller;
  if (auto s = ParseCaller(req->node_id(), req->incarnation(), false, &caller); !s.ok()) {
    return t.Done(s);
  }
  const grpc::Status done =
      Fail(store_->ReleaseLease(req->lease_id(), caller), /*ids_expire=*/true);
  return t.Done(done.ok() ? Served(term) : done);
}

grpc::Status CacheStoreService::Stats(grpc::ServerContext* ctx, const v1::StatsRequest*,
                                      v1::StatsResponse* resp) {
  RpcTimer t(latency_[kStats], errors_[kStats]);
  if (auto s = CheckDeadline(ctx); !s.ok()) return t.Done(s);
  if (auto s = Authorize(ctx, kStats, ""); !s.ok()) return t.Done(s);
  // Standbys answer too (their own counts show how far they follow); the term only when leading.
  int64_t term = 0;
  if (grpc::Status leading = Lead(ctx, &term); leading.ok()) {
    resp->set_leading(true);
    resp->set_term(term);
  } else if (leadership_ != nullptr) {
    // A standby: the leader's address travels in the refusal's ErrorInfo.
    if (std::optional<v1::ErrorInfo> info =
            proto::GetErrorInfo(leadership_->LeaderTerm().status())) {
      resp->set_leader_address(info->address());
    }
  }
  resp->set_prefix_query_blocks(
      store_->counters().prefix_query_blocks.load(std::memory_order_relaxed));
  resp->set_prefix_hit_blocks(store_->counters().prefix_hit_blocks.load(std::memory_order_relaxed));
  StoreStats s = store_->Stats();
  resp->set_nodes(s.nodes);
  resp->set_committed_blocks(s.committed_blocks);
  resp->set_allocated_blocks(s.allocated_blocks);
  resp->set_active_leases(s.active_leases);
  resp->set_evictions(s.evictions);
  resp->set_last_sequence(s.last_sequence);
  resp->set_policy(s.policy);
  resp->set_suspect_nodes(s.suspect_nodes);
  resp->set_store_incarnation(s.store_incarnation);
  for (const TierUsage& u : s.tiers) {
    v1::TierStats* ts = resp->add_tiers();
    ts->set_tier(static_cast<v1::Tier>(u.tier));
    ts->set_capacity_bytes(u.capacity_bytes);
    ts->set_used_bytes(u.used_bytes);
  }
  return t.Done(grpc::Status::OK);
}

grpc::Status CacheStoreService::WatchEvents(grpc::ServerContext* ctx,
                                            const v1::WatchEventsRequest* req,
                                            grpc::ServerWriter<v1::Event>* writer) {
  RpcTimer t(latency_[kWatch], errors_[kWatch]);
  if (auto s = Authorize(ctx, kWatch, ""); !s.ok()) return t.Done(s);
  int64_t term = 0;
  if (auto s = Lead(ctx, &term); !s.ok()) return t.Done(s);
  uint64_t next = req->from_sequence();
  if (next == 0) next = store_->last_sequence() + 1;
  // Streams until the client cancels, its deadline passes or the server stops; each wait is
  // short so all three are noticed promptly.
  while (!ctx->IsCancelled() && !stopping_.load(std::memory_order_acquire)) {
    if (ctx->deadline() < std::chrono::system_clock::now()) break;
    // A store that stopped leading ends its streams: its events are no longer the cluster's.
    if (auto s = Served(term); !s.ok()) return t.Done(s);
    absl::StatusOr<std::vector<StoreEvent>> events =
        store_->EventsSince(next, 1024, absl::Now() + absl::Milliseconds(100));
    if (!events.ok()) return t.Done(Fail(events.status()));
    for (const StoreEvent& e : *events) {
      v1::Event out;
      out.set_sequence(e.sequence);
      out.set_kind(static_cast<v1::Event::Kind>(e.kind));
      out.set_store_incarnation(store_->store_incarnation());
      if (e.kind == StoreEvent::Kind::kStored || e.kind == StoreEvent::Kind::kRemoved) {
        ToProto(e.hash, out.mutable_hash());
        ToProto(e.parent, out.mutable_parent());
      } else {
        ToProto(e.node, out.mutable_node());
        out.mutable_node()->set_state(e.kind == StoreEvent::Kind::kNodeSuspect
                                          ? v1::NODE_STATE_SUSPECT
                                          : v1::NODE_STATE_LIVE);
      }
      for (const std::string& n : e.node_ids) out.add_node_ids(n);
      out.set_tier(static_cast<v1::Tier>(e.tier));
      if (!writer->Write(out)) return t.Done(grpc::Status::OK);
      next = e.sequence + 1;
    }
  }
  return t.Done(grpc::Status::OK);
}

void CacheStoreService::RegisterMetrics(MetricsRegistry* metrics) {
  for (int i = 0; i < kNumRpcs; ++i) {
    const MetricLabels rpc = {{"rpc", RpcName(i)}};
    latency_[i] = metrics->GetHistogram("kvrelay:cachestore_rpc_seconds", "RPC handling latency.",
                                        RpcBucketsSeconds(), rpc);
    errors_[i] = metrics->GetCounter("kvrelay:cachestore_rpc_errors_total", "Failed RPCs.", rpc);
  }
  stream_messages_ =
      metrics->GetCounter("kvrelay:cachestore_lookup_stream_messages_total",
                          "MatchPrefixStream messages read (a batch of lookups counts once).", {});
  // The store keeps these as its own atomics (trace-replay and tests read them too); the
  // registry reads them at each scrape.
  const StoreCounters* c = &store_->counters();
  auto counter = [metrics](const char* name, const char* help, const std::atomic<int64_t>* value) {
    metrics->AddCounterFunc(name, help, {}, [value] {
      return static_cast<double>(value->load(std::memory_order_relaxed));
    });
  };
  counter("kvrelay:cachestore_prefix_queries_total", "MatchPrefix calls.", &c->prefix_queries);
  counter("kvrelay:cachestore_prefix_query_blocks_total", "Blocks asked for in MatchPrefix.",
          &c->prefix_query_blocks);
  // Hits by tier (the fastest holding each block); their sum is every hit.
  for (Tier tier : {Tier::kGpu, Tier::kHost, Tier::kSsd}) {
    const std::atomic<int64_t>* value = &c->prefix_hit_blocks_by_tier[static_cast<size_t>(tier)];
    metrics->AddCounterFunc("kvrelay:cachestore_prefix_hit_blocks_total",
                            "Blocks found by MatchPrefix, by the fastest tier holding each.",
                            {{"tier", std::string(TierName(tier))}}, [value] {
                              return static_cast<double>(value->load(std::memory_order_relaxed));
                            });
  }
  counter("kvrelay:cachestore_allocated_blocks_total", "Blocks reserved by Allocate.",
          &c->allocated_blocks);
  counter("kvrelay:cachestore_committed_blocks_total", "Blocks committed.", &c->committed_blocks);
  counter("kvrelay:cachestore_aborted_blocks_total", "Allocated blocks aborted.",
          &c->aborted_blocks);
  counter("kvrelay:cachestore_reclaimed_blocks_total",
          "Allocated blocks reclaimed after the commit timeout.", &c->reclaimed_blocks);
  counter("kvrelay:cachestore_evictions_total", "Blocks evicted.", &c->evicted_blocks);
  counter("kvrelay:cachestore_expired_nodes_total",
          "Nodes forgotten after their TTL and the suspect grace period.", &c->expired_nodes);
  counter("kvrelay:cachestore_suspected_nodes_total", "Nodes that missed their heartbeat TTL.",
          &c->suspected_nodes);
  counter("kvrelay:cachestore_refused_registrations_total",
          "Registrations refused (duplicate live node id, bad spec, too many nodes).",
          &c->refused_registrations);
  counter("kvrelay:cachestore_announced_blocks_total", "Blocks indexed from AnnounceBlocks.",
          &c->announced_blocks);
  // Gauges from the store's Stats() (a few locks and counts; scrapes are seconds apart).
  CacheStore* store = store_;
  auto gauge = [metrics, store](const char* name, const char* help, const MetricLabels& labels,
                                std::function<double(const StoreStats&)> read) {
    metrics->AddGaugeFunc(name, help, labels,
                          [store, read = std::move(read)] { return read(store->Stats()); });
  };
  gauge("kvrelay:cachestore_nodes", "Live registered nodes.", {},
        [](const StoreStats& s) { return s.nodes; });
  gauge("kvrelay:cachestore_suspect_nodes", "Nodes past their TTL, within the grace period.", {},
        [](const StoreStats& s) { return s.suspect_nodes; });
  gauge("kvrelay:cachestore_blocks", "Committed blocks.", {},
        [](const StoreStats& s) { return s.committed_blocks; });
  gauge("kvrelay:cachestore_active_leases", "Read leases held.", {},
        [](const StoreStats& s) { return s.active_leases; });
  gauge("kvrelay:cachestore_index_bytes", "Bytes held by the block index's structures.", {},
        [](const StoreStats& s) { return s.index_bytes; });
  gauge("kvrelay:cachestore_retained_events",
        "KV events kept for WatchEvents resumption (at most --event-retention).", {},
        [](const StoreStats& s) { return s.retained_events; });
  gauge("kvrelay:cachestore_kept_token_blocks",
        "Blocks whose token ids the store keeps for KV events.", {},
        [](const StoreStats& s) { return s.kept_token_blocks; });
  for (Tier tier : {Tier::kGpu, Tier::kHost, Tier::kSsd}) {
    const MetricLabels labels = {{"tier", std::string(TierName(tier))}};
    gauge("kvrelay:cachestore_tier_used_slots",
          "Slots holding a block, by tier (ssd: the workers' disk tiers, as they announce them).",
          labels, [tier](const StoreStats& s) { return UsageOf(s, tier).used_slots; });
    gauge("kvrelay:cachestore_tier_capacity_slots", "Registered slots by tier.", labels,
          [tier](const StoreStats& s) { return UsageOf(s, tier).capacity_slots; });
    gauge("kvrelay:cachestore_used_bytes", "Bytes of slots in use by tier.", labels,
          [tier](const StoreStats& s) { return UsageOf(s, tier).used_bytes; });
    gauge("kvrelay:cachestore_capacity_bytes", "Registered bytes by tier.", labels,
          [tier](const StoreStats& s) { return UsageOf(s, tier).capacity_bytes; });
  }
}

}  // namespace kvrelay::cachestore::server

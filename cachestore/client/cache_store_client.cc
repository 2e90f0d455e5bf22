#include "cachestore/client/cache_store_client.h"

#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <iterator>
#include <optional>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/logging.h"
#include "common/server/credentials.h"
#include "grpcpp/grpcpp.h"
#include "proto/grpc_status.h"

namespace kvrelay::cachestore {

using ::kvrelay::proto::FromGrpcStatus;

namespace {
constexpr int kAnnounceBatch = 4096;
// The shortest attempt on one of several instances (see AttemptDeadline).
constexpr absl::Duration kMinAttempt = absl::Milliseconds(20);

uint64_t KernelRandom64() {
  uint64_t v = 0;
  while (v == 0) {
    const ssize_t n = getrandom(&v, sizeof(v), 0);
    if (n != static_cast<ssize_t>(sizeof(v))) v = 0;  // EINTR: retry
  }
  return v;
}

// After a failed attempt: counts it and waits 10 ms per failure so far (at most 100 ms); false,
// without waiting, when the pause would reach `deadline`.
bool PauseBeforeRetry(int& failures, absl::Time deadline) {
  ++failures;
  const absl::Duration pause = std::min(absl::Milliseconds(10) * failures, absl::Milliseconds(100));
  if (absl::Now() + pause >= deadline) return false;
  absl::SleepFor(pause);
  return true;
}

// Names the caller on a request that carries its identity, once it has one with an incarnation:
// the store checks the pair against its registry; an anonymous client (gateway, tools) sends none.
template <typename Request>
void StampCaller(const NodeIdentity& me, Request& req) {
  if (me.empty() || me.incarnation == 0) return;
  req.set_node_id(me.node_id);
  req.set_incarnation(me.incarnation);
}

}  // namespace

absl::StatusOr<std::shared_ptr<CacheStoreClient::Endpoint>> CacheStoreClient::MakeEndpoint(
    const std::string& address, const Options& options) {
  server::ChannelOptions channel_options;
  channel_options.keepalive_time = options.keepalive;
  channel_options.own_connection = options.own_connection;
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
      server::MakeChannel(address, options.security, channel_options);
  if (!channel.ok()) return channel.status();
  auto endpoint = std::make_shared<Endpoint>();
  endpoint->address = address;
  endpoint->channel = *std::move(channel);
  endpoint->stub = v1::CacheStore::NewStub(endpoint->channel);
  return endpoint;
}

absl::StatusOr<std::unique_ptr<CacheStoreClient>> CacheStoreClient::Connect(
    const std::string& target, Options options) {
  if (target.empty()) return absl::InvalidArgumentError("target: empty cache store address");
  std::vector<std::shared_ptr<Endpoint>> endpoints;
  for (absl::string_view part : absl::StrSplit(target, ',')) {
    const std::string address(absl::StripAsciiWhitespace(part));
    if (address.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("target: empty entry in the store address list '", target, "'"));
    }
    absl::StatusOr<std::shared_ptr<Endpoint>> endpoint = MakeEndpoint(address, options);
    if (!endpoint.ok()) return endpoint.status();
    endpoints.push_back(*std::move(endpoint));
  }
  return std::unique_ptr<CacheStoreClient>(new CacheStoreClient(std::move(endpoints), options));
}

std::unique_ptr<CacheStoreClient> CacheStoreClient::FromChannel(
    std::shared_ptr<grpc::Channel> channel, Options options) {
  auto endpoint = std::make_shared<Endpoint>();
  endpoint->channel = std::move(channel);
  endpoint->stub = v1::CacheStore::NewStub(endpoint->channel);
  return std::unique_ptr<CacheStoreClient>(new CacheStoreClient({std::move(endpoint)}, options));
}

CacheStoreClient::CacheStoreClient(std::vector<std::shared_ptr<Endpoint>> endpoints,
                                   Options options)
    : options_(options), node_(options.node), endpoints_(std::move(endpoints)) {}

CacheStoreClient::~CacheStoreClient() {
  std::vector<std::shared_ptr<Endpoint>> endpoints;
  {
    absl::MutexLock lock(&mu_);
    endpoints = endpoints_;
  }
  std::vector<std::shared_ptr<LookupStream>> streams;
  for (const std::shared_ptr<Endpoint>& endpoint : endpoints) {
    absl::MutexLock lock(&endpoint->lookup_mu);
    if (endpoint->lookup != nullptr) streams.push_back(std::move(endpoint->lookup));
    for (auto& s : endpoint->ended) streams.push_back(std::move(s));
    endpoint->ended.clear();
  }
  for (const std::shared_ptr<LookupStream>& stream : streams) stream->Cancel();
  for (std::shared_ptr<LookupStream>& stream : streams) {
    // Freed here, on this thread, once gRPC is done with it; one it never finishes is leaked
    // rather than freed under it.
    if (!stream->WaitDone(absl::Seconds(1))) new std::shared_ptr<LookupStream>(std::move(stream));
  }
}

std::shared_ptr<LookupStream> CacheStoreClient::LookupStreamOf(Endpoint& endpoint) {
  std::vector<std::shared_ptr<LookupStream>> finished;  // freed after the lock, on this thread
  absl::MutexLock lock(&endpoint.lookup_mu);
  if (endpoint.lookup == nullptr || endpoint.lookup->ended()) {
    if (endpoint.lookup != nullptr) endpoint.ended.push_back(std::move(endpoint.lookup));
    auto done = std::partition(endpoint.ended.begin(), endpoint.ended.end(),
                               [](const auto& s) { return !s->finished(); });
    std::move(done, endpoint.ended.end(), std::back_inserter(finished));
    endpoint.ended.erase(done, endpoint.ended.end());
    endpoint.lookup = LookupStream::Open(endpoint.stub.get());
  }
  return endpoint.lookup;
}

absl::Status CacheStoreClient::StreamedMatchPrefix(const v1::MatchPrefixRequest& request,
                                                   v1::MatchPrefixResponse* response,
                                                   const CallOptions& call) {
  const absl::Time deadline = std::min(absl::Now() + options_.timeout, call.deadline);
  int failures = 0;
  absl::Status not_leader;  // as in Invoke: more telling than the deadline of the last retry
  auto result = [&not_leader](absl::Status status) {
    if (absl::IsDeadlineExceeded(status) && !not_leader.ok()) return not_leader;
    return status;
  };
  auto unary = [&] {
    CallOptions rest = call;
    rest.deadline = deadline;
    return Invoke(&v1::CacheStore::Stub::MatchPrefix, request, response, rest);
  };
  while (true) {
    size_t index = 0, count = 0;
    std::shared_ptr<Endpoint> endpoint = Current(&index, &count);
    if (endpoint->no_lookup_stream.load(std::memory_order_relaxed)) return unary();
    std::shared_ptr<LookupStream> stream = LookupStreamOf(*endpoint);
    const absl::Time attempt_deadline = AttemptDeadline(deadline, count);
    LookupStream::Result r = stream->Lookup(request, attempt_deadline);
    absl::Status status = std::move(r.status);
    if (status.ok()) {
      if (AcceptTerm(r.term)) {
        *response = std::move(r.response);
        return status;
      }
      // A store deposed since (it resumed after a pause): drop its stream and its answer.
      status = StaleTermRefusal(*endpoint, r.term);
      stream->Cancel();
      not_leader = status;
      MoveOn(index);
    } else if (r.stream_ended && absl::IsUnimplemented(status)) {
      // A store without MatchPrefixStream (an older build): unary from now on.
      endpoint->no_lookup_stream.store(true, std::memory_order_relaxed);
      continue;
    } else if (r.not_sent && absl::IsResourceExhausted(status)) {
      return unary();  // this client's own bound on waiting lookups
    } else if (r.stream_ended && absl::IsResourceExhausted(status)) {
      return unary();  // the store's bound on open streams
    } else {
      std::optional<v1::ErrorInfo> info = proto::GetErrorInfo(status);
      const bool is_not_leader = info.has_value() && info->reason() == v1::FAILURE_NOT_LEADER;
      if (is_not_leader) {
        not_leader = status;
        if (FollowNotLeader(*info, index, failures)) continue;
      } else if (r.stream_ended && r.not_sent && failures == 0) {
        // The stream ended just before this lookup would have gone out: a fresh one, at once.
        ++failures;
        continue;
      } else if (count > 1 && (absl::IsUnavailable(status) ||
                               (absl::IsDeadlineExceeded(status) && attempt_deadline < deadline))) {
        // Dead, unreachable, draining or paused: try the next instance; a stream stuck on a
        // paused one is dropped, so coming back to it starts afresh.
        if (absl::IsDeadlineExceeded(status)) stream->Cancel();
        MoveOn(index);
      } else {
        return result(status);
      }
    }
    if (!PauseBeforeRetry(failures, deadline)) return result(status);
  }
}

absl::Time CacheStoreClient::AttemptDeadline(absl::Time deadline, size_t count) const {
  if (count <= 1) return deadline;
  const absl::Time now = absl::Now();
  const absl::Duration left = deadline - now;
  // Half of what is left (a paused instance leaves the other half for the next, however short
  // the caller's budget), not below a floor a live store answers within, nor above
  // attempt_timeout.
  const absl::Duration share = std::max(left / 2, std::min(left, kMinAttempt));
  return std::min(deadline, now + std::min(options_.attempt_timeout, share));
}

std::shared_ptr<CacheStoreClient::Endpoint> CacheStoreClient::Current(size_t* index,
                                                                      size_t* count) const {
  absl::MutexLock lock(&mu_);
  *index = current_;
  *count = endpoints_.size();
  return endpoints_[current_];
}

v1::CacheStore::Stub& CacheStoreClient::stub() {
  size_t index = 0, count = 0;
  return *Current(&index, &count)->stub;  // endpoints are never removed: the stub lives on
}

std::string CacheStoreClient::current_address() const {
  size_t index = 0, count = 0;
  return Current(&index, &count)->address;
}

void CacheStoreClient::NoteAnswered(size_t index, size_t count, const Endpoint& endpoint,
                                    int64_t term) {
  if (count <= 1) return;
  // Relaxed: a log line's order, nothing else. Read first: every successful call passes here,
  // and a write per call would bounce the line between the callers' cores.
  if (last_answered_.load(std::memory_order_relaxed) == index ||
      last_answered_.exchange(index, std::memory_order_relaxed) == index) {
    return;
  }
  // Once per switch of replica: when the calls reached a new leader (operators and the
  // namespace harness read it).
  KV_LOG(INFO) << "cachestore client: " << endpoint.address << " answers (term " << term << ")";
}

void CacheStoreClient::MoveOn(size_t index) {
  absl::MutexLock lock(&mu_);
  if (current_ == index) current_ = (index + 1) % endpoints_.size();
}

bool CacheStoreClient::Redirect(const std::string& address, size_t index) {
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < endpoints_.size(); ++i) {
    if (endpoints_[i]->address == address) {
      if (i == index) return false;
      current_ = i;
      return true;
    }
  }
  // A leader the list did not name (a replica set grown since): reach it too.
  if (endpoints_.size() >= 16) return false;
  absl::StatusOr<std::shared_ptr<Endpoint>> endpoint = MakeEndpoint(address, options_);
  if (!endpoint.ok()) return false;
  endpoints_.push_back(*std::move(endpoint));
  current_ = endpoints_.size() - 1;
  return true;
}

bool CacheStoreClient::AcceptTerm(int64_t term) {
  int64_t seen = max_term_.load(std::memory_order_acquire);
  while (term > seen) {
    // acq_rel: a term published here is what later calls compare against.
    if (max_term_.compare_exchange_weak(seen, term, std::memory_order_acq_rel)) return true;
  }
  return term >= seen;
}

void CacheStoreClient::NoteFailure(const absl::Status& status, size_t index) {
  std::optional<v1::ErrorInfo> info = proto::GetErrorInfo(status);
  if (!info.has_value() || info->reason() != v1::FAILURE_NOT_LEADER) return;
  if (info->address().empty() || !Redirect(info->address(), index)) MoveOn(index);
}

namespace {
int64_t TermOf(const grpc::ClientContext& ctx) {
  const auto& trailers = ctx.GetServerTrailingMetadata();
  auto it = trailers.find("kvrelay-store-term");
  if (it == trailers.end()) return 0;
  int64_t term = 0;
  if (!absl::SimpleAtoi(absl::string_view(it->second.data(), it->second.size()), &term)) return 0;
  return term;
}
}  // namespace

bool CacheStoreClient::FollowNotLeader(const v1::ErrorInfo& info, size_t index, int& failures) {
  if (info.address().empty() || !Redirect(info.address(), index)) {
    MoveOn(index);
    return false;
  }
  if (failures > 0) return false;
  ++failures;
  return true;  // straight to the leader it named
}

absl::Status CacheStoreClient::StaleTermRefusal(const Endpoint& endpoint, int64_t term) const {
  return proto::Attribute(absl::UnavailableError(absl::StrCat(
                              "cache store ", endpoint.address, " answered with term ", term,
                              ", older than term ", this->term(), " already seen: reply dropped")),
                          v1::ROLE_STORE, "", v1::FAILURE_NOT_LEADER);
}

template <typename Request, typename Response>
absl::Status CacheStoreClient::Invoke(
    grpc::Status (v1::CacheStore::Stub::*method)(grpc::ClientContext*, const Request&, Response*),
    const Request& request, Response* response, const CallOptions& call) {
  const absl::Time deadline = std::min(absl::Now() + options_.timeout, call.deadline);
  int failures = 0;
  // The last refusal by a store that does not lead: more telling than the deadline that ended
  // the last retry.
  absl::Status not_leader;
  auto result = [&not_leader](absl::Status status) {
    if (absl::IsDeadlineExceeded(status) && !not_leader.ok()) return not_leader;
    return status;
  };
  while (true) {
    size_t index = 0, count = 0;
    std::shared_ptr<Endpoint> endpoint = Current(&index, &count);
    grpc::ClientContext ctx;
    const absl::Time attempt_deadline = AttemptDeadline(deadline, count);
    ctx.set_deadline(absl::ToChronoTime(attempt_deadline));
    response->Clear();
    absl::Status status = FromGrpcStatus(((*endpoint->stub).*method)(&ctx, request, response));
    const int64_t term = TermOf(ctx);
    if (status.ok()) {
      if (AcceptTerm(term)) {
        NoteAnswered(index, count, *endpoint, term);
        return status;
      }
      // A store deposed since (it resumed after a pause): what it said is not the cluster's.
      status = StaleTermRefusal(*endpoint, term);
      response->Clear();
      not_leader = status;
      MoveOn(index);
    } else {
      std::optional<v1::ErrorInfo> info = proto::GetErrorInfo(status);
      const bool is_not_leader = info.has_value() && info->reason() == v1::FAILURE_NOT_LEADER;
      if (is_not_leader) {
        not_leader = status;
        if (FollowNotLeader(*info, index, failures)) continue;
      } else if (count > 1 && (absl::IsUnavailable(status) ||
                               (absl::IsDeadlineExceeded(status) && attempt_deadline < deadline))) {
        MoveOn(index);  // dead, unreachable, draining or paused: try the next instance
      } else {
        return result(status);
      }
    }
    if (!PauseBeforeRetry(failures, deadline)) return result(status);
  }
}

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

absl::Status CacheStoreClient::WaitForReady(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  // Any instance will do: calls find the leader from there.
  while (true) {
    size_t index = 0, count = 0;
    std::shared_ptr<Endpoint> endpoint = Current(&index, &count);
    const absl::Time attempt =
        count > 1 ? std::min(deadline, absl::Now() + absl::Milliseconds(200)) : deadline;
    if (endpoint->channel->WaitForConnected(absl::ToChronoTime(attempt))) return absl::OkStatus();
    if (absl::Now() >= deadline) break;
    MoveOn(index);
  }
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
  req.set_block_tokens(reg.block_tokens);
  return RegisterNode(req, call);
}

absl::StatusOr<v1::RegisterNodeResponse> CacheStoreClient::RegisterNode(
    const v1::RegisterNodeRequest& req_in, const CallOptions& call) {
  v1::RegisterNodeRequest req = req_in;
  const NodeIdentity me = node();
  if (req.node_id().empty()) req.set_node_id(me.node_id);
  if (req.incarnation() == 0 && req.node_id() == me.node_id) req.set_incarnation(me.incarnation);
  v1::RegisterNodeResponse resp;
  absl::Status s = Invoke(&v1::CacheStore::Stub::RegisterNode, req, &resp, call);
  if (!s.ok()) return s;
  return resp;
}

absl::Status CacheStoreClient::Deregister(const CallOptions& call) {
  const NodeIdentity me = node();
  v1::DeregisterNodeRequest req;
  req.set_node_id(me.node_id);
  req.set_incarnation(me.incarnation);
  v1::DeregisterNodeResponse resp;
  return Invoke(&v1::CacheStore::Stub::DeregisterNode, req, &resp, call);
}

absl::StatusOr<v1::HeartbeatResponse> CacheStoreClient::Heartbeat(const v1::NodeLoad* load,
                                                                  const CallOptions& call) {
  const NodeIdentity me = node();
  v1::HeartbeatRequest req;
  req.set_node_id(me.node_id);
  req.set_incarnation(me.incarnation);
  if (load != nullptr) *req.mutable_load() = *load;
  v1::HeartbeatResponse resp;
  absl::Status s = Invoke(&v1::CacheStore::Stub::Heartbeat, req, &resp, call);
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<bool> CacheStoreClient::Heartbeat(const std::string& node_id,
                                                 const CallOptions& call) {
  v1::HeartbeatRequest req;
  req.set_node_id(node_id);
  v1::HeartbeatResponse resp;
  absl::Status s = Invoke(&v1::CacheStore::Stub::Heartbeat, req, &resp, call);
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
    v1::AnnounceBlocksResponse resp;
    absl::Status s = Invoke(&v1::CacheStore::Stub::AnnounceBlocks, req, &resp, call);
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
  StampCaller(node(), req);
  v1::MatchPrefixResponse resp;
  absl::Status s = options_.lookup_stream
                       ? StreamedMatchPrefix(req, &resp, call)
                       : Invoke(&v1::CacheStore::Stub::MatchPrefix, req, &resp, call);
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
  v1::QueryPrefixRequest req;
  for (const kv::BlockHash& h : chain) ToProto(h, req.add_chain());
  v1::QueryPrefixResponse resp;
  absl::Status s = Invoke(&v1::CacheStore::Stub::QueryPrefix, req, &resp, call);
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<v1::AllocateResponse> CacheStoreClient::Allocate(const v1::AllocateRequest& req_in,
                                                                const CallOptions& call) {
  v1::AllocateRequest req = req_in;
  if (req.node_id().empty()) StampCaller(node(), req);
  v1::AllocateResponse resp;
  absl::Status s = Invoke(&v1::CacheStore::Stub::Allocate, req, &resp, call);
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
                                             const CallOptions& call,
                                             absl::Span<const int32_t> token_ids) {
  v1::CommitRequest req;
  req.set_allocation_id(allocation_id);
  for (const kv::BlockHash& h : hashes) ToProto(h, req.add_hashes());
  req.mutable_token_ids()->Add(token_ids.begin(), token_ids.end());
  StampCaller(node(), req);
  v1::CommitResponse resp;
  absl::Status s = Invoke(&v1::CacheStore::Stub::Commit, req, &resp, call);
  if (!s.ok()) return s;
  return resp.committed();
}

absl::Status CacheStoreClient::Abort(uint64_t allocation_id, const CallOptions& call) {
  v1::AbortRequest req;
  req.set_allocation_id(allocation_id);
  StampCaller(node(), req);
  v1::AbortResponse resp;
  return Invoke(&v1::CacheStore::Stub::Abort, req, &resp, call);
}

absl::Status CacheStoreClient::ReleaseLease(uint64_t lease_id, const CallOptions& call) {
  v1::ReleaseLeaseRequest req;
  req.set_lease_id(lease_id);
  StampCaller(node(), req);
  v1::ReleaseLeaseResponse resp;
  return Invoke(&v1::CacheStore::Stub::ReleaseLease, req, &resp, call);
}

absl::StatusOr<v1::ListNodesResponse> CacheStoreClient::ListNodes(const CallOptions& call) {
  v1::ListNodesResponse resp;
  absl::Status s = Invoke(&v1::CacheStore::Stub::ListNodes, v1::ListNodesRequest(), &resp, call);
  if (!s.ok()) return s;
  // The block size is in every block hash: with another one, no prefix would ever match.
  if (options_.block_tokens != 0 && resp.block_tokens() != 0 &&
      resp.block_tokens() != options_.block_tokens) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the cache store uses ", resp.block_tokens(), "-token KV blocks (--block-tokens ",
        resp.block_tokens(), ") but this process ", options_.block_tokens,
        "-token ones (--block-tokens ", options_.block_tokens,
        "): every process of a deployment must use the same --block-tokens"));
  }
  return resp;
}

absl::StatusOr<v1::StatsResponse> CacheStoreClient::Stats(const CallOptions& call) {
  v1::StatsResponse resp;
  absl::Status s = Invoke(&v1::CacheStore::Stub::Stats, v1::StatsRequest(), &resp, call);
  if (!s.ok()) return s;
  return resp;
}

absl::Status CacheStoreClient::WatchEvents(uint64_t from_sequence, absl::Duration timeout,
                                           const std::function<bool(const v1::Event&)>& on_event) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout));
  v1::WatchEventsRequest req;
  req.set_from_sequence(from_sequence);
  size_t index = 0, count = 0;
  std::shared_ptr<Endpoint> endpoint = Current(&index, &count);
  std::unique_ptr<grpc::ClientReader<v1::Event>> reader = endpoint->stub->WatchEvents(&ctx, req);
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
  absl::Status status = FromGrpcStatus(s);
  NoteFailure(status, index);  // the next watch goes to the leader
  if (count > 1 && absl::IsUnavailable(status)) MoveOn(index);
  return status;
}

}  // namespace kvrelay::cachestore

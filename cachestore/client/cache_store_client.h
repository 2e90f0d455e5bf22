#pragma once

// CacheStoreClient: the typed client of kvrelay.v1.CacheStore for prefill / decode workers and
// the gateway. Every call has a deadline: Options::timeout, or sooner when the call's
// CallOptions::deadline says so. Every call returns absl::Status / StatusOr converted from the
// gRPC status (codes, never message text, are what callers decide on).
//
// A worker's life with the store:
//
//   CacheStoreClient::Options o;
//   o.node = {CacheStoreClient::DefaultNodeId("prefill"), CacheStoreClient::NewIncarnation()};
//   auto store = CacheStoreClient::Connect("store:7000", o);        // no I/O yet
//   CacheStoreClient::Registration reg;                             // role, addresses, segments
//   reg.role = v1::NODE_ROLE_PREFILL; reg.grpc_address = "10.0.0.5:7100";
//   reg.transport_kind = "ucx"; reg.transport_address = "10.0.0.5:13337";
//   reg.segments.push_back(segment);                                // v1::Segment
//   KV_RETURN_IF_ERROR((*store)->Register(reg).status());  // ALREADY_EXISTS: id taken by a live
//                                                          // process: pick another id
//   every ttl/3:  Heartbeat(load) -> known=false: Register again, then Announce(...) what the
//                 segment still holds; FAILED_PRECONDITION: this incarnation was replaced: stop
//                 serving cached blocks and exit / re-register with a new incarnation.
//   per request:  MatchPrefix(chain, lease) -> Locations(resp) (each carries the holder's
//                 incarnation) ... ReleaseLease(lease_id);
//                 AllocateChain(chain, bytes) -> write blocks into the returned slots (always
//                 this node's segment) -> Commit(allocation_id) or Abort(allocation_id).
//   shutdown:     Deregister().
//
// The identity in Options::node (node_id + incarnation) is sent with every call that names a
// node: the store binds allocations and leases to it, so only this process can commit, abort
// or release them. A client without an identity (the gateway, tools) is anonymous: it can
// match, query, list and watch.
//
// Discovery (gateway): ListNodes() for role, gRPC address, data-plane address, load and
// liveness of every registered node, then WatchEvents(last_sequence + 1, ...) for
// KIND_NODE_JOINED / SUSPECT / LIVE / LEFT as they happen. A changed store_incarnation means
// the store restarted: list again.
//
// High availability (`kvrelay cachestore --etcd`, issue 20): `target` may list several store
// instances ("a:7000,b:7000,c:7000"). Calls go to the one believed to lead; an instance that
// does not lead answers UNAVAILABLE with ErrorInfo FAILURE_NOT_LEADER and the leader's address,
// and the call is retried there (an address not in the list is added); an instance that does not
// answer within its attempt's share of the call (Options::attempt_timeout, at most half of what
// is left), or refuses the connection, is skipped for the next, all within the call's deadline.
// Every reply of an HA store carries its term (trailing metadata kvrelay-store-term); the client
// keeps the highest term seen and drops a reply from an older one (a deposed leader that resumed)
// as UNAVAILABLE FAILURE_NOT_LEADER, trying elsewhere. A call that failed on a store that died may
// or may not have been applied there: writes are idempotent (Register, Heartbeat, Announce,
// Release) or bound to ids the new leader does not know (Commit/Abort of an allocation taken on the
// old one: NOT_FOUND, FAILURE_EXPIRED).
//
// Thread-safe (gRPC stubs are; SetNode may be called while other calls run).

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "cachestore/client/lookup_stream.h"
#include "common/server/credentials.h"
#include "kv/block_hash.h"
#include "kvrelay/v1/cachestore.grpc.pb.h"

namespace kvrelay::cachestore {

// A node process: its id and the random incarnation it picked at start.
struct NodeIdentity {
  std::string node_id;
  uint64_t incarnation = 0;
  bool empty() const { return node_id.empty(); }
};

// Per-call options. The effective deadline is min(now + Options::timeout, deadline).
struct CallOptions {
  absl::Time deadline = absl::InfiniteFuture();
};

class CacheStoreClient {
 public:
  struct Options {
    absl::Duration timeout = absl::Seconds(5);
    // Give this client its own TCP connection instead of sharing one with every other channel
    // to the same target in the process (gRPC's global subchannel pool).
    bool own_connection = false;
    // gRPC keepalive pings on the channel (server::MakeChannel), so a dead store or a cut link
    // is noticed even when no call is running.
    absl::Duration keepalive = absl::Seconds(10);
    server::SecurityOptions security;  // plain text unless TLS files are given
    // The calling node; empty for anonymous clients (gateway, tools).
    NodeIdentity node;
    // With several store instances: one attempt waits at most this long, and at most half of
    // what is left of the call's budget (at least 20 ms), before the next instance is tried (a
    // leader paused by SIGSTOP answers nobody). So a call fails over within its own budget,
    // however short the caller made it.
    absl::Duration attempt_timeout = absl::Seconds(1);
    // MatchPrefix goes over one MatchPrefixStream per store instance (opened on first use,
    // reopened after it ends); a store that does not know the RPC (UNIMPLEMENTED) gets unary
    // MatchPrefix from then on. False: unary calls always.
    bool lookup_stream = true;
    // Tokens per KV block this process uses; non-zero: ListNodes from a store with another
    // --block-tokens is FailedPrecondition naming both (a gateway discovering workers).
    int32_t block_tokens = 0;
  };
  // `target` is host:port, or several separated by commas (HA). Does not wait for the
  // connection.
  static absl::StatusOr<std::unique_ptr<CacheStoreClient>> Connect(const std::string& target,
                                                                   Options options);
  static absl::StatusOr<std::unique_ptr<CacheStoreClient>> Connect(const std::string& target) {
    return Connect(target, Options{});
  }

  // A client over a channel made elsewhere (server::MakeChannel: credentials and keepalive).
  static std::unique_ptr<CacheStoreClient> FromChannel(std::shared_ptr<grpc::Channel> channel,
                                                       Options options);
  // Ends the lookup streams (waits up to a second for each).
  ~CacheStoreClient();

  // A random non-zero incarnation (kernel CSPRNG); call once per process start.
  static uint64_t NewIncarnation();
  // "<role>-<hostname>-<8 random hex digits>": unique per process unless an id is configured.
  static std::string DefaultNodeId(std::string_view role);

  // Waits until the channel is ready or `timeout` passes (Unavailable then).
  absl::Status WaitForReady(absl::Duration timeout);

  NodeIdentity node() const;
  // Replaces the identity (e.g. the incarnation the store assigned to a legacy registration).
  void SetNode(NodeIdentity node);

  // --- Node lifecycle (need Options::node) ---
  struct Registration {
    v1::NodeRole role = v1::NODE_ROLE_UNSPECIFIED;
    std::string grpc_address;       // this node's gRPC service (host:port), for discovery
    std::string transport_kind;     // data plane, e.g. "ucx"
    std::string transport_address;  // data plane host:port
    std::vector<v1::Segment> segments;
    absl::Duration ttl = absl::Seconds(10);  // tolerate multi-second stalls
    // Tokens per KV block of the node's layout, checked by the store; 0: not said.
    int32_t block_tokens = 0;
  };
  // ALREADY_EXISTS: another live process holds the id. Idempotent for the same incarnation.
  absl::StatusOr<v1::RegisterNodeResponse> Register(const Registration& reg,
                                                    const CallOptions& call = {});
  // Raw form (legacy callers); fills node_id / incarnation from Options::node when empty.
  absl::StatusOr<v1::RegisterNodeResponse> RegisterNode(const v1::RegisterNodeRequest& req,
                                                        const CallOptions& call = {});
  absl::Status Deregister(const CallOptions& call = {});
  // known=false: register again (then Announce). FAILED_PRECONDITION: replaced.
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::NodeLoad* load = nullptr,
                                                  const CallOptions& call = {});
  // Legacy form: heartbeat for `node_id` without an incarnation; false = must register.
  absl::StatusOr<bool> Heartbeat(const std::string& node_id, const CallOptions& call = {});
  // Re-announces blocks this node still holds in `segment_id`, parents first; sent in batches
  // of at most 4096 (counts summed; rejected indices refer to `blocks`).
  absl::StatusOr<v1::AnnounceBlocksResponse> Announce(const std::string& segment_id,
                                                      absl::Span<const v1::AnnouncedBlock> blocks,
                                                      const CallOptions& call = {});

  // --- Lookups ---
  // With lease_ttl > 0 the matched blocks are pinned under a lease bound to this node (if any).
  // On the instance's lookup stream unless Options::lookup_stream is false; the answer, the
  // status codes and their ErrorInfo, leader-following and the term check are the unary call's.
  absl::StatusOr<v1::MatchPrefixResponse> MatchPrefix(
      absl::Span<const kv::BlockHash> chain, absl::Duration lease_ttl = absl::ZeroDuration(),
      const CallOptions& call = {});
  absl::StatusOr<v1::QueryPrefixResponse> QueryPrefix(absl::Span<const kv::BlockHash> chain,
                                                      const CallOptions& call = {});
  absl::Status ReleaseLease(uint64_t lease_id, const CallOptions& call = {});

  // --- Writes ---
  // Fills node_id / incarnation from Options::node when empty.
  absl::StatusOr<v1::AllocateResponse> Allocate(const v1::AllocateRequest& req,
                                                const CallOptions& call = {});
  // Allocates a chain: block i's parent is block i-1 (block 0's is `first_parent`). With an
  // identity and no preferred_node, blocks go into this node's own segments (evicting there).
  absl::StatusOr<v1::AllocateResponse> AllocateChain(absl::Span<const kv::BlockHash> chain,
                                                     uint64_t size_bytes,
                                                     kv::BlockHash first_parent = {},
                                                     const std::string& preferred_node = "",
                                                     const CallOptions& call = {});
  // `token_ids`: the tokens of `hashes` (block_tokens per hash, in order), for the store's KV
  // events; optional.
  absl::StatusOr<int> Commit(uint64_t allocation_id, absl::Span<const kv::BlockHash> hashes = {},
                             const CallOptions& call = {},
                             absl::Span<const int32_t> token_ids = {});
  absl::Status Abort(uint64_t allocation_id, const CallOptions& call = {});

  // --- Discovery and monitoring ---
  absl::StatusOr<v1::ListNodesResponse> ListNodes(const CallOptions& call = {});
  absl::StatusOr<v1::StatsResponse> Stats(const CallOptions& call = {});
  // Streams events from `from_sequence` until `on_event` returns false, the stream ends or
  // `timeout` passes (then OK). OutOfRange when from_sequence is no longer retained or is
  // ahead of the store (it restarted without its log).
  absl::Status WatchEvents(uint64_t from_sequence, absl::Duration timeout,
                           const std::function<bool(const v1::Event&)>& on_event);

  // The stub of the instance calls go to now (tests that send hand-made requests).
  v1::CacheStore::Stub& stub();

  // The highest store term seen in a reply (0: none, or a store without --etcd).
  int64_t term() const { return max_term_.load(std::memory_order_acquire); }
  // The address calls go to now.
  std::string current_address() const;

  // MatchPrefix asks for the columnar answer; this expands it: result[i] = locations of chain
  // block i (with the holder's incarnation).
  static std::vector<std::vector<v1::BlockLocation>> Locations(const v1::MatchPrefixResponse& resp);

  static void ToProto(const kv::BlockHash& h, v1::BlockHash* out) {
    out->set_hi(h.hi);
    out->set_lo(h.lo);
  }
  static kv::BlockHash FromProto(const v1::BlockHash& h) { return kv::BlockHash{h.hi(), h.lo()}; }

 private:
  struct Endpoint {
    std::string address;  // "" for a channel made elsewhere
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<v1::CacheStore::Stub> stub;
    // The instance answered MatchPrefixStream with UNIMPLEMENTED: unary MatchPrefix only.
    std::atomic<bool> no_lookup_stream{false};
    absl::Mutex lookup_mu;
    std::shared_ptr<LookupStream> lookup ABSL_GUARDED_BY(lookup_mu);
    // Ended streams gRPC has not finished yet: kept until it has (see LookupStream).
    std::vector<std::shared_ptr<LookupStream>> ended ABSL_GUARDED_BY(lookup_mu);
  };
  CacheStoreClient(std::vector<std::shared_ptr<Endpoint>> endpoints, Options options);
  static absl::StatusOr<std::shared_ptr<Endpoint>> MakeEndpoint(const std::string& address,
                                                                const Options& options);
  // One unary call with leader-following, retries and the term check (see the class comment).
  template <typename Request, typename Response>
  absl::Status Invoke(grpc::Status (v1::CacheStore::Stub::*method)(grpc::ClientContext*,
                                                                   const Request&, Response*),
                      const Request& request, Response* response, const CallOptions& call);
  std::shared_ptr<Endpoint> Current(size_t* index, size_t* count) const;
  // One attempt's deadline within the call's `deadline` with `count` instances known (see
  // Options::attempt_timeout).
  absl::Time AttemptDeadline(absl::Time deadline, size_t count) const;
  // MatchPrefix on the lookup streams, with Invoke's leader-following and term check.
  absl::Status StreamedMatchPrefix(const v1::MatchPrefixRequest& request,
                                   v1::MatchPrefixResponse* response, const CallOptions& call);
  // The endpoint's open lookup stream, a new one when it has none or it ended.
  static std::shared_ptr<LookupStream> LookupStreamOf(Endpoint& endpoint);
  // Calls go to the instance after `index` next (unless another call moved on already).
  void MoveOn(size_t index);
  // A call succeeded at instance `index` of `count`: logs when that is another replica than
  // the last success's.
  void NoteAnswered(size_t index, size_t count, const Endpoint& endpoint, int64_t term);
  // Calls go to `address` next (added when not known). False when it is `index` itself.
  bool Redirect(const std::string& address, size_t index);
  // After a FAILURE_NOT_LEADER answer from instance `index`: follows the leader it named (true:
  // retry at once, the first time only) or moves on to the next instance (false).
  bool FollowNotLeader(const v1::ErrorInfo& info, size_t index, int& failures);
  // A reply from `endpoint` carrying `term`, older than one already seen: refused, as the
  // store that sent it no longer leads.
  absl::Status StaleTermRefusal(const Endpoint& endpoint, int64_t term) const;
  // Records `term` from a reply; false when it is older than one already seen.
  bool AcceptTerm(int64_t term);
  // After a stream or call ended: follow a FAILURE_NOT_LEADER redirect for the next call.
  void NoteFailure(const absl::Status& status, size_t index);

  const Options options_;
  mutable absl::Mutex mu_;
  NodeIdentity node_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<Endpoint>> endpoints_ ABSL_GUARDED_BY(mu_);
  size_t current_ ABSL_GUARDED_BY(mu_) = 0;
  // The replica that answered the last successful call (NoteAnswered).
  std::atomic<size_t> last_answered_{~size_t{0}};
  std::atomic<int64_t> max_term_{0};
};

}  // namespace kvrelay::cachestore

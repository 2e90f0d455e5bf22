#pragma once

// CacheStoreService: the thin gRPC glue for kvrelay.v1.CacheStore. It validates every field
// (size limits answered with INVALID_ARGUMENT / RESOURCE_EXHAUSTED naming the field), converts
// proto <-> domain, calls the CacheStore and records per-RPC latency and errors in the server's
// MetricsRegistry, where it also registers the store's own counters and gauges (read at each
// scrape), so the store's /metrics comes from the one renderer like every other server's.
//
// Thread-safe: gRPC's sync server calls handlers from its thread pool, and MatchPrefix and
// MatchPrefixStream, the lookups on every request's path, from its callback threads.

#include <array>
#include <atomic>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "cachestore/cache_store.h"
#include "cachestore/limits.h"
#include "cachestore/server/leadership.h"
#include "common/metrics.h"
#include "common/server/auth.h"
#include "kvrelay/v1/cachestore.grpc.pb.h"

namespace kvrelay::cachestore::server {

// The bounds live in cachestore/limits.h; the store and the service share one instance.
using Limits = ::kvrelay::cachestore::Limits;

class CacheStoreService final : public kvrelay::v1::CacheStore::WithCallbackMethod_MatchPrefix<
                                    kvrelay::v1::CacheStore::WithCallbackMethod_MatchPrefixStream<
                                        kvrelay::v1::CacheStore::Service>> {
 public:
  // `store` and `metrics` are not owned and must outlive the service. `authorizer` checks every
  // RPC against common/server/auth.h's table (the default checks nothing: --insecure).
  // `leadership` (not owned, outlives the service; null without --etcd): every RPC but Stats is
  // refused with FAILURE_NOT_LEADER unless this instance leads, checked before and after the
  // work, and every reply carries the term in kTermMetadataKey trailing metadata.
  CacheStoreService(CacheStore* store, Limits limits, MetricsRegistry* metrics,
                    kvrelay::server::Authorizer authorizer = {},
                    const Leadership* leadership = nullptr);

  grpc::Status RegisterNode(grpc::ServerContext* ctx, const v1::RegisterNodeRequest* req,
                            v1::RegisterNodeResponse* resp) override;
  grpc::Status DeregisterNode(grpc::ServerContext* ctx, const v1::DeregisterNodeRequest* req,
                              v1::DeregisterNodeResponse* resp) override;
  grpc::Status Heartbeat(grpc::ServerContext* ctx, const v1::HeartbeatRequest* req,
                         v1::HeartbeatResponse* resp) override;
  grpc::Status AnnounceBlocks(grpc::ServerContext* ctx, const v1::AnnounceBlocksRequest* req,
                              v1::AnnounceBlocksResponse* resp) override;
  grpc::Status ListNodes(grpc::ServerContext* ctx, const v1::ListNodesRequest* req,
                         v1::ListNodesResponse* resp) override;
  // On gRPC's callback API: answered on the thread that read the request, with no hand-off to
  // a sync-server thread (~35% less store CPU per lookup than the sync form; README.md).
  grpc::ServerUnaryReactor* MatchPrefix(grpc::CallbackServerContext* ctx,
                                        const v1::MatchPrefixRequest* req,
                                        v1::MatchPrefixResponse* resp) override;
  // Lookups on one long-lived stream, answered in order on gRPC's callback threads
  // (match_prefix_stream.cc): the caller's role checked when it opens, everything else per
  // lookup exactly as MatchPrefix checks it; one lookup in flight per stream.
  grpc::ServerBidiReactor<v1::MatchPrefixStreamRequest, v1::MatchPrefixStreamResponse>*
  MatchPrefixStream(grpc::CallbackServerContext* ctx) override;
  // The same handler, for in-process callers (the RPC fuzzer); gRPC never calls this one.
  grpc::Status MatchPrefix(grpc::ServerContext* ctx, const v1::MatchPrefixRequest* req,
                           v1::MatchPrefixResponse* resp) override;
  grpc::Status QueryPrefix(grpc::ServerContext* ctx, const v1::QueryPrefixRequest* req,
                           v1::QueryPrefixResponse* resp) override;
  grpc::Status Allocate(grpc::ServerContext* ctx, const v1::AllocateRequest* req,
                        v1::AllocateResponse* resp) override;
  grpc::Status Commit(grpc::ServerContext* ctx, const v1::CommitRequest* req,
                      v1::CommitResponse* resp) override;
  grpc::Status Abort(grpc::ServerContext* ctx, const v1::AbortRequest* req,
                     v1::AbortResponse* resp) override;
  grpc::Status ReleaseLease(grpc::ServerContext* ctx, const v1::ReleaseLeaseRequest* req,
                            v1::ReleaseLeaseResponse* resp) override;
  grpc::Status Stats(grpc::ServerContext* ctx, const v1::StatsRequest* req,
                     v1::StatsResponse* resp) override;
  grpc::Status WatchEvents(grpc::ServerContext* ctx, const v1::WatchEventsRequest* req,
                           grpc::ServerWriter<v1::Event>* writer) override;

  // Makes WatchEvents and MatchPrefixStream streams end (server shutdown); new lookup streams
  // are refused with UNAVAILABLE.
  void StopStreams();

  // At most this many MatchPrefixStream streams are open at once (RESOURCE_EXHAUSTED beyond).
  static constexpr int kMaxLookupStreams = 4096;

 private:
  class MatchStream;  // match_prefix_stream.cc
  enum Rpc {
    kRegister,
    kHeartbeat,
    kMatch,
    kQuery,
    kAllocate,
    kCommit,
    kAbort,
    kRelease,
    kStats,
    kWatch,
    kDeregister,
    kAnnounce,
    kListNodes,
    kMatchStream,
    kNumRpcs
  };
  // node_id + incarnation of a request that names its caller. `required`: node_id must be set.
  grpc::Status ParseCaller(const std::string& node_id, uint64_t incarnation, bool required,
                           Caller* out) const;
  // The store's failure with kvrelay.v1.ErrorInfo attached: identity errors name the node they
  // are about (FAILURE_IDENTITY), bad input is the client's, the rest the store's. `ids_expire`:
  // NOT_FOUND means an allocation or lease id that expired (FAILURE_EXPIRED).
  grpc::Status Fail(absl::Status status, bool ids_expire = false) const;
  static const char* RpcName(int rpc);
  // OK when the caller's certificate may make `rpc` (as `node_id`, for node-scoped RPCs).
  grpc::Status Authorize(grpc::ServerContextBase* ctx, Rpc rpc, const std::string& node_id) const;
  grpc::Status MatchPrefixImpl(grpc::ServerContextBase* ctx, const v1::MatchPrefixRequest* req,
                               v1::MatchPrefixResponse* resp);
  // One lookup, as both forms serve it (authorized as `rpc` for the request's node id). `term`:
  // set to the term it was decided under once this instance was found leading.
  // `not_leader`: it failed because this instance does not lead, or stopped leading meanwhile.
  grpc::Status MatchPrefixCore(grpc::ServerContextBase* ctx, Rpc rpc,
                               const v1::MatchPrefixRequest& req, v1::MatchPrefixResponse* resp,
                               std::optional<int64_t>* term, bool* not_leader);
  // OK (and the term in the trailing metadata) while this instance leads.
  grpc::Status Lead(grpc::ServerContextBase* ctx, int64_t* term) const;
  // OK (and the term) while this instance leads; 0 without leadership.
  grpc::Status CurrentTerm(int64_t* term) const;
  // OK when this instance still leads with `term` after doing the work.
  grpc::Status Served(int64_t term) const;
  // The kvrelay:cachestore_* families: RPC latency and errors, the store's counters and gauges.
  void RegisterMetrics(MetricsRegistry* metrics);

  CacheStore* const store_;
  const Limits limits_;
  const kvrelay::server::Authorizer authorizer_;
  const Leadership* const leadership_;
  std::array<Histogram*, kNumRpcs> latency_{};  // owned by the registry
  std::array<Counter*, kNumRpcs> errors_{};
  // MatchPrefixStream messages read, a batch of lookups counting once (lookups per message =
  // the MatchPrefixStream latency count over this).
  Counter* stream_messages_ = nullptr;
  // Release/acquire pair: StopStreams() publishes, WatchEvents loops and lookup streams observe.
  std::atomic<bool> stopping_{false};
  // Open lookup streams (each removes itself in OnDone), so StopStreams can end them.
  absl::Mutex streams_mu_;
  absl::flat_hash_set<MatchStream*> streams_ ABSL_GUARDED_BY(streams_mu_);
};

}  // namespace kvrelay::cachestore::server

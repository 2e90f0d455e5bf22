#pragma once

// CacheStoreClient: a small typed wrapper over the kvrelay.v1.CacheStore stub for prefill /
// decode workers and the gateway. Every call has a deadline (Options::timeout unless given) and
// returns absl::Status / StatusOr converted from the gRPC status.
//
// Thread-safe (gRPC stubs are); one client per process per cache store is enough.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/server/credentials.h"
#include "kv/block_hash.h"
#include "kvrelay/v1/cachestore.grpc.pb.h"

namespace kvrelay::cachestore {

class CacheStoreClient {
 public:
  struct Options {
    absl::Duration timeout = absl::Seconds(5);
    // Give this client its own TCP connection instead of sharing one with every other channel
    // to the same target in the process (gRPC's global subchannel pool).
    bool own_connection = false;
    server::SecurityOptions security;  // plain text unless TLS files are given
  };
  // `target` is host:port. Does not wait for the connection.
  static absl::StatusOr<std::unique_ptr<CacheStoreClient>> Connect(const std::string& target,
                                                                   Options options);
  static absl::StatusOr<std::unique_ptr<CacheStoreClient>> Connect(const std::string& target) {
    return Connect(target, Options{});
  }

  // A client over a channel made elsewhere (server::MakeChannel: credentials and keepalive).
  static std::unique_ptr<CacheStoreClient> FromChannel(std::shared_ptr<grpc::Channel> channel,
                                                       Options options);

  // Waits until the channel is ready or `timeout` passes (Unavailable then).
  absl::Status WaitForReady(absl::Duration timeout);

  absl::StatusOr<v1::RegisterNodeResponse> RegisterNode(const v1::RegisterNodeRequest& req);
  // False when the server does not know the node (it must register again).
  absl::StatusOr<bool> Heartbeat(const std::string& node_id);
  absl::StatusOr<v1::MatchPrefixResponse> MatchPrefix(absl::Span<const kv::BlockHash> chain,
                                                      absl::Duration lease_ttl = absl::ZeroDuration());
  absl::StatusOr<v1::QueryPrefixResponse> QueryPrefix(absl::Span<const kv::BlockHash> chain);
  absl::StatusOr<v1::AllocateResponse> Allocate(const v1::AllocateRequest& req);
  // Allocates a chain: block i's parent is block i-1 (block 0's is `first_parent`).
  absl::StatusOr<v1::AllocateResponse> AllocateChain(absl::Span<const kv::BlockHash> chain,
                                                     uint64_t size_bytes,
                                                     kv::BlockHash first_parent = {},
                                                     const std::string& preferred_node = "");
  absl::StatusOr<int> Commit(uint64_t allocation_id, absl::Span<const kv::BlockHash> hashes = {});
  absl::Status Abort(uint64_t allocation_id);
  absl::Status ReleaseLease(uint64_t lease_id);
  absl::StatusOr<v1::StatsResponse> Stats();
  // Streams events from `from_sequence` until `on_event` returns false, the stream ends or
  // `timeout` passes (then OK). OutOfRange when from_sequence is no longer retained.
  absl::Status WatchEvents(uint64_t from_sequence, absl::Duration timeout,
                           const std::function<bool(const v1::Event&)>& on_event);

  v1::CacheStore::Stub& stub() { return *stub_; }

  // MatchPrefix asks for the columnar answer; this expands it: result[i] = locations of chain
  // block i.
  static std::vector<std::vector<v1::BlockLocation>> Locations(
      const v1::MatchPrefixResponse& resp);

  static void ToProto(const kv::BlockHash& h, v1::BlockHash* out) {
    out->set_hi(h.hi);
    out->set_lo(h.lo);
  }
  static kv::BlockHash FromProto(const v1::BlockHash& h) { return kv::BlockHash{h.hi(), h.lo()}; }

 private:
  CacheStoreClient(std::shared_ptr<grpc::Channel> channel, Options options);
  void SetDeadline(grpc::ClientContext* ctx) const;

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::CacheStore::Stub> stub_;
  Options options_;
};

}  // namespace kvrelay::cachestore

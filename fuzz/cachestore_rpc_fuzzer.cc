// The cache store's RPC handlers (cachestore/server/service.cc: each request's validation, then
// the store itself), called in-process on a fresh store per input, as a sequence of calls:
//   repeat { u8 call | u16 little-endian length | that many bytes of the request's protobuf }
// Calls: RegisterNode, Heartbeat, AnnounceBlocks, MatchPrefix, QueryPrefix, Allocate, Commit,
// Abort, ReleaseLease, DeregisterNode, ListNodes, Stats, and a WatchEvents resumption
// (CacheStore::EventsSince from the request's from_sequence: the path of issue 13.5's crash),
// and a tick of the simulated clock. Any sanitizer report or crash is a bug.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

#include "cachestore/cache_store.h"
#include "cachestore/server/service.h"
#include "common/clock.h"
#include "common/metrics.h"
#include "grpcpp/server_context.h"

namespace {

namespace v1 = ::kvrelay::v1;
using ::kvrelay::cachestore::server::CacheStoreService;

template <typename Request, typename Response, typename Method>
void Call(CacheStoreService& service, Method method, std::string_view bytes) {
  Request request;
  if (!request.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) return;
  Response response;
  grpc::ServerContext context;  // no deadline
  (void)(service.*method)(&context, &request, &response);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvrelay::SimulatedClock clock;
  kvrelay::cachestore::CacheStoreOptions options;
  options.clock = &clock;
  options.event_retention = 64;  // small, so that resumption past the retained events is hit
  // The default (adaptive) policy sizes its admission history for a million slots and starts a
  // learner thread per store: 167 inputs in 20 s. The RPC handlers under test are the same.
  options.policy = "lrfu";
  absl::StatusOr<std::unique_ptr<kvrelay::cachestore::CacheStore>> store =
      kvrelay::cachestore::CacheStore::Create(options);
  if (!store.ok()) __builtin_trap();
  kvrelay::MetricsRegistry metrics;
  CacheStoreService service(store->get(), kvrelay::cachestore::Limits{}, &metrics);
  std::string_view in(reinterpret_cast<const char*>(data), size);
  for (int calls = 0; in.size() >= 3 && calls < 64; ++calls) {
    const uint8_t call = static_cast<uint8_t>(in[0]);
    const size_t len = static_cast<uint8_t>(in[1]) | (static_cast<size_t>(in[2]) << 8);
    in.remove_prefix(3);
    const std::string_view bytes = in.substr(0, len);
    in.remove_prefix(bytes.size());
    switch (call % 14) {
      case 0:
        Call<v1::RegisterNodeRequest, v1::RegisterNodeResponse>(
            service, &CacheStoreService::RegisterNode, bytes);
        break;
      case 1:
        Call<v1::HeartbeatRequest, v1::HeartbeatResponse>(service, &CacheStoreService::Heartbeat,
                                                          bytes);
        break;
      case 2:
        Call<v1::AnnounceBlocksRequest, v1::AnnounceBlocksResponse>(
            service, &CacheStoreService::AnnounceBlocks, bytes);
        break;
      case 3:
        // The sync-shaped overload (gRPC itself calls the callback one).
        Call<v1::MatchPrefixRequest, v1::MatchPrefixResponse>(
            service,
            static_cast<grpc::Status (CacheStoreService::*)(
                grpc::ServerContext*, const v1::MatchPrefixRequest*, v1::MatchPrefixResponse*)>(
                &CacheStoreService::MatchPrefix),
            bytes);
        break;
      case 4:
        Call<v1::QueryPrefixRequest, v1::QueryPrefixResponse>(
            service, &CacheStoreService::QueryPrefix, bytes);
        break;
      case 5:
        Call<v1::AllocateRequest, v1::AllocateResponse>(service, &CacheStoreService::Allocate,
                                                        bytes);
        break;
      case 6:
        Call<v1::CommitRequest, v1::CommitResponse>(service, &CacheStoreService::Commit, bytes);
        break;
      case 7:
        Call<v1::AbortRequest, v1::AbortResponse>(service, &CacheStoreService::Abort, bytes);
        break;
      case 8:
        Call<v1::ReleaseLeaseRequest, v1::ReleaseLeaseResponse>(
            service, &CacheStoreService::ReleaseLease, bytes);
        break;
      case 9:
        Call<v1::DeregisterNodeRequest, v1::DeregisterNodeResponse>(
            service, &CacheStoreService::DeregisterNode, bytes);
        break;
      case 10:
        Call<v1::ListNodesRequest, v1::ListNodesResponse>(service, &CacheStoreService::ListNodes,
                                                          bytes);
        break;
      case 11:
        Call<v1::StatsRequest, v1::StatsResponse>(service, &CacheStoreService::Stats, bytes);
        break;
      case 12: {
        v1::WatchEventsRequest request;
        if (!request.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) break;
        // WatchEvents' resumption read, without waiting for new events.
        (void)(*store)->EventsSince(request.from_sequence(), 1024, absl::InfinitePast());
        break;
      }
      case 13:
        clock.Advance(absl::Seconds(1 + (bytes.empty() ? 0 : static_cast<uint8_t>(bytes[0]))));
        (*store)->Tick();
        break;
    }
  }
  return 0;
}

// The gateway's holdings lookup against a cache store that takes every call and never answers
// (a real gRPC server on loopback): the first lookup waits its bounded time once and routing
// goes on without holdings; the next ones return at once while the store's gate is open; after
// the cool-down one lookup probes, bounded by the short probe limit, and a failed probe doubles
// the cool-down. The gate's time is a SimulatedClock.

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "cachestore/client/cache_store_client.h"
#include "common/clock.h"
#include "common/dependency_gate.h"
#include "common/metrics.h"
#include "gateway/worker_set.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/testing/silent_server.h"
#include "tests/testing/status_matchers.h"

namespace kvrelay::gateway {
namespace {

using State = DependencyGate::State;

using ::kvrelay::testing::SilentServer;

TEST(WorkerSetStoreGate, AStoreThatDoesNotAnswerIsWaitedOnOnceThenSkippedUntilAProbe) {
  SilentServer silent;
  KV_ASSERT_OK_AND_ASSIGN(std::unique_ptr<cachestore::CacheStoreClient> store,
                          cachestore::CacheStoreClient::Connect(silent.address()));
  SimulatedClock breakers, gate_clock;
  MetricsRegistry metrics;
  WorkerSetOptions options;
  options.route_timeout = absl::Milliseconds(200);
  options.store_backoff = absl::Milliseconds(250);
  options.store_backoff_max = absl::Seconds(1);
  options.store_probe_timeout = absl::Milliseconds(50);
  options.store_gate_clock = &gate_clock;
  options.metrics = &metrics;
  WorkerSet set(options, &breakers, store.get(), {});
  const std::vector<kv::BlockHash> chain = {{1, 2}, {3, 4}};
  const absl::Time request_deadline = absl::Now() + absl::Minutes(1);

  // The one bounded wait (route_timeout, not the request's minute): no holdings, and the
  // request's prefill is told to skip its own lookup.
  WorkerSet::PrefixHoldings first = set.Holdings(chain, request_deadline);
  EXPECT_TRUE(first.held.empty());
  EXPECT_TRUE(first.store_unreachable);
  EXPECT_EQ(set.store_gate().state(), State::kOpen);
  // Then no call: the lookup is skipped, routing goes by load alone (prefills skip theirs).
  EXPECT_TRUE(set.Holdings(chain, request_deadline).store_unreachable);
  EXPECT_TRUE(set.Holdings(chain, request_deadline).held.empty());
  EXPECT_EQ(set.store_gate().fast_failures(), 2);
  EXPECT_NE(metrics.RenderText().find(
                "kvrelay:dependency_fast_failures_total{dependency=\"cachestore\"} 2"),
            std::string::npos)
      << metrics.RenderText();
  // After the cool-down one lookup probes, still unanswered: the cool-down doubles.
  gate_clock.Advance(absl::Milliseconds(250));
  EXPECT_EQ(set.store_gate().state(), State::kHalfOpen);
  EXPECT_TRUE(set.Holdings(chain, request_deadline).held.empty());
  EXPECT_EQ(set.store_gate().state(), State::kOpen);
  EXPECT_EQ(set.store_gate().cooldown(), absl::Milliseconds(500));
  EXPECT_EQ(set.store_gate().fast_failures(), 2);
}

// A request with no time left says nothing about the store: the gate stays closed.
TEST(WorkerSetStoreGate, ARequestOutOfTimeLeavesTheGateClosed) {
  SilentServer silent;
  KV_ASSERT_OK_AND_ASSIGN(std::unique_ptr<cachestore::CacheStoreClient> store,
                          cachestore::CacheStoreClient::Connect(silent.address()));
  SimulatedClock breakers, gate_clock;
  WorkerSetOptions options;
  options.route_timeout = absl::Seconds(10);
  options.store_gate_clock = &gate_clock;
  WorkerSet set(options, &breakers, store.get(), {});
  WorkerSet::PrefixHoldings holdings = set.Holdings({{1, 2}}, absl::Now() + absl::Milliseconds(50));
  EXPECT_TRUE(holdings.held.empty());
  EXPECT_FALSE(holdings.store_unreachable);
  EXPECT_EQ(set.store_gate().state(), State::kClosed);
}

}  // namespace
}  // namespace kvrelay::gateway

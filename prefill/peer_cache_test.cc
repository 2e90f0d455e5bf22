// PeerCache over two real UCX transports in one process.

#include "prefill/peer_cache.h"

#include <memory>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"
#include "transfer/ucx/ucx_transport.h"

namespace kvrelay::prefill {
namespace {

// A burst of requests to a worker with no live connection (after a fault) opens one
// connection, not one each: each extra one held UCX connections until the next fault.
TEST(PeerCacheTest, ABurstOfCallersSharesOneConnect) {
  KV_ASSERT_OK_AND_ASSIGN(transfer::TransportPtr server, transfer::MakeUcxTransport());
  KV_ASSERT_OK_AND_ASSIGN(transfer::TransportPtr client, transfer::MakeUcxTransport());
  PeerCache cache(client.get());
  constexpr int kCallers = 16;
  std::vector<absl::StatusOr<transfer::PeerId>> got(kCallers);
  std::vector<std::thread> callers;
  for (int i = 0; i < kCallers; ++i) {
    callers.emplace_back(
        [&, i] { got[i] = cache.Get(server->address(), "", absl::Now() + absl::Seconds(30)); });
  }
  for (std::thread& t : callers) t.join();
  for (int i = 0; i < kCallers; ++i) {
    KV_ASSERT_OK(got[i].status()) << "caller " << i;
    EXPECT_EQ(*got[i], *got[0]) << "caller " << i;
  }
  EXPECT_EQ(client->Peers().size(), 1u);
  // A later caller reuses it.
  KV_ASSERT_OK_AND_ASSIGN(transfer::PeerId again,
                          cache.Get(server->address(), "", absl::Now() + absl::Seconds(30)));
  EXPECT_EQ(again, *got[0]);
}

// Waiters share the connect's failure rather than dialing again at once; the next call dials.
TEST(PeerCacheTest, WaitersShareAFailedConnect) {
  KV_ASSERT_OK_AND_ASSIGN(transfer::TransportPtr client, transfer::MakeUcxTransport());
  PeerCache cache(client.get());
  std::vector<absl::StatusOr<transfer::PeerId>> got(4);
  std::vector<std::thread> callers;
  for (int i = 0; i < 4; ++i) {
    callers.emplace_back([&, i] {
      // Port 1 on loopback: nothing listens, the connect is refused.
      got[i] = cache.Get("127.0.0.1:1", "", absl::Now() + absl::Seconds(10));
    });
  }
  for (std::thread& t : callers) t.join();
  for (int i = 0; i < 4; ++i) EXPECT_FALSE(got[i].ok()) << "caller " << i;
  EXPECT_TRUE(client->Peers().empty());
  EXPECT_FALSE(cache.Get("127.0.0.1:1", "", absl::Now() + absl::Seconds(10)).ok());
}

}  // namespace
}  // namespace kvrelay::prefill

// StoreLink's request-path calls against a real cache store (gRPC on loopback) and against one
// that never answers. Here and not beside store_link.cc because it needs a gRPC server, which
// the worker library does not link.

#include "worker/store_link.h"

#include <signal.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "cachestore/cache_store.h"
#include "cachestore/client/cache_store_client.h"
#include "cachestore/server/service.h"
#include "common/metrics.h"
#include "common/server/service_host.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kv/presets.h"
#include "proto/grpc_status.h"
#include "tests/testing/process_harness.h"
#include "tests/testing/silent_server.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"
#include "transfer/inproc/in_process_transport.h"
#include "worker/disk_cache.h"
#include "worker/kv_memory.h"

namespace kvrelay::worker {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using testing::IsOk;
using testing::StatusIs;

std::vector<kv::BlockHash> Chain(int n) {
  std::vector<kv::BlockHash> chain;
  for (int i = 0; i < n; ++i) chain.push_back({0x1000u + i, 0x2000u + i});
  return chain;
}

using ::kvrelay::testing::WaitStopped;

using ::kvrelay::testing::SilentServer;

class StoreLinkTest : public ::testing::Test {
 protected:
  void SetUp() override {
    KV_ASSERT_OK_AND_ASSIGN(store_, cachestore::CacheStore::Create({}));
    service_ = std::make_unique<cachestore::server::CacheStoreService>(
        store_.get(), cachestore::server::Limits{}, &metrics_);
    kvrelay::server::ServiceHostOptions host;
    host.name = "cachestore";
    KV_ASSERT_OK_AND_ASSIGN(host_,
                            kvrelay::server::ServiceHost::Start(host, {service_.get()}, nullptr));
    KV_ASSERT_OK_AND_ASSIGN(transport_, transfer::MakeInProcessTransport());
    KV_ASSERT_OK_AND_ASSIGN(segment_, CacheSegment::Create(layout_, 8, transport_.get()));
  }

  StoreLinkOptions Options(const std::string& address) const {
    StoreLinkOptions options;
    options.cachestore_address = address;
    options.node_id = "prefill-0";
    options.incarnation = 7;
    options.role = kvrelay::v1::NODE_ROLE_PREFILL;
    options.transport_kind = "inproc";
    options.transport_address = transport_->address();
    options.block_tokens = layout_.block_tokens();
    return options;
  }

  // Writes nothing but succeeds: the bytes do not matter to the store.
  static absl::Status WriteNothing(int64_t, int64_t) { return absl::OkStatus(); }

  const kv::ModelLayout layout_ = kv::LoadPreset("tiny-llama")->layout;
  MetricsRegistry metrics_;
  std::unique_ptr<cachestore::CacheStore> store_;
  std::unique_ptr<cachestore::server::CacheStoreService> service_;
  std::unique_ptr<kvrelay::server::ServiceHost> host_;
  transfer::TransportPtr transport_;
  std::unique_ptr<CacheSegment> segment_;
};

// A committed block whose cache slot the store hands to another block is demoted to the node's
// disk tier, verified, and announced there: the store then matches it as an SSD replica of this
// node (not a DRAM slot), and the disk gives back the bytes the slot held.
TEST_F(StoreLinkTest, EvictedBlocksAreDemotedToTheDiskTierAndAnnounced) {
  kvrelay::testing::TempDir dir;
  DiskCacheOptions disk_options;
  disk_options.directory = dir.path();
  disk_options.block_bytes = segment_->block_bytes();
  disk_options.capacity_bytes = 32 * (4096 + (segment_->block_bytes() + 4095) / 4096 * 4096);
  disk_options.layout = layout_.fingerprint();
  disk_options.node_id = "prefill-0";
  KV_ASSERT_OK_AND_ASSIGN(std::unique_ptr<DiskCache> disk, DiskCache::Open(disk_options));
  StoreLinkOptions options = Options(host_->address());
  options.disk = disk.get();
  KV_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<StoreLink> link,
      StoreLink::Connect(options, segment_.get(), Clock::Real(), absl::Now() + absl::Seconds(10)));
  // Block i's bytes are all (i + 1).
  auto fill = [this](uint8_t base) {
    return [this, base](int64_t block_index, int64_t slot) {
      std::memset(segment_->GroupUnit(slot, 0), base + static_cast<int>(block_index),
                  static_cast<size_t>(segment_->block_bytes()));
      return absl::OkStatus();
    };
  };
  const std::vector<kv::BlockHash> first = Chain(8);
  std::vector<kv::BlockHash> second;
  for (int i = 0; i < 8; ++i) second.push_back({0x9000u + i, 0x7000u + i});
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  KV_ASSERT_OK_AND_ASSIGN(int32_t n, link->CommitBlocksFrom(first, 0, 8, fill(1), deadline));
  EXPECT_EQ(n, 8);
  // The segment has 8 slots: the second chain takes every one of them.
  KV_ASSERT_OK_AND_ASSIGN(n, link->CommitBlocksFrom(second, 0, 8, fill(101), deadline));
  EXPECT_EQ(n, 8);
  ASSERT_TRUE(disk->Flush(deadline));
  EXPECT_EQ(disk->HeldRun(first, 0), 8);
  while (store_->Stats().disk_blocks < 8 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(store_->Stats().disk_blocks, 8);
  const std::vector<cachestore::NodePrefix> held = store_->QueryPrefix(first);
  ASSERT_EQ(held.size(), 1u);
  EXPECT_EQ(held[0].node_id, "prefill-0");
  EXPECT_EQ(held[0].matched, 8);
  EXPECT_EQ(held[0].disk_blocks, 8);
  KV_ASSERT_OK_AND_ASSIGN(PrefixMatch match,
                          link->MatchPrefix(first, absl::ZeroDuration(), deadline));
  EXPECT_EQ(match.matched, 8);
  for (int64_t slot : match.local_slots) EXPECT_EQ(slot, -1);  // on disk, not in the segment
  for (const auto& remote : match.remote) EXPECT_TRUE(remote.empty());
  KV_ASSERT_OK_AND_ASSIGN(auto bytes, disk->Read(first, deadline));
  ASSERT_EQ(bytes.size(), 8u);
  for (size_t i = 0; i < bytes.size(); ++i) {
    EXPECT_EQ(bytes[i], std::vector<uint8_t>(segment_->block_bytes(), static_cast<uint8_t>(1 + i)))
        << i;
  }
  link.reset();  // before the disk tier it announces from
}

// The per-call limit is an hour; the request has 100 ms left: the call ends with the request's
// deadline (were it bounded by the limit, the test would time out).
TEST_F(StoreLinkTest, AShortRemainingDeadlineBoundsTheCall) {
  SilentServer silent;
  StoreLinkOptions options = Options(silent.address());
  options.request_timeout = absl::Hours(1);
  KV_ASSERT_OK_AND_ASSIGN(std::unique_ptr<StoreLink> link,
                          StoreLink::UnregisteredForTest(options, segment_.get(), Clock::Real()));
  EXPECT_THAT(link->MatchPrefix(Chain(2), absl::Seconds(30), absl::Now() + absl::Milliseconds(100)),
              StatusIs(absl::StatusCode::kDeadlineExceeded));
  EXPECT_THAT(
      link->CommitBlocksFrom(Chain(2), 0, 2, &WriteNothing, absl::Now() + absl::Milliseconds(100)),
      StatusIs(absl::StatusCode::kDeadlineExceeded));
}

// A request with no time left makes no store call, and says nothing about the store: the next
// request's calls go out (no backoff) and succeed.
TEST_F(StoreLinkTest, ARequestOutOfTimeLeavesTheStoreOpen) {
  KV_ASSERT_OK_AND_ASSIGN(std::unique_ptr<StoreLink> link,
                          StoreLink::Connect(Options(host_->address()), segment_.get(),
                                             Clock::Real(), absl::Now() + absl::Seconds(30)));
  const absl::Time passed = absl::Now() - absl::Milliseconds(1);
  EXPECT_THAT(link->MatchPrefix(Chain(2), absl::Seconds(30), passed),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("deadline passed")));
  EXPECT_THAT(link->CommitBlocksFrom(Chain(2), 0, 2, &WriteNothing, passed),
              StatusIs(absl::StatusCode::kDeadlineExceeded));
  const absl::Time later = absl::Now() + absl::Seconds(30);
  KV_ASSERT_OK_AND_ASSIGN(int32_t committed,
                          link->CommitBlocksFrom(Chain(2), 0, 2, &WriteNothing, later));
  EXPECT_EQ(committed, 2);
  KV_ASSERT_OK_AND_ASSIGN(PrefixMatch match, link->MatchPrefix(Chain(2), absl::Seconds(30), later));
  EXPECT_EQ(match.matched, 2);
  EXPECT_EQ(match.local_slots.size(), 2u);
  link->ReleaseLease(match.lease_id, later);
}

// A real cache store process, SIGSTOPped: the first request-path call waits its bounded time
// once; the next ones fail fast (no call goes out) with UNAVAILABLE naming the store; a probe
// per cool-down is bounded by the short probe limit; after SIGCONT a probe gets through and
// the prefix is reused again. The gate's time is a SimulatedClock, so the cool-downs are not
// waited out.
TEST_F(StoreLinkTest, AHungStoreCostsOneBoundedWaitThenNothingUntilAProbeGetsThrough) {
  KV_ASSERT_OK_AND_ASSIGN(std::unique_ptr<kvrelay::testing::ChildProcess> store,
                          kvrelay::testing::ChildProcess::Start(
                              {kvrelay::testing::BinaryPath("kvrelay"), "cachestore", "--host",
                               "127.0.0.1", "--port", "0", "--metrics-port", "0", "--insecure"}));
  KV_ASSERT_OK_AND_ASSIGN(std::string line,
                          store->WaitForOutput("cachestore listening on", absl::Seconds(60)));
  std::vector<std::string> words = absl::StrSplit(line, ' ', absl::SkipEmpty());
  ASSERT_GE(words.size(), 4u) << line;
  StoreLinkOptions options = Options(words[3]);
  options.rpc_timeout = absl::Seconds(1);  // the heartbeat's, so the link's end is quick
  options.request_timeout = absl::Milliseconds(400);
  options.store_backoff = absl::Milliseconds(250);
  options.store_backoff_max = absl::Seconds(2);
  options.probe_timeout = absl::Milliseconds(50);
  options.metrics = &metrics_;
  SimulatedClock clock;
  options.gate_clock = &clock;
  KV_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<StoreLink> link,
      StoreLink::Connect(options, segment_.get(), &clock, absl::Now() + absl::Seconds(30)));
  const absl::Time request_deadline = absl::Now() + absl::Seconds(60);
  KV_ASSERT_OK_AND_ASSIGN(int32_t committed,
                          link->CommitBlocksFrom(Chain(2), 0, 2, &WriteNothing, request_deadline));
  ASSERT_EQ(committed, 2);
  auto fast_failures = [&] {
    return metrics_.RenderText().find(
               "kvrelay:dependency_fast_failures_total{dependency=\"cachestore\"} 2") !=
           std::string::npos;
  };

  store->Signal(SIGSTOP);
  ASSERT_TRUE(WaitStopped(store->pid()));
  // The one bounded wait: the per-call limit, not the request's minute.
  EXPECT_THAT(link->MatchPrefix(Chain(2), absl::Seconds(30), request_deadline),
              StatusIs(absl::StatusCode::kDeadlineExceeded));
  // Then nothing: no call goes out, reuse is simply off.
  EXPECT_THAT(
      link->MatchPrefix(Chain(2), absl::Seconds(30), request_deadline),
      StatusIs(absl::StatusCode::kUnavailable,
               AllOf(HasSubstr("cache store at " + words[3]), HasSubstr("did not answer"))));
  EXPECT_THAT(link->CommitBlocksFrom(Chain(3), 2, 3, &WriteNothing, request_deadline),
              StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_TRUE(fast_failures()) << metrics_.RenderText();
  EXPECT_THAT(metrics_.RenderText(),
              HasSubstr("kvrelay:dependency_state{dependency=\"cachestore\"} 1"));
  // After the cool-down one call probes (bounded by the probe limit) and finds it still away.
  clock.Advance(absl::Milliseconds(250));
  EXPECT_THAT(link->MatchPrefix(Chain(2), absl::Seconds(30), request_deadline),
              StatusIs(absl::StatusCode::kDeadlineExceeded));
  EXPECT_THAT(link->MatchPrefix(Chain(2), absl::Seconds(30), request_deadline),
              StatusIs(absl::StatusCode::kUnavailable));

  store->Signal(SIGCONT);
  // A probe per (simulated) cool-down until one gets an answer: reuse is back.
  absl::StatusOr<PrefixMatch> match;
  for (int probe = 0; probe < 100; ++probe) {
    clock.Advance(options.store_backoff_max);
    match = link->MatchPrefix(Chain(2), absl::Seconds(30), request_deadline);
    if (match.ok()) break;
  }
  KV_ASSERT_OK(match.status());
  EXPECT_EQ(match->matched, 2);
  EXPECT_EQ(match->local_slots.size(), 2u);
  link->ReleaseLease(match->lease_id, request_deadline);
  KV_ASSERT_OK_AND_ASSIGN(PrefixMatch again,
                          link->MatchPrefix(Chain(2), absl::Seconds(30), request_deadline));
  EXPECT_EQ(again.matched, 2);
  link->ReleaseLease(again.lease_id, request_deadline);
}

// The block size is in every block hash: a node with another one is refused at registration,
// at once and naming both values, instead of never matching a prefix.
TEST_F(StoreLinkTest, ANodeWithAnotherBlockSizeIsRefusedNamingBoth) {
  StoreLinkOptions options = Options(host_->address());
  options.block_tokens = 32;
  ASSERT_EQ(store_->block_tokens(), kv::kDefaultBlockTokens);
  EXPECT_THAT(
      StoreLink::Connect(options, segment_.get(), Clock::Real(), absl::Now() + absl::Seconds(30))
          .status(),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               AllOf(HasSubstr("--block-tokens 32"), HasSubstr("--block-tokens 16"))));
  EXPECT_TRUE(store_->ListNodes().empty());
  // The same node with the store's block size registers.
  options.block_tokens = kv::kDefaultBlockTokens;
  KV_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<StoreLink> link,
      StoreLink::Connect(options, segment_.get(), Clock::Real(), absl::Now() + absl::Seconds(30)));
  EXPECT_EQ(store_->ListNodes().size(), 1u);
}

// The gateway's side: discovery (ListNodes) from a store with another block size fails naming
// both; a client that does not say its block size is not checked.
TEST_F(StoreLinkTest, DiscoveryFromAStoreWithAnotherBlockSizeFailsNamingBoth) {
  cachestore::CacheStoreClient::Options options;
  options.block_tokens = 32;
  KV_ASSERT_OK_AND_ASSIGN(std::unique_ptr<cachestore::CacheStoreClient> gateway,
                          cachestore::CacheStoreClient::Connect(host_->address(), options));
  EXPECT_THAT(gateway->ListNodes().status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("--block-tokens 16"), HasSubstr("--block-tokens 32"))));
  options.block_tokens = 0;
  KV_ASSERT_OK_AND_ASSIGN(std::unique_ptr<cachestore::CacheStoreClient> unchecked,
                          cachestore::CacheStoreClient::Connect(host_->address(), options));
  KV_ASSERT_OK_AND_ASSIGN(kvrelay::v1::ListNodesResponse listed, unchecked->ListNodes());
  EXPECT_EQ(listed.block_tokens(), kv::kDefaultBlockTokens);
}

// A second process with a node id a running process holds is refused at once (it names the
// holder); one whose holder went silent (killed without deregistering, from another address)
// waits until the store forgets the holder after its TTL, then registers.
TEST_F(StoreLinkTest, ARunningDuplicateIsRefusedAtOnceASilentHolderIsWaitedOut) {
  StoreLinkOptions first = Options(host_->address());
  KV_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<StoreLink> running,
      StoreLink::Connect(first, segment_.get(), Clock::Real(), absl::Now() + absl::Seconds(30)));
  StoreLinkOptions duplicate = first;
  duplicate.incarnation = first.incarnation + 1;
  const absl::Time started = absl::Now();
  const absl::Status refused =
      StoreLink::Connect(duplicate, segment_.get(), Clock::Real(), absl::Now() + absl::Seconds(30))
          .status();
  EXPECT_LT(absl::Now() - started, absl::Seconds(2)) << "a running holder is not waited out";
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("prefill-0")));
  const std::optional<kvrelay::v1::ErrorInfo> info = proto::GetErrorInfo(refused);
  ASSERT_TRUE(info.has_value() && info->has_holder_silent_ms()) << refused;
  EXPECT_EQ(info->reason(), kvrelay::v1::FAILURE_IDENTITY);
  EXPECT_LT(info->holder_silent_ms(), info->holder_ttl_ms() / 2);
  EXPECT_EQ(info->holder_ttl_ms(), absl::ToInt64Milliseconds(first.ttl));

  // A holder that never heartbeats again (TTL 1 s), registered from another address.
  cachestore::NodeSpec silent;
  silent.node_id = "prefill-9";
  silent.incarnation = 3;
  silent.role = cachestore::NodeRole::kPrefill;
  silent.grpc_address = "127.0.0.1:1";
  silent.transport_kind = "inproc";
  silent.transport_address = "gone";
  silent.ttl = absl::Seconds(1);
  ASSERT_THAT(store_->RegisterNode(silent), IsOk());
  absl::Notification done;
  std::thread ticker([&] {  // what the store server's timer does
    while (!done.WaitForNotificationWithTimeout(absl::Milliseconds(50))) store_->Tick();
  });
  absl::SleepFor(absl::Milliseconds(600));  // silent for over half its TTL
  StoreLinkOptions successor = Options(host_->address());
  successor.node_id = "prefill-9";
  successor.incarnation = 4;
  const absl::StatusOr<std::unique_ptr<StoreLink>> replaced =
      StoreLink::Connect(successor, segment_.get(), Clock::Real(), absl::Now() + absl::Seconds(30));
  done.Notify();
  ticker.join();
  EXPECT_THAT(replaced.status(), IsOk());
}

}  // namespace
}  // namespace kvrelay::worker

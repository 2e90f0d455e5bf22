#include "gateway/worker_set.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/metrics.h"
#include "gateway/fake_endpoints.h"
#include "gtest/gtest.h"

namespace kvrelay::gateway {
namespace {

using ::kvrelay::gateway::testing::FakeDecodeEndpoint;
using ::kvrelay::gateway::testing::FakePrefillEndpoint;
using Node = WorkerSet::Node;
using State = CircuitBreaker::State;

constexpr absl::Duration kOpenFor = absl::Seconds(1);

WorkerSetOptions Options() {
  WorkerSetOptions options;
  options.breaker = {.open_for = kOpenFor, .max_open_for = absl::Seconds(8)};
  options.block_bytes = 1 << 20;
  return options;
}

kvrelay::v1::NodeInfo Listed(const std::string& id, kvrelay::v1::NodeRole role,
                             const std::string& address, uint64_t incarnation,
                             kvrelay::v1::NodeState state = kvrelay::v1::NODE_STATE_LIVE) {
  kvrelay::v1::NodeInfo info;
  info.set_node_id(id);
  info.set_role(role);
  info.set_grpc_address(address);
  info.set_incarnation(incarnation);
  info.set_state(state);
  return info;
}

// Fixed workers over fakes, on a simulated clock (the breakers' time).
class WorkerSetTest : public ::testing::Test {
 protected:
  explicit WorkerSetTest(WorkerSetOptions options = Options())
      : set_(options, &clock_, /*store=*/nullptr, {}) {}

  FakePrefillEndpoint* AddPrefill(const std::string& name) {
    auto endpoint = std::make_unique<FakePrefillEndpoint>(name + ":1", name, &clock_);
    FakePrefillEndpoint* raw = endpoint.get();
    set_.AddFixed(std::move(endpoint));
    return raw;
  }
  FakeDecodeEndpoint* AddDecode(const std::string& name) {
    auto endpoint = std::make_unique<FakeDecodeEndpoint>(name + ":1", name, &clock_);
    FakeDecodeEndpoint* raw = endpoint.get();
    set_.AddFixed(std::move(endpoint));
    return raw;
  }
  Node* PickDecode(const std::vector<Node*>& excluded = {},
                   const absl::flat_hash_map<std::string, int32_t>& held = {}) {
    return set_.PickDecode(set_.Nodes().decode, held, /*full_blocks=*/8, excluded);
  }
  Node* PickPrefill(const absl::flat_hash_map<std::string, int32_t>& held, int64_t full_blocks,
                    bool* routed, const std::vector<Node*>& excluded = {}) {
    return set_.PickPrefill(set_.Nodes().prefill, held, full_blocks, excluded,
                            absl::InfiniteFuture(), routed);
  }

  SimulatedClock clock_;
  WorkerSet set_;
};

TEST_F(WorkerSetTest, DecodeTradesTheHeldPrefixAgainstLoadAtTheLearnedTransferRate) {
  AddDecode("d0");
  AddDecode("d1");
  AddDecode("d2");
  const WorkerSet::Snapshot nodes = set_.Nodes();
  Node* d1 = nodes.decode[1].get();
  Node* d2 = nodes.decode[2].get();
  // Nothing learned yet: 50 ms per request ahead, so 300 / 100 / 250 ms.
  nodes.decode[0]->in_flight = 5;
  d1->in_flight = 1;
  d2->in_flight = 4;
  PickReason why{};
  auto pick = [&](const absl::flat_hash_map<std::string, int32_t>& held) {
    return set_.PickDecode(nodes.decode, held, /*full_blocks=*/8, {}, &why);
  };
  EXPECT_EQ(pick({}), d1);
  EXPECT_EQ(why, PickReason::kLoad);
  // Half the prompt held three requests further behind: no transfer rate learned yet, so the
  // load decides.
  d2->SetNodeId("d2");
  EXPECT_EQ(pick({{"d2", 4}}), d1);
  // Over a slow link (0.1 s per MiB, 1 MiB blocks) the 4 blocks not pushed again are worth
  // more than three requests ahead: the holder wins, for its prefix.
  for (const auto& n : nodes.decode) n->transfer_seconds_per_mib.Observe(0.1, clock_.Now());
  EXPECT_EQ(pick({{"d2", 4}}), d2);
  EXPECT_EQ(why, PickReason::kPrefix);
  // Over a fast one they are not.
  for (int i = 0; i < 20; ++i) {
    for (const auto& n : nodes.decode) n->transfer_seconds_per_mib.Observe(0.001, clock_.Now());
  }
  EXPECT_EQ(pick({{"d2", 4}}), d1);
  // Within the tie margin (50% + 50 ms) the holder wins.
  d2->in_flight = 1;
  EXPECT_EQ(pick({{"d2", 4}}), d2);
  EXPECT_EQ(why, PickReason::kPrefix);
  // Excluded (failed for this request) nodes are never picked.
  EXPECT_EQ(set_.PickDecode(nodes.decode, {{"d2", 4}}, 8, {d2}), d1);
  EXPECT_EQ(set_.PickDecode(nodes.decode, {}, 8, {nodes.decode[0].get(), d1, d2}), nullptr);
}

// A prefix every recent request shared must not keep a node that just joined (or came back)
// from its share: past 1.1x its share of recent picks (+1), a holder's prefix no longer wins
// ties, and tied nodes rotate.
TEST_F(WorkerSetTest, AHoldersPrefixWinsTiesOnlyUpToItsShare) {
  AddDecode("d0");
  AddDecode("d1");
  const WorkerSet::Snapshot nodes = set_.Nodes();
  Node* d0 = nodes.decode[0].get();
  Node* d1 = nodes.decode[1].get();
  d0->SetNodeId("d0");
  const absl::flat_hash_map<std::string, int32_t> held = {{"d0", 4}};
  int to_d0 = 0;
  for (int i = 0; i < 40; ++i) {
    to_d0 += set_.PickDecode(nodes.decode, held, 5, {}) == d0;
    clock_.Advance(absl::Milliseconds(200));  // 5 requests a second, none overlapping
  }
  EXPECT_GE(to_d0, 20);  // the holder gets more than its half...
  EXPECT_LE(to_d0, 32);  // ...but d1 gets well over half of its own
  EXPECT_GT(d1->picked.load(), 8);
}

// A few requests in a row (a conversation's turns, not sustained traffic) keep their affinity.
TEST_F(WorkerSetTest, AFewRequestsInARowStayWithTheirHolder) {
  AddDecode("d0");
  AddDecode("d1");
  const WorkerSet::Snapshot nodes = set_.Nodes();
  nodes.decode[0]->SetNodeId("d0");
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(set_.PickDecode(nodes.decode, {{"d0", 4}}, 5, {}), nodes.decode[0].get()) << i;
    clock_.Advance(absl::Milliseconds(500));
  }
}

// A decode worker does not read its disk tier: a prefix it holds only there is no reason to
// pick it.
TEST_F(WorkerSetTest, ADecodeWorkersDiskHeldBlocksAreNotCountedAsHeld) {
  AddDecode("d0");
  AddDecode("d1");
  const WorkerSet::Snapshot nodes = set_.Nodes();
  nodes.decode[0]->SetNodeId("d0");
  nodes.decode[1]->SetNodeId("d1");
  const absl::flat_hash_map<std::string, int32_t> held = {{"d1", 4}};
  const absl::flat_hash_map<std::string, int32_t> on_disk = {{"d1", 4}};
  int to_d1_dram = 0, to_d1_disk = 0;
  for (int i = 0; i < 6; ++i) {
    PickReason why{};
    to_d1_dram += set_.PickDecode(nodes.decode, held, 5, {}, &why) == nodes.decode[1].get();
    EXPECT_EQ(why, PickReason::kPrefix) << i;
    clock_.Advance(absl::Milliseconds(500));
  }
  for (int i = 0; i < 6; ++i) {
    PickReason why{};
    to_d1_disk +=
        set_.PickDecode(nodes.decode, held, 5, {}, &why, &on_disk) == nodes.decode[1].get();
    EXPECT_NE(why, PickReason::kPrefix) << i;
    clock_.Advance(absl::Milliseconds(500));
  }
  EXPECT_EQ(to_d1_dram, 6);  // held in DRAM: the holder wins each time
  EXPECT_EQ(to_d1_disk, 3);  // held on disk only: the two rotate
}

// A node measured slow (or penalized by a failure) loses traffic to busier fast ones, then
// forgets it while idle and gets traffic back.
TEST_F(WorkerSetTest, DecodeLearnsAServiceTimeAndForgetsItWhileIdle) {
  AddDecode("d0");
  AddDecode("d1");
  const WorkerSet::Snapshot nodes = set_.Nodes();
  Node* d0 = nodes.decode[0].get();
  Node* d1 = nodes.decode[1].get();
  d0->service.Observe(0.05, clock_.Now());
  d1->service.ObservePenalty(2.0, clock_.Now());  // a 2 s timeout
  d0->in_flight = 3;
  PickReason why{};
  EXPECT_EQ(set_.PickDecode(nodes.decode, {}, 0, {}, &why), d0);
  EXPECT_EQ(why, PickReason::kService);
  EXPECT_EQ(WorkerSet::BestService(nodes.decode), 0.05);
  // Left alone for a while (half-life 2 s), it is the fleet's best again.
  clock_.Advance(absl::Seconds(30));
  EXPECT_EQ(set_.PickDecode(nodes.decode, {}, 0, {}, &why), d1);
  EXPECT_EQ(why, PickReason::kLoad);
  // Its first answer is believed at once.
  d1->service.Observe(0.04, clock_.Now());
  EXPECT_EQ(*d1->service.Last(), 0.04);
  d0->in_flight = 2;
  EXPECT_EQ(set_.PickDecode(nodes.decode, {}, 0, {}), d1);
}

// Until its first push is measured, a node's link looks as fast as the fleet's best: a burst
// must not pile onto a link that may be slow (at 5 Mbit, seconds per request). One push at a
// time measures it.
TEST_F(WorkerSetTest, AnUnmeasuredLinkTakesOnePushAtATimeUntilItIsMeasured) {
  AddDecode("d0");
  AddDecode("d1");
  const WorkerSet::Snapshot nodes = set_.Nodes();
  Node* d0 = nodes.decode[0].get();
  Node* d1 = nodes.decode[1].get();
  d0->transfer_seconds_per_mib.Observe(0.01, clock_.Now());
  d0->in_flight = 4;
  EXPECT_EQ(PickDecode(), d1) << "idle and not being measured: the load decides";
  d1->in_flight = 1;
  d1->measuring_pushes = 1;
  EXPECT_TRUE(d1->LinkBeingMeasured());
  for (int i = 0; i < 3; ++i) EXPECT_EQ(PickDecode(), d0) << "the measured node, though busier";
  EXPECT_EQ(PickDecode({d0}), d1) << "nothing else usable";
  d1->transfer_seconds_per_mib.Observe(0.01, clock_.Now());
  EXPECT_FALSE(d1->LinkBeingMeasured());
  EXPECT_EQ(PickDecode(), d1) << "measured: the load decides again";
}

TEST_F(WorkerSetTest, WhenEveryLinkIsBeingMeasuredNoneIsHeldBack) {
  AddDecode("d0");
  AddDecode("d1");
  const WorkerSet::Snapshot nodes = set_.Nodes();
  for (const auto& n : nodes.decode) n->measuring_pushes = 1;
  nodes.decode[0]->in_flight = 5;
  nodes.decode[1]->in_flight = 1;
  EXPECT_EQ(PickDecode(), nodes.decode[1].get());
}

// Promote goes to the node whose held prefix runs furthest past the prefill node's with some
// of it on disk only (from the prefill node's end), and to the picked decode node when it holds
// blocks on disk; not when recomputing is faster than reading, nor to a node whose last
// Promote failed within promote_backoff.
TEST_F(WorkerSetTest, PromotionsGoToTheFurthestDiskHolderAndToTheDecodeNode) {
  AddPrefill("p0");
  AddPrefill("p1");
  AddDecode("d0");
  AddDecode("d1");
  const WorkerSet::Snapshot nodes = set_.Nodes();
  Node* p0 = nodes.prefill[0].get();
  Node* p1 = nodes.prefill[1].get();
  Node* d0 = nodes.decode[0].get();
  Node* d1 = nodes.decode[1].get();
  p0->SetNodeId("p0");
  p1->SetNodeId("p1");
  d0->SetNodeId("d0");
  d1->SetNodeId("d1");
  using Held = absl::flat_hash_map<std::string, int32_t>;
  auto promotions = [&](const Held& held, const Held& disk, Node* decode) {
    std::vector<std::pair<Node*, int64_t>> out;
    for (const WorkerSet::Promotion& p : set_.Promotions(nodes, held, disk, p0, decode, 8)) {
      out.emplace_back(p.node, p.first);
    }
    return out;
  };
  using Expected = std::vector<std::pair<Node*, int64_t>>;
  const Held held = {{"p0", 2}, {"p1", 6}, {"d0", 4}, {"d1", 3}};
  EXPECT_EQ(promotions(held, {}, d0), Expected{}) << "nothing on disk";
  EXPECT_EQ(promotions(held, {{"p1", 3}}, d0), (Expected{{p1, 2}}));
  EXPECT_EQ(promotions(held, {{"p1", 3}, {"d1", 1}}, d1), (Expected{{p1, 2}, {d1, 0}}));
  EXPECT_EQ(promotions({{"p0", 2}, {"d1", 6}}, {{"d1", 2}}, d1), (Expected{{d1, 0}}))
      << "the decode node is the holder: one Promote, from its first block";
  EXPECT_EQ(promotions(held, {{"p0", 2}}, d0), Expected{}) << "the prefill node reads its own";
  // 4 blocks of 1 MiB read at 1 GB/s (4 ms) against 64 tokens at a million per second.
  p0->prefill_tokens.Observe(1e6, 1.0, clock_.Now());
  EXPECT_EQ(promotions(held, {{"p1", 3}}, d0), Expected{}) << "recomputing is faster";
  p0->prefill_tokens.ObserveCeiling(1e3, 1.0, clock_.Now());  // now slow: reading pays
  ASSERT_EQ(promotions(held, {{"p1", 3}}, d0), (Expected{{p1, 2}}));
  set_.PromoteFailed(p1);
  EXPECT_EQ(promotions(held, {{"p1", 3}}, d0), Expected{}) << "it just failed";
  clock_.Advance(Options().promote_backoff);
  EXPECT_EQ(promotions(held, {{"p1", 3}}, d0), (Expected{{p1, 2}}));
  // The holder measured its disk at 1 MB/s: 4 MiB read in 4 s, 64 tokens computed in 64 ms.
  p1->disk_read_bytes_per_second = 1e6;
  EXPECT_EQ(promotions(held, {{"p1", 3}}, d0), Expected{}) << "its disk is slower than compute";
}

TEST_F(WorkerSetTest, TheReserveTimeoutFollowsMeasuredRoundTripsWithinItsBounds) {
  EXPECT_EQ(set_.ReserveTimeout(), absl::Seconds(2));  // nothing measured: the upper bound
  for (int i = 0; i < 10; ++i) set_.ObserveReserve(absl::Milliseconds(3));
  EXPECT_EQ(set_.ReserveTimeout(), absl::Milliseconds(500));  // the floor
}

TEST_F(WorkerSetTest, AnOpenBreakerIsSkippedThenProbedOnceWhenHalfOpen) {
  AddDecode("d0");
  AddDecode("d1");
  const WorkerSet::Snapshot nodes = set_.Nodes();
  Node* d0 = nodes.decode[0].get();
  Node* d1 = nodes.decode[1].get();
  d0->breaker.RecordFailure();
  for (int i = 0; i < 4; ++i) EXPECT_EQ(PickDecode(), d1) << i;

  clock_.Advance(kOpenFor + absl::Milliseconds(1));
  EXPECT_EQ(d0->breaker.state(), State::kHalfOpen);
  // The half-open node takes the next request as its probe, even though it is busier.
  d0->in_flight = 5;
  EXPECT_EQ(PickDecode(), d0);
  // One probe at a time: the others go elsewhere until its outcome is known.
  EXPECT_EQ(PickDecode(), d1);
  d0->breaker.RecordSuccess();
  d0->in_flight = 0;
  d1->in_flight = 1;
  EXPECT_EQ(d0->breaker.state(), State::kClosed);
  EXPECT_EQ(PickDecode(), d0);
}

TEST_F(WorkerSetTest, ABusyNodeIsPassedOverNotUnhealthyAndPickedAgainAfterBusyFor) {
  AddDecode("d0");
  AddDecode("d1");
  const WorkerSet::Snapshot nodes = set_.Nodes();
  nodes.decode[0]->breaker.RecordBusy(absl::Milliseconds(150));
  EXPECT_TRUE(nodes.decode[0]->breaker.Healthy());
  EXPECT_TRUE(WorkerSet::AnyPickable(nodes.decode, {}));
  EXPECT_FALSE(WorkerSet::AnyPickable(nodes.decode, {nodes.decode[1].get()}));
  EXPECT_EQ(PickDecode(), nodes.decode[1].get());
  EXPECT_EQ(PickDecode(), nodes.decode[1].get());
  // Every usable node busy: no pick, and BusyWait says overload (the shortest predicted wait),
  // where a failed node would say nothing.
  nodes.decode[1]->breaker.RecordBusy(absl::Milliseconds(80));
  EXPECT_FALSE(WorkerSet::AnyPickable(nodes.decode, {}));
  EXPECT_EQ(PickDecode(), nullptr);
  EXPECT_EQ(WorkerSet::BusyWait(nodes.decode, {}), absl::Milliseconds(80));
  EXPECT_EQ(WorkerSet::BusyWait(nodes.decode, {nodes.decode[1].get()}), absl::Milliseconds(150));
  nodes.decode[1]->breaker.RecordFailure();
  EXPECT_EQ(WorkerSet::BusyWait(nodes.decode, {nodes.decode[0].get()}), std::nullopt);
  clock_.Advance(absl::Milliseconds(151));
  EXPECT_EQ(PickDecode(), nodes.decode[0].get());  // busy no more
  EXPECT_EQ(nodes.decode[0]->breaker.failures(), 0);
}

TEST_F(WorkerSetTest, PrefillPassesOverABusyNode) {
  AddPrefill("p0");
  AddPrefill("p1");
  const WorkerSet::Snapshot nodes = set_.Nodes();
  nodes.prefill[1]->breaker.RecordBusy();
  bool routed = false;
  EXPECT_EQ(PickPrefill({}, 4, &routed), nodes.prefill[0].get());
  EXPECT_EQ(PickPrefill({}, 4, &routed), nodes.prefill[0].get());
  nodes.prefill[0]->breaker.RecordBusy();
  EXPECT_EQ(PickPrefill({}, 4, &routed), nullptr);
  EXPECT_TRUE(WorkerSet::BusyWait(nodes.prefill, {}).has_value());
}

TEST_F(WorkerSetTest, AFailedProbeOpensTheBreakerForLonger) {
  AddDecode("d0");
  AddDecode("d1");
  Node* d0 = set_.Nodes().decode[0].get();
  d0->breaker.RecordFailure();
  clock_.Advance(kOpenFor + absl::Milliseconds(1));
  ASSERT_EQ(PickDecode(), d0);  // the probe
  d0->breaker.RecordFailure();  // fails: open for twice as long
  clock_.Advance(kOpenFor + absl::Milliseconds(1));
  EXPECT_NE(PickDecode(), d0);
  clock_.Advance(kOpenFor);
  EXPECT_EQ(PickDecode(), d0);
}

TEST_F(WorkerSetTest, SuspectNodesArePickedOnlyWhenNothingElseIsUsable) {
  AddDecode("d0");
  AddDecode("d1");
  const WorkerSet::Snapshot nodes = set_.Nodes();
  nodes.decode[0]->suspect = true;
  nodes.decode[1]->in_flight = 4;
  EXPECT_EQ(PickDecode(), nodes.decode[1].get());
  nodes.decode[1]->breaker.RecordFailure();
  EXPECT_EQ(PickDecode(), nodes.decode[0].get());
}

TEST_F(WorkerSetTest, PrefillGoesToThePrefixHolderAndLearnsNodeIdsOnce) {
  FakePrefillEndpoint* p0 = AddPrefill("p0");
  FakePrefillEndpoint* p1 = AddPrefill("p1");
  const WorkerSet::Snapshot nodes = set_.Nodes();
  bool routed = false;
  EXPECT_EQ(PickPrefill({{"p1", 3}}, 4, &routed), nodes.prefill[1].get());
  EXPECT_TRUE(routed);
  EXPECT_EQ(nodes.prefill[0]->NodeId(), "p0");
  EXPECT_EQ(nodes.prefill[1]->NodeId(), "p1");
  // A holder one request busier still wins while rates are unmeasured (prefix first).
  nodes.prefill[1]->in_flight = 1;
  EXPECT_EQ(PickPrefill({{"p1", 3}}, 4, &routed), nodes.prefill[1].get());
  EXPECT_TRUE(routed);
  // Nothing held: the least loaded, not routed.
  EXPECT_EQ(PickPrefill({}, 4, &routed), nodes.prefill[0].get());
  EXPECT_FALSE(routed);
  EXPECT_EQ(p0->status_calls, 1);
  EXPECT_EQ(p1->status_calls, 1);
}

TEST(WorkerSetMetrics, WorkersAndOpenBreakersByRoleAreReadAtEachScrape) {
  SimulatedClock clock;
  MetricsRegistry metrics;
  WorkerSetOptions options = Options();
  options.metrics = &metrics;
  options.metric_labels = {{"model_name", "m"}};
  auto gauge = [&metrics](const std::string& name, const std::string& role) {
    const std::string text = metrics.RenderText();
    const std::string series = absl::StrCat(name, "{model_name=\"m\",role=\"", role, "\"} ");
    const size_t at = text.find(series);
    if (at == std::string::npos) return -1.0;
    return std::stod(text.substr(at + series.size()));
  };
  {
    WorkerSet set(options, &clock, /*store=*/nullptr, {});
    EXPECT_EQ(gauge("kvrelay:gateway_workers", "decode"), 0);
    for (const char* name : {"d0", "d1"}) {
      set.AddFixed(std::make_unique<FakeDecodeEndpoint>(absl::StrCat(name, ":1"), name, &clock));
    }
    set.AddFixed(std::make_unique<FakePrefillEndpoint>("p0:1", "p0", &clock));
    EXPECT_EQ(gauge("kvrelay:gateway_workers", "decode"), 2);
    EXPECT_EQ(gauge("kvrelay:gateway_workers", "prefill"), 1);
    EXPECT_EQ(gauge("kvrelay:gateway_breakers_open", "decode"), 0);
    set.Nodes().decode[1]->breaker.RecordFailure();
    EXPECT_EQ(gauge("kvrelay:gateway_breakers_open", "decode"), 1);
    EXPECT_EQ(gauge("kvrelay:gateway_breakers_open", "prefill"), 0);
    // Half-open (its probe not answered yet) still counts; a good probe closes it.
    clock.Advance(kOpenFor + absl::Milliseconds(1));
    EXPECT_EQ(set.Nodes().decode[1]->breaker.state(), State::kHalfOpen);
    EXPECT_EQ(gauge("kvrelay:gateway_breakers_open", "decode"), 1);
    set.Nodes().decode[1]->breaker.RecordSuccess();
    EXPECT_EQ(gauge("kvrelay:gateway_breakers_open", "decode"), 0);
  }
  // The set is gone: the scrape reads zeros, not freed memory.
  EXPECT_EQ(gauge("kvrelay:gateway_workers", "decode"), 0);
}

TEST(WorkerSetLayout, WorkersOfAnotherLayoutAreNeverPairedAndAskedOnce) {
  SimulatedClock clock;
  MetricsRegistry metrics;
  WorkerSetOptions options = Options();
  options.layout_fingerprint = "fp8-layout";
  options.layout_description = "model m, KV fp8_e4m3";
  options.metrics = &metrics;
  WorkerSet set(options, &clock, /*store=*/nullptr, {});
  std::vector<FakeDecodeEndpoint*> decodes;
  for (const char* fp : {"fp8-layout", "bf16-layout", ""}) {
    auto endpoint = std::make_unique<FakeDecodeEndpoint>(absl::StrCat("d", decodes.size(), ":1"),
                                                         absl::StrCat("d", decodes.size()), &clock);
    endpoint->layout_fingerprint = fp;
    decodes.push_back(endpoint.get());
    set.AddFixed(std::move(endpoint));
  }
  auto prefill = std::make_unique<FakePrefillEndpoint>("p0:1", "p0", &clock);
  prefill->layout_fingerprint = "bf16-layout";
  FakePrefillEndpoint* p0 = prefill.get();
  set.AddFixed(std::move(prefill));
  const WorkerSet::Snapshot nodes = set.Nodes();
  for (int round = 0; round < 3; ++round) {
    // The same layout and the one that does not say (it refuses other layouts itself) stay.
    const WorkerSet::NodeList same = set.SameLayout(nodes.decode, absl::InfiniteFuture());
    ASSERT_EQ(same.size(), 2u);
    EXPECT_EQ(same[0].get(), nodes.decode[0].get());
    EXPECT_EQ(same[1].get(), nodes.decode[2].get());
    EXPECT_TRUE(set.SameLayout(nodes.prefill, absl::InfiniteFuture()).empty());
  }
  // A known layout is learned once; one that said nothing is asked again only after a second.
  EXPECT_EQ(decodes[0]->status_calls, 1);
  EXPECT_EQ(decodes[1]->status_calls, 1);
  EXPECT_EQ(decodes[2]->status_calls, 1);
  EXPECT_EQ(p0->status_calls, 1);
  EXPECT_EQ(nodes.prefill[0]->NodeId(), "p0");
  EXPECT_EQ(metrics.GetCounter("kvrelay:gateway_layout_mismatch_total", "", {{"role", "decode"}})
                ->value(),
            1);
  // Without a layout to check (in-process tests), every node stays, no call made.
  WorkerSet unchecked(Options(), &clock, /*store=*/nullptr, {});
  auto d = std::make_unique<FakeDecodeEndpoint>("x:1", "x", &clock);
  d->layout_fingerprint = "other";
  FakeDecodeEndpoint* x = d.get();
  unchecked.AddFixed(std::move(d));
  EXPECT_EQ(unchecked.SameLayout(unchecked.Nodes().decode, absl::InfiniteFuture()).size(), 1u);
  EXPECT_EQ(x->status_calls, 0);
}

TEST_F(WorkerSetTest, PrefillSkipsAnOpenBreakerAndExcludedNodes) {
  AddPrefill("p0");
  FakePrefillEndpoint* p1 = AddPrefill("p1");
  p1->status = absl::UnavailableError("down");  // its id stays unknown
  const WorkerSet::Snapshot nodes = set_.Nodes();
  bool routed = false;
  nodes.prefill[0]->breaker.RecordFailure();
  EXPECT_EQ(PickPrefill({{"p0", 3}}, 4, &routed), nodes.prefill[1].get());
  EXPECT_FALSE(routed);
  EXPECT_EQ(PickPrefill({}, 4, &routed, {nodes.prefill[1].get()}), nullptr);
}

class LoadOnlyWorkerSetTest : public WorkerSetTest {
 protected:
  static WorkerSetOptions LoadOnly() {
    WorkerSetOptions options = Options();
    options.prefix_routing = false;
    return options;
  }
  LoadOnlyWorkerSetTest() : WorkerSetTest(LoadOnly()) {}
};

TEST_F(LoadOnlyWorkerSetTest, PrefixRoutingOffPicksByLoadAlone) {
  AddPrefill("p0");
  AddPrefill("p1");
  const WorkerSet::Snapshot nodes = set_.Nodes();
  nodes.prefill[1]->in_flight = 1;
  bool routed = true;
  EXPECT_EQ(PickPrefill({{"p1", 8}}, 8, &routed), nodes.prefill[0].get());
  EXPECT_FALSE(routed);
}

// Discovery: a set whose factories make fakes for the addresses the registry lists.
class DiscoveryTest : public ::testing::Test {
 protected:
  DiscoveryTest()
      : set_(Options(), &clock_, /*store=*/nullptr,
             WorkerFactories{.make_prefill = [this](const std::string& address)
                                 -> absl::StatusOr<std::unique_ptr<PrefillEndpoint>> {
                               made_.push_back(address);
                               if (refuse_ == address)
                                 return absl::InvalidArgumentError("bad address");
                               return std::make_unique<FakePrefillEndpoint>(address, "", &clock_);
                             },
                             .make_decode = [this](const std::string& address)
                                 -> absl::StatusOr<std::unique_ptr<DecodeEndpoint>> {
                               made_.push_back(address);
                               if (refuse_ == address)
                                 return absl::InvalidArgumentError("bad address");
                               return std::make_unique<FakeDecodeEndpoint>(address, "", &clock_);
                             }}) {}

  SimulatedClock clock_;
  std::vector<std::string> made_;
  std::string refuse_;  // the factories fail for this address
  WorkerSet set_;
};

TEST_F(DiscoveryTest, AddsListedWorkersRefreshesThemAndDropsTheOnesGone) {
  kvrelay::v1::ListNodesResponse listed;
  *listed.add_nodes() = Listed("p-a", kvrelay::v1::NODE_ROLE_PREFILL, "10.0.0.1:50051", 1);
  *listed.add_nodes() = Listed("d-a", kvrelay::v1::NODE_ROLE_DECODE, "10.0.0.2:50052", 1);
  listed.mutable_nodes(1)->mutable_load()->set_active_requests(3);
  listed.mutable_nodes(1)->mutable_load()->set_queued_requests(2);
  listed.mutable_nodes(0)->mutable_load()->set_disk_read_bytes_per_second(3'000'000'000);
  // Neither live nor reachable: not added.
  *listed.add_nodes() = Listed("d-b", kvrelay::v1::NODE_ROLE_DECODE, "10.0.0.3:50052", 1,
                               kvrelay::v1::NODE_STATE_SUSPECT);
  *listed.add_nodes() = Listed("d-c", kvrelay::v1::NODE_ROLE_DECODE, "", 1);
  set_.Apply(listed);
  ASSERT_EQ(set_.num_prefill(), 1u);
  ASSERT_EQ(set_.num_decode(), 1u);
  const WorkerSet::Snapshot first = set_.Nodes();
  EXPECT_EQ(first.prefill[0]->NodeId(), "p-a");
  EXPECT_EQ(first.prefill[0]->address(), "10.0.0.1:50051");
  EXPECT_TRUE(first.decode[0]->discovered);

  // The same listing again makes nothing new, and refreshes the load each node reports.
  set_.Apply(listed);
  EXPECT_EQ(made_.size(), 2u);
  EXPECT_EQ(first.decode[0]->Load(), 5);  // active + queued
  EXPECT_EQ(first.prefill[0]->DiskReadRate(1e9), 3e9) << "the rate it measured";
  EXPECT_EQ(first.decode[0]->DiskReadRate(1e9), 1e9) << "none reported: nominal";

  // The decode worker turns suspect; the prefill worker is gone from the registry.
  kvrelay::v1::ListNodesResponse later;
  *later.add_nodes() = Listed("d-a", kvrelay::v1::NODE_ROLE_DECODE, "10.0.0.2:50052", 1,
                              kvrelay::v1::NODE_STATE_SUSPECT);
  set_.Apply(later);
  EXPECT_EQ(set_.num_prefill(), 0u);
  ASSERT_EQ(set_.num_decode(), 1u);
  EXPECT_TRUE(set_.Nodes().decode[0]->suspect.load());
  // A request that picked the dropped node before still holds a valid one.
  EXPECT_EQ(first.prefill[0]->address(), "10.0.0.1:50051");

  // The decode worker restarts (a new incarnation): the old node goes, a new one comes.
  kvrelay::v1::ListNodesResponse restarted;
  *restarted.add_nodes() = Listed("d-a", kvrelay::v1::NODE_ROLE_DECODE, "10.0.0.2:50052", 2);
  set_.Apply(restarted);
  ASSERT_EQ(set_.num_decode(), 1u);
  EXPECT_NE(set_.Nodes().decode[0], first.decode[0]);
  EXPECT_EQ(set_.Nodes().decode[0]->incarnation, 2u);
  EXPECT_FALSE(set_.Nodes().decode[0]->suspect.load());
}

TEST_F(DiscoveryTest, FixedWorkersStayAndAreNotAddedTwice) {
  set_.AddFixed(std::make_unique<FakeDecodeEndpoint>("10.0.0.2:50052", "d-a", &clock_));
  kvrelay::v1::ListNodesResponse listed;
  *listed.add_nodes() = Listed("d-a", kvrelay::v1::NODE_ROLE_DECODE, "10.0.0.2:50052", 7);
  listed.mutable_nodes(0)->mutable_load()->set_active_requests(4);
  set_.Apply(listed);
  ASSERT_EQ(set_.num_decode(), 1u);
  EXPECT_TRUE(made_.empty());
  EXPECT_FALSE(set_.Nodes().decode[0]->discovered);
  EXPECT_EQ(set_.Nodes().decode[0]->Load(), 4);  // a fixed worker's reported load counts too
  set_.Apply(kvrelay::v1::ListNodesResponse());
  EXPECT_EQ(set_.num_decode(), 1u);  // never dropped
}

TEST_F(DiscoveryTest, AWorkerWhoseEndpointCannotBeMadeIsRetriedNextPass) {
  kvrelay::v1::ListNodesResponse listed;
  *listed.add_nodes() = Listed("p-a", kvrelay::v1::NODE_ROLE_PREFILL, "10.0.0.1:50051", 1);
  refuse_ = "10.0.0.1:50051";
  set_.Apply(listed);
  EXPECT_EQ(set_.num_prefill(), 0u);
  refuse_.clear();
  set_.Apply(listed);
  EXPECT_EQ(set_.num_prefill(), 1u);
}

TEST_F(DiscoveryTest, ANewWorkerGetsTheNextRequestItIsLeastLoadedFor) {
  set_.AddFixed(std::make_unique<FakeDecodeEndpoint>("10.0.0.9:50052", "d-fixed", &clock_));
  kvrelay::v1::ListNodesResponse listed;
  *listed.add_nodes() = Listed("d-new", kvrelay::v1::NODE_ROLE_DECODE, "10.0.0.2:50052", 1);
  set_.Apply(listed);
  const WorkerSet::Snapshot nodes = set_.Nodes();
  ASSERT_EQ(nodes.decode.size(), 2u);
  nodes.decode[0]->SetNodeId("d-fixed");
  // The fixed node holds the whole prefix, but the new one has had nothing yet.
  Node* picked = set_.PickDecode(nodes.decode, {{"d-fixed", 8}}, 8, {});
  EXPECT_EQ(picked, nodes.decode[1].get());
  EXPECT_EQ(set_.PickDecode(nodes.decode, {{"d-fixed", 8}}, 8, {}), nodes.decode[0].get());
}

// A worker back from a pause or partition heartbeats again: the registry no longer marks it
// suspect, and its open breaker (cool-down doubled by failed probes) probes on the next pick.
TEST_F(DiscoveryTest, AWorkerHeartbeatingAgainIsProbedAtOnce) {
  kvrelay::v1::ListNodesResponse listed;
  *listed.add_nodes() = Listed("d0", kvrelay::v1::NODE_ROLE_DECODE, "10.0.0.1:50052", 1);
  *listed.add_nodes() = Listed("d1", kvrelay::v1::NODE_ROLE_DECODE, "10.0.0.2:50052", 1);
  set_.Apply(listed);
  const WorkerSet::Snapshot nodes = set_.Nodes();
  ASSERT_EQ(nodes.decode.size(), 2u);
  Node* d0 = nodes.decode[0].get();
  d0->breaker.RecordFailure();
  clock_.Advance(kOpenFor + absl::Milliseconds(1));
  ASSERT_TRUE(d0->breaker.Allow());
  d0->breaker.RecordFailure();  // a failed probe: open for 2 s now
  listed.mutable_nodes(0)->set_state(kvrelay::v1::NODE_STATE_SUSPECT);
  set_.Apply(listed);
  EXPECT_EQ(d0->breaker.state(), State::kOpen);
  listed.mutable_nodes(0)->set_state(kvrelay::v1::NODE_STATE_LIVE);
  set_.Apply(listed);
  EXPECT_EQ(d0->breaker.state(), State::kHalfOpen);
  PickReason why{};
  EXPECT_EQ(set_.PickDecode(nodes.decode, {}, 0, {}, &why), d0);
  EXPECT_EQ(why, PickReason::kProbe);
}

TEST_F(DiscoveryTest, RefreshNeedsAStore) {
  EXPECT_FALSE(set_.CanDiscover());
  EXPECT_TRUE(absl::IsFailedPrecondition(set_.Refresh()));
}

}  // namespace
}  // namespace kvrelay::gateway

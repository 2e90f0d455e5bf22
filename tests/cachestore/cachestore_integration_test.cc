// Integration tests against the real `kvrelay cachestore` process over gRPC on loopback.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "cachestore/client/cache_store_client.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kv/block_hash.h"
#include "tests/testing/process_harness.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"

namespace kvrelay::cachestore {
namespace {

using ::kvrelay::testing::ChildProcess;
using ::kvrelay::testing::IsOk;
using ::kvrelay::testing::StatusIs;
using ::testing::HasSubstr;

std::vector<kv::BlockHash> Chain(const std::string& salt, int n, int start = 0) {
  std::vector<int32_t> tokens;
  for (int i = 0; i < n * 16; ++i) tokens.push_back(start + i);
  return kv::HashChain(kv::LayoutFingerprint{}, salt, tokens, 16);
}

class CacheStoreProcessTest : public ::testing::Test {
 protected:
  void Start(const std::vector<std::string>& extra = {}) {
    std::vector<std::string> argv = {testing::BinaryPath("kvrelay"),
                                     "cachestore",
                                     "--port",
                                     "0",
                                     "--metrics-port",
                                     "0",
                                     "--data-dir",
                                     dir_.File("data"),
                                     "--tick",
                                     "20ms",
                                     "--insecure"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    KV_ASSERT_OK_AND_ASSIGN(proc_, ChildProcess::Start(argv));
    KV_ASSERT_OK_AND_ASSIGN(std::string line,
                            proc_->WaitForOutput("cachestore listening on", absl::Seconds(30)));
    // "cachestore listening on 127.0.0.1:PORT metrics 127.0.0.1:PORT"
    std::vector<std::string> words = absl::StrSplit(line, ' ', absl::SkipEmpty());
    ASSERT_GE(words.size(), 6u) << line;
    target_ = words[3];
    const std::string metrics = words[5];
    ASSERT_TRUE(absl::SimpleAtoi(metrics.substr(metrics.rfind(':') + 1), &metrics_port_));
    KV_ASSERT_OK_AND_ASSIGN(client_, CacheStoreClient::Connect(target_));
    ASSERT_THAT(client_->WaitForReady(absl::Seconds(10)), IsOk());
  }
  void Register(const std::string& node, int64_t slots, int64_t ttl_ms = 60000) {
    v1::RegisterNodeRequest req;
    req.set_node_id(node);
    req.mutable_address()->set_kind("ucx");
    req.mutable_address()->set_address("127.0.0.1:1");
    v1::Segment* s = req.add_segments();
    s->set_segment_id("host0");
    s->set_tier(v1::TIER_HOST);
    s->set_capacity_slots(slots);
    s->set_slot_bytes(1 << 20);
    s->set_memory_key("rkey");
    req.set_ttl_ms(ttl_ms);
    ASSERT_THAT(client_->RegisterNode(req), IsOk());
  }
  void Store(const std::vector<kv::BlockHash>& chain, const std::string& node = "") {
    KV_ASSERT_OK_AND_ASSIGN(v1::AllocateResponse a,
                            client_->AllocateChain(chain, 1 << 20, {}, node));
    ASSERT_EQ(a.blocks_size(), static_cast<int>(chain.size()));
    KV_ASSERT_OK_AND_ASSIGN(int n, client_->Commit(a.allocation_id()));
    ASSERT_EQ(n, static_cast<int>(chain.size()));
  }
  int Matched(const std::vector<kv::BlockHash>& chain) {
    absl::StatusOr<v1::MatchPrefixResponse> r = client_->MatchPrefix(chain);
    EXPECT_THAT(r, IsOk());
    return r.ok() ? r->matched() : -1;
  }

  // A client that speaks for node `id` (incarnation `incarnation`).
  std::unique_ptr<CacheStoreClient> NodeClient(const std::string& id, uint64_t incarnation) {
    CacheStoreClient::Options o;
    o.node = {id, incarnation};
    auto c = CacheStoreClient::Connect(target_, o);
    EXPECT_THAT(c, IsOk());
    return c.ok() ? *std::move(c) : nullptr;
  }
  static CacheStoreClient::Registration Reg(int64_t slots,
                                            v1::NodeRole role = v1::NODE_ROLE_PREFILL,
                                            absl::Duration ttl = absl::Seconds(60)) {
    CacheStoreClient::Registration reg;
    reg.role = role;
    reg.grpc_address = "127.0.0.1:7100";
    reg.transport_kind = "ucx";
    reg.transport_address = "127.0.0.1:13337";
    reg.ttl = ttl;
    if (slots > 0) {
      v1::Segment seg;
      seg.set_segment_id("kv");
      seg.set_tier(v1::TIER_HOST);
      seg.set_capacity_slots(slots);
      seg.set_slot_bytes(1 << 20);
      seg.set_memory_key("rkey");
      reg.segments.push_back(seg);
    }
    return reg;
  }
  void Kill9AndRestart(const std::vector<std::string>& extra = {}) {
    proc_->Signal(SIGKILL);
    ASSERT_THAT(proc_->Wait(absl::Seconds(10)), IsOk());
    client_.reset();
    Start(extra);
  }

  testing::TempDir dir_;
  std::unique_ptr<ChildProcess> proc_;
  std::string target_;
  int metrics_port_ = 0;
  std::unique_ptr<CacheStoreClient> client_;
};

TEST_F(CacheStoreProcessTest, RegisterAllocateCommitMatchQueryAndMetrics) {
  Start();
  Register("prefill-0", 64);
  Register("decode-0", 64);
  auto chain = Chain("tenant", 8);
  KV_ASSERT_OK_AND_ASSIGN(v1::AllocateResponse a,
                          client_->AllocateChain(chain, 1 << 20, {}, "prefill-0"));
  EXPECT_EQ(a.blocks(0).replicas(0).node_id(), "prefill-0");
  EXPECT_EQ(a.blocks(2).replicas(0).offset_bytes(),
            static_cast<uint64_t>(a.blocks(2).replicas(0).slot()) << 20);
  EXPECT_EQ(Matched(chain), 0);  // not committed yet
  KV_ASSERT_OK_AND_ASSIGN(int n, client_->Commit(a.allocation_id()));
  EXPECT_EQ(n, 8);
  KV_ASSERT_OK_AND_ASSIGN(v1::MatchPrefixResponse m,
                          client_->MatchPrefix(chain, absl::Seconds(30)));
  EXPECT_EQ(m.matched(), 8);
  EXPECT_NE(m.lease_id(), 0u);
  const auto locations = CacheStoreClient::Locations(m);
  ASSERT_EQ(locations.size(), 8u);
  EXPECT_EQ(locations[7].at(0).node_id(), "prefill-0");
  EXPECT_EQ(locations[7].at(0).slot(), a.blocks(7).replicas(0).slot());
  EXPECT_EQ(locations[7].at(0).offset_bytes(), a.blocks(7).replicas(0).offset_bytes());
  EXPECT_EQ(m.segments_size(), 1);  // one (node, segment) for all 8 blocks
  {  // The verbose form (columnar = false) carries the same locations per block.
    grpc::ClientContext ctx;
    v1::MatchPrefixRequest req;
    for (const kv::BlockHash& h : chain) CacheStoreClient::ToProto(h, req.add_chain());
    v1::MatchPrefixResponse verbose;
    ASSERT_TRUE(client_->stub().MatchPrefix(&ctx, req, &verbose).ok());
    ASSERT_EQ(verbose.blocks_size(), 8);
    EXPECT_EQ(verbose.blocks(7).replicas(0).node_id(), "prefill-0");
    EXPECT_EQ(verbose.blocks(7).replicas(0).slot(), locations[7].at(0).slot());
    EXPECT_EQ(CacheStoreClient::FromProto(verbose.blocks(7).hash()), chain[7]);
  }
  EXPECT_THAT(client_->ReleaseLease(m.lease_id()), IsOk());
  KV_ASSERT_OK_AND_ASSIGN(v1::QueryPrefixResponse q, client_->QueryPrefix(chain));
  ASSERT_EQ(q.nodes_size(), 1);
  EXPECT_EQ(q.nodes(0).node_id(), "prefill-0");
  EXPECT_EQ(q.nodes(0).matched(), 8);
  KV_ASSERT_OK_AND_ASSIGN(v1::StatsResponse st, client_->Stats());
  EXPECT_EQ(st.nodes(), 2);
  EXPECT_EQ(st.committed_blocks(), 8);
  EXPECT_EQ(st.policy(), "adaptive");
  const std::string metrics = testing::HttpGet(metrics_port_, "/metrics");
  EXPECT_THAT(metrics, HasSubstr("200 OK"));
  // The node registered a host segment: every hit is the host tier's.
  EXPECT_THAT(metrics, HasSubstr("kvrelay:cachestore_prefix_hit_blocks_total{tier=\"host\"} 16"));
  EXPECT_THAT(metrics, HasSubstr("kvrelay:cachestore_prefix_hit_blocks_total{tier=\"gpu\"} 0"));
  EXPECT_THAT(metrics, HasSubstr("kvrelay:cachestore_prefix_hit_blocks_total{tier=\"ssd\"} 0"));
  EXPECT_THAT(metrics, HasSubstr("kvrelay:cachestore_used_bytes{tier=\"host\"} 8388608"));
  EXPECT_THAT(metrics, HasSubstr("kvrelay:cachestore_rpc_seconds_count{rpc=\"MatchPrefix\"}"));
  // Every family the store exports, each with its type (one renderer: common/metrics).
  for (const char* family : {"prefix_queries_total counter",
                             "prefix_query_blocks_total counter",
                             "prefix_hit_blocks_total counter",
                             "allocated_blocks_total counter",
                             "committed_blocks_total counter",
                             "aborted_blocks_total counter",
                             "reclaimed_blocks_total counter",
                             "evictions_total counter",
                             "expired_nodes_total counter",
                             "suspected_nodes_total counter",
                             "refused_registrations_total counter",
                             "announced_blocks_total counter",
                             "nodes gauge",
                             "suspect_nodes gauge",
                             "blocks gauge",
                             "active_leases gauge",
                             "used_bytes gauge",
                             "capacity_bytes gauge",
                             "rpc_errors_total counter",
                             "rpc_seconds histogram"}) {
    EXPECT_THAT(metrics, HasSubstr(absl::StrCat("# TYPE kvrelay:cachestore_", family, "\n")));
  }
  EXPECT_THAT(metrics, HasSubstr("kvrelay:cachestore_nodes 2\n"));
  EXPECT_THAT(metrics, HasSubstr("kvrelay:cachestore_blocks 8\n"));
  EXPECT_THAT(metrics, HasSubstr("kvrelay:cachestore_capacity_bytes{tier=\"gpu\"} 0\n"));
  EXPECT_THAT(metrics, HasSubstr("kvrelay:cachestore_rpc_errors_total{rpc=\"Commit\"} 0\n"));
  EXPECT_THAT(metrics,
              HasSubstr("kvrelay:cachestore_rpc_seconds_bucket{rpc=\"MatchPrefix\",le=\"5e-05\"}"));
  EXPECT_THAT(testing::HttpGet(metrics_port_, "/nope"), HasSubstr("404"));
}

TEST_F(CacheStoreProcessTest, WatchEventsResumesFromASequenceNumber) {
  Start();
  Register("n", 64);
  Store(Chain("t", 3));
  std::vector<v1::Event> seen;
  ASSERT_THAT(client_->WatchEvents(1, absl::Seconds(10),
                                   [&](const v1::Event& e) {
                                     seen.push_back(e);
                                     return seen.size() < 2;  // disconnect after two
                                   }),
              IsOk());
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[0].sequence(), 1u);
  EXPECT_EQ(seen[1].sequence(), 2u);
  Store(Chain("t", 2, 500));  // while disconnected
  std::vector<v1::Event> rest;
  ASSERT_THAT(client_->WatchEvents(seen.back().sequence() + 1, absl::Seconds(10),
                                   [&](const v1::Event& e) {
                                     rest.push_back(e);
                                     return rest.size() < 3;
                                   }),
              IsOk());
  ASSERT_EQ(rest.size(), 3u);
  for (size_t i = 0; i < rest.size(); ++i) {
    EXPECT_EQ(rest[i].sequence(), 3 + i);
    EXPECT_EQ(rest[i].kind(), v1::Event::KIND_BLOCK_STORED);
    EXPECT_EQ(rest[i].node_ids(0), "n");
  }
}

TEST_F(CacheStoreProcessTest, Kill9AndRestartReplaysTheLog) {
  Start();
  Register("n", 64);
  auto chain = Chain("t", 5);
  Store(chain);
  KV_ASSERT_OK_AND_ASSIGN(v1::AllocateResponse pending,
                          client_->AllocateChain(Chain("t", 2, 900), 1 << 20));
  proc_->Signal(SIGKILL);
  ASSERT_THAT(proc_->Wait(absl::Seconds(10)), IsOk());
  client_.reset();
  Start();
  EXPECT_EQ(Matched(chain), 5);
  EXPECT_EQ(Matched(Chain("t", 2, 900)), 0);  // never committed: gone
  KV_ASSERT_OK_AND_ASSIGN(v1::StatsResponse st, client_->Stats());
  EXPECT_EQ(st.nodes(), 1);
  EXPECT_EQ(st.allocated_blocks(), 0);
  EXPECT_GE(st.last_sequence(), 6u);  // node joined + 5 blocks; numbers may be skipped
}

TEST_F(CacheStoreProcessTest, HeartbeatLossDropsTheNodesBlocks) {
  Start({"--suspect-grace", "100ms"});
  Register("alive", 64, /*ttl_ms=*/60000);
  Register("dying", 64, /*ttl_ms=*/300);
  auto on_alive = Chain("t", 2);
  auto on_dying = Chain("t", 2, 100);
  Store(on_alive, "alive");
  Store(on_dying, "dying");
  // Bounded wait for the server's tick to notice the missed TTL.
  int matched = -1;
  for (int i = 0; i < 200 && matched != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    matched = Matched(on_dying);
  }
  EXPECT_EQ(matched, 0);  // suspect first: skipped
  EXPECT_EQ(Matched(on_alive), 2);
  int64_t suspect = -1;  // then forgotten after the (short) grace period
  for (int i = 0; i < 200 && suspect != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    absl::StatusOr<v1::StatsResponse> st = client_->Stats();
    if (st.ok()) suspect = st->suspect_nodes();
  }
  EXPECT_EQ(suspect, 0);
  KV_ASSERT_OK_AND_ASSIGN(bool known, client_->Heartbeat("dying"));
  EXPECT_FALSE(known);
}

TEST_F(CacheStoreProcessTest, SameTenantSaltHits) {
  Start();
  Register("n", 64);
  Store(Chain("salt-a", 4));
  EXPECT_EQ(Matched(Chain("salt-a", 4)), 4);
}

TEST_F(CacheStoreProcessTest, DifferentTenantSaltMisses) {
  Start();
  Register("n", 64);
  Store(Chain("salt-a", 4));
  EXPECT_EQ(Matched(Chain("salt-b", 4)), 0);
}

TEST_F(CacheStoreProcessTest, BadInputIsRejectedByFieldAndTheServerKeepsServing) {
  Start();
  Register("n", 8);
  EXPECT_THAT(client_->MatchPrefix({}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("chain")));
  std::vector<kv::BlockHash> too_long(4097, kv::BlockHash{1, 2});
  EXPECT_THAT(client_->MatchPrefix(too_long),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("chain_packed")));
  EXPECT_THAT(client_->QueryPrefix(too_long),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("chain")));
  EXPECT_THAT(client_->MatchPrefix({kv::BlockHash{}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("chain_packed[0]")));
  {  // A packed chain that is not whole hashes, and both forms at once.
    grpc::ClientContext ctx;
    v1::MatchPrefixRequest req;
    req.set_chain_packed(std::string(15, 'x'));
    v1::MatchPrefixResponse resp;
    grpc::Status s = client_->stub().MatchPrefix(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("chain_packed"));
    grpc::ClientContext ctx2;
    req.set_chain_packed(std::string(16, 'x'));
    CacheStoreClient::ToProto(kv::BlockHash{1, 2}, req.add_chain());
    s = client_->stub().MatchPrefix(&ctx2, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("set one of them"));
    grpc::ClientContext ctx3;
    v1::MatchPrefixRequest zero;
    CacheStoreClient::ToProto(kv::BlockHash{}, zero.add_chain());
    s = client_->stub().MatchPrefix(&ctx3, zero, &resp);
    EXPECT_THAT(s.error_message(), HasSubstr("chain[0]"));
  }
  v1::RegisterNodeRequest bad;
  bad.set_node_id("bad id with spaces");
  EXPECT_THAT(client_->RegisterNode(bad),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("node_id")));
  bad.set_node_id("ok");
  bad.add_segments()->set_segment_id("s");
  EXPECT_THAT(client_->RegisterNode(bad),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("segments[0].tier")));
  v1::AllocateRequest alloc;
  alloc.add_blocks()->set_size_bytes(10);
  EXPECT_THAT(client_->Allocate(alloc),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("blocks[0].hash")));
  EXPECT_THAT(client_->AllocateChain(Chain("t", 1), 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("size_bytes")));
  EXPECT_THAT(client_->AllocateChain(Chain("t", 1), 1 << 21),  // bigger than any slot
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("blocks[0]")));
  EXPECT_THAT(client_->Commit(0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("allocation_id")));
  EXPECT_THAT(client_->ReleaseLease(77),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("lease_id")));
  v1::RegisterNodeRequest huge;  // over the 4 MiB message limit
  huge.set_node_id("huge");
  huge.add_segments()->set_memory_key(std::string(5 << 20, 'x'));
  EXPECT_THAT(client_->RegisterNode(huge), StatusIs(absl::StatusCode::kResourceExhausted));
  // Still serving.
  Store(Chain("t", 3));
  EXPECT_EQ(Matched(Chain("t", 3)), 3);
  EXPECT_TRUE(proc_->Running());
}

TEST_F(CacheStoreProcessTest, AnswersTheStandardHealthCheck) {
  Start();
  auto channel = grpc::CreateChannel(target_, grpc::InsecureChannelCredentials());
  auto health = grpc::health::v1::Health::NewStub(channel);
  for (const std::string service : {"", "kvrelay.v1.CacheStore"}) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    grpc::health::v1::HealthCheckRequest req;
    req.set_service(service);
    grpc::health::v1::HealthCheckResponse resp;
    grpc::Status status = health->Check(&ctx, req, &resp);
    ASSERT_TRUE(status.ok()) << service << ": " << status.error_message();
    EXPECT_EQ(resp.status(), grpc::health::v1::HealthCheckResponse::SERVING) << service;
  }
}

TEST_F(CacheStoreProcessTest, SigtermDrainsAndExitsCleanly) {
  Start({"--drain-timeout", "1s"});
  Register("n", 8);
  proc_->Signal(SIGTERM);
  KV_ASSERT_OK_AND_ASSIGN(int code, proc_->Wait(absl::Seconds(30)));
  EXPECT_EQ(code, 0);
  EXPECT_THAT(proc_->Stdout(), HasSubstr("cachestore stopped"));
}

// --- Identity, soft state, events (issues 10 and 13) -----------------------------------------

TEST_F(CacheStoreProcessTest, SecondProcessWithTheSameNodeIdIsRefused) {
  Start();
  auto first = NodeClient("prefill-0", CacheStoreClient::NewIncarnation());
  auto second = NodeClient("prefill-0", CacheStoreClient::NewIncarnation());
  KV_ASSERT_OK_AND_ASSIGN(v1::RegisterNodeResponse r, first->Register(Reg(16)));
  EXPECT_EQ(r.incarnation(), first->node().incarnation);
  EXPECT_NE(r.store_incarnation(), 0u);
  CacheStoreClient::Registration elsewhere = Reg(16);  // another host (the same one would be
  elsewhere.grpc_address = "127.0.0.2:7100";           // the first process's successor)
  EXPECT_THAT(second->Register(elsewhere),
              StatusIs(absl::StatusCode::kAlreadyExists,
                       ::testing::AllOf(HasSubstr("prefill-0"), HasSubstr("127.0.0.1:13337"))));
  EXPECT_THAT(first->Register(Reg(16)), IsOk());  // idempotent for the same incarnation
  // The second process cannot act for the node either.
  EXPECT_THAT(second->Heartbeat(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("prefill-0")));
  EXPECT_THAT(second->AllocateChain(Chain("t", 2), 1 << 20),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("prefill-0")));
  // Unguessable, caller-bound ids: another node cannot commit, abort or release.
  auto other = NodeClient("decode-0", CacheStoreClient::NewIncarnation());
  ASSERT_THAT(other->Register(Reg(0, v1::NODE_ROLE_DECODE)), IsOk());
  KV_ASSERT_OK_AND_ASSIGN(v1::AllocateResponse a, first->AllocateChain(Chain("t", 2), 1 << 20));
  EXPECT_EQ(a.blocks(0).replicas(0).node_id(), "prefill-0");
  EXPECT_EQ(a.blocks(0).replicas(0).incarnation(), first->node().incarnation);
  EXPECT_THAT(other->Commit(a.allocation_id()), StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(other->Abort(a.allocation_id()), StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(client_->Abort(a.allocation_id()), StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(second->Commit(a.allocation_id()), StatusIs(absl::StatusCode::kFailedPrecondition));
  KV_ASSERT_OK_AND_ASSIGN(int n, first->Commit(a.allocation_id()));
  EXPECT_EQ(n, 2);
  KV_ASSERT_OK_AND_ASSIGN(v1::MatchPrefixResponse m,
                          first->MatchPrefix(Chain("t", 2), absl::Seconds(30)));
  ASSERT_EQ(m.matched(), 2);
  EXPECT_EQ(CacheStoreClient::Locations(m)[0][0].incarnation(), first->node().incarnation);
  EXPECT_THAT(other->ReleaseLease(m.lease_id()), StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(first->ReleaseLease(m.lease_id()), IsOk());
}

TEST_F(CacheStoreProcessTest, SilentNodeIsSuspectThenServesAgainWithItsBlocks) {
  Start({"--suspect-grace", "60s"});
  auto node = NodeClient("decode-0", CacheStoreClient::NewIncarnation());
  ASSERT_THAT(node->Register(Reg(16, v1::NODE_ROLE_DECODE, absl::Seconds(1))), IsOk());
  auto chain = Chain("t", 3);
  KV_ASSERT_OK_AND_ASSIGN(v1::AllocateResponse a, node->AllocateChain(chain, 1 << 20));
  ASSERT_THAT(node->Commit(a.allocation_id()), IsOk());
  ASSERT_EQ(Matched(chain), 3);
  // No heartbeat for a while (a stall or a partition): suspect, blocks skipped but kept.
  int matched = -1;
  for (int i = 0; i < 200 && matched != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
    matched = Matched(chain);
  }
  ASSERT_EQ(matched, 0);
  KV_ASSERT_OK_AND_ASSIGN(v1::StatsResponse st, client_->Stats());
  EXPECT_EQ(st.suspect_nodes(), 1);
  EXPECT_EQ(st.committed_blocks(), 3);
  KV_ASSERT_OK_AND_ASSIGN(v1::ListNodesResponse list, client_->ListNodes());
  ASSERT_EQ(list.nodes_size(), 1);
  EXPECT_EQ(list.nodes(0).state(), v1::NODE_STATE_SUSPECT);
  // Back: live again at once, with its blocks.
  v1::NodeLoad load;
  load.set_active_requests(2);
  load.set_free_kv_blocks(100);
  KV_ASSERT_OK_AND_ASSIGN(v1::HeartbeatResponse hb, node->Heartbeat(&load));
  EXPECT_TRUE(hb.known());
  EXPECT_EQ(hb.previous_state(), v1::NODE_STATE_SUSPECT);
  EXPECT_EQ(Matched(chain), 3);
  KV_ASSERT_OK_AND_ASSIGN(list, client_->ListNodes());
  ASSERT_EQ(list.nodes_size(), 1);
  EXPECT_EQ(list.nodes(0).role(), v1::NODE_ROLE_DECODE);
  EXPECT_EQ(list.nodes(0).grpc_address(), "127.0.0.1:7100");
  EXPECT_EQ(list.nodes(0).address().address(), "127.0.0.1:13337");
  EXPECT_EQ(list.nodes(0).load().active_requests(), 2);
  // Node events reach watchers: joined, suspect, live.
  std::vector<v1::Event::Kind> kinds;
  ASSERT_THAT(client_->WatchEvents(1, absl::Seconds(5),
                                   [&](const v1::Event& e) {
                                     if (e.has_node()) kinds.push_back(e.kind());
                                     return e.sequence() < list.last_sequence();
                                   }),
              IsOk());
  ASSERT_GE(kinds.size(), 3u);
  kinds.resize(3);  // on a loaded machine it may have turned suspect again since
  EXPECT_EQ(kinds,
            (std::vector<v1::Event::Kind>{v1::Event::KIND_NODE_JOINED, v1::Event::KIND_NODE_SUSPECT,
                                          v1::Event::KIND_NODE_LIVE}));
}

TEST_F(CacheStoreProcessTest, NodeReannouncesItsBlocksAfterAStoreRestartWithoutItsLog) {
  Start({"--data-dir", ""});  // no durability: the restart loses the index
  const uint64_t incarnation = CacheStoreClient::NewIncarnation();
  auto chain = Chain("t", 4);
  std::vector<v1::AnnouncedBlock> held;
  uint64_t store_incarnation = 0;
  {
    auto node = NodeClient("prefill-0", incarnation);
    KV_ASSERT_OK_AND_ASSIGN(v1::RegisterNodeResponse r, node->Register(Reg(16)));
    store_incarnation = r.store_incarnation();
    KV_ASSERT_OK_AND_ASSIGN(v1::AllocateResponse a, node->AllocateChain(chain, 1 << 20));
    ASSERT_THAT(node->Commit(a.allocation_id()), IsOk());
    for (int i = 0; i < a.blocks_size(); ++i) {
      v1::AnnouncedBlock b;
      *b.mutable_hash() = a.blocks(i).hash();
      if (i > 0) *b.mutable_parent() = a.blocks(i - 1).hash();
      b.set_slot(a.blocks(i).replicas(0).slot());
      b.set_size_bytes(1 << 20);
      held.push_back(b);
    }
  }
  Kill9AndRestart({"--data-dir", ""});
  auto node = NodeClient("prefill-0", incarnation);
  KV_ASSERT_OK_AND_ASSIGN(v1::HeartbeatResponse hb, node->Heartbeat());
  EXPECT_FALSE(hb.known());
  EXPECT_NE(hb.store_incarnation(), store_incarnation);
  ASSERT_THAT(node->Register(Reg(16)), IsOk());
  KV_ASSERT_OK_AND_ASSIGN(v1::AnnounceBlocksResponse ann, node->Announce("kv", held));
  EXPECT_EQ(ann.accepted(), 4);
  EXPECT_EQ(ann.rejected_size(), 0);
  EXPECT_EQ(Matched(chain), 4);
  KV_ASSERT_OK_AND_ASSIGN(ann, node->Announce("kv", held));
  EXPECT_EQ(ann.already_present(), 4);
}

TEST_F(CacheStoreProcessTest, WatchFromOneAfterALogReplayAnswersAndSequencesNeverGoBack) {
  // Issue 13.5: after a restart that replays the log, WatchEvents{from_sequence: 1} crashed the
  // store, and sequence numbers went backwards after kill -9 (10 -> 5).
  Start();
  const uint64_t inc = CacheStoreClient::NewIncarnation();
  auto node = NodeClient("n", inc);
  ASSERT_THAT(node->Register(Reg(64)), IsOk());
  KV_ASSERT_OK_AND_ASSIGN(v1::AllocateResponse a, node->AllocateChain(Chain("t", 4), 1 << 20));
  ASSERT_THAT(node->Commit(a.allocation_id()), IsOk());
  ASSERT_THAT(node->Deregister(), IsOk());  // removal events the log does not list one by one
  KV_ASSERT_OK_AND_ASSIGN(v1::StatsResponse before, client_->Stats());
  ASSERT_GE(before.last_sequence(), 10u);
  Kill9AndRestart();
  for (uint64_t from : {uint64_t{1}, uint64_t{5}, before.last_sequence()}) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
    v1::WatchEventsRequest req;
    req.set_from_sequence(from);
    auto reader = client_->stub().WatchEvents(&ctx, req);
    v1::Event e;
    while (reader->Read(&e)) {
    }
    grpc::Status s = reader->Finish();
    EXPECT_TRUE(s.error_code() == grpc::StatusCode::OUT_OF_RANGE ||
                s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED)
        << from << ": " << s.error_message();
  }
  ASSERT_TRUE(proc_->Running()) << "the store crashed on WatchEvents";
  KV_ASSERT_OK_AND_ASSIGN(v1::StatsResponse after, client_->Stats());
  EXPECT_GE(after.last_sequence(), before.last_sequence());
  auto again = NodeClient("n", CacheStoreClient::NewIncarnation());
  ASSERT_THAT(again->Register(Reg(64)), IsOk());
  std::vector<uint64_t> seqs;
  ASSERT_THAT(client_->WatchEvents(after.last_sequence() + 1, absl::Seconds(5),
                                   [&](const v1::Event& e) {
                                     seqs.push_back(e.sequence());
                                     return false;
                                   }),
              IsOk());
  ASSERT_EQ(seqs.size(), 1u);
  EXPECT_GT(seqs[0], before.last_sequence());
}

TEST_F(CacheStoreProcessTest, NumericInputsAreBoundedAndNamed) {
  Start();
  auto node = NodeClient("fake", CacheStoreClient::NewIncarnation());
  CacheStoreClient::Registration reg = Reg(16);
  reg.segments[0].set_capacity_slots(int64_t{1} << 40);  // ~8 EiB at 8 MiB slots
  EXPECT_THAT(node->Register(reg), StatusIs(absl::StatusCode::kInvalidArgument,
                                            HasSubstr("segments[0].capacity_slots")));
  reg = Reg(16);
  reg.segments[0].set_slot_bytes(uint64_t{1} << 40);
  EXPECT_THAT(node->Register(reg),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("segments[0].slot_bytes")));
  reg = Reg(16);
  reg.ttl = absl::Milliseconds(5);
  EXPECT_THAT(node->Register(reg),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ttl_ms")));
  v1::RegisterNodeRequest raw;
  raw.set_node_id("x");
  raw.set_role(static_cast<v1::NodeRole>(42));
  EXPECT_THAT(client_->RegisterNode(raw),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("role")));
  ASSERT_THAT(node->Register(Reg(16)), IsOk());
  v1::NodeLoad load;
  load.set_queued_requests(-1);
  EXPECT_THAT(node->Heartbeat(&load),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("load.queued_requests")));
  v1::AllocateRequest alloc;
  CacheStoreClient::ToProto(Chain("t", 1)[0], alloc.add_blocks()->mutable_hash());
  alloc.mutable_blocks(0)->set_size_bytes(1 << 20);
  alloc.set_replicas(99);
  EXPECT_THAT(client_->Allocate(alloc),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("replicas")));
  alloc.set_replicas(1);
  alloc.set_node_id("fake");  // a node must say which incarnation it is
  EXPECT_THAT(client_->Allocate(alloc),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("incarnation")));
  v1::AnnouncedBlock b;
  CacheStoreClient::ToProto(Chain("t", 1)[0], b.mutable_hash());
  b.set_slot(-1);
  b.set_size_bytes(1);
  EXPECT_THAT(node->Announce("kv", {b}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("blocks[0].slot")));
  EXPECT_TRUE(proc_->Running());
}

TEST(CacheStoreCommandTest, BadFlagsAreUsageErrors) {
  KV_ASSERT_OK_AND_ASSIGN(auto r, testing::RunCommand({testing::BinaryPath("kvrelay"), "cachestore",
                                                       "--policy", "fifo", "--insecure"}));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.stderr_text, HasSubstr("policy"));
  KV_ASSERT_OK_AND_ASSIGN(
      r, testing::RunCommand({testing::BinaryPath("kvrelay"), "trace-replay", "--trace",
                              "/nonexistent", "--capacity-blocks", "0"}));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.stderr_text, HasSubstr("capacity-blocks"));
}

TEST(TraceReplayCommandTest, PrintsJsonForASmallTrace) {
  testing::TempDir dir;
  const std::string path = dir.File("trace.jsonl");
  {
    FILE* f = std::fopen(path.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs("{\"hash_ids\": [1, 2, 3]}\n{\"hash_ids\": [1, 2, 4]}\n", f);
    std::fclose(f);
  }
  KV_ASSERT_OK_AND_ASSIGN(
      auto r, testing::RunCommand({testing::BinaryPath("kvrelay"), "trace-replay", "--trace", path,
                                   "--capacity-blocks", "10", "--policy", "lru", "--json"}));
  EXPECT_EQ(r.exit_code, 0) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("\"hit_rate\": 0.333333"));  // 2 of 6 blocks
  EXPECT_THAT(r.stdout_text, HasSubstr("\"policy\": \"lru\""));
  EXPECT_THAT(r.stdout_text, HasSubstr("\"capacity_blocks\": 10"));
}

}  // namespace
}  // namespace kvrelay::cachestore

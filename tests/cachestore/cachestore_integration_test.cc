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

std::string HttpGet(int port, const std::string& path) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string out;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string req = "GET " + path + " HTTP/1.0\r\n\r\n";
    ::send(fd, req.data(), req.size(), 0);
    char buf[4096];
    ssize_t n;
    while ((n = ::recv(fd, buf, sizeof(buf), 0)) > 0) out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

class CacheStoreProcessTest : public ::testing::Test {
 protected:
  void Start(const std::vector<std::string>& extra = {}) {
    std::vector<std::string> argv = {testing::BinaryPath("kvrelay"), "cachestore",
                                     "--port",     "0",
                                     "--metrics-port", "0",
                                     "--data-dir", dir_.File("data"),
                                     "--tick",     "20ms"};
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
  EXPECT_EQ(st.policy(), "lrfu");
  const std::string metrics = HttpGet(metrics_port_, "/metrics");
  EXPECT_THAT(metrics, HasSubstr("200 OK"));
  EXPECT_THAT(metrics, HasSubstr("kvrelay_cachestore_prefix_hit_blocks_total 16"));
  EXPECT_THAT(metrics, HasSubstr("kvrelay_cachestore_used_bytes{tier=\"host\"} 8388608"));
  EXPECT_THAT(metrics, HasSubstr("kvrelay_cachestore_rpc_seconds_count{rpc=\"MatchPrefix\"}"));
  EXPECT_THAT(HttpGet(metrics_port_, "/nope"), HasSubstr("404"));
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
  EXPECT_EQ(st.last_sequence(), 5u);
}

TEST_F(CacheStoreProcessTest, HeartbeatLossDropsTheNodesBlocks) {
  Start();
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
  EXPECT_EQ(matched, 0);
  EXPECT_EQ(Matched(on_alive), 2);
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
  EXPECT_THAT(client_->Commit(0), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr("allocation_id")));
  EXPECT_THAT(client_->ReleaseLease(77), StatusIs(absl::StatusCode::kNotFound,
                                                  HasSubstr("lease_id")));
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

TEST(CacheStoreCommandTest, BadFlagsAreUsageErrors) {
  KV_ASSERT_OK_AND_ASSIGN(auto r, testing::RunCommand({testing::BinaryPath("kvrelay"),
                                                       "cachestore", "--policy", "fifo"}));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.stderr_text, HasSubstr("policy"));
  KV_ASSERT_OK_AND_ASSIGN(r, testing::RunCommand({testing::BinaryPath("kvrelay"), "trace-replay",
                                                  "--trace", "/nonexistent", "--capacity-blocks",
                                                  "0"}));
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
  KV_ASSERT_OK_AND_ASSIGN(auto r, testing::RunCommand({testing::BinaryPath("kvrelay"),
                                                       "trace-replay", "--trace", path,
                                                       "--capacity-blocks", "10", "--policy",
                                                       "lru", "--json"}));
  EXPECT_EQ(r.exit_code, 0) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("\"hit_rate\": 0.333333"));  // 2 of 6 blocks
  EXPECT_THAT(r.stdout_text, HasSubstr("\"policy\": \"lru\""));
  EXPECT_THAT(r.stdout_text, HasSubstr("\"capacity_blocks\": 10"));
}

}  // namespace
}  // namespace kvrelay::cachestore

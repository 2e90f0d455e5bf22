// kill -9 of a decode worker while it streams: its requests fail over to the other decode
// worker (or end with UNAVAILABLE) within their deadline, the other requests are unaffected
// (same tokens as the co-located reference), `kvrelay up` reports the death, the cache store
// drops the dead node and its blocks, and the cluster keeps serving.

#include <signal.h>

#include <atomic>
#include <map>
#include <set>

#include "common/file_util.h"
#include "gateway/gateway.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kv/block_hash.h"
#include "tests/e2e/e2e_util.h"
#include "tests/e2e/local_cluster.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"

namespace kvrelay::e2e {
using ::kvrelay::gateway::client::GatewayClient;
using ::kvrelay::gateway::client::GatewayRequest;

namespace {

using ::testing::HasSubstr;

// MatchPrefix without a lease: for each leading committed block of `chain`, the nodes holding
// a replica of it.
absl::StatusOr<std::vector<std::set<std::string>>> MatchPrefix(
    const std::string& store, const std::vector<kv::BlockHash>& chain) {
  auto stub =
      v1::CacheStore::NewStub(grpc::CreateChannel(store, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  v1::MatchPrefixRequest request;
  for (const kv::BlockHash& h : chain) {
    v1::BlockHash* p = request.add_chain();
    p->set_hi(h.hi);
    p->set_lo(h.lo);
  }
  v1::MatchPrefixResponse response;
  grpc::Status s = stub->MatchPrefix(&context, request, &response);
  if (!s.ok()) return absl::UnavailableError(absl::StrCat("MatchPrefix: ", s.error_message()));
  std::vector<std::set<std::string>> blocks;
  for (int i = 0; i < response.matched(); ++i) {
    std::set<std::string> nodes;
    for (const v1::BlockLocation& l : response.blocks(i).replicas()) nodes.insert(l.node_id());
    blocks.push_back(std::move(nodes));
  }
  return blocks;
}

TEST(DecodeWorkerKilled, RequestsFailOverOthersUnaffectedStoreDropsBlocks) {
  testing::TempDir dir;
  const std::string model_dir = dir.File("llama");
  KV_ASSERT_OK(WriteModel(model_dir, "llama"));
  KV_ASSERT_OK_AND_ASSIGN(auto reference, cli::ColocatedGenerator::Load(model_dir));
  // A known tenant secret, so the test can compute the block hashes the workers commit.
  const std::string secret = "e2e-failover-secret";
  KV_ASSERT_OK(WriteFileAtomically(dir.File("secret"), secret));
  ClusterOptions options;
  options.model_dir = model_dir;
  options.prefill = 1;
  options.decode = 2;
  options.extra_args = {"--gateway-args", "--tenant-secret-file " + dir.File("secret")};
  KV_ASSERT_OK_AND_ASSIGN(std::unique_ptr<LocalCluster> cluster, LocalCluster::Start(options));
  KV_ASSERT_OK_AND_ASSIGN(ServiceInfo store, cluster->Service("cachestore"));
  KV_ASSERT_OK_AND_ASSIGN(ServiceInfo victim, cluster->Service("decode-1"));
  KV_ASSERT_OK_AND_ASSIGN(ServiceInfo survivor, cluster->Service("decode-0"));

  // Warm-up: both decode workers finish requests and commit their blocks to the store.
  std::vector<GatewayRequest> warmup;
  for (int i = 0; i < 4; ++i) {
    GatewayRequest r;
    r.generation.tokens = RandomPrompt(40, 300 + i);
    r.generation.max_tokens = 40;
    r.tenant = "failover";
    warmup.push_back(r);
  }
  std::vector<kv::BlockHash> victim_chain;  // blocks a warm-up request left on decode-1
  const std::string salt = gateway::DeriveTenantSalt(secret, "failover");
  const kv::ModelLayout& layout = reference->config().layout;
  std::vector<absl::StatusOr<cli::GenerationResult>> warm =
      GenerateConcurrently(cluster->gateway(), warmup, absl::Seconds(60));
  for (size_t i = 0; i < warm.size(); ++i) {
    ASSERT_TRUE(warm[i].ok()) << warm[i].status() << "\n" << cluster->Log();
    if (warm[i]->decode_worker != victim.address || !victim_chain.empty()) continue;
    // The decode worker commits the full blocks of everything it computed: the prompt and
    // every generated token but the last.
    std::vector<int32_t> seq = warmup[i].generation.tokens;
    seq.insert(seq.end(), warm[i]->tokens.begin(), warm[i]->tokens.end() - 1);
    victim_chain = kv::HashChain(layout.fingerprint(), salt, seq, layout.block_tokens());
  }
  ASSERT_FALSE(victim_chain.empty()) << "no warm-up request reached decode-1";
  KV_ASSERT_OK_AND_ASSIGN(v1::StatsResponse before, CacheStoreStats(store.address));
  ASSERT_EQ(before.nodes(), 3) << before.DebugString();  // prefill-0, decode-0, decode-1
  // The prefill worker committed the 2 pushed prompt blocks, decode-1 the 2 blocks it
  // computed after them (40 + 39 tokens = 4 full blocks).
  KV_ASSERT_OK_AND_ASSIGN(auto held, MatchPrefix(store.address, victim_chain));
  ASSERT_EQ(held.size(), 4u) << "decode-1 did not commit its blocks";
  EXPECT_TRUE(held[0].count("prefill-0") && held[1].count("prefill-0"));
  EXPECT_TRUE(held[2].count("decode-1") && held[3].count("decode-1"));

  // Long requests, all streaming when decode-1 is killed.
  constexpr int kRequests = 6;
  constexpr int kMaxTokens = 2000;
  constexpr absl::Duration kDeadline = absl::Seconds(90);
  std::vector<GatewayRequest> requests;
  for (int i = 0; i < kRequests; ++i) {
    GatewayRequest r;
    r.generation.tokens = RandomPrompt(40, 400 + i);
    r.generation.max_tokens = kMaxTokens;
    r.tenant = "failover";
    requests.push_back(r);
  }
  GatewayClient client(cluster->gateway());
  std::atomic<int> streaming{0};
  std::vector<absl::StatusOr<cli::GenerationResult>> results(kRequests,
                                                             absl::UnknownError("not run"));
  std::vector<absl::Duration> elapsed(kRequests);
  std::vector<std::thread> threads;
  for (int i = 0; i < kRequests; ++i) {
    threads.emplace_back([&, i] {
      bool first = true;
      const absl::Time start = absl::Now();
      results[i] = client.Generate(requests[i], kDeadline, [&](const std::vector<int32_t>&) {
        if (first) streaming.fetch_add(1);
        first = false;
      });
      elapsed[i] = absl::Now() - start;
    });
  }
  const absl::Time wait_until = absl::Now() + absl::Seconds(60);
  while (streaming.load() < kRequests && absl::Now() < wait_until) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(streaming.load(), kRequests) << "not every request started streaming";
  ASSERT_EQ(::kill(victim.pid, SIGKILL), 0);
  for (std::thread& t : threads) t.join();

  int failed_over = 0, unavailable = 0, unaffected = 0;
  for (int i = 0; i < kRequests; ++i) {
    SCOPED_TRACE(absl::StrCat("request ", i));
    EXPECT_LT(elapsed[i], kDeadline);
    if (!results[i].ok()) {
      EXPECT_EQ(results[i].status().code(), absl::StatusCode::kUnavailable) << results[i].status();
      ++unavailable;
      continue;
    }
    const cli::GenerationResult& r = *results[i];
    EXPECT_EQ(r.generated_tokens, kMaxTokens);
    ASSERT_EQ(r.tokens.size(), static_cast<size_t>(kMaxTokens));
    EXPECT_EQ(r.decode_worker, survivor.address);  // nothing finishes on the dead worker
    if (r.attempts > 1) {
      ++failed_over;
      continue;
    }
    // Served by decode-0 from start to end: exactly the co-located tokens.
    ++unaffected;
    KV_ASSERT_OK_AND_ASSIGN(cli::GenerationResult expected,
                            reference->Generate(requests[i].generation));
    EXPECT_EQ(r.tokens, expected.tokens);
  }
  std::printf(
      "after kill -9 of decode-1: %d requests failed over, %d ended UNAVAILABLE, %d "
      "unaffected\n",
      failed_over, unavailable, unaffected);
  EXPECT_GT(failed_over + unavailable, 0) << "the kill hit no request";
  EXPECT_GT(unaffected, 0) << "no request stayed on decode-0";

  // `kvrelay up` reports the death and keeps the rest running.
  EXPECT_TRUE(cluster->process()
                  .WaitForOutput(absl::StrCat("decode-1 (pid ", victim.pid, ") died unexpectedly"),
                                 absl::Seconds(10))
                  .ok())
      << cluster->Log();

  // The cache store drops the dead node (heartbeat TTL) and its blocks: the chain now ends
  // where decode-1's blocks began; the prefill worker's blocks stay.
  v1::StatsResponse after;
  const absl::Time store_deadline = absl::Now() + absl::Seconds(30);
  while (true) {
    KV_ASSERT_OK_AND_ASSIGN(after, CacheStoreStats(store.address));
    if (after.nodes() == before.nodes() - 1 || absl::Now() > store_deadline) break;
    absl::SleepFor(absl::Milliseconds(200));
  }
  EXPECT_EQ(after.nodes(), before.nodes() - 1) << after.DebugString();
  KV_ASSERT_OK_AND_ASSIGN(held, MatchPrefix(store.address, victim_chain));
  ASSERT_EQ(held.size(), 2u) << "blocks held only by the dead decode-1 are still matched";
  for (const std::set<std::string>& nodes : held) EXPECT_EQ(nodes.count("decode-1"), 0u);

  // Still serving through decode-0.
  GatewayRequest fresh;
  fresh.generation.tokens = RandomPrompt(30, 999);
  fresh.generation.max_tokens = 5;
  fresh.tenant = "failover";
  KV_ASSERT_OK_AND_ASSIGN(cli::GenerationResult r, client.Generate(fresh, absl::Seconds(60)));
  KV_ASSERT_OK_AND_ASSIGN(cli::GenerationResult expected, reference->Generate(fresh.generation));
  EXPECT_EQ(r.tokens, expected.tokens);

  // A child died, so `kvrelay up` exits 1, after stopping the others cleanly.
  KV_ASSERT_OK_AND_ASSIGN(int code, cluster->Stop());
  EXPECT_EQ(code, 1);
  EXPECT_THAT(cluster->process().Stdout(), HasSubstr("kvrelay up: stopped"));
}

}  // namespace
}  // namespace kvrelay::e2e

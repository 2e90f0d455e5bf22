// A hung cache store costs reuse, not latency (issue 34), on real processes: `kvrelay up` (cache
// store, one prefill and one decode worker, a gateway), the store SIGSTOPped for ~5 s under
// sequential requests with new prompts. Each process that calls the store on the request path
// (the gateway's holdings lookup, the prefill worker's MatchPrefix and commit) may wait once,
// bounded by its per-call limit; after that its gate fails those calls fast until a short probe
// gets an answer. So: no request fails, every answer equals the co-located reference, and at
// most one request per process (two) has a TTFT above the cold TTFT + 600 ms. After SIGCONT a
// repeated prompt gets its prefix hits again. Labelled `timing`: it asserts latency.

#include <signal.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "cli/colocated.h"
#include "common/status_macros.h"
#include "gateway/client/gateway_client.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_util.h"
#include "tests/e2e/local_cluster.h"
#include "tests/testing/process_harness.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"

namespace kvrelay::e2e {
namespace {

using ::kvrelay::gateway::client::GatewayClient;
using ::kvrelay::gateway::client::GatewayRequest;

constexpr absl::Duration kRequestTimeout = absl::Seconds(30);
constexpr int kPromptTokens = 256;
// The processes that call the store on a request's path: the gateway and the prefill worker.
constexpr int kStoreCallers = 2;

using ::kvrelay::testing::WaitStopped;

GatewayRequest Request(uint32_t seed) {
  GatewayRequest r;
  r.generation.tokens = RandomPrompt(kPromptTokens, seed);
  r.generation.max_tokens = 4;
  r.tenant = "pause";
  return r;
}

TEST(StorePaused, CostsAtMostOneBoundedWaitPerProcessAndReuseComesBack) {
  testing::TempDir dir;
  const std::string model_dir = dir.File("llama");
  KV_ASSERT_OK(WriteModel(model_dir, "llama"));
  KV_ASSERT_OK_AND_ASSIGN(std::unique_ptr<cli::ColocatedGenerator> reference,
                          cli::ColocatedGenerator::Load(model_dir));
  ClusterOptions options;
  options.model_dir = model_dir;
  options.prefill = 1;
  options.decode = 1;
  KV_ASSERT_OK_AND_ASSIGN(std::unique_ptr<LocalCluster> cluster, LocalCluster::Start(options));
  KV_ASSERT_OK_AND_ASSIGN(ServiceInfo store, cluster->Service("cachestore"));
  GatewayClient client(cluster->gateway());

  // Cold TTFT with the store up: new prompts, nothing to reuse (the first one warms up).
  double cold_ms = 0;
  for (uint32_t seed = 100; seed < 104; ++seed) {
    KV_ASSERT_OK_AND_ASSIGN(cli::GenerationResult r,
                            client.Generate(Request(seed), kRequestTimeout));
    if (seed > 100) cold_ms = std::max(cold_ms, r.ttft_ms);
  }
  // A prompt whose prefix the store knows.
  const GatewayRequest repeated = Request(7);
  KV_ASSERT_OK(client.Generate(repeated, kRequestTimeout).status());
  KV_ASSERT_OK_AND_ASSIGN(cli::GenerationResult hit, client.Generate(repeated, kRequestTimeout));
  ASSERT_GT(hit.prefix_hit_tokens, 0) << cluster->Log();

  ASSERT_EQ(::kill(store.pid, SIGSTOP), 0);
  ASSERT_TRUE(WaitStopped(store.pid));
  const absl::Time resume_at = absl::Now() + absl::Seconds(5);
  std::vector<GatewayRequest> sent;
  std::vector<absl::StatusOr<cli::GenerationResult>> results;
  for (uint32_t seed = 1000; absl::Now() < resume_at; ++seed) {
    sent.push_back(Request(seed));
    results.push_back(client.Generate(sent.back(), kRequestTimeout));
  }
  ASSERT_EQ(::kill(store.pid, SIGCONT), 0);

  int failed = 0, wrong = 0, slow = 0;
  std::string report;
  for (size_t i = 0; i < results.size(); ++i) {
    if (!results[i].ok()) {
      ++failed;
      absl::StrAppend(&report, "request ", i, ": ", results[i].status().ToString(), "\n");
      continue;
    }
    KV_ASSERT_OK_AND_ASSIGN(cli::GenerationResult expected,
                            reference->Generate(sent[i].generation));
    if (results[i]->tokens != expected.tokens) ++wrong;
    if (results[i]->ttft_ms > cold_ms + 600) ++slow;
    absl::StrAppend(&report, "request ", i, ": TTFT ", results[i]->ttft_ms, " ms\n");
  }
  std::printf(
      "store paused 5 s: %zu requests, %d failed, %d wrong, %d with TTFT > cold %.0f ms "
      "+ 600 ms\n%s",
      results.size(), failed, wrong, slow, cold_ms, report.c_str());
  EXPECT_EQ(wrong, 0);
  EXPECT_EQ(failed, 0) << report << cluster->Log();
  EXPECT_GE(results.size(), 3u) << "requests during the pause waited on the store\n" << report;
  EXPECT_LE(slow, kStoreCallers) << report;

  // Reuse comes back once a probe gets through (cool-downs are at most a few seconds).
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  int32_t hit_tokens = 0;
  while (hit_tokens == 0 && absl::Now() < give_up) {
    KV_ASSERT_OK_AND_ASSIGN(cli::GenerationResult r, client.Generate(repeated, kRequestTimeout));
    hit_tokens = r.prefix_hit_tokens;
  }
  EXPECT_GT(hit_tokens, 0) << "no prefix hit within 20 s of SIGCONT\n" << cluster->Log();
}

}  // namespace
}  // namespace kvrelay::e2e

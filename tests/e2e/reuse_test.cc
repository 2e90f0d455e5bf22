// Prefix reuse across nodes, on real processes (`kvrelay up`: cache store, 2 prefill workers, 2
// decode workers, a gateway that picks prefill workers by load alone, UCX on loopback):
//  - a prefix computed on one prefill node is pulled by the other, which computes only the new
//    tokens; the fetched bytes are exactly the layout's bytes of the reused blocks;
//  - a second turn on the same decode worker receives only its new blocks;
//  - holders killed while another node pulls from them cost the pull, not the request: the
//    reader recomputes and the tokens are right, within the deadline.
// Every output is compared with the co-located reference. The cluster runs an fp8_e4m3 KV cache
// (--kv-cache-dtype): the blocks pulled across nodes carry their scales inside them, and the
// fetched bytes are the fp8 layout's (bf16 blocks cross nodes in serving_inprocess_test and
// tests/multinode/reuse_cost_test.sh).

#include <signal.h>

#include <map>
#include <thread>

#include "common/status_macros.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kv/hf_config.h"
#include "tests/e2e/e2e_util.h"
#include "tests/e2e/local_cluster.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"

namespace kvrelay::e2e {
using ::kvrelay::gateway::client::GatewayClient;
using ::kvrelay::gateway::client::GatewayRequest;

namespace {

constexpr absl::Duration kRequestTimeout = absl::Seconds(60);

class CrossNodeReuse : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing::TempDir();
    model_dir_ = dir_->File("llama");
    ASSERT_TRUE(WriteModel(model_dir_, "llama").ok());
    absl::StatusOr<kv::ModelConfig> config =
        kv::LoadHfConfig(model_dir_ + "/config.json", {.kv_dtype = kv::DType::kFp8});
    ASSERT_TRUE(config.ok()) << config.status();
    config_ = new kv::ModelConfig(*config);
    absl::StatusOr<std::unique_ptr<cli::ColocatedGenerator>> reference =
        cli::ColocatedGenerator::Load(model_dir_, 1, {.kind = model::DeviceChoice::Kind::kCpu},
                                      kv::DType::kFp8);
    ASSERT_TRUE(reference.ok()) << reference.status();
    reference_ = reference->release();
    ClusterOptions options;
    options.model_dir = model_dir_;
    options.prefill = 2;
    options.decode = 2;
    options.worker_args = kPatientStoreCalls;
    // By load alone, consecutive requests alternate between the two prefill workers, so a
    // prefix computed on one is next asked of the other.
    options.extra_args = {"--gateway-args",
                          "--prefix-routing=false --prefill-timeout 10s --reserve-timeout-floor 2s",
                          "--prefill-args",
                          "--fetch-timeout 3s",
                          "--kv-cache-dtype",
                          "fp8_e4m3"};
    absl::StatusOr<std::unique_ptr<LocalCluster>> cluster = LocalCluster::Start(options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = cluster->release();
  }
  static void TearDownTestSuite() {
    delete cluster_;  // SIGKILLs what is left (one worker was killed on purpose)
    delete reference_;
    delete config_;
    delete dir_;
  }

  static int64_t BlockBytes() {
    int64_t bytes = 0;
    for (size_t g = 0; g < config_->layout.groups().size(); ++g) {
      bytes += config_->layout.BlockBytes(static_cast<int>(g));
    }
    return bytes;
  }
  static GatewayRequest Request(std::vector<int32_t> tokens, const std::string& tenant,
                                int32_t max_tokens = 6) {
    GatewayRequest r;
    r.generation.tokens = std::move(tokens);
    r.generation.max_tokens = max_tokens;
    r.tenant = tenant;
    return r;
  }
  static std::vector<int32_t> Reference(const GatewayRequest& r) {
    absl::StatusOr<cli::GenerationResult> expected = reference_->Generate(r.generation);
    EXPECT_TRUE(expected.ok()) << expected.status();
    return expected.ok() ? expected->tokens : std::vector<int32_t>{};
  }
  // The name (prefill-0, ...) of the service at gRPC `address`.
  static std::string ServiceAt(const std::string& address) {
    for (const ServiceInfo& s : cluster_->services()) {
      if (s.address == address) return s.name;
    }
    return "";
  }

  static testing::TempDir* dir_;
  static std::string model_dir_;
  static kv::ModelConfig* config_;
  static cli::ColocatedGenerator* reference_;
  static LocalCluster* cluster_;
};
testing::TempDir* CrossNodeReuse::dir_ = nullptr;
std::string CrossNodeReuse::model_dir_;
kv::ModelConfig* CrossNodeReuse::config_ = nullptr;
cli::ColocatedGenerator* CrossNodeReuse::reference_ = nullptr;
LocalCluster* CrossNodeReuse::cluster_ = nullptr;

// Request A (100 tokens: 6 full blocks) is computed on one prefill node; request B shares A's
// first 96 tokens (6 blocks) and goes to the other prefill node, which pulls the 6 blocks from
// the first and computes only block 7.
TEST_F(CrossNodeReuse, ThePrefixIsPulledFromItsHolderNotRecomputed) {
  GatewayClient client(cluster_->gateway());
  const std::vector<int32_t> a = RandomPrompt(100, 31);
  std::vector<int32_t> b(a.begin(), a.begin() + 96);
  for (int32_t t : RandomPrompt(20, 32)) b.push_back(t);

  const GatewayRequest first = Request(a, "pull");
  KV_ASSERT_OK_AND_ASSIGN(cli::GenerationResult cold, client.Generate(first, kRequestTimeout));
  EXPECT_EQ(cold.tokens, Reference(first));
  EXPECT_EQ(cold.prefix_hit_tokens, 0);
  EXPECT_EQ(cold.fetched_bytes, 0);

  const GatewayRequest second = Request(b, "pull");
  KV_ASSERT_OK_AND_ASSIGN(cli::GenerationResult warm, client.Generate(second, kRequestTimeout));
  EXPECT_EQ(warm.tokens, Reference(second));
  ASSERT_NE(warm.prefill_worker, cold.prefill_worker)
      << "the load-only gateway sent both requests to " << ServiceAt(cold.prefill_worker);
  EXPECT_EQ(warm.prefix_source, "pulled") << cluster_->Log();
  EXPECT_EQ(warm.fetched_bytes, 6 * BlockBytes());
  EXPECT_EQ(warm.prefix_hit_tokens, 96);
  // 116 tokens: prefill computes block 7 (16 tokens), the decode worker the 4-token tail.
  EXPECT_EQ(warm.computed_prompt_tokens, 20);

  KV_ASSERT_OK_AND_ASSIGN(ServiceInfo reader, cluster_->Service(ServiceAt(warm.prefill_worker)));
  KV_ASSERT_OK_AND_ASSIGN(double fetched, ScrapeMetric(reader.metrics_address,
                                                       "kvrelay:prefill_fetched_kv_bytes_total"));
  EXPECT_GE(fetched, static_cast<double>(6 * BlockBytes()));
}

// Turn 1: a 100-token prompt. Turn 2: turn 1's prompt, its 6 generated tokens and 30 new ones
// (136 tokens, 8 full blocks). The decode worker kept turn 1's blocks, so turn 2 goes to it and
// only blocks 7 and 8 are pushed.
TEST_F(CrossNodeReuse, ASecondTurnReceivesOnlyItsNewBlocks) {
  GatewayClient client(cluster_->gateway());
  const GatewayRequest turn1 = Request(RandomPrompt(100, 41), "turns");
  KV_ASSERT_OK_AND_ASSIGN(cli::GenerationResult one, client.Generate(turn1, kRequestTimeout));
  EXPECT_EQ(one.tokens, Reference(turn1));
  EXPECT_EQ(one.transferred_bytes, 6 * BlockBytes());

  std::vector<int32_t> history = turn1.generation.tokens;
  history.insert(history.end(), one.tokens.begin(), one.tokens.end());
  for (int32_t t : RandomPrompt(30, 42)) history.push_back(t);
  ASSERT_EQ(history.size(), 136u);
  const GatewayRequest turn2 = Request(history, "turns");
  KV_ASSERT_OK_AND_ASSIGN(cli::GenerationResult two, client.Generate(turn2, kRequestTimeout));
  EXPECT_EQ(two.tokens, Reference(turn2));
  EXPECT_EQ(two.decode_worker, one.decode_worker);
  // Turn 1's sequence (100 prompt + 5 fed-back generated tokens) filled 6 blocks.
  EXPECT_EQ(two.decode_held_blocks, 6);
  EXPECT_EQ(two.transferred_bytes, (8 - 6) * BlockBytes()) << cluster_->Log();
}

// Both holders of a prefix (the prefill node that computed it and the decode node that kept a
// copy) hang (SIGSTOP) and are killed 2.5 s later. The next request sharing the prefix waits
// out its reserve on the hung decode node (the gateway's --reserve-timeout-floor 2s keeps that
// wait at 2 s, so the pull below starts close to the kill), fails over to the other, and its
// prefill node (the other one) tries to pull from a holder that hangs and then dies: the pull
// is given up, the blocks are recomputed, and the request returns the right tokens well within
// its deadline.
TEST_F(CrossNodeReuse, HoldersKilledMidFetchCostThePullNotTheRequest) {
  GatewayClient client(cluster_->gateway());
  const std::vector<int32_t> a = RandomPrompt(100, 51);
  std::vector<int32_t> b(a.begin(), a.begin() + 96);
  for (int32_t t : RandomPrompt(30, 52)) b.push_back(t);
  const GatewayRequest first = Request(a, "holders-die");
  KV_ASSERT_OK_AND_ASSIGN(cli::GenerationResult cold, client.Generate(first, kRequestTimeout));
  KV_ASSERT_OK_AND_ASSIGN(ServiceInfo prefill, cluster_->Service(ServiceAt(cold.prefill_worker)));
  KV_ASSERT_OK_AND_ASSIGN(ServiceInfo decode, cluster_->Service(ServiceAt(cold.decode_worker)));

  ASSERT_EQ(::kill(prefill.pid, SIGSTOP), 0);
  ASSERT_EQ(::kill(decode.pid, SIGSTOP), 0);
  std::thread killer([&] {
    absl::SleepFor(absl::Milliseconds(2500));
    ::kill(prefill.pid, SIGKILL);
    ::kill(decode.pid, SIGKILL);
  });
  const GatewayRequest second = Request(b, "holders-die");
  const absl::Time start = absl::Now();
  absl::StatusOr<cli::GenerationResult> warm = client.Generate(second, kRequestTimeout);
  const absl::Duration took = absl::Now() - start;
  killer.join();
  ASSERT_TRUE(warm.ok()) << warm.status() << "\n" << cluster_->Log();
  EXPECT_EQ(warm->tokens, Reference(second));
  EXPECT_NE(warm->prefill_worker, cold.prefill_worker);
  EXPECT_NE(warm->decode_worker, cold.decode_worker);
  EXPECT_EQ(warm->prefix_source, "recomputed");
  EXPECT_EQ(warm->fetched_bytes, 0);
  EXPECT_LT(took, absl::Seconds(20));
}

}  // namespace
}  // namespace kvrelay::e2e

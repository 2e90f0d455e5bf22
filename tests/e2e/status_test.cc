// `kvrelay status` on real processes (issue 35): `kvrelay up` with mutual TLS (its default), one
// prefill and two decode workers. Every node serving; a decode worker SIGSTOPped is suspect and
// serving again after SIGCONT; one SIGKILLed is unregistered once the store forgot it (its
// 10 s heartbeat TTL, then --suspect-grace 1s), while the gateway still has its address. Only
// an admin certificate may ask.

#include <signal.h>

#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
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
using ::kvrelay::testing::RunKvrelay;
using ::kvrelay::testing::WaitStopped;
using ::testing::HasSubstr;

class StatusCommand : public ::testing::Test {
 protected:
  void SetUp() override {
    KV_ASSERT_OK(WriteModel(dir_.File("llama"), "llama"));
    ClusterOptions options;
    options.model_dir = dir_.File("llama");
    options.prefill = 1;
    options.decode = 2;
    options.tls = true;
    // --grace 30s: the services drain for up to 28 s, so the long generation the draining
    // step below SIGTERMs its worker during ends even on a loaded ASan machine.
    options.extra_args = {"--cachestore-args", "--suspect-grace 1s", "--grace", "30s"};
    KV_ASSERT_OK_AND_ASSIGN(cluster_, LocalCluster::Start(options));
    // "kvrelay up: status: kvrelay status --gateway G --tls-cert C --tls-key K --tls-ca A"
    for (absl::string_view line : absl::StrSplit(cluster_->process().Stdout(), '\n')) {
      if (!absl::StartsWith(line, "kvrelay up: status: kvrelay status ")) continue;
      std::vector<std::string> words = absl::StrSplit(line, ' ', absl::SkipEmpty());
      admin_flags_.assign(words.begin() + 5, words.end());
    }
    ASSERT_THAT(admin_flags_, ::testing::Contains("--tls-cert")) << cluster_->Log();
  }

  // `kvrelay status --json` with `flags`; the parsed output (null when it printed none).
  nlohmann::json Status(const std::vector<std::string>& flags, int* exit_code = nullptr) {
    std::vector<std::string> args = {"status", "--json", "--timeout", "5s"};
    args.insert(args.end(), flags.begin(), flags.end());
    testing::CommandResult r = RunKvrelay(args, absl::Seconds(20));
    if (exit_code != nullptr) *exit_code = r.exit_code;
    last_stderr_ = r.stderr_text;
    return nlohmann::json::parse(r.stdout_text, nullptr, /*allow_exceptions=*/false);
  }
  nlohmann::json AdminStatus() { return Status(admin_flags_); }

  // The node whose gRPC address is `address` (null when absent).
  static nlohmann::json Node(const nlohmann::json& status, const std::string& address) {
    if (!status.is_object()) return nullptr;
    for (const nlohmann::json& n : status["nodes"]) {
      if (n["address"] == address) return n;
    }
    return nullptr;
  }
  // Polls until `address` is in `state` or `timeout` passes; the last status seen.
  nlohmann::json WaitForState(const std::string& address, const std::string& state,
                              absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    nlohmann::json status;
    while (true) {
      status = AdminStatus();
      const nlohmann::json n = Node(status, address);
      if ((n.is_object() && n["state"] == state) || absl::Now() > deadline) return status;
      absl::SleepFor(absl::Milliseconds(500));
    }
  }

  testing::TempDir dir_;
  std::unique_ptr<LocalCluster> cluster_;
  std::vector<std::string> admin_flags_;  // --gateway and the admin certificate
  std::string last_stderr_;
};

TEST_F(StatusCommand, ShowsServingSuspectAndUnregisteredNodes) {
  // One request, so the prefill worker has hit-rate figures.
  GatewayRequest r;
  r.generation.tokens = RandomPrompt(40, 3);
  r.generation.max_tokens = 2;
  KV_ASSERT_OK(GatewayClient(cluster_->gateway(), cluster_->client_security())
                   .Generate(r, absl::Seconds(60))
                   .status());

  KV_ASSERT_OK_AND_ASSIGN(ServiceInfo prefill, cluster_->Service("prefill-0"));
  KV_ASSERT_OK_AND_ASSIGN(ServiceInfo paused, cluster_->Service("decode-0"));
  KV_ASSERT_OK_AND_ASSIGN(ServiceInfo killed, cluster_->Service("decode-1"));
  KV_ASSERT_OK_AND_ASSIGN(ServiceInfo store, cluster_->Service("cachestore"));

  // Polled: on a loaded CI machine (ASan) a worker's Status may miss the gateway's 500 ms bound
  // once, which rightly shows it suspect for that call.
  nlohmann::json all;
  const absl::Time deadline = absl::Now() + absl::Seconds(15);
  do {
    all = AdminStatus();
    bool serving = all.is_object() && all["nodes"].size() == 3;
    if (serving) {
      for (const nlohmann::json& n : all["nodes"]) serving = serving && n["state"] == "serving";
    }
    if (serving) break;
    absl::SleepFor(absl::Milliseconds(500));
  } while (absl::Now() < deadline);
  ASSERT_TRUE(all.is_object()) << last_stderr_ << cluster_->Log();
  ASSERT_EQ(all["nodes"].size(), 3u) << all.dump(2);
  for (const nlohmann::json& n : all["nodes"]) {
    EXPECT_EQ(n["state"], "serving") << n.dump(2);
    EXPECT_EQ(n["breaker"], "closed") << n.dump(2);
    EXPECT_TRUE(n["registered"].get<bool>()) << n.dump(2);
    EXPECT_NE(n["incarnation"], "0000000000000000") << n.dump(2);
    EXPECT_GT(n["tiers"]["dram"]["total_slots"].get<int64_t>(), 0) << n.dump(2);
  }
  const nlohmann::json p = Node(all, prefill.address);
  ASSERT_TRUE(p.is_object()) << all.dump(2);
  EXPECT_EQ(p["node_id"], "prefill-0");
  EXPECT_EQ(p["role"], "prefill");
  EXPECT_GT(p["computed_tokens"].get<int64_t>() + p["prefix_hit_tokens"].get<int64_t>(), 0)
      << p.dump(2);  // the prompt's full blocks: found or computed
  EXPECT_TRUE(all["store"]["answered"].get<bool>());
  EXPECT_TRUE(all["store"]["leading"].get<bool>());
  EXPECT_EQ(all["store"]["address"], store.address);
  EXPECT_GE(all["store"]["prefix_query_blocks"].get<int64_t>(), 2);

  // The table form names every node.
  std::vector<std::string> table_args = {"status"};
  table_args.insert(table_args.end(), admin_flags_.begin(), admin_flags_.end());
  testing::CommandResult table = RunKvrelay(table_args, absl::Seconds(20));
  EXPECT_EQ(table.exit_code, 0) << table.stderr_text;
  EXPECT_THAT(table.stdout_text, HasSubstr("leader (no HA)"));
  EXPECT_THAT(table.stdout_text, HasSubstr("decode-1"));

  // Only operators (and gateways) may ask: the tenant's client certificate is refused.
  const server::SecurityOptions& c = cluster_->client_security();
  int code = 0;
  (void)Status({"--gateway", cluster_->gateway(), "--tls-cert", c.cert_file, "--tls-key",
                c.key_file, "--tls-ca", c.ca_file},
               &code);
  EXPECT_EQ(code, 1);
  EXPECT_THAT(last_stderr_, HasSubstr("no gateway answered"));

  // Paused: it cannot answer, so it is suspect at once; serving again once it runs.
  ASSERT_EQ(::kill(paused.pid, SIGSTOP), 0);
  ASSERT_TRUE(WaitStopped(paused.pid));
  const nlohmann::json stopped = AdminStatus();
  ::kill(paused.pid, SIGCONT);
  EXPECT_EQ(Node(stopped, paused.address)["state"], "suspect") << stopped.dump(2);
  EXPECT_EQ(Node(stopped, prefill.address)["state"], "serving") << stopped.dump(2);
  const nlohmann::json resumed = WaitForState(paused.address, "serving", absl::Seconds(10));
  EXPECT_EQ(Node(resumed, paused.address)["state"], "serving") << resumed.dump(2);

  // Killed: suspect while the store still lists it, then unregistered once its lease ran out
  // (the gateway keeps the fixed address `kvrelay up` gave it).
  ASSERT_EQ(::kill(killed.pid, SIGKILL), 0);
  const absl::Time killed_at = absl::Now();
  const nlohmann::json gone = WaitForState(killed.address, "unregistered", absl::Seconds(25));
  const nlohmann::json n = Node(gone, killed.address);
  ASSERT_TRUE(n.is_object()) << gone.dump(2);
  EXPECT_EQ(n["state"], "unregistered") << gone.dump(2);
  EXPECT_FALSE(n["registered"].get<bool>());
  std::printf("decode-1 unregistered %.1f s after SIGKILL\n",
              absl::ToDoubleSeconds(absl::Now() - killed_at));
  const nlohmann::json after = WaitForState(paused.address, "serving", absl::Seconds(10));
  EXPECT_EQ(Node(after, paused.address)["state"], "serving") << after.dump(2);

  // SIGTERMed with a long generation in flight (decode-0 is the only decode worker left): it
  // says it is draining while it finishes that request, which still ends with every token.
  GatewayRequest long_one;
  long_one.generation.tokens = RandomPrompt(40, 5);
  // ~1.5 s in the plain build. Under ASan the decode worker made 625-725 tokens in the 28 s
  // drain on a 2-core CI VM (this one), so it asks for fewer there: still ~15 s in flight.
#if defined(__SANITIZE_ADDRESS__)
  long_one.generation.max_tokens = 400;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
  long_one.generation.max_tokens = 400;
#else
  long_one.generation.max_tokens = 1000;
#endif
#else
  long_one.generation.max_tokens = 1000;
#endif
  absl::StatusOr<cli::GenerationResult> finished = absl::UnknownError("not run");
  std::thread generating([&] {
    finished = GatewayClient(cluster_->gateway(), cluster_->client_security())
                   .Generate(long_one, absl::Seconds(60));
  });
  nlohmann::json busy;
  const absl::Time busy_deadline = absl::Now() + absl::Seconds(20);
  do {
    busy = AdminStatus();
    const nlohmann::json d = Node(busy, paused.address);
    if (d.is_object() && d["active_requests"].is_number() && d["active_requests"] > 0) break;
    absl::SleepFor(absl::Milliseconds(50));
  } while (absl::Now() < busy_deadline);
  ASSERT_EQ(::kill(paused.pid, SIGTERM), 0);
  const nlohmann::json draining = WaitForState(paused.address, "draining", absl::Seconds(5));
  generating.join();
  EXPECT_EQ(Node(draining, paused.address)["state"], "draining")
      << busy.dump(2) << draining.dump(2);
  ASSERT_TRUE(finished.ok()) << finished.status() << "\n" << cluster_->Log();
  EXPECT_EQ(finished->tokens.size(), static_cast<size_t>(long_one.generation.max_tokens));
}

}  // namespace
}  // namespace kvrelay::e2e

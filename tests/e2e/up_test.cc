// `kvrelay up` lifecycle on real processes: Ctrl-C (SIGINT) drains every service and exits 0;
// a `kvrelay up` killed with SIGKILL leaves no service behind (PR_SET_PDEATHSIG).

#include <signal.h>

#include <fstream>
#include <sstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_util.h"
#include "tests/e2e/local_cluster.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"

namespace kvrelay::e2e {
using ::kvrelay::gateway::client::GatewayClient;
using ::kvrelay::gateway::client::GatewayRequest;

namespace {

using ::testing::HasSubstr;

// Running and not a zombie.
bool Alive(pid_t pid) {
  std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
  if (!stat) return false;
  std::string line;
  std::getline(stat, line);
  const size_t paren = line.rfind(')');
  return paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] != 'Z';
}

class UpCommand : public ::testing::Test {
 protected:
  void SetUp() override {
    KV_ASSERT_OK(WriteModel(dir_.File("llama"), "llama"));
    ClusterOptions options;
    options.model_dir = dir_.File("llama");
    options.prefill = 1;
    options.decode = 1;
    KV_ASSERT_OK_AND_ASSIGN(cluster_, LocalCluster::Start(options));
    ASSERT_EQ(cluster_->services().size(), 4u);
    // It serves.
    GatewayRequest r;
    r.generation.tokens = RandomPrompt(20, 1);
    r.generation.max_tokens = 3;
    KV_ASSERT_OK(GatewayClient(cluster_->gateway()).Generate(r, absl::Seconds(60)).status());
  }
  testing::TempDir dir_;
  std::unique_ptr<LocalCluster> cluster_;
};

TEST_F(UpCommand, CtrlCStopsEveryServiceCleanly) {
  cluster_->process().Signal(SIGINT);
  KV_ASSERT_OK_AND_ASSIGN(int code, cluster_->process().Wait(absl::Seconds(60)));
  EXPECT_EQ(code, 0) << cluster_->Log();
  const std::string out = cluster_->process().Stdout();
  EXPECT_THAT(out, HasSubstr("kvrelay up: signal 2, stopping"));
  EXPECT_THAT(out, HasSubstr("kvrelay up: stopped\n"));
  for (const ServiceInfo& s : cluster_->services()) EXPECT_FALSE(Alive(s.pid)) << s.name;
}

TEST_F(UpCommand, KilledSupervisorLeavesNoService) {
  cluster_->process().Signal(SIGKILL);
  KV_ASSERT_OK(cluster_->process().Wait(absl::Seconds(10)).status());
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  for (const ServiceInfo& s : cluster_->services()) {
    while (Alive(s.pid) && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(50));
    EXPECT_FALSE(Alive(s.pid)) << s.name << " (pid " << s.pid << ") outlived kvrelay up";
  }
}

}  // namespace
}  // namespace kvrelay::e2e

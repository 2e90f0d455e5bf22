// --device on real processes: `kvrelay up --device cpu` and the default (auto) serve the
// co-located tokens and say in /metrics and in the listening lines that the workers compute on
// the CPU (on a machine without a usable CUDA device); an explicit `--device cuda` that this
// machine cannot honour stops a worker at once with a usage error naming why, never a silent
// CPU.

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "platform/device_platform.h"
#include "tests/e2e/e2e_util.h"
#include "tests/e2e/local_cluster.h"
#include "tests/testing/process_harness.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"

namespace kvrelay::e2e {
using ::kvrelay::gateway::client::GatewayClient;
using ::kvrelay::gateway::client::GatewayRequest;

namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

bool MachineHasCudaDevice() { return platform::MakeDevicePlatform().ok(); }

// The kvrelay:cache_config_info sample line of a /metrics body ("" when absent).
std::string CacheConfigLine(const std::string& metrics) {
  for (absl::string_view line : absl::StrSplit(metrics, '\n')) {
    if (absl::StartsWith(line, "kvrelay:cache_config_info{")) return std::string(line);
  }
  return "";
}

struct DeviceCase {
  std::string name;
  std::string device;         // ClusterOptions::device: `kvrelay up --device`, "" for none
  std::string reason_prefix;  // how the listening line explains the pick
};

class DeviceFlagCluster : public ::testing::TestWithParam<DeviceCase> {};

TEST_P(DeviceFlagCluster, ServesColocatedTokensOnTheCpuAndSaysSo) {
  if (MachineHasCudaDevice()) {
    GTEST_SKIP() << "this machine has a CUDA device, where auto may pick it and tokens follow "
                    "that backend's numerics (bench/gpu_check.sh checks that path)";
  }
  testing::TempDir dir;
  KV_ASSERT_OK(WriteModel(dir.File("llama"), "llama"));
  ClusterOptions options;
  options.model_dir = dir.File("llama");
  options.prefill = 1;
  options.decode = 1;
  options.device = GetParam().device;
  KV_ASSERT_OK_AND_ASSIGN(std::unique_ptr<LocalCluster> cluster, LocalCluster::Start(options));

  KV_ASSERT_OK_AND_ASSIGN(auto reference, cli::ColocatedGenerator::Load(options.model_dir));
  GatewayRequest r;
  r.generation.tokens = RandomPrompt(37, 5);
  r.generation.max_tokens = 6;
  KV_ASSERT_OK_AND_ASSIGN(cli::GenerationResult want, reference->Generate(r.generation));
  KV_ASSERT_OK_AND_ASSIGN(cli::GenerationResult got,
                          GatewayClient(cluster->gateway()).Generate(r, absl::Seconds(60)));
  EXPECT_EQ(got.tokens, want.tokens) << cluster->Log();

  for (const char* name : {"prefill-0", "decode-0"}) {
    SCOPED_TRACE(name);
    KV_ASSERT_OK_AND_ASSIGN(ServiceInfo service, cluster->Service(name));
    KV_ASSERT_OK_AND_ASSIGN(std::string metrics, ScrapeText(service.metrics_address));
    const std::string info = CacheConfigLine(metrics);
    EXPECT_THAT(info, HasSubstr("device=\"cpu\""));
    EXPECT_THAT(info, HasSubstr("device_name=\"cpu\""));
  }
  // "<role> listening on A metrics M device cpu (<why>)", once per worker.
  const std::string log = cluster->Log();
  for (const char* role : {"prefill", "decode"}) {
    EXPECT_THAT(log, HasSubstr(absl::StrCat(role, " listening on ")));
    bool found = false;
    for (absl::string_view line : absl::StrSplit(log, '\n')) {
      if (!absl::StrContains(line, absl::StrCat(role, " listening on "))) continue;
      found = true;
      EXPECT_THAT(std::string(line),
                  HasSubstr(absl::StrCat(" device cpu (", GetParam().reason_prefix)));
    }
    EXPECT_TRUE(found) << role;
  }
  absl::StatusOr<int> code = cluster->Stop();
  EXPECT_TRUE(code.ok() && *code == 0) << cluster->Log();
}

INSTANTIATE_TEST_SUITE_P(Devices, DeviceFlagCluster,
                         ::testing::Values(DeviceCase{"cpu", "cpu", "--device cpu)"},
                                           DeviceCase{"auto_by_default", "", "auto: "}),
                         [](const ::testing::TestParamInfo<DeviceCase>& info) {
                           return info.param.name;
                         });

// A worker asked for a device it cannot have exits 2 (bad usage) with one line naming it,
// before it loads weights, connects to a store or listens.
TEST(DeviceFlag, WorkersRefuseADeviceThisMachineCannotHonour) {
  testing::TempDir dir;
  KV_ASSERT_OK(WriteModel(dir.File("llama"), "llama"));
  KV_ASSERT_OK(WriteModel(dir.File("mamba"), "mamba"));
  struct Case {
    std::string role, device, model, why;
    bool needs_no_gpu;  // the expectation holds only on a machine without a CUDA device
  };
  const std::vector<Case> cases = {
      {"prefill", "cuda", "llama", "--device cuda:0: ", true},
      {"decode", "cuda:1", "llama", "--device cuda:1: ", true},
      {"prefill", "cuda", "mamba", "--device cuda:0: mamba models run on the CPU only", false},
      {"decode", "tpu", "llama", "--device must be auto, cpu, cuda or cuda:N", false},
  };
  const bool has_gpu = MachineHasCudaDevice();
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat(c.role, " --device ", c.device, " --model ", c.model));
    if (c.needs_no_gpu && has_gpu) continue;
    const absl::Time start = absl::Now();
    // 127.0.0.1:1: nothing listens there; a worker that got past its flags would fail later.
    testing::CommandResult r = testing::RunKvrelay(
        {c.role, "--device", c.device, "--model", dir.File(c.model), "--cachestore", "127.0.0.1:1",
         "--insecure", "--port", "0", "--metrics-port", "0"},
        absl::Seconds(30));
    EXPECT_EQ(r.exit_code, 2) << r.stderr_text;
    EXPECT_LT(absl::Now() - start, absl::Seconds(10));
    const std::string prefix = absl::StrCat("kvrelay ", c.role, ": ", c.why);
    EXPECT_THAT(r.stderr_text, HasSubstr(prefix));
    if (c.needs_no_gpu) {
      // Names what is missing: no device, or no CUDA in this build.
      EXPECT_TRUE(absl::StrContains(r.stderr_text, "no usable CUDA device") ||
                  absl::StrContains(r.stderr_text, "built without CUDA"))
          << r.stderr_text;
    }
    // One line, and nothing served.
    EXPECT_EQ(std::count(r.stderr_text.begin(), r.stderr_text.end(), '\n'), 1) << r.stderr_text;
    EXPECT_THAT(r.stdout_text, Not(HasSubstr("listening on")));
  }
}

}  // namespace
}  // namespace kvrelay::e2e

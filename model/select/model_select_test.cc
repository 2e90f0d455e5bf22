// --device parsing and the pick LoadAttentionModel makes, on whatever machine runs the test:
// cpu always loads the CPU runner; auto takes the CPU exactly when the platform has no usable
// CUDA device, and says why; an explicit cuda[:N] that this machine cannot honour is an error,
// never a silent CPU.

#include "model/select/model_select.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kv/hf_config.h"
#include "model/test_model.h"
#include "platform/device_platform.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"

namespace kvrelay::model {
namespace {

using ::kvrelay::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::StartsWith;

TEST(ParseDeviceFlag, AcceptsEveryForm) {
  KV_ASSERT_OK_AND_ASSIGN(DeviceChoice a, ParseDeviceFlag("auto"));
  EXPECT_EQ(a.kind, DeviceChoice::Kind::kAuto);
  EXPECT_EQ(a.ToString(), "auto");
  KV_ASSERT_OK_AND_ASSIGN(DeviceChoice c, ParseDeviceFlag("cpu"));
  EXPECT_EQ(c.kind, DeviceChoice::Kind::kCpu);
  EXPECT_EQ(c.ToString(), "cpu");
  KV_ASSERT_OK_AND_ASSIGN(DeviceChoice g, ParseDeviceFlag("cuda"));
  EXPECT_EQ(g.kind, DeviceChoice::Kind::kCuda);
  EXPECT_EQ(g.cuda_index, 0);
  EXPECT_EQ(g.ToString(), "cuda:0");
  KV_ASSERT_OK_AND_ASSIGN(DeviceChoice g3, ParseDeviceFlag("cuda:3"));
  EXPECT_EQ(g3.kind, DeviceChoice::Kind::kCuda);
  EXPECT_EQ(g3.cuda_index, 3);
  EXPECT_EQ(g3.ToString(), "cuda:3");
  KV_ASSERT_OK_AND_ASSIGN(DeviceChoice g1023, ParseDeviceFlag("cuda:1023"));
  EXPECT_EQ(g1023.cuda_index, 1023);
}

TEST(ParseDeviceFlag, RefusesOtherValuesNamingThemAndTheAcceptedForms) {
  for (const char* bad : {"", "gpu", "CPU", "cuda:", "cuda:-1", "cuda:+1", "cuda: 1", "cuda:1x",
                          "cuda:1024", "cuda:99999999999", "cuda0", "cpu:0", "auto "}) {
    SCOPED_TRACE(bad);
    EXPECT_THAT(ParseDeviceFlag(bad), StatusIs(absl::StatusCode::kInvalidArgument,
                                               AllOf(HasSubstr(absl::StrCat("'", bad, "'")),
                                                     HasSubstr("auto, cpu, cuda or cuda:N"))));
  }
}

class LoadAttentionModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    TestModelOptions o;
    o.arch = "llama";
    o.seed = 4;
    KV_ASSERT_OK(WriteTestModel(dir_.path(), o));
  }
  testing::TempDir dir_;
};

TEST_F(LoadAttentionModelTest, CpuLoadsTheCpuRunner) {
  KV_ASSERT_OK_AND_ASSIGN(DeviceChoice cpu, ParseDeviceFlag("cpu"));
  KV_ASSERT_OK_AND_ASSIGN(LoadedModel loaded, LoadAttentionModel(dir_.path(), {}, cpu));
  ASSERT_NE(loaded.model, nullptr);
  EXPECT_EQ(loaded.model->device().kind, DeviceKind::kCpu);
  EXPECT_EQ(loaded.model->device().Label(), "cpu");
  EXPECT_EQ(loaded.model->numerics_id(), "");
  EXPECT_NE(dynamic_cast<ModelRunner*>(loaded.model.get()), nullptr);
  EXPECT_EQ(loaded.reason, "--device cpu");
  // The CPU's layout is the reference: the fingerprint of the config, unchanged.
  KV_ASSERT_OK_AND_ASSIGN(kv::ModelConfig config, kv::LoadHfConfig(dir_.File("config.json")));
  EXPECT_EQ(loaded.model->layout().fingerprint(), config.layout.fingerprint());
  KV_EXPECT_OK(CheckDeviceChoice(cpu, config));
}

TEST_F(LoadAttentionModelTest, CpuReportsABadModelDirectory) {
  EXPECT_THAT(LoadAttentionModel(dir_.File("missing"), {}, *ParseDeviceFlag("cpu")),
              StatusIs(absl::StatusCode::kNotFound));
}

// This machine's answer: with no usable device auto is the CPU and the reason names what is
// missing; with one, auto tries CUDA (and names the device either way).
TEST_F(LoadAttentionModelTest, AutoPicksCpuExactlyWhenNoDeviceIsUsable) {
  absl::StatusOr<std::unique_ptr<platform::DevicePlatform>> platform =
      platform::MakeDevicePlatform();
  KV_ASSERT_OK_AND_ASSIGN(LoadedModel loaded,
                          LoadAttentionModel(dir_.path(), {}, *ParseDeviceFlag("auto")));
  ASSERT_NE(loaded.model, nullptr);
  EXPECT_THAT(loaded.reason, StartsWith("auto: "));
  if (!platform.ok()) {
    EXPECT_EQ(loaded.model->device().Label(), "cpu");
    if (platform.status().code() == absl::StatusCode::kUnimplemented) {
      EXPECT_THAT(loaded.reason, HasSubstr("built without CUDA"));
    } else {
      EXPECT_THAT(loaded.reason, HasSubstr("no usable CUDA device ("));
      EXPECT_THAT(loaded.reason, HasSubstr(platform.status().message()));
    }
  } else {
    EXPECT_THAT(loaded.reason, HasSubstr("CUDA device 0"));
  }
}

TEST_F(LoadAttentionModelTest, ExplicitCudaWithoutThatDeviceIsAnErrorNotACpu) {
  absl::StatusOr<std::unique_ptr<platform::DevicePlatform>> platform =
      platform::MakeDevicePlatform();
  KV_ASSERT_OK_AND_ASSIGN(kv::ModelConfig config, kv::LoadHfConfig(dir_.File("config.json")));
  if (platform.ok()) {
    // Device 1023 exists nowhere.
    EXPECT_THAT(LoadAttentionModel(dir_.path(), {}, *ParseDeviceFlag("cuda:1023")),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         HasSubstr("--device cuda:1023: no usable CUDA device 1023")));
    GTEST_SKIP() << "this machine has a CUDA device: cuda and cuda:1 may be usable";
  }
  for (const char* flag : {"cuda", "cuda:1"}) {
    SCOPED_TRACE(flag);
    KV_ASSERT_OK_AND_ASSIGN(DeviceChoice choice, ParseDeviceFlag(flag));
    const std::string prefix = absl::StrCat("--device ", choice.ToString(), ": ");
    const std::string why = platform.status().code() == absl::StatusCode::kUnimplemented
                                ? "built without CUDA"
                                : "no usable CUDA device";
    EXPECT_THAT(
        LoadAttentionModel(dir_.path(), {}, choice),
        StatusIs(absl::StatusCode::kFailedPrecondition, AllOf(StartsWith(prefix), HasSubstr(why))));
    EXPECT_THAT(
        CheckDeviceChoice(choice, config),
        StatusIs(absl::StatusCode::kFailedPrecondition, AllOf(StartsWith(prefix), HasSubstr(why))));
  }
}

TEST(CpuOnlyModels, MambaGetsTheCpuWithAReasonAndRefusesCuda) {
  TestModelOptions o;
  o.arch = "mamba";
  testing::TempDir dir;
  KV_ASSERT_OK(WriteTestModel(dir.path(), o));
  KV_ASSERT_OK_AND_ASSIGN(kv::ModelConfig config, kv::LoadHfConfig(dir.File("config.json")));
  EXPECT_THAT(CheckDeviceChoice(*ParseDeviceFlag("cuda:0"), config),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("--device cuda:0: mamba models run on the CPU only")));
  KV_EXPECT_OK(CheckDeviceChoice(*ParseDeviceFlag("auto"), config));
  EXPECT_THAT(CpuOnlyModelReason(*ParseDeviceFlag("auto"), "mamba"),
              testing::IsOkAndHolds("auto: mamba models run on the CPU only"));
  EXPECT_THAT(CpuOnlyModelReason(*ParseDeviceFlag("cpu"), "mamba"),
              testing::IsOkAndHolds("--device cpu"));
  EXPECT_THAT(CpuOnlyModelReason(*ParseDeviceFlag("cuda"), "mamba"),
              StatusIs(absl::StatusCode::kFailedPrecondition));
}

// One loader for both families: the config's model_type picks the runner. Each case writes a
// test model of its arch and loads it with the parsed config, as the workers do.
class LoadServingModelTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    TestModelOptions o;
    o.arch = GetParam();
    KV_ASSERT_OK(WriteTestModel(dir_.path(), o));
    KV_ASSERT_OK_AND_ASSIGN(config_, kv::LoadHfConfig(dir_.File("config.json")));
  }
  testing::TempDir dir_;
  kv::ModelConfig config_;
};

TEST_P(LoadServingModelTest, PicksTheRunnerOfTheFamily) {
  const bool mamba = std::string(GetParam()) == "mamba";
  KV_ASSERT_OK_AND_ASSIGN(ServingModel loaded,
                          LoadServingModel(dir_.path(), config_, {}, *ParseDeviceFlag("cpu")));
  EXPECT_EQ(loaded.attention == nullptr, mamba);
  EXPECT_EQ(loaded.mamba == nullptr, !mamba);
  EXPECT_EQ(loaded.device.Label(), "cpu");
  EXPECT_EQ(loaded.reason, "--device cpu");
  if (!mamba) {
    EXPECT_EQ(loaded.attention->layout().fingerprint(), config_.layout.fingerprint());
    return;
  }
  EXPECT_EQ(loaded.mamba->config().model_type, "mamba");
  KV_ASSERT_OK_AND_ASSIGN(loaded,
                          LoadServingModel(dir_.path(), config_, {}, *ParseDeviceFlag("auto")));
  EXPECT_EQ(loaded.device.Label(), "cpu");
  EXPECT_EQ(loaded.reason, "auto: mamba models run on the CPU only");
  // Mamba under cuda[:N] is refused before any weight is read: a directory without weights
  // gives the same answer.
  EXPECT_THAT(LoadServingModel(dir_.File("missing"), config_, {}, *ParseDeviceFlag("cuda:0")),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("--device cuda:0: mamba models run on the CPU only")));
}

INSTANTIATE_TEST_SUITE_P(Families, LoadServingModelTest, ::testing::Values("llama", "mamba"));

}  // namespace
}  // namespace kvrelay::model

#include "platform/device_platform.h"

#include <cstring>
#include <vector>

#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace kvrelay::platform {
namespace {

using ::kvrelay::testing::StatusIs;

TEST(CpuPlatform, HostMemoryOnly) {
  auto cpu = MakeCpuPlatform();
  EXPECT_EQ(cpu->name(), "cpu");
  KV_ASSERT_OK_AND_ASSIGN(auto host, cpu->MakeMemoryResource(kv::MemoryKind::kHost));
  KV_ASSERT_OK_AND_ASSIGN(void* p, host->Allocate(1 << 20));
  std::vector<char> src(1 << 20, 'x');
  KV_ASSERT_OK(cpu->Copy(p, src.data(), src.size()));
  EXPECT_EQ(std::memcmp(p, src.data(), src.size()), 0);
  host->Deallocate(p, 1 << 20);
  EXPECT_THAT(cpu->MakeMemoryResource(kv::MemoryKind::kDevice),
              StatusIs(absl::StatusCode::kUnimplemented));
}

TEST(DevicePlatform, AbsentDeviceIsAStatusNotACrash) {
  absl::StatusOr<std::unique_ptr<DevicePlatform>> device = MakeDevicePlatform();
  if (!device.ok()) {
    EXPECT_TRUE(absl::IsUnimplemented(device.status()) ||
                absl::IsFailedPrecondition(device.status()))
        << device.status();
    EXPECT_EQ(MakeBestPlatform()->name(), "cpu");
    GTEST_SKIP() << "no GPU: " << device.status();
  }
  // A GPU is present: device memory round trip through the platform.
  DevicePlatform& gpu = **device;
  ASSERT_FALSE(gpu.devices().empty());
  KV_ASSERT_OK_AND_ASSIGN(auto dev, gpu.MakeMemoryResource(kv::MemoryKind::kDevice));
  KV_ASSERT_OK_AND_ASSIGN(auto pinned, gpu.MakeMemoryResource(kv::MemoryKind::kPinnedHost));
  constexpr size_t kBytes = 4 << 20;
  KV_ASSERT_OK_AND_ASSIGN(void* d, dev->Allocate(kBytes));
  KV_ASSERT_OK_AND_ASSIGN(void* h, pinned->Allocate(kBytes));
  std::vector<uint8_t> src(kBytes);
  for (size_t i = 0; i < kBytes; ++i) src[i] = static_cast<uint8_t>(i * 7);
  KV_ASSERT_OK(gpu.Copy(d, src.data(), kBytes));
  KV_ASSERT_OK(gpu.Copy(h, d, kBytes));
  EXPECT_EQ(std::memcmp(h, src.data(), kBytes), 0);
  dev->Deallocate(d, kBytes);
  pinned->Deallocate(h, kBytes);
}

}  // namespace
}  // namespace kvrelay::platform

#include <poll.h>

#include "common/clock.h"
#include "common/event_fd.h"
#include "common/file_util.h"
#include "common/flags.h"
#include "common/status_macros.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"

namespace kvrelay {
namespace {

using ::kvrelay::testing::StatusIs;
using ::testing::HasSubstr;

absl::StatusOr<int> Half(int n) {
  if (n % 2 != 0) return absl::InvalidArgumentError("odd");
  return n / 2;
}

absl::StatusOr<int> Quarter(int n) {
  KV_ASSIGN_OR_RETURN(int half, Half(n));
  KV_ASSIGN_OR_RETURN(int quarter, Half(half));
  return quarter;
}

TEST(StatusMacros, PropagateErrorsAndValues) {
  EXPECT_EQ(*Quarter(8), 2);
  EXPECT_THAT(Quarter(6), StatusIs(absl::StatusCode::kInvalidArgument, "odd"));
}

TEST(SimulatedClock, MovesOnlyWhenTold) {
  SimulatedClock clock;
  const absl::Time t0 = clock.Now();
  EXPECT_EQ(clock.Now(), t0);
  clock.Advance(absl::Seconds(31));
  EXPECT_EQ(clock.Now() - t0, absl::Seconds(31));
}

TEST(EventFd, WakesPoll) {
  KV_ASSERT_OK_AND_ASSIGN(EventFd efd, EventFd::Create());
  pollfd p{efd.fd(), POLLIN, 0};
  EXPECT_EQ(::poll(&p, 1, 0), 0);
  efd.Notify();
  EXPECT_EQ(::poll(&p, 1, 0), 1);
  efd.Drain();
  EXPECT_EQ(::poll(&p, 1, 0), 0);
}

TEST(FileUtil, AtomicWriteAndRead) {
  testing::TempDir dir;
  KV_ASSERT_OK(MakeDirectories(dir.File("a/b/c")));
  const std::string path = dir.File("a/b/c/file");
  KV_ASSERT_OK(WriteFileAtomically(path, "one"));
  KV_ASSERT_OK(WriteFileAtomically(path, "two"));
  EXPECT_EQ(*ReadFileToString(path), "two");
  EXPECT_THAT(ReadFileToString(dir.File("nope")),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("nope")));
}

TEST(FlagSet, ParsesEveryKindAndNamesBadFlags) {
  std::string name = "x";
  int64_t count = 1;
  int32_t small = 2;
  double ratio = 0.5;
  bool json = false;
  absl::Duration ttl = absl::Seconds(1);
  FlagSet flags("test", "a test command");
  flags.AddString("name", &name, "a name");
  flags.AddInt64("count", &count, "a count");
  flags.AddInt32("small", &small, "small");
  flags.AddDouble("ratio", &ratio, "ratio");
  flags.AddBool("json", &json, "json");
  flags.AddDuration("ttl", &ttl, "ttl");
  KV_ASSERT_OK(flags.Parse({"--name", "abc", "--count=42", "--small", "7", "--ratio=0.25",
                            "--json", "--ttl", "30s"}));
  EXPECT_EQ(name, "abc");
  EXPECT_EQ(count, 42);
  EXPECT_EQ(small, 7);
  EXPECT_DOUBLE_EQ(ratio, 0.25);
  EXPECT_TRUE(json);
  EXPECT_EQ(ttl, absl::Seconds(30));
  EXPECT_TRUE(flags.WasSet("count"));
  EXPECT_THAT(flags.Usage(), HasSubstr("--count"));

  FlagSet bad("test", "");
  bad.AddInt64("count", &count, "");
  EXPECT_THAT(bad.Parse({"--count=abc"}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--count")));
  EXPECT_THAT(bad.Parse({"--bogus"}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--bogus")));
  EXPECT_THAT(bad.Parse({"--count"}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("missing value")));
  EXPECT_THAT(bad.Parse({"stray"}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("stray")));
}

}  // namespace
}  // namespace kvrelay

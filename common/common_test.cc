#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

#include "common/clock.h"
#include "common/config_file.h"
#include "common/errno_status.h"
#include "common/event_fd.h"
#include "common/file_util.h"
#include "common/flags.h"
#include "common/http_server.h"
#include "common/metrics.h"
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
  KV_ASSERT_OK(flags.Parse(
      {"--name", "abc", "--count=42", "--small", "7", "--ratio=0.25", "--json", "--ttl", "30s"}));
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
  EXPECT_THAT(bad.Parse({"stray"}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("stray")));
}

TEST(ErrnoToStatus, AbseilCodesWithLostPeersUnavailableAndTheOperationNamed) {
  EXPECT_THAT(ErrnoToStatus(ENOENT, "open /x/wal.log"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("open /x/wal.log: ")));
  EXPECT_THAT(ErrnoToStatus(EACCES, "open f"), StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(ErrnoToStatus(ENOSPC, "append f"), StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(ErrnoToStatus(EADDRINUSE, "bind :1"),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  // A peer that is gone is Unavailable, whatever Abseil's table says (never DeadlineExceeded,
  // which callers read as their own deadline).
  for (int err : {ECONNREFUSED, ECONNRESET, EHOSTUNREACH, EPIPE, ETIMEDOUT, EADDRNOTAVAIL}) {
    EXPECT_THAT(ErrnoToStatus(err, "connect to peer"), StatusIs(absl::StatusCode::kUnavailable))
        << err;
  }
  EXPECT_THAT(ErrnoToStatus(EPIPE, "send to 10.0.0.1:7"),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("send to 10.0.0.1:7: ")));
}

TEST(CommandLine, ParseHelpAndUsageErrorsGiveExitCodes) {
  std::string name = "x";
  FlagSet flags("demo", "A demo command.");
  flags.AddString("name", &name, "a name");
  EXPECT_EQ(ParseCommandLine(flags, {"--name", "y"}), std::nullopt);
  EXPECT_EQ(name, "y");
  FlagSet bad("demo", "A demo command.");
  EXPECT_EQ(ParseCommandLine(bad, {"--bogus"}), 2);
  FlagSet help("demo", "A demo command.");
  EXPECT_EQ(ParseCommandLine(help, {"--help"}), 0);
  EXPECT_EQ(CommandFailed("demo", absl::NotFoundError("no file")), 2);
  EXPECT_EQ(CommandFailed("demo", absl::UnavailableError("down")), 1);
  EXPECT_EQ(UsageError("demo", "bad", 3), 3);
}

TEST(Metrics, RendersPrometheusText) {
  MetricsRegistry registry;
  registry.GetCounter("kvrelay_requests_total", "Requests.", {{"code", "ok"}})->Increment(3);
  registry.GetCounter("kvrelay_requests_total", "Requests.", {{"code", "ok"}})->Increment();
  registry.GetGauge("kvrelay_active", "Active.")->Set(2);
  Histogram* h = registry.GetHistogram("kvrelay_latency_seconds", "Latency.", {0.1, 1});
  h->Observe(0.05);
  h->Observe(0.5);
  h->Observe(5);
  const std::string text = registry.RenderText();
  EXPECT_THAT(text, HasSubstr("# TYPE kvrelay_requests_total counter"));
  EXPECT_THAT(text, HasSubstr("kvrelay_requests_total{code=\"ok\"} 4"));
  EXPECT_THAT(text, HasSubstr("kvrelay_active 2"));
  EXPECT_THAT(text, HasSubstr("kvrelay_latency_seconds_bucket{le=\"0.1\"} 1"));
  EXPECT_THAT(text, HasSubstr("kvrelay_latency_seconds_bucket{le=\"1\"} 2"));
  EXPECT_THAT(text, HasSubstr("kvrelay_latency_seconds_bucket{le=\"+Inf\"} 3"));
  EXPECT_THAT(text, HasSubstr("kvrelay_latency_seconds_count 3"));
}

TEST(Metrics, RendersFunctionMetricsAtEachScrape) {
  MetricsRegistry registry;
  double hits = 5;
  registry.AddCounterFunc("kvrelay_hits_total", "Hits.", {}, [&hits] { return hits; });
  registry.AddGaugeFunc("kvrelay_bytes", "Bytes.", {{"tier", "host"}}, [] { return 8388608.0; });
  EXPECT_THAT(registry.RenderText(), HasSubstr("# TYPE kvrelay_hits_total counter\n"
                                               "kvrelay_hits_total 5\n"));
  hits = 7;
  const std::string text = registry.RenderText();
  EXPECT_THAT(text, HasSubstr("kvrelay_hits_total 7\n"));
  EXPECT_THAT(text,
              HasSubstr("# TYPE kvrelay_bytes gauge\nkvrelay_bytes{tier=\"host\"} 8388608\n"));
}

TEST(HttpServer, ServesMetricsOverRealSocket) {
  MetricsRegistry registry;
  registry.GetCounter("kvrelay_test_total", "Test.")->Increment(7);
  KV_ASSERT_OK_AND_ASSIGN(auto server,
                          HttpServer::Start("127.0.0.1", 0, MetricsHandler(&registry)));
  ASSERT_GT(server->port(), 0);
  std::string r = testing::HttpGet(server->port(), "/metrics");
  EXPECT_THAT(r, HasSubstr("HTTP/1.0 200"));
  EXPECT_THAT(r, HasSubstr("kvrelay_test_total 7"));
  EXPECT_THAT(testing::HttpGet(server->port(), "/nope"), HasSubstr("404"));
  EXPECT_THAT(HttpServer::Start("not-an-ip", 0, MetricsHandler(&registry)),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(ConfigFile, YamlKeysBecomeFlagsAndCommandLineWins) {
  testing::TempDir dir;
  const std::string path = dir.File("c.yaml");
  KV_ASSERT_OK(WriteFileAtomically(path, "port: 7000\nprefill: [a:1, b:2]\njson: true\n"));
  KV_ASSERT_OK_AND_ASSIGN(std::vector<std::string> args,
                          ExpandConfigFile({"--config", path, "--port=8000"}));
  EXPECT_EQ(args, (std::vector<std::string>{"--port=7000", "--prefill=a:1,b:2", "--json=true",
                                            "--port=8000"}));
  int64_t port = 0;
  std::string prefill;
  bool json = false;
  FlagSet flags("x", "");
  flags.AddInt64("port", &port, "");
  flags.AddString("prefill", &prefill, "");
  flags.AddBool("json", &json, "");
  KV_ASSERT_OK(flags.Parse(args));
  EXPECT_EQ(port, 8000);
  EXPECT_EQ(prefill, "a:1,b:2");
  KV_ASSERT_OK(WriteFileAtomically(path, "port: [unclosed\n"));
  EXPECT_THAT(ExpandConfigFile({"--config", path}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("c.yaml")));
  KV_ASSERT_OK(WriteFileAtomically(path, "- just\n- a list\n"));
  EXPECT_THAT(ExpandConfigFile({"--config=" + path}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("map")));
}

}  // namespace
}  // namespace kvrelay

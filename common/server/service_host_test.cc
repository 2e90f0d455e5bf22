#include "common/server/service_host.h"

#include <sched.h>

#include <atomic>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/http_server.h"
#include "common/server/server_flags.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "kvrelay/v1/prefill.grpc.pb.h"
#include "tests/testing/status_matchers.h"

namespace kvrelay::server {
namespace {

using ::kvrelay::testing::StatusIs;
using ::testing::HasSubstr;

grpc::health::v1::HealthCheckResponse::ServingStatus Check(grpc::Channel* channel,
                                                           const std::string& service) {
  auto stub = grpc::health::v1::Health::NewStub(
      std::shared_ptr<grpc::Channel>(channel, [](grpc::Channel*) {}));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  grpc::Status status = stub->Check(&context, request, &response);
  EXPECT_TRUE(status.ok()) << status.error_message();
  return response.status();
}

TEST(ServiceHost, ServesHealthMetricsAndDrainsOnRequest) {
  MetricsRegistry metrics;
  metrics.GetCounter("kvrelay_test_total", "t")->Increment();
  ServiceHostOptions options;
  options.name = "test";
  options.drain_timeout = absl::Seconds(1);
  options.health_services = {"kvrelay.v1.Prefill"};
  kvrelay::v1::Prefill::Service unimplemented;  // any service: gRPC needs one to serve
  KV_ASSERT_OK_AND_ASSIGN(auto host, ServiceHost::Start(options, {&unimplemented}, &metrics));
  ASSERT_GT(host->port(), 0);
  KV_ASSERT_OK_AND_ASSIGN(auto channel, MakeChannel(host->address(), SecurityOptions{}));
  EXPECT_EQ(Check(channel.get(), ""), grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_EQ(Check(channel.get(), "kvrelay.v1.Prefill"),
            grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_EQ(Check(host->InProcessChannel().get(), ""),
            grpc::health::v1::HealthCheckResponse::SERVING);

  std::atomic<int> ticks{0};
  std::thread stopper([&] {
    while (ticks.load() < 2) absl::SleepFor(absl::Milliseconds(5));
    host->RequestShutdown();
  });
  bool drained = false;
  host->WaitForShutdown({.on_drain = [&] { drained = true; },
                         .on_tick = [&] { ticks.fetch_add(1); },
                         .tick = absl::Milliseconds(10)});
  stopper.join();
  EXPECT_TRUE(drained);
  EXPECT_TRUE(host->draining());
  EXPECT_GE(ticks.load(), 2);
}

TEST(ServerFlags, ParsesConfigSecurityAndRejectsBadUsage) {
  ServiceHostOptions options;
  FlagSet flags("test", "t");
  AddServerFlags(flags, options);
  EXPECT_EQ(ParseCommandLine(flags, {"--port", "7", "--metrics-port=8", "--insecure"}, "test",
                             &options.security),
            std::nullopt);
  EXPECT_EQ(options.port, 7);
  EXPECT_EQ(options.metrics_port, 8);
  EXPECT_TRUE(options.security.insecure);

  // Plain text is never the silent default.
  ServiceHostOptions silent;
  FlagSet silent_flags("test", "t");
  AddServerFlags(silent_flags, silent);
  EXPECT_EQ(ParseCommandLine(silent_flags, {"--port", "7"}, "test", &silent.security),
            std::optional<int>(2));
  ServiceHostOptions both;
  FlagSet both_flags("test", "t");
  AddServerFlags(both_flags, both);
  EXPECT_EQ(ParseCommandLine(both_flags,
                             {"--insecure", "--tls-cert", "a", "--tls-key", "b", "--tls-ca", "c"},
                             "test", &both.security),
            std::optional<int>(2));
  ServiceHostOptions tls;
  FlagSet tls_flags("test", "t");
  AddServerFlags(tls_flags, tls);
  EXPECT_EQ(ParseCommandLine(tls_flags, {"--tls-cert", "a", "--tls-key", "b", "--tls-ca", "c"},
                             "test", &tls.security),
            std::nullopt);
  EXPECT_FALSE(tls.security.insecure);

  ServiceHostOptions partial;
  FlagSet partial_flags("test", "t");
  AddServerFlags(partial_flags, partial);
  EXPECT_EQ(ParseCommandLine(partial_flags, {"--tls-cert", "a.pem"}, "test", &partial.security),
            std::optional<int>(2));

  ServiceHostOptions bad;
  FlagSet bad_flags("test", "t");
  AddServerFlags(bad_flags, bad);
  EXPECT_EQ(ParseCommandLine(bad_flags, {"--no-such-flag"}, "test", &bad.security),
            std::optional<int>(2));
}

// The death-test child of CpuListsParseAndPinningChecksTheAllowedSet: exits 0 only if every
// check held.
void CheckPinningInThisProcess() {
  cpu_set_t before;
  if (sched_getaffinity(0, sizeof(before), &before) != 0) _exit(10);
  int first = 0;
  while (!CPU_ISSET(first, &before)) ++first;
  std::atomic<bool> pinned{false}, moved{false};
  std::thread started_before([&] {
    while (!pinned.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    cpu_set_t mine;
    moved = sched_getaffinity(0, sizeof(mine), &mine) == 0 && CPU_COUNT(&mine) == 1 &&
            CPU_ISSET(first, &mine);
  });
  if (!PinToCpus({first}).ok()) _exit(11);
  pinned = true;
  started_before.join();
  if (!moved) _exit(15);
  std::thread started_after([first] {
    cpu_set_t mine;
    if (sched_getaffinity(0, sizeof(mine), &mine) != 0 || CPU_COUNT(&mine) != 1 ||
        !CPU_ISSET(first, &mine)) {
      _exit(12);
    }
  });
  started_after.join();
  // Now only `first` is allowed: another CPU is refused, by name, and nothing changes.
  const absl::Status refused = PinToCpus({first + 1});
  if (refused.code() != absl::StatusCode::kFailedPrecondition ||
      !absl::StrContains(refused.message(), absl::StrCat("allowed: ", first))) {
    _exit(13);
  }
  cpu_set_t after;
  if (sched_getaffinity(0, sizeof(after), &after) != 0 || CPU_COUNT(&after) != 1) _exit(14);
  _exit(0);
}

TEST(ServerFlags, CpuListsParseAndPinningChecksTheAllowedSet) {
  KV_ASSERT_OK_AND_ASSIGN(std::vector<int> cpus, ParseCpuList("3,0-1,1"));
  EXPECT_EQ(cpus, (std::vector<int>{0, 1, 3}));
  for (const char* bad : {"", "a", "1-", "-1", "3-1", "0,,1", "99999"}) {
    EXPECT_THAT(ParseCpuList(bad), StatusIs(absl::StatusCode::kInvalidArgument)) << bad;
  }
  // PinToCpus moves every thread of the process: checked in a child (a death test re-runs this
  // binary), so the test process keeps its CPUs.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(CheckPinningInThisProcess(), ::testing::ExitedWithCode(0), "");
  ServiceHostOptions host;
  FlagSet flags("test", "");
  AddServerFlags(flags, host);
  EXPECT_EQ(ParseServerCommandLine(flags, {"--insecure", "--cpus", "2-1"}, "test", host), 2);
}

TEST(ServerFlags, CheckHostPort) {
  EXPECT_THAT(CheckHostPort("127.0.0.1:0", "--x"),
              testing::StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--x")));
  EXPECT_THAT(CheckHostPort(":80", "--x"), testing::StatusIs(absl::StatusCode::kInvalidArgument));
  KV_EXPECT_OK(CheckHostPort("10.0.0.1:50051", "--x"));
  KV_EXPECT_OK(CheckHostPort("store-0.kvrelay-store:50050", "--x"));
}

TEST(ServerFlags, ModelNameFromDirIsTheDirectorysBaseName) {
  EXPECT_EQ(ModelNameFromDir("/models/tiny-llama/"), "tiny-llama");
  EXPECT_EQ(ModelNameFromDir("tiny"), "tiny");
}

TEST(Credentials, TlsWithoutFilesIsAClearError) {
  SecurityOptions tls;
  tls.insecure = false;
  EXPECT_THAT(ServerCredentialsFor(tls).status(),
              testing::StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--tls-cert")));
  tls.cert_file = "/nonexistent/cert.pem";
  tls.key_file = "/nonexistent/key.pem";
  tls.ca_file = "/nonexistent/ca.pem";
  EXPECT_FALSE(MakeChannel("127.0.0.1:1", tls).ok());
}

}  // namespace
}  // namespace kvrelay::server

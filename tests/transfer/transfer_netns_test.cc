// A network cut between two hosts (network namespaces joined by a veth pair, UCX over tcp):
// while the link is down the sender's pushes fail with a clear status and its peer is reported
// dead within the heartbeat timeout; once the link is back the same receiver process (same
// incarnation) is reached again through a fresh connection, without restarting anything.
// Skipped, saying why, where network namespaces cannot be created.

#include <signal.h>
#include <unistd.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/process_harness.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"

namespace kvrelay::transfer {
namespace {

using testing::ChildProcess;
using testing::RunCommand;

// The `ip` binary (the harness execs without a PATH search).
std::string IpPath() {
  for (const char* p : {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"}) {
    if (::access(p, X_OK) == 0) return p;
  }
  return "ip";
}

absl::Status Ip(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {IpPath()};
  argv.insert(argv.end(), args.begin(), args.end());
  absl::StatusOr<testing::CommandResult> r = RunCommand(argv, absl::Seconds(20));
  if (!r.ok()) return r.status();
  if (r->exit_code != 0) {
    return absl::InternalError(absl::StrCat(absl::StrJoin(argv, " "), " failed: ", r->stderr_text));
  }
  return absl::OkStatus();
}

// Two namespaces joined by a veth pair; removed (with the veths) on destruction.
class TwoHosts {
 public:
  static absl::StatusOr<std::unique_ptr<TwoHosts>> Create() {
    auto h = std::unique_ptr<TwoHosts>(new TwoHosts);
    const int pid = static_cast<int>(::getpid());
    h->ns_a_ = absl::StrCat("kvxfer", pid, "a");
    h->ns_b_ = absl::StrCat("kvxfer", pid, "b");
    h->veth_a_ = absl::StrCat("kvxa", pid % 10000000);
    h->veth_b_ = absl::StrCat("kvxb", pid % 10000000);
    const std::string net = absl::StrCat("10.213.", pid % 250, ".");
    h->addr_a_ = net + "1";
    h->addr_b_ = net + "2";
    if (absl::Status s = Ip({"netns", "add", h->ns_a_}); !s.ok()) return s;
    h->created_a_ = true;
    if (absl::Status s = Ip({"netns", "add", h->ns_b_}); !s.ok()) return s;
    h->created_b_ = true;
    for (const std::vector<std::string>& cmd : std::vector<std::vector<std::string>>{
             {"link", "add", h->veth_a_, "type", "veth", "peer", "name", h->veth_b_},
             {"link", "set", h->veth_a_, "netns", h->ns_a_},
             {"link", "set", h->veth_b_, "netns", h->ns_b_},
             {"-n", h->ns_a_, "addr", "add", h->addr_a_ + "/24", "dev", h->veth_a_},
             {"-n", h->ns_b_, "addr", "add", h->addr_b_ + "/24", "dev", h->veth_b_},
             {"-n", h->ns_a_, "link", "set", "lo", "up"},
             {"-n", h->ns_b_, "link", "set", "lo", "up"},
             {"-n", h->ns_a_, "link", "set", h->veth_a_, "up"},
             {"-n", h->ns_b_, "link", "set", h->veth_b_, "up"}}) {
      if (absl::Status s = Ip(cmd); !s.ok()) return s;
    }
    return h;
  }
  ~TwoHosts() {
    if (created_a_) (void)Ip({"netns", "del", ns_a_});
    if (created_b_) (void)Ip({"netns", "del", ns_b_});
  }
  absl::Status SetLinkB(bool up) {
    return Ip({"-n", ns_b_, "link", "set", veth_b_, up ? "up" : "down"});
  }
  std::vector<std::string> InA(std::vector<std::string> argv) const { return In(ns_a_, argv); }
  std::vector<std::string> InB(std::vector<std::string> argv) const { return In(ns_b_, argv); }
  const std::string& addr_b() const { return addr_b_; }

 private:
  TwoHosts() = default;
  static std::vector<std::string> In(const std::string& ns, std::vector<std::string> argv) {
    std::vector<std::string> out = {IpPath(), "netns", "exec", ns};
    out.insert(out.end(), argv.begin(), argv.end());
    return out;
  }
  std::string ns_a_, ns_b_, veth_a_, veth_b_, addr_a_, addr_b_;
  bool created_a_ = false, created_b_ = false;
};

// The sender's "OK ..." / "FAIL ..." lines, from the `from`-th on.
std::vector<std::string> Lines(const ChildProcess& p, size_t from = 0) {
  std::vector<std::string> all = absl::StrSplit(p.Stdout(), '\n', absl::SkipEmpty());
  if (from >= all.size()) return {};
  return std::vector<std::string>(all.begin() + static_cast<long>(from), all.end());
}

std::string Field(const std::string& line, const std::string& key) {
  for (absl::string_view part : absl::StrSplit(line, ' ')) {
    if (absl::StartsWith(part, key + "=")) return std::string(part.substr(key.size() + 1));
  }
  return "";
}

TEST(TransferNetnsTest, LinkCutIsReportedAndTheSameReceiverIsReachedAgain) {
  if (::geteuid() != 0) GTEST_SKIP() << "network namespaces need root; skipping the link-cut test";
  absl::StatusOr<std::unique_ptr<TwoHosts>> hosts = TwoHosts::Create();
  if (!hosts.ok()) {
    GTEST_SKIP() << "cannot create network namespaces + veth here (" << hosts.status().message()
                 << "); skipping the link-cut test";
  }
  const std::string bin = testing::BinaryPath("kvrelay_transfer_peer");
  const int port = 41000 + static_cast<int>(::getpid() % 20000);
  const std::string address = absl::StrCat((*hosts)->addr_b(), ":", port);
  const std::map<std::string, std::string> env = {{"UCX_TLS", "tcp"}};
  KV_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<ChildProcess> receiver,
      ChildProcess::Start(
          (*hosts)->InB({bin, "transfer-bench", "--role=receiver", "--until=sigterm", "--tls=tcp",
                         "--region-bytes=4194304", "--listen-host=" + (*hosts)->addr_b(),
                         absl::StrCat("--listen-port=", port)}),
          env));
  KV_ASSERT_OK_AND_ASSIGN(std::string ready, receiver->WaitForOutput("READY", absl::Seconds(60)));
  EXPECT_THAT(ready, ::testing::HasSubstr(address));
  // 1 s peer timeout (heartbeat 100 ms), a push every 100 ms.
  KV_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<ChildProcess> sender,
      ChildProcess::Start(
          (*hosts)->InA({bin, "transfer-bench", "--role=sender", "--tls=tcp",
                         "--connect=" + address, "--interval-ms=100", "--duration-s=60",
                         "--heartbeat-ms=100", "--peer-timeout-ms=1000"}),
          env));
  KV_ASSERT_OK_AND_ASSIGN(std::string first_ok,
                          sender->WaitForOutput("OK peer=", absl::Seconds(60)));
  const std::string peer_before = Field(first_ok, "peer");
  const std::string incarnation = Field(first_ok, "incarnation");

  // Cut the link for 4 s (4x the peer timeout).
  const size_t before_cut = Lines(*sender).size();
  KV_ASSERT_OK((*hosts)->SetLinkB(false));
  absl::SleepFor(absl::Seconds(4));
  std::vector<std::string> during = Lines(*sender, before_cut);
  KV_ASSERT_OK((*hosts)->SetLinkB(true));
  const absl::Time restored = absl::Now();
  size_t fails = 0;
  for (const std::string& l : during) fails += absl::StartsWith(l, "FAIL ");
  EXPECT_GE(fails, 1u) << "no push failed while the link was down: "
                       << absl::StrJoin(during, " | ");
  // After the cut the dead peer is reported as Unavailable (never a hang past the deadline).
  bool unavailable = false;
  for (const std::string& l : during) unavailable |= absl::StrContains(l, "UNAVAILABLE");
  EXPECT_TRUE(unavailable) << absl::StrJoin(during, " | ");

  // Back within 10 s of the link coming up: a fresh connection to the same process.
  const size_t after_cut = before_cut + during.size();
  std::string ok_again;
  while (ok_again.empty() && absl::Now() - restored < absl::Seconds(20)) {
    for (const std::string& l : Lines(*sender, after_cut)) {
      if (absl::StartsWith(l, "OK ")) ok_again = l;
    }
    if (ok_again.empty()) absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_FALSE(ok_again.empty()) << "no successful push after the link came back; sender: "
                                 << sender->Stdout() << sender->Stderr()
                                 << " receiver: " << receiver->Stderr();
  const absl::Duration recovery = absl::Now() - restored;
  EXPECT_LT(recovery, absl::Seconds(10));
  EXPECT_EQ(Field(ok_again, "incarnation"), incarnation);  // the same receiver process
  EXPECT_NE(Field(ok_again, "peer"), peer_before);         // through a new connection
  RecordProperty("recovery_ms", std::to_string(absl::ToInt64Milliseconds(recovery)));
  sender->Signal(SIGTERM);
  receiver->Signal(SIGTERM);
  (void)sender->Wait(absl::Seconds(10));
  (void)receiver->Wait(absl::Seconds(10));
}

}  // namespace
}  // namespace kvrelay::transfer

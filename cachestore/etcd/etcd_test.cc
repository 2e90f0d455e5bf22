// The etcd client and leader election against a real etcd (Debian's etcd-server), started here on
// free loopback ports with its own data dir.

#include <signal.h>

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "cachestore/etcd/etcd_client.h"
#include "cachestore/etcd/leader_election.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/process_harness.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"

namespace kvrelay::etcd {
namespace {

using ::kvrelay::testing::ChildProcess;
using ::testing::HasSubstr;

constexpr char kEtcd[] = "/usr/bin/etcd";

class EtcdTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::access(kEtcd, X_OK) != 0) GTEST_SKIP() << kEtcd << " missing (scripts/setup.sh)";
    const int client_port = kvrelay::testing::PickUnusedPort();
    const int peer_port = kvrelay::testing::PickUnusedPort();
    endpoint_ = absl::StrCat("127.0.0.1:", client_port);
    const std::string peer = absl::StrCat("http://127.0.0.1:", peer_port);
    auto etcd = ChildProcess::Start({kEtcd, "--name", "t", "--data-dir", dir_.File("etcd"),
                                     "--listen-client-urls", "http://" + endpoint_,
                                     "--advertise-client-urls", "http://" + endpoint_,
                                     "--listen-peer-urls", peer, "--initial-advertise-peer-urls",
                                     peer, "--initial-cluster", "t=" + peer,
                                     // A one-member cluster elects itself at once.
                                     "--heartbeat-interval", "50", "--election-timeout", "300"});
    ASSERT_TRUE(etcd.ok()) << etcd.status();
    etcd_ = *std::move(etcd);
    KV_ASSERT_OK_AND_ASSIGN(
        client_, EtcdClient::Create({.endpoints = {endpoint_}, .rpc_timeout = absl::Seconds(2)}));
    const absl::Time started = absl::Now();
    // Ready once it answers a read.
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    // Asked before etcd listens: the client must connect as soon as it does.
    while (!client_->Get("/ready").ok()) {
      ASSERT_LT(absl::Now(), deadline) << "etcd did not answer:\n" << etcd_->Stderr();
      absl::SleepFor(absl::Milliseconds(100));
    }
    EXPECT_LT(absl::Now() - started, absl::Seconds(5)) << "etcd answered late";
  }

  kvrelay::testing::TempDir dir_;
  std::string endpoint_;
  std::unique_ptr<ChildProcess> etcd_;
  std::unique_ptr<EtcdClient> client_;
};

TEST_F(EtcdTest, LeasesAndCreateIfAbsent) {
  KV_ASSERT_OK_AND_ASSIGN(int64_t a, client_->GrantLease(absl::Seconds(5)));
  KV_ASSERT_OK_AND_ASSIGN(int64_t b, client_->GrantLease(absl::Seconds(5)));
  KV_ASSERT_OK_AND_ASSIGN(EtcdClient::CreateResult first, client_->CreateIfAbsent("/k", "a", a));
  EXPECT_TRUE(first.created);
  EXPECT_GT(first.kv.create_revision, 0);
  KV_ASSERT_OK_AND_ASSIGN(EtcdClient::CreateResult second, client_->CreateIfAbsent("/k", "b", b));
  EXPECT_FALSE(second.created);
  EXPECT_EQ(second.kv.value, "a");
  EXPECT_EQ(second.kv.lease, a);
  EXPECT_EQ(second.kv.create_revision, first.kv.create_revision);
  KV_ASSERT_OK_AND_ASSIGN(absl::Duration ttl, client_->KeepAlive(a));
  EXPECT_GE(ttl, absl::Seconds(4));
  // Only the incarnation that created the key may delete it.
  EXPECT_THAT(client_->DeleteIfCreatedAt("/k", first.kv.create_revision + 100),
              kvrelay::testing::IsOkAndHolds(false));
  // A write fenced by the creator's revision goes through; a stale one does not.
  EXPECT_THAT(client_->PutIfGuardCreatedAt("/k", first.kv.create_revision, "/data", "x"),
              kvrelay::testing::IsOkAndHolds(true));
  EXPECT_THAT(client_->PutIfGuardCreatedAt("/k", first.kv.create_revision - 1, "/data", "y"),
              kvrelay::testing::IsOkAndHolds(false));
  KV_ASSERT_OK(client_->RevokeLease(a));  // its key goes with it
  KV_ASSERT_OK_AND_ASSIGN(std::optional<KeyValue> gone, client_->Get("/k"));
  EXPECT_FALSE(gone.has_value());
  EXPECT_THAT(client_->KeepAlive(a), kvrelay::testing::StatusIs(absl::StatusCode::kNotFound));
  KV_ASSERT_OK_AND_ASSIGN(EtcdClient::CreateResult third, client_->CreateIfAbsent("/k", "b", b));
  EXPECT_TRUE(third.created);
  EXPECT_GT(third.kv.create_revision, first.kv.create_revision);
  EXPECT_THAT(ParseEndpoints("a:1,http://b:2379").value(), ::testing::ElementsAre("a:1", "b:2379"));
  EXPECT_THAT(ParseEndpoints("a").status().message(), HasSubstr("want host:port"));
}

TEST_F(EtcdTest, StandbyLeadsWhenTheLeaderResignsOrItsLeaseExpires) {
  ElectionOptions options;
  options.key = "/kvrelay/test/leader";
  // A leader that died: its key under a lease nobody renews.
  KV_ASSERT_OK_AND_ASSIGN(int64_t dead_lease, client_->GrantLease(absl::Seconds(2)));
  KV_ASSERT_OK_AND_ASSIGN(EtcdClient::CreateResult dead,
                          client_->CreateIfAbsent(options.key, "dead:1", dead_lease));
  ASSERT_TRUE(dead.created);

  options.value = "a:7000";
  KV_ASSERT_OK_AND_ASSIGN(auto a, LeaderElection::Start(client_.get(), options));
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_FALSE(a->IsLeader());
  EXPECT_EQ(a->state().leader_value, "dead:1");
  const absl::Time expired_by = absl::Now() + absl::Seconds(2);
  ASSERT_TRUE(a->WaitUntilLeader(absl::Now() + absl::Seconds(6)));
  EXPECT_LT(absl::Now(), expired_by + absl::Seconds(2)) << "took over late";
  const int64_t term_a = a->term();
  EXPECT_GT(term_a, dead.kv.create_revision);
  // The dead leader's fenced writes are refused now.
  EXPECT_THAT(client_->PutIfGuardCreatedAt(options.key, dead.kv.create_revision, "/x", "stale"),
              kvrelay::testing::IsOkAndHolds(false));

  options.value = "b:7000";
  KV_ASSERT_OK_AND_ASSIGN(auto b, LeaderElection::Start(client_.get(), options));
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_FALSE(b->IsLeader());
  EXPECT_EQ(b->state().leader_value, "a:7000");
  EXPECT_EQ(b->state().leader_term, term_a);
  const absl::Time resigned = absl::Now();
  a.reset();  // a clean shutdown resigns
  ASSERT_TRUE(b->WaitUntilLeader(absl::Now() + absl::Seconds(3)));
  EXPECT_LT(absl::Now() - resigned, absl::Seconds(1));
  EXPECT_GT(b->term(), term_a);
}

TEST_F(EtcdTest, LeaderFailsClosedWhileEtcdIsGoneAndLeadsAgainAfter) {
  ElectionOptions options;
  options.key = "/kvrelay/test/leader";
  options.value = "a:7000";
  KV_ASSERT_OK_AND_ASSIGN(auto a, LeaderElection::Start(client_.get(), options));
  ASSERT_TRUE(a->WaitUntilLeader(absl::Now() + absl::Seconds(5)));
  const int64_t first_term = a->term();
  etcd_->Signal(SIGSTOP);
  const absl::Time stopped = absl::Now();
  // No renewal can succeed: leadership ends on the leader's own clock within one TTL.
  while (a->IsLeader() && absl::Now() < stopped + absl::Seconds(5)) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_FALSE(a->IsLeader());
  EXPECT_LE(absl::Now() - stopped, options.ttl);
  absl::SleepFor(absl::Seconds(1));
  etcd_->Signal(SIGCONT);
  ASSERT_TRUE(a->WaitUntilLeader(absl::Now() + absl::Seconds(10)));
  EXPECT_GT(a->term(), first_term);
}

}  // namespace
}  // namespace kvrelay::etcd

// Cache store high availability (issue 20) on real processes: a real etcd and three
// `kvrelay cachestore --etcd` instances on free loopback ports, a steady stream of requests from
// a node client that knows all three addresses. Each test is bounded (~10-25 s).
//
//   - kill -9 of the leader: a standby leads within 3 s, no reply ever names a wrong slot,
//     only a mid-placement write fails, the prefix hits are there at once on the new leader,
//     and re-announcing what the node holds is idempotent;
//   - SIGSTOP of the leader for 10 s: a standby takes over, and after SIGCONT the old leader
//     refuses writes at once, steps down and follows the new one;
//   - SIGTERM of the leader: it resigns as its drain starts, a standby leads within 1 s;
//   - etcd SIGSTOPped for 10 s: the leader serves until its lease could have expired, then every
//     instance fails closed with FAILURE_NOT_LEADER; service resumes when etcd returns;
//   - KV events: a standby that takes over publishes its blocks with the tokens they were
//     committed with (replicated, never on disk).

#include <signal.h>
#include <sys/stat.h>

#include <atomic>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "cachestore/client/cache_store_client.h"
#include "common/file_util.h"
#include "common/server/dev_certs.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kv/block_hash.h"
#include "nlohmann/json.hpp"
#include "proto/grpc_status.h"
#include "tests/cachestore/ha_cluster.h"
#include "tests/testing/status_matchers.h"

namespace kvrelay::cachestore {
namespace {

using ::kvrelay::testing::ChildProcess;
using ::kvrelay::testing::HaCluster;
using ::kvrelay::testing::IsOk;
using ::kvrelay::testing::IsOkAndHolds;
using ::kvrelay::testing::PickUnusedPort;
using ::testing::HasSubstr;

constexpr int kChainBlocks = 8;
constexpr int kPreloadChains = 16;
constexpr char kNode[] = "worker-1";
constexpr char kSegment[] = "kv";

std::vector<kv::BlockHash> Chain(int id) {
  std::vector<int32_t> tokens;
  // Unsigned: id 99999 wraps (signed overflow is undefined; UBSan stopped it), same tokens.
  for (int i = 0; i < kChainBlocks * 16; ++i) {
    tokens.push_back(static_cast<int32_t>(static_cast<uint32_t>(id) * 100000u + i));
  }
  return kv::HashChain(kv::LayoutFingerprint{}, "ha", tokens, 16);
}

// One call to exactly this instance's stub: no redirect is followed.
absl::Status RawCall(CacheStoreClient& c, bool write) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(3)));
  if (write) {
    v1::AllocateRequest req;
    v1::BlockToAllocate* b = req.add_blocks();
    CacheStoreClient::ToProto(Chain(99999)[0], b->mutable_hash());
    b->set_size_bytes(4096);
    v1::AllocateResponse resp;
    return proto::FromGrpcStatus(c.stub().Allocate(&ctx, req, &resp));
  }
  v1::ListNodesResponse resp;
  return proto::FromGrpcStatus(c.stub().ListNodes(&ctx, v1::ListNodesRequest(), &resp));
}

bool IsNotLeader(const absl::Status& s) {
  std::optional<v1::ErrorInfo> info = proto::GetErrorInfo(s);
  return absl::IsUnavailable(s) && info.has_value() && info->reason() == v1::FAILURE_NOT_LEADER;
}

// What the node committed where: any reply naming another slot for a block is a wrong answer.
class Ledger {
 public:
  void Record(const v1::AllocateResponse& a) {
    absl::MutexLock lock(&mu_);
    for (const v1::Allocation& b : a.blocks()) {
      if (b.replicas_size() > 0) slot_[{b.hash().hi(), b.hash().lo()}] = b.replicas(0).slot();
    }
  }
  // Wrong locations in a match of `chain`.
  int Check(absl::Span<const kv::BlockHash> chain, const v1::MatchPrefixResponse& r) {
    const auto locations = CacheStoreClient::Locations(r);
    absl::MutexLock lock(&mu_);
    int wrong = 0;
    for (int i = 0; i < r.matched() && i < static_cast<int>(locations.size()); ++i) {
      auto it = slot_.find({chain[i].hi, chain[i].lo});
      for (const v1::BlockLocation& loc : locations[i]) {
        if (it == slot_.end() || loc.node_id() != kNode || loc.slot() != it->second) ++wrong;
      }
    }
    return wrong;
  }

 private:
  absl::Mutex mu_;
  std::map<std::pair<uint64_t, uint64_t>, int64_t> slot_ ABSL_GUARDED_BY(mu_);
};

// A steady stream of requests: a MatchPrefix of a preloaded chain every few ms and a new chain
// placed and committed every other iteration, heartbeating meanwhile.
class Stream {
 public:
  Stream(CacheStoreClient* client, Ledger* ledger) : client_(client), ledger_(ledger) {
    thread_ = std::thread([this] { Run(); });
  }
  ~Stream() { Stop(); }
  void Stop() {
    stop_.store(true);
    if (thread_.joinable()) thread_.join();
  }

  std::atomic<int> reads{0}, failed_reads{0}, short_matches{0}, wrong{0};
  std::atomic<int> writes{0}, failed_allocs{0}, failed_commits{0}, term_regressions{0};
  std::atomic<int64_t> last_write_us{0};  // unix micros of the last successful commit
  std::string first_failure;

 private:
  void Run() {
    int next_chain = 1000;
    int64_t term = 0;
    absl::Time next_heartbeat = absl::Now();
    for (int i = 0; !stop_.load(); ++i) {
      if (absl::Now() >= next_heartbeat) {
        (void)client_->Heartbeat();
        next_heartbeat = absl::Now() + absl::Milliseconds(500);
      }
      const std::vector<kv::BlockHash> old = Chain(i % kPreloadChains);
      absl::StatusOr<v1::MatchPrefixResponse> m = client_->MatchPrefix(old);
      ++reads;
      if (!m.ok()) {
        ++failed_reads;
        Note(m.status());
      } else {
        wrong += ledger_->Check(old, *m);
        if (m->matched() != kChainBlocks) ++short_matches;
      }
      if (i % 2 == 0) {
        const std::vector<kv::BlockHash> chain = Chain(next_chain++);
        absl::StatusOr<v1::AllocateResponse> a = client_->AllocateChain(chain, 4096);
        if (!a.ok()) {
          ++failed_allocs;
          Note(a.status());
        } else {
          ledger_->Record(*a);
          absl::StatusOr<int> c = client_->Commit(a->allocation_id());
          if (!c.ok()) {
            ++failed_commits;
            Note(c.status());
          } else {
            ++writes;
            last_write_us.store(absl::ToUnixMicros(absl::Now()));
          }
        }
      }
      const int64_t now_term = client_->term();
      if (now_term < term) ++term_regressions;
      term = now_term;
      absl::SleepFor(absl::Milliseconds(5));
    }
  }
  void Note(const absl::Status& s) {
    if (first_failure.empty()) first_failure = s.ToString();
  }

  CacheStoreClient* client_;
  Ledger* ledger_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

class CacheStoreHaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaCluster::EtcdInstalled()) GTEST_SKIP() << "etcd missing (scripts/setup.sh)";
    ASSERT_THAT(cluster_.Start(3), IsOk()) << cluster_.Logs();
    CacheStoreClient::Options o;
    o.node = {kNode, CacheStoreClient::NewIncarnation()};
    o.timeout = absl::Seconds(6);
    o.attempt_timeout = absl::Milliseconds(500);
    o.own_connection = true;
    KV_ASSERT_OK_AND_ASSIGN(client_, CacheStoreClient::Connect(cluster_.addresses(), o));
    CacheStoreClient::Registration reg;
    reg.role = v1::NODE_ROLE_PREFILL;
    reg.grpc_address = "127.0.0.1:7100";
    reg.transport_kind = "ucx";
    reg.transport_address = "127.0.0.1:13337";
    reg.ttl = absl::Seconds(10);
    v1::Segment seg;
    seg.set_segment_id(kSegment);
    seg.set_tier(v1::TIER_HOST);
    seg.set_capacity_slots(100000);
    seg.set_slot_bytes(4096);
    reg.segments.push_back(seg);
    ASSERT_THAT(client_->Register(reg), IsOk());
    for (int c = 0; c < kPreloadChains; ++c) {
      const std::vector<kv::BlockHash> chain = Chain(c);
      KV_ASSERT_OK_AND_ASSIGN(v1::AllocateResponse a, client_->AllocateChain(chain, 4096));
      ledger_.Record(a);
      for (const v1::Allocation& b : a.blocks()) {
        v1::AnnouncedBlock held;
        *held.mutable_hash() = b.hash();
        held.set_slot(b.replicas(0).slot());
        held.set_size_bytes(4096);
        held_.push_back(held);
      }
      for (int i = 0; i < kChainBlocks; ++i) {
        if (i > 0)
          CacheStoreClient::ToProto(chain[i - 1], held_[c * kChainBlocks + i].mutable_parent());
      }
      KV_ASSERT_OK_AND_ASSIGN(int n, client_->Commit(a.allocation_id()));
      ASSERT_EQ(n, kChainBlocks);
    }
    ASSERT_TRUE(StandbysHave(kPreloadChains * kChainBlocks, absl::Seconds(5))) << cluster_.Logs();
  }

  // Every instance's own index holds at least `blocks` committed blocks.
  bool StandbysHave(int64_t blocks, absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    for (int i = 0; i < cluster_.size(); ++i) {
      while (true) {
        if (!cluster_.store(i)->Running()) break;
        absl::StatusOr<std::unique_ptr<CacheStoreClient>> c = cluster_.Direct(i);
        if (c.ok()) {
          absl::StatusOr<v1::StatsResponse> s = (*c)->Stats();
          if (s.ok() && s->committed_blocks() >= blocks) break;
        }
        if (absl::Now() > deadline) return false;
        absl::SleepFor(absl::Milliseconds(20));
      }
    }
    return true;
  }

  void ExpectClean(const Stream& stream, int max_failed_writes) {
    EXPECT_EQ(stream.wrong.load(), 0) << "a reply named a slot the block was never written to";
    EXPECT_EQ(stream.failed_reads.load(), 0) << stream.first_failure;
    EXPECT_EQ(stream.short_matches.load(), 0) << "a committed prefix went missing";
    EXPECT_EQ(stream.term_regressions.load(), 0);
    EXPECT_LE(stream.failed_allocs.load() + stream.failed_commits.load(), max_failed_writes)
        << stream.first_failure;
    EXPECT_GT(stream.writes.load(), 0);
  }

  HaCluster cluster_;
  std::unique_ptr<CacheStoreClient> client_;
  Ledger ledger_;
  std::vector<v1::AnnouncedBlock> held_;
};

TEST_F(CacheStoreHaTest, KillNineOfTheLeaderUnderASteadyStream) {
  KV_ASSERT_OK_AND_ASSIGN(HaCluster::Leader leader, cluster_.WaitForLeader(absl::Seconds(5)));
  Stream stream(client_.get(), &ledger_);
  absl::SleepFor(absl::Seconds(1));
  const int writes_before = stream.writes.load();
  const absl::Time killed = absl::Now();
  cluster_.KillStore(leader.index);
  absl::StatusOr<HaCluster::Leader> next = cluster_.WaitForLeader(absl::Seconds(10), leader.term);
  ASSERT_THAT(next, IsOk()) << cluster_.Logs();
  const absl::Duration failover = absl::Now() - killed;
  EXPECT_NE(next->index, leader.index);
  EXPECT_GT(next->term, leader.term);
  EXPECT_LT(failover, absl::Seconds(3)) << "a standby should lead within 3 s";
  // The stream goes on against the new leader.
  const absl::Time resumed_by = absl::Now() + absl::Seconds(5);
  while (stream.last_write_us.load() < absl::ToUnixMicros(absl::Now() - absl::Milliseconds(200)) &&
         absl::Now() < resumed_by) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  absl::SleepFor(absl::Seconds(1));
  stream.Stop();
  std::printf(
      "failover after kill -9: %.0f ms; stream: %d reads, %d writes (%d before the kill), "
      "%d failed allocations, %d failed commits\n",
      absl::ToDoubleMilliseconds(failover), stream.reads.load(), stream.writes.load(),
      writes_before, stream.failed_allocs.load(), stream.failed_commits.load());
  // At most the one placement in flight when the leader died (its allocation died with it).
  ExpectClean(stream, 1);
  EXPECT_GT(stream.writes.load(), writes_before);
  EXPECT_EQ(client_->term(), next->term);
  // The prefix hits came from the replicated index, not from a re-registration; re-announcing
  // what the node holds to the new leader is idempotent.
  KV_ASSERT_OK_AND_ASSIGN(v1::AnnounceBlocksResponse announced, client_->Announce(kSegment, held_));
  EXPECT_EQ(announced.accepted(), 0);
  EXPECT_EQ(announced.already_present(), static_cast<int>(held_.size()));
  EXPECT_EQ(announced.rejected_size(), 0);
  // The killed instance comes back as a standby and catches up.
  ASSERT_THAT(cluster_.StartStore(leader.index), IsOk());
  KV_ASSERT_OK_AND_ASSIGN(v1::StatsResponse stats, client_->Stats());
  EXPECT_TRUE(StandbysHave(stats.committed_blocks(), absl::Seconds(10))) << cluster_.Logs();
}

TEST_F(CacheStoreHaTest, SigstopOfTheLeaderForTenSeconds) {
  KV_ASSERT_OK_AND_ASSIGN(HaCluster::Leader leader, cluster_.WaitForLeader(absl::Seconds(5)));
  Stream stream(client_.get(), &ledger_);
  absl::SleepFor(absl::Milliseconds(500));
  const absl::Time stopped = absl::Now();
  cluster_.store(leader.index)->Signal(SIGSTOP);
  absl::StatusOr<HaCluster::Leader> next = cluster_.WaitForLeader(absl::Seconds(8), leader.term);
  if (!next.ok()) cluster_.store(leader.index)->Signal(SIGCONT);
  ASSERT_THAT(next, IsOk()) << cluster_.Logs();
  const absl::Duration takeover = absl::Now() - stopped;
  EXPECT_LT(takeover, absl::Seconds(4));
  absl::SleepFor(stopped + absl::Seconds(10) - absl::Now());
  // A client of the old leader alone: whatever it asks right after the pause is refused.
  KV_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CacheStoreClient> old, cluster_.Direct(leader.index));
  cluster_.store(leader.index)->Signal(SIGCONT);
  const absl::Status refused = RawCall(*old, /*write=*/true);
  EXPECT_TRUE(IsNotLeader(refused)) << refused;
  const absl::Status read = RawCall(*old, /*write=*/false);
  EXPECT_TRUE(IsNotLeader(read)) << read;
  // It steps down: its refusals name the new leader, and it follows the new leader's log.
  bool redirects = false;
  for (absl::Time deadline = absl::Now() + absl::Seconds(5); absl::Now() < deadline;) {
    std::optional<v1::ErrorInfo> info = proto::GetErrorInfo(RawCall(*old, /*write=*/false));
    if (info.has_value() && info->address() == cluster_.address(next->index)) {
      redirects = true;
      break;
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_TRUE(redirects) << cluster_.Logs();
  stream.Stop();
  std::printf(
      "takeover after SIGSTOP: %.0f ms; stream: %d reads, %d writes, %d failed "
      "allocations, %d failed commits\n",
      absl::ToDoubleMilliseconds(takeover), stream.reads.load(), stream.writes.load(),
      stream.failed_allocs.load(), stream.failed_commits.load());
  ExpectClean(stream, 1);
  EXPECT_EQ(client_->term(), next->term);
  KV_ASSERT_OK_AND_ASSIGN(v1::StatsResponse stats, client_->Stats());
  EXPECT_TRUE(StandbysHave(stats.committed_blocks(), absl::Seconds(5))) << cluster_.Logs();
}

// The gateway's case (issue 34): a client whose calls each get only 500 ms (below the default
// 1 s per-instance attempt) and the leader SIGSTOPped. Each call fails over within its own
// budget (half of what is left per instance), so the calls reach the standby that takes the
// lease within one call of its election instead of waiting on the paused leader for good, and
// no call outlives its budget.
TEST_F(CacheStoreHaTest, AShortCallBudgetStillFailsOverToTheNewLeader) {
  KV_ASSERT_OK_AND_ASSIGN(HaCluster::Leader leader, cluster_.WaitForLeader(absl::Seconds(5)));
  CacheStoreClient::Options o;  // anonymous, default attempt_timeout, as the gateway's
  o.timeout = absl::Milliseconds(500);
  o.own_connection = true;
  KV_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CacheStoreClient> gateway,
                          CacheStoreClient::Connect(cluster_.addresses(), o));
  const std::vector<kv::BlockHash> chain = Chain(0);
  KV_ASSERT_OK_AND_ASSIGN(v1::QueryPrefixResponse before, gateway->QueryPrefix(chain));
  ASSERT_EQ(before.nodes_size(), 1);
  cluster_.store(leader.index)->Signal(SIGSTOP);
  const absl::Time stopped = absl::Now();
  absl::Duration longest_call;
  std::optional<absl::Time> elected, reached;
  std::thread watch([&] {
    absl::StatusOr<HaCluster::Leader> next = cluster_.WaitForLeader(absl::Seconds(8), leader.term);
    if (next.ok()) elected = absl::Now();
  });
  while (!reached.has_value() && absl::Now() < stopped + absl::Seconds(10)) {
    const absl::Time start = absl::Now();
    absl::StatusOr<v1::QueryPrefixResponse> r = gateway->QueryPrefix(chain);
    longest_call = std::max(longest_call, absl::Now() - start);
    if (r.ok()) {
      reached = absl::Now();
      EXPECT_EQ(r->nodes_size(), 1);
      EXPECT_EQ(r->nodes(0).matched(), kChainBlocks);
    }
  }
  watch.join();
  cluster_.store(leader.index)->Signal(SIGCONT);
  ASSERT_TRUE(elected.has_value()) << cluster_.Logs();
  ASSERT_TRUE(reached.has_value()) << "no call reached the new leader\n" << cluster_.Logs();
  std::printf(
      "paused leader: new leader after %.0f ms, first answer after %.0f ms; longest "
      "call %.0f ms\n",
      absl::ToDoubleMilliseconds(*elected - stopped),
      absl::ToDoubleMilliseconds(*reached - stopped), absl::ToDoubleMilliseconds(longest_call));
  // Lease TTL (2 s) plus one call, with room for a loaded machine.
  EXPECT_LT(*reached - stopped, absl::Seconds(2) + absl::Seconds(2));
  EXPECT_LT(longest_call, absl::Seconds(1)) << "a call outlived its 500 ms budget";
}

TEST_F(CacheStoreHaTest, SigtermOfTheLeaderHandsOverAtOnce) {
  KV_ASSERT_OK_AND_ASSIGN(HaCluster::Leader leader, cluster_.WaitForLeader(absl::Seconds(5)));
  Stream stream(client_.get(), &ledger_);
  absl::SleepFor(absl::Milliseconds(500));
  const absl::Time terminated = absl::Now();
  cluster_.store(leader.index)->Signal(SIGTERM);
  absl::StatusOr<HaCluster::Leader> next = cluster_.WaitForLeader(absl::Seconds(5), leader.term);
  ASSERT_THAT(next, IsOk()) << cluster_.Logs();
  const absl::Duration handover = absl::Now() - terminated;
  // It resigns when the drain starts: no lease has to run out.
  EXPECT_LT(handover, absl::Seconds(1));
  EXPECT_THAT(cluster_.store(leader.index)->Wait(absl::Seconds(15)), IsOkAndHolds(0));
  absl::SleepFor(absl::Milliseconds(500));
  stream.Stop();
  std::printf("handover after SIGTERM: %.0f ms\n", absl::ToDoubleMilliseconds(handover));
  ExpectClean(stream, 1);
}

// What `kvrelay status` shows as the HA leader: every instance's Stats says whether it leads
// (with its term), and a standby names the leader's address.
TEST_F(CacheStoreHaTest, StatsNameTheLeaderOnEveryInstance) {
  KV_ASSERT_OK_AND_ASSIGN(HaCluster::Leader leader, cluster_.WaitForLeader(absl::Seconds(5)));
  for (int i = 0; i < cluster_.size(); ++i) {
    KV_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CacheStoreClient> direct, cluster_.Direct(i));
    absl::StatusOr<v1::StatsResponse> stats;
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    do {
      stats = direct->Stats();
      // A standby may not know the leader's address for a moment after the election.
      if (stats.ok() && (stats->leading() || !stats->leader_address().empty())) break;
      absl::SleepFor(absl::Milliseconds(50));
    } while (absl::Now() < deadline);
    ASSERT_THAT(stats, IsOk());
    EXPECT_EQ(stats->leading(), i == leader.index) << i;
    if (i == leader.index) {
      EXPECT_EQ(stats->term(), leader.term);
    } else {
      EXPECT_EQ(stats->leader_address(), cluster_.address(leader.index)) << i;
    }
  }
}

TEST_F(CacheStoreHaTest, EtcdUnavailableForTenSeconds) {
  KV_ASSERT_OK_AND_ASSIGN(HaCluster::Leader leader, cluster_.WaitForLeader(absl::Seconds(5)));
  KV_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CacheStoreClient> direct, cluster_.Direct(leader.index));
  ASSERT_THAT(direct->WaitForReady(absl::Seconds(2)), IsOk());
  auto quick = [] {
    CallOptions call;
    call.deadline = absl::Now() + absl::Milliseconds(300);
    return call;
  };
  const absl::Time stopped = absl::Now();
  cluster_.etcd()->Signal(SIGSTOP);
  // It keeps serving reads while its lease may still be valid...
  EXPECT_THAT(direct->MatchPrefix(Chain(0), absl::ZeroDuration(), quick()), IsOk());
  // ... and fails closed, with a status that says so, once it could have expired.
  absl::Duration closed_after = absl::InfiniteDuration();
  while (absl::Now() - stopped < absl::Seconds(4)) {
    absl::StatusOr<v1::MatchPrefixResponse> r =
        direct->MatchPrefix(Chain(0), absl::ZeroDuration(), quick());
    if (!r.ok()) {
      EXPECT_TRUE(IsNotLeader(r.status())) << r.status();
      closed_after = absl::Now() - stopped;
      break;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_LE(closed_after, absl::Seconds(2)) << "the leader must stop within its lease TTL";
  absl::SleepFor(absl::Seconds(1));
  for (int i = 0; i < cluster_.size(); ++i) {
    KV_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CacheStoreClient> c, cluster_.Direct(i));
    absl::StatusOr<v1::AllocateResponse> w =
        c->AllocateChain(Chain(5000 + i), 4096, {}, "", quick());
    EXPECT_TRUE(IsNotLeader(w.status())) << "store " << i << ": " << w.status();
  }
  absl::SleepFor(stopped + absl::Seconds(10) - absl::Now());
  cluster_.etcd()->Signal(SIGCONT);
  const absl::Time resumed = absl::Now();
  KV_ASSERT_OK_AND_ASSIGN(HaCluster::Leader after, cluster_.WaitForLeader(absl::Seconds(15)));
  // Service resumes: the HA client writes and reads again.
  KV_ASSERT_OK_AND_ASSIGN(v1::AllocateResponse a, client_->AllocateChain(Chain(7000), 4096));
  EXPECT_THAT(client_->Commit(a.allocation_id()), IsOk());
  KV_ASSERT_OK_AND_ASSIGN(v1::MatchPrefixResponse m, client_->MatchPrefix(Chain(0)));
  EXPECT_EQ(m.matched(), kChainBlocks);
  std::printf(
      "etcd stopped 10 s: the leader failed closed after %.0f ms; serving again %.0f ms "
      "after etcd resumed (term %lld -> %lld)\n",
      absl::ToDoubleMilliseconds(closed_after), absl::ToDoubleMilliseconds(absl::Now() - resumed),
      static_cast<long long>(leader.term), static_cast<long long>(after.term));
}

// The client's side of fencing, against in-process stores whose answers the test sets: a
// deposed leader that still answers OK cannot be made on demand from the real process (it
// refuses on its own clock first), so this seam is a hand-written service.
class ScriptedStore final : public v1::CacheStore::Service {
 public:
  grpc::Status ListNodes(grpc::ServerContext* ctx, const v1::ListNodesRequest*,
                         v1::ListNodesResponse* resp) override {
    absl::MutexLock lock(&mu_);
    ++calls_;
    if (!redirect_to_.empty()) {
      return proto::ToGrpcStatus(proto::Attribute(absl::UnavailableError("not leader"),
                                                  v1::ROLE_STORE, "", v1::FAILURE_NOT_LEADER,
                                                  redirect_to_));
    }
    ctx->AddTrailingMetadata("kvrelay-store-term", absl::StrCat(term_));
    resp->set_store_incarnation(static_cast<uint64_t>(term_));
    return grpc::Status::OK;
  }
  void Lead(int64_t term) {
    absl::MutexLock lock(&mu_);
    term_ = term;
    redirect_to_.clear();
  }
  void Redirect(const std::string& to) {
    absl::MutexLock lock(&mu_);
    redirect_to_ = to;
  }
  int calls() {
    absl::MutexLock lock(&mu_);
    return calls_;
  }

 private:
  absl::Mutex mu_;
  int64_t term_ ABSL_GUARDED_BY(mu_) = 0;
  std::string redirect_to_ ABSL_GUARDED_BY(mu_);
  int calls_ ABSL_GUARDED_BY(mu_) = 0;
};

TEST(CacheStoreClientFencing, FollowsRedirectsAndDropsRepliesOfAnOlderTerm) {
  ScriptedStore a, b;
  std::vector<std::unique_ptr<grpc::Server>> servers;
  std::vector<std::string> addresses;
  for (ScriptedStore* store : {&a, &b}) {
    int port = 0;
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(store);
    servers.push_back(builder.BuildAndStart());
    ASSERT_NE(servers.back(), nullptr);
    addresses.push_back(absl::StrCat("127.0.0.1:", port));
  }
  CacheStoreClient::Options o;
  o.timeout = absl::Seconds(1);
  o.attempt_timeout = absl::Milliseconds(200);
  KV_ASSERT_OK_AND_ASSIGN(auto client,
                          CacheStoreClient::Connect(addresses[0] + "," + addresses[1], o));
  a.Lead(5);
  b.Redirect(addresses[0]);
  KV_ASSERT_OK_AND_ASSIGN(v1::ListNodesResponse r, client->ListNodes());
  EXPECT_EQ(r.store_incarnation(), 5u);
  EXPECT_EQ(client->term(), 5);
  // `a` now redirects to `b`, which answers OK but with term 3 < 5 (a deposed leader that
  // resumed): its reply must never reach the caller.
  a.Redirect(addresses[1]);
  b.Lead(3);
  absl::StatusOr<v1::ListNodesResponse> stale = client->ListNodes();
  EXPECT_TRUE(IsNotLeader(stale.status())) << stale.status();
  EXPECT_GT(b.calls(), 0);
  // A newer term is accepted, wherever it comes from.
  b.Lead(6);
  KV_ASSERT_OK_AND_ASSIGN(r, client->ListNodes());
  EXPECT_EQ(r.store_incarnation(), 6u);
  EXPECT_EQ(client->term(), 6);
  EXPECT_EQ(client->current_address(), addresses[1]);
  for (auto& server : servers) server->Shutdown();
}

// Issue 35.5: the replication stream carries each block's tokens, so a standby that takes over
// publishes its blocks (its KV-event state resend after the promotion) with their token_ids,
// as the old leader would have. Its own WAL never holds them.
TEST(CacheStoreHaEvents, ANewLeadersEventsCarryTheTokens) {
  if (!HaCluster::EtcdInstalled()) GTEST_SKIP() << "etcd missing (scripts/setup.sh)";
  if (::access("/usr/bin/python3", X_OK) != 0) GTEST_SKIP() << "no /usr/bin/python3";
  HaCluster cluster;
  std::vector<std::string> pub, replay;
  for (int i = 0; i < 2; ++i) {
    pub.push_back(absl::StrCat("tcp://127.0.0.1:", PickUnusedPort()));
    replay.push_back(absl::StrCat("tcp://127.0.0.1:", PickUnusedPort()));
  }
  cluster.extra_store_flags = [&](int i) {
    return std::vector<std::string>{"--kv-events-endpoint",        pub[i],
                                    "--kv-events-replay-endpoint", replay[i],
                                    "--kv-events-model",           "ha"};
  };
  ASSERT_THAT(cluster.Start(2), IsOk()) << cluster.Logs();
  KV_ASSERT_OK_AND_ASSIGN(HaCluster::Leader leader, cluster.WaitForLeader(absl::Seconds(15)));
  const int standby = 1 - leader.index;

  CacheStoreClient::Options o;
  o.node = {kNode, CacheStoreClient::NewIncarnation()};
  o.timeout = absl::Seconds(6);
  o.own_connection = true;
  KV_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CacheStoreClient> client,
                          CacheStoreClient::Connect(cluster.addresses(), o));
  CacheStoreClient::Registration reg;
  reg.role = v1::NODE_ROLE_PREFILL;
  reg.grpc_address = "127.0.0.1:7100";
  reg.transport_kind = "ucx";
  reg.transport_address = "127.0.0.1:13337";
  reg.ttl = absl::Seconds(30);  // outlives the fail-over without heartbeats
  v1::Segment seg;
  seg.set_segment_id(kSegment);
  seg.set_tier(v1::TIER_HOST);
  seg.set_capacity_slots(64);
  seg.set_slot_bytes(4096);
  reg.segments.push_back(seg);
  ASSERT_THAT(client->Register(reg), IsOk());
  // Chain(7)'s tokens, as Chain builds them.
  std::vector<int32_t> tokens;
  for (int i = 0; i < kChainBlocks * 16; ++i) tokens.push_back(7 * 100000 + i);
  const std::vector<kv::BlockHash> chain = Chain(7);
  KV_ASSERT_OK_AND_ASSIGN(v1::AllocateResponse a, client->AllocateChain(chain, 4096));
  KV_ASSERT_OK_AND_ASSIGN(int n, client->Commit(a.allocation_id(), chain, {}, tokens));
  ASSERT_EQ(n, kChainBlocks);
  // The standby has applied the commit.
  const absl::Time applied_by = absl::Now() + absl::Seconds(10);
  for (;;) {
    absl::StatusOr<std::unique_ptr<CacheStoreClient>> c = cluster.Direct(standby);
    absl::StatusOr<v1::StatsResponse> stats =
        c.ok() ? (*c)->Stats() : absl::StatusOr<v1::StatsResponse>(c.status());
    if (stats.ok() && stats->committed_blocks() >= kChainBlocks) break;
    ASSERT_LT(absl::Now(), applied_by) << cluster.Logs();
    absl::SleepFor(absl::Milliseconds(20));
  }

  // A subscriber of the standby's stream, then the leader dies.
  testing::TempDir dir;
  KV_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<ChildProcess> subscriber,
      ChildProcess::Start({"/usr/bin/python3",
                           testing::SourceDir() + "/tests/cachestore/kv_events_subscriber.py",
                           "--endpoint", pub[standby], "--replay", replay[standby], "--model", "ha",
                           "--state", dir.File("state.json")}));
  ASSERT_THAT(subscriber->WaitForOutput("subscriber ready", absl::Seconds(30)), IsOk());
  cluster.KillStore(leader.index);
  KV_ASSERT_OK_AND_ASSIGN(HaCluster::Leader next,
                          cluster.WaitForLeader(absl::Seconds(10), leader.term));
  ASSERT_EQ(next.index, standby);

  // The new leader's stream has every block of the chain with its 16 tokens.
  std::map<std::string, std::vector<int32_t>> want;
  for (int i = 0; i < kChainBlocks; ++i) {
    want[absl::StrCat(chain[i].hi)] =
        std::vector<int32_t>(tokens.begin() + i * 16, tokens.begin() + (i + 1) * 16);
  }
  std::map<std::string, std::vector<int32_t>> seen;
  nlohmann::json state;
  const absl::Time deadline = absl::Now() + absl::Seconds(15);
  while (seen != want && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(50));
    absl::StatusOr<std::string> text = ReadFileToString(dir.File("state.json"));
    if (!text.ok()) continue;
    state = nlohmann::json::parse(*text, nullptr, false);
    seen.clear();
    if (state.is_discarded() || !state.contains("tokens") || !state["tokens"].contains(kNode)) {
      continue;
    }
    for (const auto& [hash, ids] : state["tokens"][kNode].items()) {
      seen[hash] = ids.get<std::vector<int32_t>>();
    }
  }
  EXPECT_EQ(seen, want) << state.dump() << "\n" << cluster.Logs();
  ASSERT_TRUE(state.contains("errors"));
  EXPECT_TRUE(state["errors"].empty()) << state["errors"].dump();
}

// etcd over mutual TLS (a real etcd started with --client-cert-auth): stores with the client
// certificate elect a leader that serves; a store talking plain text is refused by etcd, never
// leads, and says so in one log line however often it retries; a store whose TLS files do not
// verify is refused at start, naming the file.
TEST(CacheStoreEtcdTls, StoresWithTheClientCertificateLeadOthersAreRefused) {
  if (!HaCluster::EtcdInstalled()) GTEST_SKIP() << "etcd missing (scripts/setup.sh)";
  HaCluster cluster;
  ASSERT_THAT(cluster.UseEtcdTls(), IsOk());
  ASSERT_THAT(cluster.Start(2), IsOk()) << cluster.Logs();
  KV_ASSERT_OK_AND_ASSIGN(HaCluster::Leader leader, cluster.WaitForLeader(absl::Seconds(15)));

  // Plain text against the TLS etcd: refused, one line, the flags named.
  KV_ASSERT_OK_AND_ASSIGN(std::unique_ptr<ChildProcess> plain,
                          cluster.StartStoreProcess(absl::StrCat("127.0.0.1:", PickUnusedPort()),
                                                    cluster.TempPath("plain-store"), {}));
  KV_ASSERT_OK_AND_ASSIGN(std::string line,
                          plain->WaitForOutput("cannot get a lease from etcd", absl::Seconds(20)));
  EXPECT_THAT(line, HasSubstr("--etcd-cert"));
  // Retries every lease TTL / 3 (about 0.7 s): over 3 s it has retried several times, and
  // logged once.
  absl::SleepFor(absl::Seconds(3));
  const std::string log = plain->Stderr();
  size_t lines = 0;
  for (size_t at = log.find("cannot get a lease from etcd"); at != std::string::npos;
       at = log.find("cannot get a lease from etcd", at + 1)) {
    ++lines;
  }
  EXPECT_EQ(lines, 1u) << log;
  KV_ASSERT_OK_AND_ASSIGN(HaCluster::Leader still, cluster.WaitForLeader(absl::Seconds(5)));
  EXPECT_EQ(still.term, leader.term);

  // Files that do not verify: refused at start (exit 2), naming what is wrong.
  const std::string other_dir = cluster.TempPath("other-ca");
  ASSERT_EQ(::mkdir(other_dir.c_str(), 0700), 0);
  KV_ASSERT_OK_AND_ASSIGN(auto other_ca,
                          ::kvrelay::server::DevCertificateAuthority::Create(other_dir));
  KV_ASSERT_OK_AND_ASSIGN(::kvrelay::server::SecurityOptions stranger,
                          other_ca->Issue(::kvrelay::server::PeerRole::kStore, "stranger"));
  const std::vector<std::string> good = cluster.EtcdTlsFlags();  // ca, cert, key
  struct BadFiles {
    std::vector<std::string> flags;
    std::string says;
  };
  for (const BadFiles& bad : {
           BadFiles{{"--etcd-ca", good[1], "--etcd-cert", stranger.cert_file, "--etcd-key",
                     stranger.key_file},
                    "does not verify against"},
           BadFiles{{"--etcd-ca", good[1], "--etcd-cert", good[3], "--etcd-key", stranger.key_file},
                    "is not the key of the certificate"},
           BadFiles{{"--etcd-ca", good[1]}, "needs all of --etcd-ca, --etcd-cert and --etcd-key"},
       }) {
    KV_ASSERT_OK_AND_ASSIGN(
        std::unique_ptr<ChildProcess> refused,
        cluster.StartStoreProcess(absl::StrCat("127.0.0.1:", PickUnusedPort()),
                                  cluster.TempPath("refused-store"), bad.flags));
    KV_ASSERT_OK_AND_ASSIGN(int code, refused->Wait(absl::Seconds(30)));
    EXPECT_EQ(code, 2) << refused->Stderr();
    EXPECT_THAT(refused->Stderr(), HasSubstr(bad.says));
  }

  // Fail-over over TLS is as fast as in plain text: kill -9 of the leader, the standby leads
  // within 3 s.
  const absl::Time killed = absl::Now();
  cluster.KillStore(leader.index);
  absl::StatusOr<HaCluster::Leader> next = cluster.WaitForLeader(absl::Seconds(10), leader.term);
  ASSERT_THAT(next, IsOk()) << cluster.Logs();
  const absl::Duration failover = absl::Now() - killed;
  EXPECT_NE(next->index, leader.index);
  EXPECT_LT(failover, absl::Seconds(3)) << "a standby should lead within 3 s with etcd TLS on";
  std::printf("failover after kill -9 with etcd mutual TLS: %.0f ms\n",
              absl::ToDoubleMilliseconds(failover));
}

}  // namespace
}  // namespace kvrelay::cachestore

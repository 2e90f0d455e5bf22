// Cache store HA (issue 20): how long until writes work again after kill -9 of the leader, and
// how far behind the leader a standby's index is.
//
//   build/bin/cachestore_ha_bench [--kills=N] [--samples=M]
//
// A real etcd and three `kvrelay cachestore --etcd --etcd-lease-ttl 2s` on loopback
// (tests/cachestore/ha_cluster.h). Failover: N times, kill -9 the leader, then time until an
// Allocate + Commit through a client that knows all three addresses succeeds (the killed one is
// restarted and caught up before the next kill); baseline: the lease TTL, the time etcd needs to
// notice a dead leader at all. Standby lag: M times, commit one block on the leader and time
// until a standby's own Stats counts it; baseline: one Stats round trip to that standby (the
// poll's own cost). p50 / p99 / max each.

#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/time/clock.h"
#include "cachestore/client/cache_store_client.h"
#include "kv/block_hash.h"
#include "tests/cachestore/ha_cluster.h"

namespace {

using kvrelay::cachestore::CacheStoreClient;
using kvrelay::testing::HaCluster;

std::vector<kvrelay::kv::BlockHash> Chain(int id, int blocks) {
  std::vector<int32_t> tokens;
  for (int i = 0; i < blocks * 16; ++i) tokens.push_back(id * 100000 + i);
  return kvrelay::kv::HashChain(kvrelay::kv::LayoutFingerprint{}, "bench", tokens, 16);
}

struct Percentiles {
  double p50 = 0, p99 = 0, max = 0;
};
Percentiles Summarize(std::vector<double> ms) {
  Percentiles p;
  if (ms.empty()) return p;
  std::sort(ms.begin(), ms.end());
  auto at = [&](double q) {
    return ms[std::min(ms.size() - 1, static_cast<size_t>(q * static_cast<double>(ms.size())))];
  };
  p.p50 = at(0.5);
  p.p99 = at(0.99);
  p.max = ms.back();
  return p;
}

int Fail(const std::string& what, const absl::Status& s, const HaCluster& cluster) {
  std::fprintf(stderr, "cachestore_ha_bench: %s: %s\n%s\n", what.c_str(), s.ToString().c_str(),
               cluster.Logs().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);
  int kills = 5, samples = 200;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--kills=", 0) == 0 && absl::SimpleAtoi(a.substr(8), &kills) && kills > 0 &&
        kills <= 100) {
      continue;
    }
    if (a.rfind("--samples=", 0) == 0 && absl::SimpleAtoi(a.substr(10), &samples) && samples > 0 &&
        samples <= 100000) {
      continue;
    }
    std::fprintf(stderr, "usage: %s [--kills=1-100] [--samples=1-100000]; bad argument '%s'\n",
                 argv[0], a.c_str());
    return 2;
  }
  if (std::getenv("KVRELAY_BIN_DIR") == nullptr) {
    // Benches live in build/bin beside kvrelay.
    std::error_code ec;
    const std::string dir = std::filesystem::read_symlink("/proc/self/exe", ec).parent_path();
    setenv("KVRELAY_BIN_DIR", dir.c_str(), 1);
  }
  if (!HaCluster::EtcdInstalled()) {
    std::fprintf(stderr, "cachestore_ha_bench: %s missing (scripts/setup.sh)\n", HaCluster::kEtcd);
    return 1;
  }
  HaCluster cluster;
  if (absl::Status s = cluster.Start(3); !s.ok()) return Fail("starting the cluster", s, cluster);
  CacheStoreClient::Options o;
  o.node = {"bench-node", CacheStoreClient::NewIncarnation()};
  o.timeout = absl::Seconds(10);
  o.attempt_timeout = absl::Milliseconds(500);
  o.own_connection = true;
  absl::StatusOr<std::unique_ptr<CacheStoreClient>> client =
      CacheStoreClient::Connect(cluster.addresses(), o);
  if (!client.ok()) return Fail("client", client.status(), cluster);
  CacheStoreClient::Registration reg;
  reg.role = kvrelay::v1::NODE_ROLE_PREFILL;
  reg.transport_kind = "ucx";
  reg.transport_address = "127.0.0.1:1";
  reg.ttl = absl::Seconds(30);
  kvrelay::v1::Segment seg;
  seg.set_segment_id("kv");
  seg.set_tier(kvrelay::v1::TIER_HOST);
  seg.set_capacity_slots(1 << 20);
  seg.set_slot_bytes(4096);
  reg.segments.push_back(seg);
  if (auto r = (*client)->Register(reg); !r.ok()) return Fail("register", r.status(), cluster);
  int next_chain = 0;
  int64_t committed_total = 0;  // one block per successful write
  auto write = [&]() -> absl::Status {
    absl::StatusOr<kvrelay::v1::AllocateResponse> a =
        (*client)->AllocateChain(Chain(next_chain++, 1), 4096);
    if (!a.ok()) return a.status();
    absl::Status s = (*client)->Commit(a->allocation_id()).status();
    if (s.ok()) ++committed_total;
    return s;
  };
  auto committed = [&](int i) -> int64_t {
    absl::StatusOr<std::unique_ptr<CacheStoreClient>> c = cluster.Direct(i);
    if (!c.ok()) return -1;
    absl::StatusOr<kvrelay::v1::StatsResponse> s = (*c)->Stats();
    return s.ok() ? s->committed_blocks() : -1;
  };

  // --- standby lag -------------------------------------------------------------------------
  absl::StatusOr<HaCluster::Leader> leader = cluster.WaitForLeader(absl::Seconds(10));
  if (!leader.ok()) return Fail("leader", leader.status(), cluster);
  const int standby = (leader->index + 1) % cluster.size();
  absl::StatusOr<std::unique_ptr<CacheStoreClient>> poll = cluster.Direct(standby);
  if (!poll.ok()) return Fail("standby client", poll.status(), cluster);
  std::vector<double> lag_ms, rtt_ms;
  for (int i = 0; i < samples; ++i) {
    if (absl::Status s = write(); !s.ok()) return Fail("write", s, cluster);
    const absl::Time acked = absl::Now();
    const int64_t want = committed_total;
    while (true) {
      const absl::Time sent = absl::Now();
      absl::StatusOr<kvrelay::v1::StatsResponse> st = (*poll)->Stats();
      rtt_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - sent));
      if (st.ok() && st->committed_blocks() >= want) break;
      if (absl::Now() - acked > absl::Seconds(10)) {
        return Fail("standby lag", absl::DeadlineExceededError("standby never caught up"), cluster);
      }
    }
    lag_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - acked));
  }

  // --- failover after kill -9 ----------------------------------------------------------------
  std::vector<double> failover_ms;
  int failed_writes = 0;
  int64_t lost_commits = 0;
  for (int k = 0; k < kills; ++k) {
    leader = cluster.WaitForLeader(absl::Seconds(10));
    if (!leader.ok()) return Fail("leader", leader.status(), cluster);
    if (absl::Status s = write(); !s.ok()) return Fail("write before the kill", s, cluster);
    const absl::Time killed = absl::Now();
    cluster.KillStore(leader->index);
    while (true) {
      absl::Status s = write();
      if (s.ok()) break;
      ++failed_writes;  // at most a mid-placement one (its allocation died with the leader)
      if (absl::Now() - killed > absl::Seconds(20)) return Fail("write after the kill", s, cluster);
    }
    failover_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - killed));
    const int dead = leader->index;
    absl::StatusOr<HaCluster::Leader> next = cluster.WaitForLeader(absl::Seconds(5), leader->term);
    if (!next.ok()) return Fail("new leader", next.status(), cluster);
    std::fprintf(stderr,
                 "kill %d: store %d (term %lld) -> store %d (term %lld): writes after %.0f ms\n", k,
                 leader->index, static_cast<long long>(leader->term), next->index,
                 static_cast<long long>(next->term), failover_ms.back());
    // Commits acked within the replication lag before the kill: not in the new leader's index
    // until the node re-announces them (a StoreLink does on the new term; this client does not).
    const int64_t on_new_leader = committed(next->index);
    lost_commits += std::max<int64_t>(0, committed_total - on_new_leader);
    committed_total = on_new_leader;
    if (absl::Status s = cluster.StartStore(dead); !s.ok()) return Fail("restart", s, cluster);
    const absl::Time restarted = absl::Now();
    while (committed(dead) < committed(next->index)) {
      if (absl::Now() - restarted > absl::Seconds(20)) {
        return Fail("catch-up", absl::DeadlineExceededError("restarted store never caught up"),
                    cluster);
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
  }

  const Percentiles lag = Summarize(lag_ms), rtt = Summarize(rtt_ms);
  const Percentiles failover = Summarize(failover_ms);
  const double ttl_ms = 2000;
  std::printf("cache store HA (3 instances, etcd lease TTL 2 s, loopback)\n");
  std::printf("| figure | samples | p50 ms | p99 ms | max ms | baseline | ratio (p50) |\n");
  std::printf("|---|---:|---:|---:|---:|---|---:|\n");
  std::printf(
      "| writes again after kill -9 of the leader | %d | %.0f | %.0f | %.0f | lease TTL "
      "%.0f ms | %.2fx |\n",
      kills, failover.p50, failover.p99, failover.max, ttl_ms, failover.p50 / ttl_ms);
  std::printf(
      "| standby lag (commit acked -> in the standby's index) | %d | %.2f | %.2f | %.2f | "
      "Stats round trip p50 %.2f ms | %.2fx |\n",
      samples, lag.p50, lag.p99, lag.max, rtt.p50, rtt.p50 > 0 ? lag.p50 / rtt.p50 : 0);
  std::printf(
      "failed writes during the %d failovers: %d (each a placement whose leader died); "
      "commits acked before a kill but not yet replicated: %lld (back when their node "
      "re-announces)\n",
      kills, failed_writes, static_cast<long long>(lost_commits));
  return 0;
}

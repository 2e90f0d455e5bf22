// cachestore_bench: the cache store's speed and size figures, each beside a baseline measured
// in the same run.
//
//   1. MatchPrefix of a 256-block chain, server side, one thread: blocks/s per core, for the
//      BlockIndex alone and for CacheStore::MatchPrefix (which also resolves replica locations),
//      beside a bare absl::flat_hash_map lookup of the same hashes.
//   2. The same lookup over gRPC on loopback against a real `kvrelay cachestore` process (with
//      --policy) with 16 concurrent clients, as unary MatchPrefix calls and on one
//      MatchPrefixStream per client (what CacheStoreClient does by default), and with the 16
//      threads sharing one client (one stream: a worker's concurrent requests), beside
//      redis-server (started here on a free loopback port) answering it as one pipeline of 256
//      EXISTS per lookup (RESP over a plain socket), and the ratios; then the latency (p50 /
//      p99) of one such lookup from a single client, for each.
//   3. Index memory per block at 10M blocks (chains of 256), from the index's own accounting and
//      from process RSS growth; goal <= 200 bytes.
//   4. Trace-replay prefix hit rates (LRU baseline vs the default policy) at 2k / 6k / 20k blocks
//      on ../shared/data/traces/synthetic_trace.jsonl, if present.
//
// Usage: cachestore_bench [--quick] [--skip=server,grpc,unary,memory,trace] [--trace=PATH]
// [--blocks=N]
//                         [--policy=NAME]

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "cachestore/block_index.h"
#include "cachestore/cache_store.h"
#include "cachestore/client/cache_store_client.h"
#include "cachestore/sim/trace_replay.h"
#include "common/server/server_flags.h"

namespace {

using kvrelay::cachestore::BlockHash;
using Clock = std::chrono::steady_clock;

constexpr int kChainLen = 256;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

BlockHash H(uint64_t i) {
  uint64_t x = i * 0x9e3779b97f4a7c15ull + 0x632be59bd9b4e019ull;
  x ^= x >> 31;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 29;
  uint64_t y = x * 0x94d049bb133111ebull + i;
  y ^= y >> 32;
  return BlockHash{y, x};
}

std::vector<BlockHash> ChainOf(int c) {
  std::vector<BlockHash> chain;
  for (int i = 0; i < kChainLen; ++i) chain.push_back(H(static_cast<uint64_t>(c) * kChainLen + i));
  return chain;
}

int64_t RssBytes() {
  FILE* f = std::fopen("/proc/self/statm", "r");
  long pages = 0, rss = 0;
  if (f != nullptr) {
    if (std::fscanf(f, "%ld %ld", &pages, &rss) != 2) rss = 0;
    std::fclose(f);
  }
  return static_cast<int64_t>(rss) * sysconf(_SC_PAGESIZE);
}

int FreePort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

int ConnectLoopback(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return -1;
  }
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

bool SendAll(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    ssize_t n = ::send(fd, s.data() + off, s.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return false;
    off += static_cast<size_t>(n);
  }
  return true;
}

// Reads `n` RESP integer replies (":0\r\n" / ":1\r\n"); returns the leading run of 1s, or -1.
int ReadExistsReplies(int fd, int n, std::string* buf) {
  buf->clear();
  int parsed = 0, leading = 0;
  bool broken = false;
  size_t pos = 0;
  char tmp[16384];
  while (parsed < n) {
    size_t eol;
    while ((eol = buf->find("\r\n", pos)) != std::string::npos && parsed < n) {
      if ((*buf)[pos] != ':') return -1;
      const bool one = (*buf)[pos + 1] == '1';
      if (!broken && one) {
        ++leading;
      } else {
        broken = true;
      }
      ++parsed;
      pos = eol + 2;
    }
    if (parsed == n) break;
    ssize_t r = ::recv(fd, tmp, sizeof(tmp), 0);
    if (r <= 0) return -1;
    buf->append(tmp, static_cast<size_t>(r));
  }
  return leading;
}

std::string RespCommand(const std::vector<std::string>& args) {
  std::string s = absl::StrCat("*", args.size(), "\r\n");
  for (const std::string& a : args) absl::StrAppend(&s, "$", a.size(), "\r\n", a, "\r\n");
  return s;
}

// CPU seconds (user + system, every thread) used so far by process `pid`; -1 if unreadable.
double ProcessCpuSeconds(pid_t pid) {
  FILE* f = std::fopen(absl::StrCat("/proc/", pid, "/stat").c_str(), "r");
  if (f == nullptr) return -1;
  char buf[1024];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  // Fields after the parenthesised command name: state is field 3, utime 14, stime 15.
  const char* p = std::strrchr(buf, ')');
  unsigned long long utime = 0, stime = 0;
  if (p == nullptr || std::sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu",
                                  &utime, &stime) != 2) {
    return -1;
  }
  return static_cast<double>(utime + stime) / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

double SelfCpuSeconds() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

std::string SelfDir() {
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return ".";
  std::string p(buf, static_cast<size_t>(n));
  return p.substr(0, p.rfind('/'));
}

// Spawns argv with stdout to a pipe; returns pid and the read end.
pid_t Spawn(const std::vector<std::string>& argv, int* out_fd) {
  int fds[2];
  if (::pipe(fds) != 0) return -1;
  pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(fds[1], 1);
    ::close(fds[0]);
    std::vector<char*> a;
    for (const std::string& s : argv) a.push_back(const_cast<char*>(s.c_str()));
    a.push_back(nullptr);
    ::execv(a[0], a.data());
    _exit(127);
  }
  ::close(fds[1]);
  *out_fd = fds[0];
  return pid;
}

std::string ReadLine(int fd) {
  std::string line;
  char c;
  while (::read(fd, &c, 1) == 1 && c != '\n') line.push_back(c);
  return line;
}

struct Options {
  bool quick = false;
  bool server = true, grpc = true, memory = true, trace = true;
  bool unary = true;  // the unary MatchPrefix phase of 2. (--skip=unary: stream and Redis only)
  std::string trace_path = "/work/shared/data/traces/synthetic_trace.jsonl";
  int64_t memory_blocks = 10'000'000;
  std::string policy = std::string(kvrelay::cachestore::kDefaultPolicy);  // server side and gRPC
};

// --- 1. server side -------------------------------------------------------------------------
void BenchServerSide(const Options& opt) {
  std::printf("== MatchPrefix, 256-block chain, server side, 1 thread (policy %s) ==\n",
              opt.policy.c_str());
  kvrelay::cachestore::CacheStoreOptions so;
  so.policy = opt.policy;
  so.max_ghost_blocks = 0;
  auto store = kvrelay::cachestore::CacheStore::Create(so);
  if (!store.ok()) {
    std::printf("  cannot create store: %s\n", store.status().ToString().c_str());
    return;
  }
  kvrelay::cachestore::NodeSpec spec;
  spec.node_id = "bench-node";
  spec.ttl = absl::Hours(1);
  constexpr int kChains = 64;
  spec.segments.push_back(
      {"host0", kvrelay::cachestore::Tier::kHost, kChains * kChainLen * 2, 1 << 20, "key"});
  (void)(*store)->RegisterNode(spec);
  absl::flat_hash_map<BlockHash, uint32_t> baseline;
  std::vector<std::vector<BlockHash>> chains;
  for (int c = 0; c < kChains; ++c) {
    chains.push_back(ChainOf(c));
    kvrelay::cachestore::AllocateArgs args;
    BlockHash parent;
    for (const BlockHash& h : chains.back()) {
      args.blocks.push_back({h, parent, 1 << 20});
      baseline[h] = static_cast<uint32_t>(baseline.size());
      parent = h;
    }
    auto a = (*store)->Allocate(args, absl::InfiniteFuture());
    if (!a.ok() || !(*store)->Commit(a->allocation_id, {}).ok()) {
      std::printf("  setup failed\n");
      return;
    }
  }
  const double run_s = opt.quick ? 0.3 : 2.0;
  auto measure = [&](auto&& fn) {
    int64_t blocks = 0;
    const auto t0 = Clock::now();
    auto t1 = t0;
    int i = 0;
    while (Seconds(t0, t1) < run_s) {
      for (int k = 0; k < 16; ++k) blocks += fn(chains[(i++) % kChains]);
      t1 = Clock::now();
    }
    return blocks / Seconds(t0, t1);
  };
  const double base = measure([&](const std::vector<BlockHash>& chain) {
    int n = 0;
    for (const BlockHash& h : chain) {
      if (!baseline.contains(h)) break;
      ++n;
    }
    return n;
  });
  std::vector<kvrelay::cachestore::MatchedBlock> out;
  const double index = measure([&](const std::vector<BlockHash>& chain) {
    out.clear();
    return (*store)->index().MatchPrefix(chain, true, false, &out);
  });
  const double full = measure([&](const std::vector<BlockHash>& chain) {
    auto r = (*store)->MatchPrefix(chain, absl::ZeroDuration());
    return r.ok() ? r->matched : 0;
  });
  std::printf("  baseline absl::flat_hash_map lookup : %12.0f blocks/s\n", base);
  std::printf("  BlockIndex::MatchPrefix (+replicas) : %12.0f blocks/s  (%.2fx baseline)\n", index,
              index / base);
  std::printf("  CacheStore::MatchPrefix (+locations): %12.0f blocks/s  (%.2fx baseline)\n", full,
              full / base);
}

// --- 2. gRPC vs Redis -------------------------------------------------------------------------
void BenchGrpcVsRedis(const Options& opt) {
  constexpr int kClients = 16;
  const double run_s = opt.quick ? 1.0 : 5.0;
  std::printf(
      "== MatchPrefix of a 256-block chain over loopback, %d concurrent clients (policy %s) ==\n",
      kClients, opt.policy.c_str());
  const std::string kvrelay_bin = SelfDir() + "/kvrelay";
  if (::access(kvrelay_bin.c_str(), X_OK) != 0) {
    std::printf("  skipped: %s not built\n", kvrelay_bin.c_str());
    return;
  }
  constexpr int kChains = kClients;
  std::vector<std::vector<BlockHash>> chains;
  for (int c = 0; c < kChains; ++c) chains.push_back(ChainOf(1000 + c));
  // A store with the 16 chains committed (pid 0 if it did not start), `extra` flags appended.
  struct Store {
    pid_t pid = 0;
    int out_fd = -1;
    std::string target;
  };
  auto start_store = [&](const std::vector<std::string>& extra) {
    Store store;
    std::vector<std::string> argv = {kvrelay_bin,  "cachestore",     "--port",
                                     "0",          "--metrics-port", "0",
                                     "--insecure", "--policy",       opt.policy};
    argv.insert(argv.end(), extra.begin(), extra.end());
    const pid_t cs = Spawn(argv, &store.out_fd);
    const std::string line = ReadLine(store.out_fd);
    // "cachestore listening on 127.0.0.1:PORT metrics ..."
    const size_t at = line.find("on ");
    if (cs <= 0 || at == std::string::npos) {
      std::printf("  cachestore did not start: '%s'\n", line.c_str());
      if (cs > 0) ::kill(cs, SIGKILL);
      return Store{};
    }
    store.target = line.substr(at + 3, line.find(' ', at + 3) - at - 3);
    auto client = kvrelay::cachestore::CacheStoreClient::Connect(store.target);
    kvrelay::v1::RegisterNodeRequest reg;
    reg.set_node_id("bench-node");
    auto* seg = reg.add_segments();
    seg->set_segment_id("host0");
    seg->set_tier(kvrelay::v1::TIER_HOST);
    seg->set_capacity_slots(kChains * kChainLen * 2);
    seg->set_slot_bytes(1 << 20);
    reg.set_ttl_ms(600000);
    if (!client.ok() || !(*client)->WaitForReady(absl::Seconds(10)).ok() ||
        !(*client)->RegisterNode(reg).ok()) {
      std::printf("  cannot reach cachestore at %s\n", store.target.c_str());
      ::kill(cs, SIGKILL);
      ::waitpid(cs, nullptr, 0);
      return Store{};
    }
    for (const auto& chain : chains) {
      auto a = (*client)->AllocateChain(chain, 1 << 20);
      if (a.ok()) (void)(*client)->Commit(a->allocation_id());
    }
    store.pid = cs;
    return store;
  };
  auto stop = [](pid_t pid, int fd) {
    ::kill(pid, SIGTERM);
    ::waitpid(pid, nullptr, 0);
    ::close(fd);
  };
  const Store store = start_store({});
  if (store.pid == 0) return;
  const pid_t cs = store.pid;
  const std::string& target = store.target;
  auto run_clients = [&](auto&& one_lookup) {
    std::atomic<int64_t> blocks{0};
    std::atomic<bool> failed{false};
    std::vector<std::thread> threads;
    const auto t0 = Clock::now();
    for (int t = 0; t < kClients; ++t) {
      threads.emplace_back([&, t] {
        int64_t mine = 0;
        auto state = one_lookup.Setup(t);
        while (Seconds(t0, Clock::now()) < run_s) {
          const int n = one_lookup.Lookup(state, chains[t]);
          if (n < 0) {
            failed = true;
            break;
          }
          mine += n;
        }
        blocks += mine;
      });
    }
    for (auto& th : threads) th.join();
    const double secs = Seconds(t0, Clock::now());
    return failed ? -1.0 : static_cast<double>(blocks.load()) / secs;
  };
  struct GrpcLookup {
    std::string target;
    bool stream = false;  // MatchPrefixStream instead of unary MatchPrefix
    std::unique_ptr<kvrelay::cachestore::CacheStoreClient> Setup(int) const {
      // One connection per client, as each Redis client has its own socket.
      kvrelay::cachestore::CacheStoreClient::Options o;
      o.own_connection = true;
      o.lookup_stream = stream;
      auto c = kvrelay::cachestore::CacheStoreClient::Connect(target, o);
      return c.ok() ? *std::move(c) : nullptr;
    }
    int Lookup(std::unique_ptr<kvrelay::cachestore::CacheStoreClient>& c,
               const std::vector<BlockHash>& chain) const {
      if (c == nullptr) return -1;
      auto r = c->MatchPrefix(chain);
      return r.ok() ? r->matched() : -1;
    }
  };
  // The 16 threads share one client, so one connection and one lookup stream, as a worker's
  // concurrent requests share its StoreLink: lookups waiting at once go out in one message.
  struct SharedLookup {
    kvrelay::cachestore::CacheStoreClient* client = nullptr;
    kvrelay::cachestore::CacheStoreClient* Setup(int) const { return client; }
    int Lookup(kvrelay::cachestore::CacheStoreClient* c,
               const std::vector<BlockHash>& chain) const {
      if (c == nullptr) return -1;
      auto r = c->MatchPrefix(chain);
      return r.ok() ? r->matched() : -1;
    }
  };
  // One client alone, one lookup at a time: the latency of a call, each call timed.
  auto latencies = [&](auto&& one_lookup) {
    std::vector<double> us;
    auto state = one_lookup.Setup(0);
    const auto t0 = Clock::now();
    while (Seconds(t0, Clock::now()) < run_s / 2) {
      const auto a = Clock::now();
      if (one_lookup.Lookup(state, chains[0]) != kChainLen) return std::vector<double>{};
      us.push_back(1e6 * Seconds(a, Clock::now()));
    }
    std::sort(us.begin(), us.end());
    return us;
  };
  auto percentile = [](const std::vector<double>& sorted, double p) {
    if (sorted.empty()) return -1.0;
    return sorted[std::min(sorted.size() - 1, static_cast<size_t>(p * sorted.size()))];
  };
  // CPU per lookup beside the rates: on a shared machine the rates follow whatever else runs,
  // the CPU each side spends per 256-block lookup much less so.
  struct Cpu {
    double server_s = 0, client_s = 0;
  };
  auto cpu_of = [](pid_t server, auto&& run) {
    const double s0 = ProcessCpuSeconds(server), c0 = SelfCpuSeconds();
    const double rate = run();
    return std::make_pair(rate, Cpu{ProcessCpuSeconds(server) - s0, SelfCpuSeconds() - c0});
  };
  const auto [ours, our_cpu] = opt.unary ? cpu_of(cs,
                                                  [&] {
                                                    return run_clients(GrpcLookup{target, false});
                                                  })
                                         : std::make_pair(0.0, Cpu{});
  const std::vector<double> our_latency =
      opt.unary ? latencies(GrpcLookup{target, false}) : std::vector<double>{};
  const auto [streamed, streamed_cpu] = cpu_of(cs, [&] {
    return run_clients(GrpcLookup{target, true});
  });
  const std::vector<double> streamed_latency = latencies(GrpcLookup{target, true});
  std::unique_ptr<kvrelay::cachestore::CacheStoreClient> shared_client =
      GrpcLookup{target, true}.Setup(0);
  const auto [shared, shared_cpu] =
      cpu_of(cs, [&] { return run_clients(SharedLookup{shared_client.get()}); });
  shared_client.reset();
  stop(cs, store.out_fd);
  // The same per-connection stream phase with the store on one core (`--cpus`), Redis below on
  // the same one (`server_cpulist`): a single-threaded Redis never wakes a thread on the other
  // core, and the store's gRPC threads then do not either.
  // The highest-numbered CPU this process may run on.
  const absl::StatusOr<std::vector<int>> allowed = kvrelay::server::AllowedCpus();
  const int pin_cpu = allowed.ok() && !allowed->empty() ? allowed->back() : 0;
  double pinned = 0, pinned_theirs = 0;
  Cpu pinned_cpu, pinned_their_cpu;
  if (const Store on_one = start_store({"--cpus", std::to_string(pin_cpu)}); on_one.pid != 0) {
    std::tie(pinned, pinned_cpu) = cpu_of(on_one.pid, [&] {
      return run_clients(GrpcLookup{on_one.target, true});
    });
    stop(on_one.pid, on_one.out_fd);
  }

  // Redis: same hashes as 32-hex-digit keys, SET once, then 256-EXISTS pipelines.
  auto key = [](const BlockHash& h) {
    char buf[40];
    std::snprintf(buf, sizeof(buf), "%016llx%016llx", static_cast<unsigned long long>(h.hi),
                  static_cast<unsigned long long>(h.lo));
    return std::string(buf);
  };
  std::vector<std::string> pipelines;
  for (const auto& chain : chains) {
    std::string pipe;
    for (const BlockHash& h : chain) pipe += RespCommand({"EXISTS", key(h)});
    pipelines.push_back(std::move(pipe));
  }
  struct RedisLookup {
    int port;
    const std::vector<std::string>* pipelines;
    const std::vector<std::vector<BlockHash>>* chains;
    struct State {
      int fd = -1;
      int index = 0;
      std::string buf;
    };
    State Setup(int t) const { return State{ConnectLoopback(port), t, {}}; }
    int Lookup(State& s, const std::vector<BlockHash>&) const {
      if (s.fd < 0 || !SendAll(s.fd, (*pipelines)[s.index])) return -1;
      return ReadExistsReplies(s.fd, kChainLen, &s.buf);
    }
  };
  // A redis-server holding the chains' keys (pid 0 if it did not start), `extra` flags appended.
  auto start_redis = [&](const std::vector<std::string>& extra, int* port, int* out_fd) -> pid_t {
    *port = FreePort();
    std::vector<std::string> argv = {"/usr/bin/redis-server",
                                     "--port",
                                     std::to_string(*port),
                                     "--bind",
                                     "127.0.0.1",
                                     "--save",
                                     "",
                                     "--appendonly",
                                     "no",
                                     "--daemonize",
                                     "no",
                                     "--loglevel",
                                     "warning"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    const pid_t redis = Spawn(argv, out_fd);
    int setup_fd = -1;
    for (int i = 0; i < 200 && setup_fd < 0; ++i) {
      setup_fd = ConnectLoopback(*port);
      if (setup_fd < 0) std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
    if (redis <= 0 || setup_fd < 0) {
      std::printf("  redis-server did not start\n");
      if (redis > 0) ::kill(redis, SIGKILL);
      return 0;
    }
    for (const auto& chain : chains) {
      std::string pipe;
      for (const BlockHash& h : chain) pipe += RespCommand({"SET", key(h), "1"});
      SendAll(setup_fd, pipe);
      // +OK replies: read them off.
      int oks = 0;
      char tmp[8192];
      std::string acc;
      while (oks < kChainLen) {
        ssize_t r = ::recv(setup_fd, tmp, sizeof(tmp), 0);
        if (r <= 0) break;
        acc.append(tmp, static_cast<size_t>(r));
        size_t p;
        while ((p = acc.find("\r\n")) != std::string::npos) {
          ++oks;
          acc.erase(0, p + 2);
        }
      }
    }
    ::close(setup_fd);
    return redis;
  };
  int port = 0, rfd = -1;
  const pid_t redis = start_redis({}, &port, &rfd);
  if (redis == 0) return;
  const auto [theirs, their_cpu] = cpu_of(redis, [&] {
    return run_clients(RedisLookup{port, &pipelines, &chains});
  });
  const std::vector<double> their_latency = latencies(RedisLookup{port, &pipelines, &chains});
  stop(redis, rfd);
  if (const pid_t on_one = start_redis({"--server_cpulist", std::to_string(pin_cpu)}, &port, &rfd);
      on_one != 0) {
    std::tie(pinned_theirs, pinned_their_cpu) = cpu_of(on_one, [&] {
      return run_clients(RedisLookup{port, &pipelines, &chains});
    });
    stop(on_one, rfd);
  }
  if (opt.unary) {
    std::printf("  kvrelay cachestore, unary MatchPrefix   : %12.0f blocks/s  (%.2fx redis)\n",
                ours, ours / theirs);
  } else {
    std::printf("  kvrelay cachestore, unary MatchPrefix   : skipped (--skip=unary)\n");
  }
  std::printf("  kvrelay cachestore, MatchPrefixStream   : %12.0f blocks/s  (%.2fx redis)\n",
              streamed, streamed / theirs);
  std::printf("  kvrelay cachestore, one shared stream   : %12.0f blocks/s  (%.2fx redis)\n",
              shared, shared / theirs);
  std::printf("  redis-server (pipeline of 256 EXISTS)   : %12.0f blocks/s\n", theirs);
  std::printf("  ratio ours (stream) / redis             : %12.2fx  (goal >= 1x; unary %.2fx)\n",
              streamed / theirs, ours / theirs);
  std::printf("  ratio ours (one shared stream) / redis  : %12.2fx\n", shared / theirs);
  // Lookups made in each phase: blocks / 256 (every lookup matches the whole chain).
  auto per_lookup_us = [&](double seconds, double rate) {
    return 1e6 * seconds / (rate * run_s / kChainLen);
  };
  const double redis_us = per_lookup_us(their_cpu.server_s + their_cpu.client_s, theirs);
  std::printf(
      "  CPU per lookup, server + client (us)    : unary %.1f + %.1f, stream %.1f + %.1f, redis "
      "%.1f + %.1f (stream / redis %.2fx)\n",
      per_lookup_us(our_cpu.server_s, ours), per_lookup_us(our_cpu.client_s, ours),
      per_lookup_us(streamed_cpu.server_s, streamed),
      per_lookup_us(streamed_cpu.client_s, streamed), per_lookup_us(their_cpu.server_s, theirs),
      per_lookup_us(their_cpu.client_s, theirs),
      per_lookup_us(streamed_cpu.server_s + streamed_cpu.client_s, streamed) / redis_us);
  std::printf("  CPU per lookup, one shared stream (us)  : %.1f + %.1f\n",
              per_lookup_us(shared_cpu.server_s, shared),
              per_lookup_us(shared_cpu.client_s, shared));
  if (pinned > 0 && pinned_theirs > 0) {
    std::printf(
        "  each server on CPU %d (--cpus / server_cpulist): MatchPrefixStream %.0f blocks/s, "
        "redis %.0f blocks/s (%.2fx redis); CPU per lookup, server + client (us): ours %.1f + "
        "%.1f, redis %.1f + %.1f\n",
        pin_cpu, pinned, pinned_theirs, pinned / pinned_theirs,
        per_lookup_us(pinned_cpu.server_s, pinned), per_lookup_us(pinned_cpu.client_s, pinned),
        per_lookup_us(pinned_their_cpu.server_s, pinned_theirs),
        per_lookup_us(pinned_their_cpu.client_s, pinned_theirs));
  }
  std::printf(
      "  one lookup, 1 client, p50 / p99 (us)    : unary %.0f / %.0f (%zu calls), stream %.0f / "
      "%.0f (%zu calls), redis %.0f / %.0f (%zu calls)\n",
      percentile(our_latency, 0.5), percentile(our_latency, 0.99), our_latency.size(),
      percentile(streamed_latency, 0.5), percentile(streamed_latency, 0.99),
      streamed_latency.size(), percentile(their_latency, 0.5), percentile(their_latency, 0.99),
      their_latency.size());
}

// --- 3. memory --------------------------------------------------------------------------------
void BenchMemory(const Options& opt) {
  const int64_t n = opt.quick ? 1'000'000 : opt.memory_blocks;
  std::printf("== Index memory at %lld blocks (chains of 256, 1 replica each) ==\n",
              static_cast<long long>(n));
  auto policy = kvrelay::cachestore::MakeEvictionPolicy("lrfu", n);
  kvrelay::cachestore::BlockIndex::Options io;
  io.policy = policy->get();
  const int64_t rss0 = RssBytes();
  auto index = std::make_unique<kvrelay::cachestore::BlockIndex>(io);
  const auto t0 = Clock::now();
  kvrelay::cachestore::NewBlock b;
  b.size_bytes = 1 << 20;
  b.replicas.push_back({1, 0, 0});
  for (int64_t i = 0; i < n; ++i) {
    b.hash = H(static_cast<uint64_t>(i) + (1ull << 40));
    b.parent = (i % kChainLen == 0) ? BlockHash{} : H(static_cast<uint64_t>(i - 1) + (1ull << 40));
    b.replicas[0].slot = static_cast<uint32_t>(i);
    if (!index->Insert(b, kvrelay::cachestore::BlockState::kCommitted).ok()) {
      std::printf("  insert failed at %lld\n", static_cast<long long>(i));
      return;
    }
  }
  const double secs = Seconds(t0, Clock::now());
  const int64_t rss1 = RssBytes();
  // Baseline: the bare map a naive index starts from (hash -> 64-bit value), same n.
  const int64_t rss_b0 = RssBytes();
  double baseline_per_block = 0;
  {
    absl::flat_hash_map<BlockHash, uint64_t> bare;
    bare.reserve(0);
    for (int64_t i = 0; i < n; ++i) bare[H(static_cast<uint64_t>(i) + (1ull << 41))] = i;
    baseline_per_block =
        static_cast<double>(bare.capacity() * (sizeof(std::pair<BlockHash, uint64_t>) + 1)) /
        static_cast<double>(n);
  }
  (void)rss_b0;
  std::printf("  inserted in %.1f s (%.0f blocks/s)\n", secs, n / secs);
  std::printf("  index accounting : %6.1f bytes/block (goal <= 200)\n",
              static_cast<double>(index->MemoryUsageBytes()) / n);
  std::printf("  RSS growth       : %6.1f bytes/block\n", static_cast<double>(rss1 - rss0) / n);
  std::printf(
      "  baseline bare absl::flat_hash_map<BlockHash, uint64_t>: %.1f bytes/block "
      "(ratio %.2fx)\n",
      baseline_per_block, static_cast<double>(index->MemoryUsageBytes()) / n / baseline_per_block);
}

// --- 4. trace replay --------------------------------------------------------------------------
void BenchTrace(const Options& opt) {
  std::printf("== Trace-replay prefix hit rate (%s) ==\n", opt.trace_path.c_str());
  if (::access(opt.trace_path.c_str(), R_OK) != 0) {
    std::printf("  skipped: trace not present\n");
    return;
  }
  auto trace = kvrelay::cachestore::sim::LoadTrace(opt.trace_path);
  if (!trace.ok()) {
    std::printf("  %s\n", trace.status().ToString().c_str());
    return;
  }
  // Hit rate and the cost per block access of the whole replay (match + touch + insert + evict,
  // and for adaptive its three shadow caches), which is the store's per-access policy work.
  const char* names[] = {"lru", "leaf-lru", "lrfu", "adaptive"};
  std::printf("  %10s", "capacity");
  for (const char* n : names) std::printf(" %9s %7s", n, "ns/acc");
  std::printf(" %13s\n", "adaptive/lru");
  for (int64_t cap : {2000, 6000, 20000, 200000}) {
    double rate[4], ns[4];
    for (int i = 0; i < 4; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      auto res = kvrelay::cachestore::sim::ReplayTrace(*trace, cap, names[i]);
      const double secs =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      rate[i] = res.ok() ? res->hit_rate() : -1;
      ns[i] = res.ok() && res->blocks > 0 ? 1e9 * secs / static_cast<double>(res->blocks) : -1;
    }
    std::printf("  %10lld", static_cast<long long>(cap));
    for (int i = 0; i < 4; ++i) std::printf(" %9.4f %7.0f", rate[i], ns[i]);
    std::printf(" %12.3fx\n", rate[3] / rate[0]);
  }
}

}  // namespace

int main(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);
  // As in the kvrelay binary (cli/main.cc): the store's clients, prefill and decode workers,
  // run without Abseil's per-acquisition deadlock check, so the benchmark's client does too.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  Options opt;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--quick") {
      opt.quick = true;
    } else if (a.rfind("--skip=", 0) == 0) {
      const std::string s = a.substr(7);
      if (s.find("server") != std::string::npos) opt.server = false;
      if (s.find("grpc") != std::string::npos) opt.grpc = false;
      if (s.find("memory") != std::string::npos) opt.memory = false;
      if (s.find("trace") != std::string::npos) opt.trace = false;
      if (s.find("unary") != std::string::npos) opt.unary = false;
    } else if (a.rfind("--policy=", 0) == 0) {
      opt.policy = a.substr(9);
    } else if (a.rfind("--trace=", 0) == 0) {
      opt.trace_path = a.substr(8);
    } else if (a.rfind("--blocks=", 0) == 0) {
      if (!absl::SimpleAtoi(a.substr(9), &opt.memory_blocks) || opt.memory_blocks <= 0) {
        std::fprintf(stderr, "cachestore_bench: --blocks: want a positive integer\n");
        return 2;
      }
    } else {
      std::fprintf(stderr,
                   "usage: cachestore_bench [--quick] [--skip=server,grpc,unary,memory,trace] "
                   "[--trace=PATH] "
                   "[--blocks=N] [--policy=NAME]\n");
      return 2;
    }
  }
  std::printf("cachestore_bench (%u hardware threads)\n", std::thread::hardware_concurrency());
  if (opt.server) BenchServerSide(opt);
  if (opt.grpc) BenchGrpcVsRedis(opt);
  if (opt.memory) BenchMemory(opt);
  if (opt.trace) BenchTrace(opt);
  return 0;
}

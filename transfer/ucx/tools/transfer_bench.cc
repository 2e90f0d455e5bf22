#include "transfer/ucx/tools/transfer_bench.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/flags.h"
#include "common/scoped_fd.h"
#include "common/status_macros.h"
#include "transfer/internal/populate.h"
#include "transfer/transport.h"
#include "transfer/ucx/tools/command.h"
#include "transfer/ucx/ucx_transport.h"

namespace kvrelay::transfer::ucx::tools {
namespace {

void FillRandom(uint8_t* p, size_t n, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i + 8 <= n; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(p + i, &x, 8);
  }
}

}  // namespace

std::string UcxTlsFor(const std::string& tls) {
  if (tls == "tcp") return "tcp";
  if (tls == "shm") return "posix,sysv,cma,self";
  return tls;
}

int RunTransferReceiver(const std::vector<std::string>& args) {
  FlagSet flags("transfer-bench --role=receiver", "receiving peer");
  std::string tls = "tcp";
  int64_t region_bytes = 1 << 30;
  std::string listen_host = "127.0.0.1";
  int32_t listen_port = 0;
  std::string role;
  std::string until = "stdin";
  flags.AddString("until", &until,
                  "stdin (exit when stdin closes; a line 'faults' prints this process's page "
                  "faults, a line 'populated' waits until this process has populated every "
                  "peer's shared memory mapped here) or sigterm (SIGUSR1 prints the faults)");
  flags.AddString("tls", &tls, "tcp, shm or a UCX_TLS list");
  flags.AddInt64("region-bytes", &region_bytes, "bytes to register");
  flags.AddString("listen-host", &listen_host, "control listener address");
  flags.AddInt32("listen-port", &listen_port, "control listener port (0: any)");
  flags.AddString("role", &role, "receiver");
  if (std::optional<int> exit_code = ParseCommandLine(flags, args)) return *exit_code;
  if (region_bytes <= 0) {
    std::fprintf(stderr, "transfer receiver: --region-bytes must be positive\n");
    return 2;
  }
  if (until != "stdin" && until != "sigterm") {
    std::fprintf(stderr, "transfer receiver: --until must be stdin or sigterm\n");
    return 2;
  }
  // Blocked before the transport starts its thread, so only sigwait() below sees SIGTERM.
  sigset_t term;
  sigemptyset(&term);
  sigaddset(&term, SIGTERM);
  sigaddset(&term, SIGINT);
  sigaddset(&term, SIGUSR1);
  if (until == "sigterm") pthread_sigmask(SIG_BLOCK, &term, nullptr);
  ::setenv("UCX_TLS", UcxTlsFor(tls).c_str(), 1);
  absl::StatusOr<TransportPtr> transport =
      MakeUcxTransport({.listen_host = listen_host, .listen_port = listen_port});
  if (!transport.ok()) {
    std::fprintf(stderr, "transfer receiver: %s\n", transport.status().ToString().c_str());
    return 1;
  }
  std::atomic<int64_t> events{0}, blocks{0}, ok{0}, bad{0}, bytes{0};
  (*transport)->SetInboundHandler([&](InboundEvent ev) {
    if (ev.kind != InboundEvent::Kind::kBlocks) return;
    events.fetch_add(1);
    for (const ReceivedBlock& b : ev.blocks) {
      blocks.fetch_add(1);
      if (b.status.ok()) {
        ok.fetch_add(1);
        bytes.fetch_add(static_cast<int64_t>(b.length));
      } else {
        bad.fetch_add(1);
      }
    }
  });
  absl::StatusOr<MemoryRegionPtr> region =
      (*transport)->AllocateMemory(static_cast<size_t>(region_bytes));
  if (!region.ok()) {
    std::fprintf(stderr, "transfer receiver: %s\n", region.status().ToString().c_str());
    return 1;
  }
  std::printf("READY %s %lu %zu\n", (*transport)->address().c_str(),
              static_cast<unsigned long>((*region)->id()), (*region)->size_bytes());
  std::fflush(stdout);
  // Page faults of this whole process since it started: the caller compares two readings
  // around a transfer (the region was populated before READY).
  auto print_faults = [] {
    const internal::PageFaults f = internal::ProcessPageFaults();
    std::printf("FAULTS minor=%ld major=%ld\n", static_cast<long>(f.minor),
                static_cast<long>(f.major));
    std::fflush(stdout);
  };
  // The sender's own regions are shared memory too, which this process maps and populates in
  // the background after the hello; a steady-state measurement waits for that.
  auto print_populated = [&transport] {
    const absl::Time start = absl::Now();
    uint64_t left = 0;
    do {
      left = 0;
      for (PeerId p : (*transport)->Peers()) {
        absl::StatusOr<PeerStatus> ps = (*transport)->GetPeerStatus(p);
        if (ps.ok()) left += ps->unpopulated_bytes;
      }
      if (left > 0) absl::SleepFor(absl::Milliseconds(5));
    } while (left > 0 && absl::Now() - start < absl::Minutes(10));
    std::printf("POPULATED seconds=%.3f unpopulated=%lu\n",
                absl::ToDoubleSeconds(absl::Now() - start), static_cast<unsigned long>(left));
    std::fflush(stdout);
  };
  if (until == "sigterm") {
    int sig = 0;
    while (sigwait(&term, &sig) == 0 && sig == SIGUSR1) print_faults();
  } else {
    std::string line;
    char c;
    while (::read(STDIN_FILENO, &c, 1) > 0) {
      if (c != '\n') {
        line.push_back(c);
        continue;
      }
      if (line == "faults") print_faults();
      if (line == "populated") print_populated();
      line.clear();
    }
  }
  std::printf("RECEIVED events=%ld blocks=%ld ok=%ld bad=%ld bytes=%ld\n", events.load(),
              blocks.load(), ok.load(), bad.load(), bytes.load());
  std::fflush(stdout);
  region->reset();
  transport->reset();
  return 0;
}

int RunTransferSender(const std::vector<std::string>& args) {
  FlagSet flags("transfer-bench --role=sender", "pushing peer that survives peer failures");
  std::string tls = "tcp";
  std::string connect;
  std::string role;
  int64_t block_bytes = 64 << 10;
  int32_t interval_ms = 100;
  int32_t duration_s = 60;
  int32_t heartbeat_ms = 200;
  int32_t peer_timeout_ms = 2000;
  flags.AddString("role", &role, "sender");
  flags.AddString("tls", &tls, "tcp, shm or a UCX_TLS list");
  flags.AddString("connect", &connect, "the receiver's address (host:port)");
  flags.AddInt64("block-bytes", &block_bytes, "bytes per push");
  flags.AddInt32("interval-ms", &interval_ms, "pause between pushes");
  flags.AddInt32("duration-s", &duration_s, "stop after this long");
  flags.AddInt32("heartbeat-ms", &heartbeat_ms, "transport heartbeat interval");
  flags.AddInt32("peer-timeout-ms", &peer_timeout_ms, "peer declared dead after this silence");
  if (std::optional<int> exit_code = ParseCommandLine(flags, args)) return *exit_code;
  if (connect.empty() || block_bytes <= 0 || interval_ms < 0 || duration_s <= 0) {
    std::fprintf(stderr,
                 "transfer sender: --connect is required; --block-bytes and --duration-s must "
                 "be positive\n");
    return 2;
  }
  ::setenv("UCX_TLS", UcxTlsFor(tls).c_str(), 1);
  absl::StatusOr<TransportPtr> transport =
      MakeUcxTransport({.heartbeat_interval = absl::Milliseconds(heartbeat_ms),
                        .peer_timeout = absl::Milliseconds(peer_timeout_ms)});
  if (!transport.ok()) {
    std::fprintf(stderr, "transfer sender: %s\n", transport.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<MemoryRegionPtr> local =
      (*transport)->AllocateMemory(static_cast<size_t>(block_bytes));
  if (!local.ok()) {
    std::fprintf(stderr, "transfer sender: %s\n", local.status().ToString().c_str());
    return 1;
  }
  FillRandom((*local)->data(), (*local)->size_bytes(), 11);
  auto report = [](const char* what, const absl::Status& st) {
    std::printf("FAIL %s %s %s\n", what, absl::StatusCodeToString(st.code()).c_str(),
                std::string(st.message()).c_str());
    std::fflush(stdout);
  };
  // What a prefill worker does per request: reuse the peer while it is alive (RemoteRegions
  // fails for a dead one), else connect again, which yields a fresh connection.
  PeerId peer = 0;
  const absl::Time stop = absl::Now() + absl::Seconds(duration_s);
  for (; absl::Now() < stop; absl::SleepFor(absl::Milliseconds(interval_ms))) {
    absl::StatusOr<std::vector<RemoteRegionInfo>> regions =
        peer != 0 ? (*transport)->RemoteRegions(peer)
                  : absl::StatusOr<std::vector<RemoteRegionInfo>>(absl::NotFoundError("none"));
    if (!regions.ok()) {
      absl::StatusOr<PeerId> p = (*transport)->Connect(connect, absl::Now() + absl::Seconds(1));
      if (!p.ok()) {
        report("connect", p.status());
        continue;
      }
      peer = *p;
      regions = (*transport)->RemoteRegions(peer);
      if (!regions.ok()) {
        report("regions", regions.status());
        continue;
      }
    }
    if (regions->empty() || regions->front().size_bytes < static_cast<uint64_t>(block_bytes)) {
      report("regions", absl::FailedPreconditionError("receiver has no region large enough"));
      continue;
    }
    TransferBatch batch{.peer = peer, .direction = Direction::kPut, .tag = 1};
    batch.blocks.push_back(BlockTransfer{.local = local->get(),
                                         .remote_region = regions->front().id,
                                         .length = static_cast<uint64_t>(block_bytes)});
    absl::StatusOr<TransferPlan> plan = (*transport)->Prepare(batch);
    if (!plan.ok()) {
      report("prepare", plan.status());
      continue;
    }
    absl::StatusOr<TransferHandlePtr> h =
        (*transport)->Post(*plan, LayerRange::All(), {absl::Now() + absl::Seconds(2)});
    absl::Status st = h.ok() ? (*h)->Wait(absl::Now() + absl::Seconds(3)) : h.status();
    if (!st.ok()) {
      report("put", st);
      continue;
    }
    absl::StatusOr<PeerStatus> ps = (*transport)->GetPeerStatus(peer);
    std::printf("OK peer=%lu incarnation=%016lx region=%lu\n", static_cast<unsigned long>(peer),
                static_cast<unsigned long>(ps.ok() ? ps->incarnation : 0),
                static_cast<unsigned long>(regions->front().id));
    std::fflush(stdout);
  }
  return 0;
}

namespace {

// The receiver child: stdin is a pipe we close to stop it; stdout a pipe we read.
struct Child {
  pid_t pid = -1;
  ScopedFd to_child;
  ScopedFd from_child;
  std::string buffered;

  absl::StatusOr<std::string> ReadLine(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      size_t nl = buffered.find('\n');
      if (nl != std::string::npos) {
        std::string line = buffered.substr(0, nl);
        buffered.erase(0, nl + 1);
        return line;
      }
      if (absl::Now() > deadline) return absl::DeadlineExceededError("receiver did not answer");
      char buf[4096];
      ssize_t n = ::read(from_child.get(), buf, sizeof(buf));
      if (n == 0) return absl::UnavailableError("receiver exited");
      if (n < 0) {
        if (errno == EAGAIN || errno == EINTR) {
          absl::SleepFor(absl::Milliseconds(2));
          continue;
        }
        return absl::InternalError("reading from the receiver failed");
      }
      buffered.append(buf, static_cast<size_t>(n));
    }
  }
};

absl::StatusOr<Child> SpawnReceiver(const std::string& tls, uint64_t region_bytes) {
  int in[2], out[2];
  if (::pipe2(in, O_CLOEXEC) != 0 || ::pipe2(out, O_CLOEXEC) != 0) {
    return absl::InternalError("pipe failed");
  }
  std::vector<std::string> argv = {"kvrelay", "transfer-bench", "--role=receiver",
                                   absl::StrCat("--tls=", tls),
                                   absl::StrCat("--region-bytes=", region_bytes)};
  pid_t pid = ::fork();
  if (pid < 0) return absl::InternalError("fork failed");
  if (pid == 0) {
    ::dup2(in[0], STDIN_FILENO);
    ::dup2(out[1], STDOUT_FILENO);
    std::vector<char*> cargv;
    for (std::string& a : argv) cargv.push_back(a.data());
    cargv.push_back(nullptr);
    ::execv("/proc/self/exe", cargv.data());
    _exit(127);
  }
  ::close(in[0]);
  ::close(out[1]);
  Child child;
  child.pid = pid;
  child.to_child.Reset(in[1]);
  child.from_child.Reset(out[0]);
  return child;
}

struct BenchConfig {
  std::string tls = "tcp";
  int64_t block_bytes = 256 << 10;
  int64_t blocks = 0;  // 0: one pass over every slot of the region
  int32_t inflight = 64;
  int32_t posts_inflight = 8;
  int32_t steady_passes = 3;
  int32_t layers = 0;
  std::string direction = "put";
  bool json = false;
  bool checksum = false;
  int64_t chunk_bytes = 1 << 20;
  int64_t max_inflight_bytes = 16 << 20;
  int64_t region_bytes = int64_t{1} << 30;
};

struct PassResult {
  double seconds = 0;
  int64_t bytes = 0;
  double p50_us = 0;
  double p99_us = 0;
  int64_t sender_minor_faults = 0;
};

struct BenchResult {
  PassResult cold;    // the first pass over every slot of a fresh region
  PassResult steady;  // the fastest measured pass (--blocks each)
  int64_t posts = 0;
  double memcpy_seconds = 0;
  int64_t receiver_minor_faults = -1;  // during the steady pass; -1 unknown
  uint64_t region_bytes = 0;
  double populate_seconds = 0;  // after Connect, until the peer's region was populated here
  // After the cold pass, until the receiver had populated its mapping of our region.
  double receiver_populate_seconds = -1;
  std::string receiver_report;
};

absl::StatusOr<BenchResult> RunBench(const BenchConfig& cfg) {
  const uint64_t B = static_cast<uint64_t>(cfg.block_bytes);
  const uint64_t slots = std::max<uint64_t>(1, static_cast<uint64_t>(cfg.region_bytes) / B);
  const uint64_t region = slots * B;
  ::setenv("UCX_TLS", UcxTlsFor(cfg.tls).c_str(), 1);
  KV_ASSIGN_OR_RETURN(Child child, SpawnReceiver(cfg.tls, region));
  absl::Cleanup reap = [&child] {
    child.to_child.Reset();
    int st = 0;
    for (int i = 0; i < 500 && ::waitpid(child.pid, &st, WNOHANG) == 0; ++i) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    if (::waitpid(child.pid, &st, WNOHANG) == 0) {
      ::kill(child.pid, SIGKILL);
      ::waitpid(child.pid, &st, 0);
    }
  };
  KV_ASSIGN_OR_RETURN(std::string ready, child.ReadLine(absl::Seconds(30)));
  std::vector<std::string> parts = absl::StrSplit(ready, ' ');
  uint64_t remote_region = 0;
  if (parts.size() != 4 || parts[0] != "READY" || !absl::SimpleAtoi(parts[2], &remote_region)) {
    return absl::InternalError(absl::StrCat("unexpected receiver output: ", ready));
  }
  UcxTransportOptions opts;
  opts.chunk_bytes = static_cast<uint64_t>(cfg.chunk_bytes);
  opts.max_inflight_ops = cfg.inflight;
  opts.max_inflight_bytes = static_cast<uint64_t>(cfg.max_inflight_bytes);
  KV_ASSIGN_OR_RETURN(TransportPtr transport, MakeUcxTransport(opts));
  KV_ASSIGN_OR_RETURN(MemoryRegionPtr local, transport->AllocateMemory(region));
  FillRandom(local->data(), region, 7);
  KV_ASSIGN_OR_RETURN(PeerId peer, transport->Connect(parts[1], absl::Now() + absl::Seconds(30)));

  // Blocks go round-robin over the region's slots; one Post carries `batch` blocks (a
  // "layer"); at most `posts_inflight` Posts await their acknowledgement, and the transport
  // keeps at most `inflight` UCX operations in flight (max_inflight_ops).
  const int64_t n = cfg.blocks > 0 ? cfg.blocks : static_cast<int64_t>(slots);
  int64_t batch =
      cfg.layers > 0 ? (n + cfg.layers - 1) / cfg.layers : std::max<int64_t>(1, cfg.inflight / 4);
  batch = std::min<int64_t>(batch, std::max<int64_t>(1, cfg.inflight));
  // Even slots, then odd ones: every slot once per pass of `slots` blocks.
  auto slot_of = [slots](int64_t i) -> uint64_t {
    if (slots < 2) return 0;
    const uint64_t u = static_cast<uint64_t>(i);
    return (u * 2 + (u * 2 / slots) % 2) % slots;
  };
  auto make_plan = [&](int64_t count) -> absl::StatusOr<TransferPlan> {
    TransferBatch tb;
    tb.peer = peer;
    tb.direction = cfg.direction == "get" ? Direction::kGet : Direction::kPut;
    tb.compute_checksums = cfg.checksum;
    tb.tag = 1;
    // Alternate slots so consecutive blocks are not contiguous (no coalescing: every block is
    // its own operation, like scattered pool slots).
    for (int64_t i = 0; i < count; ++i) {
      const uint64_t slot = slot_of(i);
      tb.blocks.push_back(BlockTransfer{.local = local.get(),
                                        .local_offset = slot * B,
                                        .remote_region = remote_region,
                                        .remote_offset = slot * B,
                                        .length = B,
                                        .layer = static_cast<int32_t>(i / batch)});
    }
    return transport->Prepare(tb);
  };
  auto run = [&](const TransferPlan& plan, int64_t count,
                 std::vector<double>* block_latency_us) -> absl::Status {
    struct Pending {
      TransferHandlePtr handle;
      absl::Time posted;
      int64_t blocks;
    };
    std::deque<Pending> pending;
    const int32_t num_posts = static_cast<int32_t>((count + batch - 1) / batch);
    auto retire = [&]() -> absl::Status {
      Pending& p = pending.front();
      KV_RETURN_IF_ERROR(p.handle->Wait(absl::Now() + absl::Seconds(60)));
      double us = absl::ToDoubleMicroseconds(absl::Now() - p.posted);
      if (block_latency_us != nullptr) {
        for (int64_t i = 0; i < p.blocks; ++i) block_latency_us->push_back(us);
      }
      pending.pop_front();
      return absl::OkStatus();
    };
    for (int32_t l = 0; l < num_posts; ++l) {
      const int64_t nb = std::min<int64_t>(batch, count - static_cast<int64_t>(l) * batch);
      while (!pending.empty() && static_cast<int64_t>(pending.size()) >= cfg.posts_inflight) {
        KV_RETURN_IF_ERROR(retire());
      }
      absl::Time t0 = absl::Now();
      KV_ASSIGN_OR_RETURN(TransferHandlePtr h, transport->Post(plan, LayerRange::One(l)));
      pending.push_back({std::move(h), t0, nb});
    }
    while (!pending.empty()) KV_RETURN_IF_ERROR(retire());
    return absl::OkStatus();
  };
  auto percentile = [](std::vector<double>& v, double p) {
    if (v.empty()) return 0.0;
    std::sort(v.begin(), v.end());
    size_t i = static_cast<size_t>(p * static_cast<double>(v.size() - 1) + 0.5);
    return v[std::min(i, v.size() - 1)];
  };
  auto timed_pass = [&](int64_t count, PassResult* out) -> absl::Status {
    KV_ASSIGN_OR_RETURN(TransferPlan plan, make_plan(count));
    std::vector<double> lat;
    lat.reserve(static_cast<size_t>(count));
    const internal::PageFaults f0 = internal::ProcessPageFaults();
    const absl::Time start = absl::Now();
    KV_RETURN_IF_ERROR(run(plan, count, &lat));
    out->seconds = absl::ToDoubleSeconds(absl::Now() - start);
    out->sender_minor_faults = internal::ProcessPageFaults().minor - f0.minor;
    out->bytes = count * cfg.block_bytes;
    out->p50_us = percentile(lat, 0.50);
    out->p99_us = percentile(lat, 0.99);
    return absl::OkStatus();
  };
  auto receiver_faults = [&child]() -> int64_t {
    if (::write(child.to_child.get(), "faults\n", 7) != 7) return -1;
    absl::StatusOr<std::string> line = child.ReadLine(absl::Seconds(30));
    int64_t minor = -1;
    if (!line.ok() || !absl::StartsWith(*line, "FAULTS minor=")) return -1;
    std::vector<std::string> parts = absl::StrSplit(*line, absl::ByAnyChar(" ="));
    if (parts.size() < 3 || !absl::SimpleAtoi(parts[2], &minor)) return -1;
    return minor;
  };
  BenchResult result;
  result.region_bytes = region;
  // The transport populates its mapping of the peer's region (shared memory) in the
  // background after connecting; a worker connects long before its first transfer, so wait.
  const absl::Time populate_start = absl::Now();
  while (true) {
    KV_ASSIGN_OR_RETURN(PeerStatus ps, transport->GetPeerStatus(peer));
    if (!ps.alive) return absl::UnavailableError("receiver went away");
    if (ps.unpopulated_bytes == 0) break;
    if (absl::Now() - populate_start > absl::Minutes(10)) {
      return absl::DeadlineExceededError("populating the receiver's region took over 10 min");
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  result.populate_seconds = absl::ToDoubleSeconds(absl::Now() - populate_start);
  // Cold: the first pass over every slot of the freshly created region, right after the
  // connection (includes endpoint wire-up and whatever populating is still under way).
  KV_RETURN_IF_ERROR(timed_pass(static_cast<int64_t>(slots), &result.cold));
  // The receiver maps our (published) region too and populates it in the background; in a
  // steady state that is long done. (Before this wait, its 8 MiB populate pieces stalled ACKs.)
  {
    if (::write(child.to_child.get(), "populated\n", 10) != 10) {
      return absl::InternalError("writing to the receiver failed");
    }
    KV_ASSIGN_OR_RETURN(std::string line, child.ReadLine(absl::Minutes(11)));
    std::vector<std::string> f = absl::StrSplit(line, absl::ByAnyChar(" ="));
    if (f.size() != 5 || f[0] != "POPULATED" || f[4] != "0" ||
        !absl::SimpleAtod(f[2], &result.receiver_populate_seconds)) {
      return absl::InternalError(absl::StrCat("receiver did not populate our region: ", line));
    }
  }
  // Steady: best of `steady_passes`, as the memcpy baseline below is best of three, so load
  // from other processes flatters neither side. Faults count over every pass.
  const int64_t rx0 = receiver_faults();
  int64_t sender_faults = 0;
  for (int32_t pass = 0; pass < cfg.steady_passes; ++pass) {
    PassResult r;
    KV_RETURN_IF_ERROR(timed_pass(n, &r));
    sender_faults += r.sender_minor_faults;
    if (pass == 0 || r.seconds < result.steady.seconds) result.steady = r;
  }
  result.steady.sender_minor_faults = sender_faults;
  const int64_t rx1 = receiver_faults();
  if (rx0 >= 0 && rx1 >= 0) result.receiver_minor_faults = rx1 - rx0;
  result.posts = (n + batch - 1) / batch;
  // Baseline from the same run: one thread memcpy'ing the same blocks, in the same order,
  // between two regions of the same size and kind (transport-allocated, populated), after a
  // cold pass like the transfer's, best of three: what a shared-memory put can at best do (it
  // is a memcpy into the peer's segment). The destination is private, so that the receiver
  // does not map and populate it meanwhile (that competed with the baseline for the CPU).
  {
    KV_ASSIGN_OR_RETURN(MemoryRegionPtr dst, transport->AllocatePrivateMemory(region));
    const uint8_t* src = local->data();
    auto copy = [&](int64_t count) {
      for (int64_t i = 0; i < count; ++i) {
        const size_t off = static_cast<size_t>(slot_of(i) * B);
        std::memcpy(dst->data() + off, src + off, B);
      }
    };
    copy(static_cast<int64_t>(slots));  // a cold pass, as the transfer had
    // Best of three, so that a descheduled baseline never flatters the ratio.
    result.memcpy_seconds = 1e300;
    for (int round = 0; round < 3; ++round) {
      const absl::Time m0 = absl::Now();
      copy(n);
      result.memcpy_seconds =
          std::min(result.memcpy_seconds, absl::ToDoubleSeconds(absl::Now() - m0));
    }
  }
  local.reset();
  transport.reset();
  child.to_child.Reset();  // receiver prints its tally and exits
  absl::StatusOr<std::string> report = child.ReadLine(absl::Seconds(30));
  if (report.ok()) result.receiver_report = *report;
  return result;
}

}  // namespace

int RunTransferBenchCommand(const std::vector<std::string>& args) {
  for (const std::string& a : args) {
    if (a == "--role=receiver") return RunTransferReceiver(args);
    if (a == "--role=sender") return RunTransferSender(args);
  }
  BenchConfig cfg;
  FlagSet flags("transfer-bench",
                "Moves blocks between this process and a receiver process it starts, over UCX "
                "on loopback; prints bandwidth and per-block latency.");
  flags.AddString("tls", &cfg.tls, "tcp or shm (posix,sysv,cma,self), or a UCX_TLS list");
  flags.AddInt64("block-bytes", &cfg.block_bytes, "bytes per block");
  flags.AddInt64("blocks", &cfg.blocks,
                 "blocks in the measured (steady) pass, after a cold pass over every slot; 0: "
                 "one block per slot of the region");
  flags.AddInt32("inflight", &cfg.inflight,
                 "UCX operations (blocks) in flight, at most, like ucx_perftest -O");
  flags.AddInt32("steady-passes", &cfg.steady_passes,
                 "steady passes; the fastest is reported (faults: all of them)");
  flags.AddInt32("posts-in-flight", &cfg.posts_inflight,
                 "Posts (layers) issued and not yet acknowledged by the receiver, at most");
  flags.AddInt32("layers", &cfg.layers,
                 "split the blocks into this many layer Posts (0: inflight/4 blocks per Post)");
  flags.AddString("direction", &cfg.direction, "put (push) or get (pull)");
  flags.AddBool("json", &cfg.json, "print one JSON object");
  flags.AddBool("checksum", &cfg.checksum, "send and verify per-block XXH3 checksums");
  flags.AddInt64("chunk-bytes", &cfg.chunk_bytes, "larger blocks are split into chunks");
  flags.AddInt64("max-inflight-bytes", &cfg.max_inflight_bytes, "UCX bytes in flight, at most");
  flags.AddInt64("region-bytes", &cfg.region_bytes,
                 "transport-allocated bytes on each side (a decode pool's size; default 1 GiB)");
  if (std::optional<int> exit_code = ParseCommandLine(flags, args)) return *exit_code;
  if (cfg.block_bytes <= 0 || cfg.blocks < 0 || cfg.inflight <= 0 || cfg.layers < 0 ||
      cfg.posts_inflight <= 0 || cfg.steady_passes <= 0 || cfg.chunk_bytes <= 0 ||
      cfg.max_inflight_bytes <= 0 || cfg.region_bytes < cfg.block_bytes) {
    std::fprintf(stderr,
                 "transfer-bench: --block-bytes, --inflight, --posts-in-flight, --steady-passes, "
                 "--chunk-bytes and "
                 "--max-inflight-bytes must be positive, --blocks and --layers >= 0, "
                 "--region-bytes >= "
                 "--block-bytes\n");
    return 2;
  }
  if (cfg.direction != "put" && cfg.direction != "get") {
    std::fprintf(stderr, "transfer-bench: --direction must be put or get, got '%s'\n",
                 cfg.direction.c_str());
    return 2;
  }
  absl::StatusOr<BenchResult> r = RunBench(cfg);
  if (!r.ok()) {
    std::fprintf(stderr, "transfer-bench: %s\n", r.status().ToString().c_str());
    return 1;
  }
  auto gbps_of = [](const PassResult& p) {
    return p.seconds > 0 ? static_cast<double>(p.bytes) / p.seconds / 1e9 : 0.0;
  };
  const double gbps = gbps_of(r->steady);
  const double cold_gbps = gbps_of(r->cold);
  const double memcpy_gbps =
      r->memcpy_seconds > 0 ? static_cast<double>(r->steady.bytes) / r->memcpy_seconds / 1e9 : 0;
  const double ratio = memcpy_gbps > 0 ? gbps / memcpy_gbps : 0.0;
  if (cfg.json) {
    std::printf(
        "{\"tls\":\"%s\",\"direction\":\"%s\",\"block_bytes\":%ld,\"blocks\":%ld,"
        "\"region_bytes\":%lu,\"inflight\":%d,\"posts\":%ld,\"checksum\":%s,\"seconds\":%.6f,"
        "\"bandwidth_gbps\":%.4f,\"p50_block_us\":%.1f,\"p99_block_us\":%.1f,"
        "\"memcpy_gbps\":%.4f,\"ratio_vs_memcpy\":%.4f,\"cold_gbps\":%.4f,"
        "\"cold_p50_block_us\":%.1f,\"cold_p99_block_us\":%.1f,\"sender_minor_faults\":%ld,"
        "\"cold_sender_minor_faults\":%ld,\"receiver_minor_faults\":%ld,"
        "\"populate_seconds\":%.3f,\"receiver_populate_seconds\":%.3f}\n",
        cfg.tls.c_str(), cfg.direction.c_str(), cfg.block_bytes, r->steady.bytes / cfg.block_bytes,
        static_cast<unsigned long>(r->region_bytes), cfg.inflight, r->posts,
        cfg.checksum ? "true" : "false", r->steady.seconds, gbps, r->steady.p50_us,
        r->steady.p99_us, memcpy_gbps, ratio, cold_gbps, r->cold.p50_us, r->cold.p99_us,
        static_cast<long>(r->steady.sender_minor_faults),
        static_cast<long>(r->cold.sender_minor_faults), static_cast<long>(r->receiver_minor_faults),
        r->populate_seconds, r->receiver_populate_seconds);
  } else {
    std::printf(
        "transfer-bench: %s %s, blocks of %ld bytes into a %.0f MiB region, %d in flight, %ld "
        "posts%s\n",
        cfg.tls.c_str(), cfg.direction.c_str(), cfg.block_bytes,
        static_cast<double>(r->region_bytes) / (1 << 20), cfg.inflight, r->posts,
        cfg.checksum ? ", checksums verified" : "");
    std::printf("  populate    %.3f s after connecting (the receiver's region, in this process)\n",
                r->populate_seconds);
    std::printf(
        "  cold pass   %.3f GB/s (%.1f MB in %.3f s), per block p50 %.1f us, p99 %.1f us, "
        "sender minor faults %ld\n",
        cold_gbps, static_cast<double>(r->cold.bytes) / 1e6, r->cold.seconds, r->cold.p50_us,
        r->cold.p99_us, static_cast<long>(r->cold.sender_minor_faults));
    std::printf(
        "  (receiver   populated its mapping of this process's region %.3f s after the cold "
        "pass)\n",
        r->receiver_populate_seconds);
    std::printf("  steady      %.3f GB/s (%.1f MB in %.3f s)\n", gbps,
                static_cast<double>(r->steady.bytes) / 1e6, r->steady.seconds);
    std::printf("  per block   p50 %.1f us, p99 %.1f us (Post to acknowledged completion)\n",
                r->steady.p50_us, r->steady.p99_us);
    std::printf(
        "  faults      sender %ld, receiver %ld minor page faults during the steady passes\n",
        static_cast<long>(r->steady.sender_minor_faults),
        static_cast<long>(r->receiver_minor_faults));
    std::printf(
        "  baseline    memcpy of the same blocks between two such regions in one process: "
        "%.3f GB/s (ratio %.3f)\n",
        memcpy_gbps, ratio);
    if (!r->receiver_report.empty()) std::printf("  receiver    %s\n", r->receiver_report.c_str());
  }
  return 0;
}

}  // namespace kvrelay::transfer::ucx::tools

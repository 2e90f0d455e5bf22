#include "transfer/ucx/ucx_transport.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "transfer/testing/transport_conformance.h"
#include "transfer/ucx/key_enforcement.h"
#include "transfer/ucx/ucx_handles.h"

namespace kvrelay::transfer {
namespace {

TransportFactory UcxFactory(std::string name, std::string tls) {
  return TransportFactory{
      std::move(name), {{"UCX_TLS", std::move(tls)}}, [] { return MakeUcxTransport(); }};
}

INSTANTIATE_TEST_SUITE_P(Ucx, TransportConformanceTest,
                         ::testing::Values(UcxFactory("tcp", "tcp"),
                                           UcxFactory("shm", "posix,sysv,cma,self")),
                         TransportFactoryName);

TEST(UcxTransportTest, ConnectErrorsAreClear) {
  testing::ScopedEnv tls("UCX_TLS", "tcp");
  KV_ASSERT_OK_AND_ASSIGN(TransportPtr t, MakeUcxTransport());
  EXPECT_THAT(t->Connect("127.0.0.1:notaport", absl::Now() + absl::Seconds(5)),
              testing::StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(t->Connect("127.0.0.1:0", absl::Now() + absl::Seconds(5)),
              testing::StatusIs(absl::StatusCode::kInvalidArgument));
  // Nobody listens on a port we just released.
  const int port = testing::PickUnusedPort();
  EXPECT_THAT(t->Connect(absl::StrCat("127.0.0.1:", port), absl::Now() + absl::Seconds(5)),
              testing::StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_THAT(MakeUcxTransport({.listen_host = "not-an-ip"}),
              testing::StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(MakeUcxTransport({.chunk_bytes = 0}),
              testing::StatusIs(absl::StatusCode::kInvalidArgument));
  Capabilities caps = t->capabilities();
  EXPECT_EQ(caps.name, "ucx");
  // What UCX itself answers for a context made the same way (false for Debian's UCX 1.13,
  // built without CUDA); without it, device memory is refused, never half-registered.
  KV_ASSERT_OK_AND_ASSIGN(ucx::UcpContextPtr context, ucx::CreateContext(64));
  KV_ASSERT_OK_AND_ASSIGN(bool ucx_moves_cuda, ucx::SupportsCudaMemory(context.get()));
  EXPECT_EQ(caps.device_memory, ucx_moves_cuda);
  if (!ucx_moves_cuda) {
    EXPECT_THAT(t->RegisterMemory(MemorySpan{&caps, 8}, MemoryKind::kDevice),
                testing::StatusIs(absl::StatusCode::kUnimplemented));
  }
}

// Issue 10's address options: hostnames, fixed ports, an advertised address distinct from the
// bind address, a wildcard bind never advertised, IPv6 literals.
TEST(UcxTransportTest, AddressOptions) {
  testing::ScopedEnv tls("UCX_TLS", "tcp");
  KV_ASSERT_OK_AND_ASSIGN(TransportPtr client, MakeUcxTransport());
  // A hostname to bind to and to advertise.
  KV_ASSERT_OK_AND_ASSIGN(TransportPtr named, MakeUcxTransport({.listen_host = "localhost"}));
  EXPECT_TRUE(absl::StartsWith(named->address(), "localhost:")) << named->address();
  KV_ASSERT_OK_AND_ASSIGN(PeerId p1,
                          client->Connect(named->address(), absl::Now() + absl::Seconds(10)));
  // A live connection to the same address is reused.
  KV_ASSERT_OK_AND_ASSIGN(PeerId p2,
                          client->Connect(named->address(), absl::Now() + absl::Seconds(10)));
  EXPECT_EQ(p1, p2);
  KV_ASSERT_OK_AND_ASSIGN(PeerStatus status, client->GetPeerStatus(p1));
  EXPECT_TRUE(status.alive);
  EXPECT_EQ(status.address, named->address());
  EXPECT_EQ(status.incarnation, named->incarnation());
  EXPECT_NE(client->incarnation(), named->incarnation());
  // A fixed port; taking it twice fails naming it.
  const int port = testing::PickUnusedPort();
  KV_ASSERT_OK_AND_ASSIGN(TransportPtr fixed, MakeUcxTransport({.listen_port = port}));
  EXPECT_EQ(fixed->address(), absl::StrCat("127.0.0.1:", port));
  EXPECT_THAT(MakeUcxTransport({.listen_port = port}),
              testing::StatusIs(absl::StatusCode::kFailedPrecondition,
                                ::testing::HasSubstr(absl::StrCat(port))));
  EXPECT_THAT(MakeUcxTransport({.listen_port = 70000}),
              testing::StatusIs(absl::StatusCode::kInvalidArgument));
  // An advertised address distinct from the bind address (NAT, Kubernetes Services).
  KV_ASSERT_OK_AND_ASSIGN(
      TransportPtr advertised,
      MakeUcxTransport({.advertise_host = "decode-0.kvrelay.svc", .advertise_port = 7000}));
  EXPECT_EQ(advertised->address(), "decode-0.kvrelay.svc:7000");
  EXPECT_THAT(MakeUcxTransport({.advertise_host = "0.0.0.0"}),
              testing::StatusIs(absl::StatusCode::kInvalidArgument));
  // Bound to every interface: never advertises the wildcard, and is reachable on loopback.
  absl::StatusOr<TransportPtr> any = MakeUcxTransport({.listen_host = "0.0.0.0"});
  if (any.ok()) {
    const std::string a = (*any)->address();
    EXPECT_FALSE(absl::StartsWith(a, "0.0.0.0")) << a;
    KV_ASSERT_OK(client
                     ->Connect(absl::StrCat("127.0.0.1", a.substr(a.rfind(':'))),
                               absl::Now() + absl::Seconds(10))
                     .status());
  } else {
    // Only on a host with no address but loopback: refused, saying why.
    EXPECT_THAT(any, testing::StatusIs(absl::StatusCode::kFailedPrecondition));
  }
  // IPv6 literals, where the host has IPv6 loopback.
  absl::StatusOr<TransportPtr> v6 = MakeUcxTransport({.listen_host = "::1"});
  if (v6.ok()) {
    EXPECT_TRUE(absl::StartsWith((*v6)->address(), "[::1]:")) << (*v6)->address();
    KV_EXPECT_OK(client->Connect((*v6)->address(), absl::Now() + absl::Seconds(10)).status());
  }
  EXPECT_THAT(client->Connect("::1:80", absl::Now() + absl::Seconds(5)),
              testing::StatusIs(absl::StatusCode::kInvalidArgument));  // unbracketed IPv6
  EXPECT_THAT(client->Connect("no-such-host.invalid:80", absl::Now() + absl::Seconds(5)),
              testing::StatusIs(absl::StatusCode::kUnavailable));
}

TEST(UcxTransportTest, ANonPeerOnTheControlPortIsRejectedWithoutHarm) {
  testing::ScopedEnv tls("UCX_TLS", "tcp");
  KV_ASSERT_OK_AND_ASSIGN(TransportPtr server, MakeUcxTransport());
  // A plain TCP client that sends garbage.
  KV_ASSERT_OK_AND_ASSIGN(TransportPtr client, MakeUcxTransport());
  {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_GE(fd, 0);
    sockaddr_in addr = {};
    addr.sin_family = AF_INET;
    std::string a = server->address();
    addr.sin_port = htons(static_cast<uint16_t>(std::stoi(a.substr(a.rfind(':') + 1))));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    const char junk[] = "\x10\x00\x00\x00\x01garbage-garbage";
    ASSERT_GT(::write(fd, junk, sizeof(junk)), 0);
    char buf[16];
    // The server closes the connection on the bad hello.
    EXPECT_LE(::read(fd, buf, sizeof(buf)), 0);
    ::close(fd);
  }
  // And keeps serving real peers.
  KV_ASSERT_OK_AND_ASSIGN(PeerId p,
                          client->Connect(server->address(), absl::Now() + absl::Seconds(10)));
  EXPECT_THAT(client->Peers(), ::testing::ElementsAre(p));
}

// Memory keys handed out per use (issue 13): a private region is in no hello and no region
// frame; a peer reaches it only through its exported key, only inside it, and not once it is
// released (the receiver's DONE check refuses it; on RDMA the NIC would refuse the write).
TEST(UcxTransportTest, PrivateRegionsAreReachableOnlyThroughTheirExportedKey) {
  for (const char* tls : {"tcp", "posix,sysv,cma,self"}) {
    SCOPED_TRACE(tls);
    testing::ScopedEnv env("UCX_TLS", tls);
    InboundQueue inbound;  // outlives the transports
    KV_ASSERT_OK_AND_ASSIGN(TransportPtr receiver, MakeUcxTransport());
    KV_ASSERT_OK_AND_ASSIGN(TransportPtr sender, MakeUcxTransport());
    EXPECT_TRUE(receiver->capabilities().private_regions);
    EXPECT_FALSE(receiver->capabilities().hardware_enforced_keys);  // no RDMA device here
    receiver->SetInboundHandler(inbound.Handler());
    constexpr size_t kPool = 1 << 20, kSlot = 64 << 10;
    KV_ASSERT_OK_AND_ASSIGN(MemoryRegionPtr pool, receiver->AllocatePrivateMemory(kPool));
    KV_ASSERT_OK_AND_ASSIGN(MemoryRegionPtr slot,
                            receiver->RegisterPrivateMemory(
                                MemorySpan{pool->data() + 2 * kSlot, kSlot}, MemoryKind::kHost));
    KV_ASSERT_OK_AND_ASSIGN(std::string key, receiver->ExportRegion(*slot));
    KV_ASSERT_OK_AND_ASSIGN(MemoryRegionPtr published, receiver->AllocateMemory(kSlot));
    EXPECT_THAT(receiver->ExportRegion(*published),
                testing::StatusIs(absl::StatusCode::kInvalidArgument));

    KV_ASSERT_OK_AND_ASSIGN(PeerId peer,
                            sender->Connect(receiver->address(), absl::Now() + absl::Seconds(10)));
    KV_ASSERT_OK_AND_ASSIGN(std::vector<RemoteRegionInfo> visible, sender->RemoteRegions(peer));
    ASSERT_EQ(visible.size(), 1u);  // the published region only
    EXPECT_EQ(visible[0].id, published->id());
    std::vector<uint8_t> source(kSlot, 0xab);
    KV_ASSERT_OK_AND_ASSIGN(
        MemoryRegionPtr local,
        sender->RegisterMemory(MemorySpan{source.data(), source.size()}, MemoryKind::kHost));
    auto put = [&](RegionId region, uint64_t offset, uint64_t length) {
      TransferBatch batch{.peer = peer, .direction = Direction::kPut, .tag = 7};
      batch.blocks.push_back({.local = local.get(),
                              .remote_region = region,
                              .remote_offset = offset,
                              .length = length});
      return sender->Prepare(batch);
    };
    // Not imported yet: the sender has no key for it.
    EXPECT_THAT(put(slot->id(), 0, 4096), testing::StatusIs(absl::StatusCode::kNotFound));
    EXPECT_THAT(sender->ImportRegion(peer, "garbage"),
                testing::StatusIs(absl::StatusCode::kInvalidArgument));
    std::string other_process = key;
    other_process[5] ^= 1;  // the incarnation's first byte
    EXPECT_THAT(sender->ImportRegion(peer, other_process),
                testing::StatusIs(absl::StatusCode::kFailedPrecondition));
    KV_ASSERT_OK_AND_ASSIGN(RegionId imported, sender->ImportRegion(peer, key));
    EXPECT_EQ(imported, slot->id());
    // Only inside the registered slot.
    EXPECT_THAT(put(imported, kSlot - 100, 4096),
                testing::StatusIs(absl::StatusCode::kInvalidArgument));
    KV_ASSERT_OK_AND_ASSIGN(TransferPlan plan, put(imported, 0, kSlot));
    KV_ASSERT_OK_AND_ASSIGN(TransferHandlePtr h, sender->Post(plan, LayerRange::All()));
    KV_ASSERT_OK(h->Wait(absl::Now() + absl::Seconds(20)));
    KV_ASSERT_OK_AND_ASSIGN(InboundEvent got, inbound.NextOfKind(InboundEvent::Kind::kBlocks,
                                                                 absl::Now() + absl::Seconds(10)));
    KV_EXPECT_OK(got.status);
    EXPECT_EQ(pool->data()[2 * kSlot], 0xab);
    EXPECT_EQ(pool->data()[3 * kSlot - 1], 0xab);
    EXPECT_EQ(pool->data()[2 * kSlot - 1], 0);  // the slot before is untouched

    // Released (ucp_mem_unmap): the stale key's put is refused. tcp and cma apply the bytes
    // before anything can check the key (the pool's memory is still there), so what refuses
    // it is the receiver's DONE check: its handler hears of no block in that region.
    slot.reset();
    std::fill(source.begin(), source.end(), 0xcd);
    KV_ASSERT_OK_AND_ASSIGN(TransferPlan stale, put(imported, 0, kSlot));
    KV_ASSERT_OK_AND_ASSIGN(TransferHandlePtr late, sender->Post(stale, LayerRange::All()));
    EXPECT_FALSE(late->Wait(absl::Now() + absl::Seconds(20)).ok());
    absl::StatusOr<InboundEvent> refused =
        inbound.NextOfKind(InboundEvent::Kind::kBlocks, absl::Now() + absl::Seconds(5));
    if (refused.ok()) {
      EXPECT_FALSE(refused->status.ok());
      ASSERT_EQ(refused->blocks.size(), 1u);
      EXPECT_THAT(refused->blocks[0].status,
                  testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                    ::testing::HasSubstr("no local region")));
    }
    RecordProperty(absl::StrCat("stale_put_bytes_landed_", tls[0] == 't' ? "tcp" : "shm"),
                   pool->data()[2 * kSlot] == 0xcd ? "yes" : "no");
    KV_EXPECT_OK(sender->ForgetRegion(peer, imported));
    EXPECT_THAT(sender->ForgetRegion(peer, imported),
                testing::StatusIs(absl::StatusCode::kNotFound));
  }
}

TEST(KeyEnforcementTest, OnlyAnRdmaDeviceThatUcxTlsAdmitsEnforcesKeys) {
  using ucx::HardwareEnforcedKeys;
  const std::vector<ucx::UctComponent> here = ucx::QueryUctComponents();
  EXPECT_FALSE(here.empty());  // tcp, posix, sysv, cma, self at least
  const std::vector<ucx::UctComponent> rdma = {{"tcp", 1}, {"ib", 2}, {"posix", 1}};
  const std::vector<ucx::UctComponent> no_device = {{"tcp", 1}, {"ib", 0}, {"cma", 1}};
  EXPECT_TRUE(HardwareEnforcedKeys(rdma, ""));
  EXPECT_TRUE(HardwareEnforcedKeys(rdma, "all"));
  EXPECT_TRUE(HardwareEnforcedKeys(rdma, "rc_x,sm,self"));
  EXPECT_TRUE(HardwareEnforcedKeys(rdma, "dc_mlx5"));
  EXPECT_TRUE(HardwareEnforcedKeys(rdma, "^tcp"));
  EXPECT_TRUE(HardwareEnforcedKeys(rdma, "^rc,dc"));  // ud is still allowed
  EXPECT_FALSE(HardwareEnforcedKeys(rdma, "tcp"));
  EXPECT_FALSE(HardwareEnforcedKeys(rdma, "posix,sysv,cma,self"));
  EXPECT_FALSE(HardwareEnforcedKeys(rdma, "^ib"));
  EXPECT_FALSE(HardwareEnforcedKeys(rdma, "^rc,dc,ud_x"));
  EXPECT_FALSE(HardwareEnforcedKeys(rdma, "rcx"));
  EXPECT_FALSE(HardwareEnforcedKeys(no_device, ""));
  EXPECT_FALSE(HardwareEnforcedKeys({}, ""));
}

double ProcessCpuSeconds() {
  rusage u = {};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + 1e-6 * (u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

// An idle connected pair sleeps in poll() on the worker's event fd: it must not spin. (A busy
// progress loop would burn about one core per transport, i.e. ~2 s of CPU in this 1 s window.)
TEST(UcxTransportTest, IdleConnectedPairUsesAlmostNoCpu) {
  for (const char* tls : {"tcp", "posix,sysv,cma,self"}) {
    testing::ScopedEnv env("UCX_TLS", tls);
    KV_ASSERT_OK_AND_ASSIGN(TransportPtr a, MakeUcxTransport());
    KV_ASSERT_OK_AND_ASSIGN(TransportPtr b, MakeUcxTransport());
    KV_ASSERT_OK_AND_ASSIGN(PeerId p, a->Connect(b->address(), absl::Now() + absl::Seconds(10)));
    (void)p;
    absl::SleepFor(absl::Milliseconds(100));
    const double before = ProcessCpuSeconds();
    absl::SleepFor(absl::Seconds(1));
    const double used = ProcessCpuSeconds() - before;
    RecordProperty(absl::StrCat("idle_cpu_seconds_", tls[0] == 't' ? "tcp" : "shm"),
                   std::to_string(used));
    EXPECT_LT(used, 0.25) << tls;
    EXPECT_EQ(a->Peers().size(), 1u);  // heartbeats kept the pair alive
    EXPECT_EQ(b->Peers().size(), 1u);
  }
}

// Thread ids of this process (/proc/self/task).
std::set<int> ThreadIds() {
  std::set<int> ids;
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return ids;
  while (dirent* e = readdir(dir)) {
    int id = 0;
    if (absl::SimpleAtoi(e->d_name, &id)) ids.insert(id);
  }
  closedir(dir);
  return ids;
}

// CPU seconds (user + system) of these threads of this process, from /proc/self/task/T/stat.
double ThreadsCpuSeconds(const std::set<int>& ids) {
  const double tick = static_cast<double>(sysconf(_SC_CLK_TCK));
  double total = 0;
  for (int id : ids) {
    std::ifstream f(absl::StrCat("/proc/self/task/", id, "/stat"));
    std::string stat((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    const size_t close = stat.rfind(')');  // the thread name may hold spaces
    if (close == std::string::npos) continue;
    std::istringstream rest(stat.substr(close + 2));
    std::string field;
    double utime = 0, stime = 0;
    // After the name: state is field 3; utime and stime are fields 14 and 15.
    for (int i = 3; i <= 15 && rest >> field; ++i) {
      if (i == 14) utime = std::stod(field);
      if (i == 15) stime = std::stod(field);
    }
    total += (utime + stime) / tick;
  }
  return total;
}

// A stream of control frames (what a receiver of shared-memory puts sees: DONE frames, no UCX
// work of its own) must not keep the receiving progress thread spinning between frames. One
// frame per millisecond for 1 s, CPU of the threads the receiving transport started: 0.18-0.21 s
// while it spun 200 us after every frame, 0.01 s woken per frame (10 ms clock ticks).
TEST(UcxTransportTest, ControlFramesDoNotKeepTheProgressThreadSpinning) {
  for (const char* tls : {"tcp", "posix,sysv,cma,self"}) {
    testing::ScopedEnv env("UCX_TLS", tls);
    KV_ASSERT_OK_AND_ASSIGN(TransportPtr a, MakeUcxTransport());
    const std::set<int> before_b = ThreadIds();
    KV_ASSERT_OK_AND_ASSIGN(TransportPtr b, MakeUcxTransport());
    std::set<int> b_threads;
    for (int id : ThreadIds()) {
      if (before_b.count(id) == 0) b_threads.insert(id);
    }
    ASSERT_FALSE(b_threads.empty());
    std::atomic<int> received{0};
    b->SetInboundHandler([&received](InboundEvent ev) {
      if (ev.kind == InboundEvent::Kind::kControl) received.fetch_add(1);
    });
    KV_ASSERT_OK_AND_ASSIGN(PeerId p, a->Connect(b->address(), absl::Now() + absl::Seconds(10)));
    absl::SleepFor(absl::Milliseconds(100));
    const double before = ThreadsCpuSeconds(b_threads);
    const absl::Time start = absl::Now();
    int sent = 0;
    for (absl::Time next = start; absl::Now() < start + absl::Seconds(1);
         next += absl::Milliseconds(1)) {
      KV_ASSERT_OK(a->SendControl(p, 1, "x"));
      ++sent;
      absl::SleepFor(next + absl::Milliseconds(1) - absl::Now());
    }
    const double wall = absl::ToDoubleSeconds(absl::Now() - start);
    const double used = ThreadsCpuSeconds(b_threads) - before;
    const absl::Time wait_until = absl::Now() + absl::Seconds(10);
    while (received.load() < sent && absl::Now() < wait_until) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    EXPECT_EQ(received.load(), sent) << tls;
    const std::string name = tls[0] == 't' ? "tcp" : "shm";
    RecordProperty(absl::StrCat("receiver_cpu_seconds_", name), std::to_string(used));
    RecordProperty(absl::StrCat("control_frames_", name), std::to_string(sent));
    EXPECT_LT(used, 0.08 * wall) << tls << ": " << sent << " frames, " << b_threads.size()
                                 << " receiver threads";
  }
}

// Frames of one loop turn share one send(); a Disconnect right after SendControl must still
// deliver the messages, in order, before the peer hears of the disconnect (the BYE goes behind
// the queued frames, never among them).
TEST(UcxTransportTest, ControlSentJustBeforeDisconnectArrivesBeforeThePeerDown) {
  for (const char* tls : {"tcp", "posix,sysv,cma,self"}) {
    testing::ScopedEnv env("UCX_TLS", tls);
    KV_ASSERT_OK_AND_ASSIGN(TransportPtr a, MakeUcxTransport());
    KV_ASSERT_OK_AND_ASSIGN(TransportPtr b, MakeUcxTransport());
    InboundQueue inbound;
    b->SetInboundHandler(inbound.Handler());
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    KV_ASSERT_OK_AND_ASSIGN(PeerId p, a->Connect(b->address(), deadline));
    for (int i = 0; i < 3; ++i) KV_ASSERT_OK(a->SendControl(p, 40 + i, absl::StrCat("m", i)));
    KV_ASSERT_OK(a->Disconnect(p));
    for (int i = 0; i < 3; ++i) {
      KV_ASSERT_OK_AND_ASSIGN(InboundEvent ev, inbound.Next(deadline));
      ASSERT_EQ(ev.kind, InboundEvent::Kind::kControl) << tls << ", event " << i;
      EXPECT_EQ(ev.tag, static_cast<uint64_t>(40 + i));
      EXPECT_EQ(ev.message, absl::StrCat("m", i));
    }
    KV_ASSERT_OK_AND_ASSIGN(InboundEvent down, inbound.Next(deadline));
    EXPECT_EQ(down.kind, InboundEvent::Kind::kPeerDown) << tls;
  }
}

}  // namespace
}  // namespace kvrelay::transfer

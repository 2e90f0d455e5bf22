#include "transfer/ucx/ucx_transport.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "transfer/testing/transport_conformance.h"

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
  EXPECT_FALSE(caps.device_memory);  // Debian's UCX 1.13 has no CUDA module
  EXPECT_THAT(t->RegisterMemory(MemorySpan{&caps, 8}, MemoryKind::kDevice),
              testing::StatusIs(absl::StatusCode::kUnimplemented));
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

}  // namespace
}  // namespace kvrelay::transfer

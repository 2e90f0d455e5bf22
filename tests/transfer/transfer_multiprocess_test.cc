// Two real processes move blocks over UCX (tcp and shared memory): the test process sends,
// kvrelay_transfer_peer receives (registering one region and counting verified blocks).

#include <signal.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kv/checksum.h"
#include "tests/testing/process_harness.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"
#include "transfer/transport.h"
#include "transfer/ucx/ucx_transport.h"

namespace kvrelay::transfer {
namespace {

using testing::ChildProcess;

struct AlignedBuffer {
  explicit AlignedBuffer(size_t n) : size(n) {
    data = static_cast<uint8_t*>(std::aligned_alloc(4096, (n + 4095) / 4096 * 4096));
  }
  ~AlignedBuffer() { std::free(data); }
  uint8_t* data;
  size_t size;
};

void FillRandom(uint8_t* p, size_t n, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i + 8 <= n; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(p + i, &x, 8);
  }
}

struct Receiver {
  std::unique_ptr<ChildProcess> process;
  std::string address;
  RegionId region = 0;
  uint64_t region_bytes = 0;
};

absl::StatusOr<Receiver> StartReceiver(const std::string& tls, uint64_t region_bytes,
                                       int listen_port = 0) {
  Receiver r;
  auto child = ChildProcess::Start(
      {testing::BinaryPath("kvrelay_transfer_peer"), "transfer-bench", "--role=receiver",
       "--until=sigterm", absl::StrCat("--tls=", tls),
       absl::StrCat("--region-bytes=", region_bytes), absl::StrCat("--listen-port=", listen_port)});
  if (!child.ok()) return child.status();
  r.process = std::move(*child);
  absl::StatusOr<std::string> line = r.process->WaitForOutput("READY", absl::Seconds(60));
  if (!line.ok()) return line.status();
  std::vector<std::string> parts = absl::StrSplit(*line, ' ');
  if (parts.size() != 4 || !absl::SimpleAtoi(parts[2], &r.region) ||
      !absl::SimpleAtoi(parts[3], &r.region_bytes)) {
    return absl::InternalError(absl::StrCat("bad READY line: ", *line));
  }
  r.address = parts[1];
  return r;
}

// The receiver's minor page faults so far (SIGUSR1 makes it print "FAULTS minor=N major=M").
absl::StatusOr<int64_t> ReceiverMinorFaults(Receiver& r) {
  auto count_lines = [&r] {
    const std::string out = r.process->Stdout();
    size_t n = 0;
    for (size_t at = out.find("FAULTS "); at != std::string::npos;
         at = out.find("FAULTS ", at + 1)) {
      ++n;
    }
    return n;
  };
  const size_t before = count_lines();
  r.process->Signal(SIGUSR1);
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (count_lines() == before) {
    if (absl::Now() > deadline) return absl::DeadlineExceededError("receiver printed no FAULTS");
    absl::SleepFor(absl::Milliseconds(5));
  }
  const std::string out = r.process->Stdout();
  const size_t at = out.rfind("FAULTS minor=");
  const size_t end = out.find(' ', at + 13);
  int64_t minor = 0;
  if (end == std::string::npos || !absl::SimpleAtoi(out.substr(at + 13, end - at - 13), &minor)) {
    return absl::InternalError(absl::StrCat("bad FAULTS line in: ", out.substr(at)));
  }
  return minor;
}

// Stops the receiver (SIGTERM) and returns its "RECEIVED ..." tally line.
absl::StatusOr<std::string> StopReceiver(Receiver& r) {
  r.process->Signal(SIGTERM);
  absl::StatusOr<std::string> line = r.process->WaitForOutput("RECEIVED", absl::Seconds(60));
  if (!line.ok()) return line.status();
  absl::StatusOr<int> code = r.process->Wait(absl::Seconds(60));
  if (!code.ok()) return code.status();
  if (*code != 0) return absl::InternalError(absl::StrCat("receiver exited with ", *code));
  return *line;
}

class MultiProcessTransferTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    tls_ = std::make_unique<testing::ScopedEnv>(
        "UCX_TLS", GetParam() == "tcp" ? "tcp" : "posix,sysv,cma,self");
    auto t = MakeUcxTransport();
    ASSERT_TRUE(t.ok()) << t.status();
    transport_ = std::move(*t);
    transport_->SetInboundHandler(events_.Handler());
  }
  void TearDown() override {
    transport_.reset();
    tls_.reset();
  }
  std::unique_ptr<testing::ScopedEnv> tls_;
  TransportPtr transport_;
  InboundQueue events_;
};

// 1 GiB of random blocks of mixed sizes (4 KiB - 2 MiB), pushed layer by layer into the
// receiver's region (which verifies every checksum), then pulled back into zeroed memory with
// the expected checksums.
TEST_P(MultiProcessTransferTest, OneGibOfMixedBlocksPushAndPullWithVerifiedChecksums) {
  constexpr uint64_t kTotal = 1ull << 30;
  std::mt19937_64 rng(20261129);
  std::uniform_int_distribution<uint64_t> size_dist(4096, 2 << 20);
  std::vector<uint64_t> sizes;
  uint64_t sum = 0;
  while (sum < kTotal) {
    uint64_t s = std::min(size_dist(rng), kTotal - sum);
    sizes.push_back(s);
    sum += s;
  }
  KV_ASSERT_OK_AND_ASSIGN(Receiver rx, StartReceiver(GetParam(), kTotal));
  AlignedBuffer local(kTotal);
  ASSERT_NE(local.data, nullptr);
  FillRandom(local.data, kTotal, 5);
  KV_ASSERT_OK_AND_ASSIGN(MemoryRegionPtr region,
                          transport_->RegisterMemory({local.data, kTotal}, MemoryKind::kHost));
  KV_ASSERT_OK_AND_ASSIGN(PeerId peer,
                          transport_->Connect(rx.address, absl::Now() + absl::Seconds(30)));
  // Remote placement is a permutation of the local one, so blocks do not coalesce.
  std::vector<size_t> order(sizes.size());
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<uint64_t> local_off(sizes.size()), remote_off(sizes.size());
  for (size_t i = 0, off = 0; i < sizes.size(); off += sizes[i], ++i) local_off[i] = off;
  for (size_t k = 0, off = 0; k < order.size(); off += sizes[order[k]], ++k) {
    remote_off[order[k]] = off;
  }
  constexpr int kLayers = 16;
  std::vector<uint64_t> checksums(sizes.size());
  TransferBatch push{.peer = peer, .direction = Direction::kPut, .tag = 1};
  for (size_t i = 0; i < sizes.size(); ++i) {
    checksums[i] = kv::BlockChecksum(local.data + local_off[i], sizes[i]);
    push.blocks.push_back(BlockTransfer{.local = region.get(),
                                        .local_offset = local_off[i],
                                        .remote_region = rx.region,
                                        .remote_offset = remote_off[i],
                                        .length = sizes[i],
                                        .layer = static_cast<int32_t>(i * kLayers / sizes.size())});
  }
  KV_ASSERT_OK_AND_ASSIGN(TransferPlan push_plan, transport_->Prepare(push));
  std::vector<TransferHandlePtr> handles;
  for (int l = 0; l < kLayers; ++l) {
    KV_ASSERT_OK_AND_ASSIGN(TransferHandlePtr h, transport_->Post(push_plan, LayerRange::One(l)));
    handles.push_back(std::move(h));
  }
  size_t verified = 0;
  for (auto& h : handles) {
    KV_ASSERT_OK(h->Wait(absl::Now() + absl::Seconds(120)));
    for (const absl::Status& s : h->block_statuses()) {
      KV_EXPECT_OK(s);
      verified += s.ok();
    }
  }
  EXPECT_EQ(verified, sizes.size());

  // Pull everything back into zeroed memory; each block is checked against its checksum.
  std::memset(local.data, 0, kTotal);
  TransferBatch pull = push;
  pull.direction = Direction::kGet;
  for (size_t i = 0; i < sizes.size(); ++i) pull.blocks[i].checksum = checksums[i];
  KV_ASSERT_OK_AND_ASSIGN(TransferPlan pull_plan, transport_->Prepare(pull));
  handles.clear();
  for (int l = 0; l < kLayers; ++l) {
    KV_ASSERT_OK_AND_ASSIGN(TransferHandlePtr h, transport_->Post(pull_plan, LayerRange::One(l)));
    handles.push_back(std::move(h));
  }
  for (auto& h : handles) KV_ASSERT_OK(h->Wait(absl::Now() + absl::Seconds(120)));
  size_t matched = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    matched += kv::BlockChecksum(local.data + local_off[i], sizes[i]) == checksums[i];
  }
  EXPECT_EQ(matched, sizes.size());

  region.reset();
  KV_ASSERT_OK_AND_ASSIGN(std::string tally, StopReceiver(rx));
  EXPECT_THAT(tally, ::testing::HasSubstr(
                         absl::StrCat("blocks=", sizes.size(), " ok=", sizes.size(), " bad=0")));
  EXPECT_THAT(tally, ::testing::HasSubstr(absl::StrCat("bytes=", kTotal)));
  RecordProperty("blocks", std::to_string(sizes.size()));
}

// kill -9 of the receiver while transfers are in flight: every handle ends (Unavailable, or OK
// for ones acknowledged before) before its deadline, and the sender serves another peer.
TEST_P(MultiProcessTransferTest, KilledReceiverFailsHandlesAndSenderServesAnotherPeer) {
  constexpr uint64_t kRegion = 256 << 20;
  constexpr uint64_t kBlock = 4 << 20;
  KV_ASSERT_OK_AND_ASSIGN(Receiver victim, StartReceiver(GetParam(), kRegion));
  AlignedBuffer local(kRegion);
  ASSERT_NE(local.data, nullptr);
  FillRandom(local.data, kRegion, 9);
  KV_ASSERT_OK_AND_ASSIGN(MemoryRegionPtr region,
                          transport_->RegisterMemory({local.data, kRegion}, MemoryKind::kHost));
  KV_ASSERT_OK_AND_ASSIGN(PeerId peer,
                          transport_->Connect(victim.address, absl::Now() + absl::Seconds(30)));
  auto plan_for = [&](PeerId p, RegionId remote) {
    TransferBatch b{.peer = p, .direction = Direction::kPut, .tag = 3};
    for (uint64_t i = 0; i < kRegion / kBlock; ++i) {
      b.blocks.push_back(BlockTransfer{.local = region.get(),
                                       .local_offset = i * kBlock,
                                       .remote_region = remote,
                                       .remote_offset = ((i * 7) % (kRegion / kBlock)) * kBlock,
                                       .length = kBlock,
                                       .layer = static_cast<int32_t>(i / 4)});
    }
    return transport_->Prepare(b);
  };
  KV_ASSERT_OK_AND_ASSIGN(TransferPlan plan, plan_for(peer, victim.region));
  const int layers = static_cast<int>(kRegion / kBlock / 4);
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  std::vector<TransferHandlePtr> handles;
  KV_ASSERT_OK_AND_ASSIGN(TransferHandlePtr first,
                          transport_->Post(plan, LayerRange::One(0), {deadline}));
  KV_ASSERT_OK(first->Wait(deadline));  // the pair really works before the kill
  // Freeze the receiver so nothing more is acknowledged, keep posting, then kill it.
  victim.process->Signal(SIGSTOP);
  for (int l = 1; l < layers; ++l) {
    KV_ASSERT_OK_AND_ASSIGN(TransferHandlePtr h,
                            transport_->Post(plan, LayerRange::One(l), {deadline}));
    handles.push_back(std::move(h));
  }
  victim.process->Signal(SIGKILL);
  int unavailable = 0;
  for (auto& h : handles) {
    absl::Status s = h->Wait(deadline);
    EXPECT_TRUE(s.ok() || absl::IsUnavailable(s)) << s;  // never DeadlineExceeded: no hang
    unavailable += absl::IsUnavailable(s);
  }
  EXPECT_GT(unavailable, 0);
  KV_ASSERT_OK_AND_ASSIGN(InboundEvent down,
                          events_.NextOfKind(InboundEvent::Kind::kPeerDown, deadline));
  EXPECT_EQ(down.peer, peer);
  EXPECT_THAT(down.status, testing::StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_THAT(transport_->Post(plan, LayerRange::One(1)),
              testing::StatusIs(absl::StatusCode::kUnavailable));

  // The same sender keeps serving a new peer.
  KV_ASSERT_OK_AND_ASSIGN(Receiver next, StartReceiver(GetParam(), kRegion));
  KV_ASSERT_OK_AND_ASSIGN(PeerId peer2,
                          transport_->Connect(next.address, absl::Now() + absl::Seconds(30)));
  KV_ASSERT_OK_AND_ASSIGN(TransferPlan plan2, plan_for(peer2, next.region));
  KV_ASSERT_OK_AND_ASSIGN(TransferHandlePtr h2, transport_->Post(plan2, LayerRange::All()));
  absl::Status h2_status = h2->Wait(absl::Now() + absl::Seconds(60));
  if (!h2_status.ok()) {
    absl::StatusOr<int> code = next.process->Wait(absl::Seconds(10));
    ADD_FAILURE() << "receiver: " << (code.ok() ? std::to_string(*code) : code.status().ToString())
                  << " stdout: " << next.process->Stdout() << " stderr: " << next.process->Stderr();
  }
  KV_ASSERT_OK(h2_status);
  region.reset();
  KV_ASSERT_OK_AND_ASSIGN(std::string tally, StopReceiver(next));
  const uint64_t n = kRegion / kBlock;
  EXPECT_THAT(tally, ::testing::HasSubstr(absl::StrCat("blocks=", n, " ok=", n, " bad=0")));
}

// Issue 19: a transfer into a freshly created large region takes no page faults on the
// receiver: the region is populated when created (AllocateMemory), so the pushes that write
// every page of it, the receiver's checksum verification that reads every page, and its
// bookkeeping fault nothing in (the sender's mapping of a shared-memory region is populated by
// the sender's transport after connecting; that is checked by transfer-bench's fault counts).
TEST_P(MultiProcessTransferTest, FreshLargeRegionTakesNoPageFaultsOnTheReceiver) {
  constexpr uint64_t kRegion = 512 << 20;
  constexpr uint64_t kBlock = 2 << 20;
  KV_ASSERT_OK_AND_ASSIGN(Receiver rx, StartReceiver(GetParam(), kRegion));
  KV_ASSERT_OK_AND_ASSIGN(MemoryRegionPtr local, transport_->AllocateMemory(kRegion));
  FillRandom(local->data(), kRegion, 9);
  KV_ASSERT_OK_AND_ASSIGN(PeerId peer,
                          transport_->Connect(rx.address, absl::Now() + absl::Seconds(30)));
  TransferBatch push{.peer = peer, .direction = Direction::kPut, .tag = 3};
  constexpr int kLayers = 8;
  const uint64_t n = kRegion / kBlock;
  for (uint64_t i = 0; i < n; ++i) {
    // Every other slot, then the rest: nothing coalesces, every page is written once.
    const uint64_t slot = (i * 2) % n + (i * 2 / n);
    push.blocks.push_back(BlockTransfer{.local = local.get(),
                                        .local_offset = slot * kBlock,
                                        .remote_region = rx.region,
                                        .remote_offset = slot * kBlock,
                                        .length = kBlock,
                                        .layer = static_cast<int32_t>(i * kLayers / n)});
  }
  KV_ASSERT_OK_AND_ASSIGN(TransferPlan plan, transport_->Prepare(push));
  // As a worker does long before its first request: let the sender's transport populate its
  // mapping of the receiver's segment (shared memory), and wire up the endpoint with one
  // block, so that the UCX buffers of the connection exist before counting.
  const absl::Time populate_deadline = absl::Now() + absl::Seconds(120);
  while (transport_->GetPeerStatus(peer)->unpopulated_bytes > 0 &&
         absl::Now() < populate_deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  {
    TransferBatch one{.peer = peer, .direction = Direction::kPut, .tag = 2};
    one.blocks.push_back(push.blocks.front());
    KV_ASSERT_OK_AND_ASSIGN(TransferPlan warm, transport_->Prepare(one));
    KV_ASSERT_OK_AND_ASSIGN(TransferHandlePtr h, transport_->Post(warm, LayerRange::All()));
    KV_ASSERT_OK(h->Wait(absl::Now() + absl::Seconds(60)));
  }
  // The receiver, too, maps and populates what its peers publish (here the sender's 512 MiB
  // region, over shared memory) in the background after connecting; that is not the transfer.
  KV_ASSERT_OK_AND_ASSIGN(int64_t faults_before, ReceiverMinorFaults(rx));
  for (int stable = 0; stable < 3 && absl::Now() < populate_deadline;) {
    absl::SleepFor(absl::Milliseconds(200));
    KV_ASSERT_OK_AND_ASSIGN(int64_t now, ReceiverMinorFaults(rx));
    stable = now == faults_before ? stable + 1 : 0;
    faults_before = now;
  }
  std::vector<TransferHandlePtr> handles;
  for (int l = 0; l < kLayers; ++l) {
    KV_ASSERT_OK_AND_ASSIGN(TransferHandlePtr h, transport_->Post(plan, LayerRange::One(l)));
    handles.push_back(std::move(h));
  }
  for (auto& h : handles) KV_ASSERT_OK(h->Wait(absl::Now() + absl::Seconds(120)));
  KV_ASSERT_OK_AND_ASSIGN(int64_t faults_after, ReceiverMinorFaults(rx));
  const int64_t pages = static_cast<int64_t>(kRegion / 4096);
  // Zero in practice; a few allow for the allocator growing the heap for event bookkeeping.
  // Under ASan its shadow memory and allocator take first-touch faults of their own (~50 here):
  // still none per page of the 131072 written, which is what this checks.
#if defined(__SANITIZE_ADDRESS__)
  constexpr int64_t kAllowedFaults = 256;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
  constexpr int64_t kAllowedFaults = 256;
#else
  constexpr int64_t kAllowedFaults = 16;
#endif
#else
  constexpr int64_t kAllowedFaults = 16;
#endif
  EXPECT_LE(faults_after - faults_before, kAllowedFaults)
      << "receiver took " << (faults_after - faults_before) << " minor faults while " << pages
      << " pages of its region were written and verified";
  RecordProperty("receiver_minor_faults", std::to_string(faults_after - faults_before));
  local.reset();
  KV_ASSERT_OK_AND_ASSIGN(std::string tally, StopReceiver(rx));
  EXPECT_THAT(tally, ::testing::HasSubstr(absl::StrCat("blocks=", n + 1, " ok=", n + 1, " bad=0")));
}

// Issue 10: a receiver killed and restarted on the same port is a new incarnation; the
// sender's old connection is reported dead (RemoteRegions, GetPeerStatus, Post), Connect to
// the same address yields a new working connection, and nothing of the old incarnation (its
// region ids) is usable on the new one.
TEST_P(MultiProcessTransferTest, RestartedReceiverOnTheSamePortIsReconnected) {
  constexpr uint64_t kRegion = 16 << 20;
  constexpr uint64_t kBlock = 1 << 20;
  const int port = testing::PickUnusedPort();
  KV_ASSERT_OK_AND_ASSIGN(Receiver first, StartReceiver(GetParam(), kRegion, port));
  KV_ASSERT_OK_AND_ASSIGN(MemoryRegionPtr local, transport_->AllocateMemory(kBlock));
  FillRandom(local->data(), kBlock, 3);
  auto push = [&](PeerId peer, RegionId region) -> absl::Status {
    TransferBatch b{.peer = peer, .direction = Direction::kPut, .tag = 9};
    b.blocks.push_back(BlockTransfer{
        .local = local.get(), .remote_region = region, .remote_offset = kBlock, .length = kBlock});
    KV_ASSIGN_OR_RETURN(TransferPlan plan, transport_->Prepare(b));
    KV_ASSIGN_OR_RETURN(TransferHandlePtr h, transport_->Post(plan, LayerRange::All(),
                                                              {absl::Now() + absl::Seconds(30)}));
    return h->Wait(absl::Now() + absl::Seconds(30));
  };
  KV_ASSERT_OK_AND_ASSIGN(PeerId old_peer,
                          transport_->Connect(first.address, absl::Now() + absl::Seconds(30)));
  KV_ASSERT_OK(push(old_peer, first.region));
  // While it lives, Connect to the same address reuses the connection.
  KV_ASSERT_OK_AND_ASSIGN(PeerId same,
                          transport_->Connect(first.address, absl::Now() + absl::Seconds(30)));
  EXPECT_EQ(same, old_peer);
  KV_ASSERT_OK_AND_ASSIGN(PeerStatus old_status, transport_->GetPeerStatus(old_peer));
  EXPECT_TRUE(old_status.alive);
  EXPECT_NE(old_status.incarnation, 0u);

  first.process->Signal(SIGKILL);
  ASSERT_TRUE(first.process->Wait(absl::Seconds(30)).ok());
  // Process death closes the control socket: reported at once, well within the heartbeat
  // timeout (2 s).
  const absl::Time killed = absl::Now();
  while (transport_->GetPeerStatus(old_peer)->alive && absl::Now() - killed < absl::Seconds(10)) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  KV_ASSERT_OK_AND_ASSIGN(PeerStatus dead, transport_->GetPeerStatus(old_peer));
  EXPECT_FALSE(dead.alive);
  EXPECT_LT(absl::Now() - killed, absl::Seconds(3));
  EXPECT_THAT(dead.down_reason, testing::StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_THAT(transport_->RemoteRegions(old_peer),
              testing::StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_THAT(push(old_peer, first.region), testing::StatusIs(absl::StatusCode::kUnavailable));

  KV_ASSERT_OK_AND_ASSIGN(Receiver second, StartReceiver(GetParam(), kRegion, port));
  EXPECT_EQ(second.address, first.address);
  KV_ASSERT_OK_AND_ASSIGN(PeerId new_peer,
                          transport_->Connect(second.address, absl::Now() + absl::Seconds(30)));
  EXPECT_NE(new_peer, old_peer);
  KV_ASSERT_OK_AND_ASSIGN(PeerStatus fresh, transport_->GetPeerStatus(new_peer));
  EXPECT_TRUE(fresh.alive);
  EXPECT_NE(fresh.incarnation, old_status.incarnation);
  // Region ids start at a random point per process: the old incarnation's id names nothing.
  EXPECT_NE(second.region, first.region);
  EXPECT_THAT(push(new_peer, first.region), testing::StatusIs(absl::StatusCode::kNotFound));
  KV_ASSERT_OK(push(new_peer, second.region));
  local.reset();
  KV_ASSERT_OK_AND_ASSIGN(std::string tally, StopReceiver(second));
  EXPECT_THAT(tally, ::testing::HasSubstr("blocks=1 ok=1 bad=0"));
}

// Issue 10: a receiver that stops answering (SIGSTOP: its socket stays open, so only the
// heartbeat can tell) is reported dead within the heartbeat timeout; once it runs again the
// same process (same incarnation) is reached through a fresh connection.
TEST_P(MultiProcessTransferTest, SilentReceiverIsReportedDeadAndReachedAgain) {
  KV_ASSERT_OK_AND_ASSIGN(TransportPtr sender,
                          MakeUcxTransport({.heartbeat_interval = absl::Milliseconds(100),
                                            .peer_timeout = absl::Milliseconds(1000)}));
  KV_ASSERT_OK_AND_ASSIGN(Receiver rx, StartReceiver(GetParam(), 4 << 20));
  KV_ASSERT_OK_AND_ASSIGN(MemoryRegionPtr local, sender->AllocateMemory(64 << 10));
  auto push = [&](PeerId peer) -> absl::Status {
    TransferBatch b{.peer = peer, .direction = Direction::kPut, .tag = 4};
    b.blocks.push_back(
        BlockTransfer{.local = local.get(), .remote_region = rx.region, .length = 64 << 10});
    KV_ASSIGN_OR_RETURN(TransferPlan plan, sender->Prepare(b));
    KV_ASSIGN_OR_RETURN(TransferHandlePtr h,
                        sender->Post(plan, LayerRange::All(), {absl::Now() + absl::Seconds(20)}));
    return h->Wait(absl::Now() + absl::Seconds(20));
  };
  KV_ASSERT_OK_AND_ASSIGN(PeerId first,
                          sender->Connect(rx.address, absl::Now() + absl::Seconds(30)));
  KV_ASSERT_OK(push(first));
  KV_ASSERT_OK_AND_ASSIGN(PeerStatus before, sender->GetPeerStatus(first));
  rx.process->Signal(SIGSTOP);
  const absl::Time stopped = absl::Now();
  while (sender->GetPeerStatus(first)->alive && absl::Now() - stopped < absl::Seconds(10)) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  const absl::Duration detected = absl::Now() - stopped;
  KV_ASSERT_OK_AND_ASSIGN(PeerStatus dead, sender->GetPeerStatus(first));
  EXPECT_FALSE(dead.alive);
  // 1 s timeout, checked every 25 ms; generous slack for a loaded machine.
  EXPECT_LT(detected, absl::Seconds(3));
  EXPECT_THAT(dead.down_reason, testing::StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_THAT(sender->RemoteRegions(first), testing::StatusIs(absl::StatusCode::kUnavailable));
  rx.process->Signal(SIGCONT);
  KV_ASSERT_OK_AND_ASSIGN(PeerId again,
                          sender->Connect(rx.address, absl::Now() + absl::Seconds(30)));
  EXPECT_NE(again, first);
  KV_ASSERT_OK_AND_ASSIGN(PeerStatus after, sender->GetPeerStatus(again));
  EXPECT_EQ(after.incarnation, before.incarnation);
  KV_ASSERT_OK(push(again));
  RecordProperty("detected_ms", std::to_string(absl::ToInt64Milliseconds(detected)));
  local.reset();
  sender.reset();
  KV_ASSERT_OK_AND_ASSIGN(std::string tally, StopReceiver(rx));
  EXPECT_THAT(tally, ::testing::HasSubstr("bad=0"));
}

// A pull from a peer that stops (SIGSTOP) after its request went out: UCX over tcp emulates
// the GET with messages, and the paused peer answers it when it runs again, naming our request
// by its address. The handle must not end while that answer can still land (its end tells the
// owner the destination is free to reuse: a KV slot); it ends once the answer has landed, and
// nothing is written into the destination after that. A peer killed while paused can never
// answer: its pulls end once UCX finds its connection refused (here, within milliseconds) or
// a new process takes its address, whichever comes first. (Shared memory pulls complete in
// place, with no message to answer.)
TEST_P(MultiProcessTransferTest, APausedPeersLateReplyNeverLandsAfterThePullEnded) {
  if (GetParam() != "tcp") GTEST_SKIP() << "shared-memory pulls complete in place";
  constexpr uint64_t kRegion = 4 << 20;
  constexpr uint64_t kPull = 1 << 20;
  KV_ASSERT_OK_AND_ASSIGN(TransportPtr puller,
                          MakeUcxTransport({.heartbeat_interval = absl::Milliseconds(100),
                                            .peer_timeout = absl::Milliseconds(1000)}));
  const int port = testing::PickUnusedPort();
  KV_ASSERT_OK_AND_ASSIGN(Receiver rx, StartReceiver(GetParam(), kRegion, port));
  KV_ASSERT_OK_AND_ASSIGN(MemoryRegionPtr source, puller->AllocateMemory(kPull));
  FillRandom(source->data(), kPull, 11);
  AlignedBuffer dest(kPull);
  ASSERT_NE(dest.data, nullptr);
  std::memset(dest.data, 0, kPull);
  KV_ASSERT_OK_AND_ASSIGN(MemoryRegionPtr dest_region,
                          puller->RegisterMemory({dest.data, kPull}, MemoryKind::kHost));
  auto post = [&](PeerId peer, RegionId remote, Direction direction,
                  const MemoryRegion* local) -> absl::StatusOr<TransferHandlePtr> {
    TransferBatch b{.peer = peer, .direction = direction, .tag = 7};
    b.blocks.push_back(BlockTransfer{.local = local, .remote_region = remote, .length = kPull});
    KV_ASSIGN_OR_RETURN(TransferPlan plan, puller->Prepare(b));
    return puller->Post(plan, LayerRange::All(), {absl::Now() + absl::Seconds(60)});
  };
  auto wait_down = [&](PeerId peer) {
    const absl::Time start = absl::Now();
    while (puller->GetPeerStatus(peer)->alive && absl::Now() - start < absl::Seconds(10)) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    return !puller->GetPeerStatus(peer)->alive;
  };

  KV_ASSERT_OK_AND_ASSIGN(PeerId peer,
                          puller->Connect(rx.address, absl::Now() + absl::Seconds(30)));
  // The peer's region gets bytes of ours (non-zero), and one pull works end to end.
  KV_ASSERT_OK_AND_ASSIGN(TransferHandlePtr pushed,
                          post(peer, rx.region, Direction::kPut, source.get()));
  KV_ASSERT_OK(pushed->Wait(absl::Now() + absl::Seconds(30)));
  KV_ASSERT_OK_AND_ASSIGN(TransferHandlePtr pulled,
                          post(peer, rx.region, Direction::kGet, dest_region.get()));
  KV_ASSERT_OK(pulled->Wait(absl::Now() + absl::Seconds(30)));
  ASSERT_EQ(std::memcmp(dest.data, source->data(), kPull), 0);
  std::memset(dest.data, 0, kPull);

  // Paused before it sees the request: it answers only after SIGCONT.
  rx.process->Signal(SIGSTOP);
  KV_ASSERT_OK_AND_ASSIGN(TransferHandlePtr late,
                          post(peer, rx.region, Direction::kGet, dest_region.get()));
  ASSERT_TRUE(wait_down(peer));
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_FALSE(late->Poll().has_value())
      << "the pull ended while the paused peer could still answer it: " << *late->Poll();
  rx.process->Signal(SIGCONT);
  EXPECT_THAT(late->Wait(absl::Now() + absl::Seconds(20)),
              testing::StatusIs(absl::StatusCode::kUnavailable));
  // Ended: the destination is ours again. Nothing may land in it any more.
  std::memset(dest.data, 0xEE, kPull);
  absl::SleepFor(absl::Seconds(1));
  const size_t overwritten = static_cast<size_t>(
      std::count_if(dest.data, dest.data + kPull, [](uint8_t b) { return b != 0xEE; }));
  EXPECT_EQ(overwritten, 0u) << "bytes written into the destination after the pull ended";

  // Paused again with a pull out, then killed: it never answers, and the pull ends.
  KV_ASSERT_OK_AND_ASSIGN(PeerId again,
                          puller->Connect(rx.address, absl::Now() + absl::Seconds(30)));
  rx.process->Signal(SIGSTOP);
  KV_ASSERT_OK_AND_ASSIGN(TransferHandlePtr orphan,
                          post(again, rx.region, Direction::kGet, dest_region.get()));
  ASSERT_TRUE(wait_down(again));
  rx.process->Signal(SIGKILL);
  ASSERT_TRUE(rx.process->Wait(absl::Seconds(30)).ok());
  KV_ASSERT_OK_AND_ASSIGN(Receiver next, StartReceiver(GetParam(), kRegion, port));
  KV_ASSERT_OK_AND_ASSIGN(PeerId fresh,
                          puller->Connect(next.address, absl::Now() + absl::Seconds(30)));
  EXPECT_NE(fresh, again);
  EXPECT_THAT(orphan->Wait(absl::Now() + absl::Seconds(10)),
              testing::StatusIs(absl::StatusCode::kUnavailable));
  // The new process serves pulls as usual.
  KV_ASSERT_OK_AND_ASSIGN(TransferHandlePtr served,
                          post(fresh, next.region, Direction::kGet, dest_region.get()));
  KV_EXPECT_OK(served->Wait(absl::Now() + absl::Seconds(30)));
  served.reset();
  orphan.reset();
  late.reset();
  dest_region.reset();
  source.reset();
  puller.reset();
  KV_ASSERT_OK_AND_ASSIGN(std::string tally, StopReceiver(next));
  EXPECT_THAT(tally, ::testing::HasSubstr("bad=0"));
}

INSTANTIATE_TEST_SUITE_P(Ucx, MultiProcessTransferTest, ::testing::Values("tcp", "shm"),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace
}  // namespace kvrelay::transfer

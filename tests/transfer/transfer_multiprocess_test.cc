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

absl::StatusOr<Receiver> StartReceiver(const std::string& tls, uint64_t region_bytes) {
  Receiver r;
  auto child =
      ChildProcess::Start({testing::BinaryPath("kvrelay_transfer_peer"), "transfer-bench",
                           "--role=receiver", "--until=sigterm", absl::StrCat("--tls=", tls),
                           absl::StrCat("--region-bytes=", region_bytes)});
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

INSTANTIATE_TEST_SUITE_P(Ucx, MultiProcessTransferTest, ::testing::Values("tcp", "shm"),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace
}  // namespace kvrelay::transfer

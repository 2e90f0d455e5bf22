#pragma once

// One conformance suite for every Transport implementation. An implementation's test file
// instantiates it with factories:
//
//   INSTANTIATE_TEST_SUITE_P(InProcess, TransportConformanceTest,
//       ::testing::Values(TransportFactory{"inproc", {}, [] { return MakeInProcessTransport(); }}),
//       TransportFactoryName);
//
// Each test builds two transports from the factory (a sender `a_` and a receiver `b_`, with
// the factory's environment, e.g. UCX_TLS, set while they exist), connects a_ to b_, and
// registers one region on each side. Everything here goes through the Transport interface.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kv/checksum.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"
#include "transfer/faulty_transport.h"
#include "transfer/transport.h"

namespace kvrelay::transfer {

struct TransportFactory {
  std::string name;
  std::map<std::string, std::string> env;  // set while the transports exist
  std::function<absl::StatusOr<TransportPtr>()> make;
};

inline void PrintTo(const TransportFactory& f, std::ostream* os) { *os << f.name; }

inline std::string TransportFactoryName(const ::testing::TestParamInfo<TransportFactory>& info) {
  return info.param.name;
}

// Page-aligned host buffer, filled with deterministic pseudo-random bytes.
class TestBuffer {
 public:
  explicit TestBuffer(size_t bytes)
      : bytes_(bytes), data_(new (std::align_val_t(4096)) uint8_t[bytes]) {}
  ~TestBuffer() { operator delete[](data_, std::align_val_t(4096)); }
  uint8_t* data() { return data_; }
  size_t size() const { return bytes_; }
  MemorySpan span() { return {data_, bytes_}; }
  void Fill(uint64_t seed) {
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
    for (size_t i = 0; i + 8 <= bytes_; i += 8) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      std::memcpy(data_ + i, &x, 8);
    }
    for (size_t i = bytes_ & ~size_t{7}; i < bytes_; ++i) data_[i] = static_cast<uint8_t>(i);
  }
  void Zero() { std::memset(data_, 0, bytes_); }

 private:
  size_t bytes_;
  uint8_t* data_;
};

class TransportConformanceTest : public ::testing::TestWithParam<TransportFactory> {
 protected:
  static constexpr size_t kRegionBytes = 64 << 20;

  void SetUp() override {
    for (const auto& [k, v] : GetParam().env) {
      env_.push_back(std::make_unique<testing::ScopedEnv>(k, v));
    }
    auto a = GetParam().make();
    ASSERT_TRUE(a.ok()) << a.status();
    auto b = GetParam().make();
    ASSERT_TRUE(b.ok()) << b.status();
    a_ = std::make_unique<FaultyTransport>(std::move(*a));
    b_ = std::move(*b);
    b_->SetInboundHandler(inbound_.Handler());
    a_->SetInboundHandler(a_inbound_.Handler());
    a_buf_ = std::make_unique<TestBuffer>(kRegionBytes);
    b_buf_ = std::make_unique<TestBuffer>(kRegionBytes);
    a_buf_->Fill(1);
    b_buf_->Zero();
    auto ra = a_->RegisterMemory(a_buf_->span(), MemoryKind::kHost);
    ASSERT_TRUE(ra.ok()) << ra.status();
    a_region_ = std::move(*ra);
    auto rb = b_->RegisterMemory(b_buf_->span(), MemoryKind::kHost);
    ASSERT_TRUE(rb.ok()) << rb.status();
    b_region_ = std::move(*rb);
    auto peer = a_->Connect(b_->address(), Deadline());
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = *peer;
  }

  void TearDown() override {
    a_region_.reset();
    b_region_.reset();
    a_.reset();
    b_.reset();
    env_.clear();
  }

  static absl::Time Deadline() { return absl::Now() + absl::Seconds(30); }

  BlockTransfer Block(uint64_t a_off, uint64_t b_off, uint64_t len, int32_t layer = 0) {
    return BlockTransfer{.local = a_region_.get(),
                         .local_offset = a_off,
                         .remote_region = b_region_->id(),
                         .remote_offset = b_off,
                         .length = len,
                         .layer = layer};
  }
  TransferBatch Batch(Direction d, std::vector<BlockTransfer> blocks, uint64_t tag = 7) {
    return TransferBatch{.peer = peer_, .direction = d, .tag = tag, .blocks = std::move(blocks)};
  }
  bool Same(uint64_t a_off, uint64_t b_off, uint64_t len) {
    return std::memcmp(a_buf_->data() + a_off, b_buf_->data() + b_off, len) == 0;
  }

  std::vector<std::unique_ptr<testing::ScopedEnv>> env_;
  std::unique_ptr<FaultyTransport> a_;
  TransportPtr b_;
  InboundQueue inbound_;
  InboundQueue a_inbound_;
  std::unique_ptr<TestBuffer> a_buf_, b_buf_;
  MemoryRegionPtr a_region_, b_region_;
  PeerId peer_ = 0;
};

using testing::IsOk;
using testing::StatusIs;

TEST_P(TransportConformanceTest, PutDeliversBytesAndVerifiedChecksums) {
  // Mixed sizes, some adjacent (coalesced), some not.
  std::vector<BlockTransfer> blocks = {Block(0, 4096, 4096), Block(4096, 8192, 4096),
                                       Block(1 << 20, 3 << 20, 2 << 20),
                                       Block(9 << 20, 12 << 20, 777)};
  KV_ASSERT_OK_AND_ASSIGN(TransferPlan plan, a_->Prepare(Batch(Direction::kPut, blocks, 42)));
  KV_ASSERT_OK_AND_ASSIGN(TransferHandlePtr h, a_->Post(plan, LayerRange::All()));
  KV_ASSERT_OK(h->Wait(Deadline()));
  for (const absl::Status& s : h->block_statuses()) KV_EXPECT_OK(s);
  for (const BlockTransfer& b : blocks) {
    EXPECT_TRUE(Same(b.local_offset, b.remote_offset, b.length)) << b.local_offset;
  }
  KV_ASSERT_OK_AND_ASSIGN(InboundEvent ev,
                          inbound_.NextOfKind(InboundEvent::Kind::kBlocks, Deadline()));
  EXPECT_EQ(ev.tag, 42u);
  KV_EXPECT_OK(ev.status);
  ASSERT_EQ(ev.blocks.size(), blocks.size());
  for (size_t i = 0; i < blocks.size(); ++i) {
    KV_EXPECT_OK(ev.blocks[i].status);
    EXPECT_EQ(ev.blocks[i].region, b_region_->id());
    EXPECT_EQ(ev.blocks[i].offset, blocks[i].remote_offset);
    ASSERT_TRUE(ev.blocks[i].checksum.has_value());
    EXPECT_EQ(*ev.blocks[i].checksum,
              kv::BlockChecksum(a_buf_->data() + blocks[i].local_offset, blocks[i].length));
  }
}

TEST_P(TransportConformanceTest, PutCarriesItsCredentialToTheReceiver) {
  TransferBatch batch = Batch(Direction::kPut, {Block(0, 0, 4096)}, 9);
  batch.credential = std::string("\x00token\xff", 7);
  KV_ASSERT_OK_AND_ASSIGN(TransferPlan plan, a_->Prepare(batch));
  KV_ASSERT_OK_AND_ASSIGN(TransferHandlePtr h, a_->Post(plan, LayerRange::All()));
  KV_ASSERT_OK(h->Wait(Deadline()));
  KV_ASSERT_OK_AND_ASSIGN(InboundEvent ev,
                          inbound_.NextOfKind(InboundEvent::Kind::kBlocks, Deadline()));
  EXPECT_EQ(ev.credential, batch.credential);
  batch.credential.assign(kMaxCredentialBytes + 1, 'x');
  EXPECT_THAT(a_->Prepare(batch), StatusIs(absl::StatusCode::kInvalidArgument));
}

// A transport with an accept key tells a peer without it nothing: Connect is refused with
// PermissionDenied, and the refused peer sees none of its regions.
TEST_P(TransportConformanceTest, AcceptKeyRefusesPeersWithoutIt) {
  auto guarded = GetParam().make();
  ASSERT_TRUE(guarded.ok()) << guarded.status();
  (*guarded)->SetAcceptKey("the-data-plane-key");
  auto client = GetParam().make();
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_THAT((*client)->Connect((*guarded)->address(), Deadline()),
              StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT((*client)->Connect((*guarded)->address(), Deadline(), {.peer_key = "the-data-plane"}),
              StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_TRUE((*client)->Peers().empty());
  KV_ASSERT_OK_AND_ASSIGN(PeerId p, (*client)->Connect((*guarded)->address(), Deadline(),
                                                       {.peer_key = "the-data-plane-key"}));
  KV_EXPECT_OK((*client)->RemoteRegions(p).status());
}

TEST_P(TransportConformanceTest, GetReadsRemoteBytesAndVerifiesExpectedChecksums) {
  b_buf_->Fill(99);
  std::vector<BlockTransfer> blocks = {Block(0, 0, 65536), Block(1 << 20, 5 << 20, 3 << 20)};
  for (BlockTransfer& b : blocks) {
    b.checksum = kv::BlockChecksum(b_buf_->data() + b.remote_offset, b.length);
  }
  KV_ASSERT_OK_AND_ASSIGN(TransferPlan plan, a_->Prepare(Batch(Direction::kGet, blocks)));
  KV_ASSERT_OK_AND_ASSIGN(TransferHandlePtr h, a_->Post(plan, LayerRange::All()));
  KV_ASSERT_OK(h->Wait(Deadline()));
  for (const BlockTransfer& b : blocks) {
    EXPECT_TRUE(Same(b.local_offset, b.remote_offset, b.length));
  }
  // A wrong expected checksum fails that block with DataLoss.
  blocks[1].checksum = *blocks[1].checksum + 1;
  KV_ASSERT_OK_AND_ASSIGN(TransferPlan bad, a_->Prepare(Batch(Direction::kGet, blocks)));
  KV_ASSERT_OK_AND_ASSIGN(TransferHandlePtr h2, a_->Post(bad, LayerRange::All()));
  EXPECT_THAT(h2->Wait(Deadline()), StatusIs(absl::StatusCode::kDataLoss));
  std::vector<absl::Status> st = h2->block_statuses();
  ASSERT_EQ(st.size(), 2u);
  KV_EXPECT_OK(st[0]);
  EXPECT_THAT(st[1], StatusIs(absl::StatusCode::kDataLoss));
}

TEST_P(TransportConformanceTest, TransportAllocatedRegionsWorkBothWays) {
  // The receiver's region comes from the transport (UCX: a shared-memory segment).
  KV_ASSERT_OK_AND_ASSIGN(MemoryRegionPtr allocated, b_->AllocateMemory(3 << 20));
  ASSERT_EQ(allocated->size_bytes(), size_t{3 << 20});
  EXPECT_EQ(allocated->data()[12345], 0);  // zero-filled
  KV_ASSERT_OK_AND_ASSIGN(auto regions, a_->RemoteRegions(peer_));
  bool published = false;
  for (const RemoteRegionInfo& r : regions) published |= r.id == allocated->id();
  // Publication to connected peers is asynchronous; wait until it shows up.
  for (int i = 0; i < 2000 && !published; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
    KV_ASSERT_OK_AND_ASSIGN(regions, a_->RemoteRegions(peer_));
    for (const RemoteRegionInfo& r : regions) published |= r.id == allocated->id();
  }
  ASSERT_TRUE(published);
  BlockTransfer put = Block(1 << 20, 4096, 1 << 20);
  put.remote_region = allocated->id();
  KV_ASSERT_OK_AND_ASSIGN(TransferPlan plan, a_->Prepare(Batch(Direction::kPut, {put})));
  KV_ASSERT_OK_AND_ASSIGN(TransferHandlePtr h, a_->Post(plan, LayerRange::All()));
  KV_ASSERT_OK(h->Wait(Deadline()));
  EXPECT_EQ(std::memcmp(allocated->data() + 4096, a_buf_->data() + (1 << 20), 1 << 20), 0);
  BlockTransfer get = Block(8 << 20, 4096, 1 << 20);
  get.remote_region = allocated->id();
  get.checksum = kv::BlockChecksum(allocated->data() + 4096, 1 << 20);
  KV_ASSERT_OK_AND_ASSIGN(TransferPlan gplan, a_->Prepare(Batch(Direction::kGet, {get})));
  KV_ASSERT_OK_AND_ASSIGN(TransferHandlePtr gh, a_->Post(gplan, LayerRange::All()));
  KV_ASSERT_OK(gh->Wait(Deadline()));
  EXPECT_THAT(a_->AllocateMemory(0), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST_P(TransportConformanceTest, LayerWiseStreamingReportsEachLayer) {
  constexpr int kLayers = 6;
  constexpr uint64_t kBlock = 256 << 10;
  std::vector<BlockTransfer> blocks;
  // Layers listed out of order on purpose; Prepare sorts them.
  for (int l = kLayers - 1; l >= 0; --l) {
    for (int j = 0; j < 3; ++j) {
      uint64_t off = (l * 3 + j) * kBlock;
      blocks.push_back(Block(off, off + kBlock * 7, kBlock, l));
    }
  }
  KV_ASSERT_OK_AND_ASSIGN(TransferPlan plan, a_->Prepare(Batch(Direction::kPut, blocks, 5)));
  std::vector<TransferHandlePtr> handles;
  for (int l = 0; l < kLayers; ++l) {
    // "Produce" layer l just before posting it: the sender writes while earlier layers fly.
    a_buf_->data()[l * 3 * kBlock] = static_cast<uint8_t>(l + 1);
    KV_ASSERT_OK_AND_ASSIGN(TransferHandlePtr h, a_->Post(plan, LayerRange::One(l)));
    handles.push_back(std::move(h));
  }
  for (int l = 0; l < kLayers; ++l) {
    KV_ASSERT_OK_AND_ASSIGN(InboundEvent ev,
                            inbound_.NextOfKind(InboundEvent::Kind::kBlocks, Deadline()));
    EXPECT_EQ(ev.layers.begin, l);
    EXPECT_EQ(ev.layers.end, l + 1);
    EXPECT_EQ(ev.blocks.size(), 3u);
    KV_EXPECT_OK(ev.status);
  }
  for (auto& h : handles) KV_EXPECT_OK(h->Wait(Deadline()));
  for (const BlockTransfer& b : blocks) {
    EXPECT_TRUE(Same(b.local_offset, b.remote_offset, b.length));
  }
}

TEST_P(TransportConformanceTest, ControlMessageArrivesAfterTheDataPostedBeforeIt) {
  std::vector<BlockTransfer> blocks;
  for (int i = 0; i < 16; ++i) blocks.push_back(Block(i * (2 << 20), i * (2 << 20), 2 << 20));
  KV_ASSERT_OK_AND_ASSIGN(TransferPlan plan, a_->Prepare(Batch(Direction::kPut, blocks, 11)));
  KV_ASSERT_OK_AND_ASSIGN(TransferHandlePtr h, a_->Post(plan, LayerRange::All()));
  KV_ASSERT_OK(a_->SendControl(peer_, 11, "done with request 11"));
  KV_ASSERT_OK_AND_ASSIGN(InboundEvent first, inbound_.Next(Deadline()));
  EXPECT_EQ(first.kind, InboundEvent::Kind::kBlocks);
  KV_ASSERT_OK_AND_ASSIGN(InboundEvent second, inbound_.Next(Deadline()));
  EXPECT_EQ(second.kind, InboundEvent::Kind::kControl);
  EXPECT_EQ(second.message, "done with request 11");
  EXPECT_EQ(second.tag, 11u);
  KV_EXPECT_OK(h->Wait(Deadline()));
  // The receiver can answer on the same connection.
  KV_ASSERT_OK(b_->SendControl(second.peer, 12, "ack"));
  KV_ASSERT_OK_AND_ASSIGN(InboundEvent reply,
                          a_inbound_.NextOfKind(InboundEvent::Kind::kControl, Deadline()));
  EXPECT_EQ(reply.message, "ack");
  EXPECT_EQ(reply.peer, peer_);
}

TEST_P(TransportConformanceTest, BadInputIsRejectedWithClearErrors) {
  const uint64_t size = kRegionBytes;
  auto prepare = [&](BlockTransfer b, PeerId peer) {
    TransferBatch batch = Batch(Direction::kPut, {b});
    batch.peer = peer;
    return a_->Prepare(batch);
  };
  EXPECT_THAT(prepare(Block(0, 0, 0), peer_), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(prepare(Block(size - 10, 0, 11), peer_),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(prepare(Block(0, size - 10, 11), peer_),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(prepare(Block(~uint64_t{0} - 5, 0, 10), peer_),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(prepare(Block(0, 0, 16, -1), peer_), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(prepare(Block(0, 0, 16), peer_ + 1000), StatusIs(absl::StatusCode::kNotFound));
  BlockTransfer unknown_remote = Block(0, 0, 16);
  unknown_remote.remote_region = b_region_->id() + 12345;
  EXPECT_THAT(prepare(unknown_remote, peer_), StatusIs(absl::StatusCode::kNotFound));
  // A region registered with the *other* transport, and a null region.
  BlockTransfer foreign = Block(0, 0, 16);
  foreign.local = b_region_.get();
  EXPECT_THAT(prepare(foreign, peer_), StatusIs(absl::StatusCode::kInvalidArgument));
  BlockTransfer null_local = Block(0, 0, 16);
  null_local.local = nullptr;
  EXPECT_THAT(prepare(null_local, peer_), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(a_->Prepare(Batch(Direction::kPut, {})),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(a_->RegisterMemory(MemorySpan{nullptr, 10}, MemoryKind::kHost),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(a_->SendControl(peer_ + 1000, 0, "x"), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(a_->SendControl(peer_, 0, std::string(Transport::kMaxControlBytes + 1, 'x')),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(a_->RemoteRegions(peer_ + 1000), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(a_->Connect("no-such-address-format", absl::Now() + absl::Seconds(5)),
              StatusIs(absl::StatusCode::kInvalidArgument));
  KV_ASSERT_OK_AND_ASSIGN(TransferPlan plan, prepare(Block(0, 0, 16, 3), peer_));
  EXPECT_THAT(a_->Post(plan, LayerRange::One(4)), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(a_->Post(plan, LayerRange{5, 5}), StatusIs(absl::StatusCode::kInvalidArgument));
  // A region that was deregistered is rejected, and the transport still works afterwards.
  auto extra = std::make_unique<TestBuffer>(4096);
  KV_ASSERT_OK_AND_ASSIGN(MemoryRegionPtr r, a_->RegisterMemory(extra->span(), MemoryKind::kHost));
  BlockTransfer stale = Block(0, 0, 16);
  stale.local = r.get();
  KV_EXPECT_OK(prepare(stale, peer_));
  r.reset();
  KV_ASSERT_OK_AND_ASSIGN(TransferHandlePtr h, a_->Post(plan, LayerRange::One(3)));
  KV_EXPECT_OK(h->Wait(Deadline()));
  KV_ASSERT_OK_AND_ASSIGN(auto regions, a_->RemoteRegions(peer_));
  ASSERT_EQ(regions.size(), 1u);
  EXPECT_EQ(regions[0].id, b_region_->id());
  EXPECT_EQ(regions[0].size_bytes, kRegionBytes);
}

TEST_P(TransportConformanceTest, CancelStopsQueuedTransfers) {
  std::vector<BlockTransfer> blocks;
  for (int i = 0; i < 32; ++i) blocks.push_back(Block(i * (2 << 20), i * (2 << 20), 2 << 20));
  KV_ASSERT_OK_AND_ASSIGN(TransferPlan plan, a_->Prepare(Batch(Direction::kPut, blocks)));
  std::vector<TransferHandlePtr> handles;
  for (int i = 0; i < 16; ++i) {
    KV_ASSERT_OK_AND_ASSIGN(TransferHandlePtr h, a_->Post(plan, LayerRange::All()));
    handles.push_back(std::move(h));
  }
  for (auto& h : handles) h->Cancel();
  int cancelled = 0;
  for (auto& h : handles) {
    absl::Status s = h->Wait(Deadline());
    EXPECT_TRUE(s.ok() || absl::IsCancelled(s)) << s;
    cancelled += absl::IsCancelled(s);
  }
  EXPECT_GT(cancelled, 0);
  // The connection still works after cancellations.
  KV_ASSERT_OK_AND_ASSIGN(TransferHandlePtr h, a_->Post(plan, LayerRange::All()));
  KV_EXPECT_OK(h->Wait(Deadline()));
  EXPECT_TRUE(Same(0, 0, 32 << 20));
}

TEST_P(TransportConformanceTest, DeadlineFailsTransfersThatCannotFinishInTime) {
  std::vector<BlockTransfer> blocks;
  for (int i = 0; i < 32; ++i) blocks.push_back(Block(i * (2 << 20), i * (2 << 20), 2 << 20));
  KV_ASSERT_OK_AND_ASSIGN(TransferPlan plan, a_->Prepare(Batch(Direction::kPut, blocks)));
  KV_ASSERT_OK_AND_ASSIGN(TransferHandlePtr late,
                          a_->Post(plan, LayerRange::All(), {absl::Now() - absl::Seconds(1)}));
  EXPECT_THAT(late->Wait(Deadline()), StatusIs(absl::StatusCode::kDeadlineExceeded));
  std::vector<TransferHandlePtr> handles;
  const absl::Time soon = absl::Now() + absl::Milliseconds(2);
  for (int i = 0; i < 16; ++i) {
    KV_ASSERT_OK_AND_ASSIGN(TransferHandlePtr h, a_->Post(plan, LayerRange::All(), {soon}));
    handles.push_back(std::move(h));
  }
  int expired = 0;
  for (auto& h : handles) {
    absl::Status s = h->Wait(Deadline());
    EXPECT_TRUE(s.ok() || absl::IsDeadlineExceeded(s)) << s;
    expired += absl::IsDeadlineExceeded(s);
  }
  EXPECT_GT(expired, 0);  // 16 x 64 MiB cannot all be done in 2 ms
  // Waiting less than the transfer takes reports the wait, not a failed transfer.
  auto dropped_spec = FaultSpec{.drop = true};
  a_->SetFaults(dropped_spec);
  KV_ASSERT_OK_AND_ASSIGN(TransferHandlePtr dropped,
                          a_->Post(plan, LayerRange::All(), {absl::Now() + absl::Seconds(1)}));
  EXPECT_THAT(dropped->Wait(absl::Now()), StatusIs(absl::StatusCode::kDeadlineExceeded));
  EXPECT_EQ(dropped->Poll(), std::nullopt);
  EXPECT_THAT(dropped->Wait(Deadline()), StatusIs(absl::StatusCode::kDeadlineExceeded));
}

TEST_P(TransportConformanceTest, CorruptedPutIsNeverReportedAsReceived) {
  a_->SetFaults(FaultSpec{.corrupt = true});
  std::vector<BlockTransfer> blocks = {Block(0, 0, 65536), Block(1 << 20, 1 << 20, 65536)};
  KV_ASSERT_OK_AND_ASSIGN(TransferPlan plan, a_->Prepare(Batch(Direction::kPut, blocks)));
  KV_ASSERT_OK_AND_ASSIGN(TransferHandlePtr h, a_->Post(plan, LayerRange::All()));
  EXPECT_THAT(h->Wait(Deadline()), StatusIs(absl::StatusCode::kDataLoss));
  KV_ASSERT_OK_AND_ASSIGN(InboundEvent ev,
                          inbound_.NextOfKind(InboundEvent::Kind::kBlocks, Deadline()));
  EXPECT_THAT(ev.status, StatusIs(absl::StatusCode::kDataLoss));
  ASSERT_EQ(ev.blocks.size(), 2u);
  EXPECT_THAT(ev.blocks[0].status, StatusIs(absl::StatusCode::kDataLoss));
  KV_EXPECT_OK(ev.blocks[1].status);
  // The sender's own bytes are intact again, and a clean retry succeeds.
  a_->SetFaults(FaultSpec{});
  KV_ASSERT_OK_AND_ASSIGN(TransferHandlePtr retry, a_->Post(plan, LayerRange::All()));
  KV_EXPECT_OK(retry->Wait(Deadline()));
  EXPECT_TRUE(Same(0, 0, 65536));
  // A corrupted get fails its first block too.
  a_->SetFaults(FaultSpec{.corrupt = true});
  BlockTransfer g = Block(4 << 20, 0, 65536);
  g.checksum = kv::BlockChecksum(b_buf_->data(), 65536);
  KV_ASSERT_OK_AND_ASSIGN(TransferPlan gp, a_->Prepare(Batch(Direction::kGet, {g})));
  KV_ASSERT_OK_AND_ASSIGN(TransferHandlePtr gh, a_->Post(gp, LayerRange::All()));
  EXPECT_THAT(gh->Wait(Deadline()), StatusIs(absl::StatusCode::kDataLoss));
}

TEST_P(TransportConformanceTest, InjectedFailuresAndDelays) {
  KV_ASSERT_OK_AND_ASSIGN(TransferPlan plan,
                          a_->Prepare(Batch(Direction::kPut, {Block(0, 0, 4096)})));
  a_->SetFaults(FaultSpec{.fail_after = a_->posts() + 1});
  KV_ASSERT_OK_AND_ASSIGN(TransferHandlePtr ok, a_->Post(plan, LayerRange::All()));
  KV_EXPECT_OK(ok->Wait(Deadline()));
  KV_ASSERT_OK_AND_ASSIGN(TransferHandlePtr failed, a_->Post(plan, LayerRange::All()));
  EXPECT_THAT(failed->Wait(Deadline()), StatusIs(absl::StatusCode::kUnavailable));
  a_->SetFaults(FaultSpec{.delay = absl::Milliseconds(20)});
  KV_ASSERT_OK_AND_ASSIGN(TransferHandlePtr delayed, a_->Post(plan, LayerRange::All()));
  KV_EXPECT_OK(delayed->Wait(Deadline()));
  KV_ASSERT_OK_AND_ASSIGN(TransferHandlePtr dropped, a_->Post(plan, LayerRange::All()));
  a_->SetFaults(FaultSpec{.drop = true});
  KV_ASSERT_OK_AND_ASSIGN(TransferHandlePtr dropped2, a_->Post(plan, LayerRange::All()));
  dropped2->Cancel();
  EXPECT_THAT(dropped2->Wait(Deadline()), StatusIs(absl::StatusCode::kCancelled));
  KV_EXPECT_OK(dropped->Wait(Deadline()));
}

TEST_P(TransportConformanceTest, PeerShutdownFailsTransfersWithUnavailable) {
  KV_ASSERT_OK_AND_ASSIGN(TransferPlan plan,
                          a_->Prepare(Batch(Direction::kPut, {Block(0, 0, 4096)})));
  b_region_.reset();
  b_.reset();
  KV_ASSERT_OK_AND_ASSIGN(InboundEvent down,
                          a_inbound_.NextOfKind(InboundEvent::Kind::kPeerDown, Deadline()));
  EXPECT_EQ(down.peer, peer_);
  EXPECT_THAT(down.status, StatusIs(absl::StatusCode::kUnavailable));
  absl::StatusOr<TransferHandlePtr> h = a_->Post(plan, LayerRange::All());
  if (h.ok()) {
    EXPECT_THAT((*h)->Wait(Deadline()), StatusIs(absl::StatusCode::kUnavailable));
  } else {
    EXPECT_THAT(h.status(), testing::StatusIs(absl::StatusCode::kUnavailable));
  }
  absl::Status control = a_->SendControl(peer_, 0, "x");
  EXPECT_TRUE(absl::IsNotFound(control) || absl::IsUnavailable(control)) << control;
}

TEST_P(TransportConformanceTest, DisconnectIsSeenByThePeer) {
  KV_ASSERT_OK(a_->Disconnect(peer_));
  KV_ASSERT_OK_AND_ASSIGN(InboundEvent down,
                          inbound_.NextOfKind(InboundEvent::Kind::kPeerDown, Deadline()));
  EXPECT_THAT(a_->Disconnect(peer_), StatusIs(absl::StatusCode::kNotFound));
  // Reconnecting works.
  KV_ASSERT_OK_AND_ASSIGN(PeerId again, a_->Connect(b_->address(), Deadline()));
  EXPECT_NE(again, peer_);
  peer_ = again;
  KV_ASSERT_OK_AND_ASSIGN(TransferPlan plan,
                          a_->Prepare(Batch(Direction::kPut, {Block(0, 0, 4096)})));
  KV_ASSERT_OK_AND_ASSIGN(TransferHandlePtr h, a_->Post(plan, LayerRange::All()));
  KV_EXPECT_OK(h->Wait(Deadline()));
}

}  // namespace kvrelay::transfer

// PushSession over the real in-process transport: a stand-in decode worker (its own transport
// and registered slots, answering push claims as DecodeWorker::OnPushClaim does) on one side,
// the session on the other.

#include "prefill/push_session.h"

#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/grpc_status.h"
#include "tests/testing/status_matchers.h"
#include "transfer/inproc/in_process_transport.h"

namespace kvrelay::prefill {
namespace {

using ::kvrelay::testing::StatusIs;

constexpr int32_t kLayers = 2;
constexpr uint64_t kLayerBytes = 256;                   // one layer of one block
constexpr uint64_t kSlotBytes = kLayers * kLayerBytes;  // one block: its layers back to back
constexpr int64_t kSlots = 8;
constexpr char kToken[] = "reservation-token";

// The decode side of the push protocol: registered slots and a verdict on each claim.
class FakeDecode {
 public:
  enum class Answer { kAllow, kRefuse, kExpired, kSilent };

  explicit FakeDecode(Answer answer) : answer_(answer) {
    transport_ = *transfer::MakeInProcessTransport();
    transport_->SetInboundHandler([this](transfer::InboundEvent e) { OnInbound(std::move(e)); });
    region_ = *transport_->AllocateMemory(kSlots * kSlotBytes);
  }

  std::string address() const { return transport_->address(); }
  transfer::RegionId region_id() const { return region_->id(); }
  const uint8_t* slot(int64_t s) const { return region_->data() + s * kSlotBytes; }
  // Blocks until the first claim arrived.
  kvrelay::v1::PushClaim AwaitClaim() {
    claimed_.WaitForNotification();
    absl::MutexLock lock(&mu_);
    return claims_.front();
  }
  int claims() {
    absl::MutexLock lock(&mu_);
    return static_cast<int>(claims_.size());
  }
  // Goes away as a crashed process would: its peers see kPeerDown.
  void ShutDown() {
    region_.reset();
    transport_.reset();
  }

 private:
  void OnInbound(transfer::InboundEvent event) {
    if (event.kind != transfer::InboundEvent::Kind::kControl) return;
    kvrelay::v1::PushClaim claim;
    ASSERT_TRUE(claim.ParseFromString(event.message));
    {
      absl::MutexLock lock(&mu_);
      claims_.push_back(claim);
    }
    if (!claimed_.HasBeenNotified()) claimed_.Notify();
    if (answer_ == Answer::kSilent) return;
    kvrelay::v1::PushVerdict verdict;
    if (answer_ == Answer::kAllow && claim.reservation_token() == kToken) {
      verdict.set_code(0);
    } else {
      verdict.set_code(static_cast<int32_t>(absl::StatusCode::kPermissionDenied));
      verdict.set_message("no live reservation has this token");
      verdict.set_reason(answer_ == Answer::kExpired ? kvrelay::v1::FAILURE_EXPIRED
                                                     : kvrelay::v1::FAILURE_UNAUTHORIZED);
    }
    ASSERT_TRUE(transport_->SendControl(event.peer, event.tag, verdict.SerializeAsString()).ok());
  }

  const Answer answer_;
  absl::Mutex mu_;
  std::vector<kvrelay::v1::PushClaim> claims_ ABSL_GUARDED_BY(mu_);
  absl::Notification claimed_;
  transfer::TransportPtr transport_;  // declared before region_: destroyed after it
  transfer::MemoryRegionPtr region_;
};

class PushSessionTest : public ::testing::Test {
 protected:
  PushSessionTest() {
    transport_ = *transfer::MakeInProcessTransport();
    transport_->SetInboundHandler([this](transfer::InboundEvent e) { verdicts_.OnInbound(e); });
    peers_ = std::make_unique<PeerCache>(transport_.get());
    local_ = *transport_->AllocateMemory(kSlots * kSlotBytes);
    // Local block b holds bytes (b, layer, i) so each slice is recognisable.
    for (int64_t b = 0; b < kSlots; ++b) {
      for (uint64_t i = 0; i < kSlotBytes; ++i) {
        local_->data()[b * kSlotBytes + i] = static_cast<uint8_t>(b * 37 + i * 7 + 1);
      }
    }
  }
  ~PushSessionTest() override {
    local_.reset();
    transport_->SetInboundHandler(nullptr);
  }

  PushContext Context(absl::Duration transfer_timeout = absl::Seconds(30)) {
    return {.transport = transport_.get(),
            .peers = peers_.get(),
            .verdicts = &verdicts_,
            .metrics = &metrics_,
            .transfer_timeout = transfer_timeout};
  }
  // A reservation of `slots` (one per block) in `decode`'s one group.
  static kvrelay::v1::ReserveResponse Target(const std::string& address, transfer::RegionId region,
                                             const std::vector<int64_t>& slots) {
    kvrelay::v1::ReserveResponse target;
    target.mutable_transport()->set_address(address);
    target.set_node_id("decode-7");
    target.set_incarnation(42);
    target.set_full_blocks(static_cast<int32_t>(slots.size()));
    target.set_reservation_token(kToken);
    kvrelay::v1::GroupTarget* group = target.add_groups();
    group->set_region_id(region);
    group->set_slot_stride_bytes(kSlotBytes);
    group->set_block_bytes(kSlotBytes);
    for (int64_t s : slots) group->add_slots(s);
    return target;
  }
  // Every (block, layer) slice of local blocks `local_blocks` into the target's slots.
  void AddAllSlices(PushSession& session, const kvrelay::v1::ReserveResponse& target,
                    const std::vector<int64_t>& local_blocks) {
    for (int32_t layer = 0; layer < kLayers; ++layer) {
      for (size_t b = 0; b < local_blocks.size(); ++b) {
        KV_ASSERT_OK(
            session.AddSlice({.group = 0,
                              .local = local_.get(),
                              .local_offset = local_blocks[b] * kSlotBytes + layer * kLayerBytes,
                              .remote_slot = target.groups(0).slots(b),
                              .offset_in_unit = layer * kLayerBytes,
                              .length = kLayerBytes,
                              .layer = layer}));
      }
    }
  }
  double Failures(const std::string& reason) {
    return registry_
        .GetCounter("kvrelay:kv_transfer_failures_total", "",
                    {{"model_name", "m"}, {"reason", reason}})
        ->value();
  }
  double PushedBytes() {
    return registry_.GetCounter("kvrelay:prefill_pushed_kv_bytes_total", "", {{"model_name", "m"}})
        ->value();
  }
  static kvrelay::v1::ErrorInfo Why(const absl::Status& status) {
    return proto::GetErrorInfo(status).value_or(kvrelay::v1::ErrorInfo{});
  }

  MetricsRegistry registry_;
  PushMetrics metrics_{&registry_, {{"model_name", "m"}}};
  ClaimVerdicts verdicts_;
  transfer::TransportPtr transport_;
  std::unique_ptr<PeerCache> peers_;
  transfer::MemoryRegionPtr local_;
};

TEST_F(PushSessionTest, AcceptedClaimLandsTheBlocksByteForByte) {
  FakeDecode decode(FakeDecode::Answer::kAllow);
  const kvrelay::v1::ReserveResponse target = Target(decode.address(), decode.region_id(), {5, 2});
  KV_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<PushSession> session,
      PushSession::Open(Context(), "req-1", target, absl::Now() + absl::Seconds(30)));
  AddAllSlices(*session, target, {1, 3});
  KV_ASSERT_OK(session->Claim());
  // The claim names the request, its token and the slots it will write.
  const kvrelay::v1::PushClaim claim = decode.AwaitClaim();
  EXPECT_EQ(claim.request_id(), "req-1");
  EXPECT_EQ(claim.reservation_token(), kToken);
  ASSERT_EQ(claim.groups_size(), 1);
  EXPECT_THAT(claim.groups(0).slots(), ::testing::ElementsAre(5, 2));

  for (int32_t layer = 0; layer < kLayers; ++layer) {
    session->Post(transfer::LayerRange::One(layer));
  }
  KV_ASSERT_OK_AND_ASSIGN(const int64_t pushed, session->Finish());
  EXPECT_EQ(pushed, static_cast<int64_t>(2 * kSlotBytes));
  EXPECT_EQ(std::memcmp(decode.slot(5), local_->data() + 1 * kSlotBytes, kSlotBytes), 0);
  EXPECT_EQ(std::memcmp(decode.slot(2), local_->data() + 3 * kSlotBytes, kSlotBytes), 0);
  // Slots outside the reservation are untouched.
  const std::vector<uint8_t> zeros(kSlotBytes, 0);
  EXPECT_EQ(std::memcmp(decode.slot(0), zeros.data(), kSlotBytes), 0);
  EXPECT_EQ(PushedBytes(), static_cast<double>(2 * kSlotBytes));
  // The same bytes on the link to the target decode worker, with the push's time.
  const MetricLabels link = {{"model_name", "m"}, {"decode", "decode-7"}};
  EXPECT_EQ(registry_.GetCounter("kvrelay:kv_transfer_link_bytes_total", "", link)->value(),
            static_cast<double>(2 * kSlotBytes));
  EXPECT_GT(registry_.GetCounter("kvrelay:kv_transfer_link_seconds_total", "", link)->value(), 0);
  EXPECT_EQ(registry_.RenderText().find("kvrelay:kv_transfer_failures_total{"), std::string::npos);
}

TEST_F(PushSessionTest, RefusedClaimIsTheCallersAndWritesNothing) {
  FakeDecode decode(FakeDecode::Answer::kRefuse);
  const kvrelay::v1::ReserveResponse target = Target(decode.address(), decode.region_id(), {4});
  KV_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<PushSession> session,
      PushSession::Open(Context(), "req-2", target, absl::Now() + absl::Seconds(30)));
  AddAllSlices(*session, target, {0});
  const absl::Status claimed = session->Claim();
  EXPECT_THAT(claimed, StatusIs(absl::StatusCode::kPermissionDenied,
                                ::testing::HasSubstr("decode node decode-7 refused the push")));
  EXPECT_EQ(Why(claimed).role(), kvrelay::v1::ROLE_CLIENT);
  EXPECT_EQ(Why(claimed).reason(), kvrelay::v1::FAILURE_UNAUTHORIZED);
  EXPECT_EQ(Failures("refused"), 1);
  session.reset();
  const std::vector<uint8_t> zeros(kSlotBytes, 0);
  EXPECT_EQ(std::memcmp(decode.slot(4), zeros.data(), kSlotBytes), 0);
  EXPECT_EQ(PushedBytes(), 0);
}

TEST_F(PushSessionTest, ExpiredReservationIsTheDecodeWorkers) {
  FakeDecode decode(FakeDecode::Answer::kExpired);
  const kvrelay::v1::ReserveResponse target = Target(decode.address(), decode.region_id(), {4});
  KV_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<PushSession> session,
      PushSession::Open(Context(), "req-3", target, absl::Now() + absl::Seconds(30)));
  AddAllSlices(*session, target, {0});
  const absl::Status claimed = session->Claim();
  EXPECT_THAT(claimed, StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_EQ(Why(claimed).role(), kvrelay::v1::ROLE_DECODE);
  EXPECT_EQ(Why(claimed).node_id(), "decode-7");
  EXPECT_EQ(Why(claimed).reason(), kvrelay::v1::FAILURE_EXPIRED);
  EXPECT_EQ(Failures("refused"), 1);
}

TEST_F(PushSessionTest, DeadlineExpiringWhileAwaitingTheVerdictIsATimeout) {
  FakeDecode decode(FakeDecode::Answer::kSilent);
  const kvrelay::v1::ReserveResponse target = Target(decode.address(), decode.region_id(), {4});
  // The decode worker never answers: the wait ends at the caller's deadline.
  KV_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<PushSession> session,
      PushSession::Open(Context(), "req-4", target, absl::Now() + absl::Milliseconds(100)));
  AddAllSlices(*session, target, {0});
  const absl::Status claimed = session->Claim();
  EXPECT_THAT(claimed, StatusIs(absl::StatusCode::kDeadlineExceeded));
  EXPECT_EQ(Why(claimed).role(), kvrelay::v1::ROLE_DECODE);
  EXPECT_EQ(Why(claimed).reason(), kvrelay::v1::FAILURE_TRANSFER);
  EXPECT_EQ(Failures("timeout"), 1);
  EXPECT_EQ(decode.claims(), 1);
}

TEST_F(PushSessionTest, UnreachablePeerIsAttributedToTheDecodeWorker) {
  const kvrelay::v1::ReserveResponse target = Target("inproc:no-such-decode-worker", 1, {4});
  absl::StatusOr<std::unique_ptr<PushSession>> session =
      PushSession::Open(Context(), "req-5", target, absl::Now() + absl::Seconds(30));
  EXPECT_THAT(session, StatusIs(absl::StatusCode::kUnavailable,
                                ::testing::HasSubstr("cannot reach decode node decode-7")));
  EXPECT_EQ(Why(session.status()).role(), kvrelay::v1::ROLE_DECODE);
  EXPECT_EQ(Why(session.status()).node_id(), "decode-7");
  EXPECT_EQ(Why(session.status()).reason(), kvrelay::v1::FAILURE_UNREACHABLE);
  EXPECT_EQ(Failures("unreachable"), 1);
}

TEST_F(PushSessionTest, PeerGoingAwayDuringTheClaimIsPeerLost) {
  auto decode = std::make_unique<FakeDecode>(FakeDecode::Answer::kSilent);
  const kvrelay::v1::ReserveResponse target = Target(decode->address(), decode->region_id(), {4});
  KV_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<PushSession> session,
      PushSession::Open(Context(), "req-6", target, absl::Now() + absl::Seconds(60)));
  AddAllSlices(*session, target, {0});
  absl::Status claimed;
  std::thread claimer([&] { claimed = session->Claim(); });
  (void)decode->AwaitClaim();
  decode->ShutDown();
  claimer.join();
  EXPECT_THAT(claimed, StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_EQ(Why(claimed).role(), kvrelay::v1::ROLE_DECODE);
  EXPECT_EQ(Failures("peer_lost"), 1);
}

TEST_F(PushSessionTest, SlotOutsideTheTargetsRunsIsTheCallers) {
  FakeDecode decode(FakeDecode::Answer::kAllow);
  kvrelay::v1::ReserveResponse target = Target(decode.address(), decode.region_id(), {4});
  KV_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<PushSession> session,
      PushSession::Open(Context(), "req-7", target, absl::Now() + absl::Seconds(30)));
  // Runs are consulted when the slice is added (their keys were imported by Open, none here).
  kvrelay::v1::SlotRun* run = target.mutable_groups(0)->add_runs();
  run->set_first_slot(0);
  run->set_slot_count(2);
  const absl::Status added = session->AddSlice(
      {.group = 0, .local = local_.get(), .remote_slot = 4, .length = kLayerBytes});
  EXPECT_THAT(added, StatusIs(absl::StatusCode::kInvalidArgument,
                              ::testing::HasSubstr("slot 4 is in none of its group's runs")));
  EXPECT_EQ(Why(added).role(), kvrelay::v1::ROLE_CLIENT);
  EXPECT_EQ(Why(added).reason(), kvrelay::v1::FAILURE_INVALID_REQUEST);
}

}  // namespace
}  // namespace kvrelay::prefill

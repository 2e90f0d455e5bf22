#include "decode/reservation_table.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/hash/hash.h"
#include "common/check.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace kvrelay::decode {
namespace {

using ::kvrelay::testing::IsOk;
using ::kvrelay::testing::StatusIs;
using ::testing::HasSubstr;

constexpr size_t kSlotBytes = 256;
constexpr transfer::RegionId kRegion = 7;
constexpr transfer::PeerId kPusher = 11;
constexpr int32_t kLayers = 4;

uint64_t Tag(const std::string& request_id) { return absl::HashOf(request_id); }

// One layer group of `slots` slots on host memory, a table over it on a simulated clock.
class ReservationTableTest : public ::testing::Test {
 protected:
  void SetUp() override { Make(/*slots=*/8); }

  void Make(int64_t slots, bool per_reservation_keys = false) {
    table_.reset();
    auto pool = kv::BlockPool::Create({kSlotBytes, slots}, kv::MakeHostMemoryResource());
    KV_CHECK(pool.ok());
    pool_ = *std::move(pool);
    table_ = std::make_unique<ReservationTable>(
        std::vector<SlotGroup>{{.pool = pool_.get(), .region_id = kRegion}}, &clock_,
        ReservationTableOptions{.ttl = absl::Seconds(60),
                                .release_grace = absl::Seconds(30),
                                .num_layers = kLayers,
                                .per_reservation_keys = per_reservation_keys,
                                .tag_of = Tag,
                                .capacity_refusals = &refusals_});
  }

  // A request pushing `blocks` blocks and booking `budget` blocks in all.
  static ReservationRequest Request(const std::string& id, int32_t blocks, int64_t budget) {
    ReservationRequest r;
    r.request_id = id;
    r.prompt_tokens = blocks * 16 + 1;
    r.full_blocks = blocks;
    r.expected_layers = blocks > 0 ? kLayers : 0;
    r.budget = {budget};
    r.wanted = [](int, int64_t) { return true; };
    return r;
  }

  kvrelay::v1::PushClaim ClaimOf(const std::string& id, const ReservationGrant& grant) const {
    kvrelay::v1::PushClaim claim;
    claim.set_request_id(id);
    claim.set_reservation_token(grant.token);
    kvrelay::v1::GroupTarget* target = claim.add_groups();
    target->set_region_id(kRegion);
    target->set_slot_stride_bytes(pool_->slot_stride());
    for (kv::SlotId s : grant.slots[0]) target->add_slots(s);
    return claim;
  }

  // A delivery of layers [begin, end) into `slot`, `length` bytes at `within` in it.
  transfer::InboundEvent Blocks(const std::string& id, const std::string& token, kv::SlotId slot,
                                int begin, int end, transfer::PeerId peer = kPusher,
                                uint64_t within = 0, uint64_t length = kSlotBytes) const {
    transfer::InboundEvent event;
    event.kind = transfer::InboundEvent::Kind::kBlocks;
    event.peer = peer;
    event.tag = Tag(id);
    event.layers = {begin, end};
    event.credential = token;
    event.blocks.push_back(transfer::ReceivedBlock{
        .region = kRegion,
        .offset = static_cast<uint64_t>(slot) * pool_->slot_stride() + within,
        .length = length});
    return event;
  }

  // Takes without waiting (the deadline has passed).
  absl::StatusOr<std::optional<TakenReservation>> TakeNow(const std::string& id,
                                                          const std::string& token,
                                                          int32_t prompt_tokens) {
    return table_->Take(id, token, prompt_tokens, absl::InfinitePast());
  }

  SimulatedClock clock_;
  Counter refusals_;
  std::unique_ptr<kv::BlockPool> pool_;
  std::unique_ptr<ReservationTable> table_;
};

TEST_F(ReservationTableTest, BooksAndRefusesAtCapacity) {
  KV_ASSERT_OK_AND_ASSIGN(ReservationGrant a, table_->Book(Request("a", 2, 5)));
  EXPECT_EQ(a.token.size(), 32u);
  ASSERT_EQ(a.slots.size(), 1u);
  EXPECT_EQ(a.slots[0].size(), 2u);
  EXPECT_EQ(pool_->free_slots(), 6);  // only the pushed blocks hold slots now
  EXPECT_EQ(table_->Load().booked, std::vector<int64_t>{5});

  EXPECT_THAT(table_->Book(Request("b", 1, 4)),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("3 of 8 are free")));
  EXPECT_EQ(refusals_.value(), 1);
  EXPECT_THAT(table_->Book(Request("a", 1, 1)), StatusIs(absl::StatusCode::kAlreadyExists));
  KV_ASSERT_OK_AND_ASSIGN(ReservationGrant c, table_->Book(Request("c", 1, 3)));
  EXPECT_NE(c.token, a.token);
  EXPECT_FALSE(table_->TryBook({1}));  // 8 of 8 booked
  const ReservationLoad load = table_->Load();
  EXPECT_EQ(load.reservations, 2);
  EXPECT_EQ(load.waiting, 2);
  EXPECT_EQ(load.capacity, std::vector<int64_t>{8});
}

TEST_F(ReservationTableTest, UnwantedBlocksGetNoSlotAndHeldSlotsAreTaken) {
  KV_ASSERT_OK_AND_ASSIGN(std::vector<kv::SlotId> held, pool_->AllocateMany(2));
  ReservationRequest r = Request("a", 4, 6);
  r.held_blocks = 2;
  r.held_slots = {held};
  r.wanted = [](int, int64_t block) { return block != 0 && block != 2; };
  KV_ASSERT_OK_AND_ASSIGN(ReservationGrant grant, table_->Book(std::move(r)));
  // Block 0 (held, unwanted) released; block 1 keeps its held slot; block 2 gets none.
  EXPECT_EQ(grant.slots[0][0], -1);
  EXPECT_EQ(grant.slots[0][1], held[1]);
  EXPECT_EQ(grant.slots[0][2], -1);
  EXPECT_GE(grant.slots[0][3], 0);
  EXPECT_EQ(pool_->RefCount(held[0]), 0);
  EXPECT_EQ(pool_->free_slots(), 6);
}

TEST_F(ReservationTableTest, RefusedBookReleasesHeldSlots) {
  Make(/*slots=*/2);
  KV_ASSERT_OK_AND_ASSIGN(std::vector<kv::SlotId> held, pool_->AllocateMany(1));
  ReservationRequest r = Request("a", 2, 3);  // 3 blocks never fit in 2
  r.held_blocks = 1;
  r.held_slots = {held};
  EXPECT_THAT(table_->Book(std::move(r)), StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_EQ(pool_->free_slots(), 2);
}

TEST_F(ReservationTableTest, ExpiresOnTheClockAndIsSweptByTheNextBook) {
  KV_ASSERT_OK_AND_ASSIGN(ReservationGrant a, table_->Book(Request("a", 2, 8)));
  EXPECT_THAT(table_->Book(Request("b", 1, 1)), StatusIs(absl::StatusCode::kResourceExhausted));
  clock_.Advance(absl::Seconds(61));
  // Expired: a claim is refused as such, and the next Book reclaims its blocks.
  const ClaimVerdict late = table_->Claim(ClaimOf("a", a), kPusher);
  EXPECT_THAT(late.status, StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("expired")));
  EXPECT_TRUE(late.expired);
  KV_EXPECT_OK(table_->Book(Request("b", 1, 8)).status());
  EXPECT_EQ(table_->Load().reservations, 1);
  EXPECT_EQ(pool_->free_slots(), 7);
  KV_ASSERT_OK_AND_ASSIGN(std::optional<TakenReservation> gone, TakeNow("a", a.token, 33));
  EXPECT_FALSE(gone.has_value());
}

// A request's remaining deadline shortens its reservation; once lapsed it is no longer waiting
// (a draining worker stops waiting for it) even before a Book sweeps it.
TEST_F(ReservationTableTest, LapsesWithItsRequestsDeadlineAndStopsWaiting) {
  ReservationRequest short_lived = Request("a", 2, 4);
  short_lived.lifetime = absl::Seconds(2);
  KV_ASSERT_OK_AND_ASSIGN(ReservationGrant a, table_->Book(std::move(short_lived)));
  KV_ASSERT_OK(table_->Book(Request("b", 1, 4)).status());  // the table's 60 s ttl
  EXPECT_EQ(table_->Load().waiting, 2);
  clock_.Advance(absl::Seconds(3));
  EXPECT_EQ(table_->Load().waiting, 1);
  EXPECT_EQ(table_->Load().reservations, 2);  // not swept yet
  EXPECT_TRUE(table_->Claim(ClaimOf("a", a), kPusher).expired);
  clock_.Advance(absl::Seconds(58));
  EXPECT_EQ(table_->Load().waiting, 0);
  KV_EXPECT_OK(table_->Book(Request("c", 1, 8)).status());
  EXPECT_EQ(table_->Load().reservations, 1);
}

TEST_F(ReservationTableTest, ReleaseNeedsTheTokenAndIsIdempotent) {
  KV_ASSERT_OK_AND_ASSIGN(ReservationGrant a, table_->Book(Request("a", 2, 4)));
  EXPECT_THAT(table_->Release("a", "not the token"),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("not its token")));
  EXPECT_EQ(table_->Load().waiting, 1);  // still reserved
  KV_EXPECT_OK(table_->Release("a", a.token));
  KV_EXPECT_OK(table_->Release("a", a.token));
  KV_EXPECT_OK(table_->Release("a", "anything: already released"));
  KV_EXPECT_OK(table_->Release("never-reserved", "x"));
  EXPECT_EQ(table_->Load().waiting, 0);
  // Its slots stay quarantined for the grace period; then the next Book sweeps it.
  EXPECT_EQ(table_->Load().reservations, 1);
  EXPECT_THAT(table_->Book(Request("b", 0, 8)), StatusIs(absl::StatusCode::kResourceExhausted));
  clock_.Advance(absl::Seconds(31));
  KV_EXPECT_OK(table_->Book(Request("b", 0, 8)).status());
  EXPECT_EQ(table_->Load().reservations, 1);
  EXPECT_EQ(pool_->free_slots(), 8);
}

TEST_F(ReservationTableTest, ReleasedSlotsStayQuarantinedWhileAClaimedPushMayWrite) {
  KV_ASSERT_OK_AND_ASSIGN(ReservationGrant a, table_->Book(Request("a", 1, 2)));
  KV_ASSERT_OK(table_->Claim(ClaimOf("a", a), kPusher).status);
  KV_ASSERT_OK(table_->Release("a", a.token));
  KV_ASSERT_OK(table_->Book(Request("b", 0, 1)).status());
  EXPECT_EQ(pool_->RefCount(a.slots[0][0]), 1) << "a push may still land in it";
  clock_.Advance(absl::Seconds(31));
  KV_ASSERT_OK(table_->Book(Request("c", 0, 1)).status());
  EXPECT_EQ(pool_->RefCount(a.slots[0][0]), 0);
}

TEST_F(ReservationTableTest, SweepReturnsLapsedAndQuietReleasedReservationsWithoutABook) {
  // Nothing pushed (quiet at once): its Release gives slots and booking back at once.
  KV_ASSERT_OK_AND_ASSIGN(ReservationGrant quiet, table_->Book(Request("quiet", 0, 2)));
  KV_ASSERT_OK(table_->Release("quiet", quiet.token));
  EXPECT_EQ(table_->Load().reservations, 0);
  EXPECT_EQ(table_->Load().booked, std::vector<int64_t>{0});

  // One nobody takes nor releases, and one released while its claimed push may still write.
  ReservationRequest short_lived = Request("lapsed", 2, 3);
  short_lived.lifetime = absl::Seconds(5);
  KV_ASSERT_OK(table_->Book(std::move(short_lived)).status());
  KV_ASSERT_OK_AND_ASSIGN(ReservationGrant pushed, table_->Book(Request("pushed", 1, 2)));
  KV_ASSERT_OK(table_->Claim(ClaimOf("pushed", pushed), kPusher).status);
  KV_ASSERT_OK(table_->Release("pushed", pushed.token));
  table_->Sweep();
  EXPECT_EQ(table_->Load().booked, std::vector<int64_t>{5});
  EXPECT_EQ(pool_->free_slots(), 5);

  clock_.Advance(absl::Seconds(6));  // past the lapse, not the grace
  table_->Sweep();
  EXPECT_EQ(table_->Load().reservations, 1);
  EXPECT_EQ(table_->Load().booked, std::vector<int64_t>{2});
  EXPECT_EQ(pool_->RefCount(pushed.slots[0][0]), 1) << "a push may still land in it";

  clock_.Advance(absl::Seconds(25));  // past the grace
  table_->Sweep();
  EXPECT_EQ(table_->Load().reservations, 0);
  EXPECT_EQ(table_->Load().booked, std::vector<int64_t>{0});
  EXPECT_EQ(pool_->free_slots(), 8);
}

TEST_F(ReservationTableTest, ClaimRules) {
  KV_ASSERT_OK_AND_ASSIGN(ReservationGrant a, table_->Book(Request("a", 2, 4)));
  kvrelay::v1::PushClaim wrong_token = ClaimOf("a", a);
  wrong_token.set_reservation_token(std::string(32, 'x'));
  EXPECT_THAT(table_->Claim(wrong_token, kPusher).status,
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("has this token")));
  EXPECT_THAT(table_->Claim(ClaimOf("nobody", a), kPusher).status,
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("has this token")));
  kvrelay::v1::PushClaim other_slot = ClaimOf("a", a);
  other_slot.mutable_groups(0)->set_slots(1, a.slots[0][1] + 1);
  EXPECT_THAT(table_->Claim(other_slot, kPusher).status,
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("not the reservation's")));
  kvrelay::v1::PushClaim other_region = ClaimOf("a", a);
  other_region.mutable_groups(0)->set_region_id(kRegion + 1);
  EXPECT_THAT(table_->Claim(other_region, kPusher).status,
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("region")));
  const ClaimVerdict ok = table_->Claim(ClaimOf("a", a), kPusher);
  KV_EXPECT_OK(ok.status);
  EXPECT_FALSE(ok.expired);
  EXPECT_THAT(table_->Claim(ClaimOf("a", a), kPusher + 1).status,
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("already claimed")));
}

TEST_F(ReservationTableTest, DeliveriesCountOnlyFromTheClaimantInsideItsSlots) {
  KV_ASSERT_OK_AND_ASSIGN(ReservationGrant a, table_->Book(Request("a", 1, 2)));
  const kv::SlotId slot = a.slots[0][0];
  EXPECT_THAT(table_->Deliver(Blocks("a", a.token, slot, 0, 2)),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("did not claim")));
  KV_ASSERT_OK(table_->Claim(ClaimOf("a", a), kPusher).status);
  EXPECT_THAT(table_->Deliver(Blocks("a", "wrong", slot, 0, 2, kPusher + 1)),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("wrong reservation token")));
  EXPECT_THAT(table_->Deliver(Blocks("a", a.token, slot, 0, 2, kPusher + 1)),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("did not claim")));
  EXPECT_THAT(table_->Deliver(Blocks("zzz", a.token, slot, 0, 2)),
              StatusIs(absl::StatusCode::kNotFound));
  KV_EXPECT_OK(table_->Deliver(Blocks("a", a.token, slot, 0, 2)));
  // Layer ranges are clipped to the model's layers.
  KV_EXPECT_OK(table_->Deliver(Blocks("a", a.token, slot, 2, kLayers + 5)));
  KV_ASSERT_OK_AND_ASSIGN(std::optional<TakenReservation> taken, TakeNow("a", a.token, 17));
  ASSERT_TRUE(taken.has_value());
  EXPECT_TRUE(taken->complete);
  KV_EXPECT_OK(taken->transfer_status);
  EXPECT_EQ(taken->bytes_received, 2 * static_cast<int64_t>(kSlotBytes));
  EXPECT_EQ(taken->slots, a.slots);
  EXPECT_EQ(taken->budget, std::vector<int64_t>{2});
  table_->FreeSlots(taken->slots);
  table_->Unbook(taken->budget);
  EXPECT_EQ(pool_->free_slots(), 8);
  EXPECT_TRUE(table_->TryBook({8}));
}

TEST_F(ReservationTableTest, AClaimantWritingOutsideItsSlotsSpoilsItsReservation) {
  KV_ASSERT_OK_AND_ASSIGN(ReservationGrant a, table_->Book(Request("a", 1, 2)));
  KV_ASSERT_OK(table_->Claim(ClaimOf("a", a), kPusher).status);
  // Past the end of its slot, then into a slot that is not its own.
  EXPECT_THAT(table_->Deliver(Blocks("a", a.token, a.slots[0][0], 0, 1, kPusher, 16, kSlotBytes)),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("outside")));
  EXPECT_THAT(table_->Deliver(Blocks("a", a.token, a.slots[0][0] + 1, 1, 2)),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("request 'a'")));
  KV_ASSERT_OK_AND_ASSIGN(std::optional<TakenReservation> taken, TakeNow("a", a.token, 17));
  ASSERT_TRUE(taken.has_value());
  EXPECT_FALSE(taken->complete);
  EXPECT_THAT(taken->transfer_status, StatusIs(absl::StatusCode::kPermissionDenied));
}

TEST_F(ReservationTableTest, AFailedDeliveryEndsTheWait) {
  KV_ASSERT_OK_AND_ASSIGN(ReservationGrant a, table_->Book(Request("a", 1, 2)));
  KV_ASSERT_OK(table_->Claim(ClaimOf("a", a), kPusher).status);
  transfer::InboundEvent failed = Blocks("a", a.token, a.slots[0][0], 0, 1);
  failed.status = absl::DataLossError("checksum mismatch");
  KV_EXPECT_OK(table_->Deliver(failed));
  // No wait although the push is incomplete: the deadline is far away.
  KV_ASSERT_OK_AND_ASSIGN(std::optional<TakenReservation> taken,
                          table_->Take("a", a.token, 17, absl::InfiniteFuture()));
  ASSERT_TRUE(taken.has_value());
  EXPECT_THAT(taken->transfer_status, StatusIs(absl::StatusCode::kDataLoss));
}

TEST_F(ReservationTableTest, TakeChecksTokenPromptAndTakesOnce) {
  KV_ASSERT_OK_AND_ASSIGN(ReservationGrant a, table_->Book(Request("a", 0, 2)));
  EXPECT_THAT(TakeNow("a", "wrong", 1), StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(TakeNow("a", a.token, 2),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("reserved for 1")));
  // Nothing to push: complete at once.
  KV_ASSERT_OK_AND_ASSIGN(std::optional<TakenReservation> taken,
                          table_->Take("a", a.token, 1, absl::InfiniteFuture()));
  ASSERT_TRUE(taken.has_value());
  EXPECT_TRUE(taken->complete);
  KV_ASSERT_OK_AND_ASSIGN(std::optional<TakenReservation> again, TakeNow("a", a.token, 1));
  EXPECT_FALSE(again.has_value());  // out of the table
  EXPECT_EQ(table_->Load().booked, std::vector<int64_t>{2}) << "the taker holds the booking";
  // A released reservation is not taken: the request computes its prompt.
  KV_ASSERT_OK_AND_ASSIGN(ReservationGrant b, table_->Book(Request("b", 1, 2)));
  KV_ASSERT_OK(table_->Release("b", b.token));
  KV_ASSERT_OK_AND_ASSIGN(std::optional<TakenReservation> released, TakeNow("b", b.token, 17));
  EXPECT_FALSE(released.has_value());
}

TEST_F(ReservationTableTest, CancelUndoesABookingWithItsTokenOnly) {
  KV_ASSERT_OK_AND_ASSIGN(ReservationGrant a, table_->Book(Request("a", 2, 4)));
  table_->Cancel("a", "another token");
  EXPECT_EQ(table_->Load().reservations, 1);
  table_->Cancel("a", a.token);
  EXPECT_EQ(table_->Load().reservations, 0);
  EXPECT_EQ(table_->Load().booked, std::vector<int64_t>{0});
  EXPECT_EQ(pool_->free_slots(), 8);
}

// A MemoryRegion standing for a reservation's own registration (no transport).
transfer::MemoryRegionPtr Region(transfer::RegionId id, kv::BlockPool& pool, kv::SlotId first,
                                 int64_t count) {
  return std::make_unique<transfer::MemoryRegion>(
      nullptr, id,
      transfer::MemorySpan{static_cast<uint8_t*>(pool.SlotAddress(first)),
                           static_cast<size_t>(count) * pool.slot_stride()},
      transfer::MemoryKind::kHost);
}

TEST_F(ReservationTableTest, PerReservationKeysAddressTheReservationsRuns) {
  Make(/*slots=*/8, /*per_reservation_keys=*/true);
  Gauge live;
  KV_ASSERT_OK_AND_ASSIGN(ReservationGrant a, table_->Book(Request("a", 2, 4)));
  const kv::SlotId first = std::min(a.slots[0][0], a.slots[0][1]);
  ASSERT_EQ(std::max(a.slots[0][0], a.slots[0][1]), first + 1);
  ReservedRuns runs;
  runs.push_back(std::make_unique<ReservedRun>(0, first, 2, Region(100, *pool_, first, 2), &live));
  table_->AttachRuns("a", a.token, std::move(runs));
  EXPECT_EQ(live.value(), 1);
  KV_ASSERT_OK(table_->Claim(ClaimOf("a", a), kPusher).status);
  // The pool's own region is private now; offsets are within the run.
  EXPECT_THAT(table_->Deliver(Blocks("a", a.token, a.slots[0][0], 0, 1)),
              StatusIs(absl::StatusCode::kPermissionDenied));
  transfer::InboundEvent in_run = Blocks("a", a.token, 0, 0, kLayers);
  in_run.blocks = {{.region = 100, .offset = 0, .length = kSlotBytes},
                   {.region = 100, .offset = pool_->slot_stride(), .length = kSlotBytes}};
  KV_EXPECT_OK(table_->Deliver(in_run));
  // The push is quiet: releasing unmaps the runs at once.
  KV_ASSERT_OK(table_->Release("a", a.token));
  EXPECT_EQ(live.value(), 0);
}

TEST_F(ReservationTableTest, RunsOfAReleasedReservationAreNotAttached) {
  Make(/*slots=*/8, /*per_reservation_keys=*/true);
  Gauge live;
  KV_ASSERT_OK_AND_ASSIGN(ReservationGrant a, table_->Book(Request("a", 1, 1)));
  KV_ASSERT_OK(table_->Release("a", a.token));
  ReservedRuns runs;
  runs.push_back(std::make_unique<ReservedRun>(0, a.slots[0][0], 1,
                                               Region(100, *pool_, a.slots[0][0], 1), &live));
  table_->AttachRuns("a", a.token, std::move(runs));
  EXPECT_EQ(live.value(), 0);
}

TEST_F(ReservationTableTest, DestroyingTheTableFreesEverySlot) {
  KV_ASSERT_OK(table_->Book(Request("a", 3, 4)).status());
  KV_ASSERT_OK(table_->Book(Request("b", 2, 4)).status());
  EXPECT_EQ(pool_->free_slots(), 3);
  table_.reset();
  EXPECT_EQ(pool_->free_slots(), 8);
}

}  // namespace
}  // namespace kvrelay::decode

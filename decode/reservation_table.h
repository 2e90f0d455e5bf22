#pragma once

// ReservationTable: the decode side's bookings of KV blocks and the gate on pushes into them.
//
//  Book     books every block a request can ever hold (prompt + output, per layer group)
//           against the pools' capacity, or refuses at once (RESOURCE_EXHAUSTED), so every
//           admitted request can finish; allocates slots for the prompt blocks a prefill
//           worker will push and mints an unguessable token bound to them. Reservations that
//           expired unclaimed, or were released and can no longer be written, are swept first.
//  Claim    a PushClaim binds a live, untaken reservation to one data-plane peer when its token
//           matches and every slot it names is the reservation's.
//  Deliver  counts a block delivery only from the claiming peer, with the token, and only
//           inside the reservation's slots; a claimant that writes elsewhere spoils its own
//           reservation (the prompt is then computed locally).
//  Sweep    ends lapsed reservations and released, quiet ones (Book sweeps first too).
//  Take     hands the reservation to its Generate once the push is complete, failed, or the
//           wait is over; the slots and the booking go with it.
//  Release  gives a reservation up (its token required); its slots stay quarantined until its
//           push is quiet or the grace period passed, so a late write never lands in a slot
//           that belongs to someone else.
//  TryBook / Unbook book and return blocks without a reservation (requests that did not
//           reserve; sequences returning what they booked).
//
// Tokens are compared in constant time. Expiry and quarantine use the injected Clock; the one
// blocking call (Take) is bounded by an absolute real deadline.
//
// Called by DecodeWorker: Book / AttachRuns / Cancel / Release from RPC threads, Claim /
// Deliver from the transport's inbound thread, Take from Generate, Unbook from the scheduler.
//
// Thread-safe. One absl::Mutex guards every reservation and the booked counts; under it the
// table calls only the BlockPools (their own leaf lock) and the clock. ReservedRuns that end
// are destroyed after the mutex is released: unmapping one may wait for the transport's
// thread, which calls Deliver. The pools, the clock and the gauges outlive the table.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/metrics.h"
#include "kv/block_hash.h"
#include "kv/pool/block_pool.h"
#include "kvrelay/v1/decode.pb.h"
#include "transfer/transport.h"

namespace kvrelay::decode {

// One reservation's own registration of a contiguous run of its slots in one group's pool
// (--memory-key-scope reservation). Destroying it unmaps the run (on RDMA the NIC refuses its
// key from then on) and takes it off the `live` gauge (may be null).
class ReservedRun {
 public:
  ReservedRun(int group, kv::SlotId first_slot, int64_t slot_count,
              transfer::MemoryRegionPtr region, Gauge* live);
  ~ReservedRun();
  ReservedRun(const ReservedRun&) = delete;
  ReservedRun& operator=(const ReservedRun&) = delete;

  int group() const { return group_; }
  kv::SlotId first_slot() const { return first_slot_; }
  int64_t slot_count() const { return slot_count_; }
  const transfer::MemoryRegion& region() const { return *region_; }

 private:
  const int group_;
  const kv::SlotId first_slot_;
  const int64_t slot_count_;
  transfer::MemoryRegionPtr region_;
  Gauge* const live_;
};
using ReservedRuns = std::vector<std::unique_ptr<ReservedRun>>;

// One layer group's slots as pushes address them.
struct SlotGroup {
  kv::BlockPool* pool = nullptr;     // allocates and frees the group's slots; outlives the table
  transfer::RegionId region_id = 0;  // the pool's registered region (claims name it)
};

struct ReservationTableOptions {
  // How long an untaken reservation holds its slots (default 60 s, on the Clock).
  absl::Duration ttl = absl::Seconds(60);
  // How long released slots stay quarantined while their push may still write (default 30 s).
  absl::Duration release_grace = absl::Seconds(30);
  // Model layers one push delivers (layer ranges are clipped to it); default 0.
  int32_t num_layers = 0;
  // true (--memory-key-scope reservation): deliveries address the reservation's ReservedRuns;
  // false (default, pool scope): the pool's own region.
  bool per_reservation_keys = false;
  // Request id -> the tag its transfers carry (worker::RequestTag). Required.
  std::function<uint64_t(const std::string&)> tag_of;
  // Incremented once per Book refused for capacity; may be null (default).
  Counter* capacity_refusals = nullptr;
};

// What Book needs to know about one request.
struct ReservationRequest {
  std::string request_id;
  int32_t prompt_tokens = 0;
  // How long the request can still use the reservation (its remaining deadline); it lapses
  // after the earlier of this and the table's ttl.
  absl::Duration lifetime = absl::InfiniteDuration();
  int32_t full_blocks = 0;      // prompt blocks pushed or held: slots [g][0, full_blocks)
  int32_t expected_layers = 0;  // layers whose delivery completes the push (0: nothing pushed)
  std::vector<int64_t> budget;  // blocks per group booked until the sequence ends
  // Whether block b of group g needs a slot at all (sliding windows skip blocks the first
  // query cannot see). Called under the table's lock; must not call back into the table.
  std::function<bool(int group, int64_t block)> wanted;
  // Leading blocks already in this worker's memory: held_slots[g][b] for b < held_blocks (one
  // reference each). The table takes them: wanted ones become the reservation's, the rest (and
  // all of them on a refusal) are released. Nobody pushes into them.
  int32_t held_blocks = 0;
  std::vector<kv::BlockHash> held_hashes;
  std::vector<std::vector<kv::SlotId>> held_slots;
};

// A booked reservation, as the ReserveResponse describes it.
struct ReservationGrant {
  std::string token;  // 256 bits from the CSPRNG; never logged
  // [group][block < full_blocks]: the slot, or -1 when not wanted. Blocks < held_blocks are
  // held, not pushed.
  std::vector<std::vector<kv::SlotId>> slots;
};

// A reservation handed to its Generate by Take.
struct TakenReservation {
  int32_t full_blocks = 0;
  int32_t held_blocks = 0;
  std::vector<kv::BlockHash> held_hashes;
  // [group][block]; the caller owns them now (adopt them, or FreeSlots).
  std::vector<std::vector<kv::SlotId>> slots;
  std::vector<int64_t> budget;   // still booked; returned with Unbook when the sequence ends
  bool complete = false;         // every expected layer was delivered
  absl::Status transfer_status;  // the first failed delivery or refused write, else OK
  int64_t bytes_received = 0;
};

// The table's answer to a PushClaim.
struct ClaimVerdict {
  absl::Status status;   // OK or PERMISSION_DENIED (INVALID_ARGUMENT: not a PushClaim)
  bool expired = false;  // refused because the reservation expired or was released
};

struct ReservationLoad {
  int32_t reservations = 0;       // in the table, taken-and-quiet ones not yet swept included
  int32_t waiting = 0;            // neither taken, released nor lapsed: pushes under way
  std::vector<int64_t> booked;    // per group, by reservations and sequences
  std::vector<int64_t> capacity;  // per group: the pool's slots
};

class ReservationTable {
 public:
  // REQUIRES: every group's pool non-null; options.tag_of set. `clock` outlives the table.
  ReservationTable(std::vector<SlotGroup> groups, Clock* clock, ReservationTableOptions options);
  // Frees every reservation's slots.
  ~ReservationTable();
  ReservationTable(const ReservationTable&) = delete;
  ReservationTable& operator=(const ReservationTable&) = delete;

  // ALREADY_EXISTS: the request id is reserved. RESOURCE_EXHAUSTED: its budget does not fit
  // beside what is booked (counted), or a pool had no free slot. INTERNAL: no CSPRNG.
  absl::StatusOr<ReservationGrant> Book(ReservationRequest request);
  // Gives the live reservation `request_id` (with `token`) its own registrations; they are
  // destroyed instead (outside the lock) when it was released or swept meanwhile.
  void AttachRuns(const std::string& request_id, const std::string& token, ReservedRuns runs);
  // Undoes a Book whose response cannot be sent: frees the slots and the booking. No-op
  // unless `request_id` is still reserved with `token`.
  void Cancel(const std::string& request_id, const std::string& token);
  // PERMISSION_DENIED: reserved, untaken and unreleased, and `token` is not its token (the
  // reservation stays). Otherwise OK: unknown, taken or already released ids are no-ops.
  absl::Status Release(const std::string& request_id, const std::string& token);

  // Checks `claim` (a control message from `peer`, size-checked and parsed by the caller);
  // when allowed, binds the reservation to `peer`.
  ClaimVerdict Claim(const kvrelay::v1::PushClaim& claim, transfer::PeerId peer);
  // A kBlocks event. NOT_FOUND: no reservation has its tag. PERMISSION_DENIED: refused (the
  // message names the request); when the claimant itself wrote outside its slots, the
  // reservation's transfer fails too.
  absl::Status Deliver(const transfer::InboundEvent& event);

  // The reservation of `request_id`, taken for its Generate after waiting (until
  // `wait_deadline`, real time) for every layer or a failure; nullopt when none is live (never
  // reserved, released, swept). PERMISSION_DENIED: another token. INVALID_ARGUMENT: already
  // taken, or reserved for another number of prompt tokens.
  absl::StatusOr<std::optional<TakenReservation>> Take(const std::string& request_id,
                                                       const std::string& token,
                                                       int32_t prompt_tokens,
                                                       absl::Time wait_deadline);

  // Books `budget` (blocks per group) if it fits beside what is booked; false otherwise.
  bool TryBook(const std::vector<int64_t>& budget);
  // Returns blocks booked by Book (via Take) or TryBook.
  void Unbook(const std::vector<int64_t>& budget);
  // Releases one reference of each slot >= 0 in its group's pool; clears `slots`.
  void FreeSlots(std::vector<std::vector<kv::SlotId>>& slots) const;

  ReservationLoad Load() const;

  // Ends reservations that lapsed untaken, and released ones whose push is quiet or whose
  // grace period passed: their slots and bookings return now, not at the next Book. The
  // worker calls it every second, so an idle worker holds nothing a gone request reserved.
  void Sweep();

 private:
  struct Reservation;
  using ReservationPtr = std::shared_ptr<Reservation>;

  // Drops expired and released-and-quiet reservations; their runs move to `ended`.
  void SweepLocked(absl::Time now, ReservedRuns& ended) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // RESOURCE_EXHAUSTED (counted) unless `budget` fits beside booked_.
  absl::Status CheckCapacityLocked(const std::vector<int64_t>& budget) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fills r.slots: fresh slots for wanted pushed blocks, held ones for wanted held blocks;
  // releases unwanted held slots. RESOURCE_EXHAUSTED when a pool is full.
  absl::Status AllocateSlots(Reservation& r, ReservationRequest& request) const;
  void UnbookLocked(const std::vector<int64_t>& budget) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The reservation of `request_id` when it exists (any state).
  ReservationPtr FindLocked(const std::string& request_id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Frees r's slots; its registrations move to `ended`.
  void EndLocked(Reservation& r, ReservedRuns& ended) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckClaimLocked(const Reservation& r, const kvrelay::v1::PushClaim& claim) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status AuthorizeBlocksLocked(const Reservation& r,
                                     const transfer::InboundEvent& event) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether `block` lies inside one of r's pushed slots of group g.
  bool InsideLocked(const Reservation& r, size_t g, const transfer::ReceivedBlock& block) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::vector<SlotGroup> groups_;
  Clock* const clock_;
  const ReservationTableOptions options_;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, ReservationPtr> reservations_ ABSL_GUARDED_BY(mu_);
  // Blocks per group booked by live reservations and sequences (never above the pool size).
  std::vector<int64_t> booked_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvrelay::decode

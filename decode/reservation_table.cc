#include "decode/reservation_table.h"

#include <algorithm>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kv/secret.h"
#include "proto/limits.h"

namespace kvrelay::decode {
namespace {

constexpr size_t kTokenBytes = 32;  // 256 bits

}  // namespace

ReservedRun::ReservedRun(int group, kv::SlotId first_slot, int64_t slot_count,
                         transfer::MemoryRegionPtr region, Gauge* live)
    : group_(group),
      first_slot_(first_slot),
      slot_count_(slot_count),
      region_(std::move(region)),
      live_(live) {
  if (live_ != nullptr) live_->Add(1);
}

ReservedRun::~ReservedRun() {
  region_.reset();
  if (live_ != nullptr) live_->Add(-1);
}

struct ReservationTable::Reservation {
  std::string request_id;
  std::string token;
  int32_t prompt_tokens = 0;
  int32_t full_blocks = 0;
  std::vector<std::vector<kv::SlotId>> slots;  // [group][block], -1 = not wanted
  int32_t held_blocks = 0;  // slots [0, held) of every group hold them; nobody pushes there
  std::vector<kv::BlockHash> held_hashes;
  int32_t expected_layers = 0;
  absl::Time expires;
  std::vector<int64_t> budget;  // booked blocks per group; moves to the taker
  int32_t layers_received = 0;
  int64_t bytes_received = 0;
  absl::Status transfer_status;
  bool taken = false;  // by its Generate
  bool released = false;
  absl::Time released_at;
  // Set by an allowed PushClaim: only this data-plane peer's blocks count.
  bool push_claimed = false;
  transfer::PeerId pusher = 0;
  ReservedRuns runs;  // --memory-key-scope reservation: registrations of the pushed slots

  bool quiet() const { return layers_received >= expected_layers; }
};

ReservationTable::ReservationTable(std::vector<SlotGroup> groups, Clock* clock,
                                   ReservationTableOptions options)
    : groups_(std::move(groups)), clock_(clock), options_(std::move(options)) {
  absl::MutexLock lock(&mu_);
  booked_.assign(groups_.size(), 0);
}

ReservationTable::~ReservationTable() {
  ReservedRuns ended;  // unmapped after the lock is released (declared first)
  absl::MutexLock lock(&mu_);
  for (auto& [tag, r] : reservations_) EndLocked(*r, ended);
  reservations_.clear();
}

void ReservationTable::FreeSlots(std::vector<std::vector<kv::SlotId>>& slots) const {
  for (size_t g = 0; g < slots.size() && g < groups_.size(); ++g) {
    for (kv::SlotId s : slots[g]) {
      if (s >= 0) (void)groups_[g].pool->Release(s);
    }
  }
  slots.clear();
}

void ReservationTable::EndLocked(Reservation& r, ReservedRuns& ended) const {
  for (std::unique_ptr<ReservedRun>& run : r.runs) ended.push_back(std::move(run));
  r.runs.clear();
  FreeSlots(r.slots);
  r.slots.resize(groups_.size());  // keep one (empty) row per group, as before
}

ReservationTable::ReservationPtr ReservationTable::FindLocked(const std::string& request_id) const {
  auto it = reservations_.find(options_.tag_of(request_id));
  return it == reservations_.end() ? nullptr : it->second;
}

void ReservationTable::SweepLocked(absl::Time now, ReservedRuns& ended) {
  for (auto it = reservations_.begin(); it != reservations_.end();) {
    Reservation& old = *it->second;
    const bool expired = !old.taken && now > old.expires;
    const bool released_and_quiet =
        old.released && (old.quiet() || now > old.released_at + options_.release_grace);
    if ((expired && !old.released) || released_and_quiet) {
      EndLocked(old, ended);
      UnbookLocked(old.budget);
      old.budget.clear();
      reservations_.erase(it++);
    } else {
      ++it;
    }
  }
}

absl::Status ReservationTable::CheckCapacityLocked(const std::vector<int64_t>& budget) const {
  for (size_t g = 0; g < groups_.size() && g < budget.size(); ++g) {
    const int64_t capacity = groups_[g].pool->num_slots();
    if (booked_[g] + budget[g] > capacity) {
      if (options_.capacity_refusals != nullptr) options_.capacity_refusals->Increment();
      return absl::ResourceExhaustedError(
          absl::StrCat("KV capacity: the request needs ", budget[g], " blocks of group ", g, ", ",
                       capacity - booked_[g], " of ", capacity, " are free"));
    }
  }
  return absl::OkStatus();
}

absl::Status ReservationTable::AllocateSlots(Reservation& r, ReservationRequest& request) const {
  r.slots.resize(groups_.size());
  for (size_t g = 0; g < groups_.size(); ++g) {
    const int group = static_cast<int>(g);
    std::vector<int64_t> wanted;
    for (int64_t b = r.held_blocks; b < r.full_blocks; ++b) {
      if (request.wanted(group, b)) wanted.push_back(b);
    }
    absl::StatusOr<std::vector<kv::SlotId>> slots =
        groups_[g].pool->AllocateMany(static_cast<int64_t>(wanted.size()));
    if (!slots.ok()) {
      return absl::ResourceExhaustedError(absl::StrCat("KV pool full: ", slots.status().message()));
    }
    r.slots[g].assign(static_cast<size_t>(r.full_blocks), -1);
    for (size_t i = 0; i < wanted.size(); ++i) r.slots[g][wanted[i]] = (*slots)[i];
    if (g >= request.held_slots.size()) continue;
    std::vector<kv::SlotId>& held = request.held_slots[g];
    for (int64_t b = 0; b < r.held_blocks && b < static_cast<int64_t>(held.size()); ++b) {
      if (request.wanted(group, b)) {
        r.slots[g][b] = held[b];
      } else {
        (void)groups_[g].pool->Release(held[b]);  // outside the window
      }
    }
    held.clear();
  }
  return absl::OkStatus();
}

absl::StatusOr<ReservationGrant> ReservationTable::Book(ReservationRequest request) {
  auto r = std::make_shared<Reservation>();
  r->request_id = request.request_id;
  r->prompt_tokens = request.prompt_tokens;
  r->full_blocks = request.full_blocks;
  r->expected_layers = request.expected_layers;
  r->held_blocks = request.held_blocks;
  r->held_hashes = std::move(request.held_hashes);
  r->budget = std::move(request.budget);
  // Destroyed after the lock is released (declared before it): held slots the reservation did
  // not take, and the registrations of swept reservations.
  absl::Cleanup free_unused_held = [this, &request] { FreeSlots(request.held_slots); };
  ReservedRuns ended;
  KV_ASSIGN_OR_RETURN(r->token, kv::RandomSecret(kTokenBytes));
  const uint64_t tag = options_.tag_of(r->request_id);

  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->Now();
  r->expires = now + std::min(options_.ttl, request.lifetime);
  SweepLocked(now, ended);
  if (reservations_.contains(tag)) {
    return absl::AlreadyExistsError(
        absl::StrCat("request_id '", r->request_id, "' is already reserved"));
  }
  // Admission: book everything the request can ever hold, or refuse now. Admitted requests
  // then never run out of KV mid-stream.
  KV_RETURN_IF_ERROR(CheckCapacityLocked(r->budget));
  if (absl::Status allocated = AllocateSlots(*r, request); !allocated.ok()) {
    EndLocked(*r, ended);
    return allocated;
  }
  for (size_t g = 0; g < booked_.size() && g < r->budget.size(); ++g) booked_[g] += r->budget[g];
  reservations_[tag] = r;
  return ReservationGrant{.token = r->token, .slots = r->slots};
}

void ReservationTable::AttachRuns(const std::string& request_id, const std::string& token,
                                  ReservedRuns runs) {
  ReservedRuns unused;  // destroyed after the lock is released (declared first)
  absl::MutexLock lock(&mu_);
  ReservationPtr r = FindLocked(request_id);
  // Released or swept meanwhile: the runs are unmapped on return.
  if (r == nullptr || !kv::SecretEquals(r->token, token) || r->released) {
    unused = std::move(runs);
    return;
  }
  r->runs = std::move(runs);
}

void ReservationTable::Cancel(const std::string& request_id, const std::string& token) {
  ReservedRuns ended;  // destroyed after the lock is released (declared first)
  absl::MutexLock lock(&mu_);
  ReservationPtr r = FindLocked(request_id);
  if (r == nullptr || !kv::SecretEquals(r->token, token)) return;
  EndLocked(*r, ended);
  UnbookLocked(r->budget);
  r->budget.clear();
  reservations_.erase(options_.tag_of(request_id));
}

absl::Status ReservationTable::Release(const std::string& request_id, const std::string& token) {
  ReservedRuns ended;  // destroyed after the lock is released (declared first)
  absl::MutexLock lock(&mu_);
  ReservationPtr r = FindLocked(request_id);
  if (r == nullptr || r->taken || r->released) return absl::OkStatus();
  if (!kv::SecretEquals(r->token, token)) {
    return absl::PermissionDeniedError(absl::StrCat("reservation_token: request '", request_id,
                                                    "' is reserved, and this is not its token"));
  }
  // Slots stay quarantined until the push finished or the grace period passed (SweepLocked).
  r->released = true;
  r->released_at = clock_->Now();
  // Its own registrations go now unless a claimed push may still be writing (an RDMA write
  // into an unmapped key fails and takes the pusher's whole connection down with it); then
  // with the slots, once quiet.
  if (!r->push_claimed || r->quiet()) {
    for (std::unique_ptr<ReservedRun>& run : r->runs) ended.push_back(std::move(run));
    r->runs.clear();
  }
  // A quiet one ends now: its slots and booking return with the Release.
  SweepLocked(r->released_at, ended);
  return absl::OkStatus();
}

void ReservationTable::Sweep() {
  ReservedRuns ended;  // destroyed after the lock is released (declared first)
  absl::MutexLock lock(&mu_);
  SweepLocked(clock_->Now(), ended);
}

absl::Status ReservationTable::CheckClaimLocked(const Reservation& r,
                                                const kvrelay::v1::PushClaim& claim) const {
  if (r.push_claimed) {
    return absl::PermissionDeniedError(
        absl::StrCat("the reservation of request '", r.request_id, "' was already claimed"));
  }
  if (claim.groups_size() != static_cast<int>(r.slots.size())) {
    return absl::PermissionDeniedError("claim names another number of layer groups");
  }
  for (int g = 0; g < claim.groups_size(); ++g) {
    const kvrelay::v1::GroupTarget& target = claim.groups(g);
    if (target.region_id() != groups_[g].region_id ||
        target.slot_stride_bytes() != groups_[g].pool->slot_stride() ||
        target.slots_size() != static_cast<int>(r.slots[g].size())) {
      return absl::PermissionDeniedError(
          absl::StrCat("claim group ", g, " is not the reservation's region or slot count"));
    }
    for (int b = 0; b < target.slots_size(); ++b) {
      if (target.slots(b) >= 0 && (b < r.held_blocks || target.slots(b) != r.slots[g][b])) {
        return absl::PermissionDeniedError(absl::StrCat("claim group ", g, " block ", b, ": slot ",
                                                        target.slots(b),
                                                        " is not the reservation's"));
      }
    }
  }
  return absl::OkStatus();
}

ClaimVerdict ReservationTable::Claim(const kvrelay::v1::PushClaim& claim, transfer::PeerId peer) {
  absl::MutexLock lock(&mu_);
  ReservationPtr r = FindLocked(claim.request_id());
  // One answer for "no such reservation" and "wrong token": a claim learns nothing.
  if (r == nullptr || r->request_id != claim.request_id() ||
      !kv::SecretEquals(r->token, claim.reservation_token())) {
    return {absl::PermissionDeniedError(absl::StrCat(
        "no live reservation of request '",
        claim.request_id().substr(0, limits::kMaxRequestIdBytes), "' has this token"))};
  }
  if (r->released || (!r->taken && clock_->Now() > r->expires)) {
    return {absl::PermissionDeniedError(absl::StrCat("the reservation of request '", r->request_id,
                                                     "' expired or was released")),
            /*expired=*/true};
  }
  if (absl::Status allowed = CheckClaimLocked(*r, claim); !allowed.ok()) return {allowed};
  r->push_claimed = true;
  r->pusher = peer;
  return {absl::OkStatus()};
}

bool ReservationTable::InsideLocked(const Reservation& r, size_t g,
                                    const transfer::ReceivedBlock& block) const {
  const uint64_t stride = groups_[g].pool->slot_stride();
  // The block's offset in the group's pool: the pool's own region (pool scope), or one of
  // this reservation's runs (reservation scope; the pool's region is then private).
  std::optional<uint64_t> pool_offset;
  if (!options_.per_reservation_keys) {
    if (groups_[g].region_id == block.region) pool_offset = block.offset;
  } else {
    for (const std::unique_ptr<ReservedRun>& run : r.runs) {
      if (run->group() == static_cast<int>(g) && run->region().id() == block.region &&
          block.offset < static_cast<uint64_t>(run->slot_count()) * stride) {
        pool_offset = static_cast<uint64_t>(run->first_slot()) * stride + block.offset;
      }
    }
  }
  if (!pool_offset.has_value()) return false;
  const uint64_t slot = *pool_offset / stride;
  const uint64_t within = *pool_offset % stride;
  if (block.length > stride - within) return false;
  for (size_t b = static_cast<size_t>(r.held_blocks); b < r.slots[g].size(); ++b) {
    const kv::SlotId s = r.slots[g][b];
    if (s >= 0 && static_cast<uint64_t>(s) == slot) return true;
  }
  return false;
}

absl::Status ReservationTable::AuthorizeBlocksLocked(const Reservation& r,
                                                     const transfer::InboundEvent& event) const {
  if (!kv::SecretEquals(r.token, event.credential)) {
    return absl::PermissionDeniedError("wrong reservation token");
  }
  if (!r.push_claimed || r.pusher != event.peer) {
    return absl::PermissionDeniedError("blocks from a peer that did not claim the reservation");
  }
  for (const transfer::ReceivedBlock& block : event.blocks) {
    bool inside = false;
    for (size_t g = 0; g < r.slots.size() && !inside; ++g) inside = InsideLocked(r, g, block);
    if (!inside) {
      return absl::PermissionDeniedError(absl::StrCat("block [", block.offset, ", +", block.length,
                                                      ") of region ", block.region,
                                                      " is outside the reservation's slots"));
    }
  }
  return absl::OkStatus();
}

absl::Status ReservationTable::Deliver(const transfer::InboundEvent& event) {
  absl::MutexLock lock(&mu_);
  auto it = reservations_.find(event.tag);
  if (it == reservations_.end()) {
    return absl::NotFoundError(absl::StrCat("blocks for an unknown request tag ", event.tag));
  }
  Reservation& r = *it->second;
  if (absl::Status allowed = AuthorizeBlocksLocked(r, event); !allowed.ok()) {
    // The holder of the token wrote outside its slots: its reservation is not used. Without
    // the token (or from another peer), the reservation is not the sender's to spoil.
    if (r.push_claimed && r.pusher == event.peer && r.transfer_status.ok()) {
      r.transfer_status = allowed;
    }
    return absl::PermissionDeniedError(
        absl::StrCat("request '", r.request_id, "': ", allowed.message()));
  }
  r.layers_received +=
      std::max(0, std::min(event.layers.end, options_.num_layers) - event.layers.begin);
  for (const transfer::ReceivedBlock& b : event.blocks) r.bytes_received += b.length;
  if (!event.status.ok() && r.transfer_status.ok()) r.transfer_status = event.status;
  return absl::OkStatus();
}

absl::StatusOr<std::optional<TakenReservation>> ReservationTable::Take(
    const std::string& request_id, const std::string& token, int32_t prompt_tokens,
    absl::Time wait_deadline) {
  ReservedRuns ended;  // destroyed after the lock is released (declared first)
  absl::MutexLock lock(&mu_);
  ReservationPtr r = FindLocked(request_id);
  if (r == nullptr || r->released) return std::nullopt;
  if (!kv::SecretEquals(r->token, token)) {
    return absl::PermissionDeniedError(absl::StrCat("reservation_token: request '", request_id,
                                                    "' is reserved, and this is not its token"));
  }
  if (r->taken) return absl::InvalidArgumentError("request_id: this request is already generating");
  if (r->prompt_tokens != prompt_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("tokens: reserved for ", r->prompt_tokens,
                                                   " prompt tokens, got ", prompt_tokens));
  }
  r->taken = true;
  auto arrived = [&r]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return r->quiet() || !r->transfer_status.ok();
  };
  mu_.AwaitWithDeadline(absl::Condition(&arrived), wait_deadline);
  // Its registrations end with the wait: the push is terminal, or its time is up and the NIC
  // should refuse the rest.
  for (std::unique_ptr<ReservedRun>& run : r->runs) ended.push_back(std::move(run));
  r->runs.clear();
  reservations_.erase(options_.tag_of(request_id));
  // Out of the table: no delivery reaches it any more, so this is its final state.
  TakenReservation taken;
  taken.full_blocks = r->full_blocks;
  taken.held_blocks = r->held_blocks;
  taken.held_hashes = std::move(r->held_hashes);
  taken.slots = std::move(r->slots);
  taken.budget = std::move(r->budget);
  taken.complete = r->quiet();
  taken.transfer_status = r->transfer_status;
  taken.bytes_received = r->bytes_received;
  return taken;
}

bool ReservationTable::TryBook(const std::vector<int64_t>& budget) {
  absl::MutexLock lock(&mu_);
  for (size_t g = 0; g < budget.size() && g < groups_.size(); ++g) {
    if (booked_[g] + budget[g] > groups_[g].pool->num_slots()) return false;
  }
  for (size_t g = 0; g < budget.size() && g < booked_.size(); ++g) booked_[g] += budget[g];
  return true;
}

void ReservationTable::Unbook(const std::vector<int64_t>& budget) {
  absl::MutexLock lock(&mu_);
  UnbookLocked(budget);
}

void ReservationTable::UnbookLocked(const std::vector<int64_t>& budget) {
  for (size_t g = 0; g < budget.size() && g < booked_.size(); ++g) booked_[g] -= budget[g];
}

ReservationLoad ReservationTable::Load() const {
  ReservationLoad load;
  for (const SlotGroup& group : groups_) load.capacity.push_back(group.pool->num_slots());
  const absl::Time now = clock_->Now();
  absl::MutexLock lock(&mu_);
  load.reservations = static_cast<int32_t>(reservations_.size());
  // A lapsed one waits for nothing (the next Book sweeps it): a drain does not wait for it.
  for (const auto& [tag, r] : reservations_) {
    load.waiting += !r->taken && !r->released && now <= r->expires;
  }
  load.booked = booked_;
  return load;
}

}  // namespace kvrelay::decode

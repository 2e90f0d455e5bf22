#include "transfer/transport.h"

#include <algorithm>
#include <atomic>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kv/checksum.h"
#include "kv/secret.h"
#include "transfer/internal/handle_state.h"

namespace kvrelay::transfer {

const char* DirectionName(Direction d) { return d == Direction::kPut ? "put" : "get"; }

namespace {

template <typename T>
std::pair<size_t, size_t> LayerIndexRange(const std::vector<T>& items, LayerRange layers) {
  auto lo = std::lower_bound(items.begin(), items.end(), layers.begin,
                             [](const T& item, int32_t l) { return item.layer < l; });
  auto hi = std::lower_bound(lo, items.end(), layers.end,
                             [](const T& item, int32_t l) { return item.layer < l; });
  return {static_cast<size_t>(lo - items.begin()), static_cast<size_t>(hi - items.begin())};
}

}  // namespace

std::pair<size_t, size_t> TransferPlan::BlockRange(LayerRange layers) const {
  return LayerIndexRange(blocks, layers);
}
std::pair<size_t, size_t> TransferPlan::SegmentRange(LayerRange layers) const {
  return LayerIndexRange(segments, layers);
}

// --- Private regions: unsupported unless a transport says otherwise -----------------------

namespace {
absl::Status NoPrivateRegions(const Transport& t) {
  return absl::UnimplementedError(absl::StrCat("transport '", t.capabilities().name,
                                               "' has no private regions (memory keys handed "
                                               "out per reservation need ucx)"));
}
}  // namespace

absl::StatusOr<MemoryRegionPtr> Transport::AllocatePrivateMemory(size_t) {
  return NoPrivateRegions(*this);
}
absl::StatusOr<MemoryRegionPtr> Transport::RegisterPrivateMemory(MemorySpan, MemoryKind) {
  return NoPrivateRegions(*this);
}
absl::StatusOr<std::string> Transport::ExportRegion(const MemoryRegion&) const {
  return NoPrivateRegions(*this);
}
absl::StatusOr<RegionId> Transport::ImportRegion(PeerId, std::string_view) {
  return NoPrivateRegions(*this);
}
absl::Status Transport::ForgetRegion(PeerId, RegionId) { return NoPrivateRegions(*this); }

// --- TransferHandle ------------------------------------------------------------------------

TransferHandle::TransferHandle(std::shared_ptr<internal::HandleState> state)
    : state_(std::move(state)) {}

TransferHandle::~TransferHandle() {
  if (state_ == nullptr || state_->done()) return;
  state_->Cancel();
  // Implementations guarantee termination after Cancel() once nothing can write into the
  // buffers any more (see the class comment: a pull towards a lost peer can take long).
  state_->Wait(absl::InfiniteFuture()).IgnoreError();
}

std::optional<absl::Status> TransferHandle::Poll() const { return state_->Poll(); }
absl::Status TransferHandle::Wait(absl::Time deadline) const { return state_->Wait(deadline); }
void TransferHandle::Cancel() { state_->Cancel(); }
std::vector<absl::Status> TransferHandle::block_statuses() const {
  return state_->block_statuses();
}
int64_t TransferHandle::bytes() const { return state_->bytes(); }

// --- InboundQueue ----------------------------------------------------------------------------

InboundHandler InboundQueue::Handler() {
  return [this](InboundEvent event) { Push(std::move(event)); };
}

void InboundQueue::Push(InboundEvent event) {
  absl::MutexLock lock(&mu_);
  events_.push_back(std::move(event));
}

absl::StatusOr<InboundEvent> InboundQueue::Next(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return head_ < events_.size(); };
  mu_.AwaitWithDeadline(absl::Condition(&ready), deadline);
  if (!ready()) return absl::DeadlineExceededError("no inbound transfer event before deadline");
  InboundEvent event = std::move(events_[head_++]);
  if (head_ == events_.size()) {
    events_.clear();
    head_ = 0;
  }
  return event;
}

absl::StatusOr<InboundEvent> InboundQueue::NextOfKind(InboundEvent::Kind kind,
                                                      absl::Time deadline) {
  while (true) {
    absl::StatusOr<InboundEvent> event = Next(deadline);
    if (!event.ok() || event->kind == kind) return event;
  }
}

size_t InboundQueue::size() const {
  absl::MutexLock lock(&mu_);
  return events_.size() - head_;
}

namespace internal {

uint64_t NewIncarnation() {
  std::random_device rd;
  uint64_t v = 0;
  while (v == 0) v = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  return v;
}

uint64_t NextRegionId() {
  static std::atomic<uint64_t> next{
      (NewIncarnation() % ((uint64_t{1} << 62) - (uint64_t{1} << 32))) + (uint64_t{1} << 32)};
  return next.fetch_add(1);
}

// --- HandleState -----------------------------------------------------------------------------

bool HandleState::Complete(absl::Status status, std::vector<absl::Status> block_statuses) {
  std::vector<absl::AnyInvocable<void(const absl::Status&)>> callbacks;
  {
    absl::MutexLock lock(&mu_);
    if (status_.has_value()) return false;
    if (block_statuses.size() != num_blocks_) block_statuses.assign(num_blocks_, status);
    status_ = status;
    block_statuses_ = std::move(block_statuses);
    callbacks.swap(on_done_);
    cancel_fn_ = nullptr;
  }
  for (auto& cb : callbacks) cb(status);
  return true;
}

bool HandleState::CompleteBlocks(std::vector<absl::Status> blocks) {
  absl::Status summary = SummarizeBlocks(blocks);
  return Complete(std::move(summary), std::move(blocks));
}

std::optional<absl::Status> HandleState::Poll() const {
  absl::MutexLock lock(&mu_);
  return status_;
}

bool HandleState::done() const {
  absl::MutexLock lock(&mu_);
  return status_.has_value();
}

absl::Status HandleState::Wait(absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return status_.has_value(); };
  mu_.AwaitWithDeadline(absl::Condition(&done), deadline);
  if (!status_.has_value()) {
    return absl::DeadlineExceededError("wait ran out; the transfer is still running");
  }
  return *status_;
}

void HandleState::Cancel() {
  absl::AnyInvocable<void()> fn;
  {
    absl::MutexLock lock(&mu_);
    if (status_.has_value() || cancel_requested_) return;
    cancel_requested_ = true;
    if (cancel_fn_ != nullptr && !cancel_fn_called_) {
      cancel_fn_called_ = true;
      fn = std::move(cancel_fn_);
    }
  }
  if (fn != nullptr) fn();
}

bool HandleState::cancel_requested() const {
  absl::MutexLock lock(&mu_);
  return cancel_requested_;
}

void HandleState::SetCancelFn(absl::AnyInvocable<void()> fn) {
  {
    absl::MutexLock lock(&mu_);
    if (status_.has_value()) return;
    if (!cancel_requested_) {
      cancel_fn_ = std::move(fn);
      return;
    }
    cancel_fn_called_ = true;
  }
  fn();
}

void HandleState::OnDone(absl::AnyInvocable<void(const absl::Status&)> fn) {
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    if (!status_.has_value()) {
      on_done_.push_back(std::move(fn));
      return;
    }
    status = *status_;
  }
  fn(status);
}

std::vector<absl::Status> HandleState::block_statuses() const {
  absl::MutexLock lock(&mu_);
  return block_statuses_;
}

TransferHandlePtr MakeDoneHandle(absl::Status status, size_t num_blocks) {
  auto state = std::make_shared<HandleState>(0, num_blocks);
  state->Complete(std::move(status));
  return std::make_unique<TransferHandle>(std::move(state));
}

// --- Plans -----------------------------------------------------------------------------------

absl::StatusOr<TransferPlan> BuildPlan(
    const void* transport, const TransferBatch& batch,
    const std::function<bool(const MemoryRegion*)>& is_local_region,
    const std::function<absl::StatusOr<uint64_t>(RegionId)>& remote_region_size) {
  if (batch.blocks.empty()) return absl::InvalidArgumentError("transfer batch has no blocks");
  if (batch.credential.size() > kMaxCredentialBytes) {
    return absl::InvalidArgumentError(absl::StrCat("transfer credential of ",
                                                   batch.credential.size(), " bytes exceeds ",
                                                   kMaxCredentialBytes));
  }
  for (size_t i = 0; i < batch.blocks.size(); ++i) {
    const BlockTransfer& b = batch.blocks[i];
    if (b.local == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("block ", i, ": local region is null"));
    }
    if (b.local->owner() != transport || !is_local_region(b.local)) {
      return absl::InvalidArgumentError(absl::StrCat("block ", i, ": local region ", b.local->id(),
                                                     " is not registered with this transport"));
    }
    if (b.length == 0) {
      return absl::InvalidArgumentError(absl::StrCat("block ", i, ": length is zero"));
    }
    if (b.layer < 0) {
      return absl::InvalidArgumentError(absl::StrCat("block ", i, ": negative layer ", b.layer));
    }
    if (b.local_offset > b.local->size_bytes() ||
        b.length > b.local->size_bytes() - b.local_offset) {
      return absl::InvalidArgumentError(absl::StrCat(
          "block ", i, ": local range [", b.local_offset, ", +", b.length, ") is outside region ",
          b.local->id(), " of ", b.local->size_bytes(), " bytes"));
    }
    absl::StatusOr<uint64_t> remote_size = remote_region_size(b.remote_region);
    if (!remote_size.ok()) return remote_size.status();
    if (b.remote_offset > *remote_size || b.length > *remote_size - b.remote_offset) {
      return absl::InvalidArgumentError(absl::StrCat(
          "block ", i, ": remote range [", b.remote_offset, ", +", b.length,
          ") is outside the peer's region ", b.remote_region, " of ", *remote_size, " bytes"));
    }
  }
  TransferPlan plan;
  plan.transport = transport;
  plan.peer = batch.peer;
  plan.direction = batch.direction;
  plan.tag = batch.tag;
  plan.compute_checksums = batch.compute_checksums;
  plan.credential = batch.credential;
  plan.blocks = batch.blocks;
  std::stable_sort(
      plan.blocks.begin(), plan.blocks.end(),
      [](const BlockTransfer& a, const BlockTransfer& b) { return a.layer < b.layer; });
  for (const BlockTransfer& b : plan.blocks) {
    if (!plan.segments.empty()) {
      Segment& last = plan.segments.back();
      if (last.layer == b.layer && last.local == b.local &&
          last.local_offset + last.length == b.local_offset &&
          last.remote_region == b.remote_region &&
          last.remote_offset + last.length == b.remote_offset) {
        last.length += b.length;
        continue;
      }
    }
    plan.segments.push_back(
        Segment{b.local, b.local_offset, b.remote_region, b.remote_offset, b.length, b.layer});
  }
  return plan;
}

absl::Status CheckPost(const void* transport, const TransferPlan& plan, LayerRange layers) {
  if (plan.transport != transport) {
    return absl::InvalidArgumentError("plan was prepared by another transport");
  }
  if (layers.begin >= layers.end) {
    return absl::InvalidArgumentError(
        absl::StrCat("empty layer range [", layers.begin, ", ", layers.end, ")"));
  }
  auto [lo, hi] = plan.BlockRange(layers);
  if (lo == hi) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan has no blocks in layers [", layers.begin, ", ", layers.end, ")"));
  }
  return absl::OkStatus();
}

std::vector<BlockTransfer> BlocksForPost(const TransferPlan& plan, LayerRange layers) {
  auto [lo, hi] = plan.BlockRange(layers);
  std::vector<BlockTransfer> blocks(plan.blocks.begin() + lo, plan.blocks.begin() + hi);
  if (plan.direction == Direction::kPut && plan.compute_checksums) {
    for (BlockTransfer& b : blocks) {
      if (!b.checksum.has_value()) {
        b.checksum = kv::BlockChecksum(b.local->data() + b.local_offset, b.length);
      }
    }
  }
  return blocks;
}

absl::Status VerifyBlock(const uint8_t* data, uint64_t length, std::optional<uint64_t> checksum,
                         RegionId region, uint64_t offset) {
  if (!checksum.has_value()) return absl::OkStatus();
  uint64_t actual = kv::BlockChecksum(data, length);
  if (actual == *checksum) return absl::OkStatus();
  return absl::DataLossError(absl::StrCat("checksum mismatch in region ", region, " at offset ",
                                          offset, " (", length, " bytes): expected ", *checksum,
                                          ", got ", actual));
}

bool PeerKeyAccepted(const std::string& accept_key, std::string_view presented) {
  return accept_key.empty() || kv::SecretEquals(accept_key, presented);
}

absl::Status SummarizeBlocks(const std::vector<absl::Status>& blocks) {
  size_t failed = 0;
  const absl::Status* first = nullptr;
  for (const absl::Status& s : blocks) {
    if (!s.ok()) {
      ++failed;
      if (first == nullptr) first = &s;
    }
  }
  if (first == nullptr) return absl::OkStatus();
  return absl::Status(first->code(), absl::StrCat(failed, " of ", blocks.size(),
                                                  " blocks failed; first: ", first->message()));
}

}  // namespace internal
}  // namespace kvrelay::transfer

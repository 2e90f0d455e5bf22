#include "transfer/faulty_transport.h"

#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "kv/checksum.h"
#include "transfer/internal/handle_state.h"

namespace kvrelay::transfer {

using internal::HandleState;

class FaultyTransport::Impl {
 public:
  ~Impl() {
    std::vector<std::thread> threads;
    {
      absl::MutexLock lock(&mu_);
      threads.swap(threads_);
    }
    for (std::thread& t : threads) t.join();
  }

  FaultSpec spec() {
    absl::MutexLock lock(&mu_);
    return spec_;
  }
  void set_spec(FaultSpec spec) {
    absl::MutexLock lock(&mu_);
    spec_ = spec;
  }
  int64_t NextPost() {
    absl::MutexLock lock(&mu_);
    return ++posts_;
  }
  int64_t posts() {
    absl::MutexLock lock(&mu_);
    return posts_;
  }
  void Spawn(std::thread t) {
    absl::MutexLock lock(&mu_);
    threads_.push_back(std::move(t));
  }

 private:
  absl::Mutex mu_;
  FaultSpec spec_ ABSL_GUARDED_BY(mu_);
  int64_t posts_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
};

FaultyTransport::FaultyTransport(TransportPtr inner, FaultSpec spec)
    : inner_(std::move(inner)), impl_(std::make_unique<Impl>()) {
  impl_->set_spec(spec);
}

// Joins the fault threads (which may still use inner_) before inner_ goes.
FaultyTransport::~FaultyTransport() { impl_.reset(); }

void FaultyTransport::SetFaults(FaultSpec spec) { impl_->set_spec(spec); }
int64_t FaultyTransport::posts() const { return impl_->posts(); }

namespace {

// Shared between the caller's handle and the fault thread.
struct FaultOp {
  std::shared_ptr<HandleState> outer;
  absl::Notification cancelled;
  absl::Mutex mu;
  std::shared_ptr<TransferHandle> inner ABSL_GUARDED_BY(mu);
};

}  // namespace

absl::StatusOr<TransferHandlePtr> FaultyTransport::Post(const TransferPlan& plan, LayerRange layers,
                                                        PostOptions options) {
  const int64_t n = impl_->NextPost();
  const FaultSpec spec = impl_->spec();
  auto [lo, hi] = plan.BlockRange(layers);
  if (spec.fail_after >= 0 && n > spec.fail_after) {
    return internal::MakeDoneHandle(
        absl::UnavailableError(
            absl::StrCat("injected fault: post ", n, " fails (fail_after=", spec.fail_after, ")")),
        hi - lo);
  }
  if ((!spec.drop && spec.delay <= absl::ZeroDuration() && !spec.corrupt) ||
      (spec.only.has_value() && *spec.only != plan.direction)) {
    return inner_->Post(plan, layers, options);
  }
  if (lo == hi) return inner_->Post(plan, layers, options);  // let the inner report it

  int64_t bytes = 0;
  for (size_t i = lo; i < hi; ++i) bytes += plan.blocks[i].length;
  auto op = std::make_shared<FaultOp>();
  op->outer = std::make_shared<HandleState>(bytes, hi - lo);
  op->outer->SetCancelFn([op_weak = std::weak_ptr<FaultOp>(op)] {
    std::shared_ptr<FaultOp> op = op_weak.lock();
    if (op == nullptr) return;
    if (!op->cancelled.HasBeenNotified()) op->cancelled.Notify();
    std::shared_ptr<TransferHandle> inner;
    {
      absl::MutexLock lock(&op->mu);
      inner = op->inner;
    }
    if (inner != nullptr) inner->Cancel();
  });
  // The fault thread works on its own copy of the plan, with checksums filled in so that a
  // corrupted put is detected by the receiver.
  TransferPlan copy = plan;
  if (plan.direction == Direction::kPut && plan.compute_checksums) {
    for (size_t i = lo; i < hi; ++i) {
      BlockTransfer& b = copy.blocks[i];
      if (!b.checksum.has_value()) {
        b.checksum = kv::BlockChecksum(b.local->data() + b.local_offset, b.length);
      }
    }
  }
  const absl::Time start = absl::Now();
  Transport* inner = inner_.get();
  impl_->Spawn(std::thread([op, copy = std::move(copy), layers, options, spec, start,
                            first_block = lo, inner] {
    auto finish_if_stopped = [&]() {
      if (op->cancelled.HasBeenNotified()) {
        op->outer->Complete(absl::CancelledError("transfer cancelled"));
        return true;
      }
      if (absl::Now() >= options.deadline) {
        op->outer->Complete(absl::DeadlineExceededError("injected delay/drop: deadline passed"));
        return true;
      }
      return false;
    };
    if (spec.drop) {
      op->cancelled.WaitForNotificationWithDeadline(options.deadline);
      if (!finish_if_stopped()) op->outer->Complete(absl::InternalError("dropped transfer"));
      return;
    }
    if (spec.delay > absl::ZeroDuration()) {
      op->cancelled.WaitForNotificationWithDeadline(std::min(start + spec.delay, options.deadline));
    }
    if (finish_if_stopped()) return;
    const BlockTransfer& first = copy.blocks[first_block];
    uint8_t* flip = first.local->data() + first.local_offset + first.length / 2;
    const bool corrupt_put = spec.corrupt && copy.direction == Direction::kPut;
    if (corrupt_put) *flip ^= 0x5a;
    absl::StatusOr<TransferHandlePtr> posted = inner->Post(copy, layers, options);
    if (!posted.ok()) {
      if (corrupt_put) *flip ^= 0x5a;
      op->outer->Complete(posted.status());
      return;
    }
    std::shared_ptr<TransferHandle> handle(std::move(*posted));
    {
      absl::MutexLock lock(&op->mu);
      op->inner = handle;
    }
    if (op->cancelled.HasBeenNotified()) handle->Cancel();
    absl::Status status = handle->Wait(absl::InfiniteFuture());
    std::vector<absl::Status> blocks = handle->block_statuses();
    if (corrupt_put) *flip ^= 0x5a;
    if (spec.corrupt && copy.direction == Direction::kGet && status.ok()) {
      *flip ^= 0x5a;
      if (!blocks.empty()) {
        blocks[0] = internal::VerifyBlock(first.local->data() + first.local_offset, first.length,
                                          first.checksum, first.local->id(), first.local_offset);
        status = internal::SummarizeBlocks(blocks);
      }
    }
    op->outer->Complete(status, std::move(blocks));
  }));
  return std::make_unique<TransferHandle>(op->outer);
}

}  // namespace kvrelay::transfer

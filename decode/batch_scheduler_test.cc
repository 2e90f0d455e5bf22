#include "decode/batch_scheduler.h"

#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace kvrelay::decode {
namespace {

using ::kvrelay::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::IsEmpty;

// A sequence whose first token is id * 100; each step adds one to the last token.
class FakeSequence : public BatchSequence {
 public:
  FakeSequence(int32_t id, int32_t max_tokens, int32_t eos_token = -1)
      : BatchSequence(max_tokens, eos_token), id(id) {}
  const int32_t id;
  bool fail_prefill = false;
};

struct Retired {
  int32_t id;
  absl::StatusCode code;
  bool stream_done;  // whether the stream already saw done when Retire ran
};

// The model the scheduler drives: records every step's batch and every retirement. With
// gated(), each step waits for a permit from the test.
class FakeModel : public BatchModel {
 public:
  absl::StatusOr<int32_t> Prefill(BatchSequence& seq) override {
    auto& s = static_cast<FakeSequence&>(seq);
    if (s.fail_prefill) return absl::InternalError("prefill failed");
    return s.id * 100;
  }

  absl::StatusOr<std::vector<int32_t>> Step(absl::Span<BatchSequence* const> batch) override {
    std::vector<int32_t> ids;
    std::vector<int32_t> tokens;
    for (BatchSequence* seq : batch) {
      ids.push_back(static_cast<FakeSequence*>(seq)->id);
      tokens.push_back(seq->last_token() + 1);
    }
    absl::MutexLock lock(&mu_);
    steps_.push_back(std::move(ids));
    if (gated_) {
      auto permitted = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return permits_ > 0; };
      mu_.Await(absl::Condition(&permitted));
      --permits_;
    }
    if (!step_error_.ok()) return step_error_;
    if (short_step_) tokens.pop_back();
    return tokens;
  }

  void Retire(BatchSequence& seq, const absl::Status& status) override {
    const bool done = seq.done();
    absl::MutexLock lock(&mu_);
    retired_.push_back({static_cast<FakeSequence&>(seq).id, status.code(), done});
  }

  void Gate() {
    absl::MutexLock lock(&mu_);
    gated_ = true;
  }
  void Permit(int n) {
    absl::MutexLock lock(&mu_);
    permits_ += n;
  }
  void FailSteps(absl::Status error) {
    absl::MutexLock lock(&mu_);
    step_error_ = std::move(error);
  }
  void ShortSteps() {
    absl::MutexLock lock(&mu_);
    short_step_ = true;
  }
  // Waits until `n` steps have begun.
  void AwaitSteps(size_t n) {
    absl::MutexLock lock(&mu_);
    auto reached = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return steps_.size() >= n; };
    mu_.Await(absl::Condition(&reached));
  }
  std::vector<std::vector<int32_t>> steps() {
    absl::MutexLock lock(&mu_);
    return steps_;
  }
  std::vector<Retired> retired() {
    absl::MutexLock lock(&mu_);
    return retired_;
  }

 private:
  absl::Mutex mu_;
  std::vector<std::vector<int32_t>> steps_ ABSL_GUARDED_BY(mu_);
  std::vector<Retired> retired_ ABSL_GUARDED_BY(mu_);
  bool gated_ ABSL_GUARDED_BY(mu_) = false;
  int permits_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status step_error_ ABSL_GUARDED_BY(mu_);
  bool short_step_ ABSL_GUARDED_BY(mu_) = false;
};

struct Streamed {
  std::vector<int32_t> tokens;
  absl::Status status;
};

// Reads the stream to its end, as Generate does.
Streamed ReadAll(BatchSequence& seq) {
  Streamed streamed;
  while (true) {
    BatchSequence::Output out = seq.Await(absl::InfiniteFuture());
    streamed.tokens.insert(streamed.tokens.end(), out.tokens.begin(), out.tokens.end());
    if (out.done) {
      streamed.status = out.status;
      return streamed;
    }
  }
}

std::shared_ptr<FakeSequence> Seq(int32_t id, int32_t max_tokens, int32_t eos = -1) {
  return std::make_shared<FakeSequence>(id, max_tokens, eos);
}

TEST(BatchScheduler, RunsASequenceToItsLength) {
  FakeModel model;
  BatchScheduler scheduler({.max_batch = 4, .max_queued = 4}, &model);
  auto a = Seq(1, 4);
  scheduler.Submit(a);
  scheduler.Start();
  Streamed out = ReadAll(*a);
  KV_EXPECT_OK(out.status);
  EXPECT_THAT(out.tokens, ElementsAre(100, 101, 102, 103));
  ASSERT_EQ(model.retired().size(), 1u);
  EXPECT_EQ(model.retired()[0].code, absl::StatusCode::kOk);
  EXPECT_FALSE(model.retired()[0].stream_done) << "resources go before the stream sees done";
}

TEST(BatchScheduler, StopsAtTheEosToken) {
  FakeModel model;
  BatchScheduler scheduler({}, &model);
  auto a = Seq(1, 100, /*eos=*/102);
  auto b = Seq(2, 1, /*eos=*/7);  // finished by its first token: never stepped
  scheduler.Submit(a);
  scheduler.Submit(b);
  scheduler.Start();
  EXPECT_THAT(ReadAll(*a).tokens, ElementsAre(100, 101, 102));
  EXPECT_THAT(ReadAll(*b).tokens, ElementsAre(200));
  for (const std::vector<int32_t>& step : model.steps()) EXPECT_THAT(step, ElementsAre(1));
}

TEST(BatchScheduler, AdmissionCountsRunningAndQueued) {
  FakeModel model;
  BatchScheduler scheduler({.max_batch = 2, .max_queued = 1}, &model);
  EXPECT_FALSE(scheduler.Full());
  std::vector<std::shared_ptr<FakeSequence>> seqs = {Seq(1, 2), Seq(2, 2), Seq(3, 2)};
  for (size_t i = 0; i < seqs.size(); ++i) {
    EXPECT_FALSE(scheduler.Full()) << i;
    scheduler.Submit(seqs[i]);
  }
  EXPECT_TRUE(scheduler.Full()) << "max_batch + max_queued wait";
  const BatchScheduler::Counts counts = scheduler.counts();
  EXPECT_EQ(counts.queued, 3);
  EXPECT_EQ(counts.active, 3);
  EXPECT_EQ(counts.running, 0);
  scheduler.Start();
  for (auto& seq : seqs) KV_EXPECT_OK(ReadAll(*seq).status);
  for (const std::vector<int32_t>& step : model.steps()) EXPECT_LE(step.size(), 2u);
}

TEST(BatchScheduler, SequencesJoinAndLeaveBetweenSteps) {
  FakeModel model;
  BatchScheduler scheduler({.max_batch = 2, .max_queued = 8}, &model);
  auto a = Seq(1, 4);
  auto b = Seq(2, 2);
  auto c = Seq(3, 3);
  for (auto& seq : {a, b, c}) scheduler.Submit(seq);
  scheduler.Start();
  EXPECT_THAT(ReadAll(*a).tokens, ElementsAre(100, 101, 102, 103));
  EXPECT_THAT(ReadAll(*b).tokens, ElementsAre(200, 201));
  EXPECT_THAT(ReadAll(*c).tokens, ElementsAre(300, 301, 302));
  // b leaves after the first step; c, queued behind the full batch, takes its place.
  EXPECT_THAT(model.steps(), ElementsAre(ElementsAre(1, 2), ElementsAre(1, 3), ElementsAre(1, 3)));
}

TEST(BatchScheduler, ANewSequenceJoinsARunningBatch) {
  FakeModel model;
  model.Gate();
  BatchScheduler scheduler({.max_batch = 4, .max_queued = 4}, &model);
  auto a = Seq(1, 3);
  scheduler.Submit(a);
  scheduler.Start();
  model.AwaitSteps(1);  // a's first step is under way
  auto b = Seq(2, 2);
  scheduler.Submit(b);
  model.Permit(100);
  EXPECT_THAT(ReadAll(*a).tokens, ElementsAre(100, 101, 102));
  EXPECT_THAT(ReadAll(*b).tokens, ElementsAre(200, 201));
  EXPECT_THAT(model.steps(), ElementsAre(ElementsAre(1), ElementsAre(1, 2)));
}

TEST(BatchScheduler, ACancelledSequenceLeavesBeforeTheNextStep) {
  FakeModel model;
  BatchScheduler scheduler({}, &model);
  auto a = Seq(1, 100);
  auto b = Seq(2, 3);
  a->Cancel();
  scheduler.Submit(a);
  scheduler.Submit(b);
  scheduler.Start();
  Streamed out = ReadAll(*a);
  EXPECT_THAT(out.status, StatusIs(absl::StatusCode::kCancelled));
  EXPECT_THAT(out.tokens, ElementsAre(100));  // its prefill ran; no step did
  KV_EXPECT_OK(ReadAll(*b).status);
  for (const std::vector<int32_t>& step : model.steps()) EXPECT_THAT(step, ElementsAre(2));
}

TEST(BatchScheduler, AFailedPrefillEndsOnlyThatSequence) {
  FakeModel model;
  BatchScheduler scheduler({}, &model);
  auto a = Seq(1, 3);
  a->fail_prefill = true;
  auto b = Seq(2, 2);
  scheduler.Submit(a);
  scheduler.Submit(b);
  scheduler.Start();
  Streamed failed = ReadAll(*a);
  EXPECT_THAT(failed.status, StatusIs(absl::StatusCode::kInternal));
  EXPECT_THAT(failed.tokens, IsEmpty());
  EXPECT_THAT(ReadAll(*b).tokens, ElementsAre(200, 201));
}

TEST(BatchScheduler, AFailedStepEndsTheWholeBatch) {
  FakeModel model;
  model.FailSteps(absl::DataLossError("device fault"));
  BatchScheduler scheduler({}, &model);
  auto a = Seq(1, 3);
  auto b = Seq(2, 3);
  scheduler.Submit(a);
  scheduler.Submit(b);
  scheduler.Start();
  EXPECT_THAT(ReadAll(*a).status, StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(ReadAll(*b).status, StatusIs(absl::StatusCode::kDataLoss));
}

TEST(BatchScheduler, AStepWithTooFewTokensIsAnError) {
  FakeModel model;
  model.ShortSteps();
  BatchScheduler scheduler({}, &model);
  auto a = Seq(1, 3);
  scheduler.Submit(a);
  scheduler.Start();
  EXPECT_THAT(ReadAll(*a).status, StatusIs(absl::StatusCode::kInternal));
}

TEST(BatchScheduler, StopRetiresRunningAndQueuedSequences) {
  FakeModel model;
  model.Gate();
  BatchScheduler scheduler({.max_batch = 1, .max_queued = 4}, &model);
  auto a = Seq(1, 1 << 30);
  auto b = Seq(2, 3);
  scheduler.Submit(a);
  scheduler.Start();
  model.AwaitSteps(1);
  scheduler.Submit(b);  // waits behind the full batch
  std::thread stopper([&scheduler] { scheduler.Stop(); });
  model.Permit(1 << 30);
  stopper.join();
  EXPECT_THAT(ReadAll(*a).status, StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_THAT(ReadAll(*b).status, StatusIs(absl::StatusCode::kUnavailable));
  auto late = Seq(3, 3);
  scheduler.Submit(late);
  EXPECT_THAT(ReadAll(*late).status, StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_EQ(model.retired().size(), 3u);
  for (const Retired& r : model.retired()) EXPECT_FALSE(r.stream_done) << r.id;
}

}  // namespace
}  // namespace kvrelay::decode

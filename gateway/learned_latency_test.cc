#include "gateway/learned_latency.h"

#include "gtest/gtest.h"

namespace kvrelay::gateway {
namespace {

const absl::Time kStart = absl::FromUnixSeconds(1000);

TEST(LearnedLatency, IsThePriorUntilSampledThenAnEwma) {
  LearnedLatency l({.weight = 0.5, .half_life = absl::Seconds(5)});
  EXPECT_FALSE(l.Last().has_value());
  EXPECT_DOUBLE_EQ(l.Value(kStart, 0.1), 0.1);
  l.Observe(0.2, kStart);
  EXPECT_DOUBLE_EQ(l.Value(kStart, 0.1), 0.2);  // the first sample is taken as it is
  l.Observe(0.4, kStart);
  EXPECT_DOUBLE_EQ(l.Value(kStart, 0.1), 0.3);
}

// A node that was slow (a hung or cut-off worker's penalty) drifts back toward the fleet's
// figure while nobody sends it anything: half the distance per half-life.
TEST(LearnedLatency, ForgetsTowardThePriorWhileNotSampled) {
  LearnedLatency l({.weight = 0.3, .half_life = absl::Seconds(5)});
  l.Observe(0.1, kStart);
  l.ObservePenalty(2.0, kStart);  // a 2 s timeout is believed at once
  EXPECT_DOUBLE_EQ(l.Value(kStart, 0.1), 2.0);
  EXPECT_NEAR(l.Value(kStart + absl::Seconds(5), 0.1), 1.05, 1e-9);
  EXPECT_NEAR(l.Value(kStart + absl::Seconds(10), 0.1), 0.575, 1e-9);
  EXPECT_NEAR(l.Value(kStart + absl::Seconds(60), 0.1), 0.1, 1e-3);
  // A penalty never lowers the estimate.
  l.ObservePenalty(0.5, kStart);
  EXPECT_DOUBLE_EQ(*l.Last(), 2.0);
  // The first answer after a penalty is believed at once (a worker back from a pause is not
  // held back by its timeout), then averaging resumes.
  l.Observe(0.1, kStart);
  EXPECT_DOUBLE_EQ(l.Value(kStart, 1.0), 0.1);
  l.Observe(0.2, kStart);
  EXPECT_NEAR(l.Value(kStart, 1.0), 0.13, 1e-9);
  // A request that was stuck through a later penalty answers late: not a sample.
  l.ObservePenalty(0.25, kStart + absl::Seconds(1));
  l.Observe(6.0, kStart + absl::Seconds(7), /*began=*/kStart + absl::Milliseconds(500));
  EXPECT_DOUBLE_EQ(*l.Last(), 0.25);
}

// A node still slow when forgetting lets it be probed keeps its figure twice as long each
// time; once it answers fast it is forgotten quickly again.
TEST(LearnedLatency, ASlownessConfirmedByAProbeIsForgottenMoreSlowly) {
  LearnedLatency l(
      {.weight = 0.3, .half_life = absl::Seconds(2), .max_half_life = absl::Seconds(8)});
  absl::Time t = kStart;
  l.Observe(0.4, t);
  for (absl::Duration want : {absl::Seconds(4), absl::Seconds(8), absl::Seconds(8)}) {
    t += l.half_life() * 3;  // forgotten enough to be probed
    l.Observe(0.4, t);       // still slow
    EXPECT_EQ(l.half_life(), want);
  }
  l.Observe(0.4, t + absl::Milliseconds(10));  // busy, not a probe: unchanged
  EXPECT_EQ(l.half_life(), absl::Seconds(8));
  l.Observe(0.02, t + absl::Seconds(30));  // fast again
  EXPECT_EQ(l.half_life(), absl::Seconds(2));
}

TEST(DecayingCount, HalvesPerHalfLife) {
  DecayingCount c(absl::Seconds(5));
  EXPECT_EQ(c.Value(kStart), 0);
  c.Add(kStart);
  c.Add(kStart);
  EXPECT_DOUBLE_EQ(c.Value(kStart), 2);
  EXPECT_DOUBLE_EQ(c.Value(kStart + absl::Seconds(5)), 1);
  c.Add(kStart + absl::Seconds(10));
  EXPECT_DOUBLE_EQ(c.Value(kStart + absl::Seconds(10)), 1.5);
}

TEST(Forget, MovesHalfTheDistancePerHalfLife) {
  EXPECT_DOUBLE_EQ(Forget(4.0, 2.0, absl::ZeroDuration(), absl::Seconds(5)), 4.0);
  EXPECT_DOUBLE_EQ(Forget(4.0, 2.0, absl::Seconds(5), absl::Seconds(5)), 3.0);
  EXPECT_DOUBLE_EQ(Forget(4.0, 2.0, absl::InfiniteDuration(), absl::Seconds(5)), 2.0);
}

TEST(AdaptiveTimeout, IsTheCeilingUntilMeasuredThenSrttPlusFourRttvarWithinBounds) {
  AdaptiveTimeout t(absl::Milliseconds(250), absl::Seconds(2));
  EXPECT_EQ(t.Timeout(), absl::Seconds(2));
  t.Observe(absl::Milliseconds(4));
  EXPECT_EQ(t.Timeout(), absl::Milliseconds(250));  // 4 + 4 * 2 ms, below the floor
  for (int i = 0; i < 50; ++i) t.Observe(absl::Milliseconds(i % 2 == 0 ? 100 : 500));
  EXPECT_GT(t.Timeout(), absl::Milliseconds(700));  // a jittery peer gets room
  EXPECT_LE(t.Timeout(), absl::Seconds(2));
  for (int i = 0; i < 50; ++i) t.Observe(absl::Seconds(10));
  EXPECT_EQ(t.Timeout(), absl::Seconds(2));  // never past the ceiling
}

}  // namespace
}  // namespace kvrelay::gateway

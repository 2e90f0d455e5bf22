#include "kv/reuse_cost.h"

#include "gtest/gtest.h"

namespace kvrelay::kv {
namespace {

TEST(ReuseCost, PullsWhenTheLinkIsFasterThanComputing) {
  // 1 MiB over 1 GB/s + 0.1 ms vs 64 tokens at 500 tokens/s.
  PullOrRecompute d = ChoosePullOrRecompute({.bytes = 1 << 20,
                                             .tokens = 64,
                                             .link_bytes_per_second = 1e9,
                                             .link_latency_seconds = 1e-4,
                                             .prefill_tokens_per_second = 500});
  EXPECT_EQ(d.choice, ReuseChoice::kPull);
  EXPECT_NEAR(d.pull_seconds, 1e-4 + (1 << 20) / 1e9, 1e-9);
  EXPECT_NEAR(d.recompute_seconds, 64.0 / 500, 1e-9);
}

TEST(ReuseCost, RecomputesWhenTheLinkIsShapedSlow) {
  // The same blocks over 1 Mbit/s take 8.4 s; computing them takes 0.128 s.
  PullOrRecompute d = ChoosePullOrRecompute({.bytes = 1 << 20,
                                             .tokens = 64,
                                             .link_bytes_per_second = 125000,
                                             .prefill_tokens_per_second = 500});
  EXPECT_EQ(d.choice, ReuseChoice::kRecompute);
  EXPECT_GT(d.pull_seconds, 8.0);
}

TEST(ReuseCost, AnUnmeasuredLinkIsPulledFromToMeasureIt) {
  PullOrRecompute d = ChoosePullOrRecompute({.bytes = 1 << 30,
                                             .tokens = 1,
                                             .link_bytes_per_second = 0,
                                             .prefill_tokens_per_second = 1e6});
  EXPECT_EQ(d.choice, ReuseChoice::kPull);
  EXPECT_EQ(d.pull_seconds, 0);
}

TEST(ReuseCost, RouteSecondsAddsQueueAndCompute) {
  EXPECT_DOUBLE_EQ(RouteSeconds(3, 0.5, 100, 200), 1.5 + 0.5);
  EXPECT_DOUBLE_EQ(RouteSeconds(-1, 0.5, 0, 200), 0);
  EXPECT_DOUBLE_EQ(RouteSeconds(2, 0.25, 100, 0), 0.5);  // unknown rate: the queue alone
}

TEST(RateMeter, AveragesSecondsPerUnit) {
  RateMeter meter(0.5);
  EXPECT_EQ(meter.rate(), 0);
  const absl::Time t = absl::FromUnixSeconds(100);
  meter.Observe(100, 1.0, t);
  EXPECT_DOUBLE_EQ(meter.rate(), 100);
  // Seconds per unit are averaged: (0.01 + 1/300) / 2 per unit.
  meter.Observe(300, 1.0, t + absl::Seconds(1));
  EXPECT_DOUBLE_EQ(meter.rate(), 1.0 / (0.5 * 0.01 + 0.5 / 300));
  // One sample 100x slower pulls the estimate down by half at once.
  RateMeter link(0.5);
  link.Observe(1e8, 1.0, t);
  link.Observe(1e6, 1.0, t);
  EXPECT_LT(link.rate(), 2.1e6);
  meter.Observe(10, 0.01, t + absl::Seconds(2));
  EXPECT_EQ(meter.last_observed(), t + absl::Seconds(2));
  meter.Observe(5, 0, t);  // ignored
  EXPECT_EQ(meter.last_observed(), t + absl::Seconds(2));
  // A pull of 100 units cut off after 10 s: at most 10/s from now on.
  meter.ObserveCeiling(100, 10, t + absl::Seconds(3));
  EXPECT_DOUBLE_EQ(meter.rate(), 10);
  meter.ObserveCeiling(1000, 1, t + absl::Seconds(4));  // a ceiling above the rate changes nothing
  EXPECT_DOUBLE_EQ(meter.rate(), 10);
}

}  // namespace
}  // namespace kvrelay::kv

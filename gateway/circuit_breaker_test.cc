#include "gateway/circuit_breaker.h"

#include "gtest/gtest.h"

namespace kvrelay::gateway {
namespace {

using State = CircuitBreaker::State;

TEST(CircuitBreaker, OpensOnFailureProbesOnceThenCloses) {
  SimulatedClock clock;
  CircuitBreaker breaker(&clock, {.open_for = absl::Seconds(1), .max_open_for = absl::Seconds(8)});
  EXPECT_TRUE(breaker.Allow());
  breaker.RecordFailure();
  EXPECT_EQ(breaker.state(), State::kOpen);
  EXPECT_FALSE(breaker.Allow());
  EXPECT_FALSE(breaker.Healthy());
  clock.Advance(absl::Milliseconds(1001));
  EXPECT_EQ(breaker.state(), State::kHalfOpen);
  EXPECT_TRUE(breaker.Allow());   // the probe
  EXPECT_FALSE(breaker.Allow());  // only one probe at a time
  breaker.RecordSuccess();
  EXPECT_EQ(breaker.state(), State::kClosed);
  EXPECT_TRUE(breaker.Allow());
  EXPECT_EQ(breaker.failures(), 1);
}

TEST(CircuitBreaker, ProbeNowEndsTheCoolDownButKeepsItsLength) {
  SimulatedClock clock;
  CircuitBreaker breaker(&clock, {.open_for = absl::Seconds(1), .max_open_for = absl::Seconds(8)});
  breaker.ProbeNow();  // closed: nothing to do
  EXPECT_EQ(breaker.state(), State::kClosed);
  breaker.RecordFailure();
  breaker.ProbeNow();
  EXPECT_EQ(breaker.state(), State::kHalfOpen);
  ASSERT_TRUE(breaker.Allow());
  breaker.RecordFailure();  // the probe failed: open for 2 s
  clock.Advance(absl::Milliseconds(1500));
  EXPECT_EQ(breaker.state(), State::kOpen);
  clock.Advance(absl::Milliseconds(501));
  EXPECT_EQ(breaker.state(), State::kHalfOpen);
}

TEST(CircuitBreaker, FailedProbesBackOffUpToTheCap) {
  SimulatedClock clock;
  CircuitBreaker breaker(&clock, {.open_for = absl::Seconds(1), .max_open_for = absl::Seconds(4)});
  breaker.RecordFailure();  // open for 1 s
  clock.Advance(absl::Milliseconds(1001));
  ASSERT_TRUE(breaker.Allow());
  breaker.RecordFailure();  // failed probe: 2 s
  for (absl::Duration open_for : {absl::Seconds(2), absl::Seconds(4), absl::Seconds(4)}) {
    clock.Advance(open_for - absl::Milliseconds(1));
    EXPECT_FALSE(breaker.Allow()) << open_for;
    clock.Advance(absl::Milliseconds(2));
    EXPECT_EQ(breaker.state(), State::kHalfOpen) << open_for;
    ASSERT_TRUE(breaker.Allow());
    breaker.RecordFailure();  // doubles, capped at 4 s
  }
}

TEST(CircuitBreaker, BusyIsNotAFailure) {
  SimulatedClock clock;
  CircuitBreaker breaker(&clock, {.busy_for = absl::Milliseconds(200)});
  breaker.RecordBusy();
  EXPECT_EQ(breaker.state(), State::kClosed);
  EXPECT_TRUE(breaker.Healthy());  // overload is not sickness
  EXPECT_TRUE(breaker.Busy());
  EXPECT_TRUE(breaker.Allow());
  clock.Advance(absl::Milliseconds(201));
  EXPECT_FALSE(breaker.Busy());
  EXPECT_EQ(breaker.failures(), 0);
}

TEST(CircuitBreaker, DrainingSkipsTheNodeWithoutOpeningTheBreaker) {
  SimulatedClock clock;
  CircuitBreaker breaker(&clock, {.draining_for = absl::Seconds(5)});
  breaker.RecordDraining();
  EXPECT_EQ(breaker.state(), State::kClosed);
  EXPECT_EQ(breaker.failures(), 0);
  EXPECT_TRUE(breaker.Draining());
  EXPECT_FALSE(breaker.Healthy());  // not ranked while it drains
  EXPECT_FALSE(breaker.Allow());
  clock.Advance(absl::Seconds(5));
  EXPECT_FALSE(breaker.Draining());
  EXPECT_TRUE(breaker.Healthy());
  EXPECT_TRUE(breaker.Allow());
}

TEST(CircuitBreaker, BusyLastsThePredictedWaitWhenShorter) {
  SimulatedClock clock;
  CircuitBreaker breaker(&clock, {.busy_for = absl::Milliseconds(200)});
  breaker.RecordBusy(absl::Milliseconds(50));
  EXPECT_EQ(breaker.PredictedWait(), absl::Milliseconds(50));
  clock.Advance(absl::Milliseconds(51));
  EXPECT_FALSE(breaker.Busy());
  breaker.RecordBusy(absl::Seconds(30));
  EXPECT_EQ(breaker.PredictedWait(), absl::Seconds(30));  // what clients are told
  clock.Advance(absl::Milliseconds(201));
  EXPECT_FALSE(breaker.Busy());  // capped at busy_for: the node is asked again soon
}

TEST(CircuitBreaker, ABusyProbeClosesTheBreaker) {
  SimulatedClock clock;
  CircuitBreaker breaker(&clock, {.open_for = absl::Seconds(1)});
  breaker.RecordFailure();
  clock.Advance(absl::Seconds(2));
  ASSERT_TRUE(breaker.Allow());  // the probe
  breaker.RecordBusy();
  EXPECT_EQ(breaker.state(), State::kClosed);
  EXPECT_EQ(breaker.failures(), 1);
}

}  // namespace
}  // namespace kvrelay::gateway

// DependencyGate on a SimulatedClock: what opens it, how long it stays open, that exactly one
// probe goes out at a time, and that the cool-down doubles per failed probe within its bounds.

#include "common/dependency_gate.h"

#include <optional>

#include "absl/status/status.h"
#include "common/clock.h"
#include "common/metrics.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace kvrelay {
namespace {

using ::kvrelay::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;
using State = DependencyGate::State;

class DependencyGateTest : public ::testing::Test {
 protected:
  DependencyGateOptions Options() {
    DependencyGateOptions o;
    o.name = "the cache store at s:7000";
    o.min_cooldown = absl::Milliseconds(250);
    o.max_cooldown = absl::Seconds(1);
    o.metrics = &metrics_;
    o.metric_label = "cachestore";
    return o;
  }
  // One admitted call that ends with `status`.
  void Call(DependencyGate& gate, const absl::Status& status, bool caller_bound = false) {
    DependencyGate::Ticket t = gate.Admit();
    ASSERT_TRUE(t.ok()) << t.status();
    t.Record(status, caller_bound);
  }

  SimulatedClock clock_;
  MetricsRegistry metrics_;
};

TEST_F(DependencyGateTest, ATimeoutOpensItAndLaterCallsFailFastNamingTheDependency) {
  DependencyGate gate(&clock_, Options());
  Call(gate, absl::OkStatus());
  EXPECT_EQ(gate.state(), State::kClosed);
  Call(gate, absl::DeadlineExceededError("x"));
  EXPECT_EQ(gate.state(), State::kOpen);
  DependencyGate::Ticket refused = gate.Admit();
  EXPECT_FALSE(refused.ok());
  EXPECT_THAT(refused.status(),
              StatusIs(absl::StatusCode::kUnavailable,
                       AllOf(HasSubstr("the cache store at s:7000"), HasSubstr("DEADLINE_EXCEEDED"),
                             HasSubstr("next probe in 250ms"))));
  EXPECT_EQ(gate.fast_failures(), 1);
  EXPECT_THAT(
      metrics_.RenderText(),
      AllOf(HasSubstr("kvrelay:dependency_state{dependency=\"cachestore\"} 1"),
            HasSubstr("kvrelay:dependency_fast_failures_total{dependency=\"cachestore\"} 1")));
}

TEST_F(DependencyGateTest, UnavailableOpensItToo) {
  DependencyGate gate(&clock_, Options());
  Call(gate, absl::UnavailableError("connection refused"));
  EXPECT_EQ(gate.state(), State::kOpen);
}

// The caller's own deadline, a cancellation, or an answer that is an error say nothing about
// whether the dependency answers: the gate stays closed.
TEST_F(DependencyGateTest, TheCallersDeadlineAndAnswersThatAreErrorsLeaveItClosed) {
  DependencyGate gate(&clock_, Options());
  Call(gate, absl::DeadlineExceededError("request out of time"), /*caller_bound=*/true);
  Call(gate, absl::CancelledError("client went away"));
  Call(gate, absl::NotFoundError("no such allocation"));
  Call(gate, absl::ResourceExhaustedError("store full"));
  EXPECT_EQ(gate.state(), State::kClosed);
  EXPECT_EQ(gate.fast_failures(), 0);
}

TEST_F(DependencyGateTest, ExactlyOneProbeAtATimeAndItsAnswerClosesTheGate) {
  DependencyGate gate(&clock_, Options());
  Call(gate, absl::DeadlineExceededError("x"));
  clock_.Advance(absl::Milliseconds(249));
  EXPECT_FALSE(gate.Admit().ok());
  clock_.Advance(absl::Milliseconds(1));
  EXPECT_EQ(gate.state(), State::kHalfOpen);
  DependencyGate::Ticket probe = gate.Admit();
  ASSERT_TRUE(probe.ok());
  EXPECT_TRUE(probe.probe());
  DependencyGate::Ticket second = gate.Admit();
  EXPECT_FALSE(second.ok());
  EXPECT_THAT(second.status(), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("probe is out")));
  probe.Record(absl::OkStatus());
  EXPECT_EQ(gate.state(), State::kClosed);
  DependencyGate::Ticket after = gate.Admit();
  EXPECT_TRUE(after.ok());
  EXPECT_FALSE(after.probe());
  EXPECT_THAT(metrics_.RenderText(),
              HasSubstr("kvrelay:dependency_state{dependency=\"cachestore\"} 0"));
}

TEST_F(DependencyGateTest, TheCooldownDoublesPerFailedProbeUpToItsBoundAndResetsOnSuccess) {
  DependencyGate gate(&clock_, Options());
  Call(gate, absl::DeadlineExceededError("x"));
  EXPECT_EQ(gate.cooldown(), absl::Milliseconds(250));
  for (absl::Duration want : {absl::Milliseconds(500), absl::Seconds(1), absl::Seconds(1)}) {
    clock_.Advance(gate.cooldown());
    Call(gate, absl::DeadlineExceededError("still away"));  // the probe
    EXPECT_EQ(gate.cooldown(), want);
    clock_.Advance(want - absl::Milliseconds(1));
    EXPECT_EQ(gate.state(), State::kOpen);
  }
  clock_.Advance(absl::Milliseconds(1));
  Call(gate, absl::OkStatus());  // the probe gets an answer
  EXPECT_EQ(gate.state(), State::kClosed);
  Call(gate, absl::UnavailableError("x"));
  EXPECT_EQ(gate.cooldown(), absl::Milliseconds(250));
  clock_.Advance(absl::Milliseconds(250));
  EXPECT_EQ(gate.state(), State::kHalfOpen);
}

// A probe that ends without a verdict (its request ran out of time, or the ticket was dropped)
// frees the probe slot: the next call probes; the gate neither closes nor backs off further.
TEST_F(DependencyGateTest, AProbeWithoutAVerdictLetsTheNextCallProbe) {
  DependencyGate gate(&clock_, Options());
  Call(gate, absl::DeadlineExceededError("x"));
  clock_.Advance(absl::Milliseconds(250));
  Call(gate, absl::DeadlineExceededError("request out of time"), /*caller_bound=*/true);
  EXPECT_EQ(gate.state(), State::kHalfOpen);
  { DependencyGate::Ticket dropped = gate.Admit(); }
  DependencyGate::Ticket probe = gate.Admit();
  ASSERT_TRUE(probe.ok());
  EXPECT_TRUE(probe.probe());
  EXPECT_EQ(gate.cooldown(), absl::Milliseconds(250));
}

// Calls admitted before the gate opened that fail afterwards do not push the probe back.
TEST_F(DependencyGateTest, FailuresOfCallsInFlightWhenItOpenedDoNotExtendTheCooldown) {
  DependencyGate gate(&clock_, Options());
  DependencyGate::Ticket a = gate.Admit();
  DependencyGate::Ticket b = gate.Admit();
  a.Record(absl::DeadlineExceededError("x"));
  clock_.Advance(absl::Milliseconds(200));
  b.Record(absl::DeadlineExceededError("x"));
  clock_.Advance(absl::Milliseconds(50));
  EXPECT_EQ(gate.state(), State::kHalfOpen);
  EXPECT_EQ(gate.cooldown(), absl::Milliseconds(250));
}

}  // namespace
}  // namespace kvrelay

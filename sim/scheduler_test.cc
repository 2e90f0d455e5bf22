#include "sim/scheduler.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace kvrelay::sim {
namespace {

TEST(SchedulerTest, ProcessesRunOneAtATimeInSimulatedTimeOrder) {
  SimulatedClock clock;
  const absl::Time t0 = clock.Now();
  Scheduler s(&clock);
  std::vector<std::string> log;
  auto at = [&] { return absl::ToInt64Milliseconds(clock.Now() - t0); };
  s.Spawn(t0 + absl::Milliseconds(10), [&] {
    log.push_back(absl::StrCat("a start ", at()));
    s.SleepUntil(clock.Now() + absl::Milliseconds(30));
    log.push_back(absl::StrCat("a end ", at()));
  });
  s.Spawn(t0 + absl::Milliseconds(20), [&] {
    log.push_back(absl::StrCat("b start ", at()));
    s.SleepUntil(clock.Now() + absl::Milliseconds(5));
    log.push_back(absl::StrCat("b end ", at()));
  });
  s.At(t0 + absl::Milliseconds(15), [&] { log.push_back(absl::StrCat("tick ", at())); });
  s.Run();
  EXPECT_EQ(log, (std::vector<std::string>{"a start 10", "tick 15", "b start 20", "b end 25",
                                           "a end 40"}));
  EXPECT_EQ(s.processes_started(), 2);
  EXPECT_EQ(s.peak_processes(), 2);
}

TEST(SchedulerTest, SimMutexHandsOverInArrivalOrder) {
  SimulatedClock clock;
  const absl::Time t0 = clock.Now();
  Scheduler s(&clock);
  SimMutex mu(&s);
  std::vector<std::string> order;
  for (int i = 0; i < 4; ++i) {
    s.Spawn(t0 + absl::Milliseconds(i), [&, i] {
      mu.Lock();
      order.push_back(absl::StrCat(i, "@", absl::ToInt64Milliseconds(clock.Now() - t0)));
      s.SleepUntil(clock.Now() + absl::Milliseconds(10));
      mu.Unlock();
    });
  }
  s.Run();
  // Each holds it 10 ms; the others queue in the order they came.
  EXPECT_EQ(order, (std::vector<std::string>{"0@0", "1@10", "2@20", "3@30"}));
  EXPECT_FALSE(mu.held());
}

TEST(SchedulerTest, ParkedProcessContinuesWhenWoken) {
  SimulatedClock clock;
  const absl::Time t0 = clock.Now();
  Scheduler s(&clock);
  Scheduler::Process* parked = nullptr;
  absl::Duration woke_at;
  s.Spawn(t0, [&] {
    parked = s.Current();
    s.Park();
    woke_at = clock.Now() - t0;
  });
  s.At(t0 + absl::Milliseconds(7), [&] { s.Wake(parked); });
  s.Run();
  EXPECT_EQ(woke_at, absl::Milliseconds(7));
}

}  // namespace
}  // namespace kvrelay::sim

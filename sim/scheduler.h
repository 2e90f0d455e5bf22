#pragma once

// Scheduler: the simulated clock of `kvrelay simulate` and the processes that run on it.
//
// Serving code calls its dependencies synchronously (GenerateCall blocks in Reserve, Prefill
// and Generate). To run that code unchanged on simulated time, each request is a process: a
// fiber (its own stack, switched to and from in user space on the thread that calls Run())
// that runs only while the scheduler has switched to it. A process that has to wait (for a
// compute slot, a transfer, the next decode step) parks, switching back to the scheduler,
// which advances the clock to the next event and switches to whatever comes next. Exactly one
// process runs at a time, events at the same instant run in the order they were scheduled, so
// a run is deterministic and needs no locking in the simulated nodes. (A thread per process,
// handed a baton through semaphores, cost a futex wake and wait per switch and a thread per
// request: a third of a 64-node run's time was in the kernel.)
//
// Everything but Run() is called from a process, from an At() callback, or before Run().
// A process must not park while it holds a real lock (absl::Mutex) another process may take:
// every process runs on one thread.

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <queue>
#include <vector>

#include "absl/time/time.h"
#include "common/clock.h"

namespace kvrelay::sim {

class Scheduler {
 public:
  struct Process;

  explicit Scheduler(SimulatedClock* clock);
  ~Scheduler();  // REQUIRES: Run() returned (every process finished)
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  SimulatedClock* clock() const { return clock_; }
  absl::Time Now() const { return clock_->Now(); }

  // Starts `body` as a process at `at` (not before now); its stack is taken at `at`, so only
  // processes that have begun hold one.
  void Spawn(absl::Time at, std::function<void()> body);
  // Runs `callback` on the scheduler's thread at `at` (not before now).
  void At(absl::Time at, std::function<void()> callback);
  // Runs events until none is left.
  void Run();

  // From a process: the calling process, to Wake() later.
  Process* Current() const;
  // From a process: gives the baton back until some other party calls Wake(this process).
  void Park();
  // Continues `process` (parked) at the current time, after what is already scheduled now.
  void Wake(Process* process);
  // From a process: parks until the clock reaches `t` (returns at once when it has).
  void SleepUntil(absl::Time t);

  int64_t events() const { return events_; }
  int64_t processes_started() const { return started_; }
  int64_t peak_processes() const { return peak_live_; }

 private:
  struct Event {
    absl::Time at;
    uint64_t seq;
    std::function<void()> callback;  // or
    Process* process = nullptr;      // to resume
    bool operator>(const Event& o) const { return at != o.at ? at > o.at : seq > o.seq; }
  };
  void Push(absl::Time at, std::function<void()> callback, Process* process);
  void Resume(Process* process);
  // Switches from the running process back to Run() (`finished`: it never resumes).
  void SwitchToScheduler(Process* self, bool finished);
  static void ProcessEntry(unsigned int high, unsigned int low);

  SimulatedClock* const clock_;
  std::priority_queue<Event, std::vector<Event>, std::greater<>> queue_;
  uint64_t next_seq_ = 0;
  int64_t events_ = 0;
  int64_t started_ = 0;
  int64_t live_ = 0;
  int64_t peak_live_ = 0;
  Process* running_ = nullptr;  // the process switched to, or null in Run() itself
  struct Context;
  std::unique_ptr<Context> context_;  // Run()'s own context, and stacks to reuse
};

// A FIFO lock on simulated time: a process that finds it held parks until it is handed over.
class SimMutex {
 public:
  explicit SimMutex(Scheduler* scheduler) : scheduler_(scheduler) {}
  void Lock();
  void Unlock();
  bool held() const { return held_; }
  size_t waiting() const { return waiters_.size(); }

 private:
  Scheduler* const scheduler_;
  bool held_ = false;
  std::deque<Scheduler::Process*> waiters_;
};

}  // namespace kvrelay::sim
